"""The warp-specialised INT8 GEMM (``i8_gemm.cu``): its tiles and variants, compiling, TMA maps and launch, and the
entry :func:`i8_gemm`.

``C = epilogue(a @ w.T)`` for int8 ``a`` (M, K) and ``w`` (N, K), int32 accumulation on Hopper's wgmma (sm_90a), the
epilogue of a quantized linear fused: ``acc * (a_scale * w_scale[n]) + bias[n]``, optionally erf-GELU, written as
fp16 (optionally + an fp16 residual) or as the next layer's int8 codes.  The math, step by step, is
``kernels/reference_i8_gemm.py``'s, which the tests hold the kernel to.

A :class:`Tile` is the shape (rows a consumer multiplies, BN, stages) of the ping-pong schedule; a :class:`Variant`
adds the epilogue (fp16 or int8 codes, GELU, residual); its ``-D`` defines select both in the one source.  The
shipped tiles (:data:`TILES`) are those that won or tied a transformer GEMM on the H200 (docs/decisions/0163).
``runtime.py`` compiles a variant with NVRTC (no GPU needed), caches the cubin on disk, loads it once per device and
launches it on PyTorch's current stream (CUDA-graph capturable).  :func:`precompile` compiles many in parallel
processes.

>>> str(Variant(parse_tile("pp_64x256_s5_e1"), gelu=True, out="int8"))
'pp_64x256_s5_e1_i8_gelu'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from .runtime import compile_all, compile_source, launch, launch_config, load_kernel, ptr, sm_count, source_cubin_path

__all__ = ["SOURCE_PATH", "OUTS", "Tile", "Variant", "parse_tile", "max_stages", "TILES", "DEFAULT_TILE",
           "GELU_TILE", "default_tile", "compile_variant", "precompile", "cubin_path", "get_kernel", "tensor_map",
           "i8_gemm", "K_ALIGN", "K_MAX"]

SOURCE_PATH = Path(__file__).with_name("i8_gemm.cu")
OUTS = ("float16", "int8")  # i8_gemm.cu's I8G_OUT: OUT_F16 = 0, OUT_I8 = 1
_MAX_SMEM = 232448  # 227 KB: the most dynamic shared memory a block of sm_90 may have
_BK = 128  # K bytes a stage (i8_gemm.cu BK)
K_ALIGN = 16  # TMA: a row's pitch (K bytes) must be a multiple of 16
K_MAX = 1 << 17  # K < 2^17 keeps every int32 sum of int8 products exact (|acc| <= K * 2^14 < 2^31)


@dataclass(frozen=True)
class Tile:
    """A ping-pong tile: each of ``consumers`` warpgroups (2, or 3 with at most 64 accumulators a thread: wm=64,
    bn=128) multiplies its own ``wm`` x ``bn`` output tile (``wm`` 64 / 128 rows, ``bn`` 128 / 256 columns), in turn,
    so that while one runs its main loop the others run their epilogues; ``stages`` K steps of 128 bytes in the TMA
    ring (>= 3).  Named ``pp_{wm}x{bn}_s{stages}_e1`` as the bench measured it (ping-pong, epilogue 1: decision 0163),
    ``pp3_...`` with three consumers (decision 0169)."""

    wm: int = 64
    bn: int = 256
    stages: int = 5
    consumers: int = 2

    def __post_init__(self):
        if self.wm not in (64, 128) or self.bn not in (128, 256):
            raise ValueError(f"wm must be 64 or 128 and bn 128 or 256, got wm={self.wm} bn={self.bn}")
        if self.wm // 64 * self.bn // 2 > 128:
            raise ValueError(f"wm={self.wm} x bn={self.bn} needs {self.wm // 64 * self.bn // 2} accumulator registers "
                             "a thread, more than 128; use wm=64 with bn=256 or wm=128 with bn=128")
        if self.consumers not in (2, 3):
            raise ValueError(f"consumers must be 2 or 3, got {self.consumers}")
        if self.consumers == 3 and self.wm // 64 * self.bn // 2 > 64:
            raise ValueError(f"3 consumers leave 160 registers a thread: at most 64 accumulators (wm=64, bn=128), "
                             f"got wm={self.wm} bn={self.bn}")
        if not 3 <= self.stages <= max_stages(self):
            raise ValueError(f"stages must be 3..{max_stages(self)} for wm={self.wm} bn={self.bn} (shared memory), "
                             f"got {self.stages}")

    @property
    def bm(self) -> int:
        """Rows of one output tile (one consumer's)."""
        return self.wm

    @property
    def threads(self) -> int:
        """Threads a block: the consumer warpgroups and the producer's."""
        return 128 * (self.consumers + 1)

    @property
    def smem_bytes(self) -> int:
        """i8_gemm.cu SMEM_BYTES: 1 KB of alignment slack, the ring, the 2 x stages mbarriers, the consumers'
        scales and biases."""
        return 1024 + self.stages * (self.bm + self.bn) * _BK + 16 * self.stages + _epi_bytes(self)

    def __str__(self) -> str:
        return f"pp{'' if self.consumers == 2 else self.consumers}_{self.bm}x{self.bn}_s{self.stages}_e1"


def _epi_bytes(tile: Tile) -> int:
    return tile.consumers * tile.bn * 8


def max_stages(tile: Tile) -> int:
    """The deepest ring (<= 8) of ``tile``'s shape that shared memory holds beside the epilogue's buffer."""
    per = (tile.bm + tile.bn) * _BK + 16
    return min(8, (_MAX_SMEM - 1024 - _epi_bytes(tile)) // per)


def parse_tile(text: str) -> Tile:
    """``"pp_64x256_s5_e1"`` / ``"pp3_64x128_s8_e1"`` (as ``str(Tile)`` writes it) -> Tile."""
    try:
        sched, mn, s, epi = text.split("_")
        if sched not in ("pp", "pp3") or epi != "e1" or not s.startswith("s"):
            raise ValueError(text)
        bm, bn = (int(v) for v in mn.split("x"))
        stages = int(s[1:])
    except ValueError:
        raise ValueError(f"tile must look like 'pp_64x256_s5_e1' (pp_BMxBN_sSTAGES_e1; pp3_...: three consumer "
                         f"warpgroups), got {text!r}") from None
    return Tile(bm, bn, stages, 3 if sched == "pp3" else 2)


# The tiles measured on the transformer's GEMMs on the H200, each with as many stages as fit: two consumers on 64 x 256
# (decision 0163's default; linear1 with the GELU since 0169) and on 64 x 128, three consumers on 64 x 128 (the
# default since 0169).
TILES = (Tile(64, 256, 5), Tile(64, 128, 8), Tile(64, 128, 8, consumers=3))
DEFAULT_TILE = TILES[2]
GELU_TILE = TILES[0]


def default_tile(gelu: bool) -> Tile:
    """The tile :func:`i8_gemm` runs when none is named: :data:`GELU_TILE` for the GELU epilogues, else
    :data:`DEFAULT_TILE` (docs/decisions/0169: three consumers on 64 x 128 tiles won every transformer GEMM but linear1
    with the GELU, where two on 64 x 256 ran 94.5 us against 99.8)."""
    return GELU_TILE if gelu else DEFAULT_TILE


@dataclass(frozen=True)
class Variant:
    """Everything compiled into one cubin: the tile and the epilogue (``out`` "float16" / "int8" codes, ``gelu``,
    ``residual`` added to the fp16 output).  Bias (none / fp32 / fp16) is a run-time argument."""

    tile: Tile = DEFAULT_TILE
    out: str = "float16"
    gelu: bool = False
    residual: bool = False

    def __post_init__(self):
        if self.out not in OUTS:
            raise ValueError(f"out must be one of {OUTS}, got {self.out!r}")
        if self.residual and self.out != "float16":
            raise ValueError("the residual is added to the float16 output; int8 codes take no residual")

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes

    def defines(self) -> list[str]:
        t = self.tile
        return [f"I8G_BN={t.bn}", f"I8G_WM={t.wm}", f"I8G_STAGES={t.stages}", f"I8G_OUT={OUTS.index(self.out)}",
                f"I8G_GELU={int(self.gelu)}", f"I8G_RES={int(self.residual)}", f"I8G_SMEM={self.smem_bytes}",
                f"I8G_NC={t.consumers}"]

    def __str__(self) -> str:
        return (f"{self.tile}_{'f16' if self.out == 'float16' else 'i8'}" + "_gelu" * self.gelu
                + "_res" * self.residual)


# ------------------------------------------------------------------------------------------------
# Compiling (no GPU needed)
# ------------------------------------------------------------------------------------------------


def cubin_path(variant: Variant, arch: str = "sm_90a") -> Path:
    return source_cubin_path(SOURCE_PATH, variant.defines(), arch)


def compile_variant(variant: Variant, arch: str = "sm_90a", *, use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin bytes, ptxas log) of ``variant``; cached on disk.  Raises ``RuntimeError`` with NVRTC's log."""
    if arch != "sm_90a":
        raise ValueError(f"i8_gemm is sm_90a only (wgmma, setmaxnreg), got arch={arch!r}")
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"i8_gemm_{variant}", use_cache=use_cache)


def _compile_one(args) -> str:
    variant, arch = args
    compile_variant(variant, arch)
    return str(variant)


def precompile(variants: Iterable[Variant], arch: str = "sm_90a", workers: int | None = None) -> int:
    """Compile every variant not yet in the disk cache, in ``workers`` processes; returns how many were compiled."""
    todo = sorted({v for v in variants if not cubin_path(v, arch).exists()}, key=str)
    return compile_all(_compile_one, [(v, arch) for v in todo], workers)


# ------------------------------------------------------------------------------------------------
# Loading and launching (GPU)
# ------------------------------------------------------------------------------------------------


def get_kernel(variant: Variant, device_index: int):
    return load_kernel(("i8_gemm", variant, device_index), SOURCE_PATH, variant.defines(), f"i8_gemm_{variant}",
                       "i8_gemm", device_index, variant.smem_bytes)


_tmaps: dict = {}
_TMAP_CACHE = 4096


def _swizzle_128b():
    import cuda.core as cc  # lazy: cuda.core is needed on a GPU only

    enum = getattr(cc, "TensorMapSwizzle", None) or cc._tensor_map.TensorMapSwizzle  # not re-exported in 1.2
    return enum.SWIZZLE_128B


class _Address:
    """A contiguous 2-D int8 CUDA tensor's address and shape as bytes (``__cuda_array_interface__``, uint8: TMA copies
    bytes, and cuda.core maps no int8 dtype) without the tensor."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "strides": None, "version": 3}


def tensor_map(t: torch.Tensor, box_rows: int):
    """The TMA descriptor of a contiguous (rows, K) int8 tensor, box ``box_rows`` x 128 bytes, 128-byte swizzled as
    wgmma reads it; out-of-bounds rows and columns read as zeros.  Memoised on (address, shape, box)."""
    key = (t.data_ptr(), tuple(t.shape), box_rows, t.device.index)
    m = _tmaps.get(key)
    if m is None:
        from cuda.core.utils import StridedMemoryView

        view = StridedMemoryView.from_cuda_array_interface(_Address(t), stream_ptr=-1)
        m = view.as_tensor_map(box_dim=(box_rows, _BK), swizzle=_swizzle_128b())
        if len(_tmaps) >= _TMAP_CACHE:
            _tmaps.clear()
        _tmaps[key] = m
    return m


def launch_i8_gemm(variant: Variant, a, w, out, a_scale, w_scale, bias, out_scale, residual) -> None:
    """Launch ``variant`` on the current stream of ``out``'s device; every tensor already checked (:func:`i8_gemm`)."""
    dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
    kernel = get_kernel(variant, dev)
    t = variant.tile
    M, K = a.shape
    N = w.shape[0]
    tiles = -(-M // t.bm) * -(-N // t.bn)
    blocks = min(tiles, sm_count(out.device)[0])  # persistent: one block an SM at most
    cfg = launch_config((blocks,), (t.threads,), variant.smem_bytes, False, dev)
    launch(kernel, cfg, out.device, tensor_map(a, t.bm), tensor_map(w, t.bn), ptr(out), ptr(a_scale), ptr(w_scale),
           ptr(bias), np.int32(int(bias is not None and bias.dtype == torch.float16)), ptr(out_scale), ptr(residual),
           np.int32(M), np.int32(N), np.int32(K))


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)} on {x.device}" + ("" if x.is_contiguous() else " (not contiguous)")
    return type(x).__name__


def _check_vector(name: str, v, n: int, dtypes: tuple, fix: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dtype not in dtypes or v.numel() != n or not v.is_contiguous():
        allowed = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be a contiguous {allowed} tensor of {n} element(s), got {_desc(v)}; {fix}")


def check_args(a, w, a_scale, w_scale, bias=None, gelu=False, out_scale=None, residual=None) -> tuple[int, int, int]:
    """(M, N, K) of valid :func:`i8_gemm` arguments, else a ValueError naming the value, what is allowed and the fix.
    Device placement is checked last, so CPU tensors exercise every other rule."""
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D torch.int8 tensor ({'(M, K)' if name == 'a' else '(N, K)'}), got "
                             f"{_desc(t)}; quantize to ShiftedInt8 int8 codes first (value = code)")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be row-major contiguous (K-major, as TMA reads it), got strides "
                             f"{t.stride()}; pass {name}.contiguous()")
    M, K = a.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"a (M, K) = {tuple(a.shape)} and w (N, K) = {tuple(w.shape)} disagree on K: {K} vs {Kw}")
    if K == 0 or K % K_ALIGN or K >= K_MAX:
        raise ValueError(f"K must be a positive multiple of {K_ALIGN} below {K_MAX} (TMA needs 16-byte row pitches; "
                         f"int32 sums stay exact below 2^17), got K={K}; zero-pad a and w along K to a multiple of 16")
    _check_vector("a_scale", a_scale, 1, (torch.float32,), "pass the per-tensor activation scale as a 1-element "
                  "float32 tensor on the GPU (a device value, not a Python float: CUDA graphs replay it)")
    _check_vector("w_scale", w_scale, N, (torch.float32,), "pass the per-output-channel weight scales, (N,) float32")
    if bias is not None:
        _check_vector("bias", bias, N, (torch.float32, torch.float16), "pass bias=None or an (N,) fp32 / fp16 tensor")
    if not isinstance(gelu, bool):
        raise ValueError(f"gelu must be True or False, got {gelu!r}")
    if out_scale is not None:
        _check_vector("out_scale", out_scale, 1, (torch.float32,), "pass the next layer's activation scale as a "
                      "1-element float32 tensor, or out_scale=None for fp16 output")
        if residual is not None:
            raise ValueError("residual is added to the fp16 output; with out_scale (int8 codes out) pass residual=None")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float16 or \
                tuple(residual.shape) != (M, N) or not residual.is_contiguous():
            raise ValueError(f"residual must be a contiguous torch.float16 tensor of the output's shape {(M, N)}, got "
                             f"{_desc(residual)}")
    dev = a.device
    tensors = {"a": a, "w": w, "a_scale": a_scale, "w_scale": w_scale, "bias": bias, "out_scale": out_scale,
               "residual": residual}
    if dev.type != "cuda":
        raise ValueError(f"i8_gemm runs on CUDA tensors (an sm_90 GPU), got a on {dev}; move the tensors to the GPU "
                         "or use tcprec.kernels.reference_i8_gemm.i8_gemm_reference")
    for name, t in tensors.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but a is on {dev}; put every tensor on one device")
    return M, N, K


def i8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
            bias: Optional[torch.Tensor] = None, *, gelu: bool = False, out_scale: Optional[torch.Tensor] = None,
            residual: Optional[torch.Tensor] = None, tile: Tile | str | None = None) -> torch.Tensor:
    """``epilogue(a @ w.T)`` on the INT8 tensor cores (sm_90a): fp16 (M, N), or int8 codes (M, N) with ``out_scale``.

    a (M, K) int8 and w (N, K) int8, row-major; K a multiple of 16 (TMA's 16-byte row pitch), M and N any.
    a_scale: float32, one element (device memory); w_scale: (N,) float32; bias: (N,) fp32 / fp16 or None;
    gelu: erf GELU after the bias; out_scale: float32, one element: write ``clamp(rint(y / out_scale), -128, 127)``
    (the next layer's ``int8`` ShiftedInt8 codes) instead of fp16; residual: (M, N) fp16 added to the fp16 output.
    ``tile``: a :class:`Tile` or its name (default :data:`DEFAULT_TILE`).  The result equals
    ``reference_i8_gemm.i8_gemm_reference`` (int32 exact; the float32 epilogue the same but for erf's last bits).

    Example (on an H100 / H200)::

        a = torch.randint(-128, 128, (197, 768), dtype=torch.int8, device="cuda")
        w = torch.randint(-128, 128, (2304, 768), dtype=torch.int8, device="cuda")
        y = i8_gemm(a, w, torch.tensor([0.02], device="cuda"), torch.full((2304,), 1e-3, device="cuda"))
    """
    M, N, K = check_args(a, w, a_scale, w_scale, bias, gelu, out_scale, residual)
    cap = torch.cuda.get_device_capability(a.device)
    if cap != (9, 0):
        raise ValueError(f"i8_gemm needs an sm_90 GPU (H100 / H200: wgmma, setmaxnreg), this one is "
                         f"sm_{cap[0]}{cap[1]}; use torch._int_mm or the Triton INT8 kernel")
    t = parse_tile(tile) if isinstance(tile, str) else (tile or default_tile(gelu))
    variant = Variant(t, "int8" if out_scale is not None else "float16", gelu, residual is not None)
    # TMA needs 16-byte aligned base addresses (a fresh tensor is; an offset view may not be)
    a = a if a.data_ptr() % 16 == 0 else a.clone()
    w = w if w.data_ptr() % 16 == 0 else w.clone()
    out = torch.empty((M, N), dtype=torch.int8 if out_scale is not None else torch.float16, device=a.device)
    if M == 0 or N == 0:
        return out
    # the general epilogue reads column pairs as one float2 (w_scale, fp32 bias) and the residual as 4-byte words, the
    # fast one the residual as 16-byte vectors
    w_scale = w_scale if w_scale.data_ptr() % 8 == 0 else w_scale.clone()
    if bias is not None and bias.data_ptr() % 8:
        bias = bias.clone()
    if residual is not None and residual.data_ptr() % 16:
        residual = residual.clone()
    launch_i8_gemm(variant, a, w, out, a_scale, w_scale, bias, out_scale, residual)
    return out
