"""Operators: validate -> choose a backend (with a stated reason) -> launch."""

from .cast import cast, choose_cast_backend, code_dtype, decode, encode
from .conv import (
    conv2d_dgrad,
    conv2d_wgrad,
    explain_conv2d_dgrad,
    explain_conv2d_wgrad,
    prepare_fp8_dgrad,
    prepare_fp8_wgrad,
    to_fp8,
)
from .matmul import explain_matmul, matmul, matmul_packed
from .quantize import quantize

__all__ = ["cast", "encode", "decode", "quantize", "matmul", "matmul_packed", "explain_matmul",
           "conv2d_dgrad", "conv2d_wgrad", "explain_conv2d_dgrad", "explain_conv2d_wgrad", "to_fp8",
           "prepare_fp8_dgrad", "prepare_fp8_wgrad", "choose_cast_backend", "code_dtype"]
