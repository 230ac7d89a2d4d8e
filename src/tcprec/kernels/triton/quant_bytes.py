"""Triton kernels: float activations -> the INT8 conv's one-byte operand, and the thin-stem gather.

``pool_quantize_int8``: y ``(N, P, Q, K)`` float (any strides) -> optional 2x2 max-pool (stride 2, or 1
with the window clipped at the bottom / right edge: darknet's size-keeping pool) -> integer code of the
format -> the stored int8 ``x8`` with ``value = off + step * x8`` (``tcprec.ops.qconv._int8_codes``'s rule:
two's complement and unsigned <= 7 bits as the value, uint8 as ``code - 128``, pm as ``(value - off) / step``)
-> ``(N, P', Q', K)`` int8 contiguous.  One read of y, one byte written per element; the codes are those
of ``tcprec.ops.quantize.quantize_static`` (IEEE ``x / scale``, round half to even, saturating; NaN -> the
code of 0), computed by the same ``_quantize_codes`` as the bit-plane packer.

``im2col_rows``: the thin-stem operand (an im2col on bytes) (``ops/qconv.py``): x8 ``(N, H, W, C)`` one-byte codes -> rows
``(N, P, Q, KP)``, row (n, p, q) = the window of output pixel (n, p, q) in (r, s, c) order, stored 0 in
the padding and past R*S*C.  One pass (the torch version padded, gathered with advanced indexing and
copied into a zeroed buffer: four passes and an index tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from .pack import _pooled_tile, _quantize_codes, pooled_output

__all__ = ["pool_quantize_int8", "im2col_rows", "ENC_UNSIGNED", "ENC_TWOS", "ENC_PM"]

ENC_UNSIGNED, ENC_TWOS, ENC_PM = 0, 1, 2
_TILE = 4096  # elements per program
FLAT_BELOW_C = 16  # an unpooled contiguous activation with fewer channels is quantized as flat 128-element rows


def flat_rows(y: torch.Tensor, pool_stride: int) -> torch.Tensor | None:
    """An elementwise pass (no pool) over a contiguous NHWC ``y`` with fewer than FLAT_BELOW_C channels, as rows of
    the widest power of two <= 128 elements that divides y's size, (1, 1, rows, width): the pass is the same
    on any layout of the same memory, and wide rows load whole 16-byte vectors.  A network's 3-channel input tiled
    by channels (1024 pixels x 4 lanes, 3 of them used) read at ~0.4 TB/s: 152 us for 256 x 224 x 224 x 3 fp16 on
    the H200.  None where that does not apply."""
    if pool_stride != 0 or not 1 < y.shape[3] < FLAT_BELOW_C or not y.is_contiguous():
        return None
    n = y.numel()
    width = next(w for w in (128, 64, 32, 16, 8, 4, 2, 1) if n % w == 0)
    if width == y.shape[3]:  # already rows of that width (so also: never twice)
        return None
    return y.view(1, 1, n // width, width)


@triton.jit
def _code_to_x8(c, ENC: tl.constexpr, BITS: tl.constexpr):
    """int32 code pattern -> the stored int8 value (``_int8_codes``)."""
    if ENC == 1:  # two's complement: sign-extend the BITS-bit pattern
        v = c - ((c >> (BITS - 1)) << BITS)
    elif ENC == 0:
        if BITS == 8:
            v = c - 128
        else:
            v = c
    else:  # pm: value = 2c - (2^BITS - 1); 8 bits: stored c - 128 (value = 1 + 2 * x8)
        if BITS == 8:
            v = c - 128
        else:
            v = 2 * c - ((1 << BITS) - 1)
    return v.to(tl.int8)


@triton.jit(do_not_specialize=["R", "P", "Q", "PO", "QO"])
def _pool_quantize_int8_kernel(
    x_ptr, scale_ptr, out_ptr,
    R, K, P, Q, PO, QO,  # R = N * PO * QO output rows
    stride_xn, stride_xh, stride_xw, stride_xk,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, ENC: tl.constexpr,
    BITS: tl.constexpr, POOL_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    v, mask, offs_out = _pooled_tile(x_ptr, R, K, P, Q, PO, QO, stride_xn, stride_xh, stride_xw, stride_xk, POOL_S,
                                     False, BLOCK_R, BLOCK_K)
    c = _quantize_codes(v, tl.load(scale_ptr), LO, HI, OFFSET, SHIFT, BITS)
    tl.store(out_ptr + offs_out, _code_to_x8(c, ENC, BITS), mask=mask)


# The geometry is compile-time (a network has one or two thin stems): the (r, s, c) decomposition of the column
# index is per column and the window's address splits into a per-row base (int64) plus a per-column offset, so
# the 2-D tile costs two adds, the bounds test and the byte copy an element.  Measured on an H200 at batch 256
# (same process): ResNet-18's stem 487 -> 196 us, VGG's 633 -> 141 us,
# AlexNet's 935 -> 444 us (runtime geometry with int64 address arithmetic a element before).
@triton.jit(do_not_specialize=["M", "H", "W", "P", "Q"])
def _im2col_rows_kernel(
    x_ptr, out_ptr,
    M, H, W, P, Q, KP,
    C: tl.constexpr, R: tl.constexpr, S: tl.constexpr, STR_H: tl.constexpr, STR_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    q = offs_m % Q
    t = offs_m // Q
    p = t % P
    n = t // P
    ih0 = p * STR_H - PAD_H
    iw0 = q * STR_W - PAD_W
    base = (n.to(tl.int64) * H + ih0) * (W * C) + iw0 * C  # (BLOCK_M,): the window's top-left, may be < 0 (masked)
    c = tt % C
    rs = tt // C
    s = rs % S
    r = rs // S
    dh = r * DIL_H
    dw = s * DIL_W
    col = dh * (W * C) + dw * C + c  # (BLOCK_T,): the tap's offset from the top-left
    ih = ih0[:, None] + dh[None, :]
    iw = iw0[:, None] + dw[None, :]
    m_ok = offs_m < M
    ok = m_ok[:, None] & (tt < R * S * C)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    v = tl.load(x_ptr + base[:, None] + col[None, :], mask=ok, other=0)
    out = out_ptr + (offs_m.to(tl.int64) * KP)[:, None] + tt[None, :]
    tl.store(out, v, mask=m_ok[:, None] & (tt < KP)[None, :])


def pool_quantize_int8(y: torch.Tensor, scale: torch.Tensor, pool_stride: int, bits: int, lo: int, hi: int,
                       offset: int, shift: int, enc: int) -> torch.Tensor:
    """Launch: y (N, P, Q, K) float, pool_stride 0 (no pool), 1 or 2 -> x8 (N, P', Q', K) int8.  The public
    entry point is ``tcprec.ops.qconv.quantize_int8_static`` (it derives the format's parameters)."""
    assert y.dim() == 4 and pool_stride in (0, 1, 2)
    flat = flat_rows(y, pool_stride)
    if flat is not None:
        return pool_quantize_int8(flat, scale, 0, bits, lo, hi, offset, shift, enc).view(y.shape)
    out, R, (PO, QO), grid, (br, bk) = pooled_output(y, pool_stride, torch.int8, _TILE)
    if out.numel() == 0:
        return out
    _pool_quantize_int8_kernel[grid](
        y, scale, out, R, y.shape[3], y.shape[1], y.shape[2], PO, QO, *y.stride(),
        LO=lo, HI=hi, OFFSET=offset, SHIFT=shift, ENC=enc, BITS=bits, POOL_S=pool_stride,
        BLOCK_R=br, BLOCK_K=bk,
    )
    return out


def im2col_rows(x8: torch.Tensor, R: int, S: int, stride, padding, dilation, P: int, Q: int, kp: int) -> torch.Tensor:
    """Launch: x8 (N, H, W, C) contiguous, any one-byte dtype -> (N, P, Q, kp) of the same dtype (see the
    module docstring); the caller checks kp >= R*S*C and the geometry."""
    N, H, W, C = x8.shape
    b = x8.view(torch.uint8)
    out = torch.empty((N, P, Q, kp), dtype=torch.uint8, device=x8.device)
    M = N * P * Q
    if M == 0:
        return out.view(x8.dtype)
    # a whole row a program up to 256 bytes (ResNet-18: 192), else 64-byte column blocks; 8192 bytes a program
    bt = next_power_of_2(kp) if kp <= 256 else 64
    bm = max(1, 2 * _TILE // bt)
    _im2col_rows_kernel[(cdiv(M, bm), cdiv(kp, bt))](
        b, out, M, H, W, P, Q, kp,
        C=C, R=R, S=S, STR_H=stride[0], STR_W=stride[1], PAD_H=padding[0], PAD_W=padding[1],
        DIL_H=dilation[0], DIL_W=dilation[1], BLOCK_M=bm, BLOCK_T=bt, num_warps=4,
    )
    return out.view(x8.dtype)
