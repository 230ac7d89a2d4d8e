"""Operators: validate -> choose a backend (with a stated reason) -> launch."""

from .cast import cast, choose_cast_backend, code_dtype, decode, encode

__all__ = ["cast", "encode", "decode", "choose_cast_backend", "code_dtype"]
