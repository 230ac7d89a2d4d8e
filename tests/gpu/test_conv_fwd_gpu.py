"""INT8 / FP8 forward convolution on the GPU, on every conv layer of issue 4's networks (AlexNet, VGG-variant,
ResNet-18, YOLOv2-tiny at 416x416) at batch 1 with the tiles of batch 8: the int32 accumulator and the
re-quantised int8 output bit-exact against the float64 reference, fp8 within a bound from the reduction
length, and the compiled kernels' tensor-core instructions (wgmma s8 -> IGMMA, e4m3 -> QGMMA)."""

import math
import zlib

import pytest
import torch

from tcprec.kernels import reference_conv_int8_fp8 as rf
from tcprec.kernels.conv_geometry import ConvGeometry

cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

DEV = "cuda"
U32 = 2.0**-24
# Hopper's fp8 wgmma accumulates up to BLOCK_K (<= 128) products in a register narrower than fp32
# (~13-bit mantissa) before each promotion into fp32 (max_num_imprecise_acc = BLOCK_K)
FP8_ACC = 128 * 2.0**-13
LAYERS = list(cf.NETWORK_LAYERS)


def _geom(name, N=1):
    H, W, C, K, R, S, st, pd = cf.NETWORK_LAYERS[name]
    return ConvGeometry(N, H, W, C, K, R, S, (st, st), (pd, pd), (1, 1))


def _cfg(name):
    """The batch-8 tiles (what the benchmark runs), so the test exercises the timed kernels."""
    return cf.pick_config(_geom(name, 8), fp8=False, device=torch.device(DEV))


@pytest.mark.parametrize("name", LAYERS)
def test_int8_layer_exact(name):
    g = _geom(name)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()))
    x = torch.randint(-128, 128, g.input_shape, device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, g.weight_shape, device=DEV, dtype=torch.int8, generator=gen)
    geo = dict(stride=g.stride, padding=g.padding)
    acc = cf.conv2d_fwd_int8(x, w, **geo, out="int32", config=_cfg(name))
    ref = rf.conv2d_fwd_int8(x, w, **geo, out="int32")
    assert torch.equal(acc, ref), f"{name}: {int((acc != ref).sum())} of {acc.numel()} accumulators differ"
    # the chained-layer epilogue: per-channel scale, bias, activation, int8 out -- bit-exact
    scale = torch.rand(g.K, device=DEV, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(g.K, device=DEV, generator=gen)
    act = ("leaky", 0.1) if name.startswith("yolo") else "relu"
    y_fp = rf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act, out="float32")
    s = float(y_fp.abs().max()) / 120
    y = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act, out=("int8", s), config=_cfg(name))
    y_ref = rf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act, out=("int8", s))
    assert torch.equal(y, y_ref), f"{name}: {int((y != y_ref).sum())} int8 outputs differ"


def test_int8_odd_shape_exact():
    """Odd sizes, channels not multiples of 16, dilation 2 with stride 2, batch 2 (the table's own tiles)."""
    gen = torch.Generator(DEV).manual_seed(3)
    x = torch.randint(-128, 128, (2, 57, 55, 40), device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (72, 3, 3, 40), device=DEV, dtype=torch.int8, generator=gen)
    geo = dict(stride=2, padding=2, dilation=2)
    assert torch.equal(cf.conv2d_fwd_int8(x, w, **geo, out="int32"), rf.conv2d_fwd_int8(x, w, **geo, out="int32"))


@pytest.mark.parametrize("name", LAYERS)
def test_fp8_layer_within_bound(name):
    g = _geom(name)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + 1)
    xf = torch.randn(g.input_shape, device=DEV, generator=gen)
    wf = torch.randn(g.weight_shape, device=DEV, generator=gen) / math.sqrt(g.R * g.S * g.C)
    xs, ws = (xf.abs().amax() / 448).reshape(1), wf.abs().amax(dim=(1, 2, 3)) / 448  # per-tensor, per-channel
    xq, wq = (xf / xs).to(torch.float8_e4m3fn), (wf / ws[:, None, None, None]).to(torch.float8_e4m3fn)
    bias = torch.randn(g.K, device=DEV, generator=gen) * 0.1
    geo = dict(stride=g.stride, padding=g.padding)
    y = cf.conv2d_fwd_fp8(xq, wq, xs, ws, **geo, bias=bias, act="relu", out="float16", config=_cfg(name))
    acc = rf.conv_acc(xq, wq, **geo)  # exact (float64)
    s = (xs.double() * ws.double())
    exact = torch.relu(acc * s + bias.double())
    red = g.R * g.S * g.C
    bound = ((1.01 * red * U32 + FP8_ACC) * rf.abs_conv_acc(xq, wq, **geo) * s + 2.0**-11 * exact.abs() * 1.01
             + 8 * U32 * (acc.abs() * s + bias.double().abs()) + 2.0**-24)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float16 and (err <= bound).all(), f"{name}: worst err/bound {float((err / bound).max()):.3g}"
    assert float(err.norm() / exact.norm()) < 5e-3


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_compiled_kernel_uses_wgmma(precision):
    """The PTX has wgmma with 8-bit operands; the SASS (cuobjdump) has IGMMA (s8) / QGMMA (e4m3) on sm_90."""
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        pytest.skip(f"wgmma needs sm_90, this GPU is sm_{cap[0]}{cap[1]}")
    name = "vgg.conv6"
    g = _geom(name)
    x = torch.randint(-8, 8, g.input_shape, device=DEV, dtype=torch.int8)
    w = torch.randint(-8, 8, g.weight_shape, device=DEV, dtype=torch.int8)
    geo = dict(stride=g.stride, padding=g.padding, config=_cfg(name), return_kernel=True)
    if precision == "int8":
        _, k = cf.conv2d_fwd_int8(x, w, out=("int8", 1.0), **geo)
        want_ptx, want_sass = ".s32.s8.s8", "IGMMA"
    else:
        _, k = cf.conv2d_fwd_fp8(x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), 1.0, 1.0, out="float16", **geo)
        want_ptx, want_sass = ".f32.e4m3.e4m3", "QGMMA"
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and want_ptx in ptx
    sass = k.asm["sass"]
    assert want_sass in sass, f"SASS lacks {want_sass}"
    assert "HGMMA" not in sass and "HMMA" not in sass


@pytest.mark.parametrize("name", ["alexnet.conv2", "vgg.conv6", "yolo.conv2", "resnet18.l4ds"])
def test_int8_acc_add_exact_and_capturable(name):
    """acc * acc_mul + acc_add (the shifted-uint8 correction of ops/qconv.py), per (p, q, k) table and per k,
    bit-exact against the reference, eagerly and replayed from a CUDA graph."""
    g = _geom(name, 2)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + 2)
    x = torch.randint(-128, 128, g.input_shape, device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, g.weight_shape, device=DEV, dtype=torch.int8, generator=gen)
    geo = dict(stride=g.stride, padding=g.padding)
    for add in (torch.randint(-2**20, 2**20, (g.P, g.Q, g.K), device=DEV, dtype=torch.int32, generator=gen),
                torch.randint(-2**20, 2**20, (g.K,), device=DEV, dtype=torch.int32, generator=gen)):
        kw = dict(geo, acc_mul=2, acc_add=add)
        want = rf.conv2d_fwd_int8(x, w, out="int32", **kw)
        assert torch.equal(cf.conv2d_fwd_int8(x, w, out="int32", **kw), want)
        y_want = rf.conv2d_fwd_int8(x, w, scale=1e-5, act="relu", out="float32", **kw)
        graph = torch.cuda.CUDAGraph()
        cf.conv2d_fwd_int8(x, w, scale=1e-5, act="relu", out="float32", **kw)  # compile outside the capture
        with torch.cuda.graph(graph):
            y = cf.conv2d_fwd_int8(x, w, scale=1e-5, act="relu", out="float32", **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y_want)


@pytest.mark.parametrize("name", ["resnet18.l1", "resnet18.l2", "resnet18.l2ds", "resnet18.l3", "resnet18.l4",
                                  "resnet18.l4ds"])
def test_int8_residual_dual_output_exact_and_capturable(name):
    """A ResNet block's fused last conv on the batch-8 tiles: relu(conv * scale + bias + residual) in fp16 / bf16
    beside the next layer's uint8 codes (stored shifted by 128; the input's uint8 correction too), bit-exact
    against the reference and the unfused conv + torch add + ReLU, the codes those of the stored float; eager and
    replayed from a CUDA graph; still wgmma s8 (IGMMA on sm_90)."""
    g = _geom(name, 2)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + 3)
    x = torch.randint(-128, 128, g.input_shape, device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, g.weight_shape, device=DEV, dtype=torch.int8, generator=gen)
    add = torch.randint(-2**20, 2**20, (g.K,), device=DEV, dtype=torch.int32, generator=gen)
    scale = torch.rand(g.K, device=DEV, generator=gen) * 1e-4 + 1e-5
    bias = torch.randn(g.K, device=DEV, generator=gen)
    geo = dict(stride=g.stride, padding=g.padding, acc_mul=1, acc_add=add, scale=scale, bias=bias)
    for rdt in (torch.float16, torch.bfloat16):
        kind = str(rdt).removeprefix("torch.")
        branch = cf.conv2d_fwd_int8(x, w, **geo, out=kind, config=_cfg(name))
        assert torch.equal(branch, rf.conv2d_fwd_int8(x, w, **geo, out=kind))
        res = (torch.randn(branch.shape, device=DEV, generator=gen) * branch.float().abs().amax()).to(rdt)
        s_out = (torch.relu(branch.float() + res.float()).amax() / 300).reshape(1)  # the top 15% saturate
        kw = dict(geo, act="relu", residual=res, out=kind, out_int8=("int8", s_out, (0, 255, 128)))
        (y, y8), k = cf.conv2d_fwd_int8(x, w, **kw, config=_cfg(name), return_kernel=True)
        ry, ry8 = rf.conv2d_fwd_int8(x, w, **kw)
        assert torch.equal(y, ry) and torch.equal(y8, ry8), f"{name} {kind}: {int((y8 != ry8).sum())} codes differ"
        assert torch.equal(y, torch.relu(branch + res))  # the unfused graph, in the network's dtype
        assert torch.equal(y8, (torch.round(torch.clamp(y.float() / s_out, 0, 255)) - 128).to(torch.int8))
        assert int(y8.max()) == 127 and len(torch.unique(y8)) > 150  # code 255 (stored 127) and many others
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gy, gy8 = cf.conv2d_fwd_int8(x, w, **kw, config=_cfg(name))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, y) and torch.equal(gy8, y8)
        assert ".s32.s8.s8" in k.asm["ptx"]
        if torch.cuda.get_device_capability() >= (9, 0):
            assert "IGMMA" in k.asm["sass"]


@pytest.mark.parametrize("name", ["vgg.conv1", "alexnet.conv1", "yolo.conv1", "resnet18.conv1", "alexnet.conv2"])
@pytest.mark.parametrize("pool", [0, 2])
def test_int8_planes_out_equals_the_quantize_pass(name, pool):
    """out=PlanesOut: the binary networks' stems (and a C = 64 layer, tap mode) writing the next layer's 2-bit planes
    from the epilogue, (2x2 max-pooled,) equal the float32 output run through the one-pass quantizer it replaces,
    at batch 2 with the batch-256 tiles (what the benchmark's batch-256 rows run) and under CUDA-graph replay."""
    from tcprec.kernels.triton import pack as tpack

    g = _geom(name, 2)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + pool)
    x = torch.randint(-128, 128, g.input_shape, device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, g.weight_shape, device=DEV, dtype=torch.int8, generator=gen)
    scale = torch.rand(g.K, device=DEV, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(g.K, device=DEV, generator=gen)
    geo = dict(stride=g.stride, padding=g.padding)
    cfg = cf.pick_config(_geom(name, 256), fp8=False, device=torch.device(DEV))
    y = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act="relu", out="float32", config=cfg)
    s = (y.abs().amax() / 3.5).reshape(1)
    want = (tpack.pool_quantize_pack(y, s, 2, 2, 0, 3, 0, 0) if pool else
            tpack.quantize_pack(y.reshape(-1, g.K), s, 2, 0, 3, 0, 0))
    spec = cf.PlanesOut(s, 2, 0, 3, pool=pool)
    got = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act="relu", out=spec, config=cfg)
    assert torch.equal(got, want), f"{name}: {int((got != want).sum())} of {got.numel()} words differ"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act="relu", out=spec, config=cfg)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


# clamp (ReLU6, hardtanh), hardswish and SiLU: the epilogue's compiled variant (ACT_EXT), against apply_act
EXT_ACTS = [("clamp", 0.0, 6.0), ("clamp", -1.0, 0.75), "hardswish", "silu"]


def _ext_close(got, want, y_pre, act, what):
    """Bit for bit, but SiLU: tl.exp is ex2.approx.f32 (~2 ulp) of RN(-y * log2 e), whose rounding exp turns into a
    relative |y| * 2^-23; apply_act's torch.exp < 1 ulp; 1 + e and the division round once on either side: float32
    within (|y| + 8) * 2^-23 relative (y the pre-activation), a 16-bit float within one step of its format, int8
    codes within one code (the float32 values can straddle a rounding boundary)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if act != "silu":
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} differ"
        return
    g, r = got.double(), want.double()
    if want.dtype == torch.int8:
        assert (g - r).abs().max() <= 1, what
    elif want.dtype == torch.float32:
        bound = (y_pre.double().abs() + 8) * 2.0**-23 * r.abs() + 2.0**-120
        assert ((g - r).abs() <= bound).all(), f"{what}: worst err/bound {float(((g - r).abs() / bound).max()):.3g}"
    else:
        assert ((g - r).abs() <= torch.finfo(want.dtype).eps * r.abs() + 2.0**-24).all(), what
    if want.dtype != torch.float32:
        assert (got == want).float().mean() > 0.95, what


@pytest.mark.parametrize("act", EXT_ACTS, ids=["relu6", "hardtanh", "hardswish", "silu"])
@pytest.mark.parametrize("name", ["resnet18.l1", "vgg.conv2", "yolo.conv2", "resnet50.l1c1", "alexnet.conv1"])
def test_int8_ext_act_equals_reference(name, act):
    """The int8 kernel (batch-8 tiles, batch 2) with clamp / hardswish / SiLU: float32, float16, bfloat16, int8 codes
    and the dual output, with and without a float16 residual, against the reference (bit for bit; SiLU within
    _ext_close's bound); only the SiLU variant's PTX has an exp and a float32 division."""
    g = _geom(name, 2)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + 4)
    x = torch.randint(-128, 128, g.input_shape, device=DEV, dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, g.weight_shape, device=DEV, dtype=torch.int8, generator=gen)
    geo = dict(stride=g.stride, padding=g.padding)
    acc = rf.conv2d_fwd_int8(x, w, **geo, out="int32")
    scale = 3.0 / acc.double().std().item() * (torch.rand(g.K, device=DEV, generator=gen) + 0.5)  # y ~ N(0, 3^2)
    bias = torch.randn(g.K, device=DEV, generator=gen)
    for res in (None, (torch.randn(g.output_shape, device=DEV, generator=gen) * 3).half()):
        kw = dict(geo, scale=scale.float(), bias=bias, residual=res)
        y_pre = rf.conv2d_fwd_int8(x, w, **kw, out="float32")
        s8 = (y_pre.abs().amax() / 100).reshape(1)
        for out, out8 in (("float32", None), ("float16", None), ("bfloat16", None), (("int8", s8), None),
                          ("float16", ("int8", s8, (-128, 127, 0)))):
            got = cf.conv2d_fwd_int8(x, w, **kw, act=act, out=out, out_int8=out8, config=_cfg(name))
            want = rf.conv2d_fwd_int8(x, w, **kw, act=act, out=out, out_int8=out8)
            pairs = zip(got, want) if out8 is not None else [(got, want)]
            for a, b in pairs:
                _ext_close(a, b, y_pre, act, f"{name} res={res is not None} out={out} out_int8={out8}")
    _, k = cf.conv2d_fwd_int8(x, w, **geo, scale=scale.float(), act=act, out="float16", config=_cfg(name),
                              return_kernel=True)
    ptx = k.asm["ptx"]
    assert ("ex2" in ptx and "div.rn.f32" in ptx) == (act == "silu") and ".s32.s8.s8" in ptx


@pytest.mark.parametrize("act", EXT_ACTS, ids=["relu6", "hardtanh", "hardswish", "silu"])
@pytest.mark.parametrize("name", ["resnet18.l2", "vgg.conv1"])
def test_fp8_ext_act_equals_reference_on_its_accumulator(name, act):
    """The FP8 kernel: the reference's epilogue on the kernel's own float32 accumulator (out="float32", unit scales, no
    bias: exactly the accumulator; the same tiles, so the same summation order), per-tensor x and per-channel w
    scales, float16 and the dual e4m3 output, with a residual."""
    g = _geom(name, 2)
    gen = torch.Generator(DEV).manual_seed(zlib.crc32(name.encode()) + 5)
    xq = (torch.randn(g.input_shape, device=DEV, generator=gen) * 4).to(torch.float8_e4m3fn)
    wq = torch.randn(g.weight_shape, device=DEV, generator=gen).to(torch.float8_e4m3fn)
    geo = dict(stride=g.stride, padding=g.padding, config=_cfg(name))
    acc = cf.conv2d_fwd_fp8(xq, wq, 1.0, 1.0, **geo, out="float32")
    xs = torch.tensor([0.5], device=DEV)
    ws = (6.0 / acc.double().std().item() * (torch.rand(g.K, device=DEV, generator=gen) + 0.5)).float()
    bias = torch.randn(g.K, device=DEV, generator=gen)
    res = (torch.randn(g.output_shape, device=DEV, generator=gen) * 3).half()
    ref_kw = dict(alpha=1.0, sa=xs, sb=ws, bias=bias, residual=res)
    y_pre = rf.epilogue(acc, **ref_kw, out="float32")
    for out, out8 in (("float32", None), ("float16", ("e4m3", float(y_pre.abs().amax()) / 300))):
        got = cf.conv2d_fwd_fp8(xq, wq, xs, ws, **geo, bias=bias, act=act, residual=res, out=out, out_int8=out8)
        want = rf.epilogue(acc, **ref_kw, act=act, out=out, out_int8=out8)
        if out8 is None:
            _ext_close(got, want, y_pre, act, f"{name} out={out}")
        else:
            _ext_close(got[0], want[0], y_pre, act, f"{name} out={out}")
            g8, r8 = got[1].view(torch.uint8), want[1].view(torch.uint8)  # (comparing the float8 codes as bytes)
            codes_ok = torch.equal(g8, r8) if act != "silu" else \
                ((got[1].float() - want[1].float()).abs() <= 2.0**-2 * want[1].float().abs() + 2.0**-9).all()
            assert codes_ok, f"{name}: e4m3 codes"
