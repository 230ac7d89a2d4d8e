"""The flat-shift wgrad kernel (kernels/triton/wgrad_flat.py) through TRITON_INTERPRET=1 on the CPU: K-major fp8
1x1 layers (any stride: the strided pixels gathered K-major first) and NHWC 16-bit stride-1 "same" layers
against torch.nn.grad in float64 within the bound of tests/test_conv_bwd.py; the gather / transpose pass and the
row padding for TMA; deterministic split-K; ops.conv's choice (backend="flat" and auto's measured rule); bad
input; and an ahead-of-time compile for sm_90 (TMA loads, fp8 wgmma with both operands in shared memory).
tests/gpu/test_wgrad_flat_gpu.py repeats the numerics at ResNet-50 sizes."""

import json
import sys

import pytest
import torch
from _aot import require_nvidia_backend, run_aot

from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import conv as opc

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
wf = pytest.importorskip("tcprec.kernels.triton.wgrad_flat")

from test_conv_bwd import _check_wgrad, _data, _geom  # noqa: E402  (the bound helpers, after the skips)

FP8_1X1 = [(2, 6, 6, 16, 32, 1, 1, 1, 0, 1),  # stride 1: L = 72 (not a multiple of 16: padded rows)
           (2, 9, 9, 16, 8, 1, 1, 2, 0, 1),  # stride 2, odd H: P = 5
           (1, 10, 9, 24, 16, 1, 1, (3, 2), 0, 1)]  # stride 3 x 2, C = 24
SAME_16 = [(2, 7, 7, 16, 32, 3, 3, 1, 1, 1),  # 3x3 pad 1: the ResNet-50 shape (wraps at every border)
           (1, 9, 8, 8, 16, 5, 5, 1, 4, 2),  # 5x5 dilation 2 pad 4
           (1, 5, 7, 16, 8, 5, 3, 1, (2, 1), 1)]  # 5x3 filter


def _id(s):
    return "x".join(map(str, s[:7])) + f"_s{s[7]}_p{s[8]}_d{s[9]}"


def _wgrad(dy, x, g, **kw):
    return opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="flat", **kw)


@pytest.mark.parametrize("spec", FP8_1X1, ids=_id)
def test_fp8_kmajor_1x1_vs_fp64(spec):
    """fp8 e5m2 dy x e4m3 x, scales in the epilogue (split 1) or the split sum; float operands and
    prepare_fp8_wgrad's Float8() QTensors give the same bits."""
    g = _geom(spec)
    dy, _, x = _data(g, seed=1)
    for split in (1, 3):
        _check_wgrad(g, "fp8", dy, x, _wgrad(dy, x, g, precision="fp8", split_k=split))
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="flat")
    assert torch.equal(_wgrad(dyq, xq, g, precision="fp8", split_k=2), _wgrad(dy, x, g, precision="fp8", split_k=2))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("spec", SAME_16, ids=_id)
def test_nhwc_same_layers_vs_fp64(spec, precision):
    """16-bit NHWC: each tap's x rows are dy's rows shifted by a constant, the wrapped pixels masked."""
    g = _geom(spec)
    dy, _, x = _data(g, seed=2)
    for split in (1, 2):
        _check_wgrad(g, precision, dy, x, _wgrad(dy, x, g, precision=precision, split_k=split))


BATCH = [(16, 6, 7, 16, 32, 3, 3, 1, 1, 1),  # 3x3 "same": the ResNet-50 shape (taps outside the image: zero fill)
         (32, 9, 9, 24, 16, 1, 1, 2, 0, 1),  # strided 1x1, odd H: the strided pixels read in place
         (16, 8, 7, 8, 16, 3, 3, (2, 1), (1, 2), (1, 2)),  # stride 2 x 1, dilation 1 x 2, C = 8
         (48, 5, 5, 16, 16, 7, 7, 1, 3, 1)]  # 7x7 on 5x5 (most taps off the image); N = 48: one partial image block


@pytest.mark.parametrize("spec", BATCH, ids=_id)
def test_fp8_batch_inner_vs_fp64(spec):
    """Batch-inner fp8 (dy stored (K, P, Q, N), x (C, H, W, N)) for any filter, stride, padding and dilation:
    prepare_fp8_wgrad makes that layout; float operands and Float8() QTensors in another memory order (copied into it)
    give the same bits."""
    g = _geom(spec)
    dy, _, x = _data(g, seed=4)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="flat")
    assert dyq.data.stride(0) == xq.data.stride(0) == 1 and wf.layout_of(dyq.data, xq.data) == "batch"
    for split in (1, 3):
        _check_wgrad(g, "fp8", dy, x, _wgrad(dyq, xq, g, precision="fp8", split_k=split))
    ref = _wgrad(dyq, xq, g, precision="fp8", split_k=2)
    assert torch.equal(ref, _wgrad(dy, x, g, precision="fp8", split_k=2))
    nhwc = (opc.to_fp8(dy, "e5m2"), opc.to_fp8(x, "e4m3"))
    assert torch.equal(ref, _wgrad(*nhwc, g, precision="fp8", split_k=2))
    s = opc.explain_conv2d_wgrad(dyq, xq, g.weight_shape, g.stride, g.padding, g.dilation, precision="fp8",
                                 backend="flat")
    assert "batch-inner" in s and "box start along H and W" in s


def test_batch_inner_gemm_path_reads_the_same_memory():
    """cuBLAS's path (a stride-1 1x1 layer) reads batch-inner operands as (K, L) / (C, L) matrices, pixels ordered
    (p, q, n) for both: the reference numerics; the float32 torch math stands in for cuBLAS on the CPU."""
    g = _geom((16, 5, 6, 16, 32, 1, 1, 1, 0, 1))
    dy, _, x = _data(g, seed=5)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, backend="flat")
    perm = opc._BATCH_PIXELS
    assert opc._batch_inner(dyq.data) and dyq.data.permute(perm).reshape(g.K, -1).data_ptr() == dyq.data.data_ptr()
    a = dyq.dequantize().permute(perm).reshape(g.K, -1).double()
    got = a @ xq.dequantize().permute(perm).reshape(g.C, -1).double().T
    ref = _wgrad(dyq, xq, g, precision="fp8", split_k=1).double().view(g.K, g.C)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * float(got.abs().max()))


def test_split_k_deterministic():
    g = _geom((3, 8, 8, 16, 16, 1, 1, 1, 0, 1))
    dy, _, x = _data(g, seed=3)
    a = _wgrad(dy, x, g, precision="fp8", split_k=3)
    assert torch.equal(a, _wgrad(dy, x, g, precision="fp8", split_k=3))
    _check_wgrad(g, "fp8", dy, x, _wgrad(dy, x, g, precision="fp8", split_k=1))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16])
@pytest.mark.parametrize("stride,order", [((1, 1), "nhwc"), ((1, 1), "cfirst"), ((2, 2), "nhwc"), ((2, 3), "nchw")])
def test_kmajor_pixels(stride, order, dtype):
    """The (C, L) matrix of x[:, ::sh, ::sw] for any memory order: a view when x already is (C, N, H, W) at
    stride 1 with 16-byte rows, else one gather / transpose pass; rows always 16-byte aligned."""
    x = torch.randn(2, 7, 9, 24).to(dtype)
    if order == "cfirst":
        x = x.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    elif order == "nchw":
        x = x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    m = wf.kmajor_pixels(x, stride)
    ref = x[:, ::stride[0], ::stride[1], :].permute(3, 0, 1, 2).reshape(24, -1)
    assert m.shape == ref.shape and m.stride(1) == 1 and (m.stride(0) * m.element_size()) % 16 == 0
    iv = torch.uint8 if dtype.itemsize == 1 else torch.int16
    assert torch.equal(m.contiguous().view(iv), ref.contiguous().view(iv))
    if order == "cfirst" and (m.shape[1] * m.element_size()) % 16 == 0:
        assert m.data_ptr() == x.data_ptr(), "an aligned (C, N, H, W) tensor should be used in place"


def test_kmajor_rows_pads_only_when_needed():
    a = torch.randn(4, 32).to(torch.float8_e5m2)
    assert wf.kmajor_rows(a).data_ptr() == a.data_ptr()
    b = torch.randn(4, 392).to(torch.float8_e5m2)[:, :390]  # 390-byte rows
    p = wf.kmajor_rows(b)
    assert p.stride(0) % 16 == 0 and torch.equal(p.view(torch.uint8), b.view(torch.uint8))


def test_bad_inputs():
    g33 = _geom((2, 6, 6, 16, 16, 3, 3, 1, 1, 1))
    dy, _, x = _data(g33)
    with pytest.raises(ValueError, match=r"backend='flat' cannot run.*16-byte boundaries.*illegal instruction"):
        _wgrad(dy, x, g33, precision="fp8")
    gs = _geom((2, 8, 8, 16, 16, 3, 3, 2, 1, 1))
    dys, _, xs = _data(gs)
    with pytest.raises(ValueError, match=r"backend='flat' cannot run.*stride \(2, 2\)"):
        _wgrad(dys, xs, gs, precision="fp16")
    gv = _geom((2, 8, 8, 16, 16, 3, 3, 1, 0, 1))  # 'valid' 3x3: output 6x6 of an 8x8 input
    dyv, _, xv = _data(gv)
    with pytest.raises(ValueError, match="'same' convolution"):
        _wgrad(dyv, xv, gv, precision="fp16")
    with pytest.raises(ValueError, match="only"):
        opc.conv2d_dgrad(dy, torch.randn(g33.weight_shape), g33.input_shape, 1, 1, backend="flat")
    g1 = _geom((2, 6, 6, 16, 16, 1, 1, 1, 0, 1))
    out = torch.empty(g1.weight_shape)
    d8 = wf.kmajor_rows(torch.randn(16, 72).to(torch.float8_e5m2))  # 72-byte rows: padded to 80
    x8 = wf.kmajor_rows(torch.randn(16, 72).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="fp8 operands must be K-major"):
        wf.wgrad_flat(torch.randn(2, 6, 6, 16).to(torch.float8_e5m2), torch.randn(2, 6, 6, 16).to(torch.float8_e4m3fn),
                      out, g1)
    with pytest.raises(ValueError, match="both fp8 or both one 16-bit type"):
        wf.wgrad_flat(d8, x8.half(), out, g1)
    with pytest.raises(ValueError, match="both 2-D"):
        wf.wgrad_flat(d8, torch.randn(2, 6, 6, 16).to(torch.float8_e4m3fn), out, g1)
    with pytest.raises(ValueError, match=r"must be a \(16, 72\) matrix.*16-byte aligned row stride"):
        wf.wgrad_flat(torch.randn(16, 72).to(torch.float8_e5m2), x8, out, g1)
    with pytest.raises(ValueError, match="BLOCK_L must be >= 32 for fp8"):
        wf.wgrad_flat(d8, x8, out, g1, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_L=16))
    with pytest.raises(ValueError, match="split_k"):
        wf.wgrad_flat(d8, x8, out, g1, split_k=0)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        wf.wgrad_flat(d8, x8, out.transpose(0, 3), g1)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        wf.wgrad_flat(d8.float(), x8.float(), out, g1)
    # batch-inner: N must fill 16-byte rows; shapes must be the layer's
    gb = _geom((8, 6, 6, 16, 16, 3, 3, 1, 1, 1))
    d_b = opc.to_fp8(torch.randn(gb.output_shape), "e5m2", memory_order=(3, 1, 2, 0)).data
    x_b = opc.to_fp8(torch.randn(gb.input_shape), "e4m3", memory_order=(3, 1, 2, 0)).data
    assert wf.layout_of(d_b, x_b) == "batch"
    with pytest.raises(ValueError, match=r"the batch N a multiple of 16, got N=8"):
        wf.wgrad_flat(d_b, x_b, torch.empty(gb.weight_shape), gb)
    g16 = _geom((16, 6, 6, 16, 16, 3, 3, 1, 1, 1))
    d16 = opc.to_fp8(torch.randn(g16.output_shape), "e5m2", memory_order=(3, 1, 2, 0)).data
    x16 = opc.to_fp8(torch.randn(16, 7, 6, 16), "e4m3", memory_order=(3, 1, 2, 0)).data
    with pytest.raises(ValueError, match=r"batch-inner dy and x must be shaped"):
        wf.wgrad_flat(d16, x16, torch.empty(g16.weight_shape), g16)
    with pytest.raises(ValueError, match="layout must be one of"):
        wf.supported(g16, torch.float8_e4m3fn, "nchw")


def test_auto_rule_and_explain(monkeypatch):
    """On (pretend) sm_90, auto runs fp8 wgrads on the flat kernel with batch-inner operands when N is a multiple of
    16 (every layer but the stride-1 1x1 ones outside L = N*P*Q in [2**15, 2**19): cuBLAS on the same memory);
    with other N: strided 1x1 and that L range on the K-major flat kernel, cuBLAS for the other 1x1 ones, the
    TMA-box kernel for 3x3; 16-bit never takes the flat kernel (measured slower than the TMA-box kernel on every
    3x3 layer)."""
    monkeypatch.setattr(opc, "choose_backend", lambda t, backend, kernel: ("triton", "pretend CUDA"))
    monkeypatch.setattr(opc, "_is_sm90", lambda t: True)
    t = torch.empty(0)
    for spec, want in (((256, 28, 28, 128, 512, 1, 1, 1, 0, 1), "flat"),  # L = 200704
                       ((256, 56, 56, 64, 256, 1, 1, 1, 0, 1), "gemm"),  # L = 802816
                       ((8, 7, 7, 512, 2048, 1, 1, 1, 0, 1), "gemm"),  # L = 392
                       ((8, 56, 56, 256, 128, 1, 1, 2, 0, 1), "flat"),
                       ((256, 56, 56, 256, 128, 1, 1, 2, 0, 1), "flat"),
                       ((256, 14, 14, 256, 256, 3, 3, 1, 1, 1), "flat"),
                       ((48, 9, 9, 64, 64, 5, 5, 2, 2, 2), "flat"),
                       ((8, 14, 14, 256, 256, 3, 3, 1, 1, 1), "tma")):
        g = _geom(spec)
        assert opc._choose("wgrad", g, t, "fp8", "auto")[0] == want, spec
        assert opc._choose("wgrad", g, t, "fp16", "auto")[0] != "flat"
        dy_order, x_order = opc._wgrad_orders(want, g)
        if g.N % 16 == 0:
            assert dy_order == x_order == opc._BATCH
        else:
            assert x_order == (opc._NHWC if want == "tma" or g.stride != (1, 1) else opc._CFIRST)
    g = _geom(FP8_1X1[1])
    dy, _, x = _data(g)
    s = opc.explain_conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, precision="fp8", backend="flat",
                                 split_k=2)
    assert "flat-shift" in s and "K-major" in s and "gathered K-major" in s and "split-K 2 ways" in s


# ------------------------------------------------------------------------------------------------
# The kernels compile for sm_90: 2-D / 4-D TMA loads, fp8 wgmma from shared memory (no GPU needed)
# ------------------------------------------------------------------------------------------------


def _aot(da: str, db: str, bm: int, bn: int, bl: int, layout: str, mask: bool, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    batch = layout.startswith("batch")
    fn = wf._wgrad_batch_kernel if batch else wf._wgrad_flat_kernel
    consts = dict(HAS_SCALE=False, SPLIT_OUT=True, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl)
    if batch:
        consts.update(DY_2D=layout == "batch2d")
    else:
        consts.update(KMAJOR=layout == "kmajor", MASK=mask)
    blocks = {"kmajor": ([bm, bl], [bn, bl]), "nhwc": ([bl, bm], [bl, bn]), "batch2d": ([bm, bl], [bn, 1, 1, bl]),
              "batch": ([bm, 1, 1, bl], [bn, 1, 1, bl])}[layout]
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("dy_desc", "x_desc"):
            blk = blocks[0] if name == "dy_desc" else blocks[1]
            sig[name] = f"tensordesc<{da if name == 'dy_desc' else db}[{', '.join(map(str, blk))}]>"
        elif name.endswith("_ptr"):
            sig[name], attrs[(i,)] = "*fp32", [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _aot_report() -> dict:
    out = {}
    for name, args in {"kmajor_fp8": ("fp8e5", "fp8e4nv", 128, 256, 128, "kmajor", False, 8, 3),
                       "nhwc_fp16_masked": ("fp16", "fp16", 128, 128, 64, "nhwc", True, 8, 4),
                       "batch_fp8": ("fp8e5", "fp8e4nv", 128, 128, 128, "batch2d", False, 8, 5)}.items():
        k = _aot(*args)
        out[name] = {"ptx": "\n".join(ln for ln in k.asm["ptx"].splitlines()
                                      if "wgmma.mma_async" in ln or "cp.async.bulk.tensor" in ln),
                     "shared": k.metadata.shared}
    return out


def test_kernel_compiles_to_tma_and_wgmma_for_sm90():
    rep = json.loads(run_aot(__file__, timeout=240).strip().splitlines()[-1])
    k8 = rep["kmajor_fp8"]["ptx"]
    assert "cp.async.bulk.tensor.2d" in k8 and "wgmma.mma_async.sync.aligned.m64n256k32.f32.e5m2.e4m3" in k8
    # both fp8 operands from shared memory: every wgmma names two matrix descriptors (%rd), none a register A
    wg = [ln for ln in k8.splitlines() if "wgmma.mma_async" in ln]
    assert wg and all(ln.split("}")[-1].count("%rd") == 2 for ln in wg), wg[:2]
    # batch-inner, BLOCK_L dividing N: dy a 2-D box, x a 4-D one (one pixel, BLOCK_L images) reshaped in shared
    # memory -- both from shared memory (a 4-D dy box reshaped to 2-D would reach wgmma through registers)
    kb = rep["batch_fp8"]["ptx"]
    assert "cp.async.bulk.tensor.4d" in kb and "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3" in kb
    wg = [ln for ln in kb.splitlines() if "wgmma.mma_async" in ln]
    assert wg and all(ln.split("}")[-1].count("%rd") == 2 for ln in wg), wg[:2]
    k16 = rep["nhwc_fp16_masked"]["ptx"]
    assert "cp.async.bulk.tensor.2d" in k16 and "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in k16
    assert all(0 < rep[n]["shared"] <= 227 * 1024 for n in rep)


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    require_nvidia_backend()
    print(json.dumps(_aot_report()))
