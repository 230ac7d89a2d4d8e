"""The geometry of a 2-D convolution in NHWC, and the activation codes, shared by every convolution
reference (``reference_conv_bwd``, ``reference_conv_int8_fp8``, ``reference_conv_bitserial``) and
kernel.

Layouts: activations ``(N, H, W, C)``, weights KRSC ``(K, R, S, C)``, output ``(N, P, Q, K)``; the
forward is ``y[n,p,q,k] = sum_{r,s,c} x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * w[k,r,s,c]``
(zero padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ConvGeometry", "pair", "ACT_NONE", "ACT_RELU", "ACT_LEAKY"]

# the activation after a convolution, as the kernels take it (a run-time or constexpr integer)
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
