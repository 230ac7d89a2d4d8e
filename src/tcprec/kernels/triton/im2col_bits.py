"""Triton kernel: im2col over bit planes (word gather), with the GEMM's row correction fused.

What it computes, for input planes ``x`` int32 ``(BITS, N*H*W, Kw_in)`` (``tcprec.packing``
layout, one row per NHWC pixel, C codes a row) and a convolution geometry::

    for b < BITS, m = (n, p, q) < M = N*P*Q, j < Kw_col:
        t, c = divmod(j, Cw);  r, s = divmod(t, S)                  Cw = ceil(C / 32) words a pixel
        h, w = p*sh - ph + r*dh,  q*sw - pw + s*dw
        out[b, m, j] = x[b, (n*H + h)*W + w, c]   if j < R*S*Cw and (h, w) inside the image
                       0                          otherwise (spatial padding, and the tail to 16 words)

    row_term[m] = row_mul * sum_b wt_b * popc(out[b, m, :]) + row_add           (optional, ROWSUM)

``wt_b = 2^b`` (``-2^(BITS-1)`` for the top plane of two's complement codes), so the popcount sum
is the sum of the activation values over the receptive field: the bit-serial GEMM's pm1
correction (``kernels/reference_gemm.py``) with ``row_mul = step_a * offset_w`` and
``row_add = K * offset_a * offset_w`` for the true ``K = R*S*C``.  Zero words (padding, the gaps
after each tap's ``C`` bits) add nothing to AND+popc or to the row sums, so the GEMM of these rows
against weight planes of the same per-tap layout is the convolution.

How: one program owns BLOCK_M output rows and walks their words in BLOCK_W chunks; every chunk is
one masked gather per plane (contiguous runs of Cw words per tap) and one store; the SWAR popcount
of the gathered words accumulates in registers.  BITS and the flags are constexpr, so one source
serves every width 1..8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv

__all__ = ["im2col_bits"]

@triton.jit
def _popc32(v):
    """Set bits of each int32 word (SWAR, Hacker's Delight 5-2); the masks make arithmetic shifts safe."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24) & 0xFF


@triton.jit
def _window_origins(M, P, Q, stride_h, stride_w, pad_h, pad_w, BLOCK_M: tl.constexpr):
    """This program's BLOCK_M output rows m = (n, p, q): (m, m < M, n, top-left input row h0 and column w0)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_i = offs_m % Q
    t_i = offs_m // Q
    p_i = t_i % P
    return offs_m, offs_m < M, t_i // P, p_i * stride_h - pad_h, q_i * stride_w - pad_w


@triton.jit
def _im2col_bits_kernel(
    # pointers
    x_ptr, out_ptr, row_ptr,
    # sizes
    M, H, W, P, Q, S, Cw, RSCw, Kw_col,
    # geometry
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    # strides (in words)
    stride_xb, stride_xr, stride_ob, stride_or,
    # row correction: row_term = row_mul * (weighted popcount) + row_add
    row_mul, row_add,
    # meta
    BITS: tl.constexpr, TWOS: tl.constexpr, ROWSUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    offs_m, m_ok, n_i, h0, w0 = _window_origins(M, P, Q, stride_h, stride_w, pad_h, pad_w, BLOCK_M)
    acc = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for j0 in range(0, Kw_col, BLOCK_W):
        # -- words j -> (tap r, s; word c of the pixel) ---------------------------------------------
        offs_j = j0 + tl.arange(0, BLOCK_W)  # (BLOCK_W,)
        tap = offs_j // Cw
        c = offs_j - tap * Cw
        r = tap // S
        s = tap - r * S
        h = h0[:, None] + (r * dil_h)[None, :]  # (BLOCK_M, BLOCK_W)
        w = w0[:, None] + (s * dil_w)[None, :]
        inside = (h >= 0) & (h < H) & (w >= 0) & (w < W)
        valid = m_ok[:, None] & (offs_j < RSCw)[None, :] & inside
        src = ((n_i[:, None] * H + h) * W + w) * stride_xr + c[None, :]  # (BLOCK_M, BLOCK_W) word offsets
        dst = offs_m[:, None] * stride_or + offs_j[None, :]
        keep = m_ok[:, None] & (offs_j < Kw_col)[None, :]
        for b in tl.static_range(BITS):
            v = tl.load(x_ptr + b * stride_xb + src, mask=valid, other=0)  # (BLOCK_M, BLOCK_W) int32
            tl.store(out_ptr + b * stride_ob + dst, v, mask=keep)
            if ROWSUM:
                pc = tl.sum(_popc32(v), axis=1)  # (BLOCK_M,) set bits of plane b
                if TWOS and b == BITS - 1:
                    acc -= pc << b
                else:
                    acc += pc << b

    if ROWSUM:
        tl.store(row_ptr + offs_m, acc * row_mul + row_add, mask=m_ok)


def im2col_bits(planes: torch.Tensor, geom, *, twos: bool = False, rowsum: bool = False,
                row_mul: int = 1, row_add: int = 0, block_m: int | None = None, block_w: int = 32,
                num_warps: int = 4):
    """Launch: planes int32 ``(bits, N*H*W, Kw_in)`` and a ``ConvGeometry`` -> ``(cols, row_term)``:
    cols int32 ``(bits, N*P*Q, Kw_col)``, row_term int32 ``(N*P*Q,)`` (None
    unless ``rowsum``).  ``tcprec.ops.qconv`` validates; this only allocates and launches."""
    bits = planes.shape[0]
    Cw = -(-geom.C // 32)
    rscw = geom.R * geom.S * Cw
    kw_col = -(-rscw // 16) * 16
    M = geom.N * geom.P * geom.Q
    dev = planes.device
    cols = torch.empty((bits, M, kw_col), dtype=torch.int32, device=dev)
    row = torch.empty((M,), dtype=torch.int32, device=dev) if rowsum else None
    if M == 0:
        return cols, row
    if block_m is None:  # Triton's CPU interpreter pays per program: few, large ones there
        block_m = 32 if planes.is_cuda else 256
    dummy = planes  # never written without ROWSUM
    grid = (cdiv(M, block_m),)
    _im2col_bits_kernel[grid](
        planes, cols, row if rowsum else dummy,
        M, geom.H, geom.W, geom.P, geom.Q, geom.S, Cw, rscw, kw_col,
        geom.stride[0], geom.stride[1], geom.padding[0], geom.padding[1], geom.dilation[0], geom.dilation[1],
        planes.stride(0), planes.stride(1),
        cols.stride(0), cols.stride(1),
        int(row_mul), int(row_add),
        BITS=bits, TWOS=bool(twos), ROWSUM=bool(rowsum),
        BLOCK_M=block_m, BLOCK_W=block_w, num_warps=num_warps,
    )
    return cols, row
