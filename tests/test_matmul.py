"""tcprec.matmul on the CPU: the bit-serial reference equals the exact integer product for every
(p, q) pair and encoding, on every shape of the issue (M in {1, 7, 64, 129}, K in {1, 127, 128,
1000, 4096}, N in {1, 8, 255, 1024}); the INT8 path too; the float and packed epilogues; bad input;
explain_matmul."""

import itertools

import pytest
import torch

import tcprec as tp
from tcprec.formats import IntFormat
from tcprec.kernels import reference_gemm as rg
from tcprec.ops.matmul import choose_matmul_backend, explain_matmul, matmul, matmul_packed
from tcprec.qtensor import PerChannel, PerGroup, PerTensor, QTensor

ENCODINGS = ("twos", "unsigned", "pm1")
PAIRS = [(p, q) for p in range(1, 9) for q in range(1, 9)]
MS, KS, NS = (1, 7, 64, 129), (1, 127, 128, 1000, 4096), (1, 8, 255, 1024)
# Cheap shapes the 192 (p, q, encoding) combinations cycle through (every K value among them)
SMALL_SHAPES = [(1, 1, 1), (7, 127, 8), (7, 128, 1), (1, 1000, 8), (7, 4096, 1), (64, 127, 8), (1, 128, 255),
                (7, 1, 255)]


def _fmt(bits, enc):
    return IntFormat(bits, encoding=enc)


def _qt(shape, fmt, gen, granularity=None, scale=None):
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, generator=gen)
    g = granularity or PerTensor()
    if scale is None:
        scale = torch.ones(g.scale_shape(shape))
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


def _exact(qa, qw):
    va = tp.decode(qa.codes, qa.fmt).double()
    vw = tp.decode(qw.codes, qw.fmt).double()
    return (va @ vw.t()).to(torch.int64)  # exact: |C| < 2^31 << 2^53


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("p,q", PAIRS)
def test_reference_exact_every_pair_and_encoding(p, q, enc):
    gen = torch.Generator().manual_seed(100 * p + 10 * q + ENCODINGS.index(enc))
    M, K, N = SMALL_SHAPES[(PAIRS.index((p, q)) + ENCODINGS.index(enc)) % len(SMALL_SHAPES)]
    qa, qw = _qt((M, K), _fmt(p, enc), gen), _qt((N, K), _fmt(q, enc), gen)
    got = matmul(qa, qw, out_dtype=torch.int32)
    assert got.dtype == torch.int32 and got.shape == (M, N)
    assert torch.equal(got.long(), _exact(qa, qw))


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("K", KS)
def test_reference_exact_every_shape(M, K):
    """Every M, K of the issue against every N, for w1a2 (binary weights) and a mixed pair."""
    gen = torch.Generator().manual_seed(M * 10_000 + K)
    for N in NS:
        qa = _qt((M, K), _fmt(2, "twos"), gen)
        qw = _qt((N, K), _fmt(1, "pm1"), gen)
        assert torch.equal(matmul(qa, qw, out_dtype=torch.int32).long(), _exact(qa, qw)), (M, K, N)
    qa, qw = _qt((M, K), _fmt(3, "unsigned"), gen), _qt((255, K), _fmt(2, "pm1"), gen)
    assert torch.equal(matmul(qa, qw, out_dtype=torch.int32).long(), _exact(qa, qw))


def test_mixed_encodings_and_batch_dims():
    gen = torch.Generator().manual_seed(1)
    for ea, ew in itertools.product(ENCODINGS, ENCODINGS):
        qa = _qt((2, 3, 77), _fmt(3, ea), gen)
        qw = _qt((9, 77), _fmt(2, ew), gen)
        got = matmul(qa, qw, out_dtype=torch.int32)
        assert got.shape == (2, 3, 9)
        assert torch.equal(got.long(), _exact(qa, qw)), (ea, ew)
    qa1 = _qt((77,), _fmt(2, "pm1"), gen)  # a 1-D a is one row
    qw = _qt((9, 77), _fmt(2, "twos"), gen)
    assert matmul(qa1, qw, out_dtype=torch.int32).shape == (9,)


def test_twos_planes_carry_the_sign_without_corrections():
    """Two's complement needs no correction term (its top plane weighs -2^(b-1)); pm1 does."""
    gen = torch.Generator().manual_seed(2)
    a = _qt((5, 100), _fmt(3, "twos"), gen)
    w = _qt((6, 100), _fmt(2, "pm1"), gen)
    ap, wp = tp.pack_bitplanes(a.codes, 3), tp.pack_bitplanes(w.codes, 2)
    ss, rt, ct = rg.corrections(ap, ap, 100, a.fmt, a.fmt)
    assert (ss, rt, ct) == (1, None, None)
    ss, rt, ct = rg.corrections(ap, wp, 100, a.fmt, w.fmt)
    assert ss == 2 and ct is None and rt is not None
    assert rg.plane_weights(a.fmt) == [1, 2, -4]


@pytest.mark.parametrize("p,q,enc", [(8, 8, "unsigned"), (8, 8, "pm1"), (8, 8, "twos"), (4, 2, "twos"),
                                     (3, 3, "unsigned"), (7, 5, "pm1"), (1, 1, "pm1")])
def test_int8_backend_exact(p, q, enc):
    """The INT8 path (torch._int_mm, here on the CPU) with its affine shift for uint8 / pm8."""
    gen = torch.Generator().manual_seed(p * 9 + q)
    qa, qw = _qt((7, 1000), _fmt(p, enc), gen), _qt((255, 1000), _fmt(q, enc), gen)
    got = matmul(qa, qw, out_dtype=torch.int32, backend="int8")
    assert torch.equal(got.long(), _exact(qa, qw))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("relu", [False, True])
def test_float_epilogue(out_dtype, relu):
    gen = torch.Generator().manual_seed(3)
    M, K, N = 7, 300, 40
    qa = _qt((M, K), _fmt(2, "twos"), gen, PerChannel(0), torch.rand(M, 1, generator=gen) + 0.1)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), torch.rand(N, 1, generator=gen) + 0.1)
    bias = torch.randn(N, generator=gen)
    got = matmul(qa, qw, out_dtype=out_dtype, bias=bias, relu=relu)
    C = _exact(qa, qw)
    want = ((C.float() * qa.scale.reshape(M, 1)) * qw.scale.reshape(1, N)) + bias  # the epilogue, step by step
    if relu:
        want = torch.where(want < 0, torch.zeros_like(want), want)
    assert got.dtype == out_dtype
    assert torch.equal(got, want.to(out_dtype))
    assert torch.equal(matmul(qa, qw, out_dtype=out_dtype, bias=bias, relu=relu, backend="int8"), got)
    # and close to the float computation it stands for
    deq = qa.dequantize().double() @ qw.dequantize().double().t() + bias.double()
    if relu:
        deq = deq.clamp_min(0)
    torch.testing.assert_close(got.double(), deq.to(out_dtype).double(), rtol=1e-2, atol=1e-2)


def test_per_tensor_and_batched_scales():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 64, generator=gen)
    qa = tp.quantize(x.abs(), "uint2", PerChannel(1))  # one scale per (batch, row) index along axis 1
    qw = tp.quantize(torch.randn(16, 64, generator=gen), "int3", PerTensor())
    got = matmul(qa, qw)
    ref = qa.dequantize() @ qw.dequantize().t()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_name", ["uint2", "int4", "binary", "pm2", "uint8"])
def test_packed_epilogue(out_name):
    gen = torch.Generator().manual_seed(5)
    qa, qw = _qt((7, 300), _fmt(2, "unsigned"), gen), _qt((40, 300), _fmt(1, "pm1"), gen, PerChannel(0),
                                                          torch.rand(40, 1, generator=gen) * 0.1)
    bias = torch.randn(40, generator=gen)
    planes = matmul_packed(qa, qw, out_name, 0.37, bias=bias, relu=True)
    fmt = tp.format(out_name)
    assert planes.shape == (fmt.bits, 7, tp.packed_words(40)) and planes.dtype == torch.int32
    y = matmul(qa, qw, bias=bias, relu=True)
    codes = tp.encode(torch.clamp(y / torch.tensor(0.37), fmt.min, fmt.max), fmt)
    assert torch.equal(planes, tp.pack_bitplanes(codes, fmt.bits))
    assert torch.equal(matmul_packed(qa, qw, out_name, 0.37, bias=bias, relu=True, backend="int8"), planes)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_float_format_is_a_type_error_naming_format_and_fix():
    qa = tp.quantize(torch.randn(4, 32), "e4m3")
    qw = tp.quantize(torch.randn(8, 32), "int2")
    with pytest.raises(TypeError, match=r"e4m3.*integer format"):
        matmul(qa, qw)
    with pytest.raises(TypeError, match="QTensor"):
        matmul(torch.randn(4, 32), qw)


def test_mismatched_k():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"K mismatch.*K=32.*K=33"):
        matmul(_qt((4, 32), _fmt(2, "twos"), gen), _qt((8, 33), _fmt(1, "pm1"), gen))
    with pytest.raises(ValueError, match="2-D"):
        matmul(_qt((4, 32), _fmt(2, "twos"), gen), _qt((2, 8, 32), _fmt(1, "pm1"), gen))


def test_bits_outside_range():
    with pytest.raises(ValueError, match="bits must be 1..8"):
        IntFormat(bits=9)
    with pytest.raises(ValueError, match="bits must be 1..8"):
        IntFormat(bits=0)


def test_devices_differ():
    gen = torch.Generator().manual_seed(0)
    qa = _qt((4, 32), _fmt(2, "twos"), gen)
    codes = torch.zeros(8, 32, dtype=torch.uint8, device="meta")
    qw = QTensor(codes, torch.ones(1, 1, device="meta"), _fmt(1, "pm1"), PerTensor(), (8, 32), torch.float32)
    with pytest.raises(ValueError, match="cpu.*meta|meta.*cpu"):
        matmul(qa, qw)


def test_gpu_backend_forced_on_cpu_tensors():
    gen = torch.Generator().manual_seed(0)
    qa, qw = _qt((4, 32), _fmt(2, "twos"), gen), _qt((8, 32), _fmt(1, "pm1"), gen)
    with pytest.raises(RuntimeError, match=r"bitserial.*CUDA"):
        matmul(qa, qw, backend="bitserial")
    with pytest.raises(ValueError, match="backend must be one of"):
        matmul(qa, qw, backend="cuda")


def test_scales_along_k_and_other_misuse():
    gen = torch.Generator().manual_seed(0)
    qa = tp.quantize(torch.randn(4, 64, generator=gen), "int2", PerGroup(32))
    qw = _qt((8, 64), _fmt(1, "pm1"), gen)
    with pytest.raises(ValueError, match="scale along K"):
        matmul(qa, qw)
    assert matmul(qa, qw, out_dtype=torch.int32).shape == (4, 8)  # raw integers need no scale
    qa = _qt((4, 64), _fmt(2, "twos"), gen)
    with pytest.raises(ValueError, match="bias"):
        matmul(qa, qw, out_dtype=torch.int32, bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        matmul(qa, qw, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="out_dtype"):
        matmul(qa, qw, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="out_scale"):
        matmul_packed(qa, qw, "uint2", -1.0)
    with pytest.raises(TypeError, match="integer format"):
        matmul_packed(qa, qw, "e4m3", 1.0)


def test_int32_overflow_is_refused():
    gen = torch.Generator().manual_seed(0)
    K = 40_000  # 40000 * 255 * 255 > 2^31
    qa, qw = _qt((1, K), _fmt(8, "unsigned"), gen), _qt((1, K), _fmt(8, "unsigned"), gen)
    with pytest.raises(ValueError, match="2\\^31"):
        matmul(qa, qw, out_dtype=torch.int32)


# ------------------------------------------------------------------------------------------------
# explain_matmul
# ------------------------------------------------------------------------------------------------


def test_explain_matmul_on_cpu():
    gen = torch.Generator().manual_seed(0)
    qa, qw = _qt((64, 256), _fmt(2, "unsigned"), gen), _qt((128, 256), _fmt(1, "pm1"), gen)
    s = explain_matmul(qa, qw)
    assert s.startswith("reference:") and "cpu" in s and "p*q = 2*1 = 2" in s and "M=64 N=128 K=256" in s
    assert explain_matmul(qa, qw, backend="int8").startswith("int8:")
    assert choose_matmul_backend(qa, qw, "reference")[0] == "reference"


def test_eager_gemm_entry_refuses_cpu_tensors():
    """The eager entry (bg.gemm_entry(): the op's implementation without the dispatcher) names the device
    problem instead of failing inside the launch."""
    from tcprec.kernels.cuda import bmma_gemm as bg

    if not torch.compiler.is_compiling():
        assert bg.gemm_entry() is bmma_gemm._bmma_gemm
    a, w = torch.zeros(2, 4, 16, dtype=torch.int32), torch.zeros(1, 8, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensors.*reference backend"):
        bg.gemm_entry()(a, w, False, False, 1, None, None, None, None, None, False, "int32", 1, "unsigned",
                            None, "")


def test_kernel_tile_choice_bounds_registers():
    from tcprec.kernels.cuda import bmma_gemm as bg

    for (p, q), t in itertools.product(PAIRS, (False, True)):
        tile = bg.pick_tile(p, q, t, t, 10**5, 10**5)
        v = bg.Variant(p, q, t, t, tile)
        mt, nt = tile.bm // (16 * tile.warps_m), tile.bn // (8 * tile.warps_n)
        assert v.n_classes * mt * nt * 4 <= 128 or (mt, nt) == (1, 2)
    assert bg.pick_tile(2, 1, False, False, 64, 1024) == bg.SMALL_TILE  # small: more blocks
    # one 512-bit step when the whole packed K is one (K <= 512 bits), on mma.sync tiles only
    assert bg.pick_tile(2, 1, False, False, 64, 1024, kw=32) == bg.SMALL_TILE
    assert bg.pick_tile(2, 1, False, False, 64, 128, kw=16).bk == 512
    assert bg.pick_tile(4, 4, False, False, 10**5, 10**5, arch="sm_90a", kw=16).bk == 512  # mma.sync big tile
    assert bg.pick_tile(2, 1, False, False, 10**5, 10**5, arch="sm_90a", kw=16).bk == 1024  # wgmma: 1024 only
    assert bg._variant_for(2, 1, False, False, 64, 128, "float16", 1, "unsigned", "", 132, "sm_90a", 16).tile.bk == 512
    assert bg.n_classes(2, 2) == 3 and bg.n_classes(1, 7) == 7
    with pytest.raises(ValueError, match="tile"):
        bg.Variant(2, 1, tile=bg.Tile(40, 256, 2, 4))
    with pytest.raises(ValueError, match="tile must look like"):
        bg.parse_tile("big")
