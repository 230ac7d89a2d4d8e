"""Device benchmark of panel_cluster.cu (issue 6): one partially pivoted LU leaf per launch of one cluster,
against cuSOLVER's getrf on the same leaf, in the same run: GPU time a launch from a CUDA graph of 20 x
(restore the leaf, factor it), minus a graph of the 20 restores alone (CUDA events, median of 5 replays).
Block 0's in-kernel cycle counters split one launch into phases (us a column at the SM clock).

    PYTHONPATH=src python3 benchmarks/bench_panel_cluster_device.py [--out benchmarks/results/panel_cluster.json]

Rows: leaf height m, width w, variant (width, rows a thread, cluster: the fewest rows a thread that hold the
leaf, for each cluster size) -> us a launch, us a column, getrf us, block 0's phases.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tcprec.bench.solve import environment
from tcprec.kernels.cuda import panel_cluster as P
from tcprec.linalg.lu import _getrf_lib


PHASES = ("load", "search", "publish", "barrier", "winner", "update", "writeback", "swaps")


def _clock_ghz() -> float:
    """The SM clock now (pynvml through torch), else H100/H200's boost clock 1.98 GHz."""
    try:
        return float(torch.cuda.clock_rate()) / 1e3
    except Exception:  # noqa: BLE001
        return 1.98


def _graph_us(body, repeats=20) -> float:
    """GPU us of one ``body()`` from a CUDA graph of ``repeats`` calls (median of 5 replays)."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeats):
            body()
    g.replay()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / repeats)
    return statistics.median(ts)


def _time(fn, reset) -> float:
    def body():
        reset()
        fn()

    return _graph_us(body) - _graph_us(reset)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/panel_cluster.json")
    ap.add_argument("--sizes", default="32768,16384,8192,4096,2048")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for m in (int(s) for s in args.sizes.split(",")):
        for w in P.WIDTHS:
            A = torch.randn(m + 1, w, device=dev)
            A[m] = 0
            W = A.clone()
            ipiv = torch.zeros(w, dtype=torch.int32, device=dev)
            reset = lambda: W.copy_(A)  # noqa: E731
            clock_ghz = _clock_ghz()
            with _getrf_lib(dev, "cusolver"):
                t_getrf = _time(lambda: torch.linalg.lu_factor_ex(W[:m]), reset)
            for c in P.CLUSTERS:
                try:
                    v = P.pick_variant(m, w, cluster=c)
                except ValueError:
                    continue
                try:
                    us = _time(lambda: P.panel_cluster(W, 0, 0, m, w, m, ipiv, variant=v), reset)
                    prof = torch.zeros(v.cluster, 8, dtype=torch.int64, device=dev)
                    reset()
                    P.panel_cluster(W, 0, 0, m, w, m, ipiv, variant=v, prof=prof)
                    phases = [round(float(x) / clock_ghz / 1e3 / w, 3) for x in prof[0].tolist()]
                except Exception as e:  # noqa: BLE001 (a cluster that cannot be scheduled: say so, go on)
                    print(f"m={m} w={w} {v}: {type(e).__name__}: {e}", flush=True)
                    continue
                rows.append({"m": m, "w": w, "variant": str(v), "us": round(us, 2), "us_per_column": round(us / w, 3),
                             "getrf_us": round(t_getrf, 2), "block0_us_per_column_by_phase": dict(zip(PHASES, phases))})
                print(f"m={m:6d} w={w:2d} {str(v):14s} {us:8.1f} us  {us / w:6.3f} us/col   getrf {t_getrf:8.1f} us  "
                      f"block 0 us/col: " + " ".join(f"{k}={x}" for k, x in zip(PHASES, phases)), flush=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(dev), "command": "PYTHONPATH=src python3 "
                   "benchmarks/bench_panel_cluster_device.py", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
