"""``timing.graph_ms_alternating`` on the GPU: one median per workload, in order, each the graph_ms of that workload
(no timing assertions: the figures belong to the benchmarks)."""

import math

import pytest
import torch

from tcprec.timing import graph_ms, graph_ms_alternating

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_alternating_returns_one_median_per_workload_and_runs_each():
    a = torch.randn(256, 256, device="cuda")
    seen = {"a": 0, "b": 0}

    def wa(i):
        seen["a"] += 1
        return a @ a

    def wb(i):
        seen["b"] += 1
        return a + 1

    ms = graph_ms_alternating([wa, wb], calls=3, replays=4)
    assert len(ms) == 2 and all(math.isfinite(m) and m > 0 for m in ms)
    assert seen == {"a": 2 + 3, "b": 2 + 3}  # two warm-ups, then each captured call once (replays re-run the graph)
    one = graph_ms(lambda i: a @ a, calls=3, replays=4)
    assert math.isfinite(one) and one > 0
