"""Error metrics between a low-precision result ``x`` and a reference ``ref``.

Every metric converts both inputs to float64 first (so its own rounding is far below that of any
format tcprec produces) and accepts real tensors, arrays, numbers and lists of numbers, on any device;
None, strings and complex values are a TypeError (a float64 cast would drop an imaginary part silently).

NaN and Inf rule, shared by all metrics: an entry where ``x`` and ``ref`` are both NaN, or are the
same infinity, *agrees* and is left out.  Any other NaN or Inf stays in, so the metric becomes NaN
or Inf: a cast that turned a number into NaN is never hidden.

>>> import torch
>>> ref = torch.tensor([0.0, 1.0, 2.0, 4.0])
>>> x = torch.tensor([0.0, 1.0, 2.0, 3.0])
>>> max_abs_error(x, ref)
1.0
>>> round(sqnr_db(x, ref), 3)
13.222
"""

from __future__ import annotations

import math

import torch

from .formats import BlockFormat, IntFormat, as_format

__all__ = ["nrmse", "sqnr_db", "max_abs_error", "max_rel_error", "ulp_error"]


def _real_tensor(v, name: str) -> torch.Tensor:
    """``v`` as a real tensor: a tensor, an array, a number or a (nested) list of numbers; anything else -- None,
    strings, complex values (whose imaginary part a float64 cast would drop silently) -- is a TypeError."""
    if v is None or isinstance(v, (str, bytes)):
        raise TypeError(f"{name} must be a real tensor (or an array / number / list of numbers), got "
                        f"{type(v).__name__}; pass the values to compare")
    try:
        t = torch.as_tensor(v)
    except (TypeError, RuntimeError, ValueError) as e:
        raise TypeError(f"{name} must be a real tensor (or an array / number / list of numbers), got "
                        f"{type(v).__name__}: {e}") from None
    if t.is_complex():
        raise TypeError(f"{name} is complex ({t.dtype}); the metrics compare real values: pass x.real and x.imag "
                        "separately, or torch.view_as_real(x)")
    return t.detach()


def _as_float64(x, ref) -> tuple[torch.Tensor, torch.Tensor]:
    """Both inputs as float64 CPU tensors, after checking that they are real and that their shapes match."""
    x = _real_tensor(x, "x")
    ref = _real_tensor(ref, "ref")
    if x.shape != ref.shape:
        raise ValueError(
            f"x and ref must have the same shape, got x.shape={tuple(x.shape)} and ref.shape={tuple(ref.shape)}"
        )
    return x.to(device="cpu", dtype=torch.float64), ref.to(device="cpu", dtype=torch.float64)


def _pair(x, ref) -> tuple[torch.Tensor, torch.Tensor]:
    """Both inputs as 1-D float64 tensors, with the agreeing NaN/Inf entries removed."""
    x, ref = (t.reshape(-1) for t in _as_float64(x, ref))
    if math.isfinite(float(ref.sum())):  # no NaN/Inf in ref (a cheap test): nothing to drop
        return x, ref
    agree = ~torch.isfinite(ref) & ((x == ref) | torch.isnan(x) & torch.isnan(ref))
    return x[~agree], ref[~agree]


def max_abs_error(x, ref) -> float:
    """``max |x - ref|`` (0.0 when nothing is left after the NaN/Inf rule).

    >>> max_abs_error(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]))
    0.5
    """
    x, ref = _pair(x, ref)
    if x.numel() == 0:
        return 0.0
    return float((x - ref).abs().max())


def max_rel_error(x, ref, floor: float | None = None) -> float:
    """``max |x - ref| / |ref|``.

    Relative error is undefined where ``ref == 0``.  With ``floor=None`` (default) those entries
    are skipped (``max_abs_error`` sees them); the result is NaN if every entry is skipped.  With a
    positive ``floor`` the denominator is ``max(|ref|, floor)`` and every entry counts.

    >>> max_rel_error(torch.tensor([1.25, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.0]))  # ref == 0 skipped
    0.25
    >>> max_rel_error(torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.0]), floor=1.0)
    0.5
    """
    if floor is not None and not floor > 0:
        raise ValueError(f"floor must be a positive number or None, got floor={floor!r}")
    x, ref = _pair(x, ref)
    if floor is None:
        keep = ref != 0
        x, ref = x[keep], ref[keep]
        if x.numel() == 0:
            return math.nan
        denom = ref.abs()
    else:
        if x.numel() == 0:
            return 0.0
        denom = ref.abs().clamp(min=floor)
    return float(((x - ref).abs() / denom).max())


def nrmse(x, ref) -> float:
    """Root-mean-square error normalised by the range of ``ref``:
    ``sqrt(mean((x - ref)**2)) / (max(ref) - min(ref))``.

    When ``ref`` is constant (range 0) the denominator is ``max|ref|`` instead; when ``ref`` is all
    zeros the result is 0.0 if ``x`` matches and Inf otherwise.  0.0 when nothing is left after the
    NaN/Inf rule.

    >>> nrmse(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 2.0, 4.0]))
    0.125
    >>> nrmse(torch.tensor([2.0, 2.0, 2.0, 3.0]), torch.tensor([2.0, 2.0, 2.0, 2.0]))  # constant ref: / 2
    0.25
    """
    x, ref = _pair(x, ref)
    if x.numel() == 0:
        return 0.0
    rmse = float(torch.sqrt(torch.mean((x - ref) ** 2)))
    lo, hi = (float(v) for v in torch.aminmax(ref))
    if not (math.isfinite(lo) and math.isfinite(hi)):  # a NaN/Inf of ref that x misses: use the finite part
        finite = ref[torch.isfinite(ref)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (-math.inf, math.inf)
    scale = hi - lo
    if scale == 0:
        scale = abs(hi)
    if scale == 0:
        return 0.0 if rmse == 0 else math.inf
    return rmse / scale


def sqnr_db(x, ref) -> float:
    """Signal-to-quantisation-noise ratio in decibels: ``10 log10(sum ref**2 / sum (x - ref)**2)``.

    +Inf when ``x`` equals ``ref`` exactly (no noise), -Inf when ``ref`` is all zeros and ``x`` is
    not.

    >>> sqnr_db(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]))
    inf
    >>> sqnr_db(torch.tensor([1.5, -0.5]), torch.tensor([1.0, -1.0]))  # noise power 1/4 of the signal's
    6.020599913279624
    """
    x, ref = _pair(x, ref)
    noise = float(torch.sum((x - ref) ** 2))
    signal = float(torch.sum(ref**2))
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def ulp_error(x, ref, fmt) -> torch.Tensor:
    """Element-wise ``|x - ref|`` in units of the last place (ulp) of ``fmt`` at ``ref`` (float64,
    ``ref``'s shape).

    For a float format ``ulp(r) = 2**(max(floor(log2|r|), fmt.emin) - fmt.man)``: the spacing of
    ``fmt``'s values in the binade of ``r``, and the subnormal spacing below the smallest normal
    (also for r = 0, and also for formats without subnormals).  For an integer format the ulp is the
    distance between neighbouring values (``fmt.step``).  Round-to-nearest gives at most 0.5 on
    every entry within range; stochastic rounding less than 1.  Entries agreeing under the NaN/Inf
    rule give 0; any other NaN or Inf gives NaN or Inf.

    >>> ulp_error(torch.tensor([1.125, 0.25]), torch.tensor([1.0, 0.25]), "e4m3")  # ulp(1) = 1/8
    tensor([1., 0.], dtype=torch.float64)
    """
    fmt = as_format(fmt)
    if isinstance(fmt, BlockFormat):
        raise TypeError(f"ulp_error takes an element format; {fmt} has a per-block scale: use its .element")
    x, ref = _as_float64(x, ref)
    if isinstance(fmt, IntFormat):
        ulp = torch.full_like(ref, float(fmt.step))
    else:
        # frexp: |r| = m * 2**e with m in [0.5, 1), so floor(log2|r|) = e - 1, exactly.
        _, e = torch.frexp(ref)
        binade = torch.where(ref == 0, torch.full_like(e, fmt.emin), (e - 1).clamp(min=fmt.emin))
        ulp = torch.ldexp(torch.ones_like(ref), (binade - fmt.man).to(torch.float64))
    err = (x - ref).abs() / ulp
    agree = (torch.isnan(x) & torch.isnan(ref)) | (torch.isinf(ref) & (x == ref))
    return torch.where(agree, torch.zeros_like(err), err)
