"""Convolution wgrad as an implicit GEMM whose operands are 4-D TMA boxes, NHWC.

``dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c]``:
a GEMM of M = K (output channels), N = C (for each tap (r, s)) and a reduction over the L = N*P*Q
output pixels.  ``kernels/triton/conv_bwd.py``'s wgrad gathers its operand rows with pointer loads and
per-row masks (cp.async); here every operand tile is one TMA box and the TMA unit does the masking:

* the reduction is tiled as boxes of BOX_N images x BOX_P rows x BOX_Q columns of output pixels
  (BLOCK_L = BOX_N * BOX_P * BOX_Q rows, powers of two, see :func:`choose_box`);
* dy's tile is the box ``[BOX_N, BOX_P, BOX_Q, BLOCK_M]`` at (n0, p0, q0, k0) of a 4-D descriptor over
  dy (N, P, Q, K);
* x's tile for tap (r, s) is the box ``[BOX_N, BOX_P, BOX_Q, BLOCK_N]`` at (n0, p0 + row, q0 + col, c0)
  of a 4-D descriptor over x -- at stride 1, row = r*dh - ph, negative at the top border.  TMA
  zero-fills every element whose coordinate is negative or past the tensor's extent: that is the
  padding, and it also zeroes the rows of a box that overhang P, Q or N (dy's rows there are zero too);
* a stride (sh, sw) > 1 has no tiled-TMA equivalent (element strides skip elements, they do not
  subsample rows), so x is split by *stride phase*: tap r reads input row p*sh + (r*dh - ph), which is row
  p + floor((r*dh - ph) / sh) of the phase view ``x[:, a::sh]`` with a = (r*dh - ph) mod sh.  One
  descriptor per phase (a, b) over ``x[:, a::sh, b::sw, :]`` (16-byte strides and base: C a multiple
  of 8) and one launch per phase, over the taps that read it; all launches write one output.

    program -> (k-block, tap of this launch's phase, c-block), split
    for box in this split's share of the reduction (counters advance without division):
        A = dy_desc.load([n0, p0, q0, k0]).reshape(BLOCK_L, BLOCK_M)                  # TMA
        B = x_desc.load([n0, p0 + row, q0 + col, c0]).reshape(BLOCK_L, BLOCK_N)     # TMA, zero-filled
        acc += A^T @ B                                                 # wgmma, fp32 accumulation
    epilogue: dw[k, r, s, c] (or this split's fp32 partial: SPLIT x (K, R, S, C) workspace, then
    conv_bwd._sum_splits adds the partials in a fixed order -- deterministic, no atomics)

What the compiler makes of it (triton 3.6 and 3.9, sm_90a, read from the PTX, ptxas -v and the SASS
without a GPU; tests/test_wgrad_tma.py checks the instructions):

* both boxes load with ``cp.async.bulk.tensor.4d`` (SASS ``UTMALDG.4D``) into 128-byte-swizzled shared
  memory, ``num_stages`` buffers deep, with mbarriers; box coordinates are plain signed 32-bit adds
  (negative ones reach the TMA unit unchanged);
* x's tile (wgmma's B, N-major) goes from shared memory to wgmma in every case: merging the box's
  leading dims is a ``ttg.memdesc_reshape`` (TMA writes the box row after row, the layout is the 2-D one);
* dy's tile (wgmma's A, transposed) does only when the box merges unit dims alone -- a *row box*
  (1, 1, BLOCK_L): then ``HGMMA ... gdesc.tnspA.tnspB``, both operands in shared memory, one wgmma group
  in flight across iterations.  With BOX_N * BOX_P > 1 Triton has no shared-memory "reshape, then
  transpose": it reads the tile into registers with ``ldmatrix.trans`` (``LDSM.16.MT88``; no store back)
  and issues wgmma with A from registers, one k16 step at a time with a ``wait_group`` on the
  accumulator between them; with more than one k16 step a box (BLOCK_L >= 32) ptxas then serialises
  the wgmmas (its C7515 note, "wgmma.mma_async instructions are serialized": every HGMMA waits for
  the one before).

An image box (BOX_N, 1, 1) -- BOX_N images of one pixel -- avoids that detour: over pixel-packed dy (N, P, Q, K)
its rows are the (N, P*Q*K) matrix's, so dy's descriptor is that 2-D matrix and its box a plain 2-D tile at
(n0, (p0*Q + q0)*K + k0) (``DY_2D``; channels past K read the next pixel's, which only meet rows k >= K of dw,
never stored): both operands reach wgmma from shared memory (7x7 512->512 3x3 at N = 256 on the H200: 116 -> 104
us).

Hence the default box (``policy="auto"``): the row box (1, 1, BLOCK_L) with BLOCK_L = Q rounded up to a
power of two, 16 to 64 (56 -> 64, 28 -> 32, 14 -> 16: 12.5% padding, where a several-row box could pad
less -- 1 x 8 x 8 pads nothing at 56x56 -- but would take the register path); where Q <= 8 (the 7x7
layers) a row box would pad Q at least 2x, so it takes the least-padding box (64 x 1 x 1: one pixel of 64
images, no padding) on the register path.  ``policy="min"`` takes the least padding whatever the path.

Operands: fp16 or bf16 (fp32 accumulation), and fp8 (e4m3 / e5m2, K and C multiples of 16): wgmma reads fp8
only K-major (the reduction index contiguous) and both tiles here are MN-major (channels contiguous), so with
fp8 codes the kernel widens each tile exactly to fp16 in registers (``WIDEN``) before the 16-bit wgmma; the
two per-tensor scales go in the epilogue.  Measured on the H200 (N = 256): 3x3 fp8 wgrads 144-222 us against
this kernel's 95-137 us on fp16 operands (the widening and the register detour cost more than the halved
bytes save) and against 327-766 us for the previous path (widening copies, then the Triton kernel).

Caveat of the zero fill: a dy row padded beyond Q (or P, N) is zero, but the x pixel it meets may be a
real one; a non-finite x value there gives 0 * inf = NaN in that tap's gradient, where the exact sum
has no such product.  Finite inputs are exact.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..conv_geometry import ACT_NONE, ConvGeometry
from ..tile_tables import int_in, load_table, nonneg_int, pos_int, record
from ._host import cdiv, next_power_of_2
from .conv_bwd import _one, _store_dw_tile, _sum_splits, _wgrad_tile, check_wgmma_blocks, interpreting, sm_count

__all__ = ["wgrad_tma", "supported", "choose_box", "pick", "split_for", "plan", "config_for", "phase_launches",
           "CONFIGS", "INTERPRETER_CONFIG"]

# Tiles (BLOCK_M over K, BLOCK_N over C, num_warps) x reduction rows BLOCK_L.  Stages: as many as fit a shared-
# memory budget ((BLOCK_M + BLOCK_N) * BLOCK_L * 2 bytes a stage) of 128 KB for 8-warp tiles (one CTA a SM) and
# 64 KB for 4-warp ones (three CTAs a SM), 3 to 8.  Compiled for sm_90a (triton 3.6 / 3.9): 58-59 registers
# (64x64), 90-106 (128x128), 154 (128x256), no spills, no local memory.  Measured: see pick().
_TILES = ((128, 128, 8), (128, 256, 8), (64, 128, 4), (64, 64, 4))
_BLOCK_LS = (64, 32, 16)


def _stages(bm: int, bn: int, bl: int, warps: int) -> int:
    budget = (128 if warps >= 8 else 64) * 1024
    return max(3, min(8, budget // ((bm + bn) * bl * 2)))


# Measured WRONG on the H200 (triton 3.6): the 128 x 256 tile with BLOCK_L = 64 (8 warps, 3 stages) returned
# results with NRMSE ~1e-2 against cuDNN on all 10 layers tried, N = 8 and 256, with every box it ran with
# (all multi-row boxes; benchmarks/results/wgrad_tma_tune.json), while the same tile with BLOCK_L = 32 or 16
# (row boxes and multi-row ones) and every other tile were exact to ~1e-6.  Cause not found (no GPU debugging
# time yet); the combination is refused by config_for and left out of CONFIGS.
_BAD_TILES = ((128, 256, 64),)
CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w))
           for bm, bn, w in _TILES for bl in _BLOCK_LS if (bm, bn, bl) not in _BAD_TILES]
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_L=16, num_warps=4, num_stages=1)
_MAX_BOX = 256  # TMA box dims are at most 256 elements


@triton.jit(do_not_specialize=["P", "Q", "TP", "TQ", "TILES", "PER_SPLIT", "S", "N_TAPS", "N_TW", "r0", "s0", "r_step",
                               "s_step", "row0", "col0", "row_step", "col_step"])
def _wgrad_tma_kernel(
    dy_desc, x_desc, out_ptr, scale_a_ptr, scale_b_ptr,
    # -- the reduction: boxes of (BOX_N images, BOX_P rows, BOX_Q columns) of dy pixels, TP x TQ boxes an image --
    P, Q, TP, TQ, TILES, PER_SPLIT,
    # -- the output: dw (K, R, S, C), or the split workspace (SPLIT, K, R, S, C); contiguous --
    K, C, S, RSC,
    # -- this launch's taps (one stride phase of x): r = r0 + i*r_step, s = s0 + j*s_step for i < N_TAPS // N_TW,
    #    j < N_TW; tap (i, j) reads the phase view of x at row p + row0 + i*row_step, column q + col0 + j*col_step --
    N_TAPS, N_TW, r0, s0, r_step, s_step, row0, col0, row_step, col_step,
    # -- what to do --
    HAS_SCALE: tl.constexpr, SPLIT_OUT: tl.constexpr, UPCAST: tl.constexpr, WIDEN: tl.constexpr, DY_2D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOX_N: tl.constexpr, BOX_P: tl.constexpr, BOX_Q: tl.constexpr,
):
    BLOCK_L: tl.constexpr = BOX_N * BOX_P * BOX_Q

    # ---- which tile (conv_bwd._wgrad_tile: neighbours share dy and overlapping x in L2) ----
    pid_k, tap, pid_c, split = _wgrad_tile(C, N_TAPS, BLOCK_N)
    i = tap // N_TW
    j = tap % N_TW
    r = r0 + i * r_step
    s = s0 + j * s_step
    row_off = row0 + i * row_step  # may be negative: TMA zero-fills the rows above the image (the padding)
    col_off = col0 + j * col_step
    k0 = pid_k * BLOCK_M
    c0 = pid_c * BLOCK_N

    # ---- this split's boxes [it_lo, it_hi) of the flat box index ((n-box * TP) + p-box) * TQ + q-box ----
    it_lo = split * PER_SPLIT
    it_hi = tl.minimum(it_lo + PER_SPLIT, TILES)
    q0 = (it_lo % TQ) * BOX_Q
    t = it_lo // TQ
    p0 = (t % TP) * BOX_P
    n0 = (t // TP) * BOX_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(it_lo, it_hi):
        if DY_2D:  # box (BOX_N, 1, 1): dy as the (N, P*Q*K) matrix, a plain 2-D box (wgmma reads it from shared memory)
            a = dy_desc.load([n0, (p0 * Q + q0) * K + k0])
        else:
            a = dy_desc.load([n0, p0, q0, k0]).reshape(BLOCK_L, BLOCK_M)  # (BLOCK_L, BLOCK_M), rows (n, p, q)
        b = x_desc.load([n0, p0 + row_off, q0 + col_off, c0]).reshape(BLOCK_L, BLOCK_N)  # same rows, tap-shifted
        if WIDEN:  # fp8 tiles (MN-major: wgmma cannot read them) widened exactly to fp16 in registers
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        if UPCAST:  # the interpreter multiplies bfloat16 as raw uint16 bits: widen (exactly) first
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a.T, b, acc)
        # next box: q fastest, then p, then n (compare-and-subtract, no division in the loop)
        q0 += BOX_Q
        wrap = (q0 >= Q).to(tl.int32)
        q0 -= wrap * (TQ * BOX_Q)
        p0 += wrap * BOX_P
        wrap = (p0 >= P).to(tl.int32)
        p0 -= wrap * (TP * BOX_P)
        n0 += wrap * BOX_N

    # ---- epilogue: dw[k, r, s, c] (contiguous), or this split's fp32 partial ----
    _store_dw_tile(out_ptr, acc, k0, c0, r * S + s, K, C, RSC, split, scale_a_ptr, scale_b_ptr, SPLIT_OUT, HAS_SCALE,
                   BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------------------------------------
# Geometry: stride phases, boxes, tiles, split
# ------------------------------------------------------------------------------------------------


def _axis_phases(R: int, stride: int, pad: int, dil: int, extent: int) -> list[tuple[int, list[int], int, int, int]]:
    """The taps of one axis grouped by the stride phase of x they read: ``(a, taps, base, base_step, len)``.
    Tap r reads x row p*stride + r*dil - pad = (p + base_r)*stride + a, i.e. row p + base_r of the phase view
    x[a::stride] (``len`` rows); within a phase the taps are r0, r0 + stride/g, ... (g = gcd(stride, dil)) and
    base_r grows by dil/g from one to the next."""
    groups: dict[int, list[int]] = {}
    for r in range(R):
        groups.setdefault((r * dil - pad) % stride, []).append(r)
    out = []
    for a, taps in sorted(groups.items()):
        base = (taps[0] * dil - pad - a) // stride
        step = (taps[1] - taps[0]) * dil // stride if len(taps) > 1 else 0
        out.append((a, taps, base, step, len(range(a, extent, stride))))
    return out


def phase_launches(g: ConvGeometry) -> list[dict]:
    """One launch per stride phase (a, b) of x that some tap reads: the phase, its taps and the row / column
    offsets of its tap (i, j) in the phase view ``x[:, a::sh, b::sw, :]``.  Stride 1: one launch, all taps.
    (Memoised per geometry; treat the dicts as read-only.)"""
    return list(_phase_launches(g))


@functools.lru_cache(maxsize=1024)
def _phase_launches(g: ConvGeometry) -> tuple:
    hs = _axis_phases(g.R, g.stride[0], g.padding[0], g.dilation[0], g.H)
    ws = _axis_phases(g.S, g.stride[1], g.padding[1], g.dilation[1], g.W)
    launches = []
    for a, rt, row0, row_step, ha in hs:
        for b, st, col0, col_step, wb in ws:
            launches.append(dict(a=a, b=b, taps_r=rt, taps_s=st, row0=row0, row_step=row_step, col0=col0,
                                 col_step=col_step, empty=ha == 0 or wb == 0))
    return tuple(launches)


def choose_box(N: int, P: int, Q: int, block_l: int, policy: str = "auto") -> tuple[int, int, int]:
    """(BOX_N, BOX_P, BOX_Q), powers of two with product ``block_l``.

    * ``"min"``: the fewest padded reduction rows (cdiv(N, bn) bn * cdiv(P, bp) bp * cdiv(Q, bq) bq); among
      equals a row box, then the longest BOX_Q, then BOX_P.
    * ``"row"``: (1, 1, block_l), a "row box": both operands then go from shared memory to wgmma (module doc).
    * ``"auto"``: the row box when block_l <= max(16, next power of two >= Q) -- it pads Q to a power of two,
      no more -- else ``"min"`` (Q <= 8 with BLOCK_L >= 16: several rows or images a box).
    """
    if block_l < 1 or block_l & (block_l - 1) or block_l > _MAX_BOX:
        raise ValueError(f"BLOCK_L must be a power of two <= {_MAX_BOX}, got {block_l}")
    if policy not in ("auto", "min", "row"):
        raise ValueError(f"box policy must be 'auto', 'min' or 'row', got {policy!r}")
    if policy == "row" or (policy == "auto" and block_l <= max(16, next_power_of_2(Q))):
        return 1, 1, block_l
    best = None
    for eq in range(block_l.bit_length()):
        bq = 1 << eq
        for ep in range(block_l.bit_length() - eq):
            bp = 1 << ep
            bn = block_l // (bq * bp)
            rows = cdiv(N, bn) * bn * cdiv(P, bp) * bp * cdiv(Q, bq) * bq
            key = (rows, not (bn == 1 and bp == 1), -bq, -bp)
            if best is None or key < best[0]:
                best = (key, (bn, bp, bq))
    return best[1]


# pick()'s rule, from the graph-replay tune on the H200 (decision 0032's sweep -> results/
# wgrad_tma_tune.json: the four 3x3 and six strided 1x1 ResNet-50 layers, N = 8 and 256, every config of CONFIGS
# x box policy), as data: wgrad_tma_tiles.json, validated at import (decision 0033).  Small problems (N = 8: ~1e9
# multiply-adds) want many CTAs: 64 x 64 tiles, 64 x 128 once the 64 x 64 tiles alone would fill ~3 waves of SMs.
# Large ones (N = 256: ~3e10) want the largest tile K fills (by_k), no wider than the channels need
# (channel_caps).  BLOCK_L = 64 (32 with the 128 x 256 tile: its 64 is refused above), and the least-padding box:
# on 56x56 the (1, 8, 8) box ran 1.4x faster than the (1, 1, 64) row box.
TILE_TABLE_PATH = Path(__file__).with_name("wgrad_tma_tiles.json")


def _tile(v) -> str | None:
    return None if isinstance(v, list) and tuple(v) in _TILES else f"a tile [BLOCK_M, BLOCK_N, num_warps] of {_TILES}"


def _by_k(v) -> str | None:
    row = record(min_k=nonneg_int, tile=_tile, tile_1x1=_tile)
    if not isinstance(v, list) or not v or any(row(r) is not None for r in v):
        return f"a non-empty list of {row(None)}"
    return None


_RULES = {
    "small_problem": record(max_macs=pos_int, many_tiles64=pos_int, tile=_tile, tile_many=_tile),
    "by_k": _by_k,
    "channel_caps": record(narrow_c=pos_int, narrow_tile=_tile, mid_c=pos_int, mid_max_bn=int_in((64, 128, 256))),
}


def _CHECK(t: dict) -> str | None:
    ks = [r["min_k"] for r in t["by_k"]]
    if any(a <= b for a, b in zip(ks, ks[1:])) or ks[-1] != 0:
        return f"by_k must go down in min_k and end with min_k 0 (every K has a row), got min_k {ks}"
    return None


_RULE = load_table(TILE_TABLE_PATH, _RULES, _CHECK)


def pick(g: ConvGeometry) -> dict:
    """The config for this layer (rule above): tile, BLOCK_L, stages and the least-padding box."""
    small, caps = _RULE["small_problem"], _RULE["channel_caps"]
    macs = g.K * g.C * g.R * g.S * g.N * g.P * g.Q
    if macs < small["max_macs"]:
        tiles64 = cdiv(g.K, 64) * cdiv(g.C, 64) * g.R * g.S
        bm, bn, w = small["tile_many"] if tiles64 >= small["many_tiles64"] else small["tile"]
    else:
        row = next(r for r in _RULE["by_k"] if g.K >= r["min_k"])
        bm, bn, w = row["tile"] if g.R * g.S > 1 else row["tile_1x1"]
    if g.C <= caps["narrow_c"]:  # no wider than the channels need (and still a tile of CONFIGS)
        bm, bn, w = caps["narrow_tile"]
    elif g.C <= caps["mid_c"] and bn > caps["mid_max_bn"]:
        bn = caps["mid_max_bn"]
    bl = 32 if (bm, bn, 64) in _BAD_TILES else 64
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w), BOX="min")


# Split cost model (H100 / H200 class; round numbers, not fitted to this kernel): a SM's sustained rate on one
# tile's MMAs, the bandwidth the fp32 partials are written and re-read at, and the fixed-order sum's launch.
_SM_FLOPS = 5.0e12
_WS_BYTES_PER_S = 3.0e12
_SUM_LAUNCH_S = 2e-6
_SMEM_PER_SM = 227 * 1024
_MAX_SPLIT = 256


def split_for(g: ConvGeometry, cfg: dict, box: tuple[int, int, int], sms: int) -> int:
    """Ways to split the reduction: waves of (output tiles x split) programs over the SMs (several CTAs a SM
    when their shared memory fits), each doing 1/split of its tile's boxes, plus writing and re-reading split
    fp32 partials and the sum's launch; the smallest split within 3% of the best.  Memoised: the model is
    pure Python over up to 256 splits (~300 us a call, more than most of the kernels it sizes)."""
    return _split_for(g, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_L"], cfg.get("num_stages", 3), tuple(box), sms)


@functools.lru_cache(maxsize=4096)
def _split_for(g: ConvGeometry, bm: int, bn: int, bl: int, stages: int, box: tuple[int, int, int], sms: int) -> int:
    tiles = cdiv(g.K, bm) * g.R * g.S * cdiv(g.C, bn)
    boxes = _box_count(g, box)
    smem = (bm + bn) * bl * 2 * stages
    per_sm = max(1, min(4, _SMEM_PER_SM // max(1, smem)))
    slots = max(1, sms) * per_sm
    box_s = 2.0 * bm * bn * bl / _SM_FLOPS * per_sm  # one box on one of per_sm CTAs sharing a SM
    part_s = 2.0 * g.K * g.R * g.S * g.C * 4 / _WS_BYTES_PER_S

    def cost(split: int) -> float:
        t = math.ceil(tiles * split / slots) * math.ceil(boxes / split) * box_s
        return t + (split * part_s + _SUM_LAUNCH_S if split > 1 else 0.0)

    costs = {s_: cost(s_) for s_ in range(1, max(1, min(_MAX_SPLIT, boxes)) + 1)}
    best = min(costs.values())
    return min(s_ for s_, c in costs.items() if c <= 1.03 * best)


def _box_count(g: ConvGeometry, box: tuple[int, int, int]) -> int:
    bn, bp, bq = box
    return cdiv(g.N, bn) * cdiv(g.P, bp) * cdiv(g.Q, bq)


def plan(g: ConvGeometry, cfg: dict, split_k: int | None, sms: int) -> dict:
    """What a launch with this config does: the box, the boxes an image row-block (TP, TQ), all boxes, the
    boxes a split and the split (every split non-empty)."""
    bl = cfg["BLOCK_L"]
    box = cfg.get("BOX", "auto")
    box = choose_box(g.N, g.P, g.Q, bl, box) if isinstance(box, str) else tuple(box)
    if len(box) != 3 or math.prod(box) != bl or any(v < 1 or v & (v - 1) or v > _MAX_BOX for v in box):
        raise ValueError(f"BOX must be three powers of two <= {_MAX_BOX} whose product is BLOCK_L={bl}, got {box}")
    tiles = _box_count(g, box)
    split = split_for(g, cfg, box, sms) if split_k is None else split_k
    per_split = max(1, cdiv(tiles, max(1, min(split, tiles))))
    return dict(box=box, tp=cdiv(g.P, box[1]), tq=cdiv(g.Q, box[2]), tiles=tiles,
                per_split=per_split, split=max(1, cdiv(tiles, per_split)))


def config_for(g: ConvGeometry, config: dict | None) -> dict:
    """The config a call with ``config`` runs: it, or :data:`INTERPRETER_CONFIG` under the interpreter, or
    :func:`pick`'s, checked."""
    cfg = dict(config if config is not None else INTERPRETER_CONFIG if interpreting() else pick(g))
    check_wgmma_blocks(cfg)
    tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_L"])
    if tile in _BAD_TILES:
        raise ValueError(f"BLOCK_M x BLOCK_N x BLOCK_L = {tile} gave wrong results on the H200 (NRMSE ~1e-2); use "
                         "BLOCK_L = 32 or 16 with this tile, or another config of wgrad_tma.CONFIGS")
    return cfg


# ------------------------------------------------------------------------------------------------
# Checks and the wrapper
# ------------------------------------------------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def supported(g: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Can :func:`wgrad_tma` run this layer (and why not)?  ``dtype``: the operands' type (None: a 16-bit
    one).  Any stride, padding and dilation; what TMA needs is 16-byte rows and phase-view bases: K and C
    multiples of 8."""
    fp8 = dtype in _FP8
    if dtype is not None and dtype not in _DTYPES and not fp8:
        return False, f"operands must be float16, bfloat16 or fp8 (e4m3 / e5m2), got {dtype}"
    if fp8 and (g.K % 16 or g.C % 16):
        return False, f"TMA loads need 16-byte rows: K and C multiples of 16 for fp8 operands, got K={g.K}, C={g.C}"
    if g.K % 8 or g.C % 8:
        return False, (f"TMA loads need 16-byte rows: K and C multiples of 8 for 16-bit operands, got K={g.K}, "
                       f"C={g.C}")
    if g.K * g.R * g.S * g.C >= 2**31:
        return False, f"K*R*S*C = {g.K * g.R * g.S * g.C} is beyond the kernel's int32 output offsets"
    if max(g.N, g.H, g.W, g.P, g.Q) >= 2**31 - _MAX_BOX:
        return False, "a tensor extent is beyond TMA's int32 coordinates"
    return True, "16-byte aligned rows (K and C multiples of 8)"


def _tma_ok(t: torch.Tensor, name: str) -> None:
    """TMA descriptors need a unit channel stride, 16-byte strides and a 16-byte aligned base."""
    es = t.element_size()
    if t.stride(-1) != 1 or any((st * es) % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name} must have a unit channel stride, 16-byte aligned strides and base for TMA, got "
                         f"strides {t.stride()} ({t.dtype}); pass a contiguous NHWC tensor (t.contiguous())")


def wgrad_tma(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *, scales=None,
              split_k: int | None = None, config: dict | None = None):
    """Write wgrad into ``out`` (K, R, S, C) (contiguous, any float dtype) from ``dy`` (N, P, Q, K) and ``x``
    (N, H, W, C), both float16 or both bfloat16, channels contiguous (any 16-byte aligned strides otherwise).
    ``scales`` (a pair of float32 device scalars) multiply the result.  ``split_k=None`` takes
    :func:`split_for`'s split; ``config`` (a dict of :data:`CONFIGS`, optionally with ``BOX``: a
    :func:`choose_box` policy or an explicit (bn, bp, bq)) fixes the tile, None takes :func:`pick`'s (the
    interpreter: :data:`INTERPRETER_CONFIG`).
    Returns (the last launched compiled kernel, the split used).  Example (sm_90, or TRITON_INTERPRET=1)::

        g = ConvGeometry(8, 28, 28, 128, 128, 3, 3, (1, 1), (1, 1), (1, 1))
        dw = torch.empty(g.weight_shape, device="cuda")          # float32
        wgrad_tma(dy.half(), x.half(), dw, g)                     # dy (8, 28, 28, 128), x (8, 28, 28, 128)
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    ok, why = supported(g, dy.dtype)
    if not ok:
        raise ValueError(f"wgrad_tma cannot run this layer: {why}")
    fp8 = dy.dtype in _FP8
    if (x.dtype != dy.dtype) and not (fp8 and x.dtype in _FP8):
        raise ValueError(f"dy and x must have one 16-bit dtype or both be fp8, got dy {dy.dtype} and x {x.dtype}")
    if tuple(dy.shape) != g.output_shape:
        raise ValueError(f"dy must be (N, P, Q, K) = {g.output_shape}, got {tuple(dy.shape)}")
    if tuple(x.shape) != g.input_shape:
        raise ValueError(f"x must be (N, H, W, C) = {g.input_shape}, got {tuple(x.shape)}")
    if tuple(out.shape) != g.weight_shape or not out.is_contiguous() or not out.dtype.is_floating_point:
        raise ValueError(f"out must be a contiguous floating (K, R, S, C) = {g.weight_shape} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    if dy.device != x.device or out.device != x.device:
        raise ValueError(f"dy, x and out must be on one device, got {dy.device}, {x.device}, {out.device}")
    _tma_ok(dy, "dy")
    _tma_ok(x, "x")
    cfg = config_for(g, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or an int >= 1, got {split_k!r}")

    if g.N == 0 or min(g.weight_shape) == 0:
        out.zero_()
        return None, 1
    pl = plan(g, cfg, split_k, sm_count(dy.device))
    box, split = pl["box"], pl["split"]
    has_scale = scales is not None
    sa, sb = scales if has_scale else (_one(out.device), _one(out.device))
    target = torch.empty((split, *g.weight_shape), dtype=torch.float32, device=out.device) if split > 1 else out

    # an image box (BOX_N, 1, 1) over pixel-packed dy: the (N, P*Q*K) matrix and a 2-D box, so that dy's tile reaches
    # wgmma from shared memory (a 4-D box merging BOX_N > 1 goes through registers, see the module doc); channels
    # past K read the next pixel's, which only meet the masked-out rows k >= K of dw
    dy_2d = box[1] == box[2] == 1 and dy.stride(2) == g.K and dy.stride(1) == g.Q * g.K
    if dy_2d:
        m = dy.as_strided((g.N, g.P * g.Q * g.K), (dy.stride(0), 1))
        dy_desc = TensorDescriptor(m, list(m.shape), list(m.stride()), [box[0], bm])
    else:
        dy_desc = TensorDescriptor(dy, list(dy.shape), list(dy.stride()), [*box, bm])
    flags = dict(HAS_SCALE=has_scale and split == 1, SPLIT_OUT=split > 1, DY_2D=dy_2d,
                 UPCAST=interpreting() and dy.dtype != torch.float16, WIDEN=fp8 and not interpreting(), BLOCK_M=bm,
                 BLOCK_N=bn, BOX_N=box[0], BOX_P=box[1], BOX_Q=box[2], num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
    sh, sw = g.stride
    kernel = None
    empty_taps = []
    for ph in phase_launches(g):
        if ph["empty"]:  # the phase view has no rows (e.g. H = 1 at stride 2): these taps reach no pixel
            empty_taps += [(r, s) for r in ph["taps_r"] for s in ph["taps_s"]]
            continue
        xv = x[:, ph["a"]::sh, ph["b"]::sw, :]  # (N, ceil((H-a)/sh), ceil((W-b)/sw), C)
        x_desc = TensorDescriptor(xv, list(xv.shape), list(xv.stride()), [*box, bn])
        rt, st = ph["taps_r"], ph["taps_s"]
        n_taps = len(rt) * len(st)
        grid = (cdiv(g.K, bm) * n_taps * cdiv(g.C, bn), split)
        kernel = _wgrad_tma_kernel[grid](
            dy_desc, x_desc, target, sa, sb,
            g.P, g.Q, pl["tp"], pl["tq"], pl["tiles"], pl["per_split"],
            g.K, g.C, g.S, g.R * g.S * g.C,
            n_taps, len(st), rt[0], st[0], (rt[1] - rt[0]) if len(rt) > 1 else 0,
            (st[1] - st[0]) if len(st) > 1 else 0, ph["row0"], ph["col0"], ph["row_step"], ph["col_step"],
            **flags)
    if split > 1:
        _sum_splits(target, out, ACT_NONE, 0.0, None, has_scale, sa, sb, None)
    for r, s in empty_taps:
        out[:, r, s, :] = 0
    return kernel, split
