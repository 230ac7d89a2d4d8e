"""Device benchmark for tcprec.linalg.solve (issue 6): run on the GPU machine from the repo root.

    PYTHONPATH=src python benchmarks/bench_solve_device.py --quick   # ~3 min: correctness at n=4096,
                                                                     # LU variants + breakdown at 8192,
                                                                     # best variants vs fp64 at 8192/16384
    PYTHONPATH=src python benchmarks/bench_solve_device.py           # full: tune at 16384, then
                                                                     # bench_solve at 8192/16384/32768

Everything is timed against fp64 torch.linalg.solve in the same process.  Each row catches its own
exceptions and the script goes on; a compact summary is printed last (the tool returns the tail).
JSON: benchmarks/results/solve.json (full), benchmarks/results/solve_quick.json (--quick).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

import tcprec.linalg as la
from tcprec.bench.solve import bench_solve, environment, measure_bf16_peak
from tcprec.linalg.lu import _probe_lowp_gemm, _probe_scaled_mm, gemm_backend

T0 = time.perf_counter()
SUMMARY: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def note(msg: str) -> None:
    SUMMARY.append(msg)
    log(msg)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fmt_prof(prof: dict) -> str:
    """Phase times in ms, compact."""
    return " ".join(f"{k}={v * 1e3:.1f}" for k, v in sorted(prof.items()))


def timeit(fn, warmup=1, repeats=3, slow_s=4.0):
    out = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        out = fn()
        sync()
        if time.perf_counter() - t0 > slow_s:
            repeats = 1
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], out


def free():
    gc.collect()
    torch.cuda.empty_cache()


def guarded(name):
    def deco(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001 - report, continue
                note(f"FAILED {name}: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
                free()
                return None
        return run
    return deco


# ------------------------------------------------------------------------------------------------
@guarded("capabilities")
def capabilities(dev):
    for f in ("bf16", "fp16", "tf32", "fp8", "fp32"):
        log(f"gemm {f}: {gemm_backend(f, dev)}")
    SUMMARY.append(f"gemm paths: bf16={_probe_lowp_gemm(dev, torch.bfloat16)} fp16={_probe_lowp_gemm(dev, torch.float16)} "
                   f"fp8_scaled_mm={_probe_scaled_mm(dev)}")


@guarded("correctness")
def correctness(dev, n=4096):
    # tiny warm-up so cuSOLVER / cuBLAS handles exist before timing
    A = la.hpl_mxp_matrix(256, device=dev)
    la.solve(A, torch.ones(256, dtype=torch.float64, device=dev))
    note(f"-- correctness n={n} (one timed solve each; fp64 torch.linalg.solve for reference)")
    for kind, piv in (("diagdom", False), ("diagdom", True), ("general", True)):
        A = la.make_matrix(kind, n, cond=1e2, device=dev)
        b = la.random_rhs(n, device=dev)
        t64, x64 = timeit(lambda: torch.linalg.solve(A, b), warmup=1, repeats=1)
        be64 = la.scaled_residual(A, x64, b)
        note(f"{kind:8} piv={str(piv):5} fp64: {t64 * 1e3:7.1f} ms be {be64:.3g}")
        factors = ("bf16", "fp16", "tf32", "fp8", "fp32") if not (kind == "diagdom" and piv) else ("bf16",)
        for f in factors:
            for refine in ("gmres", "classic") if f == "bf16" else ("gmres",):
                try:
                    t, (x, info) = timeit(lambda: la.solve(A, b, factor=f, refine=refine, pivoting=piv),
                                          warmup=1, repeats=1)
                    err = float((x - x64).abs().max() / x64.abs().max())
                    note(f"{kind:8} piv={str(piv):5} {f:5} {refine:7}: {t * 1e3:7.1f} ms be {info.backward_error:6.3g} "
                         f"{info.path:20} it {info.iterations}/{info.inner_iterations} relerr_vs_fp64 {err:.1e} "
                         f"{info.reason[:60]}")
                except Exception as e:  # noqa: BLE001
                    note(f"{kind:8} piv={piv} {f} {refine}: FAILED {type(e).__name__}: {str(e)[:200]}")
        del A, b, x64
        free()


def _lu_time(A, **kw):
    t, F = timeit(lambda: la.lu_factor(A, **kw), warmup=1, repeats=2)
    prof = la.lu_factor(A, profile=True, **kw).phase_times
    return t, F, prof


@guarded("variants")
def variants(dev, n=8192, tune_only=False):
    """LU variants (bf16 factor): wall time of lu_factor incl. fp64->fp32 conversion + phase split."""
    note(f"-- LU variants n={n} (bf16 updates; ms = lu_factor wall time; phases = GPU time per phase)")
    best = {}
    A = la.hpl_mxp_matrix(n, device=dev)
    if not tune_only:
        t32, _ = timeit(lambda: torch.linalg.lu_factor(A.float()), warmup=1, repeats=1)
        t64, _ = timeit(lambda: torch.linalg.solve(A, torch.ones(n, dtype=torch.float64, device=dev)), 1, 1)
        note(f"reference: torch.linalg.lu_factor fp32 {t32 * 1e3:.1f} ms, torch.linalg.solve fp64 {t64 * 1e3:.1f} ms")
    cands = []
    for block in (512, 1024) if tune_only else (256, 512, 1024):
        for trsm in ("trsm", "inverse"):
            for lookahead in (True, False) if not tune_only else (True,):
                cands.append(dict(pivoting=False, block=block, trsm=trsm, lookahead=lookahead))
    res = []
    for kw in cands:
        try:
            t, F, prof = _lu_time(A, factor="bf16", **kw)
            res.append((t, kw))
            note(f"nopiv {kw}: {t * 1e3:7.1f} ms [{fmt_prof(prof)}]")
        except Exception as e:  # noqa: BLE001
            note(f"nopiv {kw}: FAILED {type(e).__name__}: {str(e)[:200]}")
        free()
    if res:
        best["diagdom"] = min(res, key=lambda r: r[0])[1]
    del A
    free()
    A = la.make_matrix("general", n, cond=1e2, device=dev)
    cands = []
    blocks = (512, 1024)
    for block in blocks:
        cands.append(dict(pivoting=True, block=block, panel="getrf", lookahead=True))
        for leaf in (64, 128) if tune_only else (32, 64, 128, 256):
            cands.append(dict(pivoting=True, block=block, panel="recursive", leaf=leaf, lookahead=True))
    if not tune_only:
        cands += [dict(pivoting=True, block=1024, panel="recursive", leaf=128, lookahead=False),
                  dict(pivoting=True, block=1024, panel="recursive", leaf=128, lookahead=True, panel_tf32=True),
                  dict(pivoting=True, block=1024, panel="recursive", leaf=128, lookahead=True, trsm="inverse")]
    res = []
    for kw in cands:
        try:
            t, F, prof = _lu_time(A, factor="bf16", **kw)
            res.append((t, kw))
            note(f"partial {kw}: {t * 1e3:7.1f} ms [{fmt_prof(prof)}]")
        except Exception as e:  # noqa: BLE001
            note(f"partial {kw}: FAILED {type(e).__name__}: {str(e)[:200]}")
        free()
    if res:
        best["general"] = min(res, key=lambda r: r[0])[1]
    note(f"best at n={n}: {best}")
    del A
    free()
    return best


@guarded("refinement kernels")
def refinement_kernels(dev, n=8192):
    note(f"-- refinement kernels n={n}")
    A = la.hpl_mxp_matrix(n, device=dev)
    v = torch.randn(n, dtype=torch.float64, device=dev)
    t, _ = timeit(lambda: A @ v, warmup=2, repeats=5)
    note(f"fp64 matvec: {t * 1e3:.2f} ms ({8 * n * n / t / 1e9:.0f} GB/s)")
    for trsv in ("trsm", "blocked"):
        F = la.lu_factor(A, factor="bf16", pivoting=False, trsv=trsv)
        t, _ = timeit(lambda: F.solve(v), warmup=2, repeats=5)
        note(f"preconditioner apply (2 triangular solves, fp32) trsv={trsv}: {t * 1e3:.2f} ms")
        del F
    del A
    free()


@guarded("solve vs fp64")
def solve_vs_fp64(dev, n, best, factors=("bf16", "fp16")):
    note(f"-- solve vs fp64 n={n} (best LU variants)")
    for kind in ("diagdom", "general"):
        kw = dict(best.get(kind, {}))
        kw.setdefault("pivoting", kind == "general")
        A = la.make_matrix(kind, n, cond=1e2, device=dev)
        b = la.random_rhs(n, device=dev)
        t64, x64 = timeit(lambda: torch.linalg.solve(A, b), warmup=1, repeats=2)
        note(f"{kind} fp64 {t64 * 1e3:.1f} ms")
        del x64
        for f in factors:
            try:
                t, (x, info) = timeit(lambda: la.solve(A, b, factor=f, **kw), warmup=1, repeats=2)
                note(f"{kind} {f}: {t * 1e3:.1f} ms = {t64 / t:.2f}x fp64; be {info.backward_error:.3g} {info.path} "
                     f"it {info.iterations}/{info.inner_iterations} factor {info.factor_time_s * 1e3:.1f} ms "
                     f"refine {info.refine_time_s * 1e3:.1f} ms {info.reason[:60]}")
            except Exception as e:  # noqa: BLE001
                note(f"{kind} {f}: FAILED {type(e).__name__}: {str(e)[:200]}")
            free()
        del A, b
        free()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--factors", default="bf16,fp16,fp8")
    ap.add_argument("--kinds", default="diagdom,general")
    ap.add_argument("--no-tune", action="store_true", help="full mode: skip the tuning pass")
    ap.add_argument("--budget", type=float, default=330.0, help="no bench_solve row starts after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on a CPU at tiny n")
    args = ap.parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine (--cpu-smoke checks its logic)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    env = environment(dev)
    note(f"env: {json.dumps(env)}")
    peak = measure_bf16_peak(dev)
    note(f"bf16 matmul 8192^3 peak: {peak:.0f} TFLOP/s")
    capabilities(dev)
    if args.quick:
        correctness(dev)
        best = variants(dev) or {}
        refinement_kernels(dev)
        solve_vs_fp64(dev, 8192, best)
        if time.perf_counter() - T0 < 300:
            solve_vs_fp64(dev, 16384, best, factors=("bf16",))
        os.makedirs("benchmarks/results", exist_ok=True)
        with open("benchmarks/results/solve_quick.json", "w") as fh:
            json.dump({"env": env, "peak_bf16_tflops": peak, "best": best, "lines": SUMMARY}, fh, indent=1, default=str)
    else:
        best = {}
        if not args.no_tune:
            best = variants(dev, n=16384, tune_only=True) or {}
        opts = {k: {kk: vv for kk, vv in v.items() if kk != "pivoting"} for k, v in best.items()}
        res = bench_solve(
            sizes=tuple(int(s) for s in args.sizes.split(",")),
            factors=tuple(args.factors.split(",")),
            kinds=tuple(args.kinds.split(",")),
            lu_options=opts or None,
            time_budget_s=args.budget,
            log=log,
        )
        SUMMARY.append("bench_solve table:\n" + res["table"])
    print("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
    print("\n".join(SUMMARY))
    print(f"total {time.perf_counter() - T0:.0f} s")
    return 0


def cpu_smoke():
    """The same steps at tiny sizes on a CPU (tensor cores emulated): checks the script, not speed."""
    dev = torch.device("cpu")
    capabilities(dev)
    correctness(dev, n=192)
    best = variants(dev, n=256) or {}
    refinement_kernels(dev, n=256)
    solve_vs_fp64(dev, 256, best)
    res = bench_solve(sizes=(128,), factors=("bf16", "fp8"), lu_options={k: {kk: vv for kk, vv in v.items() if kk != "pivoting"} for k, v in best.items()},
                      device="cpu", out=None, log=log, repeats=1)
    SUMMARY.append(res["table"])
    print("\n".join(SUMMARY))
    return 0 if not any(line.startswith("FAILED") for line in SUMMARY) else 1


if __name__ == "__main__":
    sys.exit(main())
