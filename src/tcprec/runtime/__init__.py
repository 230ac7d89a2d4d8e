"""Runtime: graph-captured inference (``tcprec.compile``)."""

from .engine import Engine, compile  # noqa: A004

__all__ = ["Engine", "compile"]
