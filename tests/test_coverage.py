"""Coverage: every conv / linear computation is quantized or listed with its reason (nn/coverage.py), on small
models, one per rule: Conv2d subclasses with their own forward (EfficientNet's static "same" padding), F.conv2d /
F.linear calls, zero-padding modules, Conv1d, attention projections, leaf layers, no conv quantized."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp


class SameConv(nn.Conv2d):
    """EfficientNet-PyTorch's Conv2dStaticSamePadding: a ZeroPad2d child, then its own F.conv2d."""

    def __init__(self, cin, cout, k, stride=1, image_size=8, **kw):
        super().__init__(cin, cout, k, stride, **kw)
        oh = math.ceil(image_size / stride)
        pad = max((oh - 1) * stride + k - image_size, 0)
        self.static_padding = nn.ZeroPad2d((pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))

    def forward(self, x):
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


class Net(nn.Module):
    def __init__(self, conv=SameConv):
        super().__init__()
        self.stem = conv(3, 8, 3, stride=2)                    # pad (0, 1, 0, 1): asymmetric
        self.bn = nn.BatchNorm2d(8)
        self.dw = conv(8, 8, 3, stride=1, groups=8, image_size=4)  # pad (1, 1, 1, 1): symmetric
        self.dw2 = conv(8, 8, 3, stride=2, groups=8, image_size=4)  # pad (0, 1, 0, 1) on a depthwise
        self.pw = conv(8, 16, 1, image_size=2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu6(self.bn(self.stem(x)))
        x = self.pw(F.relu6(self.dw2(F.relu6(self.dw(x)))))
        return self.fc(x.mean((2, 3)))


def _plain_twin(net: Net) -> nn.Module:
    """The same network written by hand with ZeroPad2d + nn.Conv2d (what the coverage pass should amount to)."""
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem_pad, self.stem = nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(3, 8, 3, 2)
            self.bn = net.bn
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
            self.dw2_pad, self.dw2 = nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(8, 8, 3, 2, groups=8)
            self.pw, self.fc = nn.Conv2d(8, 16, 1), net.fc
            for a, b in ((self.stem, net.stem), (self.dw, net.dw), (self.dw2, net.dw2), (self.pw, net.pw)):
                a.load_state_dict(b.state_dict())

        def forward(self, x):
            x = F.relu6(self.bn(self.stem(self.stem_pad(x))))
            x = self.pw(F.relu6(self.dw2(self.dw2_pad(F.relu6(self.dw(x))))))
            return self.fc(x.mean((2, 3)))
    return Plain().eval()


def _net():
    torch.manual_seed(0)
    net = Net().eval()
    net.bn.running_mean.uniform_(-0.1, 0.1)
    net.bn.running_var.uniform_(0.5, 1.5)
    return net


def test_subclass_with_own_forward_is_quantized_and_pads_fold():
    net = _net()
    x = torch.randn(4, 3, 8, 8)
    q = tp.quantize_model(net, "int8", calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert {n: r.precision for n, r in rec.items()} == {n: "w8a8" for n in ("stem", "dw", "dw2", "pw", "fc")}
    assert "pad" in rec["dw"].fused and "pad" in rec["dw2"].fused  # symmetric folded; asymmetric -> 4-sided
    assert "pad" not in rec["stem"].fused  # a dense conv keeps an asymmetric pad as a float op, and says so
    assert any("asymmetric zero pad (0, 1, 0, 1)" in n for n in q.tcprec_summary.notes)
    assert q.dw2.pad4 == (0, 1, 0, 1)
    # the hand-written ZeroPad2d + nn.Conv2d twin quantizes to the same numbers
    qp = tp.quantize_model(_plain_twin(net), "int8", calibration=x, warn=False)
    with torch.no_grad():
        assert torch.equal(q(x), qp(x))
        assert ((q(x) - net(x)).norm() / net(x).norm()).item() < 0.1


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(6) * 0.1)
        self.lw = nn.Parameter(torch.randn(4, 6) * 0.3)
        self.v = nn.Parameter(torch.randn(6, 6, 1, 1) * 0.3)

    def forward(self, x):
        y = F.relu(F.conv2d(x, self.w, self.b, padding=1))
        y = F.conv2d(y, self.v / self.v.norm())  # a computed weight (weight standardisation): stays float, listed
        return F.linear(y.mean((2, 3)), self.lw)


def test_functional_calls_quantized_or_listed():
    torch.manual_seed(0)
    m = Functional().eval()
    x = torch.randn(2, 3, 5, 5)
    with pytest.warns(UserWarning, match="stay in floating point"):
        q = tp.quantize_model(m, "int8", calibration=x)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    quantized = [r for r in rec.values() if r.precision != "float"]
    assert len(quantized) == 2 and {r.kind for r in quantized} == {"conv", "linear"}
    floats = q.tcprec_summary.float_layers
    assert len(floats) == 1 and "computed weight" in floats[0].backend
    with torch.no_grad():
        assert ((q(x) - m(x)).norm() / m(x).norm()).item() < 0.1


class _Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv(input=x))
        return self.fc(input=y.mean((2, 3)))


def test_layers_called_with_their_input_as_a_keyword_are_quantized():
    """``conv(input=x)`` is the call ``conv(x)``: calibrated and quantized like it (it used to fail calibration with
    an IndexError)."""
    torch.manual_seed(0)
    m, x = _Keyword().eval(), torch.randn(2, 3, 6, 6)
    q = tp.quantize_model(m, "int8", calibration=x, warn=False)
    assert [(r.name, r.precision, r.fused) for r in q.tcprec_summary.layers] == [("conv", "w8a8", ("relu",)),
                                                                                ("fc", "w8a8", ())]
    with torch.no_grad():
        assert ((q(x) - m(x)).norm() / m(x).norm()).item() < 0.05


def test_zero_pad_module_folds_into_conv():
    torch.manual_seed(0)
    m = nn.Sequential(nn.ZeroPad2d(2), nn.Conv2d(3, 4, 5), nn.ReLU(), nn.ConstantPad2d(1, 0.0), nn.Conv2d(4, 4, 3)).eval()
    x = torch.randn(2, 3, 6, 6)
    q = tp.quantize_model(m, "int8", calibration=x, warn=False)
    assert [r.fused for r in q.tcprec_summary.layers] == [("pad", "relu"), ("pad",)]
    assert q.get_submodule("1").padding == (2, 2) and q.get_submodule("4").padding == (1, 1)
    with torch.no_grad():
        assert q(x).shape == m(x).shape
        assert ((q(x) - m(x)).norm() / m(x).norm()).item() < 0.05


def test_conv1d_runs_as_a_1xk_conv2d():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv1d(4, 8, 5, padding=2, stride=2), nn.ReLU(), nn.Conv1d(8, 8, 3, groups=8)).eval()
    x = torch.randn(3, 4, 20)
    q = tp.quantize_model(m, "int8", calibration=x, warn=False)
    assert [(r.name, r.precision) for r in q.tcprec_summary.layers] == [("0", "w8a8"), ("2", "w8a8")]
    with torch.no_grad():
        y, yq = m(x), q(x)
    assert yq.shape == y.shape and ((yq - y).norm() / y.norm()).item() < 0.05


def test_attention_and_leaf_layers_are_listed_with_reasons():
    """nn.MultiheadAttention and nn.TransformerEncoderLayer are decomposed and quantized (nn/attention.py,
    tests/test_transformer_quant.py), nn.TransformerDecoderLayer too; an attention with add_bias_kv stays float,
    listed with the reason."""
    torch.manual_seed(0)

    class Att(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True, add_bias_kv=True)
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.dec = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)

        def forward(self, x):
            x = self.inp(x)
            x = self.enc(self.mha(x, x, x, need_weights=False)[0])
            return self.dec(x, x)

    m = Att().eval()
    q = tp.quantize_model(m, "int8", calibration=torch.randn(2, 5, 8), warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["inp"].precision == "w8a8"
    assert "add_bias_kv" in rec["mha"].backend and "mha.out_proj" not in rec
    assert rec["enc.self_attn.q_proj"].precision == "w8a8" and rec["enc.linear1"].precision == "w8a8"
    assert "enc.self_attn" not in rec
    # the decoder layer is decomposed like the encoder's (self- and cross-attention projections quantized)
    assert all(rec[f"dec.{n}"].precision == "w8a8" for n in ("self_attn.q_proj", "multihead_attn.out_proj", "linear1"))
    assert "dec.self_attn" not in rec and "dec.multihead_attn" not in rec
    text = str(q.tcprec_summary)
    assert "mha" in text and "dec.linear2" in text


def test_no_conv_quantized_is_an_error_naming_them():
    m = nn.Sequential(nn.Conv3d(2, 4, 3), nn.ReLU(), nn.Conv3d(4, 4, 1)).eval()
    with pytest.raises(ValueError, match=r"none of the model's 2 convolution\(s\).*Conv3d has no quantized path"):
        tp.quantize_model(m, "int8", calibration=torch.randn(1, 2, 4, 4, 4))
    # kept float on purpose: fine
    q = tp.quantize_model(m, tp.QuantConfig("int8", overrides={"0": "float", "2": "float"}),
                          calibration=torch.randn(1, 2, 4, 4, 4), warn=False)
    assert len(q.tcprec_summary.float_layers) == 2


class AuxHead(nn.Module):
    """GoogLeNet / Inception-v3's shape: an auxiliary classifier that runs only in training, and a conv whose weight
    the parent reads itself (weight standardisation)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.aux = nn.Conv2d(8, 4, 1)
        self.std = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.conv(x))
        w = self.std.weight
        x = F.conv2d(x, (w - w.mean()) / (w.std() + 1e-5))
        out = self.fc(x.mean((2, 3)))
        if self.training:
            return out, self.aux(x).mean((2, 3))
        return out


def test_a_layer_the_eval_forward_never_runs_is_listed_as_such():
    torch.manual_seed(0)
    m = AuxHead().eval()
    with pytest.warns(UserWarning, match="stay in floating point"):
        q = tp.quantize_model(m, "int8", calibration=torch.randn(2, 3, 6, 6))
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["conv"].precision != "float" and rec["fc"].precision != "float"
    assert "not run by the model's forward in eval mode" in rec["aux"].backend  # dead in eval: said so
    assert "not run" not in rec["std"].backend and "float" == rec["std"].precision  # read by its parent: not dead


@torch.fx.wrap
def _window_attention(x, qkv_weight, proj_weight):
    """A function torch.fx keeps whole that computes with its caller's weights (torchvision's Swin:
    shifted_window_attention(x, self.qkv.weight, self.proj.weight, ...))."""
    q, k, v = F.linear(x, qkv_weight).chunk(3, -1)
    return F.linear(F.scaled_dot_product_attention(q, k, v), proj_weight)


class WindowBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.mlp = nn.Linear(8, 24, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(_window_attention(x, self.qkv.weight, self.proj.weight))


def test_weights_passed_to_a_function_fx_keeps_whole_name_it():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="stay in floating point"):
        q = tp.quantize_model(WindowBlock().eval(), "int8", calibration=torch.randn(2, 4, 8))
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["mlp"].precision != "float"
    for n in ("qkv", "proj"):
        assert rec[n].precision == "float" and "its weights go to _window_attention" in rec[n].backend
