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

import math

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
    kc = max(1, min(K, (1 << 15) // max(1, M * N)))  # (kc, M, N) float64 products: <= 256 KB a block (L2)
    if rounding == "nearest" and not kahan and _unchecked_ok(acc_fmt):
        out = _fma_nearest(a64, b64, acc_fmt, kc)
        if out is not None:
            return out.float()
    for k0 in range(0, K, kc):
        p = round_acc(a64.t()[k0:k0 + kc, :, None] * b64[k0:k0 + kc, None, :], acc_fmt, rounding)  # (kc, M, N)
        for j in range(p.shape[0]):
            s, c = _kahan_or_plain(s, c, p[j], acc_fmt, rounding, kahan, generator, _sums_exact(acc_fmt))
    return s.float()


# ---- the unchecked round-to-nearest loops (the hot path of both modes) ---------------------------------------------
#
# ``_round_nearest_fast`` without its checks, in place, and round-to-odd without ``where`` / ``isfinite`` (each of
# those costs ~10 adds on the CPU): integer and float ops on float64 views.  Valid while every value rounded stays
# below 2^emax in magnitude (then no step overflows, and none is NaN or Inf).  Most GEMMs are known to stay there
# before the loop, from max|a| and max|b| (``_below_emax``); the others keep the largest float64 exponent field they
# rounded, and the caller reruns the checked loop when it reached 2^emax (or NaN / Inf).

_EXP_FIELD = 0x7FF0000000000000  # float64 exponent bits
_ABS = 0x7FFFFFFFFFFFFFFF
_NEG_ZERO32 = -(2**31)  # the bits of float32 -0 as an int32, the smallest int32


def _unchecked_ok(fmt: FloatFormat) -> bool:
    """Formats of the unchecked loop: the fast RNE's, with subnormals (no flush to zero to test for)."""
    return _fast_nearest_ok(fmt) and fmt.subnormals


def _add_odd_unchecked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``add_round_to_odd(a, b)`` where a + b is finite, in float and integer ops only: the float64 sum s, rounded
    toward zero (one ulp down in magnitude where TwoSum's t is nonzero and of the other sign), with its last bit
    set where t is nonzero."""
    s = a + b
    bb = s - a
    t = a - (s - bb)
    t += b - bb  # TwoSum: a + b == s + t exactly (Knuth)
    bits, tb = s.view(torch.int64), t.view(torch.int64)
    nz = torch.bitwise_and(tb, _ABS).neg_().bitwise_right_shift_(63)  # -1 where t != 0 (t finite), else 0
    down = torch.bitwise_xor(tb, bits).bitwise_right_shift_(63).bitwise_and_(nz)  # -1: t nonzero, other sign
    return down.add_(bits).bitwise_or_(nz.neg_()).view(torch.float64)


def _rne_constants(fmt: FloatFormat) -> tuple[int, float]:
    """``_round_nearest_into``'s constants for fmt: the exponent field of 2^emin, and 1.5 * 2^(52 - man)."""
    return (fmt.emin + 1023) << 52, 1.5 * 2.0 ** (52 - fmt.man)


def _round_nearest_into(x: torch.Tensor, consts: tuple[int, float], c: torch.Tensor, top: torch.Tensor | None,
                        out: torch.Tensor) -> torch.Tensor:
    """out = ``_round_nearest_fast(x, fmt)`` (out may be x; ``consts = _rne_constants(fmt)``), where the result is in
    range (fmt with subnormals), except that a zero comes out +0.  ``c``: int64 scratch shaped like x.  ``top``: None,
    or int64 shaped like x (or 0-d) that keeps the largest exponent field of x seen (in place)."""
    lo, scale = consts
    torch.bitwise_and(x.view(torch.int64), _EXP_FIELD, out=c)  # as a float64: |x| rounded down to a power of two
    if top is not None:
        torch.maximum(top, c if top.dim() else c.amax(), out=top)
    # 1.5 * 2^52 * spacing, the spacing clamped to the subnormals' below 2^emin (no upper clamp: in range); a float
    # mul_ is cheaper than an int64 add_ on the CPU
    cf = c.clamp_min_(lo).view(torch.float64).mul_(scale)
    return torch.add(x, cf, out=out).sub_(cf)


def _absmax(t: torch.Tensor) -> float:
    """max |t| (NaN if t has a NaN), in one reduction over t's memory order."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t.t() if t.dim() == 2 and t.t().is_contiguous() else t)
    return max(-float(lo), float(hi))


def _below_emax(term: float, steps: int, fmt: FloatFormat) -> bool:
    """Whether ``steps`` accumulation steps s = R(s + p), every |p| <= ``term``, keep every value rounded (every
    s + p, every s) below 2^emax in magnitude, for R round-to-nearest to fmt after at most a round-to-odd to float64.
    By induction |s_i| <= rho (|s_(i-1)| + term) + eta, with rho = (1 + u)(1 + 2^-52) <= 1 + 2^-man (u = 2^-(man+1),
    the relative error; eta = 2^(emin - man - 1), the subnormals' absolute error), so every |s_(i-1) + p_i| is at most
    steps * rho^steps * (term + eta).  False for NaN / Inf terms."""
    eta = 2.0 ** (fmt.emin - fmt.man - 1)
    try:
        bound = steps * (1 + 2.0 ** -fmt.man) ** steps * (term + eta) * (1 + 2.0**-30)  # (margin for this float math)
    except OverflowError:
        return False
    return bound < 2.0**fmt.emax


def _fma_nearest(a64: torch.Tensor, b64: torch.Tensor, fmt: FloatFormat, kc: int) -> torch.Tensor | None:
    """``matmul_fma``'s round-to-nearest loop, unchecked: the products of kc k rounded in one (kc, M, N) block, then
    s = R(s + p) along K.  None where a value reached 2^emax (or NaN / Inf): the caller reruns its checked loop.

    Zeros come out +0, which is right: s starts +0 and is never -0.  s + p is a multiple of the finest value of fmt
    (both are values of fmt), so a nonzero s + p (or its round-to-odd, no smaller) never rounds to zero, and a zero
    one is +0 (x + (-x) = +0; +0 + -0 = +0).  So the sign of a zero product never shows either.

    Where float64 sums of fmt values are exact (``_sums_exact``) round-to-odd is skipped: R(fl(s + p)) == R(s + p)."""
    M, K = a64.shape
    N = b64.shape[1]
    bounded = _below_emax(2 * _absmax(a64) * _absmax(b64), K, fmt)  # |R(ab)| <= (1 + u)|ab| + eta <= 2|ab| + eta
    exact = _sums_exact(fmt)
    dev = a64.device
    s = torch.zeros(M, N, dtype=torch.float64, device=dev)
    c = torch.empty(M, N, dtype=torch.int64, device=dev)
    prod = torch.empty(kc, M, N, dtype=torch.float64, device=dev)  # a block of products, and its scratch
    cp = torch.empty(kc, M, N, dtype=torch.int64, device=dev)
    top = None if bounded else torch.zeros(M, N, dtype=torch.int64, device=dev)
    top_p = None if bounded else torch.zeros((), dtype=torch.int64, device=dev)
    rne = _rne_constants(fmt)
    a_t, b_c = a64.t().contiguous(), b64.contiguous()  # (K, M), (K, N): rows for the products (3x faster than strided)
    for k0 in range(0, K, kc):
        kk = min(kc, K - k0)
        p = torch.mul(a_t[k0:k0 + kk, :, None], b_c[k0:k0 + kk, None, :], out=prod[:kk])  # (kk, M, N) exact
        _round_nearest_into(p, rne, cp[:kk], top_p, out=p)
        for p_k in p:
            x = s.add_(p_k) if exact else _add_odd_unchecked(s, p_k)
            s = _round_nearest_into(x, rne, c, top, out=x)
    if not bounded and not (_in_range(top, fmt) and _in_range(top_p, fmt)):
        return None
    return s


def _chunk_nearest(a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat, chunk: int) -> torch.Tensor | None:
    """``matmul_chunk``'s round-to-nearest loop, unchecked (``_accumulate_chunks``); None where a value reached
    2^emax (or NaN / Inf): the caller reruns its checked loop."""
    M, K = a.shape
    N = b.shape[1]
    if K == 0 or M == 0 or N == 0:  # (nothing to round; empty partials have no -0 to look for)
        return torch.zeros(M, N, dtype=torch.float64, device=a.device)
    cc = min(chunk, K)
    # |fp32 partial| <= (1 + gamma_cc) sum |ab| in any summation order, gamma_cc = cc u32 / (1 - cc u32) (Higham 3.5):
    # the factor 2 also covers a matmul that rounds its inputs (TF32, bf16) and underflow, <= 2^-100.  (No partial
    # overflows float32 where the bound holds: every format's 2^emax is a float32.)
    term = 2 * cc * _absmax(a) * _absmax(b) + 2.0**-100 if cc <= 2**20 else math.inf

    def partials():  # (M, N) fp32 partial sums of the chunks, in one buffer
        p = torch.empty(M, N, dtype=torch.float32, device=a.device)
        for a_k, b_k in zip(a.split(chunk, 1), b.split(chunk, 0)):
            yield torch.matmul(a_k.float(), b_k.float(), out=p)  # as `a_k @ b_k` computes it

    return _accumulate_chunks(partials, fmt, M, N, a.device, _below_emax(term, -(-K // chunk), fmt))


def _accumulate_chunks(partials, fmt: FloatFormat, M: int, N: int, device, bounded: bool,
                       sign_every_step: bool = False) -> torch.Tensor | None:
    """s = R(s + p) for the (M, N) fp32 partials that ``partials()`` yields, in order, unchecked (R: round to nearest
    even to fmt, with subnormals); None where a value reached 2^emax (or NaN / Inf).  ``bounded``: known not to
    (``_below_emax``), so the loop keeps no tracker.  ``partials`` is called a second time for a rerun (see below).

    Round-to-odd is skipped for ``_sums_exact(fmt)`` formats: R(fl(s + p)) == R(s + p) there.  A partial sum p has
    at most 24 significant bits, and with E the larger operand's exponent, the sum is exact unless the smaller is
    below 2^(E-28).  If that smaller one is p, |p| is under a quarter of s's distance to a midpoint of fmt (man <= 23),
    so x = fl(s + p) and s + p both round to s.  If it is s (|s| >= 2^(emin - man), the finest fmt value),
    x = fl(p + s) is a midpoint of fmt only where x = p, |s| <= 2^(E-53), so E >= emin - man + 53 > emax + 1 for
    ``_sums_exact`` formats: |x| >= 2^emax, a rejected run.  Otherwise x is no midpoint and rounds like s + p (the
    float64 nearest to s + p; a midpoint between them would be nearer).

    Signs of zeros: the loop rounds zeros to +0 and sets the sign of x only after the last step.  Every other value
    is the same as with the sign set at every step (-0 and +0 add alike to a nonzero p).  So only a zero result can
    differ, and its sign is the sign of the last step's x unless that step adds a -0 to a zero (x = s + -0 keeps the
    sign of s, from an earlier step).  Where a -0 last partial meets a zero result, the loop runs again with the sign
    set at every step (``sign_every_step``)."""
    exact = _sums_exact(fmt)
    signed = fmt.has_negative_zero
    s = torch.zeros(M, N, dtype=torch.float64, device=device)
    x = torch.empty_like(s)  # s + p
    c = torch.empty(M, N, dtype=torch.int64, device=device)
    top = None if bounded else torch.zeros(M, N, dtype=torch.int64, device=device)
    rne = _rne_constants(fmt)
    p = xx = None
    for p in partials():
        xx = x.copy_(p).add_(s) if exact else _add_odd_unchecked(s, x.copy_(p))
        _round_nearest_into(xx, rne, c, top, out=s)
        if signed and sign_every_step:
            s.copysign_(xx)
    if not bounded and not _in_range(top, fmt):
        return None
    if signed and not sign_every_step and p is not None:
        s.copysign_(xx)  # the last step's x
        p_bits = p.view(torch.int32)
        if int(p_bits.min()) == _NEG_ZERO32 and bool(((p_bits == _NEG_ZERO32) & (s == 0)).any()):
            return _accumulate_chunks(partials, fmt, M, N, device, bounded, sign_every_step=True)
    return s


def _in_range(top: torch.Tensor, fmt: FloatFormat) -> bool:
    """Every value the unchecked loop rounded was below 2^emax in magnitude (so every result is at most
    2^emax <= fmt.max: no overflow; NaN / Inf have the largest field)."""
    return bool((top.max() < (fmt.emax + 1023) << 52).item()) if top.numel() else True


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
    if rounding == "nearest" and not kahan and _unchecked_ok(acc_fmt):
        out = _chunk_nearest(a, b, acc_fmt, chunk)
        if out is not None:
            return out.float()
    s = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    c = torch.zeros_like(s)
    for k0 in range(0, K, chunk):
        p = (a[:, k0:k0 + chunk].float() @ b[k0:k0 + chunk].float()).double()  # (M, N) fp32 partial sum
        s, c = _kahan_or_plain(s, c, p, acc_fmt, rounding, kahan, generator)
    return s.float()
