"""Build and launch ``panel_pivot.cu``: one whole LU block column with partial pivoting per launch.

``tcprec.linalg``'s LU calls :func:`panel_pivot` for every block column when ``panel="fused"`` (see
panel_pivot.cu for the algorithm).  A :class:`PivotVariant` fixes what one cubin is compiled for: the
leaf width (columns held in registers while their pivots are picked), the threads a block and the rows
a thread holds.  The grid is one block per SM at most (the kernel's grid barriers need every block
resident), so the panel can have at most ``SMs * threads * rows`` rows; :func:`pick_variant` takes the
fewest rows a thread that fit.

Scratch (:class:`PivotScratch`) is allocated once per factorization; every launch bumps its epoch,
which tags the words the blocks exchange, so nothing has to be cleared between launches except the
barrier counter (one memset).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .runtime import _stream_for, compile_source, cuda_core_api, load_kernel
from .runtime import sm_count as _sm_count

__all__ = ["SOURCE_PATH", "WIDTHS", "ROWS", "THREADS", "PivotVariant", "pick_variant", "compile_panel_pivot",
           "PivotScratch", "panel_pivot", "max_rows"]

SOURCE_PATH = Path(__file__).with_name("panel_pivot.cu")
WIDTHS = (16, 32)  # leaf widths (TCP_W)
ROWS = (1, 2, 4)  # rows a thread (TCP_R)
THREADS = 256  # a block (TCP_T); one polled candidate a thread, so at most this many blocks
MAX_BLOCK = 65535  # panel columns (the exchanged words carry the column in 16 bits)
_EPOCHS = 1 << 15  # the exchanged words carry the launch epoch in 15 bits


@dataclass(frozen=True)
class PivotVariant:
    """What one cubin of panel_pivot.cu is compiled for."""

    width: int = 32  # leaf columns
    rows: int = 1  # rows a thread
    threads: int = THREADS

    def __post_init__(self):
        if self.width not in WIDTHS:
            raise ValueError(f"panel_pivot is compiled for leaf widths {WIDTHS}, got width={self.width}")
        if self.rows not in ROWS:
            raise ValueError(f"panel_pivot is compiled for {ROWS} rows a thread, got rows={self.rows}")
        if self.threads % 32 or not 160 <= self.threads <= 1024:
            raise ValueError(f"threads must be whole warps in [160, 1024], got threads={self.threads}")

    def defines(self) -> list[str]:
        return [f"TCP_W={self.width}", f"TCP_T={self.threads}", f"TCP_R={self.rows}"]

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the block's rows of the leaf (stride width + 1 floats) and their ids."""
        return self.threads * self.rows * (self.width + 2) * 4

    def __str__(self) -> str:
        return f"w{self.width}_t{self.threads}_r{self.rows}"


def max_rows(device: torch.device) -> int:
    """The tallest panel one launch factors on ``device``."""
    return _sm_count(device)[0] * THREADS * ROWS[-1]


def pick_variant(m: int, sms: int, width: int = 32, max_blocks: int | None = None) -> tuple[PivotVariant, int, int]:
    """(variant, grid, rows a block) for a panel of ``m`` rows on ``sms`` SMs: the fewest rows a thread
    that fit one block an SM (at most ``max_blocks`` blocks), then as few blocks as that allows."""
    blocks = min(sms, THREADS) if max_blocks is None else min(sms, THREADS, max_blocks)
    for r in ROWS:
        if m <= blocks * THREADS * r:
            v = PivotVariant(width, r)
            grid = -(-m // (THREADS * r))
            return v, grid, -(-m // grid)
    raise ValueError(f"a fused LU panel of {m} rows does not fit {blocks} blocks of {THREADS} threads x "
                     f"{ROWS[-1]} rows; use panel='getrf' (cuSOLVER) for matrices this tall")


def compile_panel_pivot(variant: PivotVariant, arch: str = "sm_90a", *, use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin, ptxas log) of ``variant``."""
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"panel_pivot_{variant}", use_cache=use_cache)


def _kernel(variant: PivotVariant, device_index: int):
    return load_kernel(("panel_pivot", variant, device_index), SOURCE_PATH, variant.defines(),
                       f"panel_pivot_{variant}", "panel_pivot", device_index, variant.smem_bytes)


@dataclass
class PivotScratch:
    """Device buffers one factorization's panel launches share."""

    flags: torch.Tensor  # int64 (2, THREADS, 16): each block's candidate {tag, a_j bits}, 128 bytes apart
    crow: torch.Tensor  # int64 (2, THREADS, 32 + 2): its row, position and content id
    trow: torch.Tensor  # int64 (2, 32 + 1): the row at the diagonal position
    ctr: torch.Tensor  # int32 (1,): grid barrier arrivals (zeroed before each launch)
    ipiv: torch.Tensor  # int32 (block,): pivots of the last launch (0-based panel positions)
    epoch: int = 0

    @classmethod
    def allocate(cls, block: int, device: torch.device) -> "PivotScratch":
        w = WIDTHS[-1]
        z = dict(dtype=torch.int64, device=device)
        return cls(flags=torch.zeros(2, THREADS, 16, **z), crow=torch.zeros(2, THREADS, w + 2, **z),
                   trow=torch.zeros(2, w + 1, **z), ctr=torch.zeros(1, dtype=torch.int32, device=device),
                   ipiv=torch.zeros(max(block, 1), dtype=torch.int32, device=device))

    def next_epoch(self) -> int:
        self.epoch += 1
        if self.epoch >= _EPOCHS:  # wrapped: clear every slot so no old tag can match
            for t in (self.flags, self.crow, self.trow):
                t.zero_()
            self.epoch = 1
        return self.epoch


def _ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


_cfgs: dict = {}


def panel_pivot(work: torch.Tensor, perm: torch.Tensor, k: int, nb: int, n: int, cols: int,
                scratch: PivotScratch, *, width: int = 32, max_blocks: int | None = None,
                prof: torch.Tensor | None = None) -> torch.Tensor:
    """Factor the block column ``work[k:n, k:k+nb]`` (fp32, row-major) in place with partial pivoting,
    on the current stream; apply its row interchanges to columns [0, cols) of ``work`` and to ``perm``
    (int64).  Returns the pivots (int32 (nb,), 0-based positions in the panel, LAPACK's order: column
    j swapped panel rows j and ipiv[j]), for the caller to apply to columns [cols, ...): a view of
    ``scratch.ipiv``, valid until the next launch on the same scratch.  ``prof``: an
    int64 (grid, 12) tensor (grid: at most the SM count) that gets each block's clock cycles a phase
    (load, publish, candidates, rows, the rest of the step, write back, barrier, interchanges, barrier, update,
    swap, eliminate)."""
    if work.dtype != torch.float32 or work.dim() != 2 or work.stride(1) != 1 or work.shape[0] < n:
        raise ValueError(f"panel_pivot needs a row-major fp32 working matrix with at least n = {n} rows, got "
                         f"{work.dtype} {tuple(work.shape)} strides {work.stride()}")
    if perm.dtype != torch.int64 or perm.numel() < n:
        raise ValueError(f"perm must be int64 with at least n = {n} entries, got {perm.dtype} {perm.numel()}")
    if not (0 <= k and 1 <= nb <= MAX_BLOCK and k + nb <= n and k + nb <= cols <= work.shape[1]):
        raise ValueError(f"panel_pivot: need 0 <= k, 1 <= nb <= {MAX_BLOCK}, k + nb <= n, k + nb <= cols <= "
                         f"{work.shape[1]}; got k={k} nb={nb} n={n} cols={cols}")
    if scratch.ipiv.numel() < nb:
        raise ValueError(f"scratch holds pivots of {scratch.ipiv.numel()} columns, the panel has {nb}")
    dev = work.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    variant, grid, rb = pick_variant(n - k, _sm_count(dev)[0], width, max_blocks)
    *_, LaunchConfig, _, launch = cuda_core_api()
    stream = _stream_for(torch.cuda.current_stream(dev).cuda_stream)
    cfg = _cfgs.get((grid, variant))
    if cfg is None:
        cfg = _cfgs[(grid, variant)] = LaunchConfig(grid=(grid,), block=(variant.threads,),
                                                    shmem_size=variant.smem_bytes)
    scratch.ctr.zero_()
    launch(stream, cfg, _kernel(variant, idx), _ptr(work), np.int64(work.stride(0)), _ptr(perm), np.int32(k),
           np.int32(nb), np.int32(n), np.int32(cols), np.int32(rb), _ptr(scratch.flags), _ptr(scratch.crow),
           _ptr(scratch.trow), _ptr(scratch.ctr), _ptr(scratch.ipiv), np.uint32(scratch.next_epoch()),
           np.uint64(0 if prof is None else prof.data_ptr()))
    return scratch.ipiv[:nb]
