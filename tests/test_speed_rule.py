"""The speed rule (nn/speed_rule.py) driven by a fake clock on the CPU: which layers it floats, what the summary and
explain say, the whole-model check, and the option's validation.  No real timing here (GPU: tests/gpu/)."""

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.nn.speed_rule import MODEL, as_speed_rule, timing_input

from _persist import assert_round_trips

SpeedRule = tp.SpeedRule  # the public name


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()


class FakeTimer:
    """ms from a table: (layer, side) -> ms; runs each side once, so the float recipe and the quantized call are
    exercised; records every call.  The whole quantized model defaults to 10% faster than ``default`` (past
    SpeedRule.margin: a test about layers is not one about the whole-model check)."""

    def __init__(self, table, default=1.0):
        self.table, self.default, self.calls = table, default, []

    def __call__(self, layer, side, fn):
        fn()
        self.calls.append((layer, side))
        return self.ms(layer, side)

    def ms(self, layer, side):
        return self.table.get((layer, side), 0.9 * self.default if (layer, side) == (MODEL, "quantized") else self.default)


def _quantize(timer, precision="int8", **kw):
    x = torch.randn(4, 3, 6, 6)
    cfg = tp.QuantConfig(precision, first_last=None, speed_rule=SpeedRule(timer=timer, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tp.quantize_model(_net(), cfg, calibration=x)


def test_floats_exactly_the_layers_measured_slower():
    t = FakeTimer({("3", "quantized"): 0.212, ("3", "float"): 0.151,  # slower: floated
                   ("6", "quantized"): 0.100, ("6", "float"): 0.100,  # equal: stays quantized
                   ("0", "quantized"): 0.050, ("0", "float"): 0.151,
                   ("9", "quantized"): 0.010, ("9", "float"): 0.020,
                   (MODEL, "quantized"): 1.0, (MODEL, "float"): 2.0})
    q = _quantize(t)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert [n for n, r in recs.items() if r.precision == "float"] == ["3"]
    assert recs["3"].reason == "kept fp32: w8a8 0.212 ms > fp32 0.151 ms at input (4,8,6,6)"
    assert recs["3"].backend == recs["3"].reason  # the summary's "why float" column
    assert recs["6"].precision == "w8a8" and recs["6"].reason.startswith("w8a8 0.100 ms <= fp32 0.100 ms")
    sp = q.tcprec_summary.speed
    assert sp.floated == ["3"] and sp.overrides() == {"3": "float"}
    assert sp.conversions == 2 and sp.speedup == pytest.approx(2.0)
    text = q.tcprec_summary.explain()
    assert "3 (conv): float, kept fp32: w8a8 0.212 ms > fp32 0.151 ms" in text and "whole model" in text
    assert "kept fp32: w8a8 0.212 ms" in q.tcprec_summary.explain("3")
    assert "speed rule" in str(q.tcprec_summary)
    # every quantized layer was timed on both sides, in the first round and again after "3" was floated
    first = t.calls[:8]
    assert sorted(first) == sorted((n, s) for n in ("0", "3", "6", "9") for s in ("quantized", "float"))
    assert ("3", "quantized") not in t.calls[8:] and ("6", "quantized") in t.calls[8:]
    y = q(torch.randn(2, 3, 6, 6))
    assert y.shape == (2, 10)


def test_nothing_floated_when_quantized_is_faster():
    q = _quantize(FakeTimer({**{(n, "float"): 1.0 for n in "0369"}, (MODEL, "quantized"): 1.0, (MODEL, "float"): 3.0},
                            default=0.5))
    assert not q.tcprec_summary.float_layers
    assert q.tcprec_summary.speed.conversions == 1
    assert not any("SLOWER" in n for n in q.tcprec_summary.speed.notes)


def test_whole_model_slower_with_every_layer_float_is_the_model_itself():
    # every layer ties in its own timing, and the whole model stays slower at every fallback step, all float too
    t = FakeTimer({(MODEL, "quantized"): 5.0, (MODEL, "float"): 1.0}, default=1.0)
    net = _net()
    cfg = tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "slower" warning: the model itself is as fast as itself)
        q = tp.quantize_model(net, cfg, calibration=torch.randn(4, 3, 6, 6), warn=False)
    sp = q.tcprec_summary.speed
    assert sp.fallback == [(1, 5.0), (2, 5.0), (3, 5.0), (4, 5.0)]  # a quarter, half, three quarters, all
    assert type(q) is nn.Sequential and q is not net and not q.training  # the model itself, a copy in eval mode
    assert all(r.precision == "float" for r in q.tcprec_summary.layers)
    assert sp.model_ms == sp.float_model_ms == 1.0
    assert sp.model_itself
    assert any("the model itself is returned" in n and "5.000 ms against 1.000 ms" in n for n in sp.notes)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert torch.equal(q(x), net.eval()(x))
    assert sp.conversions == 5  # timed, then the four fallback steps; no final calibration for a float model


def test_whole_model_within_the_margin_is_not_kept_quantized():
    # 0.995 ms quantized against 1.000 float: faster, but by less than the 1% margin (timing noise), so the layer that
    # saved least is kept float; at 0.98 ms the model is measurably faster and stays as it is
    table = {**{(n, "float"): 0.2 for n in "0369"}, ("0", "quantized"): 0.1, ("3", "quantized"): 0.15,
             ("6", "quantized"): 0.19, ("9", "quantized"): 0.12, (MODEL, "float"): 1.0}
    t = SlowerAsAWhole(table, model_ms=[0.995, 0.98])
    q = _quantize(t)
    sp = q.tcprec_summary.speed
    assert sp.fallback == [(1, 0.98)] and sp.floated == ["6"] and not sp.model_itself
    assert {r.name: r for r in q.tcprec_summary.layers}["6"].reason.startswith(
        "kept fp32: the whole model was not 1% faster quantized (0.995 ms against fp32 1.000 ms); this layer saved least")
    q = _quantize(SlowerAsAWhole(table, model_ms=[0.995]), margin=0.0)  # margin 0: any win is kept
    assert not q.tcprec_summary.speed.fallback and not q.tcprec_summary.float_layers
    with pytest.raises(ValueError, match=r"SpeedRule.margin must be a fraction in \[0, 1\)"):
        SpeedRule(margin=1.0)
    with pytest.raises(ValueError, match="SpeedRule.margin"):
        SpeedRule(margin=-0.1)


def test_float_side_is_timed_once_across_rounds():
    # round 1 floats "3"; round 2 times the re-chained layers' quantized side again, their float side from round 1
    t = FakeTimer({("3", "quantized"): 2.0, (MODEL, "quantized"): 0.5, (MODEL, "float"): 1.0}, default=0.5)
    q = _quantize(t)
    assert q.tcprec_summary.speed.floated == ["3"]
    layer_calls = [c for c in t.calls if c[0] != MODEL]
    assert sum(side == "quantized" for _, side in layer_calls) == 4 + 3  # two rounds
    assert sorted(n for n, side in layer_calls if side == "float") == ["0", "3", "6", "9"]  # once each


def test_whole_model_slower_is_said_loudly_when_a_layer_stays_quantized():
    # the fallback is off: the model stays as the layer timings left it, and the summary says it is slower
    t = FakeTimer({(MODEL, "quantized"): 5.0, (MODEL, "float"): 1.0}, default=1.0)
    cfg = tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=t, fallback=()))
    with pytest.warns(UserWarning, match="SLOWER THAN FP32"):
        q = tp.quantize_model(_net(), cfg, calibration=torch.randn(4, 3, 6, 6), warn=False)
    assert "SLOWER THAN FP32" in str(q.tcprec_summary)
    assert not q.tcprec_summary.speed.fallback and not q.tcprec_summary.float_layers


class SlowerAsAWhole(FakeTimer):
    """The whole quantized model times ``model_ms`` in turn (the fallback's conversions), the layers as ``table``."""

    def __init__(self, table, model_ms):
        super().__init__(table)
        self.model_ms = list(model_ms)

    def __call__(self, layer, side, fn):
        ms = super().__call__(layer, side, fn)
        return self.model_ms.pop(0) if (layer, side) == (MODEL, "quantized") else ms


def test_whole_model_slower_floats_the_layers_that_saved_least_until_it_is_not():
    t = SlowerAsAWhole({("0", "quantized"): 0.050, ("0", "float"): 0.151,  # saves 0.101
                        ("3", "quantized"): 0.100, ("3", "float"): 0.150,  # 0.050
                        ("6", "quantized"): 0.099, ("6", "float"): 0.100,  # 0.001: the least
                        ("9", "quantized"): 0.010, ("9", "float"): 0.020,  # 0.010
                        (MODEL, "float"): 2.0}, model_ms=[5.0, 3.0, 1.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "slower" warning: it ends faster)
        q = tp.quantize_model(_net(), tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=t)),
                              calibration=torch.randn(4, 3, 6, 6), warn=False)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert [n for n, r in recs.items() if r.precision == "float"] == ["6", "9"]  # a quarter (1), then half (2)
    assert recs["6"].reason == ("kept fp32: the whole model was slower quantized (5.000 ms > fp32 2.000 ms); this "
                                "layer saved least (w8a8 0.099 ms <= fp32 0.100 ms at input (4,8,6,6))")
    assert recs["9"].reason.startswith("kept fp32: the whole model was slower quantized (5.000 ms")
    assert recs["3"].precision == "w8a8" and recs["3"].reason.startswith("w8a8 0.100 ms <= fp32 0.150 ms")
    sp = q.tcprec_summary.speed
    assert sp.fallback == [(1, 3.0), (2, 1.5)] and sp.model_ms == 1.5 and sp.speedup == pytest.approx(2.0 / 1.5)
    assert sp.overrides() == {"6": "float", "9": "float"}
    assert sp.conversions == 4  # timed, two fallback steps, then the final calibration on the final layer set
    assert not t.model_ms  # (every whole-model time was asked for)
    # each step times both whole models again (the default clock alternates the pair), the quantized one first
    whole = [c for c in t.calls if c[0] == MODEL]
    assert whole == [(MODEL, "quantized"), (MODEL, "float")] * 3
    assert sp.convert_s > 0 and sp.timing_s >= 0 and "s converting" in sp.lines()[0]
    text = q.tcprec_summary.explain()
    assert "whole model not faster than fp32 at first" in text and "1 float, 3.000 ms, 2 float, 1.500 ms" in text
    # the outcome pins: rebuilt from the overrides without timing, the same layers are float
    pinned = tp.quantize_model(_net(), tp.QuantConfig("int8", first_last=None, overrides=sp.overrides()),
                               calibration=torch.randn(4, 3, 6, 6), warn=False)
    assert [r.name for r in pinned.tcprec_summary.layers if r.precision == "float"] == ["6", "9"]


def test_rounds_bound_the_conversions_and_say_so():
    # every layer looks slower in every round: round 1 floats all four, and no second timing round is allowed
    t = FakeTimer({(MODEL, "quantized"): 1.0, (MODEL, "float"): 1.0,
                   **{(n, "quantized"): 2.0 for n in "0369"}}, default=1.0)
    q = _quantize(t, rounds=1)
    sp = q.tcprec_summary.speed
    assert sorted(sp.floated) == ["0", "3", "6", "9"] and sp.conversions == 2
    assert any("stopped after 1 timing round" in n for n in sp.notes)
    assert all(r.precision == "float" for r in q.tcprec_summary.layers)  # on purpose: no coverage error


def test_timing_batch_repeats_the_calibration_rows():
    t = FakeTimer({}, default=1.0)
    q = _quantize(t, batch=10)
    assert q.tcprec_summary.speed.input_shape == (10, 3, 6, 6)
    assert "at input (10,3,6,6)" in {r.name: r for r in q.tcprec_summary.layers}["0"].reason
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(timing_input(x, 7), torch.cat([x, x, x])[:7])


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match=r"speed_rule must be one of \('off', 'measured'\)"):
        tp.QuantConfig("int8", speed_rule="fast")
    with pytest.raises(ValueError, match="SpeedRule.batch must be a positive int"):
        SpeedRule(batch=0)
    with pytest.raises(ValueError, match="SpeedRule.rounds"):
        SpeedRule(rounds=0)
    for bad in ((0.5, 0.25), (0.0, 1.0), (1.5,), [0.5], ("half",)):
        with pytest.raises(ValueError, match=r"SpeedRule.fallback must be a tuple of increasing shares in \(0, 1\]"):
            SpeedRule(fallback=bad)
    with pytest.raises(TypeError, match="timer must be callable"):
        SpeedRule(timer=3)
    with pytest.raises(ValueError, match="speed_rule mode"):
        SpeedRule("sometimes")
    assert as_speed_rule("off").mode == "off" and tp.QuantConfig("int8").speed_rule.mode == "off"


def test_cpu_model_without_a_timer_is_an_error_not_a_silent_skip():
    with pytest.raises(ValueError, match="CUDA device, but the model is on cpu"):
        tp.quantize_model(_net(), tp.QuantConfig("int8", speed_rule="measured"), calibration=torch.randn(2, 3, 6, 6))


def test_inplace_with_the_rule_is_refused():
    with pytest.raises(ValueError, match="inplace=True cannot be combined"):
        tp.quantize_model(_net(), tp.QuantConfig("int8", speed_rule=SpeedRule(timer=FakeTimer({}))),
                          calibration=torch.randn(2, 3, 6, 6), inplace=True)


# -- self-attention's fused qkv_proj (nn/attention.py: fuse_qkv) ------------------------------------------------

QKV = "layers.0.self_attn.qkv_proj"
QKV_MEMBERS = [f"layers.0.self_attn.{p}_proj" for p in "qkv"]


def _encoder(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


class ShapeTimer(FakeTimer):
    """FakeTimer that also records each side's output shape (what the timed callable computed)."""

    def __init__(self, table, default=1.0):
        super().__init__(table, default)
        self.shapes = {}

    def __call__(self, layer, side, fn):
        y = fn()
        y = y[0] if isinstance(y, tuple) else y
        self.calls.append((layer, side))
        self.shapes[(layer, side)] = tuple(y.shape)
        return self.ms(layer, side)


def _quantize_encoder(table, seed=0, precision="int8"):
    t = ShapeTimer(table)
    cfg = tp.QuantConfig(precision, first_last=None, speed_rule=SpeedRule(timer=t))
    return tp.quantize_model(_encoder(seed), cfg, calibration=torch.randn(2, 5, 32), warn=False), t


def test_fused_qkv_is_timed_as_one_gemm_and_floated_when_slower():
    q, t = _quantize_encoder({(QKV, "quantized"): 2.0, (QKV, "float"): 1.0})
    # round 1 timed the fused module on both sides: the quantized (3E, E) GEMM and the stacked float linear
    assert (QKV, "quantized") in t.calls[:4] and (QKV, "float") in t.calls
    assert t.shapes[(QKV, "quantized")] == t.shapes[(QKV, "float")] == (2, 5, 96)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    want = ("kept fp32: w8a8 2.000 ms > fp32 1.000 ms at input (2,5,32), timed as layers.0.self_attn.qkv_proj "
            "(q_proj/k_proj/v_proj in one GEMM)")
    for n in QKV_MEMBERS:
        assert recs[n].precision == "float" and recs[n].reason == want and recs[n].backend == want
        assert "one float GEMM" in recs[n].out
    assert all(recs[n].precision == "w8a8" for n in ("layers.0.self_attn.out_proj", "layers.0.linear1",
                                                     "layers.0.linear2"))
    # floated, the three run as the one float GEMM that was timed (torch's in_proj), not three
    fused = q.get_submodule(QKV)
    assert type(fused) is nn.Linear and fused.out_features == 96 and fused.tcprec_fused == tuple(QKV_MEMBERS)
    sp = q.tcprec_summary.speed
    assert sp.floated == [QKV] and sp.overrides() == {n: "float" for n in QKV_MEMBERS}
    assert (QKV, "quantized") not in t.calls[8:]  # floated: not timed again in round 2
    assert want in q.tcprec_summary.explain("layers.0.self_attn.k_proj")
    assert "1 of 4 timed layer(s) kept fp32" in q.tcprec_summary.explain()
    with torch.no_grad():  # the float q / k / v: the float model's own in_proj
        mha, x = _encoder(0).layers[0].self_attn, torch.randn(2, 5, 32)
        torch.testing.assert_close(fused(x), torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias))


def test_fused_qkv_stays_quantized_when_faster_and_says_so():
    q, t = _quantize_encoder({(QKV, "quantized"): 0.5, (QKV, "float"): 1.0})
    recs = {r.name: r for r in q.tcprec_summary.layers}
    for n in QKV_MEMBERS:
        assert recs[n].precision == "w8a8"
        assert recs[n].reason.startswith("w8a8 0.500 ms <= fp32 1.000 ms") and "timed as " + QKV in recs[n].reason
    assert type(q.get_submodule(QKV)).__name__ == "QLinear" and not q.tcprec_summary.speed.floated


def test_floated_qkv_persists_through_the_pinned_overrides():
    q, _ = _quantize_encoder({(QKV, "quantized"): 2.0, (QKV, "float"): 1.0})
    pinned = tp.QuantConfig("int8", first_last=None, overrides=q.tcprec_summary.speed.overrides())
    other = tp.quantize_model(_encoder(seed=3), pinned, calibration=torch.randn(2, 5, 32) * 2, warn=False)
    assert type(other.get_submodule(QKV)) is nn.Linear  # the same structure, without timing
    assert_round_trips(q, other, torch.randn(3, 5, 32))


@pytest.mark.parametrize("slow", [(), ("3",)])
def test_adaround_runs_once_on_the_final_layer_set(slow):
    """The first conversion is only timed, without AdaRound; the model returned is the full calibration of the
    final layer set: the same codes as quantize_model with the rule off and those layers pinned float."""
    ada = tp.QuantConfig("w4a8", first_last=None, weight_rounding=tp.nn.calibrate.AdaRound(iters=20))
    t = FakeTimer({**{(n, "float"): 1.0 for n in "0369"}, **{(n, "quantized"): 2.0 for n in slow},
                   (MODEL, "quantized"): 1.0, (MODEL, "float"): 3.0}, default=0.5)
    x = torch.randn(4, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = tp.quantize_model(_net(), replace(ada, speed_rule=SpeedRule(timer=t)), calibration=x)
        want = tp.quantize_model(_net(), replace(ada, overrides=dict.fromkeys(slow, "float")), calibration=x)
    assert q.tcprec_summary.speed.conversions == 2 and q.tcprec_summary.speed.floated == list(slow)
    for n in "0369":
        if n not in slow:
            assert torch.equal(q.get_submodule(n).weight.qw.codes, want.get_submodule(n).weight.qw.codes), n


# -- a torch transformer module with nothing quantized left inside is the user's own module again ------------------

ENC_LINEARS = [f"enc.layers.{i}.{n}" for i in range(2) for n in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "linear1", "linear2")]


class _Wrapped(nn.Module):
    """A 2-layer nn.TransformerEncoder inside a user module, then a head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.enc(x))


class SlowerQuantized(FakeTimer):
    """Every layer 2 ms quantized against 1 ms float, except the ``fast`` ones (0.5 ms quantized); the whole model
    10% faster quantized (past the margin: no fallback)."""

    def __init__(self, fast=()):
        super().__init__({**{(n, "quantized"): 0.5 for n in fast}, (MODEL, "quantized"): 0.9, (MODEL, "float"): 1.0})

    def __call__(self, layer, side, fn):
        fn()
        self.calls.append((layer, side))
        return self.table.get((layer, side), 2.0 if side == "quantized" else 1.0)


def _fast_path_calls(model, *args) -> int:
    """How many times torch's fused encoder-layer kernel ran in one no-grad forward."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(*args)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_transformer_encoder_layer_fwd")


def _rule(model, fast=(), seed=0, timer=None, **kw):
    cfg = tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=timer or SlowerQuantized(fast)), **kw)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(seed + 1))
    return tp.quantize_model(model, cfg, calibration=x, warn=False), x


@pytest.mark.parametrize("where", ["inside a module", "the model itself"])
def test_encoder_measured_slower_everywhere_is_torchs_own_encoder_again(where):
    """Every linear measured slower quantized: the converted model holds an equal copy of the user's
    nn.TransformerEncoder (torch's forward and fast path, what the float model runs), so its output is the float
    model's bit for bit; the summary still lists every linear, float, with the measured reason."""
    model = _Wrapped().eval() if where == "inside a module" else _Wrapped().enc.eval()
    t = SlowerQuantized()
    q, x = _rule(model, timer=t)
    # nothing quantized is left inside a layer: no layer is timed whole, no conversion more than the one that floated
    assert not any(n.endswith(("layers.0", "layers.1")) for n, _ in t.calls) and q.tcprec_summary.speed.conversions == 2
    assert q.tcprec_summary.speed.modules == []
    pre = "enc." if where == "inside a module" else ""
    enc = q.get_submodule(pre[:-1]) if pre else q
    assert type(enc) is nn.TransformerEncoder and all(type(m) is nn.TransformerEncoderLayer for m in enc.layers)
    with torch.no_grad():
        assert torch.equal(q(x), model(x))
    assert _fast_path_calls(q, x) == 2  # torch's fused layer kernel, as in the float model
    recs = {r.name: r for r in q.tcprec_summary.layers}
    for n in (k.removeprefix("enc.") if not pre else k for k in ENC_LINEARS):
        r = recs[n]
        assert r.precision == "float" and r.backend == r.reason, n
        assert r.reason.startswith("kept fp32: w8a8 2.000 ms > fp32 1.000 ms at input (2,5,"), (n, r.reason)
        assert "torch's own TransformerEncoder" in r.out, (n, r.out)
        assert r.reason in q.tcprec_summary.explain(n)
    assert "timed as " + pre + "layers.1.self_attn.qkv_proj" in recs[pre + "layers.1.self_attn.v_proj"].reason
    assert any("kept as the model's own" in n and "TransformerEncoder" in n for n in q.tcprec_summary.notes)
    assert not any("decomposed" in n for n in q.tcprec_summary.notes)
    # the rule's outcome, pinned as overrides, builds the same structure without timing (state_dict loads)
    pinned = tp.QuantConfig("int8", first_last=None, overrides=q.tcprec_summary.speed.overrides())
    other_model = _Wrapped(seed=3).eval() if pre else _Wrapped(seed=3).enc.eval()
    other = tp.quantize_model(other_model, pinned, calibration=x, warn=False)
    assert type(other.get_submodule(pre[:-1]) if pre else other) is nn.TransformerEncoder
    assert_round_trips(q, other, x)


def test_one_linear_faster_quantized_keeps_tcprecs_modules_around_it():
    """Layer 1's fused q/k/v is faster quantized: layer 1 and its attention stay tcprec's (the quantized qkv_proj
    inside), so the encoder does too; layer 0, all float, is torch's own layer.  Layer 1's linear2 alone faster:
    layer 1 stays tcprec's, its attention (all float) is torch's own.  Both times layer 1, timed whole (tcprec's
    module as converted against torch's float layer), is faster quantized (the clock says so for "enc.layers.1"):
    the module-level decision keeps it.

    The two layers are twins, which the rule times once and decides alike (docs/decisions/0159): layer 0's
    q/k/v (then its linear2) is kept float by the config, so layer 1's is timed by itself and can win."""
    t = SlowerQuantized(fast=("enc.layers.1.self_attn.qkv_proj", "enc.layers.1"))
    pinned = {f"enc.layers.0.self_attn.{p}_proj": "float" for p in "qkv"}
    q, x = _rule(_Wrapped().eval(), timer=t, overrides=pinned)
    sp = q.tcprec_summary.speed
    assert [(m.name, m.kind, m.floated) for m in sp.modules] == [("enc.layers.1", "TransformerEncoderLayer", False)]
    assert sp.modules[0].quantized == tuple(f"enc.layers.1.self_attn.{p}_proj" for p in "qkv")
    assert ("enc.layers.1", "quantized") in t.calls and ("enc.layers.1", "float") in t.calls
    assert not any(n == "enc.layers.0" for n, _ in t.calls)  # all float already: not timed whole
    assert sp.conversions == 2 and "torch modules with quantized linears, timed whole: 0 of 1" in "\n".join(sp.lines())
    assert type(q.get_submodule("enc")) is not nn.TransformerEncoder
    assert type(q.get_submodule("enc.layers.0")) is nn.TransformerEncoderLayer
    assert type(q.get_submodule("enc.layers.1")) is not nn.TransformerEncoderLayer
    assert type(q.get_submodule("enc.layers.1.self_attn.qkv_proj")).__name__ == "QLinear"
    recs = {r.name: r for r in q.tcprec_summary.layers}
    quantized = [n for n in ENC_LINEARS if recs[n].precision != "float"]
    assert quantized == [f"enc.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert all(recs[n].reason.startswith("kept fp32: w8a8 2.000 ms") for n in ENC_LINEARS
               if n not in quantized and n not in pinned)
    with torch.no_grad():
        assert q(x).shape == (2, 5, 10)
    assert _fast_path_calls(q, x) == 1  # layer 0

    q, x = _rule(_Wrapped().eval(), fast=("enc.layers.1.linear2", "enc.layers.1"),
                 overrides={"enc.layers.0.linear2": "float"})
    assert type(q.get_submodule("enc.layers.1")) is not nn.TransformerEncoderLayer
    assert type(q.get_submodule("enc.layers.1.linear2")).__name__ == "QLinear"
    assert type(q.get_submodule("enc.layers.1.self_attn")) is nn.MultiheadAttention
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert [n for n in ENC_LINEARS if recs[n].precision != "float"] == ["enc.layers.1.linear2"]
    assert "torch's own MultiheadAttention enc.layers.1.self_attn" in recs["enc.layers.1.self_attn.k_proj"].out


class LayersSlowerWhole(FakeTimer):
    """Every linear faster quantized (0.5 ms against 1 ms float), but the encoder layers in ``slow``, timed whole,
    faster as torch's float layer (2 ms against 3 ms quantized); the other layers faster quantized whole."""

    def __init__(self, slow, whole=("layers.0", "layers.1")):
        super().__init__({(MODEL, "quantized"): 1.0, (MODEL, "float"): 1.0})
        self.slow, self.whole, self.outs = slow, whole, {}

    def __call__(self, layer, side, fn):
        y = fn()
        self.calls.append((layer, side))
        if layer == MODEL:
            return 0.9 if side == "quantized" else 1.0  # (past the margin: no fallback)
        if layer.endswith(self.whole):
            self.outs[(layer, side)] = (y[0] if isinstance(y, tuple) else y).float()
            if layer in self.slow:
                return 3.0 if side == "quantized" else 2.0
            return 1.0 if side == "quantized" else 2.0
        return 0.5 if side == "quantized" else 1.0


@pytest.mark.parametrize("slow", [("enc.layers.0",), ("enc.layers.0", "enc.layers.1")])
def test_a_layer_faster_as_torchs_fused_module_is_torchs_again(slow):
    """Every linear wins quantized layer by layer, but a layer timed whole -- tcprec's module with its quantized
    linears against torch's float layer (its fused forward, which one quantized linear costs it) -- is faster as
    torch's: all its linears are kept float and torch's nn.TransformerEncoderLayer comes back (both: torch's
    nn.TransformerEncoder); the summary says why for each of its linears."""
    t = LayersSlowerWhole(slow)
    q, x = _rule(_Wrapped().eval(), timer=t)
    sp = q.tcprec_summary.speed
    # round 1 timed every distinct linear (layer 1's are layer 0's twins: timed once, as layer 0's, decision 0159)
    # and the head; then each layer whole, once, on both sides; one conversion more
    modules = [c for c in t.calls if c[0] in ("enc.layers.0", "enc.layers.1")]
    assert modules == [(n, s) for n in ("enc.layers.0", "enc.layers.1") for s in ("quantized", "float")]
    layers = t.calls[:t.calls.index(modules[0])]
    assert sorted({n for n, _ in layers}) == sorted(["head", "enc.layers.0.self_attn.qkv_proj",
                                                     *(n for n in ENC_LINEARS[3:6])])
    twins = [lt for lt in sp.layers if lt.name.startswith("enc.layers.1.")]
    assert len(twins) == 4 and all(lt.quant_from == lt.float_from == lt.name.replace(".1.", ".0.") for lt in twins)
    assert t.calls[-2:] == [(MODEL, "quantized"), (MODEL, "float")]
    for n in ("enc.layers.0", "enc.layers.1"):  # both sides computed the whole layer, on the same input
        yq, yf = t.outs[(n, "quantized")], t.outs[(n, "float")]
        assert yq.shape == yf.shape == (2, 5, 32) and (yq - yf).norm() / yf.norm() < 0.05, n
    assert sp.conversions == 2 and sp.floated == []
    assert [(m.name, m.floated) for m in sp.modules] == [(n, n in slow) for n in ("enc.layers.0", "enc.layers.1")]
    mine = [n for n in ENC_LINEARS if n.startswith(slow)]
    assert sp.overrides() == dict.fromkeys(mine, "float")
    recs = {r.name: r for r in q.tcprec_summary.layers}
    for n in ENC_LINEARS:
        r = recs[n]
        if n in mine:
            layer = n[:len("enc.layers.0")]
            want = (f"kept fp32: its TransformerEncoderLayer {layer} as torch's fused module 2.000 ms < quantized "
                    "3.000 ms")
            assert r.precision == "float" and r.reason == want and r.backend == want, (n, r.reason)
            assert "torch's own" in r.out and want in q.tcprec_summary.explain(n)
        else:
            assert r.precision == "w8a8" and r.reason.startswith("w8a8 0.500 ms <= fp32 1.000 ms"), (n, r.reason)
    assert recs["head"].precision == "w8a8"
    assert type(q.get_submodule("enc.layers.0")) is nn.TransformerEncoderLayer
    if len(slow) == 2:
        assert type(q.get_submodule("enc")) is nn.TransformerEncoder
    else:
        assert type(q.get_submodule("enc")) is not nn.TransformerEncoder
        assert type(q.get_submodule("enc.layers.1")) is not nn.TransformerEncoderLayer
        assert type(q.get_submodule("enc.layers.1.linear1")).__name__ == "QLinear"
    assert _fast_path_calls(q, x) == len(slow)
    text = q.tcprec_summary.explain()
    assert f"timed whole: {len(slow)} of 2 faster as torch's float module" in text
    assert f"0 of 9 timed layer(s) kept fp32, and {6 * len(slow)} linear(s) for torch's modules" in text
    with torch.no_grad():  # torch's layers compute what the float model's do: only the quantized rest differs
        assert q(x).shape == (2, 5, 10)
    pinned = tp.QuantConfig("int8", first_last=None, overrides=sp.overrides())
    other = tp.quantize_model(_Wrapped(seed=3).eval(), pinned, calibration=x, warn=False)
    assert type(other.get_submodule("enc.layers.0")) is nn.TransformerEncoderLayer
    assert_round_trips(q, other, x)


class _Attention(nn.Module):
    """A standalone nn.MultiheadAttention (self-attention), then a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        y, _ = self.mha(x, x, x, need_weights=False)
        return self.head(y)


@pytest.mark.parametrize("slow", [True, False])
def test_a_standalone_attention_is_timed_whole_too(slow):
    t = LayersSlowerWhole(("mha",) if slow else (), whole=("mha",))
    q, x = _rule(_Attention().eval(), timer=t)
    sp = q.tcprec_summary.speed
    assert [(m.name, m.kind, m.floated) for m in sp.modules] == [("mha", "MultiheadAttention", slow)]
    yq, yf = t.outs[("mha", "quantized")], t.outs[("mha", "float")]
    assert yq.shape == yf.shape == (2, 5, 32) and (yq - yf).norm() / yf.norm() < 0.05
    assert (type(q.get_submodule("mha")) is nn.MultiheadAttention) == slow
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert all((recs[f"mha.{p}_proj"].precision == "float") == slow for p in ("q", "k", "v", "out"))
    assert recs["head"].precision == "w8a8" and sp.conversions == (2 if slow else 1)
    with torch.no_grad():
        assert q(x).shape == (2, 5, 10)


def test_a_model_without_torch_modules_gets_no_module_timing():
    t = FakeTimer({**{(n, "float"): 1.0 for n in "0369"}, (MODEL, "quantized"): 1.0, (MODEL, "float"): 3.0},
                  default=0.5)
    q = _quantize(t)
    assert sorted(t.calls) == sorted([(n, s) for n in "0369" for s in ("quantized", "float")]
                                     + [(MODEL, "quantized"), (MODEL, "float")])
    assert q.tcprec_summary.speed.conversions == 1 and q.tcprec_summary.speed.modules == []
    assert not any("timed whole" in line for line in q.tcprec_summary.speed.lines())


def test_restoring_torchs_module_does_not_touch_the_users_model():
    model = _Wrapped().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [(n, type(m)) for n, m in model.named_modules()]
    layers = list(model.enc.layers)
    q, _ = _rule(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == kinds and list(model.enc.layers) == layers
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # an equal copy, not the user's objects
    assert q.get_submodule("enc") is not model.enc
    ours = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in ours for p in q.parameters())


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 4)

    def forward(self, tgt, memory):
        return self.head(self.dec(tgt, memory))


def test_decoder_modules_come_back_too_under_the_pinned_overrides():
    """The same for nn.TransformerDecoder and its layers, here through the overrides that pin a rule's outcome (no
    timing): all float -> torch's own decoder, bit-equal to the float model; layer 1's cross-attention quantized ->
    layer 0 is torch's layer, and layer 1's self-attention torch's attention (reading layer 0's restored output)."""
    model = _Decoder().eval()
    cal = {"tgt": torch.randn(2, 5, 16), "memory": torch.randn(2, 7, 16)}
    dec = [f"dec.layers.{i}.{a}.{p}_proj" for i in range(2) for a in ("self_attn", "multihead_attn")
           for p in ("q", "k", "v", "out")] + [f"dec.layers.{i}.linear{j}" for i in range(2) for j in (1, 2)]
    everything = dict.fromkeys(dec + ["head"], "float")
    q = tp.quantize_model(model, tp.QuantConfig("int8", first_last=None, overrides=everything), calibration=cal,
                          warn=False)
    assert type(q.get_submodule("dec")) is nn.TransformerDecoder
    with torch.no_grad():
        assert torch.equal(q(**cal), model(**cal))
    assert sorted(r.name for r in q.tcprec_summary.layers) == sorted(everything)
    cross = [n for n in dec if n.startswith("dec.layers.1.multihead_attn")]
    q = tp.quantize_model(model, tp.QuantConfig("int8", first_last=None, overrides={
        n: "float" for n in dec if n not in cross}), calibration=cal, warn=False)
    assert type(q.get_submodule("dec.layers.0")) is nn.TransformerDecoderLayer
    assert type(q.get_submodule("dec.layers.1.self_attn")) is nn.MultiheadAttention
    assert type(q.get_submodule("dec.layers.1.multihead_attn.out_proj")).__name__ == "QLinear"
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert all(recs[n].precision == "w8a8" for n in cross) and recs["dec.layers.1.linear1"].precision == "float"
    with torch.no_grad():
        assert q(**cal).shape == (2, 5, 4)


def test_chained_depthwise_layer_is_timed_from_the_codes_it_reads_and_floated_when_slower():
    """An MBConv-like block on the INT8 kernels (interpreter): the depthwise layer reads the expand conv's int8 operand
    (the expand conv's epilogue applies its ReLU6), the rule times it from those codes; measured slower, it is
    floated, and the re-conversion gives the expand conv a float output (still with its ReLU6)."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 1), nn.BatchNorm2d(16), nn.ReLU6(),
                      nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(),
                      nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(2, 3, 6, 6)
    seen = []

    class Timer(FakeTimer):
        def __call__(self, layer, side, fn):
            if layer == "3" and side == "quantized":
                seen.append(True)
            return super().__call__(layer, side, fn)

    for slow_dw, want in ((False, "int8 codes uint8 -> 3"), (True, "float32")):
        t = Timer({("3", "quantized"): 2.0 if slow_dw else 0.5, ("3", "float"): 1.0})
        cfg = tp.QuantConfig("int8", backend="int8", first_last=None, speed_rule=SpeedRule(timer=t))
        q = tp.quantize_model(m, cfg, calibration=x, warn=False)
        out = {r.name: r for r in q.tcprec_summary.layers}
        assert out["0"].out == want, out["0"]
        assert (out["3"].precision == "float") == slow_dw
        assert out["0"].fused == ("bn", "clamp(0,6)")
        # the depthwise conv's ReLU6: in its epilogue, or after the floated conv left to the project conv's quantizer
        assert not any(isinstance(mod, nn.ReLU6) for mod in q.modules())
        assert any(n.startswith("5: clamp(0,6)") for n in q.tcprec_summary.notes) == slow_dw
    assert seen  # the depthwise layer was timed quantized (from the chained codes, in the first conversion)
    with torch.no_grad():
        assert torch.isfinite(q(x)).all()


class _MLP(nn.Module):
    def __init__(self, gelu: nn.Module, first: type = nn.Linear):
        super().__init__()
        self.fc1, self.act, self.fc2 = first(16, 64), gelu, nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class OutputTimer(FakeTimer):
    """FakeTimer that keeps each side's output (what the timed callable computed)."""

    def __init__(self, table, default=1.0):
        super().__init__(table, default)
        self.outs = {}

    def __call__(self, layer, side, fn):
        self.outs[(layer, side)] = fn().float()
        return super().__call__(layer, side, lambda: None)


class _SubLinear(nn.Linear):
    pass


class _KeywordMLP(_MLP):
    def forward(self, x):  # the layer called with its input as a keyword (nn/coverage.normalize_graph)
        return self.fc2(self.act(self.fc1(input=x)))


@pytest.mark.parametrize("model", [_MLP, _KeywordMLP])
@pytest.mark.parametrize("first", [nn.Linear, _SubLinear])
def test_a_linear_read_by_gelu_is_timed_with_its_gelu_on_both_sides(model, first):
    """The GELU after a quantized linear is a separate pass in the quantized model and the GEMM's epilogue of the
    float LinearGELU it becomes kept float: both sides are timed with it, so that pass is no longer outside every
    timing.  The erf GELU's minimum is -0.17, so the timed outputs show it was applied; fc2, read by nothing, is
    timed alone."""
    torch.manual_seed(0)
    m = model(nn.GELU(), first).eval()
    t = OutputTimer({("fc1", "quantized"): 2.0, ("fc1", "float"): 1.0})  # fc1 kept float: it becomes LinearGELU
    x = torch.randn(8, 16)
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=t)), calibration=x,
                          warn=False)
    for side in ("quantized", "float"):
        assert t.outs[("fc1", side)].min() >= -0.1701 and t.outs[("fc1", side)].shape == (8, 64)
    assert t.outs[("fc2", "float")].min() < -0.5  # (random input, no activation)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert recs["fc1"].precision == "float" and recs["fc1"].fused == ("gelu",)
    assert recs["fc1"].reason.endswith("with the GELU after it: a pass quantized, the GEMM's epilogue in float")
    assert "GELU" not in recs["fc2"].reason and recs["fc2"].precision == "w8a8"
    with torch.no_grad():
        assert torch.allclose(q(x), m(x), atol=0.05)
    # the tanh GELU is not the erf one: neither fused nor timed with the linear
    t = OutputTimer({})
    tp.quantize_model(_MLP(nn.GELU(approximate="tanh")).eval(),
                      tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=t)),
                      calibration=torch.randn(8, 16), warn=False)
    assert t.outs[("fc1", "float")].min() < -0.5


@pytest.mark.parametrize("bias", [True, False])
def test_an_encoder_with_one_layer_torchs_own_again_runs(bias):
    """Layer 0 all float comes back as torch's nn.TransformerEncoderLayer inside tcprec's encoder, which is called
    with ``is_causal=None`` by default; torch's layer needs a bool there (without bias it takes the slow path, where
    ``scaled_dot_product_attention`` refuses None)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, bias=bias, batch_first=True), 2,
                                  enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    layer0 = {f"layers.0.{n}": "float" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "self_attn.out_proj", "linear1", "linear2")}
    q = tp.quantize_model(model, tp.QuantConfig("int8", first_last=None, overrides=layer0), calibration=x, warn=False)
    assert not any("could not trace" in n for n in q.tcprec_summary.notes)  # (the encoder is the traced root)
    assert type(q.get_submodule("layers.0")) is nn.TransformerEncoderLayer
    assert type(q.get_submodule("layers.1.linear1")).__name__ == "QLinear"
    with torch.no_grad():
        y, ref = q(x), model(x)
    assert y.shape == ref.shape and (y - ref).norm() / ref.norm() < 0.05


def test_the_float_side_runs_each_activation_form_the_kernels_take_and_refuses_others():
    """The float side times what the float model runs: each form of ``parse_act`` (a bare "leaky" is slope 0.1)
    maps to its torch op; a form the kernels do not take is refused (the layer is then left as converted, with the
    reason in the notes), never timed as some other activation."""
    import torch.nn.functional as F

    from tcprec.nn.speed_rule import _act_fn
    y = torch.linspace(-8, 8, 33)
    assert _act_fn(None) is None and _act_fn("relu") is F.relu
    assert _act_fn("hardswish") is F.hardswish and _act_fn("silu") is F.silu
    for act, ref in ((("clamp", 0.0, 6.0), F.relu6(y)), ("leaky", F.leaky_relu(y, 0.1)),
                     (("leaky", 0.2), F.leaky_relu(y, 0.2)), ("leaky_relu", F.leaky_relu(y, 0.1))):
        assert torch.allclose(_act_fn(act)(y), ref), act
    with pytest.raises(ValueError, match="gelu_tanh"):
        _act_fn("gelu_tanh")


@pytest.mark.parametrize("layer, channels_last", [(nn.Conv2d(8, 16, 3, padding=1), True), (nn.Linear(8, 16), False)])
def test_the_float_side_gets_the_layout_the_float_model_runs(layer, channels_last):
    """A conv's float input is channels_last (cuDNN's fast layout, the baseline's); a linear's 4-D input (B, H, W, C)
    (ConvNeXt, Swin) is contiguous, as the permute in front of it leaves it -- channels_last there would make
    F.linear copy it first, timing a pass the float model never runs."""
    from tcprec.nn.speed_rule import _float_fn

    seen = []
    layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    shape = (2, 8, 5, 5) if channels_last else (2, 5, 5, 8)
    _float_fn(layer, nn.Identity(), (), shape, torch.device("cpu"), torch.float32)()
    x = seen[-1]
    assert x.shape == shape and x.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert x.is_contiguous() != channels_last
