"""The CPD reproduction (issue 5): ResNet-18 on Fashion-MNIST, gradients all-reduced across 8 emulated
nodes in fp32, e4m3 and e3m0, with and without APS, over several seeds; test accuracy table.

Runs ``tcprec train`` once per (format, APS, seed), several processes at a time on one GPU (each run is
small: micro-batches of batch/8), then writes ``benchmarks/results/cpd.json`` and prints a Markdown table.

    PYTHONPATH=src python3 benchmarks/bench_cpd_device.py --data-path .carry/fashion-mnist --epochs 2 --seeds 0,1,2

(on the GPU machine; copy the data first, here: `mkdir -p .carry && cp -r /usr/share/datasets/fashion-mnist .carry/`,
and name `.carry` in the device call's carry list)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [("fp32", True), ("e4m3", True), ("e4m3", False), ("e3m0", True), ("e3m0", False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-path", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=5, help="runs at a time on the GPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", default=os.environ.get("OUT", "/tmp/out") + "/cpd_runs")
    ap.add_argument("--out", default="benchmarks/results/cpd.json")
    ap.add_argument("--extra", default="", help="extra arguments for tcprec train (e.g. --limit-train 2048)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = []
    for fmt, aps in CONFIGS:
        for seed in seeds:
            name = f"{fmt}_{'aps' if aps else 'noaps'}_s{seed}"
            out = Path(args.runs) / name
            cmd = [sys.executable, "-m", "tcprec.cli", "train", "--model", "resnet18", "--data", "fashion-mnist",
                   "--data-path", args.data_path, "--grad-format", fmt, "--aps" if aps else "--no-aps",
                   "--nodes", str(args.nodes), "--epochs", str(args.epochs), "--seed", str(seed), "--device", args.device,
                   "--out", str(out), *args.extra.split()]
            jobs.append((name, fmt, aps, seed, out, cmd))
    t0 = time.time()
    running: list = []
    pending = list(jobs)
    logs = Path(args.runs)
    logs.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            j = pending.pop(0)
            f = open(logs / f"{j[0]}.log", "w")
            running.append((j, subprocess.Popen(j[5], stdout=f, stderr=subprocess.STDOUT), f))
        time.sleep(2)
        for r in list(running):
            if r[1].poll() is not None:
                r[2].close()
                running.remove(r)
                print(f"{r[0][0]} exit {r[1].returncode} at {time.time() - t0:.0f} s", flush=True)
    rows = []
    for name, fmt, aps, seed, out, _ in jobs:
        m = out / "metrics.json"
        if m.is_file():
            s = json.loads(m.read_text())
            rows.append(dict(run=name, grad_format=fmt, aps=aps, seed=seed, test_acc=s["final_test_acc"],
                             skipped_steps=s["skipped_steps"], history=s["history"]))
        else:
            tail = (logs / f"{name}.log").read_text()[-800:]
            rows.append(dict(run=name, grad_format=fmt, aps=aps, seed=seed, error=tail))
    summary = []
    for fmt, aps in CONFIGS:
        accs = [r["test_acc"] for r in rows if r["grad_format"] == fmt and r["aps"] == aps and "test_acc" in r]
        summary.append(dict(grad_format=fmt, aps=aps, runs=len(accs),
                            mean=statistics.mean(accs) if accs else None,
                            std=statistics.stdev(accs) if len(accs) > 1 else None,
                            accs=accs))
    import torch

    payload = dict(command="PYTHONPATH=src python3 benchmarks/bench_cpd_device.py " + " ".join(sys.argv[1:]),
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   epochs=args.epochs, nodes=args.nodes, seeds=seeds, wall_s=time.time() - t0, summary=summary, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print("| gradient all-reduce | APS | test accuracy, mean +- std | per seed |")
    print("|---|---|---|---|")
    for s in summary:
        mean = "-" if s["mean"] is None else f"{s['mean']:.4f}"
        std = "" if s["std"] is None else f" +- {s['std']:.4f}"
        print(f"| {s['grad_format']} | {'yes' if s['aps'] else 'no'} | {mean}{std} | "
              f"{', '.join(f'{a:.4f}' for a in s['accs'])} |")
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
