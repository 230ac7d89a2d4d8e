"""Triton kernel: pack integer codes into bit planes (layout: ``tcprec.packing``).

What it computes, for codes ``(R, K)`` and ``BITS`` planes::

    for b < BITS, r < R, w < Kw:
        planes[b, r, w] = sum_{j < 32} ((codes[r, 32*w + j] >> b) & 1) << j     (0 past K)

How: each program owns a tile of BLOCK_R rows x BLOCK_W words, i.e. a (BLOCK_R, BLOCK_W, 32) tile
of codes, lane axis last.  It loads the tile once (zeros past K: that is the padding), and for each
plane extracts bit b, shifts it to its lane position and sums over the lane axis.  The 32 terms
have disjoint bits, so the int32 sum is exact (lane 31 contributes -2**31, the sign bit).  BITS is a
constexpr, so one source serves every width 1..8 and the plane loop unrolls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...packing import packed_words

__all__ = ["pack_bitplanes"]


@triton.jit
def _pack_bitplanes_kernel(
    # pointers
    codes_ptr, planes_ptr,
    # sizes
    R, K, Kw,
    # strides (in elements)
    stride_cr, stride_ck,
    stride_pb, stride_pr, stride_pw,
    # meta
    BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)

    # -- offsets: rows (BLOCK_R,), words (BLOCK_W,), lanes (32,) --------------------------------
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    lanes = tl.arange(0, 32)
    offs_k = offs_w[:, None] * 32 + lanes[None, :]  # (BLOCK_W, 32): element index of each bit

    # -- load the code tile (BLOCK_R, BLOCK_W, 32); past K reads 0 = the zero padding -------------
    r3 = offs_r[:, None, None]
    k3 = offs_k[None, :, :]
    mask = (r3 < R) & (k3 < K)
    codes = tl.load(codes_ptr + r3 * stride_cr + k3 * stride_ck, mask=mask, other=0).to(tl.int32)

    # -- one plane at a time: bit b of each code, moved to its lane, summed into words -----------
    lane_shift = lanes[None, None, :]
    out_mask = (offs_r[:, None] < R) & (offs_w[None, :] < Kw)
    out_ptrs = planes_ptr + offs_r[:, None] * stride_pr + offs_w[None, :] * stride_pw
    for b in tl.static_range(BITS):
        bit = (codes >> b) & 1  # (BLOCK_R, BLOCK_W, 32) in {0, 1}
        words = tl.sum(bit << lane_shift, axis=2)  # (BLOCK_R, BLOCK_W) int32, disjoint bits: exact
        tl.store(out_ptrs + b * stride_pb, words.to(tl.int32), mask=out_mask)


def pack_bitplanes(codes: torch.Tensor, bits: int, *, block_r: int = 16, block_w: int = 16) -> torch.Tensor:
    """Launch: codes (R, K) of an integer dtype, values < 2**bits (checked by the caller)
    -> planes int32 (bits, R, Kw).  ``tcprec.packing.pack_bitplanes`` is the public entry point."""
    assert codes.dim() == 2, "pass a (R, K) view; tcprec.packing.pack_bitplanes reshapes for you"
    R, K = codes.shape
    Kw = packed_words(K)
    planes = torch.empty((bits, R, Kw), dtype=torch.int32, device=codes.device)  # (bits, R, Kw)
    if planes.numel() == 0:
        return planes
    grid = (triton.cdiv(R, block_r), triton.cdiv(Kw, block_w))
    _pack_bitplanes_kernel[grid](
        codes, planes,
        R, K, Kw,
        codes.stride(0), codes.stride(1),
        planes.stride(0), planes.stride(1), planes.stride(2),
        BITS=bits, BLOCK_R=block_r, BLOCK_W=block_w,
    )
    return planes
