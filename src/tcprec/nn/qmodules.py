"""Quantized inference modules: ``QConv2d`` and ``QLinear``.

Each holds its weight already quantized (and, for the bit-serial backend, already packed into bit
planes: ``ops.qconv.pack_conv_weight``), a calibrated per-tensor activation scale, and the float
epilogue folded from the layers it absorbed (batch-norm -> per-channel scale and bias, ReLU /
LeakyReLU, 2x2 pooling).  Float tensors in, float tensors out (NCHW, channels_last memory), so a
module drops into any network; when ``quantize_model`` finds that a conv feeds only another
quantized conv, it sets ``out_fmt`` / ``out_scale`` and the pair exchanges packed activations
(``ops.qconv.PackedActivation``) instead, never materialising a float tensor between them.

A ``QConv2d`` fused with a residual block's add (``has_residual``, set by ``quantize_model``) is called as
``m(x, residual)`` and computes ``act(conv_bn(x) + residual)`` in its epilogue; a conv whose output is both
a residual and the input of INT8 convs returns an ``ops.qconv.Int8Activation`` carrying the float too
(``hp``), of FP8 convs an ``ops.qconv.Fp8Activation`` (the e4m3 QTensor and ``hp``): its consumers take the
codes as ``x`` and the float as ``residual``.

Precision of a layer: weights and activations are integer formats of 1..8 bits (``binary`` = pm1
weights for 1 bit, two's complement ``intN`` otherwise; activations ``uintN`` when calibration saw no
negative input, ``intN`` otherwise), or ``e4m3`` for both (the FP8 path).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..formats import FloatFormat, IntFormat, as_format
from ..kernels.reference_conv import ConvGeometry
from ..ops import qconv as qc
from ..ops.matmul import choose_int_backend
from ..ops.quantize import absmax_qmax, quantize, quantize_pack, quantize_static
from ..qtensor import PerChannel

__all__ = ["LayerPrecision", "parse_precision", "QConv2d", "QLinear", "flatten_nhwc", "weight_format",
           "activation_format"]

from ..precision import LayerPrecision, parse_layer_precision  # noqa: E402  (re-exported)

_ACTS = (None, "relu", "leaky")


def parse_precision(text) -> LayerPrecision | None:
    """``"w1a2"`` / ``"w4a4"`` / ``"int4"`` (= w4a4) / ``"int8"`` / ``"fp8"`` (= ``"e4m3"``) -> LayerPrecision;
    ``"float"`` / None -> None.  The vocabulary is ``tcprec.precision``'s, shared with the CLI."""
    return parse_layer_precision(text)


def weight_format(p: LayerPrecision):
    if p.fp8:
        return as_format("e4m3")
    return as_format("binary") if p.w_bits == 1 else as_format(f"int{p.w_bits}")


def activation_format(p: LayerPrecision, signed: bool):
    if p.fp8:
        return as_format("e4m3")
    return as_format(f"int{p.a_bits}" if signed else f"uint{p.a_bits}")


def _quantize_weight(w: torch.Tensor, fmt):
    """Per-output-channel scales along axis 0: absmax for multi-bit codes; mean |w| for binary (the
    L2-optimal scale of sign(w), XNOR-Net) -- absmax would map every weight to +-max|w|."""
    w = w.detach().float()
    if isinstance(fmt, IntFormat) and fmt.encoding == "pm1":
        s = w.abs().flatten(1).mean(1).clamp_min(torch.finfo(torch.float32).tiny)
        return quantize(w, fmt, PerChannel(0), scale=s.view(-1, *([1] * (w.dim() - 1))))
    return quantize(w, fmt, PerChannel(0))


def _fold_bn(out_ch: int, bias: torch.Tensor | None, bn: nn.BatchNorm2d | None, device):
    """Per-channel (scale, bias) of bn(conv + bias) = conv * scale + bias'."""
    b = torch.zeros(out_ch, device=device) if bias is None else bias.detach().float()
    if bn is None:
        return None, (None if bias is None else b)
    inv = (bn.running_var.float() + bn.eps).rsqrt()
    g = bn.weight.detach().float() if bn.weight is not None else torch.ones_like(inv)
    beta = bn.bias.detach().float() if bn.bias is not None else torch.zeros_like(inv)
    scale = g * inv
    return scale, (b - bn.running_mean.float()) * scale + beta


def _prepare(qw):
    """Pack the weight once (bit planes in the im2col word layout; the int8 path reads its codes)."""
    return qc.pack_conv_weight(qw)


def _quantize_input(x_nhwc: torch.Tensor, m: "_QBase", compact: bool = False):
    """Float NHWC -> the op's activation operand with the calibrated scale, sync-free (capturable):
    bit planes in one fused kernel for the bit-serial backend (``compact``: rows without their padding
    words, for a convolution that reads its input through an im2col), e4m3 codes for FP8, the INT8 conv's
    int8 operand (``Int8Activation``, one fused kernel on CUDA) for the int8 backend, uint8 codes otherwise."""
    if m.precision.fp8:
        return qc.quantize_fp8_static(x_nhwc, m.in_scale)  # QTensor of e4m3 codes (N, H, W, C)
    name, _ = choose_int_backend(m.a_fmt, m.w_fmt, x_nhwc.device, m.backend)
    if name == "bitserial":
        N, H, W, C = x_nhwc.shape
        planes = quantize_pack(x_nhwc.reshape(N * H * W, C), m.a_fmt, m.in_scale, compact=compact)  # (bits, NHW, Kw)
        return qc.PackedActivation(planes, m.a_fmt, m.in_scale, (N, H, W, C))
    if name == "int8":
        return qc.quantize_int8_static(x_nhwc, m.a_fmt, m.in_scale)  # (N, H, W, C) int8 operand
    return quantize_static(x_nhwc, m.a_fmt, m.in_scale)  # QTensor (N, H, W, C) codes


class _QBase(nn.Module):
    tcprec_leaf = True  # profiling: one layer, however many kernels it launches

    def _init_common(self, prec: LayerPrecision, in_absmax: float, signed_input: bool, out_dtype, backend: str,
                     device):
        self.precision = prec
        self.a_fmt = activation_format(prec, signed_input)
        self.w_fmt = weight_format(prec)
        qmax = absmax_qmax(self.a_fmt)
        s = max(float(in_absmax), 1e-8) / qmax
        self.register_buffer("in_scale", torch.tensor([s], dtype=torch.float32, device=device))  # with the weights
        self.out_dtype = out_dtype
        self.backend = backend
        self.out_fmt = None  # set by quantize_model when the output feeds another quantized conv
        self.out_layout = "planes"  # ... as bit planes (a bit-serial consumer), int8 codes (INT8 ones), or both
        self.register_buffer("out_scale", None)
        self.has_residual = False  # set by quantize_model: forward(x, residual) adds it before the activation

    def _apply(self, fn, *args, **kwargs):  # .to(device) / .cuda() move the packed weight too
        super()._apply(fn, *args, **kwargs)
        if getattr(self, "weight", None) is not None:
            qw = self.weight.qw
            dev = fn(torch.empty(0, device=qw.device)).device  # where fn sends tensors
            if dev != qw.device:
                self.weight = _prepare(qw.to(dev))
        return self

    def chain_to(self, nxt: "QConv2d", layout: str = "planes") -> None:
        """Emit ``nxt``'s input directly: bit planes for a bit-serial ``nxt`` (the fused re-quantize + pack
        epilogue), int8 codes (``Int8Activation``) for an INT8 one, e4m3 codes (a QTensor) for an FP8 one;
        ``"int8+float"`` / ``"fp8+float"`` / ``"planes+float"``: the codes with the float output attached
        (``Int8Activation.hp`` / ``Fp8Activation.hp`` / ``PackedActivation.hp``), for an output that is also a residual
        block's shortcut; ``"compact"``: planes without padding words, for a consumer that gathers windows."""
        if layout not in qc.OUT_LAYOUTS:
            raise ValueError(f"layout must be one of {qc.OUT_LAYOUTS}, got {layout!r}")
        self.out_fmt = nxt.a_fmt
        self.out_scale = nxt.in_scale
        self.out_layout = layout

    def tcprec_trace(self) -> list[str]:
        """The steps inside this layer, for ``tcprec.profile``'s dtype trace."""
        if self.out_fmt is None:
            out = _short(self.out_dtype)
        else:
            out = (f"{_short(self.out_dtype)} + {self.out_fmt} codes" if self.out_layout == "fp8+float" else
                   f"{self.out_fmt} codes" if isinstance(self.out_fmt, FloatFormat) else
                   f"{self.out_fmt} int8 codes" if self.out_layout == "int8" else
                   f"{_short(self.out_dtype)} + {self.out_fmt} int8 codes" if self.out_layout == "int8+float" else
                   f"{_short(self.out_dtype)} + {self.out_fmt} planes" if self.out_layout == "planes+float" else
                   f"{self.out_fmt} planes")
        acc = "fp32" if self.precision.fp8 else "int32"
        epi = "+".join(x for x in ("scale/bias", getattr(self, "has_residual", False) and "residual", self._act_name(),
                                   getattr(self, "pool", None) and "pool") if x)
        return [f"{self.a_fmt} x {self.w_fmt} weights", acc, epi, out]

    def _act_name(self) -> str | None:
        act = getattr(self, "act", None)
        return act if isinstance(act, str) or act is None else f"leaky({act[1]:g})"


def _short(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, str(dt))


class QConv2d(_QBase):
    """A conv (+ folded BN, activation, pooling) at integer or FP8 precision, NHWC inside.

    Build with ``QConv2d.from_float(conv, precision, in_absmax=..., signed_input=..., bn=, act=, pool=)``
    or through ``tcprec.quantize_model``.
    """

    @classmethod
    def from_float(cls, conv: nn.Conv2d, precision, *, in_absmax: float, signed_input: bool, bn=None,
                   act=None, pool=None, backend: str = "auto", out_dtype=None) -> "QConv2d":
        m = cls()
        prec = parse_precision(precision)
        if prec is None:
            raise ValueError("QConv2d needs a quantized precision ('w1a2', 'int8', 'fp8', ...), got 'float'")
        if conv.groups != 1:
            raise ValueError(f"QConv2d supports groups=1 only, got groups={conv.groups} (keep this layer in float)")
        if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            raise ValueError(f"QConv2d needs numeric zero padding, got padding={conv.padding!r} "
                             f"padding_mode={conv.padding_mode!r}")
        if act is not None and not (act == "relu" or (isinstance(act, tuple) and act[0] == "leaky")):
            raise ValueError(f"act must be None, 'relu' or ('leaky', slope), got {act!r}")
        m._init_common(prec, in_absmax, signed_input, out_dtype or conv.weight.dtype, backend, conv.weight.device)
        m.stride, m.padding, m.dilation = tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation)
        m.in_channels, m.out_channels, m.kernel_size = conv.in_channels, conv.out_channels, tuple(conv.kernel_size)
        m.act, m.pool = act, pool
        w = conv.weight.detach().permute(0, 2, 3, 1).contiguous()  # (K, R, S, C): NHWC filters
        m.weight = _prepare(_quantize_weight(w, m.w_fmt))
        scale, bias = _fold_bn(conv.out_channels, conv.bias, bn, w.device)
        m.register_buffer("ch_scale", scale)
        m.register_buffer("ch_bias", bias)
        return m

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, {self.precision} ({self.w_fmt} x {self.a_fmt}), act={self.act}, "
                f"pool={self.pool}, out={'packed ' + str(self.out_fmt) if self.out_fmt is not None else _short(self.out_dtype)}"
                + (", residual" if self.has_residual else ""))

    def forward(self, x, residual=None):
        """``x``: float NCHW, or the operand a chained producer emitted (packed planes, int8 codes);
        ``residual`` (a layer fused with its block's add, ``has_residual``): float NCHW of the output's
        shape, or the producer's ``Int8Activation`` / ``Fp8Activation`` / ``PackedActivation`` carrying the float
        (``hp``)."""
        if self.has_residual != (residual is not None):
            raise ValueError(f"this QConv2d {'was' if self.has_residual else 'was not'} fused with a residual add "
                             f"(has_residual={self.has_residual}): call it as "
                             f"{'m(x, residual)' if self.has_residual else 'm(x)'}")
        if isinstance(x, torch.Tensor):
            if x.dim() != 4 or x.shape[1] != self.in_channels:
                raise ValueError(f"QConv2d expects (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
            xn = x.permute(0, 2, 3, 1)  # NHWC (a view for channels_last input)
            x = _quantize_input(xn, self, compact=self.reads_compact)
        res = None if residual is None else self._residual_nhwc(residual, x.shape)
        y = qc.conv2d(x, self.weight, stride=self.stride, padding=self.padding, dilation=self.dilation,
                      scale=self.ch_scale, bias=self.ch_bias, act=self.act, pool=self.pool,
                      out_dtype=self.out_dtype, out_fmt=self.out_fmt, out_scale=self.out_scale,
                      out_layout=self.out_layout, backend=self.backend, residual=res)
        return y.permute(0, 3, 1, 2) if isinstance(y, torch.Tensor) else y  # NCHW view, channels_last memory

    @property
    def reads_compact(self) -> bool:
        """Whether this conv takes bit-plane input in compact rows (no padding words): it gathers windows (im2col or
        implicit GEMM) -- every conv but a 1x1 stride-1 unpadded one, whose planes are the GEMM operand as they are --
        and ``ops.qconv.compact_planes_ok`` holds for its channels.  What its quantizer and a chained producer write."""
        pointwise = self.kernel_size == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)
        return not pointwise and qc.compact_planes_ok(self.in_channels)

    def _residual_nhwc(self, residual, x_nhwc: tuple) -> torch.Tensor:
        """The residual as NHWC (N, P, Q, K): the float an Int8Activation carries, or an NCHW tensor permuted
        (a view for channels_last memory)."""
        if isinstance(residual, qc.Fp8Activation):
            return residual.hp
        if isinstance(residual, (qc.Int8Activation, qc.PackedActivation)):
            if residual.hp is None:
                both = "'int8+float'" if isinstance(residual, qc.Int8Activation) else "'planes+float'"
                raise ValueError(f"the residual is a {type(residual).__name__} without its float (hp): the producer "
                                 f"must write both (out_layout={both})")
            return residual.hp
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a float NCHW tensor, or an Int8Activation / PackedActivation with hp or "
                            f"an Fp8Activation, "
                            f"got {type(residual).__name__}")
        N, H, W, _ = x_nhwc
        g = ConvGeometry(N, H, W, self.in_channels, self.out_channels, *self.kernel_size, self.stride, self.padding,
                         self.dilation)
        want = (N, self.out_channels, g.P, g.Q)
        if tuple(residual.shape) != want:
            raise ValueError(f"residual must have the output's NCHW shape {want}, got {tuple(residual.shape)}")
        return residual.permute(0, 2, 3, 1)


class QLinear(_QBase):
    """A Linear (+ ReLU) at integer or FP8 precision; float in, float out."""

    @classmethod
    def from_float(cls, lin: nn.Linear, precision, *, in_absmax: float, signed_input: bool, act=None,
                   backend: str = "auto", out_dtype=None) -> "QLinear":
        m = cls()
        prec = parse_precision(precision)
        if prec is None:
            raise ValueError("QLinear needs a quantized precision ('w1a2', 'int8', 'fp8', ...), got 'float'")
        if act not in (None, "relu"):
            raise ValueError(f"QLinear fuses act=None or 'relu', got {act!r}")
        m._init_common(prec, in_absmax, signed_input, out_dtype or lin.weight.dtype, backend, lin.weight.device)
        m.in_features, m.out_features, m.act = lin.in_features, lin.out_features, act
        w = lin.weight.detach()[:, None, None, :]  # (N_out, 1, 1, K): a 1x1 conv over one pixel
        m.weight = _prepare(_quantize_weight(w, m.w_fmt))
        m.register_buffer("bias", None if lin.bias is None else lin.bias.detach().float())
        return m

    in_channels_last = None  # C when nhwc_input(C) reordered the weight's columns

    def extra_repr(self) -> str:
        order = "" if self.in_channels_last is None else f", input=flatten_nhwc(C={self.in_channels_last})"
        return (f"{self.in_features}, {self.out_features}, {self.precision} ({self.w_fmt} x {self.a_fmt}), "
                f"act={self.act}{order}")

    def nhwc_input(self, channels: int) -> None:
        """Take the flattened input in (h, w, c) order (``flatten_nhwc`` of an NCHW activation of ``channels``
        channels) instead of torch.flatten's (c, h, w): the quantized weight's columns are permuted once, so the
        flatten is a view of a channels_last activation (or of a chained conv's planes) rather than a copy.  The
        codes and per-output-channel scales are the same numbers, so integer results are unchanged."""
        if self.in_channels_last is not None:
            raise ValueError(f"nhwc_input was already applied (C={self.in_channels_last})")
        K = self.in_features
        if not (isinstance(channels, int) and channels >= 1 and K % channels == 0):
            raise ValueError(f"channels must be a positive divisor of in_features={K}, got {channels!r}")
        qw = self.weight.qw
        codes = qw.codes.reshape(self.out_features, channels, K // channels).transpose(1, 2)
        self.weight = _prepare(dataclasses.replace(qw, codes=codes.reshape(qw.codes.shape).contiguous()))
        self.in_channels_last = channels

    def forward(self, x) -> torch.Tensor:
        """``x``: float (..., in_features), or the packed planes a chained conv wrote, flattened (``flatten_nhwc``
        of a ``PackedActivation``: shape (B, 1, 1, in_features))."""
        if isinstance(x, qc.PackedActivation):
            lead, xa = x.shape[:1], x
            if x.shape != (*lead, 1, 1, self.in_features):
                raise ValueError(f"QLinear expects planes of shape (B, 1, 1, {self.in_features}), got {x.shape}")
        elif not isinstance(x, torch.Tensor) or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"QLinear expects (..., {self.in_features}), got {got}")
        else:
            lead = x.shape[:-1]
            xa = _quantize_input(x.reshape(-1, 1, 1, self.in_features), self)  # (B, 1, 1, K) NHWC
        y = qc.conv2d(xa, self.weight, bias=self.bias, act=self.act, out_dtype=self.out_dtype, backend=self.backend)
        return y.reshape(*lead, self.out_features)


def flatten_nhwc(x):
    """``torch.flatten(x, 1)`` of an NCHW activation in (h, w, c) order: a view of channels_last memory (a copy
    otherwise), where torch.flatten copies into (c, h, w) order.  For the packed planes a chained conv wrote
    (a ``PackedActivation`` of shape (N, H, W, C), C % 32 == 0) the planes of the flattened rows (N, 1, 1, H * W * C):
    a view of compact rows (what the bit-serial epilogue writes).  ``quantize_model`` puts it between a conv and a
    ``QLinear`` whose weight it reordered the same way (``QLinear.nhwc_input``)."""
    if isinstance(x, qc.PackedActivation):
        N, H, W, C = x.shape
        K = H * W * C
        if C % 32 or K % 512:
            raise ValueError(f"flatten_nhwc of planes needs C % 32 == 0 and H * W * C % 512 == 0 (rows of whole words "
                             f"that flatten into the GEMM's padded rows), got shape {x.shape}")
        hp = None if x.hp is None else x.hp.reshape(N, 1, 1, K)
        planes = x.planes[:, :, : C // 32]  # (padded rows, from the reference backend: a copy below)
        return qc.PackedActivation(planes.reshape(x.planes.shape[0], N, K // 32), x.fmt, x.scale, (N, 1, 1, K), hp)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"flatten_nhwc expects an NCHW tensor (N, C, H, W) or a PackedActivation, got {got}")
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)
