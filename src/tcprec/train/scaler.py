"""Loss scaling for low-precision gradients: static, or dynamic with ``torch.amp.GradScaler``'s rules
(start 2**16, x2 after 2000 clean steps, x0.5 and skip the step on overflow), for any format.

Overflow means a non-finite gradient (formats with Inf or NaN produce one on overflow) or, for a
saturating ``grad_format`` (no Inf, no NaN: overflow clamps silently), a gradient at the format's
max before unscaling.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=0.1)
>>> sc = LossScaler("dynamic", init_scale=4.0)
>>> sc.scale((p * 3).sum()).backward(); sc.step(opt), p.grad.tolist(), sc.update()
(True, [3.0, 3.0], None)
"""

from __future__ import annotations

import logging

import torch

from ..formats import as_format

__all__ = ["LossScaler"]

log = logging.getLogger("tcprec.train")


class LossScaler:
    def __init__(self, mode: str = "dynamic", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, grad_format=None):
        if mode not in ("static", "dynamic", "none"):
            raise ValueError(f"mode must be 'static', 'dynamic' or 'none', got mode={mode!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        self.mode = mode
        self.scale_value = 1.0 if mode == "none" else float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.grad_format = as_format(grad_format) if grad_format is not None else None
        self.clean_steps = 0
        self.skipped = 0
        self._found_overflow: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        fmt = self.grad_format
        saturating = fmt is not None and getattr(fmt, "overflow", None) == "saturate"
        for g in grads:
            if not torch.isfinite(g).all():
                return True
            if saturating and (g.abs() >= fmt.max).any():
                return True
        return False

    def unscale_and_check(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the scale (in place); True if the step must be skipped."""
        grads = [p.grad for grp in optimizer.param_groups for p in grp["params"] if p.grad is not None]
        self._found_overflow = self._overflow(grads)
        if not self._found_overflow and self.scale_value != 1.0:
            for g in grads:
                g.div_(self.scale_value)
        return self._found_overflow

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """optimizer.step() unless a gradient overflowed (then skipped and logged); True if applied."""
        if self._found_overflow is None:
            self.unscale_and_check(optimizer)
        if self._found_overflow:
            self.skipped += 1
            log.warning("non-finite or overflowing gradient at loss scale %g: optimizer step skipped", self.scale_value)
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Apply the dynamic rules once per iteration (after step)."""
        overflow, self._found_overflow = bool(self._found_overflow), None
        if self.mode != "dynamic":
            return
        if overflow:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale_value, self.clean_steps, self.skipped = d["scale"], d["clean_steps"], d["skipped"]
