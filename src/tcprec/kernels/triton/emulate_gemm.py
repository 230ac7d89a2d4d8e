"""Emulated-accumulator GEMMs: C = A @ B with the accumulator held in any FloatFormat.

Model and proof of exactness: kernels/reference_emulate.py (the ground truth these kernels equal).

``fma`` mode, on CUDA cores (pseudo-code of one program, a BLOCK_M x BLOCK_N tile of C)::

    s = 0; c = 0
    for k in range(K):                       # in order along K: the model fixes the order
        p = R(odd(a[:, k] * b[k, :]))        # outer product of a column and a row, rounded
        s = R(odd(s + p))                    # (or Kahan: y = R(p - c); t = R(s + y); ...)

Each FMA costs two roundings; R is ``round.round_to_format`` with the format folded in as
constexprs.  ``chunk`` mode runs ``tl.dot`` (tensor cores) on BLOCK_K = chunk columns with a fresh
fp32 accumulator and rounds the running sum after each chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats import FloatFormat
from .round import MODES, add_round_to_odd, mul_round_to_odd, round_constexprs, round_to_format


@triton.jit
def _acc_update(s, c, p,
                MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                MODE: tl.constexpr, KAHAN: tl.constexpr):
    """s <- R(s + p) (KAHAN: the compensated update, every operation rounded); returns (s, c)."""
    if KAHAN:
        y = round_to_format(add_round_to_odd(p, -c), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        t = round_to_format(add_round_to_odd(s, y), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        d = round_to_format(add_round_to_odd(t, -s), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        c = round_to_format(add_round_to_odd(d, -y), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        s = t
    else:
        s = round_to_format(add_round_to_odd(s, p), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    return s, c


@triton.jit
def _fma_gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # -- the accumulator format (FloatFormat), folded at compile time --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, KAHAN: tl.constexpr, EXACT_PRODUCT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m * stride_am  # (BLOCK_M,) column k of the A tile
    b_ptrs = b_ptr + offs_n * stride_bn  # (BLOCK_N,) row k of the B tile
    s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K):
        a_k = tl.load(a_ptrs + k * stride_ak, mask=mask_m, other=0.0)
        b_k = tl.load(b_ptrs + k * stride_bk, mask=mask_n, other=0.0)
        # ---- product, rounded once to the accumulator format ----
        p = mul_round_to_odd(a_k[:, None], b_k[None, :], EXACT_PRODUCT)
        p = round_to_format(p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        # ---- accumulate, rounded once ----
        s, c = _acc_update(s, c, p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                           OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, s, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _chunk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, CHUNK)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, CHUNK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (CHUNK, BLOCK_N)
    s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, CHUNK):
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (offs_n[None, :] < N), other=0.0)
        if IEEE_DOT:  # float32 operands that do not fit a 16-bit type: no TF32 shortcut
            p = tl.dot(a, b, input_precision="ieee")
        else:  # fp16 / bf16 operands (exact copies of the values): tensor cores, fp32 accumulate
            p = tl.dot(a, b)
        s, c = _acc_update(s, c, p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                           OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN)
        a_ptrs += CHUNK * stride_ak
        b_ptrs += CHUNK * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, s, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ----------------------------------------------------------------------------------------------


def can_implement(acc_fmt, rounding: str, mode: str, chunk: int = 32) -> str | None:
    """None if the kernels run this configuration, else the reason they cannot."""
    if not isinstance(acc_fmt, FloatFormat):
        return f"the accumulator must be a FloatFormat, got {acc_fmt}"
    if acc_fmt.man > 21:
        return (f"acc_fmt {acc_fmt} has {acc_fmt.man} mantissa bits; exact rounding from a float32 rounded-to-odd "
                "sum needs <= 21 (the reference backend handles up to 23 through float64)")
    if rounding not in MODES:
        return f"rounding={rounding!r} inside the GEMM kernel is not implemented (deterministic modes: {tuple(MODES)})"
    if mode == "chunk" and (chunk < 16 or chunk & (chunk - 1)):
        return f"chunk mode on tensor cores needs chunk a power of two >= 16 (tl.dot), got chunk={chunk}"
    return None


def product_is_exact(a_fmt, b_fmt) -> bool:
    """True if every product of an a_fmt value and a b_fmt value is a float32 (one multiply suffices)."""
    if not (isinstance(a_fmt, FloatFormat) and isinstance(b_fmt, FloatFormat)):
        return False
    fits = a_fmt.precision + b_fmt.precision <= 24
    q = (a_fmt.emin - a_fmt.man if a_fmt.subnormals else a_fmt.emin) + \
        (b_fmt.emin - b_fmt.man if b_fmt.subnormals else b_fmt.emin)  # exponent of the finest product quantum
    return fits and q >= -149 and a_fmt.max * b_fmt.max < 3.4e38


def matmul(a: torch.Tensor, b: torch.Tensor, acc_fmt: FloatFormat, mode: str = "fma", chunk: int = 32,
           kahan: bool = False, rounding: str = "nearest", exact_product: bool = False,
           block_m: int = 32, block_n: int = 32, num_warps: int = 4) -> torch.Tensor:
    """(M, K) @ (K, N) -> float32 (M, N); the op layer validates and explains.  fma mode takes float32
    operands; chunk mode takes float32, or float16/bfloat16 holding the values exactly (tensor cores)."""
    why = can_implement(acc_fmt, rounding, mode, chunk)
    if why is not None:
        raise ValueError(why)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return c
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    common = dict(**round_constexprs(acc_fmt), MODE=MODES[rounding], KAHAN=kahan,
                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if mode == "fma":
        _fma_gemm_kernel[grid](*args, EXACT_PRODUCT=exact_product, **common)
    else:
        _chunk_gemm_kernel[grid](*args, CHUNK=chunk, IEEE_DOT=a.dtype == torch.float32, **common)
    return c
