"""The speed rule (nn/speed_rule.py) end to end over a pre-norm GELU encoder where every fusion that depends on a
neighbour applies: the LayerNorm writing its readers' codes (``QLayerNorm``, decision 0162), the ``wgmma-gemm`` route
of the linears' rows (decision 0163), linear1 -> GELU -> linear2 chained on it (``convert._chain_ffn``) and the
residual adds in out_proj's / linear2's epilogue (``convert._fuse_linear_residuals``).  A fake clock floats chosen
layers; each outcome must leave no fusion whose partner was floated, apply each GELU once, equal the conversion with
the same layers pinned float by ``overrides``, name every floated layer with the rule's reason, and run.

No GPU: the converter sees a faked sm_90 device, and at run time the route is forced on the CPU (a faked device that
runs Triton through its interpreter, ``wgmma_gemm_refusal``'s device checks patched, ``i8_gemm`` swapped for its
pure-torch reference: tests/test_linear_residual.py's ``_force_route``), so the rule's timings and the model's forward
run the route's glue, the chained codes, the residual epilogue and the QLayerNorm's Triton kernel (interpreted).
``QuantConfig(backend="int8")``: on the CPU "auto" is the reference backend, which takes no route."""

import operator

import pytest
import torch
import torch.nn.functional as F
from test_linear_residual import _force_route
from test_linear_wgmma_route import F16, H100
from torch import nn

import tcprec as tp
from tcprec.nn import convert
from tcprec.nn.linear_gelu import LinearGELU
from tcprec.nn.qmodules import QLayerNorm, QLinear
from tcprec.nn.speed_rule import MODEL, SpeedRule
from tcprec.ops import qconv_plan
from tcprec.ops.qconv_plan import WGMMA_GEMM

NRMSE_MAX = 0.02  # int8 against fp32, as tests/test_transformer_quant.py (measured 0.003-0.006 here)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LINEARS = [f"layers.{i}.{n}" for i in range(2) for n in (*PROJ, "self_attn.out_proj", "linear1", "linear2")]


def _encoder(twins=False):
    """2 pre-norm GELU layers, d_model 64, 4 heads, ffn 256 (eval-mode dropouts, which the fusions skip).  Layer 1 is
    built without biases unless ``twins``: identical layers share their timings and so their decisions (decision
    0159), and a clock cannot float one layer's linear2 alone."""
    torch.manual_seed(0)
    kw = {"d_model": 64, "nhead": 4, "dim_feedforward": 256, "dropout": 0.1, "activation": "gelu",
          "batch_first": True, "norm_first": True}
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), 2, enable_nested_tensor=False)
    if not twins:
        enc.layers[1] = nn.TransformerEncoderLayer(**kw, bias=False)
    return enc.eval().half()


def _x():
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1)).half()


@pytest.fixture
def route(monkeypatch):
    """The faked sm_90 device for the converter, and the route forced at run time (``_force_route``); yields the
    i8_gemm calls seen ((a's shape), gelu, codes out, the residual or None) in order."""
    monkeypatch.setattr(convert, "device_caps", lambda dev: H100)
    yield _force_route(monkeypatch)
    monkeypatch.undo()
    qconv_plan.plan_conv2d.cache_clear()


class Clock:
    """ms by (layer, side): a layer's float side 1.0, its quantized side 0.5 unless ``table`` says; the whole model
    0.9 quantized (or ``model_ms`` in turn) against 1.0; a module timed whole as ``table`` says, else 0.5 against 1.0.
    Runs what it times (the route's glue, each side's recipe) and records the calls."""

    def __init__(self, table=None, model_ms=()):
        self.table, self.model_ms, self.calls = dict(table or {}), list(model_ms), []

    def __call__(self, layer, side, fn):
        fn()
        self.calls.append((layer, side))
        if (layer, side) in self.table:
            return self.table[(layer, side)]
        if layer == MODEL:
            return (self.model_ms.pop(0) if self.model_ms else 0.9) if side == "quantized" else 1.0
        return 0.5 if side == "quantized" else 1.0


def _cfg(**kw):
    return tp.QuantConfig("int8", first_last=None, backend="int8", **kw)


def _layer_names(prefix):
    return [f"{prefix}.{n}" for n in (*PROJ, "self_attn.out_proj", "linear1", "linear2")]


QKV0, QKV1 = [f"layers.0.{p}" for p in PROJ], [f"layers.1.{p}" for p in PROJ]
SLOW = "kept fp16: w8a8 2.000 ms > fp16 1.000 ms at input "
WHOLE = "kept fp16: the whole model was slower quantized (5.000 ms > fp16 1.000 ms); this layer saved least"
TORCHS = "kept fp16: its TransformerEncoderLayer layers.{} as torch's fused module 2.000 ms < quantized 3.000 ms"

# name -> (clock table, whole-model times, the layers floated, the reason they give)
SCENARIOS = {
    "all-quantized": ({}, (), [], ""),
    "linear2-of-layer-0": ({("layers.0.linear2", "quantized"): 2.0}, (), ["layers.0.linear2"], SLOW),
    "linear1-of-layer-1": ({("layers.1.linear1", "quantized"): 2.0}, (), ["layers.1.linear1"], SLOW),
    "out_proj-everywhere": ({("layers.0.self_attn.out_proj", "quantized"): 2.0,
                             ("layers.1.self_attn.out_proj", "quantized"): 2.0}, (),
                            ["layers.0.self_attn.out_proj", "layers.1.self_attn.out_proj"], SLOW),
    # slower as a whole: a quarter of the 8 timed layers (2, those that saved least), then half (4) kept float
    "whole-model-fallback": ({("layers.0.linear2", "quantized"): 0.99, ("layers.1.linear1", "quantized"): 0.98,
                              ("layers.0.self_attn.out_proj", "quantized"): 0.9,
                              ("layers.1.self_attn.qkv_proj", "quantized"): 0.8}, (5.0, 3.0, 0.5),
                             ["layers.0.linear2", "layers.1.linear1", "layers.0.self_attn.out_proj", *QKV1], WHOLE),
    "ffn-of-layer-0": ({("layers.0.linear1", "quantized"): 2.0, ("layers.0.linear2", "quantized"): 2.0}, (),
                       ["layers.0.linear1", "layers.0.linear2"], SLOW),
    # a layer timed whole is faster as torch's fused layer: torch's layer back; layer 1 after torch's layer 0 still
    # fused, layer 0 before torch's layer 1 too
    "layer-0-as-torchs": ({("layers.0", "quantized"): 3.0, ("layers.0", "float"): 2.0}, (),
                          _layer_names("layers.0"), TORCHS.format(0)),
    "layer-1-as-torchs": ({("layers.1", "quantized"): 3.0, ("layers.1", "float"): 2.0}, (),
                          _layer_names("layers.1"), TORCHS.format(1)),
}


def _node(q, target):
    return next((n for n in q.graph.nodes if n.op == "call_module" and n.target == target), None)


def _gelus(q, prefix):
    """The GELUs layer ``prefix`` applies: F.gelu nodes read from its linear1 (through nothing but itself), a
    LinearGELU, a QLinear's epilogue GELU, or torch's own layer (its activation)."""
    m = q.get_submodule(prefix)
    if type(m) is nn.TransformerEncoderLayer:
        return ["torch's layer"]
    mods = dict(q.named_modules())
    out = []
    lin1 = mods[f"{prefix}.linear1"]
    if isinstance(lin1, LinearGELU):
        out.append("LinearGELU")
    if isinstance(lin1, QLinear) and lin1.act == "gelu":
        out.append("epilogue")
    for n in q.graph.nodes:
        if n.op == "call_function" and n.target in (F.gelu, torch._C._nn.gelu) and n.args[0] is _node(q, f"{prefix}.linear1"):
            out.append("F.gelu")
    return out


def _check_fusions(q, floated):
    """No fusion survives whose partner is float, and each applies where both partners are quantized."""
    mods = dict(q.named_modules())

    def quant(n):
        return n not in floated

    for i in range(2):
        p = f"layers.{i}"
        if type(mods[p]) is nn.TransformerEncoderLayer:  # torch's own layer: nothing of tcprec inside
            assert all(n in floated for n in _layer_names(p))
            continue
        qkv, out_proj = mods.get(f"{p}.self_attn.qkv_proj"), mods.get(f"{p}.self_attn.out_proj")
        lin1, lin2 = mods[f"{p}.linear1"], mods[f"{p}.linear2"]
        # norm1 writes the fused qkv_proj's codes iff q / k / v are quantized; norm2 linear1's iff it is
        assert (type(mods.get(f"{p}.norm1")) is QLayerNorm) == quant(f"{p}.self_attn.q_proj"), p
        assert (type(mods[f"{p}.norm2"]) is QLayerNorm) == quant(f"{p}.linear1"), p
        if quant(f"{p}.self_attn.q_proj"):
            assert isinstance(qkv, QLinear) and _node(q, f"{p}.self_attn.qkv_proj").args[0].target == f"{p}.norm1"
        if type(mods.get(f"{p}.self_attn")) is nn.MultiheadAttention:  # (torch's attention: every projection float)
            assert all(n in floated for n in (*[f"{p}.{x}" for x in PROJ], f"{p}.self_attn.out_proj"))
        else:
            assert isinstance(out_proj, QLinear) == quant(f"{p}.self_attn.out_proj")
            assert bool(getattr(out_proj, "has_residual", False)) == quant(f"{p}.self_attn.out_proj"), p
        assert isinstance(lin1, QLinear) == quant(f"{p}.linear1") and isinstance(lin2, QLinear) == quant(f"{p}.linear2")
        assert bool(getattr(lin2, "has_residual", False)) == quant(f"{p}.linear2"), p
        assert len(_node(q, f"{p}.linear2").args) == 1 + quant(f"{p}.linear2")
        chained = quant(f"{p}.linear1") and quant(f"{p}.linear2")
        if isinstance(lin1, QLinear):  # chained iff linear2 is quantized too; its GELU in the epilogue only then
            assert (lin1.act == "gelu") == chained and (lin1.out_layout == "int8") == chained, p
            assert (lin1.out_fmt is not None) == chained
            if chained:
                assert torch.equal(lin1.out_scale, lin2.in_scale) and lin2.layer_plan.chain_in == "int8"
                assert list(_node(q, f"{p}.linear1").users) == [_node(q, f"{p}.linear2")]
        else:  # float linear1: one GEMM with its GELU (LinearGELU), whatever linear2 is
            assert type(lin1) is LinearGELU, p
        assert len(_gelus(q, p)) == 1, (p, _gelus(q, p))  # each GELU applied exactly once
    # every add left is a residual whose linear is float (or torch's layer's output feeding a float add)
    adds = [n for n in q.graph.nodes if n.op == "call_function" and n.target is operator.add]
    fused = sum(bool(getattr(m, "has_residual", False)) for m in mods.values())
    assert len(adds) + fused == 2 * sum(type(mods[f"layers.{i}"]) is not nn.TransformerEncoderLayer for i in range(2))


def _structure(q):
    """What a conversion decided, to compare two conversions: the graph's calls and each module's kind and fusions."""
    nodes = [(n.op, str(n.target), len(n.args)) for n in q.graph.nodes]
    mods = {n: (type(m).__name__, getattr(m, "act", None), getattr(m, "out_layout", None),
                getattr(m, "has_residual", None)) for n, m in q.named_modules()}
    recs = [(r.name, r.precision, r.fused, r.out, r.route) for r in q.tcprec_summary.layers]
    return nodes, mods, recs


def _nrmse(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_rule_leaves_no_fusion_with_a_floated_partner(route, scenario):
    table, model_ms, floated, why = SCENARIOS[scenario]
    x = _x()
    clock = Clock(table, model_ms)
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=x, warn=False)
    summary, sp = q.tcprec_summary, q.tcprec_summary.speed
    assert not clock.model_ms  # (every whole-model time scripted was asked for)
    recs = {r.name: r for r in summary.layers}
    assert sorted(recs) == sorted(LINEARS)
    # the floated layers are the rule's, each with its reason; nothing else is float (nothing silently unquantized)
    assert sorted(n for n, r in recs.items() if r.precision == "float") == sorted(floated)
    assert sorted(sp.overrides()) == sorted(floated)
    text = summary.explain()
    for n, r in recs.items():
        if n in floated:
            assert r.reason.startswith(why) and r.backend == r.reason, (n, r.reason)
            assert r.reason in summary.explain(n) and n in text
        else:
            assert r.precision == "w8a8" and r.reason.startswith("w8a8 ") and r.route.startswith(WGMMA_GEMM), (n, r)
    for i in range(2):  # linear1's GELU was in both sides' timing, and the reason says how
        r, lin1 = recs[f"layers.{i}.linear1"], q.get_submodule(f"layers.{i}.linear1")
        if r.reason.startswith("kept fp16: its TransformerEncoderLayer"):
            continue  # (floated with its layer, timed whole)
        timed_chained = "with the GELU in the GEMM's epilogue on both sides" in r.reason
        timed_pass = "with the GELU after it: a pass quantized, the GEMM's epilogue in float" in r.reason
        assert timed_chained + timed_pass == 1, r.reason
        if r.precision != "float" and not any(t.form_now for t in sp.layers if t.name == r.name):
            assert timed_chained == (getattr(lin1, "act", None) == "gelu"), r.reason
    # a layer whose chain / fusion a later floating undid says so: the fallback floats without timing again (the
    # per-layer rounds time the layers they change again)
    changed = ["layers.0.linear1", "layers.1.linear2"] if scenario == "whole-model-fallback" else []
    assert sorted(t.name for t in sp.layers if t.form_now) == changed
    note = [n for n in sp.notes if "run in another form than they were timed in" in n]
    assert len(note) == bool(changed) and all(n in note[0] for n in changed)
    if scenario == "whole-model-fallback":
        assert sp.fallback == [(2, 3.0), (6, 0.5)] and "whole model not faster than fp16 at first" in text
        assert recs["layers.0.linear1"].reason.endswith(
            "; timed with the gelu in its epilogue, int8 codes out, it runs with float out, a GELU pass after it (a "
            "neighbour kept float after its last timing; not timed again, the whole-model check times it)")
        assert "timed with float out, reading int8 codes, the residual add in its epilogue" not in text
        assert "timed with float out, the residual add in its epilogue, reading int8 codes, it runs with float " \
               "out, the residual add in its epilogue" in recs["layers.1.linear2"].reason
    _check_fusions(q, set(floated))
    # the LayerNorms the notes name as fused are the QLayerNorms, and no other
    mods = dict(q.named_modules())
    noted = sorted(n.partition(":")[0] for n in summary.notes if "LayerNorm(64) fused" in n)
    assert noted == sorted(n for n, m in mods.items() if type(m) is QLayerNorm)
    # the same as the conversion with those layers pinned float (no rule): the same graph, modules, records, output
    ref = tp.quantize_model(_encoder(), _cfg(overrides=sp.overrides()), calibration=x, warn=False)
    assert _structure(q) == _structure(ref)
    ref.load_state_dict(q.state_dict())  # (the pinned outcome takes the rule's state)
    # it runs through the route: each quantized GEMM once, the chains and the residual epilogues as converted
    route.clear()
    with torch.no_grad():
        y = q(x)
        calls = [(gelu, codes, res is not None) for _, gelu, codes, res in route]
        y_ref, y32 = ref(x), _encoder().float()(x.float())
    gemms = [m for m in mods.values() if isinstance(m, QLinear)]
    assert len(calls) == len(gemms)
    assert sum(g and c for g, c, _ in calls) == sum(m.act == "gelu" for m in gemms)
    assert sum(r for _, _, r in calls) == sum(m.has_residual for m in gemms)
    assert y.shape == x.shape and y.dtype == F16 and torch.equal(y, y_ref)
    assert _nrmse(y, y32) < NRMSE_MAX, _nrmse(y, y32)


def test_twin_layers_float_together(route):
    """With identical layers (nn.TransformerEncoder's clones) the clock is asked once for both linear2s (decision
    0159): floating layer 0's floats layer 1's too, and both linear1s lose their chain."""
    x = _x()
    clock = Clock({("layers.0.linear2", "quantized"): 2.0})
    q = tp.quantize_model(_encoder(twins=True), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=x,
                          warn=False)
    floated = {"layers.0.linear2", "layers.1.linear2"}
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert {n for n, r in recs.items() if r.precision == "float"} == floated
    assert recs["layers.1.linear2"].reason == recs["layers.0.linear2"].reason + "; the times of layers.0.linear2, an " \
                                                                                "identical layer"
    assert ("layers.1.linear2", "quantized") not in clock.calls
    _check_fusions(q, floated)
    with torch.no_grad():
        assert _nrmse(q(x), _encoder(twins=True).float()(x.float())) < NRMSE_MAX


def test_a_layer_after_torchs_own_layer_keeps_its_residual_fusions(route):
    """Layer 0 all float is torch's nn.TransformerEncoderLayer again (restore_torch_modules); layer 1 reads its output
    as the residual of out_proj's add, which must still go into out_proj's epilogue.  The restored call had lost
    ShapeProp's tensor_meta, so that add was left a float op (and the rule had timed out_proj with it fused)."""
    x = _x()
    q = tp.quantize_model(_encoder(), _cfg(overrides=dict.fromkeys(_layer_names("layers.0"), "float")),
                          calibration=x, warn=False)
    assert type(q.get_submodule("layers.0")) is nn.TransformerEncoderLayer
    out_proj = q.get_submodule("layers.1.self_attn.out_proj")
    assert out_proj.has_residual and _node(q, "layers.1.self_attn.out_proj").args[1].target == "layers.0"
    assert "residual" in {r.name: r for r in q.tcprec_summary.layers}["layers.1.self_attn.out_proj"].fused
    assert not [n for n in q.graph.nodes if n.op == "call_function" and n.target is operator.add]
    _check_fusions(q, set(_layer_names("layers.0")))
    with torch.no_grad():
        assert _nrmse(q(x), _encoder().float()(x.float())) < NRMSE_MAX


def test_a_chain_undone_after_the_last_round_says_so(route):
    """With one timing round, floating layer 0's linear2 unchains its linear1 (the GELU a pass after it), which no
    round times again: its reason and the notes say it runs in another form than it was timed in."""
    clock = Clock({("layers.0.linear2", "quantized"): 2.0})
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock, rounds=1)), calibration=_x(),
                          warn=False)
    sp = q.tcprec_summary.speed
    assert any("stopped after 1 timing round" in n for n in sp.notes)
    assert [t.name for t in sp.layers if t.form_now] == ["layers.0.linear1"]
    r = {r.name: r for r in q.tcprec_summary.layers}["layers.0.linear1"]
    assert r.precision == "w8a8" and "it runs with float out, a GELU pass after it" in r.reason
    assert any("run in another form than they were timed in" in n and "layers.0.linear1" in n for n in sp.notes)
    _check_fusions(q, {"layers.0.linear2"})


def test_backend_int8_converts_as_auto_on_the_faked_device(monkeypatch):
    """These tests ask for QuantConfig(backend="int8") so that the CPU runs the route; on the sm_90 device the
    converter sees, "auto" decides the same graph, modules and records."""
    monkeypatch.setattr(convert, "device_caps", lambda dev: H100)
    a = tp.quantize_model(_encoder(), tp.QuantConfig("int8", first_last=None), calibration=_x(), warn=False)
    b = tp.quantize_model(_encoder(), _cfg(), calibration=_x(), warn=False)
    assert _structure(a) == _structure(b) and a.tcprec_summary.notes == b.tcprec_summary.notes


CHAIN_SIDE = (MODEL, "quantized, chains kept")


def test_a_chain_head_slower_alone_is_quantized_where_the_whole_model_is_faster_with_it(route):
    """Layer 1's linear1, chained (GELU + linear2's codes in its epilogue), loses its own timing, but floating it makes
    linear2 quantize its own input again: the chain check times the model as decided against the model with it
    quantized, and keeps the faster -- here the chain.  The result is the conversion with nothing pinned float, and
    the layer's reason gives both timings."""
    x = _x()
    clock = Clock({("layers.1.linear1", "quantized"): 2.0, CHAIN_SIDE: 0.5})
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=x, warn=False)
    sp = q.tcprec_summary.speed
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert all(r.precision == "w8a8" for r in recs.values()) and sp.overrides() == {}
    assert sp.chain_check == (("layers.1.linear1",), 0.9, 0.5, True)
    assert clock.calls.count((MODEL, "quantized, chains kept")) == 1
    why = recs["layers.1.linear1"].reason
    assert why.startswith("w8a8 2.000 ms > fp16 1.000 ms at input ") and "on both sides, but kept w8a8: the whole " \
        "model ran faster with the 1 such layer(s) quantized, the chains they start kept (0.500 ms < 0.900 ms with " \
        "them fp16)" in why, why
    check = [line for line in sp.lines() if line.startswith("chain check: 1 layer(s) kept float alone")]
    assert len(check) == 1 and check[0].endswith(": quantized") and check[0] in q.tcprec_summary.explain()
    lin1 = q.get_submodule("layers.1.linear1")
    assert isinstance(lin1, QLinear) and lin1.act == "gelu" and lin1.out_layout == "int8"
    _check_fusions(q, set())
    ref = tp.quantize_model(_encoder(), _cfg(), calibration=x, warn=False)
    assert _structure(q)[:2] == _structure(ref)[:2]
    ref.load_state_dict(q.state_dict())
    with torch.no_grad():
        assert torch.equal(q(x), ref(x))


def test_a_chain_head_stays_float_where_the_whole_model_is_not_faster_with_it(route):
    """The same layer, with the chained model no faster (the clock's default 1.0 against 0.9 for the model as
    decided): linear1 stays float with its own reason, and the check's figures are in the report."""
    x = _x()
    clock = Clock({("layers.1.linear1", "quantized"): 2.0})
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=x, warn=False)
    sp = q.tcprec_summary.speed
    assert sp.overrides() == {"layers.1.linear1": "float"} and sp.chain_check == (("layers.1.linear1",), 0.9, 1.0, False)
    assert {r.name: r for r in q.tcprec_summary.layers}["layers.1.linear1"].reason.startswith(SLOW)
    assert any(line.startswith("chain check:") and line.endswith("kept float") for line in sp.lines())


def test_no_chain_check_where_no_floated_layer_wrote_codes(route):
    """linear2 writes fp16 (its residual add in the epilogue): floating it re-chains no reader, so no chain check."""
    clock = Clock({("layers.0.linear2", "quantized"): 2.0})
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=_x(), warn=False)
    assert q.tcprec_summary.speed.chain_check is None and CHAIN_SIDE not in clock.calls


class RoundClock(Clock):
    """Clock, but ``seq[(layer, side)]`` gives that side's times call by call (a layer timed again in a later round
    when a floating changed its operand)."""

    def __init__(self, table=None, seq=None):
        super().__init__(table)
        self.seq = {k: list(v) for k, v in (seq or {}).items()}

    def __call__(self, layer, side, fn):
        if self.seq.get((layer, side)):
            fn()
            self.calls.append((layer, side))
            return self.seq[(layer, side)].pop(0)
        return super().__call__(layer, side, fn)


def test_the_chain_check_brings_back_a_reader_a_later_round_floated(route):
    """Layer 1's linear1 loses alone in round 1; in round 2 its linear2, now quantizing its own fp16 input, loses too
    and is floated.  The chain check quantizes both again (the chain whole), and keeps it where that model is
    faster: both w8a8, linear1 writing linear2's codes, each reason saying why."""
    x = _x()
    lin2 = ("layers.1.linear2", "quantized")
    clock = RoundClock({("layers.1.linear1", "quantized"): 2.0, CHAIN_SIDE: 0.5}, {lin2: [0.5, 2.0]})
    q = tp.quantize_model(_encoder(), _cfg(speed_rule=SpeedRule(batch=4, timer=clock)), calibration=x, warn=False)
    sp = q.tcprec_summary.speed
    assert clock.calls.count(lin2) == 2 and not clock.seq[lin2]  # (timed in both rounds)
    assert sp.chain_check == (("layers.1.linear1", "layers.1.linear2"), 0.9, 0.5, True)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert all(r.precision == "w8a8" for r in recs.values()) and sp.overrides() == {}
    for n in ("layers.1.linear1", "layers.1.linear2"):
        assert " ms > fp16 " in recs[n].reason and "but kept w8a8: the whole model ran faster with the 2 such" \
            in recs[n].reason, recs[n].reason
    lin1 = q.get_submodule("layers.1.linear1")
    assert lin1.act == "gelu" and lin1.out_layout == "int8"
    _check_fusions(q, set())
