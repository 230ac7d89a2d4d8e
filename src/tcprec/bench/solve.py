"""Benchmark: ``tcprec.linalg.solve`` (low-precision tensor-core LU + fp64 refinement) against
fp64 ``torch.linalg.solve``, in the same process, on the same matrices.

For every size n and matrix kind the matrix is generated once (fp64, on the device); then

* fp64 ``torch.linalg.solve(A, b)``: ``warmup`` + ``repeats`` timed calls, median;
* ``solve(A, b, factor=f)`` for each factor format: the same;

and each row reports time, speedup over fp64, the HPL-MxP scaled backward error of both answers,
iterations, converged / path, and the effective rate (2/3 n^3) / time in TFLOP/s next to a bf16
``torch.matmul`` 8192^3 peak measured in the same run.  Results go to
``benchmarks/results/solve.json`` with the environment (GPU, driver, torch, triton, CUDA).

``bench_solve`` returns ``{"env", "peak", "rows", "table"}``; ``format_table(rows)`` renders rows.
On a CPU it runs too (small sizes; tensor cores emulated, labelled so) -- for smoke tests only.
``run(...)`` is the ``tcprec bench solve`` entry point (CUDA only, like every ``tcprec bench``).

Timing: a solve is one long call (tens to hundreds of ms) that synchronizes the host itself, so it is
timed with ``torch.cuda.synchronize`` + ``perf_counter`` around each call, after a warm-up, median
of ``repeats``; inputs (GBs) are far beyond L2, so no buffer rotation is needed.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import time

import torch

from ..linalg import DEFAULT_REFINE, gemm_backend, make_matrix, random_rhs, scaled_residual, solve
from ..linalg.demo import timed
from ..progress import track
from .common import environment as _common_environment
from .common import require_cuda, write_json

__all__ = ["run", "bench_solve", "format_table", "environment", "measure_bf16_peak"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, warmup: int, repeats: int, slow_s: float = 5.0):
    """linalg.demo.timed with a 5 s warm-up budget: (median s, sorted times, last result)."""
    return timed(fn, device, warmup=warmup, repeats=repeats, slow_s=slow_s)


def environment(device: torch.device) -> dict:
    """tcprec's environment record (GPU, driver, torch, triton, ...) plus the benchmark device."""
    try:
        env = dict(_common_environment())
    except Exception as e:  # noqa: BLE001 - never lose a benchmark to the environment probe
        env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "python": platform.python_version(), "env_error": f"{type(e).__name__}: {e}"}
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20)
                env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
            except (OSError, subprocess.SubprocessError, IndexError):
                env["driver"] = None
    env["bench_device"] = str(device)
    if device.type != "cuda":
        env["note"] = "CPU: tensor-core GEMMs emulated in software; timings say nothing about GPUs"
    return env


def measure_bf16_peak(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of a bf16 torch.matmul size^3 (median), the rate the LU's GEMMs aim at."""
    if device.type != "cuda":
        size = min(size, 512)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    t, _, _ = _time(lambda: a @ b, device, warmup=3, repeats=repeats)
    return 2.0 * size**3 / t / 1e12


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_solve(
    sizes=(8192, 16384, 32768),
    factors=("bf16", "fp16", "fp8"),
    kinds=("diagdom", "general"),
    *,
    refine: str = DEFAULT_REFINE,
    cond: float = 1e2,
    pivoting: dict | None = None,
    warmup: int = 1,
    repeats: int = 3,
    device=None,
    out: str | None = "benchmarks/results/solve.json",
    lu_options: dict | None = None,
    time_budget_s: float | None = None,
    skip_slower: tuple = (),
    optional_factors: tuple = (),
    optional_budget_s: float | None = None,
    log=print,
) -> dict:
    """Benchmark ``solve`` against fp64 ``torch.linalg.solve`` (see the module docstring).

    ``pivoting``: per kind, default ``{"diagdom": False, "general": True}`` (HPL-MxP factors its
    diagonally dominant matrix without pivoting).  ``lu_options``: passed to ``solve`` (block,
    panel, trsv, options=LUOptions(...)), or one such dict per kind (``{"general": {...}}``).  ``time_budget_s``: rows that would start after this
    many seconds are skipped (reported as such).  ``skip_slower``: kinds (e.g. ``("general",)``)
    whose (kind, factor) row is skipped when the same row at the previous, smaller n was slower
    than fp64 (the row says so; if every factor of a kind is skipped, so are its matrix and fp64
    baseline).  ``optional_factors``: run after ``factors`` only while less than
    ``optional_budget_s`` seconds have passed (e.g. fp8 "if time allows").  Every row catches its
    own exceptions.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    piv = {"diagdom": False, "general": True, **(pivoting or {})}
    lu_options = dict(lu_options or {})
    per_kind = bool(lu_options) and all(k in kinds for k in lu_options)  # {"diagdom": {...}, ...}
    options_for = (lambda kind: dict(lu_options.get(kind, {}))) if per_kind else (lambda kind: lu_options)
    t_begin = time.perf_counter()
    env = environment(dev)
    log(f"[bench_solve] {env.get('gpu') or 'CPU'} torch {env.get('torch')} triton {env.get('triton')} "
        f"driver {env.get('driver')}")
    try:
        peak = measure_bf16_peak(dev)
    except Exception as e:  # noqa: BLE001 - report and go on
        peak = float("nan")
        log(f"[bench_solve] bf16 peak measurement failed: {e!r}")
    log(f"[bench_solve] bf16 matmul peak: {peak:.0f} TFLOP/s")
    rows: list = []

    def over_budget() -> bool:
        return time_budget_s is not None and time.perf_counter() - t_begin > time_budget_s

    last_speedup: dict = {}  # (kind, factor) -> (n, speedup) of the latest row that ran

    def slower_before(kind, f):
        if kind not in skip_slower or (kind, f) not in last_speedup:
            return None
        n0, sp = last_speedup[(kind, f)]
        return f"skipped: {sp:.2f}x fp64 (slower) at n={n0}" if sp < 1.0 else None

    def optional_skip(f):
        if f in factors or optional_budget_s is None or time.perf_counter() - t_begin <= optional_budget_s:
            return None
        return f"skipped: optional factor, past {optional_budget_s:.0f} s"

    all_factors = tuple(factors) + tuple(f for f in optional_factors if f not in factors)
    for n in sizes:
        for kind in track(kinds, f"bench solve n={n}", label=str):
            base = {"n": n, "kind": kind, "cond": cond if kind == "general" else None}
            if over_budget():
                rows.append({**base, "factor": "fp64", "error": "skipped: time budget"})
                continue
            skips = {f: slower_before(kind, f) or optional_skip(f) for f in all_factors}
            if all(skips.values()):
                rows.append({**base, "factor": "fp64", "skipped": "skipped: no factor left to run (slower than "
                             "fp64 at the previous n, or optional)"})
                rows += [{**base, "factor": f, "skipped": skips[f]} for f in all_factors]
                log(f"[bench_solve] n={n} {kind}: skipped (no factor left to run)")
                continue
            A = b = None
            try:
                t0 = time.perf_counter()
                A = make_matrix(kind, n, cond=cond, seed=0, device=dev)
                b = random_rhs(n, seed=1, device=dev)
                _sync(dev)
                gen_s = time.perf_counter() - t0
                t64, ts64, x64 = _time(lambda: torch.linalg.solve(A, b), dev, warmup, repeats)
                be64 = scaled_residual(A, x64, b)
                del x64
                row64 = {**base, "factor": "fp64", "method": "torch.linalg.solve fp64", "time_s": t64,
                         "times_s": ts64, "backward_error": be64, "speedup": 1.0, "generate_s": gen_s,
                         "tflops": 2 / 3 * n**3 / t64 / 1e12}
                rows.append(row64)
                log(f"[bench_solve] n={n} {kind}: generated in {gen_s:.1f}s; fp64 solve {t64 * 1e3:.1f} ms, "
                    f"backward error {be64:.3g}")
            except Exception as e:  # noqa: BLE001
                rows.append({**base, "factor": "fp64", "error": f"{type(e).__name__}: {e}"})
                log(f"[bench_solve] n={n} {kind}: baseline failed: {e!r}")
                A = b = None
                _free(dev)
                continue
            _free(dev)
            for f in all_factors:
                row = {**base, "factor": f, "refine": refine, "pivoting": piv[kind]}
                if over_budget():
                    rows.append({**row, "error": "skipped: time budget"})
                    continue
                skips[f] = skips[f] or optional_skip(f)
                if skips[f]:
                    rows.append({**row, "skipped": skips[f]})
                    log(f"[bench_solve] n={n} {kind} {f}: {skips[f]}")
                    continue
                try:
                    t, ts, (x, info) = _time(
                        lambda: solve(A, b, factor=f, refine=refine, pivoting=piv[kind], **options_for(kind)),
                        dev, warmup, repeats,
                    )
                    del x
                    row.update(
                        method=f"tcprec.linalg.solve {info.path}", time_s=t, times_s=ts,
                        backward_error=info.backward_error, meets_criterion=info.meets_criterion,
                        converged=info.converged, path=info.path, reason=info.reason,
                        iterations=info.iterations, inner_iterations=info.inner_iterations,
                        factor_time_s=info.factor_time_s, refine_time_s=info.refine_time_s,
                        speedup=t64 / t, tflops=2 / 3 * n**3 / t / 1e12,
                        frac_bf16_peak=(2 / 3 * n**3 / t / 1e12) / peak if peak == peak else None,
                        block=info.block, gemm=gemm_backend(f, dev), history=list(info.history),
                        lu_options=options_for(kind),
                        fp64_time_s=t64, fp64_backward_error=be64,
                    )
                    last_speedup[(kind, f)] = (n, t64 / t)
                    log(f"[bench_solve] n={n} {kind} {f}: {t * 1e3:.1f} ms ({t64 / t:.2f}x fp64), "
                        f"be {info.backward_error:.3g}, {info.path}, it {info.iterations}/{info.inner_iterations}, "
                        f"factor {info.factor_time_s * 1e3:.1f} ms, refine {info.refine_time_s * 1e3:.1f} ms")
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"
                    log(f"[bench_solve] n={n} {kind} {f}: FAILED {e!r}")
                rows.append(row)
                _free(dev)
            A = b = None
            _free(dev)

    result = {
        "benchmark": "solve",
        "command": "tcprec bench solve",
        "env": env,
        "peak": {"bf16_matmul_8192_tflops": peak},
        "config": {"refine": refine, "cond": cond, "pivoting": piv, "warmup": warmup, "repeats": repeats,
                   "lu_options": lu_options, "skip_slower": list(skip_slower),
                   "optional_factors": list(optional_factors), "optional_budget_s": optional_budget_s},
        "rows": rows,
        "elapsed_s": time.perf_counter() - t_begin,
    }
    result["table"] = format_table(rows)
    if out:
        path = write_json(out, result)
        log(f"[bench_solve] wrote {path}")
    return result


def run(
    sizes=(8192, 16384, 32768),
    factors=("bf16", "fp16", "fp8"),
    kinds=("diagdom", "general"),
    out="benchmarks/results/solve.json",
    console=None,
    command: str = "tcprec bench solve",
    **options,
) -> dict:
    """``tcprec bench solve``: :func:`bench_solve` on the current CUDA device, printing progress and
    the table.  Raises ``NeedsGPU`` without a CUDA device.  ``options`` go to ``bench_solve``."""
    device = require_cuda(command)
    printer = console.print if console is not None else print
    res = bench_solve(sizes, factors, kinds, device=device, out=None, log=printer, **options)
    res["command"] = command
    if out:
        res["json"] = str(write_json(out, res))
    printer(res["table"])
    if out:
        printer(f"wrote {res['json']}")
    return res


def format_table(rows: list) -> str:
    """Fixed-width text table of bench_solve rows."""
    head = f"{'n':>6} {'kind':8} {'factor':6} {'ms':>9} {'x fp64':>7} {'bwd err':>9} {'path':22} {'it':>6} {'TF/s':>6} {'%pk':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['n']:>6} {r['kind']:8} {r['factor']:6} {r['skipped'][:80]}")
            continue
        if "error" in r:
            lines.append(f"{r['n']:>6} {r['kind']:8} {r['factor']:6} {'ERROR: ' + r['error'][:70]}")
            continue
        it = "" if r["factor"] == "fp64" else f"{r.get('iterations', '')}/{r.get('inner_iterations', '')}"
        frac = r.get("frac_bf16_peak")
        lines.append(
            f"{r['n']:>6} {r['kind']:8} {r['factor']:6} {r['time_s'] * 1e3:9.1f} {r['speedup']:7.2f} "
            f"{r['backward_error']:9.3g} {r.get('path', 'fp64 LAPACK-style'):22} {it:>6} "
            f"{r['tflops']:6.1f} {'' if frac is None else f'{100 * frac:5.1f}'}"
        )
    return "\n".join(lines)
