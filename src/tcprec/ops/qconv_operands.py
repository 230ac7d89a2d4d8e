"""The quantized convolution's operands: the activation ``QTensor`` layouts ``ops.qconv.conv2d`` takes and returns,
the prepared weight, and the static quantizers that make them (all re-exported by ``ops/qconv.py``, their public
home).

Activations are ``QTensor`` of NHWC shape ``(N, H, W, C)`` with one scale (``PerTensor``), in the layout their
consumer's kernel reads (``tcprec.qtensor``): ``Dense()`` codes, ``BitPlanes()`` (rows ``N*H*W``, padded or compact:
the bit-serial GEMM's operand), ``ShiftedInt8()`` (the INT8 kernel's), float8 codes (``Dense()`` e4m3 / e5m2).  A conv
that writes its float result too (a residual block's output) returns the codes with ``hp``, that float.

* :func:`planes_qtensor`, :func:`int8_qtensor`: a kernel's output (planes / int8) as that QTensor, the scale checked.
* :class:`PackedConvWeight`: a KRSC weight prepared once for every backend (planes, int8 / float8 views).
* :func:`quantize_int8_static`, :func:`quantize_fp8_static`, :func:`pack_activation`, :func:`pack_conv_weight`.
* :func:`max_pool_quantize`, :func:`layer_norm_quantize`: a max-pool / a LayerNorm that writes its readers' operand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..formats import FloatFormat, IntFormat, as_format
from ..kernels import reference_conv_bitserial as rq
from ..kernels import reference_gemm as rg
from ..kernels.triton._host import interpreting
from ..memo import memo_get, memo_put
from ..packing import pack_bitplanes, packed_words
from ..qtensor import BitPlanes, PerChannel, PerTensor, QTensor, ShiftedInt8, int8_codes
from .qconv_plan import _FUSED_POOLS, _check_pool, _fp8_dtype
from .quantize import _check_static, _qp_params, _static_codes, quantize, quantize_pack

__all__ = ["PackedConvWeight", "planes_qtensor", "int8_qtensor", "quantize_int8_static", "pack_activation",
           "pack_conv_weight", "quantize_fp8_static", "max_pool_quantize", "max_pool_planes", "max_pool_window",
           "MAX_POOL_OPERANDS",
           "layer_norm_quantize", "LAYER_NORM_OPERANDS", "LAYER_NORM_MAX_C"]


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


def planes_qtensor(planes: torch.Tensor, fmt, scale, shape, hp: torch.Tensor | None = None) -> QTensor:
    """NHWC activations of ``shape`` ``(N, H, W, C)`` given as bit planes, int32 ``(bits, N*H*W, packed_words(C))``
    or compact ``(bits, N*H*W, ceil(C / 32))`` (the layout follows the width): a ``BitPlanes`` QTensor of integer
    ``fmt`` with the one ``scale`` (a float or a one-element tensor, checked finite and > 0) and the optional float
    ``hp`` (``out_layout="planes+float"``).  The bits past C must be zero (packing guarantees it).

    >>> import torch
    >>> planes_qtensor(torch.zeros(2, 4, 16, dtype=torch.int32), "uint2", 0.5, (1, 2, 2, 3)).layout
    BitPlanes(compact=False)
    """
    fmt = as_format(fmt)
    if not isinstance(fmt, IntFormat):
        raise TypeError(f"bit-plane activations hold integer codes, got fmt={fmt}; use an integer format (e.g. 'uint2')")
    shape = tuple(int(v) for v in shape)
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"shape must be NHWC (N, H, W, C) of positive sizes, got {shape}")
    N, H, W, C = shape
    want = (fmt.bits, N * H * W, packed_words(C))
    if not isinstance(planes, torch.Tensor) or planes.dtype != torch.int32:
        raise TypeError("planes must be an int32 tensor (bits, N*H*W, packed_words(C))")
    if tuple(planes.shape) not in (want, want[:2] + (-(-C // 32),)):
        raise ValueError(f"planes of a {fmt} activation of shape {shape} must be (bits, N*H*W, packed_words(C)) "
                         f"= {want} or compact (bits, N*H*W, ceil(C / 32)) = {want[:2] + (-(-C // 32),)}, got "
                         f"{tuple(planes.shape)}")
    compact = planes.shape[2] != packed_words(C)
    s = _scale_tensor(scale, planes.device, "scale")
    return QTensor(planes, s.reshape(1, 1, 1, 1), fmt, PerTensor(), shape, torch.float32, BitPlanes(compact), hp)


def pack_activation(x: torch.Tensor, fmt, scale) -> QTensor:
    """Quantize float NHWC ``x`` to ``fmt`` with one given ``scale`` into a ``BitPlanes()`` QTensor (planes
    ``(bits, N*H*W, packed_words(C))``).

    >>> import torch
    >>> xa = pack_activation(torch.ones(1, 1, 1, 2), "uint2", 1.0)
    >>> xa.data.shape, xa.dequantize().flatten().tolist()
    (torch.Size([2, 1, 16]), [1.0, 1.0])
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
    return planes_qtensor(planes, fmt, s, (N, H, W, C))


def int8_qtensor(x8: torch.Tensor, fmt, scale, hp: torch.Tensor | None = None) -> QTensor:
    """NHWC activations given as the INT8 conv's operand, one int8 per element (``decode(code) = offset + step * x8``,
    ``tcprec.qtensor.int8_affine``): a ``ShiftedInt8()`` QTensor of integer ``fmt`` with the one ``scale`` (checked
    finite and > 0) and the optional float ``hp`` (``out_layout="int8+float"``).

    >>> import torch
    >>> int8_qtensor(torch.tensor([-128, 127], dtype=torch.int8).reshape(1, 1, 1, 2), "uint8", 1.0).codes.flatten().tolist()
    [0, 255]
    """
    fmt = as_format(fmt)
    if not isinstance(fmt, IntFormat):
        raise TypeError(f"int8 activations hold integer codes, got fmt={fmt}; use an integer format (e.g. 'uint8')")
    if not isinstance(x8, torch.Tensor) or x8.dtype != torch.int8 or x8.dim() != 4 or not x8.is_contiguous():
        got = f"{x8.dtype} {tuple(x8.shape)}" if isinstance(x8, torch.Tensor) else type(x8).__name__
        raise TypeError(f"x8 must be a contiguous int8 NHWC tensor (N, H, W, C), got {got}")
    s = _scale_tensor(scale, x8.device, "scale")
    return QTensor(x8, s.reshape(1, 1, 1, 1), fmt, PerTensor(), tuple(x8.shape), torch.float32, ShiftedInt8(), hp)


def quantize_int8_static(x: torch.Tensor, fmt, scale: torch.Tensor, pool=None, *, backend: str = "auto"
                         ) -> QTensor:
    """Float NHWC ``x`` -> (optional 2x2 max-pool ->) the ``ShiftedInt8()`` QTensor of integer format ``fmt``
    with a fixed per-tensor ``scale`` (a one-element float32 tensor on x's device): the codes of
    ``tcprec.ops.quantize.quantize_static`` (round half to even, saturating; NaN -> the code of 0), no host
    sync (capturable).  On CUDA (and under ``TRITON_INTERPRET=1``) one Triton pass
    (``kernels/triton/quant_bytes.py``); elsewhere torch ops.  ``pool``: None, ("max", 2, 2), ("max", 2, 1)
    in the same pass, ("avg", 2, 2) as a torch pass first.  ``backend="reference"``: torch ops everywhere.

    >>> import torch
    >>> xa = quantize_int8_static(torch.tensor([0.0, 1.0, 300.0]).reshape(1, 1, 1, 3), "uint8", torch.tensor([1.0]))
    >>> xa.data.flatten().tolist(), xa.codes.flatten().tolist()
    ([-128, -127, 127], [0, 1, 255])
    """
    fmt = _check_static(x, fmt, scale, "quantize_int8_static")
    if x.dim() != 4:
        raise ValueError(f"x must be a float NHWC tensor (N, H, W, C), got shape {tuple(x.shape)}")
    pool = _check_pool(pool)
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    if backend == "auto" and (x.is_cuda or interpreting()) and (pool is None or pool in _FUSED_POOLS):
        from ..kernels.triton import quant_bytes as qb  # TRITON_INTERPRET is read at import

        enc = {"unsigned": qb.ENC_UNSIGNED, "twos": qb.ENC_TWOS}.get(fmt.encoding, qb.ENC_PM)
        x8 = qb.pool_quantize_int8(x, scale.reshape(1), _FUSED_POOLS.get(pool, 0), fmt.bits, *_qp_params(fmt), enc)
        return int8_qtensor(x8, fmt, scale)
    y = rq.pool_nhwc(x, pool)
    codes = _static_codes(y, fmt, scale).to(torch.uint8)
    return int8_qtensor(int8_codes(codes, fmt)[0].contiguous(), fmt, scale)


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
    w8, w_off, w_step = int8_codes(w.codes, w.fmt)  # (K, R, S, C) int8
    C = w.shape[3]
    cwt = rq.conv_tap_words(C)
    conv_planes = planes if cwt == -(-C // 32) else pack_bitplanes(rq.weight_tap_codes(w.codes, cwt), w.fmt.bits,
                                                                        validate=False)
    return PackedConvWeight(w, planes, w_scale, rowsum, w8, w_off, w_step, conv_planes=conv_planes)





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
    if x.is_cuda and 1 <= x.dim() <= 4 and not interpreting():
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


MAX_POOL_OPERANDS = ("int8", "planes", "compact", "fp8")


def max_pool_window(kernel_size, stride, padding) -> tuple:
    """``nn.MaxPool2d``'s arguments -> the window ((KH, KW), (SH, SW), (PH, PW)) of :func:`max_pool_quantize`
    (``stride=None`` is the kernel size, as torch)."""
    def two(v, name):
        v = (v, v) if isinstance(v, int) else tuple(v)
        if len(v) != 2 or not all(isinstance(i, int) for i in v):
            raise ValueError(f"max-pool {name} must be an int or a pair of ints, got {v!r}")
        return v

    k = two(kernel_size, "kernel_size")
    return k, two(k if stride is None else stride, "stride"), two(padding, "padding")


def max_pool_quantize(x: torch.Tensor, window, operand: str, fmt, scale: torch.Tensor, *, with_float: bool = False,
                      backend: str = "auto") -> QTensor:
    """Float NHWC ``x`` -> ``nn.MaxPool2d`` of ``window`` ((KH, KW), (SH, SW), (PH, PW); floor, dilation 1; torch's
    rule: NaN propagates) -> the operand quantized convolutions read, with the fixed per-tensor ``scale``:
    ``operand`` ``"int8"`` (the ``ShiftedInt8`` QTensor of :func:`quantize_int8_static`), ``"planes"`` /
    ``"compact"`` (a ``BitPlanes`` QTensor, rows padded to 512 bits or not: ``quantize_pack``'s), ``"fp8"`` (the
    float8 QTensor of :func:`quantize_fp8_static`; ``fmt`` e4m3 / e5m2).  ``with_float``: the pooled float (NHWC, x's
    dtype) rides along as the QTensor's ``hp``, for a residual add that reads the pool too.  On CUDA (and under
    ``TRITON_INTERPRET=1``) one Triton pass (``kernels/triton/pool_window.py``); elsewhere, or with
    ``backend="reference"``, torch's ``max_pool2d`` and the quantizer: the same codes (max-pooling is exact in any
    float dtype).

    >>> import torch
    >>> x = torch.tensor([0.0, 1.0, 7.0, 2.0]).reshape(1, 2, 2, 1)
    >>> max_pool_quantize(x, max_pool_window(2, 2, 0), "int8", "uint8", torch.tensor([1.0])).codes.flatten().tolist()
    [7]
    """
    if operand not in MAX_POOL_OPERANDS:
        raise ValueError(f"operand must be one of {MAX_POOL_OPERANDS}, got {operand!r}")
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.dtype.is_floating_point:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"max_pool_quantize: x must be a float NHWC tensor (N, H, W, C), got {got}")
    (kh, kw), (sh, sw), (ph, pw) = window
    fmt = as_format(fmt)
    if operand == "fp8":
        if _fp8_dtype(fmt) is None:
            raise TypeError(f"operand 'fp8' holds float8 codes (e4m3 / e5m2), got fmt={fmt}")
    else:
        fmt = _check_static(x, fmt, scale, "max_pool_quantize")
    if backend == "auto" and (x.is_cuda or interpreting()):
        from ..kernels.triton import pool_window as pw_  # TRITON_INTERPRET is read at import

        s = scale.reshape(1)
        if operand == "fp8":
            f8, hp = pw_.pool_window_fp8(x, s, window, _fp8_dtype(fmt), with_float=with_float)
            return QTensor(f8.view(torch.uint8), scale.reshape(1, 1, 1, 1), fmt, PerTensor(), tuple(f8.shape), x.dtype,
                           hp=hp)
        N, H, W, C = x.shape
        P, Q = pw_.pooled_size(H, W, window)
        if operand == "int8":
            from ..kernels.triton import quant_bytes as qb

            enc = {"unsigned": qb.ENC_UNSIGNED, "twos": qb.ENC_TWOS}.get(fmt.encoding, qb.ENC_PM)
            x8, hp = pw_.pool_window_int8(x, s, window, fmt.bits, *_qp_params(fmt), enc, with_float=with_float)
            return int8_qtensor(x8, fmt, scale, hp)
        planes, hp = pw_.pool_window_pack(x, s, window, fmt.bits, *_qp_params(fmt), compact=operand == "compact",
                                          with_float=with_float)
        return planes_qtensor(planes, fmt, scale, (N, P, Q, C), hp)
    y = torch.nn.functional.max_pool2d(x.permute(0, 3, 1, 2), (kh, kw), (sh, sw), (ph, pw)).permute(0, 2, 3, 1)
    hp = y.contiguous() if with_float else None
    if operand == "fp8":
        return replace(quantize_fp8_static(y, scale, fmt), hp=hp)
    if operand == "int8":
        q = quantize_int8_static(y, fmt, scale, backend="reference")
        return int8_qtensor(q.data, fmt, scale, hp)
    N, P, Q, C = y.shape
    planes = quantize_pack(y.reshape(N * P * Q, C), fmt, scale, backend="reference", compact=operand == "compact")
    return planes_qtensor(planes, fmt, scale, (N, P, Q, C), hp)


def max_pool_planes(x: QTensor, window, *, compact: bool = False, backend: str = "auto") -> QTensor:
    """A ``BitPlanes`` QTensor of NHWC codes (a producer's quantized output: a ResNet stem chained to its pool) ->
    ``nn.MaxPool2d`` of ``window`` over the codes -> a ``BitPlanes`` QTensor of the pooled shape, the same format and
    scale, rows padded to 512 bits or ``compact``.  Quantizing is monotone (the codes ordered as their values), so
    this equals the codes of the pooled float bit for bit -- :func:`max_pool_quantize` of the float the producer
    quantized.  On CUDA (and under ``TRITON_INTERPRET=1``) one Triton pass (``kernels/triton/pool_window.py``
    ``pool_planes``, bit-sliced: codes of 1..3 bits); elsewhere, or with ``backend="reference"``, torch's
    ``max_pool2d`` of the codes' values (any bits)."""
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    if not isinstance(x, QTensor) or not isinstance(x.layout, BitPlanes) or len(x.shape) != 4:
        got = (f"a {x.layout!r} QTensor of shape {x.shape}" if isinstance(x, QTensor) else type(x).__name__)
        raise ValueError(f"max_pool_planes: x must be a BitPlanes QTensor of NHWC codes (N, H, W, C), got {got}; "
                         "max_pool_quantize pools a float tensor")
    (kh, kw), (sh, sw), (ph, pw) = window
    if not (0 <= 2 * ph <= kh and 0 <= 2 * pw <= kw):
        raise ValueError(f"max_pool_planes: padding {(ph, pw)} must be at most half the kernel {(kh, kw)} (torch's "
                         "rule: every window then holds a pixel of the image)")
    fmt = x.element_format
    N, H, W, C = x.shape
    twos = fmt.encoding == "twos"
    if backend == "auto" and (x.device.type == "cuda" or interpreting()):
        from ..kernels.triton import pool_window as pw_  # TRITON_INTERPRET is read at import

        P, Q = pw_.pooled_size(H, W, window)
        planes = pw_.pool_planes(x.data, x.shape, window, fmt.bits, twos, compact=compact)
        return planes_qtensor(planes, fmt, x.scale, (N, P, Q, C))
    flip = (1 << (fmt.bits - 1)) if twos else 0
    order = (x.codes.to(torch.int32) ^ flip).to(torch.float32)  # exact small integers, ordered as the values
    y = torch.nn.functional.max_pool2d(order.permute(0, 3, 1, 2), (kh, kw), (sh, sw), (ph, pw)).permute(0, 2, 3, 1)
    codes = (y.to(torch.int32) ^ flip).to(torch.uint8).contiguous()
    return planes_qtensor(BitPlanes(compact=compact).pack(codes, fmt), fmt, x.scale, tuple(codes.shape))


LAYER_NORM_OPERANDS = ("int8", "fp8")
LAYER_NORM_MAX_C = 16384  # kernels/triton/layer_norm_quant.MAX_C (importing that module here would load Triton)


def layer_norm_quantize(x: torch.Tensor, weight, bias, eps: float, operand: str, fmt, scale: torch.Tensor, *,
                        backend: str = "auto") -> QTensor:
    """Float ``x (..., C)`` -> ``F.layer_norm`` over its last dimension (``weight`` / ``bias``: (C,) or None; ``eps``)
    -> the operand quantized linears read, with the fixed per-tensor ``scale``: ``operand`` ``"int8"`` (a
    ``ShiftedInt8`` QTensor of integer ``fmt``, the codes of :func:`quantize_int8_static`) or ``"fp8"`` (the float8
    QTensor of :func:`quantize_fp8_static`; ``fmt`` e4m3 / e5m2), of x's shape.  The LayerNorm is computed in float32
    and rounded to x's dtype, as torch writes it, before the quantizer; no host sync (capturable).  On CUDA (and under
    ``TRITON_INTERPRET=1``) one Triton pass (``kernels/triton/layer_norm_quant.py``, C <= its ``MAX_C``); elsewhere,
    or with ``backend="reference"``, torch's ``F.layer_norm`` and the quantizer.  The two agree code for code except
    where their float32 statistics round an element of x's dtype one ulp apart (rare: the kernel's docstring).

    >>> import torch
    >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    >>> layer_norm_quantize(x, None, None, 0.0, "int8", "int8", torch.tensor([0.1])).codes.flatten().tolist()
    [243, 252, 4, 13]
    """
    if operand not in LAYER_NORM_OPERANDS:
        raise ValueError(f"operand must be one of {LAYER_NORM_OPERANDS}, got {operand!r}")
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.dtype.is_floating_point or x.shape[-1] < 1:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"layer_norm_quantize: x must be a float tensor (..., C) with C >= 1, got {got}")
    C = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (C,) or t.device != x.device):
            got = f"shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"layer_norm_quantize: {name} must be None or a tensor of shape ({C},) on x's device, "
                             f"got {got}")
    fmt = as_format(fmt)
    if operand == "fp8":
        f8 = _fp8_dtype(fmt)
        if f8 is None:
            raise TypeError(f"operand 'fp8' holds float8 codes (e4m3 / e5m2), got fmt={fmt}")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
                or scale.device != x.device:
            raise TypeError("scale must be a one-element float32 tensor on x's device (the readers' calibrated "
                            "scale), got " + (f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}"
                                              if isinstance(scale, torch.Tensor) else type(scale).__name__))
    else:
        fmt = _check_static(x, fmt, scale, "layer_norm_quantize")
    if backend == "auto" and (x.is_cuda or interpreting()):
        if C > LAYER_NORM_MAX_C:
            raise ValueError(f"layer_norm_quantize: rows of C = {C} elements; the one-pass kernel holds a row of at "
                             f"most {LAYER_NORM_MAX_C}; use backend='reference' (torch's LayerNorm, then the "
                             "quantizer)")
        from ..kernels.triton import layer_norm_quant as lq  # TRITON_INTERPRET is read at import

        x2 = x.reshape(-1, C)  # (R, C) rows: a view of a contiguous x
        s = scale.reshape(1)
        if operand == "fp8":
            codes = lq.layer_norm_fp8(x2, weight, bias, eps, s, f8).view(torch.uint8).view(x.shape)
            return QTensor(codes, scale.reshape((1,) * x.dim()), fmt, PerTensor(), tuple(x.shape), x.dtype)
        from ..kernels.triton import quant_bytes as qb

        enc = {"unsigned": qb.ENC_UNSIGNED, "twos": qb.ENC_TWOS}.get(fmt.encoding, qb.ENC_PM)
        x8 = lq.layer_norm_int8(x2, weight, bias, eps, s, fmt.bits, *_qp_params(fmt), enc).view(x.shape)
        return QTensor(x8, _scale_tensor(scale, x.device, "scale").reshape((1,) * x.dim()), fmt, PerTensor(),
                       tuple(x.shape), torch.float32, ShiftedInt8())
    y = torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)  # in x's dtype, as the float model writes it
    if operand == "fp8":
        return quantize_fp8_static(y, scale, fmt)
    q = quantize_int8_static(y.reshape(-1, 1, 1, C), fmt, scale, backend="reference")  # (R, 1, 1, C)
    return QTensor(q.data.view(x.shape), q.scale.reshape((1,) * x.dim()), fmt, PerTensor(), tuple(x.shape),
                   torch.float32, ShiftedInt8())
