"""The flat-shift wgrad kernel (kernels/triton/wgrad_flat.py) on an sm_90 GPU: tests/test_wgrad_flat.py's checks at
ResNet-50 sizes (small batch) against torch.nn.grad in float64 within the bound of the other conv tests -- fp8
K-major 1x1 layers at stride 1 and 2 (rows padded to 16 bytes where N*P*Q is not a multiple of 16), 16-bit NHWC
3x3 layers -- deterministic split-K, auto's choice, and the compiled kernel: 2-D TMA loads (UTMALDG) and fp8
wgmma (HGMMA) with both operands in shared memory."""

import pytest
import torch

from tcprec.ops import conv as opc

wf = pytest.importorskip("tcprec.kernels.triton.wgrad_flat")

from test_conv_bwd_gpu import DEV, _data, _geom, check_wgrad  # noqa: E402  (the GPU bound helpers)

FP8_GEOMS = [
    (4, 56, 56, 256, 128, 1, 1, 2, 0, 1),  # strided: x's pixels gathered K-major first
    (4, 28, 28, 128, 512, 1, 1, 1, 0, 1),  # stride 1, L = 3136
    (4, 14, 14, 1024, 512, 1, 1, 2, 0, 1),
    (4, 7, 7, 2048, 512, 1, 1, 1, 0, 1),  # L = 196: rows padded to 208 bytes
    (3, 15, 13, 48, 80, 1, 1, (2, 3), 0, 1),  # odd sizes, stride 2 x 3
]


@pytest.fixture(autouse=True)
def _sm90():
    cap = torch.cuda.get_device_capability()
    if cap[0] < 9:
        pytest.skip(f"TMA descriptors and wgmma need sm_90+, this GPU is sm_{cap[0]}{cap[1]}")


def _wgrad(dy, x, g, **kw):
    return opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="flat", **kw)


@pytest.mark.parametrize("spec", FP8_GEOMS, ids=lambda s: "x".join(map(str, s[:7])) + f"_s{s[7]}")
def test_fp8_1x1_vs_fp64(spec):
    g = _geom(spec)
    dy, _, x = _data(g, seed=hash(spec) % 1000)
    for split in (None, 1):
        check_wgrad(g, "fp8", dy, x, _wgrad(dy, x, g, precision="fp8", split_k=split))
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="flat")
    assert torch.equal(_wgrad(dyq, xq, g, precision="fp8", split_k=4), _wgrad(dy, x, g, precision="fp8", split_k=4))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_nhwc_3x3_vs_fp64(precision):
    for spec in ((4, 14, 14, 256, 256, 3, 3, 1, 1, 1), (4, 7, 7, 512, 512, 3, 3, 1, 1, 1)):
        g = _geom(spec)
        dy, _, x = _data(g, seed=7)
        check_wgrad(g, precision, dy, x, _wgrad(dy, x, g, precision=precision))


@pytest.mark.parametrize("spec", [(8, 28, 28, 512, 256, 1, 1, 2, 0, 1),  # K-major (N = 8)
                                  (128, 14, 14, 256, 256, 3, 3, 1, 1, 1),  # batch-inner, BLOCK_L divides N: 2-D dy
                                  (48, 14, 14, 256, 256, 3, 3, 1, 1, 1)],  # batch-inner, partial image boxes
                         ids=lambda s: "x".join(map(str, s[:7])))
def test_every_fp8_config_and_split_determinism(spec):
    g = _geom(spec)
    dy, _, x = _data(g, seed=8)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="flat")
    for cfg in wf.CONFIGS:
        check_wgrad(g, "fp8", dy, x, _wgrad(dyq, xq, g, precision="fp8", config=cfg))
    a = _wgrad(dyq, xq, g, precision="fp8", split_k=7)
    assert torch.equal(a, _wgrad(dyq, xq, g, precision="fp8", split_k=7)), f"split-K flat wgrad not reproducible: {g}"


def test_auto_takes_flat_for_fp8_strided_1x1():
    g = _geom((8, 56, 56, 256, 512, 1, 1, 2, 0, 1))
    dy = torch.empty(g.output_shape, device=DEV)
    x = torch.empty(g.input_shape, device=DEV)
    assert "flat-shift" in opc.explain_conv2d_wgrad(dy, x, g.weight_shape, 2, 0, precision="fp8")
    assert "flat-shift" not in opc.explain_conv2d_wgrad(dy, x, g.weight_shape, 2, 0, precision="fp16")


def test_compiled_kernel_uses_tma_and_fp8_wgmma_from_shared_memory():
    g = _geom((8, 28, 28, 128, 512, 1, 1, 1, 0, 1))
    dy, _, x = _data(g, seed=9)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, 1, 0, backend="flat")
    dy_m = wf.kmajor_rows(dyq.data.permute(3, 0, 1, 2).reshape(g.K, -1))
    x_m = wf.kmajor_pixels(xq.data)
    k, _ = wf.wgrad_flat(dy_m, x_m, torch.empty(g.weight_shape, device=DEV), g, config=wf.CONFIGS[0], split_k=2)
    _check_tma_fp8_wgmma(k, ("cp.async.bulk.tensor.2d",), "UTMALDG")


def _check_tma_fp8_wgmma(k, ptx_loads, sass_load):
    """The compiled kernel loads by TMA and runs fp8 wgmma (SASS QGMMA) with both operands in shared memory (every
    wgmma names two matrix descriptors, %rd, none a register A)."""
    ptx = k.asm["ptx"]
    assert all(ld in ptx for ld in ptx_loads) and "e5m2.e4m3" in ptx
    wg = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert wg and all(ln.split("}")[-1].count("%rd") == 2 for ln in wg), "an fp8 operand left shared memory"
    try:
        sass = k.asm["sass"]
    except Exception:  # cuobjdump / nvdisasm missing: the PTX checks above are what ran
        return
    ops = sorted({ln.split("\t")[-1].split()[0] for ln in sass.splitlines() if "\t" in ln and ln.split("\t")[-1]})
    assert "QGMMA" in sass and sass_load in sass, [o for o in ops if o.startswith(("U", "Q", "H"))]


# ------------------------------------------------------------------------------------------------
# Batch-inner fp8 operands (N a multiple of 16): any filter, stride, padding, dilation
# ------------------------------------------------------------------------------------------------

BATCH_GEOMS = [
    (32, 28, 28, 128, 128, 3, 3, 1, 1, 1),  # 3x3 "same": taps off the image are TMA zero fill
    (16, 56, 56, 64, 64, 3, 3, 1, 1, 1),  # N = 16 < BLOCK_L: one partial image box a pixel (4-D dy box)
    (32, 56, 56, 256, 512, 1, 1, 2, 0, 1),  # strided 1x1: strided pixels read in place
    (48, 15, 13, 48, 80, 3, 3, (2, 1), (1, 2), (1, 2)),  # odd sizes, mixed stride / padding / dilation
    (32, 7, 7, 512, 512, 3, 3, 1, 1, 1),
    (16, 11, 11, 16, 64, 7, 7, 2, 3, 1),  # a 7x7 stem-like layer
]


@pytest.mark.parametrize("spec", BATCH_GEOMS, ids=lambda s: "x".join(map(str, s[:7])) + f"_s{s[7]}")
def test_fp8_batch_inner_vs_fp64(spec):
    g = _geom(spec)
    dy, _, x = _data(g, seed=hash(spec) % 1000)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="flat")
    assert wf.layout_of(dyq.data, xq.data) == "batch"
    for split in (None, 1, 5):
        check_wgrad(g, "fp8", dy, x, _wgrad(dyq, xq, g, precision="fp8", split_k=split))
    assert torch.equal(_wgrad(dyq, xq, g, precision="fp8", split_k=3), _wgrad(dy, x, g, precision="fp8", split_k=3))


def test_auto_takes_batch_inner_flat_for_fp8_when_n_is_a_multiple_of_16():
    for n, want in ((32, "batch-inner"), (8, "TMA-box")):
        g = _geom((n, 28, 28, 128, 128, 3, 3, 1, 1, 1))
        dy = torch.empty(g.output_shape, device=DEV)
        x = torch.empty(g.input_shape, device=DEV)
        assert want in opc.explain_conv2d_wgrad(dy, x, g.weight_shape, 1, 1, precision="fp8")


def test_compiled_batch_inner_kernel_uses_4d_tma_and_fp8_wgmma_from_shared_memory():
    g = _geom((128, 14, 14, 256, 256, 3, 3, 1, 1, 1))
    dy, _, x = _data(g, seed=11)
    dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, 1, 1, backend="flat")
    k, _ = wf.wgrad_flat(dyq.data, xq.data, torch.empty(g.weight_shape, device=DEV), g,
                         config=dict(BLOCK_M=128, BLOCK_N=128, BLOCK_L=128, num_warps=8, num_stages=4), split_k=2)
    _check_tma_fp8_wgmma(k, ("cp.async.bulk.tensor.4d", "cp.async.bulk.tensor.2d"), "UTMALDG.4D")
