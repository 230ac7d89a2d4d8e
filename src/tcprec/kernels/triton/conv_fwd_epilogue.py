"""The fused epilogue of the INT8 / FP8 forward conv (``conv_fwd.py``), one ``@triton.jit`` function a GEMM kernel
calls after its accumulator (a persistent TMA GEMM shared it and gave the same bits: docs/decisions/0140).  What each
output mode computes, in the float32 operation order of ``kernels/reference_conv_int8_fp8.py``, is in
``conv_fwd.py``'s module docstring.
"""

from __future__ import annotations

from enum import IntEnum

import triton
import triton.language as tl

from ..reference_conv_int8_fp8 import ACT_CLAMP, ACT_HARDSWISH, ACT_LEAKY, ACT_RELU, ACT_SILU, HARDSWISH_SIXTH
from .pack import PAD_W, _quantize_codes, _store_planes
from .round import div_by_scalar, fp8_code

__all__ = ["OutMode"]


class OutMode(IntEnum):
    """What the epilogue writes (the kernels' ``OUT_MODE``; conv_fwd.py's module docstring says each in full)."""

    RAW = 0  # the accumulator
    FLOAT = 1  # float16 / bfloat16 / float32 y
    INT8 = 2  # the next INT8 layer's codes
    DUAL = 3  # the float y and the int8 codes of that float
    FP8 = 4  # the next FP8 layer's float8 codes
    DUAL_FP8 = 5  # the float y and the float8 codes of that float
    PLANES = 6  # the next bit-serial layer's packed planes


# the same values as the kernel compares them (constexpr globals): the run-time activation code (ReLU / LeakyReLU) and
# the compiled-in one (ACT_EXT: clamp, hardswish, SiLU)
OUT_RAW = tl.constexpr(int(OutMode.RAW))
OUT_FLOAT = tl.constexpr(int(OutMode.FLOAT))
OUT_INT8 = tl.constexpr(int(OutMode.INT8))
OUT_DUAL = tl.constexpr(int(OutMode.DUAL))
OUT_FP8 = tl.constexpr(int(OutMode.FP8))
OUT_DUAL_FP8 = tl.constexpr(int(OutMode.DUAL_FP8))
OUT_PLANES = tl.constexpr(int(OutMode.PLANES))
_ACT_RELU = tl.constexpr(ACT_RELU)
_ACT_LEAKY = tl.constexpr(ACT_LEAKY)
_ACT_CLAMP = tl.constexpr(ACT_CLAMP)
_ACT_HARDSWISH = tl.constexpr(ACT_HARDSWISH)
_ACT_SILU = tl.constexpr(ACT_SILU)
_SIXTH = tl.constexpr(HARDSWISH_SIXTH)


@triton.jit
def _channel_scale(sa_ptr, sb_ptr, offs_n_ld, alpha, sa_stride, sb_stride, OUT_MODE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The epilogue's per-channel multiplier ``(alpha * sa[k]) * sb[k]``, float32 (scales per channel: stride 1, per
    tensor: 0); zeros for the raw accumulator, which the epilogue never scales."""
    if OUT_MODE != OUT_RAW:
        sa = tl.load(sa_ptr + offs_n_ld * sa_stride).to(tl.float32)
        sb = tl.load(sb_ptr + offs_n_ld * sb_stride).to(tl.float32)
        scl = (alpha * sa) * sb
    else:
        scl = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return scl


@triton.jit
def _conv_epilogue(acc, offs_m, offs_n, offs_n_ld, m_ok, n_ok, scl, pid_n, num_n, M, K, out_ptr, bias_ptr, oscale_ptr,
                   res, res_ptr, out8_ptr, bias_stride, act, act_a, act_b, planes_kw, OUT_MODE: tl.constexpr,
                   ACT_EXT: tl.constexpr, INT64: tl.constexpr, HAS_RES: tl.constexpr, OUT_LO: tl.constexpr,
                   OUT_HI: tl.constexpr, OUT_OFF: tl.constexpr,
                   F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr,
                   F8_MIN_NORMAL_BITS: tl.constexpr, F8_SUB_SCALE: tl.constexpr, Q_BITS: tl.constexpr,
                   Q_SHIFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Everything after the accumulator, shared by the implicit-GEMM kernel and the TMA GEMM (conv_fwd_tma.py), so
    that both run the same code: ``acc`` (BLOCK_M, BLOCK_N) of output rows ``offs_m`` (``m_ok``) and channels
    ``offs_n`` (``n_ok``; ``offs_n_ld`` = offs_n mod K, safe to load), ``scl`` = (alpha * sa) * sb per channel
    (unused for OUT_RAW); ``res`` the residual tile (HAS_RES: loaded by the caller before its K loop, so that
    its latency hides behind the MMAs; ``res_ptr`` gives its dtype); the stores of OUT_MODE (conv_fwd.py's module
    docstring).  ``pid_n`` / ``num_n`` (the channel block and their count), ``M`` and ``planes_kw``: OUT_PLANES
    only; ``K``: the row length of out.

    The activation (``reference_conv_int8_fp8.apply_act``'s operations): ReLU / LeakyReLU by the run-time code ``act``
    (slope ``act_a``), or one compiled in by ``ACT_EXT`` (0: none; ``_ACT_CLAMP``: bounds ``act_a``, ``act_b``;
    ``_ACT_HARDSWISH``; ``_ACT_SILU``) with ``act`` = ACT_NONE -- a constexpr, so that the ReLU / LeakyReLU variants
    compile to the code they compiled to before these existed (no ``exp``, no float32 division)."""
    if INT64:
        offs_out = offs_m.to(tl.int64)[:, None] * K + offs_n[None, :]
    else:
        offs_out = offs_m[:, None] * K + offs_n[None, :]
    out_ptrs = out_ptr + offs_out
    mask = m_ok[:, None] & n_ok[None, :]
    if OUT_MODE == OUT_RAW:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        bias = tl.load(bias_ptr + offs_n_ld * bias_stride).to(tl.float32)
        y = acc.to(tl.float32) * scl[None, :]
        y = y + bias[None, :]
        if HAS_RES:  # the unfused graph: the branch stored in the residual's dtype, then one float32 add
            y = y.to(res_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)  # (no-op roundings for fp32)
            y = y.to(res_ptr.dtype.element_ty).to(tl.float32)  # the sum as the add stores it: any act sees that
        if act == _ACT_RELU:
            y = tl.where(y > 0, y, 0.0)
        elif act == _ACT_LEAKY:
            y = tl.where(y > 0, y, y * act_a)
        if ACT_EXT == _ACT_CLAMP:  # ReLU6 / hardtanh: min(max(y, lo), hi), NaN -> lo
            y = tl.where(y > act_a, y, act_a)
            y = tl.where(y < act_b, y, act_b)
        elif ACT_EXT == _ACT_HARDSWISH:  # y * relu6(y + 3) / 6, as a product with float32(1/6)
            t = y + 3.0
            t = tl.where(t > 0, t, 0.0)
            t = tl.where(t < 6.0, t, 6.0)
            y = y * (t * _SIXTH)
        elif ACT_EXT == _ACT_SILU:  # y * sigmoid(y) = y / (1 + exp(-y)), IEEE division (Triton's '/' is div.full)
            y = tl.div_rn(y, 1.0 + tl.exp(-y))
        if OUT_MODE == OUT_PLANES:  # the next bit-serial layer's planes: quantize -> pack (pooled above)
            offs_p = offs_m
            if INT64:
                offs_p = offs_p.to(tl.int64)
            c = _quantize_codes(y, tl.load(oscale_ptr), OUT_LO, OUT_HI, OUT_OFF, Q_SHIFT, Q_BITS)
            c = tl.where(n_ok[None, :], c, 0)  # channels past K: the zero bits of the row's last word
            offs_w = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            _store_planes(tl.reshape(c, (offs_p.shape[0], BLOCK_N // 32, 32)), out_ptr, offs_p, offs_w, M,
                          planes_kw, M * planes_kw, planes_kw, 1, Q_BITS)
            if pid_n == num_n - 1:  # the zero words past the last channel block (rows padded to 512 bits)
                offs_z = (pid_n + 1) * (BLOCK_N // 32) + tl.arange(0, PAD_W)
                z_ptrs = out_ptr + offs_p[:, None] * planes_kw + offs_z[None, :]
                z_mask = (offs_p[:, None] < M) & (offs_z[None, :] < planes_kw)
                for b in tl.static_range(Q_BITS):
                    tl.store(z_ptrs + b * (M * planes_kw), tl.zeros((offs_p.shape[0], PAD_W), tl.int32), mask=z_mask)
        elif OUT_MODE == OUT_FLOAT or OUT_MODE == OUT_DUAL or OUT_MODE == OUT_DUAL_FP8:
            y_out = y.to(out_ptr.dtype.element_ty)
            tl.store(out_ptrs, y_out, mask=mask)
            if OUT_MODE != OUT_FLOAT:  # the codes of the stored float, as a separate quantize pass would read it
                y = y_out.to(tl.float32)
        elif HAS_RES:  # int8 / fp8 codes: of the value in the residual's (the network's) float dtype
            y = y.to(res_ptr.dtype.element_ty).to(tl.float32)
        if OUT_MODE == OUT_FP8 or OUT_MODE == OUT_DUAL_FP8:  # the next FP8 layer's codes (float8 bit patterns)
            y = div_by_scalar(y, tl.load(oscale_ptr))
            c = fp8_code(y, F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
            if OUT_MODE == OUT_FP8:
                tl.store(out_ptrs, c.to(tl.uint8), mask=mask)
            else:
                tl.store(out8_ptr + offs_out, c.to(tl.uint8), mask=mask)
        if OUT_MODE == OUT_INT8 or OUT_MODE == OUT_DUAL:
            y = div_by_scalar(y, tl.load(oscale_ptr))
            y = tl.where(y == y, y, 0.0)  # NaN -> 0
            y = tl.minimum(tl.maximum(y, OUT_LO * 1.0), OUT_HI * 1.0)
            y = (y + 12582912.0) - 12582912.0  # round half to even (1.5 * 2**23; |y| <= 255 here)
            if OUT_MODE == OUT_INT8:
                tl.store(out_ptrs, (y.to(tl.int32) - OUT_OFF).to(tl.int8), mask=mask)
            else:
                tl.store(out8_ptr + offs_out, (y.to(tl.int32) - OUT_OFF).to(tl.int8), mask=mask)
