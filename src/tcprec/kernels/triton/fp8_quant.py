"""Scale, quantise to fp8 and lay out in one pass: ``out = fp8(clamp(x / scale, -max, max))`` written in any
memory order (a transposing copy when the orders differ, e.g. NHWC activations into the batch-inner (C, H, W, N)
order of ``ops.conv.prepare_fp8_wgrad``).

The same bits as ``ops.conv.to_fp8``'s torch path: the division is IEEE (``round.div_by_scalar``; Triton's
``/`` is ``div.full``, 2 ulp), the clamp keeps NaN (compares, not min/max), and the conversion rounds to nearest even
(``cvt.rn.satfinite`` on sm_90: within the clamp it is torch's rounding).  The torch path it replaces took
several full-size float32 temporaries and a strided copy: 7.4 ms for a 256x56x56x256 fp16 tensor into the
batch-inner order on the H200, this pass 0.32-0.40 ms (1.5-1.9 TB/s; docs/decisions/0013).

    program -> a (BLOCK_A x BLOCK_B) tile of (the source's contiguous dim a) x (the destination's contiguous dim
    b) at one index of the two other dims: loads coalesce along a, stores along b (Triton moves the tile through
    shared memory between the two layouts)

``pool_quantize_fp8``: a conv's float output y ``(N, P, Q, K)`` (any strides) -> optional 2x2 max-pool (stride 2,
or 1 with the window clipped at the bottom / right edge: darknet's size-keeping pool; ``reference_conv_bitserial.pool_nhwc``'s
comparisons, so NaN propagates and of +-0 the first wins, as torch's max-pool) -> ``fp8(clamp(y / scale))`` ->
``(N, P', Q', K)`` float8 contiguous: the next FP8 layer's operand in one read of y, one byte written an element
(``ops.qconv`` ran a torch max-pool on float32 and then the quantiser: 2.8 GB of float32 written and read again at
YOLOv2-tiny's first layer, batch 256).  The codes are :func:`round.fp8_code`'s: bit-identical to
``quantize_fp8_static`` (torch's path) on the CPU interpreter and on the GPU.

    program -> (BLOCK_R pooled pixels, BLOCK_K channels): max over the window, divide, encode, store
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv
from .pack import _pooled_tile, pooled_output
from .quant_bytes import flat_rows
from .round import div_by_scalar, fp8_code, fp8_constexprs

__all__ = ["quantize_fp8", "pool_quantize_fp8"]

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
    """The tile, measured on the H200 (docs/decisions/0013): a transpose
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


# ------------------------------------------------------------------------------------------------
# max-pool + quantize to fp8 in one pass
# ------------------------------------------------------------------------------------------------

_POOL_TILE = 4096  # elements a program


@triton.jit(do_not_specialize=["R", "P", "Q", "PO", "QO"])
def _pool_quantize_fp8_kernel(
    x_ptr, scale_ptr, out_ptr,  # out: the uint8 view of the float8 result (N, PO, QO, K) contiguous
    R, K, P, Q, PO, QO,  # R = N * PO * QO output rows
    stride_xn, stride_xh, stride_xw, stride_xk,
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    POOL_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # torch's max-pool rule (NaN propagates): the codes of what torch's pool + quantize_fp8_static give
    v, mask, offs_out = _pooled_tile(x_ptr, R, K, P, Q, PO, QO, stride_xn, stride_xh, stride_xw, stride_xk, POOL_S,
                                     True, BLOCK_R, BLOCK_K)
    c = fp8_code(div_by_scalar(v, tl.load(scale_ptr)), F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS,
                 F8_SUB_SCALE)
    tl.store(out_ptr + offs_out, c.to(tl.uint8), mask=mask)


def pool_quantize_fp8(y: torch.Tensor, scale: torch.Tensor, pool_stride: int, dtype=torch.float8_e4m3fn
                      ) -> torch.Tensor:
    """y (N, P, Q, K) float16 / bfloat16 / float32 (any strides), ``scale`` a one-element float32 tensor on y's
    device, ``pool_stride`` 0 (no pool), 1 (2x2 window, stride 1, clipped at the edge: the size is kept) or 2
    (2x2, stride 2, floor) -> ``fp8(clamp(pool(y) / scale, -max, max))`` (N, P', Q', K) of ``dtype``
    (float8_e4m3fn or float8_e5m2), contiguous.  One Triton pass; the public entry is ``tcprec.ops.qconv.conv2d``
    (an FP8 layer chained to an FP8 layer).

    >>> y = torch.tensor([1.0, 3.0, 1e6, 104.0]).reshape(1, 2, 2, 1)          # doctest: +SKIP
    >>> pool_quantize_fp8(y.cuda(), torch.tensor([1.0]).cuda(), 2).float()    # doctest: +SKIP
    """
    if dtype not in _FP8:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not isinstance(y, torch.Tensor) or y.dim() != 4 or y.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        got = (f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__)
        raise ValueError(f"y must be a float16 / bfloat16 / float32 NHWC tensor (N, P, Q, K), got {got}")
    if pool_stride not in (0, 1, 2):
        raise ValueError(f"pool_stride must be 0 (no pool), 1 (2x2 size-keeping) or 2 (2x2 stride 2), got "
                         f"{pool_stride!r}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
            or scale.device != y.device:
        raise ValueError("scale must be a one-element float32 tensor on y's device (the next layer's activation "
                         "scale), got " + (f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
                                           if isinstance(scale, torch.Tensor) else type(scale).__name__))
    flat = flat_rows(y, pool_stride)  # (a thin contiguous input: wide flat rows)
    if flat is not None:
        return pool_quantize_fp8(flat, scale, 0, dtype).view(y.shape)
    out, R, (PO, QO), grid, (br, bk) = pooled_output(y, pool_stride, dtype, _POOL_TILE)
    if out.numel() == 0:
        return out
    _pool_quantize_fp8_kernel[grid](
        y, scale.reshape(1), out.view(torch.uint8), R, y.shape[3], y.shape[1], y.shape[2], PO, QO, *y.stride(),
        **fp8_constexprs(dtype), POOL_S=pool_stride, BLOCK_R=br, BLOCK_K=bk,
    )
    return out
