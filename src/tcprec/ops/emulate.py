"""Emulated GEMM with a custom accumulator: validate, choose a backend (with a stated reason), launch.

Backends: ``"triton"`` (kernels/triton/emulate_gemm.py, on CUDA tensors or under TRITON_INTERPRET=1)
and ``"reference"`` (kernels/reference_emulate.py, pure torch, every device).  Both compute the
same bits in ``fma`` mode; in ``chunk`` mode they share the model but the fp32 partial sum of a
chunk is the backend's own (tensor-core order vs torch.matmul): equal bits whenever those partial
sums are exact, otherwise within chunk * 2**-24 relative per chunk.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat, as_format
from ..kernels import reference_emulate as ref_em
from ..kernels.triton import choose_backend, triton_usable
from .cast import cast
from .codes import check_float_input, check_rounding

__all__ = ["matmul", "explain_matmul", "MODES"]

MODES = ("fma", "chunk")


def _fits(fmt, dtype: torch.dtype) -> bool:
    """Every value of ``fmt`` is exactly a value of the 16-bit float ``dtype``: enough significand
    bits, range, and a finest quantum no finer than dtype's smallest subnormal."""
    if not isinstance(fmt, FloatFormat):
        return False
    d = as_format(dtype)  # the tcprec preset of float16 / bfloat16
    return fmt.man <= d.man and fmt.max <= d.max and fmt.min_subnormal >= d.min_subnormal


def _check(a, b, acc_fmt, mode, chunk, kahan):
    check_float_input(a, "emulate.matmul")
    check_float_input(b, "emulate.matmul")
    if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"emulate.matmul takes a (..., K) and b (K, N), got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"emulate.matmul needs a and b on one device, got a on {a.device} and b on {b.device}; "
                         f"move one, e.g. b.to({str(a.device)!r})")
    if acc_fmt is None:
        raise TypeError("emulate.matmul needs acc_fmt=, the accumulator format (e.g. acc_fmt='e5m10')")
    acc_fmt = as_format(acc_fmt)
    if not isinstance(acc_fmt, FloatFormat):
        raise TypeError(f"acc_fmt must be a float format, got {acc_fmt}; integer accumulation is exact: use tcprec.matmul")
    if acc_fmt.man > 23:  # pragma: no cover - FloatFormat allows up to 23
        raise ValueError(f"acc_fmt {acc_fmt} is wider than float32")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")
    if mode == "chunk" and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got chunk={chunk!r}")
    if not isinstance(kahan, bool):
        raise TypeError(f"kahan must be a bool, got {kahan!r}")
    return acc_fmt


def _choose(a, acc_fmt, rounding, mode, chunk, backend) -> tuple[str, str]:
    name, why = choose_backend(a, backend, f"Triton emulated-accumulator GEMM ({mode} mode)")
    if name == "triton" or (backend == "auto" and triton_usable(a)[0]):
        try:
            from ..kernels.triton.emulate_gemm import can_implement
        except Exception as e:  # pragma: no cover - triton missing
            cannot = f"triton kernels unavailable ({e})"
        else:
            cannot = can_implement(acc_fmt, rounding, mode, chunk)
        if cannot is not None:
            if backend == "triton":
                raise ValueError(f"backend='triton' cannot run this emulated GEMM: {cannot}; use backend='reference'")
            return "reference", f"pure-torch reference: {cannot}"
    return name, why


def explain_matmul(a, b, *, a_fmt=None, b_fmt=None, acc_fmt=None, mode="fma", chunk=32, kahan=False,
                   rounding="nearest", backend="auto") -> str:
    """Which backend ``emulate.matmul`` would use for these arguments, and why."""
    acc_fmt = _check(a, b, acc_fmt, mode, chunk, kahan)
    name, why = _choose(a, acc_fmt, rounding, mode, chunk, backend)
    return f"{name}: {why}"


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_fmt=None,
    b_fmt=None,
    acc_fmt,
    mode: str = "fma",
    chunk: int = 32,
    kahan: bool = False,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``a @ b`` with the accumulator held in ``acc_fmt`` (float32 result, every value in acc_fmt).

    Operands are first rounded to ``a_fmt`` / ``b_fmt`` (when given), then

    * ``mode="fma"``: each product and each addition rounded once (exactly) to ``acc_fmt``, in order
      along K (CPD's model); ``kahan=True`` adds Kahan compensation, also in ``acc_fmt``.
    * ``mode="chunk"``: fp32 partial sums of ``chunk`` consecutive k (tensor cores on a GPU), the
      running accumulator rounded to ``acc_fmt`` after each chunk (narrow hardware accumulators).

    ``rounding`` applies to every rounding (``stochastic`` runs on the reference backend).

    >>> import torch, tcprec as tp
    >>> a = torch.full((1, 4096), 1.0); b = torch.full((4096, 1), 1.0)
    >>> tp.emulate.matmul(a, b, acc_fmt="e5m10")          # 1 + 1 + ... stalls at 2**(man+1)
    tensor([[2048.]])
    >>> tp.emulate.matmul(a, b, acc_fmt="e5m10", kahan=True)
    tensor([[4096.]])
    """
    acc_fmt = _check(a, b, acc_fmt, mode, chunk, kahan)
    check_rounding(rounding)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1]).float()  # (M, K)
    b2 = b.float()
    if a_fmt is not None:
        a2 = cast(a2, a_fmt, rounding, generator)
    if b_fmt is not None:
        b2 = cast(b2, b_fmt, rounding, generator)
    name, _ = _choose(a2, acc_fmt, rounding, mode, chunk, backend)
    if name == "triton":
        from ..kernels.triton import emulate_gemm as tk  # lazy: imports Triton, whose jit reads TRITON_INTERPRET

        if mode == "fma":
            a_eff = as_format(a_fmt) if a_fmt is not None else None
            b_eff = as_format(b_fmt) if b_fmt is not None else None
            out = tk.matmul(a2.contiguous(), b2.contiguous(), acc_fmt, "fma", kahan=kahan, rounding=rounding,
                            exact_product=tk.product_is_exact(a_eff, b_eff),
                            product_on_acc_grid=tk.product_on_grid(a_eff, b_eff, acc_fmt))
        else:
            dt = torch.float32
            for cand in (torch.bfloat16, torch.float16):  # exact 16-bit copies run on tensor cores
                if all(f is not None and _fits(as_format(f), cand) for f in (a_fmt, b_fmt)):
                    dt = cand
                    break
            out = tk.matmul(a2.to(dt).contiguous(), b2.to(dt).contiguous(), acc_fmt, "chunk", chunk=chunk,
                            kahan=kahan, rounding=rounding)
    elif mode == "fma":
        out = ref_em.matmul_fma(a2, b2, acc_fmt, rounding, kahan, generator)
    else:
        out = ref_em.matmul_chunk(a2, b2, acc_fmt, chunk, rounding, kahan, generator)
    return out.reshape(*lead, b.shape[1])
