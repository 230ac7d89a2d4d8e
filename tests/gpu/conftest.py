"""GPU-suite setup.

Under pytest-xdist (``-n 16`` on the 16-core device host) every worker's torch starts one CPU thread
per core for its CPU-side references (the all-reduce engine on CPU tensors, float64 references):
16 workers x 16 threads on 16 cores.  The all-reduce tests whose CPU side takes 2-15 s on one core
here ran past 95 s there, seven at once.  Each worker gets its share of the cores instead.  Only
with a GPU: the CPU-only CI run (tests/gpu skipped) keeps torch's default.
"""

import os

import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if torch.cuda.is_available() and _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
