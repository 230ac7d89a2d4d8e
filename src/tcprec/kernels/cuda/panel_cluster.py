"""Build and launch ``panel_cluster.cu``: one partially pivoted LU leaf per launch of one thread-block cluster.

``tcprec.linalg``'s LU (``panel="cluster"``) factors every leaf of its recursive panel with
:func:`panel_cluster`: the leaf's rows live in the registers of the cluster's threads and the blocks
agree on each column's pivot through distributed shared memory and one cluster barrier, instead of the
round trips through L2 of ``panel_pivot.cu`` or cuSOLVER's getf2.  A :class:`ClusterVariant` fixes what
one cubin is compiled for: the most leaf columns, the rows a thread holds in registers and the blocks in the
cluster; the rows a launch can hold are bounded by the cluster's registers: :func:`max_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .runtime import _stream_for, compile_source, cuda_core_api, load_kernel

__all__ = ["SOURCE_PATH", "WIDTHS", "CLUSTERS", "ROWS", "ClusterVariant", "all_variants", "pick_variant",
           "compile_panel_cluster",
           "max_rows", "panel_cluster"]

SOURCE_PATH = Path(__file__).with_name("panel_cluster.cu")
WIDTHS = (16, 32)  # most leaf columns (TCP_W)
CLUSTERS = (4, 8, 16)  # blocks in the cluster (TCP_C); 16 needs the non-portable cluster size
ROWS = (1, 2, 4)  # rows a thread holds in registers (TCP_R; rows x width <= 64)
THREADS = 512  # a block (TCP_T)


@dataclass(frozen=True)
class ClusterVariant:
    """What one cubin of panel_cluster.cu is compiled for."""

    width: int = 16  # most leaf columns
    rows: int = 4  # rows a thread
    cluster: int = 16
    threads: int = THREADS

    def __post_init__(self):
        if self.width not in WIDTHS:
            raise ValueError(f"panel_cluster is compiled for leaf widths {WIDTHS}, got width={self.width}")
        if self.cluster not in CLUSTERS:
            raise ValueError(f"panel_cluster runs clusters of {CLUSTERS} blocks, got cluster={self.cluster}")
        if self.rows not in ROWS or self.rows * self.width > 64:
            raise ValueError(f"panel_cluster holds {ROWS} rows a thread in registers, at most 64 values (rows x "
                             f"width), got rows={self.rows} width={self.width}")
        if self.threads != THREADS:
            raise ValueError(f"panel_cluster is compiled for {THREADS} threads a block, got threads={self.threads}")

    def defines(self) -> list[str]:
        return [f"TCP_W={self.width}", f"TCP_T={self.threads}", f"TCP_R={self.rows}", f"TCP_C={self.cluster}"]

    @property
    def capacity(self) -> int:
        """The most rows a launch holds."""
        return self.cluster * self.threads * self.rows

    def fits(self, m: int) -> bool:
        return m <= self.capacity

    def __str__(self) -> str:
        return f"w{self.width}_r{self.rows}_c{self.cluster}"


def all_variants() -> list[ClusterVariant]:
    """Every variant the kernel is built for."""
    out = []
    for w in WIDTHS:
        for r in ROWS:
            for c in CLUSTERS:
                try:
                    out.append(ClusterVariant(w, r, c))
                except ValueError:
                    pass
    return out


def max_rows(width: int = 16) -> int:
    """The tallest leaf of ``width`` columns one launch holds (the largest cluster, the most rows a thread)."""
    return max(v.capacity for v in all_variants() if v.width == width)


def pick_variant(m: int, width: int, cluster: int | None = None) -> ClusterVariant:
    """The variant for a leaf of ``m`` rows and ``width`` (<= 32) columns: the narrowest compiled width that
    holds it, then the fewest rows a thread in the largest cluster (or ``cluster``) that holds the rows."""
    if not 1 <= width <= WIDTHS[-1]:
        raise ValueError(f"panel_cluster factors leaves of 1..{WIDTHS[-1]} columns, got width={width}")
    if m > 65535:
        raise ValueError(f"panel_cluster packs LAPACK positions in 16 bits: at most 65535 rows, got m={m}")
    w = next(x for x in WIDTHS if x >= width)
    c = CLUSTERS[-1] if cluster is None else cluster
    for r in ROWS:
        try:
            v = ClusterVariant(w, r, c)
        except ValueError:
            continue
        if v.fits(m):
            return v
    raise ValueError(f"a leaf of {m} rows x {width} columns does not fit the registers of a cluster of {c} blocks "
                     f"(at most {max_rows(w)} rows at width {w}): use narrower leaves or panel='getrf'")


def compile_panel_cluster(variant: ClusterVariant, arch: str = "sm_90a", *, use_cache: bool = True):
    """(cubin, ptxas log) of ``variant``."""
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"panel_cluster_{variant}", use_cache=use_cache)


def _kernel(variant: ClusterVariant, device_index: int):
    attrs = {"NON_PORTABLE_CLUSTER_SIZE_ALLOWED": 1} if variant.cluster > 8 else {}
    return load_kernel(("panel_cluster", variant, device_index), SOURCE_PATH, variant.defines(),
                       f"panel_cluster_{variant}", "panel_cluster", device_index, 0, attrs)


_cfgs: dict = {}


def _ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


def panel_cluster(work: torch.Tensor, r0: int, c0: int, n: int, w: int, scratch: int, ipiv: torch.Tensor,
                  idx: torch.Tensor | None = None, *, cols: tuple[int, int] | None = None,
                  variant: ClusterVariant | None = None, prof: torch.Tensor | None = None) -> None:
    """Factor the leaf ``work[r0:n, c0:c0+w]`` (fp32, row-major) in place with partial pivoting, on the
    current stream; its rows end in getf2's order, and so do the rows of the other columns in ``cols =
    (pc0, pc1)`` (default: none).  Writes ``ipiv[:w]`` (int32: 0-based global pivot rows, getf2's order)
    and, when given, ``idx`` (int64 (2, 2w): ``dst, src`` such that ``work[dst] = work[src]``, all gathered
    before any is written, applies the leaf's interchanges to any other column; unused slots pair the row
    ``scratch`` with itself).  ``prof``: int64 (cluster, 8) zeros that get each block's clock cycles a
    phase (load, search, publish, cluster barriers, winner, update, write back, interchanges)."""
    if work.dtype != torch.float32 or work.dim() != 2 or work.stride(1) != 1 or not work.is_cuda:
        raise ValueError(f"panel_cluster needs a row-major fp32 CUDA matrix, got {work.dtype} {tuple(work.shape)} "
                         f"strides {work.stride()} on {work.device}")
    m = n - r0
    if not (0 <= r0 and 1 <= w <= WIDTHS[-1] and m >= w and n <= work.shape[0] and 0 <= c0
            and c0 + w <= work.shape[1]):
        raise ValueError(f"panel_cluster: need 0 <= r0, 1 <= w <= {WIDTHS[-1]}, n - r0 >= w, n <= rows and "
                         f"c0 + w <= cols of work {tuple(work.shape)}; got r0={r0} c0={c0} n={n} w={w}")
    pc0, pc1 = (c0, c0 + w) if cols is None else cols
    if not 0 <= pc0 <= c0 < c0 + w <= pc1 <= work.shape[1]:
        raise ValueError(f"cols=(pc0, pc1) must hold the leaf's columns [{c0}, {c0 + w}) within the "
                         f"{work.shape[1]} columns of work, got {cols}")
    if not 0 <= scratch < work.shape[0]:
        raise ValueError(f"scratch must be a row of work (0..{work.shape[0] - 1}), got {scratch}")
    if ipiv.dtype != torch.int32 or ipiv.numel() < w or (idx is not None and (
            idx.dtype != torch.int64 or idx.shape != (2, 2 * w) or not idx.is_contiguous())):
        raise ValueError(f"ipiv must be int32 with >= {w} entries and idx contiguous int64 (2, {2 * w}); got "
                         f"{ipiv.dtype} {ipiv.numel()} and {None if idx is None else (idx.dtype, tuple(idx.shape))}")
    v = variant or pick_variant(m, w)
    if w > v.width or not v.fits(m):
        raise ValueError(f"variant {v} cannot hold a leaf of {m} x {w}")
    if prof is not None and (prof.dtype != torch.int64 or prof.numel() < 8 * v.cluster):
        raise ValueError(f"prof must be int64 with >= {8 * v.cluster} entries")
    dev = work.device
    di = dev.index if dev.index is not None else torch.cuda.current_device()
    *_, LaunchConfig, _, launch = cuda_core_api()
    stream = _stream_for(torch.cuda.current_stream(dev).cuda_stream)
    cfg = _cfgs.get(v)
    if cfg is None:
        cfg = _cfgs[v] = LaunchConfig(grid=(1,), cluster=(v.cluster,), block=(v.threads,))
    launch(stream, cfg, _kernel(v, di), _ptr(work), np.int64(work.stride(0)), np.int32(r0), np.int32(c0),
           np.int32(n), np.int32(w), np.int32(pc0), np.int32(pc1), np.int32(scratch), _ptr(ipiv),
           np.uint64(0 if idx is None else idx.data_ptr()), np.uint64(0 if prof is None else prof.data_ptr()))
