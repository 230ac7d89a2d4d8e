"""Names for the integers the CUDA kernels take as ``-D`` defines and arguments, one enum per vocabulary, with the
values the ``.cu`` sources name the same way (``constexpr int EPI_PACKED = 2`` & co.).  The launchers pass
``int(member)``, so the defines -- and the cubin cache keys made from them -- are the integers they always were.

>>> Encoding.of("pm1"), int(Epilogue.PACKED), int(OutType.of("bfloat16"))
(<Encoding.PM1: 2>, 2, 2)
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Encoding", "Epilogue", "OutType", "Act"]


class Encoding(IntEnum):
    """How an OB-bit output code is stored (``TCP_OENC``; ``codes.cuh``'s ``ENC_*``): an ``IntFormat``'s encoding."""

    TWOS = 0
    UNSIGNED = 1
    PM1 = 2

    @classmethod
    def of(cls, encoding: str) -> "Encoding":
        """The member of an ``IntFormat.encoding`` string ("twos", "unsigned", "pm1")."""
        try:
            return cls[encoding.upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"encoding must be one of {[m.name.lower() for m in cls]}, got {encoding!r}") from None


class Epilogue(IntEnum):
    """What the bit-serial GEMM writes (``TCP_EPI``; ``bmma_gemm.cu``'s ``EPI_*``): raw int32 sums, the scaled float
    output, or the packed bit planes of the next layer's codes."""

    INT32 = 0
    FLOAT = 1
    PACKED = 2

    @classmethod
    def of(cls, name: str) -> "Epilogue":
        """The member of ``bmma_gemm.EPILOGUES``' names ("int32", "float", "packed")."""
        try:
            return cls[name.upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"epilogue must be one of {[m.name.lower() for m in cls]}, got {name!r}") from None


class OutType(IntEnum):
    """A float output's dtype (``bmma_gemm.cu``'s ``TCP_OUT_T`` / ``OUT_F*``; ``stem_conv.cu``'s ``TCP_FOUT`` /
    ``FOUT_F16`` / ``FOUT_BF16``, where 0 means no float output: that kernel has no float32 one)."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2

    @classmethod
    def of(cls, name: str) -> "OutType":
        """The member of a dtype name ("float32", "float16", "bfloat16")."""
        try:
            return cls[name.upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"out_dtype must be one of {[m.name.lower() for m in cls]}, got {name!r}") from None


class Act(IntEnum):
    """``stem_conv``'s activation argument (``stem_conv.cu``'s ``ACT_*``)."""

    NONE = 0
    RELU = 1
    LEAKY = 2
