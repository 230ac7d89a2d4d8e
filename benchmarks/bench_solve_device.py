"""Device benchmark for tcprec.linalg.solve (issue 6): run on the GPU machine from the repo root.

    PYTHONPATH=src python benchmarks/bench_solve_device.py --quick   # < 2 min: correctness at 4096,
        # panel pieces + LU variants + refinement kernels at 8192, solve vs fp64 at 8192 / 16384
        # (bf16, fp16, both kinds), 32768 diagdom bf16 if time is left
    PYTHONPATH=src python benchmarks/bench_solve_device.py           # full, ~5-6 min on an H100:
        # tune at 16384, then bench_solve at 8192 / 16384 / 32768, bf16 + fp16 (+ fp8 while time
        # allows), diagdom + general; a general row is skipped when that factor was slower than
        # fp64 at the previous n (the table says so)

Everything is timed against fp64 torch.linalg.solve in the same process.  Each step catches its own
exceptions and the script goes on; a compact summary is printed last (the tool returns the tail).
JSON: benchmarks/results/solve.json (full), benchmarks/results/solve_quick.json (--quick).

    PYTHONPATH=src python benchmarks/bench_solve_device.py --refine-ab   # ~3 min: general matrices
        # (kappa 1e2, partial pivoting) at 8192 / 16384 / 32768, fp16 (+ bf16 at 8192): refine
        # gmres vs fgmres, U12 GEMM tf32 (default) vs fp32 (trsm_tf32=False), each against fp64
        # in the same run -> benchmarks/results/solve_refine_ab.json
    PYTHONPATH=src python benchmarks/bench_solve_device.py --trsv-ab     # ~2 min: the preconditioner's triangular
        # solves eager vs from a CUDA graph, whole solves with default options -> benchmarks/results/solve_trsv_ab.json
    PYTHONPATH=src python benchmarks/bench_solve_device.py --cpu-iterations 4096   # no GPU: the same
        # A/B's refinement counts from the CPU emulation in the CUDA configuration (block 1024, one
        # getrf per panel, U12 as a tf32 GEMM emulated in software); n = 8192 takes ~5 min
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
from tcprec.linalg.lu import (
    _getrf_lib,
    _inv_lower_unit,
    _inv_upper,
    _lu_nopivot,
    _probe_lowp_gemm,
    _probe_scaled_mm,
    _tf32,
    _tournament,
    _tri_inv,
    gemm_backend,
    swaps_from_pivots,
)

T0 = time.perf_counter()
SUMMARY: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def note(msg: str) -> None:
    SUMMARY.append(msg)
    log(msg)


def elapsed() -> float:
    return time.perf_counter() - T0


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
    if torch.cuda.is_available():
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
                   f"fp8_scaled_mm={_probe_scaled_mm(dev)} linalg_lib={torch.backends.cuda.preferred_linalg_library() if dev.type == 'cuda' else '-'}")


@guarded("correctness")
def correctness(dev, n=4096):
    # tiny warm-up so cuSOLVER / cuBLAS handles exist before timing
    A = la.hpl_mxp_matrix(256, device=dev)
    la.solve(A, torch.ones(256, dtype=torch.float64, device=dev))
    note(f"-- correctness n={n} (one timed solve each; fp64 torch.linalg.solve for reference)")
    cases = (
        ("diagdom", False, ("bf16", "fp16", "tf32", "fp8", "fp32"), {}),
        ("diagdom", True, ("bf16",), {}),
        ("general", True, ("bf16", "fp16", "tf32", "fp8", "fp32"), {}),
        ("general", True, ("bf16", "fp16"), {"panel": "calu", "leaf": 128}),
    )
    for kind, piv, factors, opts in cases:
        A = la.make_matrix(kind, n, cond=1e2, device=dev)
        b = la.random_rhs(n, device=dev)
        t64, x64 = timeit(lambda: torch.linalg.solve(A, b), warmup=1, repeats=1)
        be64 = la.scaled_residual(A, x64, b)
        note(f"{kind:8} piv={str(piv):5} fp64: {t64 * 1e3:7.1f} ms be {be64:.3g} {opts or ''}")
        for f in factors:
            for refine in ("gmres", "classic") if (f == "bf16" and not opts) else ("gmres",):
                try:
                    t, (x, info) = timeit(lambda: la.solve(A, b, factor=f, refine=refine, pivoting=piv, **opts),
                                          warmup=1, repeats=1)
                    err = float((x - x64).abs().max() / x64.abs().max())
                    note(f"{kind:8} piv={str(piv):5} {f:5} {refine:7}: {t * 1e3:7.1f} ms be {info.backward_error:6.3g} "
                         f"{info.path:20} it {info.iterations}/{info.inner_iterations} relerr_vs_fp64 {err:.1e} "
                         f"{info.reason[:60]}")
                except Exception as e:  # noqa: BLE001
                    note(f"{kind:8} piv={piv} {f} {refine}: FAILED {type(e).__name__}: {str(e)[:200]}")
        del A, b, x64
        free()


@guarded("panel pieces")
def panel_pieces(dev, n=8192):
    """The latency-bound pieces, each alone (wall ms incl. launch, median of 5)."""
    note(f"-- panel pieces n={n} (ms per call, alone)")
    A = la.hpl_mxp_matrix(n, device=dev).float()
    for nb in (256, 512, 1024, 2048):
        if nb >= n:
            continue
        D = A[:nb, :nb].clone()
        t_lu, _ = timeit(lambda: _lu_nopivot(D), warmup=2, repeats=5)  # cuSOLVER getrf, no pivoting
        with _tf32(False):
            t_inv, _ = timeit(lambda: (_inv_lower_unit(D), _inv_upper(D)), warmup=2, repeats=5)
            S = D.unsqueeze(0)
            t_rec, _ = timeit(lambda: (_tri_inv(S, upper=False, unit=True), _tri_inv(S, upper=True, unit=False)),
                              warmup=2, repeats=5)
            uinv = _inv_upper(D)
        a21 = A[nb:, :nb].clone()
        with _tf32(True):
            t_l21, _ = timeit(lambda: a21 @ uinv, warmup=2, repeats=5)
        note(f"nopiv nb={nb}: getrf(diag) {t_lu * 1e3:.3f}  2 inverses trsm {t_inv * 1e3:.3f} / recursive "
             f"{t_rec * 1e3:.3f}  L21 tf32 gemm ({n - nb}x{nb}x{nb}) {t_l21 * 1e3:.3f}  "
             f"[{t_lu / nb * 1e6:.2f} us/column for getrf]")
        del D, a21, uinv
    del A
    free()
    G = la.make_matrix("general", n, cond=1e2, device=dev).float()
    for w in (128, 256, 1024):
        if w >= n:
            continue
        P = G[:, :w].clone()
        parts = []
        for lib in ("cusolver", "default"):
            def run(lib=lib):
                with _getrf_lib(dev, lib):
                    return torch.linalg.lu_factor_ex(P)
            t, _ = timeit(run, warmup=1, repeats=3)
            parts.append(f"getrf[{lib}] {t * 1e3:.2f}")
        for rows in (512, 1024, 2048):
            if rows >= w:
                t, _ = timeit(lambda: _tournament(P, rows, 0, n), warmup=1, repeats=3)
                parts.append(f"tournament[rows={rows}] {t * 1e3:.2f}")
        note(f"pivoted tall panel {n}x{w}: " + "  ".join(parts))
        del P
    del G
    free()


def _lu_time(A, **kw):
    t, F = timeit(lambda: la.lu_factor(A, **kw), warmup=1, repeats=2)
    prof = la.lu_factor(A, profile=True, **kw).phase_times
    return t, F, prof


@guarded("variants")
def variants(dev, n=8192, tune_only=False):
    """LU variants (bf16 factor): wall time of lu_factor incl. fp64->fp32 conversion + phase split.
    ``side`` = GPU time of the look-ahead stream (overlaps panel)."""
    note(f"-- LU variants n={n} (bf16 updates; ms = lu_factor wall time; phases = GPU time per phase)")
    best = {}
    A = la.hpl_mxp_matrix(n, device=dev)
    if not tune_only:
        t32, _ = timeit(lambda: torch.linalg.lu_factor(A.float()), warmup=1, repeats=1)
        t64, _ = timeit(lambda: torch.linalg.solve(A, torch.ones(n, dtype=torch.float64, device=dev)), 1, 1)
        note(f"reference: torch.linalg.lu_factor fp32 {t32 * 1e3:.1f} ms, torch.linalg.solve fp64 {t64 * 1e3:.1f} ms")
    cands = []
    for block in (512, 1024, 2048) if tune_only else (512, 1024):
        for lookahead in (True,) if tune_only else (True, False):
            cands.append(dict(pivoting=False, block=block, trsm="inverse", lookahead=lookahead))
    if not tune_only:
        cands.append(dict(pivoting=False, block=1024, trsm="trsm", lookahead=True))
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
    cands = [dict(pivoting=True, block=1024, panel="getrf"),
             dict(pivoting=True, block=512, panel="getrf"),
             dict(pivoting=True, block=1024, panel="recursive", leaf=256),
             dict(pivoting=True, block=1024, panel="calu", leaf=128, calu_rows=1024),
             dict(pivoting=True, block=1024, panel="calu", leaf=256, calu_rows=1024)]
    if not tune_only:
        cands += [dict(pivoting=True, block=1024, panel="recursive", leaf=128),
                  dict(pivoting=True, block=1024, panel="calu", leaf=128, calu_rows=512),
                  dict(pivoting=True, block=1024, panel="calu", leaf=64, calu_rows=1024),
                  dict(pivoting=True, block=1024, panel="getrf", lookahead=False),
                  dict(pivoting=True, block=1024, panel="getrf", getrf_lib="default")]  # the old MAGMA path
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
def refinement_kernels(dev, n=8192, block=None):
    """fp64 matvec and one preconditioner apply per trsv method.  Returns {kind: trsv}: the
    method with the least (first call + k applies), k = 4 for diagdom (a solve there applies M
    ~4 times) and 30 for general -- a CUDA graph is captured per factorization, so it only pays
    off with many applies."""
    note(f"-- refinement kernels n={n}")
    A = la.hpl_mxp_matrix(n, device=dev)
    v = torch.randn(n, dtype=torch.float64, device=dev)
    t, _ = timeit(lambda: A @ v, warmup=2, repeats=5)
    note(f"fp64 matvec: {t * 1e3:.2f} ms ({8 * n * n / t / 1e9:.0f} GB/s)")
    cost = {}
    for trsv in ("trsm", "blocked", "graph"):
        F = la.lu_factor(A, factor="bf16", pivoting=False, trsv=trsv, block=block)
        sync()
        t0 = time.perf_counter()
        F.solve(v)  # first call: inverses / plan / graph capture
        sync()
        first = time.perf_counter() - t0
        t, _ = timeit(lambda: F.solve(v), warmup=2, repeats=5)
        extra = f" (graph captured: {F._graph not in (None, False)})" if trsv == "graph" else ""
        note(f"preconditioner apply (fp32 triangular solves) trsv={trsv}: {t * 1e3:.3f} ms, first call "
             f"{first * 1e3:.1f} ms{extra}")
        cost[trsv] = (first, t)
        del F
        free()
    del A
    free()
    pick = {kind: min(cost, key=lambda m: cost[m][0] + k * cost[m][1]) for kind, k in (("diagdom", 4), ("general", 30))}
    note(f"trsv choice: {pick}")
    return pick


@guarded("solve vs fp64")
def _system_and_fp64(kind, n, dev):
    """(A, b, seconds of fp64 torch.linalg.solve) for a kappa = 1e2 ``kind`` matrix of order n: the baseline every
    A/B of this script times its solves against, on the same A."""
    A = la.make_matrix(kind, n, cond=1e2, device=dev)
    b = la.random_rhs(n, device=dev)
    t64, _ = timeit(lambda: torch.linalg.solve(A, b), warmup=1, repeats=2)
    return A, b, t64


def solve_vs_fp64(dev, n, best, factors=("bf16", "fp16"), kinds=("diagdom", "general"), slow=None):
    """Solve rows at n; ``slow`` (dict) remembers (kind, factor) slower than fp64 to skip later."""
    note(f"-- solve vs fp64 n={n} (best LU variants)")
    slow = {} if slow is None else slow
    for kind in kinds:
        todo = [f for f in factors if (kind, f) not in slow]
        for f in factors:
            if (kind, f) in slow:
                note(f"{kind} {f}: skipped ({slow[(kind, f)]})")
        if not todo:
            continue
        kw = dict(best.get(kind, {}))
        kw.setdefault("pivoting", kind == "general")
        A, b, t64 = _system_and_fp64(kind, n, dev)
        note(f"{kind} fp64 {t64 * 1e3:.1f} ms")
        for f in todo:
            try:
                t, (x, info) = timeit(lambda: la.solve(A, b, factor=f, **kw), warmup=1, repeats=2)
                _, info_p = la.solve(A, b, factor=f, profile=True, **kw)
                note(f"{kind} {f}: {t * 1e3:.1f} ms = {t64 / t:.2f}x fp64; be {info.backward_error:.3g} {info.path} "
                     f"it {info.iterations}/{info.inner_iterations} factor {info.factor_time_s * 1e3:.1f} ms "
                     f"refine {info.refine_time_s * 1e3:.1f} ms [{fmt_prof(info_p.phase_times)}] {info.reason[:60]}")
                if t > t64 and kind == "general":
                    slow[(kind, f)] = f"{t64 / t:.2f}x fp64 at n={n}"
            except Exception as e:  # noqa: BLE001
                note(f"{kind} {f}: FAILED {type(e).__name__}: {str(e)[:200]}")
            free()
        del A, b
        free()
    return slow


def _solve_fields(t, t64, info) -> dict:
    """A solve's time against fp64 and its SolveInfo, as a results row's fields."""
    return {"time_s": t, "speedup": t64 / t, "path": info.path, "backward_error": info.backward_error,
            "iterations": info.iterations, "inner_iterations": info.inner_iterations,
            "factor_time_s": info.factor_time_s, "refine_time_s": info.refine_time_s}


def _solve_line(t, t64, info) -> str:
    return (f"{t * 1e3:7.1f} ms = {t64 / t:.2f}x fp64, {info.path} it {info.iterations}/{info.inner_iterations} "
            f"be {info.backward_error:.3g} factor {info.factor_time_s * 1e3:.1f} refine "
            f"{info.refine_time_s * 1e3:.1f} ms")


def _write_json(out, payload) -> None:
    if out:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)


# The LU options the last full run picked for general matrices on the H200 (BENCHMARKS.md).
AB_LU = {"block": 1024, "panel": "getrf", "trsv": "graph"}


@guarded("refine A/B")
def refine_ab(dev, sizes=(8192, 16384, 32768), out="benchmarks/results/solve_refine_ab.json"):
    """General matrices: GMRES-IR vs flexible GMRES-IR, tf32 vs fp32 U12 GEMM (same run, same A).
    CPU emulation predicted (n = 8192, fp16): gmres 3/23 -> fgmres 1/12 inner steps; with an fp32
    U12 GEMM fewer still (n = 4096: 10 -> 7)."""
    note("-- refine A/B on general matrices (kappa 1e2, partial pivoting), same A per n")
    rows = []
    cases = [("fp16", "gmres", None), ("fp16", "fgmres", None), ("fp16", "fgmres", False), ("fp16", "gmres", False)]
    for n in sizes:
        A, b, t64 = _system_and_fp64("general", n, dev)
        note(f"n={n} fp64 torch.linalg.solve {t64 * 1e3:.1f} ms")
        rows.append({"n": n, "factor": "fp64", "time_s": t64})
        todo = cases + ([("bf16", "gmres", None), ("bf16", "fgmres", None)] if n <= 8192 else [])
        for f, refine, tf32 in todo:
            kw = dict(AB_LU, factor=f, refine=refine, pivoting=True)
            if tf32 is not None:
                kw["trsm_tf32"] = tf32
            try:
                t, (x, info) = timeit(lambda: la.solve(A, b, **kw), warmup=1, repeats=2)
                _, info_p = la.solve(A, b, profile=True, **kw)
                rows.append({"n": n, "factor": f, "refine": refine, "trsm_tf32": tf32, **_solve_fields(t, t64, info),
                             "history": list(info.history), "phase_times": info_p.phase_times, "reason": info.reason})
                note(f"n={n} {f} {refine:6} trsm_tf32={str(tf32):5}: {_solve_line(t, t64, info)} "
                     f"[{fmt_prof(info_p.phase_times)}] {info.reason[:60]}")
            except Exception as e:  # noqa: BLE001
                note(f"n={n} {f} {refine} trsm_tf32={tf32}: FAILED {type(e).__name__}: {str(e)[:200]}")
            free()
        del A, b
        free()
    _write_json(out, {"env": environment(dev), "lu_options": AB_LU, "rows": rows, "lines": SUMMARY})
    return rows


def trsv_ab(dev, sizes=(8192, 16384, 32768), out="benchmarks/results/solve_trsv_ab.json"):
    """The preconditioner's triangular solves eager (trsv="blocked", the CUDA default: two cuBLAS calls a block from
    Python) vs replayed from a CUDA graph captured per factorization (trsv="graph"), whole fp16 / bf16 solves with the
    library's other defaults, both matrix kinds, same A per (kind, n), against fp64 in the same run."""
    note("-- trsv A/B: blocked vs graph, whole solves with default options")
    rows = []
    for n in sizes:
        for kind in ("diagdom", "general"):
            A, b, t64 = _system_and_fp64(kind, n, dev)
            note(f"n={n} {kind} fp64 torch.linalg.solve {t64 * 1e3:.1f} ms")
            rows.append({"n": n, "kind": kind, "factor": "fp64", "time_s": t64})
            for f in ("fp16",) if kind == "general" else ("bf16",):
                for trsv in ("blocked", "graph"):
                    kw = dict(factor=f, pivoting=kind == "general", trsv=trsv)
                    t, (x, info) = timeit(lambda: la.solve(A, b, **kw), warmup=1, repeats=3)
                    rows.append({"n": n, "kind": kind, "factor": f, "trsv": trsv, **_solve_fields(t, t64, info)})
                    note(f"n={n} {kind} {f} trsv={trsv:7}: {_solve_line(t, t64, info)}")
                    free()
            del A, b
            free()
    _write_json(out, {"env": environment(dev), "rows": rows, "lines": SUMMARY})
    return rows


def _fp16_solve_row(rows, A, b, t64, n, kw, label) -> None:
    """Time an fp16 solve with LU options ``kw`` (partial pivoting) against the fp64 baseline ``t64``;
    append its row and summary line."""
    t, (x, info) = timeit(lambda: la.solve(A, b, factor="fp16", pivoting=True, **kw), warmup=1, repeats=2)
    rows.append({"kind": "solve", "n": n, "factor": "fp16", "options": kw, **_solve_fields(t, t64, info)})
    note(f"n={n} solve fp16 {label}: {_solve_line(t, t64, info)}")


def _event_ms(fn, repeats=10):
    """Mean GPU ms of fn() over ``repeats`` back-to-back calls (CUDA events), after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


@guarded("panel A/B")
def panel_ab(dev, sizes=(8192, 16384, 32768), out="benchmarks/results/solve_panel_ab.json"):
    """Partially pivoted panels: cuSOLVER getrf per 1024-column block vs Toledo's recursion with
    tournament-pivoting leaves (one panel_lu.cu launch a leaf), same A per n; then full fp16 solves
    with each against fp64 torch.linalg.solve in the same run."""
    from tcprec.kernels.cuda import panel_lu as PL

    rows = []
    note("-- one leaf alone (GPU ms a launch, CUDA events) vs cuSOLVER getrf of the same panel")
    for m in (32768, 16384, 4096):
        G = la.make_matrix("general", m, cond=1e2, device=dev).float()
        for w in (32, 64):
            work = torch.empty(m + 1, m, device=dev)
            work[:m].copy_(G)
            work[m].zero_()
            perm = torch.arange(m + 1, device=dev)
            scratch = PL.PanelScratch.allocate(m, m, work.device)
            t_leaf = _event_ms(lambda: PL.panel_calu(work, perm, 0, w, m, w, scratch))
            t_cols = _event_ms(lambda: PL.panel_calu(work, perm, 0, w, m, m, scratch), repeats=5)
            P = G[:, :w].clone()
            with _getrf_lib(dev, "cusolver"):
                t_getrf = _event_ms(lambda: torch.linalg.lu_factor_ex(P), repeats=5)
            note(f"m={m} w={w}: panel_calu {t_leaf:.3f} ms (swaps on all {m} columns: {t_cols:.3f} ms), "
                 f"cuSOLVER getrf {t_getrf:.3f} ms = {t_getrf / t_leaf:.1f}x")
            rows.append({"kind": "leaf", "m": m, "w": w, "panel_calu_ms": t_leaf, "panel_calu_all_cols_ms": t_cols,
                         "getrf_ms": t_getrf})
            del work, perm, scratch, P
        P = G[:, :1024].clone()
        with _getrf_lib(dev, "cusolver"):
            t_getrf = _event_ms(lambda: torch.linalg.lu_factor_ex(P), repeats=3)
        note(f"m={m} w=1024: cuSOLVER getrf {t_getrf:.3f} ms")
        rows.append({"kind": "leaf", "m": m, "w": 1024, "getrf_ms": t_getrf})
        del G, P
        free()
    variants_ = [dict(panel="getrf"), dict(panel="calu", leaf=32), dict(panel="calu", leaf=64)]
    for n in sizes:
        A, b, t64 = _system_and_fp64("general", n, dev)
        note(f"n={n} fp64 torch.linalg.solve {t64 * 1e3:.1f} ms")
        rows.append({"kind": "solve", "n": n, "factor": "fp64", "time_s": t64})
        best = None
        for v in variants_:
            kw = dict(AB_LU, **v)
            try:
                t, F, prof = _lu_time(A, factor="fp16", **kw)
                err = None
                if n <= 16384:
                    Ld = torch.tril(F.lu.double(), -1)
                    Ld.diagonal().fill_(1.0)
                    err = float((A[F.perm] * F.scale - Ld @ torch.triu(F.lu.double())).abs().max()
                                / (A.abs().max() * F.scale))
                    del Ld
                note(f"n={n} lu fp16 {v}: {t * 1e3:7.1f} ms [{fmt_prof(prof)}] max|PA-LU|/max|A| {err}")
                rows.append({"kind": "lu", "n": n, "factor": "fp16", "options": kw, "time_s": t, "phase_times": prof,
                             "lu_rel_err": err})
                if best is None or t < best[0]:
                    best = (t, kw)
                del F
            except Exception as e:  # noqa: BLE001
                note(f"n={n} lu {v}: FAILED {type(e).__name__}: {str(e)[:300]}")
            free()
        for v in variants_:
            kw = dict(AB_LU, **v)
            try:
                _fp16_solve_row(rows, A, b, t64, n, kw, v)
            except Exception as e:  # noqa: BLE001
                note(f"n={n} solve {v}: FAILED {type(e).__name__}: {str(e)[:300]}")
            free()
        del A, b
        free()
    _write_json(out, {"env": environment(dev), "command": "PYTHONPATH=src python3 benchmarks/bench_solve_device.py "
                      "--panel-ab", "rows": rows, "lines": SUMMARY})
    return rows


def _panel_variant_rows(dev, sizes, variants_, rows) -> None:
    """For each n: fp64 torch.linalg.solve on a general kappa = 1e2 A, then per panel variant (LU options on
    top of block 1024 and the graph trsv) the fp16 LU's time and phases and the fp16 solve; rows appended."""
    for n in sizes:
        A, b, t64 = _system_and_fp64("general", n, dev)
        note(f"n={n} fp64 torch.linalg.solve {t64 * 1e3:.1f} ms")
        rows.append({"kind": "solve", "n": n, "factor": "fp64", "time_s": t64})
        for v in variants_:
            kw = {"block": 1024, "trsv": "graph", **v}
            try:
                t, F, prof = _lu_time(A, factor="fp16", **kw)
                note(f"n={n} lu fp16 {v}: {t * 1e3:7.1f} ms [{fmt_prof(prof)}]")
                rows.append({"kind": "lu", "n": n, "factor": "fp16", "options": kw, "time_s": t, "phase_times": prof})
                del F
                free()
                _fp16_solve_row(rows, A, b, t64, n, kw, v)
            except Exception as e:  # noqa: BLE001
                note(f"n={n} {v}: FAILED {type(e).__name__}: {str(e)[:300]}")
            free()
        del A, b
        free()


@guarded("fused panel A/B")
def fused_ab(dev, sizes=(8192, 16384, 32768), out="benchmarks/results/solve_fused_ab.json"):
    """Partially pivoted panels: cuSOLVER getrf vs the fused panel kernel (panel_pivot.cu), first one
    panel alone (same m x nb panel, GPU ms by CUDA events, interchanges on 2 nb columns for both), then
    the whole LU and fp16 solve on the same general A per n, against fp64 torch.linalg.solve."""
    from tcprec.kernels.cuda import panel_pivot as PP

    rows = []
    note("-- one panel alone: fused kernel vs cuSOLVER getrf + interchanges (GPU ms, CUDA events)")
    for m in (32768, 16384, 8192):
        G = la.make_matrix("general", m, cond=1e2, device=dev).float()
        for nb in (256, 1024):
            base = torch.empty(m + 1, m, device=dev)
            base[:m].copy_(G)
            base[m].zero_()
            work = base.clone()
            perm = torch.arange(m + 1, device=dev)
            scratch = PP.PivotScratch.allocate(nb, work.device)
            cols = min(m, 2 * nb)

            def fused():
                work.copy_(base)
                PP.panel_pivot(work, perm, 0, nb, m, cols, scratch)

            def getrf():
                work.copy_(base)
                with _getrf_lib(dev, "cusolver"):
                    lu, piv, _ = torch.linalg.lu_factor_ex(work[:m, :nb])
                dst, src = swaps_from_pivots(piv, 0, scratch=m)
                left = work[:, :cols]
                left.index_copy_(0, dst, left.index_select(0, src))
                work[:m, :nb].copy_(lu)

            t_copy = _event_ms(lambda: work.copy_(base), repeats=5)
            t_f = _event_ms(fused, repeats=5) - t_copy
            t_g = _event_ms(getrf, repeats=5) - t_copy
            note(f"m={m} nb={nb}: fused {t_f:.3f} ms ({t_f * 1e3 / nb:.2f} us a column), cuSOLVER getrf "
                 f"{t_g:.3f} ms = {t_g / t_f:.2f}x")
            rows.append({"kind": "panel", "m": m, "nb": nb, "fused_ms": t_f, "getrf_ms": t_g})
            del base, work, perm, scratch
            free()
        del G
        free()
    variants_ = [dict(panel="getrf"), dict(panel="fused", leaf=256), dict(panel="fused", leaf=512),
                 dict(panel="fused", leaf=256, lookahead=True)]
    _panel_variant_rows(dev, sizes, variants_, rows)
    _write_json(out, {"env": environment(dev), "command": "PYTHONPATH=src python3 benchmarks/bench_solve_device.py "
                      "--fused-ab", "rows": rows, "lines": SUMMARY})
    return rows


@guarded("cluster panel A/B")
def cluster_ab(dev, sizes=(8192, 16384, 32768), out="benchmarks/results/solve_cluster_ab.json", variants_=None):
    """Partially pivoted panels: cuSOLVER getrf vs Toledo's recursion with panel_cluster.cu leaves (one
    thread-block cluster a leaf), with and without look-ahead: the whole LU (phase times) and the fp16
    solve on the same general A per n, against fp64 torch.linalg.solve in the same run."""
    rows = []
    variants_ = variants_ or [dict(panel="getrf"), dict(panel="cluster"), dict(panel="cluster", lookahead=False),
                              dict(panel="cluster", panel_tf32=True)]
    _panel_variant_rows(dev, sizes, variants_, rows)
    _write_json(out, {"env": environment(dev), "command": "PYTHONPATH=src python3 benchmarks/bench_solve_device.py "
                      "--cluster-ab", "rows": rows, "lines": SUMMARY})
    return rows


def cpu_iterations(n: int):
    """Refinement counts of the A/B cases, emulated on the CPU in the CUDA configuration (block
    1024, getrf panels, U12 = inv(L11) @ A12 with tf32-rounded operands, blocked trsv).  Counts,
    not times: at n = 8192 this reproduced the H200's GMRES-IR counts (fp16 3/23, bf16 6/180)."""
    dev = torch.device("cpu")
    A = la.make_matrix("general", n, cond=1e2, device=dev)
    b = la.random_rhs(n, device=dev)
    gpu_like = dict(block=min(1024, n), panel="getrf", trsm="inverse", trsv="blocked", pivoting=True)
    for f, refine, tf32 in (("fp16", "gmres", True), ("fp16", "fgmres", True), ("fp16", "fgmres", False),
                            ("bf16", "gmres", True), ("bf16", "fgmres", True)):
        t0 = time.perf_counter()
        _, info = la.solve(A, b, factor=f, refine=refine, trsm_tf32=tf32, **gpu_like)
        note(f"n={n} {f} {refine:6} U12 {'tf32' if tf32 else 'fp32'}: {info.path} it {info.iterations}/"
             f"{info.inner_iterations} be {info.backward_error:.3g} history "
             f"{[float(f'{h:.2g}') for h in info.history]} ({time.perf_counter() - t0:.0f} s)")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--factors", default="bf16,fp16")
    ap.add_argument("--optional-factors", default="fp8", help="full mode: run while time allows")
    ap.add_argument("--kinds", default="diagdom,general")
    ap.add_argument("--no-tune", action="store_true", help="full mode: skip the tuning pass")
    ap.add_argument("--budget", type=float, default=300.0, help="no bench_solve row starts after this many seconds")
    ap.add_argument("--optional-budget", type=float, default=200.0,
                    help="optional factors (fp8) only while bench_solve has run less than this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on a CPU at tiny n")
    ap.add_argument("--cpu-iterations", type=int, default=0, metavar="N",
                    help="no GPU needed: refinement counts of the A/B cases from the CPU emulation at order N")
    ap.add_argument("--panel-ab", action="store_true",
                    help="only the panel A/B: getrf vs CALU leaf kernel, one leaf alone, LU and fp16 solves")
    ap.add_argument("--fused-ab", action="store_true",
                    help="only the fused-panel A/B: panel_pivot.cu vs cuSOLVER getrf, one panel, LU and fp16 solves")
    ap.add_argument("--cluster-ab", action="store_true",
                    help="only the cluster-panel A/B: panel_cluster.cu leaves vs cuSOLVER getrf, LU and fp16 solves")
    ap.add_argument("--trsv-ab", action="store_true",
                    help="only the trsv A/B: blocked vs CUDA-graph triangular solves in whole solves (~2 min)")
    ap.add_argument("--refine-ab", action="store_true",
                    help="only the general-matrix A/B: gmres vs fgmres, tf32 vs fp32 U12 GEMM (~3 min)")
    args = ap.parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    if args.cpu_iterations:
        return cpu_iterations(args.cpu_iterations)
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine (--cpu-smoke checks its logic)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    env = environment(dev)
    note(f"env: {json.dumps(env)}")
    peak = measure_bf16_peak(dev)
    note(f"bf16 matmul 8192^3 peak: {peak:.0f} TFLOP/s")
    capabilities(dev)
    if args.panel_ab:
        panel_ab(dev, sizes=tuple(int(s) for s in args.sizes.split(",")))
    elif args.fused_ab:
        fused_ab(dev, sizes=tuple(int(s) for s in args.sizes.split(",")))
    elif args.cluster_ab:
        cluster_ab(dev, sizes=tuple(int(s) for s in args.sizes.split(",")))
    elif args.refine_ab:
        refine_ab(dev, sizes=tuple(int(s) for s in args.sizes.split(",")))
    elif args.trsv_ab:
        trsv_ab(dev, sizes=tuple(int(s) for s in args.sizes.split(",")))
    elif args.quick:
        correctness(dev)
        panel_pieces(dev)
        best = variants(dev) or {}
        trsv = refinement_kernels(dev, block=best.get("diagdom", {}).get("block"))
        for kind, method in (trsv or {}).items():
            best.setdefault(kind, {})["trsv"] = method
        slow = solve_vs_fp64(dev, 8192, best)
        slow = solve_vs_fp64(dev, 16384, best, slow=slow)
        if elapsed() < 75:
            solve_vs_fp64(dev, 32768, best, factors=("bf16",), kinds=("diagdom",))
        else:
            note(f"n=32768 skipped in --quick ({elapsed():.0f} s spent)")
        os.makedirs("benchmarks/results", exist_ok=True)
        with open("benchmarks/results/solve_quick.json", "w") as fh:
            json.dump({"env": env, "peak_bf16_tflops": peak, "best": best, "lines": SUMMARY}, fh, indent=1, default=str)
    else:
        best = {}
        if not args.no_tune:
            best = variants(dev, n=16384, tune_only=True) or {}
            trsv = refinement_kernels(dev, n=16384, block=best.get("diagdom", {}).get("block"))
            for kind, method in (trsv or {}).items():
                best.setdefault(kind, {})["trsv"] = method
        opts = {k: {kk: vv for kk, vv in v.items() if kk != "pivoting"} for k, v in best.items()}
        note(f"lu options for bench_solve: {opts}")
        res = bench_solve(
            sizes=tuple(int(s) for s in args.sizes.split(",")),
            factors=tuple(args.factors.split(",")),
            optional_factors=tuple(f for f in args.optional_factors.split(",") if f),
            optional_budget_s=args.optional_budget,
            kinds=tuple(args.kinds.split(",")),
            lu_options=opts or None,
            time_budget_s=args.budget,
            skip_slower=("general",),
            log=log,
        )
        SUMMARY.append("bench_solve table:\n" + res["table"])
    print("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
    print("\n".join(SUMMARY))
    print(f"total {elapsed():.0f} s")
    return 0


def cpu_smoke():
    """The same steps at tiny sizes on a CPU (tensor cores emulated): checks the script, not speed."""
    dev = torch.device("cpu")
    capabilities(dev)
    correctness(dev, n=192)
    panel_pieces(dev, n=512)
    best = variants(dev, n=256) or {}
    refinement_kernels(dev, n=256)
    refine_ab(dev, sizes=(256,), out=None)
    slow = solve_vs_fp64(dev, 256, best)
    solve_vs_fp64(dev, 320, best, slow=slow)
    res = bench_solve(sizes=(96, 128), factors=("bf16",), optional_factors=("fp8",), optional_budget_s=1e9,
                      lu_options={k: {kk: vv for kk, vv in v.items() if kk != "pivoting"} for k, v in best.items()},
                      skip_slower=("general",), device="cpu", out=None, log=log, repeats=1)
    SUMMARY.append(res["table"])
    print("\n".join(SUMMARY))
    return 0 if not any(line.startswith("FAILED") or "FAILED" in line for line in SUMMARY) else 1


if __name__ == "__main__":
    sys.exit(main())
