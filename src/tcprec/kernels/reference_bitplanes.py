"""Bit planes in pure torch: the layout's constants, the reference packer (ground truth of
``kernels/triton/pack.py``), the unpacker and the per-row popcounts.  The layout is described in
``tcprec.packing``, the public entry point that validates the codes and picks the backend.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "K_PAD_BITS",
    "WORD_BITS",
    "packed_words",
    "check_bits",
    "pack_bitplanes_reference",
    "unpack_bitplanes",
    "plane_popcounts",
]

K_PAD_BITS = 512  # 64 bytes: row alignment for 16-byte loads, and two whole 256-bit MMA k-steps
WORD_BITS = 32
_WORDS_PER_PAD = K_PAD_BITS // WORD_BITS  # 16
_M32 = 0xFFFFFFFF


def packed_words(K: int) -> int:
    """Kw, the number of int32 words a row of K codes packs into: ceil(K / 512) * 16.

    >>> packed_words(1), packed_words(512), packed_words(513)
    (16, 16, 32)
    """
    return -(-K // K_PAD_BITS) * _WORDS_PER_PAD


def check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int in 1..8, got bits={bits!r}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8 for bit planes, got bits={bits}; wider integers use the int8 GEMM path")


def pack_bitplanes_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pure-torch packing (no validation): ``(*lead, K)`` codes -> int32 ``(bits, *lead, Kw)``.

    One plane at a time in bytes: bit j of byte i of a word is lane 8i + j, and four bytes read as one int32 on a
    little-endian machine (the only byte order torch's CPU and CUDA builds run on) are that word."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build exists
        raise RuntimeError("pack_bitplanes_reference assumes a little-endian machine")
    lead, K = tuple(codes.shape[:-1]), codes.shape[-1]
    Kw = packed_words(K)
    c = codes if codes.dtype == torch.uint8 else (codes.to(torch.int64) & 0xFF).to(torch.uint8)
    c = torch.nn.functional.pad(c, (0, Kw * WORD_BITS - K))  # (*lead, Kw*32), zero padding
    c = c.reshape(*lead, Kw * 4, 8)  # byte i of word w holds elements 32w + 8i .. 32w + 8i + 7
    out = torch.empty((bits, *lead, Kw * 4), dtype=torch.uint8, device=c.device)
    for b in range(bits):
        plane = (c >> b) & 1  # (*lead, Kw*4, 8) in {0, 1}
        byte = plane[..., 0].clone()
        for j in range(1, 8):
            byte |= plane[..., j] << j
        out[b] = byte
    return out.view(torch.int32) if out.numel() else out.reshape(bits, *lead, Kw).to(torch.int32)


def unpack_bitplanes(planes: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """Inverse of ``pack_bitplanes``: int32 ``(bits, *lead, Kw)`` -> uint8 codes ``(*lead, K)``.

    >>> import torch
    >>> codes = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    >>> unpack_bitplanes(pack_bitplanes_reference(codes, 2), 2, 3).tolist()
    [[1, 2, 3]]
    """
    check_bits(bits)
    _check_planes(planes)
    if isinstance(K, bool) or not isinstance(K, int) or K < 0:
        raise ValueError(f"K must be a non-negative int (the number of codes per row), got K={K!r}")
    Kw = packed_words(K)
    if planes.dim() < 2 or planes.shape[0] != bits or planes.shape[-1] != Kw:
        raise ValueError(
            f"planes for bits={bits}, K={K} must have shape (bits={bits}, *lead, Kw={Kw}), got {tuple(planes.shape)}"
        )
    lead = tuple(planes.shape[1:-1])
    w = planes.to(torch.int64) & _M32  # (bits, *lead, Kw) as unsigned words
    lanes = torch.arange(WORD_BITS, device=w.device, dtype=torch.int64)
    bitv = (w.unsqueeze(-1) >> lanes) & 1  # (bits, *lead, Kw, 32)
    bitv = bitv.reshape((bits,) + lead + (Kw * WORD_BITS,))[..., :K]  # (bits, *lead, K)
    shifts = torch.arange(bits, device=w.device, dtype=torch.int64).view((bits,) + (1,) * (bitv.dim() - 1))
    return (bitv << shifts).sum(0).to(torch.uint8)  # (*lead, K) uint8


def _check_planes(planes) -> None:
    if not isinstance(planes, torch.Tensor):
        raise TypeError(f"planes must be a torch.Tensor, got {type(planes).__name__}")
    if planes.dtype != torch.int32:
        raise TypeError(f"planes must be int32 (from pack_bitplanes), got dtype={planes.dtype}")


def plane_popcounts(planes: torch.Tensor) -> torch.Tensor:
    """Number of set bits in each row of each plane: int32 ``(bits, *lead)`` from ``(bits, *lead, Kw)``.

    The GEMM's corrections for signed (two's complement) and pm1 codes need these row sums.

    >>> import torch
    >>> plane_popcounts(pack_bitplanes_reference(torch.tensor([[1, 2, 3]], dtype=torch.uint8), 2)).tolist()
    [[2], [2]]
    """
    _check_planes(planes)
    if planes.dim() < 1:
        raise ValueError("planes must have at least one dimension (the word axis)")
    x = planes.to(torch.int64) & _M32  # (bits, *lead, Kw) unsigned words
    # SWAR popcount of 32-bit words (Hacker's Delight 5-2), exact in int64
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = ((x * 0x01010101) & _M32) >> 24  # (bits, *lead, Kw) popcount per word, 0..32
    return x.sum(-1).to(torch.int32)  # (bits, *lead)
