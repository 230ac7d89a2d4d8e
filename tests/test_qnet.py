"""Whole quantized networks on the CPU: the model zoo, QConv2d / QLinear, quantize_model (fusion,
calibration, chaining rules, summary, warnings), the engine's eager mode and its input checks, and
the CLI commands that need no GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import dataclasses  # noqa: E402
import operator  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import tcprec as tp  # noqa: E402
from tcprec.nn import models as zoo  # noqa: E402
from tcprec.nn.qmodules import LayerPrecision, QConv2d, QLinear, parse_precision  # noqa: E402


def _as_on_h100(monkeypatch):
    """quantize_model's decisions (backends, chaining) as on an H100 (sm_90, 132 SMs, cuda.core): bit-serial while
    p*q < 8, INT8 otherwise.  The layers still run the float64 reference on this CPU, which reads and writes the same
    operands (BitPlanes, ShiftedInt8 and float8 QTensors)."""
    from tcprec.nn import convert
    from tcprec.ops.qconv_plan import DeviceCaps

    caps = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)
    monkeypatch.setattr(convert, "device_caps", lambda dev: caps)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.LeakyReLU(0.1),
        nn.Conv2d(16, 16, 1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10),
    )


def _calibrated(net, x):
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)
    return net.eval()


def _nrmse(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


# -- precision strings -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [("w1a2", LayerPrecision(1, 2)), ("W4A8", LayerPrecision(4, 8)),
                                        ("int8", LayerPrecision(8, 8)), ("fp8", LayerPrecision(fp8=True)),
                                        ("float", None)])
def test_parse_precision(text, want):
    assert parse_precision(text) == want


@pytest.mark.parametrize("bad", ["w0a2", "w9a9", "w1", "int4x", "int9", "e5m2"])
def test_parse_precision_rejects(bad):
    with pytest.raises(ValueError, match=r"(?i)accepted: 'float'"):  # the whole accepted set
        parse_precision(bad)


def test_parse_precision_aliases_are_one_vocabulary():
    assert parse_precision("e4m3") == parse_precision("fp8")  # e4m3 weights and activations
    assert parse_precision("int4") == parse_precision("w4a4")
    for old in ("fp16", "bf16"):  # no longer silently "keep float": the error says what to write
        with pytest.raises(ValueError, match="float"):
            parse_precision(old)


# -- modules ----------------------------------------------------------------------------------------


def test_qconv2d_equals_fake_quant_simulation():
    """A QConv2d computes act(bn(conv(dequant(q(x)), dequant(q(w))))) exactly up to float32 rounding."""
    torch.manual_seed(1)
    conv = nn.Conv2d(6, 10, 3, stride=2, padding=1, bias=True)
    bn = _calibrated(nn.Sequential(nn.BatchNorm2d(10)), None)[0]
    x = torch.relu(torch.randn(2, 6, 9, 11))
    m = QConv2d.from_float(conv, "w3a4", in_absmax=float(x.max()), signed_input=False, bn=bn, act="relu",
                           backend="reference")
    y = m(x)
    xq = tp.quantize(x, "uint4", scale=m.in_scale.reshape(1, 1, 1, 1)).dequantize()
    wq = m.weight.qw.dequantize().permute(0, 3, 1, 2)  # KRSC -> KCRS
    ref = torch.relu(bn(F.conv2d(xq.double(), wq.double(), conv.bias.double(), 2, 1).float()))
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_qlinear_equals_fake_quant_simulation():
    torch.manual_seed(2)
    lin = nn.Linear(40, 7)
    x = torch.randn(5, 40)
    m = QLinear.from_float(lin, "w2a3", in_absmax=float(x.abs().max()), signed_input=True, act="relu")
    xq = tp.quantize(x, "int3", scale=m.in_scale.reshape(1, 1)).dequantize()
    wq = m.weight.qw.dequantize().reshape(7, 40)
    ref = torch.relu(xq.double() @ wq.double().T + lin.bias.double()).float()
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


def test_binary_weights_use_mean_abs_scale():
    conv = nn.Conv2d(4, 3, 3, bias=False)
    m = QConv2d.from_float(conv, "w1a2", in_absmax=1.0, signed_input=False)
    want = conv.weight.detach().abs().flatten(1).mean(1)
    torch.testing.assert_close(m.weight.qw.scale.flatten(), want)
    assert str(m.w_fmt) == "binary" and str(m.a_fmt) == "uint2"


def test_qconv2d_rejects_groups_and_bad_input():
    with pytest.raises(ValueError, match="groups=1"):
        QConv2d.from_float(nn.Conv2d(4, 4, 3, groups=2), "w2a2", in_absmax=1.0, signed_input=False)
    m = QConv2d.from_float(nn.Conv2d(4, 4, 3), "w2a2", in_absmax=1.0, signed_input=False)
    with pytest.raises(ValueError, match=r"expects \(N, 4, H, W\)"):
        m(torch.randn(1, 3, 8, 8))


# -- quantize_model ------------------------------------------------------------------------------------


def test_quantize_model_fuses_and_reports():
    x = torch.randn(4, 3, 8, 8)
    net = _calibrated(_net(), x)
    q = tp.quantize_model(net, "w2a2", calibration=x)
    s = q.tcprec_summary
    assert s.traced
    assert [r.name for r in s.layers] == ["0", "4", "7", "10", "12"]
    assert [r.precision for r in s.layers] == ["w8a8", "w2a2", "w2a2", "w2a2", "w8a8"]  # first / last at 8 bits
    assert s.layers[0].fused == ("bn", "relu", "maxpool") and s.layers[1].fused == ("bn", "leaky(0.1)")
    assert s.layers[3].fused == ("flatten", "relu")  # nn.Flatten -> flatten_nhwc + reordered weight columns
    kinds = [type(m).__name__ for m in q.modules()]
    assert "BatchNorm2d" not in kinds and "MaxPool2d" not in kinds and "Flatten" not in kinds  # folded away
    assert kinds.count("QConv2d") == 3 and kinds.count("QLinear") == 2
    # the leaky layer's input can be negative after a LeakyReLU -> signed activations next
    assert str(dict(q.named_modules())["7"].a_fmt) == "int2"
    with torch.no_grad():
        y, ref = q(x), net(x)
    assert y.shape == ref.shape and _nrmse(y, ref) < 1.0
    assert "w2a2" in str(s)


def test_int8_model_is_close_to_float():
    x = torch.randn(4, 3, 8, 8)
    net = _calibrated(_net(), x)
    q = tp.quantize_model(net, "int8", calibration=x)
    with torch.no_grad():
        assert _nrmse(q(x), net(x)) < 0.05


def test_quantize_model_overrides_and_float_warning():
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_net(), x)
    net[7] = nn.Conv2d(16, 16, 1, groups=4)  # grouped: QGroupedConv2d (nn/qgrouped.py)
    with pytest.warns(UserWarning, match=r"stay in floating point: 4 \(kept in float \(config\)\)"):
        q = tp.quantize_model(net, tp.QuantConfig("w4a4", overrides={"4": "float"}), calibration=x)
    prec = {r.name: r.precision for r in q.tcprec_summary.layers}
    assert prec["4"] == "float" and prec["7"] == "w4a4" and prec["10"] == "w4a4"
    assert type(dict(q.named_modules())["7"]).__name__ == "QGroupedConv2d"
    assert isinstance(dict(q.named_modules())["4"], nn.Conv2d)
    with torch.no_grad():
        q(x)  # float and quantized layers interoperate (NCHW float between them)


def test_a_conv_kept_float_keeps_its_batchnorm_grouped_or_dense():
    """A conv kept in float (an override here; the speed rule the same way) runs as the float model runs it: conv,
    then its BN module.  Folding the BN into a depthwise conv's weights made whole EfficientNets 2-3.5% slower on an
    H200 (cuDNN's depthwise fp16 conv with a bias is slower than conv + BN at most shapes: docs/decisions/0155)."""
    x = torch.randn(2, 3, 8, 8)
    net = _net()
    net[4] = nn.Conv2d(8, 16, 3, padding=1, groups=8)  # grouped, followed by BN "5"
    net = _calibrated(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tp.quantize_model(copy.deepcopy(net), tp.QuantConfig("int8", overrides={"4": "float", "0": "float"}),
                              calibration=x)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    calls = {n.target for n in q.graph.nodes if n.op == "call_module"}
    for conv, bn in (("4", "5"), ("0", "1")):
        assert rec[conv].precision == "float" and rec[conv].fused == () and bn in calls
        assert torch.equal(dict(q.named_modules())[conv].weight, dict(net.named_modules())[conv].weight)
    with torch.no_grad():
        assert _nrmse(q(x), net(x)) < 0.1  # the model still runs end to end


def test_quantize_model_does_not_touch_the_original():
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_net(), x)
    before = [type(m) for m in net.modules()]
    tp.quantize_model(net, "w1a2", calibration=x)
    assert [type(m) for m in net.modules()] == before


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent control flow: torch.fx cannot trace this
            x = x * 0
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def test_untraceable_model_falls_back_to_module_swap_and_says_so():
    x = torch.randn(2, 3, 6, 6)
    with pytest.warns(UserWarning, match="torch.fx could not trace"):
        q = tp.quantize_model(_Untraceable(), tp.QuantConfig("w2a2", first_last=None), calibration=x)
    assert not q.tcprec_summary.traced
    assert isinstance(q.conv, QConv2d) and isinstance(q.fc, QLinear)
    with torch.no_grad():
        assert q(x).shape == (2, 5)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(), ValueError, "needs calibration data"),
    (dict(calibration="x"), TypeError, "calibration must be"),
    (dict(calibration=torch.zeros(1, 3, 8, 8), config="w9a9"), ValueError, "unknown layer precision"),
    (dict(calibration=torch.zeros(1, 3, 8, 8), config=tp.QuantConfig(overrides={"nope": "w2a2"})), ValueError,
     "overrides name no module"),
])
def test_quantize_model_bad_input(kwargs, err, match):
    args = dict(config="w2a2")
    args.update(kwargs)
    with pytest.raises(err, match=match):
        tp.quantize_model(_net(), args.pop("config"), **args)


# -- residual blocks -------------------------------------------------------------------------------------


class _FunctionalBlock(nn.Module):
    """relu(torch.add(x, branch(x))): the identity first, a functional ReLU (the other spelling of a block)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(torch.add(x, self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))))


class _ToyResNet(nn.Module):
    """A stem, an identity block, a stride-2 block with a 1x1 shortcut conv, an identity block written
    functionally: every way a block's output is read (residual, conv1, shortcut conv)."""

    def __init__(self):
        super().__init__()
        from tcprec.nn.models._blocks import conv_bn_act
        from tcprec.nn.models.resnet import BasicBlock

        self.stem = nn.Sequential(*conv_bn_act(3, 16, 3))
        self.stages = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), _FunctionalBlock(32))
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.stages(self.stem(x)), 1))


def _adds_and_relus(gm):
    return [n for n in gm.graph.nodes if n.target in (operator.add, torch.add, F.relu)
            or (n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.ReLU))]


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("reference", torch.float16),
                                            ("int8", torch.float16), ("int8", torch.float32)])
def test_residual_fusion_is_bit_identical(backend, dtype):
    """quantize_model fuses relu(conv_bn(x) + residual) into the conv (the graph keeps no add / ReLU), and the
    output equals the unfused network's bit for bit; with backend 'int8' (the Triton kernel, interpreter)
    block outputs are written once as the next convs' int8 codes, with the float when a residual reads it."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_ToyResNet(), x).to(dtype=dtype, memory_format=torch.channels_last)
    x = x.to(dtype)
    cfg = tp.QuantConfig("int8", backend=backend)
    qf = tp.quantize_model(net, cfg, calibration=x)
    qu = tp.quantize_model(net, dataclasses.replace(cfg, fuse_residual=False), calibration=x)
    with torch.no_grad():
        yf, yu, ref = qf(x), qu(x), net.float()(x.float())
    assert yf.dtype == dtype and torch.equal(yf, yu)
    assert _nrmse(yf.float(), ref) < 0.1
    fused = {r.name: r.fused for r in qf.tcprec_summary.layers}
    blocks_end = ["stages.0.branch.3", "stages.1.branch.3", "stages.2.conv2"]
    assert [fused[n] for n in blocks_end] == [("bn", "residual", "relu")] * 3
    assert "residual" not in "".join("".join(r.fused) for r in qu.tcprec_summary.layers)
    # unfused: the 3 adds and 2 ReLUs stay; stage 0's ReLU, read only by stage 1's conv and shortcut (unsigned inputs
    # whose codes saturate at 0), is left to their quantizers (the same codes: yf == yu above)
    assert _adds_and_relus(qf) == [] and len(_adds_and_relus(qu)) == 5
    assert any(n.startswith("stages.0.relu: clamp(0,inf) read only by") for n in qu.tcprec_summary.notes)
    mods = dict(qf.named_modules())
    assert all(mods[n].has_residual and "residual" in mods[n].tcprec_trace()[2] for n in blocks_end)
    out = {r.name: r.out for r in qf.tcprec_summary.layers}
    if backend == "int8":  # the stem and the block outputs: one pass for every reader
        dt = str(dtype).removeprefix("torch.")
        assert out["stem.0"] == f"{dt} + int8 codes uint8 -> stages.0.branch.0"
        assert out["stages.0.branch.3"] == "int8 codes uint8 -> stages.1.branch.0, stages.1.shortcut.0"
        assert out["stages.1.branch.3"] == f"{dt} + int8 codes uint8 -> stages.2.conv1"
        assert out["stages.2.conv2"] == dt  # read by flatten: float only
        assert mods["stem.0"].out_layout == "int8+float" and mods["stages.0.branch.3"].out_layout == "int8"
    else:  # reference layers exchange float tensors
        assert all(m.out_fmt is None for m in mods.values() if isinstance(m, QConv2d))


def test_bitserial_resnet_block_outputs_are_float_and_planes(monkeypatch):
    """On the bit-serial kernel a block's output (its last conv fused with the add) is written once as the float
    and its planes ("planes+float", a BitPlanes QTensor with hp) for every reader: the next block's conv1, its 1x1
    shortcut conv and its residual add; so is the first conv's (int8); the last block's (read by flatten) is not."""
    _as_on_h100(monkeypatch)
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_ToyResNet(), x).half().to(memory_format=torch.channels_last)
    q = tp.quantize_model(net, tp.QuantConfig("w1a2", first_last="int8"), calibration=x.half(), warn=False)
    mods = dict(q.named_modules())
    out = {r.name: r.out for r in q.tcprec_summary.layers}
    assert mods["stages.0.branch.3"].out_layout == "planes+float"
    assert out["stages.0.branch.3"] == "float16 + packed uint2 -> stages.1.branch.0, stages.1.shortcut.0"
    assert out["stages.1.branch.3"] == "float16 + packed uint2 -> stages.2.conv1"
    assert mods["stages.0.branch.0"].out_layout == "compact" and mods["stages.2.conv2"].out_fmt is None
    # the int8 stem, read by the first block's conv and its add: the float and its planes too
    assert mods["stem.0"].out_layout == "planes+float" and out["stem.0"].startswith("float16 + packed uint2 -> ")
    assert mods["stages.1.branch.3"].tcprec_trace()[-1] == "fp16 + uint2 planes"


def _int8_kernel_layers(monkeypatch):
    """Chaining decisions as on a GPU: quantize_model sees the integer layers on the INT8 kernel (on the CPU they
    run the reference backend, which takes and writes the same operands: ShiftedInt8 and float8 QTensors)."""
    _as_on_h100(monkeypatch)


@pytest.mark.parametrize("first_last", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_resnet_chains_codes_and_float(monkeypatch, dtype, first_last):
    """FP8 blocks: a block output read by the next conv1 (and the 1x1 shortcut) and by the next residual add is
    written once as the float and its e4m3 codes (out_layout "fp8+float", a float8 QTensor with hp), codes only at a
    stage's entry; with the int8 stem (first_last) the stem writes the float and the first FP8 layer's codes.
    Bit-identical to the network with unfused residual adds (whose block outputs are float tensors that the next
    layers quantize), and in float32 to the unchained network (in float16 a chained non-residual link quantizes the
    float32 result, not its float16 rounding: the chaining rule of every kind)."""
    _int8_kernel_layers(monkeypatch)
    torch.manual_seed(5)
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_ToyResNet(), x).to(dtype=dtype, memory_format=torch.channels_last)
    x = x.to(dtype)
    cfg = tp.QuantConfig("fp8", first_last=first_last)
    qc_, qr, qu = (tp.quantize_model(net, dataclasses.replace(cfg, **kw), calibration=x, warn=False)
                   for kw in ({}, {"fuse_residual": False}, {"chain": False}))
    with torch.no_grad():
        yc, yr, yu = qc_(x), qr(x), qu(x)
    assert yc.dtype == dtype and torch.equal(yc, yr)
    assert torch.equal(yc, yu) or dtype != torch.float32
    assert all(getattr(m, "out_layout", "") != "fp8+float" for m in qr.modules())  # no block output to fuse
    assert _nrmse(yc.float(), net.float()(x.float())) < 0.1
    out = {r.name: r.out for r in qc_.tcprec_summary.layers}
    dt = str(dtype).removeprefix("torch.")
    assert out["stem.0"] == f"{dt} + codes float8_e4m3fn -> stages.0.branch.0"
    assert out["stages.0.branch.3"] == "codes float8_e4m3fn -> stages.1.branch.0, stages.1.shortcut.0"
    assert out["stages.1.branch.3"] == f"{dt} + codes float8_e4m3fn -> stages.2.conv1"
    assert out["stages.0.branch.0"] == "codes float8_e4m3fn -> stages.0.branch.3"
    assert out["stages.2.conv2"] == dt  # read by flatten
    mods = dict(qc_.named_modules())
    assert mods["stages.1.branch.3"].out_layout == "fp8+float"
    assert mods["stages.1.branch.3"].tcprec_trace()[-1] == f"{_short(dtype)} + float8_e4m3fn codes"
    assert all(m.out_fmt is None for m in dict(qu.named_modules()).values() if isinstance(m, QConv2d))


def _short(dt):
    return {torch.float32: "fp32", torch.float16: "fp16"}[dt]


class _TinyYolo(nn.Module):
    """YOLOv2-tiny's shape: an int8 stem with a 2x2 pool, FP8 convs (pools, the stride-1 'same' pool), an int8 1x1
    head conv (the last layer under first_last)."""

    def __init__(self):
        super().__init__()
        from tcprec.nn.models._blocks import conv_bn_act
        from tcprec.nn.models.yolo import MaxPoolSame

        self.features = nn.Sequential(
            *conv_bn_act(3, 8, 3, act="leaky", pool=nn.MaxPool2d(2, 2)),
            *conv_bn_act(8, 16, 3, act="leaky", pool=MaxPoolSame()),
            *conv_bn_act(16, 16, 3, act="leaky"),
            nn.Conv2d(16, 10, 1, bias=True))

    def forward(self, x):
        return self.features(x)


def test_fp8_cross_kind_chain_yolo_like(monkeypatch):
    """The int8 stem (+ pool) hands the first FP8 layer its e4m3 codes; the last FP8 layer hands the int8 head its
    int8 codes; bit-identical to the unchained network; the summary says so."""
    _int8_kernel_layers(monkeypatch)
    torch.manual_seed(6)
    x = torch.randn(2, 3, 12, 12)
    net = _calibrated(_TinyYolo(), x)
    qc_, qu = (tp.quantize_model(net, tp.QuantConfig("fp8", chain=c), calibration=x, warn=False) for c in (True, False))
    with torch.no_grad():
        yc, yu = qc_(x), qu(x)
    assert torch.equal(yc, yu) and _nrmse(yc, net(x)) < 0.1
    rec = {r.name: r for r in qc_.tcprec_summary.layers}
    assert [rec[n].precision for n in ("features.0", "features.4", "features.8", "features.11")] == \
        ["w8a8", "fp8", "fp8", "w8a8"]
    assert rec["features.0"].out == "codes float8_e4m3fn -> features.4"
    assert rec["features.4"].out == "codes float8_e4m3fn -> features.8"
    assert rec["features.8"].out.startswith("int8 codes ") and rec["features.8"].out.endswith(" -> features.11")
    mods = dict(qc_.named_modules())
    assert mods["features.8"].out_layout == "int8" and mods["features.0"].tcprec_trace()[-1] == "float8_e4m3fn codes"


def test_no_cross_kind_chain_from_a_binary_layer(monkeypatch):
    """A bit-serial layer cannot write float8 codes (its epilogue packs integer planes): it hands an FP8 layer
    the float."""
    _as_on_h100(monkeypatch)
    x = torch.randn(2, 3, 12, 12)
    q = tp.quantize_model(_calibrated(_TinyYolo(), x), tp.QuantConfig("fp8", first_last="w2a2"), calibration=x,
                          warn=False)
    rec = {r.name: r.out for r in q.tcprec_summary.layers}
    assert rec["features.0"] == "float32" and rec["features.8"] == "float32"


def test_bitserial_chain_hands_gathering_convs_compact_planes(monkeypatch):
    """A bit-serial consumer that gathers windows (3x3) gets compact planes (out_layout "compact": no padding words
    to store), a 1x1 stride-1 one the padded rows its GEMM reads as they are."""
    _as_on_h100(monkeypatch)
    x = torch.randn(4, 3, 8, 8)
    q = tp.quantize_model(_calibrated(_net(), x), "w2a2", calibration=x, warn=False)
    mods = dict(q.named_modules())
    assert mods["0"].out_layout == "compact"  # -> layer 4, a 3x3 conv
    assert mods["4"].out_layout == "planes"  # -> layer 7, a 1x1 stride-1 conv
    rec = {r.name: r.out for r in q.tcprec_summary.layers}
    assert rec["0"].startswith("packed ") and rec["4"].startswith("packed ")


def _no_flatten_fusion(monkeypatch, cfg, net, x):
    from tcprec.nn import convert

    with monkeypatch.context() as mp:
        mp.setattr(convert, "_fuse_flatten", lambda gm, records: None)
        return tp.quantize_model(net, cfg, calibration=x, warn=False)


@pytest.mark.parametrize("precision", ["w2a2", "int8", "fp8"])
def test_flatten_into_a_linear_is_a_view(monkeypatch, precision):
    """conv -> torch.flatten(y, 1) -> linear: the linear's weight columns are reordered to (h, w, c) once and the
    flatten becomes flatten_nhwc, a view of the conv's channels_last output (no NCHW copy); the same codes meet
    the same weights, so the output equals the unfused network's (integer layers bit for bit)."""
    from tcprec.nn.qmodules import flatten_nhwc

    torch.manual_seed(7)
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_ToyResNet(), x).to(memory_format=torch.channels_last)
    cfg = tp.QuantConfig(precision, first_last=None)
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    q0 = _no_flatten_fusion(monkeypatch, cfg, net, x)
    fns = [n.target for n in q.graph.nodes if n.op == "call_function"]
    assert flatten_nhwc in fns and torch.flatten not in fns
    assert torch.flatten in [n.target for n in q0.graph.nodes if n.op == "call_function"]
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["fc"].fused == ("flatten",) and dict(q.named_modules())["fc"].in_channels_last == 32
    with torch.no_grad():
        y, y0 = q(x), q0(x)
    if precision == "fp8":  # float accumulation in another order
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5 * float(y0.abs().max()))
    else:
        assert torch.equal(y, y0)
    h = torch.randn(2, 32, 4, 4).to(memory_format=torch.channels_last)
    v = flatten_nhwc(h)
    assert v.data_ptr() == h.data_ptr() and torch.equal(v, h.permute(0, 2, 3, 1).reshape(2, -1))


class _ConvFc(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc1, self.fc2 = nn.Linear(c * 4 * 4, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))))


@pytest.mark.parametrize("net_kind, dtype", [("resnet", torch.float16), ("resnet", torch.float32),
                                             ("convfc", torch.float32), ("convfc16", torch.float32)])
def test_bitserial_conv_hands_a_flattened_linear_its_planes(monkeypatch, net_kind, dtype):
    """A bit-serial linear after flatten_nhwc gets the conv's planes (compact rows, flattened as a view): a ResNet's
    last block writes "planes+float" (float16; the float32 dual has no kernel: the float only), a plain conv
    "compact"; the output equals the unchained network's bit for bit.  Rows that are not whole words (16 channels)
    stay float."""
    _as_on_h100(monkeypatch)
    torch.manual_seed(8)
    x = torch.randn(2, 3, 4 if net_kind != "resnet" else 8, 4 if net_kind != "resnet" else 8)
    net = {"resnet": _ToyResNet, "convfc": _ConvFc, "convfc16": lambda: _ConvFc(16)}[net_kind]()
    net = _calibrated(net, x).to(dtype=dtype, memory_format=torch.channels_last)
    x = x.to(dtype)
    cfg = tp.QuantConfig("w1a2", first_last=None)
    q, qn = (tp.quantize_model(net, dataclasses.replace(cfg, chain=c), calibration=x, warn=False) for c in (True, False))
    conv = "stages.2.conv2" if net_kind == "resnet" else "conv"
    m = dict(q.named_modules())[conv]
    out = {r.name: r.out for r in q.tcprec_summary.layers}
    dt = str(dtype).removeprefix("torch.")
    if net_kind == "resnet" and dtype == torch.float16:
        assert m.out_layout == "planes+float" and out[conv] == f"{dt} + packed uint2 -> fc (flatten_nhwc)"
    elif net_kind == "convfc":
        assert m.out_layout == "compact" and out[conv] == "packed uint2 -> fc1 (flatten_nhwc)"
    else:
        assert m.out_fmt is None and out[conv] == dt
    with torch.no_grad():
        y, yn = q(x), qn(x)
    assert torch.equal(y, yn)


def test_flatten_nhwc_bad_input():
    from tcprec.nn.qmodules import flatten_nhwc
    from tcprec.ops.qconv import pack_activation

    with pytest.raises(ValueError, match="NCHW tensor"):
        flatten_nhwc(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="C % 32 == 0"):
        flatten_nhwc(pack_activation(torch.rand(1, 4, 4, 16), "uint2", 0.5))
    lin = QLinear.from_float(nn.Linear(64, 4), "w2a2", in_absmax=1.0, signed_input=False)
    with pytest.raises(ValueError, match="divisor of in_features=64"):
        lin.nhwc_input(6)
    lin.nhwc_input(16)
    with pytest.raises(ValueError, match="already applied"):
        lin.nhwc_input(16)
    with pytest.raises(ValueError, match=r"planes of shape \(B, 1, 1, 64\)"):
        lin(pack_activation(torch.rand(1, 1, 1, 32), "uint2", 0.5))


def test_residual_fusion_leaves_other_adds_alone():
    """An add whose operands differ in shape (broadcast), a conv with an activation before the add, or a conv
    read twice keep the float add; the fused conv refuses a call without its residual."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.c = nn.Conv2d(4, 4, 1)
            self.bias = nn.Parameter(torch.randn(1, 4, 1, 1))

        def forward(self, x):
            y = torch.relu(self.a(x) + self.bias)  # broadcast: not a residual
            z = torch.relu(torch.relu(self.b(y)) + y)  # the conv has its own activation first
            c = self.c(z)
            return torch.relu(c + z) + c  # c is read twice

    x = torch.randn(2, 4, 6, 6)
    net = Odd().eval()
    q = tp.quantize_model(net, tp.QuantConfig("int8", backend="reference"), calibration=x)
    assert all("residual" not in r.fused for r in q.tcprec_summary.layers)
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x), rtol=0.05, atol=0.05)
    m = QConv2d.from_float(nn.Conv2d(4, 4, 3, padding=1), "int8", in_absmax=1.0, signed_input=True)
    m.has_residual = True
    with pytest.raises(ValueError, match=r"was fused with a residual add \(has_residual=True\): call it as "
                                         r"m\(x, residual\)"):
        m(x)
    with pytest.raises(ValueError, match=r"residual must have the output's NCHW shape \(2, 4, 6, 6\), got "
                                         r"\(2, 6, 6, 4\)"):
        m(x, x.permute(0, 2, 3, 1))


# -- model zoo ------------------------------------------------------------------------------------------


def test_models_build_and_run():
    assert sorted(zoo.MODELS) == ["alexnet", "resnet18", "vgg", "yolov2-tiny"]
    y = zoo.build("yolov2-tiny")(torch.randn(1, 3, 64, 64))
    assert y.shape == (1, 125, 2, 2)
    r = zoo.build("resnet18")
    with torch.no_grad():
        assert r(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    with pytest.raises(ValueError, match="unknown model"):
        zoo.build("lenet")


def test_yolo_quantized_fuses_the_stride1_pool():
    m = zoo.build("yolov2-tiny")
    x = torch.randn(1, 3, 64, 64)
    q = tp.quantize_model(m, "int8", calibration=x)
    fused = {r.name: r.fused for r in q.tcprec_summary.layers}
    assert fused["features.20"] == ("bn", "leaky(0.1)", "maxpool")  # the 2x2 stride-1 'same' pool
    with torch.no_grad():
        assert _nrmse(q(x), m(x)) < 0.1


# -- engine ---------------------------------------------------------------------------------------------


def test_engine_eager_on_cpu_and_input_checks():
    x = torch.randn(2, 3, 8, 8)
    net = _calibrated(_net(), x)
    with pytest.warns(UserWarning, match="runs the model eagerly"):
        eng = tp.compile(net, x, device="cpu")
    assert eng.mode == "eager" and eng.copies_per_call == 2
    torch.testing.assert_close(eng(x), net(x))
    with pytest.raises(ValueError, match=r"compiled for \(2, 3, 8, 8\)"):
        eng(torch.randn(3, 3, 8, 8))
    with pytest.raises(ValueError, match="float tensor"):
        eng(torch.zeros(2, 3, 8, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        eng([1, 2])


# -- CLI ------------------------------------------------------------------------------------------------


def test_cli_bench_net_needs_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run the benchmark")
    from tcprec.cli import app

    res = CliRunner().invoke(app, ["bench", "net", "--model", "resnet18", "--batch", "8"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


@pytest.mark.parametrize("args, match", [
    (["bench", "net", "--model", "lenet"], "not one of"),
    (["bench", "net", "--precision", "w9a9"], "unknown precision 'w9a9'; accepted"),
    (["run", "--precision", "int9"], "unknown precision 'int9'; accepted"),
    (["run", "--image", "/no/such/photo.jpg"], "neither a file"),
])
def test_cli_bad_options(args, match):
    from tcprec.cli import app

    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and match in res.output


def test_cli_run_on_cpu(tmp_path):
    from tcprec.cli import app
    import numpy as np

    out = tmp_path / "y.npy"
    res = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["run", "--model", "yolov2-tiny", "--precision", "int8", "--image", "chelsea",
                                   "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    y = np.load(out)
    assert y.shape == (1, 125, 13, 13)
    assert "NRMSE against fp32" in res.output and "features.0" in res.output


class _Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 -> 3x3 -> 1x1, the last fused with the identity add."""

    def __init__(self, c: int, mid: int):
        super().__init__()
        from tcprec.nn.models._blocks import conv_bn_act

        self.conv1 = nn.Sequential(*conv_bn_act(c, mid, 1))
        self.conv2 = nn.Sequential(*conv_bn_act(mid, mid, 3))
        self.conv3 = nn.Sequential(*conv_bn_act(mid, c, 1, act="none"))

    def forward(self, x):
        return torch.relu(self.conv3(self.conv2(self.conv1(x))) + x)


class _ToyBottleneckNet(nn.Module):
    def __init__(self, c: int = 64):
        super().__init__()
        from tcprec.nn.models._blocks import conv_bn_act

        self.stem = nn.Sequential(*conv_bn_act(3, c, 3))
        self.stages = nn.Sequential(_Bottleneck(c, 16), _Bottleneck(c, 16), _Bottleneck(c, 16))
        self.fc = nn.Linear(c * 2 * 2, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.stages(self.stem(x)), 1))


def test_bitserial_bottleneck_output_feeds_the_next_1x1_conv_its_planes(monkeypatch):
    """A bit-serial block's output (conv3 fused with the add) is written as the float and its compact planes
    ("planes+float") also where the next reader is a 1x1 conv (a bottleneck's conv1, whose GEMM pads the rows): no
    quantize pass over the float in front of it.  The chained network equals the unfused one bit for bit."""
    _as_on_h100(monkeypatch)
    torch.manual_seed(5)
    x = torch.randn(2, 3, 2, 2)
    net = _calibrated(_ToyBottleneckNet(), x).half().to(memory_format=torch.channels_last)
    cfg = tp.QuantConfig("w1a2", first_last="int8")
    q = tp.quantize_model(net, cfg, calibration=x.half(), warn=False)
    mods = dict(q.named_modules())
    out = {r.name: r.out for r in q.tcprec_summary.layers}
    assert {r.name: r.backend for r in q.tcprec_summary.layers}["stages.1.conv1.0"] == "bitserial"
    for i in (0, 1):
        assert mods[f"stages.{i}.conv3.0"].out_layout == "planes+float"
        assert out[f"stages.{i}.conv3.0"] == f"float16 + packed uint2 -> stages.{i + 1}.conv1.0"
    qu = tp.quantize_model(net, dataclasses.replace(cfg, fuse_residual=False), calibration=x.half(), warn=False)
    assert all(m.out_layout != "planes+float" for m in qu.modules() if isinstance(m, QConv2d))
    with torch.no_grad():
        assert torch.equal(q(x.half()), qu(x.half()))
