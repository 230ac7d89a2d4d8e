"""Operators: validate -> choose a backend (with a stated reason) -> launch."""

from .cast import cast, choose_cast_backend, code_dtype, decode, encode
from .quantize import quantize

__all__ = ["cast", "encode", "decode", "quantize", "choose_cast_backend", "code_dtype"]
