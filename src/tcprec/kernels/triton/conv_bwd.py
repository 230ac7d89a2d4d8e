"""Convolution backward (dgrad and wgrad) as implicit GEMMs on tensor cores, NHWC.

Layouts and index names are those of ``kernels/conv_geometry.py``: x / dx ``(N, H, W, C)``,
dy ``(N, P, Q, K)``, w / dw ``(K, R, S, C)``.  Every tensor is passed with its four strides, so any
strided view works (the contiguous dimension is what makes loads vectorise: C for x and w, K for dy).

dgrad -- GEMM of M = output pixels, N = C, reduction = (taps, K)
-----------------------------------------------------------------
A strided dgrad is a transposed convolution; inserting zeros into dy would waste stride^2 of the
work.  Instead, split dx by *stride phase*: the pixels ``h = a + sh*i`` (``a`` in ``[0, sh)``) are
reached only by the taps ``r = r0(a) + t*step`` and read ``dy`` row ``p = i + base(a) - t*dp``
(``ConvGeometry.phase_taps``), so each phase (a, b) is a dense, stride-1 convolution over the
sub-image (i, j) with ceil(R/step) x ceil(S/step) taps -- and phases with no taps just write zeros.

    program -> (phase (a, b), tile of BLOCK_M pixels (n, i, j) of that phase, BLOCK_N channels c)
    per row: bit masks of the tap rows / columns that land inside dy (computed once)
    acc[BLOCK_M, BLOCK_N] = 0
    for it in (taps of the phase) x (K in BLOCK_K steps):       # one flat loop: pipelines well
        A = dy[n, i + base_h - th*dp_h, j + base_w - tw*dp_w, k-block]  (masked at the borders)
        B = w[k-block, r0 + th*step_h, s0 + tw*step_w, c-block]
        acc += A @ B                                             # tl.dot: wgmma / mma, fp32 acc
        advance (kb, tw, th) by compare-and-subtract (no integer division in the loop)
    epilogue: * fp8 scales; ReLU / LeakyReLU backward from act_input; cast; store dx[n, h, w, c]

Per loop iteration the address work is one scalar offset added to loop-invariant pointer tiles.

wgrad -- GEMM of M = K, N = (tap, C), reduction = L = N*P*Q, split-K
---------------------------------------------------------------------
The output is small (K x R*S*C) and the reduction long (hundreds of thousands at batch 256), so the
reduction is cut into SPLIT chunks of CHUNK rows.  Each program writes its fp32 partial tile to a
workspace ``(SPLIT, K, R, S, C)``; ``_sum_splits_kernel`` then adds the partials in a fixed order
(split 0, 1, 2, ...).  No atomics: the result is bit-for-bit reproducible for a given config.

    program -> (k-block, tap (r, s), c-block), chunk
    for l-block in chunk:   (n, p, q) = l        (divisions by Q and P: multiply-high, _magic)
        A = dy[n, p, q, k-block]^T               (one linear index when (N, P, Q) pack densely)
        B = x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c-block]          (masked at the borders)
        acc += A @ B

fp8 (e4m3 activations / weights, e5m2 gradients)
------------------------------------------------
Triton (3.6 and later) lowers ``tl.dot`` on float8e4nv / float8e5 operands, mixed freely, to
sm_90 ``wgmma ... .e4m3/.e5m2`` (SASS ``QGMMA``) with an fp32 accumulator and to ``mma.sync`` fp8 on
sm_89.  Two Hopper facts shape the kernels: (1) the fp8 wgmma accumulator is narrower than fp32, and
on sm_90 Triton's default (``max_num_imprecise_acc_default = 2**30``) never promotes it; we pass
``max_num_imprecise_acc = BLOCK_K`` (promote into a true fp32 register after every BLOCK_K
products, like cuBLAS's default) unless ``fast_accum`` is asked for; (2) wgmma reads fp8 operands
from shared memory only K-major (the transpose bit exists for 16-bit types only), so Triton
transposes an MN-major fp8 tile on its way to shared memory.  dgrad avoids that by taking the weight
in ``(R, S, C, K)`` memory order (``ops.conv.prepare_fp8_dgrad``); wgrad takes dy K-major
(``(K, N, P, Q)`` memory order, read as one linear index ``l``) and x as NHWC.
Per-tensor scales are device scalars, applied once in the epilogue.

Checked without a GPU (triton 3.9's NVIDIA backend, target sm_90, see tests/test_conv_bwd.py): every
config compiles to ``wgmma.mma_async`` (m64nNk16 f16/bf16, m64nNk32 e5m2.e4m3) fed by 16-byte
``cp.async`` (LDGSTS.128) software pipelining, no register spills; the dgrad main loop is ~120 SASS
instructions a thread for 4 HGMMA 64x128x16 (128x128 tile), wgrad ~230 (fp8 wgrad ~400: Triton
transposes the MN-major x tile through registers for the K-major fp8 wgmma operand).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from ..conv_geometry import ACT_NONE, ConvGeometry
from ._host import cdiv, interpreting, next_power_of_2

__all__ = ["dgrad", "wgrad", "phase_scatter", "dgrad_split", "wgrad_split", "sm_count", "DGRAD_CONFIGS", "WGRAD_CONFIGS",
           "INTERPRETER_CONFIG", "interpreting"]

# Tiles for Hopper/Ampere: (BLOCK_M, BLOCK_N, num_warps, num_stages); the reduction block is 64
# elements for 16-bit operands and 128 for fp8 (the same 128 bytes a row).
_TILES = ((128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3), (128, 256, 8, 3))
DGRAD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bm, bn, w, s in _TILES for bk in (64, 128)]
WGRAD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_L": bk}, num_warps=w, num_stages=s)
                 for bm, bn, w, s in _TILES for bk in (64, 128)]
# The interpreter runs one small fixed tile (no autotuning on the CPU).
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_L": 16, "num_warps": 4, "num_stages": 1}
CHUNK_ALIGN = 128  # wgrad split chunks are multiples of every BLOCK_L
_SUM_BLOCK = 1024


def _magic(d: int) -> tuple[int, int]:
    """(m, s) with ``x // d == (umulhi(x, m) + x) >> s`` for every 0 <= x < 2**31 (the "round-up,
    add" method, Hacker's Delight 10-8); m is returned as the int32 with m's bit pattern."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {d}")
    s = (d - 1).bit_length()  # ceil(log2 d)
    m = (1 << (32 + s)) // d + 1 - (1 << 32)  # in [0, 2**32)
    return (m - (1 << 32) if m >= 1 << 31 else m), s


@triton.jit
def _fastdiv(x, m, s):
    """x // d for int32 0 <= x < 2**31, with (m, s) = _magic(d) and m already uint32: (umulhi + x) >> s
    cannot overflow 32 bits there."""
    xu = x.to(tl.uint32, bitcast=True)
    return ((tl.umulhi(xu, m) + xu) >> s).to(tl.int32, bitcast=True)


@triton.jit
def _wgrad_tile(C, N_TAPS, BLOCK_N: tl.constexpr):
    """The wgrad kernels' grid: axis 0 enumerates (k-block, tap, c-block) tiles, c-block fastest, then tap (so
    neighbours share dy's tile in L2), then k-block; axis 1 is the split.  Returns (pid_k, tap, pid_c, split)."""
    pid = tl.program_id(0)
    num_c = tl.cdiv(C, BLOCK_N)
    rest = pid // num_c
    return rest // N_TAPS, rest % N_TAPS, pid % num_c, tl.program_id(1)


@triton.jit
def _mma(a, b, acc, IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ b with fp32 accumulation: fp8 products promoted into fp32 every BLOCK_K (unless FAST_ACCUM);
    UPCAST widens the tiles first (the interpreter multiplies bfloat16 as raw uint16 bits)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IS_FP8 and not FAST_ACCUM:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return tl.dot(a, b, acc)


@triton.jit
def _store_dw(out_ptr, acc, offs, mask, split, K, RSC, scale_a_ptr, scale_b_ptr, SPLIT_OUT: tl.constexpr,
              HAS_SCALE: tl.constexpr):
    """wgrad epilogue: this split's fp32 partial into the (SPLIT, K, R, S, C) workspace, or dw itself
    (times the fp8 scales, cast); ``offs`` are the tile's offsets k*R*S*C + tap*C + c."""
    if SPLIT_OUT:
        tl.store(out_ptr + split.to(tl.int64) * K * RSC + offs, acc, mask=mask)
    else:
        if HAS_SCALE:
            acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_wgmma_blocks(cfg: dict) -> None:
    """A TMA wgrad kernel's config names BLOCK_M, BLOCK_N and BLOCK_L, each a power of two >= 16 (wgmma's smallest
    reduction step); raise a ValueError naming the value otherwise."""
    missing = {"BLOCK_M", "BLOCK_N", "BLOCK_L"} - set(cfg)
    if missing:
        raise ValueError(f"config needs BLOCK_M, BLOCK_N and BLOCK_L, missing {sorted(missing)}")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_L"):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (wgmma's smallest reduction step), got {v!r}")


@triton.jit
def _store_dw_tile(out_ptr, acc, k0, c0, tap, K, C, RSC, split, scale_a_ptr, scale_b_ptr, SPLIT_OUT: tl.constexpr,
                   HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The TMA wgrad kernels' epilogue: the (BLOCK_M output channels from k0) x (BLOCK_N input channels from c0)
    tile of tap ``tap`` = r * S + s into dw[k, r, s, c] (contiguous), or this split's fp32 partial (_store_dw)."""
    offs_k = k0 + tl.arange(0, BLOCK_M)
    offs_c = c0 + tl.arange(0, BLOCK_N)
    offs = offs_k[:, None] * RSC + tap * C + offs_c[None, :]
    _store_dw(out_ptr, acc, offs, (offs_k < K)[:, None] & (offs_c < C)[None, :], split, K, RSC, scale_a_ptr,
              scale_b_ptr, SPLIT_OUT, HAS_SCALE)


# ------------------------------------------------------------------------------------------------
# dgrad
# ------------------------------------------------------------------------------------------------


# Shape scalars are not specialised (no recompile per layer or batch); strides, C and K are (a unit
# stride and multiples of 16 are what make loads vectorise and masks uniform).
_DGRAD_NOSPEC = ["N", "H", "W", "P", "Q", "R", "S", "str_h", "str_w", "pad_h", "pad_w", "dil_h", "dil_w", "g_h",
                 "step_h", "dp_h", "inv_h", "g_w", "step_w", "dp_w", "inv_w", "M_MAX", "SPLIT"]
_WGRAD_NOSPEC = ["N", "H", "W", "P", "Q", "R", "S", "str_h", "str_w", "pad_h", "pad_w", "dil_h", "dil_w", "L", "CHUNK",
                 "mag_q", "shift_q", "mag_p", "shift_p"]


@triton.jit(do_not_specialize=_DGRAD_NOSPEC)
def _dgrad_kernel(
    dy_ptr, w_ptr, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr,
    # -- sizes --
    N, H, W, C, P, Q, K, R, S,
    # -- strides: dy (N, P, Q, K), w (K, R, S, C), out (N, H, W, C) or workspace, act (N, H, W, C) --
    sdy_n, sdy_p, sdy_q, sdy_k,
    sw_k, sw_r, sw_s, sw_c,
    so_n, so_h, so_w, so_c,
    sa_n, sa_h, sa_w, sa_c,
    # -- geometry: stride, padding, dilation and the stride-phase arithmetic (ConvGeometry.phase_params) --
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    g_h, step_h, dp_h, inv_h, g_w, step_w, dp_w, inv_w,
    M_MAX, SPLIT, slope,
    # -- what to do --
    ACT: tl.constexpr, HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr,
    SPLIT_OUT: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    # ---- which tile: n-block fastest, then phase, then pixel block (neighbours share dy in L2) ----
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_n = tl.cdiv(C, BLOCK_N)
    n_phase = str_h * str_w
    pid_n = pid % num_n
    rest = pid // num_n
    phase = rest % n_phase
    pid_m = rest // n_phase
    a = phase // str_w  # output rows h = a + str_h * i
    b = phase % str_w  # output cols w = b + str_w * j
    Hi = (H - a + str_h - 1) // str_h
    Wi = (W - b + str_w - 1) // str_w
    M = N * Hi * Wi
    if pid_m * BLOCK_M >= M:
        return

    # ---- the taps of this phase (scalars): r = r0 + th*step_h, dy row p = i + base_h - th*dp_h ----
    ch = a + pad_h
    r0 = ((ch // g_h) * inv_h) % step_h
    nr = ((R - r0 + step_h - 1) // step_h) * (ch % g_h == 0).to(tl.int32)
    base_h = (ch - r0 * dil_h) // str_h  # exact division when nr > 0
    cw = b + pad_w
    s0 = ((cw // g_w) * inv_w) % step_w
    ns = ((S - s0 + step_w - 1) // step_w) * (cw % g_w == 0).to(tl.int32)
    base_w = (cw - s0 * dil_w) // str_w

    # ---- rows of the tile: pixel (n, i, j) of the phase's sub-image ----
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    j = offs_m % Wi
    i = (offs_m // Wi) % Hi
    n = offs_m // (Wi * Hi)
    if INT64:
        n = n.to(tl.int64)
    p0 = i + base_h
    q0 = j + base_w
    # bit t of hbits / wbits: tap row / column t reads inside dy (the borders are zero padding)
    hbits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for t in range(0, nr):
        hbits |= ((p0 >= t * dp_h) & (p0 - t * dp_h < P)).to(tl.int32) << t
    hbits = tl.where(m_ok, hbits, 0)
    wbits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for t in range(0, ns):
        wbits |= ((q0 >= t * dp_w) & (q0 - t * dp_w < Q)).to(tl.int32) << t
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = offs_c < C
    # loop-invariant parts of the operand addresses (tap (0, 0), k-block 0): the loop adds a scalar
    a_base = dy_ptr + (n * sdy_n + p0 * sdy_p + q0 * sdy_q)[:, None] + offs_k[None, :] * sdy_k  # (BLOCK_M, BLOCK_K)
    b_base = w_ptr + r0 * sw_r + s0 * sw_s + offs_k[:, None] * sw_k + offs_c[None, :] * sw_c  # (BLOCK_K, BLOCK_N)

    # ---- main loop over (tap (th, tw), k-block kb), this split's share; counters advance without division ----
    k_iters = tl.cdiv(K, BLOCK_K)
    total = nr * ns * k_iters
    per_split = tl.cdiv(total, SPLIT)
    it_lo = split * per_split
    it_hi = tl.minimum(total, it_lo + per_split)
    ns_ = tl.maximum(ns, 1)
    kb = it_lo % k_iters
    tw = (it_lo // k_iters) % ns_
    th = (it_lo // k_iters) // ns_
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(it_lo, it_hi):  # noqa: B007 (the counters kb, tw, th carry the position)
        row_ok = ((hbits >> th) & (wbits >> tw) & 1) != 0
        a_ptrs = a_base + (kb * (BLOCK_K * sdy_k) - th * (dp_h * sdy_p) - tw * (dp_w * sdy_q))
        b_ptrs = b_base + (kb * (BLOCK_K * sw_k) + th * (step_h * sw_r) + tw * (step_w * sw_s))
        if EVEN_K:
            a_blk = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b_blk = tl.load(b_ptrs, mask=c_ok[None, :], other=0.0)
        else:
            k_ok = kb * BLOCK_K + offs_k < K
            a_blk = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b_blk = tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc = _mma(a_blk, b_blk, acc, IS_FP8, FAST_ACCUM, UPCAST, BLOCK_K)
        kb += 1
        wrap = (kb == k_iters).to(tl.int32)
        kb -= wrap * k_iters
        tw += wrap
        wrap = (tw == ns).to(tl.int32)
        tw -= wrap * ns
        th += wrap

    # ---- epilogue: dx[n, a + sh*i, b + sw*j, c] (or this split's partial) ----
    h = a + i * str_h
    w = b + j * str_w
    mask = m_ok[:, None] & c_ok[None, :]
    out_ptrs = out_ptr + (n * so_n + h * so_h + w * so_w)[:, None] + offs_c[None, :] * so_c
    if SPLIT_OUT:
        out_ptrs += split.to(tl.int64) * N * H * W * C
        tl.store(out_ptrs, acc, mask=mask)
    else:
        if HAS_SCALE:
            acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
        if ACT != 0:
            z = tl.load(act_ptr + (n * sa_n + h * sa_h + w * sa_w)[:, None] + offs_c[None, :] * sa_c,
                        mask=mask, other=0.0)
            if ACT == 1:
                acc = tl.where(z > 0, acc, 0.0)
            else:
                acc = tl.where(z > 0, acc, acc * slope)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# wgrad
# ------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_WGRAD_NOSPEC)
def _wgrad_kernel(
    dy_ptr, x_ptr, out_ptr, scale_a_ptr, scale_b_ptr,
    # -- sizes --
    N, H, W, C, P, Q, K, R, S,
    # -- strides: dy (N, P, Q, K), x (N, H, W, C); out is contiguous (SPLIT?, K, R, S, C) --
    sdy_n, sdy_p, sdy_q, sdy_k,
    sx_n, sx_h, sx_w, sx_c,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    L, CHUNK,
    mag_q, shift_q, mag_p, shift_p,  # l // Q and (l // Q) // P by multiply-high (see _magic)
    # -- what to do --
    HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, DY_LINEAR: tl.constexpr,
    SPLIT_OUT: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_F16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    # ---- which tile: c-block fastest, then tap, then k-block; the split is grid axis 1 ----
    pid_k, tap, pid_c, split = _wgrad_tile(C, R * S, BLOCK_N)
    r = tap // S
    s = tap % S
    offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    c_ok = offs_c < C

    # ---- loop-invariant address parts; x row (n, p, q) -> n*sx_n + p*(sh*sx_h) + q*(sw*sx_w) + tap_off ----
    tap_off = (r * dil_h - pad_h) * sx_h + (s * dil_w - pad_w) * sx_w
    x_cols = x_ptr + tap_off + offs_c[None, :] * sx_c  # (1, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_L)
    if DY_LINEAR:  # dy's (N, P, Q) dims pack into one index l of stride sdy_q (contiguous NHWC or K-major fp8)
        a_lin = dy_ptr + offs_r[:, None] * sdy_q + offs_k[None, :] * sdy_k  # (BLOCK_L, BLOCK_M)
    # dy rows hit by tap r / s are the p, q with 0 <= p*sh - ph + r*dh < H: p in [p_lo, p_hi)
    p_lo = tl.maximum(0, tl.cdiv(pad_h - r * dil_h, str_h))
    p_hi = tl.minimum(P, tl.cdiv(H + pad_h - r * dil_h, str_h))
    q_lo = tl.maximum(0, tl.cdiv(pad_w - s * dil_w, str_w))
    q_hi = tl.minimum(Q, tl.cdiv(W + pad_w - s * dil_w, str_w))
    mq = mag_q.to(tl.uint32, bitcast=True)
    mp = mag_p.to(tl.uint32, bitcast=True)

    # ---- reduce over this split's rows l = (n, p, q) ----
    l_lo = split * CHUNK
    l_hi = tl.minimum(l_lo + CHUNK, L)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for l0 in range(l_lo, l_hi, BLOCK_L):
        offs_l = l0 + offs_r
        l_ok = offs_l < l_hi
        # (n, p, q) from l by multiply-high with host-computed magic numbers (no division instructions)
        t = _fastdiv(offs_l, mq, shift_q)  # n*P + p
        q = offs_l - t * Q
        n = _fastdiv(t, mp, shift_p)
        p = t - n * P
        if INT64:
            n = n.to(tl.int64)
        if DY_LINEAR:
            if INT64:
                a_ptrs = a_lin + l0.to(tl.int64) * sdy_q
            else:
                a_ptrs = a_lin + l0 * sdy_q
        else:
            a_ptrs = dy_ptr + (n * sdy_n + p * sdy_p + q * sdy_q)[:, None] + offs_k[None, :] * sdy_k
        a_blk = tl.load(a_ptrs, mask=l_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_L, BLOCK_M)
        x_ok = l_ok & (p >= p_lo) & (p < p_hi) & (q >= q_lo) & (q < q_hi)
        x_rows = n * sx_n + p * (str_h * sx_h) + q * (str_w * sx_w)
        b_blk = tl.load(x_cols + x_rows[:, None], mask=x_ok[:, None] & c_ok[None, :], other=0.0)  # (BLOCK_L, BLOCK_N)
        if UPCAST:
            a_blk = a_blk.to(tl.float32)
            b_blk = b_blk.to(tl.float32)
        elif DOT_F16:  # fp8 codes widened exactly to fp16: 16-bit wgmma reads the MN-major x tile as is
            a_blk = a_blk.to(tl.float16)
            b_blk = b_blk.to(tl.float16)
        if IS_FP8 and not FAST_ACCUM and not DOT_F16:
            acc = tl.dot(tl.trans(a_blk), b_blk, acc, max_num_imprecise_acc=BLOCK_L)
        else:
            acc = tl.dot(tl.trans(a_blk), b_blk, acc)

    # ---- epilogue: dw[k, r, s, c] (contiguous), or this split's partial ----
    RSC = R * S * C
    offs = offs_k[:, None] * RSC + tap * C + offs_c[None, :]
    _store_dw(out_ptr, acc, offs, k_ok[:, None] & c_ok[None, :], split, K, RSC, scale_a_ptr, scale_b_ptr, SPLIT_OUT,
              HAS_SCALE)


# ------------------------------------------------------------------------------------------------
# The deterministic split-K reduction: out = epilogue(sum_{s=0..SPLIT-1} ws[s]), in that order
# ------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["numel", "SPLIT", "H", "W"])
def _sum_splits_kernel(
    ws_ptr, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr, numel, SPLIT,
    # act (dgrad only): element f of the contiguous (N, H, W, C) output sits at act[n, h, w, c]
    H, W, C, sa_n, sa_h, sa_w, sa_c, slope,
    ACT: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    if HAS_SCALE:
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    if ACT != 0:
        c = offs % C
        pix = offs // C
        w = pix % W
        h = (pix // W) % H
        n = pix // (W * H)
        z = tl.load(act_ptr + n * sa_n + h * sa_h + w * sa_w + c * sa_c, mask=ok, other=0.0)
        if ACT == 1:
            acc = tl.where(z > 0, acc, 0.0)
        else:
            acc = tl.where(z > 0, acc, acc * slope)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------
# Strided 1x1 dgrad: the GEMM result (one row per pixel the filter touches) scattered into dx
# ------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["H", "W", "P", "Q"])
def _phase_scatter_kernel(
    src_ptr, out_ptr, act_ptr, H, W, C, P, Q,
    sa_n, sa_h, sa_w, sa_c, slope,
    STR_H: tl.constexpr, STR_W: tl.constexpr, ACT: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out (N, H, W, C) contiguous: pixel (n, p*sh, q*sw) <- src row (n, p, q) (contiguous (N*P*Q, C)),
    every other pixel 0 (no filter tap reaches it); then the activation backward.  One program per
    (image row, w-block, c-block): the row's (n, h) is one scalar division, the stride tests are
    constexpr, so the pass runs at copy speed -- it is the memory-bound part of a strided 1x1 dgrad."""
    row = tl.program_id(0)  # n * H + h
    h = row % H
    n = row // H
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    w_ok = offs_w < W
    c_ok = offs_c < C
    hit = w_ok & (offs_w % STR_W == 0) & ((offs_w * 0 + h % STR_H) == 0)  # (a tensor: the interpreter's masks)
    src_row = (n * P + h // STR_H).to(tl.int64) * Q + offs_w // STR_W
    v = tl.load(src_ptr + src_row[:, None] * C + offs_c[None, :], mask=hit[:, None] & c_ok[None, :], other=0.0)
    mask = w_ok[:, None] & c_ok[None, :]
    if ACT != 0:
        v = v.to(tl.float32)
        z = tl.load(act_ptr + (n.to(tl.int64) * sa_n + h * sa_h + offs_w * sa_w)[:, None] + offs_c[None, :] * sa_c,
                    mask=mask, other=0.0)
        if ACT == 1:
            v = tl.where(z > 0, v, 0.0)
        else:
            v = tl.where(z > 0, v, v * slope)
    out_off = (row.to(tl.int64) * W + offs_w) * C
    tl.store(out_ptr + out_off[:, None] + offs_c[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


def phase_scatter(src: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *, act: tuple[int, float] = (0, 0.0),
                  act_input: torch.Tensor | None = None) -> None:
    """dx of an unpadded 1x1 layer from its GEMM result: ``out`` (N, H, W, C), contiguous, gets
    ``src`` (N*P*Q, C) (contiguous, out's dtype) at the pixels (n, p*sh, q*sw) and zeros elsewhere,
    times act'(act_input) when an activation is given."""
    mode, slope = act
    if not (g.R == g.S == 1 and g.padding == (0, 0)):
        raise ValueError(f"phase_scatter is for unpadded 1x1 layers, got {g.R}x{g.S} padding {g.padding}")
    if not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError("phase_scatter needs contiguous src (N*P*Q, C) and out (N, H, W, C)")
    act_t = act_input if (act_input is not None and mode) else out
    bw = min(64, next_power_of_2(g.W)) if not interpreting() else min(8, next_power_of_2(g.W))
    bc = min(next_power_of_2(g.C), max(16, 8192 // bw)) if not interpreting() else min(16, next_power_of_2(g.C))
    grid = (g.N * g.H, cdiv(g.W, bw), cdiv(g.C, bc))
    _phase_scatter_kernel[grid](src, out, act_t, g.H, g.W, g.C, g.P, g.Q, *_strides(act_t), float(slope),
                                STR_H=g.stride[0], STR_W=g.stride[1], ACT=mode, BLOCK_W=bw, BLOCK_C=bc,
                                num_warps=4)


@triton.jit
def _rotate_filter_kernel(w_ptr, out_ptr, K, C, RS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c, RS-1-t, k] = w[k, t, c] for one tap t: a tiled transpose (loads along C, stores along K)."""
    t = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_k[:, None] < K) & (offs_c[None, :] < C)
    v = tl.load(w_ptr + (offs_k[:, None] * RS + t) * C + offs_c[None, :], mask=mask)  # (BLOCK_K, BLOCK_C)
    tl.store(out_ptr + (offs_c[None, :] * RS + (RS - 1 - t)) * K + offs_k[:, None], v, mask=mask)


def rotate_filter(w: torch.Tensor) -> torch.Tensor:
    """The filter of a stride-1 dgrad as a forward conv: ``w`` (K, R, S, C) -> (C, R, S, K) contiguous with
    ``out[c, r, s, k] = w[k, R-1-r, S-1-s, c]`` (rotated by 180 degrees, channels swapped), in one pass
    (torch's flip + permuted copy take two slow strided passes)."""
    K, R, S, C = w.shape
    w = w.contiguous()
    out = torch.empty((C, R, S, K), dtype=w.dtype, device=w.device)
    if w.numel() == 0:
        return out
    bk = bc = 16 if interpreting() else 64
    grid = (R * S, cdiv(K, bk), cdiv(C, bc))
    _rotate_filter_kernel[grid](w, out, K, C, RS=R * S, BLOCK_K=bk, BLOCK_C=bc, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------
# Autotuning (GPU only) and the configs it may pick
# ------------------------------------------------------------------------------------------------


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _prune(configs, nargs, red_name: str, red_size: str, m_size: str, n_size: str):
    """Keep the configs that fit the problem: the reduction block matches the operand width (64
    elements for 16-bit, 128 for fp8 when the reduction is that long), and tiles are not far larger
    than the problem."""
    fp8 = _is_fp8(nargs["dy_ptr"])
    red = nargs[red_size]
    want_red = 128 if fp8 and red >= 128 else 64
    m_cap = max(64, next_power_of_2(nargs[m_size]))
    n_cap = max(64, next_power_of_2(nargs[n_size]))
    kept = [c for c in configs if c.kwargs[red_name] == want_red
            and c.kwargs["BLOCK_M"] <= m_cap and c.kwargs["BLOCK_N"] <= n_cap]
    if not kept:  # never empty: the smallest tile always fits
        kept = [c for c in configs if c.kwargs[red_name] == want_red][-1:] or configs[:1]
    return kept


def _tune_bench(kernel_call, quantiles):
    """Autotuning timer: do_bench with a shorter budget than the default 25 + 100 ms a config."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_TUNE_KW = {"do_bench": _tune_bench} if "do_bench" in inspect.signature(triton.autotune).parameters else {}
_dgrad_heur = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(_dgrad_kernel)
_dgrad_tuned = triton.autotune(
    DGRAD_CONFIGS, key=["M_MAX", "C", "K", "R", "S", "str_h", "str_w", "SPLIT"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune(cfgs, nargs, "BLOCK_K", "K", "M_MAX",
                                                                             "C")},
    **_TUNE_KW,
)(_dgrad_heur)
_wgrad_tuned = triton.autotune(
    WGRAD_CONFIGS, key=["K", "C", "R", "S", "L", "CHUNK"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune(cfgs, nargs, "BLOCK_L", "CHUNK", "K",
                                                                             "C")},
    **_TUNE_KW,
)(_wgrad_kernel)


def _meta(config: dict | None, names: tuple[str, ...]) -> dict | None:
    """Launch meta-parameters from a fixed config (interpreter, or asked for); None: autotune."""
    if config is None and not interpreting():
        return None
    cfg = dict(INTERPRETER_CONFIG if config is None else config)
    meta = {k: cfg[k] for k in names}
    meta["num_warps"] = cfg.get("num_warps", 4)
    meta["num_stages"] = cfg.get("num_stages", 3)
    return meta


# ------------------------------------------------------------------------------------------------
# Split-K heuristics
# ------------------------------------------------------------------------------------------------


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter: any small number exercises the split path


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# A cost model for the wgrad split (H100 / H200 class): sustained tensor-core rate of one SM on a
# 128x128 tile (~55% of the wgmma peak a SM), the bandwidth the fp32 partials move at, and the
# launch of the fixed-order sum.  Fitted to nothing but these round numbers; it reproduces the first
# H200 run's 7x7 512->512 3x3 N=256 wgrad (split 1: 206 us modelled, 205 us measured).
_SM_FLOPS = 4.0e12
_WS_BYTES_PER_S = 3.0e12
_SUM_LAUNCH_S = 2e-6
# Above this many rows the first rule (about two waves of programs, split <= L / 8192) measured
# faster on H200 (28x28 128->128 3x3 N=256: 166 us vs 228 us with the model's split); below it the
# model's larger splits fill the GPU (N=8: 56x56 64->64 3x3 43 -> 17 us, 28x28 128->128 31 -> 16 us).
_MODEL_MAX_ROWS = 65536


@functools.lru_cache(maxsize=4096)
def wgrad_split(g: ConvGeometry, sms: int, fp8: bool = False) -> int:
    """Chunks of the L = N*P*Q reduction.  Below ``_MODEL_MAX_ROWS`` rows from a cost model: waves of (tiles x split) programs over
    the SMs, each doing 1/split of its tile's work, plus writing and re-reading split fp32 partials
    and the sum's launch; the smallest split within 3% of the best.  Small batches split a lot (few
    output tiles, nothing else to fill the GPU), big output tiles counts do not.  (fp8 runs the same
    16-bit MMA as fp16 here, see ``wgrad(dot_f16=)``; the argument is kept for callers.)  Memoised: the
    model loops over up to 128 splits in Python (~100-175 us a call on the CPUs measured)."""
    L = g.N * g.P * g.Q
    bm = min(128, max(64, next_power_of_2(g.K)))  # the tiles the autotuner's pruning allows
    bn = min(128, max(64, next_power_of_2(g.C)))
    tiles = cdiv(g.K, bm) * g.R * g.S * cdiv(g.C, bn)
    tile_s = 2.0 * bm * bn * L / _SM_FLOPS  # one tile's whole reduction on one SM
    part_s = 2.0 * g.K * g.R * g.S * g.C * 4 / _WS_BYTES_PER_S  # one split's partial: written + read

    def cost(split: int) -> float:
        t = cdiv(tiles * split, max(1, sms)) * tile_s / split
        return t + (split * part_s + _SUM_LAUNCH_S if split > 1 else 0.0)

    if L >= _MODEL_MAX_ROWS:  # long reductions: ~2 waves, partial traffic <= ~10% (measured better there)
        return max(1, min(cdiv(2 * sms, tiles), L // (16384 if fp8 else 8192), 128))
    cands = range(1, max(1, min(128, cdiv(L, CHUNK_ALIGN))) + 1)
    costs = {s_: cost(s_) for s_ in cands}
    best = min(costs.values())
    return min(s_ for s_, c in costs.items() if c <= 1.03 * best)


@functools.lru_cache(maxsize=4096)
def dgrad_split(g: ConvGeometry, sms: int) -> int:
    """dgrad splits its (tap, K) loop only when the pixel tiles cannot fill the GPU (small batch,
    7x7 / 14x14 layers): up to 4 ways, keeping >= 8 loop iterations a split."""
    m_phase = g.N * cdiv(g.H, g.stride[0]) * cdiv(g.W, g.stride[1])
    programs = g.stride[0] * g.stride[1] * cdiv(m_phase, 128) * cdiv(g.C, 64)
    if 2 * programs > sms:
        return 1
    _, step_h, _, _ = g.phase_params(0)
    _, step_w, _, _ = g.phase_params(1)
    iters = cdiv(g.R, step_h) * cdiv(g.S, step_w) * cdiv(g.K, 64)
    return max(1, min(4, sms // programs, iters // 8))


# ------------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ------------------------------------------------------------------------------------------------


def _upcast(t: torch.Tensor) -> bool:
    """Triton's interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bits as
    integers; widen bf16 tiles to fp32 there (exact).  Never on a GPU."""
    return interpreting() and t.dtype == torch.bfloat16


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    if t.dim() != 4:
        raise ValueError(f"expected a 4-D tensor, got shape {tuple(t.shape)}")
    return tuple(t.stride())


def _needs_int64(*ts: torch.Tensor) -> bool:
    """Element offsets beyond int32 (a 4-D view's largest offset is sum (size-1)*stride)."""
    lim = 2**31 - 1
    for t in ts:
        if t is None:
            continue
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0) + 1
        if span >= lim or t.numel() >= lim:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _one(device: torch.device) -> torch.Tensor:
    """A float32 1.0 per device, bound to unused pointer arguments (made once: no launch per call)."""
    return torch.ones((), dtype=torch.float32, device=device)


def _scales(scales, device):
    if scales is None:
        return False, _one(device), _one(device)
    sa, sb = scales
    return True, sa, sb


def dgrad(dy: torch.Tensor, w: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *, act: tuple[int, float] = (0, 0.0),
          act_input: torch.Tensor | None = None, scales=None, split_k: int = 1, fast_accum: bool = False,
          config: dict | None = None):
    """Write dgrad into ``out`` (N, H, W, C) (contiguous -- the split-K sum writes it flat -- any float dtype).  ``scales`` is a pair
    of float32 device scalars multiplied into the result (fp8).  Returns the compiled main kernel
    (its ``.asm`` holds the PTX / SASS)."""
    mode, slope = act
    split = max(1, int(split_k))
    has_scale, sa, sb = _scales(scales, dy.device)
    g_h, step_h, dp_h, inv_h = g.phase_params(0)
    g_w, step_w, dp_w, inv_w = g.phase_params(1)
    if cdiv(g.R, step_h) > 31 or cdiv(g.S, step_w) > 31:  # tap validity is a 31-bit mask a row
        raise ValueError(f"a {g.R}x{g.S} filter has more than 31 taps per stride phase along one axis; the Triton "
                         "dgrad kernel supports up to 31 (use backend='reference')")
    m_max = g.N * cdiv(g.H, g.stride[0]) * cdiv(g.W, g.stride[1])
    n_phase = g.stride[0] * g.stride[1]
    int64 = _needs_int64(dy, w, out, act_input)
    if split > 1:
        target = torch.empty((split, g.N, g.H, g.W, g.C), dtype=torch.float32, device=dy.device)
        int64 = int64 or _needs_int64(target)
        t_strides = tuple(target.stride()[1:])
    else:
        target, t_strides = out, _strides(out)
    act_t = act_input if act_input is not None else out
    args = (dy, w, target, act_t, sa, sb,
            g.N, g.H, g.W, g.C, g.P, g.Q, g.K, g.R, g.S,
            *_strides(dy), *_strides(w), *t_strides, *_strides(act_t),
            g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1],
            g_h, step_h, dp_h, inv_h, g_w, step_w, dp_w, inv_w,
            m_max, split, float(slope))
    flags = dict(ACT=mode if split == 1 else ACT_NONE, HAS_SCALE=has_scale and split == 1,
                 IS_FP8=_is_fp8(dy), FAST_ACCUM=bool(fast_accum), SPLIT_OUT=split > 1, INT64=int64,
                 UPCAST=_upcast(dy))

    def grid(meta):
        return (cdiv(m_max, meta["BLOCK_M"]) * n_phase * cdiv(g.C, meta["BLOCK_N"]), split)

    meta = _meta(config, ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    if meta is None:
        kernel = _dgrad_tuned[grid](*args, **flags)
    else:
        kernel = _dgrad_heur[grid(meta)](*args, **flags, **meta)
    if split > 1:
        _sum_splits(target, out, mode, slope, act_input, has_scale, sa, sb, g)
    return kernel


def wgrad(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *, scales=None,
          split_k: int | None = None, fast_accum: bool = False, config: dict | None = None,
          dot_f16: bool | None = None):
    """Write wgrad into ``out`` (K, R, S, C) (contiguous, any float dtype).  ``split_k=None`` picks
    the split with :func:`wgrad_split`.  ``dot_f16`` (fp8 operands; default True) widens the fp8
    tiles to fp16 in registers and multiplies on the 16-bit tensor cores: exact (every e4m3 / e5m2
    value is an fp16 value), fp32-accumulated, and free of the register transpose that fp8 wgmma
    needs for the MN-major x tile (``dot_f16=False``: fp8 wgmma, ~4x slower on H200 in the first
    measurements).  Returns (compiled main kernel, split used)."""
    L = g.N * g.P * g.Q
    if L >= 2**31 - 2 * CHUNK_ALIGN:  # the (n, p, q) decomposition divides int32 row indices
        raise ValueError(f"N*P*Q = {L} rows is beyond the wgrad kernel's int32 row index; split the batch")
    if split_k is None:
        split_k = wgrad_split(g, sm_count(dy.device), _is_fp8(dy))
    split = max(1, min(int(split_k), cdiv(L, CHUNK_ALIGN)))
    chunk = cdiv(cdiv(L, split), CHUNK_ALIGN) * CHUNK_ALIGN
    split = cdiv(L, chunk)  # every split non-empty
    has_scale, sa, sb = _scales(scales, dy.device)
    if split > 1:
        target = torch.empty((split, *out.shape), dtype=torch.float32, device=dy.device)
    else:
        target = out
    sdy = _strides(dy)
    # dy rows as one linear index l when (N, P, Q) pack with no gaps (contiguous NHWC or K-major)
    dy_linear = sdy[1] == g.Q * sdy[2] and (g.N == 1 or sdy[0] == g.P * sdy[1])
    int64 = _needs_int64(dy, x, target)
    args = (dy, x, target, sa, sb,
            g.N, g.H, g.W, g.C, g.P, g.Q, g.K, g.R, g.S,
            *sdy, *_strides(x),
            g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1],
            L, chunk, *_magic(max(1, g.Q)), *_magic(max(1, g.P)))
    fp8 = _is_fp8(dy)
    flags = dict(HAS_SCALE=has_scale and split == 1, IS_FP8=fp8, FAST_ACCUM=bool(fast_accum),
                 DY_LINEAR=bool(dy_linear), SPLIT_OUT=split > 1, INT64=int64, UPCAST=_upcast(dy),
                 DOT_F16=fp8 and (dot_f16 is None or bool(dot_f16)))

    def grid(meta):
        return (cdiv(g.K, meta["BLOCK_M"]) * g.R * g.S * cdiv(g.C, meta["BLOCK_N"]), split)

    meta = _meta(config, ("BLOCK_M", "BLOCK_N", "BLOCK_L"))
    if meta is None:
        kernel = _wgrad_tuned[grid](*args, **flags)
    else:
        kernel = _wgrad_kernel[grid(meta)](*args, **flags, **meta)
    if split > 1:
        _sum_splits(target, out, ACT_NONE, 0.0, None, has_scale, sa, sb, None)
    return kernel, split


def _sum_splits(ws, out, mode, slope, act_input, has_scale, sa, sb, g: ConvGeometry | None):
    numel = out.numel()
    act_t = act_input if (act_input is not None and mode) else out
    H, W, C = (g.H, g.W, g.C) if g is not None else (1, 1, 1)
    sa_ = _strides(act_t) if act_t.dim() == 4 else (0, 0, 0, 0)
    _sum_splits_kernel[(cdiv(numel, _SUM_BLOCK),)](
        ws, out, act_t, sa, sb, numel, ws.shape[0], H, W, C, *sa_, float(slope),
        ACT=mode, HAS_SCALE=has_scale, BLOCK=_SUM_BLOCK, num_warps=4,
    )
