"""Convolution wgrad as one GEMM over the flat pixel index, for fp8 with both operands K-major, by flat shifts.

``dw[k, r, s, c] = sum over output pixels l = (n, p, q) of dy[l, k] * x[n, p*sh + dr, q*sw + ds, c]`` with
dr = r*dh - ph, ds = s*dw - pw.  Three layouts:

* **batch-inner** (fp8, or 16-bit; the fp8 path ``ops.conv`` takes when N is a multiple of 16): dy stored
  (K, P, Q, N) and x (C, H, W, N), the *image* index contiguous.  A reduction step is BLOCK_L images of one output
  pixel (p, q): dy's tile is a 2-D box of the (K, P*Q*N) matrix, x's a 4-D box [BLOCK_N, 1, 1, BLOCK_L] at
  (c0, p*sh + dr, q*sw + ds, n0).  A tap, a stride or a dilation moves x's box along H and W only -- outer TMA
  axes, where any start is allowed and negative / past-the-edge coordinates are zero-filled (the padding) -- while
  the innermost start n0 stays a multiple of BLOCK_L: every box is 16-byte aligned, so any layer is an fp8 wgmma
  GEMM with both operands K-major in shared memory (SASS QGMMA + UTMALDG), no gather, no padded copy.  Measured
  on the H200 at N = 256: 3x3 layers 1.3-2.1x and strided 1x1 layers 1.2-1.9x cuDNN's fp16 wgrad (graph replay,
  ``benchmarks/results/conv_bwd.json``).  (A dy box [BLOCK_M, 1, 1, BLOCK_L] reshaped to 2-D reaches wgmma
  through registers -- ldmatrix, A from registers -- hence the 2-D dy box when BLOCK_L divides N.)

* **K-major** (fp8, or 16-bit): dy as the (K, L) matrix and x as the (C, L) matrix, L = N*P*Q contiguous --
  what fp8 wgmma needs (it reads fp8 only K-major).  1x1 unpadded stride-1 layers only: one GEMM.  A strided
  1x1 layer is the stride-1 one on ``x[:, ::sh, ::sw]`` (:func:`flat_geometry`; :func:`kmajor_pixels` gathers
  those pixels K-major in one pass).  A 3x3 tap would shift the box start along the contiguous L axis by
  dr*W + ds elements, and TMA needs the innermost box start 16-byte aligned: measured on the H200, a 2-D TMA
  load at innermost offset 1 or -1 (fp8 or fp16) dies with "illegal instruction" (Triton's interpreter
  asserts the same rule).  So 3x3 fp8 wgrads run on ``wgrad_tma.py`` (tiles widened to fp16 in registers).
* **NHWC** (16-bit): dy as the (L, K) matrix and x as the (N*H*W, C) matrix, stride-1 "same" layers (P = H,
  Q = W).  Each tap's x rows are then dy's rows shifted by the constant dr*W + ds -- along the *outer* TMA
  axis, any start allowed -- except where the tap leaves the image: those rows wrapped to a neighbouring row
  or image and are masked in dy's tile (through registers), with (p, q) from multiply-high divisions
  (``conv_bwd._magic``).  No reduction row is padding (an 8x8 TMA box on 7x7 pads 31%), but measured on the
  H200 it ran 0.45-0.76x cuDNN on the four ResNet-50 3x3 layers, slower than ``wgrad_tma.py`` (the masked
  register path costs more than the padding), so ``ops.conv``'s auto never takes it
  (``benchmarks/results/wgrad_flat_tune_256.json``).

    program -> (k-block, tap, c-block), split
    for l0 in this split's share of range(0, L, BLOCK_L):          [batch-inner: (p, q, n0) steps]
        A = dy tile (BLOCK_M, BLOCK_L)  [TMA; NHWC: transposed, masked where the tap wrapped]
        B = x tile (BLOCK_N, BLOCK_L)   [TMA; NHWC: rows shifted by dr*W + ds, zero fill outside the tensor]
        acc += A @ B^T                                   # wgmma, fp32 accumulation
    epilogue: dw[k, r, s, c] * scale_dy * scale_x, or this split's fp32 partial (the (SPLIT, K, R, S, C)
    workspace of kernels/triton/conv_bwd.py, summed in a fixed order: deterministic, no atomics)

Measured (H200, N = 256, graph replay): fp8 1x1 layers 17-73 us; faster than cuBLAS's ``_scaled_mm`` on the
28x28 and 14x14 layers (L = 200704 / 50176), slower on 56x56 and 7x7 (``ops.conv._auto_wgrad_flat``'s rule).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..conv_geometry import ACT_NONE, ConvGeometry
from ._host import cdiv, next_power_of_2
from .conv_bwd import (_fastdiv, _magic, _one, _store_dw_tile, _sum_splits, _wgrad_tile, check_wgmma_blocks,
                       interpreting, sm_count)

__all__ = ["wgrad_flat", "supported", "geometry_ok", "layout_of", "LAYOUTS", "pick", "split_for", "config_for",
           "CONFIGS", "INTERPRETER_CONFIG", "ALIGN"]

ALIGN = 16  # bytes: TMA wants 16-byte aligned row strides and bases

# (BLOCK_M over K, BLOCK_N over C, BLOCK_L over the reduction, num_warps); stages fill ~160 KB (8 warps) / 96 KB
# (4 warps) of shared memory at 1 byte an element (fp8), half as many for 16-bit operands.
_TILES = ((128, 256, 128, 8), (128, 128, 128, 8), (128, 128, 64, 4), (64, 128, 128, 4), (64, 64, 128, 4),
          (128, 256, 64, 8), (64, 64, 64, 4))


def _stages(bm: int, bn: int, bl: int, warps: int, esize: int = 1) -> int:
    budget = (160 if warps >= 8 else 96) * 1024
    return max(2, min(6, budget // ((bm + bn) * bl * esize)))


CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w))
           for bm, bn, bl, w in _TILES]  # fp8 (K-major)
_TILES16 = ((128, 256, 64, 8), (128, 128, 64, 8), (64, 128, 64, 4), (64, 64, 64, 4), (128, 256, 32, 8),
            (128, 128, 32, 8))
CONFIGS16 = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w, 2))
             for bm, bn, bl, w in _TILES16]  # 16-bit operands
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_L=32, num_warps=4, num_stages=1)


@triton.jit(do_not_specialize=["L", "H", "W", "TILES", "PER_SPLIT", "mag_w", "shift_w", "mag_h", "shift_h", "S",
                               "ph", "pw", "dh", "dw"])
def _wgrad_flat_kernel(
    dy_desc, x_desc, out_ptr, scale_a_ptr, scale_b_ptr,
    L, H, W, TILES, PER_SPLIT,  # L = N*P*Q output pixels = N*H*W input pixels; TILES = cdiv(L, BLOCK_L)
    mag_w, shift_w, mag_h, shift_h,  # l // W and (l // W) // H by multiply-high (conv_bwd._magic)
    K, C, S, RSC, N_TAPS, ph, pw, dh, dw,
    KMAJOR: tl.constexpr, MASK: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_OUT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_k, tap, pid_c, split = _wgrad_tile(C, N_TAPS, BLOCK_N)
    r = tap // S
    s = tap % S
    dr = r * dh - ph
    ds = s * dw - pw
    delta = dr * W + ds
    k0 = pid_k * BLOCK_M
    c0 = pid_c * BLOCK_N
    mw = mag_w.to(tl.uint32, bitcast=True)
    mh = mag_h.to(tl.uint32, bitcast=True)

    it_lo = split * PER_SPLIT
    it_hi = tl.minimum(it_lo + PER_SPLIT, TILES)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(it_lo, it_hi):
        l0 = it * BLOCK_L
        if KMAJOR:  # (K, L) and (C, L) matrices: tap shifts are 0 here (TMA's innermost start must be 16-byte aligned)
            a = dy_desc.load([k0, l0])  # (BLOCK_M, BLOCK_L)
            b = x_desc.load([c0, l0])  # (BLOCK_N, BLOCK_L)
        else:  # NHWC (L, K) and (L', C): the tap shift moves x's box along its rows, any start
            a = dy_desc.load([l0, k0]).T  # (BLOCK_M, BLOCK_L)
            b = x_desc.load([l0 + delta, c0]).T  # (BLOCK_N, BLOCK_L): the same pixels, shifted to the tap
        if MASK:  # zero the pixels whose tap pixel is outside the image (the flat shift wrapped there)
            offs_l = l0 + tl.arange(0, BLOCK_L)
            row = _fastdiv(offs_l, mw, shift_w)  # n*H + p
            q = offs_l - row * W
            p = row - _fastdiv(row, mh, shift_h) * H
            ok = (p + dr >= 0) & (p + dr < H) & (q + ds >= 0) & (q + ds < W)
            a = tl.where(ok[None, :], a, tl.zeros_like(a))
        if UPCAST:  # the interpreter has no fp8 / bf16 arithmetic: widen (exactly) first
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)

    # ---- epilogue: dw[k, r, s, c] (contiguous), or this split's fp32 partial ----
    _store_dw_tile(out_ptr, acc, k0, c0, tap, K, C, RSC, split, scale_a_ptr, scale_b_ptr, SPLIT_OUT, HAS_SCALE,
                   BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["P", "Q", "NB", "TILES", "PER_SPLIT", "S", "N_TAPS", "sh", "sw", "ph", "pw", "dh",
                               "dw"])
def _wgrad_batch_kernel(
    dy_desc, x_desc, out_ptr, scale_a_ptr, scale_b_ptr,
    P, Q, NB, TILES, PER_SPLIT,  # NB = cdiv(N, BLOCK_L) reduction steps a pixel; TILES = P*Q*NB
    K, C, S, RSC, N_TAPS, sh, sw, ph, pw, dh, dw,
    DY_2D: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_OUT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Batch-inner operands: dy (K, P, Q, N) and x (C, H, W, N), the image index contiguous.  A reduction step
    is BLOCK_L images of one output pixel (p, q); tap (r, s) reads the same images at input pixel
    (p*sh + r*dh - ph, q*sw + s*dw - pw): a box start along H and W (outer TMA axes, any start, negative or past
    the edge zero-filled = the padding) while the innermost start n0 stays a multiple of BLOCK_L (16-byte
    aligned).  Any filter, stride, padding and dilation; no gather, no padded copy.

    ``DY_2D`` (BLOCK_L divides N): dy's descriptor is the (K, P*Q*N) matrix and its box a plain 2-D tile -- which
    wgmma reads from shared memory; a [BLOCK_M, 1, 1, BLOCK_L] box reshaped to 2-D goes through registers
    (ldmatrix; seen in the sm_90 PTX with triton 3.9: A from registers), x's box stays in shared memory."""
    pid_k, tap, pid_c, split = _wgrad_tile(C, N_TAPS, BLOCK_N)
    r = tap // S
    s = tap % S
    dr = r * dh - ph
    ds = s * dw - pw
    k0 = pid_k * BLOCK_M
    c0 = pid_c * BLOCK_N

    # ---- this split's steps [it_lo, it_hi) of the step index (p * Q + q) * NB + nb ----
    it_lo = split * PER_SPLIT
    it_hi = tl.minimum(it_lo + PER_SPLIT, TILES)
    nb = it_lo % NB
    t = it_lo // NB
    q = t % Q
    p = t // Q
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(it_lo, it_hi):
        n0 = nb * BLOCK_L
        if DY_2D:
            a = dy_desc.load([k0, (p * Q + q) * (NB * BLOCK_L) + n0])  # K-major: images contiguous
        else:
            a = dy_desc.load([k0, p, q, n0]).reshape(BLOCK_M, BLOCK_L)
        b = x_desc.load([c0, p * sh + dr, q * sw + ds, n0]).reshape(BLOCK_N, BLOCK_L)  # the tap's pixel, zero-filled
        if UPCAST:  # the interpreter has no fp8 / bf16 arithmetic: widen (exactly) first
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
        # next step: images fastest, then q, then p (compare-and-subtract, no division in the loop)
        nb += 1
        wrap = (nb >= NB).to(tl.int32)
        nb -= wrap * NB
        q += wrap
        wrap = (q >= Q).to(tl.int32)
        q -= wrap * Q
        p += wrap

    _store_dw_tile(out_ptr, acc, k0, c0, tap, K, C, RSC, split, scale_a_ptr, scale_b_ptr, SPLIT_OUT, HAS_SCALE,
                   BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------------------------------------
# Geometry, tiles and split
# ------------------------------------------------------------------------------------------------

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_16BIT = (torch.float16, torch.bfloat16)


LAYOUTS = ("kmajor", "nhwc", "batch")


def geometry_ok(g: ConvGeometry, layout: str) -> tuple[bool, str]:
    """Can the kernel run this layer in this operand layout: a plain GEMM (K-major), every tap a constant flat
    shift of the output pixel (NHWC), or any layer (batch-inner: taps move the box along H and W)?"""
    if layout == "batch":
        return True, ("batch-inner operands (the image index contiguous): every tap is a box start along H and W, "
                      "any filter, stride, padding and dilation")
    if g.stride != (1, 1):
        return False, f"stride {g.stride}: the flat shift needs stride 1 (a 1x1 strided layer: subsample x first)"
    if layout == "kmajor":
        if (g.R, g.S) != (1, 1) or g.padding != (0, 0):
            return False, (f"{g.R}x{g.S} filter, padding {g.padding}: with the pixel index contiguous a tap shift would "
                           "start TMA boxes off 16-byte boundaries (measured: illegal instruction on the H200), so "
                           "K-major operands take 1x1 unpadded layers only")
        return True, "a 1x1 stride-1 layer: one GEMM over the pixels, both operands K-major"
    if (g.P, g.Q) != (g.H, g.W):
        return False, (f"output {g.P}x{g.Q} differs from input {g.H}x{g.W}: the flat shift needs a 'same' "
                       "convolution (padding = dilation * (R - 1) / 2)")
    return True, "stride 1, output the size of the input: each tap is a constant shift of the flat pixel index"


def supported(g: ConvGeometry, dtype: torch.dtype, layout: str) -> tuple[bool, str]:
    """Can :func:`wgrad_flat` run this layer with operands of ``dtype`` in ``layout`` (one of :data:`LAYOUTS`)?"""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in _FP8 + _16BIT:
        return False, f"operands must be fp8 (e4m3 / e5m2), float16 or bfloat16, got {dtype}"
    if dtype in _FP8 and layout == "nhwc":
        return False, ("fp8 operands must be K-major or batch-inner (reduction index contiguous): wgmma reads fp8 "
                       "only K-major")
    ok, why = geometry_ok(g, layout)
    if not ok:
        return ok, why
    esize = dtype.itemsize
    if layout == "nhwc" and (g.K * esize % ALIGN or g.C * esize % ALIGN):
        return False, f"TMA rows need 16 bytes: K and C multiples of {ALIGN // esize}, got K={g.K}, C={g.C}"
    if layout == "batch" and g.N * esize % ALIGN:
        return False, (f"batch-inner TMA rows need 16 bytes: the batch N a multiple of {ALIGN // esize}, got "
                       f"N={g.N}")
    if g.K * g.R * g.S * g.C >= 2**31 or g.N * g.H * g.W + g.R * g.W * g.dilation[0] >= 2**31:
        return False, "a dimension is beyond the kernel's int32 offsets"
    return True, why


def pick(g: ConvGeometry, esize: int = 1, batch: bool = False) -> dict:
    """The tile for this layer: the widest one the channels fill, 64-wide for small problems (more CTAs).

    ``batch`` (batch-inner operands), from the N = 256 tune on the H200 (results/wgrad_flat_tune_bi_256.json):
    filters wider than 1x1 take 128 x 128, or 128 x 256 with C >= 256 (47.6 vs 71.6 us on 14x14 256 3x3, 64.8 vs
    79.6 on 7x7 512 3x3); 1x1 layers 64 x 128; 64 x 64 where a channel count is below 128; BLOCK_L covers the
    batch (a power of two, 32 to 128: fp8 wgmma steps 32 deep)."""
    if batch:
        if min(g.K, g.C) < 128:  # 64 x 128 measured slower than 64 x 64 on 56x56 256->64 (104 vs 74 us)
            bm, bn, w = 64, 64, 4
        elif g.R * g.S > 1:
            bm, bn, w = (128, 256, 8) if g.C >= 256 else (128, 128, 8)
        else:  # 1x1: memory-bound GEMMs, more CTAs (31 vs 36 us on 14x14 256->1024, 44 vs 57 on 14x14 1024->2048 s2)
            bm, bn, w = 64, 128, 4
        bl = min(128 // esize, max(32 // esize, next_power_of_2(max(1, g.N))))
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w, esize))
    macs = g.K * g.C * g.R * g.S * g.N * g.P * g.Q
    if g.K >= 128 and g.C >= 256 and macs >= 4e9:
        bm, bn, bl, w = 128, 256, 128, 8
    elif g.K >= 128 and g.C >= 128 and macs >= 4e9:
        bm, bn, bl, w = 128, 128, 128, 8
    elif g.C >= 128:
        bm, bn, bl, w = 64, 128, 128, 4
    else:
        bm, bn, bl, w = 64, 64, 128, 4
    if esize > 1:
        bl = 64
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=_stages(bm, bn, bl, w, esize))


_SM_FLOPS = 9.0e12  # one SM's sustained fp8 rate on a tile's MMAs (H100 / H200 class, round number)
_WS_BYTES_PER_S = 3.0e12
_SUM_LAUNCH_S = 2e-6
_MAX_SPLIT = 128
# batch-inner tune (H200, N = 256): a 128 x 128 x 128 step took ~0.6 us (7 TFLOP/s an SM), a 64 x 64 x 128 one
# ~0.3 us on the 3x3 layers (latency-bound: small tiles count their co-resident CTAs); the big 1x1 layers ran at
# about DRAM speed (56x56 64->256: 74 us for 257 MB), where more splits only add partial sums
_BATCH_SM_FLOPS = 7.0e12
_STEP_LATENCY_S = 0.3e-6
_SMEM_BYTES = 227 * 1024
_DRAM_BYTES_PER_S = 3.0e12


@functools.lru_cache(maxsize=4096)
def split_for(g: ConvGeometry, bm: int, bn: int, bl: int, sms: int, batch: bool = False, stages: int = 3,
              esize: int = 1) -> int:
    """Ways to split the reduction: waves of (tiles x split) programs over the SMs, each 1/split of the L tiles,
    plus writing and re-reading split fp32 partials; the smallest split within 3% of the best.  ``batch``: the
    batch-inner layout's steps (BLOCK_L images of one pixel), CTAs that fit an SM's shared memory together
    (``stages`` buffers of ``esize``-byte tiles) each running at max(step latency, their MMA time), and never
    faster than reading dy and x's pixels once from DRAM with as many CTA slots filled as there are programs
    (measured, 64 x 128 tiles, two slots an SM: 28x28 512->128 at 96 programs 56 us, at 248 programs 47 us;
    56x56 256->512 s2 at 160 programs 71 us, at 256 programs 58 us)."""
    tiles = cdiv(g.K, bm) * g.R * g.S * cdiv(g.C, bn)
    mem_s = 0.0
    if batch:
        steps = g.P * g.Q * cdiv(g.N, bl)
        step_s = max(_STEP_LATENCY_S, 2.0 * bm * bn * bl / _BATCH_SM_FLOPS)
        slots = max(1, sms) * max(1, _SMEM_BYTES // (stages * (bm + bn) * bl * esize + 1024))
        mem_s = (g.K + g.C) * g.N * g.P * g.Q * esize / _DRAM_BYTES_PER_S
    else:
        steps = cdiv(g.N * g.P * g.Q, bl)
        step_s = 2.0 * bm * bn * bl / _SM_FLOPS
        slots = max(1, sms)
    part_s = 2.0 * g.K * g.R * g.S * g.C * 4 / _WS_BYTES_PER_S

    def cost(split: int) -> float:
        busy = min(1.0, tiles * split / slots)  # DRAM bandwidth takes every CTA slot pulling
        t = max(mem_s / busy, math.ceil(tiles * split / slots) * math.ceil(steps / split) * step_s)
        return t + (split * part_s + _SUM_LAUNCH_S if split > 1 else 0.0)

    costs = {s_: cost(s_) for s_ in range(1, max(1, min(_MAX_SPLIT, steps)) + 1)}
    best = min(costs.values())
    return min(s_ for s_, c in costs.items() if c <= 1.03 * best)


def config_for(g: ConvGeometry, config: dict | None, esize: int = 1, batch: bool = False) -> dict:
    cfg = dict(config if config is not None else INTERPRETER_CONFIG if interpreting() else pick(g, esize, batch))
    check_wgmma_blocks(cfg)
    if cfg["BLOCK_L"] < 32 and esize == 1:
        raise ValueError(f"BLOCK_L must be >= 32 for fp8 operands (wgmma's fp8 reduction step), got {cfg['BLOCK_L']}")
    return cfg


def _matrix(t: torch.Tensor, name: str, rows: int, cols: int) -> torch.Tensor:
    """``t`` as a (rows, cols) matrix view with unit column stride, 16-byte aligned row stride and base (TMA)."""
    m = t
    if t.dim() == 4:  # NHWC: the pixels as rows (a view when N, H, W merge)
        try:
            m = t.view(rows, cols)
        except RuntimeError:
            m = None
    if m is None or m.dim() != 2 or tuple(m.shape) != (rows, cols) or m.stride(1) != 1 or \
            (m.stride(0) * m.element_size()) % ALIGN or m.data_ptr() % ALIGN:
        raise ValueError(f"{name} must be a ({rows}, {cols}) matrix (or an NHWC tensor that views as one) with unit "
                         f"column stride and a 16-byte aligned row stride and base (TMA), got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}; ops.conv.prepare_fp8_wgrad makes K-major fp8 operands")
    return m


def layout_of(dy: torch.Tensor, x: torch.Tensor) -> str:
    """Which of :data:`LAYOUTS` the operands are in: 2-D matrices are K-major; 4-D (N, H, W, C)-shaped tensors are
    batch-inner when both have the image index contiguous (stride 1 on dim 0, N > 1), else NHWC."""
    if x.dim() != dy.dim() or dy.dim() not in (2, 4):
        raise ValueError(f"dy and x must be both 2-D (K-major matrices) or both 4-D ((N, H, W, C)-shaped), got "
                         f"{dy.dim()}-D and {x.dim()}-D")
    if dy.dim() == 2:
        return "kmajor"
    if dy.shape[0] > 1 and dy.stride(0) == 1 and x.stride(0) == 1:
        return "batch"
    return "nhwc"


def _batch_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` (N, H, W, C)-shaped with the image index contiguous, as the (C, H, W, N) view TMA reads."""
    v = t.permute(3, 1, 2, 0)
    if v.stride(3) != 1 or any((st * t.element_size()) % ALIGN for st in v.stride()[:3]) or t.data_ptr() % ALIGN:
        raise ValueError(f"{name} must have the image index contiguous and 16-byte aligned strides and base (TMA), got "
                         f"shape {tuple(t.shape)}, strides {t.stride()}; ops.conv.prepare_fp8_wgrad makes batch-inner "
                         "fp8 operands")
    return v


def wgrad_flat(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor, g: ConvGeometry, *, scales=None,
               split_k: int | None = None, config: dict | None = None):
    """Write wgrad into ``out`` (K, R, S, C) (contiguous, floating).  Three operand layouts (:func:`layout_of`):

    * K-major (fp8, or 16-bit): ``dy`` the (K, L) matrix and ``x`` the (C, L) matrix, pixel index contiguous
      (``t.permute(3, 0, 1, 2)`` of a (K, N, P, Q)-ordered tensor, flattened); 1x1 unpadded stride-1 layers.
    * NHWC (16-bit): ``dy`` (N, P, Q, K) and ``x`` (N, H, W, C), channels contiguous, pixels merging into rows;
      stride-1 "same" layers.
    * batch-inner (fp8, or 16-bit): ``dy`` (N, P, Q, K) and ``x`` (N, H, W, C) shaped, stored (K, P, Q, N) and
      (C, H, W, N) -- the image index contiguous (``to_fp8(t, memory_order=(3, 1, 2, 0))``); any layer, N a
      multiple of 16 bytes.

    ``scales`` (two float32 device scalars) multiply the result.  Returns (the compiled kernel, the split used).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    layout = layout_of(dy, x)
    ok, why = supported(g, dy.dtype, layout)
    if not ok:
        raise ValueError(f"wgrad_flat cannot run this layer with {layout} operands: {why}")
    if (dy.dtype in _FP8) != (x.dtype in _FP8) or (dy.dtype in _16BIT and x.dtype != dy.dtype):
        raise ValueError(f"dy and x must be both fp8 or both one 16-bit type, got {dy.dtype} and {x.dtype}")
    L = g.N * g.P * g.Q
    if layout == "kmajor":
        dy_m, x_m = _matrix(dy, "dy", g.K, L), _matrix(x, "x", g.C, g.N * g.H * g.W)
    elif layout == "nhwc":
        dy_m, x_m = _matrix(dy, "dy", L, g.K), _matrix(x, "x", g.N * g.H * g.W, g.C)
    else:
        if tuple(dy.shape) != g.output_shape or tuple(x.shape) != g.input_shape:
            raise ValueError(f"batch-inner dy and x must be shaped {g.output_shape} and {g.input_shape}, got "
                             f"{tuple(dy.shape)} and {tuple(x.shape)}")
        dy_m, x_m = _batch_view(dy, "dy"), _batch_view(x, "x")
    if tuple(out.shape) != g.weight_shape or not out.is_contiguous() or not out.dtype.is_floating_point:
        raise ValueError(f"out must be a contiguous floating (K, R, S, C) = {g.weight_shape} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    if dy.device != x.device or out.device != x.device:
        raise ValueError(f"dy, x and out must be on one device, got {dy.device}, {x.device}, {out.device}")
    batch = layout == "batch"
    cfg = config_for(g, config, dy.element_size(), batch)
    bm, bn, bl = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_L"]
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or an int >= 1, got {split_k!r}")
    if L == 0 or min(g.weight_shape) == 0:
        out.zero_()
        return None, 1

    nb = cdiv(g.N, bl)
    tiles = g.P * g.Q * nb if batch else cdiv(L, bl)
    split = split_for(g, bm, bn, bl, sm_count(dy.device), batch, cfg.get("num_stages", 3),
                      dy.element_size()) if split_k is None else split_k
    per_split = cdiv(tiles, max(1, min(split, tiles)))
    split = cdiv(tiles, per_split)  # every split non-empty
    has_scale = scales is not None
    sa, sb = scales if has_scale else (_one(out.device), _one(out.device))
    target = torch.empty((split, *g.weight_shape), dtype=torch.float32, device=out.device) if split > 1 else out
    blk_a, blk_b = {"kmajor": ([bm, bl], [bn, bl]), "nhwc": ([bl, bm], [bl, bn]),
                    "batch": ([bm, 1, 1, bl], [bn, 1, 1, bl])}[layout]
    dy_desc = TensorDescriptor(dy_m, list(dy_m.shape), list(dy_m.stride()), blk_a)
    x_desc = TensorDescriptor(x_m, list(x_m.shape), list(x_m.stride()), blk_b)
    n_taps = g.R * g.S
    grid = (cdiv(g.K, bm) * n_taps * cdiv(g.C, bn), split)
    common = dict(HAS_SCALE=has_scale and split == 1, SPLIT_OUT=split > 1, UPCAST=interpreting(), BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_L=bl, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
    if batch:
        # (K, P*Q*N) a matrix view and no box straddling two pixels
        dy_2d = g.N % bl == 0 and dy_m.stride(2) == g.N and dy_m.stride(1) == g.Q * g.N
        if dy_2d:
            m = dy_m.reshape(g.K, L)
            dy_desc = TensorDescriptor(m, list(m.shape), list(m.stride()), [bm, bl])
        kernel = _wgrad_batch_kernel[grid](
            dy_desc, x_desc, target, sa, sb, g.P, g.Q, nb, tiles, per_split,
            g.K, g.C, g.S, g.R * g.S * g.C, n_taps, *g.stride, *g.padding, *g.dilation, DY_2D=dy_2d, **common)
    else:
        kernel = _wgrad_flat_kernel[grid](
            dy_desc, x_desc, target, sa, sb,
            L, g.H, g.W, tiles, per_split, *_magic(max(1, g.W)), *_magic(max(1, g.H)),
            g.K, g.C, g.S, g.R * g.S * g.C, n_taps, g.padding[0], g.padding[1], g.dilation[0], g.dilation[1],
            KMAJOR=layout == "kmajor", MASK=g.padding != (0, 0), **common)
    if split > 1:
        _sum_splits(target, out, ACT_NONE, 0.0, None, has_scale, sa, sb, None)
    return kernel, split


# ------------------------------------------------------------------------------------------------
# K-major operands: the pixel index contiguous, rows 16-byte aligned
# ------------------------------------------------------------------------------------------------


def flat_geometry(g: ConvGeometry) -> ConvGeometry:
    """The geometry the kernel runs for ``g``: a 1x1 unpadded stride-s layer is the stride-1 1x1 layer on
    ``x[:, ::sh, ::sw]`` (the only pixels its filter reads); any other layer is itself."""
    if g.stride != (1, 1) and (g.R, g.S) == (1, 1) and g.padding == (0, 0):
        return ConvGeometry(g.N, g.P, g.Q, g.C, g.K, 1, 1, (1, 1), (0, 0), (1, 1))
    return g


def _aligned(m: torch.Tensor) -> bool:
    return m.stride(1) == 1 and (m.stride(0) * m.element_size()) % ALIGN == 0 and m.data_ptr() % ALIGN == 0


def _padded_rows(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (rows, cols) matrix whose row stride is ``cols`` rounded up to 16 bytes."""
    per = max(1, ALIGN // torch.empty((), dtype=dtype).element_size())
    return torch.empty(rows, cdiv(cols, per) * per, dtype=dtype, device=device)[:, :cols]


def kmajor_rows(m: torch.Tensor) -> torch.Tensor:
    """The 2-D matrix ``m`` itself when TMA can read it along its rows (unit column stride, 16-byte aligned row
    stride and base), else a copy with a padded row stride (e.g. L = N*P*Q not a multiple of 16 fp8 codes)."""
    if _aligned(m):
        return m
    return _padded_rows(m.shape[0], m.shape[1], m.dtype, m.device).copy_(m)


@triton.jit(do_not_specialize=["L", "PQ", "Q", "s_n", "s_h", "s_w", "s_c", "ld"])
def _pixels_t_kernel(x_ptr, out_ptr, L, C, PQ, Q, s_n, s_h, s_w, s_c, ld,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c, l] = x[n, p*sh, q*sw, c] for l = (n, p, q): a gather (the strides s_h, s_w already include the
    filter stride) and a transpose in one pass; Triton routes the tile through shared memory between the
    channel-contiguous loads and the pixel-contiguous stores."""
    offs_l = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = offs_l // PQ
    r = offs_l - n * PQ
    p = r // Q
    q = r - p * Q
    src = n.to(tl.int64) * s_n + p.to(tl.int64) * s_h + q.to(tl.int64) * s_w
    ok = (offs_l < L)[:, None] & (offs_c < C)[None, :]
    tile = tl.load(x_ptr + src[:, None] + offs_c.to(tl.int64)[None, :] * s_c, mask=ok)  # channel-contiguous
    # transposed in registers so the store's contiguous axis (pixels) is the tile's last one
    tl.store(out_ptr + offs_c.to(tl.int64)[:, None] * ld + offs_l[None, :], tl.trans(tile), mask=tl.trans(ok))


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def kmajor_pixels(x: torch.Tensor, stride=(1, 1)) -> torch.Tensor:
    """The (C, L) matrix of the pixels ``x[:, ::sh, ::sw, :]`` of ``x`` (N, H, W, C), pixel index l = (n, p, q)
    contiguous and rows 16-byte aligned (TMA): a view of ``x`` when its memory already is that ((C, N, H, W)
    order, stride 1), else one Triton pass that gathers and transposes (bytes moved: the pixels read, once)."""
    N, H, W, C = x.shape
    sh, sw = stride
    P, Q = cdiv(H, sh), cdiv(W, sw)
    L = N * P * Q
    if (sh, sw) == (1, 1):
        v = x.permute(3, 0, 1, 2)
        if v.is_contiguous():
            m = v.reshape(C, L)
            if _aligned(m):
                return m
    out = _padded_rows(C, L, x.dtype, x.device)
    if L == 0 or C == 0:
        return out
    iv = _INT_VIEW[x.element_size()]  # move codes, not values (fp8 / 16-bit alike)
    sn, s_h, s_w, sc = x.stride()
    bp, bc = 128, 64
    _pixels_t_kernel[(cdiv(L, bp), cdiv(C, bc))](x.view(iv), out.view(iv), L, C, P * Q, Q, sn, s_h * sh, s_w * sw,
                                                 sc, out.stride(0), BLOCK_P=bp, BLOCK_C=bc, num_warps=4)
    return out
