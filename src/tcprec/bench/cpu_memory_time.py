"""``tcprec bench cpu-memory-time``: CPU memory and time of conversion and emulated layers (issue 40).

Targets (issue 40, "Memory and CPU time"):

* ``quantize_model`` peaks at <= 3x the model's fp32 weight size above the memory held before the call
  (cases ``linear_9216x4096`` -- one nn.Linear(9216, 4096), 151 MB -- and ``alexnet``; the first forward, which
  builds the packed weights, is reported beside it);
* an emulated layer within 10x of its plain float time (``EmulatedLinear(256, 256)``, e5m10 accumulator, batch
  64, forward + backward, against nn.Linear in the same process), in both accumulation models: ``fma`` (every
  product and sum rounded, the layer's default) and ``chunk`` (fp32 partial sums of 32, hardware-like).

Peak memory is the process's peak RSS (``resource.getrusage(...).ru_maxrss``) minus its RSS just before the call,
each case in a fresh subprocess (so one case's peak does not hide another's); an emulated layer's time is a median
of the process's CPU time (``time.process_time``), conversion times are wall-clock.
Threads are pinned to 1 so the ratios do not depend on the load of a shared machine.

Case names: ``linear_<in>x<out>`` (one nn.Linear, int8, batch 8), ``alexnet`` (the zoo's AlexNet, int8, one
224x224 image), ``emulated_linear_<acc>`` / ``emulated_linear_chunk_<acc>`` (``EmulatedLinear(F, F)`` with accumulator
format ``acc``, ``acc_mode`` fma / chunk, batch B, F and B from ``--emulated-features`` / ``--emulated-batch``).

A case runs as ``python <this file> --case NAME ...`` (this file as a script: only the measured code comes from the
``tcprec`` on the path), so ``--baseline SRC`` can put another checkout's ``src`` first on PYTHONPATH and run the
same measurement on it, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from typing import Sequence

# No tcprec import at module level: the case runner (``--case``) must import the tcprec under test, which
# ``--baseline`` puts first on PYTHONPATH.

__all__ = ["CASES", "check_case", "run_case", "summarize", "run"]

CASES = ("linear_9216x4096", "alexnet", "emulated_linear_e5m10", "emulated_linear_chunk_e5m10")
_LINEAR = re.compile(r"linear_(\d+)x(\d+)")
_EMULATED = re.compile(r"emulated_linear_(?:(chunk)_)?(\w+)")  # (acc_mode, acc format)
CONVERT_TARGET = 3.0  # quantize_model's peak above the memory held before, in fp32 weight sizes
EMULATED_TARGET = 10.0  # an emulated layer's fwd + bwd time in plain nn.Linear times


def check_case(name: str) -> str:
    """``name`` if it is a case this suite knows, else ValueError with the accepted forms."""
    if name == "alexnet":
        return name
    m = _LINEAR.fullmatch(name)
    if m and int(m[1]) > 0 and int(m[2]) > 0:
        return name
    m = _EMULATED.fullmatch(name)
    if m:
        from tcprec.formats import as_format  # lazy: this file runs as a script against the tcprec under test

        try:
            as_format(m[2])
        except (ValueError, TypeError) as e:
            raise ValueError(f"case {name!r}: the accumulator format {m[2]!r} is not a format ({e})") from None
        return name
    raise ValueError(f"unknown case {name!r}; accepted: linear_<in>x<out> (e.g. linear_9216x4096), alexnet, "
                     f"emulated_linear_[chunk_]<acc format> (e.g. emulated_linear_e5m10, emulated_linear_chunk_e5m10); "
                     f"default: {','.join(CASES)}")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _conversion(build, x) -> dict:
    import torch

    from tcprec.nn import quantize_model  # lazy: the tcprec under test (--baseline puts another checkout first)

    torch.manual_seed(0)
    model = build().eval()
    weights_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    before, peak_before = _rss_mb(), _peak_mb()
    t0 = time.perf_counter()
    q = quantize_model(model, "int8", calibration=x, warn=False)
    t_convert = time.perf_counter() - t0
    peak_convert = _peak_mb()
    with torch.no_grad():
        t0 = time.perf_counter()
        q(x)
        t_first = time.perf_counter() - t0
    peak_first = _peak_mb()
    return {"weights_fp32_mb": round(weights_mb, 1), "rss_before_mb": round(before, 1),
            "peak_before_call_mb": round(peak_before, 1),
            "convert_peak_above_before_mb": round(peak_convert - before, 1),
            "convert_peak_x_weights": round((peak_convert - before) / weights_mb, 2),
            "convert_s": round(t_convert, 2),
            "first_forward_peak_above_before_mb": round(peak_first - before, 1),
            "first_forward_peak_x_weights": round((peak_first - before) / weights_mb, 2),
            "first_forward_s": round(t_first, 2)}


def _paired_times(plain, emulated, rounds: int = 9, inner: int = 10) -> tuple[float, float]:
    """Median CPU times of the process (1 thread: an idle machine's wall time, not stretched by other users'
    processes time-slicing a shared one) of ``plain`` (the mean of ``inner`` calls a round) and ``emulated``, the two
    alternating round by round so both sides see the same load."""
    plain(), emulated()  # warm-up
    tp, te = [], []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(inner):
            plain()
        tp.append((time.process_time() - t0) / inner)
        t0 = time.process_time()
        emulated()
        te.append(time.process_time() - t0)
    return sorted(tp)[rounds // 2], sorted(te)[rounds // 2]


def _emulated(acc: str, mode: str, features: int, batch: int) -> dict:
    import torch

    from tcprec.nn.emulated import EmulatedLinear, Recipe  # lazy: the tcprec under test

    torch.manual_seed(0)
    plain = torch.nn.Linear(features, features)
    emu = EmulatedLinear.from_module(plain, Recipe(acc=acc, acc_mode=mode))
    x = torch.randn(batch, features, requires_grad=True)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).square().mean().backward()
        return run

    t_plain, t_emu = _paired_times(step(plain), step(emu))
    return {"plain_ms": round(t_plain * 1e3, 3), "emulated_ms": round(t_emu * 1e3, 2),
            "ratio": round(t_emu / t_plain, 1), "features": features, "batch": batch, "acc": acc, "mode": mode}


def run_case(name: str, emulated_features: int = 256, emulated_batch: int = 64) -> dict:
    """One case in this process (peak RSS is the process's: run each in a fresh one, as :func:`run` does)."""
    import torch

    torch.set_num_threads(1)
    check_case(name)
    if name == "alexnet":
        from tcprec.nn import models as zoo  # lazy: the tcprec under test

        return _conversion(lambda: zoo.build("alexnet"), torch.randn(1, 3, 224, 224))
    m = _LINEAR.fullmatch(name)
    if m:
        n_in, n_out = int(m[1]), int(m[2])
        return _conversion(lambda: torch.nn.Linear(n_in, n_out), torch.randn(8, n_in))
    m = _EMULATED.fullmatch(name)
    return _emulated(m[2], m[1] or "fma", emulated_features, emulated_batch)



def _subprocess_case(name: str, src: str | None, features: int, batch: int) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    # -P: the script's folder (tcprec/bench) is not put on sys.path, so its modules shadow nothing
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--case", name, "--emulated-features", str(features),
           "--emulated-batch", str(batch)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"case {name} ({'baseline ' + src if src else 'current tree'}) failed with exit code "
                           f"{r.returncode}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _rows(detail: dict, suffix: str = "") -> list[dict]:
    rows = []
    for k, v in detail.items():
        if "ratio" in v:
            rows.append({"case": f"EmulatedLinear({v['features']},{v['features']}) {v['acc']} "
                                 f"{v.get('mode', 'fma')} b{v['batch']} fwd+bwd{suffix}", "plain_ms": v["plain_ms"],
                         "emulated_ms": v["emulated_ms"],
                         "ratio": v["ratio"]})
        else:
            rows.append({"case": k + suffix, "weights_mb": v["weights_fp32_mb"],
                         "convert_peak_mb": v["convert_peak_above_before_mb"], "x_weights": v["convert_peak_x_weights"],
                         "convert_s": v["convert_s"], "first_fwd_peak_mb": v["first_forward_peak_above_before_mb"]})
    # conversions first, then the emulated layers (the table of the script this suite replaced)
    return sorted(rows, key=lambda r: "ratio" in r)


def summarize(detail: dict, baseline: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The table (conversions, then emulated layers; the baseline's rows after) and issue 40's targets of
    :func:`run_case` results (case name -> result)."""
    summary = _rows(detail) + (_rows(baseline, " (baseline)") if baseline else [])
    targets = []
    for k, v in detail.items():
        if "ratio" in v:
            targets.append({"target": f"EmulatedLinear {v['acc']} {v.get('mode', 'fma')} within "
                                      f"{EMULATED_TARGET:g}x of nn.Linear (fwd+bwd, CPU)", "value": f"{v['ratio']}x",
                            "met": v["ratio"] <= EMULATED_TARGET})
        else:
            targets.append({"target": f"quantize_model peak <= {CONVERT_TARGET:g}x fp32 weights ({k})",
                            "value": f"{v['convert_peak_x_weights']}x",
                            "met": v["convert_peak_x_weights"] <= CONVERT_TARGET})
    targets.sort(key=lambda t: t["target"].startswith("Emulated"))
    return summary, targets


def run(cases: Sequence[str] = CASES, out="benchmarks/results/cpu_memory_time.json", baseline: str | None = None,
        emulated_features: int = 256, emulated_batch: int = 64, command: str = "tcprec bench cpu-memory-time",
        console=None) -> dict:
    """Each case in a fresh process (and again with ``baseline`` first on PYTHONPATH); JSON to ``out``; returned."""
    import torch
    from rich.console import Console

    from .common import git_commit, write_json  # lazy: this file also runs as a script (the case runner), outside the package

    console = console or Console(stderr=True)
    for name in cases:
        check_case(name)
    if baseline is not None and not os.path.isdir(os.path.join(baseline, "tcprec")):
        raise ValueError(f"baseline must be a source folder holding the tcprec package (e.g. "
                         f"/path/to/checkout/src), got {baseline!r}: no {os.path.join(baseline, 'tcprec')}")

    def case(name, src=None):
        r = _subprocess_case(name, src, emulated_features, emulated_batch)
        console.print(f"{'baseline' if src else 'current'} {name} {r}", markup=False)
        return r

    detail = {name: case(name) for name in cases}
    base = {name: case(name, baseline) for name in cases} if baseline else None
    summary, targets = summarize(detail, base)
    result = {"suite": "cpu_memory_time", "command": command,
              "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread, "
                        f"torch {torch.__version__}",
              "commit": git_commit(), "summary": summary, "targets": targets, "detail": detail,
              "baseline": None if base is None else {"src": baseline, "detail": base},
              "load_note": "a shared 2-core machine: conversion times (wall) vary with other users' load; the "
                           "emulated layers' times are CPU time of the process (1 thread), both sides of a ratio "
                           "measured back to back in one process"}
    path = write_json(out, result)
    console.print(f"wrote {path}")
    return result


def _main() -> None:  # the case runner: python <this file> --case NAME
    ap = argparse.ArgumentParser(description="one case of tcprec bench cpu-memory-time, JSON on stdout")
    ap.add_argument("--case", required=True)
    ap.add_argument("--emulated-features", type=int, default=256)
    ap.add_argument("--emulated-batch", type=int, default=64)
    a = ap.parse_args()
    print(json.dumps(run_case(a.case, a.emulated_features, a.emulated_batch)))


if __name__ == "__main__":
    _main()
