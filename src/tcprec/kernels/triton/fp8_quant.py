"""Scale, quantise to fp8 and lay out in one pass: ``out = fp8(clamp(x / scale, -max, max))`` written in any
memory order (a transposing copy when the orders differ, e.g. NHWC activations into the batch-inner (C, H, W, N)
order of ``ops.conv.prepare_fp8_wgrad``).

The same bits as ``ops.conv.to_fp8``'s torch path: the division is IEEE (``round.div_by_scalar``; Triton's
``/`` is ``div.full``, 2 ulp), the clamp keeps NaN (compares, not min/max), and the conversion rounds to nearest even
(``cvt.rn.satfinite`` on sm_90: within the clamp it is torch's rounding).  The torch path it replaces took
several full-size float32 temporaries and a strided copy: 7.4 ms for a 256x56x56x256 fp16 tensor into the
batch-inner order on the H200, this pass 0.32-0.40 ms (1.5-1.9 TB/s; results/fp8_quant.json).

    program -> a (BLOCK_A x BLOCK_B) tile of (the source's contiguous dim a) x (the destination's contiguous dim
    b) at one index of the two other dims: loads coalesce along a, stores along b (Triton moves the tile through
    shared memory between the two layouts)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv
from .round import div_by_scalar

__all__ = ["quantize_fp8"]

_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
BLOCK_A, BLOCK_B, NUM_WARPS = 64, 64, 4


# sizes and the outer strides are not specialised (no recompile per shape); sa and db are, so that a unit stride
# (the source's contiguous dim a, the destination's b) is known at compile time and the accesses vectorise
@triton.jit(do_not_specialize=["S1", "SA", "SB", "TB", "s0", "s1", "sb", "d0", "d1", "da"])
def _quant_kernel(x_ptr, out_ptr, scale_ptr, S1, SA, SB, TB, s0, s1, sa, sb, d0, d1, da, db,
                  FMT: tl.constexpr, FMAX: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    tiles = tl.cdiv(SA, BLOCK_A) * TB
    rest = pid // tiles
    t = pid - rest * tiles
    i0 = rest // S1
    i1 = rest - i0 * S1
    ta = t // TB
    tb = t - ta * TB
    offs_a = (ta * BLOCK_A + tl.arange(0, BLOCK_A)).to(tl.int64)
    offs_b = (tb * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    mask = (offs_a < SA)[:, None] & (offs_b < SB)[None, :]
    src = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + offs_a[:, None] * sa + offs_b[None, :] * sb
    dst = i0.to(tl.int64) * d0 + i1.to(tl.int64) * d1 + offs_a[:, None] * da + offs_b[None, :] * db
    y = div_by_scalar(tl.load(x_ptr + src, mask=mask).to(tl.float32), tl.load(scale_ptr))
    y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))  # NaN stays NaN (no min / max)
    if FMT == 1:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
    tl.store(out_ptr + dst, q, mask=mask)


def _tile_dims(x: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(a, b): the source's unit-stride dim and the destination's (another dim when they coincide)."""
    def inner(t):
        return min(range(t.dim()), key=lambda d: (abs(t.stride(d)) if t.shape[d] > 1 else 1 << 62, -d))

    a, b = inner(x), inner(out)
    if a == b:
        b = min((d for d in range(out.dim()) if d != a),
                key=lambda d: (abs(out.stride(d)) if out.shape[d] > 1 else 1 << 62, -d))
    return a, b


def _block(x: torch.Tensor, a: int, b: int) -> tuple[int, int, int]:
    """The tile, measured on the H200 (benchmarks/bench_fp8_quant_device.py, results/fp8_quant.json): a transpose
    whose destination rows are far apart in the source (NHWC into batch-inner: 256x56x56x256 fp16 in 0.32 ms, 1.9
    TB/s) takes 32 x 128 (128-byte fp8 stores), 0.40 ms at 64 x 64; everything else 64 x 64 (NHWC into (C, N, H, W)
    with C = 64: 0.20 vs 0.36 ms; no transpose: 0.015 vs 0.039 ms)."""
    if x.shape[a] >= 128 and abs(x.stride(b)) >= 1024:
        return 32, 128, 4
    return BLOCK_A, BLOCK_B, NUM_WARPS


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, block: tuple[int, int, int] | None = None
                 ) -> torch.Tensor:
    """Write ``fp8(clamp(x / scale))`` into ``out`` (float8_e4m3fn or float8_e5m2, x's shape, any strides) in one
    Triton pass; ``scale`` a float32 one-element tensor on x's device.  1 to 4 dims.  ``block``: (BLOCK_A,
    BLOCK_B, num_warps) of the tile (default: :func:`_block`'s measured rule).  Returns ``out``."""
    if out.dtype not in _FP8:
        raise ValueError(f"out must be torch.float8_e4m3fn or torch.float8_e5m2, got {out.dtype}")
    if not x.dtype.is_floating_point or x.dtype in _FP8:
        raise ValueError(f"x must be a float16 / bfloat16 / float32 tensor, got {x.dtype}")
    if tuple(out.shape) != tuple(x.shape) or not 1 <= x.dim() <= 4:
        raise ValueError(f"x and out must have one shape of 1 to 4 dims, got {tuple(x.shape)} and {tuple(out.shape)}")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device or out.device != x.device:
        raise ValueError("scale must be a one-element float32 tensor on x's device, and out on x's device")
    if x.numel() == 0:
        return out
    result = out
    while x.dim() < 4:
        x, out = x.unsqueeze(0), out.unsqueeze(0)
    a, b = _tile_dims(x, out)
    ba, bb, warps = block or _block(x, a, b)
    r0, r1 = (d for d in range(4) if d not in (a, b))
    S1, SA, SB = x.shape[r1], x.shape[a], x.shape[b]
    tb = cdiv(SB, bb)
    grid = (x.shape[r0] * S1 * cdiv(SA, ba) * tb,)
    _quant_kernel[grid](x, out, scale.reshape(1), S1, SA, SB, tb,
                        x.stride(r0), x.stride(r1), x.stride(a), x.stride(b),
                        out.stride(r0), out.stride(r1), out.stride(a), out.stride(b),
                        FMT=_FP8[out.dtype], FMAX=float(torch.finfo(out.dtype).max), BLOCK_A=ba, BLOCK_B=bb,
                        num_warps=warps)
    return result
