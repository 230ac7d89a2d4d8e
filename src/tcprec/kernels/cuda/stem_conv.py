"""Build and launch ``stem_conv.cu``: the INT8 convolution of a thin input (C <= 4 channels, a network's RGB stem)
with the next bit-serial layer's epilogue fused -- optional 2x2 stride-2 max-pool, quantize to 1..3-bit codes, pack
into bit planes -- in one launch that reads the int8 image once (no window gather pass).  Without a pool it can write
the float16 / bfloat16 output instead, or that float and the planes of it (a ResNet stem: the float is the first
block's shortcut, the planes its first conv's input).

:func:`conv_planes` computes exactly what ``kernels.triton.conv_fwd.conv2d_fwd_int8(..., out=PlanesOut(...))`` computes
for the same integer sums, and :func:`conv_stem`'s float what ``conv2d_fwd_int8(..., out="float16")`` stores, with the
planes a quantize pass over it writes (the GPU tests compare them bit for bit): ``tcprec.ops.qconv`` routes a thin
8-bit stem that writes bit planes, a 16-bit float or both here on sm_90.  A :class:`StemVariant` fixes what one cubin
is compiled for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...memo import remembered
from .codes import Act, Encoding, OutType
from .runtime import compile_source, launch, launch_config, load_kernel, ptr, set_kernel_attribute

__all__ = ["SOURCE_PATH", "MAX_C", "MAX_WORDS", "ENCODINGS", "FLOAT_OUTS", "StemVariant", "all_variants",
           "stem_weight_words", "stem_thresholds", "conv_stem", "conv_planes", "pick_tile", "StemTile"]

SOURCE_PATH = Path(__file__).with_name("stem_conv.cu")
MAX_C = 4  # input channels (a pixel is one 32-bit word)
MAX_WORDS = 4  # 32-channel output words a block (more channels: more blocks along grid.y)
ENCODINGS = {e.name.lower(): e for e in Encoding}  # output code encodings (TCP_OENC), as bmma_gemm's
FLOAT_OUTS = {torch.float16: OutType.FLOAT16, torch.bfloat16: OutType.BFLOAT16}  # the float output (TCP_FOUT; 0: none)
WARPS = 4
_MAX_SMEM = 227 * 1024


@dataclass(frozen=True)
class StemVariant:
    """What one cubin of stem_conv.cu is compiled for: output code bits and encoding, pool (2: 2x2 stride-2
    max-pool, 1: none), the float output's dtype (``fout``: None, float16 or bfloat16; no pool) and whether the planes
    are written (``planes=False``: the float alone; its code bits and encoding are then the defaults)."""

    out_bits: int = 2
    out_encoding: str = "unsigned"
    pool: int = 2
    fout: torch.dtype | None = None
    planes: bool = True

    def __post_init__(self):
        if self.out_bits not in (1, 2, 3):
            raise ValueError(f"stem_conv writes 1..3-bit codes, got out_bits={self.out_bits!r}")
        if self.out_encoding not in ENCODINGS:
            raise ValueError(f"stem_conv encodings are {tuple(ENCODINGS)}, got out_encoding={self.out_encoding!r}")
        if self.pool not in (1, 2):
            raise ValueError(f"stem_conv pool is 1 (none) or 2 (2x2 stride 2), got pool={self.pool!r}")
        if self.fout is not None and self.fout not in FLOAT_OUTS:
            raise ValueError(f"stem_conv's float output is one of {[str(d) for d in FLOAT_OUTS]} or None, got "
                             f"fout={self.fout!r}")
        if self.fout is not None and self.pool != 1:
            raise ValueError(f"stem_conv writes a float output without a pool: pool=1 with fout={self.fout}, got "
                             f"pool={self.pool!r}")
        if not self.planes and (self.fout is None or (self.out_bits, self.out_encoding) != (2, "unsigned")):
            raise ValueError("stem_conv without planes writes the float alone: pass fout= and leave out_bits / "
                             "out_encoding at their defaults")

    def defines(self) -> list[str]:
        return [f"TCP_OB={self.out_bits}", f"TCP_OENC={int(ENCODINGS[self.out_encoding])}", f"TCP_POOL={self.pool}",
                f"TCP_WARPS={WARPS}", f"TCP_FOUT={int(FLOAT_OUTS.get(self.fout, 0))}",
                f"TCP_PLANES={int(self.planes)}"]

    def __str__(self) -> str:
        f = "" if self.fout is None else "_" + str(self.fout).removeprefix("torch.")
        return (f"o{self.out_bits}{self.out_encoding[0]}_p{self.pool}{f}" if self.planes else f"p{self.pool}{f}")


def all_variants() -> list[StemVariant]:
    """Every variant the kernel is built for: the planes (pooled or not), the float with its planes, the float alone."""
    planes = [StemVariant(b, e, p) for b in (1, 2, 3) for e in ENCODINGS for p in (1, 2)]
    dual = [StemVariant(b, e, 1, d) for b in (1, 2, 3) for e in ENCODINGS for d in FLOAT_OUTS]
    return planes + dual + [StemVariant(pool=1, fout=d, planes=False) for d in FLOAT_OUTS]


def compile_stem(variant: StemVariant, arch: str = "sm_90a", *, use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin, ptxas log) of ``variant``."""
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"stem_conv_{variant}", use_cache=use_cache)


def _kernel(variant: StemVariant, entry: str, device_index: int, smem: int = 0):
    k = load_kernel(("stem_conv", variant, entry, device_index), SOURCE_PATH, variant.defines(),
                    f"stem_conv_{variant}", entry, device_index, 0)
    if smem > 48 * 1024:  # (load_kernel memoises the kernel: the attribute is set for the largest size asked)
        key = ("stem_conv_smem", variant, device_index)
        if _smem_set.get(key, 0) < smem:
            set_kernel_attribute(k, "MAX_DYNAMIC_SHARED_SIZE_BYTES", smem, device_index)
            _smem_set[key] = smem
    return k


_smem_set: dict = {}


def stem_weight_words(w8: torch.Tensor) -> torch.Tensor:
    """(K, R, S, C) int8 -> (ceil(K / 32), KW * 32) int32 in the kernel's B-fragment order.

    Word (k, j) holds channel k's tap j (taps in (r, s) order) as its C bytes (byte c = channel c, zeros above C);
    KW = R*S rounded up to a multiple of 8 (zero taps), zero channels past K.  A 32-channel word's row lays them out
    as (k-step, tile i, lane, e): tap 8 k-step + 4 e + (lane & 3) of channel 8 i + (lane >> 2), so that a lane's two
    B registers of an m16n8k32 tile are one 8-byte shared load, the 4 tiles at fixed offsets."""
    K, R, S, C = w8.shape
    if C > MAX_C:
        raise ValueError(f"stem_conv takes at most {MAX_C} input channels, got C={C}")
    kw = -(-(R * S) // 8) * 8
    b = torch.zeros((-(-K // 32) * 32, kw, 4), dtype=torch.uint8, device=w8.device)
    b[:K, :R * S, :C] = w8.reshape(K, R * S, C).view(torch.uint8)
    words = b.view(torch.int32).reshape(-1, 4, 8, kw // 8, 2, 4)  # (word, tile i, gq, k-step, e, t)
    return words.permute(0, 3, 1, 2, 5, 4).reshape(-1, kw * 32).contiguous()  # (word, k-step, i, gq, t, e)


# The threshold words of calibrated scale / bias buffers, remembered like bmma_gemm.code_thresholds'.
_THRESHOLDS: dict = {}


def stem_thresholds(variant: StemVariant, col_scale: torch.Tensor, bias, out_scale: torch.Tensor, relu: bool,
                    slope: float, K: int) -> torch.Tensor:
    """The kernel's integer threshold words (K, 2^OB) int32 (stem_code_thresholds), on the current stream."""
    srcs = tuple(t for t in (col_scale, bias, out_scale) if t is not None)
    extra = (variant.out_bits, variant.out_encoding, variant.fout, bool(relu), float(slope), int(K), bias is not None)

    def compute():
        dev = out_scale.device.index if out_scale.device.index is not None else torch.cuda.current_device()
        codes = 1 << variant.out_bits
        thr = torch.empty((K, codes), dtype=torch.int32, device=out_scale.device)
        blocks = -(-K * codes // 128)
        launch(_kernel(variant, "stem_code_thresholds", dev), launch_config((blocks,), (128,)), out_scale.device,
               ptr(col_scale), ptr(bias), ptr(out_scale), np.int32(int(relu)), np.float32(slope), np.int32(K), ptr(thr))
        return thr

    return remembered(_THRESHOLDS, srcs, compute, extra)


@dataclass(frozen=True)
class StemTile:
    """A block's outputs: ``tpo`` rows x ``tqo`` columns (pooled for pool 2) of one image."""

    tpo: int
    tqo: int


def _patch(tile: StemTile, pool: int, R: int, S: int, stride, dilation) -> tuple[int, int]:
    ph = (tile.tpo * pool - 1) * stride[0] + (R - 1) * dilation[0] + 1
    pw = (tile.tqo * pool - 1) * stride[1] + (S - 1) * dilation[1] + 1
    return ph, pw


def _raw_words(pw: int, c: int) -> int:
    """stem_conv.cu's raw_words: a patch row's image bytes as aligned words, and one more."""
    return (pw * c + 6) // 4 + 1


def smem_bytes(variant: StemVariant, tile: StemTile, R: int, S: int, stride, dilation, words: int = MAX_WORDS,
               c: int = MAX_C) -> int:
    """Dynamic shared memory of a block of ``words`` 32-channel output words on a ``c``-channel input: weights,
    epilogue vectors, taps, the patch's pixel words and its raw rows."""
    kw = -(-(R * S) // 8) * 8
    ph, pw = _patch(tile, variant.pool, R, S, stride, dilation)
    codes, nb = 1 << variant.out_bits, 32 * words
    return 4 * (nb * kw + nb * codes + 3 * nb + codes + kw + ph * pw + ph * _raw_words(pw, c))


BLOCKS_PER_SM = 4  # pick_tile: the fewest blocks an SM a launch should have before tiles get their full height
_SM_SMEM = 228 * 1024  # shared memory of an SM (each resident block also reserves 1 KB)


def _resident(variant: StemVariant) -> int:
    """Blocks an SM the kernel's registers allow (stem_conv.cu's MIN_BLOCKS)."""
    return 3 if variant.pool == 1 and variant.out_bits == 3 else 4


def pick_tile(variant: StemVariant, PO: int, QO: int, R: int, S: int, stride, dilation, N: int = 256,
              sm_count: int = 132, words: int = MAX_WORDS, c: int = MAX_C) -> StemTile:
    """Columns: the output row in as few tiles of at most 64 as evenly as the unit width (8 windows, or 32 pixels
    without a pool) allows; rows: enough for ~4 units a warp, rounded so the warps get equal shares -- fewer where
    the launch would have under BLOCKS_PER_SM blocks an SM (small batches), where the shared memory of a block would
    keep the SM below the blocks its registers allow, or while the input patch does not fit in shared memory."""
    uw = 8 if variant.pool == 2 else 32
    per = -(-QO // -(-QO // 64))
    tqo = -(-per // uw) * uw
    upr = tqo // uw
    tpo = max(1, min(PO, -(-4 * WARPS // upr)))
    while tpo < PO and (tpo * upr) % WARPS:
        tpo += 1
    while tpo > 1 and N * -(-PO // tpo) * -(-QO // tqo) < BLOCKS_PER_SM * sm_count:
        tpo -= 1
    tile = StemTile(tpo, tqo)
    smem = lambda t: smem_bytes(variant, t, R, S, stride, dilation, words, c)  # noqa: E731
    share = _SM_SMEM // _resident(variant) - 1024
    if tile.tpo > 1 and smem(tile) > share:
        while tile.tpo > 1 and smem(tile) > share:
            tile = StemTile(tile.tpo - 1, tile.tqo)
        even = [p for p in range(tile.tpo, 0, -1) if (p * upr) % WARPS == 0]  # (equal shares for the warps again)
        tile = StemTile(even[0], tile.tqo) if even else tile
    if smem(tile) > _MAX_SMEM:
        raise ValueError(f"stem_conv: a {R}x{S} filter with stride {stride} needs {smem(tile)} "
                         f"bytes of shared memory for one row of {tile.tqo} outputs, more than {_MAX_SMEM}")
    return tile


def conv_planes(x8: torch.Tensor, wq: torch.Tensor, K: int, R: int, S: int, **kw) -> torch.Tensor:
    """Planes (out_bits, N * P' * Q', ldo) int32 of the stem (:func:`conv_stem` without a float output)."""
    return conv_stem(x8, wq, K, R, S, **kw)[1]


def conv_stem(x8: torch.Tensor, wq: torch.Tensor, K: int, R: int, S: int, *, stride=(1, 1), padding=(0, 0),
              dilation=(1, 1), col_scale: torch.Tensor, bias, out_scale: torch.Tensor | None, act=None,
              acc_add: torch.Tensor | None = None, pad: int = 0, out_bits: int = 2, out_encoding: str = "unsigned",
              pool: int = 0, ldo: int | None = None, fout: torch.dtype | None = None, planes: bool = True,
              tile: StemTile | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(y, planes)``: ``y = act(float(C) * col_scale[k] + bias[k])``, C = conv(x8, w) + acc_add[k] over the int8
    codes ``x8`` (N, H, W, C <= 4) with padded taps holding code ``pad``, ``wq`` from :func:`stem_weight_words`;
    ``act``: None, "relu" or ("leaky", slope >= 0).

    ``fout`` (float16 / bfloat16, no pool): y stored as (N, P, Q, K) of that dtype, else None.  ``planes``: (out_bits,
    N * P' * Q', ldo) int32 of y ((2x2 stride-2 max-pool ->) quantized to ``out_bits``-bit codes of y / out_scale ->
    packed; of the stored float when there is one), ``ldo`` words a row (default ceil(K / 32), words past it zeroed),
    else None."""
    N, H, W, C = x8.shape
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    if x8.dtype != torch.int8 or not x8.is_contiguous() or C > MAX_C:
        raise ValueError(f"stem_conv needs contiguous int8 (N, H, W, C <= {MAX_C}) codes, got {x8.dtype} "
                         f"{tuple(x8.shape)}")
    if pool not in (0, 2):
        raise ValueError(f"stem_conv pool is 0 (none) or 2 (2x2 stride 2), got {pool!r}")
    if P < 1 or Q < 1 or (pool == 2 and (P < 2 or Q < 2)):
        raise ValueError(f"stem_conv: output {P} x {Q} is too small" + (" for a 2x2 pool" if pool else ""))
    if planes and out_scale is None:
        raise ValueError("stem_conv: the planes need out_scale (the next layer's activation scale)")
    relu, slope, a = _act(act)
    if not -128 <= pad <= 127:
        raise ValueError(f"stem_conv: the padding code must be an int8, got {pad}")
    variant = (StemVariant(out_bits, out_encoding, 2 if pool == 2 else 1, fout) if planes else
               StemVariant(pool=2 if pool == 2 else 1, fout=fout, planes=False))
    want = (-(-K // 32), -(-(R * S) // 8) * 8 * 32)
    if tuple(wq.shape) != want or wq.dtype != torch.int32:
        raise ValueError(f"stem_conv: wq must be stem_weight_words(w8) of shape {want} int32, got {tuple(wq.shape)} "
                         f"{wq.dtype}")
    words = min(-(-K // 32), MAX_WORDS)
    PO, QO = (P // 2, Q // 2) if pool == 2 else (P, Q)
    if N * PO * QO >= 2**31:
        raise ValueError(f"stem_conv: {N} x {PO} x {QO} output rows reach 2^31 (int32 row indices); split the batch")
    ldo = -(-K // 32) if ldo is None else ldo
    if ldo < -(-K // 32):
        raise ValueError(f"stem_conv: ldo={ldo} is less than the {-(-K // 32)} words of {K} channels")
    tile = tile or pick_tile(variant, PO, QO, R, S, stride, dilation, N,
                             torch.cuda.get_device_properties(x8.device).multi_processor_count, words, C)
    tp, tq = -(-PO // tile.tpo), -(-QO // tile.tqo)
    phh, pww = _patch(tile, variant.pool, R, S, stride, dilation)
    smem = smem_bytes(variant, tile, R, S, stride, dilation, words, C)
    if smem > _MAX_SMEM:
        raise ValueError(f"stem_conv: tile {tile} needs {smem} bytes of shared memory, more than {_MAX_SMEM}")
    dev = x8.device.index if x8.device.index is not None else torch.cuda.current_device()
    # the integer path's threshold words (with a float output: of the stored value, its rounding included)
    thr = stem_thresholds(variant, col_scale, bias, out_scale, relu, slope, K) if planes else None
    out = torch.empty((out_bits, N * PO * QO, ldo), dtype=torch.int32, device=x8.device) if planes else None
    y = torch.empty((N, P, Q, K), dtype=fout, device=x8.device) if fout is not None else None
    cfg = launch_config((N * tp * tq, -(-K // (32 * words))), (32 * WARPS,), smem)
    geo = np.array([N, H, W, C, R, S, sh, sw, ph, pw, dh, dw, PO, QO, K, tile.tpo, tile.tqo, tp, tq, phh, pww,
                    -(-(R * S) // 8) * 8], dtype=np.int32)
    launch(_kernel(variant, "stem_conv", dev, smem), cfg, x8.device, ptr(x8), ptr(wq), ptr(thr), ptr(col_scale),
           ptr(bias), ptr(out_scale), np.int32(a), np.float32(slope), ptr(acc_add),
           np.int32(pad), ptr(out), np.int32(ldo), np.int32(words), *[np.int32(v) for v in geo], ptr(y))
    return y, out


def _act(act) -> tuple[bool, float, Act]:
    """(relu for the thresholds, slope, the kernel's act code)."""
    if act is None:
        return False, 0.0, Act.NONE
    if act == "relu":
        return True, 0.0, Act.RELU
    if isinstance(act, tuple) and len(act) == 2 and act[0] == "leaky" and float(act[1]) >= 0:
        return True, float(act[1]), Act.LEAKY
    raise ValueError(f"stem_conv act must be None, 'relu' or ('leaky', slope >= 0), got {act!r}")
