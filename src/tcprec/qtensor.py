"""Quantized tensors: codes + scales + format, the granularity of the scales, and the layout of the codes.

A ``QTensor`` is what ``tcprec.quantize`` returns: ``x ~= decode(codes) * scale``.

Granularity (value objects, as in torchao; never loose strings):

* ``PerTensor()``            one scale for the whole tensor.
* ``PerChannel(axis)``       one scale per index along ``axis`` (per output channel of a weight).
* ``PerGroup(size, axis=-1)`` one scale per ``size`` consecutive elements along ``axis``.

Shape of ``QTensor.scale`` (float32 always), for ``x`` of shape ``S`` (``ndim`` dims):

* PerTensor:               ``(1,) * ndim``                        -- broadcasts against ``S``
* PerChannel(axis=a):      ``S`` with every dim but ``a`` set to 1 -- broadcasts against ``S``
* PerGroup(size, axis=a):  ``S`` with dim ``a`` divided by ``size``, e.g. ``(N, K)`` with
  ``PerGroup(32)`` -> ``(N, K/32)`` (torchao's layout).  It broadcasts against the grouped view
  ``S[:a] + (S[a]/size, size) + S[a+1:]`` after ``scale.unsqueeze(a + 1)``; ``group_view`` and
  ``scale_view`` below do exactly that.

MX block formats (``BlockFormat``) are PerGroup(block, axis=last) with the scale stored as
**float32 powers of two** (not e8m0 codes): they multiply like any other scale, and every power of
two the e8m0 format holds (2**-127 .. 2**127) is exact in float32.  ``encode(qt.scale, fmt.scale)``
gives the e8m0 codes when a kernel wants them.

Layout (value objects, as torchao's ``Layout``): how ``QTensor.data`` stores the codes.  The scale, format,
granularity, shape and dtype mean the same in every layout; ``qt.codes`` and ``qt.dequantize()`` read any.

==================  ====================================================  ===========================================
layout              ``data``                                              for
==================  ====================================================  ===========================================
``Dense()``         the codes, ``code_dtype(fmt)`` of ``shape``            every format (what ``encode`` returns)
``BitPlanes()``     int32 ``(bits, R, packed_words(K))``, R = prod of the  integer formats: the binary tensor-core GEMM
                    leading dims: bit b of every code along the last axis  (``tcprec.packing``); ``compact=True``: rows
                    (K), LSB-first, rows zero-padded to 512 bits           of ``ceil(K / 32)`` words (no padding words)
``ShiftedInt8()``   int8 of ``shape``, contiguous: ``decode(code) = offset  integer formats: the INT8 tensor cores' operand
                    + step * data`` (``int8_affine``: uint8 / pm8 stored   (``torch._int_mm``, the INT8 conv)
                    as ``code - 128``, every other format as its value)
``Float8()``        ``torch.float8_e4m3fn`` / ``float8_e5m2`` of ``shape``  e4m3 / e5m2: the codes' own torch dtype (a
                    (any strides): the codes' bits                        view, no copy), as the FP8 kernels read it
==================  ====================================================  ===========================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .formats import BlockFormat, FloatFormat, IntFormat, as_format
from .kernels.reference import code_dtype, decode_float, decode_int
from .packing import pack_bitplanes, packed_words, unpack_bitplanes

__all__ = ["PerTensor", "PerChannel", "PerGroup", "Granularity", "QTensor", "Dense", "BitPlanes", "ShiftedInt8",
           "Float8", "Layout", "LAYOUTS", "check_layout"]


def _check_axis_int(name: str, value, cls: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (negative counts from the end) for {cls}, got {name}={value!r}")


def _normalize_axis(axis: int, ndim: int, cls: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis={axis} is out of range for a tensor with ndim={ndim} ({cls}); "
            f"allowed axes are {-ndim}..{ndim - 1}" if ndim else
            f"axis={axis} is out of range for a 0-d tensor ({cls}); use PerTensor() for scalars"
        )
    return axis % ndim


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor.

    >>> PerTensor().scale_shape((64, 128))
    (1, 1)
    """

    def normalized(self, ndim: int) -> "PerTensor":
        return self

    def scale_shape(self, shape) -> tuple[int, ...]:
        return (1,) * len(shape)


@dataclass(frozen=True)
class PerChannel:
    """One scale per index along ``axis`` (e.g. ``axis=0``: per output channel of an (N, K) weight).

    >>> PerChannel(0).scale_shape((64, 128))
    (64, 1)
    """

    axis: int

    def __post_init__(self):
        _check_axis_int("axis", self.axis, "PerChannel")

    def normalized(self, ndim: int) -> "PerChannel":
        """The same granularity with a non-negative axis (ValueError if out of range)."""
        return PerChannel(_normalize_axis(self.axis, ndim, "PerChannel"))

    def scale_shape(self, shape) -> tuple[int, ...]:
        a = _normalize_axis(self.axis, len(shape), "PerChannel")
        return tuple(n if d == a else 1 for d, n in enumerate(shape))


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``size`` consecutive elements along ``axis`` (default: the last axis).

    The axis length must be a multiple of ``size``.

    >>> PerGroup(32).scale_shape((64, 128))
    (64, 4)
    """

    size: int
    axis: int = -1

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise TypeError(f"size must be a positive int for PerGroup, got size={self.size!r}")
        if self.size < 1:
            raise ValueError(
                f"size must be >= 1 for PerGroup, got size={self.size}; pick a group length such as 32, 64 or 128"
            )
        _check_axis_int("axis", self.axis, "PerGroup")

    def normalized(self, ndim: int) -> "PerGroup":
        return PerGroup(self.size, _normalize_axis(self.axis, ndim, "PerGroup"))

    def check_divides(self, shape) -> int:
        """The normalized axis; ValueError unless the axis length is a multiple of ``size``."""
        a = _normalize_axis(self.axis, len(shape), "PerGroup")
        k = shape[a]
        if k % self.size:
            lo = k - k % self.size
            raise ValueError(
                f"PerGroup(size={self.size}) needs the length of axis {a} to be a multiple of {self.size}, got "
                f"K={k}; pad that axis to {lo + self.size} (torch.nn.functional.pad) or pick a size that divides "
                f"{k}" + (f" (e.g. size={_largest_divisor(k, self.size)})" if k else "")
            )
        return a

    def scale_shape(self, shape) -> tuple[int, ...]:
        a = self.check_divides(shape)
        return tuple(n // self.size if d == a else n for d, n in enumerate(shape))


def _largest_divisor(k: int, below: int) -> int:
    return max(d for d in range(1, min(k, below) + 1) if k % d == 0)


Granularity = Union[PerTensor, PerChannel, PerGroup]
_GRANULARITIES = (PerTensor, PerChannel, PerGroup)


def check_granularity(g) -> Granularity:
    if not isinstance(g, _GRANULARITIES):
        raise TypeError(
            f"granularity must be PerTensor(), PerChannel(axis) or PerGroup(size, axis), got {type(g).__name__} "
            f"{g!r}" + ("; strings are not accepted, write e.g. tcprec.PerChannel(0)" if isinstance(g, str) else "")
        )
    return g


# ------------------------------------------------------------------------------------------------
# Views that make the stored scale broadcast against the data
# ------------------------------------------------------------------------------------------------


def granularity_args(g: Granularity) -> tuple[str, int, int]:
    """``g`` as (kind, size, axis), plain values a ``torch.library`` custom op can take; inverse of
    :func:`granularity_from_args`.

    >>> granularity_args(PerGroup(32, 1)), granularity_from_args("channel", 0, 0)
    (('group', 32, 1), PerChannel(axis=0))
    """
    if isinstance(g, PerGroup):
        return "group", g.size, g.axis
    if isinstance(g, PerChannel):
        return "channel", 0, g.axis
    return "tensor", 0, 0


def granularity_from_args(kind: str, size: int, axis: int) -> Granularity:
    """The granularity :func:`granularity_args` describes."""
    if kind == "group":
        return PerGroup(size, axis)
    if kind == "channel":
        return PerChannel(axis)
    if kind == "tensor":
        return PerTensor()
    raise ValueError(f"granularity kind must be 'tensor', 'channel' or 'group', got {kind!r}")


def group_view(t: torch.Tensor, g: Granularity) -> torch.Tensor:
    """``t`` viewed so that ``scale_view(scale, g)`` broadcasts against it.

    Only PerGroup changes anything: ``S`` -> ``S[:a] + (S[a]/size, size) + S[a+1:]``.
    """
    if not isinstance(g, PerGroup):
        return t
    a = g.check_divides(t.shape)
    s = tuple(t.shape)
    return t.reshape(s[:a] + (s[a] // g.size, g.size) + s[a + 1 :])  # (..., K/size, size, ...)


def scale_view(scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """The stored scale shaped to broadcast against ``group_view(x, g)``."""
    if not isinstance(g, PerGroup):
        return scale
    a = g.axis % max(scale.dim(), 1)
    return scale.unsqueeze(a + 1)  # (..., K/size, 1, ...)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------
# Layouts: how QTensor.data stores the codes
# ------------------------------------------------------------------------------------------------

_FLOAT8 = {as_format("float8_e4m3fn"): torch.float8_e4m3fn, as_format("float8_e5m2"): torch.float8_e5m2}


def float8_dtype(fmt) -> torch.dtype | None:
    """The torch float8 dtype whose bit patterns are ``fmt``'s codes (e4m3 / e5m2), or None."""
    return _FLOAT8.get(fmt) if isinstance(fmt, FloatFormat) else None


def int8_affine(fmt: IntFormat) -> tuple[int, int]:
    """(offset, step) of the ``ShiftedInt8`` layout: ``decode(code) = offset + step * x8``.  Only 8-bit unsigned /
    pm codes are stored shifted (uint8 = 128 + x8, pm8 = 1 + 2 * x8); every other format as its value."""
    if fmt.bits == 8 and fmt.encoding != "twos":
        return (128, 1) if fmt.encoding == "unsigned" else (1, 2)
    return 0, 1


def int8_codes(codes: torch.Tensor, fmt: IntFormat) -> tuple[torch.Tensor, int, int]:
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
    return (codes.to(torch.int16) - 128).to(torch.int8), *int8_affine(fmt)


def _got(t) -> str:
    return f"{_short(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _need_int(layout, fmt) -> IntFormat:
    if not isinstance(fmt, IntFormat):
        raise TypeError(f"{layout!r} stores integer codes (intN, uintN, binary, pmN), got fmt={fmt}; use Dense() "
                        f"(every format){' or Float8()' if float8_dtype(fmt) is not None else ''}")
    return fmt


@dataclass(frozen=True)
class Dense:
    """The codes in x's shape, ``code_dtype(fmt)`` (uint8 for <= 8 bits): what ``tcprec.encode`` returns."""

    def check_format(self, fmt, ndim: int) -> None:
        """Every format, every rank."""

    def check(self, data, fmt, shape: tuple) -> None:
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != shape:
            raise ValueError(f"codes must be a tensor of shape {shape}, got "
                             f"{tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__}")
        want = code_dtype(fmt)
        if data.dtype != want:
            raise TypeError(f"codes of {fmt} must be {_short(want)} (as encode returns them), got {_short(data.dtype)}")

    def pack(self, codes: torch.Tensor, fmt) -> torch.Tensor:
        return codes

    def unpack(self, data: torch.Tensor, fmt, shape: tuple) -> torch.Tensor:
        return data


@dataclass(frozen=True)
class BitPlanes:
    """Bit planes of the codes along the last axis, int32 ``(bits, R, words)`` with ``R`` the product of the
    leading dims: plane ``b`` holds bit ``b`` of every code, K packed LSB-first (``tcprec.packing``).  Rows are
    zero-padded to whole 512-bit rows (``packed_words(K)`` words, what the binary GEMM reads), or with
    ``compact=True`` hold only ``ceil(K / 32)`` words (what an im2col reads).  Integer formats only.

    >>> import torch, tcprec as tp
    >>> tp.quantize(torch.rand(6, 40), "uint2", layout=tp.BitPlanes()).data.shape
    torch.Size([2, 6, 16])
    """

    compact: bool = False

    def __post_init__(self):
        if not isinstance(self.compact, bool):
            raise TypeError(f"BitPlanes(compact=) must be True or False, got compact={self.compact!r}")

    def words(self, k: int) -> int:
        """Words per row for a last axis of ``k`` codes."""
        return -(-k // 32) if self.compact else packed_words(k)

    def check_format(self, fmt, ndim: int) -> None:
        _need_int(self, fmt)
        if ndim < 1:
            raise ValueError(f"{self!r} packs along the last axis; a 0-d tensor has none (use Dense())")

    def check(self, data, fmt, shape: tuple) -> None:
        self.check_format(fmt, len(shape))
        rows = math.prod(shape[:-1])
        want = (fmt.bits, rows, self.words(shape[-1]))
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int32 or tuple(data.shape) != want:
            raise ValueError(f"data of a {fmt} {self!r} QTensor of shape {shape} must be int32 (bits, rows, words) = "
                             f"{want}, got {_got(data)}")

    def pack(self, codes: torch.Tensor, fmt) -> torch.Tensor:
        k = codes.shape[-1]
        planes = pack_bitplanes(codes.reshape(-1, k), fmt.bits, validate=False)  # (bits, R, packed_words(K))
        return planes[..., : self.words(k)].contiguous() if self.compact else planes

    def padded(self, data: torch.Tensor, k: int) -> torch.Tensor:
        """``data`` with full rows ``(bits, R, packed_words(K))`` (a padded copy when compact)."""
        if data.shape[-1] == packed_words(k):
            return data
        return torch.nn.functional.pad(data, (0, packed_words(k) - data.shape[-1]))

    def unpack(self, data: torch.Tensor, fmt, shape: tuple) -> torch.Tensor:
        return unpack_bitplanes(self.padded(data, shape[-1]), fmt.bits, shape[-1]).reshape(shape)


@dataclass(frozen=True)
class ShiftedInt8:
    """One int8 per code, ``decode(code) = offset + step * data`` (:func:`int8_affine`: uint8 / pm8 stored as
    ``code - 128``, every other integer format as its value): the INT8 tensor cores' operand.  Integer formats only.

    >>> import torch, tcprec as tp
    >>> tp.quantize(torch.tensor([0.0, 1.0, 255.0]), "uint8", scale=1.0, layout=tp.ShiftedInt8()).data.tolist()
    [-128, -127, 127]
    """

    def check_format(self, fmt, ndim: int) -> None:
        _need_int(self, fmt)

    def check(self, data, fmt, shape: tuple) -> None:
        self.check_format(fmt, len(shape))
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int8 or tuple(data.shape) != shape \
                or not data.is_contiguous():
            raise TypeError(f"data of a {fmt} ShiftedInt8() QTensor must be a contiguous int8 tensor of shape {shape}, "
                            f"got {_got(data)}")

    def pack(self, codes: torch.Tensor, fmt) -> torch.Tensor:
        return int8_codes(codes, fmt)[0].contiguous()

    def unpack(self, data: torch.Tensor, fmt, shape: tuple) -> torch.Tensor:
        off, step = int8_affine(fmt)
        v = off + step * data.to(torch.int16)  # the decoded integer value
        b = fmt.bits
        if fmt.encoding == "twos":
            c = v & ((1 << b) - 1)
        elif fmt.encoding == "unsigned":
            c = v
        else:  # pm: value = 2c - (2^b - 1)
            c = (v + ((1 << b) - 1)) // 2
        return c.to(torch.uint8)


@dataclass(frozen=True)
class Float8:
    """The codes as their own torch float8 dtype (``float8_e4m3fn`` for e4m3, ``float8_e5m2`` for e5m2), a view
    of the same bits in x's shape with any strides (a K-major copy is a permuted view): what the FP8 kernels read.

    >>> import torch, tcprec as tp
    >>> tp.quantize(torch.tensor([1.0, -3.0]), "e4m3", layout=tp.Float8()).data.dtype
    torch.float8_e4m3fn
    """

    def check_format(self, fmt, ndim: int) -> None:
        if float8_dtype(fmt) is None:
            raise TypeError(f"Float8() stores e4m3 / e5m2 codes as torch.float8_e4m3fn / float8_e5m2, got fmt={fmt}; "
                            "use Dense() for other formats")

    def check(self, data, fmt, shape: tuple) -> None:
        self.check_format(fmt, len(shape))
        f8 = float8_dtype(fmt)
        if not isinstance(data, torch.Tensor) or data.dtype != f8 or tuple(data.shape) != shape:
            raise TypeError(f"data of a {fmt} Float8() QTensor must be {_short(f8)} of shape {shape}, got {_got(data)}")

    def pack(self, codes: torch.Tensor, fmt) -> torch.Tensor:
        return codes.view(float8_dtype(fmt))

    def unpack(self, data: torch.Tensor, fmt, shape: tuple) -> torch.Tensor:
        return data.view(torch.uint8)  # the same bits (any strides: one byte per element either way)


Layout = Union[Dense, BitPlanes, ShiftedInt8, Float8]
LAYOUTS = (Dense, BitPlanes, ShiftedInt8, Float8)
_LAYOUT_NAMES = "Dense(), BitPlanes(compact=False|True), ShiftedInt8(), Float8()"


def check_layout(layout) -> Layout:
    """``layout`` if it is a layout object; TypeError naming the allowed set otherwise.

    >>> check_layout(BitPlanes(compact=True))
    BitPlanes(compact=True)
    """
    if not isinstance(layout, LAYOUTS):
        hint = "; strings are not accepted, write e.g. tcprec.Dense() or tcprec.BitPlanes()" if isinstance(layout, str) \
            else ""
        raise TypeError(f"layout must be one of {_LAYOUT_NAMES}, got {type(layout).__name__} {layout!r}{hint}")
    return layout


# ------------------------------------------------------------------------------------------------
# QTensor
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor: ``x ~= decode(codes, element format) * scale`` (see ``dequantize``), its codes stored
    in one of the layouts (module docstring).

    Fields
      data         the codes as ``layout`` stores them: ``Dense()`` (the default) the codes of ``shape``, exactly as
                   ``tcprec.encode`` returns them (uint8 for formats of <= 8 bits, int16 / int32 for wider ones);
                   ``BitPlanes`` int32 planes; ``ShiftedInt8`` int8; ``Float8`` the float8 view.
      scale        float32 tensor of the granularity's scale shape (module docstring); powers of two
                   for MX block formats.
      fmt          IntFormat, FloatFormat or BlockFormat.
      granularity  PerTensor / PerChannel / PerGroup, axis normalized to be non-negative.
      shape        the original shape (a tuple).
      dtype        the original float dtype; ``dequantize`` returns it.
      layout       ``Dense()``, ``BitPlanes(compact=)``, ``ShiftedInt8()`` or ``Float8()``.
      hp           None, or the float tensor of ``shape`` the codes were quantized from when one kernel wrote both
                   (a quantized convolution's dual output: the float feeds a residual add, the codes the next convs).

    ``codes`` gives the dense codes in every layout (a view or an unpacking copy).  Build one with
    ``tcprec.quantize(..., layout=)``; the constructor only checks that the pieces fit together.

    >>> import torch, tcprec as tp
    >>> qx = tp.quantize(torch.randn(4, 8), "int4", tp.PerChannel(0))
    >>> qx.scale.shape, qx.codes.dtype, qx.layout
    (torch.Size([4, 1]), torch.uint8, Dense())
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: Union[IntFormat, FloatFormat, BlockFormat]
    granularity: Granularity
    shape: tuple
    dtype: torch.dtype
    layout: Layout = Dense()
    hp: Optional[torch.Tensor] = None

    def __post_init__(self):
        fmt = as_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        g = check_granularity(self.granularity).normalized(len(self.shape))
        object.__setattr__(self, "granularity", g)
        check_layout(self.layout).check(self.data, self.element_format, self.shape)
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (the original x's), got {self.dtype!r}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32:
            got = _short(self.scale.dtype) if isinstance(self.scale, torch.Tensor) else type(self.scale).__name__
            raise TypeError(f"scale must be a float32 tensor, got {got}")
        sshape = g.scale_shape(self.shape)
        if tuple(self.scale.shape) != sshape:
            raise ValueError(f"scale of a {g} QTensor of shape {self.shape} must have shape {sshape}, got {tuple(self.scale.shape)}")
        if self.scale.device != self.data.device:
            raise ValueError(f"codes are on {self.data.device} but scale is on {self.scale.device}; move both")
        hp = self.hp
        if hp is not None and (not isinstance(hp, torch.Tensor) or not hp.is_floating_point()
                               or tuple(hp.shape) != self.shape or hp.device != self.data.device):
            got = f"{hp.dtype} {tuple(hp.shape)} on {hp.device}" if isinstance(hp, torch.Tensor) else type(hp).__name__
            raise TypeError(f"hp must be None or a float tensor of the codes' shape {self.shape} on {self.data.device}, "
                            f"got {got}")

    # -- properties ----------------------------------------------------------------------------
    @property
    def element_format(self) -> Union[IntFormat, FloatFormat]:
        """The format of one code (``fmt.element`` for MX block formats)."""
        return self.fmt.element if isinstance(self.fmt, BlockFormat) else self.fmt

    @property
    def codes(self) -> torch.Tensor:
        """The dense codes of ``shape`` (``code_dtype``), whatever the layout: ``data`` itself for ``Dense()``, a
        view for ``Float8()``, an unpacked copy for ``BitPlanes`` / ``ShiftedInt8``."""
        return self.layout.unpack(self.data, self.element_format, self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements (a method, as ``torch.Tensor.numel``)."""
        return math.prod(self.shape)

    # -- conversions ---------------------------------------------------------------------------
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``decode(codes) * scale`` (the scale broadcast per granularity) in ``dtype``, by default the original
        dtype; the same values in every layout."""
        return torch.ops.tcprec.dequantize(self.codes, self.scale, str(self.element_format),
                                           *granularity_args(self.granularity), dtype or self.dtype)

    def to(self, device, non_blocking: bool = False) -> "QTensor":
        """A copy on ``device`` (data, scale and hp move together)."""
        return QTensor(
            self.data.to(device, non_blocking=non_blocking),
            self.scale.to(device, non_blocking=non_blocking),
            self.fmt, self.granularity, self.shape, self.dtype, self.layout,
            None if self.hp is None else self.hp.to(device, non_blocking=non_blocking),
        )

    def to_layout(self, layout: Layout) -> "QTensor":
        """The same codes stored in ``layout`` (the same scale, format, granularity and ``hp``).

        >>> import torch, tcprec as tp
        >>> qx = tp.quantize(torch.rand(2, 40), "uint2")
        >>> bool((qx.to_layout(tp.BitPlanes(compact=True)).codes == qx.codes).all())
        True
        """
        layout = check_layout(layout)
        if layout == self.layout:
            return self
        layout.check_format(self.element_format, self.ndim)
        if isinstance(layout, BitPlanes) and isinstance(self.layout, BitPlanes):  # the words as stored, re-padded
            k = self.shape[-1]
            data = layout.padded(self.data, k) if not layout.compact else self.data[..., : layout.words(k)].contiguous()
        else:
            data = layout.pack(self.codes, self.element_format)
        return QTensor(data, self.scale, self.fmt, self.granularity, self.shape, self.dtype, layout, self.hp)

    def to_bitplanes(self, *, backend: str = "auto", validate: bool = True) -> torch.Tensor:
        """Bit planes of the codes along the last axis: int32 ``(bits, *shape[:-1], Kw)``.

        Integer formats only (the bit-serial GEMM multiplies integers); see ``tcprec.packing``.
        """
        if not isinstance(self.fmt, IntFormat):
            raise TypeError(
                f"to_bitplanes() needs an integer format (intN, uintN, binary, pmN), this QTensor is {self.fmt}; "
                "the bit-serial GEMM multiplies integer codes. Quantize to an integer format first"
            )
        return pack_bitplanes(self.codes, self.fmt.bits, backend=backend, validate=validate)

    def __repr__(self) -> str:
        return (
            f"QTensor(shape={self.shape}, fmt={self.fmt}, granularity={self.granularity!r}, layout={self.layout!r}, "
            f"scale={tuple(self.scale.shape)} {_short(self.scale.dtype)}, data={_short(self.data.dtype)}, "
            f"device={self.device}{', hp' if self.hp is not None else ''})"
        )


# torch.library custom op: torch.compile / torch.export see QTensor.dequantize as one opaque call on its codes and
# scale (Inductor would otherwise trace decode's bit manipulation); the fake gives shape and dtype on every device.


@torch.library.custom_op("tcprec::dequantize", mutates_args=())
def _dequantize_op(codes: torch.Tensor, scale: torch.Tensor, fmt: str, kind: str, size: int, axis: int,
                   dtype: torch.dtype) -> torch.Tensor:
    fe, g = as_format(fmt), granularity_from_args(kind, size, axis)
    vals = (decode_int if isinstance(fe, IntFormat) else decode_float)(codes, fe)  # (*shape) float32
    y = group_view(vals, g) * scale_view(scale, g)
    return y.reshape(codes.shape).to(dtype)


def _dequantize_setup(ctx, inputs, output):
    codes, scale, fmt, kind, size, axis, dtype = inputs
    ctx.save_for_backward(codes)
    ctx.args = (fmt, kind, size, axis)


def _dequantize_backward(ctx, grad):
    """d/dscale of ``decode(codes) * scale`` (summed over each group); codes are integers: no gradient."""
    (codes,) = ctx.saved_tensors
    fe, g = as_format(ctx.args[0]), granularity_from_args(*ctx.args[1:])
    vals = (decode_int if isinstance(fe, IntFormat) else decode_float)(codes, fe)  # (*shape) float32
    gv = group_view(vals * grad.to(torch.float32), g)
    sshape = g.scale_shape(tuple(codes.shape))
    ones = torch.ones(sshape, dtype=torch.float32, device=codes.device)
    return None, gv.sum_to_size(scale_view(ones, g).shape).reshape(sshape), None, None, None, None, None


_dequantize_op.register_autograd(_dequantize_backward, setup_context=_dequantize_setup)


@_dequantize_op.register_fake
def _(codes, scale, fmt, kind, size, axis, dtype):
    return torch.empty_like(codes, dtype=dtype)
