"""INT8 and FP8 forward convolution for inference: a Triton implicit GEMM, NHWC, with a fused epilogue.

Layouts and the epilogue's exact float32 operation order are those of ``kernels/reference_conv_int8_fp8.py``:
x ``(N, H, W, C)`` contiguous, w ``(K, R, S, C)`` contiguous, y ``(N, P, Q, K)`` contiguous.

GEMM: M = output pixels (n, p, q), N = K output channels, reduction = (r, s, c)
------------------------------------------------------------------------------
Both operands are *reduction-major* in memory (C is the contiguous dimension of x and of w), which
is the only layout Hopper's wgmma accepts for 8-bit operands in shared memory: no transposes.
The output row of pixel m = n*P*Q + p*Q + q is simply ``y + m*K``.

    program -> (BLOCK_M pixels, BLOCK_N output channels)         # channel block fastest: neighbours share x in L2
    ih0, iw0 = p*sh - ph, q*sw - pw   (per row, once)
    acc[BLOCK_M, BLOCK_N] = 0   (int32 for int8, fp32 for fp8)
    TAP mode (C a multiple of BLOCK_K): one flat loop over (r, s, c-block)
        A = x[n, ih0 + r*dh, iw0 + s*dw, c-block]   rows masked by per-row bit masks of valid r / s
        B = w[k-block, r, s, c-block]^T
        acc += A @ B                                 # tl.dot -> wgmma s8 (IGMMA) / e4m3 (QGMMA)
    FLAT mode (small or odd C: 3, 16, 32, 96): the reduction index t = (r*S + s)*C + c runs in
        BLOCK_K steps over all of R*S*C; (r, s, c) come from t per column, masks are per element.
        Nothing is wasted on C = 3 (an 11x11 filter is 363 products, not 121 blocks of 32); with C a
        multiple of 16 the columns still come in 16-byte runs.
    int8 operands shifted by an offset (uint8 / pm8 codes stored as code - 128, ops/qconv.py):
              acc = acc * acc_mul + add[(p, q), k]   the exact integer correction, before any rounding
    epilogue: a = float(acc); y = a * ((alpha * sa[k]) * sb[k]) + bias[k];
              residual (HAS_RES): y = rd(float32(rd(y)) + float32(res[m, k])), rd = round to the residual's
                        dtype (a ResNet block's relu(branch + shortcut) exactly as the unfused graph computes it:
                        the conv's stored output, one IEEE float32 add, the sum stored);
              act (reference_conv_int8_fp8.apply_act): ReLU / LeakyReLU by a run-time code; clamp (ReLU6, hardtanh),
                        hardswish and SiLU compiled in (ACT_EXT), so the other variants carry none of their code;
              store fp16 / fp32, or int8 = clamp(rint(y / out_scale), lo, hi) - offset -- the next layer's
              input (plain int8, or a uint8 code stored shifted: reference_conv_int8_fp8.Int8Out; with a residual,
              of y rounded to the residual's dtype, as the unfused graph quantizes it);
              or both (OUT_DUAL): the float y and the int8 codes of that float (rounded to its dtype),
              bit-identical to quantizing the stored float in a separate pass;
              or (OUT_FP8) float8 codes fp8(clamp(y / out_scale, -max, max)), round to nearest even, NaN stays
              NaN (``round.fp8_code``: quantize_fp8_static's codes) -- the next FP8 layer's input, with a residual
              of y rounded to its dtype as for int8;
              or both (OUT_DUAL_FP8): the float y and the float8 codes of that float (rounded to its dtype), the FP8
              twin of OUT_DUAL (a ResNet block's output: the next residual and the next FP8 convs' operand);
              or (OUT_PLANES) the next bit-serial layer's packed planes (``PlanesOut``): codes =
              pack._quantize_codes(y / out_scale) (quantize_pack's), packed 32 channels a word
              (pack._store_planes), optionally after a 2x2 stride-2 max-pool (POOL = 2: the program's BLOCK_M rows
              are pooled pixels, the reduction runs once per window pixel and keeps the running max of the
              accumulators -- of their negations in columns of negative scale: y is monotone in acc -- so the
              epilogue runs on the pooled tile only); pack.pool_quantize_pack's planes bit for bit, without the
              float32 output;
              or (OUT_RAW) the raw accumulator.

The kernel is compiled with ``enable_fp_fusion=False`` (the epilogue's mul and add round separately,
exactly as the reference) and divides as IEEE division does (``round.div_by_scalar``; Triton's ``/`` is
``div.full``, 2 ulp).

fp8: ``tl.dot`` on float8e4nv lowers to ``wgmma ... e4m3`` (SASS QGMMA).  The Hopper fp8 accumulator is
narrower than fp32; unless ``fast_accum=True`` we promote it into fp32 every BLOCK_K products
(``max_num_imprecise_acc=BLOCK_K``), as cuBLAS does by default.

Tiles come from a small table per class of shape and epilogue (:func:`pick_config`, :func:`shape_class`); no autotuning
at run time.
Shape scalars are not specialised (no recompile per layer, batch or image size); C and K are, so
16-byte vector loads are provable when C % 16 == 0.
"""

from __future__ import annotations

import functools
import json
import numbers
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..conv_geometry import ConvGeometry, pair
from ..reference_bitplanes import packed_words
from ..reference_conv_int8_fp8 import (ACT_CLAMP, ACT_NONE, FP8_KINDS, Fp8Out, Int8Out, act_monotone, parse_act,
                                       parse_out)
from ._host import cdiv, interpreting, next_power_of_2
from .conv_fwd_epilogue import OutMode, _channel_scale, _conv_epilogue
from .round import fp8_constexprs

__all__ = ["conv2d_fwd_int8", "conv2d_fwd_fp8", "pick_config", "shape_class", "epilogue_of", "compile_key", "geometry",
           "NETWORK_LAYERS", "INTERPRETER_CONFIG", "interpreting", "PlanesOut"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_OUT_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
               "int32": torch.int32, "int8": torch.int8, **FP8_KINDS}
# The interpreter runs one small tile (reduction block 32: the smallest 8-bit wgmma step)
INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


_NOSPEC = ["N", "H", "W", "P", "Q", "R", "S", "str_h", "str_w", "pad_h", "pad_w", "dil_h", "dil_w", "M",
           "alpha", "sa_stride", "sb_stride", "bias_stride", "act", "act_a", "act_b", "acc_mul", "int_pq", "planes_kw"]


class PlanesOut(NamedTuple):
    """``out=`` of :func:`conv2d_fwd_int8` for the next bit-serial layer: the epilogue quantizes ``y / scale`` to
    ``bits``-bit codes (``lo``, ``hi``, ``offset``, ``shift``: ``ops.quantize._qp_params`` of the format), optionally
    after a 2x2 stride-2 max-pool (``pool=2``; the floor pool of nn.MaxPool2d(2, 2)), and writes them as bit planes
    int32 (bits, N * P' * Q', Kw): rows of ``packing.packed_words(K)`` words, or ``ceil(K / 32)`` with
    ``compact=True`` -- what ``pack.pool_quantize_pack`` / ``quantize_pack`` write from the float32 output."""

    scale: object
    bits: int
    lo: int
    hi: int
    offset: int = 0
    shift: int = 0
    pool: int = 0
    compact: bool = False


@triton.jit
def _conv_acc(x_ptr, w_ptr, add_ptr, n, p, q, m_ok, w_rows, offs_n_ld, H, W, C, P, Q, K, R, S, str_h, str_w, pad_h,
              pad_w, dil_h, dil_w, acc_mul, int_pq, IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr,
              FLAT: tl.constexpr, HAS_ADD: tl.constexpr, ADD_PIX: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) accumulator of output pixels (n, p, q) (rows, ``m_ok``) and the channels whose weight
    rows start at ``w_rows``: int32 (corrected by ``acc * acc_mul + add`` for shifted int8 operands) or float32."""
    ih0 = p * str_h - pad_h  # the top-left input pixel of each window
    iw0 = q * str_w - pad_w
    row_base = n * (H * W * C) + ih0 * (W * C) + iw0 * C  # (BLOCK_M,) may be negative (padding; masked)
    offs_k = tl.arange(0, BLOCK_K)
    RSC = R * S * C
    if IS_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)

    if FLAT:
        # ---- reduction index t = (r*S + s)*C + c over all of R*S*C, BLOCK_K at a time ----
        a_rows = x_ptr + row_base[:, None]  # (BLOCK_M, 1)
        b_cols = w_ptr + w_rows[None, :]  # (1, BLOCK_N)
        for k0 in range(0, RSC, BLOCK_K):
            tt = k0 + offs_k
            c = tt % C
            rs = tt // C
            s = rs % S
            r = rs // S
            t_ok = tt < RSC
            ih = ih0[:, None] + (r * dil_h)[None, :]
            iw = iw0[:, None] + (s * dil_w)[None, :]
            a_ok = (m_ok[:, None] & t_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
            a_blk = tl.load(a_rows + ((r * dil_h) * (W * C) + (s * dil_w) * C + c)[None, :], mask=a_ok, other=0.0)
            b_blk = tl.load(b_cols + tt[:, None], mask=t_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N)
            if not IS_FP8:  # out_dtype: triton 3.6 defaults to float32 for every input type
                acc = tl.dot(a_blk, b_blk, acc, out_dtype=tl.int32)
            elif FAST_ACCUM:
                acc = tl.dot(a_blk, b_blk, acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(a_blk, b_blk, acc, max_num_imprecise_acc=BLOCK_K, out_dtype=tl.float32)
    else:
        # ---- bit r of hbits / s of wbits: tap row r / column s reads inside the image ----
        hbits = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for rr in range(0, R):
            hbits |= ((ih0 + rr * dil_h >= 0) & (ih0 + rr * dil_h < H)).to(tl.int32) << rr
        hbits = tl.where(m_ok, hbits, 0)
        wbits = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for ss in range(0, S):
            wbits |= ((iw0 + ss * dil_w >= 0) & (iw0 + ss * dil_w < W)).to(tl.int32) << ss
        a_base = x_ptr + row_base[:, None] + offs_k[None, :]  # (BLOCK_M, BLOCK_K), tap (0, 0), c-block 0
        b_base = w_ptr + w_rows[None, :] + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
        c_iters = tl.cdiv(C, BLOCK_K)
        total = R * S * c_iters
        cb = 0
        s = 0
        r = 0
        for it in range(0, total):  # noqa: B007 (cb, s, r carry the position; no division in the loop)
            row_ok = ((hbits >> r) & (wbits >> s) & 1) != 0
            a_ptrs = a_base + (r * (dil_h * W * C) + s * (dil_w * C) + cb * BLOCK_K)
            b_ptrs = b_base + ((r * S + s) * C + cb * BLOCK_K)
            if EVEN_K:
                a_blk = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b_blk = tl.load(b_ptrs)
            else:
                k_ok = cb * BLOCK_K + offs_k < C
                a_blk = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b_blk = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if not IS_FP8:  # out_dtype: triton 3.6 defaults to float32 for every input type
                acc = tl.dot(a_blk, b_blk, acc, out_dtype=tl.int32)
            elif FAST_ACCUM:
                acc = tl.dot(a_blk, b_blk, acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(a_blk, b_blk, acc, max_num_imprecise_acc=BLOCK_K, out_dtype=tl.float32)
            cb += 1
            wrap = (cb == c_iters).to(tl.int32)
            cb -= wrap * c_iters
            s += wrap
            wrap = (s == S).to(tl.int32)
            s -= wrap * S
            r += wrap

    if HAS_ADD:  # int32 wrap-around is harmless: the true sum fits int32 (checked by the caller)
        if ADD_PIX:  # interior rows share one entry a channel (a 1-D load); only border rows gather theirs
            row_in = ((ih0 >= 0) & (ih0 + (R - 1) * dil_h < H) & (iw0 >= 0) & (iw0 + (S - 1) * dil_w < W)
                      & (int_pq >= 0))
            add_in = tl.load(add_ptr + tl.maximum(int_pq, 0) * K + offs_n_ld)
            add_b = tl.load(add_ptr + (p * Q + q)[:, None] * K + offs_n_ld[None, :], mask=(row_in == 0)[:, None],
                            other=0)
            add = tl.where(row_in[:, None], add_in[None, :], add_b)
        else:
            add = tl.load(add_ptr + offs_n_ld)[None, :]
        acc = acc * acc_mul + add
    return acc


@triton.jit(do_not_specialize=_NOSPEC)
def _conv_fwd_kernel(
    x_ptr, w_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, add_ptr, oscale_ptr, res_ptr, out8_ptr,
    # -- sizes (x, w, out contiguous NHWC / KRSC / NPQK: strides follow from C, W, H, R, S, K) --
    N, H, W, C, P, Q, K, R, S,
    str_h, str_w, pad_h, pad_w, dil_h, dil_w,
    M,  # N*P*Q
    # -- epilogue (see reference_conv_int8_fp8): scales sa / sb are per-channel (stride 1) or per-tensor (0); act the
    #    run-time ReLU / LeakyReLU code, act_a its slope or the clamp's lo, act_b the clamp's hi --
    alpha, sa_stride, sb_stride, bias_stride, act, act_a, act_b,
    # -- int8 with affine-shifted operands: acc = acc * acc_mul + add[(p, q), k] (ADD_PIX), or add[k]; int_pq: an
    #    output position whose window lies inside the image (its entry is every interior pixel's), or -1 --
    acc_mul, int_pq,
    # -- packed planes (OUT_PLANES): rows of planes_kw words; POOL 2: a 2x2 stride-2 max-pool first, M pooled rows --
    planes_kw,
    # -- what to do --
    IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, FLAT: tl.constexpr, OUT_MODE: tl.constexpr, HAS_ADD: tl.constexpr,
    ADD_PIX: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
    # -- a compiled-in activation: 0, or ACT_CLAMP / ACT_HARDSWISH / ACT_SILU (then act is ACT_NONE) --
    ACT_EXT: tl.constexpr,
    # -- residual: res (N, P, Q, K) float, contiguous like out, added after the bias, before the activation --
    HAS_RES: tl.constexpr,
    # -- int8 output (OUT_INT8 at out, OUT_DUAL at out8): stored clamp(rne(y / out_scale), OUT_LO, OUT_HI) - OUT_OFF --
    OUT_LO: tl.constexpr, OUT_HI: tl.constexpr, OUT_OFF: tl.constexpr,
    # -- float8 output (OUT_FP8 at out, OUT_DUAL_FP8 at out8; uint8 views): round.fp8_code's constants of the format --
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    # -- planes (OUT_PLANES): pack._quantize_codes' format constants (with OUT_LO, OUT_HI, OUT_OFF) --
    Q_BITS: tl.constexpr, Q_SHIFT: tl.constexpr, POOL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # ---- which tile: channel block fastest ----
    pid = tl.program_id(0)
    num_n = tl.cdiv(K, BLOCK_N)
    pid_n = pid % num_n
    pid_m = pid // num_n

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < K
    offs_n_ld = offs_n % K  # weight rows past K read row (k mod K): loads need no mask along N
    if INT64:
        w_rows = offs_n_ld.to(tl.int64) * (R * S * C)
    else:
        w_rows = offs_n_ld * (R * S * C)
    scl = _channel_scale(sa_ptr, sb_ptr, offs_n_ld, alpha, sa_stride, sb_stride, OUT_MODE, BLOCK_N)

    # ---- rows: output pixel m = (n, p, q) ----
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    res = 0.0
    if HAS_RES:  # the residual tile, loaded before the K loop so that its latency hides behind the MMAs
        if INT64:
            offs_r = offs_m.to(tl.int64)[:, None] * K + offs_n[None, :]
        else:
            offs_r = offs_m[:, None] * K + offs_n[None, :]
        res = tl.load(res_ptr + offs_r, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    if POOL == 2:  # M pooled pixels (n, po, qo): the 4 pixels of each window, one after another
        qo = offs_m % (Q // 2)
        t = offs_m // (Q // 2)
        po = t % (P // 2)
        n = t // (P // 2)
        if INT64:
            n = n.to(tl.int64)
        pos = (scl >= 0)[None, :]
        for quad in tl.static_range(4):
            p = po * 2 + quad // 2
            q = qo * 2 + quad % 2
            acc = _conv_acc(x_ptr, w_ptr, add_ptr, n, p, q, m_ok, w_rows, offs_n_ld, H, W, C, P, Q, K, R, S,
                            str_h, str_w, pad_h, pad_w, dil_h, dil_w, acc_mul, int_pq, IS_FP8, FAST_ACCUM, FLAT,
                            HAS_ADD, ADD_PIX, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
            # the epilogue (y = act(float(acc) * scl + bias), each step rounding monotonically) is non-decreasing
            # in acc where scl >= 0 and non-increasing where scl < 0 (the caller refuses an act that is not
            # monotone: reference_conv_int8_fp8.act_monotone): the window's max of y is y of its largest
            # accumulator, or of its smallest -- the largest of the negated ones (|acc| < 2^31: exact), bit for bit
            acc = tl.where(pos, acc, -acc)
            if quad == 0:
                best = acc
            else:
                best = tl.maximum(best, acc)
        acc = tl.where(pos, best, -best)
    else:
        q = offs_m % Q
        t = offs_m // Q
        p = t % P
        n = t // P
        if INT64:
            n = n.to(tl.int64)
        acc = _conv_acc(x_ptr, w_ptr, add_ptr, n, p, q, m_ok, w_rows, offs_n_ld, H, W, C, P, Q, K, R, S,
                        str_h, str_w, pad_h, pad_w, dil_h, dil_w, acc_mul, int_pq, IS_FP8, FAST_ACCUM, FLAT,
                        HAS_ADD, ADD_PIX, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)

    # ---- epilogue: y[m, k] at out + m*K + k (OUT_PLANES: planes row m) ----
    _conv_epilogue(acc, offs_m, offs_n, offs_n_ld, m_ok, n_ok, scl, pid_n, num_n, M, K, out_ptr, bias_ptr, oscale_ptr,
                   res, res_ptr, out8_ptr, bias_stride, act, act_a, act_b, planes_kw, OUT_MODE, ACT_EXT, INT64, HAS_RES,
                   OUT_LO, OUT_HI, OUT_OFF, F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE, Q_BITS,
                   Q_SHIFT, BLOCK_N)


# The conv layers of issue 4's networks that the tile table was tuned on (batch is a separate axis):
# name -> (H, W, C, K, R, S, stride, padding)
NETWORK_LAYERS = {
    "alexnet.conv1": (224, 224, 3, 64, 11, 11, 4, 2), "alexnet.conv2": (27, 27, 64, 192, 5, 5, 1, 2),
    "alexnet.conv3": (13, 13, 192, 384, 3, 3, 1, 1), "alexnet.conv4": (13, 13, 384, 256, 3, 3, 1, 1),
    "alexnet.conv5": (13, 13, 256, 256, 3, 3, 1, 1),
    "vgg.conv1": (224, 224, 3, 96, 3, 3, 2, 1), "vgg.conv2": (56, 56, 96, 256, 3, 3, 1, 1),
    "vgg.conv3": (56, 56, 256, 256, 3, 3, 1, 1), "vgg.conv5": (28, 28, 256, 512, 3, 3, 1, 1),
    "vgg.conv6": (28, 28, 512, 512, 3, 3, 1, 1), "vgg.conv8": (14, 14, 512, 512, 3, 3, 1, 1),
    "resnet18.conv1": (224, 224, 3, 64, 7, 7, 4, 3), "resnet18.l1": (56, 56, 64, 64, 3, 3, 1, 1),
    "resnet18.l2a": (56, 56, 64, 128, 3, 3, 2, 1), "resnet18.l2": (28, 28, 128, 128, 3, 3, 1, 1),
    "resnet18.l2ds": (56, 56, 64, 128, 1, 1, 2, 0), "resnet18.l3a": (28, 28, 128, 256, 3, 3, 2, 1),
    "resnet18.l3": (14, 14, 256, 256, 3, 3, 1, 1), "resnet18.l4a": (14, 14, 256, 512, 3, 3, 2, 1),
    "resnet18.l4": (7, 7, 512, 512, 3, 3, 1, 1), "resnet18.l4ds": (14, 14, 256, 512, 1, 1, 2, 0),
    "yolo.conv1": (416, 416, 3, 16, 3, 3, 1, 1), "yolo.conv2": (208, 208, 16, 32, 3, 3, 1, 1),
    "yolo.conv3": (104, 104, 32, 64, 3, 3, 1, 1), "yolo.conv4": (52, 52, 64, 128, 3, 3, 1, 1),
    "yolo.conv5": (26, 26, 128, 256, 3, 3, 1, 1), "yolo.conv6": (13, 13, 256, 512, 3, 3, 1, 1),
    "yolo.conv7": (13, 13, 512, 1024, 3, 3, 1, 1), "yolo.conv8": (13, 13, 1024, 1024, 3, 3, 1, 1),
    "yolo.conv9": (13, 13, 1024, 125, 1, 1, 1, 0),
    # ResNet-50's bottleneck convs whose epilogue adds the shortcut (tuned with it: bench/tune_conv_fwd.TUNE_LAYERS)
    "resnet50.l1c3": (56, 56, 64, 256, 1, 1, 1, 0), "resnet50.l2c3": (28, 28, 128, 512, 1, 1, 1, 0),
    "resnet50.l3c3": (14, 14, 256, 1024, 1, 1, 1, 0), "resnet50.l4c3": (7, 7, 512, 2048, 1, 1, 1, 0),
    # ResNet-50's 1x1 conv1s, and a ViT-B / TransformerEncoder(d_model 768) layer's linears as QLinear runs them: 197
    # tokens an image as H = 197, W = 1 (batch 64: M = 12608 rows); measured in decision 0140
    "resnet50.l1c1": (56, 56, 256, 64, 1, 1, 1, 0), "resnet50.l2c1": (28, 28, 512, 128, 1, 1, 1, 0),
    "resnet50.l3c1": (14, 14, 1024, 256, 1, 1, 1, 0), "resnet50.l4c1": (7, 7, 2048, 512, 1, 1, 1, 0),
    "xf768.qkv": (197, 1, 768, 2304, 1, 1, 1, 0), "xf768.out_proj": (197, 1, 768, 768, 1, 1, 1, 0),
    "xf768.linear1": (197, 1, 768, 3072, 1, 1, 1, 0), "xf768.linear2": (197, 1, 3072, 768, 1, 1, 1, 0),
}


# ------------------------------------------------------------------------------------------------
# Tiles: a small table per shape class (data: conv_fwd_tiles.json, written by `tcprec tune conv-fwd`)
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device | None) -> int:
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # no GPU (the interpreter, or planning on the CPU): an H100 / H200


def _flat_block_k(rsc: int) -> int:
    """The largest reduction block (128, 64, 32) that pads R*S*C by at most 15%."""
    for bk in (128, 64):
        if cdiv(rsc, bk) * bk <= 1.15 * rsc:
            return bk
    return 32


# Tile table: shape class -> (BLOCK_M, largest BLOCK_N, num_warps, num_stages), data in conv_fwd_tiles.json beside
# this file (each value with what was measured to pick it; written by `tcprec tune conv-fwd`).
#   tap   C a multiple of 64 / 128;   flat  C >= 16 not a multiple of 64;   thin  C < 16 (the stems);
#   tap_res     a "tap" conv whose epilogue adds a residual (a ResNet block's last conv): the residual tile and the
#               float result live beside the accumulator, so 128x128 with 4 warps runs out of registers (255 a
#               thread, spilling; 12% occupancy) at a quarter of the bandwidth (decision 0130);
#   point_dual  a 1x1 "tap" conv with a residual and the dual output (float + codes: a bottleneck's conv3), the
#               heaviest epilogue over the shortest reduction.
TILE_CLASSES = ("tap", "flat", "thin", "tap_res", "point_dual")
# what the epilogue does besides the activation: nothing more, a residual add, or a residual add with the dual output
EPILOGUES = ("plain", "residual", "dual")
TILE_TABLE_PATH = Path(__file__).with_name("conv_fwd_tiles.json")
_TILE_BLOCK_M = (64, 128, 256)
_TILE_WARPS = (4, 8)
_TILE_STAGES = (2, 3, 4, 5, 6)


def load_tile_table(path=TILE_TABLE_PATH) -> dict[str, tuple[int, int, int, int]]:
    """The tile table at ``path``, validated: ``{class: (BLOCK_M, BLOCK_N cap, num_warps, num_stages)}`` for every
    class of :data:`TILE_CLASSES`; ValueError naming the file, the entry and the allowed values otherwise."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"conv_fwd tile table {path}: cannot read it as JSON ({e}); restore it from git or "
                         "re-run `tcprec tune conv-fwd`") from None
    if not isinstance(doc, dict):
        raise ValueError(f"conv_fwd tile table {path}: expected a JSON object, got {type(doc).__name__}")
    missing = [c for c in TILE_CLASSES if c not in doc]
    if missing:
        raise ValueError(f"conv_fwd tile table {path}: classes {missing} missing; it needs {list(TILE_CLASSES)}")
    table = {}
    for cls in TILE_CLASSES:
        v = doc[cls].get("value") if isinstance(doc[cls], dict) else None
        ok = (isinstance(v, list) and len(v) == 4 and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
              and v[0] in _TILE_BLOCK_M and v[1] >= 16 and v[1] & (v[1] - 1) == 0 and v[1] <= 256
              and v[2] in _TILE_WARPS and v[3] in _TILE_STAGES)
        if not ok:
            raise ValueError(f"conv_fwd tile table {path}: {cls}.value must be [BLOCK_M, BLOCK_N cap, num_warps, "
                             f"num_stages] with BLOCK_M in {_TILE_BLOCK_M}, BLOCK_N cap a power of two in 16..256, "
                             f"num_warps in {_TILE_WARPS}, num_stages in {_TILE_STAGES}; got {v!r}")
        table[cls] = tuple(v)
    return table


_TILES = load_tile_table()
_SMALL_M_WARPS = 4  # 64-row tiles (too few 128-row tiles to fill the SMs): one warpgroup


# A pooled planes epilogue (PlanesOut pool=2) runs 4 accumulations a program (one per window pixel), each a reduction
# loop of its own.  With a single reduction step there is nothing to pipeline within them: 64-row tiles and 2 stages
# (more programs resident) measured fastest -- the VGG stem gathered to 32-byte rows at batch 256, H200: 383 us against
# 491 with the table's 128 / 3 (AlexNet's stem, 3 steps of 128: the table's 124 us against 190).
_POOLED_ONE_STEP = {"BLOCK_M": 64, "num_stages": 2}


def shape_class(g: ConvGeometry, epilogue: str = "plain") -> str:
    """The tile table's class of a conv: "tap" (C a multiple of 64), else "thin" (C < 16) or "flat"; a "tap" conv
    whose ``epilogue`` (one of :data:`EPILOGUES`) adds a residual is "tap_res", or "point_dual" when it is 1x1 with the
    dual output.  (A residual on a "flat" / "thin" conv keeps its shape class: no network layer was measured there.)"""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if g.C % 64 != 0:
        return "thin" if g.C < 16 else "flat"
    if epilogue == "plain":
        return "tap"
    return "point_dual" if epilogue == "dual" and g.R == g.S == 1 else "tap_res"


def epilogue_of(residual: bool, dual: bool) -> str:
    """The :data:`EPILOGUES` entry of a launch: "dual" (a residual and the float + codes output), "residual", or
    "plain" (no residual; a dual output without one was not measured apart and keeps the plain tiles)."""
    return ("dual" if dual else "residual") if residual else "plain"


def pick_config(g: ConvGeometry, fp8: bool, device: torch.device | None = None, pooled: bool = False,
                tiles: dict | None = None, epilogue: str = "plain") -> dict:
    """Tile, warps and stages for one conv (the same table for int8 and fp8: both are 8-bit operands).

    * reduction: TAP mode with BLOCK_K = 128 (or 64) when C is a multiple of it, else FLAT mode with
      the largest BLOCK_K that pads R*S*C by at most 15%;
    * the class (:func:`shape_class` of the geometry and the ``epilogue``) picks BLOCK_M, the BLOCK_N cap, warps and
      stages from ``_TILES``; BLOCK_N is the output channels rounded up to a power of two in [16, cap];
    * BLOCK_M 64 (and BLOCK_N <= 64), 4 warps, when 128-row tiles would leave most SMs idle (small batch, 7x7 /
      13x13 maps); with one row tile (a linear layer at batch 8) BLOCK_N halved down to 16 while the tiles still
      leave SMs idle (4096 -> 1000 int8 at M = 8 ran on 16 programs: 17.6 us on the H200 for 4 MB of weights).
    ``pooled``: for a ``PlanesOut(pool=2)`` epilogue (BLOCK_M counts pooled pixels): :data:`_POOLED_ONE_STEP` where
    the reduction is one BLOCK_K step and there are enough pooled tiles.
    ``tiles``: another table of the same form (``tcprec tune conv-fwd`` times candidates through this).
    """
    sms = _sm_count(device)
    M = g.N * g.P * g.Q
    cls = shape_class(g, epilogue)
    if g.C % 64 == 0:
        flat, bk = False, (128 if g.C % 128 == 0 else 64)
    else:
        flat, bk = True, _flat_block_k(g.R * g.S * g.C)
    bm, bn_cap, warps, stages = (_TILES if tiles is None else tiles)[cls]
    bn = min(bn_cap, max(16, next_power_of_2(g.K)))
    if cdiv(M, bm) * cdiv(g.K, bn) < sms:
        bm, warps = 64, _SMALL_M_WARPS
        if cdiv(M, bm) * cdiv(g.K, bn) < sms and bn > 64:
            bn = 64
        while M <= bm and cdiv(g.K, bn) < sms and bn > 16:  # one row tile (a linear layer at batch 8): W on more SMs
            bn //= 2
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FLAT": flat, "num_warps": warps, "num_stages": stages}
    steps = cdiv(g.R * g.S * g.C, bk) if flat else g.R * g.S * cdiv(g.C, bk)  # of the reduction loop
    if pooled and steps == 1 and cdiv(M // 4, _POOLED_ONE_STEP["BLOCK_M"]) * cdiv(g.K, bn) >= sms:
        cfg.update(_POOLED_ONE_STEP)
    return cfg


def compile_key(g: ConvGeometry, cfg: dict, fp8: bool, out_kind: str, has_add: bool = False,
                has_res: bool = False, act=None) -> tuple:
    """What decides which compiled variant a launch uses (C and K are specialised on divisibility by
    16; every other shape scalar is not): launches with equal keys share one compiled kernel.  ``out_kind``
    names the output (a float dtype with ``+int8`` for the dual output); ``has_res``: a residual input; ``act``: the
    activation (ReLU / LeakyReLU are run-time codes and share the variant of None; clamp, hardswish and SiLU are
    compiled in, the clamp's bounds are run-time)."""
    flat = cfg.get("FLAT", g.C % cfg["BLOCK_K"] != 0)
    key = (fp8, out_kind, has_add, g.C % 16 == 0, g.C == 1, g.K % 16 == 0, g.K == 1, flat, g.C % cfg["BLOCK_K"] == 0,
           cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("num_warps", 4), cfg.get("num_stages", 3))
    mode = parse_act(act)[0]
    ext = (("act", mode),) if mode >= ACT_CLAMP else ()  # the compiled-in activations only
    return key + (("residual",) if has_res else ()) + ext  # unchanged keys for launches without them


# ------------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ------------------------------------------------------------------------------------------------


_CONSTS: dict = {}


def _const(device: torch.device, value: float) -> torch.Tensor:
    """A float32 scalar per device, bound to absent scale / bias pointers (stride 0): made once, so a
    call launches nothing but the conv (CUDA-graph friendly).  One first made inside a CUDA-graph
    capture is not kept: its fill runs only when the graph replays, so eager calls must not see it."""
    key = (device, value)
    t = _CONSTS.get(key)
    if t is None:
        t = torch.full((1,), value, dtype=torch.float32, device=device)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _CONSTS[key] = t
    return t


def geometry(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, op: str) -> ConvGeometry:
    """Check the layouts and sizes of x (N, H, W, C) and w (K, R, S, C); the ConvGeometry."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D ({'(N, H, W, C)' if name == 'x' else '(K, R, S, C)'}), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous "
                             f"{'NHWC (N, H, W, C)' if name == 'x' else '(K, R, S, C)'}, got strides "
                             f"{tuple(t.stride())}; pass {name}.contiguous() (from NCHW: "
                             f"{name}.permute(0, 2, 3, 1).contiguous())")
    if x.device != w.device:
        raise ValueError(f"{op}: x is on {x.device} but w is on {w.device}; move both to one device")
    N, H, W, C = x.shape
    K, R, S, Cw = w.shape
    if Cw != C:
        raise ValueError(f"{op}: x has C={C} channels (NHWC, last dim) but w (K, R, S, C) has C={Cw}; "
                         "the weight must be (K, R, S, C) -- nn.Conv2d's (K, C, R, S) permuted (0, 2, 3, 1)")
    st, pd, dl = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(st) < 1 or min(dl) < 1 or min(pd) < 0:
        raise ValueError(f"{op}: stride and dilation must be >= 1 and padding >= 0, got stride={st}, "
                         f"padding={pd}, dilation={dl}")
    g = ConvGeometry(N, H, W, C, K, R, S, st, pd, dl)
    if min(N, C, K, R, S) < 1 or g.P < 1 or g.Q < 1:
        raise ValueError(f"{op}: empty problem or filter larger than the padded input: x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, stride={st}, padding={pd}, dilation={dl} gives output "
                         f"{g.P}x{g.Q}")
    if (R > 31 or S > 31):
        raise ValueError(f"{op}: filters up to 31x31 are supported (per-row tap bit masks), got {R}x{S}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"{op}: x is on {x.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "on the CPU use tcprec.kernels.reference_conv_int8_fp8")
    return g


def _scale_arg(v, name: str, K: int, device, op: str):
    """(alpha, tensor, stride): a number goes into alpha; a tensor of 1 or K elements is a pointer
    with stride 0 (per-tensor) or 1 (per-channel)."""
    if v is None:
        return 1.0, _const(device, 1.0), 0
    if isinstance(v, torch.Tensor):
        if not v.is_floating_point() or v.numel() not in (1, K):
            raise ValueError(f"{op}: {name} must be a float number or a float tensor of 1 or K={K} elements "
                             f"(per output channel), got dtype {v.dtype}, shape {tuple(v.shape)}")
        if v.device != device:
            raise ValueError(f"{op}: {name} is on {v.device}, the conv runs on {device}; move it there first")
        return 1.0, v.reshape(-1).contiguous(), (0 if v.numel() == 1 else 1)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{op}: {name} must be None, a number or a tensor, got {type(v).__name__}")
    return float(v), _const(device, 1.0), 0


def _check_add(acc_mul, acc_add, g: ConvGeometry, device, op: str):
    if isinstance(acc_mul, bool) or not isinstance(acc_mul, numbers.Integral) or not 1 <= acc_mul <= 4:
        raise ValueError(f"{op}: acc_mul must be an int in 1..4 (the product of the operands' steps), got {acc_mul!r}")
    if acc_add is None:
        if acc_mul != 1:
            raise ValueError(f"{op}: acc_mul={acc_mul} needs acc_add (pass zeros of shape (K,) if there is no offset)")
        return None
    if not isinstance(acc_add, torch.Tensor) or acc_add.dtype != torch.int32 or \
            tuple(acc_add.shape) not in ((g.K,), (g.P, g.Q, g.K)):
        got = (acc_add.dtype, tuple(acc_add.shape)) if isinstance(acc_add, torch.Tensor) else type(acc_add).__name__
        raise ValueError(f"{op}: acc_add must be an int32 tensor of shape (K,) = ({g.K},) or (P, Q, K) = "
                         f"({g.P}, {g.Q}, {g.K}), got {got}")
    if acc_add.device != device:
        raise ValueError(f"{op}: acc_add is on {acc_add.device}, the conv runs on {device}; move it there first")
    return acc_add.contiguous()


def _check_residual(residual, g: ConvGeometry, device, kind: str, op: str):
    """The residual: a float tensor of the output's shape (N, P, Q, K), contiguous, on x's device; it needs the
    float epilogue (not the raw int32 accumulator)."""
    if residual is None:
        return None
    if kind == "int32":
        raise ValueError(f"{op}: residual is added in the float epilogue; out='int32' returns the raw accumulator. "
                         "Pass a float out (e.g. 'float16') or ('int8', out_scale)")
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{op}: residual must be a torch.Tensor (N, P, Q, K), got {type(residual).__name__}")
    if residual.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: residual must be float16, float32 or bfloat16, got {residual.dtype}; "
                         "pass residual.to(torch.float16) (the network's float dtype)")
    if tuple(residual.shape) != g.output_shape:
        raise ValueError(f"{op}: residual must have the output's shape (N, P, Q, K) = {g.output_shape}, got "
                         f"{tuple(residual.shape)}")
    if residual.device != device:
        raise ValueError(f"{op}: residual is on {residual.device}, the conv runs on {device}; move it there first")
    if not residual.is_contiguous():
        raise ValueError(f"{op}: residual must be contiguous NHWC (N, P, Q, K), got strides "
                         f"{tuple(residual.stride())}; pass residual.contiguous()")
    return residual


def _oscale(spec, device, op: str):
    oscale = spec.scale if isinstance(spec.scale, torch.Tensor) else _const(device, spec.scale)
    if oscale.device != device:
        raise ValueError(f"{op}: out_scale is on {oscale.device}, the conv runs on {device}; move it there first")
    return oscale


def _interior_position(g: ConvGeometry) -> int:
    """p * Q + q of an output position whose whole window lies inside the image, or -1 when there is none."""
    def first(pad, st, span, size, n):
        i = -(-pad // st)  # the first output whose window starts inside
        return i if i < n and i * st - pad + span <= size else -1

    p = first(g.padding[0], g.stride[0], (g.R - 1) * g.dilation[0] + 1, g.H, g.P)
    q = first(g.padding[1], g.stride[1], (g.S - 1) * g.dilation[1] + 1, g.W, g.Q)
    return p * g.Q + q if p >= 0 and q >= 0 else -1


def _launch(x, w, g: ConvGeometry, op: str, *, fp8: bool, alpha, sa, sb, bias, act, out, fast_accum, config,
            add=None, acc_mul: int = 1, res=None, out8=None, add_interior: bool = False):
    kind, spec = out
    mode, act_a, act_b = parse_act(act)
    act_ext = mode if mode >= ACT_CLAMP else 0  # compiled in (ACT_EXT); ReLU / LeakyReLU stay run-time codes
    device = x.device
    f8_out = out8 if isinstance(out8, Fp8Out) else spec if kind in FP8_KINDS else None  # float8 codes (4, 5)
    planes = spec if kind == "planes" else None  # the next bit-serial layer's planes (6)
    if planes is not None:
        oscale, o_lo, o_hi, o_off = _oscale(planes, device, op), planes.lo, planes.hi, planes.offset
    elif kind == "int8" or isinstance(out8, Int8Out):  # the int8 codes at out (OUT_INT8) or beside the float (3)
        spec8 = spec if kind == "int8" else out8
        oscale, o_lo, o_hi, o_off = _oscale(spec8, device, op), spec8.lo, spec8.hi, spec8.offset
    elif f8_out is not None:  # float8 codes at out (OUT_FP8) or beside the float out (5)
        oscale, o_lo, o_hi, o_off = _oscale(f8_out, device, op), -128, 127, 0
    else:
        oscale, o_lo, o_hi, o_off = _const(device, 1.0), -128, 127, 0
    if bias is None:
        bias_t, bias_stride = _const(device, 0.0), 0
    else:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.numel() != g.K:
            raise ValueError(f"{op}: bias must be a float tensor of K={g.K} elements, got "
                             f"{type(bias).__name__ if not isinstance(bias, torch.Tensor) else (bias.dtype, tuple(bias.shape))}")
        if bias.device != device:
            raise ValueError(f"{op}: bias is on {bias.device}, the conv runs on {device}; move it there first")
        bias_t, bias_stride = bias.reshape(-1).contiguous(), 1
    cfg = dict(INTERPRETER_CONFIG if (config is None and interpreting()) else
               (config or pick_config(g, fp8, device, pooled=planes is not None and planes.pool == 2,
                                      epilogue=epilogue_of(res is not None, out8 is not None))))
    M, kw = g.N * g.P * g.Q, 0
    if planes is not None:  # (bits, rows, Kw) int32; a program packs whole words: BLOCK_N >= 32
        if planes.pool:  # BLOCK_M pooled pixels a program (4 accumulators of BLOCK_M rows, one a window pixel)
            M = g.N * (g.P // 2) * (g.Q // 2)
        kw = cdiv(g.K, 32) if planes.compact else packed_words(g.K)
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], 32)
        y = torch.empty((planes.bits, M, kw), dtype=torch.int32, device=device)
    else:
        y = torch.empty(g.output_shape, dtype=_OUT_DTYPES[kind], device=device)
    flat = cfg.get("FLAT", g.C % cfg["BLOCK_K"] != 0)
    lim = 2**31 - 1
    int64 = x.numel() >= lim or y.numel() >= lim or w.numel() >= lim
    out_mode = (OutMode.RAW if kind == "int32" else OutMode.INT8 if kind == "int8" else OutMode.FP8 if kind in FP8_KINDS
                else OutMode.PLANES if planes is not None else OutMode.DUAL_FP8 if f8_out is not None
                else OutMode.DUAL if out8 is not None else OutMode.FLOAT)
    f8 = fp8_constexprs(f8_out.dtype if f8_out is not None else torch.float8_e4m3fn)
    if out_mode in (OutMode.DUAL, OutMode.DUAL_FP8):
        y8 = torch.empty(g.output_shape, dtype=torch.int8 if out_mode == OutMode.DUAL else f8_out.dtype, device=device)
    else:
        y8 = y
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(g.K, cfg["BLOCK_N"]),)
    add_t = _const(device, 0.0) if add is None else add
    kernel = _conv_fwd_kernel[grid](
        x, w, y.view(torch.uint8) if out_mode == OutMode.FP8 else y, sa[0], sb[0], bias_t, add_t, oscale,
        _const(device, 0.0) if res is None else res, y8.view(torch.uint8) if out_mode == OutMode.DUAL_FP8 else y8,
        g.N, g.H, g.W, g.C, g.P, g.Q, g.K, g.R, g.S,
        g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1], M,
        float(alpha), sa[1], sb[1], bias_stride, ACT_NONE if act_ext else mode, float(act_a), float(act_b),
        int(acc_mul), _interior_position(g) if add_interior else -1, kw,
        IS_FP8=fp8, FAST_ACCUM=bool(fast_accum), FLAT=bool(flat), OUT_MODE=int(out_mode), HAS_ADD=add is not None,
        ADD_PIX=add is not None and add.dim() == 3, ACT_EXT=act_ext,
        EVEN_K=g.C % cfg["BLOCK_K"] == 0, INT64=int64, HAS_RES=res is not None, OUT_LO=o_lo, OUT_HI=o_hi, OUT_OFF=o_off,
        **f8, Q_BITS=planes.bits if planes is not None else 1, Q_SHIFT=planes.shift if planes is not None else 0,
        POOL=planes.pool if planes is not None else 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), enable_fp_fusion=False,
    )
    return ((y, y8) if out_mode in (OutMode.DUAL, OutMode.DUAL_FP8) else y), kernel


def _parse_outs(out, out_int8, allowed: tuple[str, ...], op: str):
    """(kind, spec, Int8Out / Fp8Out or None): ``out`` and, for the dual output, ``out_int8`` (the codes of ``out``:
    int8, or float8 with ``("e4m3" | "e5m2", out_scale)``)."""
    kind, spec = parse_out(out, allowed)
    if out_int8 is None:
        return kind, spec, None
    if kind not in ("float16", "float32", "bfloat16"):
        raise ValueError(f"{op}: out_int8 writes int8 / float8 codes beside a float output; out must be 'float16', "
                         f"'float32' or 'bfloat16' with it, got out={out!r}")
    return kind, spec, parse_out(out_int8, ("int8", *FP8_KINDS))[1]


def _check_planes_out(spec: PlanesOut, g: ConvGeometry, act, residual, out_int8, op: str) -> PlanesOut:
    """A :class:`PlanesOut`: 1..8 bits, pool 0 or 2 (a 2x2 stride-2 pool needs an output of at least 2 x 2, and an
    epilogue monotone in the accumulator: ``act_monotone(act)``, not hardswish, SiLU or a negative LeakyReLU slope), the
    codes' range inside the bits, no residual or dual output beside it."""
    if isinstance(spec.bits, bool) or spec.bits not in range(1, 9):
        raise ValueError(f"{op}: PlanesOut.bits must be an int in 1..8, got {spec.bits!r}")
    if spec.pool not in (0, 2):
        raise ValueError(f"{op}: PlanesOut.pool must be 0 (none) or 2 (2x2 max-pool, stride 2), got {spec.pool!r}; "
                         "other pools run as a separate pass (pack.pool_planes)")
    if spec.pool and min(g.P, g.Q) < 2:
        raise ValueError(f"{op}: PlanesOut(pool=2) needs an output of at least 2 x 2, got {g.P} x {g.Q}")
    if spec.pool and not act_monotone(act):
        raise ValueError(f"{op}: PlanesOut(pool=2) pools the accumulators (the epilogue must be monotone in them): "
                         f"act must be None, 'relu', ('leaky', slope >= 0) or ('clamp', lo, hi), got act={act!r}; "
                         "pool the float output instead (pack.pool_quantize_pack)")
    if spec.shift not in (0, 1) or not -255 <= spec.lo <= spec.hi <= 255:
        raise ValueError(f"{op}: PlanesOut needs lo <= hi within +-255 and shift 0 or 1 (ops.quantize._qp_params of "
                         f"the format), got lo={spec.lo}, hi={spec.hi}, shift={spec.shift}")
    if residual is not None or out_int8 is not None:
        raise ValueError(f"{op}: out=PlanesOut(...) writes only the planes; residual and out_int8 need a float out")
    return spec


def conv2d_fwd_int8(x: torch.Tensor, w: torch.Tensor, *, stride=1, padding=0, dilation=1, scale=None, bias=None,
                    act=None, out="float16", acc_mul: int = 1, acc_add: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, out_int8=None, acc_add_interior: bool = False,
                    config: dict | None = None, return_kernel: bool = False):
    """Exact int8 convolution (int32 accumulation) with a fused epilogue, NHWC.

    ``x`` (N, H, W, C) and ``w`` (K, R, S, C) int8, contiguous.  ``scale``: None, a number, or a float
    tensor of 1 or K elements; ``bias``: None or a float tensor of K elements; ``act``: None, "relu",
    ("leaky", slope), ("clamp", lo, hi) (ReLU6: ("clamp", 0.0, 6.0)), "hardswish" or "silu"
    (``reference_conv_int8_fp8`` says each in float32 operations; the last three are a compiled variant of their
    own); ``out``: "float16", "float32", "int32" (the raw accumulator, no epilogue) or ("int8", out_scale)
    (``clamp(round_half_even(y / out_scale), -128, 127)``, NHWC: the next int8 layer's input), or "bfloat16", or
    ("e4m3", out_scale) / ("e5m2", out_scale): float8 codes of ``y / out_scale``
    (saturated, round to nearest even, NaN kept: ``quantize_fp8_static``'s), the next FP8 layer's input.
    Returns y (N, P, Q, K) (and the compiled kernel with ``return_kernel=True``).

    Operands stored with an offset (uint8 codes as ``code - 128``: ``tcprec.ops.qconv``) are corrected
    exactly before the epilogue: ``acc = acc * acc_mul + acc_add[p, q, k]`` with ``acc_add`` int32 of
    shape (K,) (the same for every pixel) or (P, Q, K) (per output position, e.g. a padded border), on
    x's device; the caller guarantees that the corrected sum fits int32.  ``acc_add_interior=True`` promises that a
    (P, Q, K) ``acc_add`` is the same at every position whose window lies inside the image (the in-image
    correction of a padded conv): the kernel then reads that one row for interior pixels and gathers only at the
    border (an int32 gathered per output cost ResNet-18's 56x56x64 3x3 conv at batch 256 126 -> 249 us on an H200).

    ``residual`` (float16 / float32 / bfloat16 (N, P, Q, K), contiguous): a ResNet block's shortcut, added
    after the bias and before ``act`` as the unfused graph adds it -- the branch rounded to the residual's
    dtype, one float32 add, the sum rounded to that dtype (an int8 ``out`` then quantizes ``act`` of it
    rounded to that dtype).
    ``out_int8=("int8", out_scale[, (lo, hi, offset)])`` with a float ``out``: the dual output, returns
    ``(y, y8)``: the float result and the int8 codes of that float (as ``out=("int8", ...)`` would compute them
    from it), so a block's output feeds both the next residual and the next INT8 layer from one pass;
    ``out_int8=("e4m3" | "e5m2", out_scale)``: the same with the float8 codes of that float (the next FP8 layer's).
    ``out=PlanesOut(out_scale, bits, lo, hi, offset, shift, pool, compact)``: the next bit-serial layer's packed
    planes int32 (bits, N * P' * Q', Kw) -- (2x2 max-pool ->) quantize -> pack in the epilogue, no float output.

    >>> x = torch.randint(-128, 128, (8, 56, 56, 64), dtype=torch.int8, device="cuda")  # doctest: +SKIP
    >>> w = torch.randint(-128, 128, (64, 3, 3, 64), dtype=torch.int8, device="cuda")   # doctest: +SKIP
    >>> y = conv2d_fwd_int8(x, w, padding=1, scale=1e-4, act="relu", out=("int8", 0.05))  # doctest: +SKIP
    >>> r = torch.randn(8, 56, 56, 64, dtype=torch.float16, device="cuda")                # doctest: +SKIP
    >>> y, y8 = conv2d_fwd_int8(x, w, padding=1, scale=1e-4, act="relu", residual=r,
    ...                         out="float16", out_int8=("int8", 0.05))                  # doctest: +SKIP
    """
    op = "conv2d_fwd_int8"
    g = geometry(x, w, stride, padding, dilation, op)
    if x.dtype != torch.int8 or w.dtype != torch.int8:
        raise TypeError(f"{op}: x and w must be int8 codes, got x {x.dtype}, w {w.dtype}; "
                        "for float8 use conv2d_fwd_fp8, for other formats quantize to int8 first")
    if isinstance(out, PlanesOut):
        kind, out_scale, out8 = "planes", _check_planes_out(out, g, act, residual, out_int8, op), None
    else:
        kind, out_scale, out8 = _parse_outs(out, out_int8, ("float16", "float32", "bfloat16", "int32", "int8",
                                                             *FP8_KINDS), op)
    res = _check_residual(residual, g, x.device, kind, op)
    add = _check_add(acc_mul, acc_add, g, x.device, op)
    if kind == "int32" and (scale is not None or bias is not None or act is not None):
        raise ValueError(f"{op}: out='int32' returns the raw accumulator; scale, bias and act must be None "
                         f"(got scale={scale!r}, bias={'a tensor' if bias is not None else None}, act={act!r})")
    alpha, sb_t, sb_stride = _scale_arg(scale, "scale", g.K, x.device, op)
    one = (_const(x.device, 1.0), 0)
    y, kernel = _launch(x, w, g, op, fp8=False, alpha=alpha, sa=one, sb=(sb_t, sb_stride), bias=bias, act=act,
                        out=(kind, out_scale), fast_accum=False, config=config, add=add, acc_mul=acc_mul, res=res,
                        out8=out8, add_interior=bool(acc_add_interior))
    return (y, kernel) if return_kernel else y


def conv2d_fwd_fp8(x: torch.Tensor, w: torch.Tensor, x_scale=1.0, w_scale=1.0, *, stride=1, padding=0, dilation=1,
                   bias=None, act=None, out="float16", fast_accum: bool = False, residual: torch.Tensor | None = None,
                   out_int8=None, config: dict | None = None, return_kernel: bool = False):
    """fp8 convolution (fp32 accumulation) with a fused epilogue, NHWC.

    ``x`` (N, H, W, C) and ``w`` (K, R, S, C) float8_e4m3fn (or float8_e5m2), contiguous; the result is
    ``x_scale * w_scale[k] * conv(x, w)`` (+ bias, act: as :func:`conv2d_fwd_int8`'s).  Scales: numbers, or float
    tensors of 1 (either) or K (w_scale, per output channel) elements -- device tensors keep the call free of host
    syncs.
    ``out``: "float16", "float32", "bfloat16", ("int8", out_scale) or ("e4m3" | "e5m2", out_scale) (float8
    codes).  ``fast_accum=True`` keeps Hopper's narrow fp8
    accumulator for the whole reduction (faster, less accurate).  ``residual`` and ``out_int8``: as
    :func:`conv2d_fwd_int8`'s (the same epilogue).
    """
    op = "conv2d_fwd_fp8"
    g = geometry(x, w, stride, padding, dilation, op)
    if x.dtype not in FP8_DTYPES or w.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: x and w must be float8_e4m3fn or float8_e5m2, got x {x.dtype}, w {w.dtype}; "
                        "for int8 codes use conv2d_fwd_int8")
    kind, out_scale, out8 = _parse_outs(out, out_int8, ("float16", "float32", "bfloat16", "int8", *FP8_KINDS), op)
    res = _check_residual(residual, g, x.device, kind, op)
    a1, sa_t, sa_stride = _scale_arg(x_scale, "x_scale", g.K, x.device, op)
    a2, sb_t, sb_stride = _scale_arg(w_scale, "w_scale", g.K, x.device, op)
    alpha = float(torch.tensor(a1, dtype=torch.float32) * torch.tensor(a2, dtype=torch.float32))
    y, kernel = _launch(x, w, g, op, fp8=True, alpha=alpha, sa=(sa_t, sa_stride), sb=(sb_t, sb_stride), bias=bias,
                        act=act, out=(kind, out_scale), fast_accum=fast_accum, config=config, res=res, out8=out8)
    return (y, kernel) if return_kernel else y
