"""``tcprec bench models``'s CPU-side logic with a fake runner: argument errors, the JSON convention, the targets.
No torchvision and no GPU here (the real run: tests/gpu/test_speed_rule_gpu.py and the lead's bench command)."""

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tcprec.bench import models as mb
from tcprec.cli import app

CATALOG = ["mobilenet_v2", "resnet50", "vit_b_16"]
SPEED = {("resnet50", "int8"): 1.6, ("resnet50", "w1a2"): 2.0, ("mobilenet_v2", "int8"): 0.9,
         ("mobilenet_v2", "w1a2"): 1.2, ("vit_b_16", "int8"): 1.1, ("vit_b_16", "w1a2"): 1.3}


def fake_measure(name, precisions, batch, seed, console):
    rows = []
    for p in precisions:
        if name == "vit_b_16" and p == "w1a2":
            rows.append({"model": name, "precision": p, "batch": batch, "fp16_ms": 2.0, "error": "ValueError: boom"})
            continue
        sp = SPEED[(name, p)]
        rows.append({"model": name, "precision": p, "batch": batch, "fp16_ms": 2.0, "ms": 2.0 / sp, "speedup": sp,
                     "nrmse_vs_fp32": 0.01, "quantized": 50, "floated_by_rule": 3, "float_other": 1, "setup_s": 1.0})
    return rows, {f"{name}/{p}": {"layers": []} for p in precisions}


def _run(tmp_path, **kw):
    args = dict(models=["resnet50", "mobilenet_v2"], precisions=["int8", "w1a2"], batch=4,
                out=str(tmp_path / "models.json"), console=Console(quiet=True), measure=fake_measure,
                catalog=lambda: CATALOG, env={"gpu": "fake GPU"})
    args.update(kw)
    return mb.run(**args)


def test_json_follows_the_convention(tmp_path):
    payload = _run(tmp_path)
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert on_disk["suite"] == "models" and on_disk["device"] == "fake GPU" and "partial" not in on_disk
    assert {"suite", "command", "device", "commit", "summary", "targets"} <= set(on_disk)
    assert [(r["model"], r["precision"]) for r in on_disk["summary"]] == [
        ("resnet50", "int8"), ("resnet50", "w1a2"), ("mobilenet_v2", "int8"), ("mobilenet_v2", "w1a2")]
    row = on_disk["summary"][0]
    assert set(row) == {"model", "precision", "ms", "fp16_ms", "speedup", "nrmse_vs_fp32", "quantized",
                        "floated_by_rule", "float_other", "commit"}
    assert all(not isinstance(v, (dict, list)) for r in on_disk["summary"] for v in r.values())  # flat rows
    tg = {t["target"]: t for t in payload["targets"]}
    assert tg["resnet50 int8 >= 1.5x fp16"]["met"] is True and tg["resnet50 int8 >= 1.5x fp16"]["value"] == "1.60x"
    assert tg["resnet50 w1a2 >= 2.5x fp16"]["met"] is False
    assert tg["no model slower than fp16 at any precision"]["met"] is False
    assert "mobilenet_v2 int8 0.90x" in tg["no model slower than fp16 at any precision"]["value"]
    conv = tg["every torchvision classification model converts"]  # two of the catalog's models: not judged
    assert conv["met"] is None and "--model all judges this target" in conv["value"]


def test_all_expands_to_the_catalog_and_errors_fail_the_conversion_target(tmp_path):
    payload = _run(tmp_path, models=["all"])
    assert sorted({r["model"] for r in payload["summary"]}) == CATALOG
    conv = next(t for t in payload["targets"] if t["target"].startswith("every"))
    assert conv["met"] is False and "failed: vit_b_16" in conv["value"]
    assert next(r for r in payload["summary"] if "error" in r)["error"] == "ValueError: boom"


def test_only_the_whole_catalog_meets_the_conversion_target(tmp_path):
    """Every model converting is met by a run of the whole catalog; a run of fewer models leaves it unjudged."""
    def ok(name, precisions, *args):  # every model measures as ResNet-50 does
        rows, _ = fake_measure("resnet50", precisions, *args)
        return [dict(r, model=name) for r in rows], {}

    def conv(payload):
        return next(t for t in payload["targets"] if t["target"].startswith("every"))

    assert conv(_run(tmp_path, models=["all"], measure=ok))["met"] is True
    assert conv(_run(tmp_path, models=["resnet50", "vit_b_16"], measure=ok))["met"] is None


def test_a_model_that_fails_to_build_is_a_row(tmp_path):
    def broken(name, *a):
        raise RuntimeError("no such layer")
    payload = _run(tmp_path, measure=broken, models=["resnet50"])
    assert [r["error"] for r in payload["summary"]] == ["RuntimeError: no such layer"] * 2
    assert next(t for t in payload["targets"] if t["target"].startswith("resnet50 int8"))["met"] is None


@pytest.mark.parametrize("kw, match", [
    ({"models": ["resnet5"]}, r"unknown model\(s\) \['resnet5'\]"),
    ({"precisions": ["fp16"]}, "not a quantized precision"),
    ({"precisions": ["int9"]}, "unknown precision 'int9'"),
    ({"batch": 0}, "batch must be a positive int"),
])
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, **kw)


def test_cli_rejects_bad_options_before_needing_a_gpu():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "models", "--precision", "fp16,int8"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "not a quantized precision" in res.output
    res = runner.invoke(app, ["bench", "models", "--batch", "0"], env={"COLUMNS": "200"})
    assert res.exit_code == 2


def test_torchvision_missing_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tv(name, *a, **k):
        if name == "torchvision":
            raise ImportError("No module named 'torchvision'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tv)
    with pytest.raises(ImportError, match="torchvision is not importable here"):
        mb.torchvision_classifiers()


def test_json_is_written_after_every_model(tmp_path):
    seen = []

    def measure(name, *a):
        if seen:  # the second model: the first one's rows are on disk already
            on_disk = json.loads((tmp_path / "models.json").read_text())
            assert on_disk["partial"] == "1 of 2 models" and {r["model"] for r in on_disk["summary"]} == {"resnet50"}
        seen.append(name)
        return fake_measure(name, *a)

    _run(tmp_path, measure=measure)
    assert seen == ["resnet50", "mobilenet_v2"]


def test_resume_keeps_the_models_measured_and_runs_the_others(tmp_path):
    _run(tmp_path, models=["resnet50"])  # a first call (or one cut short)
    seen = []

    def measure(name, precisions, batch, seed, console):
        seen.append(name)
        return fake_measure(name, precisions, batch, seed, console)

    payload = _run(tmp_path, models=["all"], measure=measure, resume=True)
    assert seen == ["mobilenet_v2", "vit_b_16"]  # resnet50 kept from the file, not measured again
    assert sorted({r["model"] for r in payload["summary"]}) == CATALOG
    assert sorted(k for k in payload["details"]) == sorted(f"{m}/{p}" for m in CATALOG for p in ("int8", "w1a2"))
    assert "partial" not in json.loads((tmp_path / "models.json").read_text())
    # a subset of the models and precisions it holds: nothing to measure, and every row of the file stays
    before = json.loads((tmp_path / "models.json").read_text())["rows"]
    payload = _run(tmp_path, models=["resnet50"], precisions=["int8"], measure=measure, resume=True)
    assert len(seen) == 2 and payload["rows"] == before == json.loads((tmp_path / "models.json").read_text())["rows"]
    # without the file: a plain run
    payload = _run(tmp_path, out=str(tmp_path / "new.json"), measure=measure, resume=True)
    assert seen[2:] == ["resnet50", "mobilenet_v2"]


def test_resume_measures_only_the_missing_precisions_and_loses_no_row(tmp_path):
    """One precision at a time into one file (the largest models, whose three precisions outlast a machine loan):
    each run adds its cases, keeps the others' (other precisions, other models), and measures only what is missing."""
    calls = []

    def measure(name, precisions, batch, seed, console):
        calls.append((name, list(precisions)))
        return fake_measure(name, precisions, batch, seed, console)

    _run(tmp_path, models=["resnet50", "mobilenet_v2"], precisions=["int8"], measure=measure, resume=True)
    _run(tmp_path, models=["resnet50"], precisions=["w1a2"], measure=measure, resume=True)
    payload = _run(tmp_path, models=["resnet50", "mobilenet_v2"], precisions=["int8", "w1a2"], measure=measure,
                   resume=True)
    assert calls == [("resnet50", ["int8"]), ("mobilenet_v2", ["int8"]), ("resnet50", ["w1a2"]),
                     ("mobilenet_v2", ["w1a2"])]
    on_disk = json.loads((tmp_path / "models.json").read_text())
    cases = sorted((r["model"], r["precision"]) for r in on_disk["rows"])
    assert cases == sorted((m, p) for m in ("resnet50", "mobilenet_v2") for p in ("int8", "w1a2"))
    assert sorted(on_disk["details"]) == sorted(f"{m}/{p}" for m, p in cases) and payload["rows"] == on_disk["rows"]
    assert "partial" not in on_disk
    # a run of another model into the same file keeps the catalog's rows
    _run(tmp_path, models=["vit_b_16"], precisions=["int8"], measure=measure, resume=True)
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert len(on_disk["rows"]) == 5 and calls[-1] == ("vit_b_16", ["int8"])


def test_resume_keeps_the_files_command_and_judges_all_its_models(tmp_path):
    """A resumed file says how all of it was measured (the first command, then each distinct resuming one), and the
    "every model converts" target counts the file's models, not only the last run's."""
    _run(tmp_path, models=["resnet50", "mobilenet_v2"], command="tcprec bench models --model all --resume")
    payload = _run(tmp_path, models=["vit_b_16"], resume=True, command="tcprec bench models --model vit_b_16 --resume")
    _run(tmp_path, models=["vit_b_16"], resume=True, command="tcprec bench models --model vit_b_16 --resume")
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert on_disk["command"] == "tcprec bench models --model all --resume"
    assert on_disk["resumed_with"] == ["tcprec bench models --model vit_b_16 --resume"]
    converts = next(t for t in payload["targets"] if t["target"].startswith("every torchvision"))
    assert converts["met"] is False and converts["value"].startswith("2 of 3 models")  # (vit_b_16 w1a2 fails)
    assert "listed: 3" in converts["value"] and "failed: vit_b_16" in converts["value"]


@pytest.mark.parametrize("edit, match", [({"batch": 8}, "at batch 4, seed 0"), ({"seed": 1}, "pass the same")])
def test_resume_refuses_a_run_of_another_kind(tmp_path, edit, match):
    _run(tmp_path, models=["resnet50"], **edit)
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, resume=True)
    (tmp_path / "models.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _run(tmp_path, resume=True)


def test_batch_norm_statistics_leave_training_only_branches_out(monkeypatch):
    """build_model's statistics pass runs the model in eval mode with only its batch norms training: a branch that
    runs only in training (inception_v3's auxiliary head fails on 224 x 224 inputs) is not run, and the batch norms
    still get the statistics of the seeded batches."""
    import types

    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x):
            if self.training:
                raise RuntimeError("auxiliary head: needs 299 x 299 inputs")
            return self.bn(self.conv(x))

    tv = types.SimpleNamespace(models=types.SimpleNamespace(get_model=lambda name, weights: Net()))
    monkeypatch.setattr(mb, "_torchvision", lambda: tv)
    m = mb.build_model("fake", seed=0, device="cpu", image=16)
    assert not m.training and not m.bn.training
    assert m.bn.num_batches_tracked.item() == 2
    assert not torch.allclose(m.bn.running_var, torch.ones(4))  # the seeded batches' statistics, not the reset ones


def test_a_zero_initialised_head_gets_default_weights(monkeypatch):
    """torchvision zero-initialises the ViT heads: with seeded weights every output would be 0, the quantized model's
    too, and the NRMSE column an empty 0. build_model gives such a layer torch's default initialisation; the others
    keep the definition's seeded weights."""
    import types

    import torch

    def get_model(name, weights):
        m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6), torch.nn.Linear(6, 3))
        torch.nn.init.zeros_(m[2].weight)
        torch.nn.init.zeros_(m[2].bias)
        return m

    tv = types.SimpleNamespace(models=types.SimpleNamespace(get_model=get_model))
    monkeypatch.setattr(mb, "_torchvision", lambda: tv)
    m = mb.build_model("fake", seed=0, device="cpu", image=2)
    torch.manual_seed(0)
    assert torch.equal(m[1].weight, get_model("fake", None)[1].weight)  # the seeded weights, untouched
    assert m[2].weight.abs().min() > 0
    assert m(torch.randn(4, 3, 2, 2)).abs().min() > 0


def test_a_non_finite_error_is_written_and_read_back(tmp_path):
    """A model whose logits are not finite (seeded Swin-V2's fp16 baseline already is) gives NaN errors: the JSON holds
    them as "nan" (standard JSON), and a resumed run keeps the row and prints its table."""
    def measure(name, precisions, batch, seed, console):
        rows, details = fake_measure(name, precisions, batch, seed, console)
        if name == "resnet50":
            for r in rows:
                r.update(nrmse_vs_fp32=float("nan"), fp16_nrmse_vs_fp32=float("nan"))
        return rows, details

    _run(tmp_path, models=["resnet50"], measure=measure)
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert {r["nrmse_vs_fp32"] for r in on_disk["summary"]} == {"nan"}
    assert {r["fp16_nrmse_vs_fp32"] for r in on_disk["summary"]} == {"nan"}
    console = Console(record=True, width=200)
    payload = _run(tmp_path, models=["resnet50", "mobilenet_v2"], measure=measure, resume=True, console=console)
    assert {r["model"] for r in payload["summary"]} == {"resnet50", "mobilenet_v2"}
    assert "nan" in console.export_text()


def test_the_fp16_model_given_back_is_not_a_slower_row(tmp_path):
    """A row whose model the speed rule gave back (the fp16 model itself) times the baseline against itself: its
    0.998x is noise, said as such, and does not fail "none slower"; a quantized row at 0.998x does."""
    def measure(name, precisions, batch, seed, console):
        rows, det = fake_measure(name, precisions, batch, seed, console)
        for r in rows:
            r.update(speedup=0.998, ms=2.0 / 0.998)
            if name == "mobilenet_v2" or r["precision"] == "w1a2":
                r.update(model_itself=True, quantized=0)
        return rows, det

    def slow_target(payload):
        return next(t for t in payload["targets"] if t["target"].startswith("no model slower"))

    t = slow_target(_run(tmp_path, measure=measure))
    assert t["met"] is False and "1 of 4 cases below 1.0x: resnet50 int8" in t["value"]
    assert "3 case(s) the fp16 model itself, given back by the speed rule (timed 0.998-0.998x" in t["value"]
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert [r.get("model_itself", False) for r in on_disk["summary"]] == [False, True, True, True]
    t = slow_target(_run(tmp_path, models=["mobilenet_v2"], measure=measure))
    assert t["met"] is True and "0 of 2 cases below 1.0x" in t["value"]
    assert mb._case_line(on_disk["rows"][1]).startswith("resnet50 w1a2: 2.004 ms, fp16 2.000 ms, 1.00x (the fp16 model "
                                                         "itself, given back by the speed rule), NRMSE")


def test_shards_share_one_file_and_measure_disjoint_models(tmp_path):
    """Two shards (one a GPU) deal the listed models by position (0/2: the 1st and 3rd of the catalog) and merge
    their rows into one --json file under a lock: what the other shard wrote meanwhile is kept."""
    seen = {0: [], 1: []}

    def shard_measure(k):
        def measure(name, *a):
            seen[k].append(name)
            if k == 0 and name == "mobilenet_v2":  # shard 1 runs to its end while shard 0 measures its first model
                _run(tmp_path, models=["all"], measure=shard_measure(1), resume=True, shard=(1, 2))
                on_disk = json.loads((tmp_path / "models.json").read_text())
                assert {r["model"] for r in on_disk["rows"]} == {"resnet50"} and on_disk["partial"] == "1 of 3 models"
            return fake_measure(name, *a)
        return measure

    payload = _run(tmp_path, models=["all"], measure=shard_measure(0), resume=True, shard=(0, 2))
    assert seen == {0: ["mobilenet_v2", "vit_b_16"], 1: ["resnet50"]}
    on_disk = json.loads((tmp_path / "models.json").read_text())
    assert sorted({r["model"] for r in on_disk["rows"]}) == CATALOG and "partial" not in on_disk
    assert [(r["model"], r["precision"]) for r in payload["rows"]] == [
        ("resnet50", "int8"), ("resnet50", "w1a2"), ("mobilenet_v2", "int8"), ("mobilenet_v2", "w1a2"),
        ("vit_b_16", "int8"), ("vit_b_16", "w1a2")]
    assert sorted(on_disk["details"]) == sorted(f"{m}/{p}" for m in CATALOG for p in ("int8", "w1a2"))
    # a shard over a finished file measures nothing
    assert _run(tmp_path, models=["all"], measure=shard_measure(1), resume=True, shard=(1, 2))["rows"] == payload["rows"]
    assert seen[1] == ["resnet50"]


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_bad_shards_are_refused(tmp_path, text):
    with pytest.raises(ValueError, match=r"--shard must be K/N with 0 <= K < N"):
        mb.parse_shard(text)
    result = CliRunner().invoke(app, ["bench", "models", "--shard", text, "--resume", "--json", str(tmp_path / "m.json")])
    assert result.exit_code == 2 and "--shard must be K/N" in result.output


def test_a_shard_without_resume_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--shard 0/2 needs --resume"):
        _run(tmp_path, shard=(0, 2))
    assert mb.parse_shard("1/4") == (1, 4)


def test_cli_refuses_a_shard_without_resume_before_needing_a_gpu(tmp_path):
    result = CliRunner().invoke(app, ["bench", "models", "--shard", "0/2", "--json", str(tmp_path / "m.json")])
    assert result.exit_code == 2 and "needs --resume" in result.output


def _fake_torchvision(monkeypatch):
    """A stand-in torchvision whose get_model builds a small conv net, and whose catalog is two of them."""
    import types

    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, stride=8, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

    tv = types.SimpleNamespace(models=types.SimpleNamespace(get_model=lambda name, weights: Net(),
                                                            list_models=lambda module: ["net_a", "net_b"]))
    monkeypatch.setattr(mb, "_torchvision", lambda: tv)


def test_convert_only_converts_on_the_cpu_without_timing(tmp_path, monkeypatch):
    """--convert-only: each model converted at each precision and run on the CPU (no GPU, no timing): its own suite,
    rows with NRMSE and layer counts but no ms, the conversion target alone, judged on the whole catalog."""
    _fake_torchvision(monkeypatch)
    out = tmp_path / "models_convert.json"
    payload = mb.run(["all"], ["int8", "w1a2"], batch=2, out=str(out), console=Console(quiet=True), env={},
                     convert_only=True)
    on_disk = json.loads(out.read_text())
    assert on_disk["suite"] == "models_convert" and on_disk["device"] == "cpu"
    assert on_disk["config"]["speed_rule"] is None and on_disk["config"]["batch"] == 2
    assert [(r["model"], r["precision"]) for r in payload["rows"]] == [
        ("net_a", "int8"), ("net_a", "w1a2"), ("net_b", "int8"), ("net_b", "w1a2")]
    for r in payload["rows"]:
        assert "ms" not in r and "error" not in r and r["float_other"] == 0 and r["quantized"] == 2
        assert 0 < r["nrmse_vs_fp32"] < 2
    assert [t["target"] for t in payload["targets"]] == ["every torchvision classification model converts"]
    assert payload["targets"][0]["met"] is True and "2 of 2 models" in payload["targets"][0]["value"]
    assert on_disk["details"]["net_a/int8"]["float"] == {}


def test_convert_only_records_a_failing_conversion_and_resumes_its_own_suite(tmp_path, monkeypatch):
    _fake_torchvision(monkeypatch)

    def quantize_fails(m, cfg, **kw):
        if cfg.precision == "w1a2":
            raise ValueError("no way to quantize this layer")
        return real(m, cfg, **kw)

    real = mb.quantize_model
    monkeypatch.setattr(mb, "quantize_model", quantize_fails)
    out = tmp_path / "models_convert.json"
    payload = mb.run(["all"], ["int8", "w1a2"], batch=2, out=str(out), console=Console(quiet=True), env={},
                     convert_only=True)
    errs = [r for r in payload["rows"] if "error" in r]
    assert [(r["model"], r["precision"]) for r in errs] == [("net_a", "w1a2"), ("net_b", "w1a2")]
    assert errs[0]["error"] == "ValueError: no way to quantize this layer"
    assert payload["targets"][0]["met"] is False and "failed: net_a, net_b" in payload["targets"][0]["value"]
    # a timed run's file is not resumed by a conversion check, nor the other way round
    with pytest.raises(ValueError, match="not a models run"):
        _run(tmp_path, out=str(out), resume=True)
    timed = tmp_path / "models.json"
    _run(tmp_path, out=str(timed))
    with pytest.raises(ValueError, match="not a models_convert run"):
        mb.run(["all"], ["int8", "w1a2"], batch=4, out=str(timed), console=Console(quiet=True), env={},
               convert_only=True, resume=True)


def test_cli_convert_only_needs_no_gpu(monkeypatch, tmp_path):
    _fake_torchvision(monkeypatch)
    out = tmp_path / "c.json"
    res = CliRunner().invoke(app, ["bench", "models", "--convert-only", "--model", "net_b", "--precision", "int8",
                                   "--json", str(out), "--quiet"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["suite"] == "models_convert" and d["config"]["batch"] == 2 and "--convert-only" in d["command"]
    assert [(r["model"], r["precision"]) for r in d["rows"]] == [("net_b", "int8")]
