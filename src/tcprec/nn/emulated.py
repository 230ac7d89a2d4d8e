"""Emulated-precision ``Linear`` and ``Conv2d``: every tensor a layer touches has its own format,
set by one frozen :class:`Recipe`, and every GEMM may accumulate in an emulated format.

Forward:   x_lp = R_act(x), w_lp = R_weight(w), y = x_lp @ w_lp^T   (accumulated in ``acc``)
Backward:  g_lp = R_grad_output(g)
           dx   = R_grad_input(g_lp @ w_lp)                          (accumulated in ``acc``)
           dw   = R_grad_weight(g_lp^T @ x_lp)                       (accumulated in ``acc``)
           db   = R_grad_weight(sum of g_lp)                         (fp32 sum)

Conv2d is im2col (``F.unfold``) + the same GEMMs; the overlap-add of ``unfold``'s backward (at
most kh*kw terms a pixel) is fp32.  With ``acc=None`` the GEMMs are float32 ``torch.matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ..formats import ROUNDING_MODES, FloatFormat, as_format
from ..ops import emulate as em
from ..ops.cast import cast

__all__ = ["Recipe", "EmulatedLinear", "EmulatedConv2d"]

_FMT_FIELDS = ("act", "weight", "grad_output", "grad_input", "grad_weight", "acc")


@dataclass(frozen=True)
class Recipe:
    """Formats of one emulated layer (None: float32, no rounding).

    >>> Recipe(act="e4m3", weight="e4m3", grad_output="e5m2", acc="e5m10").acc
    FloatFormat(exp=5, man=10, bias=15, subnormals=True, specials='ieee', overflow='inf', signed=True, zero=True)
    """

    act: object = None
    weight: object = None
    grad_output: object = None
    grad_input: object = None
    grad_weight: object = None
    acc: object = None
    acc_mode: str = "fma"
    chunk: int = 32
    kahan: bool = False
    rounding: str = "nearest"
    grad_rounding: str = "nearest"

    def __post_init__(self):
        for name in _FMT_FIELDS:
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, as_format(v))
        if self.acc is not None and not isinstance(self.acc, FloatFormat):
            raise TypeError(f"Recipe.acc must be a float format, got {self.acc}")
        for name in ("rounding", "grad_rounding"):
            if getattr(self, name) not in ROUNDING_MODES:
                raise ValueError(f"Recipe.{name} must be one of {ROUNDING_MODES}, got {getattr(self, name)!r}")
        if self.acc_mode not in em.MODES:
            raise ValueError(f"Recipe.acc_mode must be one of {em.MODES}, got {self.acc_mode!r}")

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None]
        return "Recipe(" + ", ".join(parts) + ")"


def _r(x, fmt, rounding):
    return x if fmt is None else cast(x, fmt, rounding)


def _mm(a, b, recipe: Recipe):
    """a (M, K) @ b (K, N) with the recipe's accumulator (float32 matmul without one)."""
    if recipe.acc is None:
        return a @ b
    return em.matmul(a, b, acc_fmt=recipe.acc, mode=recipe.acc_mode, chunk=recipe.chunk, kahan=recipe.kahan,
                     rounding=recipe.rounding)


class _LinearFn(torch.autograd.Function):
    """y = x @ w^T + b on 2-D x, every tensor rounded by the recipe (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, w, b, recipe: Recipe):
        x_lp = _r(x, recipe.act, recipe.rounding)  # (M, K)
        w_lp = _r(w, recipe.weight, recipe.rounding)  # (N, K)
        y = _mm(x_lp, w_lp.t(), recipe)
        if b is not None:
            y = y + b
        ctx.save_for_backward(x_lp, w_lp)
        ctx.recipe, ctx.has_bias = recipe, b is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x_lp, w_lp = ctx.saved_tensors
        rc: Recipe = ctx.recipe
        g_lp = _r(g.contiguous(), rc.grad_output, rc.grad_rounding)  # (M, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _r(_mm(g_lp, w_lp, rc), rc.grad_input, rc.grad_rounding)  # (M, K)
        if ctx.needs_input_grad[1]:
            dw = _r(_mm(g_lp.t(), x_lp, rc), rc.grad_weight, rc.grad_rounding)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _r(g_lp.sum(0), rc.grad_weight, rc.grad_rounding)
        return dx, dw, db, None


class EmulatedLinear(torch.nn.Linear):
    """``nn.Linear`` computed by the recipe's formats.  ``from_module`` shares the parameters."""

    def __init__(self, in_features, out_features, bias=True, *, recipe: Recipe, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def from_module(cls, m: torch.nn.Linear, recipe: Recipe) -> "EmulatedLinear":
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = m.in_features, m.out_features
        new.weight, new.bias = m.weight, m.bias  # the same Parameters: optimizers keep working
        new.recipe = recipe
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _LinearFn.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self.recipe)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.recipe.describe()}"


class EmulatedConv2d(torch.nn.Conv2d):
    """``nn.Conv2d`` (groups=1) as im2col + the recipe's GEMMs."""

    @classmethod
    def from_module(cls, m: torch.nn.Conv2d, recipe: Recipe) -> "EmulatedConv2d":
        reason = cls.cannot_convert(m)
        if reason:
            raise ValueError(reason)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                     "padding_mode", "transposed", "output_padding", "_reversed_padding_repeated_twice"):
            setattr(new, attr, getattr(m, attr))
        new.weight, new.bias = m.weight, m.bias
        new.recipe = recipe
        return new

    @staticmethod
    def cannot_convert(m: torch.nn.Conv2d) -> str | None:
        if m.groups != 1:
            return f"groups={m.groups}: emulated Conv2d supports groups=1"
        if m.padding_mode != "zeros" or isinstance(m.padding, str):
            return f"padding={m.padding!r}, padding_mode={m.padding_mode!r}: emulated Conv2d supports numeric zero padding"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        kh, kw = self.kernel_size
        oh = (h + 2 * self.padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)  # (n, C*kh*kw, L)
        cols = cols.transpose(1, 2).reshape(n * oh * ow, -1)  # (n*L, C*kh*kw)
        w2 = self.weight.reshape(self.out_channels, -1)  # (O, C*kh*kw)
        y = _LinearFn.apply(cols, w2, self.bias, self.recipe)  # (n*L, O)
        return y.reshape(n, oh * ow, self.out_channels).transpose(1, 2).reshape(n, self.out_channels, oh, ow)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.recipe.describe()}"
