"""Values derived from tensors that come back unchanged on every call (a quantized network's calibrated buffers),
remembered by the source tensors' storage -- each one's base tensor (checked alive through a weak reference), view
and version counter -- so an in-place change (load_state_dict, fill_) derives the value again.  Inference tensors
have no version counter and are never remembered.  Used by the ops (checked scales, column scales) and the kernel
launchers (the packed epilogues' threshold words)."""

from __future__ import annotations

import weakref

import torch

__all__ = ["memo_get", "memo_put", "MEMO_MAX"]

MEMO_MAX = 4096  # entries a memo keeps before it starts over


def _base_of(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _memo_key(srcs: tuple) -> tuple:
    return tuple((id(_base_of(t)), t._version, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                 for t in srcs)


def memo_get(memo: dict, srcs: tuple, extra=()):
    """The value remembered for the tensors ``srcs`` (and the hashable ``extra``) in ``memo``, or None."""
    if any(t.is_inference() for t in srcs):
        return None
    hit = memo.get((_memo_key(srcs), extra))
    return hit[1] if hit is not None and all(r() is _base_of(t) for r, t in zip(hit[0], srcs)) else None


def memo_put(memo: dict, srcs: tuple, value, extra=()) -> None:
    if any(t.is_inference() for t in srcs):
        return
    if len(memo) >= MEMO_MAX:
        memo.clear()
    memo[(_memo_key(srcs), extra)] = (tuple(weakref.ref(_base_of(t)) for t in srcs), value)
