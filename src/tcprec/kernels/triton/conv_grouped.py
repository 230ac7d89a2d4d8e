"""Grouped / depthwise quantized convolution: a direct Triton conv, integer codes in and int32 accumulation, or
e4m3 codes in and float32 accumulation.

What and why.  A depthwise 3x3 conv does 9 multiply-adds per output and reads each input once per tap: it is
memory-bound, and the tensor cores' K-dimension (>= 16 or 32 per MMA) has nothing to reduce over (Cg = 1).  So
this kernel runs on the CUDA cores, one program per BLOCK_M output pixels x BLOCK_K output channels, NHWC so
that the BLOCK_K channels of one pixel are contiguous loads::

    for each tap (r, s):                                 # static, R*S <= 49
        ih, iw = p*sh - pt + r*dh, q*sw - pl + s*dw      # (BLOCK_M,) input pixel, masked outside the image
        for c in range(Cg):                              # 1 for depthwise
            x = decode(codes[n, ih, iw, g(k)*Cg + c])    # (BLOCK_M, BLOCK_K) uint8 -> int32 / float32 values
            acc += x * w[k, r, s, c]                     # int32: exact; float32: the product exact, the add rounds
    y = act(float32(acc) * col[k] + bias[k])             # the dense conv's epilogue (or acc itself, OUT_ACC)

The integer depthwise loop is bound by integer instructions, not bytes (a byte's sign extension and a multiply-add
an element a tap).  On CUDA, with 8-bit weights over byte operands, it sums 4 taps x 4 channels an instruction
instead (``DP4A``: 8 byte permutes transpose 4 taps' words of 4 channels, 4 ``dp4a`` add them; inline PTX, so the
interpreter runs the plain loop and tests/test_grouped_conv.py builds this variant for sm_90 ahead of time;
docs/decisions/0152).

Integer codes (X_FP8=False; uint8 codes, or the INT8 kernels' int8 operand whose value is off + step * x8, as the
dense INT8 layers take it): exact against ``kernels/reference_conv_grouped.grouped_conv_int`` (int32 bit for
bit).  e4m3 codes (X_FP8=True): decoded with integer ops (any CUDA GPU, no fp8 conversion instruction needed), the
weights come as float32 values; the sum runs in ``grouped_conv_f32``'s order and every e4m3 x e4m3 product is exact
in float32, so the accumulator equals that reference bit for bit, on a GPU too (an FMA of an exact product rounds
like the add).  tests/test_grouped_conv.py runs both through TRITON_INTERPRET=1.  The float epilogue may contract
``acc * col + bias`` into one FMA on a GPU (one rounding instead of two), so float outputs agree to 1 ulp before
the activation there, bit for bit under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...memo import remembered
from ._host import cdiv, interpreting

__all__ = ["grouped_conv", "ACT_CODES"]

ACT_CODES = {None: 0, "relu": 1, "leaky": 2, "clamp": 3, "hardswish": 4, "silu": 5}


@triton.jit
def _decode_e4m3(u):
    """float8_e4m3fn code (int32 0..255) -> its float32 value, exactly: (1 + m/8) * 2**(e-7), m * 2**-9 when e = 0,
    NaN for S.1111.111 (e4m3fn has no infinities)."""
    e = (u >> 3) & 15
    m = u & 7
    bits = ((e + 120) << 23) | (m << 20)  # float32 exponent e - 7 + 127, the 3 mantissa bits on top
    bits = tl.where((u & 127) == 127, 0x7FC00000, bits)  # the quiet NaN of float32
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, bits.to(tl.float32, bitcast=True))  # subnormal: m * 2**-9
    return tl.where(u >= 128, -mag, mag)


def _dp4a_asm(x_type: str) -> str:
    """PTX: 8 byte permutes transpose 4 taps x 4 channels ($4..$7: a tap's 4 channels a word) into 4 channels x 4
    taps, and 4 dp4a add each channel's 4 products to its sum ($0..$3 = $12..$15 + ..., weights $8..$11)."""
    return """{
    .reg .b32 l01, h01, l23, h23, t0, t1, t2, t3;
    prmt.b32 l01, $4, $5, 0x5140;
    prmt.b32 h01, $4, $5, 0x7362;
    prmt.b32 l23, $6, $7, 0x5140;
    prmt.b32 h23, $6, $7, 0x7362;
    prmt.b32 t0, l01, l23, 0x5410;
    prmt.b32 t1, l01, l23, 0x7632;
    prmt.b32 t2, h01, h23, 0x5410;
    prmt.b32 t3, h01, h23, 0x7632;
    dp4a.XT.s32 $0, t0, $8, $12;
    dp4a.XT.s32 $1, t1, $9, $13;
    dp4a.XT.s32 $2, t2, $10, $14;
    dp4a.XT.s32 $3, t3, $11, $15;
    }""".replace("XT", x_type)


_DP4A_SIGNED = tl.constexpr(_dp4a_asm("s32"))  # signed bytes (the int8 operand's x8, int8 codes)
_DP4A_UNSIGNED = tl.constexpr(_dp4a_asm("u32"))  # unsigned codes


@triton.jit
def _dp4a_taps4(x0, x1, x2, x3, w0, w1, w2, w3, a0, a1, a2, a3, X_SIGNED: tl.constexpr):
    """Four taps x four channels: x_i holds tap i's codes of channels 0..3 (a byte each), w_j channel j's weights of
    taps 0..3; a_j += sum_i x_i[j] * w_j[i], exact in int32.  Inline PTX: CUDA only (the interpreter runs the
    kernel's plain loop)."""
    return tl.inline_asm_elementwise(_DP4A_SIGNED if X_SIGNED else _DP4A_UNSIGNED,
                                     "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [x0, x1, x2, x3, w0, w1, w2, w3, a0, a1, a2, a3],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _tap_words(x32, T: tl.constexpr, base, ih0, iw0, m_ok, offs_c, H, W, C4, dil_h, dil_w, R: tl.constexpr,
               S: tl.constexpr, EVEN_K: tl.constexpr, K4, BLOCK_M: tl.constexpr, KQ: tl.constexpr):
    """(BLOCK_M, KQ) int32 words of tap T, 4 channels' codes each (0 past the last tap and outside the image).
    ``base``: each pixel's word offset of its window's corner (ih0, iw0), channel 0."""
    if T < R * S:
        ih = ih0 + (T // S) * dil_h
        iw = iw0 + (T % S) * dil_w
        ok = m_ok & (ih.to(tl.uint32, bitcast=True) < H) & (iw.to(tl.uint32, bitcast=True) < W)  # (0 <= i < n)
        xp = x32 + (base + ((T // S) * dil_h * W + (T % S) * dil_w) * C4)[:, None] + offs_c[None, :]
        if EVEN_K:
            return tl.load(xp, mask=ok[:, None], other=0)
        else:
            return tl.load(xp, mask=ok[:, None] & (offs_c < K4)[None, :], other=0)
    else:
        return tl.zeros((BLOCK_M, KQ), dtype=tl.int32)


@triton.jit
def _quad_weights(wp, K4, offs_c, EVEN_K: tl.constexpr):
    """(1, KQ) words of one channel of each quad (wp: its row of the (G, 4, K/4) weights)."""
    if EVEN_K:
        return tl.load(wp + offs_c)[None, :]
    else:
        return tl.load(wp + offs_c, mask=offs_c < K4, other=0)[None, :]


@triton.jit
def _grouped_conv_kernel(
    # tensors
    x_ptr, w_ptr, col_ptr, bias_ptr, y_ptr, sat_ptr, wq_ptr,
    # geometry
    N, H, W, C, K, P, Q, Cg, Kg,
    stride_h, stride_w, pad_t, pad_l, dil_h, dil_w,
    # epilogue scalars: leaky slope, or clamp bounds
    act_a, act_b,
    R: tl.constexpr, S: tl.constexpr,
    X_BITS: tl.constexpr, X_TWOS: tl.constexpr,  # integer activation codes: two's complement of X_BITS, or unsigned
    X_FP8: tl.constexpr,  # e4m3 activation codes, float32 weight values and accumulator (X_BITS / X_TWOS unused)
    X_I8: tl.constexpr, X_OFF: tl.constexpr, X_STEP: tl.constexpr,  # int8 storage: value = X_OFF + X_STEP * x8
    DW: tl.constexpr,  # depthwise (one input channel a group, one filter a group): channel k reads channel k
    DP4A: tl.constexpr,  # depthwise bytes (the int8 operand, or unsigned codes) summed 4 taps at a time by dp4a
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no channel mask
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, OUT_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixel n*P*Q + p*Q + q
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # output channel
    m_ok = offs_m < N * P * Q
    k_ok = offs_k < K
    n = offs_m // (P * Q)
    pq = offs_m % (P * Q)
    p = pq // Q
    q = pq % Q
    # -- main loop: taps x channels of the group, int32 (float32 for e4m3) accumulation ---------------
    if X_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    if DW:
        # depthwise: channel k reads channel k, so a pixel's BLOCK_K codes are one contiguous (vector) load, unmasked
        # along the channels when K % BLOCK_K == 0 (EVEN_K); the weights come as int32 (R*S, K), one vector a tap (no
        # widening in the loop).  Codes outside the image load as 0, the value 0 of the code formats.  The int8
        # operand's offset is summed after the loop: sum_valid (X_OFF + X_STEP * x8) * w
        # = X_STEP * sum x8 * w + X_OFF * sum_valid w, the last a rectangle of the taps (the valid rows and columns of
        # a pixel are each one run) read from the weights' summed-area table sat (R+1, S+1, K), only at the pixels
        # whose window the border cuts (the others take its total; H200: docs/decisions/0152).
        if DP4A:  # 4 taps x 4 channels an instruction: words of 4 channels' bytes, the weights packed 4 taps a word
            KQ: tl.constexpr = BLOCK_K // 4
            offs_c = pid_k * KQ + tl.arange(0, KQ)  # channel quads
            x32 = x_ptr.to(tl.pointer_type(tl.int32))
            C4 = C // 4
            K4 = K // 4
            ih0 = p * stride_h - pad_t
            iw0 = q * stride_w - pad_l
            base = ((n.to(tl.int64) * H + ih0) * W + iw0) * C4  # the window corner's word (may lie outside)
            a0 = tl.zeros((BLOCK_M, KQ), dtype=tl.int32)
            a1 = tl.zeros((BLOCK_M, KQ), dtype=tl.int32)
            a2 = tl.zeros((BLOCK_M, KQ), dtype=tl.int32)
            a3 = tl.zeros((BLOCK_M, KQ), dtype=tl.int32)
            for g in tl.static_range((R * S + 3) // 4):
                x0 = _tap_words(x32, 4 * g, base, ih0, iw0, m_ok, offs_c, H, W, C4, dil_h, dil_w, R, S, EVEN_K, K4,
                                BLOCK_M, KQ)
                x1 = _tap_words(x32, 4 * g + 1, base, ih0, iw0, m_ok, offs_c, H, W, C4, dil_h, dil_w, R, S, EVEN_K,
                                K4, BLOCK_M, KQ)
                x2 = _tap_words(x32, 4 * g + 2, base, ih0, iw0, m_ok, offs_c, H, W, C4, dil_h, dil_w, R, S, EVEN_K,
                                K4, BLOCK_M, KQ)
                x3 = _tap_words(x32, 4 * g + 3, base, ih0, iw0, m_ok, offs_c, H, W, C4, dil_h, dil_w, R, S, EVEN_K,
                                K4, BLOCK_M, KQ)
                wp = wq_ptr + g * K  # (G, 4, K/4) words: [g, j, c] = channel 4c + j's weights of taps 4g .. 4g+3
                a0, a1, a2, a3 = _dp4a_taps4(x0, x1, x2, x3, _quad_weights(wp, K4, offs_c, EVEN_K),
                                             _quad_weights(wp + K4, K4, offs_c, EVEN_K),
                                             _quad_weights(wp + 2 * K4, K4, offs_c, EVEN_K),
                                             _quad_weights(wp + 3 * K4, K4, offs_c, EVEN_K), a0, a1, a2, a3,
                                             X_I8 or X_TWOS)
            # channel 4c + j is a_j[:, c]: interleave back to (BLOCK_M, BLOCK_K) in offs_k's order
            acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_M, BLOCK_K))
        else:
            for r in tl.static_range(R):
                ih = p * stride_h - pad_t + r * dil_h
                row_ok = m_ok & (ih >= 0) & (ih < H)
                row = (n.to(tl.int64) * H + ih) * W
                for s in tl.static_range(S):
                    iw = q * stride_w - pad_l + s * dil_w
                    pix_ok = row_ok & (iw >= 0) & (iw < W)
                    xp = x_ptr + ((row + iw) * C)[:, None] + offs_k[None, :]
                    if EVEN_K:
                        mask = pix_ok[:, None]
                        wv = tl.load(w_ptr + (r * S + s) * K + offs_k)
                    else:
                        mask = pix_ok[:, None] & k_ok[None, :]
                        wv = tl.load(w_ptr + (r * S + s) * K + offs_k, mask=k_ok, other=0)
                    if X_FP8:
                        acc += _decode_e4m3(tl.load(xp, mask=mask, other=0).to(tl.int32)) * wv[None, :]
                    else:  # uint8 codes, the int8 operand's x8 (sign-extended), or X_BITS-bit two's complement
                        u = tl.load(xp, mask=mask, other=0).to(tl.int32)  # code 0: value 0 in both encodings
                        if X_TWOS and not X_I8:
                            u = u - ((u >> (X_BITS - 1)) << X_BITS)  # sign-extend the X_BITS-bit pattern
                        acc += u * wv[None, :]
        if X_I8:
            if X_STEP != 1:
                acc = acc * X_STEP
            if X_OFF != 0:  # + X_OFF * (the weights of the pixel's valid taps: a rectangle of the summed-area table)
                r_lo = tl.zeros((BLOCK_M,), dtype=tl.int32)  # taps above the image: rows [0, r_lo)
                r_hi = tl.full((BLOCK_M,), R, dtype=tl.int32)  # taps below it: rows [r_hi, R)
                for r in tl.static_range(R):
                    ih = p * stride_h - pad_t + r * dil_h
                    r_lo += (ih < 0).to(tl.int32)
                    r_hi -= (ih >= H).to(tl.int32)
                s_lo = tl.zeros((BLOCK_M,), dtype=tl.int32)
                s_hi = tl.full((BLOCK_M,), S, dtype=tl.int32)
                for s in tl.static_range(S):
                    iw = q * stride_w - pad_l + s * dil_w
                    s_lo += (iw < 0).to(tl.int32)
                    s_hi -= (iw >= W).to(tl.int32)
                # a window the border does not cut takes the table's total (one vector a program); the 4 reads
                # are masked to the pixels whose window it cuts
                full = (r_lo == 0) & (r_hi == R) & (s_lo == 0) & (s_hi == S)
                total = tl.load(sat_ptr + ((R * (S + 1) + S) * K) + offs_k, mask=k_ok, other=0)
                sp = sat_ptr + offs_k[None, :]
                cmask = (m_ok & ~full)[:, None] & k_ok[None, :]
                rect = tl.load(sp + ((r_hi * (S + 1) + s_hi) * K)[:, None], mask=cmask, other=0)
                rect -= tl.load(sp + ((r_lo * (S + 1) + s_hi) * K)[:, None], mask=cmask, other=0)
                rect -= tl.load(sp + ((r_hi * (S + 1) + s_lo) * K)[:, None], mask=cmask, other=0)
                rect += tl.load(sp + ((r_lo * (S + 1) + s_lo) * K)[:, None], mask=cmask, other=0)
                acc += X_OFF * tl.where(full[:, None], total[None, :], rect)
    else:
        ch0 = (offs_k // Kg) * Cg  # first input channel of k's group
        for r in tl.static_range(R):
            for s in tl.static_range(S):
                ih = p * stride_h - pad_t + r * dil_h
                iw = q * stride_w - pad_l + s * dil_w
                pix_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                base = ((n.to(tl.int64) * H + ih) * W + iw) * C  # (BLOCK_M,) offset of the pixel's channel 0
                mask = pix_ok[:, None] & k_ok[None, :]
                for c in range(0, Cg):
                    u = tl.load(x_ptr + base[:, None] + (ch0 + c)[None, :], mask=mask, other=0).to(tl.int32)
                    wv = tl.load(w_ptr + ((offs_k * R + r) * S + s) * Cg + c, mask=k_ok, other=0)
                    if X_FP8:
                        xv = _decode_e4m3(u)  # code 0 outside the image: value +0
                        acc += xv * wv[None, :]
                    else:
                        if X_I8:
                            u = X_OFF + X_STEP * u  # the int8 load is sign-extended: the stored x8
                        elif X_TWOS:
                            u = u - ((u >> (X_BITS - 1)) << X_BITS)  # sign-extend the X_BITS-bit pattern
                        u = tl.where(mask, u, 0)  # value 0 outside the image, whatever the encoding
                        acc += u * wv.to(tl.int32)[None, :]

    # -- epilogue -----------------------------------------------------------------------------------------
    out = offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    if EVEN_K:
        omask = m_ok[:, None]  # constant along the channels: vector stores
    else:
        omask = m_ok[:, None] & k_ok[None, :]
    if OUT_ACC:
        tl.store(y_ptr + out, acc, mask=omask)
    else:
        col = tl.load(col_ptr + offs_k, mask=k_ok, other=0.0)
        y = acc.to(tl.float32) * col[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_k, mask=k_ok, other=0.0)[None, :]
        if ACT == 1:
            y = tl.where(y < 0, 0.0, y)
        elif ACT == 2:
            y = tl.where(y < 0, y * act_a, y)
        elif ACT == 3:
            y = tl.minimum(tl.maximum(y, act_a), act_b)
        elif ACT == 4:
            y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) / 6.0
        elif ACT == 5:
            y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=omask)


# What the depthwise launch derives from the weights alone (summed-area table, dp4a words, transposed taps), by the
# weight tensor (tcprec.memo): a layer's weights come back unchanged on every call, and these were 3-5 small kernels a
# layer a forward.
_DERIVED: dict = {}


def _summed_area_table(w_values: torch.Tensor, K: int, R: int, S: int) -> torch.Tensor:
    """(R+1, S+1, K) int32: [r, s, k] = sum of w[k, :r, :s] (the depthwise weights (K, R, S, 1))."""
    sat = torch.zeros((R + 1, S + 1, K), dtype=torch.int32, device=w_values.device)
    sat[1:, 1:] = w_values.reshape(K, R, S).to(torch.int32).cumsum(1, dtype=torch.int32).cumsum(
        2, dtype=torch.int32).permute(1, 2, 0)
    return sat


def _dp4a_words(w_values: torch.Tensor, K: int, R: int, S: int) -> torch.Tensor:
    """(G, 4, K/4) int32, G = ceil(R*S / 4): [g, j, c] holds w[4c + j, tap 4g + i] in byte i (taps past R*S: 0)."""
    G = cdiv(R * S, 4)
    wt = torch.zeros((G, 4, K), dtype=torch.int8, device=w_values.device)  # [g, i, k] = w[k, tap 4g + i]
    wt.view(4 * G, K)[:R * S] = w_values.reshape(K, R * S).t()
    return wt.view(G, 4, K // 4, 4).permute(0, 3, 2, 1).contiguous().view(torch.int32).reshape(G, 4, K // 4)


def grouped_conv(codes: torch.Tensor, x_bits: int, x_twos: bool, w_values: torch.Tensor, groups: int, stride, pad4,
                 dilation, P: int, Q: int, col: torch.Tensor | None = None, bias: torch.Tensor | None = None, act=None,
                 out_dtype: torch.dtype = torch.int32, x_fp8: bool = False, x_affine: tuple[int, int] | None = None,
                 block_m: int | None = None, block_k: int | None = None, w_int8: bool = False) -> torch.Tensor:
    """codes: uint8 (N, H, W, C) contiguous, integer codes of ``x_bits`` or (``x_fp8``) float8_e4m3fn bit patterns,
    or (``x_affine=(off, step)``) int8, the INT8 kernels' operand (``ShiftedInt8``: value = off + step * x8);
    w_values: (K, R, S, Cg) contiguous, int16 integers (float32 e4m3 values for ``x_fp8``) -> (N, P, Q, K) in
    ``out_dtype``.  ``col=None``: the raw accumulator (int32, or float32 for ``x_fp8``).  ``w_int8``: the caller
    vouches that every weight value is in [-128, 127] (its format says so): a depthwise conv of bytes that are their
    value (the int8 operand's x8, unsigned codes, int8 codes) over C % 4 == 0 channels then sums 4 taps an
    instruction (dp4a) on CUDA (codes 4-byte aligned, as allocations are).  What is derived from the weights alone
    (the packed words, the summed-area table, the transposed taps) is remembered for ``w_values`` (tcprec.memo: made
    again after an in-place change).  Checks, allocates, launches; the ops layer validated the rest."""
    N, H, W, C = codes.shape
    K, R, S, Cg = w_values.shape
    w_dtype, acc_dtype = (torch.float32, torch.float32) if x_fp8 else (torch.int16, torch.int32)
    x_dtype = torch.uint8 if x_affine is None else torch.int8
    if codes.dtype != x_dtype or w_values.dtype != w_dtype or (x_fp8 and x_affine is not None):
        raise TypeError(f"grouped_conv takes {x_dtype} codes and {w_dtype} weight values"
                        f"{' (x_fp8)' if x_fp8 else ''}, got {codes.dtype}, {w_values.dtype}"
                        f"{' (x_affine needs integer codes)' if x_fp8 and x_affine is not None else ''}")
    if col is None and out_dtype != acc_dtype:
        raise ValueError(f"col=None returns the raw accumulator: out_dtype must be {acc_dtype}, got {out_dtype}")
    y = torch.empty((N, P, Q, K), dtype=out_dtype, device=codes.device)
    dw = Cg == 1 and K == groups
    if block_k is None:  # depthwise: a channel block that divides K (no channel mask); <= 2048 outputs a program
        # (wider tiles spill at 5x5: 64 x 64 ran 4x slower), 32 pixels for 5x5 windows on maps of <= 14 x 14
        # (H200, EfficientNet-Lite0's depthwise convs at batch 256: docs/decisions/0151)
        block_k = (32 if K % 32 == 0 else 16) if dw else 32
    if block_m is None:
        block_m = 32 if dw and R * S > 9 and P * Q <= 196 else 64
    dummy = torch.empty(1, dtype=torch.float32, device=codes.device)

    def derived(kind, make):  # a tensor of the weights alone, remembered for them
        return remembered(_DERIVED, (w_values,), make, (kind,))

    sat = dummy
    if dw and not x_fp8 and x_affine is not None and int(x_affine[0]) != 0:  # the weights' summed-area table
        sat = derived("sat", lambda: _summed_area_table(w_values, K, R, S))
    codes = codes.contiguous()
    dp4a = (dw and w_int8 and not x_fp8 and (x_affine is not None or not x_twos or x_bits == 8) and C % 4 == 0
            and block_k % 16 == 0 and codes.data_ptr() % 4 == 0 and not interpreting())
    wq = dummy
    if dp4a:
        wq = derived("dp4a_words", lambda: _dp4a_words(w_values, K, R, S))
        w_values = dummy
    elif dw:  # (R*S, K): a tap's weights are one contiguous vector, int32 for integer codes
        w_values = derived("taps_by_channel", lambda: w_values.reshape(K, R * S).t().to(
            torch.float32 if x_fp8 else torch.int32).contiguous())
    kind = act if act is None or isinstance(act, str) else act[0]
    a = float(act[1]) if isinstance(act, tuple) else 0.0
    b = float(act[2]) if isinstance(act, tuple) and len(act) > 2 else 0.0
    grid = (cdiv(N * P * Q, block_m), cdiv(K, block_k))
    _grouped_conv_kernel[grid](
        codes, w_values.contiguous(), dummy if col is None else col, dummy if bias is None else bias, y,
        sat.contiguous(), wq, N, H, W, C, K, P, Q, Cg, K // groups,
        stride[0], stride[1], pad4[0], pad4[2], dilation[0], dilation[1],
        a, b,
        R=R, S=S, X_BITS=x_bits, X_TWOS=x_twos, X_FP8=x_fp8,
        X_I8=x_affine is not None, X_OFF=0 if x_affine is None else int(x_affine[0]),
        X_STEP=1 if x_affine is None else int(x_affine[1]), DW=dw, DP4A=dp4a, EVEN_K=K % block_k == 0,
        HAS_BIAS=bias is not None, ACT=ACT_CODES[kind], OUT_ACC=col is None,
        BLOCK_M=block_m, BLOCK_K=block_k,
    )
    return y
