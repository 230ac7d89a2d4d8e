"""Triton kernels: a max-pool of any window in front of an activation quantizer, in one pass.

A float NHWC activation ``y (N, H, W, C)`` (any strides) -> ``nn.MaxPool2d((KH, KW), (SH, SW), (PH, PW))`` ->
the operand of the quantized convolutions that read the pooled tensor:

* ``pool_window_int8``: the INT8 kernel's int8 codes (``quant_bytes``' quantizer: ``_quantize_codes`` then
  ``_code_to_x8``), ``(N, P, Q, C)`` int8;
* ``pool_window_pack``: bit planes (``pack``'s ``_quantize_codes`` + ``_store_planes``), ``(bits, N*P*Q, Kw)``
  int32, rows padded to 512 bits or compact (``ceil(C / 32)`` words);
* ``pool_window_fp8``: float8 codes (``round.fp8_code`` of the IEEE quotient), ``(N, P, Q, C)`` uint8;
* ``pool_planes``: the max-pool of codes already in bit planes (a producer's quantized output), planes in, planes
  out -- the codes of the pooled float, since quantizing is monotone (below).

    program -> (BLOCK_R output pixels, BLOCK_K channels | BLOCK_W words of 32 channels)
        m = -inf; for each of the KH x KW window pixels inside the image: m = v if v > m or v is NaN
        (torch's max-pool rule, row-major window order: NaN propagates, of -0 and +0 the first stays)
        codes = quantize(m) -> store

P = (H + 2 PH - KH) // SH + 1 (floor, as ``nn.MaxPool2d`` without ceil_mode), padding pixels never win (torch pads
with -inf).  Max-pooling is exact in any float dtype, so the codes equal torch's ``max_pool2d`` followed by the same
quantizer, bit for bit.  Why (ResNet's stem pool, 3x3 stride 2 padding 1, on the H200 at batch 256): torch's
channels-last fp16 max-pool read 411 MB and wrote 103 MB in 0.83 ms, then each reader quantized its 103 MB again;
here one pass reads the 411 MB and writes the 1-byte (or 2-bit) codes once (docs/decisions/0137).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference_bitplanes import packed_words
from ._host import cdiv, next_power_of_2
from .pack import _quantize_codes, _store_padding, _store_planes, pack_tile
from .quant_bytes import _code_to_x8
from .round import div_by_scalar, fp8_code, fp8_constexprs

__all__ = ["pool_window_int8", "pool_window_pack", "pool_window_fp8", "pool_planes", "pooled_size"]

_TILE = 4096  # elements a program (int8 / fp8 outputs)
# codes a program of the bit-plane variant: (BLOCK_R, BLOCK_W, 32) window maxima stay live through the pool, and a
# 4096-code tile took 114 registers a thread (25% occupancy).  ResNet's stem pool at batch 256 (256 x 112 x 112 x 64
# fp16 -> 2-bit planes, H200): 4096 codes (64 rows) 365 us, 1024 (16 rows) 241 us, 2048 255 us (a scan of
# rows x warps, 4 warps best: docs/decisions/0170)
_PACK_TILE_CODES = 1024
_NOSPEC = ["R", "H", "W", "P", "Q"]
_PLANES_TILE_WORDS = 512  # words a program of pool_planes (per plane): 256 rows of a 64-channel map


@triton.jit
def _window_max(x_ptr, n, p, q, koff, mask, H, W, stride_xn, stride_xh, stride_xw, KH: tl.constexpr,
                KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, init):
    """max(init, the window of output pixel (p, q) of image n) in float32, torch's rule; n, p, q broadcast against
    the channel offsets ``koff`` (any tile rank); pixels outside the image are skipped."""
    m = init
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            h = p * SH - PH + i
            w = q * SW - PW + j
            ok = mask & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            v = tl.load(x_ptr + n * stride_xn + h * stride_xh + w * stride_xw + koff, mask=ok, other=float("-inf"))
            v = v.to(tl.float32)
            m = tl.where((v > m) | (v != v), v, m)
    return m


@triton.jit
def _rows(offs_r, P, Q):
    """Output row r -> (image n as int64, row p, column q) of an (N, P, Q) map."""
    q = offs_r % Q
    t = offs_r // Q
    return (t // P).to(tl.int64), t % P, q


@triton.jit(do_not_specialize=_NOSPEC)
def _pool_window_bytes_kernel(
    x_ptr, scale_ptr, out_ptr, f_ptr,  # out (N, P, Q, C) contiguous, one byte an element; f: the pooled float (HAS_F)
    R, C, H, W, P, Q,  # R = N * P * Q output rows
    stride_xn, stride_xh, stride_xw, stride_xc,
    FP8: tl.constexpr,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, ENC: tl.constexpr,
    BITS: tl.constexpr,
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    HAS_F: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n, p, q = _rows(offs_r, P, Q)
    if EVEN_K:  # a mask constant along the channels: 16-byte loads
        mask = tl.broadcast_to((offs_r < R)[:, None], (BLOCK_R, BLOCK_K))
    else:
        mask = (offs_r < R)[:, None] & (offs_k < C)[None, :]
    m = _window_max(x_ptr, n[:, None], p[:, None], q[:, None], offs_k[None, :] * stride_xc, mask, H, W, stride_xn,
                    stride_xh, stride_xw, KH, KW, SH, SW, PH, PW,
                    tl.full((BLOCK_R, BLOCK_K), float("-inf"), tl.float32))
    scale = tl.load(scale_ptr)
    if FP8:
        c = fp8_code(div_by_scalar(m, scale), F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE)
        v = c.to(tl.uint8)
    else:
        v = _code_to_x8(_quantize_codes(m, scale, LO, HI, OFFSET, SHIFT, BITS), ENC, BITS)
    offs = offs_r.to(tl.int64)[:, None] * C + offs_k[None, :]
    tl.store(out_ptr + offs, v, mask=mask)
    if HAS_F:  # the pooled float too (a residual add reads it): exact, one of the inputs
        tl.store(f_ptr + offs, m.to(f_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_NOSPEC)
def _pool_window_pack_kernel(
    x_ptr, scale_ptr, planes_ptr, f_ptr,
    R, C, Kw, H, W, P, Q,
    stride_xn, stride_xh, stride_xw, stride_xc,
    stride_pb, stride_pr, stride_pw,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    HAS_F: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_w = tl.program_id(1)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = offs_w[:, None] * 32 + tl.arange(0, 32)[None, :]  # (BLOCK_W, 32)
    n, p, q = _rows(offs_r, P, Q)
    k3 = offs_k[None, :, :]
    if EVEN_K:  # whole tiles of channels: a mask constant along them (16-byte loads)
        mask = tl.broadcast_to((offs_r < R)[:, None, None], (BLOCK_R, BLOCK_W, 32))
    else:
        mask = (offs_r[:, None, None] < R) & (k3 < C)
    m = _window_max(x_ptr, n[:, None, None], p[:, None, None], q[:, None, None], k3 * stride_xc, mask, H, W,
                    stride_xn, stride_xh, stride_xw, KH, KW, SH, SW, PH, PW,
                    tl.full((BLOCK_R, BLOCK_W, 32), float("-inf"), tl.float32))
    if HAS_F:  # the pooled float (N, P, Q, C) too (a residual add reads it)
        tl.store(f_ptr + offs_r.to(tl.int64)[:, None, None] * C + k3, m.to(f_ptr.dtype.element_ty), mask=mask)
    c = _quantize_codes(m, tl.load(scale_ptr), LO, HI, OFFSET, SHIFT, BITS)
    codes = tl.where(mask, c, 0)  # channels past C: the zero bits of the row's last word
    _store_planes(codes, planes_ptr, offs_r, offs_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS)
    _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS, BLOCK_W)


@triton.jit
def _invert_sign_plane(w0, w1, w2, BITS: tl.constexpr):
    """Two's complement codes <-> their order: the sign plane (bit BITS - 1) inverted."""
    if BITS == 3:
        w2 = ~w2
    elif BITS == 2:
        w1 = ~w1
    else:
        w0 = ~w0
    return w0, w1, w2


@triton.jit
def _sliced_max(m0, m1, m2, a0, a1, a2, BITS: tl.constexpr):
    """The larger of two codes bit-sliced over the planes (bit BITS - 1 the most significant; 32 codes a word),
    lane by lane: the words of max(m, a)."""
    top_m = m2 if BITS == 3 else (m1 if BITS == 2 else m0)
    top_a = a2 if BITS == 3 else (a1 if BITS == 2 else a0)
    lt = top_a & ~top_m  # lanes where a > m, decided so far
    gt = top_m & ~top_a
    if BITS == 3:
        und = ~(lt | gt)
        lt = lt | (und & a1 & ~m1)
        gt = gt | (und & m1 & ~a1)
    if BITS >= 2:
        lt = lt | (~(lt | gt) & a0 & ~m0)
    return (m0 & ~lt) | (a0 & lt), (m1 & ~lt) | (a1 & lt), (m2 & ~lt) | (a2 & lt)


@triton.jit(do_not_specialize=_NOSPEC)
def _pool_planes_kernel(
    x_ptr, planes_ptr,
    R, CW, Kw, H, W, P, Q,  # CW = ceil(C / 32) words of codes a row
    stride_xb, stride_xr, stride_xw,
    stride_pb, stride_pr, stride_pw,
    BITS: tl.constexpr, TWOS: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_w = tl.program_id(1)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    n, p, q = _rows(offs_r, P, Q)
    row_ok = offs_r < R
    w_ok = offs_w < CW
    # the window's largest codes, bit-sliced: plane b's words; two's complement patterns with their sign plane
    # inverted, so the planes order the codes as their values; 0 (the least) where no pixel was seen yet
    m0 = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    m1 = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    m2 = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            h = p * SH - PH + i
            w = q * SW - PW + j
            ok = (row_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W))[:, None] & w_ok[None, :]
            ptrs = x_ptr + ((n * H + h) * W + w)[:, None] * stride_xr + offs_w[None, :] * stride_xw
            a0 = tl.load(ptrs, mask=ok, other=0)
            a1 = tl.load(ptrs + stride_xb, mask=ok, other=0) if BITS >= 2 else m1
            a2 = tl.load(ptrs + 2 * stride_xb, mask=ok, other=0) if BITS == 3 else m2
            if TWOS:
                a0, a1, a2 = _invert_sign_plane(a0, a1, a2, BITS)
            b0, b1, b2 = _sliced_max(m0, m1, m2, a0, a1, a2, BITS)
            m0 = tl.where(ok, b0, m0)  # padding pixels never win (torch pads with -inf)
            m1 = tl.where(ok, b1, m1)
            m2 = tl.where(ok, b2, m2)
    if TWOS:
        m0, m1, m2 = _invert_sign_plane(m0, m1, m2, BITS)
    out_ok = row_ok[:, None] & (offs_w < Kw)[None, :]
    out = planes_ptr + offs_r.to(tl.int64)[:, None] * stride_pr + offs_w[None, :] * stride_pw
    tl.store(out, tl.where(w_ok[None, :], m0, 0), mask=out_ok)  # (words past the codes': padding, zero)
    if BITS >= 2:
        tl.store(out + stride_pb, tl.where(w_ok[None, :], m1, 0), mask=out_ok)
    if BITS == 3:
        tl.store(out + 2 * stride_pb, tl.where(w_ok[None, :], m2, 0), mask=out_ok)
    _store_padding(planes_ptr, offs_r, pid_w, R, Kw, stride_pb, stride_pr, stride_pw, BITS, BLOCK_W)


def pooled_size(H: int, W: int, window) -> tuple[int, int]:
    """(P, Q) of ``nn.MaxPool2d(kernel, stride, padding)`` (floor) on an H x W map; ``window`` = ((KH, KW), (SH, SW),
    (PH, PW))."""
    (kh, kw), (sh, sw), (ph, pw) = window
    return (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1


def _check(y: torch.Tensor, scale: torch.Tensor, window, what: str):
    if not isinstance(y, torch.Tensor) or y.dim() != 4 or y.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        got = f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{what}: y must be a float16 / bfloat16 / float32 NHWC tensor (N, H, W, C), got {got}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
            or scale.device != y.device:
        raise ValueError(f"{what}: scale must be a one-element float32 tensor on y's device, got "
                         + (f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
                            if isinstance(scale, torch.Tensor) else type(scale).__name__))
    (kh, kw), (sh, sw), (ph, pw) = window
    if min(kh, kw, sh, sw) < 1 or ph < 0 or pw < 0 or 2 * ph > kh or 2 * pw > kw:
        raise ValueError(f"{what}: window {window} is not a max-pool torch accepts (kernel and stride >= 1, "
                         "0 <= padding <= kernel / 2)")
    N, H, W, C = y.shape
    P, Q = pooled_size(H, W, window)
    if P < 1 or Q < 1:
        raise ValueError(f"{what}: the window {window} does not fit the {H} x {W} map")
    return N, H, W, C, P, Q


def _win_kwargs(window) -> dict:
    (kh, kw), (sh, sw), (ph, pw) = window
    return {"KH": kh, "KW": kw, "SH": sh, "SW": sw, "PH": ph, "PW": pw}


def _float_out(y: torch.Tensor, shape, with_float: bool) -> torch.Tensor | None:
    return torch.empty(shape, dtype=y.dtype, device=y.device) if with_float else None


def _bytes(y, scale, window, out_dtype, fp8: bool, fmt_kw: dict, what: str, with_float: bool):
    N, H, W, C, P, Q = _check(y, scale, window, what)
    out = torch.empty((N, P, Q, C), dtype=out_dtype, device=y.device)
    f = _float_out(y, (N, P, Q, C), with_float)
    if out.numel() == 0:
        return out, f
    R = N * P * Q
    bk = min(next_power_of_2(C), 128)
    br = max(1, _TILE // bk)
    _pool_window_bytes_kernel[(cdiv(R, br), cdiv(C, bk))](
        y, scale.reshape(1), out, out if f is None else f, R, C, H, W, P, Q, *y.stride(), FP8=fp8, **fmt_kw,
        **_win_kwargs(window), HAS_F=f is not None, EVEN_K=C % bk == 0, BLOCK_R=br, BLOCK_K=bk)
    return out, f


_NO_F8 = {"F8_MAN": 0, "F8_BIAS": 0, "F8_MAX_BITS": 0, "F8_MIN_NORMAL_BITS": 0, "F8_SUB_SCALE": 0.0}
_NO_INT = {"LO": 0, "HI": 0, "OFFSET": 0, "SHIFT": 0, "ENC": 0, "BITS": 8}


def pool_window_int8(y: torch.Tensor, scale: torch.Tensor, window, bits: int, lo: int, hi: int, offset: int,
                     shift: int, enc: int, *, with_float: bool = False):
    """Launch: y (N, H, W, C) float -> max-pool ``window`` -> (int8 codes (N, P, Q, C) contiguous, as
    ``quant_bytes.pool_quantize_int8`` stores them; the pooled float in y's dtype with ``with_float``, else None).
    The public entry is ``tcprec.ops.qconv.max_pool_quantize``."""
    kw = {"LO": lo, "HI": hi, "OFFSET": offset, "SHIFT": shift, "ENC": enc, "BITS": bits, **_NO_F8}
    return _bytes(y, scale, window, torch.int8, False, kw, "pool_window_int8", with_float)


def pool_window_fp8(y: torch.Tensor, scale: torch.Tensor, window, dtype=torch.float8_e4m3fn, *,
                    with_float: bool = False):
    """Launch: y (N, H, W, C) float -> max-pool ``window`` -> (``fp8(clamp(m / scale))`` (N, P, Q, C) of ``dtype``,
    contiguous: ``fp8_quant.pool_quantize_fp8``'s codes; the pooled float with ``with_float``, else None)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    out, f = _bytes(y, scale, window, torch.uint8, True, {**_NO_INT, **fp8_constexprs(dtype)}, "pool_window_fp8",
                    with_float)
    return out.view(dtype), f


def pool_window_pack(y: torch.Tensor, scale: torch.Tensor, window, bits: int, lo: int, hi: int, offset: int,
                     shift: int, *, compact: bool = False, with_float: bool = False):
    """Launch: y (N, H, W, C) float -> max-pool ``window`` -> (``quantize_pack``'s planes int32 (bits, N*P*Q, Kw):
    Kw = packed_words(C), or ceil(C / 32) with ``compact``; the pooled float with ``with_float``, else None)."""
    N, H, W, C, P, Q = _check(y, scale, window, "pool_window_pack")
    R = N * P * Q
    Kw = cdiv(C, 32) if compact else packed_words(C)
    planes = torch.empty((bits, R, Kw), dtype=torch.int32, device=y.device)
    f = _float_out(y, (N, P, Q, C), with_float)
    if planes.numel() == 0:
        return planes, f
    bw = pack_tile(cdiv(C, 32))[1]
    br = max(1, _PACK_TILE_CODES // (32 * bw))
    _pool_window_pack_kernel[(cdiv(R, br), cdiv(cdiv(C, 32), bw))](
        y, scale.reshape(1), planes, planes if f is None else f, R, C, Kw, H, W, P, Q, *y.stride(), *planes.stride(),
        LO=lo, HI=hi, OFFSET=offset, SHIFT=shift, BITS=bits, **_win_kwargs(window), HAS_F=f is not None,
        EVEN_K=C % (32 * bw) == 0, BLOCK_R=br, BLOCK_W=bw)
    return planes, f


def pool_planes(x: torch.Tensor, shape, window, bits: int, twos: bool, *, compact: bool = False) -> torch.Tensor:
    """Launch: the bit planes ``x`` int32 (bits, N*H*W, words >= ceil(C / 32); bits past C zero) of NHWC codes of
    ``shape`` (N, H, W, C), 1..3 bits -> max-pool ``window`` of the codes (two's-complement patterns ``twos``, else
    unsigned code indices, both ordered as their values), bit-sliced: 32 codes a word, no unpacking -> planes
    (bits, N*P*Q, Kw): Kw = packed_words(C), or ceil(C / 32) with ``compact``.  Quantizing is monotone, so this is
    the codes of the pooled float bit for bit (torch's pool pads with -inf: padding pixels never win; a window always
    holds a pixel of the image).  Why: a ResNet stem that writes its readers' 2-bit planes (51 MB at batch 256) instead
    of its fp16 output (411 MB) for the pool to read (docs/decisions/0172)."""
    N, H, W, C = shape
    if bits not in (1, 2, 3):
        raise ValueError(f"pool_planes pools codes of 1..3 bits, got bits={bits}; pool the float with "
                         "pool_window_pack instead")
    if x.dtype != torch.int32 or x.dim() != 3 or x.shape[0] != bits or x.shape[1] != N * H * W \
            or x.shape[2] < cdiv(C, 32):
        raise ValueError(f"pool_planes: x must be int32 planes (bits={bits}, N*H*W={N * H * W}, >= {cdiv(C, 32)} "
                         f"words), got {x.dtype} {tuple(x.shape)}")
    P, Q = pooled_size(H, W, window)
    R = N * P * Q
    Kw = cdiv(C, 32) if compact else packed_words(C)
    planes = torch.empty((bits, R, Kw), dtype=torch.int32, device=x.device)
    if planes.numel() == 0:
        return planes
    bw = pack_tile(cdiv(C, 32))[1]  # (the word tile of every pack kernel)
    br = max(1, _PLANES_TILE_WORDS // bw)
    _pool_planes_kernel[(cdiv(R, br), cdiv(cdiv(C, 32), bw))](
        x, planes, R, cdiv(C, 32), Kw, H, W, P, Q, *x.stride(), *planes.stride(), BITS=bits, TWOS=twos,
        **_win_kwargs(window), BLOCK_R=br, BLOCK_W=bw)
    return planes
