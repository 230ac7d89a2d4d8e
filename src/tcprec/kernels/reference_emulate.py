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
    return ref.cast_float(x64, fmt, rounding, seed)


def _kahan_or_plain(s, c, p, fmt, rounding, kahan, generator):
    R = lambda v: round_acc(v, fmt, rounding, generator)  # noqa: E731
    if not kahan:
        return R(add_round_to_odd(s, p)), c
    y = R(add_round_to_odd(p, -c))
    t = R(add_round_to_odd(s, y))
    c = R(add_round_to_odd(R(add_round_to_odd(t, -s)), -y))
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
    for k in range(K):
        p = round_acc(a64[:, k, None] * b64[None, k, :], acc_fmt, rounding, generator)  # (M, N), exact product
        s, c = _kahan_or_plain(s, c, p, acc_fmt, rounding, kahan, generator)
    return s.float()


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
