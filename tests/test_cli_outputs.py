"""What every command shares: --quiet, --json PATH ('-' = stdout and nothing else there), flags shown as
flags, progress through one helper; profile's --sqlite / --html; formats at 80 columns."""

import json
import re
import sqlite3

import pytest
from typer.testing import CliRunner

from tcprec import progress
from tcprec.cli import app, bench_app, tune_app
from tcprec.formats import presets

ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
COMMANDS = [["info"], ["formats"], ["demo"], ["run"], ["profile"], ["solve"], ["train"]] + [
    [group, c.name] for group, sub in (("bench", bench_app), ("tune", tune_app)) for c in sub.registered_commands]
LONG = [c for c in COMMANDS if c not in (["info"], ["formats"])]


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args, env=ENV: runner.invoke(app, list(args), env=env)


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help_shows_flags_as_flags(run, cmd):
    res = run(*cmd, "--help")
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output and "BOOLEAN" not in res.output
    assert "--json" in res.output or cmd == ["formats"]
    assert ("--quiet" in res.output) == (cmd in LONG)


def test_json_dash_keeps_stdout_for_json(run):
    res = run("demo", "--size", "256", "--formats", "e4m3,fp4", "--json", "-")
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)  # the tables went to stderr
    assert {r["format"] for r in payload["rows"]} == {"e4m3", "fp4"}
    assert "e4m3 (float8_e4m3fn)" in res.stderr
    res = run("bench", "cast-cpu", "--numel", "512", "--formats", "e4m3", "--rounding", "nearest", "--reps", "1",
              "--json", "-", "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["suite"] == "cast_cpu"


def test_train_reports_json(run, tmp_path):
    res = run("train", "--data", "synthetic", "--model", "tiny_cnn", "--epochs", "1", "--limit-train", "64",
              "--limit-test", "32", "--batch-size", "32", "--nodes", "2", "--out", str(tmp_path), "--quiet",
              "--json", "-")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep == json.loads((tmp_path / "metrics.json").read_text())
    assert len(rep["history"]) == 1


def test_bench_suites_take_json_and_old_out(run, tmp_path):
    for name in ("--json", "--out"):
        res = run("bench", "cast-cpu", "--numel", "256", "--formats", "fp4", "--rounding", "nearest", "--reps", "1",
                  name, str(tmp_path / f"c{name}.json"), "--quiet")
        assert res.exit_code == 0, res.output
        payload = json.loads((tmp_path / f"c{name}.json").read_text())
        assert "--json" in payload["command"]  # the command recorded in the JSON is the current spelling


def test_profile_sqlite_html_json(run, tmp_path):
    db, page = tmp_path / "p.sqlite", tmp_path / "p.html"
    res = run("profile", "--model", "alexnet", "--precision", "fp32", "--batch", "1", "--warmup", "0", "--iters", "1",
              "--sqlite", str(db), "--html", str(page), "--json", "-", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert f"wrote the SQLite profile to {db}" in res.stderr and f"wrote the HTML report to {page}" in res.stderr
    conn = sqlite3.connect(db)
    per_layer = dict(conn.execute("SELECT layer, SUM(duration) / 1e6 FROM TCPREC_KERNELS WHERE layer IS NOT NULL "
                                  "GROUP BY layer"))
    layers = {lay["name"]: lay["ms"] for lay in rep["layers"]}
    assert set(per_layer) <= set(layers) and "features.0" in per_layer
    assert all(per_layer[k] <= layers[k] * (1 + 1e-9) + 1e-6 for k in per_layer)
    assert "features.0" in page.read_text()


@pytest.mark.parametrize("opt, value, match", [("--sqlite", "{tmp}", "is a folder"),
                                               ("--sqlite", "{tmp}/no/p.sqlite", "does not exist"),
                                               ("--html", "{tmp}/p.pdf", "must end in .html or .htm"),
                                               ("--trace", "{tmp}/t.txt", "must end in .json")])
def test_profile_bad_paths_fail_before_running(run, tmp_path, opt, value, match):
    res = run("profile", "--precision", "fp32", opt, value.format(tmp=tmp_path))
    assert res.exit_code == 2 and match in res.output, res.output


def test_profile_trace_says_where(run, tmp_path):
    trace = tmp_path / "t.json"
    res = run("profile", "--model", "alexnet", "--precision", "fp32", "--batch", "1", "--warmup", "0", "--iters", "1",
              "--trace", str(trace), "--quiet")
    assert res.exit_code == 0, res.output
    assert trace.is_file() and f"wrote the Chrome trace to {trace}" in res.stderr.replace("\n", " ")
    assert "USDT" not in res.stderr


def test_formats_at_80_columns_cuts_no_word(run):
    res = run("formats", env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0
    assert "…" not in res.output and max(len(line) for line in res.output.splitlines()) <= 80
    words = set(re.findall(r"[\w.+-]+", res.output))
    for name in presets():
        assert str(presets()[name]) in words  # every canonical name whole, on one line
    assert "not shown at 80 columns" in res.output
    wide = run("formats", env=ENV)
    assert "not shown" not in wide.output and "min sub" in wide.output


def test_quiet_context_silences_every_bar(capsys):
    with progress.quiet():
        with progress.bar(2, "a") as b:
            assert b._progress.disable
            with progress.bar(1, "nested") as inner:  # nested bars share the display
                inner.advance()
    with progress.bar(2, "b") as b, progress.bar(1, "inner") as inner:
        assert not b._progress.disable and inner._progress is b._progress
    assert list(progress.track(iter([1, 2]), "x", quiet=True)) == [1, 2]


def test_run_reports_json(run, tmp_path):
    out = tmp_path / "y.npy"
    res = run("run", "--model", "alexnet", "--precision", "fp32", "--device", "cpu", "--out", str(out), "--quiet",
              "--json", "-")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["model"] == "alexnet" and rep["precision"] == "fp32" and rep["output"] == str(out) and out.is_file()
    assert 0.0 <= rep["nrmse_vs_fp32"] < 1e-5  # fp32 against the fp32 reference: summation order only
    assert [lay["name"] for lay in rep["profile"]["layers"]][0] == "features.0"


def test_bracketed_text_in_reasons_is_printed_not_taken_as_markup(run, monkeypatch):
    """A reason such as 'pip install "tcprec[cuda]"' reaches the user whole (rich would drop "[cuda]" as a tag)."""
    import tcprec.cli as cli

    monkeypatch.setattr(cli, "choose_cast_backend", lambda x: ("reference", 'no triton; pip install "tcprec[cuda]"'))
    res = run("demo", "--size", "256", "--formats", "e4m3", "--quiet")
    assert res.exit_code == 0, res.output
    assert 'pip install "tcprec[cuda]"' in res.output
