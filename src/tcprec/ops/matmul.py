"""matmul of quantized integer tensors: validate -> choose a backend (with a stated reason) -> launch.

``matmul(a, w)`` computes ``decode(a) @ decode(w).T`` for ``QTensor`` operands of integer formats
(1..8 bits each; two's complement, unsigned or pm1), ``w`` shaped ``(N, K)`` like an
``nn.Linear`` weight and ``a`` shaped ``(*lead, K)``.  The integer part is exact on every backend;
the scales, bias and ReLU follow in one fused float epilogue.

Backends

* ``"bitserial"`` -- the binary tensor-core kernel (``kernels/cuda/bmma_gemm.cu``): p*q binary
  GEMMs with AND+popc over bit planes (APNN-TC).  Each binary MMA (AND+popc, k = 256 bits) runs at 8x
  the INT8 rate on Hopper, so it wins while p*q < 8.
* ``"int8"`` -- ``torch._int_mm`` on the INT8 tensor cores (cuBLAS), for p*q >= 8.  Every integer
  format of <= 8 bits fits int8 after an affine shift (uint8 and pm8 are stored as x - 128), whose
  correction terms are the same as pm1's (``kernels/reference_gemm.py``).
* ``"reference"`` -- the pure-torch bit-serial algorithm (``kernels/reference_gemm.py``); CPU, or
  any device when asked for.

INT4 MMA and XOR+popc are emulated on Hopper and are never used.

``matmul`` and ``matmul_packed`` run as the custom op ``tcprec::matmul`` on the codes and the per-row /
per-column scales (the QTensors are checked and unpacked outside it), so torch.compile and torch.export see
one opaque call.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..enums import Backend, backend_names
from ..formats import IntFormat, as_format
from ..kernels import reference_gemm as rg
from ..packing import pack_bitplanes, packed_words
from ..qtensor import PerChannel, PerTensor, QTensor

__all__ = ["matmul", "matmul_packed", "explain_matmul", "choose_matmul_backend", "choose_int_backend", "BACKENDS"]

BACKENDS = backend_names(Backend.AUTO, Backend.BITSERIAL, Backend.INT8, Backend.REFERENCE)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
_KIND = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int32: "int32"}
_INT32_LIMIT = 1 << 31


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _int_format(x, name: str) -> IntFormat:
    if not isinstance(x, QTensor):
        raise TypeError(
            f"matmul() takes QTensor operands (tcprec.quantize(x, 'int2', ...)), got {name} of type {type(x).__name__}"
        )
    fmt = x.fmt
    if not isinstance(fmt, IntFormat):
        raise TypeError(
            f"matmul() multiplies integer formats on the binary / INT8 tensor cores, but {name} is {fmt} "
            f"({type(fmt).__name__}); quantize {name} to an integer format instead (e.g. 'int4', 'uint2', 'binary')"
        )
    if not 1 <= fmt.bits <= 8:  # IntFormat enforces this; kept as a guard for hand-built records
        raise ValueError(f"bits must be 1..8 for matmul, got {name} with bits={fmt.bits}")
    return fmt


def _check_operands(a, w) -> tuple[IntFormat, IntFormat, int, int, int]:
    fa, fw = _int_format(a, "a"), _int_format(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K) like an nn.Linear weight, got shape {w.shape}")
    if a.ndim < 1:
        raise ValueError("a must have at least one dimension (its last is K), got a 0-d QTensor")
    K, N = a.shape[-1], w.shape[0]
    if w.shape[1] != K:
        raise ValueError(
            f"K mismatch: a has K={K} (last dim of {a.shape}) but w has K={w.shape[1]} (dim 1 of {w.shape}); "
            "w is (N, K) like an nn.Linear weight (transpose it if it is (K, N))"
        )
    if a.device != w.device:
        raise ValueError(f"a is on {a.device} but w is on {w.device}; move both to one device (qt.to(device))")
    M = 1
    for d in a.shape[:-1]:
        M *= d
    bound = K * max(abs(fa.min), abs(fa.max)) * max(abs(fw.min), abs(fw.max))
    if bound >= _INT32_LIMIT:
        raise ValueError(
            f"K={K} with {fa} x {fw} can reach |C| = {bound} >= 2^31, beyond the tensor cores' int32 accumulator; "
            "split K into chunks and add the partial results in float"
        )
    return fa, fw, M, K, N


def _row_scale(a: QTensor, M: int) -> torch.Tensor:
    """a's scale as one float32 per output row (M,): PerTensor, or PerChannel along a leading dim."""
    g = a.granularity
    if isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis < a.ndim - 1):
        return a.scale.expand(*a.shape[:-1], 1).reshape(M).contiguous()
    raise ValueError(
        f"a's scale is {g}: matmul applies scales after the integer product, so a needs one scale per row "
        "(PerTensor() or PerChannel(axis) on a leading axis); a scale along K (the last axis) cannot be pulled out "
        "of the sum -- requantize a, or use out_dtype=torch.int32 for the raw integer product"
    )


def _col_scale(w: QTensor, N: int) -> torch.Tensor:
    g = w.granularity
    if isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis == 0):
        return w.scale.expand(N, 1).reshape(N).contiguous()
    raise ValueError(
        f"w's scale is {g}: matmul needs one scale per output channel, PerTensor() or PerChannel(0) on the (N, K) "
        "weight; a scale along K cannot be pulled out of the sum -- requantize w, or use out_dtype=torch.int32"
    )


def _check_bias(bias, N: int, device) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        raise TypeError(f"bias must be a floating torch.Tensor of shape ({N},), got {type(bias).__name__}"
                        + (f" of dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else ""))
    if tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape ({N},) (one per output channel), got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but the operands are on {device}")
    return bias.to(torch.float32).contiguous()


# ------------------------------------------------------------------------------------------------
# Backend choice
# ------------------------------------------------------------------------------------------------


def _bitserial_usable(device: torch.device) -> tuple[bool, str]:
    from ..kernels.cuda import bmma_gemm as bg

    return bg.can_run(device)


def choose_matmul_backend(a: QTensor, w: QTensor, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for ``matmul(a, w)``; raises if a forced backend cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    fa, fw, M, K, N = _check_operands(a, w)
    return choose_int_backend(fa, fw, a.device, backend)


def choose_int_backend(fa: IntFormat, fw: IntFormat, dev: torch.device, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for an integer product of ``fa`` activations and ``fw`` weights on ``dev``:
    the one rule of ``matmul`` (and of ``tcprec.ops.qconv.conv2d``): bit-serial while p*q < 8,
    INT8 tensor cores otherwise, the reference off CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    usable = _bitserial_usable(dev) if backend in ("auto", "bitserial") else (False, "not asked")
    return int_backend_rule(fa, fw, dev, usable, backend)


def int_backend_rule(fa: IntFormat, fw: IntFormat, dev: torch.device, bitserial_usable: tuple[bool, str],
                     backend: str = "auto") -> tuple[str, str]:
    """:func:`choose_int_backend` given whether the binary kernel can run on ``dev`` (``bmma_gemm.can_run``'s
    answer): no device query, so a planner can decide for a device it describes (``ops/qconv_plan.DeviceCaps``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    p, q = fa.bits, fw.bits
    pq = f"{fa} activations x {fw} weights: p*q = {p}*{q} = {p * q} binary GEMMs"
    if backend == "reference":
        return "reference", f"asked for the pure-torch bit-serial reference ({pq}, on {dev})"
    if backend == "int8":
        if dev.type != "cuda" and not hasattr(torch, "_int_mm"):
            raise RuntimeError("backend='int8' needs torch._int_mm")
        return "int8", f"asked for the INT8 path (torch._int_mm on {dev}; {pq} would cost {p * q}/8 of INT8's time)"
    ok, why = bitserial_usable
    if backend == "bitserial":
        if not ok:
            raise RuntimeError(f"backend='bitserial' cannot run: {why}; move a and w to a CUDA device, or use "
                               "backend='reference' (CPU) / 'auto'")
        return "bitserial", f"asked for the binary tensor-core kernel ({pq}; {why})"
    if dev.type != "cuda":
        return "reference", f"tensors on {dev.type}: pure-torch bit-serial reference, same integers as the GPU ({pq})"
    if not ok:
        return "int8", f"binary kernel unavailable ({why}): INT8 tensor cores via torch._int_mm ({pq})"
    if p * q < 8:
        return "bitserial", (
            f"{pq} < 8: each binary MMA (BMMA AND.POPC) runs at 8x the INT8 rate, so about {8 / (p * q):.2g}x INT8's "
            f"peak; {why}"
        )
    return "int8", (
        f"{pq} >= 8: the binary path would reach only {8 / (p * q):.2g}x INT8's peak, so INT8 tensor cores "
        "(torch._int_mm; every <= 8-bit integer fits int8 after an affine shift)"
    )


def explain_matmul(a: QTensor, w: QTensor, *, backend: str = "auto") -> str:
    """Which backend ``matmul(a, w)`` runs and why, in one line.

    >>> import torch, tcprec as tp
    >>> qa = tp.quantize(torch.randn(4, 64), "int2"); qw = tp.quantize(torch.randn(8, 64), "binary")
    >>> tp.explain_matmul(qa, qw).split(":")[0]
    'reference'
    """
    name, why = choose_matmul_backend(a, w, backend)
    fa, fw, M, K, N = _check_operands(a, w)
    detail = ""
    if name == "bitserial":
        from ..kernels.cuda import bmma_gemm as bg

        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        tile = bg.pick_tile(fa.bits, fw.bits, fa.encoding == "twos", fw.encoding == "twos", M, N, sms,
                                kw=packed_words(K))
        detail = f"; tile {tile}"
    return f"{name}: {why}; M={M} N={N} K={K}{detail}"


# ------------------------------------------------------------------------------------------------
# Integer products per backend: (C int32 (M, N))
# ------------------------------------------------------------------------------------------------


def _planes(x: QTensor, rows: int, K: int) -> torch.Tensor:
    codes = x.codes.reshape(rows, K)  # (rows, K) uint8 code patterns
    return pack_bitplanes(codes, x.fmt.bits, validate=False)  # (bits, rows, Kw) int32


def _terms32(a_planes, w_planes, K, fa, fw):
    ss, row_term, col_term = rg.corrections(a_planes, w_planes, K, fa, fw)
    cast = (lambda t: None if t is None else t.to(torch.int32).contiguous())
    return ss, cast(row_term), cast(col_term)


def _int8_operand(x: QTensor, rows: int, K: int) -> tuple[torch.Tensor, int, int]:
    """(x8 int8 (rows, K), offset, step) with value = offset + step * x8."""
    fmt = x.fmt
    b = fmt.bits
    c = x.codes.reshape(rows, K).to(torch.int16)  # (rows, K) code patterns / indices
    if fmt.encoding == "twos":
        return (c - ((c >> (b - 1)) << b)).to(torch.int8), 0, 1
    if b <= 7:  # unsigned 0..127, pm1 -127..127: the values fit int8 as they are
        v = c if fmt.encoding == "unsigned" else 2 * c - ((1 << b) - 1)
        return v.to(torch.int8), 0, 1
    # 8 bits: store u - 128; uint8 = 128 + x8, pm8 = 2u - 255 = 1 + 2 * x8
    return (c - 128).to(torch.int8), (128 if fmt.encoding == "unsigned" else 1), (1 if fmt.encoding == "unsigned" else 2)


def _int8_product(a: QTensor, w: QTensor, M: int, K: int, N: int) -> torch.Tensor:
    a8, oa, sa = _int8_operand(a, M, K)
    w8, ow, sw = _int8_operand(w, N, K)
    # torch._int_mm: M > 16, K and N multiples of 8 (cuBLAS); zero padding adds nothing
    Mp, Kp, Np = max(M, 17), -(-K // 8) * 8, -(-N // 8) * 8
    a8p = torch.nn.functional.pad(a8, (0, Kp - K, 0, Mp - M))  # (Mp, Kp)
    w8p = torch.nn.functional.pad(w8, (0, Kp - K, 0, Np - N))  # (Np, Kp)
    X = torch._int_mm(a8p, w8p.t())[:M, :N].to(torch.int64)  # (M, N) sum_k x8a x8w
    C = sa * sw * X
    if ow:
        C += (sa * ow * a8.sum(1, dtype=torch.int64) + K * oa * ow)[:, None]
    if oa:
        C += (oa * sw * w8.sum(1, dtype=torch.int64))[None, :]
    return C.to(torch.int32)


def _reference_product(a: QTensor, w: QTensor, M: int, K: int, N: int, fa, fw) -> torch.Tensor:
    return rg.bitserial_matmul(_planes(a, M, K), _planes(w, N, K), K, fa, fw).to(torch.int32)


def _bitserial(a: QTensor, w: QTensor, M, K, N, fa, fw, *, out_kind, row_scale=None, col_scale=None, bias=None,
               relu=False, out_fmt: IntFormat | None = None, out_scale=None, tile: str = "", leaky_slope: float = 0.0):
    # leaky_slope (with relu=True): y < 0 -> leaky_slope * y in the fused epilogue (LeakyReLU); 0 is ReLU
    from ..kernels.cuda import bmma_gemm as bg  # (registers torch.ops.tcprec.bmma_gemm)

    a_planes, w_planes = _planes(a, M, K), _planes(w, N, K)
    ss, row_term, col_term = _terms32(a_planes, w_planes, K, fa, fw)
    return bg.gemm_entry()(
        a_planes, w_planes, fa.encoding == "twos", fw.encoding == "twos", ss, row_term, col_term,
        row_scale, col_scale, bias, bool(relu), out_kind,
        out_fmt.bits if out_fmt is not None else 1, out_fmt.encoding if out_fmt is not None else "unsigned",
        out_scale, tile, float(leaky_slope),
    )


# ------------------------------------------------------------------------------------------------
# Public operators
# ------------------------------------------------------------------------------------------------


def matmul(a: QTensor, w: QTensor, *, out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
           relu: bool = False, backend: str = "auto", tile: str = "") -> torch.Tensor:
    """``dequantize(a) @ dequantize(w).T`` for integer-format QTensors, integer part exact.

    a: ``(*lead, K)``; w: ``(N, K)`` (an nn.Linear weight); result ``(*lead, N)``.

    * ``out_dtype=torch.int32``: the exact integer product ``decode(a.codes) @ decode(w.codes).T``
      (no scales; ``bias`` and ``relu`` are not allowed).
    * float ``out_dtype`` (float32, float16, bfloat16): ``((C * a_scale[row]) * w_scale[n]) + bias``,
      then ReLU if ``relu``, rounded once per step in float32 and once into ``out_dtype``.  a's scale
      must be PerTensor or PerChannel on a leading axis, w's PerTensor or PerChannel(0).

    ``backend``: ``"auto"`` (see :func:`explain_matmul`), ``"bitserial"``, ``"int8"``, ``"reference"``.
    ``tile`` (bitserial only): force a kernel tile such as ``"64x256_w2x4_s4"`` (tuning).

    >>> import torch, tcprec as tp
    >>> qa = tp.quantize(torch.tensor([[1.0, -1.0, 0.5]]), "int2")
    >>> qw = tp.quantize(torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 1.0]]), "binary")
    >>> tp.matmul(qa, qw, out_dtype=torch.int32).tolist()
    [[0, 2]]
    """
    name, _ = choose_matmul_backend(a, w, backend)
    fa, fw, M, K, N = _check_operands(a, w)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    lead = a.shape[:-1]
    if out_dtype == torch.int32:
        if bias is not None or relu:
            raise ValueError("bias and relu apply to the scaled float result; pass a float out_dtype "
                             "(out_dtype=torch.int32 returns the raw integer product)")
        row_scale = col_scale = None
    else:
        row_scale, col_scale = _row_scale(a, M), _col_scale(w, N)
    bias = _check_bias(bias, N, a.device)
    y = torch.ops.tcprec.matmul(a.codes.reshape(M, K), w.codes, str(fa), str(fw), row_scale, col_scale, bias,
                                bool(relu), out_dtype, "", None, name, tile)  # (M, N)
    return y.reshape(*lead, N)


def matmul_packed(a: QTensor, w: QTensor, out_fmt, out_scale, *, bias: torch.Tensor | None = None,
                  relu: bool = False, backend: str = "auto", tile: str = "") -> torch.Tensor:
    """``matmul`` whose float result is re-quantized to ``out_fmt`` and returned as bit planes,
    the next layer's A operand: int32 ``(bits, *lead, packed_words(N))``, equal bit for bit to
    ``pack_bitplanes(encode(clamp(y / out_scale), out_fmt))`` with ``y = matmul(a, w, bias=bias,
    relu=relu)``.  No float tensor is materialised on the bit-serial backend.

    ``out_scale``: a positive float or a one-element float tensor (per-tensor scale of the output).
    """
    out_fmt = as_format(out_fmt)
    if not isinstance(out_fmt, IntFormat):
        raise TypeError(f"out_fmt must be an integer format (the next layer's activations), got {out_fmt}")
    name, _ = choose_matmul_backend(a, w, backend)
    fa, fw, M, K, N = _check_operands(a, w)
    if isinstance(out_scale, torch.Tensor):
        s = out_scale.to(device=a.device, dtype=torch.float32).reshape(-1)
        if s.numel() != 1:
            raise ValueError(f"out_scale must be one finite positive number, got {out_scale!r}")
    else:
        v = float(out_scale)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"out_scale must be one finite positive number, got {out_scale!r}")
        s = torch.full((1,), v, dtype=torch.float32, device=a.device)  # a fill, no host copy
    row_scale, col_scale = _row_scale(a, M), _col_scale(w, N)
    bias = _check_bias(bias, N, a.device)
    planes = torch.ops.tcprec.matmul(a.codes.reshape(M, K), w.codes, str(fa), str(fw), row_scale, col_scale, bias,
                                     bool(relu), torch.float32, str(out_fmt), s, name, tile)  # (bits, M, Kw)
    return planes.reshape(out_fmt.bits, *a.shape[:-1], packed_words(N))


# torch.library custom op: torch.compile / torch.export see matmul and matmul_packed as one opaque call on the
# codes (a (M, K), w (N, K)) and the per-row / per-column scales; the wrappers above validate the QTensors and
# reshape.  out_fmt "" is matmul (result (M, N) in out_dtype), an integer format's name is matmul_packed (its bit
# planes (bits, M, packed_words(N)) int32).


class _Codes(NamedTuple):
    """The two fields of a QTensor the integer products read."""

    codes: torch.Tensor
    fmt: IntFormat


@torch.library.custom_op("tcprec::matmul", mutates_args=())
def _matmul_op(a_codes: torch.Tensor, w_codes: torch.Tensor, fa: str, fw: str, row_scale: Optional[torch.Tensor],
               col_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
               out_fmt: str, out_scale: Optional[torch.Tensor], backend: str, tile: str) -> torch.Tensor:
    fa_, fw_ = as_format(fa), as_format(fw)
    a, w = _Codes(a_codes, fa_), _Codes(w_codes, fw_)
    (M, K), N = a_codes.shape, w_codes.shape[0]
    ofmt = as_format(out_fmt) if out_fmt else None
    if ofmt is not None:
        capturing = out_scale.is_cuda and torch.cuda.is_current_stream_capturing()
        # (no sync inside CUDA-graph capture)
        if not capturing and not bool(torch.isfinite(out_scale).all() and (out_scale > 0).all()):
            raise ValueError(f"out_scale must be one finite positive number, got {out_scale!r}")
    if backend == "bitserial":
        kind = "packed" if ofmt is not None else _KIND[out_dtype]
        return _bitserial(a, w, M, K, N, fa_, fw_, out_kind=kind, row_scale=row_scale, col_scale=col_scale,
                          bias=bias, relu=relu, out_fmt=ofmt, out_scale=out_scale, tile=tile)
    C = _int8_product(a, w, M, K, N) if backend == "int8" else _reference_product(a, w, M, K, N, fa_, fw_)
    if ofmt is not None:
        return rg.pack_output(rg.float_epilogue(C, row_scale, col_scale, bias, relu, torch.float32), ofmt, out_scale)
    if out_dtype == torch.int32:
        return C
    return rg.float_epilogue(C, row_scale, col_scale, bias, relu, out_dtype)


@_matmul_op.register_fake
def _(a_codes, w_codes, fa, fw, row_scale, col_scale, bias, relu, out_dtype, out_fmt, out_scale, backend, tile):
    M, N = a_codes.shape[0], w_codes.shape[0]
    if out_fmt:
        return a_codes.new_empty((as_format(out_fmt).bits, M, packed_words(N)), dtype=torch.int32)
    return a_codes.new_empty((M, N), dtype=out_dtype)
