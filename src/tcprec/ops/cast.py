"""cast: round a tensor to a format's values.  Element formats go through ``ops/codes.py`` (the fused
Triton kernel in ``kernels/triton/cast.py`` on CUDA tensors, or anywhere under ``TRITON_INTERPRET=1``;
the pure-torch ``kernels/reference.py`` on every device; both compute the same bits, stochastic
rounding included); MX block formats are ``quantize`` + ``dequantize``.
"""

from __future__ import annotations

import torch

from ..formats import BlockFormat, as_format
from .codes import cast_element, check_float_input, check_rounding, choose_cast_backend, code_dtype, decode, encode
from .quantize import quantize

__all__ = ["cast", "encode", "decode", "choose_cast_backend", "code_dtype"]


def cast(
    x: torch.Tensor,
    fmt,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt`` (one rounding from the float32/float64 bit pattern).

    Returns a tensor of x's dtype whose values are exactly representable in ``fmt``.  Round to
    nearest-even is bit-exact with ml_dtypes (and gfloat for custom formats).  NaN stays NaN
    (also for formats that have no NaN code: ``encode`` refuses those); Inf and overflow follow the
    format's ``specials`` and ``overflow``; -0 is kept where the format has it.

    ``rounding``: ``"nearest"`` (ties to even), ``"nearest_away"``, ``"toward_zero"``, ``"up"``
    (toward +Inf), ``"down"`` (toward -Inf), ``"stochastic"`` (unbiased; reproducible from
    ``generator``, or from torch's default generator).

    >>> import torch, tcprec as tp
    >>> tp.cast(torch.tensor([0.3, 500.0]), "e4m3")
    tensor([0.3125,    nan])
    """
    check_float_input(x, "cast")
    fmt = as_format(fmt)
    check_rounding(rounding)
    if isinstance(fmt, BlockFormat):
        return quantize(x, fmt, rounding=rounding, generator=generator).dequantize().to(x.dtype)
    return cast_element(x, fmt, rounding, generator, backend)
