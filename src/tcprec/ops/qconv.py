"""Quantized forward convolution at arbitrary integer precision: validate -> plan -> run.

Three files, by role:

* ``ops/qconv_operands.py``: the operands (activation ``QTensor`` layouts: :func:`planes_qtensor`,
  :func:`int8_qtensor`; :class:`PackedConvWeight`) and the static quantizers that make them;
* ``ops/qconv_plan.py``: the plan -- one pure function (``plan_conv2d``) turns the operands' specs and the device's
  capabilities (``DeviceCaps``) into a frozen ``ConvPlan``: backend and why, route, thin-stem path, what the epilogue
  writes, the pass after it, and the same in words (``explain_conv2d`` prints them);
* this file: validation of the tensors, :func:`conv2d_plan`, :func:`run` (each backend below executes the plan's
  decisions, never re-deriving one), :func:`conv2d` = run(conv2d_plan(...)), :func:`explain_conv2d`.  The operand
  names are re-exported here, their public home.

``conv2d(x, w)`` convolves NHWC activations of a p-bit integer format with KRSC weights of a q-bit
integer format (1..8 bits each; two's complement, unsigned or pm1), any kernel size, stride,
padding (zeros) and dilation.  The integer part is exact on every backend; then one epilogue::

    C[n, p, q, k] = sum_{r,s,c} decode(x)[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * decode(w)[k, r, s, c]
    col[k]  = (x_scale * w_scale[k]) * scale[k]            float32 (scale: folded batch-norm, optional)
    y       = act(float32(C) * col[k] + bias[k])             act: None | "relu" | ("leaky", slope) |
                                                             ("clamp", lo, hi) | "hardswish" | "silu"
    y       = pool(y)                                        None | ("max", 2, 2) | ("avg", 2, 2) | ("max", 2, 1)

and the result is ``y`` in ``out_dtype``, the raw ``C`` (``out_dtype=torch.int32``, nothing else
allowed), or -- with ``out_fmt`` -- ``y / out_scale`` rounded to ``out_fmt`` and packed into bit planes
as a ``BitPlanes`` QTensor, the next layer's input, so layers chain without a float tensor.

Activations come as a ``QTensor`` ``(N, H, W, C)`` with one scale (``PerTensor``) in any layout: ``Dense()`` codes,
``BitPlanes()`` (planes ``(bits, N*H*W, packed_words(C))`` or compact, what this op returns), ``ShiftedInt8()``.  Weights come as a ``QTensor`` of codes ``(K, R, S, C)`` (``PerTensor`` or
``PerChannel(0)``) or pre-packed once with :func:`pack_conv_weight`.

Backends (one rule with ``tcprec.matmul``: bit-serial while p*q < 8, INT8 otherwise)

* ``"bitserial"``: an im2col over the *packed* planes (``kernels/triton/im2col_bits.py``, a word
  gather: each output pixel's row gets, per tap (r, s), the ceil(C/32) meaningful words of its input
  pixel, zeros in the padding) that also computes the pm1 row correction, then the binary
  tensor-core GEMM (``torch.ops.tcprec.bmma_gemm``) with the true K = R*S*C in its corrections and
  its fused epilogue (scale, bias, ReLU / LeakyReLU, the output dtype or the packed next-layer
  planes).  A 1x1 stride-1 unpadded convolution needs no im2col: the input planes are the operand.
  Where it measured faster (:func:`implicit_conv`: taps without padding words, and at most two
  column tiles when the GEMM runs the large wgmma tiles) it is an implicit GEMM instead (``bmma_gemm`` with
  ``conv=``): the kernel gathers each window from the packed input planes as it loads (per tap the ceil(C/32)
  words rounded up to an even number, zeros in the padding; any kernel size, stride, padding and dilation), and
  sums the gathered rows on the tensor cores for pm1 weights' row correction (``row_affine``): one launch.
  A max-pool in front of packed output runs on the codes (the epilogue packs at full size, one bit-plane
  pass pools: quantizing is monotone, so it equals pooling first); other pooling is a separate float32
  pass after the GEMM (then the cast or the re-quantize + pack pass);
  ``explain_conv2d`` says which passes run.
* ``"int8"``: on CUDA (and under ``TRITON_INTERPRET=1``) the Triton implicit-GEMM INT8 conv
  (``kernels/triton/conv_fwd.py``: no im2col buffer, scale / bias / activation fused).  Every <= 8-bit
  integer fits int8 after an affine shift (the rule of ``ops/matmul.py``): two's complement as is,
  unsigned and pm1 of <= 7 bits as their values, uint8 / pm8 stored as ``code - 128`` with
  ``value = offset + step * x8``.  Zero padding must stay value 0, and the kernel pads the *stored*
  int8 with 0, so a shifted activation (uint8: offset 128) is corrected over the taps that lie inside
  the image only: ``C = step * acc + offset * sum_{taps inside} w[k]``, an int32 table (P, Q, K) (one
  vector (K,) without padding) that depends on the weight and the geometry, not on the batch; it is
  computed once (one int8 conv of a ones image) and cached in the :class:`PackedConvWeight`.  Shifted
  *weights* (uint8 / pm8) would need a per-pixel window sum of x; they keep the im2col path, as does
  the CPU without the interpreter: im2col on the codes + ``torch._int_mm`` (exact).  An 8-bit layer in front of
  bit-serial ones (an integer ``out_fmt`` as planes, no pool or a 2x2 stride-2 max-pool: the binary networks' stems)
  has the kernel's epilogue max-pool, quantize and pack the planes itself (``conv_fwd.PlanesOut``): no float32
  output and no pass over it; the same planes as the one-pass quantizer's.
* ``"fp8"``: float8 operands (``e4m3`` / ``e5m2`` QTensors, e.g. from :func:`quantize_fp8_static`, and
  a weight packed by :func:`pack_conv_weight`): the Triton implicit-GEMM FP8 conv with x's per-tensor
  and w's per-channel scales folded into the fused epilogue's column scale.  ``fp8_fast_accum=True``
  (the default) keeps Hopper's narrow fp8 accumulator over the whole reduction.  An e4m3 / e5m2 ``out_fmt`` (FP8
  layers handing each other codes): the epilogue writes the float8 codes itself when there is no pooling
  (``conv_fwd`` OUT_FP8), else one Triton pass max-pools and quantizes the float32 output
  (``fp8_quant.pool_quantize_fp8``); both give :func:`quantize_fp8_static`'s codes bit for bit.
* ``"reference"``: ``F.conv2d`` on the decoded codes (fp8: the decoded values) in float64 (exact), any
  device; the default off CUDA and the ground truth of the tests.

Residual blocks (``residual=``, a float NHWC ``(N, P, Q, K)`` tensor of ``out_dtype``): ResNet's
``act(conv_bn(x) + shortcut)`` in the conv's epilogue, with the unfused graph's roundings, so a fused network
is bit-identical to the unfused one::

    y = act(rd(float32(rd(float32(C) * col[k] + bias[k])) + float32(residual)))   rd: round to out_dtype

on the INT8 and FP8 kernels (one IEEE add in the Triton epilogue), on the bit-serial GEMM's float epilogue (float
output: ``bmma_gemm.cu`` TCP_RES, also with its planes as below; a packed-only output raises) and on the torch
epilogues (``reference``, the INT8 im2col route).  ``out_layout="int8+float"``
(integer ``out_fmt``): the *dual* output, a ``ShiftedInt8()`` QTensor whose ``hp`` is the float result in
``out_dtype`` and whose codes are that float's (what :func:`quantize_int8_static` would give from it) -- a
block output feeding both the next residual add and the next INT8 convs, from one pass.  With a residual,
``out_layout="int8"`` quantizes the sum rounded to ``out_dtype`` as well.  ``out_layout="fp8+float"`` (e4m3 / e5m2
``out_fmt``): the FP8 twin, the float8 ``QTensor`` of the next FP8 convs with the float ``hp``
(``conv_fwd`` OUT_DUAL_FP8 on the INT8 and FP8 kernels).  ``out_layout="planes+float"`` (integer ``out_fmt``
of <= 3 bits, float16 / bfloat16 ``out_dtype``): the bit-serial twin, a ``BitPlanes`` QTensor (compact planes of
the stored float's codes, for the next bit-serial convs) with ``hp`` (the float, for the next block's add), from one
epilogue (``bmma_gemm.cu`` TCP_DUAL; the ``reference`` backend writes the same codes).

Activations: None, ``"relu"`` and ``("leaky", slope)`` on every backend; ``("clamp", lo, hi)`` (ReLU6 is
``("clamp", 0.0, 6.0)``, hardtanh), ``"hardswish"`` and ``"silu"`` on the INT8 / FP8 kernels (a compiled variant of
their epilogue; a thin stem takes the gathered Triton route, not ``stem_conv.cu``) and the torch epilogues
(``reference``, the INT8 im2col route), in ``kernels/reference_conv_int8_fp8.apply_act``'s float32 operations; the
bit-serial GEMM's epilogue has none of the three, and a plan that runs it with one raises (run the layer on the INT8
backend, or apply the activation after the conv).  A fused 2x2 max-pool of the bit-planes epilogue needs a monotone
activation (``act_monotone``): hardswish and SiLU leave the pool to the pass after the kernel.

pm1 activations (``binary``, ``pmN``) have no zero, so they cannot stand for the zeros of spatial
padding: the bit-serial kernel's pm1 correction assumes every one of the K terms is present.
``padding > 0`` with pm1 activations raises (use unsigned / two's complement activations, e.g. after
a ReLU ``uint2``); pm1 *weights* are fine with any padding.

``conv2d`` is not a ``torch.library`` custom op: its operands and results are containers (QTensor in its layouts, with
``hp``; PackedConvWeight) and a plan picks among a dozen output layouts, so there
is no one tensor-in / tensor-out signature to register.  Inside it the bit-serial GEMM (``tcprec::bmma_gemm``)
and the im2col INT8 product of the int8 backend's unfused route (``tcprec::matmul``) are opaque calls; the rest
is torch ops and Triton launches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..formats import FloatFormat, IntFormat
from ..kernels import reference_conv_bitserial as rq
from ..kernels import reference_gemm as rg
from ..kernels.conv_geometry import ConvGeometry, pair
from ..kernels.reference_conv_int8_fp8 import conv_acc, parse_act
from ..kernels.reference_i8_gemm import INV_SQRT2_F32
from ..kernels.triton._host import interpreting
from ..memo import remembered
from ..packing import pack_bitplanes, packed_words
from ..qtensor import BitPlanes, Dense, PerTensor, QTensor, ShiftedInt8, int8_codes
from .matmul import matmul
from .qconv_operands import (_CHECKED_SCALES, LAYER_NORM_MAX_C, LAYER_NORM_OPERANDS,  # noqa: F401 (re-exported)
                             PackedConvWeight, _check_weight_qtensor,
                             _scale_checked, _scale_tensor, int8_qtensor, layer_norm_quantize, max_pool_planes,
                             max_pool_quantize, max_pool_window, pack_activation, pack_conv_weight, planes_qtensor,
                             quantize_fp8_static, quantize_int8_static)
from .qconv_plan import (_FP8_KIND, _FUSED_POOLS, _KIND, BACKENDS, GELU, OUT_LAYOUTS, POOLS, THIN_C,  # noqa: F401
                         WGMMA_GEMM, ConvPlan, DeviceCaps, _bitserial_kind, _check_pool, _fp8_dtype, _input_words,
                         _int8_affine,
                         _stem_kp, _stem_out, _stem_pad, _thin_stem, device_caps, format_plan, implicit_conv,
                         plan_conv2d, stem_variant)
from .quantize import _qp_params

__all__ = [
    "PackedConvWeight",
    "planes_qtensor",
    "int8_qtensor",
    "quantize_int8_static",
    "pack_activation",
    "pack_conv_weight",
    "quantize_fp8_static",
    "max_pool_planes",
    "max_pool_quantize",
    "max_pool_window",
    "layer_norm_quantize",
    "conv2d",
    "conv2d_plan",
    "run",
    "explain_conv2d",
    "choose_conv2d_backend",
    "ConvPlan",
    "DeviceCaps",
    "OUT_LAYOUTS",
    "POOLS",
    "BACKENDS",
]

# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _X:
    fmt: IntFormat | FloatFormat
    scale: torch.Tensor  # (1,) float32
    shape: tuple  # (N, H, W, C)
    device: torch.device
    qt: QTensor  # in its layout: Dense codes, BitPlanes, ShiftedInt8

    def codes(self) -> torch.Tensor:  # (N, H, W, C) uint8
        return self.qt.codes

    def planes(self) -> torch.Tensor:  # (bits, N*H*W, Kw)
        if isinstance(self.qt.layout, BitPlanes):
            return self.qt.data
        N, H, W, C = self.shape
        return pack_bitplanes(self.codes().reshape(N * H * W, C), self.fmt.bits, validate=False)

    @property
    def compact(self) -> bool:
        """Bit planes without their padding words."""
        return isinstance(self.qt.layout, BitPlanes) and self.qt.data.shape[2] != packed_words(self.shape[3])

    @property
    def layout(self) -> str:
        """How x arrives (``qconv_plan.INPUT_LAYOUTS``): bit planes (padded or compact rows), int8 codes, codes."""
        if isinstance(self.qt.layout, BitPlanes):
            return "compact" if self.compact else "planes"
        if isinstance(self.qt.layout, ShiftedInt8):
            return "int8"
        return "fp8" if _fp8_dtype(self.fmt) is not None else "codes"

    def int8(self) -> tuple[torch.Tensor, int, int]:  # (x8 (N, H, W, C) int8, offset, step)
        if isinstance(self.qt.layout, ShiftedInt8):
            return (self.qt.data, *_int8_affine(self.fmt))
        return int8_codes(self.codes(), self.fmt)


def _check_x(x) -> _X:
    if not isinstance(x, QTensor):
        raise TypeError(f"x must be a QTensor of NHWC codes (tcprec.quantize(x_nhwc, 'uint2'), in the Dense(), "
                        f"BitPlanes() or ShiftedInt8() layout), got {type(x).__name__}")
    if not isinstance(x.fmt, IntFormat) and _fp8_dtype(x.fmt) is None:
        raise TypeError(f"x must be of an integer format (uintN, intN, binary, pmN) or e4m3 / e5m2 "
                        f"(quantize_fp8_static), got {x.fmt}; quantize it to one")
    if x.ndim != 4:
        raise ValueError(f"x must be NHWC (N, H, W, C), got shape {x.shape}; an NCHW tensor is x.permute(0, 2, 3, 1)")
    if not isinstance(x.granularity, PerTensor):
        raise ValueError(f"x's scale is {x.granularity}: conv2d needs one activation scale (PerTensor()); "
                         "requantize x with tcprec.quantize(x, fmt, tcprec.PerTensor())")
    if not isinstance(x.layout, (Dense, BitPlanes, ShiftedInt8)):
        raise ValueError(f"x is in the {x.layout!r} layout; conv2d reads Dense() (float8 codes too), BitPlanes() or "
                         "ShiftedInt8(): x.to_layout(tcprec.Dense())")
    return _X(x.fmt, x.scale.reshape(1), x.shape, x.device, x)


def _check_act(act):
    """``act`` in the canonical (hashable) form the plan holds: None, "relu", ("leaky", slope), ("clamp", lo, hi)
    (float32 bounds, ``reference_conv_int8_fp8.parse_act``'s check), "hardswish", "silu"."""
    if act is None or (isinstance(act, str) and act in ("relu", "hardswish", "silu", GELU)):
        return act  # (GELU: the wgmma GEMM's and the torch epilogues only, qconv_plan._check_gelu)
    if isinstance(act, (tuple, list)) and len(act) == 2 and act[0] == "leaky":
        try:
            slope = float(act[1])
        except (TypeError, ValueError):
            slope = float("nan")
        if math.isfinite(slope):
            return ("leaky", slope)
    if isinstance(act, (tuple, list)) and len(act) == 3 and act[0] == "clamp":
        _, lo, hi = parse_act(act)  # (raises, naming the bounds, unless finite lo < hi)
        return ("clamp", lo, hi)
    raise ValueError(f"act must be None, 'relu', ('leaky', slope), ('clamp', lo, hi) (ReLU6: ('clamp', 0.0, 6.0)), "
                     f"'hardswish', 'silu' or 'gelu' (a linear's rows on the wgmma GEMM), got act={act!r}; e.g. "
                     "act=('leaky', 0.1)")


def _check_vec(t, K: int, name: str, device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.Tensor of shape ({K},) (one per output channel), "
                        f"got {type(t).__name__}" + (f" of dtype {t.dtype}" if isinstance(t, torch.Tensor) else ""))
    if tuple(t.shape) != (K,):
        raise ValueError(f"{name} must have shape ({K},) (one per output channel), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the operands are on {device}")
    return t.to(torch.float32).contiguous()


def _geometry(xs: _X, wshape, stride, padding, dilation) -> ConvGeometry:
    N, H, W, C = xs.shape
    K, R, S, Cw = wshape
    if Cw != C:
        raise ValueError(f"C mismatch: x has C={C} channels (last dim of NHWC {xs.shape}) but w has C={Cw} (last dim "
                         f"of KRSC {tuple(wshape)}); an nn.Conv2d weight (K, C, R, S) is w.permute(0, 2, 3, 1)")
    st, pd, dl = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(st) < 1 or min(dl) < 1 or min(pd) < 0:
        raise ValueError(f"stride and dilation must be >= 1 and padding >= 0, got stride={stride}, padding={padding}, "
                         f"dilation={dilation}")
    g = ConvGeometry(N, H, W, C, K, R, S, st, pd, dl)
    if g.P < 1 or g.Q < 1:
        raise ValueError(f"the dilated {R}x{S} kernel (dilation {dl}) does not fit the padded {H}x{W} input "
                         f"(padding {pd}): output would be {g.P}x{g.Q}; add padding or use a smaller kernel")
    return g


def _check_residual(residual, g: ConvGeometry, out_dtype, device) -> None:
    """A residual is a float NHWC tensor of the conv's output shape, in ``out_dtype``, on the operands' device."""
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a float NHWC torch.Tensor (N, P, Q, K) = {g.output_shape}, got "
                        f"{type(residual).__name__}")
    if out_dtype not in _KIND:
        raise ValueError(f"residual is added in the float epilogue: out_dtype must be one of "
                         f"{[str(d) for d in _KIND]}, got {out_dtype}; pass the network's float dtype")
    if residual.dtype != out_dtype:
        raise ValueError(f"residual must have the output's dtype out_dtype={out_dtype} (the unfused graph adds two "
                         f"tensors of the network's dtype), got residual.dtype={residual.dtype}; pass "
                         f"residual.to({out_dtype}) or out_dtype={residual.dtype}")
    if tuple(residual.shape) != g.output_shape:
        raise ValueError(f"residual must have the output's NHWC shape (N, P, Q, K) = {g.output_shape}, got "
                         f"{tuple(residual.shape)}; an NCHW tensor is residual.permute(0, 2, 3, 1)")
    if residual.device != device:
        raise ValueError(f"residual is on {residual.device} but the operands are on {device}; move it there "
                         f"(residual.to('{device}'))")


# ------------------------------------------------------------------------------------------------
# Backends
# ------------------------------------------------------------------------------------------------


# Column scales already multiplied out (x_scale * w_scale[k] * scale[k]).  A quantized network passes the same
# calibrated buffers on every call, and the two multiplies were two kernel launches a layer: ~2 us each in a batch-8
# CUDA graph, about a sixth of ResNet-18's w1a2 forward (H200 profile).  A memo like _CHECKED_SCALES (tcprec.memo),
# so an in-place change of a buffer computes it again.  Not stored while a graph is being captured (the values would
# exist only after a replay), nor for tensors that need grad or under torch.compile.
_COL_SCALES: dict = {}


def _col_scale(xs: _X, w_scale: torch.Tensor, scale) -> torch.Tensor:
    srcs = (xs.scale, w_scale) if scale is None else (xs.scale, w_scale, scale)

    def compute():
        col = xs.scale * w_scale  # (K,) float32: x_scale * w_scale[k]
        return (col if scale is None else col * scale).contiguous()

    return remembered(_COL_SCALES, srcs, compute)


def _im2col_codes(codes: torch.Tensor, g: ConvGeometry) -> torch.Tensor:
    """uint8 codes (N, H, W, C) -> (M, R*S*C), zero codes in the padding (value 0 for twos/unsigned)."""
    if g.is_pointwise:
        return codes.reshape(g.N * g.H * g.W, g.C)
    ph, pw = g.padding
    xp = torch.nn.functional.pad(codes, (0, 0, pw, pw, ph, ph))  # (N, H+2ph, W+2pw, C)
    dev = codes.device
    hh = (torch.arange(g.P, device=dev) * g.stride[0])[:, None] + (torch.arange(g.R, device=dev) * g.dilation[0])[None]
    ww = (torch.arange(g.Q, device=dev) * g.stride[1])[:, None] + (torch.arange(g.S, device=dev) * g.dilation[1])[None]
    cols = xp[:, hh[:, None, :, None], ww[None, :, None, :], :]  # (N, P, Q, R, S, C)
    return cols.reshape(g.N * g.P * g.Q, g.R * g.S * g.C)


def _int_product(plan: ConvPlan, xs: _X, qw: QTensor) -> torch.Tensor:
    """int32/int64 C (M, K) on the int8 or reference backend."""
    g = plan.geometry
    if plan.backend == "reference":
        return rq.conv2d_int(xs.codes(), plan.a_fmt, qw.codes, plan.w_fmt, g).reshape(-1, g.K)
    cols = _im2col_codes(xs.codes(), g)  # (M, RSC) uint8
    M, Kt = cols.shape
    one = torch.ones((1, 1), dtype=torch.float32, device=cols.device)
    qa = QTensor(cols, one, plan.a_fmt, PerTensor(), (M, Kt), torch.float32)
    qwm = QTensor(qw.codes.reshape(g.K, Kt), one, plan.w_fmt, PerTensor(), (g.K, Kt), torch.float32)
    return matmul(qa, qwm, out_dtype=torch.int32, backend="int8")  # (M, K) exact


def _pool_float(plan: ConvPlan, y: torch.Tensor) -> torch.Tensor:
    """The max-pool of a float output the kernel wrote at full size in its final dtype (``plan.pool_float``):
    one Triton pass on CUDA and under the interpreter (``pack.pool_cast``), torch's pool elsewhere -> (N, P', Q', K)."""
    g = plan.geometry
    y4 = y.reshape(g.N, g.P, g.Q, g.K)
    if plan.device.triton:
        from ..kernels.triton import pack as tpack  # TRITON_INTERPRET is read at import

        return tpack.pool_cast(y4, _FUSED_POOLS[tuple(plan.pool)])
    return rq.pool_nhwc(y4.float(), plan.pool).to(y4.dtype)


def _int8_correction(pw: PackedConvWeight, g: ConvGeometry, off: int, padded: bool | None = None) -> torch.Tensor:
    """int32 ``off * sum_{taps (r, s) inside the image} sum_c w8[k, r, s, c]``: (K,) without padding (every
    tap of every window is inside; ``padded=False``: over every tap, for a kernel whose padded taps hold the code
    of value 0), else (P, Q, K) from one int8 conv of an all-ones image (exact, on
    the weight's device; the same for every image of the batch).  Cached in ``pw.corr`` per geometry,
    except when first computed inside a CUDA-graph capture (its kernels run only on replay)."""
    from ..kernels.triton.conv_fwd import conv2d_fwd_int8  # TRITON_INTERPRET is read at import

    padded = max(g.padding) > 0 if padded is None else padded
    key = (off, g.H, g.W, g.stride, g.padding, g.dilation) if padded else (off,)
    t = pw.corr.get(key)
    if t is not None:
        return t
    w8 = pw.w8
    if padded:
        ones = torch.ones((1, g.H, g.W, g.C), dtype=torch.int8, device=w8.device)
        wsum = conv2d_fwd_int8(ones, w8, stride=g.stride, padding=g.padding, dilation=g.dilation, out="int32")
        t = (wsum[0] * off).contiguous()  # (P, Q, K)
    else:
        t = (w8.sum((1, 2, 3), dtype=torch.int32) * off).contiguous()  # (K,)
    if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        pw.corr[key] = t
    return t


def _stem_cols(x8: torch.Tensor, g: ConvGeometry, kp: int) -> torch.Tensor:
    """(N, H, W, C) 8-bit codes (any 1-byte dtype) -> (N, P, Q, kp) of the same dtype: output pixel (n, p, q)'s
    window in (r, s, c) order -- the (K, R, S, C) weight's -- then zeros; padded taps read stored code 0.
    One Triton pass on CUDA / under the interpreter (``quant_bytes.im2col_rows``), torch ops elsewhere."""
    if x8.is_cuda or interpreting():
        from ..kernels.triton.quant_bytes import im2col_rows  # TRITON_INTERPRET is read at import

        return im2col_rows(x8.contiguous(), g.R, g.S, g.stride, g.padding, g.dilation, g.P, g.Q, kp)
    b = x8.view(torch.uint8) if x8.dtype != torch.uint8 else x8  # gather on bytes (float8 has no pad kernel)
    rsc = g.R * g.S * g.C
    out = torch.zeros((g.N, g.P, g.Q, kp), dtype=torch.uint8, device=x8.device)
    out[..., :rsc] = _im2col_codes(b, g).view(g.N, g.P, g.Q, rsc)
    return out.view(x8.dtype)


def _stem_weight(pw: PackedConvWeight, g: ConvGeometry, kp: int) -> torch.Tensor:
    """The 8-bit weight (K, R, S, C) as a 1x1 filter (K, 1, 1, kp), zero tail; cached in ``pw.corr``."""
    key = ("stem_w", kp)
    w = pw.corr.get(key)
    if w is None:
        rsc = g.R * g.S * g.C
        b = pw.w8.view(torch.uint8).reshape(g.K, rsc)
        w = torch.zeros((g.K, 1, 1, kp), dtype=torch.uint8, device=b.device)
        w[:, 0, 0, :rsc] = b
        w = w.view(pw.w8.dtype)
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            pw.corr[key] = w
    return w


def _conv_operands(x8: torch.Tensor, pw: PackedConvWeight, g: ConvGeometry):
    """(x, w, stride, padding, dilation) the 8-bit kernel runs: the layer itself, or for a thin stem its
    gathered columns as a 1x1 convolution."""
    if _thin_stem(g):
        kp = _stem_kp(g)
        return _stem_cols(x8, g, kp), _stem_weight(pw, g, kp), 1, 0, 1
    return x8, pw.w8, g.stride, g.padding, g.dilation


def _out_spec(plan: ConvPlan, s_out):
    """The kernels' ``(out, out_int8)`` arguments: a kind, or the next INT8 layer's codes ("int8", scale,
    (lo, hi, offset)), or for the dual output the float kind and those codes."""
    kind = plan.epilogue
    if kind in _FP8_KIND.values():  # the next FP8 layer's codes
        return (kind, s_out), None
    if kind == "planes":
        from ..kernels.triton.conv_fwd import PlanesOut

        return PlanesOut(s_out, plan.out_fmt.bits, *_qp_params(plan.out_fmt), pool=2 if plan.pool else 0,
                         compact=plan.out_layout == "compact"), None
    if kind not in ("int8", "dual"):
        return kind, None
    if isinstance(plan.out_fmt, FloatFormat):  # the float and the next FP8 layers' codes (OUT_DUAL_FP8)
        return _KIND[plan.out_dtype], (_FP8_KIND[_fp8_dtype(plan.out_fmt)], s_out)
    lo, hi, _, _ = _qp_params(plan.out_fmt)
    codes = ("int8", s_out, (lo, hi, _int8_affine(plan.out_fmt)[0]))
    return (codes, None) if kind == "int8" else (_KIND[plan.out_dtype], codes)


# Thin stems that write bit planes (VGG / AlexNet / YOLOv2-tiny in front of binary layers) run the CUDA kernel
# kernels/cuda/stem_conv.cu on sm_90: it reads the int8 image once into shared memory a tile and fuses the pool,
# quantize and pack, with no window gather pass (VGG's stem at batch 256 on an H200: docs/decisions/0004).  The
# same integers and epilogue as the reference (tests/gpu/test_stem_conv_gpu.py compares them bit for bit).


def _stem_kernel(plan: ConvPlan, xs: _X, pw: PackedConvWeight, col, bias, s_out):
    """kernels/cuda/stem_conv.cu, as the Triton route computes: planes (bits, N * P' * Q', Kw) of the thin stem, its
    16-bit float (N, P, Q, K), or both as (float, compact planes) (``qconv_plan._stem_out``)."""
    from ..kernels.cuda import stem_conv as sc

    g = plan.geometry
    out = _stem_out(plan)
    x8, oa, _ = xs.int8()  # (N, H, W, C) int8, value = oa + sa * x8
    # padded taps hold the code of value 0 (_stem_pad: unit steps), so the correction is the same for every pixel: (K,)
    acc_add = _int8_correction(pw, g, oa, padded=False) if oa else None
    key = ("stem_words",)
    wq = pw.corr.get(key)
    if wq is None:
        wq = sc.stem_weight_words(pw.w8)
        if not (wq.is_cuda and torch.cuda.is_current_stream_capturing()):
            pw.corr[key] = wq
    ldo = packed_words(g.K) if plan.out_layout == "planes" else -(-g.K // 32)  # compact rows: "compact", the dual
    v = stem_variant(plan, out)
    y, planes = sc.conv_stem(x8.contiguous(), wq, g.K, g.R, g.S, stride=g.stride, padding=g.padding,
                             dilation=g.dilation, col_scale=col, bias=bias, out_scale=s_out, act=plan.act,
                             acc_add=acc_add, pad=_stem_pad(plan), out_bits=v.out_bits, out_encoding=v.out_encoding,
                             pool=2 if plan.pool else 0, ldo=ldo, fout=v.fout, planes=v.planes)
    return planes if out == "planes" else y if out == "float" else (y, planes)


def _int8_kernel(plan: ConvPlan, xs: _X, pw: PackedConvWeight, col, bias, s_out, residual=None):
    """The Triton implicit-GEMM INT8 conv with the fused epilogue; (N, P, Q, K) in ``_kernel_out`` (a pair
    (float, int8) for the dual output).  ``plan.stem == "cuda"``: kernels/cuda/stem_conv.cu instead."""
    from ..kernels.triton.conv_fwd import conv2d_fwd_int8

    g = plan.geometry
    if plan.stem == "cuda":
        return _stem_kernel(plan, xs, pw, col, bias, s_out)
    x8, oa, sa = xs.int8()  # (N, H, W, C) int8, value = oa + sa * x8
    acc_mul, acc_add = 1, None
    if oa:  # C = sa*sw * acc + oa*sw * (sum of w over the taps inside the image); w unshifted (route rule)
        acc_mul, acc_add = sa * pw.w_step, _int8_correction(pw, g, oa * pw.w_step)
    out, out_int8 = _out_spec(plan, s_out)
    float_out = out != "int32"
    x, w, st, pd, dl = _conv_operands(x8, pw, g)
    return conv2d_fwd_int8(x, w, stride=st, padding=pd, dilation=dl,
                           scale=col if float_out else None, bias=bias if float_out else None,
                           act=plan.act if float_out else None, out=out, acc_mul=acc_mul, acc_add=acc_add,
                           residual=residual, out_int8=out_int8,
                           acc_add_interior=not _thin_stem(g))  # a thin stem's table is the original conv's


def _wgmma_gemm(plan: ConvPlan, xs: _X, pw: PackedConvWeight, bias, s_out, residual=None):
    """A linear's rows on ``kernels/cuda/i8_gemm.cu`` (the ``wgmma-gemm`` route): (N, 1, 1, K) float16, or the next
    layer's int8 ``ShiftedInt8`` QTensor.  The kernel's epilogue is the Triton kernel's float32 operations in its order:
    ``a_scale * w_scale[k]`` rounded once (the Triton route's ``col``), ``float32(acc) * col + bias``, one rounding;
    ``residual`` (N, 1, 1, K) float16, contiguous: ``fp16(float32(that) + float32(residual))``, the Triton epilogue's
    ``HAS_RES`` sum (``qconv_plan.wgmma_gemm_refusal``)."""
    from ..kernels.cuda.i8_gemm import i8_gemm

    g = plan.geometry
    x8, _, _ = xs.int8()  # (N, 1, 1, C) int8: the values (the plan checked offset 0, step 1)
    a = x8.reshape(g.N, g.C)  # (M, K) rows, a view
    w8 = pw.w8.reshape(g.K, g.C)  # (N, K)
    a_scale = xs.scale.reshape(1).to(torch.float32)
    w_scale = pw.w_scale.reshape(g.K)  # (N,) float32, contiguous
    res = residual.reshape(g.N, g.K) if residual is not None else None  # (M, N) fp16, a view (_run made it contiguous)
    y = i8_gemm(a, w8, a_scale, w_scale, bias, gelu=plan.act == GELU,
                out_scale=s_out.reshape(1) if plan.out_fmt is not None else None, residual=res)  # (M, N) fp16 / int8
    if plan.out_fmt is not None:
        return int8_qtensor(y.reshape(g.N, 1, 1, g.K), plan.out_fmt, s_out)
    return y.reshape(g.N, 1, 1, g.K)


def _gelu_f32(y: torch.Tensor) -> torch.Tensor:
    """The erf GELU in the wgmma GEMM epilogue's float32 operations (``reference_i8_gemm``): the torch epilogues'."""
    inv = torch.tensor(INV_SQRT2_F32, dtype=torch.float32, device=y.device)
    return (0.5 * y) * (1.0 + torch.erf(y * inv))


def _fp8_kernel(plan: ConvPlan, xs: _X, pw: PackedConvWeight, col, bias, fast_accum: bool, s_out, residual=None):
    """The Triton implicit-GEMM FP8 conv; col = x_scale * w_scale[k] (* scale[k]) is its x_scale
    operand (per channel), so the kernel's column scale is exactly the reference's."""
    from ..kernels.triton.conv_fwd import conv2d_fwd_fp8

    g = plan.geometry
    x8 = xs.codes().contiguous().view(_fp8_dtype(plan.a_fmt))  # (N, H, W, C) float8, no copy
    x, w, st, pd, dl = _conv_operands(x8, pw, g)  # fp8 code 0 is value 0: padded taps need no correction
    out, out_int8 = _out_spec(plan, s_out)
    return conv2d_fwd_fp8(x, w, col, None, stride=st, padding=pd, dilation=dl, bias=bias,
                          act=plan.act, out=out, fast_accum=fast_accum, residual=residual, out_int8=out_int8)


def _fp8_reference(plan: ConvPlan, xs: _X, qw: QTensor) -> torch.Tensor:
    """float64 (M, K): F.conv2d on the decoded fp8 values (every product and partial sum exact)."""
    g = plan.geometry
    x = xs.codes().contiguous().view(_fp8_dtype(plan.a_fmt))
    w = qw.codes.contiguous().view(_fp8_dtype(plan.w_fmt))
    return conv_acc(x, w, g.stride, g.padding, g.dilation).reshape(-1, g.K)


def _bitserial(plan: ConvPlan, xs: _X, pw: PackedConvWeight, col, bias, out_scale, gemm, residual=None,
               short_rows=None):
    """The binary tensor-core pipeline: (im2col over planes) -> bmma_gemm with the fused epilogue (and a float
    output's residual add).  Returns (M, K) int32 / float, or planes, per ``plan.epilogue``.  ``short_rows``
    (``bmma_gemm.short_rows_ok`` with the CUDA GEMM): whether the GEMM takes compact input rows as they are."""
    from ..kernels.triton.im2col_bits import im2col_bits  # TRITON_INTERPRET is read at import

    g, fa, fw = plan.geometry, plan.a_fmt, plan.w_fmt
    oa, sa = rg.affine(fa)
    ow, sw = rg.affine(fw)
    K_true = g.R * g.S * g.C
    planes = xs.planes()  # (p, N*H*W, packed_words(C)), or compact (p, N*H*W, ceil(C / 32)): fine for the im2col
    need_row = ow != 0
    conv, w_planes = None, pw.planes
    row_term, extra = None, {}
    row_mul, row_add = sa * ow, K_true * oa * ow  # the pm1 row term: row_mul * (row sum of A) + row_add
    row_affine = [row_mul, row_add] if need_row else None  # (the implicit / 1x1 routes: row sums in the kernel)
    kind, relu, slope, ofmt = _bitserial_kind(plan)
    out_bits, out_enc = (ofmt.bits, ofmt.encoding) if ofmt is not None else (1, "unsigned")
    twos_a, twos_w = fa.encoding == "twos", fw.encoding == "twos"
    if plan.route == "implicit":
        if pw.conv_planes is None or planes.shape[2] != _input_words(plan):
            raise ValueError(f"the plan gathers windows from {_input_words(plan)}-word planes with the implicit-GEMM "
                             f"weight layout, got {planes.shape[2]}-word planes and conv_planes="
                             f"{'None' if pw.conv_planes is None else 'set'}; pack the weight with pack_conv_weight")
        # implicit GEMM: the kernel gathers the windows from the input planes, and (pm1 weights) sums their rows on
        # the tensor cores -- one launch, no pass over A before it
        cwt = rq.conv_tap_words(g.C)
        conv = [g.H, g.W, g.P, g.Q, g.R, g.S, *g.stride, *g.padding, *g.dilation, cwt]
        a_planes, w_planes = planes, pw.conv_planes
        extra["row_affine"] = row_affine
    elif plan.route == "pointwise":
        # whole 512-bit rows, unless the GEMM's TMA tile reads the compact ones as they are (bmma_gemm.short_rows_ok)
        if xs.compact and not (short_rows is not None and short_rows(
                planes, w_planes, twos_a, twos_w, kind, out_bits, out_enc, residual=residual is not None,
                dual=plan.dual, rowsum=row_affine is not None)):
            planes = BitPlanes().padded(planes, g.C)
        a_planes = planes  # the input planes are the GEMM operand (Kw_col = packed_words(C)); row sums in the kernel
        extra["row_affine"] = row_affine
    else:
        a_planes, row_term = im2col_bits(planes, g, twos=twos_a, rowsum=need_row,
                                         row_mul=row_mul, row_add=row_add)  # (p, M, Kw_col), (M,)
    col_term = (oa * sw * pw.rowsum).contiguous() if oa != 0 else None  # (K,) int32
    if conv is not None:
        extra["conv"] = conv
    if kind == "packed" and plan.out_layout == "compact":  # rows of ceil(K / 32) words for a gathering consumer
        extra["out_compact"] = True
    if plan.dual:  # "planes+float": the output's planes (compact rows) from the same epilogue
        extra["dual_out"] = torch.empty((ofmt.bits, g.N * g.P * g.Q, -(-g.K // 32)), dtype=torch.int32,
                                        device=planes.device)
    if residual is not None:  # a float output (_check_fusion): the epilogue adds it before the activation
        extra["residual"] = residual.reshape(-1, g.K)
    y = gemm(a_planes, w_planes, twos_a, twos_w, sa * sw, row_term, col_term, None,
             col if kind != "int32" else None, bias if kind != "int32" else None, relu, kind, out_bits, out_enc,
             out_scale if kind == "packed" or plan.dual else None, "", slope, **extra)
    return (y, extra["dual_out"]) if plan.dual else y


def _finish_float(plan: ConvPlan, y: torch.Tensor, out_scale, act_done: bool, residual=None):
    """float32 y (M, K) -> (+ residual) -> act (unless done) -> pool -> out dtype or packed.  To packed integer
    planes from a kernel backend on CUDA (and under the interpreter): one Triton pass, max-pool + quantize + pack
    (``kernels/triton/pack.py``; the same codes as the reference's torch passes for finite y)."""
    g = plan.geometry
    if residual is not None:  # the kernels' order: the branch in the residual's dtype, one add, the sum in it, act
        y = y.to(residual.dtype).to(torch.float32) + residual.reshape(-1, g.K).to(torch.float32)
        y = y.to(residual.dtype).to(torch.float32)  # the sum as the unfused add stores it
    if not act_done:
        y = _gelu_f32(y) if plan.act == GELU else rq.apply_act(y, plan.act)
    fmt = plan.out_fmt
    if residual is not None and isinstance(fmt, FloatFormat) and not plan.dual:
        y = y.to(residual.dtype).to(torch.float32)  # the codes of the sum in the network's dtype, as the kernels
    y4 = y.reshape(g.N, g.P, g.Q, g.K)
    s = out_scale.to(torch.float32).reshape(1) if out_scale is not None else None
    how = "reference" if plan.backend == "reference" else "auto"
    if plan.dual and isinstance(fmt, FloatFormat):  # the float result, and its codes for the next FP8 layers
        y_hp = y4.to(plan.out_dtype)
        qt = quantize_fp8_static(y_hp, s, fmt)
        return QTensor(qt.codes, qt.scale, fmt, PerTensor(), qt.shape, torch.float32, hp=y_hp)
    if plan.dual and plan.out_layout == "planes+float":  # the float result, and its planes for bit-serial layers
        return _with_planes(plan, y4.to(plan.out_dtype), s)
    if plan.dual:  # the float result, and the codes of that float as the next INT8 layers' operand
        y_hp = y4.to(plan.out_dtype)
        return int8_qtensor(quantize_int8_static(y_hp, fmt, s, backend=how).data, fmt, s, hp=y_hp)
    if plan.out_layout == "int8":  # the next INT8 layer's codes: one Triton pass on CUDA (torch elsewhere)
        if residual is not None:  # the codes of the sum in the network's dtype (the unfused graph quantizes that)
            y4 = y4.to(residual.dtype)
        return quantize_int8_static(y4, fmt, s, plan.pool, backend=how)
    if plan.finish == "pack":
        from ..kernels.triton import pack as tpack  # TRITON_INTERPRET is read at import

        if plan.pool is None:
            planes = tpack.quantize_pack(y4.reshape(-1, g.K), s, fmt.bits, *_qp_params(fmt))
        else:
            planes = tpack.pool_quantize_pack(y4, s, _FUSED_POOLS[tuple(plan.pool)], fmt.bits, *_qp_params(fmt))
        return _packed_result(planes, plan, out_scale, _pooled_shape(g, plan.pool))
    if plan.finish == "fp8":  # the next FP8 layer's codes: max-pool + quantize in one Triton pass
        from ..kernels.triton.fp8_quant import pool_quantize_fp8  # TRITON_INTERPRET is read at import

        f8 = pool_quantize_fp8(y4, s, _FUSED_POOLS.get(plan.pool, 0), _fp8_dtype(fmt))  # (N, P', Q', K)
        return QTensor(f8.view(torch.uint8), s.reshape(1, 1, 1, 1), fmt, PerTensor(), tuple(f8.shape), torch.float32)
    y = rq.pool_nhwc(y4, plan.pool)  # (N, P', Q', K)
    if isinstance(plan.out_fmt, FloatFormat):
        return quantize_fp8_static(y, out_scale, plan.out_fmt)  # (N, P', Q', K) float8 codes
    if plan.out_fmt is not None:
        return _packed_result(_requant_pack(y, plan.out_fmt, out_scale), plan, out_scale, y.shape)
    return y.to(plan.out_dtype)


def _with_planes(plan: ConvPlan, y_hp: torch.Tensor, s: torch.Tensor, planes: torch.Tensor | None = None
                 ) -> QTensor:
    """``out_layout="planes+float"``: the stored float output (N, P, Q, K) and the bit planes of it (given: written by
    stem_conv.cu's epilogue; else one quantize + pack pass over the float: Triton's on CUDA and under the interpreter
    for the INT8 kernel, compact rows; torch's elsewhere and on the reference backend)."""
    fmt = plan.out_fmt
    if planes is None and plan.backend != "reference" and plan.device.triton:
        from ..kernels.triton import pack as tpack  # TRITON_INTERPRET is read at import

        planes = tpack.quantize_pack(y_hp.reshape(-1, y_hp.shape[-1]), s, fmt.bits, *_qp_params(fmt), compact=True)
    elif planes is None:
        planes = _requant_pack(y_hp.to(torch.float32), fmt, s)
    return planes_qtensor(planes, fmt, s, tuple(y_hp.shape), hp=y_hp)


def _requant_pack(y: torch.Tensor, fmt: IntFormat, out_scale: torch.Tensor) -> torch.Tensor:
    """``rq.requant_codes`` packed by ``pack_bitplanes`` (the Triton kernel on CUDA): planes
    ``(bits, prod(...), packed_words(K))``, no host sync."""
    return pack_bitplanes(rq.requant_codes(y, fmt, out_scale), fmt.bits, validate=False)


def _pooled_shape(g: ConvGeometry, pool) -> tuple:
    """The NHWC shape after a fused max-pool (:data:`_FUSED_POOLS`: stride 2 floors the map, the size-keeping stride 1
    keeps it), or the conv's output shape without one."""
    if pool is not None and _FUSED_POOLS[tuple(pool)] == 2:
        return (g.N, g.P // 2, g.Q // 2, g.K)
    return (g.N, g.P, g.Q, g.K)


def _packed_result(planes, plan: ConvPlan, out_scale, shape) -> QTensor:
    """Planes (bits, ..., words) of an NHWC ``shape`` -> a BitPlanes QTensor (padded or compact rows, as written)."""
    N, P, Q, K = shape
    return planes_qtensor(planes.reshape(plan.out_fmt.bits, N * P * Q, planes.shape[-1]), plan.out_fmt, out_scale,
                          (N, P, Q, K))


def _prepare(x, w, *, stride=1, padding=0, dilation=1, bias=None, scale=None, act=None, out_dtype=torch.float32,
             out_fmt=None, out_scale=None, pool=None, backend="auto", fp8_fast_accum=True, out_layout="planes",
             residual=None, force_bitserial=False):
    """Validate the operands and plan: (x's record, w's QTensor, the ConvPlan)."""
    xs = _check_x(x)
    qw = w.qw if isinstance(w, PackedConvWeight) else _check_weight_qtensor(w)
    if qw.device != xs.device:
        raise ValueError(f"x is on {xs.device} but w is on {qw.device}; move both to one device")
    g = _geometry(xs, qw.shape, stride, padding, dilation)
    plan = plan_conv2d(g, xs.fmt, qw.fmt, device=device_caps(xs.device), input_layout=xs.layout,
                       act=_check_act(act), pool=_check_pool(pool), out_dtype=out_dtype, out_fmt=out_fmt,
                       out_scale_given=out_scale is not None, backend=backend, out_layout=out_layout,
                       has_residual=residual is not None, fast_accum=fp8_fast_accum, force_bitserial=force_bitserial,
                       has_scale=scale is not None)
    _check_residual(residual, g, out_dtype, xs.device)
    if out_dtype == torch.int32 and (scale is not None or bias is not None):
        raise ValueError("scale, bias, act and pool apply to the scaled float result; out_dtype=torch.int32 returns the "
                         "raw integer convolution, so pass a float out_dtype (or out_fmt) to use them")
    return xs, qw, plan


def _conv2d_impl(x, w, *, bias=None, scale=None, out_scale=None, residual=None, _gemm=None, **kw):
    """``conv2d`` with the test hook ``_gemm`` (a bit-serial GEMM stand-in: forces the bit-serial pipeline)."""
    xs, qw, plan = _prepare(x, w, bias=bias, scale=scale, out_scale=out_scale, residual=residual,
                            force_bitserial=_gemm is not None, **kw)
    return _run(plan, xs, qw, w, bias, scale, out_scale, residual, _gemm)


def run(plan: ConvPlan, x, w, *, bias=None, scale=None, out_scale=None, residual=None):
    """Run a :class:`ConvPlan` (from :func:`conv2d_plan`, or ``ops.qconv_plan.plan_conv2d``) on operands of the
    spec it was made for: ``conv2d(x, w, **kw)`` is ``run(conv2d_plan(x, w, **kw), x, w, bias=, scale=, out_scale=,
    residual=)``.  Raises ValueError if x or w is not what the plan was made for (format, shape, layout, device)."""
    if not isinstance(plan, ConvPlan):
        raise TypeError(f"plan must be a ConvPlan (conv2d_plan(x, w, ...)), got {type(plan).__name__}")
    if plan.route == WGMMA_GEMM and scale is not None:
        raise ValueError(f"the plan runs the {WGMMA_GEMM} route, whose epilogue has no per-channel scale; make the "
                         "plan with the scale (conv2d_plan(x, w, scale=...)): it then takes the Triton kernel")
    xs = _check_x(x)
    qw = w.qw if isinstance(w, PackedConvWeight) else _check_weight_qtensor(w)
    g = plan.geometry
    have = (xs.fmt, tuple(xs.shape), xs.layout, xs.device, qw.fmt, tuple(qw.shape))
    want = (plan.a_fmt, (g.N, g.H, g.W, g.C), plan.input_layout, plan.device.device, plan.w_fmt, (g.K, g.R, g.S, g.C))
    if have != want or qw.device != xs.device:
        raise ValueError(f"the plan was made for x {want[0]} {want[1]} as {want[2]!r} on {want[3]} and w {want[4]} "
                         f"{want[5]}, got x {have[0]} {have[1]} as {have[2]!r} on {have[3]} and w {have[4]} {have[5]} "
                         f"on {qw.device}; make a plan for these operands (conv2d_plan(x, w, ...))")
    if (residual is not None) != plan.has_residual or (out_scale is not None) != (plan.out_fmt is not None):
        raise ValueError(f"the plan was made with residual={'a tensor' if plan.has_residual else None} and "
                         f"out_fmt={plan.out_fmt}; pass residual= and out_scale= to match, or make a new plan")
    _check_residual(residual, g, plan.out_dtype, xs.device)
    return _run(plan, xs, qw, w, bias, scale, out_scale, residual, None)


def _run(plan: ConvPlan, xs: _X, qw: QTensor, w, bias, scale, out_scale, residual, _gemm):
    """Execute ``plan``: one backend's kernels, then the pass ``plan.after`` names (module docstring of
    ``ops/qconv_plan.py``)."""
    g, out_dtype = plan.geometry, plan.out_dtype
    if residual is not None:
        residual = residual.contiguous()  # (N, P, Q, K); a no-op for the NHWC view of a channels_last tensor
    K = g.K
    pw = w if isinstance(w, PackedConvWeight) else None
    w_scale = pw.w_scale if pw is not None else qw.scale.reshape(-1).expand(K).to(torch.float32)
    scale = _check_vec(scale, K, "scale", xs.device)
    bias = _check_vec(bias, K, "bias", xs.device)
    s_out = _scale_tensor(out_scale, xs.device, "out_scale") if plan.out_fmt is not None else None
    if plan.route == WGMMA_GEMM:  # (its epilogue multiplies x_scale * w_scale[k] itself)
        return _wgmma_gemm(plan, xs, pw if pw is not None else pack_conv_weight(qw), bias, s_out, residual)
    col = _col_scale(xs, w_scale, scale) if out_dtype != torch.int32 or plan.out_fmt is not None else None

    if plan.backend == "bitserial":
        short_rows = None
        if _gemm is None:
            from ..kernels.cuda import bmma_gemm as bg  # (registers torch.ops.tcprec.bmma_gemm)

            short_rows = bg.short_rows_ok

            # pdl=False: the GEMM follows its own im2col / quantize pass, which never triggers a programmatic launch,
            # and with it whole networks ran 1-1.5% slower (measured: bmma_gemm.launch_bmma)
            _gemm = functools.partial(bg.gemm_entry(), pdl=False)
        pw = pw if pw is not None else pack_conv_weight(qw)
        res = _bitserial(plan, xs, pw, col, bias, s_out, _gemm, residual, short_rows)
        if plan.dual:  # the float output and its compact planes
            y, planes = res
            return planes_qtensor(planes, plan.out_fmt, s_out, (g.N, g.P, g.Q, K), hp=y.reshape(g.N, g.P, g.Q, K))
        kind = plan.epilogue
        if kind == "int32":
            return res.reshape(g.N, g.P, g.Q, K)
        if plan.after == "pool_planes":  # max-pool on the codes (plan.pool_codes)
            st, full = _FUSED_POOLS[tuple(plan.pool)], (g.N, g.P, g.Q, K)
            if plan.device.triton:
                from ..kernels.triton import pack as tpack  # TRITON_INTERPRET is read at import

                res = tpack.pool_planes(res, full, st, plan.out_fmt.bits, plan.out_fmt.encoding == "twos")
            else:
                res = rq.pool_planes(res, full, plan.pool, plan.out_fmt)
            return _packed_result(res, plan, s_out, _pooled_shape(g, plan.pool))
        if kind == "packed":
            return _packed_result(res, plan, s_out, (g.N, g.P, g.Q, K))
        if plan.after == "pool_float":
            return _pool_float(plan, res)
        if plan.after == "finish":
            return _finish_float(plan, res, s_out, act_done=True)
        return res.reshape(g.N, g.P, g.Q, K)

    if plan.backend == "fp8" or (plan.backend == "int8" and plan.route == "kernel"):
        pw = pw if pw is not None else pack_conv_weight(qw)
        if plan.backend == "fp8":
            y = _fp8_kernel(plan, xs, pw, col, bias, plan.fast_accum, s_out, residual)
        else:
            y = _int8_kernel(plan, xs, pw, col, bias, s_out, residual)  # (N, P, Q, K)
        if plan.out_layout == "planes+float":  # stem_conv's (float, planes), or the float for one pack pass
            y, planes = y if isinstance(y, tuple) else (y, None)
            return _with_planes(plan, y, s_out.reshape(1), planes)
        kind = plan.epilogue
        if kind == "planes":  # (bits, N*P'*Q', Kw): pooled in the epilogue when plan.pool
            return _packed_result(y, plan, s_out, _pooled_shape(g, plan.pool))
        if kind == "int8":
            return int8_qtensor(y, plan.out_fmt, s_out)
        if kind in _FP8_KIND.values():  # (N, P, Q, K) float8 from the epilogue: quantize_fp8_static's QTensor
            return QTensor(y.view(torch.uint8), s_out.reshape(1, 1, 1, 1), plan.out_fmt, PerTensor(), tuple(y.shape),
                           torch.float32)
        if kind == "dual" and isinstance(plan.out_fmt, FloatFormat):  # (N, P, Q, K) float and float8
            return QTensor(y[1].view(torch.uint8), s_out.reshape(1, 1, 1, 1), plan.out_fmt, PerTensor(),
                           tuple(y[1].shape), torch.float32, hp=y[0])
        if kind == "dual":
            return int8_qtensor(y[1], plan.out_fmt, s_out, hp=y[0])
        if plan.after == "pool_float":
            return _pool_float(plan, y)
        if plan.after == "finish":
            return _finish_float(plan, y.reshape(-1, K), s_out, act_done=True)
        return y

    if plan.backend == "reference" and _fp8_dtype(plan.a_fmt) is not None:
        y = rg.float_epilogue(_fp8_reference(plan, xs, qw), None, col, bias, False, torch.float32)
        return _finish_float(plan, y, s_out, act_done=False, residual=residual)
    C = _int_product(plan, xs, qw)  # (M, K)
    if plan.out_dtype == torch.int32 and plan.out_fmt is None:
        return C.to(torch.int32).reshape(g.N, g.P, g.Q, K)
    y = rg.float_epilogue(C, None, col, bias, False, torch.float32)  # (M, K) float32
    return _finish_float(plan, y, s_out, act_done=False, residual=residual)


# ------------------------------------------------------------------------------------------------
# Public operators
# ------------------------------------------------------------------------------------------------


def conv2d(x, w, *, stride=1, padding=0, dilation=1, bias=None, scale=None, act=None, out_dtype=torch.float32,
           out_fmt=None, out_scale=None, pool=None, backend="auto", fp8_fast_accum=True, out_layout="planes",
           residual=None):
    """Quantized 2-D convolution, NHWC, integer part exact (module docstring for the full contract).

    x: ``QTensor`` ``(N, H, W, C)`` (PerTensor scale) of an integer format in the ``Dense()``, ``BitPlanes()`` or
    ``ShiftedInt8()`` layout; or a float8 ``QTensor`` (``e4m3`` / ``e5m2``, e.g. from :func:`quantize_fp8_static`).
    w: ``QTensor`` codes ``(K, R, S, C)`` (PerTensor / PerChannel(0)) or :class:`PackedConvWeight`.
    Returns float NHWC ``(N, P, Q, K)`` in ``out_dtype``; int32 raw ``C`` for ``out_dtype=torch.int32``;
    a ``BitPlanes`` QTensor of ``out_fmt`` when ``out_fmt`` (and ``out_scale``) are given, or a
    float8 ``QTensor`` (N, P, Q, K) when ``out_fmt`` is e4m3 / e5m2 (the next FP8 layer's input).
    ``out_layout="compact"``: the bit-serial epilogue writes those planes without their padding words (rows of
    ceil(K / 32) words, what a next conv that gathers windows reads; 64 channels: 2 words a row stored, not 16);
    planes another pass writes (an avg-pool) stay padded -- either is a valid input.
    ``out_layout="int8"`` (integer ``out_fmt``): a ``ShiftedInt8()`` QTensor instead of bit planes, the next
    INT8 layer's operand -- written by the INT8 / FP8 kernel's epilogue itself when there is no pooling,
    else by one Triton pass (max-pool + re-quantize) after it.  ``out_layout="int8+float"``: that
    QTensor with ``hp`` = the float result in ``out_dtype`` (its codes are that float's).
    ``out_layout="fp8+float"`` (e4m3 / e5m2 ``out_fmt``, INT8 / FP8 kernels or reference): an
    float8 QTensor with ``hp``: the next FP8 layers' codes and the float result they come from, from one epilogue.
    ``out_layout="planes+float"`` (integer ``out_fmt``; bit-serial, INT8 or reference): a ``BitPlanes`` QTensor
    with ``hp``, the float result and the next bit-serial layers' planes of it -- from one epilogue on the bit-serial
    GEMM and on a thin INT8 stem on sm_90 (kernels/cuda/stem_conv.cu), else the float and one quantize-pack pass.

    ``act``: None, "relu", ("leaky", slope); on the INT8 / FP8 / reference backends also ("clamp", lo, hi) (ReLU6:
    ("clamp", 0.0, 6.0)), "hardswish" and "silu" (module docstring).

    ``residual``: float NHWC ``(N, P, Q, K)`` in ``out_dtype`` on x's device, added before ``act`` as the
    unfused ``act(conv(...) + residual)`` adds it (module docstring): a ResNet block's last conv, its shortcut
    add and ReLU in one kernel on the INT8 / FP8 / bit-serial backends (torch ops on ``reference``).

    ``fp8_fast_accum`` (float8 operands on the GPU): True keeps Hopper's narrow fp8 accumulator for the
    whole reduction; False promotes it into fp32 every BLOCK_K products (as cuBLAS does by default).
    True is the default for inference: on the H200 it ran the networks' layers at 0.95x cuDNN fp16
    (geomean, batch 256) against 0.71x promoted (benchmarks/results/conv_fwd.json), and the extra
    accumulation error stays far below e4m3's own rounding (2^-4 relative per operand).

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import conv2d
    >>> qx = tp.quantize(torch.ones(1, 3, 3, 2), "uint2", scale=1.0)
    >>> qw = tp.quantize(torch.ones(1, 3, 3, 2), "binary", scale=1.0)
    >>> conv2d(qx, qw, padding=1, out_dtype=torch.int32)[0, :, :, 0].tolist()
    [[8, 12, 8], [12, 18, 12], [8, 12, 8]]
    >>> conv2d(qx, qw, padding=1, act="relu", residual=torch.full((1, 3, 3, 1), -10.0))[0, :, :, 0].tolist()
    [[0.0, 2.0, 0.0], [2.0, 8.0, 2.0], [0.0, 2.0, 0.0]]
    """
    return _conv2d_impl(x, w, stride=stride, padding=padding, dilation=dilation, bias=bias, scale=scale, act=act,
                        out_dtype=out_dtype, out_fmt=out_fmt, out_scale=out_scale, pool=pool, backend=backend,
                        fp8_fast_accum=fp8_fast_accum, out_layout=out_layout, residual=residual)


def conv2d_plan(x, w, **kw) -> ConvPlan:
    """The :class:`~tcprec.ops.qconv_plan.ConvPlan` ``conv2d(x, w, **kw)`` runs: backend and why, route, stem,
    epilogue, the passes after it -- decided once, from the operands' specs and their device.

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import conv2d_plan
    >>> qx = tp.quantize(torch.rand(1, 5, 5, 3), "uint2"); qw = tp.quantize(torch.randn(4, 3, 3, 3), "binary")
    >>> conv2d_plan(qx, qw, padding=1).backend
    'reference'
    """
    return _prepare(x, w, **kw)[2]


def choose_conv2d_backend(x, w, backend: str = "auto", **kw) -> tuple[str, str]:
    """(backend, reason) for ``conv2d(x, w, **kw)``."""
    plan = conv2d_plan(x, w, backend=backend, **kw)
    return plan.backend, plan.reason


def explain_conv2d(x, w, **kw) -> str:
    """Which backend ``conv2d(x, w, **kw)`` runs, why, and which passes it launches.

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import explain_conv2d
    >>> qx = tp.quantize(torch.rand(1, 5, 5, 3), "uint2"); qw = tp.quantize(torch.randn(4, 3, 3, 3), "binary")
    >>> explain_conv2d(qx, qw, padding=1).split(":")[0]
    'reference'
    """
    return format_plan(conv2d_plan(x, w, **kw))
