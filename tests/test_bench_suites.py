"""The suites that were scripts in benchmarks/ (decision 0031): ``tcprec bench fp8-accuracy`` (GPU),
``cpu-memory-time`` and ``cpu-train-step`` (CPU), run through the CLI at tiny sizes: the JSON they write follows
the results convention (the keys tcprec.bench.report reads), its command is the CLI command, and bad options are
usage errors that name the value and the allowed set.  No timings are asserted."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tcprec.bench import cpu_memory_time as cmt
from tcprec.bench import cpu_train_step as cts
from tcprec.bench import report
from tcprec.cli import app

ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
NO_CUDA = not torch.cuda.is_available()
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CONVENTION = {"suite", "command", "device", "commit", "summary", "targets"}


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args], env=ENV)


def _convention(path: Path, suite: str) -> dict:
    d = json.loads(path.read_text())
    assert CONVENTION <= set(d) and d["suite"] == suite
    assert all(isinstance(r, dict) and all(not isinstance(v, (dict, list)) for v in r.values()) for r in d["summary"])
    assert all(set(t) == {"target", "value", "met"} for t in d["targets"])
    assert report.normalize(path.stem, d)["summary"] == d["summary"]  # rendered generically, no adapter
    return d


# ------------------------------------------------------------------------------------------------ fp8-accuracy (GPU)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal shown without a GPU (tests/gpu runs the suite)")
def test_fp8_accuracy_refuses_without_a_gpu(run, tmp_path):
    res = run("bench", "fp8-accuracy", "--nets", "resnet18", "--batch", 1, "--out", tmp_path / "f.json")
    assert res.exit_code == 2, res.output
    assert "tcprec bench fp8-accuracy needs a CUDA GPU;" in res.output
    assert not (tmp_path / "f.json").exists()


def test_fp8_accuracy_bad_options(run):
    res = run("bench", "fp8-accuracy", "--nets", "resnet18,resnet50")
    assert res.exit_code == 2 and "'resnet50' is not one of alexnet, vgg, resnet18, yolov2-tiny" in res.output
    res = run("bench", "fp8-accuracy", "--first-last", "int9")
    assert res.exit_code == 2 and "int9" in res.output and "'none'" in res.output
    assert run("bench", "fp8-accuracy", "--batch", 0).exit_code == 2


# ------------------------------------------------------------------------------------------------ cpu-memory-time


def test_cpu_memory_time_writes_the_convention(run, tmp_path):
    out = tmp_path / "cmt.json"
    res = run("bench", "cpu-memory-time", "--cases", "linear_64x32", "--out", out)
    assert res.exit_code == 0, res.output
    d = _convention(out, "cpu_memory_time")
    assert d["command"] == f"tcprec bench cpu-memory-time --cases linear_64x32 --json {out}"
    assert [r["case"] for r in d["summary"]] == ["linear_64x32"]
    det = d["detail"]["linear_64x32"]
    assert det["weights_fp32_mb"] == round((64 * 32 + 32) * 4 / 2**20, 1) and det["convert_peak_above_before_mb"] >= 0
    assert [t["target"] for t in d["targets"]] == ["quantize_model peak <= 3x fp32 weights (linear_64x32)"]
    assert d["targets"][0]["met"] == (det["convert_peak_x_weights"] <= 3) and d["baseline"] is None


@pytest.mark.parametrize("case,mode", [("emulated_linear_e5m10", "fma"), ("emulated_linear_chunk_e5m10", "chunk")])
def test_cpu_memory_time_one_case_in_process(run, case, mode):
    res = run("bench", "cpu-memory-time", "--case", case, "--emulated-features", 4, "--emulated-batch", 2)
    assert res.exit_code == 0, res.output
    r = json.loads(res.output.strip().splitlines()[-1])
    assert (r["features"], r["batch"], r["acc"], r["mode"]) == (4, 2, "e5m10", mode)
    assert r["plain_ms"] > 0 and r["emulated_ms"] > 0


def test_cpu_memory_time_summary_reproduces_the_committed_results():
    d = json.loads((RESULTS / "cpu_memory_time.json").read_text())
    base = (d.get("baseline") or {}).get("detail")
    for det in [d["detail"]] + ([base] if base else []):  # results written before these keys: the defaults
        for v in det.values():
            if "ratio" in v:
                v.setdefault("features", 256), v.setdefault("batch", 64), v.setdefault("acc", "e5m10")
    assert cmt.summarize(d["detail"], base) == (d["summary"], d["targets"])


def test_cpu_memory_time_bad_options(run, tmp_path):
    res = run("bench", "cpu-memory-time", "--cases", "linear_9216x4096,resnet")
    assert res.exit_code == 2 and "unknown case 'resnet'" in res.output and "linear_<in>x<out>" in res.output
    res = run("bench", "cpu-memory-time", "--case", "emulated_linear_e9m9x")
    assert res.exit_code == 2 and "'e9m9x' is not a format" in res.output
    res = run("bench", "cpu-memory-time", "--cases", "linear_0x4")
    assert res.exit_code == 2 and "unknown case 'linear_0x4'" in res.output
    res = run("bench", "cpu-memory-time", "--baseline", tmp_path)
    assert res.exit_code == 2 and "holds no tcprec package" in res.output


# ------------------------------------------------------------------------------------------------ cpu-train-step


def test_cpu_train_step_writes_the_convention(run, tmp_path):
    out = tmp_path / "cts.json"
    res = run("bench", "cpu-train-step", "--variants", "e4m3_aps", "--model", "tiny_cnn", "--batch", 4, "--nodes", 2,
              "--steps", 2, "--out", out)
    assert res.exit_code == 0, res.output
    d = _convention(out, "cpu_train_step")
    assert d["command"] == ("tcprec bench cpu-train-step --steps 2 --reference-steps 2 --batch 4 --nodes 2 "
                            f"--algorithm direct --variants e4m3_aps --threads 1 --model tiny_cnn --json {out}")
    assert [r["variant"] for r in d["summary"]] == ["e4m3_aps"] and d["summary"][0]["vs_fp32_time"] is None
    assert d["targets"] == []  # the targets compare with fp32, which did not run
    row = d["rows"][0]
    assert row["steps"] == 2 and row["numel"] == sum(p.numel() for p in cts.MODELS["tiny_cnn"]().parameters())
    assert "float32" in row["backend"] and d["setup"]["nodes"] == 2
    assert f"[{row['backend']}]" in res.output  # printed as text, not eaten as rich markup


def test_cpu_train_step_targets_from_in_process_variants():
    rows = [cts.child(v, steps=2, batch=4, nodes=2, algorithm="direct", threads=1, model="tiny_cnn")
            for v in ("fp32", "e4m3_aps")]
    summary, targets = cts.summarize(rows)
    assert [r["variant"] for r in summary] == ["fp32", "e4m3_aps"] and summary[0]["vs_fp32_time"] == 1.0
    ratio = rows[1]["step_s"] / rows[0]["step_s"]
    assert targets[0]["value"] == f"{ratio:.2f}x" and targets[0]["met"] == (ratio <= cts.TARGET_RATIO)


def test_cpu_train_step_summary_reproduces_the_committed_results():
    d = json.loads((RESULTS / "cpu_train_step.json").read_text())
    assert cts.summarize(d["rows"]) == (d["summary"], d["targets"])


def test_cpu_train_step_bad_options(run):
    res = run("bench", "cpu-train-step", "--variants", "fp32,bf16")
    assert res.exit_code == 2 and "['fp32', 'bf16']" in res.output and "e4m3_aps_float64_reference" in res.output
    res = run("bench", "cpu-train-step", "--algorithm", "tree")
    assert res.exit_code == 2 and "algorithm must be one of" in res.output and "'tree'" in res.output
    res = run("bench", "cpu-train-step", "--model", "resnet50")
    assert res.exit_code == 2 and "model must be one of resnet18, vgg, tiny_cnn" in res.output
    res = run("bench", "cpu-train-step", "--batch", 10, "--nodes", 4)
    assert res.exit_code == 2 and "batch=10, nodes=4" in res.output


def test_the_recorded_commit_can_be_given(monkeypatch):
    """A copy of a working tree whose .git is older (a remote GPU machine) records the commit it is given."""
    from tcprec.bench.common import git_commit

    monkeypatch.setenv("TCPREC_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("TCPREC_COMMIT")
    assert git_commit() != "abc1234"
