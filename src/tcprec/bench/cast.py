"""``tcprec bench cast``: how close ``tcprec.cast`` / ``tcprec.encode`` come to memory speed.

A cast is memory-bound, so its yardstick is a device-to-device copy of the same float32 tensor,
timed in the same run.  For each format and rounding mode we time

* ``tcprec.cast(x, fmt, rounding)``   float32 -> float32          (read 4 + write 4 bytes/element)
* ``tcprec.encode(x, fmt, rounding)`` float32 -> codes            (read 4 + write 1 or 2)

next to the baselines: ``dst.copy_(src)``, torch's own ``x.to(torch.float8_e4m3fn)`` and
``x.to(torch.bfloat16)``, and QPyTorch's ``float_quantize`` when it imports (it JIT-builds a CUDA
extension; its formats are IEEE-like without our exact specials, so it is timed, not compared).

Targets: a cast reaches >= 80% of copy bandwidth with round-to-nearest, >= 70% with stochastic
rounding.  encode writes fewer bytes than the copy; its fraction of copy bandwidth is reported
next to torch's own conversion, without a target.  Before timing, the GPU result on a 2**20-element slice
is compared bit for bit with the reference backend on the CPU (stochastic rounding included: same
seed, same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..formats import FloatFormat, as_format
from ..ops.cast import cast, choose_cast_backend, code_dtype, encode
from ..progress import bar as progress_bar
from .common import environment, gbps, print_environment, require_cuda, rotating_buffers, time_median_ms, write_json

__all__ = ["DEFAULT_FORMATS", "TARGETS", "CHECK_NUMEL", "run"]

DEFAULT_FORMATS = ("e4m3", "e5m2", "bf16", "fp6", "e3m4")
TARGETS = {"nearest": 0.80, "stochastic": 0.70}  # fraction of copy bandwidth
CHECK_NUMEL = 2**20
_TORCH_BASELINES = {"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
_F32 = 4  # bytes of a float32 element


@dataclass
class _Case:
    op: str  # "copy", "tcprec.cast", "tcprec.encode", "torch.to", "qtorch.float_quantize"
    fmt: str | None
    rounding: str | None
    bytes_per_element: int
    fn: Callable
    exact: bool | None = None  # GPU == reference backend, bit for bit (tcprec rows only)
    error: str | None = None  # why the case could not run


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality; NaNs match NaNs (their payload is not part of the contract)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    same = (a.view(int_dtype) == b.view(int_dtype)) | (torch.isnan(a) & torch.isnan(b))
    return bool(same.all())


def _check_exact(fn, x_small: torch.Tensor, fmt, rounding: str, seed: int) -> bool:
    """``fn`` (cast or encode) on the GPU equals the reference backend on the CPU, seed for seed."""
    y_gpu = fn(x_small, fmt, rounding, torch.Generator().manual_seed(seed))
    y_ref = fn(x_small.cpu(), fmt, rounding, torch.Generator().manual_seed(seed), backend="reference")
    return _same_bits(y_gpu, y_ref)


def _load_qtorch() -> tuple[Callable | None, dict]:
    """QPyTorch's float_quantize, or None and the reason (its import JIT-builds a CUDA extension)."""
    try:
        from qtorch.quant import float_quantize
    except Exception as e:  # ImportError, or a failed extension build (RuntimeError, OSError, ...)
        return None, {"available": False, "error": f"{type(e).__name__}: {e}"}
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("qtorch")
    except PackageNotFoundError:
        ver = None
    return float_quantize, {"available": True, "version": ver, "error": None}


def _cases(fmts, roundings, qtorch_fn, x_small, seed) -> list[_Case]:
    """Every timed case, copy first; each tcprec case is checked against the reference on
    ``x_small`` here, before anything is timed (a case that cannot run records its error)."""
    cases = [_Case("copy", None, None, 2 * _F32, lambda pair: pair[1].copy_(pair[0]))]
    for name, fmt in fmts:
        for rounding in roundings:
            for op, fn, nbytes in (
                ("tcprec.cast", cast, 2 * _F32),
                ("tcprec.encode", encode, _F32 + code_dtype(fmt).itemsize),
            ):
                case = _Case(op, name, rounding, nbytes, lambda t, fn=fn, fmt=fmt, r=rounding: fn(t, fmt, r))
                try:
                    case.exact = _check_exact(fn, x_small, fmt, rounding, seed)
                except Exception as e:  # a kernel that cannot run is reported, not hidden
                    case.error = f"{type(e).__name__}: {e}"
                cases.append(case)
            if qtorch_fn is not None and isinstance(fmt, FloatFormat) and rounding in ("nearest", "stochastic"):
                cases.append(_Case("qtorch.float_quantize", name, rounding, 2 * _F32,
                                   lambda t, e=fmt.exp, m=fmt.man, r=rounding: qtorch_fn(t, e, m, rounding=r)))
        torch_dtype = _TORCH_BASELINES.get(str(fmt))
        if torch_dtype is not None and "nearest" in roundings:
            cases.append(_Case("torch.to", name, "nearest", _F32 + torch_dtype.itemsize,
                               lambda t, dt=torch_dtype: t.to(dt)))
    return cases


def _baseline_ms(rows: list[dict], row: dict) -> tuple[str, float] | None:
    """The same-output baseline of a tcprec row: torch.to for encode, QPyTorch for cast."""
    other = {"tcprec.encode": "torch.to", "tcprec.cast": "qtorch.float_quantize"}.get(row["op"])
    for r in rows:
        if (r["op"], r["format"], r["rounding"]) == (other, row["format"], row["rounding"]) and r["ms"]:
            return other, r["ms"]
    return None


def run(
    numel: int,
    formats: Sequence[str] = DEFAULT_FORMATS,
    roundings: Sequence[str] = ("nearest", "stochastic"),
    out="benchmarks/results/cast.json",
    use_qtorch: bool = True,
    console: Console | None = None,
    command: str = "tcprec bench cast",
    seed: int = 0,
) -> dict:
    """Run the cast benchmark on the current CUDA device, print the table, write JSON to ``out``
    and return the payload ``{"env", "command", "numel", "backend", "qtorch", "rows"}``.

    Raises ``NeedsGPU`` without a CUDA device.
    """
    console = console or Console()
    device = require_cuda("tcprec bench cast")
    env = environment()
    print_environment(console, env)
    fmts = [(name, as_format(name)) for name in formats]

    x = torch.randn(numel, device=device, generator=torch.Generator(device).manual_seed(seed))
    backend, why = choose_cast_backend(x)
    console.print(f"[bold]backend[/] {backend}: {why}")
    if backend != "triton":
        console.print("[yellow]warning: not the Triton kernel; these timings are of the reference backend")
    qtorch_fn, qtorch_info = _load_qtorch() if use_qtorch else (None, {"available": False, "error": "--no-qtorch"})
    if use_qtorch and qtorch_fn is None:
        console.print(f"[yellow]QPyTorch not timed: {qtorch_info['error']}")

    cases = _cases(fmts, roundings, qtorch_fn, x[:CHECK_NUMEL], seed)
    srcs = rotating_buffers(x, env["l2_cache_bytes"])
    pairs = [(s, torch.empty_like(s)) for s in srcs]
    rows = []
    with progress_bar(len(cases), "bench cast") as progress:
        for case in cases:
            progress.update(description=f"bench cast: {case.op} {case.fmt or ''} {case.rounding or ''}")
            ms = None
            if case.error is None:
                try:
                    ms = time_median_ms(case.fn, pairs if case.op == "copy" else srcs)
                except Exception as e:
                    case.error = f"{type(e).__name__}: {e}"
            if case.error is not None:
                console.print(f"[red]{case.op} {case.fmt} {case.rounding}: {case.error}")
            rows.append({
                "op": case.op, "format": case.fmt, "rounding": case.rounding,
                "bytes_per_element": case.bytes_per_element, "ms": ms,
                "gb_per_s": None if ms is None else gbps(case.bytes_per_element * numel, ms),
                "exact": case.exact, "error": case.error,
            })
            progress.advance()

    copy_gbs = rows[0]["gb_per_s"]
    for row in rows:
        row["fraction_of_copy"] = None if None in (row["gb_per_s"], copy_gbs) else row["gb_per_s"] / copy_gbs
        target = TARGETS.get(row["rounding"]) if row["op"] == "tcprec.cast" else None
        row["target"] = target
        row["passed"] = None if target is None or row["ms"] is None else row["fraction_of_copy"] >= target
        base = _baseline_ms(rows, row)
        row["baseline"] = None if base is None else base[0]
        row["speedup_vs_baseline"] = None if base is None or row["ms"] is None else base[1] / row["ms"]

    payload = {
        "env": env, "command": command, "numel": numel, "seed": seed,
        "backend": {"name": backend, "reason": why}, "qtorch": qtorch_info, "rows": rows,
    }
    path = write_json(out, payload)
    console.print(_table(rows, numel))
    console.print(f"wrote {path}")
    return payload


def _table(rows: list[dict], numel: int) -> Table:
    def num(v, spec):
        return "-" if v is None else format(v, spec)

    t = Table(title=f"cast of {numel:,} float32 elements (median of do_bench; % of copy bandwidth in the same run)")
    for col in ("op", "format", "rounding", "B/elem", "ms", "GB/s", "% copy", "target", "exact", "speed vs"):
        t.add_column(col, justify="left" if col in ("op", "format", "rounding") else "right")
    for r in rows:
        verdict = "" if r["passed"] is None else ("[green]pass" if r["passed"] else "[red]FAIL")
        target = "" if r["target"] is None else f">= {r['target']:.0%} {verdict}"
        exact = "" if r["exact"] is None else ("[green]yes" if r["exact"] else "[red]NO")
        vs = "" if r["speedup_vs_baseline"] is None else f"{r['speedup_vs_baseline']:.2f}x {r['baseline']}"
        t.add_row(r["op"], r["format"] or "", r["rounding"] or "", str(r["bytes_per_element"]),
                  "[red]error" if r["error"] else num(r["ms"], ".4f"), num(r["gb_per_s"], ".0f"),
                  num(None if r["fraction_of_copy"] is None else 100 * r["fraction_of_copy"], ".1f"),
                  target, exact, vs)
    return t
