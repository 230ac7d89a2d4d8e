"""Build and launch ``panel_lu.cu``: one tall LU leaf with tournament pivoting (CALU) per launch.

``tcprec.linalg``'s recursive panel calls :func:`panel_calu` on every leaf of ``width`` <= 64 columns
(see panel_lu.cu for the algorithm).  A :class:`PanelVariant` fixes the leaf width the code is
compiled for (32 or 64), the threads a block (= rows of a first-level tournament block; the fan-in
of the tree is threads / width) and whether the step loop is unrolled.  The grid is at most one
block per SM and never more blocks than the tournament's first level has: the kernel's grid
barriers need every block resident.

Scratch (:class:`PanelScratch`) is allocated once per factorization and reused by every leaf (all
launches are ordered on one stream).  The row interchanges come back as ``(dst, src)`` index
vectors, already applied to columns [0, cols) of the working matrix and to ``perm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .runtime import _stream_for, compile_source, cuda_core_api, load_kernel
from .runtime import sm_count as _sm_count

__all__ = ["SOURCE_PATH", "WIDTHS", "THREADS", "PanelVariant", "default_variant", "compile_panel", "PanelScratch",
           "panel_calu"]

SOURCE_PATH = Path(__file__).with_name("panel_lu.cu")
WIDTHS = (32, 64)  # compiled leaf widths (TCP_W); a leaf of w columns uses the first >= w
THREADS = (128, 256, 512, 1024)


@dataclass(frozen=True)
class PanelVariant:
    """What one cubin of panel_lu.cu is compiled for."""

    width: int = 32  # leaf columns (at most)
    threads: int = 256  # a block; = rows of a first-level tournament block
    unroll: bool = False  # the step loop unrolled

    def __post_init__(self):
        if self.width not in WIDTHS:
            raise ValueError(f"panel_lu is compiled for leaf widths {WIDTHS}, got width={self.width}")
        if self.threads not in THREADS or self.threads < 2 * self.width:
            raise ValueError(f"threads must be one of {THREADS} and >= 2 * width (a tree fan-in of at least 2), "
                             f"got threads={self.threads} for width={self.width}")

    @property
    def fan_in(self) -> int:
        return self.threads // self.width

    def defines(self) -> list[str]:
        return [f"TCP_W={self.width}", f"TCP_THREADS={self.threads}", f"TCP_UNROLL={int(self.unroll)}"]

    def __str__(self) -> str:
        return f"w{self.width}_t{self.threads}" + ("_u" if self.unroll else "")


def default_variant(w: int, threads: int = 256) -> PanelVariant:
    """The variant a leaf of ``w`` columns runs in blocks of ``threads``: the narrowest width that
    holds it, the step loop unrolled for width 32 (measured faster on an H200 at 128 and 256
    threads; 64 columns unrolled gains nothing and doubles the code)."""
    for width in WIDTHS:
        if w <= width:
            return PanelVariant(width, threads, width == 32)
    raise ValueError(f"a CALU leaf must have at most {WIDTHS[-1]} columns, got {w}; use leaf <= {WIDTHS[-1]}")


def compile_panel(variant: PanelVariant, arch: str = "sm_90a", *, use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin, ptxas log) of ``variant``."""
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"panel_lu_{variant}", use_cache=use_cache)


def _levels(m: int, variant: PanelVariant) -> list[int]:
    """Nodes per level of the tournament tree for m rows (as panel_lu.cu computes them)."""
    r, fan = variant.threads, variant.fan_in
    b = -(-m // r)
    out = [b]
    while b > 1:
        b = -(-b // fan)
        out.append(b)
    return out


_cfgs: dict = {}


def _kernel(variant: PanelVariant, device_index: int):
    return load_kernel(("panel_lu", variant, device_index), SOURCE_PATH, variant.defines(), f"panel_lu_{variant}",
                       "panel_calu", device_index)


@dataclass
class PanelScratch:
    """Device buffers one factorization's leaves share (sized for n rows, ``ld`` columns)."""

    cand: torch.Tensor  # int32 candidate rows of every tree level
    cnt: torch.Tensor  # int32 (as uint32) arrival counters of the tree's parents; zero between launches
    top: torch.Tensor  # (64 * 64,) fp32 L11\U11 of the selection
    tmp: torch.Tensor  # (128 * ld,) fp32 rows in flight during the interchange
    tperm: torch.Tensor  # (128,) int64
    bar: torch.Tensor  # (2,) int32 (as uint32) grid barrier: arrivals, generation

    @classmethod
    def allocate(cls, n: int, ld: int, device: torch.device) -> "PanelScratch":
        smallest = [PanelVariant(w, max(THREADS[0], 2 * w)) for w in WIDTHS]  # the most tree nodes
        cand = max(sum(_levels(n, v)) * v.width for v in smallest)
        cnt = max(sum(_levels(n, v)[1:]) for v in smallest) + 1
        w = WIDTHS[-1]
        return cls(
            cand=torch.empty(cand, dtype=torch.int32, device=device),
            cnt=torch.zeros(cnt, dtype=torch.int32, device=device),
            top=torch.empty(w * w, dtype=torch.float32, device=device),
            tmp=torch.empty(2 * w * ld, dtype=torch.float32, device=device),
            tperm=torch.empty(2 * w, dtype=torch.int64, device=device),
            bar=torch.zeros(2, dtype=torch.int32, device=device),
        )


def _ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


def panel_calu(work: torch.Tensor, perm: torch.Tensor, k: int, w: int, n: int, cols: int,
               scratch: PanelScratch, variant: PanelVariant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Factor the leaf ``work[k:n, k:k+w]`` (fp32, row-major, ``n + 1`` rows, row n scratch) in place
    with tournament pivoting, on the current stream; apply its row interchanges to columns [0, cols)
    of ``work`` and to ``perm`` (int64, n + 1).  ``variant``: None picks :func:`default_variant`.
    Returns ``(dst, src)`` (int64, 2 * variant.width each): the same interchanges as
    ``work[dst] = work[src]`` (gathered before written), for the other columns."""
    if work.dtype != torch.float32 or work.dim() != 2 or work.stride(1) != 1 or work.shape[0] < n + 1:
        raise ValueError(f"panel_calu needs a row-major fp32 working matrix with n + 1 = {n + 1} rows, got "
                         f"{work.dtype} {tuple(work.shape)} strides {work.stride()}")
    if perm.dtype != torch.int64 or perm.numel() < n + 1:
        raise ValueError(f"perm must be int64 with n + 1 = {n + 1} entries, got {perm.dtype} {perm.numel()}")
    if not (0 <= k and 1 <= w and k + w <= n and w <= cols <= work.shape[1]):
        raise ValueError(f"panel_calu: need 0 <= k, 1 <= w, k + w <= n, k + w <= cols <= {work.shape[1]}; got "
                         f"k={k} w={w} n={n} cols={cols}")
    variant = variant or default_variant(w)
    if w > variant.width:
        raise ValueError(f"variant {variant} factors leaves of at most {variant.width} columns, got w={w}")
    width = variant.width
    dev = work.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    grid = max(1, min(_sm_count(dev)[0], _levels(n - k, variant)[0]))
    *_, LaunchConfig, _, launch = cuda_core_api()
    swaps = torch.empty(2, 2 * width, dtype=torch.int64, device=dev)
    stream = _stream_for(torch.cuda.current_stream(dev).cuda_stream)
    cfg = _cfgs.get((grid, variant.threads))
    if cfg is None:
        cfg = _cfgs[(grid, variant.threads)] = LaunchConfig(grid=(grid,), block=(variant.threads,))
    launch(stream, cfg, _kernel(variant, idx), _ptr(work), np.int64(work.stride(0)), _ptr(perm), np.int32(k),
           np.int32(w), np.int32(n), np.int32(cols), _ptr(scratch.cand), _ptr(scratch.cnt), _ptr(scratch.top),
           _ptr(swaps[0]), _ptr(swaps[1]), _ptr(scratch.tmp), _ptr(scratch.tperm), _ptr(scratch.bar))
    return swaps[0], swaps[1]
