"""Triton kernels (run on CUDA, or on the CPU under TRITON_INTERPRET=1).

``choose_backend`` is the one place that decides between a Triton kernel and the pure-torch
reference, and says why; the ops call it with their kernel's name.
"""

from __future__ import annotations

import torch

from ...enums import Backend, backend_names
from ...env import INSTALL_CUDA
from ._host import interpreting

BACKENDS = backend_names(Backend.AUTO, Backend.TRITON, Backend.REFERENCE)


def triton_usable(t: torch.Tensor) -> tuple[bool, str]:
    """(usable, reason): Triton runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - triton is a Linux dependency
        return False, f"triton is not importable ({type(e).__name__}: {e}); {INSTALL_CUDA}"
    if t.is_cuda:
        return True, "CUDA tensor"
    if interpreting():
        return True, "TRITON_INTERPRET=1: Triton's interpreter"
    return False, f"tensor on {t.device.type}: Triton needs a CUDA tensor or TRITON_INTERPRET=1"


def choose_backend(t: torch.Tensor, backend: str = "auto", kernel: str = "Triton kernel") -> tuple[str, str]:
    """(backend, reason) for running ``kernel`` on ``t``: ``"triton"`` on CUDA tensors (or when asked
    for and the interpreter is on), ``"reference"`` otherwise.  Never falls back silently: asking for
    ``"triton"`` where it cannot run raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    if backend == "reference":
        return "reference", "asked for the reference backend"
    ok, why = triton_usable(t)
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"backend='triton' cannot run the {kernel}: {why}; use backend='reference' or a CUDA tensor")
        return "triton", f"{kernel}, {why}"
    if ok and t.is_cuda:
        return "triton", f"{kernel}, {why}"
    return "reference", f"pure-torch reference; {why}" if not ok else "pure-torch reference on CPU"
