"""Operators: validate -> choose a backend (with a stated reason) -> launch."""

from .cast import cast, choose_cast_backend, code_dtype, decode, encode
from .matmul import explain_matmul, matmul, matmul_packed
from .quantize import quantize

__all__ = ["cast", "encode", "decode", "quantize", "matmul", "matmul_packed", "explain_matmul",
           "choose_cast_backend", "code_dtype"]
