"""The quantized convolution's operands: the activation and weight containers ``ops.qconv.conv2d`` takes and
returns, and the static quantizers that make them (all re-exported by ``ops/qconv.py``, their public home).

* :class:`PackedActivation`: bit planes ``(bits, N*H*W, words)`` of NHWC codes (padded or compact rows), for the
  bit-serial GEMM; optionally with the float it was quantized from (``hp``, ``out_layout="planes+float"``).
* :class:`Int8Activation`: NHWC codes stored as int8 (``value = offset + step * x8``), the INT8 kernel's operand.
* :class:`Fp8Activation`: a float8 ``QTensor`` and the float it came from (``out_layout="fp8+float"``).
* :class:`PackedConvWeight`: a KRSC weight prepared once for every backend (planes, int8 / float8 views).
* :func:`quantize_int8_static`, :func:`quantize_fp8_static`, :func:`pack_activation`, :func:`pack_conv_weight`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from ..formats import FloatFormat, IntFormat, as_format
from ..kernels import reference_conv_bitserial as rq
from ..kernels import reference_gemm as rg
from ..memo import memo_get, memo_put
from ..packing import pack_bitplanes, packed_words, unpack_bitplanes
from ..qtensor import PerChannel, PerTensor, QTensor
from .codes import decode
from .qconv_plan import _FUSED_POOLS, _check_pool, _fp8_dtype, _int8_affine
from .quantize import _check_static, _qp_params, _static_codes, quantize

__all__ = ["PackedActivation", "Int8Activation", "Fp8Activation", "PackedConvWeight", "quantize_int8_static",
           "pack_activation", "pack_conv_weight", "quantize_fp8_static"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------
# Operand records
# ------------------------------------------------------------------------------------------------


# Scale tensors already checked: checking a CUDA scale reads it back (a host sync), and an eager forward of a
# quantized network passes the same calibrated scale buffers on every call -- 35 syncs an eager ResNet-18 forward
# (H200 profile).  An in-place change bumps the version, so a changed scale is checked again.
_CHECKED_SCALES: dict = {}


def _scale_checked(scale: torch.Tensor) -> bool:
    return memo_get(_CHECKED_SCALES, (scale,)) is not None


def _scale_tensor(scale, device, what: str) -> torch.Tensor:
    """A per-tensor scale as float32 (1,) on ``device``; checked for finite > 0 unless capturing (a tensor once a
    version: see ``_CHECKED_SCALES``)."""
    def bad():  # built only on failure: printing a CUDA tensor syncs, which a graph capture forbids
        return ValueError(f"{what} must be one finite positive number (a float or a one-element tensor), got {scale!r}")

    if isinstance(scale, torch.Tensor):
        s = scale.to(device=device, dtype=torch.float32).reshape(-1)
        if s.numel() != 1:
            raise bad()
        if not (s.is_cuda and torch.cuda.is_current_stream_capturing()) and not _scale_checked(scale):
            if not bool(torch.isfinite(s).all() and (s > 0).all()):  # no sync inside a graph capture
                raise bad()
            memo_put(_CHECKED_SCALES, (scale,), True)
        return s
    try:
        v = float(scale)
    except (TypeError, ValueError):
        raise bad() from None
    if not (math.isfinite(v) and v > 0):
        raise bad()
    return torch.full((1,), v, dtype=torch.float32, device=device)  # a fill, no host copy


@dataclass(frozen=True, eq=False)
class PackedActivation:
    """NHWC activations as bit planes: ``value = decode(codes) * scale``.

    planes  int32 ``(bits, N*H*W, packed_words(C))``: one row per pixel, the C channel codes packed
            LSB-first (``tcprec.packing``); the bits past C must be zero (packing guarantees it).  Or
            *compact*, ``(bits, N*H*W, ceil(C / 32))``: the same words without the zero words that pad
            a row to 512 bits -- what a layer that reads its input through an im2col is given
            (``quantize_pack(..., compact=True)``); ``padded_planes()`` restores the full rows.
    fmt     the integer format of the codes; scale float32 ``(1,)`` (per tensor); shape ``(N, H, W, C)``.
    hp      (optional) the float NHWC tensor of ``shape`` the codes were quantized from, when a conv wrote both
            (``out_layout="planes+float"``: a ResNet block's output, its float for the next block's add and its
            planes for the next block's convolutions).

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import pack_activation
    >>> xa = pack_activation(torch.rand(1, 2, 2, 3), "uint2", 0.5)
    >>> xa.planes.shape, xa.dequantize().shape
    (torch.Size([2, 4, 16]), torch.Size([1, 2, 2, 3]))
    """

    planes: torch.Tensor
    fmt: IntFormat
    scale: torch.Tensor
    shape: tuple
    hp: torch.Tensor | None = None

    def __post_init__(self):
        fmt = as_format(self.fmt)
        if not isinstance(fmt, IntFormat):
            raise TypeError(f"PackedActivation holds integer codes, got fmt={fmt}; use an integer format (e.g. 'uint2')")
        object.__setattr__(self, "fmt", fmt)
        shape = tuple(int(v) for v in self.shape)
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"shape must be NHWC (N, H, W, C) of positive sizes, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        N, H, W, C = shape
        want = (fmt.bits, N * H * W, packed_words(C))
        if not isinstance(self.planes, torch.Tensor) or self.planes.dtype != torch.int32:
            raise TypeError("planes must be an int32 tensor (bits, N*H*W, packed_words(C))")
        if tuple(self.planes.shape) not in (want, want[:2] + (-(-C // 32),)):
            raise ValueError(f"planes of a {fmt} activation of shape {shape} must be (bits, N*H*W, packed_words(C)) "
                             f"= {want} or compact (bits, N*H*W, ceil(C / 32)) = {want[:2] + (-(-C // 32),)}, got "
                             f"{tuple(self.planes.shape)}")
        object.__setattr__(self, "scale", _scale_tensor(self.scale, self.planes.device, "scale"))
        if self.hp is not None:
            _check_hp(self.hp, shape, self.planes.device, "None or a float NHWC tensor of the activation's shape")

    @property
    def device(self) -> torch.device:
        return self.planes.device

    @property
    def compact(self) -> bool:
        """Rows without their padding words (see the class docstring)."""
        return self.planes.shape[2] != packed_words(self.shape[3])

    def padded_planes(self) -> torch.Tensor:
        """``planes`` with full rows ``(bits, N*H*W, packed_words(C))`` (a padded copy when compact)."""
        if not self.compact:
            return self.planes
        return torch.nn.functional.pad(self.planes, (0, packed_words(self.shape[3]) - self.planes.shape[2]))

    def codes(self) -> torch.Tensor:
        """The codes, uint8 ``(N, H, W, C)``."""
        return unpack_bitplanes(self.padded_planes(), self.fmt.bits, self.shape[3]).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float NHWC ``(N, H, W, C)``: ``decode(codes) * scale``."""
        return (decode(self.codes(), self.fmt) * self.scale.reshape(())).to(dtype)

    def to_qtensor(self) -> QTensor:
        """The same activations as a dense ``QTensor`` (codes ``(N, H, W, C)``, PerTensor scale)."""
        return QTensor(self.codes(), self.scale.reshape(1, 1, 1, 1), self.fmt, PerTensor(), self.shape, torch.float32)


def pack_activation(x: torch.Tensor, fmt, scale) -> PackedActivation:
    """Quantize float NHWC ``x`` to ``fmt`` with one given ``scale`` and pack it into bit planes.

    >>> import torch
    >>> pack_activation(torch.ones(1, 1, 1, 2), "uint2", 1.0).dequantize().flatten().tolist()
    [1.0, 1.0]
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 4:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float NHWC tensor (N, H, W, C), got {got}; an NCHW tensor is x.permute(0, 2, 3, 1)")
    fmt = as_format(fmt)
    if not isinstance(fmt, IntFormat):
        raise TypeError(f"fmt must be an integer format (e.g. 'uint2', 'int4'), got {fmt}")
    s = _scale_tensor(scale, x.device, "scale")
    qx = quantize(x, fmt, PerTensor(), scale=s.reshape(1, 1, 1, 1))
    N, H, W, C = x.shape
    planes = pack_bitplanes(qx.codes.reshape(N * H * W, C), fmt.bits, validate=False)  # (bits, NHW, Kw)
    return PackedActivation(planes, fmt, s, (N, H, W, C))


@dataclass(frozen=True, eq=False)
class Int8Activation:
    """NHWC activations as the INT8 conv's operand: one int8 ``x8`` per element, ``decode(code) = offset +
    step * x8`` (the rule of :func:`_int8_codes`: two's complement, and unsigned / pm of <= 7 bits, as the
    value; uint8 / pm8 stored as ``code - 128``) and ``value = decode(code) * scale``.

    What :func:`quantize_int8_static` and ``conv2d(..., out_fmt=, out_layout="int8")`` return: chained INT8
    layers hand it to each other, so no float tensor and no shift pass sits between them.

    ``hp`` (optional): the float NHWC tensor of the same shape that the codes were quantized from, when one
    conv wrote both (``out_layout="int8+float"``: a residual block's output is the next block's shortcut in
    float and the next INT8 convs' operand as codes).  ``conv2d(x=...)`` reads the codes; ``residual=`` the float.

    >>> import torch
    >>> xa = quantize_int8_static(torch.tensor([0.0, 1.0, 300.0]).reshape(1, 1, 1, 3), "uint8", torch.tensor([1.0]))
    >>> xa.x8.flatten().tolist(), xa.codes().flatten().tolist()
    ([-128, -127, 127], [0, 1, 255])
    """

    x8: torch.Tensor
    fmt: IntFormat
    scale: torch.Tensor
    hp: torch.Tensor | None = None

    def __post_init__(self):
        fmt = as_format(self.fmt)
        if not isinstance(fmt, IntFormat):
            raise TypeError(f"Int8Activation holds integer codes, got fmt={fmt}; use an integer format (e.g. 'uint8')")
        object.__setattr__(self, "fmt", fmt)
        x8 = self.x8
        if not isinstance(x8, torch.Tensor) or x8.dtype != torch.int8 or x8.dim() != 4 or not x8.is_contiguous():
            got = f"{x8.dtype} {tuple(x8.shape)}" if isinstance(x8, torch.Tensor) else type(x8).__name__
            raise TypeError(f"x8 must be a contiguous int8 NHWC tensor (N, H, W, C), got {got}")
        if self.hp is not None:
            _check_hp(self.hp, x8.shape, x8.device, "None or a float NHWC tensor of x8's shape")
        object.__setattr__(self, "scale", _scale_tensor(self.scale, x8.device, "scale"))

    @property
    def shape(self) -> tuple:
        return tuple(self.x8.shape)

    @property
    def device(self) -> torch.device:
        return self.x8.device

    def affine(self) -> tuple[int, int]:
        """(offset, step): ``decode(code) = offset + step * x8``."""
        return _int8_affine(self.fmt)

    def codes(self) -> torch.Tensor:
        """The codes, uint8 ``(N, H, W, C)``."""
        off, step = self.affine()
        v = off + step * self.x8.to(torch.int16)  # the decoded integer value
        b = self.fmt.bits
        if self.fmt.encoding == "twos":
            c = v & ((1 << b) - 1)
        elif self.fmt.encoding == "unsigned":
            c = v
        else:  # pm: value = 2c - (2^b - 1)
            c = (v + ((1 << b) - 1)) // 2
        return c.to(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        off, step = self.affine()
        return ((off + step * self.x8.to(torch.float32)) * self.scale.reshape(())).to(dtype)


def _check_hp(hp, shape, device, what: str) -> None:
    """A dual-output activation's float ``hp`` must be a floating tensor of ``shape`` on ``device`` (TypeError)."""
    if not isinstance(hp, torch.Tensor) or not hp.is_floating_point() or tuple(hp.shape) != tuple(shape) \
            or hp.device != device:
        got = f"{hp.dtype} {tuple(hp.shape)} on {hp.device}" if isinstance(hp, torch.Tensor) else type(hp).__name__
        raise TypeError(f"hp must be {what} {tuple(shape)} on {device}, got {got}")


@dataclass(frozen=True, eq=False)
class Fp8Activation:
    """A float8 activation with the float it was quantized from: ``qt`` the next FP8 convs' operand (an e4m3 /
    e5m2 ``QTensor`` of codes ``(N, H, W, C)``, PerTensor scale: what :func:`quantize_fp8_static` gives from
    ``hp``) and ``hp`` the float NHWC tensor of the same shape -- what ``conv2d(..., out_fmt="e4m3",
    out_layout="fp8+float")`` returns for a ResNet block's output, read by the next block's convs (``x=``: the
    codes) and by its residual add (``residual=``: the float), written in one epilogue pass.

    >>> import torch
    >>> hp = torch.tensor([1.0, 3.0]).reshape(1, 1, 1, 2)
    >>> a = Fp8Activation(quantize_fp8_static(hp, torch.tensor([0.5])), hp)
    >>> a.shape, a.dequantize().flatten().tolist()
    ((1, 1, 1, 2), [1.0, 3.0])
    """

    qt: QTensor
    hp: torch.Tensor

    def __post_init__(self):
        qt, hp = self.qt, self.hp
        if not isinstance(qt, QTensor) or _fp8_dtype(qt.fmt) is None or qt.ndim != 4 \
                or not isinstance(qt.granularity, PerTensor):
            got = f"a {qt.fmt} QTensor of shape {qt.shape}" if isinstance(qt, QTensor) else type(qt).__name__
            raise TypeError(f"qt must be an e4m3 / e5m2 QTensor of NHWC codes (N, H, W, C) with one scale "
                            f"(quantize_fp8_static), got {got}")
        _check_hp(hp, qt.shape, qt.device, "a float NHWC tensor of the codes' shape")

    @property
    def shape(self) -> tuple:
        return tuple(self.qt.shape)

    @property
    def device(self) -> torch.device:
        return self.qt.device

    @property
    def fmt(self) -> FloatFormat:
        return self.qt.fmt

    @property
    def scale(self) -> torch.Tensor:
        return self.qt.scale.reshape(1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The codes' values (not ``hp``): ``decode(codes) * scale``, float NHWC."""
        return self.qt.dequantize().to(dtype)


def quantize_int8_static(x: torch.Tensor, fmt, scale: torch.Tensor, pool=None, *, backend: str = "auto"
                         ) -> Int8Activation:
    """Float NHWC ``x`` -> (optional 2x2 max-pool ->) the :class:`Int8Activation` of integer format ``fmt``
    with a fixed per-tensor ``scale`` (a one-element float32 tensor on x's device): the codes of
    ``tcprec.ops.quantize.quantize_static`` (round half to even, saturating; NaN -> the code of 0), no host
    sync (capturable).  On CUDA (and under ``TRITON_INTERPRET=1``) one Triton pass
    (``kernels/triton/quant_bytes.py``); elsewhere torch ops.  ``pool``: None, ("max", 2, 2), ("max", 2, 1)
    in the same pass, ("avg", 2, 2) as a torch pass first.  ``backend="reference"``: torch ops everywhere."""
    fmt = _check_static(x, fmt, scale, "quantize_int8_static")
    if x.dim() != 4:
        raise ValueError(f"x must be a float NHWC tensor (N, H, W, C), got shape {tuple(x.shape)}")
    pool = _check_pool(pool)
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    if backend == "auto" and (x.is_cuda or _interpreting()) and (pool is None or pool in _FUSED_POOLS):
        from ..kernels.triton import quant_bytes as qb  # TRITON_INTERPRET is read at import

        enc = {"unsigned": qb.ENC_UNSIGNED, "twos": qb.ENC_TWOS}.get(fmt.encoding, qb.ENC_PM)
        x8 = qb.pool_quantize_int8(x, scale.reshape(1), _FUSED_POOLS.get(pool, 0), fmt.bits, *_qp_params(fmt), enc)
        return Int8Activation(x8, fmt, scale)
    y = rq.pool_nhwc(x, pool)
    codes = _static_codes(y, fmt, scale).to(torch.uint8)
    return Int8Activation(_int8_codes(codes, fmt)[0].contiguous(), fmt, scale)


@dataclass(frozen=True, eq=False)
class PackedConvWeight:
    """A KRSC weight prepared once (BitBLAS's transform_weight): ``qw`` the QTensor ``(K, R, S, C)``,
    ``w_scale`` float32 ``(K,)``, and per backend:

    * bit-serial (integer formats): ``planes`` int32 ``(q, K, Kw_col)`` in the im2col word layout (each
      tap padded to a whole number of words), ``rowsum`` int32 ``(K,)`` = sum of the weighted codes of
      each filter (the correction term when the activations are pm1), and ``conv_planes``, the same weights in
      the implicit-GEMM layout (each tap padded to an even number of words: ``reference_conv_bitserial.conv_tap_words``;
      ``planes`` itself where that is already so);
    * INT8 / FP8 kernels: ``w8`` ``(K, R, S, C)`` contiguous, int8 with ``value = w_off + w_step * w8``
      (integer formats) or the float8 view of the codes (``e4m3`` / ``e5m2``: ``w_off = 0, w_step = 1``);
    * ``corr``: the INT8 kernel's cached corrections for shifted activations (see ``_int8_correction``).

    fp8 weights have no planes (``planes`` and ``rowsum`` are None).
    """

    qw: QTensor
    planes: torch.Tensor | None
    w_scale: torch.Tensor
    rowsum: torch.Tensor | None
    w8: torch.Tensor | None = None
    w_off: int = 0
    w_step: int = 1
    corr: dict = field(default_factory=dict, repr=False)
    conv_planes: torch.Tensor | None = None

    @property
    def shape(self) -> tuple:
        return self.qw.shape

    @property
    def fmt(self) -> IntFormat | FloatFormat:
        return self.qw.fmt

    @property
    def device(self) -> torch.device:
        return self.qw.device


def _check_weight_qtensor(w) -> QTensor:
    if not isinstance(w, QTensor):
        raise TypeError(f"w must be a QTensor of codes (K, R, S, C) (tcprec.quantize(w_krsc, 'binary', PerChannel(0))) "
                        f"or a PackedConvWeight, got {type(w).__name__}")
    if not isinstance(w.fmt, IntFormat) and _fp8_dtype(w.fmt) is None:
        raise TypeError(f"w must be of an integer format (binary, intN, uintN, pmN) or e4m3 / e5m2, got {w.fmt}; "
                        "quantize it to one")
    if w.ndim != 4:
        raise ValueError(f"w must be KRSC (K, R, S, C), got shape {w.shape}; an nn.Conv2d weight (K, C, R, S) is "
                         "w.permute(0, 2, 3, 1)")
    g = w.granularity
    if not (isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis == 0)):
        raise ValueError(f"w's scale is {g}: conv2d needs PerTensor() or PerChannel(0) (one scale per output channel); "
                         "a scale along R, S or C cannot be pulled out of the sum")
    return w


def pack_conv_weight(w: QTensor) -> PackedConvWeight:
    """Pack a KRSC integer weight once for repeated ``conv2d`` calls (no sync: capturable).

    >>> import torch, tcprec as tp
    >>> pw = pack_conv_weight(tp.quantize(torch.randn(8, 3, 3, 5), "binary"))
    >>> pw.planes.shape
    torch.Size([1, 8, 16])
    """
    w = _check_weight_qtensor(w)
    K = w.shape[0]
    w_scale = w.scale.reshape(-1).expand(K).to(torch.float32).contiguous()  # (K,)
    f8 = _fp8_dtype(w.fmt)
    if f8 is not None:
        return PackedConvWeight(w, None, w_scale, None, w.codes.contiguous().view(f8))  # (K, R, S, C) float8
    planes = pack_bitplanes(rq.weight_tap_codes(w.codes), w.fmt.bits, validate=False)  # (q, K, Kw_col)
    rowsum = rg.weighted_rowsums(planes, w.fmt).to(torch.int32)  # (K,): the pm1-activation correction (cheap)
    w8, w_off, w_step = _int8_codes(w.codes, w.fmt)  # (K, R, S, C) int8
    C = w.shape[3]
    cwt = rq.conv_tap_words(C)
    conv_planes = planes if cwt == -(-C // 32) else pack_bitplanes(rq.weight_tap_codes(w.codes, cwt), w.fmt.bits,
                                                                        validate=False)
    return PackedConvWeight(w, planes, w_scale, rowsum, w8, w_off, w_step, conv_planes=conv_planes)


def _int8_codes(codes: torch.Tensor, fmt: IntFormat) -> tuple[torch.Tensor, int, int]:
    """(x8 int8 of codes' shape, offset, step) with value = offset + step * x8: the rule of
    ``ops/matmul.py::_int8_operand``, shape-preserving; a view (no copy) where the pattern is the value."""
    b = fmt.bits
    if fmt.encoding == "twos":
        if b == 8:
            return codes.contiguous().view(torch.int8), 0, 1
        c = codes.to(torch.int16)
        return (c - ((c >> (b - 1)) << b)).to(torch.int8), 0, 1
    if b <= 7:  # unsigned 0..127, pm1 -127..127: the values fit int8 as they are
        if fmt.encoding == "unsigned":
            return codes.contiguous().view(torch.int8), 0, 1
        return (2 * codes.to(torch.int16) - ((1 << b) - 1)).to(torch.int8), 0, 1
    # 8 bits: store u - 128; uint8 = 128 + x8, pm8 = 2u - 255 = 1 + 2 * x8
    return (codes.to(torch.int16) - 128).to(torch.int8), *_int8_affine(fmt)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor, fmt="e4m3") -> QTensor:
    """Float ``x`` -> a float8 ``QTensor`` (``value = decode(codes) * scale``) with a fixed per-tensor
    ``scale`` (a one-element float32 tensor on x's device), with no host sync, so it runs inside a CUDA-graph
    capture (the activation quantizer of an FP8 layer): one Triton pass on CUDA, torch ops elsewhere.
    ``x / scale`` is saturated to +-max (448 for e4m3) and rounded to nearest even by ``.to(torch.float8_e4m3fn)``; NaN stays NaN.
    The codes are the uint8 view of the float8 tensor (no copy); ``conv2d`` views them back.

    >>> import torch
    >>> quantize_fp8_static(torch.tensor([1.0, 3.0, 1e6]), torch.tensor([0.5])).dequantize().tolist()
    [1.0, 3.0, 224.0]
    """
    fmt = as_format(fmt)
    f8 = _fp8_dtype(fmt)
    if f8 is None:
        raise TypeError(f"quantize_fp8_static quantizes to float8_e4m3fn ('e4m3') or float8_e5m2 ('e5m2'), got {fmt}; "
                        "for integer formats use tcprec.ops.quantize.quantize_static")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise TypeError("scale must be a one-element float32 tensor (a calibrated per-tensor scale), got "
                        + (f"{scale.dtype} of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
                           else type(scale).__name__))
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}; keep the scale with the activations")
    m = float(torch.finfo(f8).max)
    if x.is_cuda and 1 <= x.dim() <= 4 and not _interpreting():
        # one Triton pass (divide, clamp, round, write; the same codes as the torch ops below, kernels/triton/
        # fp8_quant.py) instead of four full-size passes with a float32 temporary.  Float activations go through
        # pool_quantize_fp8 (no pool): its tiles follow the channels, so a 3-channel network input costs one pass
        # at memory speed (quantize_fp8's transposing tiles left 61 of 64 lanes idle there: 0.6 ms for AlexNet's
        # 256x224x224x3 input on an H200).  NaN keeps its sign in the codes (torch writes +NaN).
        from ..kernels.triton.fp8_quant import pool_quantize_fp8, quantize_fp8

        if x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            x4 = x
            while x4.dim() < 4:
                x4 = x4.unsqueeze(0)
            codes = pool_quantize_fp8(x4, scale.reshape(1), 0, f8).reshape(x.shape).view(torch.uint8)
        else:
            codes = quantize_fp8(x, scale, torch.empty(x.shape, dtype=f8, device=x.device)).view(torch.uint8)
    else:
        v = torch.clamp(x.to(torch.float32) / scale.reshape(()), -m, m)  # saturate: .to(float8) overflows to NaN
        codes = v.to(f8).view(torch.uint8)  # bit patterns = tcprec's codes of the format
    return QTensor(codes, scale.reshape((1,) * x.dim()), fmt, PerTensor(), tuple(x.shape), x.dtype)
