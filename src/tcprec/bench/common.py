"""Benchmark methodology shared by every ``tcprec bench`` command.

* Time on the GPU with ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed before each
  run) and report the **median**.
* Rotate over copies of the inputs whose total size is well beyond the L2 cache, so no run reads
  data a previous run left in cache.
* Measure the baseline (a device-to-device copy, torch, QPyTorch, ...) in the **same process and
  run**, and report ratios to it.
* Print the environment (GPU, driver, torch, triton) and write everything to JSON in
  ``benchmarks/results/``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..env import device_report
from ..timing import graph_ms, graph_ms_alternating

__all__ = [
    "NeedsGPU",
    "require_cuda",
    "environment",
    "print_environment",
    "copies_needed",
    "rotating_buffers",
    "time_median_ms",
    "time_graph_ms",
    "time_graphs_alternating_ms",
    "gbps",
    "write_json",
    "git_commit",
    "cpu_name",
]

# Used when the device does not report its L2 size: larger than the L2 of any current GPU
# (H100 50 MiB, B200 126 MiB), so rotation stays effective.
_FALLBACK_L2_BYTES = 256 * 2**20


class NeedsGPU(RuntimeError):
    """A benchmark was asked to run on a machine without a CUDA GPU."""


def require_cuda(command: str) -> torch.device:
    """The CUDA device to benchmark on, or ``NeedsGPU`` with the reason and what to do instead."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    why = (
        f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    )
    raise NeedsGPU(
        f"{command} needs a CUDA GPU; {why}. Timings of the pure-torch reference backend would say "
        "nothing about the kernels. Run it on a GPU machine with a CUDA build of torch; here, "
        "`tcprec demo` and `python -m pytest` run on the reference backend."
    )


def environment() -> dict:
    """The environment record every benchmark JSON carries (see :func:`tcprec.env.device_report`)."""
    return device_report()


def print_environment(console, env: dict) -> None:
    """One line each for the GPU and the software versions, printed before any timing."""
    console.print(
        f"[bold]GPU[/] {env['gpu']} (sm_{str(env['compute_capability']).replace('.', '')}, "
        f"{env['sm_count']} SMs, {env['gpu_memory_gib']} GiB, L2 {_mib(env['l2_cache_bytes'])}), "
        f"driver {env['driver']}"
    )
    console.print(
        f"[bold]software[/] torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, "
        f"cuda-core {env['cuda_core']}, tcprec {env['tcprec']}, Python {env['python']}"
    )


def _mib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def copies_needed(bytes_per_copy: int, l2_bytes: int | None, factor: int = 4) -> int:
    """How many copies of a ``bytes_per_copy`` input make more than ``factor`` x the L2 cache.

    >>> copies_needed(2**30, 50 * 2**20)   # a 1 GiB tensor is far beyond L2: no copies
    1
    >>> copies_needed(2**20, 50 * 2**20)   # 1 MiB inputs: 201 copies make 201 MiB > 200 MiB
    201
    """
    l2 = _FALLBACK_L2_BYTES if l2_bytes is None else l2_bytes
    return max(1, math.floor(factor * l2 / max(1, bytes_per_copy)) + 1)


def rotating_buffers(t: torch.Tensor, l2_bytes: int | None, factor: int = 4) -> list[torch.Tensor]:
    """``t`` followed by enough clones that together they exceed ``factor`` x the L2 cache."""
    n = copies_needed(t.numel() * t.element_size(), l2_bytes, factor)
    return [t] + [t.clone() for _ in range(n - 1)]


def time_median_ms(fn: Callable, inputs: Sequence, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time in ms of ``fn(item)``, taking the next item of ``inputs`` (cyclically) on every
    call; ``do_bench`` warms up for ``warmup_ms`` and times calls for ``rep_ms``."""
    from triton.testing import do_bench  # Linux-only dependency; imported where it is needed

    items = itertools.cycle(inputs)
    return float(do_bench(lambda: fn(next(items)), warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_graph_ms(fn: Callable, items: Sequence | None = None, calls: int = 32, replays: int = 5) -> float:
    """ms per call of ``fn`` (``fn(item)`` cycling through ``items``, or ``fn()``) captured ``calls``
    times in one CUDA graph; median over ``replays`` replays timed with CUDA events.  Excludes host
    launch overhead, for tcprec and its baselines alike."""
    call = (lambda i: fn(items[i % len(items)])) if items else (lambda i: fn())
    if items:
        calls = max(calls, min(len(items), 64))
    return graph_ms(call, calls, replays)


def time_graphs_alternating_ms(*fns: Callable, calls: int = 2, replays: int = 9) -> list[float]:
    """ms per call of each ``fn()``, each captured ``calls`` times in its own CUDA graph and the graphs replayed in
    turn (A, B, A, B, ...; ``timing.graph_ms_alternating``), median over ``replays``: how a quantized model is timed
    against its float baseline, so that a drift of the GPU's clocks during the run lands on both sides (timed one
    after the other, the same torch module measured 2% slower the second time on the H200)."""
    return graph_ms_alternating([lambda i, f=f: f() for f in fns], calls, replays)


def gbps(bytes_moved: float, ms: float) -> float:
    """Achieved bandwidth in GB/s (10**9 bytes per second) for bytes read + written in ``ms``.

    >>> gbps(8 * 2**28, 0.5)
    4294.967296
    """
    return bytes_moved / (ms * 1e-3) / 1e9


def _plain(obj):
    """JSON-safe copy: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def write_json(path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (standard JSON: no NaN/Infinity literals); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(payload), indent=2, allow_nan=False) + "\n")
    return path


def git_commit() -> str | None:
    """HEAD of the checkout a benchmark runs from, recorded in its JSON (None outside a git checkout).
    ``TCPREC_COMMIT``, when set, is recorded instead: for a copy of a working tree whose ``.git`` is not that tree's
    (a remote GPU machine given the files and an older repository), or a build without ``.git``."""
    if os.environ.get("TCPREC_COMMIT"):
        return os.environ["TCPREC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - not a git checkout, or no git
        return None


def cpu_name() -> str:
    """The CPU's model name (for the device string of a CPU benchmark)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
