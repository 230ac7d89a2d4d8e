"""CPU training step of CPD's experiment (``tcprec train``'s loop: ResNet-18 on 28x28 inputs, batch 256
= 8 emulated nodes x 32, SGD momentum): plain fp32 gradients against gradients all-reduced in e4m3
with APS, on the all-reduce's float32 engine (the default on the CPU) and on its float64 reference
(what ``tcprec train`` ran before: issue 40 item 4).  Each variant runs in a fresh process so its
peak RSS is its own; step time = median of the steps after the first (the first builds tables).

    PYTHONPATH=src python benchmarks/bench_cpu_train_step.py            # writes benchmarks/results/cpu_train_step.json

Target (issue 40): the e4m3 step within 3x the fp32 step in time and in peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name -> (grad format, all-reduce backend)
    "fp32": (None, "auto"),
    "e4m3_aps": ("e4m3", "auto"),
    "e4m3_aps_float64_reference": ("e4m3", "reference"),
}


def child(variant: str, steps: int, batch: int, nodes: int, algorithm: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import torch.nn.functional as F

    from tcprec.distributed import EmulatedNodes
    from tcprec.train.models import resnet18

    fmt, backend = VARIANTS[variant]
    torch.manual_seed(0)
    net = resnet18()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reference-steps", type=int, default=2, help="steps of the (slow) float64 variant")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--algorithm", default="direct")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every variant (the CI machine's "
                    "cores are shared: multi-threaded timings there measure the contention)")
    ap.add_argument("--out", default="benchmarks/results/cpu_train_step.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        steps = a.reference_steps if "reference" in a.child else a.steps
        print("RESULT " + json.dumps(child(a.child, steps, a.batch, a.nodes, a.algorithm, a.threads)))
        return
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; allowed: {', '.join(VARIANTS)}")
    rows = []
    for name in names:
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(a.steps), "--reference-steps",
               str(a.reference_steps), "--batch", str(a.batch), "--nodes", str(a.nodes), "--algorithm", a.algorithm,
               "--threads", str(a.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        r = json.loads(line[0][7:])
        rows.append(r)
        print(f"{name:30s} step {r['step_s']:7.2f} s (all-reduce {r['allreduce_s']:6.2f} s)  peak RSS "
              f"{r['peak_rss_mb']:7.0f} MB  [{r['backend']}]", flush=True)
    by = {r["variant"]: r for r in rows}
    summary = [dict(variant=r["variant"], step_s=round(r["step_s"], 3), allreduce_s=round(r["allreduce_s"], 3),
                    peak_rss_mb=round(r["peak_rss_mb"]), vs_fp32_time=round(r["step_s"] / by["fp32"]["step_s"], 2)
                    if "fp32" in by else None,
                    vs_fp32_rss=round(r["peak_rss_mb"] / by["fp32"]["peak_rss_mb"], 2) if "fp32" in by else None)
               for r in rows]
    targets = []
    if "fp32" in by and "e4m3_aps" in by:
        t, m = by["e4m3_aps"]["step_s"] / by["fp32"]["step_s"], by["e4m3_aps"]["peak_rss_mb"] / by["fp32"]["peak_rss_mb"]
        targets = [{"target": "e4m3-gradient CPU step <= 3x the fp32 step time (issue 40)", "value": f"{t:.2f}x",
                    "met": t <= 3.0},
                   {"target": "e4m3-gradient CPU step peak RSS <= 3x the fp32 step's (issue 40)", "value": f"{m:.2f}x",
                    "met": m <= 3.0}]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
    import torch

    res = dict(suite="cpu_train_step", command=shlex.join(["python", "benchmarks/bench_cpu_train_step.py"] + sys.argv[1:]),
               device=f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
                      f"torch {torch.__version__}",
               commit=commit, summary=summary, targets=targets, rows=rows,
               setup=dict(model="resnet18 (28x28, 11.2M parameters)", batch=a.batch, nodes=a.nodes,
                          algorithm=a.algorithm, steps=a.steps, reference_steps=a.reference_steps, threads=a.threads,
                          timing="median wall time of the steps after the first, one process per variant; "
                                 "peak RSS = ru_maxrss of that process"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
