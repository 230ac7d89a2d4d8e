"""``run_solve``: generate a test system, solve it with ``solve`` and with fp64
``torch.linalg.solve`` in the same process, and return one flat dict (what ``tcprec solve`` prints).
"""

from __future__ import annotations

import time

import torch

from ..progress import bar
from .lu import canonical_factor, gemm_backend
from .matrices import make_matrix, random_rhs
from .refine import scaled_residual
from .solver import DEFAULT_REFINE, solve

__all__ = ["run_solve", "timed"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, *, warmup: int = 1, repeats: int = 1, slow_s: float | None = None):
    """(median seconds, sorted times, last result) of ``fn()`` over ``repeats`` synchronized calls
    after ``warmup`` calls; a warm-up call slower than ``slow_s`` cuts the repeats to one (to stay
    inside a benchmark's time budget)."""
    out = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        if slow_s is not None and time.perf_counter() - t0 > slow_s:
            repeats = 1
    times = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times, out


def run_solve(
    n: int = 1024,
    *,
    factor: str = "bf16",
    refine: str = DEFAULT_REFINE,
    kind: str = "diagdom",
    cond: float = 1e2,
    pivoting=None,
    device=None,
    seed: int = 0,
    nrhs: int | None = None,
    compare_fp64: bool = True,
    warmup: int | None = None,
    repeats: int = 1,
    quiet: bool = False,
    **solve_options,
) -> dict:
    """Solve a generated system of order ``n`` and compare with fp64 ``torch.linalg.solve``.

    ``kind``: "diagdom" (HPL-MxP matrix; default pivoting none, as HPL-MxP allows) or "general"
    (condition number ``cond``; default partial pivoting).  ``device`` defaults to CUDA when
    available; on a CPU the tensor-core GEMMs are emulated and the result says so.  A progress bar
    (stderr, terminals only; ``quiet=True`` or :func:`tcprec.progress.quiet` silences it) names the phase.

    >>> r = run_solve(128, factor="bf16", device="cpu")
    >>> r["converged"], r["meets_criterion"]
    (True, True)
    """
    factor = canonical_factor(factor)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if pivoting is None:
        pivoting = False if kind == "diagdom" else True
    if warmup is None:
        warmup = 1 if dev.type == "cuda" else 0
    with bar(2 + bool(compare_fp64), f"solve n={n}", quiet=quiet) as progress:
        progress.update(description=f"solve n={n}: generating the {kind} matrix")
        t0 = time.perf_counter()
        A = make_matrix(kind, n, cond=cond, seed=seed, device=dev)
        b = random_rhs(n, nrhs, seed=seed + 1, device=dev)
        _sync(dev)
        gen_s = time.perf_counter() - t0
        progress.advance(description=f"solve n={n}: {factor} LU + {refine} ({warmup + repeats} calls)")
        t, _, (x, info) = timed(
            lambda: solve(A, b, factor=factor, refine=refine, pivoting=pivoting, **solve_options),
            dev, warmup=warmup, repeats=repeats,
        )
        progress.advance(description=f"solve n={n}: fp64 torch.linalg.solve")
        if compare_fp64:
            t64, _, x64 = timed(lambda: torch.linalg.solve(A, b), dev, warmup=warmup, repeats=repeats)
            progress.advance()
    row = {
        "n": n, "nrhs": nrhs or 1, "kind": kind, "cond": cond if kind == "general" else None,
        "factor": factor, "refine": refine, "pivoting": info.pivoting, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tensor_cores": dev.type == "cuda",
        "gemm": gemm_backend(factor, dev),
        "time_s": t, "factor_time_s": info.factor_time_s, "refine_time_s": info.refine_time_s,
        "backward_error": info.backward_error, "meets_criterion": info.meets_criterion,
        "converged": info.converged, "path": info.path, "reason": info.reason,
        "iterations": info.iterations, "inner_iterations": info.inner_iterations,
        "history": list(info.history), "generate_s": gen_s,
    }
    if compare_fp64:
        row.update(
            fp64_time_s=t64,
            fp64_backward_error=scaled_residual(A, x64, b),
            speedup=t64 / t if t > 0 else float("nan"),
            max_rel_diff_vs_fp64=float((x - x64).abs().max() / x64.abs().max().clamp_min(1e-300)),
        )
    return row
