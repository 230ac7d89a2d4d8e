"""Triton kernel: a LayerNorm over the last dimension that writes its readers' 8-bit operand, in one pass.

Rows ``x (R, C)`` float16 / bfloat16 / float32 (any row stride) -> ``nn.LayerNorm(C)`` -> the operand of the
quantized linears that read the normalised tensor, with their one calibrated ``scale``:

* ``layer_norm_int8``: the INT8 kernel's int8 codes (``quant_bytes``' quantizer: ``pack._quantize_codes`` then
  ``quant_bytes._code_to_x8``), ``(R, C)`` int8;
* ``layer_norm_fp8``: float8 codes (``round.fp8_code`` of the IEEE quotient), ``(R, C)`` uint8.

    program -> BLOCK_R rows, each whole (two chunks of power-of-two widths: ``chunks(C)``, 768 = 512 + 256)
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
# columns a warp (launch_params): BLOCK_R = max(1, _TILE // next_power_of_2(CA + CB)) rows a program, one warp a
# _TILE columns (up to 16).  For C = 768 one row a program on one warp ran 12.6 us against 12.8-14.7 for 2-16 rows
# on 1-8 warps (H200, 12608 rows, fp16 in, int8 codes out; 15.8 us with the row as one masked 1024-column block, 4
# rows, 4 warps: decision 0169)
_TILE = 1024


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


@triton.jit
def _load_chunk(x_ptr, rows, r_ok, c0, C, stride_xc, CW: tl.constexpr):
    """Columns c0 .. c0 + CW - 1 of the program's rows in float32 (0 past C), with their column offsets and mask."""
    cols = c0 + tl.arange(0, CW)
    ok = cols < C
    x = tl.load(x_ptr + rows + cols[None, :] * stride_xc, mask=r_ok[:, None] & ok[None, :], other=0.0)
    return x.to(tl.float32), cols, ok


@triton.jit
def _chunk_codes(d, rstd, w_ptr, b_ptr, scale, cols, ok,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND: tl.constexpr, FP8: tl.constexpr,
                 LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, ENC: tl.constexpr,
                 BITS: tl.constexpr, F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr,
                 F8_MIN_NORMAL_BITS: tl.constexpr, F8_SUB_SCALE: tl.constexpr):
    """The codes of one chunk: the affine map, torch's output rounding to x's dtype, the readers' quantizer."""
    y = rstd[:, None] * d
    if HAS_W:
        y = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :] * y
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
    if ROUND == ROUND_FP16:
        y = y.to(tl.float16).to(tl.float32)
    elif ROUND == ROUND_BF16:
        y = _round_bf16(y)
    if FP8:
        v = fp8_code(div_by_scalar(y, scale), F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
        v = v.to(tl.uint8)
    else:
        v = _code_to_x8(_quantize_codes(y, scale, LO, HI, OFFSET, SHIFT, BITS), ENC, BITS)
    return v


# The row is held as two chunks of power-of-two widths, CA = the largest power of two <= C and CB >= C - CA (0: none),
# instead of one block of next_power_of_2(C) columns masked past C: for C = 768 (ViT-B) 512 + 256 lanes and no
# masked lane, where one 1024-column block idled a quarter of them.  C is a compile-time constant (one compile per
# width; a model has one or two): the chunk masks fold away and the addresses are constants, 13.4 -> 12.5 us for
# 12608 x 768 on the H200 (decision 0169).  stride_xr stays specialized (Triton's divisibility-by-16 specialization):
# each thread loads its row as 16-byte vectors and stores its codes 16 at a time (unspecialized: 1568 against 1104
# SASS instructions a program, sm_90, C = 768).  R (a loop bound) needs no compile of its own.
@triton.jit(do_not_specialize=["R"])
def _layer_norm_quant_kernel(
    x_ptr, w_ptr, b_ptr, scale_ptr, out_ptr,  # out (R, C) contiguous, one byte an element
    R, C: tl.constexpr, stride_xr, stride_xc, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND: tl.constexpr,
    FP8: tl.constexpr,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, ENC: tl.constexpr,
    BITS: tl.constexpr,
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr,
):
    # -- BLOCK_R rows, each as the chunks [0, CA) and [CA, CA + CB) (masked past C) -----------------------
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows = offs_r.to(tl.int64)[:, None] * stride_xr
    out_rows = offs_r.to(tl.int64)[:, None] * C

    # -- the statistics, in float32 (0 past C: they add nothing) ---------------------------------------
    xa, ca, a_ok = _load_chunk(x_ptr, rows, r_ok, 0, C, stride_xc, CA)
    total = tl.sum(xa, axis=1)
    if CB > 0:
        xb, cb, b_ok = _load_chunk(x_ptr, rows, r_ok, CA, C, stride_xc, CB)
        total += tl.sum(xb, axis=1)
    n = C * 1.0
    mean = tl.div_rn(total, n)  # (BLOCK_R,); IEEE division (Triton's '/' is approximate)
    da = tl.where(a_ok[None, :], xa - mean[:, None], 0.0)
    sq = tl.sum(da * da, axis=1)
    if CB > 0:
        db = tl.where(b_ok[None, :], xb - mean[:, None], 0.0)
        sq += tl.sum(db * db, axis=1)
    rstd = tl.rsqrt(tl.div_rn(sq, n) + eps)  # torch's CUDA LayerNorm: rsqrtf

    # -- each chunk: the affine map, torch's output rounding, the readers' quantizer -----------------
    scale = tl.load(scale_ptr)
    va = _chunk_codes(da, rstd, w_ptr, b_ptr, scale, ca, a_ok, HAS_W, HAS_B, ROUND, FP8, LO, HI, OFFSET, SHIFT, ENC,
                      BITS, F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
    tl.store(out_ptr + out_rows + ca[None, :], va, mask=r_ok[:, None] & a_ok[None, :])
    if CB > 0:
        vb = _chunk_codes(db, rstd, w_ptr, b_ptr, scale, cb, b_ok, HAS_W, HAS_B, ROUND, FP8, LO, HI, OFFSET, SHIFT,
                          ENC, BITS, F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
        tl.store(out_ptr + out_rows + cb[None, :], vb, mask=r_ok[:, None] & b_ok[None, :])


def chunks(C: int) -> tuple[int, int]:
    """The kernel's row chunks (CA, CB) for C columns: CA the largest power of two <= C, CB the next power of two
    >= C - CA (0 where CA = C)."""
    ca = 1 << (C.bit_length() - 1)
    return ca, (next_power_of_2(C - ca) if C > ca else 0)


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


def launch_params(C: int) -> tuple[int, int, int, int]:
    """(CA, CB, BLOCK_R, num_warps) for rows of C columns: the chunks, max(1, _TILE // W) rows a program and one warp
    a _TILE of the program's W-wide rows (W = next_power_of_2(CA + CB); up to 16 warps), both powers of two as Triton
    needs (num_warps = 3 for C = 3072 does not compile)."""
    ca, cb = chunks(C)
    width = next_power_of_2(ca + cb)
    br = max(1, _TILE // width)
    return ca, cb, br, max(1, min(16, br * width // _TILE))


def _launch(x, weight, bias, eps: float, scale, out, fp8: bool, fmt_kw: dict) -> None:
    R, C = x.shape
    if R == 0:
        return
    ca, cb, br, warps = launch_params(C)
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    _layer_norm_quant_kernel[(cdiv(R, br),)](
        x, x if w is None else w, x if b is None else b, scale.reshape(1), out,
        R, C, x.stride(0), x.stride(1), float(eps),
        HAS_W=w is not None, HAS_B=b is not None, ROUND=_ROUND[x.dtype], FP8=fp8, **fmt_kw, BLOCK_R=br, CA=ca, CB=cb,
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
