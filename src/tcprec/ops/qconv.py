"""Quantized forward convolution at arbitrary integer precision: validate -> choose a backend (with a
stated reason) -> launch.

``conv2d(x, w)`` convolves NHWC activations of a p-bit integer format with KRSC weights of a q-bit
integer format (1..8 bits each; two's complement, unsigned or pm1), any kernel size, stride,
padding (zeros) and dilation.  The integer part is exact on every backend; then one epilogue::

    C[n, p, q, k] = sum_{r,s,c} decode(x)[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * decode(w)[k, r, s, c]
    col[k]  = (x_scale * w_scale[k]) * scale[k]            float32 (scale: folded batch-norm, optional)
    y       = act(float32(C) * col[k] + bias[k])             act: None | "relu" | ("leaky", slope)
    y       = pool(y)                                        None | ("max", 2, 2) | ("avg", 2, 2) | ("max", 2, 1)

and the result is ``y`` in ``out_dtype``, the raw ``C`` (``out_dtype=torch.int32``, nothing else
allowed), or -- with ``out_fmt`` -- ``y / out_scale`` rounded to ``out_fmt`` and packed into bit planes
as a :class:`PackedActivation`, the next layer's input, so layers chain without a float tensor.

Activations come as a ``QTensor`` of codes ``(N, H, W, C)`` with one scale (``PerTensor``), or as a
:class:`PackedActivation` (planes ``(bits, N*H*W, packed_words(C))``, what ``matmul_packed`` and this
op return).  Weights come as a ``QTensor`` of codes ``(K, R, S, C)`` (``PerTensor`` or
``PerChannel(0)``) or pre-packed once with :func:`pack_conv_weight`.

Backends (one rule with ``tcprec.matmul``: bit-serial while p*q < 8, INT8 otherwise)

* ``"bitserial"``: an im2col over the *packed* planes (``kernels/triton/im2col_bits.py``, a word
  gather: each output pixel's row gets, per tap (r, s), the ceil(C/32) meaningful words of its input
  pixel, zeros in the padding) that also computes the pm1 row correction, then the binary
  tensor-core GEMM (``torch.ops.tcprec.bmma_gemm``) with the true K = R*S*C in its corrections and
  its fused epilogue (scale, bias, ReLU / LeakyReLU, the output dtype or the packed next-layer
  planes).  A 1x1 stride-1 unpadded convolution needs no im2col: the input planes are the operand.
  Pooling is a separate float32 pass after the GEMM (then the cast or the re-quantize + pack pass);
  ``explain_conv2d`` says which passes run.
* ``"int8"``: im2col on the codes + ``torch._int_mm`` through matmul's INT8 path (exact).
* ``"reference"``: ``F.conv2d`` on the decoded codes in float64 (exact), any device; the default
  off CUDA and the ground truth of the tests.

pm1 activations (``binary``, ``pmN``) have no zero, so they cannot stand for the zeros of spatial
padding: the bit-serial kernel's pm1 correction assumes every one of the K terms is present.
``padding > 0`` with pm1 activations raises (use unsigned / two's complement activations, e.g. after
a ReLU ``uint2``); pm1 *weights* are fine with any padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats import IntFormat, as_format
from ..kernels import reference_gemm as rg
from ..kernels import reference_qconv as rq
from ..kernels.reference_conv import ConvGeometry, pair
from ..packing import pack_bitplanes, packed_words, unpack_bitplanes
from ..qtensor import PerChannel, PerTensor, QTensor
from .matmul import BACKENDS, choose_int_backend

__all__ = [
    "PackedActivation",
    "PackedConvWeight",
    "pack_activation",
    "pack_conv_weight",
    "conv2d",
    "explain_conv2d",
    "choose_conv2d_backend",
    "POOLS",
    "BACKENDS",
]

POOLS = (None, ("max", 2, 2), ("avg", 2, 2), ("max", 2, 1))
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
_KIND = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_INT32_LIMIT = 1 << 31


# ------------------------------------------------------------------------------------------------
# Operand records
# ------------------------------------------------------------------------------------------------


def _scale_tensor(scale, device, what: str) -> torch.Tensor:
    """A per-tensor scale as float32 (1,) on ``device``; checked for finite > 0 unless capturing."""
    def bad():  # built only on failure: printing a CUDA tensor syncs, which a graph capture forbids
        return ValueError(f"{what} must be one finite positive number (a float or a one-element tensor), got {scale!r}")

    if isinstance(scale, torch.Tensor):
        s = scale.to(device=device, dtype=torch.float32).reshape(-1)
        if s.numel() != 1:
            raise bad()
        if not (s.is_cuda and torch.cuda.is_current_stream_capturing()):  # no sync inside a graph capture
            if not bool(torch.isfinite(s).all() and (s > 0).all()):
                raise bad()
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
            LSB-first (``tcprec.packing``); the bits past C must be zero (packing guarantees it).
    fmt     the integer format of the codes; scale float32 ``(1,)`` (per tensor); shape ``(N, H, W, C)``.

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
        if tuple(self.planes.shape) != want:
            raise ValueError(f"planes of a {fmt} activation of shape {shape} must be (bits, N*H*W, packed_words(C)) "
                             f"= {want}, got {tuple(self.planes.shape)}")
        object.__setattr__(self, "scale", _scale_tensor(self.scale, self.planes.device, "scale"))

    @property
    def device(self) -> torch.device:
        return self.planes.device

    def codes(self) -> torch.Tensor:
        """The codes, uint8 ``(N, H, W, C)``."""
        return unpack_bitplanes(self.planes, self.fmt.bits, self.shape[3]).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float NHWC ``(N, H, W, C)``: ``decode(codes) * scale``."""
        from .cast import decode

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
    from .quantize import quantize

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
class PackedConvWeight:
    """A KRSC integer weight packed once (BitBLAS's transform_weight): ``qw`` the QTensor ``(K, R, S, C)``,
    ``planes`` int32 ``(q, K, Kw_col)`` in the im2col word layout (each tap padded to a whole number of
    words), ``w_scale`` float32 ``(K,)``, ``rowsum`` int32 ``(K,)`` = sum of the weighted codes of each
    filter (the correction term when the activations are pm1)."""

    qw: QTensor
    planes: torch.Tensor
    w_scale: torch.Tensor
    rowsum: torch.Tensor

    @property
    def shape(self) -> tuple:
        return self.qw.shape

    @property
    def fmt(self) -> IntFormat:
        return self.qw.fmt

    @property
    def device(self) -> torch.device:
        return self.qw.device


def _check_weight_qtensor(w) -> QTensor:
    if not isinstance(w, QTensor):
        raise TypeError(f"w must be a QTensor of codes (K, R, S, C) (tcprec.quantize(w_krsc, 'binary', PerChannel(0))) "
                        f"or a PackedConvWeight, got {type(w).__name__}")
    if not isinstance(w.fmt, IntFormat):
        raise TypeError(f"w must be of an integer format (binary, intN, uintN, pmN), got {w.fmt}; quantize it to one")
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
    planes = rq.pack_weight_planes(w.codes, w.fmt.bits)  # (q, K, Kw_col)
    w_scale = w.scale.reshape(-1).expand(K).to(torch.float32).contiguous()  # (K,)
    rowsum = rg.weighted_rowsums(planes, w.fmt).to(torch.int32)  # (K,): the pm1-activation correction (cheap)
    return PackedConvWeight(w, planes, w_scale, rowsum)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _X:
    fmt: IntFormat
    scale: torch.Tensor  # (1,) float32
    shape: tuple  # (N, H, W, C)
    device: torch.device
    qt: QTensor | None
    packed: PackedActivation | None

    def codes(self) -> torch.Tensor:  # (N, H, W, C) uint8
        return self.qt.codes if self.qt is not None else self.packed.codes()

    def planes(self) -> torch.Tensor:  # (bits, N*H*W, Kw)
        if self.packed is not None:
            return self.packed.planes
        N, H, W, C = self.shape
        return pack_bitplanes(self.qt.codes.reshape(N * H * W, C), self.fmt.bits, validate=False)


def _check_x(x) -> _X:
    if isinstance(x, PackedActivation):
        return _X(x.fmt, x.scale, x.shape, x.device, None, x)
    if not isinstance(x, QTensor):
        raise TypeError(f"x must be a QTensor of NHWC codes (tcprec.quantize(x_nhwc, 'uint2')) or a PackedActivation, "
                        f"got {type(x).__name__}")
    if not isinstance(x.fmt, IntFormat):
        raise TypeError(f"x must be of an integer format (uintN, intN, binary, pmN), got {x.fmt}; quantize it to one")
    if x.ndim != 4:
        raise ValueError(f"x must be NHWC (N, H, W, C), got shape {x.shape}; an NCHW tensor is x.permute(0, 2, 3, 1)")
    if not isinstance(x.granularity, PerTensor):
        raise ValueError(f"x's scale is {x.granularity}: conv2d needs one activation scale (PerTensor()); "
                         "requantize x with tcprec.quantize(x, fmt, tcprec.PerTensor())")
    return _X(x.fmt, x.scale.reshape(1), x.shape, x.device, x, None)


def _check_act(act):
    if act is None or act == "relu":
        return act
    if isinstance(act, tuple) and len(act) == 2 and act[0] == "leaky":
        try:
            slope = float(act[1])
        except (TypeError, ValueError):
            slope = float("nan")
        if math.isfinite(slope):
            return ("leaky", slope)
    raise ValueError(f"act must be None, 'relu' or ('leaky', slope), got act={act!r}; e.g. act=('leaky', 0.1)")


def _check_pool(pool):
    if isinstance(pool, list):
        pool = tuple(pool)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS} ((kind, kernel, stride)), got pool={pool!r}")
    return pool


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


@dataclass(frozen=True)
class _Plan:
    name: str
    why: str
    g: ConvGeometry
    fa: IntFormat
    fw: IntFormat
    act: object
    pool: object
    out_dtype: torch.dtype
    out_fmt: IntFormat | None

    @property
    def fused(self) -> bool:
        """Whether the bit-serial kernel's epilogue does everything (it has scale, bias, ReLU /
        LeakyReLU and the output dtype or packed planes; pooling is a separate pass)."""
        return self.pool is None


def _plan(x, w, stride, padding, dilation, act, out_dtype, out_fmt, pool, backend, scale, bias, out_scale,
          force_bitserial=False):
    xs = _check_x(x)
    if isinstance(w, PackedConvWeight):
        qw = w.qw
    else:
        qw = _check_weight_qtensor(w)
    if qw.device != xs.device:
        raise ValueError(f"x is on {xs.device} but w is on {qw.device}; move both to one device")
    g = _geometry(xs, qw.shape, stride, padding, dilation)
    fa, fw = xs.fmt, qw.fmt
    if fa.encoding == "pm1" and max(g.padding) > 0:
        raise ValueError(
            f"x is {fa} (pm1: values +-1, +-3, ...; no zero) but padding={g.padding}: spatial padding adds zeros, which "
            "a pm1 code cannot hold, and the bit-serial kernel's pm1 correction counts every one of the K terms. Use "
            "unsigned or two's complement activations (e.g. 'uint2' after a ReLU, 'int2'), or padding=0"
        )
    act, pool = _check_act(act), _check_pool(pool)
    if out_fmt is not None:
        out_fmt = as_format(out_fmt)
        if not isinstance(out_fmt, IntFormat):
            raise TypeError(f"out_fmt must be an integer format (the next layer's activations), got {out_fmt}")
        if out_scale is None:
            raise ValueError("out_fmt needs out_scale (one positive float: the next layer's activation scale)")
        if out_dtype == torch.int32:
            raise ValueError("out_fmt re-quantizes the float result; leave out_dtype at its default with out_fmt")
    elif out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    if out_dtype == torch.int32 and (scale is not None or bias is not None or act is not None or pool is not None):
        raise ValueError("scale, bias, act and pool apply to the scaled float result; out_dtype=torch.int32 returns the "
                         "raw integer convolution, so pass a float out_dtype (or out_fmt) to use them")
    K_true = g.R * g.S * g.C
    bound = K_true * max(abs(fa.min), abs(fa.max)) * max(abs(fw.min), abs(fw.max))
    if bound >= _INT32_LIMIT:
        raise ValueError(f"R*S*C = {K_true} with {fa} x {fw} can reach |C| = {bound} >= 2^31, beyond the int32 "
                         "accumulator; split the input channels and add the partial results in float")
    if force_bitserial:
        name, why = "bitserial", "forced (test hook: emulated GEMM)"
    else:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
        name, why = choose_int_backend(fa, fw, xs.device, backend)
        if name == "reference":
            why = why.replace("pure-torch bit-serial reference", "float64 F.conv2d on the decoded codes")
    return xs, qw, g, _Plan(name, why, g, fa, fw, act, pool, out_dtype, out_fmt)


# ------------------------------------------------------------------------------------------------
# Backends
# ------------------------------------------------------------------------------------------------


def _col_scale(xs: _X, w_scale: torch.Tensor, scale) -> torch.Tensor:
    col = xs.scale * w_scale  # (K,) float32: x_scale * w_scale[k]
    if scale is not None:
        col = col * scale
    return col.contiguous()


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


def _int_product(plan: _Plan, xs: _X, qw: QTensor) -> torch.Tensor:
    """int32/int64 C (M, K) on the int8 or reference backend."""
    g = plan.g
    if plan.name == "reference":
        return rq.conv2d_int(xs.codes(), plan.fa, qw.codes, plan.fw, g).reshape(-1, g.K)
    from .matmul import matmul

    cols = _im2col_codes(xs.codes(), g)  # (M, RSC) uint8
    M, Kt = cols.shape
    one = torch.ones((1, 1), dtype=torch.float32, device=cols.device)
    qa = QTensor(cols, one, plan.fa, PerTensor(), (M, Kt), torch.float32)
    qwm = QTensor(qw.codes.reshape(g.K, Kt), one, plan.fw, PerTensor(), (g.K, Kt), torch.float32)
    return matmul(qa, qwm, out_dtype=torch.int32, backend="int8")  # (M, K) exact


def _bitserial(plan: _Plan, xs: _X, pw: PackedConvWeight, col, bias, out_scale, gemm):
    """The binary tensor-core pipeline: (im2col over planes) -> bmma_gemm with the fused epilogue.
    Returns (M, K) int32 / float, or planes, per ``_bitserial_kind``."""
    from ..kernels.triton.im2col_bits import im2col_bits  # TRITON_INTERPRET is read at import

    g, fa, fw = plan.g, plan.fa, plan.fw
    oa, sa = rg.affine(fa)
    ow, sw = rg.affine(fw)
    K_true = g.R * g.S * g.C
    planes = xs.planes()  # (p, N*H*W, packed_words(C))
    need_row = ow != 0
    if g.is_pointwise:
        a_planes = planes  # the input planes are the GEMM operand (Kw_col = packed_words(C))
        _, row_term = im2col_bits(planes, g, twos=fa.encoding == "twos", store=False, rowsum=need_row,
                                  row_mul=sa * ow, row_add=K_true * oa * ow)
    else:
        a_planes, row_term = im2col_bits(planes, g, twos=fa.encoding == "twos", store=True, rowsum=need_row,
                                         row_mul=sa * ow, row_add=K_true * oa * ow)  # (p, M, Kw_col), (M,)
    col_term = (oa * sw * pw.rowsum).contiguous() if oa != 0 else None  # (K,) int32
    kind, relu, slope, ofmt = _bitserial_kind(plan)
    return gemm(a_planes, pw.planes, fa.encoding == "twos", fw.encoding == "twos", sa * sw, row_term, col_term,
                None, col if kind != "int32" else None, bias if kind != "int32" else None, relu, kind,
                ofmt.bits if ofmt is not None else 1, ofmt.encoding if ofmt is not None else "unsigned",
                out_scale if kind == "packed" else None, "", slope)


def _bitserial_kind(plan: _Plan):
    """(out_kind, relu, leaky slope, packed format) of the GEMM call: the kernel's epilogue applies
    the activation always, and writes the final dtype / packed planes unless a pooling pass follows."""
    if plan.out_dtype == torch.int32 and plan.out_fmt is None:
        return "int32", False, 0.0, None
    relu = plan.act is not None
    slope = plan.act[1] if isinstance(plan.act, tuple) else 0.0
    if not plan.fused:
        return "float32", relu, slope, None
    if plan.out_fmt is not None:
        return "packed", relu, slope, plan.out_fmt
    return _KIND[plan.out_dtype], relu, slope, None


def _finish_float(plan: _Plan, y: torch.Tensor, out_scale, act_done: bool):
    """float32 y (M, K) -> act (unless done) -> pool -> out dtype or packed."""
    g = plan.g
    if not act_done:
        y = rq.apply_act(y, plan.act)
    y = rq.pool_nhwc(y.reshape(g.N, g.P, g.Q, g.K), plan.pool)  # (N, P', Q', K)
    if plan.out_fmt is not None:
        return _packed_result(rq.requant_pack(y, plan.out_fmt, out_scale), plan, out_scale, y.shape)
    return y.to(plan.out_dtype)


def _packed_result(planes, plan: _Plan, out_scale, shape) -> PackedActivation:
    N, P, Q, K = shape
    return PackedActivation(planes.reshape(plan.out_fmt.bits, N * P * Q, packed_words(K)), plan.out_fmt, out_scale,
                            (N, P, Q, K))


def _conv2d_impl(x, w, *, stride=1, padding=0, dilation=1, bias=None, scale=None, act=None, out_dtype=torch.float32,
                 out_fmt=None, out_scale=None, pool=None, backend="auto", _gemm=None):
    xs, qw, g, plan = _plan(x, w, stride, padding, dilation, act, out_dtype, out_fmt, pool, backend, scale, bias,
                            out_scale, force_bitserial=_gemm is not None)
    K = g.K
    pw = w if isinstance(w, PackedConvWeight) else None
    w_scale = pw.w_scale if pw is not None else qw.scale.reshape(-1).expand(K).to(torch.float32)
    scale = _check_vec(scale, K, "scale", xs.device)
    bias = _check_vec(bias, K, "bias", xs.device)
    s_out = _scale_tensor(out_scale, xs.device, "out_scale") if plan.out_fmt is not None else None
    col = _col_scale(xs, w_scale, scale) if out_dtype != torch.int32 or plan.out_fmt is not None else None

    if plan.name == "bitserial":
        if _gemm is None:
            from ..kernels.cuda import loader  # noqa: F401  (registers torch.ops.tcprec.bmma_gemm)

            _gemm = torch.ops.tcprec.bmma_gemm
        pw = pw if pw is not None else pack_conv_weight(qw)
        res = _bitserial(plan, xs, pw, col, bias, s_out, _gemm)
        kind = _bitserial_kind(plan)[0]
        if kind == "int32":
            return res.reshape(g.N, g.P, g.Q, K)
        if kind == "packed":
            return _packed_result(res, plan, s_out, (g.N, g.P, g.Q, K))
        if plan.fused:
            return res.reshape(g.N, g.P, g.Q, K)
        return _finish_float(plan, res, s_out, act_done=True)

    C = _int_product(plan, xs, qw)  # (M, K)
    if plan.out_dtype == torch.int32 and plan.out_fmt is None:
        return C.to(torch.int32).reshape(g.N, g.P, g.Q, K)
    y = rg.float_epilogue(C, None, col, bias, False, torch.float32)  # (M, K) float32
    return _finish_float(plan, y, s_out, act_done=False)


# ------------------------------------------------------------------------------------------------
# Public operators
# ------------------------------------------------------------------------------------------------


def conv2d(x, w, *, stride=1, padding=0, dilation=1, bias=None, scale=None, act=None, out_dtype=torch.float32,
           out_fmt=None, out_scale=None, pool=None, backend="auto"):
    """Quantized 2-D convolution, NHWC, integer part exact (module docstring for the full contract).

    x: ``QTensor`` codes ``(N, H, W, C)`` (PerTensor scale) or :class:`PackedActivation`.
    w: ``QTensor`` codes ``(K, R, S, C)`` (PerTensor / PerChannel(0)) or :class:`PackedConvWeight`.
    Returns float NHWC ``(N, P, Q, K)`` in ``out_dtype``; int32 raw ``C`` for ``out_dtype=torch.int32``;
    a :class:`PackedActivation` of ``out_fmt`` when ``out_fmt`` (and ``out_scale``) are given.

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import conv2d
    >>> qx = tp.quantize(torch.ones(1, 3, 3, 2), "uint2", scale=1.0)
    >>> qw = tp.quantize(torch.ones(1, 3, 3, 2), "binary", scale=1.0)
    >>> conv2d(qx, qw, padding=1, out_dtype=torch.int32)[0, :, :, 0].tolist()
    [[8, 12, 8], [12, 18, 12], [8, 12, 8]]
    """
    return _conv2d_impl(x, w, stride=stride, padding=padding, dilation=dilation, bias=bias, scale=scale, act=act,
                        out_dtype=out_dtype, out_fmt=out_fmt, out_scale=out_scale, pool=pool, backend=backend)


def choose_conv2d_backend(x, w, backend: str = "auto", **kw) -> tuple[str, str]:
    """(backend, reason) for ``conv2d(x, w, **kw)``."""
    _, _, _, plan = _plan(x, w, kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1), kw.get("act"),
                          kw.get("out_dtype", torch.float32), kw.get("out_fmt"), kw.get("pool"), backend,
                          kw.get("scale"), kw.get("bias"), kw.get("out_scale"))
    return plan.name, plan.why


def explain_conv2d(x, w, **kw) -> str:
    """Which backend ``conv2d(x, w, **kw)`` runs, why, and which passes it launches.

    >>> import torch, tcprec as tp
    >>> from tcprec.ops.qconv import explain_conv2d
    >>> qx = tp.quantize(torch.rand(1, 5, 5, 3), "uint2"); qw = tp.quantize(torch.randn(4, 3, 3, 3), "binary")
    >>> explain_conv2d(qx, qw, padding=1).split(":")[0]
    'reference'
    """
    _, _, g, plan = _plan(x, w, kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1), kw.get("act"),
                          kw.get("out_dtype", torch.float32), kw.get("out_fmt"), kw.get("pool"),
                          kw.get("backend", "auto"), kw.get("scale"), kw.get("bias"), kw.get("out_scale"))
    M, Kt = g.N * g.P * g.Q, g.R * g.S * g.C
    head = (f"{plan.name}: {plan.why}; conv {g.N}x{g.H}x{g.W}x{g.C} * {g.K}x{g.R}x{g.S}x{g.C}, stride {g.stride}, "
            f"padding {g.padding}, dilation {g.dilation} -> {g.N}x{g.P}x{g.Q}x{g.K}; GEMM M={M} N={g.K} K={Kt}")
    out = ("int32" if plan.out_dtype == torch.int32 and plan.out_fmt is None else
           f"packed {plan.out_fmt} planes" if plan.out_fmt is not None else str(plan.out_dtype).removeprefix("torch."))
    if plan.name == "bitserial":
        Cw = -(-g.C // 32)
        steps = ["no im2col (1x1 stride 1: the input planes are the operand)" if g.is_pointwise else
                 f"Triton im2col over packed planes ({g.R * g.S} taps x {Cw} words a pixel, "
                 f"{rq.taps_words(g)[2]} words a row, {plan.fa.bits} planes)"]
        kind, relu, slope, _ = _bitserial_kind(plan)
        act = [f"LeakyReLU({slope})" if slope else "ReLU"] if relu else []
        fused = ["scale", "bias"] + act + ([out] if plan.fused else ["float32"])
        steps.append(f"bmma_gemm with fused epilogue ({', '.join(fused if kind != 'int32' else ['int32'])})")
        if not plan.fused:
            if plan.pool is not None:
                steps.append(f"separate pass: {plan.pool[0]}-pool {plan.pool[1]}x{plan.pool[1]} stride {plan.pool[2]} "
                             "(torch, float32)")
            steps.append(f"separate pass: {'re-quantize + pack' if plan.out_fmt is not None else 'cast to ' + out}")
    else:
        steps = [("float64 F.conv2d on decoded codes" if plan.name == "reference" else
                  "im2col on codes (torch gather) + torch._int_mm (INT8 tensor cores)"),
                 f"epilogue in torch (scale, bias, act={plan.act}, pool={plan.pool}) -> {out}"]
    return head + "; passes: " + " -> ".join(steps)
