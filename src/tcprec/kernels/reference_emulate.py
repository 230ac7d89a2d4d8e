"""Pure-torch reference of the emulated-accumulator GEMM (CPU and GPU): the ground truth for
``kernels/triton/emulate_gemm.py`` and the backend without a GPU.

The model (emulated accumulation states its model)
--------------------------------------------------
``mode="fma"`` (CPD's model; every operation is *one* rounding of the exact real result)::

    for k in 0..K-1:                      # in order along K
        p = R(a[m, k] * b[k, n])          # R = round to acc_fmt with the chosen rounding mode
        if kahan:                         # Kahan's compensated sum, every operation in acc_fmt
            y = R(p - c); t = R(s + y); c = R(R(t - s) - y); s = t
        else:
            s = R(s + p)

``mode="chunk"`` (hardware-like: tensor cores with an fp32 partial sum per K-chunk)::

    for each chunk of C consecutive k:
        p = fp32 dot product of the chunk (torch.matmul / tl.dot, summation order of the backend)
        s = R(s + p)                      # or the Kahan update above with this p

Exactly rounded, not "computed in fp32 and rounded again": a product of two float32 values is exact
in float64 (48 significant bits), and a sum is made exact-enough by TwoSum plus *round to odd*
(the float64 sum, with its last bit set if the sum was inexact).  Rounding the round-to-odd value to
any format with at least two fewer significand bits gives the correctly rounded exact sum, for every
rounding mode (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms
using rounding to odd", IEEE TC 2008).  CPD rounds the float32 result, which double-rounds.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat
from . import reference as ref

__all__ = ["add_round_to_odd", "round_acc", "matmul_fma", "matmul_chunk"]


def add_round_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (float64) rounded to odd: the float64 sum, moved one ulp toward the exact sum when that
    sum is not representable and the float64 result is even.  Non-finite sums are returned as is."""
    s = a + b
    bb = s - a
    t = (a - (s - bb)) + (b - bb)  # TwoSum: a + b == s + t exactly (Knuth)
    bits = s.view(torch.int64)
    fix = (t != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    toward_t = torch.where((t < 0) == (bits < 0), 1, -1)  # magnitude up if t has s's sign
    return torch.where(fix, (bits + toward_t).view(torch.float64), s)


def round_acc(x64: torch.Tensor, fmt: FloatFormat, rounding: str, generator=None) -> torch.Tensor:
    """One rounding of float64 values to ``fmt`` (float64 out; stochastic draws from generator)."""
    seed = None
    if rounding == "stochastic":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    elif rounding == "nearest" and _fast_nearest_ok(fmt):
        return _round_nearest_fast(x64, fmt)
    return ref.cast_float(x64, fmt, rounding, seed)


def _fast_nearest_ok(fmt: FloatFormat) -> bool:
    """Formats whose in-range round-to-nearest-even is ``round(x / q) * q`` with q the ulp of x's binade (signed,
    with a zero, of at most 50 significand bits): every accumulator format of the emulated GEMMs."""
    return fmt.signed and fmt.zero and fmt.man <= 50 and fmt.emax <= 960


def _round_nearest_fast(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``ref.cast_float(x, fmt, "nearest")`` of float64 ``x``, bit for bit, in a few elementwise ops: the hot step
    of ``matmul_fma`` (two roundings per k of an (M, N) accumulator).

    For finite nonzero x, q = 2^(clamp(e, emin, emax + 1) - man) (e = floor(log2 |x|), from the exponent bits;
    emin clamps to the subnormal grid) is the spacing of fmt's values around x.  With C = 1.5 * 2^52 * q,
    |x| < 2^(man + 1) q <= C / 3 keeps x + C in C's binade, whose float64 spacing is q: the float64 addition
    rounds x to a multiple of q half to even, a carry into the next binade included, and (x + C) - C is exact.
    Entries where that is not the whole story -- results of magnitude above
    fmt.max (overflow: Inf, saturation or NaN by fmt.overflow; |x| >= 2^(emax + 2) lands there too), below the
    smallest normal of a format without subnormals, NaN / Inf -- are taken from ``ref.cast_float`` itself (rare
    in an accumulator).  (Integer and add ops only: torch's CPU round / frexp / ldexp on float64 are ~100x
    slower than an add.)"""
    e = ((x.view(torch.int64) >> 52) & 0x7FF) - 1023  # floor(log2 |x|) of a normal float64
    q_exp = torch.clamp(e, fmt.emin, fmt.emax + 1) - fmt.man  # exponent of the spacing q
    c = (((q_exp + (52 + 1023)) << 52) | (1 << 51)).view(torch.float64)  # 1.5 * 2^52 * q
    r = (x + c) - c  # a zero comes out +0: the sign of x where fmt has a -0 (its sign rule for zero results)
    if fmt.has_negative_zero:
        r = torch.copysign(r, x)
    hard = ~(r.abs() <= fmt.max)  # NaN, Inf, overflow
    if not fmt.subnormals:
        hard |= x.abs() < fmt.min_normal
    if bool(hard.any()):
        r = torch.where(hard, ref.cast_float(x, fmt, "nearest", None), r)
    return r


def _kahan_or_plain(s, c, p, fmt, rounding, kahan, generator, exact: bool = False):
    """One accumulation step; ``exact``: s, c, p are values of fmt whose float64 sums are exact (``_sums_exact``),
    so the round-to-odd correction is a no-op and is skipped."""
    R = lambda v: round_acc(v, fmt, rounding, generator)  # noqa: E731
    add = (lambda u, v: u + v) if exact else add_round_to_odd  # noqa: E731
    if not kahan:
        return R(add(s, p)), c
    y = R(add(p, -c))
    t = R(add(s, y))
    c = R(add(R(add(t, -s)), -y))
    return t, c


def matmul_fma(a: torch.Tensor, b: torch.Tensor, acc_fmt: FloatFormat, rounding: str = "nearest",
               kahan: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """(M, K) @ (K, N) of float32 values, every product and every addition rounded to ``acc_fmt``.
    Returns float32 (every acc_fmt value is a float32)."""
    a64, b64 = a.double(), b.double()  # exact: the inputs are float32 values
    M, K = a.shape
    N = b.shape[1]
    s = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    c = torch.zeros_like(s)
    if rounding == "stochastic":  # one draw per rounding, in this order: the bits a seed promises
        for k in range(K):
            p = round_acc(a64[:, k, None] * b64[None, k, :], acc_fmt, rounding, generator)  # (M, N), exact product
            s, c = _kahan_or_plain(s, c, p, acc_fmt, rounding, kahan, generator)
        return s.float()
    # Deterministic rounding is elementwise: the products of many k are rounded in one call (the same values as
    # one k at a time); only the additions are sequential along K.
    kc = max(1, min(K, (1 << 22) // max(1, M * N)))  # (M, kc, N) float64 products: <= 32 MB a block
    if rounding == "nearest" and not kahan and _fast_nearest_ok(acc_fmt) and acc_fmt.subnormals:
        out = _fma_nearest_unchecked(a64, b64, acc_fmt, kc)
        if out is not None:
            return out.float()
    for k0 in range(0, K, kc):
        p = round_acc(a64[:, k0:k0 + kc, None] * b64[None, k0:k0 + kc, :], acc_fmt, rounding)  # (M, kc, N) exact
        for j in range(p.shape[1]):
            s, c = _kahan_or_plain(s, c, p[:, j], acc_fmt, rounding, kahan, generator, _sums_exact(acc_fmt))
    return s.float()


def _fma_nearest_unchecked(a64: torch.Tensor, b64: torch.Tensor, fmt: FloatFormat, kc: int) -> torch.Tensor | None:
    """The plain (no Kahan) round-to-nearest loop of ``matmul_fma`` with ``_round_nearest_fast``'s arithmetic in
    place and its overflow test deferred: the running max of |s| is kept, and None is returned when any sum left
    [-max, max] (or became NaN), where the caller reruns the checked loop.  Otherwise every rounding was in range,
    where the unchecked and the checked rounding are the same formula: the same bits, ~1.5x fewer ops a step."""
    M, N = a64.shape[0], b64.shape[1]
    s = torch.zeros(M, N, dtype=torch.float64, device=a64.device)
    big = torch.zeros_like(s)  # running max |s|
    lo, hi = fmt.emin + 1023, fmt.emax + 1 + 1023  # biased exponents of the spacing's range
    const = ((52 - fmt.man) << 52) + (1 << 51)  # (e + 52 - man) << 52 | 2^51 = (e << 52) + const
    exact = _sums_exact(fmt)
    for k0 in range(0, a64.shape[1], kc):
        p = round_acc(a64[:, k0:k0 + kc, None] * b64[None, k0:k0 + kc, :], fmt, "nearest")  # (M, kc, N), checked
        for j in range(p.shape[1]):
            x = s + p[:, j] if exact else add_round_to_odd(s, p[:, j])
            e = x.view(torch.int64) >> 52
            e.bitwise_and_(0x7FF).clamp_(lo, hi).bitwise_left_shift_(52).add_(const)
            c = e.view(torch.float64)  # 1.5 * 2^52 * spacing
            s = x + c
            s.sub_(c)
            if fmt.has_negative_zero:
                s.copysign_(x)
            torch.maximum(big, s.abs(), out=big)
    if not bool((big <= fmt.max).all()):
        return None
    return s


def _sums_exact(fmt: FloatFormat) -> bool:
    """Whether the float64 sum of any two finite values of ``fmt`` is exact: every value is a multiple of the
    smallest subnormal's spacing 2^(emin - man) below 2^(emax + 1), so a sum needs at most emax + 2 - emin + man
    bits (e5m10: 42 <= 53).  Then round-to-odd of the sum is the sum itself (and Inf / NaN sums are the same)."""
    return (fmt.emax + 2) - (fmt.emin - fmt.man) <= 53


def matmul_chunk(a: torch.Tensor, b: torch.Tensor, acc_fmt: FloatFormat, chunk: int, rounding: str = "nearest",
                 kahan: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """(M, K) @ (K, N): fp32 partial sums of ``chunk`` consecutive k (torch.matmul in float32), the
    running accumulator rounded to ``acc_fmt`` after each chunk.  Returns float32."""
    M, K = a.shape
    N = b.shape[1]
    s = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    c = torch.zeros_like(s)
    for k0 in range(0, K, chunk):
        p = (a[:, k0:k0 + chunk].float() @ b[k0:k0 + chunk].float()).double()  # (M, N) fp32 partial
        s, c = _kahan_or_plain(s, c, p, acc_fmt, rounding, kahan, generator)
    return s.float()
