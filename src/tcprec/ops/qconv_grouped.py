"""Grouped and depthwise quantized convolution (``groups > 1``): validate -> choose a backend (with its reason)
-> launch.

x: a ``QTensor`` of integer codes (N, H, W, C) with one scale (``intN`` / ``uintN``, <= 8 bits; ``Dense()`` codes or
the INT8 kernels' ``ShiftedInt8()`` operand, read as it is); w: a ``QTensor`` of
codes (K, R, S, C / groups), ``PerChannel(0)`` or ``PerTensor``, any <= 8-bit integer format.  The integer sums are
exact on both backends.  FP8: x and w both ``e4m3`` (``quantize_fp8_static``'s activation codes, the FP8 layers'
per-channel weights); the sums run in float32 in one stated order (taps row-major, then the group's channels), the
same bits on both backends (``kernels/reference_conv_grouped.grouped_conv_f32``; docs/numerics.md).  The epilogue
is the dense conv's (``ops.qconv``)::

    y = act(float32(C) * col[k] + bias[k]),  col[k] = (x_scale * w_scale[k]) * scale[k]

act: None, "relu", ("leaky", slope), ("clamp", lo, hi) (ReLU6, hardtanh), "hardswish", "silu".
Padding is four-sided ``(top, bottom, left, right)``: TensorFlow's "same" padding of a stride-2 conv is asymmetric.

Backends

* ``"triton"``: ``kernels/triton/conv_grouped.py``, a direct conv on the CUDA cores (int8 codes in, int32
  accumulate; or e4m3 codes in, float32 accumulate; the epilogue fused), chosen on CUDA and, when asked for, under TRITON_INTERPRET=1.  Depthwise convs
  are memory-bound and have no reduction for the tensor cores (C / groups = 1), so CUDA cores are the right units.
* ``"reference"``: ``kernels/reference_conv_grouped.py`` (pure torch, int64 elementwise; float32 for e4m3), any
  device.
"""

from __future__ import annotations

import torch

from ..formats import IntFormat, as_format
from ..memo import remembered
from ..kernels.triton import triton_usable
from ..kernels import reference_conv_grouped as rg
from ..kernels.reference_conv_bitserial import decode_values
from ..qtensor import Dense, QTensor, ShiftedInt8, int8_affine

_E4M3 = as_format("e4m3")
# The weights' decoded values and the column scales, by their source tensors (tcprec.memo, as ops.qconv's): a
# quantized layer passes the same buffers on every call; an in-place change (load_state_dict) derives them again.
_W_VALUES: dict = {}
_COL_SCALES: dict = {}

__all__ = ["grouped_conv2d", "choose_grouped_backend", "GROUPED_BACKENDS"]

GROUPED_BACKENDS = ("auto", "triton", "reference")


def choose_grouped_backend(device: torch.device, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for a grouped conv on ``device``; asking for ``"triton"`` where it cannot run raises."""
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"backend must be one of {GROUPED_BACKENDS} for a grouped conv, got {backend!r}")
    ok, why = triton_usable(torch.empty(0, device=device))
    if backend == "reference":
        return "reference", "asked for the reference backend"
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"backend='triton' cannot run the grouped conv: {why}; use backend='reference'")
        return "triton", f"Triton direct conv on the CUDA cores ({why})"
    if ok and device.type == "cuda":
        return "triton", "Triton direct conv on the CUDA cores (depthwise is memory-bound: no tensor-core reduction)"
    return "reference", f"pure-torch integer reference ({why})"


def _check(x, w, groups: int, pad4, act) -> bool:
    """Validate; True for the FP8 (e4m3 x e4m3) conv, False for integer codes."""
    if not isinstance(x, QTensor) or len(x.shape) != 4 or not isinstance(x.layout, (Dense, ShiftedInt8)):
        raise TypeError(f"x must be a QTensor of codes (N, H, W, C) in the Dense() or ShiftedInt8() layout, got "
                        f"{type(x).__name__}{f' in {x.layout!r}' if isinstance(x, QTensor) else ''}")
    if not isinstance(w, QTensor) or w.codes.dim() != 4:
        raise TypeError(f"w must be a QTensor of codes (K, R, S, C / groups), got {type(w).__name__}")
    fp8 = x.fmt == _E4M3 or w.fmt == _E4M3
    if fp8 and (x.fmt != _E4M3 or w.fmt != _E4M3):
        raise ValueError(f"the FP8 grouped conv takes e4m3 activations and e4m3 weights, got x {x.fmt}, w {w.fmt}; "
                         "quantize both to e4m3 (or both to integer formats)")
    if not fp8 and not isinstance(x.fmt, IntFormat):
        raise TypeError(f"x must be integer codes (intN / uintN) or e4m3 codes, got {x.fmt}")
    if not fp8 and (x.fmt.encoding not in ("twos", "unsigned") or x.fmt.bits > 8):
        raise ValueError(f"x must be intN / uintN of <= 8 bits, got {x.fmt}")
    if x.scale.numel() != 1:
        raise ValueError(f"x needs one (per-tensor) scale, got {x.scale.numel()}")
    if not fp8 and not isinstance(w.fmt, IntFormat):
        raise TypeError(f"w must be integer codes with integer x, got {w.fmt}")
    C, (K, _, _, Cg) = x.shape[3], w.codes.shape
    if not (isinstance(groups, int) and groups >= 1 and C == Cg * groups and K % groups == 0):
        raise ValueError(f"groups={groups!r} does not fit C={C} input channels, K={K} filters of {Cg} channels: "
                         "need C == groups * Cg and K % groups == 0")
    if len(pad4) != 4 or min(pad4) < 0:
        raise ValueError(f"padding must be four non-negative ints (top, bottom, left, right), got {pad4!r}")
    kind = act if act is None or isinstance(act, str) else act[0]
    if kind is not None and kind not in rg.ACTS:
        raise ValueError(f"act must be None or one of {rg.ACTS}, got {act!r}")
    return fp8


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 float8_e4m3fn bit patterns -> their float32 values (exact)."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def grouped_conv2d(x: QTensor, w: QTensor, *, groups: int, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1),
                   scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, act=None,
                   out_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """Grouped / depthwise conv of integer or e4m3 codes, NHWC in and out (module docstring).  ``out_dtype=torch.int32``
    (integer codes) returns the raw integer sums C.  The weights' decoded values and the column scales are remembered
    for their source tensors (tcprec.memo): a layer's buffers come back unchanged on every call.

    >>> import torch, tcprec as tp
    >>> x = tp.quantize(torch.ones(1, 3, 3, 2), "uint2", scale=1.0)
    >>> w = tp.quantize(torch.ones(2, 3, 3, 1), "int4", scale=1.0)
    >>> grouped_conv2d(x, w, groups=2, padding=(1, 1, 1, 1), out_dtype=torch.int32)[0, :, :, 0].tolist()
    [[4, 6, 4], [6, 9, 6], [4, 6, 4]]
    """
    fp8 = _check(x, w, groups, padding, act)
    if fp8 and out_dtype == torch.int32:
        raise ValueError("out_dtype=torch.int32 (the raw integer sums) needs integer codes; e4m3 sums are float32: "
                         "pass a float out_dtype")
    N, H, W, C = x.shape
    K, R, S, Cg = w.codes.shape
    P, Q = rg.output_size(H, W, R, S, stride, padding, dilation)
    name, _ = choose_grouped_backend(x.data.device, backend)

    def col_scales():  # (K,) x_scale * w_scale[k] * scale[k]
        w_scale = w.scale.reshape(-1).to(torch.float32).expand(K) if w.scale.numel() == 1 else w.scale.reshape(K)
        col = x.scale.reshape(()).to(torch.float32) * w_scale.to(torch.float32)
        return (col if scale is None else col * scale).contiguous()

    col = remembered(_COL_SCALES, (x.scale, w.scale) if scale is None else (x.scale, w.scale, scale), col_scales)
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    raw = out_dtype == torch.int32

    def values():  # (K, R, S, Cg) exact values; int16 for the Triton integer conv
        v = _e4m3_values(w.codes) if fp8 else decode_values(w.codes, w.fmt)
        return v.to(torch.int16).contiguous() if name == "triton" and not fp8 else v

    w_vals = remembered(_W_VALUES, (w.codes,), values, (name, str(w.fmt)))
    if name == "triton":
        from ..kernels.triton.conv_grouped import grouped_conv  # TRITON_INTERPRET is read at import

        if fp8:
            return grouped_conv(x.codes.contiguous(), 8, False, w_vals.contiguous(), groups, stride, padding,
                                dilation, P, Q, col=col, bias=bias, act=act, out_dtype=out_dtype, x_fp8=True)
        # the INT8 kernels' operand (what quantize_int8_static writes) is read as it is: value = off + step * x8
        shifted = isinstance(x.layout, ShiftedInt8)
        w_int8 = -128 <= w.fmt.min and w.fmt.max <= 127  # every weight value fits a byte (the dp4a path)
        return grouped_conv(x.data.contiguous() if shifted else x.codes.contiguous(), x.fmt.bits,
                            x.fmt.encoding == "twos", w_vals, groups, stride, padding,
                            dilation, P, Q, col=None if raw else col, bias=bias, act=act, out_dtype=out_dtype,
                            x_affine=int8_affine(x.fmt) if shifted else None, w_int8=w_int8)
    if fp8:
        acc = rg.grouped_conv_f32(_e4m3_values(x.codes), w_vals, groups, stride, padding, dilation)
        return rg.epilogue(acc, col, bias, act).to(out_dtype)
    acc = rg.grouped_conv_int(decode_values(x.codes, x.fmt), w_vals, groups, stride, padding, dilation)
    if raw:
        return acc.to(torch.int32)
    return rg.epilogue(acc, col, bias, act).to(out_dtype)
