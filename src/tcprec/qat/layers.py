"""Trainable fake-quant layers: ``QATConv2d`` (a conv and the BatchNorm ``quantize_model`` folds into it) and
``QATLinear``.

Training mode: the dequantized codes of input and weight (``s_x * q_x``, ``s_w[k] * q_w``; STE / LSQ gradients,
``quantizers``) go through a float conv / linear (fp16 under autocast: the raw integer sums of 8-bit codes would
overflow fp16, the dequantized values do not), the conv's bias is added and the BatchNorm normalises with batch
statistics (the BN is trained, and folded only at conversion: docs/decisions/0050).

Eval mode is the deployed layer's arithmetic, step for step (``ops/qconv.py``'s epilogue, ``codes.cuh`` y_of)::

    C   = conv(codes_x, codes_w)                    exact integers (fp32 while the bound < 2^20, else fp64;
                                                    TF32 off; rounded, so a non-exact cuDNN algorithm is harmless)
    col = (s_x * s_w[k]) * bn_scale[k]              float32, this order (qconv._col_scale)
    y   = float32(C) * col[k] + bn_bias[k]          two IEEE roundings, no FMA (bmma_gemm / stem_conv / Triton)

with ``bn_scale = gamma / sqrt(var + eps)``, ``bn_bias = (b - mean) * bn_scale + beta`` computed in float64 and
rounded once to float32 (sqrt and division are correctly rounded on every device, so CPU and GPU agree), and
the result in channels_last memory like ``QConv2d``'s.  ``tcprec.convert_qat`` hands these same tensors to
``QConv2d`` / ``QLinear`` (``FixedQuant``), so the deployed codes equal these codes.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.qmodules import LayerPrecision
from .quantizers import ActQuant, WeightQuant

__all__ = ["QATConv2d", "QATLinear", "exact_int"]

_FP32_EXACT = 1 << 20  # |sum of |terms|| below this: fp32 + round recovers the integer even from Winograd


@contextlib.contextmanager
def _no_tf32(device: torch.device):
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def exact_int(fn, xq: torch.Tensor, wq: torch.Tensor, bound: float) -> torch.Tensor:
    """``fn(xq, wq)`` (conv / linear of integer-valued tensors) as exact integers in float32: computed in fp32
    (TF32 off) when ``bound`` (an upper bound of sum |x| |w| of one output) < 2^20, else in float64."""
    dt = torch.float32 if bound < _FP32_EXACT else torch.float64
    with _no_tf32(xq.device), torch.autocast(xq.device.type, enabled=False):
        y = fn(xq.to(dt), wq.to(dt)).round()
    return y.to(torch.float32)


def _bound(xq: torch.Tensor, wq: torch.Tensor, terms: int) -> float:
    return terms * float(xq.abs().max()) * float(wq.abs().max())


class _QATBase(nn.Module):
    def _setup(self, prec: LayerPrecision, weight: torch.Tensor, bias, act_mode: str):
        self.precision = prec
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.act_quant = ActQuant(prec.a_bits, act_mode)
        self.weight_quant = WeightQuant(self.weight, prec.w_bits)

    def epilogue(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(per-channel scale or None, bias or None) of the deployed epilogue, float32."""
        bn = getattr(self, "bn", None)
        b = None if self.bias is None else self.bias.detach()
        if bn is None:
            return None, None if b is None else b.float()
        var, mean = bn.running_var.double(), bn.running_mean.double()
        g = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(var)
        beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(var)
        scale = g / torch.sqrt(var + bn.eps)
        b64 = torch.zeros_like(var) if b is None else b.double()
        return scale.float(), ((b64 - mean) * scale + beta).float()


class QATConv2d(_QATBase):
    """Fake-quant ``nn.Conv2d`` (+ the folded ``nn.BatchNorm2d``); see the module docstring."""

    def __init__(self, conv: nn.Conv2d, precision: LayerPrecision, bn: nn.BatchNorm2d | None = None,
                 act_mode: str = "lsq"):
        super().__init__()
        self._setup(precision, conv.weight, conv.bias, act_mode)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.in_channels, self.out_channels, self.kernel_size = conv.in_channels, conv.out_channels, conv.kernel_size
        self.bn = None if bn is None else copy.deepcopy(bn)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, {self.precision}, bn={'folded at conversion' if self.bn is not None else None}")

    def _conv(self, x, w):
        return F.conv2d(x, w, None, self.stride, self.padding, self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.forward_exact(x)
        q, s_x = self.act_quant(x)
        wq, s_w = self.weight_quant(self.weight)
        # dequantized operands: the integer sums of 8-bit codes overflow fp16 under autocast (9 * 127 * 127 > 65504)
        z = self._conv(q * s_x, wq * s_w.view(-1, 1, 1, 1))
        if self.bias is not None:
            z = z + self.bias.view(1, -1, 1, 1).to(z.dtype)
        return z if self.bn is None else self.bn(z)

    @torch.no_grad()
    def forward_exact(self, x: torch.Tensor) -> torch.Tensor:
        """What the deployed QConv2d computes (module docstring), float32 channels_last."""
        q = self.act_quant.codes(x)
        wq, s_w = self.weight_quant.codes(self.weight)
        C = exact_int(self._conv, q, wq, _bound(q, wq, wq[0].numel()))
        scale, bias = self.epilogue()
        col = self.act_quant.scale().detach() * s_w
        if scale is not None:
            col = col * scale
        y = C * col.view(1, -1, 1, 1)
        if bias is not None:
            y = y + bias.view(1, -1, 1, 1)
        return y.contiguous(memory_format=torch.channels_last)


class QATLinear(_QATBase):
    """Fake-quant ``nn.Linear``; see the module docstring."""

    def __init__(self, lin: nn.Linear, precision: LayerPrecision, act_mode: str = "lsq"):
        super().__init__()
        self._setup(precision, lin.weight, lin.bias, act_mode)
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.precision}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.forward_exact(x)
        q, s_x = self.act_quant(x)
        wq, s_w = self.weight_quant(self.weight)
        z = F.linear(q * s_x, wq * s_w.view(-1, 1))
        return z if self.bias is None else z + self.bias.to(z.dtype)

    @torch.no_grad()
    def forward_exact(self, x: torch.Tensor) -> torch.Tensor:
        """What the deployed QLinear computes: ``float32(C) * (s_x * s_w[n]) + bias[n]``."""
        q = self.act_quant.codes(x)
        wq, s_w = self.weight_quant.codes(self.weight)
        C = exact_int(F.linear, q, wq, _bound(q, wq, self.in_features))
        y = C * (self.act_quant.scale().detach() * s_w)
        return y if self.bias is None else y + self.bias.detach().float()
