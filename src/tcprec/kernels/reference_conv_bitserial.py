"""Pure-torch references for the quantized forward convolution (``tcprec.ops.qconv.conv2d``).

Layouts: activations NHWC ``(N, H, W, C)``, weights KRSC ``(K, R, S, C)``, output NHWC
``(N, P, Q, K)``; geometry from ``kernels/conv_geometry.ConvGeometry`` (zero padding)::

    C[n, p, q, k] = sum_{r, s, c} x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * w[k, r, s, c]

on the *decoded integer values* of the codes (the scales come after, in the epilogue).

Three things live here:

* ``conv2d_int``: the ground truth, ``F.conv2d`` on decoded values in float64 (exact: every
  partial sum is an integer far below 2^53), returned as int64 NHWC.
* ``im2col_bits``: the word gather of the bit-serial backend, in plain torch (the Triton kernel
  ``kernels/triton/im2col_bits.py`` must give the same words).  Bit planes of the input are
  ``(bits, N*H*W, Kw_in)``; output row ``m = (n, p, q)`` holds, for tap ``t = r*S + s``, the
  ``Cw = ceil(C/32)`` meaningful words of input pixel ``(n, h, w)`` at word offset ``t*Cw``,
  zeros where ``(h, w)`` falls in the padding, zeros past ``R*S*Cw`` (padded to 16 words).
  Zero words add nothing to AND+popc, and the weight planes use the same per-tap layout
  (``weight_tap_codes``, then packed), so the binary GEMM over these rows is the convolution.
* ``bmma_gemm_reference``: the contract of ``torch.ops.tcprec.bmma_gemm`` (int32 / float /
  packed epilogues) in plain torch, so the whole bit-serial pipeline runs on the CPU in tests.
  Plus the epilogue pieces shared by every backend (activation, pooling, re-quantize + pack).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import IntFormat
from .reference_bitplanes import pack_bitplanes_reference, packed_words, unpack_bitplanes
from . import reference_gemm as rg
from .reference import encode_int
from . import reference_conv_int8_fp8 as rf
from .conv_geometry import ConvGeometry

__all__ = [
    "decode_values",
    "conv2d_int",
    "taps_words",
    "im2col_bits",
    "weight_tap_codes",
    "pack_weight_planes",
    "bmma_gemm_reference",
    "apply_act",
    "pool_nhwc",
    "requant_codes",
    "requant_pack",
]


def decode_values(codes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """Integer codes -> their values as float64 (exact for every <= 8-bit integer format)."""
    if codes.dtype != torch.uint8 or fmt.bits != 8:
        codes = codes.to(torch.int64) & (fmt.n_codes - 1)
    c = codes.to(torch.float64)  # the code as an unsigned integer, exact
    if fmt.encoding == "twos":
        return torch.where(c >= fmt.n_codes // 2, c - fmt.n_codes, c)
    return c * fmt.step + fmt.offset  # integers below 2^10: exact in float64


def conv2d_int(x_codes: torch.Tensor, x_fmt: IntFormat, w_codes: torch.Tensor, w_fmt: IntFormat,
               g: ConvGeometry) -> torch.Tensor:
    """The exact integer convolution of decoded codes: int64 NHWC ``(N, P, Q, K)``.

    x_codes ``(N, H, W, C)``, w_codes ``(K, R, S, C)``; float64 ``F.conv2d`` is exact here, so the weight is decoded a
    chunk of output channels at a time (``reference_conv_int8_fp8.channel_chunks``: the whole layer's float64 weight
    and its decode temporaries were ~32 bytes a weight, 3.3 GB for VGG's fc6) with the same result.
    """
    x = decode_values(x_codes, x_fmt).permute(0, 3, 1, 2)  # (N, C, H, W) float64
    out = torch.empty((g.N, g.P, g.Q, g.K), dtype=torch.int64, device=x_codes.device)
    for k0, k1 in rf.channel_chunks(w_codes):
        w = decode_values(w_codes[k0:k1], w_fmt).permute(0, 3, 1, 2)  # (k, C, R, S) float64
        y = F.conv2d(x, w, stride=g.stride, padding=g.padding, dilation=g.dilation)  # (N, k, P, Q)
        out[..., k0:k1] = y.round().permute(0, 2, 3, 1)  # (N, P, Q, k), integers: exact in int64
        del w, y
    return out


def taps_words(g: ConvGeometry) -> tuple[int, int, int]:
    """(Cw, RSCw, Kw_col): meaningful words a pixel, words of all taps, and that padded to 16."""
    Cw = -(-g.C // 32)
    rscw = g.R * g.S * Cw
    return Cw, rscw, packed_words(rscw * 32)


def im2col_bits(planes: torch.Tensor, g: ConvGeometry) -> torch.Tensor:
    """Word gather over packed planes: ``(bits, N*H*W, Kw_in)`` -> ``(bits, N*P*Q, Kw_col)`` int32."""
    bits = planes.shape[0]
    Cw, rscw, kw_col = taps_words(g)
    dev = planes.device
    x = planes[:, :, :Cw].reshape(bits, g.N, g.H, g.W, Cw)  # (bits, N, H, W, Cw)
    ph, pw = g.padding
    x = F.pad(x, (0, 0, pw, pw, ph, ph))  # (bits, N, H+2ph, W+2pw, Cw), zero words in the padding
    p = torch.arange(g.P, device=dev) * g.stride[0]
    q = torch.arange(g.Q, device=dev) * g.stride[1]
    r = torch.arange(g.R, device=dev) * g.dilation[0]
    s = torch.arange(g.S, device=dev) * g.dilation[1]
    hh = (p[:, None] + r[None, :])  # (P, R) padded row index
    ww = (q[:, None] + s[None, :])  # (Q, S)
    cols = x[:, :, hh[:, None, :, None], ww[None, :, None, :], :]  # (bits, N, P, Q, R, S, Cw)
    cols = cols.reshape(bits, g.N * g.P * g.Q, rscw)  # (bits, M, R*S*Cw), tap-major words
    return F.pad(cols, (0, kw_col - rscw)).contiguous()  # (bits, M, Kw_col)


def conv_tap_words(C: int) -> int:
    """Words a tap takes in the implicit-GEMM convolution's K layout: ceil(C / 32) rounded up to an even number
    (whole 8-byte halves of 16-byte chunks: the kernel gathers a tap with cp.async of 16 bytes, or of 8 where the
    tap or the row is not whole 16-byte chunks -- C = 64: 2 words a tap, and compact rows of 2 words serve)."""
    return -(-C // 64) * 2


def implicit_conv_fits(kin: int, cwt: int, H: int, W: int, ph: int, pw: int) -> bool:
    """Whether input planes with ``kin``-word rows can be gathered by the implicit-GEMM convolution with taps of
    ``cwt`` words: whole 8-byte copies (both even, ``kin >= cwt``), and window origins that fit the kernel's int16
    halves (H, W <= 32767, padding <= 16383)."""
    return cwt % 2 == 0 and kin % 2 == 0 and kin >= cwt and max(H, W) <= 32767 and max(ph, pw) <= 16383


def weight_tap_codes(w_codes: torch.Tensor, tap_words: int | None = None) -> torch.Tensor:
    """KRSC codes -> the rows the weight planes pack in the im2col word layout: ``(K, R*S*Cw*32)``
    (``tcprec.pack_bitplanes`` of them gives int32 ``(bits, K, Kw_col)``).

    Each tap's C codes are padded with zero codes to ``Cw*32`` so that tap ``t`` starts at word
    ``t*Cw``, as in :func:`im2col_bits`; ``tap_words`` (>= Cw) pads each tap to that many words instead (the
    implicit-GEMM layout, :func:`conv_tap_words`).  (A zero code has all-zero planes: it adds nothing to
    AND+popc nor to the row sums of the corrections, whatever the format.)
    """
    K, R, S, C = w_codes.shape
    Cw = tap_words or -(-C // 32)
    wc = F.pad(w_codes, (0, Cw * 32 - C))  # (K, R, S, Cw*32) zero codes past C
    return wc.reshape(K, R * S * Cw * 32)  # (K, R*S*Cw*32): tap t at codes t*Cw*32 ..


def pack_weight_planes(w_codes: torch.Tensor, bits: int, *, tap_words: int | None = None) -> torch.Tensor:
    """``weight_tap_codes`` packed by the reference packer: int32 ``(bits, K, Kw_col)`` (``tcprec.ops.qconv``
    packs the same codes with ``tcprec.pack_bitplanes``, the Triton kernel on CUDA: the same bits)."""
    return pack_bitplanes_reference(weight_tap_codes(w_codes, tap_words), bits)


def _weighted_S(a_planes, w_planes, a_twos: bool, w_twos: bool) -> torch.Tensor:
    p, q = a_planes.shape[0], w_planes.shape[0]
    kbits = a_planes.shape[-1] * 32
    pop = rg.popcount_gemm(a_planes, w_planes, kbits)  # (p, M, q, N) over the whole plane width
    fa, fw = IntFormat(p, signed=a_twos), IntFormat(q, signed=w_twos)
    S = torch.zeros(a_planes.shape[1], w_planes.shape[1], dtype=torch.int64, device=a_planes.device)
    for i, wi in enumerate(rg.plane_weights(fa)):
        for j, wj in enumerate(rg.plane_weights(fw)):
            S += (wi * wj) * pop[i, :, j, :]
    return S


def implicit_conv_rows(a_planes: torch.Tensor, w_planes: torch.Tensor, conv) -> torch.Tensor:
    """The implicit-GEMM convolution's A operand (``torch.ops.tcprec.bmma_gemm`` with ``conv``), gathered
    explicitly: row (n, p, q), word ``t * CWT + i`` = word i of input pixel (n, p*sh - ph + r*dh, q*sw - pw + s*dw)
    for tap t = r*S + s, zero outside the image and past the R*S taps; as wide as ``w_planes``' rows."""
    H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, cwt = conv
    bits, rows, _ = a_planes.shape
    g = ConvGeometry(rows // (H * W), H, W, cwt * 32, w_planes.shape[1], R, S, (sh, sw), (ph, pw), (dh, dw))
    a = im2col_bits(a_planes[:, :, :cwt].contiguous(), g)[..., : R * S * cwt]  # taps of cwt words
    return F.pad(a, (0, w_planes.shape[2] - R * S * cwt))


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    """int64 -> the int32 value it wraps to (mod 2^32), as int64."""
    return ((v + 2**31) % 2**32) - 2**31


def check_conv_row_scale(conv, row_scale) -> None:
    """The bit-serial GEMM's contract: an implicit convolution (``conv``) takes no row scale -- its GEMM rows are output
    pixels and the kernel applies none -- so it is refused, naming the fix (bmma_gemm._bmma_gemm and the reference)."""
    if conv is not None and row_scale is not None:
        raise ValueError("row_scale with conv: a convolution's GEMM rows are output pixels and its kernel applies no "
                         "row scale; fold a per-tensor activation scale into col_scale and pass row_scale=None")


def bmma_gemm_reference(a_planes, w_planes, a_twos, w_twos, ss, row_term, col_term, row_scale, col_scale, bias,
                        relu, out_kind, out_bits, out_encoding, out_scale, tile="", leaky_slope=0.0, pdl=True,
                        conv=None, residual=None, out_compact=False, dual_out=None, row_affine=None):
    """``torch.ops.tcprec.bmma_gemm``'s contract in plain torch (same arguments, same result):
    ``C = ss * S + row_term[m] + col_term[n]`` (int32), then the float or packed epilogue.  ``tile`` and ``pdl``
    (how the kernel launches) do not change the result and are ignored.  With ``conv`` the A operand is
    :func:`implicit_conv_rows` of the input planes; with ``residual`` (float out_kind) ``act(rd(rd(y) + residual))``,
    rd the rounding to the output dtype; ``out_compact`` (packed): rows of ceil(N / 32) words, unpadded;
    ``dual_out`` (16-bit float out_kind): also filled with the compact planes of the output's codes;
    ``row_affine = (row_mul, row_add)`` instead of ``row_term``: ``row_term = row_mul * R + row_add`` with R the
    weighted popcount of A's rows as multiplied (int32, wrapping like the kernel's); a ``row_scale`` with ``conv`` is
    refused as the kernel refuses it (:func:`check_conv_row_scale`)."""
    check_conv_row_scale(conv, row_scale)
    if conv is not None:
        a_planes = implicit_conv_rows(a_planes, w_planes, conv)
    if row_affine is not None:
        if row_term is not None:
            raise ValueError("pass row_term or row_affine=(row_mul, row_add), not both")
        fa = IntFormat(a_planes.shape[0], signed=a_twos)
        R = rg.weighted_rowsums(a_planes, fa).to(torch.int64)
        row_term = _wrap32(int(row_affine[0]) * R + int(row_affine[1]))
    C = ss * _weighted_S(a_planes, w_planes, a_twos, w_twos)  # (M, N) int64
    if row_term is not None:
        C = C + row_term.to(torch.int64)[:, None]
    if col_term is not None:
        C = C + col_term.to(torch.int64)[None, :]
    if out_kind == "int32":
        return C.to(torch.int32)
    y = rg.float_epilogue(C, row_scale, col_scale, bias, False, torch.float32)
    if residual is not None:
        if out_kind not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"residual is added by the float epilogue: out_kind must be float32, float16 or "
                             f"bfloat16, got {out_kind!r}")
        od = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[out_kind]
        y = (y.to(od).to(torch.float32) + residual.to(torch.float32)).to(od).to(torch.float32)
    if relu:  # y < 0 -> leaky_slope * y (0: ReLU), one float32 multiply, as the kernel
        y = apply_act(y, ("leaky", leaky_slope) if leaky_slope else "relu")
    if out_kind == "packed":
        planes = requant_pack(y, IntFormat(out_bits, encoding=out_encoding), out_scale)
        return planes[:, :, :-(-y.shape[1] // 32)].contiguous() if out_compact else planes
    out = y.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[out_kind])
    if dual_out is not None:  # the stored values' codes (what quantize_pack of the output gives)
        planes = requant_pack(out.to(torch.float32), IntFormat(out_bits, encoding=out_encoding), out_scale)
        dual_out.copy_(planes[:, :, :dual_out.shape[2]])
    return out


# ------------------------------------------------------------------------------------------------
# Epilogue pieces after the GEMM (every backend)
# ------------------------------------------------------------------------------------------------


def apply_act(y: torch.Tensor, act) -> torch.Tensor:
    """None / "relu" / ("leaky", slope) on float32 ``y``: one float32 multiply for leaky (the bit-serial GEMM's
    epilogue).  ("clamp", lo, hi), "hardswish", "silu" (which the bit-serial GEMM does not offer; the torch epilogues
    of ``ops.qconv`` do): ``reference_conv_int8_fp8.apply_act``'s, the INT8 / FP8 kernels' float32 operations."""
    if act is None:
        return y
    if act == "relu":
        return torch.where(y < 0, torch.zeros_like(y), y)
    if isinstance(act, tuple) and act[0] == "leaky":
        return torch.where(y < 0, y * float(act[1]), y)
    return rf.apply_act(y, act)


def pool_nhwc(y: torch.Tensor, pool) -> torch.Tensor:
    """2x2 pooling of NHWC float ``y``: ("max", 2, 2), ("avg", 2, 2) (floor: an odd last row or
    column is dropped, as nn.MaxPool2d), or ("max", 2, 1), darknet's size-keeping max-pool that
    pads right and bottom by one (with -inf, so the border takes the max of what exists)."""
    if pool is None:
        return y
    kind, k, s = pool
    t = y.permute(0, 3, 1, 2)  # (N, K, P, Q) view of NHWC
    if kind == "max" and s == 1:
        t = F.pad(t, (0, 1, 0, 1), value=float("-inf"))
        t = F.max_pool2d(t, k, 1)
    elif kind == "max":
        t = F.max_pool2d(t, k, s)
    else:
        t = F.avg_pool2d(t, k, s)
    return t.permute(0, 2, 3, 1).contiguous()  # (N, P', Q', K)


def pool_planes(planes: torch.Tensor, shape: tuple, pool, fmt: IntFormat) -> torch.Tensor:
    """A max ``pool`` (as :func:`pool_nhwc`) of packed codes ``planes`` (bits, N*P*Q, Kw) of NHWC ``shape``,
    in the order of the values (two's complement patterns compared with the sign bit flipped) -> planes of the
    pooled activation.  Quantizing is monotone, so this equals pooling the floats, then quantizing."""
    N, P, Q, K = shape
    flip = 1 << (fmt.bits - 1) if fmt.encoding == "twos" else 0
    idx = (unpack_bitplanes(planes, fmt.bits, K).reshape(N, P, Q, K).to(torch.int64) ^ flip).to(torch.float64)
    pooled = pool_nhwc(idx, pool).to(torch.int64) ^ flip  # indices < 256: exact in float64, -inf pads lose
    return pack_bitplanes_reference(pooled.reshape(-1, K).to(torch.uint8), fmt.bits)


def requant_codes(y: torch.Tensor, fmt: IntFormat, out_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``(..., K)`` -> uint8 codes ``(prod(...), K)``: ``y / out_scale``, saturated to the
    format's range, rounded to nearest (ties to even).  Packed (``requant_pack``, or
    ``tcprec.pack_bitplanes`` on the device), they equal the bit-serial kernel's packed epilogue and
    ``reference_gemm.pack_output``; no host sync, so it runs inside a CUDA graph capture."""
    K = y.shape[-1]
    v = y.reshape(-1, K).to(torch.float32) / out_scale.to(torch.float32).reshape(())
    v = torch.clamp(v, float(fmt.min), float(fmt.max))
    return encode_int(v, fmt, "nearest").to(torch.uint8)  # (rows, K) code patterns


def requant_pack(y: torch.Tensor, fmt: IntFormat, out_scale: torch.Tensor) -> torch.Tensor:
    """``requant_codes`` packed: planes ``(bits, prod(...), packed_words(K))``."""
    return pack_bitplanes_reference(requant_codes(y, fmt, out_scale), fmt.bits)
