"""Pure-torch references for 2-D convolution backward in NHWC, and the geometry both the references
and the Triton kernels share.

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
from dataclasses import dataclass

import torch

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

ACT_NONE, ACT_RELU, ACT_LEAKY = 0, 1, 2


def pair(v, name: str) -> tuple[int, int]:
    """``v`` as a pair of ints: an int, or a sequence of two ints."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    if isinstance(v, int):
        return (v, v)
    try:
        a, b = v
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in (a, b)):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    return (a, b)


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one convolution: input (N, H, W, C), weight (K, R, S, C), output (N, P, Q, K).

    ``phase_params(axis)`` gives the stride-phase arithmetic of the dgrad kernel: output rows
    ``h = a + sh*i`` (residue ``a`` in ``[0, sh)``) receive exactly the filter taps
    ``r = r0(a) + t*step`` and read ``dy`` row ``p = i + base(a) - t*dp`` -- a dense convolution
    per phase, with no zeros inserted.  For ``r*dh = a + ph (mod sh)``, with ``g = gcd(dh, sh)``:
    solvable iff ``g | a + ph``; then ``r = ((a + ph)/g) * inv (mod sh/g)``, ``inv`` the inverse of
    ``dh/g`` modulo ``sh/g``, ``step = sh/g`` and ``dp = dh/g``.
    """

    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def P(self) -> int:
        return (self.H + 2 * self.padding[0] - self.dilation[0] * (self.R - 1) - 1) // self.stride[0] + 1

    @property
    def Q(self) -> int:
        return (self.W + 2 * self.padding[1] - self.dilation[1] * (self.S - 1) - 1) // self.stride[1] + 1

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.H, self.W, self.C)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.K, self.R, self.S, self.C)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.P, self.Q, self.K)

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the forward (the same for dgrad and wgrad)."""
        return 2 * self.N * self.P * self.Q * self.K * self.R * self.S * self.C

    @property
    def is_pointwise(self) -> bool:
        """1x1, stride 1, no padding: every conv-backward is a plain GEMM."""
        return (self.R, self.S) == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)

    @property
    def is_gemm_1x1(self) -> bool:
        """1x1 and unpadded (any stride): dgrad and wgrad are GEMMs over the pixels the filter touches,
        ``(n, p*sh, q*sw)`` -- for stride 1 all of them."""
        return (self.R, self.S) == (1, 1) and self.padding == (0, 0)

    def phase_params(self, axis: int) -> tuple[int, int, int, int]:
        """(g, step, dp, inv) of the stride-phase decomposition along ``axis`` (0: H, 1: W)."""
        s, d = self.stride[axis], self.dilation[axis]
        g = math.gcd(s, d)
        step, dp = s // g, d // g
        inv = pow(dp, -1, step) if step > 1 else 0
        return g, step, dp, inv

    def phase_taps(self, axis: int, a: int) -> tuple[int, int, int]:
        """(r0, n_taps, base) for residue ``a`` along ``axis`` (what the kernel computes in its prologue)."""
        g, step, dp, inv = self.phase_params(axis)
        c = a + self.padding[axis]
        R = self.R if axis == 0 else self.S
        if c % g:
            return 0, 0, 0
        r0 = ((c // g) * inv) % step
        n = max(0, -(-(R - r0) // step))
        return r0, n, (c - r0 * self.dilation[axis]) // self.stride[axis]


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
