"""quantize_model fuses ReLU6 / hardtanh, hardswish and SiLU into dense QConv2d layers (decision 0154) where the
layer's epilogue has them -- the INT8 / FP8 paths and the reference backend -- and leaves them float ops after a layer
that runs the bit-serial GEMM (on every device: a model converted on the CPU runs the same layers on the GPU).

A fused layer computes ``apply_act`` of the same layer without the activation: bit for bit on the reference backend
(the CPU's for every layer here), and on the INT8 / FP8 kernels under TRITON_INTERPRET=1 for clamp and hardswish (SiLU
within its exp's bound, tests/test_conv_fwd_act.py); torch's own activation of it within a few ulp.  Chained outputs,
residual adds (an activation after the add, not before it), a max-pool after a non-monotone activation, persistence,
the summary's names and a bad activation."""

import copy
import dataclasses
import io
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp
from _persist import assert_round_trips
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.reference_conv_int8_fp8 import apply_act
from tcprec.nn import convert
from tcprec.nn.qmodules import QConv2d
from tcprec.ops.qconv_plan import DeviceCaps, plan_conv2d
from tcprec.ops.quantize import absmax_qmax

# SiLU on the INT8 kernel under the interpreter: NumPy's exp against torch's (tests/test_conv_fwd_act.py SILU_RTOL)
SILU_RTOL = 6 * 2.0**-23
# torch's hardswish divides by 6 where the epilogue multiplies by float32(1/6) (within 2 ulp); torch's SiLU is
# x * sigmoid(x) where the epilogue divides by 1 + exp(-x) (a few ulp)
TORCH_RTOL = 8 * 2.0**-23


class _F(nn.Module):
    """A functional activation (fx records a call_function node)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# (activation module, the epilogue's encoding, the summary's name)
ACTS = [(nn.ReLU6(), ("clamp", 0.0, 6.0), "clamp(0,6)"),
        (nn.Hardswish(), "hardswish", "hardswish"),
        (nn.SiLU(), "silu", "silu"),
        (_F(F.silu), "silu", "silu"),
        (nn.Hardtanh(-1.0, 2.0), ("clamp", -1.0, 2.0), "clamp(-1,2)")]
ACT_IDS = ["ReLU6", "Hardswish", "SiLU", "F.silu", "Hardtanh(-1,2)"]
H100 = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)


class _Net(nn.Module):
    """conv -> BN -> act (-> 2x2 max-pool) -> 1x1 head conv; ``residual``: act(bn(conv(x)) + x)."""

    def __init__(self, act: nn.Module, pool: bool = False, residual: bool = False):
        super().__init__()
        c = 8 if residual else 3
        self.conv, self.bn, self.act = nn.Conv2d(c, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), act
        self.pool = nn.MaxPool2d(2, 2) if pool else nn.Identity()
        self.head = nn.Conv2d(8, 4, 1)
        self.residual = residual

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.head(self.pool(self.act(y + x if self.residual else y)))


def _net(act, seed=0, **kw):
    torch.manual_seed(seed)
    m = _Net(copy.deepcopy(act), **kw).eval()
    m.bn.running_mean.uniform_(-0.5, 0.5)
    m.bn.running_var.uniform_(0.5, 2.0)
    m.bn.weight.data.uniform_(0.5, 2.0)
    return m


def _x(c=3, seed=1):
    return torch.randn(2, c, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2


def _act_nodes(q):
    """The graph's activation nodes (``convert._act_of``): what stays a float op."""
    mods = dict(q.named_modules())
    return [n for n in q.graph.nodes if convert._act_of(n, mods) is not None]


def _float_out(layer: QConv2d, act="same") -> QConv2d:
    """The same quantized layer with a float output (not its chained codes), and ``act`` (None: the unfused path's
    conv)."""
    plain = copy.deepcopy(layer)
    plain.out_fmt, plain.out_scale, plain.out_layout = None, None, "planes"
    plain.act = layer.act if act == "same" else act
    return plain


@pytest.mark.parametrize("prec", ["int8", "fp8"])
@pytest.mark.parametrize("act,enc,name", ACTS, ids=ACT_IDS)
def test_dense_conv_absorbs_the_act(act, enc, name, prec):
    """The activation leaves the graph; the summary, the layer's trace and its extra state name it; the layer's output
    is apply_act of the layer without it, bit for bit (reference backend), torch's activation of it within a few ulp;
    the model stays near the float model."""
    m, x = _net(act), _x()
    q = tp.quantize_model(m, tp.QuantConfig(prec, first_last=None), calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}["conv"]
    assert rec.fused == ("bn", name) and f"fused bn+{name}" in q.tcprec_summary.explain("conv")
    assert _act_nodes(q) == []
    layer = q.conv
    assert layer.act == enc and layer.get_extra_state()["act"] == enc and name in layer.tcprec_trace()[2]
    with torch.no_grad():
        y, y0 = _float_out(layer)(x), _float_out(layer, None)(x)
        assert torch.equal(y, apply_act(y0, enc))
        torch.testing.assert_close(y, act(y0), rtol=TORCH_RTOL, atol=1e-30)
        assert torch.equal(q(x), q.head(y))  # the head reads the fused output as it is
        ref = m(x)
        assert ((q(x) - ref).norm() / ref.norm()).item() < (0.02 if prec == "int8" else 0.1)
        absmax = float(m.act(m.bn(m.conv(x))).abs().max())
    # the head's input sign and range were calibrated on the activation's output
    assert q.head.a_fmt == tp.format("e4m3" if prec == "fp8" else "uint8" if name == "clamp(0,6)" else "int8")
    assert torch.equal(q.head.in_scale, torch.tensor([absmax / absmax_qmax(q.head.a_fmt)]))


@pytest.mark.parametrize("pool", [False, True], ids=["", "maxpool"])
@pytest.mark.parametrize("act,enc,name", ACTS[:3], ids=ACT_IDS[:3])
def test_int8_kernel_fused_act_and_chained_codes(act, enc, name, pool):
    """On the INT8 kernel (interpreter) the fused layer hands the head its int8 codes (with a 2x2 max-pool after
    hardswish / SiLU too: the pool runs on the float result, after the activation); the chained model equals the
    unchained one bit for bit; the unchained layer is apply_act of the layer without the activation (SiLU within its
    exp's bound)."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    m, x = _net(act, pool=pool), _x()
    cfg = tp.QuantConfig("int8", first_last=None, backend="int8")
    q = tp.quantize_model(m, cfg, calibration=x, warn=False)
    q0 = tp.quantize_model(m, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}["conv"]
    assert rec.fused == ("bn", name) + (("maxpool",) if pool else ()) and rec.out.startswith("int8 codes")
    assert q.conv.out_layout == "int8" and q0.conv.out_fmt is None
    with torch.no_grad():
        assert torch.equal(q(x), q0(x))
        if not pool:
            y, y0 = q0.conv(x), _float_out(q0.conv, None)(x)
            torch.testing.assert_close(y, apply_act(y0, enc), rtol=SILU_RTOL if enc == "silu" else 0, atol=0)


@pytest.mark.parametrize("act", [("clamp", -1.0, 2.0), "hardswish", "silu"], ids=["hardtanh", "hardswish", "silu"])
def test_fp8_kernel_layer_applies_the_act(act):
    """A QConv2d on the FP8 kernel (interpreter) with the activation is apply_act of the same layer without it, bit
    for bit for clamp and hardswish (the same float32 accumulator), SiLU within its exp's bound."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    torch.manual_seed(2)
    conv, x = nn.Conv2d(16, 8, 3, padding=1), _x(16)
    layer = QConv2d.from_float(conv, "fp8", in_absmax=float(x.abs().max()), signed_input=True, act=act,
                               backend="fp8")
    with torch.no_grad():
        y, y0 = layer(x), _float_out(layer, None)(x)
    torch.testing.assert_close(y, apply_act(y0, act), rtol=SILU_RTOL if act == "silu" else 0, atol=0)


def _assert_left_float(q, name: str):
    """The activation after the conv is a float op in the graph; ReLU6, read only by the head's unsigned quantizer
    (which saturates inside its bounds), is left to that quantizer (the same codes: convert._absorb_clamps)."""
    if name == "clamp(0,6)":
        assert _act_nodes(q) == [] and any(n.startswith("act: clamp(0,6) read only by head")
                                           for n in q.tcprec_summary.notes), q.tcprec_summary.notes
    else:
        assert len(_act_nodes(q)) == 1


@pytest.mark.parametrize("prec", ["w2a2", "w1a2"])
@pytest.mark.parametrize("act,enc,name", ACTS, ids=ACT_IDS)
def test_bitserial_layer_keeps_the_act_a_float_op(act, enc, name, prec, monkeypatch):
    """A layer that runs the bit-serial GEMM (p*q < 8) keeps the activation after it, on the CPU (where it runs the
    reference) as on an H100 (where it runs the binary GEMM, whose epilogue lacks it); the model computes the layer,
    then torch's activation.  On the INT8 backend the same layer takes it."""
    m, x = _net(act), _x()
    cfg = tp.QuantConfig(prec, first_last=None)
    for on_h100 in (False, True):
        with monkeypatch.context() as mp:
            if on_h100:
                mp.setattr(convert, "device_caps", lambda dev: H100)
            q = tp.quantize_model(m, cfg, calibration=x, warn=False)
        rec = {r.name: r for r in q.tcprec_summary.layers}["conv"]
        assert rec.fused == ("bn",) and q.conv.act is None
        assert rec.backend == ("bitserial" if on_h100 else "reference")
        _assert_left_float(q, name)
        with torch.no_grad():
            assert torch.equal(q(x), q.head(act(_float_out(q.conv)(x))))
    q = tp.quantize_model(m, dataclasses.replace(cfg, backend="int8"), calibration=x, warn=False)
    assert {r.name: r for r in q.tcprec_summary.layers}["conv"].fused == ("bn", name) and _act_nodes(q) == []


def test_qconv2d_refuses_a_bad_act_and_a_bitserial_one():
    """A bad activation: an error naming it and the allowed ones.  An extended one on a layer that runs the bit-serial
    GEMM: an error naming the backend, what it applies and the fix; backend='int8' / 'reference' take it."""
    conv = nn.Conv2d(8, 4, 3, padding=1)
    kw = dict(in_absmax=1.0, signed_input=False)
    for bad, match in (("gelu", r"got act='gelu'"), (("clamp", 2.0, 1.0), r"lo=2.0, hi=1.0"),
                       (("clamp", 0.0), r"got act=\('clamp', 0.0\)")):
        with pytest.raises(ValueError, match=match) as e:
            QConv2d.from_float(conv, "int8", act=bad, **kw)
        if bad == "gelu":
            assert "('clamp', lo, hi)" in str(e.value) and "'hardswish' or 'silu'" in str(e.value)
    with pytest.raises(ValueError, match=r"QConv2d w2a2: act='silu': backend 'bitserial' .*applies only None, 'relu' "
                                         r"and \('leaky', slope\).*backend='int8'"):
        QConv2d.from_float(conv, "w2a2", act="silu", **kw)
    for backend in ("int8", "reference"):
        assert QConv2d.from_float(conv, "w2a2", act="silu", backend=backend, **kw).act == "silu"
    assert QConv2d.from_float(conv, "w4a4", act="silu", **kw).act == "silu"  # p*q = 16: the INT8 kernel


@pytest.mark.parametrize("act,enc,name", [ACTS[0], ACTS[2]], ids=["ReLU6", "SiLU"])
def test_act_after_a_residual_add(act, enc, name, monkeypatch):
    """act(bn(conv(x)) + x): the add and the activation in the conv's epilogue, which is torch's activation of the sum
    (within a few ulp); the model equals the one with the add and the activation left float (bit for bit for the
    clamp).  On the bit-serial GEMM the add is fused and the activation stays after it."""
    m, x = _net(act, residual=True), _x(8)
    cfg = tp.QuantConfig("int8", first_last=None)
    qf = tp.quantize_model(m, cfg, calibration=x, warn=False)
    qu = tp.quantize_model(m, dataclasses.replace(cfg, fuse_residual=False), calibration=x, warn=False)
    assert {r.name: r for r in qf.tcprec_summary.layers}["conv"].fused == ("bn", "residual", name)
    assert qf.conv.has_residual and qf.conv.act == enc and _act_nodes(qf) == []
    with torch.no_grad():
        yf, yu = qf(x), qu(x)
        y, y0 = _float_out(qf.conv)(x, x), _float_out(qf.conv, None)(x, x)
    torch.testing.assert_close(y, act(y0), rtol=TORCH_RTOL, atol=1e-30)  # the layer: torch's act of the sum
    if enc == "silu":  # (a head's input code may differ by one where torch's SiLU and the epilogue's round apart)
        torch.testing.assert_close(yf, yu, rtol=0, atol=float(yu.abs().max()) * 1e-2)
    else:
        assert torch.equal(yf, yu)
    monkeypatch.setattr(convert, "device_caps", lambda dev: H100)
    qb = tp.quantize_model(m, dataclasses.replace(cfg, precision="w2a2"), calibration=x, warn=False)
    assert {r.name: r for r in qb.tcprec_summary.layers}["conv"].fused == ("bn", "residual")
    assert qb.conv.has_residual and qb.conv.act is None
    _assert_left_float(qb, name)
    with torch.no_grad():
        assert torch.equal(qb(x), qb.head(act(_float_out(qb.conv)(x, x))))


class _ActBeforeAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x))) + x


def test_act_before_a_residual_add_is_not_moved_after_it():
    """silu(bn(conv(x))) + x: the SiLU is the conv's, the add stays a float op (fusing it would apply SiLU to the
    sum)."""
    torch.manual_seed(0)
    m, x = _ActBeforeAdd().eval(), _x(8)
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None), calibration=x, warn=False)
    assert {r.name: r for r in q.tcprec_summary.layers}["conv"].fused == ("bn", "silu") and not q.conv.has_residual
    assert any(n.target in (operator.add, torch.add) for n in q.graph.nodes)
    with torch.no_grad():
        assert torch.equal(q(x), q.conv(x) + x)


@pytest.mark.parametrize("act,enc,name", ACTS[:3], ids=ACT_IDS[:3])
def test_pool_after_the_act_into_bit_planes_plans_what_the_kernel_runs(act, enc, name, monkeypatch):
    """An int8 conv -> act -> 2x2 max-pool read by a bit-serial conv (on an H100): the pool is fused and the conv
    writes the reader's planes; its plan pools the accumulators in the kernel's epilogue for the clamp (monotone) and
    the float result in the pass after the kernel for hardswish / SiLU (the kernel refuses to pool before them).  The
    model equals the unchained one (the CPU's reference backend writes the same codes)."""
    monkeypatch.setattr(convert, "device_caps", lambda dev: H100)
    m, x = _net(act, pool=True), _x()
    cfg = tp.QuantConfig("w2a2", first_last="int8", overrides={"head": "w2a2"})
    q = tp.quantize_model(m, cfg, calibration=x, warn=False)
    q0 = tp.quantize_model(m, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["conv"].fused == ("bn", name, "maxpool") and rec["head"].backend == "bitserial"
    layer = q.conv
    assert layer.out_fmt == q.head.a_fmt and layer.out_layout == "planes"
    g = ConvGeometry(2, 8, 8, 3, 8, 3, 3, (1, 1), (1, 1), (1, 1))  # the conv on x
    p = plan_conv2d(g, layer.a_fmt, layer.w_fmt, device=H100, act=layer.act, pool=layer.pool, out_fmt=layer.out_fmt,
                    out_scale_given=True, out_layout=layer.out_layout)
    pooled_in_kernel = name.startswith("clamp")  # (a monotone activation)
    assert (p.backend, p.epilogue, p.after) == (("int8", "planes", "") if pooled_in_kernel else
                                                ("int8", "float32", "finish"))
    with torch.no_grad():
        assert torch.equal(q(x), q0(x))


@pytest.mark.parametrize("prec", ["int8", "fp8"])
def test_fused_acts_persist(prec):
    """state_dict loads into a model quantized from other weights and calibration and makes it the same, torch.save of
    the whole model round-trips; a state saved with another activation is refused and changes nothing."""
    x = _x()
    cfg = tp.QuantConfig(prec, first_last=None)
    for act, enc, _ in (ACTS[0], ACTS[2], ACTS[4]):
        q = tp.quantize_model(_net(act), cfg, calibration=x, warn=False)
        q2 = tp.quantize_model(_net(act, seed=3), cfg, calibration=3 * x, warn=False)
        assert q.state_dict()["conv._extra_state"]["act"] == enc
        assert_round_trips(q, q2, x)
        buf = io.BytesIO()
        torch.save(q.state_dict(), buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True)["conv._extra_state"]["act"] == enc  # (a weights-only file too)
    silu = tp.quantize_model(_net(nn.SiLU(), seed=3), cfg, calibration=x, warn=False)
    other = tp.quantize_model(_net(nn.Hardswish()), cfg, calibration=x, warn=False)
    before = other.conv.weight_codes.clone()
    with pytest.raises(ValueError, match=r"act: saved 'silu', this module 'hardswish'"):
        other.load_state_dict(silu.state_dict())
    assert torch.equal(other.conv.weight_codes, before)
