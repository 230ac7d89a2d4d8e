"""``QGroupedConv2d``: a grouped / depthwise conv (+ folded BN, fused activation) at integer or FP8 precision.

Float NCHW in, float NCHW out (channels_last memory): it quantizes its input with the calibrated per-tensor scale
(``ops.qconv.quantize_int8_static``'s one-pass int8 operand where the Triton conv runs, ``ops.quantize.quantize_static``
elsewhere; ``quantize_fp8_static`` to e4m3 for FP8, as the dense FP8 layers do), runs ``ops.qconv_grouped.grouped_conv2d`` (the Triton direct conv on CUDA, the
integer reference elsewhere) with the per-channel weight scales, the folded batch-norm and the activation in the
epilogue.  Four-sided padding (``tcprec_pad4``, what ``nn.coverage`` folds from an asymmetric ``ZeroPad2d``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.qconv_grouped import choose_grouped_backend, grouped_conv2d
from ..ops.qconv import quantize_fp8_static, quantize_int8_static
from ..ops.quantize import absmax_qmax, quantize_static
from ..qtensor import PerChannel, QTensor, ShiftedInt8
from .qmodules import (LayerPrecision, _check_before_load, _fold_bn, _quantize_weight, activation_format,
                       check_extra_state, parse_precision, weight_format)

__all__ = ["QGroupedConv2d", "grouped_unsupported"]


def grouped_unsupported(conv: nn.Conv2d, prec: LayerPrecision | None) -> str | None:
    """Why a grouped conv cannot take this path (None: it can); every precision of ``parse_precision`` can."""
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"padding={conv.padding!r}, padding_mode={conv.padding_mode!r} (needs numeric zero padding)"
    return None


class QGroupedConv2d(nn.Module):
    """Build with ``QGroupedConv2d.from_float(conv, "int8", in_absmax=..., signed_input=..., bn=, act=)`` (or
    ``"fp8"``: e4m3 activations and weights, per-channel weight scales, float32 sums) or through
    ``tcprec.quantize_model``; act: None, "relu", ("leaky", a), ("clamp", lo, hi), "hardswish", "silu"."""

    tcprec_leaf = True

    @classmethod
    def from_float(cls, conv: nn.Conv2d, precision, *, in_absmax: float, signed_input: bool, bn=None, act=None,
                   backend: str = "auto", out_dtype=None, w_fmt=None) -> "QGroupedConv2d":
        prec = parse_precision(precision)
        if prec is None:
            raise ValueError("QGroupedConv2d needs a quantized precision ('int8', 'w4a8', ...), got 'float'")
        why = grouped_unsupported(conv, prec)
        if why:
            raise ValueError(f"QGroupedConv2d cannot take this conv: {why}")
        m = cls()
        m.precision = prec
        m.a_fmt = activation_format(prec, signed_input)
        m.w_fmt = w_fmt if w_fmt is not None else weight_format(prec)
        m.backend = backend
        m.groups = conv.groups
        m.in_channels, m.out_channels, m.kernel_size = conv.in_channels, conv.out_channels, tuple(conv.kernel_size)
        m.stride, m.dilation = tuple(conv.stride), tuple(conv.dilation)
        ph, pw = conv.padding
        m.pad4 = tuple(getattr(conv, "tcprec_pad4", (ph, ph, pw, pw)))
        m.act = act
        m.out_dtype = out_dtype or conv.weight.dtype
        dev = conv.weight.device
        s = max(float(in_absmax), 1e-8) / absmax_qmax(m.a_fmt)
        m.register_buffer("in_scale", torch.tensor([s], dtype=torch.float32, device=dev))
        w = conv.weight.detach().permute(0, 2, 3, 1).contiguous()  # (K, R, S, Cg)
        qw = _quantize_weight(w, m.w_fmt)
        m.register_buffer("w_codes", qw.codes)
        m.register_buffer("w_scale", qw.scale.reshape(-1).to(torch.float32))
        scale, bias = _fold_bn(conv.out_channels, conv.bias, bn, dev)
        m.register_buffer("ch_scale", scale)
        m.register_buffer("ch_bias", bias)
        return m

    _STATE_KEYS = ("kind", "precision", "w_fmt", "a_fmt", "geometry", "act")

    def get_extra_state(self) -> dict:
        """What the buffers mean (an int8 and an fp8 layer both hold uint8 codes of one shape): saved with them,
        checked on load."""
        return {"version": 1, "kind": type(self).__name__, "precision": str(self.precision), "w_fmt": str(self.w_fmt),
                "a_fmt": str(self.a_fmt), "act": self.act,
                "geometry": (self.in_channels, self.out_channels, self.kernel_size, self.stride, self.pad4,
                             self.dilation, self.groups)}

    def set_extra_state(self, state) -> None:
        """Refuse a state saved from a layer of another precision, format, geometry or activation."""
        check_extra_state(self, state, "a grouped layer's", "build the target with the same quantize_model config, "
                          "or torch.save / torch.load the whole model")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _check_before_load(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def route(self) -> tuple[str, str]:
        """(backend, reason) the forward takes on the weights' device."""
        return choose_grouped_backend(self.w_codes.device, self.backend)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.pad4}, groups={self.groups}, {self.precision} ({self.w_fmt} x {self.a_fmt}), "
                f"act={self.act}")

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, QTensor):  # the int8 operand a chained producer wrote (quantize_model's chain pass)
            if self.precision.fp8 or not isinstance(x.layout, ShiftedInt8) or x.fmt != self.a_fmt \
                    or len(x.shape) != 4 or x.shape[3] != self.in_channels:
                raise ValueError(f"QGroupedConv2d reads a chained operand as ShiftedInt8() {self.a_fmt} codes "
                                 f"(N, H, W, {self.in_channels}), got {x.layout!r} {x.fmt} {x.shape}; quantize_model "
                                 "chains only what the layer reads, or pass the float NCHW input")
            xq = x
        elif not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != self.in_channels:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"QGroupedConv2d expects (N, {self.in_channels}, H, W), got {got}")
        else:
            xq = self._quantize(x.permute(0, 2, 3, 1))  # (N, H, W, C), a view for channels_last input
        K = self.out_channels
        qw = QTensor(self.w_codes, self.w_scale.reshape(K, 1, 1, 1), self.w_fmt, PerChannel(0),
                     tuple(self.w_codes.shape), torch.float32)
        y = grouped_conv2d(xq, qw, groups=self.groups, stride=self.stride, padding=self.pad4, dilation=self.dilation,
                           scale=self.ch_scale, bias=self.ch_bias, act=self.act, out_dtype=self.out_dtype,
                           backend=self.backend)
        return y.permute(0, 3, 1, 2)  # NCHW view, channels_last memory

    def _quantize(self, xn: torch.Tensor) -> QTensor:
        """Float NHWC -> this layer's input codes with the calibrated scale (sync-free)."""
        if self.precision.fp8:
            xq = quantize_fp8_static(xn, self.in_scale, self.a_fmt)  # (N, H, W, C) e4m3 codes
        elif self.route[0] == "triton":  # the INT8 kernels' int8 operand: one Triton pass, which the conv reads as is
            xq = quantize_int8_static(xn, self.a_fmt, self.in_scale)
        else:
            xq = quantize_static(xn, self.a_fmt, self.in_scale)  # (N, H, W, C) codes
        return xq
