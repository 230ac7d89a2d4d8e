"""Fake quantizers of quantization-aware training: the exact codes of the deployed layer forward, STE / LSQ
gradients backward.

Activations (:class:`ActQuant`, one learned per-tensor step ``s``)::

    forward   q = round_half_even(clamp(x / s, lo, hi))          the codes QConv2d's quantizer computes
              (lo, hi) = (0, 2^b - 1) after a ReLU (uintN), (-2^(b-1), 2^(b-1) - 1) otherwise (intN)
    backward  dq/dx = 1/s inside [lo, hi], 0 outside               (STE through the rounding)
              LSQ:  d(s*q)/ds = (q - x/s) inside, lo or hi outside, times g = 1/sqrt(N * Qp)
                    (N: features of one sample, Qp = hi: Esser et al., "Learned Step Size Quantization")
              PACT: a learned clip alpha (s = alpha / Qp), d(s*q)/dalpha = 1 where x >= alpha, else 0
                    (Choi et al.; unsigned inputs only -- a signed input falls back to LSQ)

The step is initialised from the first batch seen (LSQ's 2 mean|x| / sqrt(Qp)), which also fixes the
signedness as ``quantize_model``'s calibration does: a layer whose first input has a negative value gets
``intN`` codes, else ``uintN``.

Weights (:class:`WeightQuant`, per output channel)::

    1 bit      binary (pm1: +-1)       s = mean|w| of the channel (XNOR-Net; derived, not learned)
                                       forward s * sign(w) (w >= 0 -> +1); backward dw_q/dw = 1 (STE)
    2-4 bits   pmN (odd integers        s learned (LSQ, g = 1/sqrt(N_c * Qp), N_c weights a channel, Qp = 2^b - 1)
               +-1, +-3, .., +-(2^b-1)) forward q = nearest odd integer to clamp(w / s, -Qp, Qp)
                                       a symmetric grid using every code (twos' -2^(b-1) would be wasted)
    5-8 bits   intN, symmetric          s = max|w| / (2^(b-1) - 1) (derived), q = round(w / s)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..formats import IntFormat, as_format

__all__ = ["round_ste", "grad_scale", "ActQuant", "WeightQuant", "weight_format_qat"]


class _RoundSTE(torch.autograd.Function):
    """round half to even forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _GradScale(torch.autograd.Function):
    """identity forward (the same bits), gradient times ``g`` backward (LSQ's step-size gradient scale)."""

    @staticmethod
    def forward(ctx, s, g: float):
        ctx.g = g
        return s.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.g, None


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``torch.round`` (half to even) with a straight-through gradient."""
    return _RoundSTE.apply(x)


def grad_scale(s: torch.Tensor, g: float) -> torch.Tensor:
    """``s`` unchanged; its gradient is multiplied by ``g``."""
    return _GradScale.apply(s, g)


_MIN_STEP = 1e-8


class ActQuant(nn.Module):
    """Per-tensor activation fake quantizer of ``bits`` bits; ``mode`` "lsq" or "pact" (module docstring)."""

    def __init__(self, bits: int, mode: str = "lsq"):
        super().__init__()
        if mode not in ("lsq", "pact"):
            raise ValueError(f"act_quant must be 'lsq' or 'pact', got {mode!r}")
        self.bits, self.mode = int(bits), mode
        self.step = nn.Parameter(torch.ones(1))  # s (LSQ) or alpha (PACT): set from the first batch
        self.register_buffer("signed", torch.zeros((), dtype=torch.bool))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self._flags = None  # (initialized, signed) as Python bools: read once, not synced every step

    def _load_from_state_dict(self, *args, **kwargs):
        self._flags = None
        return super()._load_from_state_dict(*args, **kwargs)

    @property
    def ready(self) -> bool:
        """Whether the step was set from data (and the signedness chosen)."""
        if self._flags is None:
            self._flags = (bool(self.initialized), bool(self.signed))
        return self._flags[0]

    @property
    def is_signed(self) -> bool:
        self.ready  # noqa: B018 - fills the cache
        return self._flags[1]

    def extra_repr(self) -> str:
        return f"bits={self.bits}, mode={self.mode}, signed={self.is_signed}"

    @property
    def bounds(self) -> tuple[int, int]:
        b = self.bits
        return (-(1 << (b - 1)), (1 << (b - 1)) - 1) if self.is_signed else (0, (1 << b) - 1)

    @property
    def pact(self) -> bool:
        return self.mode == "pact" and not self.is_signed

    @property
    def fmt(self) -> IntFormat:
        return as_format(f"int{self.bits}" if self.is_signed else f"uint{self.bits}")

    @torch.no_grad()
    def _init(self, x: torch.Tensor) -> None:
        self.signed.fill_(bool((x < 0).any()))
        self._flags = (True, bool(self.signed))
        qp = max(self.bounds[1], 1)
        s = 2 * x.detach().float().abs().mean() / math.sqrt(qp)
        s = float(s) if float(s) > 0 else 1.0
        self.step.fill_(s * qp if self.pact else s)
        self.initialized.fill_(True)

    def scale(self) -> torch.Tensor:
        """The step ``s`` as a one-element float32 tensor (what the deployed layer's ``in_scale`` holds)."""
        st = self.step.float().abs().clamp_min(_MIN_STEP)
        return st / float(self.bounds[1]) if self.pact else st

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as float with the STE / LSQ / PACT gradients, the step with its gradient path)."""
        if not self.ready:
            self._init(x)
        lo, hi = self.bounds
        if self.pact:  # alpha's gradient only through the clip
            alpha = self.step.float().abs().clamp_min(_MIN_STEP)
            s = (alpha / float(hi)).detach()
            q = round_ste(torch.clamp(torch.minimum(x.float(), alpha) / s, lo, hi))
            return q, s
        s = grad_scale(self.scale(), 1.0 / math.sqrt(x[0].numel() * max(hi, 1)))
        return round_ste(torch.clamp(x.float() / s, lo, hi)), s

    @torch.no_grad()
    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """The deployed quantizer's codes as float values: ``round(clamp(x / s, lo, hi))`` (IEEE quotient by a
        tensor, half to even) -- ``ops.quantize.quantize_static`` / the fused quantize+pack kernel."""
        if not self.ready:
            self._init(x)
        lo, hi = self.bounds
        return torch.round(torch.clamp(x.float() / self.scale().detach(), lo, hi))


def weight_format_qat(bits: int) -> IntFormat:
    """The weight format QAT trains for ``bits``: binary (1), pmN (2-4: every code used), intN (5-8)."""
    if bits == 1:
        return as_format("binary")
    return as_format(f"pm{bits}") if bits <= 4 else as_format(f"int{bits}")


class WeightQuant(nn.Module):
    """Per-output-channel weight fake quantizer (module docstring); ``w`` (K, ...) initialises the LSQ step."""

    def __init__(self, w: torch.Tensor, bits: int):
        super().__init__()
        self.bits = int(bits)
        self.fmt = weight_format_qat(self.bits)
        self.learned = 2 <= self.bits <= 4
        if self.learned:
            self.step = nn.Parameter(self._mse_step(w.detach().float()))

    def extra_repr(self) -> str:
        return f"{self.fmt}, scale={'LSQ' if self.learned else ('mean|w|' if self.bits == 1 else 'absmax')}"

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1 if self.bits <= 4 else (1 << (self.bits - 1)) - 1

    def _mse_step(self, w: torch.Tensor) -> torch.Tensor:
        """Per-channel step minimising ||w - s q(w / s)||^2 over 40 candidates s = t max|w| / Qp."""
        wf = w.flatten(1)  # (K, n)
        amax = wf.abs().amax(1).clamp_min(1e-8)
        best, best_err = amax / self.qmax, torch.full_like(amax, float("inf"))
        for t in torch.linspace(0.15, 1.0, 40).tolist():
            s = amax * t / self.qmax
            err = ((wf - s[:, None] * self._odd(wf / s[:, None])) ** 2).sum(1)
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
        return best

    def _odd(self, v: torch.Tensor) -> torch.Tensor:
        """Nearest odd integer to v, clamped to +-Qp (pmN values)."""
        return torch.clamp(2 * torch.floor(v / 2) + 1, -self.qmax, self.qmax)

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        """Per-channel float32 scales (K,): learned (pmN), mean|w| in float64 (binary), absmax (intN)."""
        if self.learned:
            return self.step.float().abs().clamp_min(_MIN_STEP)
        wf = w.detach().flatten(1)
        if self.bits == 1:
            return wf.double().abs().mean(1).float().clamp_min(torch.finfo(torch.float32).tiny)
        return (wf.float().abs().amax(1) / float(self.qmax)).clamp_min(torch.finfo(torch.float32).tiny)

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        if self.bits == 1:
            return torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v))
        if self.learned:
            return self._odd(v)
        return torch.round(torch.clamp(v, -self.qmax, self.qmax))

    def forward(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(integer weight values as float with STE gradients, per-channel scales (K,) with their gradient path)."""
        shape = (-1,) + (1,) * (w.dim() - 1)
        if self.learned:
            s = grad_scale(self.scale(w), 1.0 / math.sqrt(w[0].numel() * self.qmax))
            v = torch.clamp(w.float() / s.view(shape), -self.qmax, self.qmax)
            return v + (self._values(v) - v).detach(), s  # (the STE; values are integers, exact)
        s = self.scale(w).detach()
        v = w.float() / s.view(shape)
        if self.bits > 1:
            v = torch.clamp(v, -self.qmax, self.qmax)
        return v + (self._values(v) - v).detach(), s

    @torch.no_grad()
    def codes(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(integer values (K, ...) float32, scales (K,) float32) that the deployed layer holds."""
        s = self.scale(w).detach()
        return self._values(w.float() / s.view((-1,) + (1,) * (w.dim() - 1))), s
