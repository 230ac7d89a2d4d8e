"""Pure-torch references for the INT8 / FP8 forward convolution kernels (``kernels/triton/conv_fwd.py``),
NHWC, any device.

Layouts are those of ``conv_geometry.py``: x ``(N, H, W, C)``, w ``(K, R, S, C)``, y ``(N, P, Q, K)``.

The accumulator
---------------
* int8: ``acc[n,p,q,k] = sum_{r,s,c} x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c] * w[k,r,s,c]`` exactly,
  as int64.  ``F.conv2d`` in float64 on the integer codes is exact here: every product is below 2**14
  and every partial sum below 2**53 for reductions up to 2**39 terms.
* fp8: the same sum of the fp8 values, in float64 (the kernel accumulates in fp32).

The epilogue (the kernel computes exactly these float32 operations, in this order, with no fused
multiply-add, so the int8 path is bit-exact)
-----------------------------------------------------------------------------------------------
::

    a  = float32(acc)                               # int32 -> float32, round to nearest even
    s  = (alpha * sa[k]) * sb[k]                    # alpha: a Python float; sa, sb: per-tensor or per-channel
    y  = a * s + bias[k]                            # two roundings (a product, then a sum)
    y  = float32(dt(float32(dt(y)) + float32(res))) # with a residual of dtype dt (a ResNet block's shortcut):
                                                    # the unfused graph's conv output in dt, one add, stored in dt
    y  = act(y)                                     # apply_act: relu, leaky, clamp, hardswish, silu (below)
    out: y rounded to float16 / float32, or
         int8: clamp(round_half_even(q / out_scale), lo, hi) - offset   (IEEE float32 division; NaN -> 0;
               (lo, hi, offset) = (-128, 127, 0) unless given: Int8Out); q = y, or float32(dt(y)) with a
               residual (the sum in the network's dtype, as the unfused graph quantizes it), or
         fp8 ("e4m3" / "e5m2"): float8(clamp(q / out_scale, -max, max)), rounded to nearest even (IEEE float32
               division; NaN stays NaN: quantize_fp8_static's codes), q as for int8 -- the next FP8 layer's input, or
         both (out_int8): y rounded to the float dtype, and the int8 (or, with ("e4m3" | "e5m2", out_scale), the
               float8) codes of that rounded value (q = it)

int8 convs pass ``scale`` as ``alpha`` (a float) or ``sb`` (a tensor); fp8 convs pass ``x_scale`` and
``w_scale`` (floats go into ``alpha``, tensors into ``sa`` / ``sb``).

The activations (:func:`parse_act`, :func:`apply_act`; float32, no fused multiply-add, bounds and constants rounded
to float32 once)
------------------------------------------------------------------------------------------------------------
::

    None                 y
    "relu"               y > 0 ? y : 0                                  (NaN -> 0)
    ("leaky", a)         y > 0 ? y : y * a                              ("leaky" alone: a = 0.1)
    ("clamp", lo, hi)    t = y > lo ? y : lo;  t < hi ? t : hi          (ReLU6 = ("clamp", 0.0, 6.0), hardtanh;
                                                                         = min(max(y, lo), hi); NaN -> lo)
    "hardswish"          t = y + 3;  t = t > 0 ? t : 0;  t = t < 6 ? t : 6;  y * (t * SIXTH)
                                                                        (SIXTH = float32(1/6): no division)
    "silu"               y / (1 + exp(-y))                              (IEEE division)

Each is a fixed sequence of IEEE float32 operations, which the kernel repeats bit for bit -- but SiLU's ``exp``, which
no two libraries round alike: the Triton kernel under the interpreter (NumPy's float32 ``exp``) agrees with
:func:`apply_act` (torch's ``exp``) within 6 * 2^-23 relative (tests/test_conv_fwd_act.py), on the GPU (``ex2.approx``
of the rounded product ``-y * log2(e)``) within (|y| + 8) * 2^-23 (tests/gpu/test_conv_fwd_gpu.py).  Clamp is torch's
``hardtanh`` bit for bit; hardswish and SiLU are within 2 ulp of torch's (another operation order, another ``exp``).
The encodings are the grouped conv's (``kernels/triton/conv_grouped.ACT_CODES``: the same codes).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .conv_geometry import ACT_LEAKY, ACT_NONE, ACT_RELU, pair

# The activations beyond ReLU / LeakyReLU (conv_geometry's, shared with the backward): codes of the forward epilogue
# only, equal to the grouped conv's (kernels/triton/conv_grouped.ACT_CODES)
ACT_CLAMP, ACT_HARDSWISH, ACT_SILU = 3, 4, 5
# hardswish's 1/6 as the float32 both the kernel and apply_act multiply by (a division would round differently)
HARDSWISH_SIXTH = float(torch.tensor(1 / 6, dtype=torch.float32))

__all__ = [
    "ACT_NONE",
    "ACT_RELU",
    "ACT_LEAKY",
    "ACT_CLAMP",
    "ACT_HARDSWISH",
    "ACT_SILU",
    "HARDSWISH_SIXTH",
    "ACTS_TEXT",
    "parse_act",
    "act_monotone",
    "apply_act",
    "parse_out",
    "Int8Out",
    "Fp8Out",
    "FP8_KINDS",
    "channel_chunks",
    "conv_acc",
    "abs_conv_acc",
    "epilogue",
    "conv2d_fwd_int8",
    "conv2d_fwd_fp8",
]

_OUT_FLOATS = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
FP8_KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # out=(kind, out_scale): float8 codes


ACTS_TEXT = ("None, 'relu', 'leaky', ('leaky', slope), ('clamp', lo, hi) (ReLU6: ('clamp', 0.0, 6.0)), "
             "'hardswish' or 'silu'")


def _finite_f32(v) -> float | None:
    """A real number rounded to float32 (what a kernel's float32 argument holds), or None when ``v`` is not a number
    or not finite in float32."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    try:
        f = float(torch.tensor(float(v), dtype=torch.float32))
    except (OverflowError, RuntimeError):
        return None
    return f if math.isfinite(f) else None


def parse_act(act) -> tuple[int, float, float]:
    """``(mode, a, b)`` of an activation (module docstring): ``(ACT_NONE, 0, 0)`` for ``None``, ``(ACT_RELU, 0, 0)``
    for ``"relu"``, ``(ACT_LEAKY, slope, 0)`` for ``("leaky", slope)`` (also spelled ``"leaky_relu"``; a bare
    ``"leaky"`` means slope 0.1, YOLO's), ``(ACT_CLAMP, lo, hi)`` for ``("clamp", lo, hi)`` (ReLU6, hardtanh; finite
    float32 bounds, lo < hi), ``(ACT_HARDSWISH, 0, 0)`` for ``"hardswish"``, ``(ACT_SILU, 0, 0)`` for ``"silu"``;
    a and b are float32 values.

    >>> parse_act(("clamp", 0, 6))
    (3, 0.0, 6.0)
    """
    if act is None:
        return ACT_NONE, 0.0, 0.0
    if isinstance(act, str):
        named = {"relu": (ACT_RELU, 0.0, 0.0), "leaky": (ACT_LEAKY, _finite_f32(0.1), 0.0),
                 "leaky_relu": (ACT_LEAKY, _finite_f32(0.1), 0.0), "hardswish": (ACT_HARDSWISH, 0.0, 0.0),
                 "silu": (ACT_SILU, 0.0, 0.0)}
        if act in named:
            return named[act]
    elif isinstance(act, (tuple, list)) and len(act) == 2 and act[0] in ("leaky", "leaky_relu"):
        slope = _finite_f32(act[1])
        if slope is None:
            raise ValueError(f"the LeakyReLU slope must be a finite number, got {act[1]!r}")
        return ACT_LEAKY, slope, 0.0
    elif isinstance(act, (tuple, list)) and len(act) == 3 and act[0] == "clamp":
        lo, hi = _finite_f32(act[1]), _finite_f32(act[2])
        if lo is None or hi is None or not lo < hi:
            raise ValueError(f"act=('clamp', lo, hi) needs finite float32 numbers lo < hi (ReLU6 is ('clamp', 0.0, "
                             f"6.0), hardtanh ('clamp', -1.0, 1.0)), got lo={act[1]!r}, hi={act[2]!r}")
        return ACT_CLAMP, lo, hi
    raise ValueError(f"act must be {ACTS_TEXT}, got {act!r}")


def act_monotone(act) -> bool:
    """Whether ``act`` is non-decreasing (``parse_act``'s forms): None, ReLU, LeakyReLU with slope >= 0 and clamp
    are; hardswish (its minimum is at -1.5) and SiLU (at about -1.28) are not, nor is a negative slope.  An epilogue
    that max-pools accumulators before the activation (``conv_fwd.PlanesOut(pool=2)``) needs a monotone one.

    >>> act_monotone(("clamp", 0.0, 6.0)), act_monotone("silu")
    (True, False)
    """
    mode, a, _ = parse_act(act)
    return mode in (ACT_NONE, ACT_RELU, ACT_CLAMP) or (mode == ACT_LEAKY and a >= 0)


def apply_act(y: torch.Tensor, act) -> torch.Tensor:
    """``act`` (``parse_act``'s forms) on float32 ``y``: the kernels' float32 operations in their order (module
    docstring) -- bit for bit what conv_fwd's epilogue computes, but for SiLU's ``exp``.

    >>> apply_act(torch.tensor([-4.0, -1.0, 0.5, 7.0]), ("clamp", 0.0, 6.0)).tolist()
    [0.0, 0.0, 0.5, 6.0]
    >>> apply_act(torch.tensor([-4.0, -1.5, 3.0]), "hardswish").tolist()
    [-0.0, -0.375, 3.0]
    """
    mode, a, b = parse_act(act)
    if mode == ACT_NONE:
        return y
    dev = y.device

    def f32(v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32, device=dev)

    if mode == ACT_RELU:
        return torch.where(y > 0, y, f32(0.0))
    if mode == ACT_LEAKY:
        return torch.where(y > 0, y, y * f32(a))
    if mode == ACT_CLAMP:
        lo, hi = f32(a), f32(b)
        t = torch.where(y > lo, y, lo)
        return torch.where(t < hi, t, hi)
    if mode == ACT_HARDSWISH:
        t = y + f32(3.0)
        t = torch.where(t > 0, t, f32(0.0))
        t = torch.where(t < 6, t, f32(6.0))
        return y * (t * f32(HARDSWISH_SIXTH))
    return y / (f32(1.0) + torch.exp(-y))  # ACT_SILU


class Int8Out(NamedTuple):
    """The int8 output of a conv epilogue: stored ``clamp(round_half_even(y / scale), lo, hi) - offset``.
    ``scale`` is a Python float or a one-element float32 tensor on the conv's device (no host sync: CUDA-graph
    capturable); (lo, hi, offset) = (-128, 127, 0) is plain int8, (0, 255, 128) a uint8 code stored shifted
    (the INT8 conv's operand for the next layer, ``tcprec.ops.qconv``), (0, 2**b - 1, 0) a uintb code."""

    scale: object
    lo: int = -128
    hi: int = 127
    offset: int = 0


class Fp8Out(NamedTuple):
    """The float8 output of a conv epilogue (``out=("e4m3", out_scale)`` or ``("e5m2", out_scale)``): stored
    ``float8(clamp(y / scale, -max, max))``, round to nearest even, NaN stays NaN -- ``quantize_fp8_static``'s codes,
    the next FP8 layer's input.  ``scale`` as :class:`Int8Out`'s; ``dtype`` the torch float8 dtype."""

    scale: object
    dtype: torch.dtype


def _check_out_scale(out):
    """out[1] of ``(kind, out_scale, ...)``: a finite number > 0 (as a float) or a one-element float32 tensor."""
    s, kind = out[1], out[0]
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise ValueError(f"out=({kind!r}, out_scale): a tensor out_scale must be one float32 element, got "
                             f"{s.dtype} of shape {tuple(s.shape)}")
        return s
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not (math.isfinite(s) and s > 0):
        raise ValueError(f"out=({kind!r}, out_scale) needs a finite out_scale > 0 (a Python number or a one-element "
                         f"float32 tensor), got {s!r}")
    return float(s)


def _check_int8_out(out) -> Int8Out:
    s = _check_out_scale(out)
    if len(out) == 2:
        return Int8Out(s)
    rng = out[2]
    ok = (isinstance(rng, (tuple, list)) and len(rng) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    for v in rng))
    if not ok or not (rng[0] < rng[1] and -128 <= rng[0] - rng[2] and rng[1] - rng[2] <= 127):
        raise ValueError(f"out=('int8', out_scale, (lo, hi, offset)) needs integers lo < hi with lo - offset >= -128 "
                         f"and hi - offset <= 127 (stored = code - offset is an int8), got {rng!r}")
    return Int8Out(s, *rng)


def parse_out(out, allowed: tuple[str, ...]) -> tuple[str, object]:
    """(kind, spec) from ``"float16"``, ``"float32"``, ``"bfloat16"``, ``"int32"`` (spec 1.0) or
    ``("int8", out_scale)`` / ``("int8", out_scale, (lo, hi, offset))`` (spec an :class:`Int8Out`);
    ``("e4m3", out_scale)`` / ``("e5m2", out_scale)`` (spec an :class:`Fp8Out`); ``allowed`` lists the kinds this
    conv offers."""
    if isinstance(out, (tuple, list)) and len(out) in (2, 3) and out[0] == "int8" and "int8" in allowed:
        return "int8", _check_int8_out(out)
    if isinstance(out, (tuple, list)) and len(out) == 2 and out[0] in FP8_KINDS and out[0] in allowed:
        return out[0], Fp8Out(_check_out_scale(out), FP8_KINDS[out[0]])
    if isinstance(out, str) and out in allowed and out != "int8" and out not in FP8_KINDS:
        return out, 1.0
    shown = [f"('int8', out_scale[, (lo, hi, offset)])" if a == "int8" else f"({a!r}, out_scale)" if a in FP8_KINDS
             else repr(a) for a in allowed]
    raise ValueError(f"out must be one of {', '.join(shown)}, got {out!r}")


def _nchw(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64).permute(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)


# Weight elements a float64 reference convolution decodes at a time.  The decoded (K, C, R, S) weight costs 8 bytes an
# element, and its decode ~32 with the integer temporaries (reference_conv_bitserial.decode_values): for a whole layer
# that was 3.3 GB for VGG-11's fc6 (102M weights) on the first CPU forward, 6x the whole float model.  Output channels
# are independent and every sum is exact in float64 (module docstring), so a chunk of channels at a time gives the same
# values; 4M elements keep the temporaries near 150 MB.
_DECODE_ELEMENTS = 1 << 22


def channel_chunks(w: torch.Tensor) -> list[tuple[int, int]]:
    """``(k0, k1)`` ranges of ``w``'s output channels (axis 0) of at most ``_DECODE_ELEMENTS`` elements each (one
    channel at least)."""
    K = w.shape[0]
    step = max(1, _DECODE_ELEMENTS // max(1, w[0].numel())) if K else 1
    return [(k, min(K, k + step)) for k in range(0, K, step)]


def conv_acc(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """The accumulator (N, P, Q, K): int64 for integer codes (exact), float64 for float inputs; the weight decoded
    to float64 a chunk of output channels at a time (``channel_chunks``).

    >>> x = torch.arange(9, dtype=torch.int8).reshape(1, 3, 3, 1)
    >>> conv_acc(x, torch.ones(1, 2, 2, 1, dtype=torch.int8))[..., 0]
    tensor([[[ 8, 12],
             [20, 24]]])
    """
    xn = _nchw(x)
    geo = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    out = None
    for k0, k1 in channel_chunks(w) or [(0, 0)]:  # (a weight of no output channel: one empty conv)
        y = F.conv2d(xn, _nchw(w[k0:k1]), None, *geo).permute(0, 2, 3, 1)  # (N, K, P, Q) -> (N, P, Q, K)
        if not x.dtype.is_floating_point:
            y = torch.round(y).to(torch.int64)
        if out is None:
            if k1 == w.shape[0]:
                return y  # (one chunk: the whole layer)
            out = torch.empty((*y.shape[:3], w.shape[0]), dtype=y.dtype, device=y.device)
        out[..., k0:k1] = y
    return out


def abs_conv_acc(x, w, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """``sum |x| |w|`` over each output's terms (float64): the scale of the fp8 error bound."""
    return F.conv2d(_nchw(x).abs(), _nchw(w).abs(), None, pair(stride, "stride"), pair(padding, "padding"),
                    pair(dilation, "dilation")).permute(0, 2, 3, 1)


def _f32(v, K: int, device) -> torch.Tensor:
    """A float32 per-channel vector (K,) from None (1), a number or a tensor of 1 or K elements."""
    if v is None:
        return torch.ones(K, dtype=torch.float32, device=device)
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).to(device=device, dtype=torch.float32).expand(K)
    return torch.full((K,), float(v), dtype=torch.float32, device=device)


def _int8_codes(y: torch.Tensor, o: Int8Out) -> torch.Tensor:
    """float32 y -> stored int8 ``clamp(round_half_even(y / scale), lo, hi) - offset`` (NaN -> 0)."""
    dev = y.device
    s_out = o.scale.reshape(()) if isinstance(o.scale, torch.Tensor) else torch.tensor(o.scale, dtype=torch.float32,
                                                                                      device=dev)
    q = torch.nan_to_num(y / s_out, nan=0.0)  # NaN -> 0, as the kernel
    return (torch.round(q.clamp(float(o.lo), float(o.hi))) - o.offset).to(torch.int8)  # round: half to even


def _fp8_codes(y: torch.Tensor, o: Fp8Out) -> torch.Tensor:
    """float32 y -> float8 ``clamp(y / scale, -max, max)`` rounded to nearest even (NaN stays NaN)."""
    s_out = o.scale.reshape(()) if isinstance(o.scale, torch.Tensor) else torch.tensor(o.scale, dtype=torch.float32,
                                                                                      device=y.device)
    m = float(torch.finfo(o.dtype).max)
    return torch.clamp(y / s_out.to(y.device), -m, m).to(o.dtype)  # saturate first: .to(float8) overflows to NaN


def epilogue(acc: torch.Tensor, *, alpha: float = 1.0, sa=None, sb=None, bias=None, act=None,
             out="float32", residual: torch.Tensor | None = None, out_int8=None):
    """The kernels' epilogue on an accumulator (N, P, Q, K), in the kernels' float32 operation order
    (module docstring); ``(y, y8)`` with ``out_int8`` (the dual output)."""
    parse_act(act)  # (validated before anything is computed)
    kind, out_scale = parse_out(out, ("float16", "float32", "bfloat16", "int8", *FP8_KINDS))
    o8 = None if out_int8 is None else parse_out(out_int8, ("int8", *FP8_KINDS))[1]
    if o8 is not None and kind not in _OUT_FLOATS:
        raise ValueError(f"out_int8 writes int8 / float8 codes beside a float output; out must be a float kind, got {out!r}")
    K, dev = acc.shape[-1], acc.device
    a = acc.to(torch.float32)  # int64 -> float32 rounds to nearest even, as the kernel's int32 -> float32
    s = (torch.tensor(alpha, dtype=torch.float32, device=dev) * _f32(sa, K, dev)) * _f32(sb, K, dev)
    y = a * s
    if bias is not None:
        y = y + bias.reshape(-1).to(device=dev, dtype=torch.float32)
    if residual is not None:  # the branch in the residual's dtype, one float32 add, the sum in that dtype
        y = y.to(residual.dtype).to(torch.float32) + residual.to(device=dev, dtype=torch.float32)
        y = y.to(residual.dtype).to(torch.float32)  # the sum as the unfused add stores it
    y = apply_act(y, act)
    if kind == "int8" or kind in FP8_KINDS:
        q = y if residual is None else y.to(residual.dtype).to(torch.float32)
        return _int8_codes(q, out_scale) if kind == "int8" else _fp8_codes(q, out_scale)
    y_out = y.to(_OUT_FLOATS[kind])
    if o8 is None:
        return y_out
    q = y_out.to(torch.float32)
    return y_out, (_fp8_codes(q, o8) if isinstance(o8, Fp8Out) else _int8_codes(q, o8))


def _split_scale(v) -> tuple[float, torch.Tensor | None]:
    return (1.0, v) if isinstance(v, torch.Tensor) else (1.0 if v is None else float(v), None)


def conv2d_fwd_int8(x, w, *, stride=1, padding=0, dilation=1, scale=None, bias=None, act=None,
                    out="float16", acc_mul: int = 1, acc_add: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, out_int8=None, acc_add_interior: bool = False):
    """Reference of :func:`tcprec.kernels.triton.conv_fwd.conv2d_fwd_int8` (same arguments): with
    ``acc_add`` (int32 (K,) or (P, Q, K)) the accumulator is ``acc * acc_mul + acc_add`` in int64;
    ``residual`` / ``out_int8`` as :func:`epilogue`."""
    kind, _ = parse_out(out, ("float16", "float32", "bfloat16", "int32", "int8", *FP8_KINDS))
    acc = conv_acc(x, w, stride, padding, dilation)
    if acc_add is not None:
        acc = acc * int(acc_mul) + acc_add.to(device=acc.device, dtype=torch.int64)  # (N, P, Q, K) + (P, Q, K) / (K,)
    if kind == "int32":
        if residual is not None or out_int8 is not None:
            raise ValueError("residual and out_int8 need the float epilogue; out='int32' returns the raw accumulator")
        return acc.to(torch.int32)
    alpha, sb = _split_scale(scale)
    return epilogue(acc, alpha=alpha, sb=sb, bias=bias, act=act, out=out, residual=residual, out_int8=out_int8)


def conv2d_fwd_fp8(x, w, x_scale=1.0, w_scale=1.0, *, stride=1, padding=0, dilation=1, bias=None, act=None,
                   out="float16", residual: torch.Tensor | None = None, out_int8=None):
    """Reference of :func:`tcprec.kernels.triton.conv_fwd.conv2d_fwd_fp8`: the float64 sum rounded
    once to float32 (the kernel's fp32 accumulation differs by rounding), then the epilogue."""
    acc = conv_acc(x, w, stride, padding, dilation)
    a1, sa = _split_scale(x_scale)
    a2, sb = _split_scale(w_scale)
    alpha = float(torch.tensor(a1, dtype=torch.float32) * torch.tensor(a2, dtype=torch.float32))
    return epilogue(acc, alpha=alpha, sa=sa, sb=sb, bias=bias, act=act, out=out, residual=residual, out_int8=out_int8)
