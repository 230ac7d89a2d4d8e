"""encode / decode of element formats and the checks the ops share: validate, choose a backend (with a
stated reason), launch.  ``tcprec.ops.cast`` builds ``cast`` on these (and on ``quantize`` for MX
block formats).  cast / encode / decode run as ``torch.library`` custom ops (``tcprec::cast``, ``::encode``,
``::decode``), so torch.compile and torch.export treat them as opaque calls (as are ``::quantize``,
``::dequantize``, ``::matmul``, ``::conv2d_dgrad`` and ``::conv2d_wgrad``: docs/ARCHITECTURE.md).

Backends: ``"triton"`` (the fused elementwise kernel in ``kernels/triton/cast.py``; on CUDA tensors,
or anywhere under ``TRITON_INTERPRET=1``) and ``"reference"`` (pure torch, ``kernels/reference.py``, with
``kernels/fast_cast.py``'s int32 route for float32 input: the same bits; every device).  Both compute the same
bits, stochastic rounding included.
"""

from __future__ import annotations

import torch

from ..formats import ROUNDING_MODES, BlockFormat, FloatFormat, IntFormat, as_format
from ..kernels import fast_cast
from ..kernels import reference as ref
from ..kernels.reference import code_dtype
from ..kernels.triton import choose_backend

__all__ = ["encode", "decode", "choose_cast_backend", "code_dtype", "check_float_input", "check_rounding",
           "cast_element", "check_code_range"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def choose_cast_backend(x: torch.Tensor, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for casting ``x``."""
    return choose_backend(x, backend, "fused Triton cast kernel")


def check_float_input(x, fn: str) -> None:
    """TypeError unless x is a float32/float16/bfloat16/float64 tensor (shared by the ops)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}() expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{fn}() takes a floating tensor of dtype float32, float16, bfloat16 or float64, got dtype={x.dtype}; "
            "convert with x.float() first"
        )


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got rounding={rounding!r}")


def _seed_from(generator: torch.Generator | None, rounding: str) -> int | None:
    if rounding != "stochastic":
        return None
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


def _compute_dtype(x: torch.Tensor, fmt) -> torch.dtype:
    """float64 stays float64; the 16-bit types are widened (exactly) to float32."""
    if x.dtype == torch.float64:
        return torch.float64
    if x.dtype in (torch.float16, torch.bfloat16) and isinstance(fmt, FloatFormat):
        limit = torch.finfo(x.dtype).max
        if fmt.max > limit:
            raise ValueError(
                f"cast of a {x.dtype} tensor to {fmt}: {fmt} reaches {fmt.max:.4g}, beyond {x.dtype}'s max "
                f"{limit:.4g}, so a result could not be stored in {x.dtype}; cast x.float() instead"
            )
    return torch.float32


def cast_element(x: torch.Tensor, fmt: IntFormat | FloatFormat, rounding: str,
                 generator: torch.Generator | None, backend: str) -> torch.Tensor:
    """``tcprec.cast`` for an element format, after its checks (``x`` checked, ``fmt`` an IntFormat
    or FloatFormat, ``rounding`` checked)."""
    cdt = _compute_dtype(x, fmt)
    seed = _seed_from(generator, rounding)
    name, _ = choose_cast_backend(x, backend)
    y = torch.ops.tcprec.cast(x.to(cdt), str(fmt), rounding, -1 if seed is None else seed, name)
    return y.to(x.dtype)


# torch.library custom ops: torch.compile / torch.export see cast, encode and decode as opaque calls
# (Inductor would otherwise trace the int32 bit manipulation, and fails on it on the CPU); the fake
# implementations give shape and dtype on every device.  Formats travel as their names (str(fmt)
# round-trips through as_format), seed -1 means "not stochastic".


@torch.library.custom_op("tcprec::cast", mutates_args=())
def _cast_op(x: torch.Tensor, fmt: str, rounding: str, seed: int, backend: str) -> torch.Tensor:
    f, sd = as_format(fmt), (None if seed < 0 else seed)
    if backend == "triton":
        from ..kernels.triton import cast as tcast  # lazy: imports Triton, whose jit reads TRITON_INTERPRET

        return tcast.cast(x, f, rounding, sd)
    if x.dtype == torch.float32 and fast_cast.supports(f) is None:  # same bits as reference.py, int32 ops
        return fast_cast.cast(x, f, rounding, sd)
    return (ref.cast_int if isinstance(f, IntFormat) else ref.cast_float)(x, f, rounding, sd)


@_cast_op.register_fake
def _(x, fmt, rounding, seed, backend):
    return torch.empty_like(x)


@torch.library.custom_op("tcprec::encode", mutates_args=())
def _encode_op(x: torch.Tensor, fmt: str, rounding: str, seed: int, backend: str) -> torch.Tensor:
    return _encode_codes(x, as_format(fmt), rounding, None if seed < 0 else seed, backend)


@_encode_op.register_fake
def _(x, fmt, rounding, seed, backend):
    return torch.empty_like(x, dtype=code_dtype(as_format(fmt)))


@torch.library.custom_op("tcprec::decode", mutates_args=())
def _decode_op(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    f = as_format(fmt)
    check_code_range(codes, f)
    return ref.decode_int(codes, f) if isinstance(f, IntFormat) else ref.decode_float(codes, f)


@_decode_op.register_fake
def _(codes, fmt):
    return torch.empty_like(codes, dtype=torch.float32)


def encode(
    x: torch.Tensor,
    fmt,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return its codes (bit patterns): uint8 for formats of up to 8 bits,
    int16 up to 16 bits, int32 above.  Integer formats give the b-bit two's complement pattern
    (``twos``) or the code index (``unsigned``, ``pm1``: value = 2*code - (2**bits - 1)).

    Raises ``ValueError`` if ``x`` holds NaN and ``fmt`` has no NaN code (integers, fp6, fp4).
    """
    check_float_input(x, "encode")
    fmt = as_format(fmt)
    check_rounding(rounding)
    if isinstance(fmt, BlockFormat):
        raise TypeError(f"encode() takes an element format; for {fmt} use tcprec.quantize(x, {str(fmt)!r})")
    cdt = _compute_dtype(x, fmt)
    seed = _seed_from(generator, rounding)
    name, _ = choose_cast_backend(x, backend)
    return torch.ops.tcprec.encode(x.to(cdt), str(fmt), rounding, -1 if seed is None else seed, name)


def _encode_codes(xc: torch.Tensor, fmt, rounding: str, seed: int | None, name: str) -> torch.Tensor:
    """encode's body (inside the custom op): codes in code_dtype(fmt), or the codeless-NaN error."""
    x = xc
    if name == "triton":
        from ..kernels.triton import cast as tcast  # lazy: imports Triton, whose jit reads TRITON_INTERPRET

        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        codes = tcast.encode(xc, fmt, rounding, seed, out_dtype=code_dtype(fmt), nan_flag=flag)
        has_codeless_nan = not fmt.has_nan and bool(flag.item())  # set inside the kernel, no extra pass
    else:
        if xc.dtype == torch.float32 and fast_cast.supports(fmt) is None:  # same bits, int32 ops
            fn = fast_cast.encode
        else:
            fn = ref.encode_int if isinstance(fmt, IntFormat) else ref.encode_float
        codes = fn(xc, fmt, rounding, seed)
        has_codeless_nan = not fmt.has_nan and bool((codes == -1).any())
    if has_codeless_nan:
        n = int(torch.isnan(x).sum())
        raise ValueError(
            f"x holds {n} NaN value(s) but {fmt} has no NaN code; remove them (torch.nan_to_num) or pick a "
            "format with NaN (e.g. float8_e4m3fn)"
        )
    dt = code_dtype(fmt)
    if codes.dtype != dt:
        if dt != torch.uint8:  # keep the bit pattern: wrap into the signed storage type
            width = torch.iinfo(dt).bits
            codes = torch.where(codes >= (1 << (width - 1)), codes - (1 << width), codes)
        codes = codes.to(dt)
    return codes


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    """Codes (as produced by ``encode``) -> float32 values."""
    fmt = as_format(fmt)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"decode() expects a torch.Tensor of codes, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"decode() takes integer codes, got dtype={codes.dtype}; codes come from tcprec.encode")
    if isinstance(fmt, BlockFormat):
        raise TypeError(f"decode() takes an element format; a {fmt} tensor is a QTensor: call .dequantize()")
    return torch.ops.tcprec.decode(codes, str(fmt))  # checks the code range inside (no graph break)


def check_code_range(codes: torch.Tensor, fmt) -> None:
    """ValueError unless every code is a bit pattern of fmt: 0 .. 2**bits - 1, or, in a signed
    dtype of exactly fmt.bits bits (encode's int16 / int32 storage), the same pattern read as
    signed.  A code outside is not wrapped: it names a value fmt does not have."""
    if codes.numel() == 0:
        return
    lo_ok, hi_ok = 0, fmt.n_codes - 1
    if codes.dtype.is_signed and torch.iinfo(codes.dtype).bits == fmt.bits:
        lo_ok = -(1 << (fmt.bits - 1))
    lo, hi = int(codes.min()), int(codes.max())
    if lo >= lo_ok and hi <= hi_ok:
        return
    bad = lo if lo < lo_ok else hi
    raise ValueError(
        f"decode(): code {bad} is outside {fmt}'s {fmt.bits}-bit codes {lo_ok}..{hi_ok}; pass the codes "
        f"tcprec.encode(x, {str(fmt)!r}) returns, or keep the low bits yourself (codes & {hi_ok:#x}) if "
        "they are wider bit patterns"
    )
