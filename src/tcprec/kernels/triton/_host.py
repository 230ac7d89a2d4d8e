"""Host-side helpers for the Triton launch code.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr-function wrappers that cost 2-3 us a call in
Python (triton 3.6 and 3.9), and the launch paths called them dozens of times per op (the TMA wgrad box
chooser alone ~90 times): host time an eager call pays before its kernel starts (the TMA wgrad wrapper went
from ~500 to ~85 us with its launches stubbed, CPU).  Launch code uses these plain versions; kernels keep
``tl.cdiv``.
"""

from __future__ import annotations

import os

__all__ = ["cdiv", "next_power_of_2", "interpreting"]


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (Triton's CPU interpreter: no inline PTX, one small tile)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0.

    >>> cdiv(7, 2), cdiv(8, 2), cdiv(0, 5)
    (4, 4, 0)
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1).

    >>> next_power_of_2(1), next_power_of_2(5), next_power_of_2(64)
    (1, 8, 64)
    """
    return 1 << max(0, int(n) - 1).bit_length()
