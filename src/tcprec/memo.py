"""Values derived from tensors that come back unchanged on every call (a quantized network's calibrated buffers),
remembered by the source tensors' storage -- each one's base tensor (checked alive through a weak reference), view
and version counter -- so an in-place change (load_state_dict, fill_) derives the value again.  Inference tensors
have no version counter and are never remembered.  Used by the ops (checked scales, column scales) and the kernel
launchers (the packed epilogues' threshold words)."""

from __future__ import annotations

import weakref

import torch

__all__ = ["memo_get", "memo_put", "remembered", "MEMO_MAX"]

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


def remembered(memo: dict, srcs: tuple, compute, extra=()):
    """``compute()`` for the tensors ``srcs`` (and the hashable ``extra``), remembered in ``memo``: recomputed after an
    in-place change of a source; not stored for sources that need grad, under torch.compile, or when the value is a
    CUDA tensor made while a graph is being captured (it would exist only after a replay)."""
    ok = not (torch.compiler.is_compiling() or any(t.requires_grad for t in srcs))
    if ok:
        hit = memo_get(memo, srcs, extra)
        if hit is not None:
            return hit
    value = compute()
    if ok and not (value.is_cuda and torch.cuda.is_current_stream_capturing()):
        memo_put(memo, srcs, value, extra)
    return value
