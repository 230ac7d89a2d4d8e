"""``tcprec.nn.Conv2d``: an ``nn.Conv2d`` whose backward runs the low-precision dgrad / wgrad kernels.

    conv = tcprec.nn.Conv2d(64, 64, 3, padding=1, precision="fp16")   # or "bf16", "fp8"
    y = conv(x)            # x (N, C, H, W) of any float dtype; y has x's dtype
    y.sum().backward()     # dx via ops.conv2d_dgrad, dw via ops.conv2d_wgrad (fp32), db = sum of dy

Forward: x and w rounded to the precision, convolved with fp32 accumulation (cuDNN on CUDA, a
float32 convolution of the rounded values elsewhere), returned in x's dtype.  For fp8, x and w are
e4m3 with per-tensor amax scales (the convolution runs on the codes, exact in bf16, and the scales
multiply the result) and dy is e5m2 in the backward.  Parameters stay float32 (master weights);
their gradients are float32.

``input_activation="relu"`` (or ``("leaky_relu", slope)``) applies the activation to x first and
fuses its backward into the dgrad epilogue, so ``Conv2d(..., input_activation="relu")(x)`` replaces
``Conv2d(...)(relu(x))`` without a separate ReLU-backward pass over dx.

Tensors flow best in ``torch.channels_last`` memory format (NHWC underneath): then dy, x and dx
need no layout copies.  Grouped convolutions and non-zero padding modes are rejected at
construction (the kernels are dense, zero-padded convolutions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import reference_conv_bwd as rc
from ..ops import conv as opc

__all__ = ["Conv2d", "conv2d"]

_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H, W, C) view (contiguous when t is channels_last)."""
    return t.permute(0, 2, 3, 1)


def _apply_act(x: torch.Tensor, activation) -> torch.Tensor:
    mode, slope = rc.parse_activation(activation)
    if mode == rc.ACT_RELU:
        return F.relu(x)
    if mode == rc.ACT_LEAKY:
        return F.leaky_relu(x, slope)
    return x


class _Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, precision, activation, backend):
        a = _apply_act(x, activation)
        cuda = a.is_cuda
        if precision == "fp8":
            g = opc.conv_geometry(tuple(_nhwc(a).shape), tuple(_nhwc(weight).shape), stride, padding, dilation)
            # x: NHWC, or (C, N, H, W) order when wgrad will be a cuBLAS GEMM; w: (R, S, C, K) order (dgrad)
            path, _ = opc._choose("wgrad", g, a, "fp8", backend)
            xq = opc.to_fp8(_nhwc(a), "e4m3", memory_order=opc._CFIRST if path == "gemm" else opc._NHWC)
            wq = opc.to_fp8(_nhwc(weight), "e4m3", memory_order=opc._KMAJOR_W)
            lp = torch.bfloat16 if cuda else torch.float32  # e4m3 codes are exact in bf16
            xc = xq.data.permute(0, 3, 1, 2).to(lp)  # (N, C, H, W) codes
            wc = wq.data.permute(0, 3, 1, 2).to(lp)  # (K, C, R, S) codes
            y = F.conv2d(xc, wc, None, stride, padding, dilation).float() * (xq.scale * wq.scale)
            saved_x, saved_w = xq, wq
        else:
            dt = _DTYPE[precision]
            x_lp = a.to(dt, memory_format=torch.channels_last)
            w_lp = weight.to(dt, memory_format=torch.channels_last)
            if cuda:
                y = F.conv2d(x_lp, w_lp, None, stride, padding, dilation)
            else:  # CPU: float32 convolution of the rounded values, rounded once at the end
                y = F.conv2d(x_lp.float(), w_lp.float(), None, stride, padding, dilation).to(dt)
            saved_x, saved_w = _nhwc(x_lp), _nhwc(w_lp)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype).view(1, -1, 1, 1)
        ctx.saved = (saved_x, saved_w)  # low-precision copies (Float8() QTensors for fp8): not autograd inputs
        ctx.save_for_backward(x if activation is not None else None)  # the activation's input: its mask
        ctx.conf = (stride, padding, dilation, precision, activation, backend)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        stride, padding, dilation, precision, activation, backend = ctx.conf
        x_lp, w_lp = ctx.saved
        (x_in,) = ctx.saved_tensors
        act_input = _nhwc(x_in) if x_in is not None else None
        (N, C, H, W), x_dtype = ctx.x_meta
        dx = dw = db = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        if precision == "fp8":
            dy_nhwc = _nhwc(dy)
            amax = dy_nhwc.abs().amax().float()
            s = torch.where(amax > 0, amax / torch.finfo(torch.float8_e5m2).max, torch.ones_like(amax))
            dyq_rows = opc.to_fp8(dy_nhwc, "e5m2", memory_order=opc._NHWC, scale=s) if need_x else None
            dyq_kmaj = opc.to_fp8(dy_nhwc, "e5m2", memory_order=opc._CFIRST, scale=s) if need_w else None
        else:
            dy_nhwc = _nhwc(dy.to(_DTYPE[precision], memory_format=torch.channels_last))
            dyq_rows = dyq_kmaj = dy_nhwc
        if need_x:
            dx = opc.conv2d_dgrad(dyq_rows, w_lp, (N, H, W, C), stride, padding, dilation, precision=precision,
                                  activation=activation, act_input=act_input, backend=backend)
            dx = dx.permute(0, 3, 1, 2).to(x_dtype)  # (N, C, H, W), channels_last memory
        if need_w:
            dw = opc.conv2d_wgrad(dyq_kmaj, x_lp, tuple(w_lp.shape), stride, padding, dilation, precision=precision,
                                  backend=backend, out_dtype=torch.float32)
            dw = dw.permute(0, 3, 1, 2).to(ctx.w_dtype)  # (K, C, R, S)
        if need_b:
            db = dy.float().sum((0, 2, 3))
        return dx, dw, db, None, None, None, None, None, None


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, *, precision: str = "fp16",
           input_activation=None, backend: str = "auto") -> torch.Tensor:
    """Functional form of :class:`Conv2d`: ``conv2d(act(x), weight) + bias`` with the low-precision
    backward.  ``weight`` is ``(K, C, R, S)`` as in ``torch.nn.functional.conv2d``."""
    if precision not in opc.PRECISIONS:
        raise ValueError(f"precision must be one of {opc.PRECISIONS}, got {precision!r}")
    if backend not in opc.BACKENDS:
        raise ValueError(f"backend must be one of {opc.BACKENDS}, got {backend!r}")
    rc.parse_activation(input_activation)
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"conv2d takes x (N, C, H, W) and weight (K, C, R, S), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has C={x.shape[1]} channels but weight (K, C, R, S) has C={weight.shape[1]} "
                         "(grouped convolutions are not supported)")
    st, pd, dl = rc.pair(stride, "stride"), rc.pair(padding, "padding"), rc.pair(dilation, "dilation")
    return _Conv2dFn.apply(x, weight, bias, st, pd, dl, precision, input_activation, backend)


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` (dense, zero padding) trained with low-precision conv backward kernels.

    ``precision``: "fp16", "bf16" or "fp8"; ``input_activation``: None, "relu" or
    ("leaky_relu", slope), applied to the input with its backward fused into dgrad; ``backend``:
    as in :func:`tcprec.ops.conv2d_dgrad` ("auto" picks cuBLAS / Triton on CUDA, the reference on CPU).

    >>> conv = Conv2d(3, 4, 3, padding=1, precision="bf16", backend="reference")
    >>> conv(torch.randn(2, 3, 8, 8)).shape
    torch.Size([2, 4, 8, 8])
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None, *, precision: str = "fp16", input_activation=None,
                 backend: str = "auto"):
        why = _unsupported(groups, padding, padding_mode)
        if why:
            raise ValueError(why)
        if precision not in opc.PRECISIONS:
            raise ValueError(f"precision must be one of {opc.PRECISIONS}, got {precision!r}")
        if backend not in opc.BACKENDS:
            raise ValueError(f"backend must be one of {opc.BACKENDS}, got {backend!r}")
        rc.parse_activation(input_activation)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)
        self.precision = precision
        self.input_activation = input_activation
        self.backend = backend

    @classmethod
    def from_module(cls, m: torch.nn.Conv2d, precision: str = "fp16", input_activation=None,
                    backend: str = "auto") -> "Conv2d":
        """A ``Conv2d`` sharing ``m``'s parameters (no copy)."""
        new = cls(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups,
                  m.bias is not None, m.padding_mode, m.weight.device, m.weight.dtype, precision=precision,
                  input_activation=input_activation, backend=backend)
        new.weight, new.bias = m.weight, m.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Conv2dFn.apply(x, self.weight, self.bias, tuple(self.stride), tuple(self.padding),
                               tuple(self.dilation), self.precision, self.input_activation, self.backend)

    def extra_repr(self) -> str:
        act = f", input_activation={self.input_activation!r}" if self.input_activation is not None else ""
        return super().extra_repr() + f", precision={self.precision!r}{act}, backend={self.backend!r}"


def _unsupported(groups, padding, padding_mode) -> str | None:
    if groups != 1:
        return (f"groups={groups} is not supported by tcprec.nn.Conv2d: the implicit-GEMM dgrad/wgrad kernels "
                "compute dense convolutions; keep torch.nn.Conv2d for grouped and depthwise layers")
    if padding_mode != "zeros":
        return (f"padding_mode={padding_mode!r} is not supported by tcprec.nn.Conv2d (zero padding only); "
                "pad the input with torch.nn.functional.pad and use padding=0")
    if isinstance(padding, str):
        return (f"padding={padding!r} is not supported by tcprec.nn.Conv2d; give the padding as an int or a pair "
                "(for 'same' with an odd kernel k and stride 1: (k - 1) // 2)")
    return None
