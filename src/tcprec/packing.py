"""Bit planes: the operand layout of the bit-serial binary tensor-core GEMM.

A p-bit by q-bit integer product is computed as p*q binary GEMMs (APNN-TC)::

    C[m, n] = sum_{i<p, j<q} 2**(i+j) * popc(A_i[m, :] AND W_j[n, :])

with ``mma.sync.m16n8k256.row.col.s32.b1.b1.s32.and.popc``: rows of A and columns of B are both
strings of K bits packed into 32-bit words.  (Signed and pm1 codes are handled by correction terms
built from ``plane_popcounts``; the planes themselves always hold unsigned code patterns.)

Layout produced by ``pack_bitplanes(codes, bits)`` for codes of shape ``(*lead, K)``::

    planes: int32 (bits, *lead, Kw),   Kw = ceil(K / K_PAD_BITS) * (K_PAD_BITS / 32)
    bit j of planes[b, ..., w]  =  bit b of codes[..., 32*w + j]       (LSB-first)
    elements K .. 32*Kw - 1 are zero (padding)

* Plane-major: plane ``b`` is one ordinary (rows, Kw) binary matrix, so the GEMM's loop over
  (i, j) plane pairs indexes whole matrices.
* LSB-first: element ``k`` is bit ``k % 32`` of word ``k // 32``, the order the MMA fragment
  layout reads (a0 = A[g][t] covers k = 32t .. 32t+31 of a 256-bit k-step).
* ``K_PAD_BITS = 512``: every row is zero-padded to a multiple of 512 bits = 64 bytes = 16 words.
  That makes every row start 64-byte aligned (rows can be fetched as 16-byte vectors / cp.async
  chunks with no misaligned tail), and makes K a whole number of 256-bit MMA k-steps, two per
  512-bit chunk, so the kernel needs no K-remainder path.  Zero bits add nothing to AND+popc, so
  padding is exact for any K.  (Padding 512 rather than 256 costs at most 255 extra bits a row
  and lets a warp move one full 64-byte row segment per step.)

Codes come in as any integer dtype holding unsigned patterns in ``[0, 2**bits)`` -- ``tcprec.encode``
gives exactly that (two's complement patterns for ``intN``, code indices for ``uintN`` / ``pmN``).

Backends: the Triton kernel in ``kernels/triton/pack.py`` (CUDA tensors; on the CPU only under
``TRITON_INTERPRET=1``) and the pure-torch ``pack_bitplanes_reference`` (any device).  Both give the
same bits.
"""

from __future__ import annotations

import torch

from .kernels.reference_bitplanes import (
    K_PAD_BITS,
    check_bits,
    pack_bitplanes_reference,
    packed_words,
    plane_popcounts,
    unpack_bitplanes,
)
from .kernels.triton import choose_backend

__all__ = [
    "K_PAD_BITS",
    "packed_words",
    "pack_bitplanes",
    "pack_bitplanes_reference",
    "unpack_bitplanes",
    "plane_popcounts",
    "choose_pack_backend",
]


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _check_codes(codes, bits: int, validate: bool) -> None:
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(
            f"codes must be an integer tensor of unsigned code patterns (uint8 from tcprec.encode), got "
            f"dtype={codes.dtype}; encode floats first (tcprec.encode / tcprec.quantize) or use .to(torch.uint8)"
        )
    if codes.dim() == 0:
        raise ValueError("codes must have at least one dimension (the K axis that is packed); got a 0-d tensor")
    if validate and codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= (1 << bits):
            bad = lo if lo < 0 else hi
            n = int(((codes < 0) | (codes >= (1 << bits))).sum())
            raise ValueError(
                f"codes must hold {bits}-bit patterns in 0..{(1 << bits) - 1}, got {n} value(s) outside (e.g. {bad}); "
                f"signed values need their pattern (codes & {(1 << bits) - 1}), or pass a larger bits="
            )


def choose_pack_backend(codes: torch.Tensor, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason) for packing ``codes``: Triton on CUDA tensors, the reference otherwise."""
    return choose_backend(codes, backend, "Triton pack kernel")


# ------------------------------------------------------------------------------------------------
# Pack / unpack
# ------------------------------------------------------------------------------------------------


def pack_bitplanes(codes: torch.Tensor, bits: int, *, backend: str = "auto", validate: bool = True) -> torch.Tensor:
    """Pack ``bits``-bit codes of shape ``(*lead, K)`` into bit planes, int32 ``(bits, *lead, Kw)``.

    Plane ``b`` holds bit ``b`` of every code, K packed LSB-first into 32-bit words and zero-padded
    to a multiple of ``K_PAD_BITS`` (512), so ``Kw = ceil(K / 512) * 16`` (module docstring).
    ``backend``: ``"auto"`` (Triton for CUDA tensors, the reference otherwise), ``"triton"`` or
    ``"reference"``.  ``validate=False`` skips the range check of the codes (it syncs the device,
    which a CUDA graph capture cannot do).

    >>> import torch
    >>> pack_bitplanes(torch.tensor([[1, 2, 3]], dtype=torch.uint8), 2)[:, 0, 0].tolist()
    [5, 6]
    """
    check_bits(bits)
    _check_codes(codes, bits, validate)
    name, _ = choose_pack_backend(codes, backend)
    if name == "reference":
        return pack_bitplanes_reference(codes, bits)
    from .kernels.triton import pack as tpack  # lazy: imports Triton, whose jit reads TRITON_INTERPRET

    lead, K = tuple(codes.shape[:-1]), codes.shape[-1]
    rows = codes.reshape(-1, K)  # (R, K), R = prod(lead)
    planes = tpack.pack_bitplanes(rows, bits)  # (bits, R, Kw) int32
    return planes.reshape((bits,) + lead + (planes.shape[-1],))  # (bits, *lead, Kw) int32
