"""One GPU clock for every comparison tcprec makes: ``graph_ms`` times a callable captured in a CUDA graph.

Used by the benchmarks (``bench.common.time_graph_ms``) and by the speed rule (``nn.speed_rule``), so a layer's
tactic choice and a reported speedup are read from the same clock: warm up on a side stream (JIT compiles, cuDNN /
cuBLAS plans, allocations) outside the capture, capture ``calls`` calls in one graph, replay ``replays`` times with
CUDA events around each replay, return the median ms per call (no host launch overhead on either side).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["graph_ms", "graph_ms_alternating"]


def graph_ms(call: Callable[[int], object], calls: int = 32, replays: int = 5) -> float:
    """Median ms per call of ``call(i)`` (``i`` = 0 .. calls-1: the call's index, e.g. to cycle inputs) captured
    ``calls`` times in one CUDA graph, over ``replays`` timed replays.  Needs a CUDA device."""
    return graph_ms_alternating([call], calls, replays)[0]


def graph_ms_alternating(workloads: Sequence[Callable[[int], object]], calls: int = 32,
                         replays: int = 5) -> list[float]:
    """:func:`graph_ms` of several workloads, each captured in its own graph, replayed in turn (A, B, A, B, ...):
    a drift of the GPU's clocks or power state during the run lands on every workload alike instead of on whichever
    was timed later -- the way to compare two models that may differ by a few percent.  Needs a CUDA device."""
    graphs = []
    for call in workloads:
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
        graphs.append(g)
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(replays):
        for g, t in zip(graphs, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) / calls)
    del graphs
    return [sorted(t)[len(t) // 2] for t in times]
