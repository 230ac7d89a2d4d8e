"""Triton kernel: a LayerNorm over the last dimension that writes its readers' 8-bit operand, in one pass.

Rows ``x (R, C)`` float16 / bfloat16 / float32 (any row stride) -> ``nn.LayerNorm(C)`` -> the operand of the
quantized linears that read the normalised tensor, with their one calibrated ``scale``:

* ``layer_norm_int8``: the INT8 kernel's int8 codes (``quant_bytes``' quantizer: ``pack._quantize_codes`` then
  ``quant_bytes._code_to_x8``), ``(R, C)`` int8;
* ``layer_norm_fp8``: float8 codes (``round.fp8_code`` of the IEEE quotient), ``(R, C)`` uint8.

    program -> BLOCK_R rows, each whole (BLOCK_C = next_power_of_2(C) columns, masked past C)
        x = load(rows) in float32
        mean = sum(x) / C;  d = x - mean;  var = sum(d * d) / C;  rstd = rsqrt(var + eps)
        y = w * (rstd * d) + b             (float32, torch's CUDA formula; w / b optional)
        y = float(dtype(y))                (the LayerNorm output torch writes in x's dtype, ties to even)
        codes = quantize(y / scale) -> store

The codes are those of torch's ``F.layer_norm`` in x's dtype followed by each reader's quantizer
(``ops.qconv.quantize_int8_static`` / ``quantize_fp8_static``) wherever the two LayerNorms round ``y`` to the same
value of x's dtype: they compute the mean and variance in float32 in different orders (torch: Welford), so an
element on the rounding boundary of x's dtype can land one ulp apart, and its code one step apart where that ulp
crosses a code boundary (tests/test_layer_norm_quant.py measures how rarely).  Why: a pre-norm transformer's
LayerNorm is read only by the next linear(s); torch's writes the fp16 tensor and the reader reads it back to quantize
it, where this pass writes one byte an element and nothing reads it twice (docs/decisions/0162).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from .pack import _quantize_codes
from .quant_bytes import _code_to_x8
from .round import div_by_scalar, fp8_code, fp8_constexprs

__all__ = ["layer_norm_int8", "layer_norm_fp8", "MAX_C"]

MAX_C = 16384  # the widest row one program holds in registers (a ViT-H's 1280 and an LLM's 4096-8192 fit)
_TILE = 4096  # elements a program: BLOCK_R = max(1, _TILE // BLOCK_C) rows


# the rounding to x's dtype that torch's LayerNorm output gets (ROUND)
ROUND_NONE, ROUND_FP16, ROUND_BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_ROUND = {torch.float32: ROUND_NONE.value, torch.float16: ROUND_FP16.value, torch.bfloat16: ROUND_BF16.value}


@triton.jit
def _round_bf16(y):
    """float32 -> the nearest bfloat16 (ties to even), as float32; NaN stays NaN.  Integer arithmetic on the bit
    pattern, not ``.to(tl.bfloat16)``: Triton's interpreter truncates that conversion, so only this form is testable
    bit for bit on the CPU (the GPU's cvt.rn gives the same)."""
    bits = y.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000: drop the low 16 bits
    return tl.where(y == y, r.to(tl.float32, bitcast=True), y)


# C and stride_xr stay specialized (Triton's divisibility-by-16 specialization): with them known to be multiples of
# 16, each thread loads its row as 16-byte vectors and stores its codes 16 at a time.  Unspecialized, every element
# was its own 2-byte load and 1-byte store with its own address and mask: 1568 against 1104 SASS instructions a
# program (sm_90, C = 768, fp16 in, int8 codes out; compiled offline).  R (a loop bound) needs no compile of its own.
@triton.jit(do_not_specialize=["R"])
def _layer_norm_quant_kernel(
    x_ptr, w_ptr, b_ptr, scale_ptr, out_ptr,  # out (R, C) contiguous, one byte an element
    R, C, stride_xr, stride_xc, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND: tl.constexpr,
    FP8: tl.constexpr,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, ENC: tl.constexpr,
    BITS: tl.constexpr,
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # -- offsets: BLOCK_R rows x BLOCK_C columns -----------------------------------------------------
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    col_ok = offs_c < C
    mask = (offs_r < R)[:, None] & col_ok[None, :]
    rows = offs_r.to(tl.int64)[:, None]

    # -- the statistics, in float32 (0 past C: they add nothing) ---------------------------------------
    x = tl.load(x_ptr + rows * stride_xr + offs_c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    n = C * 1.0
    mean = tl.div_rn(tl.sum(x, axis=1), n)  # (BLOCK_R,); IEEE division (Triton's '/' is approximate)
    d = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    var = tl.div_rn(tl.sum(d * d, axis=1), n)
    rstd = tl.rsqrt(var + eps)  # torch's CUDA LayerNorm: rsqrtf

    # -- the affine map, then torch's output rounding to x's dtype -------------------------------------
    y = rstd[:, None] * d
    if HAS_W:
        y = tl.load(w_ptr + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :] * y
    if HAS_B:
        y = y + tl.load(b_ptr + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND == ROUND_FP16:
        y = y.to(tl.float16).to(tl.float32)
    elif ROUND == ROUND_BF16:
        y = _round_bf16(y)

    # -- the readers' quantizer ------------------------------------------------------------------------
    scale = tl.load(scale_ptr)
    if FP8:
        v = fp8_code(div_by_scalar(y, scale), F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
        v = v.to(tl.uint8)
    else:
        v = _code_to_x8(_quantize_codes(y, scale, LO, HI, OFFSET, SHIFT, BITS), ENC, BITS)
    tl.store(out_ptr + rows * C + offs_c[None, :], v, mask=mask)


def _check(x: torch.Tensor, weight, bias, scale: torch.Tensor, what: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: x must be float16 / bfloat16 / float32 rows (R, C), got {got}")
    R, C = x.shape
    if not 1 <= C <= MAX_C:
        raise ValueError(f"{what}: rows of C = {C} elements; one program holds 1..{MAX_C} (MAX_C)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (C,) or t.device != x.device
                              or not t.dtype.is_floating_point):
            got = f"{t.dtype} of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{what}: {name} must be None or a float tensor of shape ({C},) on x's device, got {got}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
            or scale.device != x.device:
        raise ValueError(f"{what}: scale must be a one-element float32 tensor on x's device, got "
                         + (f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
                            if isinstance(scale, torch.Tensor) else type(scale).__name__))
    return R, C


def _launch(x, weight, bias, eps: float, scale, out, fp8: bool, fmt_kw: dict) -> None:
    R, C = x.shape
    if R == 0:
        return
    bc = next_power_of_2(C)
    br = max(1, _TILE // bc)
    warps = 4 if bc * br <= 4096 else 8 if bc <= 8192 else 16
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    _layer_norm_quant_kernel[(cdiv(R, br),)](
        x, x if w is None else w, x if b is None else b, scale.reshape(1), out,
        R, C, x.stride(0), x.stride(1), float(eps),
        HAS_W=w is not None, HAS_B=b is not None, ROUND=_ROUND[x.dtype], FP8=fp8, **fmt_kw, BLOCK_R=br, BLOCK_C=bc,
        num_warps=warps)


_NO_F8 = {"F8_MAN": 0, "F8_BIAS": 0, "F8_MAX_BITS": 0, "F8_MIN_NORMAL_BITS": 0, "F8_SUB_SCALE": 0.0}
_NO_INT = {"LO": 0, "HI": 0, "OFFSET": 0, "SHIFT": 0, "ENC": 0, "BITS": 8}


def layer_norm_int8(x: torch.Tensor, weight, bias, eps: float, scale: torch.Tensor, bits: int, lo: int, hi: int,
                    offset: int, shift: int, enc: int) -> torch.Tensor:
    """Launch: rows x (R, C) -> LayerNorm (``weight`` / ``bias`` (C,) or None) -> int8 codes (R, C) contiguous, as
    ``quant_bytes.pool_quantize_int8`` stores them.  The public entry is ``tcprec.ops.qconv.layer_norm_quantize``."""
    _check(x, weight, bias, scale, "layer_norm_int8")
    out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    kw = {"LO": lo, "HI": hi, "OFFSET": offset, "SHIFT": shift, "ENC": enc, "BITS": bits, **_NO_F8}
    _launch(x, weight, bias, eps, scale, out, False, kw)
    return out


def layer_norm_fp8(x: torch.Tensor, weight, bias, eps: float, scale: torch.Tensor,
                   dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Launch: rows x (R, C) -> LayerNorm -> ``fp8(clamp(y / scale))`` (R, C) of ``dtype`` (float8_e4m3fn or
    float8_e5m2), contiguous: ``quantize_fp8_static``'s codes of the LayerNorm output."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    _check(x, weight, bias, scale, "layer_norm_fp8")
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _launch(x, weight, bias, eps, scale, out, True, {**_NO_INT, **fp8_constexprs(dtype)})
    return out.view(dtype)
