"""quantize_model's memory on the CPU (docs/decisions/0158): the conversion copies only the float tensors that survive
into the result (not the whole float model up front), the result shares no memory with the caller's model, a forward
on the float64 reference keeps no packed weight, and the reference convolutions decode their weight a chunk of output
channels at a time with the same results."""

import copy

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.formats import as_format
from tcprec.kernels import reference_conv_int8_fp8 as rf
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.reference_conv_bitserial import conv2d_int


class _Net(nn.Module):
    """conv -> BN -> ReLU twice, then two linears, with a LayerNorm that stays float: most bytes in the quantized
    layers' weights (~1.1 MB of fp32), a few in what survives as float."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.norm = nn.LayerNorm(64 * 8 * 8)
        self.fc1 = nn.Linear(64 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(torch.flatten(self.features(x), 1)))))


def _calibrated_net() -> nn.Module:
    torch.manual_seed(0)
    net = _Net()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _storages(m: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()] if t.numel()}


def _float_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict().values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


@pytest.mark.parametrize("precision", ["w1a2", "int8", "fp8"])
def test_conversion_copies_only_the_float_survivors(precision, monkeypatch):
    """The tensors deep-copied during quantize_model are at most the result's float state (the LayerNorm, biases and
    scales), not the float model: a deepcopy up front held every weight twice during the conversion.  The result
    owns its memory (no storage shared with the caller's model), and the caller's model is unchanged."""
    net = _calibrated_net()
    before = copy.deepcopy(net.state_dict())
    x = torch.randn(2, 3, 8, 8)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    copied = []
    for cls in (torch.Tensor, nn.Parameter):
        orig = cls.__deepcopy__

        def counting(self, memo, orig=orig):
            if id(self) not in memo:
                copied.append(self.numel() * self.element_size())
            return orig(self, memo)

        monkeypatch.setattr(cls, "__deepcopy__", counting)
    q = tp.quantize_model(net, tp.QuantConfig(precision, first_last=None), calibration=x, warn=False)
    monkeypatch.undo()
    assert [r.precision for r in q.tcprec_summary.layers].count("float") == 0
    assert sum(copied) <= _float_bytes(q) and sum(copied) < 0.1 * weights, (sum(copied), _float_bytes(q), weights)
    assert not (_storages(q) & _storages(net))  # the result's tensors are its own
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    y = q(x)
    with torch.no_grad():  # the caller's model changed in place: the result does not see it
        for p in net.parameters():
            p.zero_()
    assert torch.equal(q(x), y)


def test_conversion_keeps_tied_float_weights_tied():
    """A float parameter registered in two modules stays one tensor in the result (the copy at the end goes through
    one deepcopy memo), as a deepcopy of the whole model keeps it."""
    torch.manual_seed(0)
    emb = nn.Linear(16, 16)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), emb, nn.ReLU(), nn.Linear(16, 16))
    net[4].weight = emb.weight  # tied
    q = tp.quantize_model(net, tp.QuantConfig("int8", overrides={"2": "float", "4": "float"}),
                          calibration=torch.randn(4, 16), warn=False)
    assert q.get_submodule("2").weight is q.get_submodule("4").weight
    assert q.get_submodule("2").weight is not emb.weight
    assert torch.equal(q.get_submodule("2").weight, emb.weight)


@pytest.mark.parametrize("precision", ["w1a2", "int8", "fp8"])
def test_cpu_forward_keeps_no_packed_weight(precision):
    """On the float64 reference the layers hand the op their codes: no packed planes / int8 / float8 views are built
    and kept (for int8 weights two more copies of every weight)."""
    net = _calibrated_net()
    x = torch.randn(2, 3, 8, 8)
    q = tp.quantize_model(net, tp.QuantConfig(precision, first_last=None), calibration=x, warn=False)
    q(x)
    layers = [m for m in q.modules() if hasattr(m, "weight_codes")]
    assert layers and not any("_packed" in m.__dict__ for m in layers)


@pytest.mark.parametrize("fmts", [("uint2", "binary"), ("int8", "int8"), ("uint4", "int4")])
def test_reference_conv_chunks_give_the_same_result(fmts, monkeypatch):
    """conv2d_int and conv_acc decode the weight a chunk of output channels at a time: the same integers (and fp8
    sums) as one pass over the whole layer."""
    torch.manual_seed(0)
    a_fmt, w_fmt = as_format(fmts[0]), as_format(fmts[1])
    x = torch.randint(0, a_fmt.n_codes, (2, 7, 7, 19), dtype=torch.uint8)
    w = torch.randint(0, w_fmt.n_codes, (37, 3, 3, 19), dtype=torch.uint8)
    g = ConvGeometry(2, 7, 7, 19, 37, 3, 3, (2, 1), (1, 1), (1, 1))
    whole = conv2d_int(x, a_fmt, w, w_fmt, g)
    xf = torch.randn(2, 7, 7, 19).to(torch.float8_e4m3fn)
    wf = torch.randn(37, 3, 3, 19).to(torch.float8_e4m3fn)
    whole_f = rf.conv_acc(xf, wf, (2, 1), 1)
    monkeypatch.setattr(rf, "_DECODE_ELEMENTS", 3 * 3 * 19 * 5)  # 5 channels a chunk: 8 chunks, the last of 2
    assert len(rf.channel_chunks(w)) == 8
    assert torch.equal(conv2d_int(x, a_fmt, w, w_fmt, g), whole)
    assert torch.equal(rf.conv_acc(xf, wf, (2, 1), 1), whole_f)
