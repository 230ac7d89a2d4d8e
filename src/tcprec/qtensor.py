"""Quantized tensors: codes + scales + format, and the granularity of the scales.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from .formats import BlockFormat, FloatFormat, IntFormat, as_format
from .kernels.reference import code_dtype, decode_float, decode_int
from .packing import pack_bitplanes

__all__ = ["PerTensor", "PerChannel", "PerGroup", "Granularity", "QTensor", "LAYOUTS"]

LAYOUTS = ("dense",)


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
# QTensor
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor: ``x ~= decode(codes, element format) * scale`` (see ``dequantize``).

    Fields
      codes        integer tensor of ``shape``, exactly as ``tcprec.encode`` returns them (uint8 for
                   formats of <= 8 bits, int16 / int32 for wider ones).
      scale        float32 tensor of the granularity's scale shape (module docstring); powers of two
                   for MX block formats.
      fmt          IntFormat, FloatFormat or BlockFormat.
      granularity  PerTensor / PerChannel / PerGroup, axis normalized to be non-negative.
      shape        the original shape (a tuple).
      dtype        the original float dtype; ``dequantize`` returns it.
      layout       ``"dense"``: codes in x's shape.  Bit planes come from ``to_bitplanes()``.

    Build one with ``tcprec.quantize``; the constructor only checks that the pieces fit together.

    >>> import torch, tcprec as tp
    >>> qx = tp.quantize(torch.randn(4, 8), "int4", tp.PerChannel(0))
    >>> qx.scale.shape, qx.codes.dtype
    (torch.Size([4, 1]), torch.uint8)
    """

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: Union[IntFormat, FloatFormat, BlockFormat]
    granularity: Granularity
    shape: tuple
    dtype: torch.dtype
    layout: str = "dense"

    def __post_init__(self):
        fmt = as_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        g = check_granularity(self.granularity).normalized(len(self.shape))
        object.__setattr__(self, "granularity", g)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got layout={self.layout!r}")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (the original x's), got {self.dtype!r}")
        if not isinstance(self.codes, torch.Tensor) or tuple(self.codes.shape) != self.shape:
            got = tuple(self.codes.shape) if isinstance(self.codes, torch.Tensor) else type(self.codes).__name__
            raise ValueError(f"codes must be a tensor of shape {self.shape}, got {got}")
        want = code_dtype(self.element_format)
        if self.codes.dtype != want:
            raise TypeError(f"codes of {fmt} must be {_short(want)} (as encode returns them), got {_short(self.codes.dtype)}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32:
            got = _short(self.scale.dtype) if isinstance(self.scale, torch.Tensor) else type(self.scale).__name__
            raise TypeError(f"scale must be a float32 tensor, got {got}")
        sshape = g.scale_shape(self.shape)
        if tuple(self.scale.shape) != sshape:
            raise ValueError(f"scale of a {g} QTensor of shape {self.shape} must have shape {sshape}, got {tuple(self.scale.shape)}")
        if self.scale.device != self.codes.device:
            raise ValueError(f"codes are on {self.codes.device} but scale is on {self.scale.device}; move both")

    # -- properties ----------------------------------------------------------------------------
    @property
    def element_format(self) -> Union[IntFormat, FloatFormat]:
        """The format of one code (``fmt.element`` for MX block formats)."""
        return self.fmt.element if isinstance(self.fmt, BlockFormat) else self.fmt

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements (a method, as ``torch.Tensor.numel``)."""
        return self.codes.numel()

    # -- conversions ---------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """``decode(codes) * scale`` in the original dtype (the scale broadcast per granularity)."""
        return torch.ops.tcprec.dequantize(self.codes, self.scale, str(self.element_format),
                                           *granularity_args(self.granularity), self.dtype)

    def to(self, device, non_blocking: bool = False) -> "QTensor":
        """A copy on ``device`` (codes and scale move together)."""
        return QTensor(
            self.codes.to(device, non_blocking=non_blocking),
            self.scale.to(device, non_blocking=non_blocking),
            self.fmt, self.granularity, self.shape, self.dtype, self.layout,
        )

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
            f"QTensor(shape={self.shape}, fmt={self.fmt}, granularity={self.granularity!r}, "
            f"scale={tuple(self.scale.shape)} {_short(self.scale.dtype)}, codes={_short(self.codes.dtype)}, "
            f"device={self.device})"
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
