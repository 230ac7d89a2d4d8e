"""Triton kernel: pack integer codes into bit planes (layout: ``tcprec.packing``).

What it computes, for codes ``(R, K)`` and ``BITS`` planes::

    for b < BITS, r < R, w < Kw:
        planes[b, r, w] = sum_{j < 32} ((codes[r, 32*w + j] >> b) & 1) << j     (0 past K)

How: each program owns a tile of BLOCK_R rows x BLOCK_W words (``pack_tile``: about 4096 codes), i.e. a
(BLOCK_R, BLOCK_W, 32) tile of codes, lane axis last.  It loads the tile once (zeros past K: that is the padding), and for each
plane extracts bit b, shifts it to its lane position and sums over the lane axis.  The 32 terms
have disjoint bits, so the int32 sum is exact (lane 31 contributes -2**31, the sign bit).  BITS is a
constexpr, so one source serves every width 1..8 and the plane loop unrolls.

``quantize_pack`` fuses the activation quantizer in front of the same packing: float ``x`` -> code
``c = encode(clamp(rne(x / scale), lo, hi))`` -> planes, one read of x and one write of the planes,
no host synchronisation (so it runs inside CUDA-graph capture).  ``x / scale`` is the IEEE quotient wherever a
code can tell (``round.div_for_codes``) and rne is round-half-even, as ``tcprec.quantize`` computes them, so the
codes are the same.  NaN has no integer code: it becomes the code of 0 (what the hardware's cvt.rni.s32.f32 does),
documented at ``tcprec.ops.quantize.quantize_pack``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference_bitplanes import packed_words
from ._host import cdiv, next_power_of_2
from .round import div_for_codes

__all__ = ["pack_bitplanes", "quantize_pack", "pool_quantize_pack", "pool_planes", "pool_cast", "pack_tile"]

PAD_W = tl.constexpr(16)  # padding words a row may have past its last tile (< 16: packed_words pads to 16)


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
    _store_planes(codes, planes_ptr, offs_r, offs_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS)
    _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS, BLOCK_W)


@triton.jit
def _store_planes(codes, planes_ptr, offs_r, offs_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS: tl.constexpr):
    """codes (BLOCK_R, BLOCK_W, 32) int32 -> BITS plane tiles: bit b of each code, moved to its lane,
    summed into words."""
    lane_shift = tl.arange(0, 32)[None, None, :]
    out_mask = (offs_r[:, None] < R) & (offs_w[None, :] < Kw)
    out_ptrs = planes_ptr + offs_r[:, None] * stride_pr + offs_w[None, :] * stride_pw
    for b in tl.static_range(BITS):
        bit = (codes >> b) & 1  # (BLOCK_R, BLOCK_W, 32) in {0, 1}
        words = tl.sum(bit << lane_shift, axis=2)  # (BLOCK_R, BLOCK_W) int32, disjoint bits: exact
        tl.store(out_ptrs + b * stride_pb, words.to(tl.int32), mask=out_mask)


@triton.jit
def _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """The last word-program of a row block also stores the zero words past its tile up to Kw (a row is padded
    to 512 bits: packed_words), so no program exists only to write padding."""
    if pid_w == tl.num_programs(1) - 1:
        offs_w = (pid_w + 1) * BLOCK_W + tl.arange(0, PAD_W)
        out_mask = (offs_r[:, None] < R) & (offs_w[None, :] < Kw)
        out_ptrs = planes_ptr + offs_r[:, None] * stride_pr + offs_w[None, :] * stride_pw
        zero = tl.zeros((offs_r.shape[0], PAD_W), tl.int32)
        for b in tl.static_range(BITS):
            tl.store(out_ptrs + b * stride_pb, zero, mask=out_mask)


@triton.jit
def _quantize_pack_kernel(
    # pointers
    x_ptr, scale_ptr, planes_ptr,
    # sizes
    R, K, Kw,
    # strides (in elements)
    stride_xr, stride_xk,
    stride_pb, stride_pr, stride_pw,
    # format: values LO..HI; SHIFT 0: code = value & mask (unsigned / twos pattern), OFFSET 0;
    #         SHIFT 1 (pm): value = 2 * code + OFFSET
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr,
    # meta
    BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = offs_w[:, None] * 32 + tl.arange(0, 32)[None, :]  # (BLOCK_W, 32)
    r3 = offs_r[:, None, None]
    k3 = offs_k[None, :, :]
    mask = (r3 < R) & (k3 < K)
    x = tl.load(x_ptr + r3 * stride_xr + k3 * stride_xk, mask=mask, other=0.0).to(tl.float32)
    c = _quantize_codes(x, tl.load(scale_ptr), LO, HI, OFFSET, SHIFT, BITS)
    codes = tl.where(mask, c, 0)  # the padding stays zero
    _store_planes(codes, planes_ptr, offs_r, offs_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS)
    _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS, BLOCK_W)


@triton.jit
def _pool_quantize_pack_kernel(
    x_ptr, scale_ptr, planes_ptr,
    # sizes: R = N * PO * QO pooled rows, x (N, P, Q, K)
    R, K, Kw, P, Q, PO, QO,
    stride_xn, stride_xh, stride_xw, stride_xk,
    stride_pb, stride_pr, stride_pw,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr,
    POOL_S: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """2x2 max-pool (stride POOL_S: 2, or 1 with the window clipped at the right / bottom edge, darknet's
    size-keeping pool) in front of the same quantize + pack: pooled row r = (n, po, qo)."""
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = offs_w[:, None] * 32 + tl.arange(0, 32)[None, :]  # (BLOCK_W, 32)
    n, po, qo = _pooled_rows(offs_r, PO, QO)
    r3 = offs_r[:, None, None]
    k3 = offs_k[None, :, :]
    mask = (r3 < R) & (k3 < K)
    m = _max_pool_2x2(x_ptr, n[:, None, None], po[:, None, None], qo[:, None, None], k3 * stride_xk, mask, P, Q,
                      stride_xn, stride_xh, stride_xw, POOL_S, tl.full((BLOCK_R, BLOCK_W, 32), float("-inf"),
                                                                       tl.float32), False)
    c = _quantize_codes(m, tl.load(scale_ptr), LO, HI, OFFSET, SHIFT, BITS)
    codes = tl.where(mask, c, 0)
    _store_planes(codes, planes_ptr, offs_r, offs_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS)
    _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS, BLOCK_W)


@triton.jit
def _window_words(src_ptr, n, h, w, offs_r, offs_w, R, Kw, P, Q, stride_sr):
    """Pointers to plane 0's words of input pixel (n, h, w) for each pooled row, whether the pixel exists (a
    clipped window at the edge has fewer), and the load mask over (rows, words)."""
    ok = (offs_r < R) & (h < P) & (w < Q)
    src = src_ptr + ((n * P + h) * Q + w)[:, None] * stride_sr + offs_w[None, :]
    return src, ok, ok[:, None] & (offs_w[None, :] < Kw)


@triton.jit
def _pool_planes_kernel(
    src_ptr, dst_ptr,
    # sizes: R = N * PO * QO pooled rows of Kw words (KR of them holding channels), the source (BITS, N * P * Q, Kw)
    R, Kw, KR, P, Q, PO, QO,
    stride_sb, stride_sr, stride_db, stride_dr,
    POOL_S: tl.constexpr, TWOS: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """2x2 max-pool of packed codes (stride POOL_S, window clipped at the edge as in _pool_quantize_pack_kernel),
    in the order of the values (two's complement patterns compared with the sign bit flipped).  1- and 2-bit
    codes (the binary networks' activations) are compared bit-sliced, 32 at a time: max(hi, lo) of two is
    hi = hi1 | hi2, lo = lo1 & (hi1 | ~hi2) | lo2 & (hi2 | ~hi1).  Wider codes are unpacked to one code a lane,
    compared, and packed again.  Padding words (past KR) are zero codes in every pixel, so they pool to zero: they are
    not read (half the bytes of a 256-channel row), only stored."""
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    n, po, qo = _pooled_rows(offs_r, PO, QO)
    top = -1 if TWOS else 0  # xor with the top plane: two's complement's sign bit flipped (value order)
    out_mask = (offs_r[:, None] < R) & (offs_w[None, :] < Kw)
    dst = dst_ptr + offs_r[:, None] * stride_dr + offs_w[None, :]
    if BITS <= 2:
        hi = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)  # the top plane (the only one at BITS = 1)
        lo = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
        for i in tl.static_range(2):
            for j in tl.static_range(2):
                src, ok, m2 = _window_words(src_ptr, n, po * POOL_S + i, qo * POOL_S + j, offs_r, offs_w, R, KR, P, Q,
                                            stride_sr)
                h2 = tl.load(src + (BITS - 1) * stride_sb, mask=m2, other=0) ^ top
                l2 = tl.load(src, mask=m2, other=0) if BITS == 2 else h2
                if i + j == 0:  # pixel (0, 0) is inside every window
                    hi, lo = h2, l2
                else:  # a clipped pixel (stride 1, at the edge) takes part as a copy of the window's first
                    h2 = tl.where(m2, h2, hi)
                    l2 = tl.where(m2, l2, lo)
                    lo = (lo & (hi | ~h2)) | (l2 & (h2 | ~hi))
                    hi = hi | h2
        tl.store(dst + (BITS - 1) * stride_db, hi ^ top, mask=out_mask)
        if BITS == 2:
            tl.store(dst, lo, mask=out_mask)
    else:
        lanes = tl.arange(0, 32)[None, None, :]
        flip = (1 << (BITS - 1)) if TWOS else 0
        best = tl.full((BLOCK_R, BLOCK_W, 32), -1, tl.int32)
        for i in tl.static_range(2):
            for j in tl.static_range(2):
                src, ok, m2 = _window_words(src_ptr, n, po * POOL_S + i, qo * POOL_S + j, offs_r, offs_w, R, KR, P, Q,
                                            stride_sr)
                code = tl.zeros((BLOCK_R, BLOCK_W, 32), tl.int32)
                for b in tl.static_range(BITS):
                    word = tl.load(src + b * stride_sb, mask=m2, other=0)
                    code = code | (((word[:, :, None] >> lanes) & 1) << b)
                idx = tl.where(ok[:, None, None], code ^ flip, -1)
                best = tl.maximum(best, idx)
        _store_planes(best ^ flip, dst_ptr, offs_r, offs_w, R, Kw, stride_db, stride_dr, 1, BITS)


@triton.jit
def _pooled_rows(offs_r, PO, QO):
    """Pooled NHWC row index r -> (image n as int64, row po, column qo) of a (N, PO, QO) output."""
    qo = offs_r % QO
    t = offs_r // QO
    return (t // PO).to(tl.int64), t % PO, qo


@triton.jit
def _max_pool_2x2(x_ptr, n, po, qo, koff, mask, P, Q, stride_xn, stride_xh, stride_xw, POOL_S: tl.constexpr, init,
                  NAN_MAX: tl.constexpr):
    """max(init, the 2x2 window at input (po * POOL_S, qo * POOL_S) of image n), float32; n, po, qo arrive
    broadcastable against the channel offsets ``koff`` (any tile rank), window pixels past P / Q skipped (darknet's
    clipped size-keeping pool at POOL_S = 1).  ``NAN_MAX``: torch's max-pool rule instead of ``tl.maximum``, pixel by
    pixel in row-major order ``m = v if v > m or v is NaN`` (NaN propagates; of -0 and +0 the first stays)."""
    m = init
    for i in tl.static_range(2):
        for j in tl.static_range(2):
            h = po * POOL_S + i
            w = qo * POOL_S + j
            ok = mask & (h < P) & (w < Q)
            v = tl.load(x_ptr + n * stride_xn + h * stride_xh + w * stride_xw + koff, mask=ok, other=float("-inf"))
            v = v.to(tl.float32)
            if NAN_MAX:
                m = tl.where((v > m) | (v != v), v, m)
            else:
                m = tl.maximum(m, v)
    return m


@triton.jit
def _pooled_tile(x_ptr, R, K, P, Q, PO, QO, stride_xn, stride_xh, stride_xw, stride_xk, POOL_S: tl.constexpr,
                 NAN_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (BLOCK_R pooled pixels x BLOCK_K channels) tile of y (N, P, Q, K) (any strides) after the
    optional 2x2 max-pool (POOL_S 0: none), float32, with its mask and its offsets in a contiguous (N, PO, QO, K)
    output (int64): the front end of the pool + quantize passes (quant_bytes, fp8_quant)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n, po, qo = _pooled_rows(offs_r, PO, QO)
    mask = (offs_r < R)[:, None] & (offs_k < K)[None, :]
    kk = offs_k[None, :] * stride_xk
    if POOL_S == 0:
        base = n * stride_xn + po * stride_xh + qo * stride_xw
        v = tl.load(x_ptr + base[:, None] + kk, mask=mask, other=0.0).to(tl.float32)
    else:
        v = _max_pool_2x2(x_ptr, n[:, None], po[:, None], qo[:, None], kk, mask, P, Q, stride_xn, stride_xh,
                          stride_xw, POOL_S, tl.full((BLOCK_R, BLOCK_K), float("-inf"), tl.float32), NAN_MAX)
    return v, mask, offs_r.to(tl.int64)[:, None] * K + offs_k[None, :]


@triton.jit
def _quantize_codes(x, scale, LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr,
                    BITS: tl.constexpr):
    """float32 x -> int32 code patterns: v = clamp(rne(x / scale)) as an integer value, NaN -> 0."""
    v = div_for_codes(x, scale)  # the IEEE quotient wherever a code can tell
    v = tl.where(v == v, v, 0.0)  # NaN -> 0
    v = tl.minimum(tl.maximum(v, LO * 1.0), HI * 1.0)  # saturate; |v| <= 255 from here
    if SHIFT == 1:
        # pm codes: value = 2c + OFFSET, c = rne((v - OFFSET) / 2) computed exactly on the integer part
        # t = floor(v) and the fraction f = v - t: with n = t - OFFSET, (n + f) / 2 rounds to n // 2,
        # plus one when n is odd and (f > 0, or f == 0 and n // 2 is odd: the tie goes to even)
        t = tl.floor(v)
        f = v - t
        n = t.to(tl.int32) - OFFSET
        half = n >> 1
        up = (n & 1) & ((f > 0).to(tl.int32) | (half & 1))
        c = half + up
    else:
        # round half to even by the 1.5 * 2**23 trick: for |v| < 2**22, t = v + 1.5 * 2**23 lies in [2**23, 2**24),
        # whose ulp is 1, so t is 1.5 * 2**23 + rne(v) and its bit pattern 0x4B400000 + rne(v): the integer without a
        # float -> int conversion (those run on the SM's 16-lane conversion pipe)
        t = v + 12582912.0
        # unsigned: the value; twos: the bit pattern
        c = (t.to(tl.int32, bitcast=True) - (0x4B400000 + OFFSET)) & ((1 << BITS) - 1)
    return c


# Tile: TILE_CODES codes per program, BLOCK_W words wide (at most MAX_BLOCK_W, never wider than the row's
# ceil(K / 32) real words).  A row of planes is padded to 512 bits (packed_words: 16 words for K = 64); a
# program whose words all lie in that padding stores zeros without reading or quantizing anything.  The
# first version quantized and summed all 16 words of a 64-channel row (14 of them padding): compute-bound
# (ncu: SM 83%, DRAM 4.5%), 0.89 ms for ResNet-18's 256x56x56x64 activations, 18x a copy of the bytes.
TILE_CODES = 4096
POOL_PROGRAMS = 512  # pool_planes: the programs to aim for on a small map (a few per SM) ...
POOL_MIN_ROWS = 16  # ... with row blocks no smaller than this
MAX_BLOCK_W = 8
# pool_planes' bit-sliced programs: words a program.  4096 (512 rows of a 256-channel compact row) held 4 pixels x 2
# planes x 32 words a thread and ran VGG's 256 x 56 x 56 x 256 pool in 109 us; 512 words: 18 us (H200;
# 16-64 rows of 8 words 17-18 us, of 16 words 32-35 us)
POOL_SLICED_WORDS = 512


def pooled_output(y: torch.Tensor, pool_stride: int, dtype: torch.dtype, tile: int):
    """The host half of :func:`_pooled_tile`: for NHWC ``y`` and ``pool_stride`` 0 (no pool), 1 (2x2 size-keeping) or
    2 (2x2 stride 2, floor), the (N, P', Q', K) output of ``dtype`` to fill, its rows R = N*P'*Q', (P', Q'), and the
    grid and block (BLOCK_R, BLOCK_K) of programs of about ``tile`` elements."""
    N, P, Q, K = y.shape
    PO, QO = (P // 2, Q // 2) if pool_stride == 2 else (P, Q)
    out = torch.empty((N, PO, QO, K), dtype=dtype, device=y.device)
    R = N * PO * QO
    bk = min(next_power_of_2(K), 128)
    br = max(1, tile // bk)
    return out, R, (PO, QO), (cdiv(R, br), cdiv(K, bk)), (br, bk)


_POOL_CAST_TILE = 4096  # elements a program


@triton.jit(do_not_specialize=["R", "P", "Q", "PO", "QO"])
def _pool_cast_kernel(x_ptr, out_ptr, R, K, P, Q, PO, QO, stride_xn, stride_xh, stride_xw, stride_xk,
                      POOL_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """2x2 max-pool of a float NHWC tile (torch's rule: NaN propagates, of +-0 the first stays), stored in its own
    dtype."""
    v, mask, offs_out = _pooled_tile(x_ptr, R, K, P, Q, PO, QO, stride_xn, stride_xh, stride_xw, stride_xk, POOL_S,
                                     True, BLOCK_R, BLOCK_K)
    tl.store(out_ptr + offs_out, v.to(out_ptr.dtype.element_ty), mask=mask)  # exact: y's own dtype


def pool_cast(y: torch.Tensor, pool_stride: int) -> torch.Tensor:
    """Launch: y (N, P, Q, K) float16 / bfloat16 / float32 (any strides), 2x2 max-pool with stride ``pool_stride``
    (2: floor, as nn.MaxPool2d; 1: darknet's size-keeping pool, the window clipped at the edge) -> (N, P', Q', K)
    contiguous, y's dtype (no rounding: every output is one of the inputs).  One read of y.  Rounding is monotone,
    so max-pooling values already rounded to a dtype gives the rounding of the float32 max-pool, bit for bit: a
    conv's epilogue writes its final dtype at full size and this pools it (``ops.qconv``), instead of a float32
    tensor, torch's max-pool on it and a cast (20 us for an 8 x 14 x 14 x 512 float32 tensor on the H200)."""
    if not isinstance(y, torch.Tensor) or y.dim() != 4 or y.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        got = f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"y must be a float16 / bfloat16 / float32 NHWC tensor (N, P, Q, K), got {got}")
    if pool_stride not in (1, 2):
        raise ValueError(f"pool_stride must be 1 (2x2 size-keeping) or 2 (2x2 stride 2), got {pool_stride!r}")
    out, R, (PO, QO), grid, (br, bk) = pooled_output(y, pool_stride, y.dtype, _POOL_CAST_TILE)
    if out.numel() == 0:
        return out
    _pool_cast_kernel[grid](y, out, R, y.shape[3], y.shape[1], y.shape[2], PO, QO, *y.stride(), POOL_S=pool_stride,
                            BLOCK_R=br, BLOCK_K=bk)
    return out


def pack_tile(Kw: int, block_r: int | None = None, block_w: int | None = None) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of Kw real words (ceil(K / 32)): BLOCK_W = min(next_pow2(Kw), MAX_BLOCK_W),
    BLOCK_R filling TILE_CODES codes; either can be forced."""
    bw = block_w or min(next_power_of_2(max(Kw, 1)), MAX_BLOCK_W)
    br = block_r or max(1, TILE_CODES // (32 * bw))
    return br, bw


def _planes_and_grid(R: int, K: int, bits: int, device, block_r: int | None, block_w: int | None,
                     compact: bool = False):
    """The output planes int32 (bits, R, Kw), the tile (BLOCK_R, BLOCK_W) and the launch grid (over the
    ceil(K / 32) real words; each row block's last program also zeroes the padding words).  ``compact``:
    Kw = ceil(K / 32), no padding words (for planes only an im2col reads)."""
    Kw = cdiv(K, 32) if compact else packed_words(K)
    planes = torch.empty((bits, R, Kw), dtype=torch.int32, device=device)  # (bits, R, Kw)
    br, bw = pack_tile(cdiv(K, 32), block_r, block_w)
    return planes, br, bw, (cdiv(R, br), cdiv(cdiv(K, 32), bw))


def pack_bitplanes(codes: torch.Tensor, bits: int, *, block_r: int | None = None,
                   block_w: int | None = None) -> torch.Tensor:
    """Launch: codes (R, K) of an integer dtype, values < 2**bits (checked by the caller)
    -> planes int32 (bits, R, Kw).  ``tcprec.packing.pack_bitplanes`` is the public entry point."""
    assert codes.dim() == 2, "pass a (R, K) view; tcprec.packing.pack_bitplanes reshapes for you"
    R, K = codes.shape
    planes, block_r, block_w, grid = _planes_and_grid(R, K, bits, codes.device, block_r, block_w)
    if planes.numel() == 0:
        return planes
    Kw = planes.shape[2]
    _pack_bitplanes_kernel[grid](
        codes, planes,
        R, K, Kw,
        codes.stride(0), codes.stride(1),
        planes.stride(0), planes.stride(1), planes.stride(2),
        BITS=bits, BLOCK_R=block_r, BLOCK_W=block_w,
    )
    return planes


def quantize_pack(x: torch.Tensor, scale: torch.Tensor, bits: int, lo: int, hi: int, offset: int, shift: int,
                  *, block_r: int | None = None, block_w: int | None = None, compact: bool = False) -> torch.Tensor:
    """Launch: x (R, K) float (any row stride), scale a 1-element float32 tensor -> planes int32
    (bits, R, Kw), Kw = packed_words(K), or ceil(K / 32) with ``compact``.
    ``tcprec.ops.quantize.quantize_pack`` is the public entry point (it derives lo, hi, offset, shift
    from the format)."""
    assert x.dim() == 2, "pass a (R, K) view"
    R, K = x.shape
    planes, block_r, block_w, grid = _planes_and_grid(R, K, bits, x.device, block_r, block_w, compact)
    if planes.numel() == 0:
        return planes
    Kw = planes.shape[2]
    _quantize_pack_kernel[grid](
        x, scale, planes,
        R, K, Kw,
        x.stride(0), x.stride(1),
        planes.stride(0), planes.stride(1), planes.stride(2),
        LO=lo, HI=hi, OFFSET=offset, SHIFT=shift,
        BITS=bits, BLOCK_R=block_r, BLOCK_W=block_w,
    )
    return planes


def pool_quantize_pack(y: torch.Tensor, scale: torch.Tensor, pool_stride: int, bits: int, lo: int, hi: int,
                       offset: int, shift: int, *, block_r: int | None = None,
                       block_w: int | None = None) -> torch.Tensor:
    """Launch: y (N, P, Q, K) float, 2x2 max-pool with stride ``pool_stride`` (2: floor, an odd last row /
    column dropped, as nn.MaxPool2d; 1: darknet's size-keeping pool, the window clipped at the edge),
    then ``quantize_pack`` -> planes int32 (bits, N*P'*Q', Kw).  One read of y."""
    assert y.dim() == 4 and pool_stride in (1, 2)
    N, P, Q, K = y.shape
    PO, QO = (P // 2, Q // 2) if pool_stride == 2 else (P, Q)
    R = N * PO * QO
    planes, block_r, block_w, grid = _planes_and_grid(R, K, bits, y.device, block_r, block_w)
    if planes.numel() == 0:
        return planes
    _pool_quantize_pack_kernel[grid](
        y, scale, planes,
        R, K, planes.shape[2], P, Q, PO, QO,
        *y.stride(),
        planes.stride(0), planes.stride(1), planes.stride(2),
        LO=lo, HI=hi, OFFSET=offset, SHIFT=shift, POOL_S=pool_stride,
        BITS=bits, BLOCK_R=block_r, BLOCK_W=block_w,
    )
    return planes


def pool_planes(planes: torch.Tensor, shape: tuple, pool_stride: int, bits: int, twos: bool) -> torch.Tensor:
    """Launch: packed codes ``planes`` int32 (bits, N*P*Q, Kw) of an NHWC activation ``shape`` (N, P, Q, K),
    2x2 max-pool with stride ``pool_stride`` (as :func:`pool_quantize_pack`) on the code order -> planes
    (bits, N*P'*Q', Kw).  Quantizing is monotone, so this equals pooling the floats, then quantizing."""
    assert planes.dim() == 3 and pool_stride in (1, 2)
    N, P, Q, K = shape
    Kw = planes.shape[2]
    PO, QO = (P // 2, Q // 2) if pool_stride == 2 else (P, Q)
    R = N * PO * QO
    out = torch.empty((bits, R, Kw), dtype=torch.int32, device=planes.device)
    if out.numel() == 0:
        return out
    sliced = bits <= 2  # bit-sliced words (POOL_SLICED_WORDS a program), else one code a lane (TILE_CODES a program)
    bw = min(next_power_of_2(Kw), 16 if sliced else MAX_BLOCK_W)  # (compact rows: any Kw)
    br = POOL_SLICED_WORDS // bw if sliced else max(1, TILE_CODES // (32 * bw))
    # small maps get smaller row blocks, down to POOL_MIN_ROWS, so that there are POOL_PROGRAMS programs: a batch-8
    # AlexNet / VGG pool ran on 3 / 13 programs and took 26 / 31 us for 1-2 KB of output (H200)
    br = max(min(br, POOL_MIN_ROWS), min(br, next_power_of_2(cdiv(R, POOL_PROGRAMS))))
    _pool_planes_kernel[(cdiv(R, br), cdiv(Kw, bw))](
        planes, out, R, Kw, min(Kw, cdiv(K, 32)), P, Q, PO, QO,
        planes.stride(0), planes.stride(1), out.stride(0), out.stride(1),
        POOL_S=pool_stride, TWOS=bool(twos), BITS=bits, BLOCK_R=br, BLOCK_W=bw,
    )
    return out
