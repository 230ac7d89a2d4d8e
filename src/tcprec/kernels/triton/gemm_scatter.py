"""dgrad of a strided, unpadded 1x1 convolution as one TMA GEMM whose epilogue writes all of dx.

For a 1x1 filter with stride (sh, sw) and no padding, ``dx[n, p*sh, q*sw, :] = dy[n, p, q, :] @ w``
and every other pixel of dx is zero (no tap reaches it).  cuBLAS can do the GEMM, but its (N*P*Q, C)
result then has to be written, read back and scattered into dx with the zeros: at N = 256 on the
56x56 256->512 s2 ResNet-50 layer that is 205 MB (dy) + 2 x 103 MB (GEMM result) + 411 MB (dx)
= 822 MB, against 616 MB when the GEMM's epilogue writes dx itself.  The layers are memory-bound
(K = 256..2048 reduction against sh*sw*C output values a row), so bytes are time.

    program -> tile (BLOCK_M rows m = (n, p, q) of dy, BLOCK_N channels c), grouped along m for L2
               (or, persistent: a loop over tiles, flattened so the next tile's loads overlap this epilogue)
    first:         zeros at dx[n, p*sh + a, q*sw + b, c], (a, b) != (0, 0): they depend on nothing, so
                   their writes overlap the main loop (masked where p*sh + a >= H or q*sw + b >= W)
    for k-block:   A = dy[m-block, k-block]     (TMA, (M, K) row-major: K-major)
                   B = w[k-block, c-block]      (TMA; fp8 reads w^T (C, K) K-major, see conv_bwd.py)
                   acc += A @ B                 (wgmma, fp32 accumulation; fp8 promoted every BLOCK_K)
    epilogue:      acc * scales, activation backward from act_input, cast, store at dx[n, p*sh, q*sw, c]
                   (every pixel of dx is written exactly once)

TMA needs 16-byte aligned rows: K and C multiples of 8 (fp16/bf16) or 16 (fp8); the caller checks
(:func:`supported`).  Out-of-range rows / reduction columns are zero-filled by the TMA unit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from ..conv_geometry import ConvGeometry
from ..tile_tables import load_table, nonneg_int, one_of, record
from ._host import cdiv
from .conv_bwd import _mma, _one, _strides, interpreting, sm_count

__all__ = ["dgrad_1x1_strided", "supported", "CONFIGS", "VARIANT_CONFIGS", "MIN_ROWS_AUTO"]

# (BLOCK_M, BLOCK_N, BLOCK_K (16-bit; fp8 doubles it), num_warps, num_stages)
_TILES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (256, 128, 64, 8, 3))
CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s) for bm, bn, bk, w, s in _TILES]
# Variants (measured: see _pick): persistent (1-2 CTAs per SM loop over tiles, the loop nest
# flattened so the next tile's loads overlap this tile's stores) and zeros-first.  Without spills on sm_90
# under Triton 3.6 except 128x256 persistent with fp8 operands (48 bytes of stack).
VARIANT_CONFIGS = ([dict(c, persistent=True, ctas_per_sm=k) for c, k in ((CONFIGS[0], 1), (CONFIGS[1], 1),
                                                                         (CONFIGS[3], 2), (CONFIGS[2], 2))]
                   + [dict(c, zeros_first=True) for c in (CONFIGS[3], CONFIGS[0])])
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)


@triton.jit
def _rows(off_m, M, P, Q, STR_H: tl.constexpr, STR_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """GEMM rows m = (n, p, q) of the tile -> (n, h = p*sh, w = q*sw, row mask)."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    q = offs_m % Q
    t = offs_m // Q
    return (t // P).to(tl.int64), (t % P) * STR_H, q * STR_W, offs_m < M


@triton.jit
def _store_zeros(out_ptr, off_m, off_n, M, H, W, P, Q, C, STR_H: tl.constexpr, STR_W: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros at dx[n, h + a, w + b, c] for the (a, b) != (0, 0) of the stride: the pixels no tap reaches."""
    n, h, w, m_ok = _rows(off_m, M, P, Q, STR_H, STR_W, BLOCK_M)
    offs_c = off_n + tl.arange(0, BLOCK_N)
    c_ok = offs_c < C
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for da in tl.static_range(STR_H):
        for db in tl.static_range(STR_W):
            if da + db > 0:
                ok = m_ok & (h + da < H) & (w + db < W)
                ptrs = out_ptr + (((n * H + h + da) * W + w + db) * C)[:, None] + offs_c[None, :]
                tl.store(ptrs, zero, mask=ok[:, None] & c_ok[None, :])


@triton.jit
def _tile(tile, a_desc, b_desc, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr, M, H, W, P, Q, C, K,
          sa_n, sa_h, sa_w, sa_c, slope,
          STR_H: tl.constexpr, STR_W: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr,
          IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
          ZEROS_FIRST: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(C, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (tile % group) % rows) * BLOCK_M
    off_n = ((tile % group) // rows) * BLOCK_N
    # The zeros depend on nothing: ZEROS_FIRST stores them before the main loop, so their writes overlap its
    # loads and MMAs, at the price of registers live across the loop (check the spills per tile).
    if ZEROS_FIRST:
        _store_zeros(out_ptr, off_m, off_n, M, H, W, P, Q, C, STR_H, STR_W, BLOCK_M, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, kb * BLOCK_K])
        if B_KMAJOR:
            b = b_desc.load([off_n, kb * BLOCK_K]).T
        else:
            b = b_desc.load([kb * BLOCK_K, off_n])
        acc = _mma(a, b, acc, IS_FP8, FAST_ACCUM, UPCAST, BLOCK_K)

    # ---- epilogue: scales, activation backward, the value pixel dx[n, p*sh, q*sw, c] ----
    n, h, w, m_ok = _rows(off_m, M, P, Q, STR_H, STR_W, BLOCK_M)
    offs_c = off_n + tl.arange(0, BLOCK_N)
    mask = m_ok[:, None] & (offs_c < C)[None, :]
    if HAS_SCALE:
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    if ACT != 0:
        z = tl.load(act_ptr + (n * sa_n + h * sa_h + w * sa_w)[:, None] + offs_c[None, :] * sa_c, mask=mask, other=0.0)
        if ACT == 1:
            acc = tl.where(z > 0, acc, 0.0)
        else:
            acc = tl.where(z > 0, acc, acc * slope)
    ptrs = out_ptr + (((n * H + h) * W + w) * C)[:, None] + offs_c[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if not ZEROS_FIRST:
        _store_zeros(out_ptr, off_m, off_n, M, H, W, P, Q, C, STR_H, STR_W, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "H", "W", "P", "Q", "NUM_PROGS"])
def _gemm_scatter_kernel(
    a_desc, b_desc, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr,
    M, H, W, P, Q, C, K,
    sa_n, sa_h, sa_w, sa_c, slope,
    STR_H: tl.constexpr, STR_W: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr,
    IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS, FLATTEN: tl.constexpr, ZEROS_FIRST: tl.constexpr,
):
    # One tile per program (grid = tiles), or persistent (FLATTEN: grid = NUM_PROGS < tiles): the flattened
    # loop nest lets the software pipeline issue the next tile's TMA loads during this tile's epilogue.
    if FLATTEN:
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(C, BLOCK_N), NUM_PROGS, flatten=True):
            _tile(tile, a_desc, b_desc, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr, M, H, W, P, Q, C, K,
                  sa_n, sa_h, sa_w, sa_c, slope, STR_H, STR_W, ACT, HAS_SCALE, IS_FP8, FAST_ACCUM, B_KMAJOR, UPCAST,
                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ZEROS_FIRST)
    else:
        _tile(tl.program_id(0), a_desc, b_desc, out_ptr, act_ptr, scale_a_ptr, scale_b_ptr, M, H, W, P, Q, C, K,
              sa_n, sa_h, sa_w, sa_c, slope, STR_H, STR_W, ACT, HAS_SCALE, IS_FP8, FAST_ACCUM, B_KMAJOR, UPCAST,
              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ZEROS_FIRST)


def supported(g: ConvGeometry, fp8: bool) -> tuple[bool, str]:
    """Can :func:`dgrad_1x1_strided` run this layer (and why not)?"""
    if not (g.R == g.S == 1 and g.padding == (0, 0)):
        return False, f"the layer is {g.R}x{g.S} with padding {g.padding}, not an unpadded 1x1 layer"
    align = 16 if fp8 else 8
    if g.K % align or g.C % align:
        return False, (f"TMA loads need 16-byte rows: K and C multiples of {align} for "
                       f"{'fp8' if fp8 else '16-bit'} operands, got K={g.K}, C={g.C}")
    return True, "unpadded 1x1 layer with 16-byte aligned rows"


# _pick's rule and ops.conv's route thresholds are data: gemm_scatter_tiles.json (each value with what was measured to
# pick it: the H200 graph-replay sweep of decision 0032, results/dgrad_tma_tune.json), validated at import
# (decision 0033).  From large_rows GEMM rows the persistent variants win on every layer (16-bit 128x256 one CTA an
# SM, fp8 64x128 two CTAs an SM); below it the plain 64x128 x 4 warps tile is the best or within 10% of it.
# An autotuner was tried and dropped: its per-call host work.
TILE_TABLE_PATH = Path(__file__).with_name("gemm_scatter_tiles.json")
_ANY_CONFIG = one_of(CONFIGS + VARIANT_CONFIGS, f"one of the kernel's configs (CONFIGS + VARIANT_CONFIGS): "
                                                f"{CONFIGS + VARIANT_CONFIGS}")
_RULES = {
    "large_rows": nonneg_int,
    "large_tile": record(**{"16bit": _ANY_CONFIG, "fp8": _ANY_CONFIG}),
    "small_tile": _ANY_CONFIG,
    "min_rows_auto": record(**{"16bit": nonneg_int, "fp8": nonneg_int}),
    "min_rows_unstrided": nonneg_int,
}
_TABLE = load_table(TILE_TABLE_PATH, _RULES)
LARGE_ROWS = _TABLE["large_rows"]


def _pick(g: ConvGeometry, fp8: bool) -> dict:
    """The tile for this layer (see above): persistent from LARGE_ROWS GEMM rows, else the small tile."""
    if g.N * g.P * g.Q >= LARGE_ROWS:
        return dict(_TABLE["large_tile"]["fp8" if fp8 else "16bit"])
    return dict(_TABLE["small_tile"])


# ops.conv's auto path takes this kernel from this many GEMM rows (N*P*Q), by fp8-ness.  Graph-replay times
# (same tune): fp8 beat cuBLAS + the scatter pass on all 12 layer x batch cases; 16-bit on 11 of 12, the loss
# 14x14 1024->2048 at N = 8 (M = 392: 9.8 vs 8.3 us), hence the 16-bit floor.  (An earlier floor of 32768 came
# from CUDA events around eager calls, which on this machine time the host's 100-160 us a call.)
MIN_ROWS_AUTO = {False: _TABLE["min_rows_auto"]["16bit"], True: _TABLE["min_rows_auto"]["fp8"]}


def dgrad_1x1_strided(dy2: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *,
                      b_kmajor: bool, act: tuple[int, float] = (0, 0.0), act_input: torch.Tensor | None = None,
                      scales=None, fast_accum: bool = False, config: dict | None = None):
    """``out`` (N, H, W, C) contiguous <- dx of an unpadded 1x1 layer: ``dy2`` (N*P*Q, K) row-major,
    ``w2`` (K, C) row-major, or (C, K) row-major with ``b_kmajor`` (fp8 operands need that); ``config``
    (a dict of :data:`CONFIGS`; fp8 doubles its BLOCK_K) fixes the tile, None takes :func:`_pick`'s.  ``act``
    is (mode, slope) as in ``conv_bwd.dgrad``; ``scales`` (scale_a, scale_b) device scalars or None.
    Returns the launched compiled kernel (its ``asm`` for inspection)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    ok, why = supported(g, dy2.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    if not ok:
        raise ValueError(f"dgrad_1x1_strided cannot run this layer: {why}")
    M = g.N * g.P * g.Q
    if tuple(dy2.shape) != (M, g.K) or not dy2.is_contiguous():
        raise ValueError(f"dy2 must be a contiguous (N*P*Q, K) = {(M, g.K)} matrix, got {tuple(dy2.shape)} "
                         f"with strides {dy2.stride()}")
    want_b = (g.C, g.K) if b_kmajor else (g.K, g.C)
    if tuple(w2.shape) != want_b or not w2.is_contiguous():
        raise ValueError(f"w2 must be a contiguous {want_b} matrix, got {tuple(w2.shape)} with strides {w2.stride()}")
    if tuple(out.shape) != g.input_shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous (N, H, W, C) = {g.input_shape} tensor")
    fp8 = dy2.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    cfg = dict(config if config is not None else _INTERPRETER_CONFIG if interpreting() else _pick(g, fp8))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if fp8 and not interpreting():
        bk *= 2  # 128 bytes of reduction a row either way
    a_desc = TensorDescriptor(dy2, [M, g.K], [g.K, 1], [bm, bk])
    b_desc = (TensorDescriptor(w2, [g.C, g.K], [g.K, 1], [bn, bk]) if b_kmajor
              else TensorDescriptor(w2, [g.K, g.C], [g.C, 1], [bk, bn]))
    mode, slope = act
    act_t = act_input if (act_input is not None and mode) else out
    has_scale = scales is not None
    sa, sb = scales if has_scale else (_one(out.device), _one(out.device))
    args = (a_desc, b_desc, out, act_t, sa, sb, M, g.H, g.W, g.P, g.Q, g.C, g.K, *_strides(act_t), float(slope))
    flags = dict(STR_H=g.stride[0], STR_W=g.stride[1], ACT=mode, HAS_SCALE=has_scale, IS_FP8=fp8,
                 FAST_ACCUM=bool(fast_accum), B_KMAJOR=bool(b_kmajor),
                 UPCAST=interpreting() and dy2.dtype == torch.bfloat16, GROUP_M=8)
    tiles = cdiv(M, bm) * cdiv(g.C, bn)
    persistent = bool(cfg.get("persistent", False))
    progs = min(tiles, cfg.get("ctas_per_sm", 1) * sm_count(out.device)) if persistent else tiles
    return _gemm_scatter_kernel[(progs,)](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGS=progs,
                                          FLATTEN=persistent, ZEROS_FIRST=bool(cfg.get("zeros_first", False)),
                                          num_warps=cfg.get("num_warps", 4),
                                          num_stages=cfg.get("num_stages", 3))
