"""``tcprec bench transformer``'s logic on the CPU with a fake clock (whole models) and a fake speed-rule timer
(layers): the rows with the speed rule on and off, the layers it kept fp16 in the JSON, the two targets.  No real
timing here (the real run: the lead's GPU command on an H200)."""

import json

import pytest
from rich.console import Console

from tcprec.bench import transformer as xf
from tcprec.nn.speed_rule import MODEL

QKV0 = "layers.0.self_attn.qkv_proj"


class Clock:
    """Whole-model ms in call order (fp16 first, then each variant with its paired fp16); runs each side once."""

    def __init__(self, ms):
        self.ms = list(ms)
        self.sides = []

    def __call__(self, *fns):
        self.sides.append(len(fns))
        for f in fns:
            f()
        got = [self.ms.pop(0) for _ in fns]
        return got[0] if len(fns) == 1 else tuple(got)


def rule_timer(layer, side, fn):
    """The first layer's fused q/k/v is slower quantized, and so is layer 1's, its twin, which takes layer 0's timing
    (the rule times identical layers once: docs/decisions/0159); every other layer ties (stays quantized); the whole
    model 10% faster quantized (past SpeedRule.margin: no fallback)."""
    fn()
    return {(QKV0, "quantized"): 2.0, (QKV0, "float"): 1.0, (MODEL, "quantized"): 0.9}.get((layer, side), 1.0)


def _run(tmp_path, ms, clock=None, **kw):
    return xf.run(d_model=32, heads=4, seq=5, batch=4, layers=2, out=str(tmp_path / "t.json"),
                  console=Console(quiet=True), clock=clock or Clock(ms), rule_timer=rule_timer, **kw)


def test_rule_on_and_off_rows_kept_layers_and_targets(tmp_path):
    clock = Clock([10.0, 7.0, 10.0, 12.0, 10.0, 11.0, 10.5, 13.0, 9.0])
    payload = _run(tmp_path, None, clock=clock, rule_off=True)
    assert clock.sides == [1, 2, 2, 2, 2] and not clock.ms  # each variant timed with its own fp16 twin
    d = json.loads((tmp_path / "t.json").read_text())
    assert {"suite", "command", "device", "commit", "summary", "targets"} <= set(d) and d["suite"] == "transformer"
    assert "not a speed figure" in d["device"]
    rows = d["summary"]
    assert [(r["precision"], r["speed_rule"]) for r in rows] == [
        ("fp16", "-"), ("int8", "on"), ("fp8", "on"), ("int8", "off"), ("fp8", "off")]
    assert all(not isinstance(v, (dict, list)) for r in rows for v in r.values())  # flat rows
    assert [r["ms"] for r in rows] == [10.0, 7.0, 12.0, 11.0, 13.0]
    assert [r.get("fp16_ms") for r in rows[1:]] == [10.0, 10.0, 10.5, 9.0]  # the paired fp16 time: its ratio's base
    assert rows[3]["speedup_vs_fp16"] == pytest.approx(10.5 / 11.0)
    qkv = [f"layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"]
    for p in ("int8", "fp8"):  # the rule kept both layers' q/k/v fp16 (the fake clock: slower), nothing with it off
        assert d["kept_fp16"][f"{p}/rule on"] == qkv and d["kept_fp16"][f"{p}/rule off"] == []
        reasons = [r["reason"] for r in d["details"][f"{p}/rule on"]["layers"]]
        assert any("timed as " + QKV0 in r for r in reasons)
        assert any("the times of " + QKV0 + ", an identical layer" in r for r in reasons)  # layer 1's
    on = {r["precision"]: r for r in rows if r["speed_rule"] == "on"}
    assert on["int8"]["kept_fp16"] == 6 and on["int8"]["quantized"] == 6
    assert all(0 < r["nrmse_vs_fp32"] < 0.1 for r in rows[1:]), rows
    tg = {t["target"]: t for t in payload["targets"]}
    main = tg["int8 >= 1.3x fp16 (d_model 32, 4 heads, seq 5, batch 4)"]
    assert main["met"] is True and main["value"] == "1.43x (speed rule on)"
    never = tg["no precision slower than fp16 (speed rule on)"]
    assert never["met"] is False and "fp8 0.83x (6 kept fp16)" in never["value"]


def test_targets_met_and_not_measured():
    rows = [{"precision": "fp16", "speed_rule": "-", "speedup_vs_fp16": 1.0},
            {"precision": "int8", "speed_rule": "on", "speedup_vs_fp16": 1.2, "kept_fp16": 0},
            {"precision": "fp8", "speed_rule": "on", "speedup_vs_fp16": 1.0, "kept_fp16": 4},
            {"precision": "int8", "speed_rule": "off", "speedup_vs_fp16": 0.8, "kept_fp16": 0}]
    t = xf._targets(rows, 768, 12, 197, 64)
    assert t[0]["met"] is False and t[0]["value"] == "1.20x (speed rule on)"
    assert t[1]["met"] is True  # the rule-off row (0.8x) is not judged: the rule is the deployed config
    failed = xf._targets(rows[:2] + [{"precision": "fp8", "speed_rule": "on", "error": "boom"}], 768, 12, 197, 64)
    assert failed[1]["met"] is False and "failed: fp8" in failed[1]["value"]
    none = xf._targets([{"precision": "int8", "speed_rule": "on", "error": "boom"}], 768, 12, 197, 64)
    assert none[0]["met"] is None and none[0]["value"] == "not measured"


def test_clock_and_rule_timer_come_together(tmp_path):
    with pytest.raises(ValueError, match="clock and rule_timer are given together"):
        xf.run(d_model=32, heads=4, seq=5, batch=2, layers=1, out=str(tmp_path / "t.json"),
               console=Console(quiet=True), clock=Clock([1.0]))
