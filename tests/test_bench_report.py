"""BENCHMARKS.md is generated from benchmarks/results/*.json (tcprec.bench.report): the committed file must equal the
generator's output, and a results file in the convention renders generically (table, command, device, commit)."""

import json
from pathlib import Path

import pytest

from tcprec.bench import report

ROOT = Path(__file__).resolve().parents[1]


def test_committed_benchmarks_md_is_generated_from_results():
    text = report.render(ROOT / "benchmarks" / "results")
    assert (ROOT / "BENCHMARKS.md").read_text() == text, "re-run `python -m tcprec.bench.report` at the repo root"
    # a reference, not a diary: one short section a results file (tables capped at MAX_ROWS); ~14 lines a suite
    files = len(list((ROOT / "benchmarks" / "results").glob("*.json")))
    assert len(text.splitlines()) < 14 * files


def test_convention_file_renders_generically(tmp_path):
    doc = {"suite": "cast_cpu", "command": "tcprec bench cast --device cpu", "device": "2-core CPU", "commit": "abc1234",
           "summary": [{"format": "e4m3", "GB/s": 1.25, "exact": True}, {"format": "bf16", "GB/s": 2.5, "exact": False}],
           "targets": [{"target": ">= 1 GB/s", "value": "1.25", "met": True}, {"target": "x", "value": "y", "met": None}],
           "detail": {"ignored": [1, 2]}}
    (tmp_path / "cast_cpu.json").write_text(json.dumps(doc))
    (tmp_path / "mystery.json").write_text(json.dumps({"rows": [], "foo": 1}))
    text = report.render(tmp_path)
    assert "## cast_cpu" in text and "`tcprec bench cast --device cpu`" in text and "2-core CPU" in text
    assert "commit: abc1234" in text
    assert "| format | GB/s | exact |" in text and "| e4m3 | 1.25 | yes |" in text and "| bf16 | 2.5 | no |" in text
    assert "- met -- >= 1 GB/s: 1.25" in text and "- (not judged) x: y" in text
    assert "ignored" not in text
    # a file neither in the convention nor known to an adapter is listed with its keys, not dropped
    assert "## mystery" in text and "keys: foo, rows" in text
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 0
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md"), "--check"]) == 0
    (tmp_path / "B.md").write_text("stale\n")
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md"), "--check"]) == 1


def test_long_summaries_are_cut_and_say_so(tmp_path):
    rows = [{"i": i} for i in range(report.MAX_ROWS + 5)]
    (tmp_path / "big.json").write_text(json.dumps({"suite": "big", "summary": rows}))
    text = report.render(tmp_path)
    assert f"| {report.MAX_ROWS - 1} |" in text and f"| {report.MAX_ROWS} |" not in text and "(5 more rows" in text


def test_bad_results_are_named(tmp_path):
    with pytest.raises(ValueError, match="no \\*.json in"):
        report.render(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        report.render(tmp_path)
    (tmp_path / "broken.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="results/broken.json must hold a JSON object, got list"):
        report.render(tmp_path)
