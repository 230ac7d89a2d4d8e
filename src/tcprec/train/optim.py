"""A low-precision SGD step: weights and momentum stored in custom formats (stochastic rounding by
default, which keeps small updates alive in expectation), with optional float32 master weights.

    buf  = R_momentum(momentum * buf + g)          (g includes weight decay)
    w_hp = w_hp - lr * buf                         (master weights: float32)
    w    = R_weight(w_hp)                          (the model sees low-precision weights)

Without master weights the update is applied to the low-precision weight directly:
``w = R_weight(w - lr * buf)``.

LARS (layer-wise adaptive rate scaling, You et al. 2017; CPD's ``--use_lars``), ``lars=True``: each
tensor's step is scaled by its trust ratio before the momentum, as in NVIDIA's LARC::

    trust = eta * ||w_hp|| / (||g|| + weight_decay * ||w_hp||)     (1 where a norm is 0)
    d     = trust * (g + weight_decay * w_hp)

norms of the master weights and the float32 gradient.  A param group may set ``lars=False`` (biases
and BatchNorm parameters usually do).
"""

from __future__ import annotations

import torch

from ..formats import ROUNDING_MODES, as_format
from ..ops.cast import cast

__all__ = ["LowPrecisionSGD"]


class LowPrecisionSGD(torch.optim.Optimizer):
    """
    >>> p = torch.nn.Parameter(torch.tensor([1.0]))
    >>> opt = LowPrecisionSGD([p], lr=0.25, weight_format="e4m3", rounding="nearest")
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.item()
    0.75
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, *,
                 weight_format=None, momentum_format=None, rounding: str = "stochastic",
                 master_weights: bool = True, generator: torch.Generator | None = None, lars: bool = False,
                 trust_coefficient: float = 0.001):
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got rounding={rounding!r}")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum, weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        if not trust_coefficient > 0:
            raise ValueError(f"trust_coefficient (LARS eta) must be > 0, got {trust_coefficient}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, lars=bool(lars),
                        trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)
        self.weight_format = as_format(weight_format) if weight_format is not None else None
        self.momentum_format = as_format(momentum_format) if momentum_format is not None else None
        self.rounding, self.master_weights, self.generator = rounding, master_weights, generator
        for grp in self.param_groups:
            for p in grp["params"]:
                if self.master_weights and self.weight_format is not None:
                    self.state[p]["master"] = p.detach().clone().float()
                p.data.copy_(self._r(p.detach(), self.weight_format))

    def _r(self, x, fmt):
        return x if fmt is None else cast(x, fmt, self.rounding, self.generator)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for grp in self.param_groups:
            lr, mom, wd = grp["lr"], grp["momentum"], grp["weight_decay"]
            for p in grp["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                w_hp = st.get("master", p.detach())
                d = p.grad.float()
                if grp["lars"]:
                    w_norm, g_norm = w_hp.float().norm(), d.norm()
                    den = g_norm + wd * w_norm
                    trust = torch.where((w_norm > 0) & (den > 0), grp["trust_coefficient"] * w_norm / den,
                                        torch.ones_like(w_norm))
                if wd:
                    d = d + wd * w_hp
                if grp["lars"]:
                    d = d * trust
                if mom:
                    buf = st.get("momentum_buffer")
                    buf = d.clone() if buf is None else mom * buf + d
                    buf = self._r(buf, self.momentum_format)
                    st["momentum_buffer"] = buf
                    d = buf
                if "master" in st:
                    st["master"] = w_hp - lr * d
                    p.copy_(self._r(st["master"], self.weight_format))
                else:
                    p.copy_(self._r(w_hp - lr * d, self.weight_format))
        return loss
