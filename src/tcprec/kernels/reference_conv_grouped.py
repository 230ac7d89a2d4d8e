"""Pure-torch reference of the grouped / depthwise quantized convolution (integer part exact, any device).

    C[n, p, q, k] = sum_{r, s, c < Cg} x[n, p*sh - pt + r*dh, q*sw - pl + s*dw, g(k)*Cg + c] * w[k, r, s, c]
    g(k) = k // (K / groups),  Cg = C / groups,  x = 0 outside the image (padding top/bottom/left/right)

x and w are integer *values* (decoded codes); the sums are exact: float32 ``F.conv2d`` (exact below 2**24, checked;
fast) or int64 elementwise ops one tap at a time (``grouped_conv_int_taps``, no integer matmul, which CUDA lacks).
Both are the oracle of the Triton kernel (``kernels/triton/conv_grouped.py``).  The epilogue is the dense conv's::

    y = act(float32(C) * col[k] + bias[k]),   col[k] = (x_scale * w_scale[k]) * scale[k]   (float32)

with act one of :data:`ACTS`; ``epilogue`` computes it in that order (one float32 multiply, one add).

FP8 (e4m3 x e4m3): x and w are the decoded float values; ``grouped_conv_f32`` sums in float32 in a fixed order,
taps row-major, then the channels of the group, one add each (``acc = 0; for r, s, c: acc += x * w``).  A product
of two e4m3 values has at most 8 significant bits, so every product is exact in float32 and only the adds round:
the Triton kernel sums in the same order, so its accumulator equals this one bit for bit (a GPU's fused
multiply-add rounds ``x * w + acc`` once, and with an exact product that is the same rounding).  Against the exact
sum ``C*``: ``|C - C*| <= (R*S*Cg) * 2**-24 * sum |x| |w|`` (docs/numerics.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_conv_int", "grouped_conv_int_taps", "grouped_conv_f32", "epilogue", "apply_act_ext", "ACTS", "output_size"]

# None | "relu" | ("leaky", slope) | ("clamp", lo, hi) (ReLU6 / hardtanh) | "hardswish" | "silu"
ACTS = ("relu", "leaky", "clamp", "hardswish", "silu")


def output_size(H: int, W: int, R: int, S: int, stride, pad4, dilation) -> tuple[int, int]:
    pt, pb, pl, pr = pad4
    P = (H + pt + pb - dilation[0] * (R - 1) - 1) // stride[0] + 1
    Q = (W + pl + pr - dilation[1] * (S - 1) - 1) // stride[1] + 1
    return P, Q


def grouped_conv_int(x: torch.Tensor, w: torch.Tensor, groups: int, stride=(1, 1), pad4=(0, 0, 0, 0),
                     dilation=(1, 1)) -> torch.Tensor:
    """x: integer values (N, H, W, C); w: integer values (K, R, S, C / groups) -> int64 (N, P, Q, K), exact.

    When max|x| * max|w| * R * S * Cg < 2**24 (8-bit depthwise 3x3: 255 * 128 * 9 < 2**19) every product and
    partial sum is an integer float32 holds exactly, so float32 ``F.conv2d`` with ``groups`` (the fast CPU path) is
    exact; otherwise :func:`grouped_conv_int_taps`, integer ops only (also the tests' oracle)."""
    K, R, S, Cg = w.shape
    bound = float(x.abs().max()) * float(w.abs().max()) * R * S * Cg if x.numel() and w.numel() else 0.0
    if bound >= 2.0 ** 24:
        return grouped_conv_int_taps(x, w, groups, stride, pad4, dilation)
    pt, pb, pl, pr = pad4
    xd = F.pad(x.to(torch.float32).permute(0, 3, 1, 2), (pl, pr, pt, pb))  # (N, C, H+pt+pb, W+pl+pr)
    wd = w.to(torch.float32).permute(0, 3, 1, 2)  # (K, Cg, R, S)
    y = F.conv2d(xd, wd, stride=stride, dilation=dilation, groups=groups)  # (N, K, P, Q)
    return y.round().to(torch.int64).permute(0, 2, 3, 1).contiguous()  # (N, P, Q, K)


def grouped_conv_int_taps(x: torch.Tensor, w: torch.Tensor, groups: int, stride=(1, 1), pad4=(0, 0, 0, 0),
                          dilation=(1, 1)) -> torch.Tensor:
    """:func:`grouped_conv_int` with int64 elementwise ops, one tap and one channel of the group at a time."""
    return _tap_sums(x.to(torch.int64), w.to(torch.int64), groups, stride, pad4, dilation)


def grouped_conv_f32(x: torch.Tensor, w: torch.Tensor, groups: int, stride=(1, 1), pad4=(0, 0, 0, 0),
                     dilation=(1, 1)) -> torch.Tensor:
    """x: float values (N, H, W, C), w: float values (K, R, S, C / groups), both exact in float32 (decoded e4m3)
    -> float32 (N, P, Q, K) summed in the kernel's order: taps row-major, then the group's channels (module doc).

    >>> x = torch.tensor([448.0, 2.0**-9, -448.0]).reshape(1, 1, 3, 1)   # e4m3 values
    >>> w = torch.tensor([448.0, 2.0**-9, 448.0]).reshape(1, 1, 3, 1)
    >>> grouped_conv_f32(x, w, 1).item()   # (448**2 + 2**-18) rounds to 448**2 in float32; the exact sum is 2**-18
    0.0
    """
    return _tap_sums(x.to(torch.float32), w.to(torch.float32), groups, stride, pad4, dilation)


def _tap_sums(x: torch.Tensor, w: torch.Tensor, groups: int, stride, pad4, dilation) -> torch.Tensor:
    """sum over taps (r, s) row-major, then c < Cg, of x * w, accumulated one add at a time in x's dtype."""
    N, H, W, C = x.shape
    K, R, S, Cg = w.shape
    if C != Cg * groups or K % groups:
        raise ValueError(f"grouped conv needs C == Cg * groups and K % groups == 0, got C={C}, Cg={Cg}, K={K}, "
                         f"groups={groups}")
    Kg = K // groups
    P, Q = output_size(H, W, R, S, stride, pad4, dilation)
    pt, pb, pl, pr = pad4
    xp = F.pad(x, (0, 0, pl, pr, pt, pb))  # (N, H+pt+pb, W+pl+pr, C), value 0 outside
    wv = w.reshape(groups, Kg, R, S, Cg)
    acc = torch.zeros(N, P, Q, groups, Kg, dtype=x.dtype, device=x.device)
    for r in range(R):
        for s in range(S):
            h0, w0 = r * dilation[0], s * dilation[1]
            tap = xp[:, h0: h0 + (P - 1) * stride[0] + 1: stride[0], w0: w0 + (Q - 1) * stride[1] + 1: stride[1]]
            tap = tap.reshape(N, P, Q, groups, Cg)  # (N, P, Q, G, Cg)
            for c in range(Cg):
                acc += tap[..., c: c + 1] * wv[:, :, r, s, c]  # (N, P, Q, G, 1) * (G, Kg)
    return acc.reshape(N, P, Q, K)


def apply_act_ext(y: torch.Tensor, act) -> torch.Tensor:
    """The activations of :data:`ACTS` on float32 ``y`` (relu / leaky as ``reference_conv_bitserial.apply_act``)."""
    if act is None:
        return y
    if act == "relu":
        return torch.where(y < 0, torch.zeros_like(y), y)
    if act == "hardswish":
        return F.hardswish(y)
    if act == "silu":
        return F.silu(y)
    if act[0] == "leaky":
        return torch.where(y < 0, y * float(act[1]), y)
    if act[0] == "clamp":
        return y.clamp(float(act[1]), float(act[2]))
    raise ValueError(f"act must be None or one of {ACTS}, got {act!r}")


def epilogue(C: torch.Tensor, col: torch.Tensor, bias: torch.Tensor | None, act) -> torch.Tensor:
    """float32 ``act(float32(C) * col + bias)`` over the last axis (K)."""
    y = C.to(torch.float32) * col
    if bias is not None:
        y = y + bias
    return apply_act_ext(y, act)
