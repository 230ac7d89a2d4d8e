"""quantize: float tensor -> QTensor (codes + scales), for integer, float and MX block formats.

Scales (absmax unless ``scale=`` is given), per group of the granularity:

================  ===========================================  ===================================
format            scale                                        codes
================  ===========================================  ===================================
intN (twos)       amax / (2**(N-1) - 1)   (int1, {-1, 0}: amax)  symmetric: -2**(N-1) is reachable
                                                               only by values at -amax rounding down
uintN             amax / (2**N - 1)       (data must be >= 0)
binary (pm1, 1b)  mean(|x|)  (XNOR-Net's alpha)                sign(x) as {-1, +1}
pmN (pm1, N>1)    amax / (2**N - 1)       (= amax / fmt.max)     odd integers -(2**N-1)..2**N-1
float formats     amax / fmt.max
MX (BlockFormat)  2**(floor(log2(amax)) - emax_elem)           OCP MX v1.0 section 6.3, blocks of
                  clamped to the scale format's range          ``fmt.block`` along the last axis
================  ===========================================  ===================================

then ``codes = encode(x / scale, element format, rounding, generator)``.

``quantize`` runs as the custom op ``tcprec::quantize`` (x -> codes, scale), so torch.compile and torch.export
see one opaque call; ``quantize_static`` / ``quantize_pack`` are plain torch (or one Triton launch) and not ops.

Rules every path keeps
* A group whose amax is 0 gets scale 1.0 and zero codes (never NaN / Inf).  pm formats have no
  zero value, so there the scale is 2**-126 and the group dequantizes to +-2**-126.  Non-zero
  absmax scales are clamped below at float32's smallest normal (2**-126) so ``x / scale`` stays
  finite.
* Quantize **saturates**: finite values of ``x / scale`` beyond the element format's range are
  clamped to +-max before the cast (OCP MX does this for its elements; torchao's float8 quantize
  too).  ``x / amax * qmax`` can exceed qmax by one float32 ulp, and directed or stochastic
  rounding would otherwise turn that into NaN (e4m3) or Inf (e5m2).  ``tcprec.cast`` keeps the
  format's own overflow rule.
* NaN / Inf input: an error for formats without a NaN code (integers, fp6, fp4, mxfp4, ...).  For
  formats with NaN (e4m3, e5m2, mxfp8) scales come from the finite values, NaN stays NaN and Inf
  follows the element format (Inf in e5m2, NaN in e4m3fn).
"""

from __future__ import annotations

import math

import torch

from ..formats import BlockFormat, FloatFormat, IntFormat, as_format
from ..kernels.reference_bitplanes import pack_bitplanes_reference
from ..kernels.triton import choose_backend
from ..qtensor import (Dense, Granularity, Layout, PerGroup, PerTensor, QTensor, check_granularity, check_layout,
                       granularity_args, granularity_from_args, group_view, scale_view)
from ..kernels.reference import code_dtype
from .codes import _encode_codes, _seed_from, check_float_input, check_rounding, choose_cast_backend

__all__ = ["quantize", "absmax_qmax", "quantize_pack", "quantize_static"]

_TINY = torch.finfo(torch.float32).tiny  # 2**-126


def absmax_qmax(fmt: IntFormat | FloatFormat) -> float:
    """The code value that an absmax scale maps a group's amax onto.

    >>> absmax_qmax(as_format("int4")), absmax_qmax(as_format("uint2")), absmax_qmax(as_format("e4m3"))
    (7.0, 3.0, 448.0)
    """
    if isinstance(fmt, FloatFormat):
        return float(fmt.max)
    if fmt.encoding == "twos":
        return float(max(fmt.max, 1))  # int1 is {-1, 0}: map amax onto 1 (the -1 code)
    return float(fmt.max)  # unsigned: 2**N - 1; pm1: 2**N - 1, the top odd value


def _check_inputs(x, rounding: str) -> None:
    check_float_input(x, "quantize")
    check_rounding(rounding)


def _check_specials(x: torch.Tensor, elem) -> torch.Tensor:
    """The finite mask; ValueError if x has NaN/Inf and the element format has no NaN code."""
    finite = torch.isfinite(x)
    if not elem.has_nan:
        n_bad = int((~finite).sum())
        if n_bad:
            n_nan = int(torch.isnan(x).sum())
            raise ValueError(
                f"x holds {n_bad} non-finite value(s) ({n_nan} NaN, {n_bad - n_nan} Inf) but {elem} has no NaN code; "
                "remove them (torch.nan_to_num) or pick a format with NaN (e.g. float8_e4m3fn)"
            )
    return finite


def _check_sign(x: torch.Tensor, elem, finite: torch.Tensor) -> None:
    unsigned = (isinstance(elem, IntFormat) and elem.encoding == "unsigned") or (
        isinstance(elem, FloatFormat) and not elem.signed
    )
    if unsigned and x.numel():
        xmin = float(torch.where(finite, x, torch.zeros_like(x)).min())
        if xmin < 0:
            signed = f"int{elem.bits}" if isinstance(elem, IntFormat) else "a signed float format"
            raise ValueError(
                f"{elem} is unsigned but x has negative values (min {xmin:.6g}); use a signed format such as "
                f"{signed}, or shift the data (x - x.min())"
            )


def _reduce(a: torch.Tensor, g: Granularity, op: str) -> torch.Tensor:
    """amax or mean of |x| per group, in the stored scale shape."""
    ag = group_view(a, g)
    if isinstance(g, PerGroup):
        dims = (g.axis + 1,)  # the `size` axis of the grouped view
    elif isinstance(g, PerTensor):
        dims = tuple(range(a.dim()))
    else:
        dims = tuple(d for d in range(a.dim()) if d != g.axis)
    if not dims:  # 0-d tensor, or PerChannel of a 1-d tensor: every element is its own group
        return ag
    if ag.numel() == 0:
        out = torch.zeros_like(ag).sum(dim=dims, keepdim=True)
    else:
        out = ag.amax(dim=dims, keepdim=True) if op == "amax" else ag.mean(dim=dims, keepdim=True)
    if isinstance(g, PerGroup):
        out = out.squeeze(g.axis + 1)  # (..., K/size, ...)
    return out


def _absmax_scale(x_abs: torch.Tensor, elem, g: Granularity) -> torch.Tensor:
    if isinstance(elem, IntFormat) and elem.encoding == "pm1" and elem.bits == 1:
        # XNOR-Net: alpha = mean |x| minimises ||x - alpha sign(x)||^2.  Summed in float64 so that
        # CPU and GPU (different reduction orders) round to the same float32 nearly always.
        s = _reduce(x_abs.to(torch.float64), g, "mean")
    else:
        amax = _reduce(x_abs, g, "amax")
        # tensor / tensor: CUDA divides by a Python scalar as a multiply by its reciprocal, which is
        # not correctly rounded; this way the scale is the same bits on every device
        s = amax / torch.full_like(amax, absmax_qmax(elem))
    s32 = s.to(torch.float32)
    if bool(torch.isinf(s32).any()):
        raise ValueError(
            f"the absmax scale for {elem} overflows float32 (amax up to {float(x_abs.max()):.4g}); rescale x first"
        )
    # pm formats have no zero: an all-zero group dequantizes to +-scale, so make that 2**-126, not 1
    zero_scale = _TINY if (isinstance(elem, IntFormat) and elem.encoding == "pm1") else 1.0
    # all-zero group -> zero_scale; tiny groups -> 2**-126 so that x / scale stays finite
    return torch.where(s32 == 0, torch.full_like(s32, zero_scale), torch.where(s > 0, s32.clamp(min=_TINY), s32))


def _check_scale_tensor(scale: torch.Tensor, device) -> None:
    if scale.dtype.is_complex or not (scale.dtype.is_floating_point or scale.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"scale must be a float or a real tensor, got dtype={scale.dtype}")
    if scale.device != device and not (scale.device.type == "cpu" and scale.numel() == 1):
        raise ValueError(f"scale is on {scale.device} but x is on {device}; put the scale on x's device "
                         f"(scale.to({str(device)!r})) -- only a one-element CPU scale (a number) may differ")


def _given_scale(scale, g: Granularity, shape, device, *, pow2: bool = False) -> torch.Tensor:
    sshape = g.scale_shape(shape)
    if isinstance(scale, torch.Tensor):
        _check_scale_tensor(scale, device)
        s = scale.to(device=device, dtype=torch.float32)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        s = torch.tensor(float(scale), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"scale must be a float or a torch.Tensor, got {type(scale).__name__}")
    try:
        s = torch.broadcast_to(s, sshape).contiguous()  # (scale shape of the granularity) float32
    except RuntimeError:
        raise ValueError(
            f"scale of shape {tuple(s.shape)} does not broadcast to {g}'s scale shape {sshape} for x of shape "
            f"{tuple(shape)}"
        ) from None
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        first = float(s[bad].flatten()[0])
        raise ValueError(f"scale must be finite and > 0, got {int(bad.sum())} bad value(s) (e.g. {first})")
    if pow2:
        m, _ = torch.frexp(s)
        if bool((m != 0.5).any()):
            raise ValueError("an MX (BlockFormat) scale must be a power of two; round it with 2**torch.floor(torch.log2(s))")
    return s


def _mx_scale(x_abs: torch.Tensor, fmt: BlockFormat, g: PerGroup) -> torch.Tensor:
    """OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - emax_elem), clamped to the scale format."""
    amax = _reduce(x_abs, g, "amax").to(torch.float32)  # (..., K/block) float32
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    sf = fmt.scale
    lo = int(round(math.log2(sf.min_subnormal)))  # e8m0: -127
    hi = sf.emax  # e8m0: 127
    lo, hi = max(lo, -149), min(hi, 127)  # float32 holds 2**-149 .. 2**127
    xe = (e.to(torch.int32) - 1 - fmt.element_emax).clamp(lo, hi)
    s = torch.ldexp(torch.ones_like(amax), xe)
    return torch.where(amax == 0, torch.ones_like(s), s)  # empty / all-zero block -> 1.0


def quantize(
    x: torch.Tensor,
    fmt,
    granularity: Granularity | None = None,
    *,
    scale=None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    layout: Layout | None = None,
) -> QTensor:
    """Quantize ``x`` to ``fmt`` with one scale per group of ``granularity``; returns a QTensor.

    ``fmt``: a format or a name (``"int4"``, ``"uint2"``, ``"binary"``, ``"e4m3"``, ``"mxfp4"``, ...).
    ``granularity``: ``PerTensor()`` (the default for element formats), ``PerChannel(axis)`` or
    ``PerGroup(size, axis=-1)``.  MX block formats always use their own blocks along the last axis
    (``PerGroup(fmt.block, -1)``; None or that granularity are accepted).
    ``scale``: a float or a tensor broadcastable to the scale shape, used as is (finite, > 0; a
    power of two for MX).  Default: absmax scales, see the module docstring.
    ``rounding`` / ``generator``: as in ``tcprec.cast``; stochastic rounding is reproducible from
    a seeded ``torch.Generator``.
    ``layout``: how the QTensor stores the codes (``tcprec.qtensor``'s table): ``Dense()`` (default),
    ``BitPlanes(compact=False)`` / ``BitPlanes(compact=True)``, ``ShiftedInt8()`` (integer formats),
    ``Float8()`` (e4m3 / e5m2).  The codes and scale are the same in every layout.

    >>> import torch, tcprec as tp
    >>> qx = tp.quantize(torch.tensor([[1.0, -0.5], [0.0, 0.0]]), "int4", tp.PerChannel(0))
    >>> qx.scale.flatten().tolist(), qx.dequantize()[0].tolist()
    ([0.1428571492433548, 1.0], [1.0, -0.4285714626312256])
    >>> tp.quantize(torch.tensor([[1.0, -0.5]]), "int4", layout=tp.BitPlanes()).data.shape
    torch.Size([4, 1, 16])
    """
    _check_inputs(x, rounding)
    fmt = as_format(fmt)
    layout = Dense() if layout is None else check_layout(layout)
    layout.check_format(fmt.element if isinstance(fmt, BlockFormat) else fmt, x.dim())
    shape = tuple(x.shape)
    if isinstance(fmt, BlockFormat):
        if x.dim() == 0:
            raise ValueError(f"{fmt} quantizes blocks of {fmt.block} along the last axis; x is 0-d")
        g = PerGroup(fmt.block, x.dim() - 1)
        if granularity is not None and check_granularity(granularity).normalized(x.dim()) != g:
            raise ValueError(
                f"{fmt} has its own granularity, blocks of {fmt.block} along the last axis ({g!r}); got "
                f"granularity={granularity!r}. Drop granularity= or pick a non-MX format"
            )
        k = shape[-1]
        if k % fmt.block:
            raise ValueError(
                f"{fmt} needs the last axis to be a multiple of the block size {fmt.block}, got K={k}; pad it to "
                f"{k + fmt.block - k % fmt.block} with torch.nn.functional.pad (padding is not done implicitly)"
            )
        elem = fmt.element
    else:
        g = check_granularity(PerTensor() if granularity is None else granularity).normalized(x.dim())
        if isinstance(g, PerGroup):
            g.check_divides(shape)
        elem = fmt

    if isinstance(scale, torch.Tensor):  # (here: a meta scale would send the op to its fake implementation)
        _check_scale_tensor(scale, x.device)
    elif scale is not None:
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"scale must be a float or a torch.Tensor, got {type(scale).__name__}")
        scale = torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    seed = _seed_from(generator, rounding)
    kind, size, axis = granularity_args(g)
    codes, s = torch.ops.tcprec.quantize(x, str(fmt), kind, size, axis, scale, rounding,
                                         -1 if seed is None else seed, choose_cast_backend(x)[0])
    return QTensor(layout.pack(codes, elem), s, fmt, g, shape, x.dtype, layout)


# torch.library custom op: torch.compile / torch.export see quantize as one opaque call on plain tensors
# (codes, scale); the Python wrapper above validates and builds the QTensor.  The granularity travels as
# (kind, size, axis) (qtensor.granularity_args), the format as its name, the generator as a seed (-1: none).


@torch.library.custom_op("tcprec::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, fmt: str, kind: str, size: int, axis: int, scale: torch.Tensor | None,
                 rounding: str, seed: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = as_format(fmt)
    g = granularity_from_args(kind, size, axis)
    elem = fmt.element if isinstance(fmt, BlockFormat) else fmt
    shape = tuple(x.shape)
    finite = _check_specials(x, elem)
    _check_sign(x, elem, finite)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(cdt)
    s = _scale_of(xc, finite, fmt, elem, g, scale)
    if scale is not None:  # an op's output must not alias its input
        s = s.clone()

    xs = group_view(xc, g) / scale_view(s, g).to(cdt)  # grouped view of x / scale
    xs = xs.reshape(shape)  # (*shape)
    if isinstance(elem, IntFormat):
        lo, hi = float(elem.min), float(elem.max)
    else:
        lo, hi = (-elem.max if elem.signed else 0.0), elem.max
    xs = torch.where(finite, xs.clamp(lo, hi), xs)  # saturate finite values; NaN / Inf go to encode
    codes = _encode_codes(xs, elem, rounding, None if seed < 0 else seed, backend)  # xs: float32 / float64
    return codes, s


def _scale_of(xc, finite, fmt, elem, g, scale) -> torch.Tensor:
    """(scale shape) float32: the given scale, or the MX / absmax scale of xc's finite values."""
    if scale is not None:
        return _given_scale(scale, g, tuple(xc.shape), xc.device, pow2=isinstance(fmt, BlockFormat))
    x_abs = torch.where(finite, xc.abs(), torch.zeros_like(xc))  # (*shape) non-finite ignored by scales
    return _mx_scale(x_abs, fmt, g) if isinstance(fmt, BlockFormat) else _absmax_scale(x_abs, elem, g)


def _quantize_setup(ctx, inputs, output):
    x, fmt, kind, size, axis, scale = inputs[:6]
    ctx.save_for_backward(x, scale)
    ctx.args = (fmt, kind, size, axis)


def _quantize_backward(ctx, grad_codes, grad_scale):
    """The gradient the scale's torch ops give (codes are integers: none through them), recomputed."""
    x, scale = ctx.saved_tensors
    fmt = as_format(ctx.args[0])
    elem = fmt.element if isinstance(fmt, BlockFormat) else fmt
    leaves = [t for t in (x, scale) if t is not None and t.requires_grad]
    grads = {}
    if leaves and grad_scale is not None:
        with torch.enable_grad():
            xr = x.detach().requires_grad_(x.requires_grad)
            sr = scale.detach().requires_grad_(scale.requires_grad) if scale is not None else None
            xc = xr.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
            s = _scale_of(xc, torch.isfinite(xc), fmt, elem, granularity_from_args(*ctx.args[1:]), sr)
            want = [t for t in (xr, sr) if t is not None and t.requires_grad]
            got = torch.autograd.grad(s, want, grad_scale, allow_unused=True) if s.requires_grad else [None] * len(want)
            grads = dict(zip([id(t) for t in leaves], got))
    return (grads.get(id(x)), None, None, None, None, grads.get(id(scale)) if scale is not None else None,
            None, None, None)


_quantize_op.register_autograd(_quantize_backward, setup_context=_quantize_setup)


@_quantize_op.register_fake
def _(x, fmt, kind, size, axis, scale, rounding, seed, backend):
    fmt = as_format(fmt)
    elem = fmt.element if isinstance(fmt, BlockFormat) else fmt
    sshape = granularity_from_args(kind, size, axis).scale_shape(tuple(x.shape))
    return (torch.empty_like(x, dtype=code_dtype(elem)),
            torch.empty(sshape, dtype=torch.float32, device=x.device))


# ------------------------------------------------------------------------------------------------
# Static-scale quantize straight into bit planes (activations at inference time)
# ------------------------------------------------------------------------------------------------


def _qp_params(fmt: IntFormat) -> tuple[int, int, int, int]:
    """(lo, hi, offset, shift) of the fused kernel: shift 0 -> code = value & mask; shift 1 (pm) ->
    value = 2 * code + offset."""
    if fmt.encoding == "pm1":
        return fmt.min, fmt.max, fmt.offset, 1
    return fmt.min, fmt.max, 0, 0


def _static_codes(x: torch.Tensor, fmt: IntFormat, scale: torch.Tensor) -> torch.Tensor:
    """int64 code patterns of ``x / scale`` (round half even, saturating, NaN -> the code of 0), with
    torch ops only (no sync); the fused kernel computes the same."""
    lo, hi, offset, shift = _qp_params(fmt)
    v = x.to(torch.float32) / scale.reshape(())  # (*lead, K) IEEE quotient, as quantize() divides
    v = torch.nan_to_num(v, nan=0.0).clamp(lo, hi)
    if shift:  # pm: c = rne((v - offset) / 2), exactly (see the kernel)
        t = torch.floor(v)
        n = t.to(torch.int64) - offset
        half = n >> 1
        return half + ((n & 1) & (((v - t) > 0).to(torch.int64) | (half & 1)))
    return torch.round(v).to(torch.int64) & ((1 << fmt.bits) - 1)  # round half even; twos pattern


def _check_static(x, fmt, scale, fn: str) -> IntFormat:
    check_float_input(x, fn)
    fmt = as_format(fmt)
    if not isinstance(fmt, IntFormat):
        raise TypeError(f"{fn}() quantizes to integer codes; {fmt} is not an integer format "
                        "(use intN, uintN, binary, pmN)")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise TypeError(f"scale must be a one-element float32 tensor (a calibrated per-tensor scale), got {scale!r}")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}; keep the scale with the activations")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last is K), got a 0-d tensor")
    return fmt


def quantize_static(x: torch.Tensor, fmt, scale: torch.Tensor) -> QTensor:
    """``quantize(x, fmt, PerTensor(), scale=scale)`` for integer formats without any host
    synchronisation (capturable in a CUDA graph): the same codes for finite input; NaN becomes the
    code of 0 instead of raising (raising needs a sync).

    >>> import torch
    >>> quantize_static(torch.tensor([0.4, 0.6, 9.0]), "uint2", torch.tensor([1.0])).codes.tolist()
    [0, 1, 3]
    """
    fmt = _check_static(x, fmt, scale, "quantize_static")
    codes = _static_codes(x, fmt, scale).to(torch.uint8)
    return QTensor(codes, scale.reshape((1,) * x.dim()), fmt, PerTensor(), tuple(x.shape), x.dtype)


def quantize_pack(x: torch.Tensor, fmt, scale: torch.Tensor, *, backend: str = "auto",
                  compact: bool = False) -> torch.Tensor:
    """Quantize ``x`` with a fixed per-tensor ``scale`` to an integer format and return its bit planes
    int32 ``(bits, *lead, packed_words(K))`` -- one fused pass, no host synchronisation, so it runs
    inside CUDA-graph capture (the activation quantizer of a compiled network).  ``compact=True``:
    ``(bits, *lead, ceil(K / 32))``, without the zero words that pad a row to 512 bits (an im2col
    reads only the real words; for K = 64 that is 2 words instead of 16).

    The codes equal ``quantize(x, fmt, PerTensor(), scale=scale).codes`` (round half to even,
    saturating) for every finite input; NaN has no integer code and becomes the code of 0 here (as
    the hardware conversion ``cvt.rni`` does) instead of raising, because raising needs a sync.
    ``x``: ``(*lead, K)`` float, last dim contiguous or strided; ``scale``: a one-element float32 tensor.

    >>> import torch
    >>> quantize_pack(torch.tensor([[0.0, 1.0, 2.0, 9.0]]), "uint2", torch.tensor([1.0]))[:, 0, 0].tolist()
    [10, 12]
    """
    fmt = _check_static(x, fmt, scale, "quantize_pack")
    name, _ = choose_backend(x, backend, "Triton quantize+pack kernel")
    if name == "reference":
        planes = pack_bitplanes_reference(_static_codes(x, fmt, scale), fmt.bits)
        return planes[..., : -(-x.shape[-1] // 32)].contiguous() if compact else planes
    from ..kernels.triton import pack as tpack  # lazy: imports Triton, whose jit reads TRITON_INTERPRET

    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    rows = x.reshape(-1, K)  # (R, K): a view when the leading dims collapse
    planes = tpack.quantize_pack(rows, scale, fmt.bits, *_qp_params(fmt), compact=compact)  # (bits, R, Kw)
    return planes.reshape((fmt.bits,) + lead + (planes.shape[-1],))
