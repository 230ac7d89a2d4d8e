"""``Quantizer``: round activations on the way forward and errors (gradients) on the way back,
each to its own format (QPyTorch's ``Quantizer``, with tcprec's bit-exact cast).

>>> import torch, tcprec as tp
>>> q = tp.nn.Quantizer(forward="e4m3", backward="e5m2")
>>> x = torch.tensor([0.3], requires_grad=True)
>>> y = q(x); y.backward(torch.tensor([0.3])); (y.item(), x.grad.item())
(0.3125, 0.3125)
"""

from __future__ import annotations

import torch

from ..formats import ROUNDING_MODES, as_format
from ..ops.cast import cast

__all__ = ["Quantizer", "quantize_fn"]


def _round(x: torch.Tensor, fmt, rounding: str, generator) -> torch.Tensor:
    return x if fmt is None else cast(x, fmt, rounding, generator)


class _QuantizeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd, rounding, bwd_rounding, generator):
        ctx.bwd, ctx.bwd_rounding, ctx.generator = bwd, bwd_rounding, generator
        return _round(x, fwd, rounding, generator)

    @staticmethod
    def backward(ctx, grad):
        return _round(grad, ctx.bwd, ctx.bwd_rounding, ctx.generator), None, None, None, None, None


def quantize_fn(x: torch.Tensor, forward=None, backward=None, rounding: str = "nearest",
                backward_rounding: str | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Functional form of :class:`Quantizer`: ``forward``/``backward`` formats (None: pass through)."""
    fwd = as_format(forward) if forward is not None else None
    bwd = as_format(backward) if backward is not None else None
    return _QuantizeFn.apply(x, fwd, bwd, rounding, backward_rounding or rounding, generator)


class Quantizer(torch.nn.Module):
    """Identity in value space except for rounding: forward rounds x to ``forward``, backward rounds
    the incoming gradient to ``backward`` (either may be None).  ``rounding`` / ``backward_rounding``
    are any of tcprec.ROUNDING_MODES (stochastic draws from ``generator``)."""

    def __init__(self, forward=None, backward=None, rounding: str = "nearest", backward_rounding: str | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        for name, r in (("rounding", rounding), ("backward_rounding", backward_rounding or rounding)):
            if r not in ROUNDING_MODES:
                raise ValueError(f"{name} must be one of {ROUNDING_MODES}, got {name}={r!r}")
        self.fwd = as_format(forward) if forward is not None else None
        self.bwd = as_format(backward) if backward is not None else None
        self.rounding = rounding
        self.backward_rounding = backward_rounding or rounding
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantizeFn.apply(x, self.fwd, self.bwd, self.rounding, self.backward_rounding, self.generator)

    def extra_repr(self) -> str:
        return f"forward={self.fwd}, backward={self.bwd}, rounding={self.rounding}, backward_rounding={self.backward_rounding}"
