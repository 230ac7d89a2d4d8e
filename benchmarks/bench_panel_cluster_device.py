"""Device benchmark of panel_cluster.cu (issue 6): one partially pivoted LU leaf per launch of one cluster,
against cuSOLVER's getrf on the same leaf, in the same run: GPU time a launch from a CUDA graph of 20 x
(restore the leaf, factor it), minus a graph of the 20 restores alone (CUDA events, median of 5 replays).
Block 0's in-kernel cycle counters split one launch into phases (us a column at the SM clock).  Last, the latency
floor of the exchange alone (block barrier, candidates through distributed shared memory, cluster barrier) a step.

    PYTHONPATH=src python3 benchmarks/bench_panel_cluster_device.py [--out benchmarks/results/panel_cluster.json]

Rows: leaf height m, width w, variant (width, rows a thread, cluster: the fewest rows a thread that hold the
leaf, for each cluster size) -> us a launch, us a column, getrf us, block 0's phases.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from tcprec.bench.common import time_graph_ms
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


def _time(fn, reset) -> float:
    def body():
        reset()
        fn()

    return (time_graph_ms(body, calls=20) - time_graph_ms(reset, calls=20)) * 1e3


# The latency floor of the kernel's exchange: `steps` iterations of (block barrier, every block's candidate -- 4 + 16
# words -- stored into every block's shared memory, cluster barrier, a read of the slots), nothing else.
_FLOOR_SRC = r"""
extern "C" __global__ void floor_kernel(int steps, unsigned* out) {
    __shared__ unsigned slot[2][16][20];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    unsigned nblk;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(nblk));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    unsigned acc = 0;
    for (int j = 0; j < steps; ++j) {
        __syncthreads();
        if (warp < (int)nblk && lane < 20) {
            unsigned a = (unsigned)__cvta_generic_to_shared(&slot[j & 1][rank][lane]), r;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"((unsigned)warp));
            asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(r), "r"(acc + j) : "memory");
        }
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        acc += slot[j & 1][lane & 15][0];
    }
    if (threadIdx.x == 0) out[rank] = acc;
}
"""


def barrier_floor(dev) -> list:
    """us a step of the bare exchange (no search, no elimination) for each cluster size, 512 threads a block."""
    from tcprec.kernels.cuda.loader import _stream_for, cuda_core_api, set_kernel_attribute

    Program, ProgramOptions, ObjectCode, Device, LaunchConfig, _, launch = cuda_core_api()
    Device(dev.index or 0).set_current()
    obj = Program(_FLOOR_SRC, code_type="c++", options=ProgramOptions(arch="sm_90a", std="c++17")).compile("cubin")
    k = ObjectCode.from_cubin(bytes(obj.code)).get_kernel("floor_kernel")
    set_kernel_attribute(k, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED", 1, dev.index or 0)
    out = torch.zeros(16, dtype=torch.int32, device=dev)
    stream = _stream_for(torch.cuda.current_stream(dev).cuda_stream)
    rows = []
    for c in P.CLUSTERS:
        cfg = LaunchConfig(grid=(1,), cluster=(c,), block=(512,))
        per = {}
        for steps in (16, 100016):  # one launch each, CUDA events: the difference is 100000 steps
            launch(stream, cfg, k, np.int32(steps), np.uint64(out.data_ptr()))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch(stream, cfg, k, np.int32(steps), np.uint64(out.data_ptr()))
            b.record()
            b.synchronize()
            per[steps] = a.elapsed_time(b) * 1e3
        us = (per[100016] - per[16]) / 100000
        rows.append({"cluster": c, "us_per_step": round(us, 3)})
        print(f"bare exchange, cluster {c:2d}: {us:.3f} us a step", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/panel_cluster.json")
    ap.add_argument("--sizes", default="32768,16384,8192,4096,2048", help="leaf heights; '' for the floor only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for m in (int(s) for s in args.sizes.split(",") if s):
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
    floor = barrier_floor(dev)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(dev), "command": "PYTHONPATH=src python3 "
                   "benchmarks/bench_panel_cluster_device.py", "rows": rows, "exchange_floor": floor}, f, indent=1)


if __name__ == "__main__":
    main()
