"""``tcprec bench cpu-train-step``: a CPU training step of CPD's experiment with low-precision gradients (issue 40).

``tcprec train``'s loop: ResNet-18 on 28x28 inputs, batch 256 = 8 emulated nodes x 32, SGD momentum: plain fp32
gradients against gradients all-reduced in e4m3 with APS, on the all-reduce's float32 engine (the default on the
CPU) and on its float64 reference (what ``tcprec train`` ran before: issue 40 item 4; decision 0061).  Each variant
runs in a fresh process (``python -m tcprec.bench.cpu_train_step --child VARIANT``) so its peak RSS is its own; step
time = median of the steps after the first (the first builds tables).

Target (issue 40): the e4m3 step within 3x the fp32 step in time and in peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from ..distributed import ALGORITHMS, EmulatedNodes
from ..train.models import MODELS
from .common import git_commit, write_json

__all__ = ["VARIANTS", "TARGET_RATIO", "check_options", "child", "summarize", "run"]

VARIANTS = {  # name -> (grad format, all-reduce backend)
    "fp32": (None, "auto"),
    "e4m3_aps": ("e4m3", "auto"),
    "e4m3_aps_float64_reference": ("e4m3", "reference"),
}
TARGET_RATIO = 3.0  # e4m3 step / fp32 step, in time and in peak RSS


def check_options(variants: Sequence[str], algorithm: str, model: str, batch: int, nodes: int) -> None:
    """ValueError naming the bad value, the allowed set and the fix."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be a non-empty list from {', '.join(VARIANTS)}, got {list(variants)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if nodes < 1 or batch < nodes or batch % nodes:
        raise ValueError(f"batch must be a positive multiple of nodes (each node takes batch / nodes images), got "
                         f"batch={batch}, nodes={nodes}: pick batch = k * nodes")


def child(variant: str, steps: int, batch: int, nodes: int, algorithm: str, threads: int,
          model: str = "resnet18") -> dict:
    """``steps`` training steps of one variant in this process: step and all-reduce times, peak RSS."""
    torch.set_num_threads(threads)
    fmt, backend = VARIANTS[variant]
    torch.manual_seed(0)
    net = MODELS[model]()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    em = EmulatedNodes(net, n_local=nodes, fmt=fmt, algorithm=algorithm, backend=backend)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    times, reduce_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses, flat = em.node_grads(F.cross_entropy, x, y)
        t1 = time.perf_counter()
        mean, info = em.reduce(flat)
        t2 = time.perf_counter()
        off = 0
        for p in em.params:
            p.grad = mean[off:off + p.numel()].view_as(p)
            off += p.numel()
        opt.step()
        times.append(time.perf_counter() - t0)
        reduce_times.append(t2 - t1)
        del flat, mean
    rest = times[1:] or times
    return dict(variant=variant, step_s=statistics.median(rest), first_step_s=times[0],
                allreduce_s=statistics.median(reduce_times[1:] or reduce_times), steps=steps,
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                backend=getattr(info, "backend", "plain float32 sum"),
                numel=sum(p.numel() for p in em.params), torch_threads=torch.get_num_threads())


def summarize(rows: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """The table (one row a variant, ratios to fp32 where it ran) and the issue-40 targets (where fp32 and e4m3_aps
    both ran) of :func:`child` results."""
    by = {r["variant"]: r for r in rows}
    summary = [dict(variant=r["variant"], step_s=round(r["step_s"], 3), allreduce_s=round(r["allreduce_s"], 3),
                    peak_rss_mb=round(r["peak_rss_mb"]), vs_fp32_time=round(r["step_s"] / by["fp32"]["step_s"], 2)
                    if "fp32" in by else None,
                    vs_fp32_rss=round(r["peak_rss_mb"] / by["fp32"]["peak_rss_mb"], 2) if "fp32" in by else None)
               for r in rows]
    targets = []
    if "fp32" in by and "e4m3_aps" in by:
        t = by["e4m3_aps"]["step_s"] / by["fp32"]["step_s"]
        m = by["e4m3_aps"]["peak_rss_mb"] / by["fp32"]["peak_rss_mb"]
        targets = [{"target": f"e4m3-gradient CPU step <= {TARGET_RATIO:g}x the fp32 step time (issue 40)",
                    "value": f"{t:.2f}x", "met": t <= TARGET_RATIO},
                   {"target": f"e4m3-gradient CPU step peak RSS <= {TARGET_RATIO:g}x the fp32 step's (issue 40)",
                    "value": f"{m:.2f}x", "met": m <= TARGET_RATIO}]
    return summary, targets



def run(variants: Sequence[str] = tuple(VARIANTS), steps: int = 3, reference_steps: int = 2, batch: int = 256,
        nodes: int = 8, algorithm: str = "direct", threads: int = 1, model: str = "resnet18",
        out="benchmarks/results/cpu_train_step.json", command: str = "tcprec bench cpu-train-step",
        console=None) -> dict:
    """Each variant in a fresh process; a table; JSON (COMMON.md's convention) to ``out``; returned."""
    from rich.console import Console

    console = console or Console(stderr=True)
    check_options(variants, algorithm, model, batch, nodes)
    rows = []
    for name in variants:
        cmd = [sys.executable, "-m", "tcprec.bench.cpu_train_step", "--child", name, "--steps",
               str(reference_steps if "reference" in name else steps), "--batch", str(batch), "--nodes", str(nodes),
               "--algorithm", algorithm, "--threads", str(threads), "--model", model]
        res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not line:
            raise RuntimeError(f"variant {name} failed (exit code {res.returncode}):\n{res.stderr[-3000:]}")
        r = json.loads(line[0][len("RESULT "):])
        rows.append(r)
        console.print(f"{name:30s} step {r['step_s']:7.2f} s (all-reduce {r['allreduce_s']:6.2f} s)  peak RSS "
                      f"{r['peak_rss_mb']:7.0f} MB  [{r['backend']}]", markup=False)  # the brackets are text
    summary, targets = summarize(rows)
    numel = rows[0]["numel"]
    res = dict(suite="cpu_train_step", command=command,
               device=f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
                      f"torch {torch.__version__}",
               commit=git_commit(), summary=summary, targets=targets, rows=rows,
               setup=dict(model=f"{model} (28x28, " + (f"{numel / 1e6:.1f}M" if numel >= 100_000 else f"{numel:,}")
                          + " parameters)", batch=batch, nodes=nodes,
                          algorithm=algorithm, steps=steps, reference_steps=reference_steps, threads=threads,
                          timing="median wall time of the steps after the first, one process per variant; "
                                 "peak RSS = ru_maxrss of that process"))
    path = write_json(out, res)
    console.print(f"wrote {path}")
    return res


def _main() -> None:  # one variant in this process: python -m tcprec.bench.cpu_train_step --child NAME ...
    ap = argparse.ArgumentParser(description="one variant of tcprec bench cpu-train-step; prints RESULT {json}")
    ap.add_argument("--child", required=True, choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--algorithm", default="direct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="resnet18")
    a = ap.parse_args()
    print("RESULT " + json.dumps(child(a.child, a.steps, a.batch, a.nodes, a.algorithm, a.threads, a.model)))


if __name__ == "__main__":
    _main()
