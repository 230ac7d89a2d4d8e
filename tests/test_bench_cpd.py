"""``tcprec train --algorithm`` and ``tcprec bench cpd`` (CPD's experiment in the new reduction orders): the emulated
nodes sum in exactly the order asked for, the suite's JSON follows the results convention with the previous table's
conclusions as targets, bad options are usage errors, and a time budget stops runs instead of overrunning.
Tiny synthetic runs on the CPU; no accuracy or timing is asserted of them."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tcprec.bench import cpd
from tcprec.bench import report
from tcprec.cli import app
from tcprec.distributed import ALGORITHMS, EmulatedNodes, allreduce_lowp
from tcprec.train.cli_impl import train
from tcprec.train.models import MODELS

ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
TINY = ["--data", "synthetic", "--model", "tiny_cnn", "--limit-train", "64", "--limit-test", "32", "--batch-size", "32",
        "--nodes", "8", "--device", "cpu"]


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args], env=ENV)


def test_emulated_nodes_sum_in_the_chosen_order():
    """EmulatedNodes(algorithm=A) puts exactly allreduce_lowp(node gradients, algorithm=A) into p.grad; the orders
    give different bits (else --algorithm would change nothing)."""
    torch.manual_seed(0)
    net = MODELS["tiny_cnn"]()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    got = {}
    for alg in ALGORITHMS:
        em = EmulatedNodes(net, n_local=8, fmt="e4m3", algorithm=alg)
        _, flat = em.node_grads(F.cross_entropy, x, y)
        want, _ = allreduce_lowp(flat, [p.numel() for p in em.params], "e4m3", algorithm=alg)
        em.backward(F.cross_entropy, x, y)
        got[alg] = torch.cat([p.grad.reshape(-1) for p in em.params])
        assert torch.equal(got[alg].view(torch.int32), want.view(torch.int32)), alg
    assert not torch.equal(got["direct"], got["ring"]) and not torch.equal(got["direct"], got["halving"])


def test_train_takes_algorithm_and_rejects_bad_ones(run, tmp_path):
    res = run("train", *TINY, "--algorithm", "halving", "--out", tmp_path, "--quiet", "--json", "-")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["algorithm"] == "halving"
    bad = run("train", *TINY, "--algorithm", "tree", "--out", tmp_path / "b")
    assert bad.exit_code == 2 and "algorithm must be one of ('direct', 'ring', 'halving')" in bad.output
    bad = run("train", *TINY, "--algorithm", "halving", "--kahan", "--out", tmp_path / "c")
    assert bad.exit_code == 2 and "no Kahan compensation" in bad.output
    with pytest.raises(ValueError, match="algorithm must be one of"):
        EmulatedNodes(torch.nn.Linear(2, 2), n_local=2, fmt="e4m3", algorithm="tree")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        train(data="synthetic", algorithm="tree", out_dir=tmp_path / "d")


def test_summary_restates_the_previous_conclusions():
    rows = [dict(case=c, algorithm="-" if c == "fp32" else "ring", seed=0, test_acc=a)
            for c, a in (("fp32", 0.80), ("e4m3_aps", 0.79), ("e4m3_noaps", 0.78), ("e3m0_aps", 0.75),
                         ("e3m0_noaps", 0.40))]
    rows.append(dict(case="e3m0_noaps", algorithm="halving", seed=0, test_acc=0.74))
    summary, targets = cpd.summarize(rows, ["ring", "halving"])
    assert summary[0]["order"] == "direct (previous table)" and summary[0]["e3m0_noaps"] == 67.91
    assert summary[1] == dict(order="ring", fp32=80.0, e4m3_aps=79.0, e4m3_noaps=78.0, e3m0_aps=75.0, e3m0_noaps=40.0,
                              seeds=1)
    assert summary[2]["fp32"] == 80.0 and summary[2]["e4m3_aps"] is None  # fp32 does not depend on the order
    assert [t["met"] for t in targets] == [None, None, None]  # halving lacks cases: not judged
    _, targets = cpd.summarize(rows, ["ring"])
    assert [t["met"] for t in targets] == [True, True, True]
    assert targets[1]["value"] == "ring 75.0 vs 40.0"
    rows[0]["test_acc"] = 0.90  # e4m3 + APS 11 points below fp32: the first conclusion fails
    assert [t["met"] for t in cpd.summarize(rows, ["ring"])[1]] == [False, True, True]


def test_bench_cpd_writes_the_convention(run, tmp_path):
    out = tmp_path / "cpd.json"
    res = run("bench", "cpd", *TINY, "--cases", "fp32,e4m3_aps", "--algorithms", "ring", "--jobs", "2",
              "--runs", tmp_path / "runs", "--json", out, "--quiet")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert {"suite", "command", "device", "commit", "summary", "targets"} <= set(d) and d["suite"] == "cpd"
    assert report.normalize("cpd", d)["summary"] == d["summary"]
    assert d["command"].startswith("tcprec bench cpd --cases fp32,e4m3_aps --algorithms ring")
    assert sorted(r["name"] for r in d["rows"]) == ["e4m3_aps_ring_s0", "fp32_s0"]
    assert all(0 <= r["test_acc"] <= 1 for r in d["rows"]), d["rows"]
    ring = json.loads((tmp_path / "runs" / "e4m3_aps_ring_s0" / "metrics.json").read_text())
    assert ring["config"]["algorithm"] == "ring" and ring["config"]["nodes"] == 8
    assert d["targets"][0]["met"] is not None and d["targets"][1]["met"] is None


def test_bench_cpd_budget_stops_runs(tmp_path):
    res = cpd.run(["e4m3_aps", "e3m0_aps"], ["ring"], [0], limit_train=64, limit_test=32, batch_size=32,
                  model="tiny_cnn", data="synthetic", device="cpu", jobs=1, budget_s=0.1, runs_dir=tmp_path / "r",
                  out=tmp_path / "cpd.json")
    assert [r.get("error") for r in res["rows"]] == ["stopped at the time budget", "not started: time budget spent"]
    assert json.loads(Path(tmp_path / "cpd.json").read_text())["rows"] == res["rows"]


def test_bench_cpd_rejects_bad_options(run):
    for args, msg in ((["--cases", "e2m1_aps"], "cases must be a non-empty list from fp32"),
                      (["--algorithms", "ring,tree"], "algorithms must be a non-empty list from direct"),
                      (["--seeds", "a"], "seeds must be comma-separated integers"),
                      (["--nodes", "3"], "batch_size must be a multiple of nodes")):
        res = run("bench", "cpd", *args)
        assert res.exit_code == 2 and msg in res.output, res.output
