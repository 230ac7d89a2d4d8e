"""nn/linear_gelu.py: a linear kept float whose reader is GELU runs as one GEMM with a bias + GELU epilogue.

The CPU form of ``torch._addmm_activation(use_gelu=True)`` is the exact erf GELU, so the converted model equals the
float model within float32 rounding; the fx graph has no separate gelu node after a kept linear."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tcprec as tp
from tcprec.kernels.reference_conv_int8_fp8 import gelu_f32
from tcprec.nn.linear_gelu import LinearGELU, linear_gelu
from tcprec.nn.qmodules import QLinear
from tcprec.qtensor import QTensor

from _persist import assert_round_trips

D_MODEL, HEADS, SEQ, BATCH = 32, 4, 7, 2


def _encoder(layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def _all_float(layers):
    names = [f"layers.{i}.{n}" for i in range(layers) for n in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "linear1", "linear2")]
    return {n: "float" for n in names}


def _gelu_nodes(gm):
    return [n for n in gm.graph.nodes if "gelu" in str(n.target).lower()]


def test_linear_gelu_is_the_linear_then_erf_gelu_on_the_cpu():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    ref = F.gelu(F.linear(x, w, b))
    assert torch.allclose(linear_gelu(x, w, b), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear_gelu(x, w, None), F.gelu(F.linear(x, w)), rtol=1e-5, atol=1e-5)
    lin = nn.Linear(16, 24)
    m = LinearGELU.from_linear(lin)
    assert m.weight is lin.weight and list(m.state_dict()) == ["weight", "bias"]


def test_kept_float_encoder_has_no_separate_gelu_and_equals_torch():
    enc, layers = _encoder(), 2
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    q = tp.quantize_model(enc, tp.QuantConfig("int8", first_last=None, overrides=_all_float(layers)), calibration=x,
                          warn=False)
    mods = dict(q.named_modules())
    assert all(type(mods[f"layers.{i}.linear1"]) is LinearGELU for i in range(layers))
    assert _gelu_nodes(q) == []  # the GELU is in linear1's GEMM
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert recs["layers.0.linear1"].precision == "float" and "gelu" in recs["layers.0.linear1"].fused
    with torch.no_grad():
        ref_fast = enc(x)  # torch's module (its fast path where it applies)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            ref_eager = enc(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        y = q(x)
    for ref in (ref_fast, ref_eager):
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4), float((y - ref).abs().max())


class _Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), act, nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_only_the_erf_gelu_fuses_into_a_float_linear():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    cfg = tp.QuantConfig("int8", first_last=None, overrides={"fc1": "float", "fc2": "float"})
    for act, fused in ((nn.GELU(), True), (nn.GELU(approximate="tanh"), False), (nn.ReLU(), False)):
        torch.manual_seed(0)
        m = _Mlp(act).eval()
        q = tp.quantize_model(m, cfg, calibration=x, warn=False)
        assert (type(q.fc1) is LinearGELU) == fused, act
        with torch.no_grad():
            assert torch.allclose(q(x), m(x), rtol=1e-5, atol=1e-5)


# -- GELU in the quantized linear's epilogue ----------------------------------------------------------------------


@pytest.mark.parametrize("precision, backend", [("int8", "reference"), ("int8", "int8"), ("fp8", "reference"),
                                                ("fp8", "fp8")])
def test_qlinear_gelu_epilogue_is_the_unfused_layer_then_gelu_f32(precision, backend):
    """The fused layer computes gelu_f32 of what the layer without the activation returns (float32 out), bit for
    bit: the epilogue only adds the erf GELU (the Triton kernels through the interpreter here)."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1))
    kw = dict(in_absmax=float(x.abs().max()), signed_input=True, backend=backend)
    fused = QLinear.from_float(lin, precision, act="gelu", **kw)
    plain = QLinear.from_float(lin, precision, act=None, **kw)
    y = fused(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 40)
    assert torch.equal(y, gelu_f32(plain(x)))
    assert _nrmse(y, F.gelu(lin(x))) < (0.02 if precision == "int8" else 0.08)


def _nrmse(y, ref):
    return float((y.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_linear1_takes_the_gelu_into_its_epilogue(precision):
    enc = _encoder()
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    q = tp.quantize_model(enc, tp.QuantConfig(precision, first_last=None), calibration=x, warn=False)
    assert _gelu_nodes(q) == []
    for i in range(2):
        m = q.get_submodule(f"layers.{i}.linear1")
        assert isinstance(m, QLinear) and m.act == "gelu"
        rec = {r.name: r for r in q.tcprec_summary.layers}[f"layers.{i}.linear1"]
        assert rec.fused == ("gelu",)
    with torch.no_grad():
        assert _nrmse(q(x), enc(x)) < (0.02 if precision == "int8" else 0.06)


def test_bitserial_linear_keeps_a_separate_gelu(monkeypatch):
    """The binary GEMM's epilogue has no GELU: a layer planned there (a device whose caps say the bit-serial kernel
    runs; conversion only, nothing is run) keeps the float GELU after it."""
    import tcprec.nn.convert as cv
    from tcprec.ops.qconv_plan import DeviceCaps

    monkeypatch.setattr(cv, "device_caps", lambda dev: DeviceCaps(torch.device("cpu"), bitserial=(True, "test caps")))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    q = tp.quantize_model(_Mlp(nn.GELU()).eval(), tp.QuantConfig("w1a2", first_last=None, backend="bitserial"),
                          calibration=x, warn=False)
    assert q.fc1.layer_plan.backend == "bitserial" and q.fc1.act is None
    assert [n.target for n in q.graph.nodes if n.op == "call_module"] == ["fc1", "act", "fc2"]


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_speed_rule_times_the_fused_gelu_on_both_sides():
    """linear1 quantized with the GELU in its epilogue is timed against the float linear + GELU as one GEMM with
    the GELU epilogue (torch._addmm_activation), the way torch's fast path and a kept-float layer run it."""
    seen = {}

    def timer(layer, side, fn):
        with _OpLog() as log:
            fn()
        seen[(layer, side)] = log.ops
        return 1.0 if side == "quantized" else 2.0  # quantized faster: nothing floated

    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    q = tp.quantize_model(_encoder(1), tp.QuantConfig("int8", first_last=None, speed_rule=tp.SpeedRule(timer=timer)),
                          calibration=x, warn=False)
    assert q.get_submodule("layers.0.linear1").act == "gelu"
    ops = seen[("layers.0.linear1", "float")]
    assert "aten._addmm_activation" in ops and "aten.gelu" not in ops, ops
    assert "aten.gelu" not in seen[("layers.0.linear1", "quantized")]
    assert "aten._addmm_activation" not in seen[("layers.0.linear2", "float")]


# -- linear1 -> GELU -> linear2: the codes from linear1's epilogue ------------------------------------------------


def test_ffn_chain_writes_linear2s_int8_codes_and_computes_the_same():
    """On the INT8 kernel (the interpreter here) linear1's epilogue writes linear2's int8 operand after the GELU;
    the eval-mode dropout between them is dropped; the outputs equal the unchained conversion's bit for bit (a float32
    model: the codes of the same float32 values), and the chained model persists."""
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    cfg = tp.QuantConfig("int8", first_last=None, backend="int8")
    q = tp.quantize_model(_encoder(), cfg, calibration=x, warn=False)
    q0 = tp.quantize_model(_encoder(), tp.QuantConfig("int8", first_last=None, backend="int8", chain=False),
                           calibration=x, warn=False)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    for i in range(2):
        a, b = q.get_submodule(f"layers.{i}.linear1"), q.get_submodule(f"layers.{i}.linear2")
        assert a.act == "gelu" and a.out_layout == "int8" and a.out_fmt == b.a_fmt
        assert torch.equal(a.out_scale, b.in_scale) and b.layer_plan.chain_in == "int8"
        assert recs[f"layers.{i}.linear1"].out == f"int8 codes {b.a_fmt} -> layers.{i}.linear2"
        assert q0.get_submodule(f"layers.{i}.linear1").out_fmt is None
    targets = [n.target for n in q.graph.nodes if n.op == "call_module"]
    assert "layers.0.dropout" not in targets and "layers.0.dropout" in [n.target for n in q0.graph.nodes]
    assert _gelu_nodes(q) == []
    with torch.no_grad():
        y = q(x)
        assert y.shape == x.shape and torch.equal(y, q0(x))
    other = tp.quantize_model(_encoder(), cfg, calibration=x * 3, warn=False)
    assert_round_trips(q, other, x)


def test_qlinear_chain_fp8_codes_equal_the_unchained_pair():
    """The FP8 kernel's epilogue writes the next FP8 linear's e4m3 codes (after the GELU): the pair's output equals
    the unchained pair's; the reader takes the leading dimensions from ``lead_shape``."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(32, 64), nn.Linear(64, 16)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = F.gelu(l1(x))
    a = QLinear.from_float(l1, "fp8", in_absmax=float(x.abs().max()), signed_input=True, act="gelu", backend="fp8")
    b = QLinear.from_float(l2, "fp8", in_absmax=float(h.abs().max()), signed_input=True, backend="fp8")
    want = b(a(x))
    a.chain_to(b, "planes")
    codes = a(x)
    assert isinstance(codes, QTensor) and codes.shape == (10, 1, 1, 64)
    assert torch.equal(b(codes, lead_shape=(2, 5)), want)
    with pytest.raises(ValueError, match="M = prod"):
        b(codes, lead_shape=(3, 5))
