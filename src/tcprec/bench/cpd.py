"""``tcprec bench cpd``: CPD's experiment (issue 5, re-run for issue 44 with the new reduction orders) -- ResNet-18
on Fashion-MNIST, gradients all-reduced across 8 emulated nodes in fp32, e4m3 and e3m0, with and without APS -- one
``tcprec train --task cpd --algorithm A`` process per (case, algorithm, seed), several at a time on one device.

The previous table (``PREVIOUS``: the direct order, 1 epoch, 3 seeds, one H200, commit 583dd70) concluded: with APS
e4m3 matches fp32; without APS e4m3 loses a little and e3m0 collapses (its range is too small for raw gradients);
APS helps most where the format is narrowest.  The targets restate those conclusions for each order run here.
Runs that would overrun ``budget_s`` are stopped and reported as such (the JSON is rewritten after every run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..distributed import ALGORITHMS
from .common import git_commit, write_json

__all__ = ["CASES", "PREVIOUS", "check_options", "summarize", "run"]

CASES = {"fp32": ("fp32", True), "e4m3_aps": ("e4m3", True), "e4m3_noaps": ("e4m3", False),
         "e3m0_aps": ("e3m0", True), "e3m0_noaps": ("e3m0", False)}
# the previous table: benchmarks/results/cpd.json at 583dd70 (direct order, 1 epoch, seeds 0, 1, 2, test accuracy)
PREVIOUS = {"fp32": [0.9004, 0.8979, 0.8961], "e4m3_aps": [0.9031, 0.9025, 0.8959],
            "e4m3_noaps": [0.9023, 0.8924, 0.8893], "e3m0_aps": [0.8884, 0.8864, 0.8803],
            "e3m0_noaps": [0.6659, 0.6830, 0.6885]}
PREVIOUS_SETUP = ("direct order, full training set, 1 epoch, seeds 0-2, batch 256 = 8 nodes x 32, one H200, "
                  "commit 583dd70 (benchmarks/results/cpd.json there)")
MATCH_POINTS = 1.5  # e4m3 + APS "matches fp32": within this many points (previous: +0.2, seed std 0.2-0.4)
RECOVER_POINTS = 5.0  # APS "rescues" e3m0: at least this many points (previous: +20.6)


def check_options(cases: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int], nodes: int,
                  batch_size: int, jobs: int) -> None:
    """ValueError naming the bad value, the allowed set and the fix."""
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise ValueError(f"cases must be a non-empty list from {', '.join(CASES)}, got {list(cases)}")
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise ValueError(f"algorithms must be a non-empty list from {', '.join(ALGORITHMS)}, got {list(algorithms)}")
    if not seeds:
        raise ValueError("seeds must name at least one seed, e.g. --seeds 0")
    if nodes < 1 or batch_size % nodes:
        raise ValueError(f"batch_size must be a multiple of nodes (one micro-batch per node), got batch_size="
                         f"{batch_size}, nodes={nodes}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")


def _runs(cases, algorithms, seeds) -> list[dict]:
    """One run per (case, algorithm, seed); fp32 once per seed (no low-precision sum: the order is moot).
    Seed-major, so a time budget cuts whole extra seeds first."""
    out = []
    for seed in seeds:
        for case in cases:
            for alg in (["-"] if case == "fp32" else algorithms):
                out.append(dict(name=f"{case}_{alg}_s{seed}".replace("_-", ""), case=case, algorithm=alg, seed=seed))
    return out


def _pct(x: float) -> float:
    return round(100 * x, 2)


def summarize(rows: Sequence[dict], algorithms: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """The table (one row per order: mean test accuracy in % over seeds per case; first the previous table, direct
    order) and the previous table's three conclusions as targets, each judged for every order run."""
    acc: dict = {}
    for r in rows:
        if r.get("test_acc") is not None:
            acc.setdefault((r["case"], r["algorithm"]), []).append(r["test_acc"])

    def mean(case, alg):
        a = acc.get((case, "-" if case == "fp32" else alg))
        return statistics.mean(a) if a else None

    summary = [dict(order="direct (previous table)", **{c: _pct(statistics.mean(v)) for c, v in PREVIOUS.items()},
                    seeds=len(PREVIOUS["fp32"]))]
    for alg in algorithms:
        seeds = {r["seed"] for r in rows if r["algorithm"] == alg and r.get("test_acc") is not None}
        summary.append(dict(order=alg, **{c: None if mean(c, alg) is None else _pct(mean(c, alg)) for c in CASES},
                            seeds=len(seeds)))

    def judge(what, prev, fn):
        vals, met = [], []
        for alg in algorithms:
            m = [mean(c, alg) for c in CASES]
            try:
                ok = fn(*m)
            except TypeError:  # a case this conclusion needs did not run (or failed)
                ok = None
            vals.append(f"{alg} {'-' if ok is None else ok[1]}")
            met.append(None if ok is None else ok[0])
        return dict(target=f"{what} (previous table: {prev})", value="; ".join(vals),
                    met=None if None in met else all(met))

    targets = [
        judge(f"e4m3 + APS within {MATCH_POINTS:g} points of fp32", "90.05 vs 89.81",
              lambda f32, e4, e4n, e3, e3n: (e4 >= f32 - MATCH_POINTS / 100, f"{_pct(e4)} vs {_pct(f32)}")),
        judge(f"APS rescues e3m0: >= {RECOVER_POINTS:g} points over no APS", "88.50 vs 67.91",
              lambda f32, e4, e4n, e3, e3n: (e3 - e3n >= RECOVER_POINTS / 100, f"{_pct(e3)} vs {_pct(e3n)}")),
        judge("APS gains more in e3m0 than in e4m3", "+20.59 vs +0.58 points",
              lambda f32, e4, e4n, e3, e3n: (e3 - e3n > e4 - e4n, f"{_pct(e3 - e3n):+} vs {_pct(e4 - e4n):+}")),
    ]
    return summary, targets


def _device(device: str) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def run(cases: Sequence[str] = tuple(CASES), algorithms: Sequence[str] = ("ring", "halving"),
        seeds: Sequence[int] = (0,), epochs: int = 1, limit_train: int | None = None, limit_test: int | None = None,
        nodes: int = 8, batch_size: int = 256, model: str = "resnet18", data: str = "fashion-mnist",
        data_path=None, device: str = "auto", jobs: int = 5, budget_s: float | None = None,
        runs_dir="runs/cpd", out="benchmarks/results/cpd.json", command: str = "tcprec bench cpd",
        console=None) -> dict:
    """Every run as its own ``tcprec train`` process, ``jobs`` at a time; JSON (COMMON.md's convention) to ``out``
    after every finished run; returned."""
    from rich.console import Console

    console = console or Console(stderr=True)
    check_options(cases, algorithms, seeds, nodes, batch_size, jobs)
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    pending = _runs(cases, algorithms, seeds)
    setup = dict(model=model, data=data, epochs=epochs, limit_train=limit_train, limit_test=limit_test, nodes=nodes,
                 batch_size=batch_size, lr=0.05, momentum=0.9, transport="compressed", jobs=jobs, budget_s=budget_s)
    rows: list[dict] = []
    t0 = time.perf_counter()

    def write() -> dict:
        summary, targets = summarize(rows, algorithms)
        res = dict(suite="cpd", command=command, device=_device(device), commit=git_commit(), summary=summary,
                   targets=targets, setup=setup, wall_s=round(time.perf_counter() - t0, 1), rows=rows,
                   previous=dict(setup=PREVIOUS_SETUP, test_acc=PREVIOUS))
        write_json(out, res)
        return res

    running: list = []
    while pending or running:
        over = budget_s is not None and time.perf_counter() - t0 > budget_s
        while pending and len(running) < jobs and not over:
            r = pending.pop(0)
            fmt, aps = CASES[r["case"]]
            where = runs_dir / r["name"]
            cmd = [sys.executable, "-m", "tcprec.cli", "train", "--task", "cpd", "--model", model, "--data", data,
                   "--grad-format", fmt, "--aps" if aps else "--no-aps", "--nodes", str(nodes), "--epochs", str(epochs),
                   "--seed", str(r["seed"]), "--batch-size", str(batch_size), "--device", device, "--out", str(where),
                   "--quiet"]
            cmd += ["--algorithm", r["algorithm"]] if r["algorithm"] != "-" else []
            cmd += ["--data-path", str(data_path)] if data_path else []
            cmd += ["--limit-train", str(limit_train)] if limit_train else []
            cmd += ["--limit-test", str(limit_test)] if limit_test else []
            log = open(runs_dir / f"{r['name']}.log", "w")
            running.append((r, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()),
                            log, time.perf_counter()))
        time.sleep(0.5)
        for item in list(running):
            r, proc, log, started = item
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:  # past the budget: stop it, say so
                proc.terminate()
                proc.wait()
            log.close()
            running.remove(item)
            m = runs_dir / r["name"] / "metrics.json"
            row = dict(r, seconds=round(time.perf_counter() - started, 1))
            if proc.returncode == 0 and m.is_file():
                s = json.loads(m.read_text())
                row.update(test_acc=s["final_test_acc"], skipped_steps=s["skipped_steps"],
                           epoch_s=[round(h["seconds"], 1) for h in s["history"]])
            else:
                row["error"] = ("stopped at the time budget" if over else
                                f"exit code {proc.returncode}: " + (runs_dir / f"{r['name']}.log").read_text()[-1500:])
            rows.append(row)
            console.print(f"{r['name']:24s} " + (f"test acc {row['test_acc']:.4f}" if "test_acc" in row else
                                                 row["error"].splitlines()[0]) + f"  ({row['seconds']:.0f} s)",
                          markup=False)
            write()
        if over and pending:
            rows.extend(dict(p, error="not started: time budget spent") for p in pending)
            pending = []
    res = write()
    console.print(f"wrote {out} ({res['wall_s']:.0f} s)")
    return res
