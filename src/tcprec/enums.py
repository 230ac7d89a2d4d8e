"""The library's vocabularies, each defined once: rounding modes and backend names.

Both are ``str``-valued enums, so the strings users already pass keep working (``"nearest" ==
Rounding.NEAREST``, hash included) and a member can be passed wherever a string is taken.  The
kernels take a rounding mode as an integer (``Rounding.code``); the Triton kernels compare it with
constexpr names generated from this enum (``kernels/triton/round.py``: ``ROUND_NEAREST`` ...), never
with bare numbers.

>>> Rounding("up") is Rounding.UP, Rounding.UP == "up", Rounding.UP.code
(True, True, 3)
>>> Backend.TRITON in ("auto", "triton", "reference")
True
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Rounding", "Backend", "ROUNDING_MODES", "DETERMINISTIC_ROUNDINGS", "backend_names"]


class _StrEnum(str, Enum):
    """A str-valued enum that prints, formats and hashes as its value."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Rounding(_StrEnum):
    """How a value between two neighbours of a format is rounded."""

    NEAREST = "nearest"  # to the nearest value, ties to the even code
    STOCHASTIC = "stochastic"  # up with probability (distance to the lower neighbour) / (gap)
    TOWARD_ZERO = "toward_zero"
    UP = "up"  # toward +Inf
    DOWN = "down"  # toward -Inf
    NEAREST_AWAY = "nearest_away"  # to the nearest value, ties away from zero

    @property
    def code(self) -> int:
        """The integer the kernels take for this mode (their ``MODE`` argument)."""
        return _CODES[self]

    @property
    def deterministic(self) -> bool:
        return self is not Rounding.STOCHASTIC


# The kernels' integer for each mode: the deterministic ones 0..4, stochastic last.
_CODES = {Rounding.NEAREST: 0, Rounding.NEAREST_AWAY: 1, Rounding.TOWARD_ZERO: 2, Rounding.UP: 3, Rounding.DOWN: 4,
          Rounding.STOCHASTIC: 5}

# every mode, as the strings users pass (the public ``tcprec.ROUNDING_MODES``)
ROUNDING_MODES = tuple(r.value for r in Rounding)
# the modes whose result depends on the value alone (no random bits), in kernel-code order
DETERMINISTIC_ROUNDINGS = tuple(r.value for r in sorted(Rounding, key=lambda r: r.code) if r.deterministic)


class Backend(_StrEnum):
    """Where an op runs.  Each op accepts a subset (its ``BACKENDS``), always with ``AUTO`` (the op
    chooses and says why) and ``REFERENCE`` (the pure-torch ground truth, every device)."""

    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"  # a Triton kernel (CUDA, or the interpreter under TRITON_INTERPRET=1)
    BITSERIAL = "bitserial"  # the binary tensor-core GEMM (kernels/cuda/bmma_gemm.cu)
    INT8 = "int8"  # INT8 tensor cores
    FP8 = "fp8"  # float8 tensor cores
    TMA = "tma"  # conv wgrad: the TMA-box kernel
    FLAT = "flat"  # conv wgrad: the flat-shift kernel
    GEMM = "gemm"  # conv dgrad / wgrad: a GEMM + scatter
    FPROP = "fprop"  # conv dgrad as a forward convolution


def backend_names(*backends: Backend) -> tuple[str, ...]:
    """An op's accepted backends as the strings its errors list: ``backend_names(Backend.AUTO, ...)``."""
    return tuple(Backend(b).value for b in backends)
