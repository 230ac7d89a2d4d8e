"""The GPU tests' CUDA-graph capture: ``graphed(fn, *static)`` runs ``fn(*static)`` once on a side stream (Triton /
NVRTC compiles, cuBLAS / cuDNN plans, allocations: outside the capture), then captures one call in a graph; returns
(graph, the captured call's output).  Replay the graph after writing new values into ``static``'s buffers."""

import torch


def graphed(fn, *static):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    return g, out
