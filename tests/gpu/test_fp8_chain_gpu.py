"""FP8 layers handing each other float8 codes, on the GPU: the one-pass max-pool + quantize
(``fp8_quant.pool_quantize_fp8``) and the conv epilogue's float8 output (``conv_fwd`` OUT_MODE 4) give the codes of
the previous path bit for bit -- torch's max-pool and ``quantize_fp8_static`` (the one-pass ``cvt.rn.satfinite``
quantiser on CUDA, torch's ops on the CPU) -- on ties, saturation, subnormals, +-Inf and NaN, on the layers of
YOLOv2-tiny, and through whole FP8 networks (YOLOv2-tiny, AlexNet, ResNet-18): every chained layer's e4m3 codes
equal its own float32 output run through torch's passes."""

import pytest
import torch

import tcprec as tp
from tcprec.kernels import reference_conv_int8_fp8 as rf
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.nn import models as zoo
from tcprec.nn.qmodules import QConv2d, _quantize_input
from tcprec.ops import qconv as qc
from tcprec.qtensor import Dense, PerChannel, QTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")
fq = pytest.importorskip("tcprec.kernels.triton.fp8_quant")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

DEV = "cuda"
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
POOLS = {0: None, 1: ("max", 2, 1), 2: ("max", 2, 2)}


def _same_codes(got: torch.Tensor, want: torch.Tensor, msg=""):
    """Bit-equal uint8 codes, except that a NaN may carry either sign (cvt.rn.satfinite writes +NaN)."""
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    nan = (want & 0x7F) == 0x7F
    assert torch.equal(got[~nan], want[~nan]), msg
    assert torch.equal(got[nan] & 0x7F, want[nan] & 0x7F), msg


def _values(shape, dtype, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(shape, device=DEV, generator=g) * 200
    flat = x.view(-1)
    specials = torch.tensor([100.0, 104.0, 98.0, 99.0, 17.0, 19.0, 460.0, 1e6, -1e6, 2.0**-10, 3 * 2.0**-11, -0.0, 0.0,
                             float("nan"), float("inf"), -float("inf"), 57344.0, 61440.0, 2.0**-17, 1.5 * 2.0**-16,
                             -100.0, -17.0], device=DEV)
    flat[::97][:specials.numel()] = specials  # spread over windows
    return x.to(dtype)


@pytest.mark.parametrize("fmt", list(F8))
@pytest.mark.parametrize("stride", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pool_quantize_fp8_equals_torch(fmt, stride, dtype):
    y = _values((4, 13, 15, 72), dtype, seed=stride)
    scale = torch.tensor([0.5], device=DEV)
    got = fq.pool_quantize_fp8(y, scale, stride, F8[fmt])
    pooled = rq.pool_nhwc(y.float(), POOLS[stride])
    _same_codes(got, qc.quantize_fp8_static(pooled, scale, fmt).codes)  # CUDA: the cvt.rn.satfinite pass
    cpu = qc.quantize_fp8_static(rq.pool_nhwc(y.float().cpu(), POOLS[stride]), scale.cpu(), fmt).codes
    assert torch.equal(got.view(torch.uint8).cpu(), cpu)  # torch's ops, NaN signs included


@pytest.mark.parametrize("kind", list(F8))
@pytest.mark.parametrize("C", [16, 64, 256])
def test_int8_conv_fp8_out_bit_exact(kind, C):
    """Exact int8 sums, scale 1: many exact ties; specials from the bias; against the reference epilogue."""
    g = torch.Generator(DEV).manual_seed(C)
    x = torch.randint(-6, 6, (4, 13, 13, C), device=DEV, generator=g, dtype=torch.int8)
    w = torch.randint(-6, 6, (32, 3, 3, C), device=DEV, generator=g, dtype=torch.int8)
    bias = torch.zeros(32, device=DEV)
    bias[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e6], device=DEV)
    for s in (1.0, 0.25, 0.3, 40.0):
        kw = dict(stride=1, padding=1, bias=bias, act=("leaky", 0.5), out=(kind, s))
        got = cf.conv2d_fwd_int8(x, w, **kw)
        assert torch.equal(got.view(torch.uint8), rf.conv2d_fwd_int8(x, w, **kw).view(torch.uint8))


@pytest.mark.parametrize("kind", list(F8))
@pytest.mark.parametrize("layer", ["yolo.conv2", "yolo.conv4", "resnet18.l2", "alexnet.conv3"])
def test_fp8_conv_fp8_out_equals_float32_quantized(kind, layer):
    H, W, C, K, R, S, st, pd = cf.NETWORK_LAYERS[layer]
    g = torch.Generator(DEV).manual_seed(1)
    x = (torch.randn(2, H, W, C, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(K, R, S, C, device=DEV, generator=g) / 4).to(torch.float8_e4m3fn)
    ws = torch.rand(K, device=DEV, generator=g) + 0.5
    bias = torch.randn(K, device=DEV, generator=g)
    for fast in (True, False):
        kw = dict(stride=st, padding=pd, bias=bias, act=("leaky", 0.1), fast_accum=fast)
        y32 = cf.conv2d_fwd_fp8(x, w, 0.125, ws, **kw, out="float32")
        o = (y32.abs().amax() / 448 / 4).reshape(1)  # the top values saturate
        got = cf.conv2d_fwd_fp8(x, w, 0.125, ws, **kw, out=(kind, o))
        _same_codes(got, qc.quantize_fp8_static(y32, o, kind).codes, (layer, fast))


@pytest.mark.parametrize("pool", [None, ("max", 2, 2), ("max", 2, 1), ("avg", 2, 2)])
@pytest.mark.parametrize("layer", ["yolo.conv1", "yolo.conv2", "yolo.conv6", "alexnet.conv2"])
def test_qconv_fp8_chain_equals_unfused_path(layer, pool):
    """conv2d with out_fmt e4m3 (the epilogue's codes, or one pooling pass) == its float32 output, torch's pool and
    quantize_fp8_static, on the shapes of the networks (batch 2)."""
    H, W, C, K, R, S, st, pd = cf.NETWORK_LAYERS[layer]
    g = torch.Generator(DEV).manual_seed(2)
    qx = qc.quantize_fp8_static(torch.randn(2, H, W, C, device=DEV, generator=g), torch.tensor([0.01], device=DEV))
    pw = qc.pack_conv_weight(tp.quantize(torch.randn(K, R, S, C, device=DEV, generator=g), "e4m3", PerChannel(0)))
    bias = torch.randn(K, device=DEV, generator=g)
    kw = dict(stride=st, padding=pd, bias=bias, act=("leaky", 0.1))
    y32 = qc.conv2d(qx, pw, **kw)
    o = (y32.abs().amax() / 448 / 2).reshape(1)
    got = qc.conv2d(qx, pw, pool=pool, out_fmt="e4m3", out_scale=o, **kw)
    want = qc.quantize_fp8_static(rq.pool_nhwc(y32, pool), o, "e4m3")
    assert isinstance(got, QTensor) and got.shape == want.shape
    assert torch.equal(got.codes, want.codes)


@pytest.mark.parametrize("name, size", [("yolov2-tiny", 128), ("alexnet", None), ("resnet18", None)])
def test_fp8_networks_chain_equals_unfused_path(name, size):
    """Every FP8 layer that hands e4m3 codes to the next: its codes equal its own float32 output (the same kernel),
    torch's pool and quantize_fp8_static; the network runs compiled (CUDA graph) to the eager result."""
    m = zoo.build(name, device=DEV).to(dtype=torch.float16, memory_format=torch.channels_last)
    c, h, w = zoo.INPUT_SHAPES[name]
    h = w = size or h
    x = torch.randn(2, c, h, w, device=DEV, generator=torch.Generator(DEV).manual_seed(0)).half()
    q = tp.quantize_model(m, "fp8", calibration=x, warn=False)
    checked = []

    def hook(mod, args, out):
        if not (isinstance(out, QTensor) and isinstance(out.layout, Dense)):  # (e4m3 codes; int8 codes: not here)
            return
        xin = args[0]
        if isinstance(xin, torch.Tensor):  # the layer quantizes its float input itself (fp8, or the int8 stem)
            xin = _quantize_input(xin.permute(0, 2, 3, 1), mod)
        res = None if len(args) < 2 or args[1] is None else mod._residual_nhwc(args[1], xin.shape)
        # with a residual the codes are of the sum in the network's dtype (the unfused graph quantizes that)
        y = qc.conv2d(xin, mod.weight, stride=mod.stride, padding=mod.padding, dilation=mod.dilation,
                      scale=mod.ch_scale, bias=mod.ch_bias, act=mod.act, backend=mod.backend, residual=res,
                      out_dtype=torch.float32 if res is None else res.dtype)
        if out.hp is not None:  # the dual output: the float as the unchained layer writes it
            assert torch.equal(out.hp, y.to(mod.out_dtype)), mod
            y = out.hp
        want = qc.quantize_fp8_static(rq.pool_nhwc(y, mod.pool), mod.out_scale, mod.out_fmt)
        assert torch.equal(out.codes, want.codes), mod
        checked.append(mod.pool)

    hooks = [mod.register_forward_hook(hook) for mod in q.modules() if isinstance(mod, QConv2d)]
    with torch.no_grad():
        y = q(x)
    for hk in hooks:
        hk.remove()
    assert len(checked) > 0 and torch.isfinite(y).all()
    if name == "yolov2-tiny":
        assert ("max", 2, 2) in checked and None in checked  # the pooled one-pass and the epilogue's codes
    eng = tp.compile(q, x)
    torch.testing.assert_close(eng(x.cpu()), y.cpu(), rtol=0, atol=0)
