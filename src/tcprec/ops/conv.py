"""2-D convolution backward in low precision: validate -> choose a backend (with a stated reason) -> launch.

Layouts (NHWC everywhere; see ``kernels/conv_geometry.py``):

* activations ``x`` / ``dx``: ``(N, H, W, C)``; output gradient ``dy``: ``(N, P, Q, K)``;
* weights ``w`` / ``dw``: ``(K, R, S, C)`` -- ``nn.Conv2d``'s ``(K, C, R, S)`` as ``w.permute(0, 2, 3, 1)``.

An NCHW tensor in ``channels_last`` memory format is NHWC after ``t.permute(0, 2, 3, 1)`` at no cost.
The Triton kernels take any strides (a plain NCHW tensor permuted to NHWC works, only slower:
loads vectorise along the unit-stride C / K dimension); the GEMM path reshapes, which copies a
non-contiguous tensor.  Results are freshly allocated, contiguous NHWC / KRSC.

Precisions

* ``"fp16"`` / ``"bf16"``: operands in that type (converted if they are not), fp32 accumulation.
* ``"fp8"``: e4m3 activations and weights, e5m2 gradients, one float32 scale per tensor
  (value = code * scale).  Pass e4m3 / e5m2 ``QTensor`` operands in the ``Float8()`` layout with one scale
  (:func:`to_fp8`, :func:`prepare_fp8_dgrad`, :func:`prepare_fp8_wgrad` make them in the memory orders the kernels
  read; ``tcprec.quantize(t, "e4m3", layout=tcprec.Float8())`` stores the same data), or float tensors that are
  quantised here with amax scaling.  fp32 accumulation (promoted every 64-128 products on Hopper, see
  ``kernels/triton/conv_bwd.py``; ``fast_accum=True`` skips the promotion).

Backends (``backend=``)

* ``"auto"``: on CUDA, unpadded 1x1 layers are GEMMs and go to cuBLAS (``torch.matmul`` /
  ``torch.mm(out_dtype=)`` / ``torch._scaled_mm`` for fp8) -- the fastest GEMM on the machine --
  except dgrad at stride s > 1 on sm_90 (from N*P*Q >= 1024 rows with 16-bit operands, always with fp8;
  with a fused activation at stride 1 from 32768 rows): there only the N*P*Q pixels the filter touches
  get GEMM rows and the rest of dx is zeros, so the ``"tma"`` kernel (a Triton TMA GEMM whose epilogue
  writes all of dx: the rows at (n, p*sh, q*sw), the zeros around them, the activation backward) saves
  cuBLAS's round trip of the rows through memory.  16-bit wgrad of every layer but an unpadded stride-1
  1x1 runs the ``"tma"`` wgrad kernel on sm_90 (measured faster than the Triton implicit GEMM and than
  cuBLAS after copying a strided slice: benchmarks/results/wgrad_tma_tune.json).  Everything else runs the Triton implicit-GEMM
  kernels.  Off CUDA: the reference.
* ``"triton"``: the Triton kernels for every layer (on the CPU through ``TRITON_INTERPRET=1``).
* ``"tma"``: dgrad -- ``kernels/triton/gemm_scatter.py``; unpadded 1x1 layers, K and C multiples of 8 (16
  for fp8).  wgrad -- ``kernels/triton/wgrad_tma.py``, an implicit GEMM whose dy and x tiles are 4-D TMA
  boxes (the padding is TMA's zero fill; strided layers read one descriptor per stride phase of x);
  any filter, stride and dilation, K and C multiples of 8 (16 for fp8, whose tiles it widens exactly to fp16
  in registers); ``"auto"`` runs fp8 3x3 wgrads here too.
* ``"flat"`` (wgrad only): ``kernels/triton/wgrad_flat.py``, one GEMM over the flat pixel index.  fp8 with N
  a multiple of 16: any layer, operands *batch-inner* (dy stored (K, P, Q, N), x (C, H, W, N): the image index
  contiguous, so a tap or a stride moves TMA boxes along H and W only and every box start stays 16-byte
  aligned); ``"auto"`` takes it for every fp8 layer on sm_90 but the stride-1 1x1 ones outside
  2**15 <= N*P*Q < 2**19 (cuBLAS, reading the same batch-inner memory as plain matrices).  fp8 with other N:
  1x1 unpadded layers, both operands K-major (a strided layer's pixels gathered first), auto for the strided
  ones and that L range.  16-bit: stride-1 "same" layers, NHWC, wrapped taps masked (measured slower than
  ``"tma"``: never auto).
* ``"gemm"``: cuBLAS; unpadded 1x1 layers only (strided dgrad: the rows, then one Triton pass that
  scatters them into dx with the zeros).
* ``"fprop"`` (dgrad only): cuDNN's forward convolution with the rotated filter; stride 1, fp16 /
  bf16, ``padding <= dilation * (R - 1)``, output in the compute type, no fused activation.
* ``"reference"``: the same math in plain torch (operands rounded to the precision, float32
  ``torch.nn.grad`` convolutions, TF32 off).

Not supported, with an error that says so: grouped convolutions (use ``torch.nn.grad`` with
``groups=``), padding modes other than zeros (pad the input first), dilation < 1, stride < 1.
Dilation > 1 is supported (the stride-phase arithmetic handles it).

``conv2d_dgrad`` / ``conv2d_wgrad`` run as the custom ops ``tcprec::conv2d_dgrad`` / ``::conv2d_wgrad`` (an fp8
QTensor passed as its data and 0-d scale), so torch.compile and torch.export see one opaque call each.
"""

from __future__ import annotations

import ast
import functools
from typing import Optional

import torch

from ..enums import Backend, backend_names
from ..formats import as_format
from ..kernels import reference_conv_bwd as rc
from ..kernels.conv_geometry import ConvGeometry, pair
from ..kernels.tile_tables import KERNELS_DIR, load_table, nonneg_int, pos_int, record
from ..kernels.triton import choose_backend
from ..precision import CONV_PRECISIONS as PRECISIONS  # one vocabulary
from ..qtensor import Float8, PerTensor, QTensor, float8_dtype

__all__ = [
    "conv2d_dgrad",
    "conv2d_wgrad",
    "explain_conv2d_dgrad",
    "explain_conv2d_wgrad",
    "to_fp8",
    "prepare_fp8_dgrad",
    "prepare_fp8_wgrad",
    "conv_geometry",
    "PRECISIONS",
    "BACKENDS",
]

BACKENDS = backend_names(Backend.AUTO, Backend.TRITON, Backend.TMA, Backend.FLAT, Backend.GEMM, Backend.FPROP,
                         Backend.REFERENCE)
_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------------
# fp8 operands
# ------------------------------------------------------------------------------------------------


_FP8_FORMATS = {dt: as_format(name) for name, dt in FP8_DTYPES.items()}  # torch float8 dtype -> its format


def _fp8_qtensor(data: torch.Tensor, scale: torch.Tensor) -> QTensor:
    """The Float8() PerTensor QTensor of fp8 ``data`` and its one-element float32 ``scale`` (stored (1,) * ndim, a
    view of the same storage; ``dtype`` float32, what its ``dequantize()`` returns)."""
    fmt = _FP8_FORMATS.get(data.dtype) if isinstance(data, torch.Tensor) else None
    if fmt is None:
        raise TypeError(f"fp8 operand data must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                        f"{data.dtype if isinstance(data, torch.Tensor) else type(data).__name__}")
    return QTensor(data, scale.reshape((1,) * data.dim()), fmt, PerTensor(), tuple(data.shape), torch.float32,
                   Float8())


def _check_fp8_operand(t, name: str) -> None:
    """An fp8 operand of the conv backward is an e4m3 / e5m2 QTensor in the ``Float8()`` layout with one scale."""
    if float8_dtype(t.fmt) is None or not isinstance(t.layout, Float8) or not isinstance(t.granularity, PerTensor):
        raise TypeError(f"{name} is a {t.fmt} QTensor in the {t.layout!r} layout with {t.granularity}: the conv "
                        "backward takes fp8 QTensors in the Float8() layout with one scale, "
                        f"tcprec.quantize({name}_hp, 'e4m3', layout=tcprec.Float8()) (or to_fp8)")


def _check_qtensors(**ts) -> None:
    for name, t in ts.items():
        if isinstance(t, QTensor):
            _check_fp8_operand(t, name)


def _scale0(t: QTensor) -> torch.Tensor:
    """The one scale of an fp8 QTensor as the 0-d float32 tensor the custom ops, kernels and cuBLAS take (a view)."""
    return t.scale.reshape(())


def to_fp8(t: torch.Tensor, fmt: str = "e4m3", *, memory_order: tuple[int, ...] | None = None,
           scale: torch.Tensor | None = None) -> QTensor:
    """Quantise ``t`` to ``fmt`` ("e4m3" or "e5m2") with one scale, ``amax(|t|) / max(fmt)`` unless
    given; round to nearest even, saturating.  ``memory_order`` (a permutation of t's dims, outermost
    first) chooses the physical layout of ``data``; its logical shape is always t's.  On CUDA (1 to 4 dims)
    the division, clamp, rounding and the layout change are one Triton pass (``kernels/triton/fp8_quant.py``,
    the same bits as the torch formula used elsewhere).

    Returns a ``QTensor`` in the ``Float8()`` layout, ``PerTensor()`` granularity: ``data`` the float8 tensor
    (any strides), ``scale`` float32 of shape ``(1,) * t.dim()``, ``dtype`` float32 (``dequantize()`` returns
    float32 whatever t's dtype, ``data.float() * scale``).

    >>> q = to_fp8(torch.tensor([[1.0, -3.0], [0.5, 2.0]]), "e4m3", memory_order=(1, 0))
    >>> q.layout, q.data.shape, q.data.stride(), q.dequantize()[0, 1].item()
    (Float8(), torch.Size([2, 2]), (1, 2), -3.0)
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 format must be one of {tuple(FP8_DTYPES)}, got {fmt!r}")
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"to_fp8 takes a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    dt = FP8_DTYPES[fmt]
    fmax = float(torch.finfo(dt).max)
    if scale is None:  # max |t| without an |t| temporary
        amax = torch.linalg.vector_norm(t, float("inf")).float() if t.numel() else torch.zeros((), device=t.device)
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    scale = scale.to(device=t.device, dtype=torch.float32).reshape(())
    order = tuple(range(t.dim())) if memory_order is None else tuple(memory_order)
    if sorted(order) != list(range(t.dim())):
        raise ValueError(f"memory_order must be a permutation of range({t.dim()}), got {memory_order!r}")
    inv = tuple(order.index(d) for d in range(t.dim()))
    data = torch.empty([t.shape[d] for d in order], dtype=dt, device=t.device).permute(inv)
    if t.is_cuda and 1 <= t.dim() <= 4:  # one Triton pass: divide, clamp, round, write in the order (same bits)
        from ..kernels.triton.fp8_quant import quantize_fp8

        quantize_fp8(t, scale, data)
    else:
        data.copy_((t.float() / scale).clamp_(-fmax, fmax))
    return _fp8_qtensor(data, scale)


# Memory orders the kernels read fastest (documented in kernels/triton/conv_bwd.py).
_NHWC = (0, 1, 2, 3)
_KMAJOR_W = (1, 2, 3, 0)  # weight (K, R, S, C) stored as (R, S, C, K): K contiguous
_CFIRST = (3, 0, 1, 2)  # (N, H, W, C) stored as (C, N, H, W): the pixel index contiguous
_BATCH = (3, 1, 2, 0)  # (N, H, W, C) stored as (C, H, W, N): the image index contiguous ("batch-inner")


def prepare_fp8_dgrad(grad_out: torch.Tensor, weight: torch.Tensor) -> tuple[QTensor, QTensor]:
    """dy as e5m2 NHWC and w as e4m3 in (R, S, C, K) memory order: both K-major operands of the
    dgrad GEMM, as wgmma fp8 (and cuBLAS fp8) want them."""
    return to_fp8(grad_out, "e5m2", memory_order=_NHWC), to_fp8(weight, "e4m3", memory_order=_KMAJOR_W)


def prepare_fp8_wgrad(grad_out: torch.Tensor, input: torch.Tensor, weight_shape=None, stride=1, padding=0,
                      dilation=1, backend: str = "auto") -> tuple[QTensor, QTensor]:
    """dy as e5m2 and x as e4m3 in the memory orders the wgrad path reads without a copy (``weight_shape`` etc.
    decide which path :func:`conv2d_wgrad` will take; :func:`_wgrad_orders`): batch-inner ((K, P, Q, N) and
    (C, H, W, N)) for the flat kernel and cuBLAS when N is a multiple of 16, else dy (K, N, P, Q) with x (C, N, H, W)
    for the cuBLAS GEMM of a 1x1 stride-1 layer or NHWC for the Triton kernels; the logical shapes stay NHWC."""
    dy_order, x_order = _CFIRST, _NHWC
    if weight_shape is not None:
        g = conv_geometry(tuple(input.shape), tuple(weight_shape), stride, padding, dilation)
        path, _ = _choose("wgrad", g, input, "fp8", backend)
        dy_order, x_order = _wgrad_orders(path, g)
    return to_fp8(grad_out, "e5m2", memory_order=dy_order), to_fp8(input, "e4m3", memory_order=x_order)


def _batch_inner_ok(g: ConvGeometry) -> bool:
    """fp8 wgrad operands go batch-inner (stored (K, P, Q, N) / (C, H, W, N)) when the batch fills TMA's 16-byte
    rows: then every layer is a TMA GEMM with aligned box starts (kernels/triton/wgrad_flat.py)."""
    return g.N % 16 == 0


def _wgrad_orders(path: str, g: ConvGeometry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The memory orders of fp8 dy and x each wgrad path reads without a copy: batch-inner for the flat kernel
    and cuBLAS when N is a multiple of 16 (a stride-1 1x1 layer's (K, L) and (C, L) matrices are then views, L
    ordered (p, q, n)); else K-major (pixel index contiguous) for the cuBLAS and flat GEMMs (x NHWC when strided:
    the flat path gathers its pixels from channel-contiguous rows); NHWC for the TMA-box kernel (its boxes are
    channel-contiguous)."""
    if path == "tma":
        return _NHWC, _NHWC
    if path in ("flat", "gemm") and _batch_inner_ok(g):
        return _BATCH, _BATCH
    if path == "gemm" or (path == "flat" and g.stride == (1, 1)):
        return _CFIRST, _CFIRST
    return _CFIRST, _NHWC


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _ints4(shape, name: str, layout: str) -> tuple[int, int, int, int]:
    try:
        vals = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be 4 ints {layout}, got {shape!r}") from None
    if len(vals) != 4 or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"{name} must be 4 ints {layout}, got {shape!r}")
    if any(v < 0 for v in vals):
        raise ValueError(f"{name} must be non-negative, got {vals}")
    return vals


def conv_geometry(input_shape, weight_shape, stride=1, padding=0, dilation=1) -> ConvGeometry:
    """Validated :class:`ConvGeometry` from an NHWC input shape and a KRSC weight shape."""
    N, H, W, C = _ints4(input_shape, "input_shape", "(N, H, W, C)")
    K, R, S, Cw = _ints4(weight_shape, "the weight shape", "(K, R, S, C)")
    st, pd, dl = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(st) < 1:
        raise ValueError(f"stride must be >= 1, got stride={st}")
    if min(pd) < 0:
        raise ValueError(f"padding must be >= 0, got padding={pd} (only zero padding; pad the input yourself "
                         "for other padding modes)")
    if min(dl) < 1:
        raise ValueError(f"dilation must be >= 1, got dilation={dl}")
    if min(R, S) < 1:
        raise ValueError(f"the filter must be at least 1x1, got R={R}, S={S}")
    if Cw != C:
        hint = ""
        if Cw and C % Cw == 0 and C != Cw:
            hint = (f"; this looks like a grouped convolution (groups={C // Cw}), which is not supported: the "
                    "implicit-GEMM kernels are dense -- use torch.nn.grad.conv2d_input/_weight with groups=")
        raise ValueError(f"channel mismatch: the input has C={C} (dim 3 of (N, H, W, C)) but the weight has "
                         f"C={Cw} (dim 3 of (K, R, S, C)){hint}. Weights are KRSC: nn.Conv2d's (K, C, R, S) "
                         "weight is w.permute(0, 2, 3, 1)")
    g = ConvGeometry(N, H, W, C, K, R, S, st, pd, dl)
    if g.P < 1 or g.Q < 1:
        raise ValueError(f"the dilated {R}x{S} filter (dilation {dl}) does not fit the {H}x{W} input padded by {pd}: "
                         f"output would be {g.P}x{g.Q}")
    return g


def _check_tensor(t, name: str, layout: str, precision: str) -> None:
    if isinstance(t, QTensor):
        _check_fp8_operand(t, name)
        if precision != "fp8":
            raise TypeError(f"{name} is an fp8 QTensor but precision={precision!r}; use precision='fp8'")
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout} or an fp8 QTensor, got {type(t).__name__}")
    if t.dtype in FP8_DTYPES.values():
        raise TypeError(f"{name} is a bare {t.dtype} tensor: the fp8 operand needs its scale, a Float8() QTensor "
                        f"(to_fp8({name}_hp, ...) or tcprec.quantize({name}_hp, 'e4m3', layout=tcprec.Float8()))")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")


def _check_grad_out(dy, g: ConvGeometry) -> None:
    want = g.output_shape
    got = tuple(dy.shape)
    if got == want:
        return
    hint = ""
    if got == (g.N, g.K, g.P, g.Q):
        hint = " -- it looks NCHW; pass grad_out.permute(0, 2, 3, 1) (free for a channels_last tensor)"
    raise ValueError(f"grad_out must be (N, P, Q, K) = {want} for this input/weight/stride/padding/dilation, "
                     f"got {got}{hint}")


def _check_devices(**ts) -> torch.device:
    devs = {k: v.device for k, v in ts.items() if v is not None}
    first = next(iter(devs.values()))
    for k, d in devs.items():
        if d != first:
            raise ValueError(f"all operands must be on one device: {', '.join(f'{n} on {v}' for n, v in devs.items())}")
    return first


def _device_of(t) -> torch.device:
    """The device of a tensor or an fp8 QTensor (the operands' devices were checked equal by the public wrapper)."""
    return t.device


def _check_common(precision: str, backend: str, out_dtype) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


# ------------------------------------------------------------------------------------------------
# Backend choice
# ------------------------------------------------------------------------------------------------


def _gemm_ok(op: str, g: ConvGeometry, precision: str) -> tuple[bool, str]:
    if not g.is_gemm_1x1:
        return False, (f"the layer is {g.R}x{g.S}, stride {g.stride}, padding {g.padding}: only unpadded 1x1 "
                       "layers are plain GEMMs")
    if precision == "fp8":
        if not hasattr(torch, "_scaled_mm"):
            return False, "this torch has no torch._scaled_mm (cuBLAS fp8 GEMM)"
        if g.K % 16 or g.C % 16:  # the pixel dim is zero-padded to a multiple of 16 when it is not one
            return False, f"cuBLAS fp8 needs K and C divisible by 16, got K={g.K}, C={g.C}"
    if g.stride == (1, 1):
        return True, "1x1 stride-1 layer: a plain GEMM"
    return True, (f"1x1 stride-{g.stride} layer: a GEMM over the N*P*Q pixels the filter touches "
                  "(dgrad: scattered into dx, the other pixels zero; wgrad: over the strided slice of x)")


# The route thresholds below are data beside their kernels (each value with what was measured to pick it),
# validated at import (kernels/tile_tables.py, decision 0033); read by path: the CPU path imports no Triton.
#
# fp16 / bf16 wgrad of a strided 1x1 layer: cuBLAS needs x's strided slice copied first; the Triton
# kernel reads those pixels in place.  On H200 (first measurements) the copy + GEMM won only from
# C = 512 channels up (28x28 512->256 s2, N=256: 99 vs 115 us) and lost below (56x56 256->128 s2: 178 vs
# 98 us).  fp8 always takes the GEMM (its Triton kernel is slower still).  kernels/triton/conv_bwd_tiles.json.
_CONV_BWD_TABLE = KERNELS_DIR / "triton" / "conv_bwd_tiles.json"
_CONV_BWD_RULES = {"strided_wgrad_gemm_min_c": pos_int}
_STRIDED_WGRAD_GEMM_MIN_C = load_table(_CONV_BWD_TABLE, _CONV_BWD_RULES)["strided_wgrad_gemm_min_c"]


def _auto_prefers_triton(op: str, g: ConvGeometry, precision: str) -> str | None:
    if (op == "wgrad" and precision != "fp8" and g.stride != (1, 1) and g.C < _STRIDED_WGRAD_GEMM_MIN_C):
        return (f"a strided 1x1 {precision} wgrad with C={g.C} < {_STRIDED_WGRAD_GEMM_MIN_C}: the Triton kernel reads "
                "x's strided pixels in place, which measured faster than cuBLAS after copying the slice")
    return None


def _auto_wgrad_tma(g: ConvGeometry, precision: str, ref_t) -> str | None:
    """Why auto runs this 16-bit wgrad on the TMA-box kernel (None: it does not).  Every layer but a stride-1
    unpadded 1x1 (a plain GEMM: cuBLAS) on sm_90: graph-replay tune on the H200 (benchmarks/results/
    wgrad_tma_tune.json), the kernel at its pick beat the Triton implicit GEMM / cuBLAS-after-copy paths on the
    ten 3x3 and strided 1x1 ResNet-50 layers at N = 8 and 256 (fp8 stays on the widening Triton path: its
    operands would need a transposing copy first).  fp8: the kernel widens its fp8 tiles to fp16 in registers
    (WIDEN); it runs the non-1x1 layers (1x1 ones are GEMMs: the flat kernel or cuBLAS, _auto_wgrad_flat)."""
    if not _is_sm90(ref_t) or not _tma_ok("wgrad", g, precision)[0]:
        return None
    if (g.R, g.S) == (1, 1) and g.padding == (0, 0) and (g.stride == (1, 1) or precision == "fp8"):
        return None
    return ("a 3x3 or strided layer on sm_90: the TMA-box implicit GEMM (4-D TMA boxes of dy and x, the zero fill "
            "as padding, deterministic split-K), measured faster than the Triton implicit GEMM and than cuBLAS after "
            "copying the strided slice")


def _flat_ok(op: str, g: ConvGeometry, precision: str) -> tuple[bool, str]:
    """Can this wgrad run on the flat-shift kernel (kernels/triton/wgrad_flat.py)?  fp8: any layer with batch-inner
    operands (N a multiple of 16), else 1x1 unpadded layers, any stride (one GEMM over the filter's pixels, both
    operands K-major); 16-bit: stride-1 "same" layers (NHWC)."""
    if op != "wgrad":
        return False, "the flat-shift kernel computes wgrad only"
    from ..kernels.triton import wgrad_flat as wf

    if precision == "fp8":
        if _batch_inner_ok(g):
            return wf.supported(g, FP8_DTYPES["e4m3"], "batch")
        return wf.supported(wf.flat_geometry(g), FP8_DTYPES["e4m3"], "kmajor")
    return wf.supported(g, _DTYPE[precision], "nhwc")


# fp8 1x1 wgrad on sm_90, graph-replay tune on the H200 (decision 0032's sweep, results/
# wgrad_flat_tune_256.json): the flat kernel beat cuBLAS's _scaled_mm on the 28x28 and 14x14 stride-1 layers
# (L = N*P*Q = 200704 / 50176: 47 vs 57 us, 34 vs 46 us) and lost on 56x56 (L = 802816: 73 vs 66 us) and 7x7
# (L = 12544: 27 vs 24 us); strided layers always take it (cuBLAS needs x's strided slice copied first).
# kernels/triton/wgrad_flat_tiles.json.
_FLAT_TABLE = KERNELS_DIR / "triton" / "wgrad_flat_tiles.json"
_FLAT_RULES = {"auto_1x1_rows": record(min_rows=nonneg_int, max_rows=nonneg_int)}


def _FLAT_CHECK(t: dict) -> str | None:
    r = t["auto_1x1_rows"]
    return None if r["min_rows"] < r["max_rows"] else f"auto_1x1_rows needs min_rows < max_rows, got {r}"


_FLAT_ROWS = load_table(_FLAT_TABLE, _FLAT_RULES, _FLAT_CHECK)["auto_1x1_rows"]
_FLAT_MIN_L, _FLAT_MAX_L = _FLAT_ROWS["min_rows"], _FLAT_ROWS["max_rows"]


def _auto_wgrad_flat(g: ConvGeometry, precision: str, ref_t) -> str | None:
    """Why auto runs this fp8 wgrad on the flat kernel (None: it does not)."""
    if precision != "fp8" or not _is_sm90(ref_t) or not _flat_ok("wgrad", g, precision)[0]:
        return None
    L = g.N * g.P * g.Q
    if _batch_inner_ok(g) and not g.is_gemm_1x1:
        return (f"a {g.R}x{g.S} stride-{g.stride} fp8 layer with N = {g.N} (a multiple of 16) on sm_90: batch-inner "
                "operands, each tap a TMA box start along H and W, one fp8 wgmma GEMM (measured 1.1-1.7x cuDNN's fp16 "
                "wgrad on the ResNet-50 3x3 and strided layers at N = 256, results/wgrad_flat_tune_bi_256.json)")
    if g.stride != (1, 1) and _batch_inner_ok(g):
        return ("a strided 1x1 fp8 layer with N a multiple of 16 on sm_90: batch-inner operands, the strided pixels "
                "read in place by TMA boxes, one fp8 wgmma GEMM (no gather; measured 1.5-1.7x cuDNN's fp16 wgrad)")
    if g.stride != (1, 1):
        return ("a strided 1x1 fp8 layer on sm_90: one pass gathers x's strided pixels K-major, then the flat-shift "
                "kernel's fp8 wgmma GEMM (measured faster than cuBLAS after torch's strided copy)")
    if _FLAT_MIN_L <= L < _FLAT_MAX_L:
        return (f"a 1x1 fp8 layer with L = N*P*Q = {L} in [{_FLAT_MIN_L}, {_FLAT_MAX_L}) on sm_90: the flat-shift "
                "kernel (fp8 wgmma, split-K) measured faster than cuBLAS's _scaled_mm there")
    return None


def _fprop_ok(op: str, g: ConvGeometry, precision: str, activation, out_dtype) -> tuple[bool, str]:
    """Can this dgrad run as cuDNN's forward conv of dy with the rotated filter (see the module doc)?"""
    if op != "dgrad":
        return False, "only dgrad is a forward convolution (wgrad reduces over pixels)"
    if precision == "fp8":
        return False, "torch has no cuDNN fp8 convolution"
    if g.stride != (1, 1):
        return False, f"stride {g.stride}: a strided dgrad is a transposed conv, not a forward one"
    for axis, (k, p, d) in enumerate(zip((g.R, g.S), g.padding, g.dilation)):
        if p > d * (k - 1):
            return False, f"padding {p} > dilation*(filter-1) = {d * (k - 1)} on axis {axis}: the rotated conv would crop"
    if activation is not None:
        return False, "a fused activation backward needs the Triton kernel's epilogue"
    if out_dtype is not None and out_dtype != _DTYPE[precision]:
        return False, f"out_dtype={out_dtype} but cuDNN writes {_DTYPE[precision]} (fp32 accumulation, rounded once)"
    return True, (f"stride-1 {g.R}x{g.S} dgrad = forward conv of dy with the 180-degree-rotated filter: cuDNN's "
                  "forward kernels (fp32 accumulation), faster than its dgrad and our Triton kernel on these layers")


def _tma_ok(op: str, g: ConvGeometry, precision: str) -> tuple[bool, str]:
    """Can this layer run on the TMA kernel of its op: dgrad as the TMA GEMM with dx written by its epilogue
    (kernels/triton/gemm_scatter.py), wgrad as the TMA-box implicit GEMM (kernels/triton/wgrad_tma.py; fp8
    operands are widened to fp16 for it, so the 16-bit rules apply)?"""
    if op == "wgrad":
        from ..kernels.triton import wgrad_tma as wt

        return wt.supported(g, FP8_DTYPES["e4m3"] if precision == "fp8" else None)
    from ..kernels.triton import gemm_scatter as gs

    return gs.supported(g, precision == "fp8")


_TMA_KERNEL = {"dgrad": "Triton TMA GEMM + scatter dgrad", "wgrad": "Triton TMA-box implicit-GEMM wgrad"}


# = kernels.triton.gemm_scatter.MIN_ROWS_AUTO (read by path here: no Triton import on the CPU path), by fp8-ness;
# stride-1 1x1 with a fused activation: the old events-based floor (not re-tuned).  gemm_scatter_tiles.json.
_TMA_TABLE = load_table(KERNELS_DIR / "triton" / "gemm_scatter_tiles.json",
                        {"min_rows_auto": record(**{"16bit": nonneg_int, "fp8": nonneg_int}),
                         "min_rows_unstrided": nonneg_int})
_TMA_MIN_ROWS = {False: _TMA_TABLE["min_rows_auto"]["16bit"], True: _TMA_TABLE["min_rows_auto"]["fp8"]}
_TMA_MIN_ROWS_UNSTRIDED = _TMA_TABLE["min_rows_unstrided"]


def _is_sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and _cc_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _cc_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _choose(op: str, g: ConvGeometry, t, precision: str, backend: str, activation=None,
            out_dtype=None) -> tuple[str, str]:
    """(path, reason): path is "gemm" (cuBLAS), "tma" (dgrad: the Triton TMA GEMM writing dx; wgrad: the
    TMA-box implicit GEMM, only when asked for), "fprop" (cuDNN forward conv), "triton" or "reference"."""
    ref_t = t.data if isinstance(t, QTensor) else t
    if backend == "reference":
        return "reference", "asked for the reference backend"
    if backend == "tma":
        ok, why = _tma_ok(op, g, precision)
        if not ok:
            raise ValueError(f"backend='tma' cannot run this {op}: {why}; use backend='triton' or 'auto'")
        choose_backend(ref_t, "triton", kernel=_TMA_KERNEL[op])  # raises where it cannot run
        return "tma", f"asked for the {_TMA_KERNEL[op]} ({why})"
    if backend == "fprop":
        ok, why = _fprop_ok(op, g, precision, activation, out_dtype)
        if not ok:
            raise ValueError(f"backend='fprop' cannot run this {op}: {why}; use backend='triton' or 'auto'")
        if not ref_t.is_cuda:
            raise ValueError(f"backend='fprop' runs cuDNN and needs CUDA tensors, got device {ref_t.device}; "
                             "use backend='reference' on the CPU")
        return "fprop", f"asked for cuDNN's forward conv ({why})"
    if backend == "flat":
        ok, why = _flat_ok(op, g, precision)
        if not ok:
            raise ValueError(f"backend='flat' cannot run this {op}: {why}; use backend='tma', 'triton' or 'auto'")
        choose_backend(ref_t, "triton", kernel="Triton flat-shift wgrad")  # raises where it cannot run
        return "flat", f"asked for the flat-shift wgrad kernel ({why})"
    if backend == "gemm":
        ok, why = _gemm_ok(op, g, precision)
        if not ok:
            raise ValueError(f"backend='gemm' cannot run this {op}: {why}; use backend='triton' or 'auto'")
        return "gemm", f"asked for cuBLAS ({why})"
    path, why = choose_backend(ref_t, backend, kernel=f"Triton implicit-GEMM conv {op}")
    if path == "reference":
        return path, why
    if backend == "auto":
        ok, gwhy = _gemm_ok(op, g, precision)
        wflat = _auto_wgrad_flat(g, precision, ref_t) if op == "wgrad" else None
        if wflat:
            return "flat", f"{wflat} ({why})"
        wtma = _auto_wgrad_tma(g, precision, ref_t) if op == "wgrad" else None
        if wtma:
            return "tma", f"{wtma} ({why})"
        pref = _auto_prefers_triton(op, g, precision) if ok else None
        if pref:
            return "triton", f"{pref} ({why})"
        tok = op == "dgrad" and _tma_ok(op, g, precision)[0]
        floor = _TMA_MIN_ROWS[precision == "fp8"] if g.stride != (1, 1) else _TMA_MIN_ROWS_UNSTRIDED
        big = g.N * g.P * g.Q >= floor
        if ok and tok and big and (g.stride != (1, 1) or activation is not None) and _is_sm90(ref_t):
            return "tma", (f"{gwhy}; dx is mostly {'zeros' if g.stride != (1, 1) else 'the GEMM rows'}: one Triton "
                           "TMA GEMM whose epilogue writes every pixel of dx"
                           + (" and applies the activation backward" if activation is not None else "")
                           + " moves fewer bytes than cuBLAS + a scatter pass (memory-bound layers, "
                           f"N*P*Q >= {floor} rows)")
        if ok and (activation is None or g.stride != (1, 1)):  # strided: the activation rides the scatter pass
            return "gemm", f"{gwhy}: cuBLAS, the fastest GEMM on this machine"
        if ok:
            return "triton", f"{gwhy}, but the activation backward fuses into the Triton kernel's epilogue ({why})"
        fok, fwhy = _fprop_ok(op, g, precision, activation, out_dtype)
        if fok and ref_t.is_cuda and torch.backends.cudnn.is_available():
            return "fprop", fwhy
        return "triton", why
    return "triton", why


# ------------------------------------------------------------------------------------------------
# Operand preparation
# ------------------------------------------------------------------------------------------------


def _lowp(t, precision: str, fmt: str, order):
    """t in the compute precision: a tensor of the 16-bit type, or an fp8 QTensor."""
    if precision == "fp8":
        return t if isinstance(t, QTensor) else to_fp8(t, fmt, memory_order=order)
    return t.to(_DTYPE[precision])


def _default_out(precision: str) -> torch.dtype:
    return _DTYPE.get(precision, torch.bfloat16)


def _dequant(t) -> torch.Tensor:
    return t.data.float() * _scale0(t) if isinstance(t, QTensor) else t.float()  # (fp8: an exact product in fp32)


def _scales(a, b):
    if isinstance(a, QTensor):
        return _scale0(a), _scale0(b)
    return None


_MM_OUT_DTYPE: bool | None = None  # does torch.mm(..., out_dtype=float32) run here (CUDA, torch >= 2.8)?


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (16-bit operands) with fp32 accumulation and fp32 output: cuBLAS through
    ``torch.mm(out_dtype=torch.float32)`` (torch >= 2.8, CUDA).  Where that overload is missing, cuBLAS
    with a 16-bit output (fp32 accumulation, reduced-precision split-K reductions off) widened
    afterwards; on the CPU a float32 GEMM of the exactly widened values."""
    global _MM_OUT_DTYPE
    if not a.is_cuda:
        with _no_tf32():
            return torch.mm(a.float(), b.float())
    if _MM_OUT_DTYPE is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
    try:
        return torch.mm(a, b).float()
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved


class _no_tf32:
    """Turn TF32 off for matmul and cuDNN inside the block (the reference and fp32 GEMMs are fp32)."""

    def __enter__(self):
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


_BATCH_PIXELS = _BATCH  # (N, P, Q, C) -> (C, P, Q, N): channels by pixels ordered (p, q, n)


def _batch_inner(t: torch.Tensor) -> bool:
    """Is the (N, H, W, C)-shaped ``t`` stored (C, H, W, N): its (C, H*W*N) matrix a view?"""
    v = t.permute(_BATCH_PIXELS)
    return t.shape[0] > 1 and v.is_contiguous()


def _to_batch_inner(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when stored (C, H, W, N) with 16-byte aligned strides and base (TMA), else a copy in that order."""
    if _batch_inner(t) and t.data_ptr() % 16 == 0:
        return t
    return t.permute(_BATCH_PIXELS).contiguous().permute(_BATCH_PIXELS)  # the permutation is its own inverse


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when a TMA descriptor can read it (unit last stride, 16-byte strides and base), else a
    contiguous copy (e.g. an NCHW-contiguous tensor permuted to NHWC)."""
    es = t.element_size()
    if t.stride(-1) == 1 and not any((st * es) % 16 for st in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 and t.stride(1) == t.shape[0] else t.t().contiguous().t()


# ------------------------------------------------------------------------------------------------
# dgrad
# ------------------------------------------------------------------------------------------------


def conv2d_dgrad(grad_out, weight, input_shape, stride=1, padding=0, dilation=1, *, precision: str = "fp16",
                 activation=None, act_input: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 backend: str = "auto", split_k: int | None = None, fast_accum: bool = False,
                 config: dict | None = None) -> torch.Tensor:
    """Gradient of a conv2d with respect to its input, NHWC: ``dx`` of shape ``input_shape``.

    ``grad_out`` (N, P, Q, K), ``weight`` (K, R, S, C), ``input_shape`` (N, H, W, C).  With
    ``activation`` ("relu", "leaky_relu" or ("leaky_relu", slope)) the activation's backward is
    fused into the epilogue: ``dx * act'(act_input)``, ``act_input`` (N, H, W, C) being the
    activation's input -- or its output, the conv's own input, which has the same sign when
    slope >= 0.  ``out_dtype`` defaults to the compute type (bf16 for fp8).  ``split_k`` splits the
    (tap, K) reduction when pixel tiles alone cannot fill the GPU (None: a heuristic).
    ``config`` fixes the Triton tile (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``,
    ``num_stages``) instead of autotuning.

    >>> dy = torch.randn(2, 4, 4, 8); w = torch.randn(8, 3, 3, 5)
    >>> conv2d_dgrad(dy, w, (2, 8, 8, 5), stride=2, padding=1, backend="reference").shape
    torch.Size([2, 8, 8, 5])
    """
    _check_common(precision, backend, out_dtype)
    _check_tensor(grad_out, "grad_out", "(N, P, Q, K)", precision)
    _check_tensor(weight, "weight", "(K, R, S, C)", precision)
    g = conv_geometry(input_shape, tuple(weight.shape), stride, padding, dilation)
    _check_grad_out(grad_out, g)
    mode, slope = rc.parse_activation(activation)
    if mode != rc.ACT_NONE:
        if not isinstance(act_input, torch.Tensor):
            raise ValueError(f"activation={activation!r} needs act_input, the (N, H, W, C) tensor the mask comes from")
        if tuple(act_input.shape) != g.input_shape:
            raise ValueError(f"act_input must have the input's shape (N, H, W, C) = {g.input_shape}, "
                             f"got {tuple(act_input.shape)}")
    elif act_input is not None:
        raise ValueError("act_input was given without an activation; pass activation='relu' or ('leaky_relu', slope)")
    # (devices here, not in the op: a meta tensor among the operands would send the op to its fake implementation)
    _check_devices(grad_out=grad_out, weight=weight, act_input=act_input if mode != rc.ACT_NONE else None)
    if split_k is not None and int(split_k) < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    (dy, dy_s), (w, w_s) = _split_fp8(grad_out), _split_fp8(weight)
    return torch.ops.tcprec.conv2d_dgrad(
        dy, dy_s, w, w_s, list(g.input_shape), list(g.stride), list(g.padding), list(g.dilation), precision,
        _ACT_NAMES[mode], slope, act_input, out_dtype or _default_out(precision), backend,
        -1 if split_k is None else int(split_k), bool(fast_accum), _config_arg(config))


def _conv2d_dgrad(grad_out, weight, input_shape, stride, padding, dilation, *, precision, activation, act_input,
                  out_dtype, backend, split_k, fast_accum, config) -> torch.Tensor:
    """conv2d_dgrad's body (inside the custom op ``tcprec::conv2d_dgrad``); :func:`conv2d_dgrad` validated the
    arguments."""
    g = conv_geometry(input_shape, tuple(weight.shape), stride, padding, dilation)
    mode, slope = rc.parse_activation(activation)
    device = _device_of(grad_out)
    out_dtype = out_dtype or _default_out(precision)
    path, _ = _choose("dgrad", g, grad_out, precision, backend, activation if mode else None, out_dtype)

    if min(g.input_shape) == 0 or g.K == 0:  # nothing to sum: dx is all zeros
        return torch.zeros(g.input_shape, dtype=out_dtype, device=device)
    dy = _lowp(grad_out, precision, "e5m2", _NHWC)
    w = _lowp(weight, precision, "e4m3", _KMAJOR_W)

    if path == "reference":
        with _no_tf32():
            dx = rc.conv2d_dgrad(_dequant(dy), _dequant(w), g.input_shape, g.stride, g.padding, g.dilation,
                                 dtype=torch.float32)
        if mode:
            dx = rc.activation_backward(dx, act_input, activation)
        return dx.to(out_dtype).contiguous()

    if path == "fprop":
        return _dgrad_fprop(dy, w, g)

    if path == "tma":
        from ..kernels.triton import gemm_scatter as gs

        M = g.N * g.P * g.Q
        out = torch.empty(g.input_shape, dtype=out_dtype, device=device)
        if precision == "fp8":  # both operands K-major: dy (M, K) rows, w as (C, K) rows
            a = _row_major(dy.data.reshape(M, g.K))
            b = _row_major(w.data.reshape(g.K, g.C).t())
        else:
            a = _row_major(dy.reshape(M, g.K))
            b = _row_major(w.reshape(g.K, g.C))
        gs.dgrad_1x1_strided(a, b, out, g, b_kmajor=precision == "fp8", act=(mode, slope), act_input=act_input,
                             scales=_scales(dy, w), fast_accum=fast_accum, config=config)
        return out

    if path == "gemm":
        M = g.N * g.P * g.Q  # the pixels the 1x1 filter reaches: all of them at stride 1
        if precision == "fp8":
            a = _row_major(dy.data.reshape(M, g.K))  # (M, K) e5m2
            b = _col_major(w.data.reshape(g.K, g.C))  # (K, C) e4m3, column-major
            m16 = -(-M // 16) * 16  # cuBLAS fp8 wants every dim a multiple of 16: zero rows, sliced off
            a = a if m16 == M else torch.nn.functional.pad(a, (0, 0, 0, m16 - M))
            dx = torch._scaled_mm(a, b, scale_a=_scale0(dy), scale_b=_scale0(w), out_dtype=out_dtype,
                                  use_fast_accum=bool(fast_accum))[:M]
        elif out_dtype == dy.dtype:
            dx = torch.matmul(dy.reshape(M, g.K), w.reshape(g.K, g.C))  # (M, C)
        else:
            dx = _mm_f32(dy.reshape(M, g.K), w.reshape(g.K, g.C)).to(out_dtype)
        if g.stride == (1, 1):
            dx = dx.view(g.input_shape)
            if mode:
                dx = rc.activation_backward(dx, act_input, activation)
            return dx
        out = torch.empty(g.input_shape, dtype=out_dtype, device=device)
        from ..kernels.triton import conv_bwd as kt

        # Tried and dropped (H200, 2026-11-21): a batched cuBLAS GEMM over the (n, p) rows writing dx's strided
        # pixels in place + zero fills -- 1.6-7x slower at N=256 (Q-row batches, strided stores) and slower
        # under graph replay at N=8 too.
        if out.is_cuda or kt.interpreting():  # one pass writes dx: the GEMM rows at (n, p*sh, q*sw), zeros
            kt.phase_scatter(dx, out, g, act=(mode, slope), act_input=act_input)
            return out
        out.zero_()
        out[:, ::g.stride[0], ::g.stride[1], :] = dx.view(g.N, g.P, g.Q, g.C)
        return rc.activation_backward(out, act_input, activation).to(out_dtype) if mode else out

    from ..kernels.triton import conv_bwd as kt

    out = torch.empty(g.input_shape, dtype=out_dtype, device=device)
    split = kt.dgrad_split(g, kt.sm_count(device)) if split_k is None else int(split_k)
    if split < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    kt.dgrad(dy.data if precision == "fp8" else dy, w.data if precision == "fp8" else w, out, g,
             act=(mode, slope), act_input=act_input, scales=_scales(dy, w), split_k=split,
             fast_accum=fast_accum, config=config)
    return out


def _dgrad_fprop(dy: torch.Tensor, w: torch.Tensor, g: ConvGeometry) -> torch.Tensor:
    """Stride-1 dgrad as cuDNN's forward conv: dx = conv2d(dy, w') with w'[c, k, r, s] = w[k, R-1-r, S-1-s, c],
    padding d*(R-1) - pad, same dilation.  NHWC views in, an NHWC (channels_last) tensor out."""
    if w.is_cuda:
        from ..kernels.triton import conv_bwd as kt

        w_rot = kt.rotate_filter(w).permute(0, 3, 1, 2)  # (C, K, R, S) in channels_last memory: one pass
    else:
        w_rot = w.flip(1, 2).permute(3, 0, 1, 2).contiguous(memory_format=torch.channels_last)
    pad = tuple(d * (k - 1) - p for k, p, d in zip((g.R, g.S), g.padding, g.dilation))
    dx = torch.nn.functional.conv2d(dy.permute(0, 3, 1, 2), w_rot, stride=1, padding=pad, dilation=g.dilation)
    dx = dx.permute(0, 2, 3, 1)  # (N, H, W, C)
    return dx if dx.is_contiguous() else dx.contiguous()


def explain_conv2d_dgrad(grad_out, weight, input_shape, stride=1, padding=0, dilation=1, *, precision: str = "fp16",
                         activation=None, backend: str = "auto", out_dtype: torch.dtype | None = None) -> str:
    """Which backend :func:`conv2d_dgrad` runs for these arguments, and why (one paragraph)."""
    _check_qtensors(grad_out=grad_out, weight=weight)
    _check_common(precision, backend, None)
    g = conv_geometry(input_shape, tuple(weight.shape), stride, padding, dilation)
    path, why = _choose("dgrad", g, grad_out, precision, backend, activation, out_dtype)
    head = _describe(g, precision, "dgrad")
    if path == "fprop":
        body = ("cuDNN forward conv (torch.nn.functional.conv2d, channels_last) of dy with the 180-degree-rotated, "
                "channel-swapped filter, padding d*(R-1)-pad: no Triton kernel runs")
    elif path == "tma":
        body = (f"TMA GEMM path: one Triton kernel (kernels/triton/gemm_scatter.py), dy (N*P*Q, K) @ w (K, C) on "
                f"tensor cores with fp32 accumulation, its epilogue writing dx: the rows at pixels (n, p*{g.stride[0]}, "
                f"q*{g.stride[1]}) and zeros at the pixels no tap reaches"
                + (f", the {activation} backward applied there" if activation else ""))
    elif path == "gemm":
        fn = "torch._scaled_mm (cuBLAS fp8)" if precision == "fp8" else "torch.matmul (cuBLAS)"
        if g.stride == (1, 1):
            body = (f"GEMM path: dx (N*H*W, C) = dy (N*P*Q, K) @ w (K, C) with {fn} -- we use the vendor GEMM "
                    "for 1x1 layers because it is the fastest GEMM available; no Triton kernel runs")
        else:
            body = (f"GEMM path: rows (N*P*Q, C) = dy (N*P*Q, K) @ w (K, C) with {fn} -- the vendor GEMM, the "
                    f"fastest available -- then one Triton pass writes dx: those rows at pixels (n, p*{g.stride[0]}, "
                    f"q*{g.stride[1]}), zeros at the pixels no tap reaches"
                    + (f", the {activation} backward applied in the same pass" if activation else ""))
    elif path == "triton":
        phases = []
        for a in range(g.stride[0]):
            for b in range(g.stride[1]):
                nr, ns = g.phase_taps(0, a)[1], g.phase_taps(1, b)[1]
                phases.append(f"({a},{b}):{nr * ns}")
        body = (f"Triton implicit GEMM, stride-phase decomposition with no inserted zeros: "
                f"{len(phases)} phase(s), taps per phase {' '.join(phases)}; fp32 accumulation"
                + (f"; {activation} backward fused in the epilogue" if activation else ""))
    else:
        body = "pure-torch reference: operands rounded to the precision, float32 torch.nn.grad.conv2d_input"
    return f"{head}: {body}. Reason: {why}."


# ------------------------------------------------------------------------------------------------
# wgrad
# ------------------------------------------------------------------------------------------------


def conv2d_wgrad(grad_out, input, weight_shape, stride=1, padding=0, dilation=1, *, precision: str = "fp16",
                 split_k: int | None = None, out_dtype: torch.dtype | None = None, backend: str = "auto",
                 fast_accum: bool = False, config: dict | None = None) -> torch.Tensor:
    """Gradient of a conv2d with respect to its weight: ``dw`` (K, R, S, C), float32 by default.

    ``grad_out`` (N, P, Q, K), ``input`` (N, H, W, C), ``weight_shape`` (K, R, S, C).  The
    reduction over L = N*P*Q is split ``split_k`` ways (None: a heuristic from the GPU's SM count);
    partial sums go to an fp32 workspace and are added in a fixed order, so the result is
    reproducible bit for bit (no atomics) for a given split and tile.

    >>> dy = torch.randn(2, 4, 4, 8); x = torch.randn(2, 8, 8, 5)
    >>> conv2d_wgrad(dy, x, (8, 3, 3, 5), stride=2, padding=1, backend="reference").shape
    torch.Size([8, 3, 3, 5])
    """
    _check_common(precision, backend, out_dtype)
    _check_tensor(grad_out, "grad_out", "(N, P, Q, K)", precision)
    _check_tensor(input, "input", "(N, H, W, C)", precision)
    g = conv_geometry(tuple(input.shape), weight_shape, stride, padding, dilation)
    _check_grad_out(grad_out, g)
    _check_devices(grad_out=grad_out, input=input)  # (a meta operand would send the op to its fake implementation)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or an int >= 1, got {split_k!r}")
    (dy, dy_s), (x, x_s) = _split_fp8(grad_out), _split_fp8(input)
    return torch.ops.tcprec.conv2d_wgrad(
        dy, dy_s, x, x_s, list(g.weight_shape), list(g.stride), list(g.padding), list(g.dilation), precision,
        -1 if split_k is None else split_k, out_dtype or torch.float32, backend, bool(fast_accum), _config_arg(config))


def _conv2d_wgrad(grad_out, input, weight_shape, stride, padding, dilation, *, precision, split_k, out_dtype,
                  backend, fast_accum, config) -> torch.Tensor:
    """conv2d_wgrad's body (inside the custom op ``tcprec::conv2d_wgrad``); :func:`conv2d_wgrad` validated the
    arguments."""
    g = conv_geometry(tuple(input.shape), weight_shape, stride, padding, dilation)
    device = _device_of(grad_out)
    out_dtype = out_dtype or torch.float32
    path, _ = _choose("wgrad", g, grad_out, precision, backend)
    if min(g.weight_shape) == 0 or g.N == 0:  # nothing to sum: dw is all zeros
        return torch.zeros(g.weight_shape, dtype=out_dtype, device=device)
    dy_order, x_order = _wgrad_orders(path, g)
    dy = _lowp(grad_out, precision, "e5m2", dy_order)
    x = _lowp(input, precision, "e4m3", x_order)

    if path == "reference":
        with _no_tf32():
            dw = rc.conv2d_wgrad(_dequant(dy), _dequant(x), g.weight_shape, g.stride, g.padding, g.dilation,
                                 dtype=torch.float32)
        return dw.to(out_dtype).contiguous()

    if path == "gemm":
        M = g.N * g.P * g.Q  # the reduction: the pixels the 1x1 filter reaches
        sh, sw = g.stride
        if precision == "fp8":
            # (K, M) e5m2 and (C, M) e4m3 row-major (= (M, C) column-major), the pixels in one order for both:
            # (p, q, n) when dy is batch-inner, else (n, p, q) -- views for prepare_fp8_wgrad's layouts; strided:
            # the slice x[:, ::sh, ::sw] copied once into that layout (a plain strided copy from those orders)
            perm = _BATCH_PIXELS if _batch_inner(dy.data) else (3, 0, 1, 2)
            a = _row_major(dy.data.permute(perm).reshape(g.K, M))
            xs = x.data[:, ::sh, ::sw, :]
            b = _row_major(xs.permute(perm).reshape(g.C, M))
            m16 = -(-M // 16) * 16  # cuBLAS fp8 wants every dim a multiple of 16: zero-pad the reduction
            if m16 != M:
                a = torch.nn.functional.pad(a, (0, m16 - M))
                b = torch.nn.functional.pad(b, (0, m16 - M))
            dw = torch._scaled_mm(a, b.t(), scale_a=_scale0(dy), scale_b=_scale0(x), out_dtype=out_dtype,
                                  use_fast_accum=bool(fast_accum))
        else:
            xs = x if (sh, sw) == (1, 1) else x[:, ::sh, ::sw, :]  # (N, P, Q, C): copied by the reshape
            if out_dtype == torch.float32:
                dw = _mm_f32(dy.reshape(M, g.K).t(), xs.reshape(M, g.C))
            else:
                dw = torch.matmul(dy.reshape(M, g.K).t(), xs.reshape(M, g.C)).to(out_dtype)
        return dw.view(g.weight_shape)

    if path == "flat":
        from ..kernels.triton import wgrad_flat as wf

        out = torch.empty(g.weight_shape, dtype=out_dtype, device=device)
        if precision == "fp8" and _batch_inner_ok(g):  # batch-inner operands (copied into that order if not)
            wf.wgrad_flat(_to_batch_inner(dy.data), _to_batch_inner(x.data), out, g, scales=_scales(dy, x),
                          split_k=split_k, config=config)
        elif precision == "fp8":  # one GEMM over the pixels the 1x1 filter reads, both operands K-major
            dy_m = wf.kmajor_rows(dy.data.permute(3, 0, 1, 2).reshape(g.K, g.N * g.P * g.Q))
            x_m = wf.kmajor_pixels(x.data, g.stride)
            wf.wgrad_flat(dy_m, x_m, out, wf.flat_geometry(g), scales=_scales(dy, x), split_k=split_k, config=config)
        else:
            wf.wgrad_flat(_tma_rows(dy), _tma_rows(x), out, g, split_k=split_k, config=config)
        return out

    if path == "tma":
        from ..kernels.triton import wgrad_tma as wt

        out = torch.empty(g.weight_shape, dtype=out_dtype, device=device)
        if precision == "fp8":
            # wgmma reads fp8 only K-major and both wgrad tiles are channel-major: the kernel widens each fp8 tile
            # exactly to fp16 in registers (WIDEN) and applies the scales in its epilogue.  Its TMA boxes need
            # NHWC-contiguous codes (prepare_fp8_wgrad makes them; another order costs one copy here).
            wt.wgrad_tma(_tma_rows(dy.data), _tma_rows(x.data), out, g, scales=_scales(dy, x), split_k=split_k,
                         config=config)
        else:
            wt.wgrad_tma(_tma_rows(dy), _tma_rows(x), out, g, split_k=split_k, config=config)
        return out

    from ..kernels.triton import conv_bwd as kt

    out = torch.empty(g.weight_shape, dtype=out_dtype, device=device)
    if precision == "fp8":
        # fp8 wgmma wants both operands K-major (L contiguous): x's taps cannot be, so Triton would transpose
        # every x tile through registers (measured 4-9x slower than fp16 on H200).  Widen the codes to fp16
        # once instead (exact: every e4m3 / e5m2 value is an fp16 value; same memory order) and run the
        # 16-bit kernel, scales in its epilogue.  The widening passes are part of this op's time.
        kt.wgrad(dy.data.to(torch.float16), x.data.to(torch.float16), out, g, scales=_scales(dy, x),
                 split_k=split_k, config=config)
    else:
        kt.wgrad(dy, x, out, g, split_k=split_k, fast_accum=fast_accum, config=config)
    return out


def explain_conv2d_wgrad(grad_out, input, weight_shape, stride=1, padding=0, dilation=1, *, precision: str = "fp16",
                         split_k: int | None = None, backend: str = "auto") -> str:
    """Which backend :func:`conv2d_wgrad` runs for these arguments, and why (one paragraph)."""
    _check_qtensors(grad_out=grad_out, input=input)
    _check_common(precision, backend, None)
    g = conv_geometry(tuple(input.shape), weight_shape, stride, padding, dilation)
    path, why = _choose("wgrad", g, grad_out, precision, backend)
    head = _describe(g, precision, "wgrad")
    if path == "gemm":
        fn = ("torch._scaled_mm (cuBLAS fp8)" if precision == "fp8" else
              "torch.mm (cuBLAS" + (", fp32 output)" if _MM_OUT_DTYPE is not False else
                                    ", 16-bit output widened to fp32: this torch has no mm(out_dtype=))"))
        body = (f"GEMM path: dw (K, C) = dy^T (K, N*P*Q) @ x (N*P*Q, C) with {fn} -- the vendor GEMM, used "
                "because it is the fastest GEMM available for a 1x1 layer"
                + ("" if g.stride == (1, 1) else f"; x's strided slice x[:, ::{g.stride[0]}, ::{g.stride[1]}] is "
                   "copied once into the GEMM's layout (part of the op's time)"))
    elif path == "triton":
        from ..kernels.triton import conv_bwd as kt

        dev = _device_of(grad_out)
        split = split_k or kt.wgrad_split(g, kt.sm_count(dev))  # fp8 runs the 16-bit kernel
        body = (f"Triton implicit GEMM over L = N*P*Q = {g.N * g.P * g.Q}, split-K {split} way(s) into an fp32 "
                "workspace, then a fixed-order sum (deterministic, no atomics); fp32 accumulation"
                + ("; the fp8 operands are first widened exactly to fp16 (one pass each) and multiplied on the "
                   "16-bit tensor cores (fp8 wgmma would need x transposed through registers)"
                   if precision == "fp8" else ""))
    elif path == "flat":
        from ..kernels.triton import conv_bwd as kt
        from ..kernels.triton import wgrad_flat as wf

        dev = _device_of(grad_out)
        batch = precision == "fp8" and _batch_inner_ok(g)
        gf = wf.flat_geometry(g) if precision == "fp8" and not batch else g
        cfg = wf.config_for(gf, None, 1 if precision == "fp8" else 2, batch)
        split = split_k or wf.split_for(gf, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_L"], kt.sm_count(dev), batch,
                                        cfg["num_stages"], 1 if precision == "fp8" else 2)
        body = (("Triton flat-shift kernel (kernels/triton/wgrad_flat.py), batch-inner fp8 (dy stored (K, P, Q, N), x "
                 "(C, H, W, N); prepare_fp8_wgrad makes them, another order costs one copy each): per tap one fp8 "
                 f"wgmma GEMM over the {g.N * g.P * g.Q} output pixels, a reduction step = {cfg['BLOCK_L']} images "
                 "of one pixel, the tap's input pixel a TMA box start along H and W (zero fill = padding)"
                 if batch else
                 "Triton flat-shift kernel (kernels/triton/wgrad_flat.py), K-major fp8: one fp8 wgmma GEMM "
                 f"dw (K, C) = dy^T (K, L) @ x (L, C) over the L = {gf.N * gf.P * gf.Q} pixels the 1x1 filter reads"
                 + ("" if g.stride == (1, 1) else f" (x's strided pixels x[:, ::{g.stride[0]}, ::{g.stride[1]}] "
                    "gathered K-major by one Triton pass first, part of the op's time)")
                 if precision == "fp8" else
                 "Triton flat-shift kernel (kernels/triton/wgrad_flat.py), NHWC: each tap's x rows are dy's rows "
                 "shifted by a constant, wrapped pixels masked (dy's tile through registers)")
                + f", {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_L']} tiles, "
                + (f"split-K {split} ways into an fp32 workspace, then a fixed-order sum (deterministic, no atomics)"
                   if split > 1 else "no split-K") + "; fp32 accumulation")
    elif path == "tma":
        from ..kernels.triton import conv_bwd as kt
        from ..kernels.triton import wgrad_tma as wt

        dev = _device_of(grad_out)
        cfg = wt.config_for(g, None)
        pl = wt.plan(g, cfg, split_k, kt.sm_count(dev))
        box, split = pl["box"], pl["split"]
        phases = len([p for p in wt.phase_launches(g) if not p["empty"]])
        body = (f"Triton TMA-box implicit GEMM (kernels/triton/wgrad_tma.py): dy and x tiles are 4-D TMA boxes of "
                f"{box[0]} image(s) x {box[1]} row(s) x {box[2]} column(s) of output pixels, the padding is TMA's "
                f"zero fill, {phases} launch(es) (one per stride phase of x), {cfg['BLOCK_M']}x{cfg['BLOCK_N']} "
                "tiles, "
                + (f"split-K {split} ways into an fp32 workspace, then a fixed-order sum (deterministic, no atomics)"
                   if split > 1 else "no split-K (one program reduces all N*P*Q rows of its tile)")
                + "; fp32 accumulation"
                + ("; the fp8 tiles are widened exactly to fp16 in registers (wgmma reads fp8 only K-major)"
                   if precision == "fp8" else ""))
    else:
        body = "pure-torch reference: operands rounded to the precision, float32 torch.nn.grad.conv2d_weight"
    return f"{head}: {body}. Reason: {why}."


def _describe(g: ConvGeometry, precision: str, op: str) -> str:
    ops = {"fp16": "fp16", "bf16": "bf16", "fp8": "fp8 (e4m3 x/w, e5m2 dy, per-tensor scales)"}[precision]
    return (f"conv2d {op} {g.H}x{g.W} {g.C}->{g.K} {g.R}x{g.S} stride {g.stride} pad {g.padding} "
            f"dil {g.dilation} N={g.N}, {ops}")


# ------------------------------------------------------------------------------------------------
# torch.library custom ops: torch.compile / torch.export see conv2d_dgrad and conv2d_wgrad as one opaque call on
# plain tensors; the wrappers above validate.  An fp8 QTensor travels as (data, 0-d scale) (scale None: a float
# tensor),
# the activation as (name, slope), split_k None as -1, the Triton tile ``config`` as "BLOCK_M=64;..." ("" for None).
# ------------------------------------------------------------------------------------------------

_ACT_NAMES = {rc.ACT_NONE: "", rc.ACT_RELU: "relu", rc.ACT_LEAKY: "leaky_relu"}


def _split_fp8(t) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (t.data, _scale0(t)) if isinstance(t, QTensor) else (t, None)


def _join_fp8(data: torch.Tensor, scale: torch.Tensor | None):
    return data if scale is None else _fp8_qtensor(data, scale)


def _literal(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_literal(t) for t in v)
    return isinstance(v, (bool, int, float)) or (isinstance(v, str) and ";" not in v)


def _config_arg(config) -> str:
    """``{"BLOCK_M": 64, "BOX": (1, 2, 8)}`` -> ``"BLOCK_M=64;BOX=(1, 2, 8)"`` (plain string ops: torch.compile
    traces them; the op reads it back with ast.literal_eval)."""
    if config is None:
        return ""
    if not (isinstance(config, dict) and all(isinstance(k, str) and _literal(v) for k, v in config.items())):
        raise TypeError(f"config must be a dict of tile parameters whose values are bools, numbers, strings or "
                        f"tuples of them (BLOCK_M, num_warps, persistent, BOX, ...), got {config!r}")
    return ";".join(f"{k}={v!r}" for k, v in config.items())


def _config(arg: str) -> dict | None:
    return {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in arg.split(";"))} if arg else None


def _activation(name: str, slope: float):
    return None if not name else ("relu" if name == "relu" else ("leaky_relu", slope))


@torch.library.custom_op("tcprec::conv2d_dgrad", mutates_args=())
def _dgrad_op(grad_out: torch.Tensor, grad_out_scale: Optional[torch.Tensor], weight: torch.Tensor,
              weight_scale: Optional[torch.Tensor], input_shape: list[int], stride: list[int], padding: list[int],
              dilation: list[int], precision: str, activation: str, slope: float, act_input: Optional[torch.Tensor],
              out_dtype: torch.dtype, backend: str, split_k: int, fast_accum: bool, config: str) -> torch.Tensor:
    return _conv2d_dgrad(_join_fp8(grad_out, grad_out_scale), _join_fp8(weight, weight_scale), tuple(input_shape),
                         tuple(stride), tuple(padding), tuple(dilation), precision=precision,
                         activation=_activation(activation, slope), act_input=act_input, out_dtype=out_dtype,
                         backend=backend, split_k=None if split_k < 0 else split_k, fast_accum=fast_accum,
                         config=_config(config))


@_dgrad_op.register_fake
def _(grad_out, grad_out_scale, weight, weight_scale, input_shape, stride, padding, dilation, precision, activation,
      slope, act_input, out_dtype, backend, split_k, fast_accum, config):
    return grad_out.new_empty(tuple(input_shape), dtype=out_dtype)


@torch.library.custom_op("tcprec::conv2d_wgrad", mutates_args=())
def _wgrad_op(grad_out: torch.Tensor, grad_out_scale: Optional[torch.Tensor], input: torch.Tensor,
              input_scale: Optional[torch.Tensor], weight_shape: list[int], stride: list[int], padding: list[int],
              dilation: list[int], precision: str, split_k: int, out_dtype: torch.dtype, backend: str,
              fast_accum: bool, config: str) -> torch.Tensor:
    return _conv2d_wgrad(_join_fp8(grad_out, grad_out_scale), _join_fp8(input, input_scale), tuple(weight_shape),
                         tuple(stride), tuple(padding), tuple(dilation), precision=precision,
                         split_k=None if split_k < 0 else split_k, out_dtype=out_dtype, backend=backend,
                         fast_accum=fast_accum, config=_config(config))


@_wgrad_op.register_fake
def _(grad_out, grad_out_scale, input, input_scale, weight_shape, stride, padding, dilation, precision, split_k,
      out_dtype, backend, fast_accum, config):
    return grad_out.new_empty(tuple(weight_shape), dtype=out_dtype)
