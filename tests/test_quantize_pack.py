"""quantize_pack: static-scale quantize straight into bit planes (the compiled networks' activation
quantizer) -- the same codes as quantize(), the Triton kernel (interpreter) equal to the reference."""

import os
import sys

if sys.argv[1:] != ["--aot"]:  # the --aot subprocess compiles for sm_90 instead of interpreting
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _aot import require_nvidia_backend, run_aot  # noqa: E402

import tcprec as tp  # noqa: E402
from tcprec.formats import IntFormat  # noqa: E402
from tcprec.ops.quantize import quantize_pack, quantize_static  # noqa: E402

FORMATS = ["uint1", "uint2", "uint4", "uint8", "int2", "int3", "int8", "binary", "pm2", "pm3"]


def _inputs(fmt, shape=(5, 1000), seed=0):
    g = torch.Generator().manual_seed(seed)
    f = tp.format(fmt)
    x = torch.randn(shape, generator=g) * (abs(f.max) + 1)  # spills over both ends: saturation
    # exact ties and boundaries: integers, half-integers (and odd-integer ties for pm), tiny values
    x[0, :64] = torch.arange(-16, 16, 0.5)
    x[1, :3] = torch.tensor([1e30, -1e30, 1e-30])
    return x.abs() if f.min >= 0 else x


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_equals_quantize_codes(fmt):
    x = _inputs(fmt)
    scale = torch.tensor([0.5])
    got = quantize_pack(x, fmt, scale, backend="reference")
    want = tp.quantize(x, fmt, tp.PerTensor(), scale=0.5).to_bitplanes(backend="reference")
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_static_equals_quantize(fmt):
    x = _inputs(fmt, seed=3)
    got = quantize_static(x, fmt, torch.tensor([0.7]))
    want = tp.quantize(x, fmt, tp.PerTensor(), scale=0.7)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.dequantize(), want.dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_equals_reference(fmt):
    x = _inputs(fmt, shape=(7, 600), seed=1).to(torch.float16).float()
    x[2, 5] = float("nan")
    scale = torch.tensor([0.37])
    got = quantize_pack(x, fmt, scale, backend="triton")
    want = quantize_pack(x, fmt, scale, backend="reference")
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["uint2", "int3", "pm2", "uint8", "binary"])
@pytest.mark.parametrize("K", [600, 64, 1030])
@pytest.mark.parametrize("tile", [None, (4, 1), (16, 16)])
def test_kernel_tiles_equal_reference(fmt, K, tile):
    """Any tile of the fused packers gives the reference's planes: ragged K (600 = 18.75 words), K = 64 (2 real
    words, 14 words of zero padding: programs there only store zeros), rows not a multiple of the tile, NaN."""
    from tcprec.kernels.triton import pack as tpack
    from tcprec.ops.quantize import _qp_params

    f = tp.format(fmt)
    x = _inputs(fmt, shape=(7, K), seed=2)
    x[3, 7] = float("nan")
    scale = torch.tensor([0.37])
    br, bw = tile or (None, None)
    got = tpack.quantize_pack(x, scale, f.bits, *_qp_params(f), block_r=br, block_w=bw)
    assert torch.equal(got, quantize_pack(x, fmt, scale, backend="reference"))
    assert got.shape[-1] == tp.packed_words(K)
    xp = x[:6, :60].reshape(1, 2, 3, 60)
    xp = xp.nan_to_num(-1e9)  # (a NaN in a max window: skipped by the kernel, propagated by amax)
    pooled = quantize_pack(xp[:, :, :2].amax((1, 2)).reshape(1, 60), fmt, scale, backend="reference")  # col 2 dropped
    got = tpack.pool_quantize_pack(xp, scale, 2, f.bits, *_qp_params(f), block_r=br, block_w=bw)
    assert torch.equal(got, pooled)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_to_code_of_zero_and_inf_saturates(backend):
    x = torch.tensor([[float("nan"), 1.0, float("inf"), -float("inf")]])
    planes = quantize_pack(x, "int2", torch.tensor([1.0]), backend=backend)
    codes = tp.unpack_bitplanes(planes, 2, 4)
    assert codes.tolist() == [[0, 1, 1, 2]]  # int2 patterns: 0, 1, max 1, min -2 = 0b10


def test_strided_rows_and_fp16_input():
    x = _inputs("uint2", shape=(6, 64)).half()
    view = x[:, :40]  # row stride 64, K = 40
    scale = torch.tensor([0.25])
    assert torch.equal(quantize_pack(view, "uint2", scale, backend="triton"),
                       quantize_pack(view.contiguous(), "uint2", scale, backend="reference"))


@pytest.mark.parametrize("bad, match", [
    (dict(fmt="e4m3"), "not an integer format"),
    (dict(scale=0.5), "one-element float32 tensor"),
    (dict(scale=torch.tensor([1.0, 2.0])), "one-element float32 tensor"),
    (dict(x=torch.ones(4, dtype=torch.int32)), "float"),
])
def test_bad_input(bad, match):
    args = dict(x=torch.ones(2, 4), fmt="uint2", scale=torch.tensor([1.0]))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        quantize_pack(args["x"], args["fmt"], args["scale"])


@pytest.mark.parametrize("fmt", ["uint2", "int3", "pm2", "binary", "uint8"])
@pytest.mark.parametrize("pool", [("max", 2, 2), ("max", 2, 1)])
def test_pool_quantize_pack_equals_pool_then_reference(fmt, pool):
    """The conv epilogue's fused pass (kernels/triton/pack.py pool_quantize_pack: 2x2 max-pool, then the
    quantizer, one read) equals reference_conv_bitserial.pool_nhwc followed by the reference quantize_pack, on odd
    sizes (stride 2 drops the last row / column, stride 1 clips the window) with ties and saturation."""
    from tcprec.kernels import reference_conv_bitserial as rq
    from tcprec.kernels.triton import pack as tpack
    from tcprec.ops.quantize import _qp_params

    f = tp.format(fmt)
    x = _inputs(fmt, shape=(2 * 7 * 9, 70), seed=5).reshape(2, 7, 9, 70)  # N, P, Q, K (K: 3 words, ragged)
    scale = torch.tensor([0.5])
    pooled = rq.pool_nhwc(x, pool)
    want = quantize_pack(pooled.reshape(-1, 70), fmt, scale, backend="reference")
    got = tpack.pool_quantize_pack(x, scale, pool[2], f.bits, *_qp_params(f))
    assert got.shape == want.shape and torch.equal(got, want)
    xs = x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # same values, other strides
    assert torch.equal(tpack.pool_quantize_pack(xs, scale, pool[2], f.bits, *_qp_params(f)), want)


@pytest.mark.parametrize("bits,enc", [(1, "pm1"), (1, "unsigned"), (2, "unsigned"), (2, "twos"), (3, "twos"),
                                      (4, "twos"), (8, "unsigned")])
@pytest.mark.parametrize("stride", [2, 1])
def test_pool_planes_equals_pooling_then_quantizing(bits, enc, stride):
    """The bit-plane max-pool (Triton, interpreted) equals the torch reference and pooling the values before
    quantizing: odd sizes (stride 2 drops the last row / column, stride 1 clips the window), K past one word,
    padding words zero."""
    from tcprec.kernels import reference_conv_bitserial as rq
    from tcprec.kernels.triton import pack as tpack

    fmt = IntFormat(bits, encoding=enc)
    gen = torch.Generator().manual_seed(bits * 10 + stride)
    N, P, Q, K = 2, 5, 7, 45
    y = torch.randn(N, P, Q, K, generator=gen) * 2 ** (bits - 1)
    s = torch.tensor([0.5])
    planes = rq.requant_pack(y, fmt, s)  # (bits, N*P*Q, Kw): quantize first
    pool = ("max", 2, stride)
    want = rq.requant_pack(rq.pool_nhwc(y, pool), fmt, s)  # pool the floats first
    got = tpack.pool_planes(planes, (N, P, Q, K), stride, bits, enc == "twos")
    assert torch.equal(got, want)
    assert torch.equal(rq.pool_planes(planes, (N, P, Q, K), pool, fmt), want)
    junk = planes.clone()
    junk[..., 2:] = -1  # the padding words past ceil(K / 32) are not read: their output is zero whatever they hold
    assert torch.equal(tpack.pool_planes(junk, (N, P, Q, K), stride, bits, enc == "twos"), want)


def test_pack_kernels_compile_for_sm90():
    """In a subprocess without TRITON_INTERPRET: Triton's NVIDIA backend builds the pack, quantize + pack,
    pool + quantize + pack and bit-plane pool kernels (the interpreter accepts code the compiler refuses,
    e.g. a global that is not a tl.constexpr instance)."""
    out = run_aot(__file__, timeout=300)
    assert out.split()[-1] == "OK" and "st.global" in out


def _aot_main():
    require_nvidia_backend()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tcprec.kernels.triton import pack as P

    def comp(fn, types, consts):
        sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    ptrs = dict(codes_ptr="*u8", planes_ptr="*i32", x_ptr="*fp16", scale_ptr="*fp32", src_ptr="*i32", dst_ptr="*i32")
    fmt = dict(LO=0, HI=3, OFFSET=0, SHIFT=0, BITS=2)
    ptx = comp(P._pack_bitplanes_kernel, ptrs, dict(BITS=2, BLOCK_R=64, BLOCK_W=2))
    comp(P._quantize_pack_kernel, ptrs, dict(fmt, BLOCK_R=64, BLOCK_W=2))
    comp(P._pool_quantize_pack_kernel, ptrs, dict(fmt, POOL_S=2, BLOCK_R=16, BLOCK_W=8))
    for bits in (1, 2, 3):  # bit-sliced (1, 2) and unpacked (3+)
        comp(P._pool_planes_kernel, ptrs, dict(POOL_S=1, TWOS=True, BITS=bits, BLOCK_R=16, BLOCK_W=8))
    print("st.global" if "st.global" in ptx else "no st.global", "OK")


if __name__ == "__main__":
    if sys.argv[1:] == ["--aot"]:
        _aot_main()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("K", [64, 100, 512, 600])
def test_compact_planes_are_the_real_words(backend, K):
    """compact=True: (bits, R, ceil(K / 32)) -- exactly the padded planes without the zero words past the
    last real word (for K = 64: 2 words a row instead of 16)."""
    x = _inputs("uint2", shape=(7, K), seed=K)
    s = torch.tensor([0.25])
    full = quantize_pack(x, "uint2", s, backend=backend)
    compact = quantize_pack(x, "uint2", s, backend=backend, compact=True)
    assert compact.shape == (2, 7, -(-K // 32)) and compact.is_contiguous()
    assert torch.equal(compact, full[..., : -(-K // 32)])
    assert not full[..., -(-K // 32):].any()
