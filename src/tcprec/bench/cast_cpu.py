"""``tcprec bench cast-cpu``: ``tcprec.cast`` / ``encode`` on the CPU against ml_dtypes and torch.

The reference backend's float32 route (``kernels/fast_cast.py``) next to, in the same process:

* ml_dtypes' ``x.astype(float8_e4m3fn)`` (numpy, one thread) for the formats it has: the target is
  ``tcprec.cast`` within 3x of it, round to nearest;
* torch's ``x.to(torch.float8_e4m3fn)`` / ``x.to(torch.bfloat16)`` where torch has the format;
* the int64 / float64 specification (``kernels/reference.py``), which the fast route replaced.

A CPU cast is timed with the host clock: median of ``reps`` calls after one warm-up call.  Before
timing, every tcprec case is compared bit for bit with the specification on the same input (and its
nearest-even codes with ml_dtypes where ml_dtypes has the format).  ``--threads`` pins torch's
intra-op threads (ml_dtypes uses one); the default, 1, compares like with like.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable, Sequence

import numpy as np
import torch

from ..formats import FloatFormat, IntFormat, as_format
from ..kernels import reference as ref
from ..ops.cast import cast, encode
from ..progress import bar as progress_bar
from .common import git_commit, write_json

__all__ = ["DEFAULT_FORMATS", "TARGET_RATIO", "run"]

DEFAULT_FORMATS = ("e4m3", "e5m2", "bf16", "fp16", "fp6", "fp4", "int8", "int4")
TARGET_RATIO = 3.0  # tcprec.cast nearest <= 3x ml_dtypes' astype
_ML_NAMES = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
             "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn", "bfloat16", "float16", "int8", "int4", "int2",
             "uint8", "uint4", "uint2"}
_TORCH = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def _ml_dtype(name: str):
    import ml_dtypes

    return np.float16 if name == "float16" else (np.int8 if name == "int8" else np.uint8 if name == "uint8"
                                                 else getattr(ml_dtypes, name))


def _median_ms(fn: Callable, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a.to(torch.int64), b.to(torch.int64))


def _spec(fn: str, x: torch.Tensor, fmt, rounding: str, seed: int) -> torch.Tensor:
    """The int64 / float64 specification's result (reference.py), as the op returns it."""
    if isinstance(fmt, IntFormat):
        f = ref.cast_int if fn == "cast" else ref.encode_int
    else:
        f = ref.cast_float if fn == "cast" else ref.encode_float
    return f(x, fmt, rounding, seed)



def run(numel: int = 2**20, formats: Sequence[str] = DEFAULT_FORMATS,
        roundings: Sequence[str] = ("nearest", "stochastic"), out="benchmarks/results/cast_cpu.json",
        reps: int = 15, threads: int = 1, command: str = "tcprec bench cast-cpu", console=None,
        progress: bool = True) -> dict:
    """Time the CPU cases, print a table, write JSON to ``out`` (COMMON.md's convention) and return it."""
    from rich.console import Console
    from rich.table import Table


    console = console or Console(stderr=True)
    torch.set_num_threads(threads)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    xn = x.numpy()
    device = f"cpu: {platform.processor() or platform.machine()}, torch threads {threads}"
    rows, detail = [], []
    plan = [(n, as_format(n), r) for n in formats for r in roundings]
    with progress_bar(len(plan), "cast-cpu", quiet=not progress) as bar:
        for name, fmt, rounding in plan:
            bar.update(description=f"cast-cpu {name} {rounding}")
            key = str(fmt)
            seed = 1234
            gen = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
            row = {"format": key, "rounding": rounding}
            # exactness first: the fast route against the specification, cast and encode
            y = cast(x, fmt, rounding, gen())
            c = encode(x, fmt, rounding, gen())
            op_seed = int(torch.randint(0, 2**62, (1,), generator=gen()).item()) if rounding == "stochastic" else None
            exact = _same(y, _spec("cast", x, fmt, rounding, op_seed))
            mask = (1 << fmt.bits) - 1
            exact &= torch.equal(c.to(torch.int64) & mask, _spec("encode", x, fmt, rounding, op_seed) & mask)
            if rounding == "nearest" and key in _ML_NAMES:
                ml = xn.astype(_ml_dtype(key))
                if isinstance(fmt, FloatFormat):
                    exact &= np.array_equal(y.numpy().view(np.int32), ml.astype(np.float32).view(np.int32))
            row["exact"] = bool(exact)
            row["tcprec_cast_ms"] = _median_ms(lambda: cast(x, fmt, rounding, gen()), reps)
            row["tcprec_encode_ms"] = _median_ms(lambda: encode(x, fmt, rounding, gen()), reps)
            row["spec_cast_ms"] = _median_ms(lambda: _spec("cast", x, fmt, rounding, op_seed), max(3, reps // 5))
            row["ml_dtypes_ms"] = (_median_ms(lambda: xn.astype(_ml_dtype(key)), reps)
                                   if rounding == "nearest" and key in _ML_NAMES else None)
            row["torch_to_ms"] = (_median_ms(lambda: x.to(_TORCH[key]), reps)
                                  if rounding == "nearest" and key in _TORCH else None)
            row["ratio_to_ml_dtypes"] = (None if row["ml_dtypes_ms"] is None
                                         else row["tcprec_cast_ms"] / row["ml_dtypes_ms"])
            row["speedup_vs_spec"] = row["spec_cast_ms"] / row["tcprec_cast_ms"]
            detail.append(row)
            bar.advance()

    for r in detail:
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                     if k in ("format", "rounding", "tcprec_cast_ms", "ml_dtypes_ms", "ratio_to_ml_dtypes",
                              "speedup_vs_spec", "exact")})
    targets = []
    for r in detail:
        if r["ratio_to_ml_dtypes"] is not None and isinstance(as_format(r["format"]), FloatFormat):
            targets.append({"target": f"cast {r['format']} nearest <= {TARGET_RATIO:g}x ml_dtypes",
                            "value": f"{r['ratio_to_ml_dtypes']:.2f}x",
                            "met": r["ratio_to_ml_dtypes"] <= TARGET_RATIO})
    targets.append({"target": "bit-exact with the int64 specification (and ml_dtypes, nearest)",
                    "value": f"{sum(r['exact'] for r in detail)}/{len(detail)} cases",
                    "met": all(r["exact"] for r in detail)})
    payload = {"suite": "cast_cpu", "command": command, "device": device, "commit": git_commit(),
               "summary": rows, "targets": targets, "numel": numel, "reps": reps, "threads": threads,
               "torch": torch.__version__, "cases": detail,
               "notes": ("ml_dtypes' integer astype is a C cast (truncation, wrap-around), not a rounding with "
                         "saturation: integer rows report it for scale only; targets are for float formats")}
    path = write_json(out, payload)
    t = Table(title=f"CPU cast of {numel:,} float32 (median of {reps}; torch threads {threads})")
    for col in ("format", "rounding", "cast ms", "encode ms", "ml_dtypes ms", "x ml_dtypes", "torch.to ms",
                "x faster than spec", "exact"):
        t.add_column(col, justify="left" if col in ("format", "rounding") else "right")

    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for r in detail:
        t.add_row(r["format"], r["rounding"], f(r["tcprec_cast_ms"]), f(r["tcprec_encode_ms"]), f(r["ml_dtypes_ms"]),
                  f(r["ratio_to_ml_dtypes"]), f(r["torch_to_ms"]), f(r["speedup_vs_spec"], ".1f"),
                  "yes" if r["exact"] else "NO")
    console.print(t)
    console.print(f"wrote {path}")
    return payload
