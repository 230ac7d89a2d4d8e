"""Pure-torch references for 2-D convolution backward in NHWC (the geometry, shared with the forward
convolutions, is ``conv_geometry.py``).

Layouts (the whole conv-backward stack uses them):

* activations ``x`` / ``dx``: ``(N, H, W, C)``      -- NHWC
* output gradient ``dy``:     ``(N, P, Q, K)``      -- NHWC of the forward's output
* weights ``w`` / ``dw``:     ``(K, R, S, C)``      -- KRSC (``nn.Conv2d``'s ``(K, C, R, S)`` permuted)

The forward is ``y[n,p,q,k] = sum_{r,s,c} x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * w[k,r,s,c]``
(zero padding), so

* dgrad: ``dx[n,h,w,c] = sum_{k,r,s} dy[n,p,q,k] * w[k,r,s,c]`` over the (p, q, r, s) with
  ``h = p*sh - ph + r*dh`` and ``w = q*sw - pw + s*dw``;
* wgrad: ``dw[k,r,s,c] = sum_{n,p,q} dy[n,p,q,k] * x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c]``.

The references call ``torch.nn.grad.conv2d_input`` / ``conv2d_weight`` on NCHW views, in the dtype
asked for (float64 for tests, float32 for the ``reference`` backend).
"""

from __future__ import annotations

import math

import torch

from .conv_geometry import ACT_LEAKY, ACT_NONE, ACT_RELU, ConvGeometry, pair

__all__ = [
    "ConvGeometry",
    "pair",
    "parse_activation",
    "activation_backward",
    "conv2d_dgrad",
    "conv2d_wgrad",
    "abs_dgrad",
    "abs_wgrad",
    "ACT_NONE",
    "ACT_RELU",
    "ACT_LEAKY",
]

def parse_activation(activation) -> tuple[int, float]:
    """(mode, slope) from ``None``, ``"relu"``, ``"leaky_relu"`` (slope 0.01) or ``("leaky_relu", slope)``."""
    if activation is None:
        return ACT_NONE, 0.0
    if activation == "relu":
        return ACT_RELU, 0.0
    if activation == "leaky_relu":
        return ACT_LEAKY, 0.01
    if isinstance(activation, (tuple, list)) and len(activation) == 2 and activation[0] == "leaky_relu":
        slope = activation[1]
        if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not math.isfinite(slope):
            raise ValueError(f"the LeakyReLU slope must be a finite number, got {slope!r}")
        return ACT_LEAKY, float(slope)
    raise ValueError(
        f"activation must be None, 'relu', 'leaky_relu' or ('leaky_relu', slope), got {activation!r}"
    )


def activation_backward(grad: torch.Tensor, act_input: torch.Tensor | None, activation) -> torch.Tensor:
    """``grad * act'(act_input)``: ReLU keeps ``grad`` where ``act_input > 0`` (0 elsewhere, as
    torch's ``threshold_backward``), LeakyReLU multiplies by ``slope`` where ``act_input <= 0``."""
    mode, slope = parse_activation(activation)
    if mode == ACT_NONE:
        return grad
    pos = act_input > 0
    if mode == ACT_RELU:
        return torch.where(pos, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return torch.where(pos, grad, grad * slope)


def _nchw(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype).permute(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W) view


def conv2d_dgrad(grad_out, weight, input_shape, stride=1, padding=0, dilation=1, *, activation=None,
                 act_input=None, dtype=torch.float64) -> torch.Tensor:
    """dx (N, H, W, C) in ``dtype`` from dy (N, P, Q, K) and w (K, R, S, C), with the optional
    activation backward applied.

    >>> dy, w = torch.ones(1, 2, 2, 1), torch.ones(1, 1, 1, 1)
    >>> conv2d_dgrad(dy, w, (1, 3, 3, 1), stride=2)[0, :, :, 0]
    tensor([[1., 0., 1.],
            [0., 0., 0.],
            [1., 0., 1.]], dtype=torch.float64)
    """
    N, H, W, C = input_shape
    dx = torch.nn.grad.conv2d_input((N, C, H, W), _nchw(weight, dtype), _nchw(grad_out, dtype),
                                    pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"))
    dx = dx.permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
    if activation is not None:
        dx = activation_backward(dx, act_input.to(dx.device), activation)
    return dx


def conv2d_wgrad(grad_out, input, weight_shape, stride=1, padding=0, dilation=1, *,
                 dtype=torch.float64) -> torch.Tensor:
    """dw (K, R, S, C) in ``dtype`` from dy (N, P, Q, K) and x (N, H, W, C)."""
    K, R, S, C = weight_shape
    dw = torch.nn.grad.conv2d_weight(_nchw(input, dtype), (K, C, R, S), _nchw(grad_out, dtype),
                                     pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"))
    return dw.permute(0, 2, 3, 1)  # (K, C, R, S) -> (K, R, S, C)


def abs_dgrad(grad_out, weight, input_shape, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """``sum |dy| |w|`` over each dx element's terms (float64): the scale of error bounds."""
    return conv2d_dgrad(grad_out.double().abs(), weight.double().abs(), input_shape, stride, padding, dilation)


def abs_wgrad(grad_out, input, weight_shape, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """``sum |dy| |x|`` over each dw element's terms (float64)."""
    return conv2d_wgrad(grad_out.double().abs(), input.double().abs(), weight_shape, stride, padding, dilation)
