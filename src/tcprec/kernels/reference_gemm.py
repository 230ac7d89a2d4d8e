"""Pure-torch bit-serial integer GEMM: the ground truth of ``kernels/cuda/bmma_gemm.cu`` and the
CPU backend of ``tcprec.matmul``.  It computes the same thing the same way (bit planes, AND,
popcount, plane weights, affine corrections), so every device gives the same integers.

The algebra (APNN-TC's decomposition, with the corrections written out)
-------------------------------------------------------------------------
An integer format of b bits stores a code whose bit planes are ``c_0 .. c_{b-1}`` (bit i of the
stored pattern, ``tcprec.packing``).  Give plane i the weight ``wt_i = 2^i``, except the top plane
of a two's complement code, which weighs ``-2^(b-1)``; the weighted code is
``v = sum_i wt_i c_i``.  Every IntFormat is then affine in v::

    value = offset + step * v
    twos      offset 0              step 1     (v is the signed value)
    unsigned  offset 0              step 1     (v is the value)
    pm1       offset -(2^b - 1)     step 2     (v is the code index u; 1 bit: {-1, +1})

For a (M, K) with p planes and w (N, K) with q planes (w like an nn.Linear weight)::

    C[m, n] = sum_k (oa + sa va[m,k]) (ow + sw vw[n,k])
            = sa sw S[m, n]  +  sa ow Ra[m]  +  oa sw Rw[n]  +  K oa ow

    S[m, n] = sum_{i<p, j<q} wt_i wt_j popc(A_i[m, :] AND W_j[n, :])     p*q binary GEMMs
    Ra[m]   = sum_k va[m, k] = sum_i wt_i popc(A_i[m, :])                  (plane_popcounts)
    Rw[n]   = sum_k vw[n, k] = sum_j wt_j popc(W_j[n, :])

K is the true K: the padding bits are zero, so they add nothing to S, Ra or Rw.  Only pm1 has an
offset, so twos and unsigned need no correction at all (their sign lives in the top plane's
weight); for pm1 the kernel's epilogue adds ``row_term[m] = sa ow Ra[m] + K oa ow`` and
``col_term[n] = oa sw Rw[n]`` to ``ss * S`` with ``ss = sa sw``.  Every term is an integer; the
result equals ``decode(a) @ decode(w).T`` exactly (here in int64; the CUDA kernel in int32, exact
while ``|C| < 2^31``, which ``tcprec.matmul`` checks from K and the formats' ranges).

The float epilogue is ``y = ((float32(C) * row_scale[m]) * col_scale[n]) + bias[n]``, then ReLU,
then the output dtype: one IEEE rounding per step, in this order on every backend.
"""

from __future__ import annotations

import torch

from ..formats import IntFormat
from .reference import encode_int
from .reference_bitplanes import pack_bitplanes_reference, packed_words, plane_popcounts

__all__ = [
    "plane_weights",
    "affine",
    "corrections",
    "unpack_planes01",
    "popcount_gemm",
    "bitserial_matmul",
    "float_epilogue",
    "pack_output",
]

_M32 = 0xFFFFFFFF
_EXACT_F32 = 1 << 24  # a float32 GEMM of 0/1 matrices is exact while every sum stays below 2^24


def plane_weights(fmt: IntFormat) -> list[int]:
    """``wt_i`` of each plane: 2^i, and -2^(b-1) for the top plane of two's complement codes.

    >>> plane_weights(IntFormat(3, signed=True)), plane_weights(IntFormat(2, encoding="pm1"))
    ([1, 2, -4], [1, 2])
    """
    b = fmt.bits
    return [-(1 << i) if (fmt.encoding == "twos" and i == b - 1) else (1 << i) for i in range(b)]


def affine(fmt: IntFormat) -> tuple[int, int]:
    """(offset, step) with value = offset + step * (weighted code).

    >>> affine(IntFormat(4, signed=True)), affine(IntFormat(1, encoding="pm1"))
    ((0, 1), (-1, 2))
    """
    if fmt.encoding == "pm1":
        return fmt.offset, fmt.step
    return 0, 1


def weighted_rowsums(planes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """``R[r] = sum_i wt_i popc(plane_i[r, :])`` = the row sums of the weighted codes, int64 (rows,)."""
    pc = plane_popcounts(planes).to(torch.int64)  # (bits, rows)
    # Python-int weights: no host-to-device copy, so this also runs inside CUDA-graph capture
    return sum(pc[i] * w for i, w in enumerate(plane_weights(fmt)))


def corrections(a_planes: torch.Tensor, w_planes: torch.Tensor, K: int, a_fmt: IntFormat, w_fmt: IntFormat):
    """``(ss, row_term, col_term)`` of the module docstring; the terms are int64 tensors (M,), (N,),
    or None when they are identically zero (no pm1 operand)."""
    oa, sa = affine(a_fmt)
    ow, sw = affine(w_fmt)
    row_term = col_term = None
    if ow != 0:
        row_term = sa * ow * weighted_rowsums(a_planes, a_fmt) + K * oa * ow  # (M,), with the constant
    if oa != 0:
        col_term = oa * sw * weighted_rowsums(w_planes, w_fmt)  # (N,)
    return sa * sw, row_term, col_term


def unpack_planes01(planes: torch.Tensor, K: int) -> torch.Tensor:
    """int32 planes (bits, rows, Kw) -> uint8 0/1 bits (bits, rows, K)."""
    bits, rows, Kw = planes.shape
    w = planes.to(torch.int64) & _M32  # (bits, rows, Kw) unsigned words
    lanes = torch.arange(32, device=planes.device, dtype=torch.int64)
    b = ((w.unsqueeze(-1) >> lanes) & 1).to(torch.uint8)  # (bits, rows, Kw, 32), LSB-first
    return b.reshape(bits, rows, Kw * 32)[..., :K]


def popcount_gemm(a_planes: torch.Tensor, w_planes: torch.Tensor, K: int) -> torch.Tensor:
    """``pop[i, m, j, n] = popc(A_i[m, :] AND W_j[n, :])`` as int64 (p, M, q, N).

    One float32 GEMM of the stacked 0/1 planes per chunk of < 2^24 bits of K: every partial sum is
    an integer below 2^24, so float32 is exact whatever the summation order.
    """
    p, M, _ = a_planes.shape
    q, N, _ = w_planes.shape
    a01 = unpack_planes01(a_planes, K).reshape(p * M, K)  # (p*M, K) 0/1, plane-major rows
    w01 = unpack_planes01(w_planes, K).reshape(q * N, K)  # (q*N, K)
    dev_f = torch.float32
    pop = torch.zeros(p * M, q * N, dtype=torch.int64, device=a_planes.device)
    for k0 in range(0, max(K, 1), _EXACT_F32 - 1):
        k1 = min(K, k0 + _EXACT_F32 - 1)
        if k1 <= k0:
            break
        pop += (a01[:, k0:k1].to(dev_f) @ w01[:, k0:k1].to(dev_f).t()).round().to(torch.int64)
    return pop.reshape(p, M, q, N)


def bitserial_matmul(a_planes: torch.Tensor, w_planes: torch.Tensor, K: int, a_fmt: IntFormat,
                     w_fmt: IntFormat) -> torch.Tensor:
    """``decode(a) @ decode(w).T`` as int64 (M, N), computed from bit planes (module docstring).

    ``a_planes`` (p, M, Kw) and ``w_planes`` (q, N, Kw) int32 from ``tcprec.pack_bitplanes``.

    >>> import torch, tcprec as tp
    >>> fa, fw = tp.IntFormat(2, signed=True), tp.IntFormat(1, encoding="pm1")
    >>> a = tp.encode(torch.tensor([[1., -2., 0.]]), fa); w = tp.encode(torch.tensor([[1., -1., 1.]]), fw)
    >>> bitserial_matmul(tp.pack_bitplanes(a, 2), tp.pack_bitplanes(w, 1), 3, fa, fw).tolist()
    [[3]]
    """
    p, M, Kw = a_planes.shape
    q, N, Kw_w = w_planes.shape
    if Kw != Kw_w or Kw != packed_words(K):
        raise ValueError(f"planes must pack K={K} into {packed_words(K)} words, got {Kw} (a) and {Kw_w} (w)")
    dev = a_planes.device
    pop = popcount_gemm(a_planes, w_planes, K)  # (p, M, q, N)
    wa = torch.tensor(plane_weights(a_fmt), dtype=torch.int64, device=dev)
    ww = torch.tensor(plane_weights(w_fmt), dtype=torch.int64, device=dev)
    S = torch.zeros(M, N, dtype=torch.int64, device=dev)
    for i in range(p):  # sum_{i,j} wt_i wt_j popc(A_i AND W_j)
        for j in range(q):
            S += int(wa[i] * ww[j]) * pop[i, :, j, :]
    ss, row_term, col_term = corrections(a_planes, w_planes, K, a_fmt, w_fmt)
    C = ss * S
    if row_term is not None:
        C += row_term[:, None]
    if col_term is not None:
        C += col_term[None, :]
    return C


def float_epilogue(C: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None,
                   bias: torch.Tensor | None, relu: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``((float32(C) * row_scale[:, None]) * col_scale[None, :]) + bias``, ReLU, cast: the kernel's
    float epilogue, step for step (each op rounds once in float32)."""
    y = C.to(torch.float32)
    if row_scale is not None:
        y = y * row_scale.to(torch.float32)[:, None]
    if col_scale is not None:
        y = y * col_scale.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)[None, :]
    if relu:
        y = torch.where(y < 0, torch.zeros_like(y), y)
    return y.to(out_dtype)


def pack_output(y: torch.Tensor, out_fmt: IntFormat, out_scale: torch.Tensor) -> torch.Tensor:
    """The packed epilogue: ``pack_bitplanes(encode(y / out_scale, out_fmt, "nearest"))`` with
    quantize's saturation; y float32 (M, N) -> int32 planes (bits, M, packed_words(N))."""
    v = y.to(torch.float32) / out_scale.to(torch.float32).reshape(())
    lo, hi = float(out_fmt.min), float(out_fmt.max)
    v = torch.clamp(v, lo, hi)  # quantize saturates before the cast (same codes as the kernel)
    codes = encode_int(v, out_fmt, "nearest")  # (M, N) int64 patterns in 0 .. 2**bits - 1; -1 for NaN
    if bool((codes < 0).any()):
        raise ValueError(f"y holds NaN, which has no {out_fmt} code; the packed epilogue needs finite outputs")
    return pack_bitplanes_reference(codes, out_fmt.bits)
