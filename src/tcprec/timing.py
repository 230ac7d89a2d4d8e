"""One GPU clock for every comparison tcprec makes: ``graph_ms`` times a callable captured in a CUDA graph.

Used by the benchmarks (``bench.common.time_graph_ms``) and by the speed rule (``nn.speed_rule``), so a layer's
tactic choice and a reported speedup are read from the same clock: warm up on a side stream (JIT compiles, cuDNN /
cuBLAS plans, allocations) outside the capture, capture ``calls`` calls in one graph, replay ``replays`` times with
CUDA events around each replay, return the median ms per call (no host launch overhead on either side).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["graph_ms"]


def graph_ms(call: Callable[[int], object], calls: int = 32, replays: int = 5) -> float:
    """Median ms per call of ``call(i)`` (``i`` = 0 .. calls-1: the call's index, e.g. to cycle inputs) captured
    ``calls`` times in one CUDA graph, over ``replays`` timed replays.  Needs a CUDA device."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (allocations, autotuning) outside the capture
        for i in range(2):
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            call(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del g
    return sorted(times)[len(times) // 2]
