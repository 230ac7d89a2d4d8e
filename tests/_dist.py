"""Multi-process tests: spawn one process per rank, each saving its results; collect them in rank order."""

from __future__ import annotations

import os
import socket
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_group(rank: int, world: int, port: int, **init_kwargs):
    """In a worker: the gloo process group of :func:`run_ranks`'s ``world`` processes (on 127.0.0.1:``port``)
    for the block, destroyed after it.  ``init_kwargs`` go to ``init_process_group`` (e.g. ``timeout``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, **init_kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_rank(res, out_dir: str, rank: int) -> None:
    """In a worker: this rank's results, for :func:`run_ranks` to collect."""
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(worker, world: int) -> list:
    """``worker(rank, world, port, out_dir)`` in ``world`` processes (it calls :func:`save_rank`); the saved
    results, rank 0 first."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, free_port(), d), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
