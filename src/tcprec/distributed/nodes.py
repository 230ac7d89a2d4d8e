"""Emulated nodes (CPD's ``emulate_node``): one process stands in for ``n_local`` nodes by running
one micro-batch per node and reducing the ``n_local`` gradient copies -- together with every other
process's -- through the same :func:`allreduce_lowp` the DDP hook uses.  Without a process group
it is N nodes on one device; under torchrun it is world_size x n_local nodes."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .algorithms import ALGORITHMS
from .lowp import AllreduceInfo, allreduce_lowp, check_aps_format

__all__ = ["EmulatedNodes"]

log = logging.getLogger("tcprec.distributed")


class EmulatedNodes:
    """
    >>> import torch
    >>> m = torch.nn.Linear(3, 1)
    >>> nodes = EmulatedNodes(m, n_local=4, fmt="e4m3")
    >>> loss, info = nodes.backward(lambda out, y: ((out - y) ** 2).mean(), torch.randn(8, 3), torch.randn(8, 1))
    >>> m.weight.grad.shape, info.nonfinite_input
    (torch.Size([1, 3]), False)
    """

    def __init__(self, model: torch.nn.Module, n_local: int, fmt=None, *, aps: bool = True, kahan: bool = False,
                 transport: str = "compressed", rounding: str = "nearest", group=None, algorithm: str = "direct",
                 acc_format=None, backend: str = "auto"):
        if n_local < 1:
            raise ValueError(f"n_local must be >= 1, got {n_local}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got algorithm={algorithm!r}")
        if algorithm == "halving" and kahan and fmt is not None:
            raise ValueError("algorithm='halving' sums a pairwise tree and has no Kahan compensation; use "
                             "algorithm='ring' or 'direct' with kahan=True, or kahan=False")
        self.model, self.n_local, self.fmt = model, n_local, fmt
        self.aps, self.kahan, self.transport, self.rounding, self.group = aps, kahan, transport, rounding, group
        self.algorithm, self.acc_format, self.backend = algorithm, acc_format, backend
        self.params = [p for p in model.parameters() if p.requires_grad]
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.n_nodes = world * n_local
        if fmt is not None and aps:
            check_aps_format(fmt, self.n_nodes)  # too few exponent bits: fail before training starts
        self.skipped = 0

    def node_grads(self, loss_fn, inputs, targets, loss_scale: float = 1.0):
        """(losses (n_local,), flat gradients (n_local, numel)): one micro-batch per node."""
        xs, ys = inputs.chunk(self.n_local), targets.chunk(self.n_local)
        if len(xs) != self.n_local:
            raise ValueError(f"a batch of {inputs.shape[0]} cannot feed {self.n_local} nodes; use a larger batch")
        numel = sum(p.numel() for p in self.params)
        dev = self.params[0].device if self.params else inputs.device
        flat = torch.empty(self.n_local, numel, device=dev)  # (n_local, numel): written in place, no copies
        losses = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            for p in self.params:
                p.grad = None
            loss = loss_fn(self.model(x), y)
            (loss * loss_scale).backward()
            off = 0
            for p in self.params:
                dst = flat[i, off:off + p.numel()]
                dst.copy_(p.grad.reshape(-1)) if p.grad is not None else dst.zero_()
                off += p.numel()
            losses.append(loss.detach())
        return torch.stack(losses), flat

    def reduce(self, flat: torch.Tensor) -> tuple[torch.Tensor, AllreduceInfo]:
        sizes = [p.numel() for p in self.params]
        if self.fmt is None:  # the float32 baseline: a plain all-reduce of the sum
            total = flat.sum(0)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(total, group=self.group)
            info = AllreduceInfo(nonfinite_input=not bool(torch.isfinite(total).all()))
            return total / self.n_nodes, info
        return allreduce_lowp(flat, sizes, self.fmt, aps=self.aps, kahan=self.kahan, transport=self.transport,
                              rounding=self.rounding, group=self.group, algorithm=self.algorithm,
                              acc_format=self.acc_format, backend=self.backend)

    def backward(self, loss_fn, inputs, targets, loss_scale: float = 1.0):
        """Micro-batch backward on every node, low-precision mean of the gradients into ``p.grad``.
        Returns (mean loss, info); on a non-finite gradient the grads are NaN and it is logged."""
        losses, flat = self.node_grads(loss_fn, inputs, targets, loss_scale)
        mean, info = self.reduce(flat)
        if info.nonfinite_input:
            self.skipped += 1
            log.warning("non-finite gradient (NaN/Inf) on some node: this step must be skipped")
        off = 0
        for p in self.params:
            p.grad = mean[off:off + p.numel()].view_as(p).to(p.dtype)
            off += p.numel()
        return losses.mean(), info
