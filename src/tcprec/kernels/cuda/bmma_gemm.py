"""The bit-serial binary tensor-core GEMM (``bmma_gemm.cu``): its variants, tile choices, TMA maps,
split-K workspace, launch, and the custom op ``torch.ops.tcprec.bmma_gemm``.

One CUDA source serves every variant: a :class:`Variant` (bit widths, two's complement flags, tile
shape, pipeline depth, epilogue) becomes ``-D`` defines; ``runtime.py`` compiles it with NVRTC (no
GPU needed: CI compiles variants for sm_90a), caches the cubin on disk, loads it once per device
and launches it on PyTorch's current stream, so it works under ``torch.cuda.graph`` capture.
``torch.ops.tcprec.bmma_gemm`` (registered at the bottom, when this module is imported) is the entry
point ``tcprec.ops.matmul`` and ``tcprec.ops.qconv`` use; it has a fake (meta) implementation, so
``torch.compile`` traces through it.  The measured constants of the tile choices are data:
``bmma_gemm_tiles.json`` beside this file.  Compiling one variant takes ~1-2 s of CPU;
:func:`precompile` compiles many in parallel processes.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from ...memo import remembered
from .codes import Encoding, Epilogue, OutType
from ..reference_bitplanes import packed_words
from ..reference_conv_bitserial import check_conv_row_scale, implicit_conv_fits
from ..tile_tables import int_in, load_table, nonneg_int, pos_int, record
from .runtime import (
    compile_all,
    compile_source,
    cuda_core_api,
    default_arch,
    launch,
    launch_config,
    load_kernel,
    ptr,
    sm_count as device_sms,
    source_cubin_path,
)

__all__ = [
    "SOURCE_PATH",
    "EPILOGUES",
    "OUT_KINDS",
    "Variant",
    "Tile",
    "n_classes",
    "SMALL_TILE",
    "pick_tile",
    "gemm_entry",
    "wgmma_tile",
    "MMAS",
    "parse_tile",
    "compile_variant",
    "precompile",
    "cubin_path",
    "get_kernel",
    "launch_bmma",
    "can_run",
    "tensor_map",
]

SOURCE_PATH = Path(__file__).with_name("bmma_gemm.cu")
EPILOGUES = ("int32", "float", "packed")
OUT_KINDS = ("int32", "float32", "float16", "bfloat16", "packed")
_OUT_T = {t.name.lower(): t for t in OutType}  # out_dtype name -> TCP_OUT_T
_OENC = {e.name.lower(): e for e in Encoding}  # out_encoding -> TCP_OENC
_ACC_REG_BUDGET = 128  # int32 accumulator registers a thread may spend (of 255)
_MAX_SMEM = 227 * 1024  # Hopper's opt-in dynamic shared memory per block
_WGMMA_N = (32, 64, 96, 128, 192, 256)  # a warpgroup's N in the kernel's wgmma wrappers


# ------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------


def _plane_weight(i: int, bits: int, twos: bool) -> int:
    return -(1 << i) if (twos and i == bits - 1) else (1 << i)


def n_classes(p: int, q: int, a_twos: bool = False, w_twos: bool = False) -> int:
    """Accumulators per output element: distinct weights among the p*q plane pairs (the kernel's
    ``ClassTable``).  Unsigned codes: p + q - 1.

    >>> n_classes(2, 2), n_classes(2, 2, True, True), n_classes(1, 4)
    (3, 3, 4)
    """
    return len({_plane_weight(i, p, a_twos) * _plane_weight(j, q, w_twos) for i in range(p) for j in range(q)})


MMAS = ("sync", "wgmma")


@dataclass(frozen=True)
class Tile:
    """Block tile ``bm x bn`` outputs, ``warps_m x warps_n`` warps, ``stages``-deep cp.async ring
    of ``bk``-bit K steps (512 or 1024); ``frag_db`` double-buffers the register fragments.

    ``mma="wgmma"``: Hopper's warpgroup MMA (sm_90a) instead of ``mma.sync``; then every 4 warps
    along M form a warpgroup that owns a 64 x (bn / warps_n) slab (bm = 16 * warps_m, warps_m a
    multiple of 4), and bk is 1024.  ``fold`` (wgmma, unsigned codes): one accumulator, each plane
    pair's wgmma issued ``weight`` times (see bmma_gemm.cu).

    ``tma`` (wgmma): a warp-specialised pipeline -- one producer warpgroup loads the stages with TMA
    (mbarrier-completed, 128-byte swizzle) while the ``warps_m / 4`` MMA warpgroups (``warps_n`` = 1)
    multiply; ``cluster = (cm, cn)`` groups cm x cn blocks whose shared A / W tiles are loaded once and
    multicast to all of them.

    ``split = s`` > 1 (``_sk<s>``; the cp.async paths, not TMA, no implicit convolution): split-K, s blocks a tile,
    each on a run of the K steps, their int32 sums added in a workspace (bmma_gemm.cu, TCP_SPLIT): exact."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    stages: int = 4
    bk: int = 512
    frag_db: bool = False
    mma: str = "sync"
    fold: bool = False
    tma: bool = False
    cluster: tuple[int, int] = (1, 1)
    split: int = 1

    def __str__(self) -> str:
        s = f"{self.bm}x{self.bn}_w{self.warps_m}x{self.warps_n}_s{self.stages}"
        return (s + ("" if self.bk == 512 else f"_k{self.bk}") + ("_db" if self.frag_db else "")
                + ("_wg" if self.mma == "wgmma" else "") + ("_f" if self.fold else "")
                + ("_tma" if self.tma else "")
                + ("" if self.cluster == (1, 1) else f"_c{self.cluster[0]}x{self.cluster[1]}")
                + (f"_sk{self.split}" if self.split > 1 else ""))

    @property
    def cluster_size(self) -> int:
        return self.cluster[0] * self.cluster[1]


def parse_tile(text: str) -> Tile:
    """``"64x256_w2x4_s4"`` / ``"64x256_w2x4_s3_k1024_db"`` / ``"128x128_w8x1_s4_k1024_wg"`` /
    ``"128x256_w8x2_s3_k1024_wg_f"`` / ``"128x256_w8x1_s3_k1024_wg_f_tma_c2x1"`` /
    ``"32x32_w2x2_s2_k1024_sk4"`` (as ``str(Tile)`` writes it) -> Tile."""
    try:
        mn, w, s, *extra = text.split("_")
        bm, bn = (int(v) for v in mn.split("x"))
        wm, wn = (int(v) for v in w.removeprefix("w").split("x"))
        bk, db, mma, fold, tma, cluster, split = 512, False, "sync", False, False, (1, 1), 1
        for e in extra:
            if e.startswith("sk"):
                split = int(e[2:])
            elif e == "db":
                db = True
            elif e == "wg":
                mma = "wgmma"
            elif e == "f":
                fold = True
            elif e == "tma":
                tma = True
            elif e.startswith("c") and "x" in e:
                cm, cn = (int(v) for v in e[1:].split("x"))
                cluster = (cm, cn)
            elif e.startswith("k"):
                bk = int(e[1:])
            else:
                raise ValueError(e)
        return Tile(bm, bn, wm, wn, int(s.removeprefix("s")), bk, db, mma, fold, tma, cluster, split)
    except ValueError:
        raise ValueError(f"tile must look like '64x256_w2x4_s4' "
                         f"(BMxBN_wWARPS_MxWARPS_N_sSTAGES[_kBK][_db][_wg][_f][_tma][_cCMxCN][_skS]), "
                         f"got {text!r}") from None


@dataclass(frozen=True)
class Variant:
    """Everything that is compiled into one cubin."""

    p: int  # activation (A) bits
    q: int  # weight (W) bits
    a_twos: bool = False
    w_twos: bool = False
    tile: Tile = Tile(64, 256, 2, 4, 4)
    epilogue: str = "int32"  # "int32" | "float" | "packed"
    out_dtype: str = "float32"  # float epilogue: "float32" | "float16" | "bfloat16"
    out_bits: int = 1  # packed epilogue: the next layer's format
    out_encoding: str = "unsigned"
    conv: bool = False  # implicit-GEMM convolution: A gathered from NHWC input planes (bmma_gemm.cu, TCP_CONV)
    res: bool = False  # the float epilogue adds a residual before the activation (bmma_gemm.cu, TCP_RES)
    dual: bool = False  # the 16-bit float output and its out_bits planes, compact rows (bmma_gemm.cu, TCP_DUAL)
    rowsum: bool = False  # the row term from in-kernel row sums of A (bmma_gemm.cu, TCP_ROWSUM), not a row_term
    # the epilogue's activation and bias compiled in (bmma_gemm.cu, TCP_ACT / TCP_BIAS): "any" reads relu, slope and
    # the bias pointer at run time, and so compiles every path of each; "none" / "relu" / "leaky" and True / False
    # compile one, for half the code
    act: str = "any"
    has_bias: Optional[bool] = None
    # no row scale compiled in (bmma_gemm.cu, TCP_RSCALE = 0): False; None reads it at run time (a GEMM whose rows are
    # all scaled by 1 then multiplies by 1.0 -- exact, one multiply an output more)
    row_scale: Optional[bool] = None

    def __post_init__(self):
        for name, v in (("p", self.p), ("q", self.q)):
            if not 1 <= v <= 8:
                raise ValueError(f"{name} (bits) must be 1..8 for the bit-serial GEMM, got {name}={v}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.out_dtype not in _OUT_T:
            raise ValueError(f"out_dtype must be one of {tuple(_OUT_T)}, got {self.out_dtype!r}")
        if self.out_encoding not in _OENC or not 1 <= self.out_bits <= 8:
            raise ValueError(f"packed output must be 1..8 bits of {tuple(_OENC)}, got {self.out_bits} {self.out_encoding!r}")
        t = self.tile
        if t.bm % (16 * t.warps_m) or t.bn % (16 * t.warps_n) or t.stages < 2 or t.bk not in (512, 1024):
            raise ValueError(f"tile {t}: bm must be a multiple of 16*warps_m, bn of 16*warps_n, stages >= 2, "
                             "bk 512 or 1024")
        if t.mma not in MMAS:
            raise ValueError(f"tile {t}: mma must be one of {MMAS}, got {t.mma!r}")
        if t.mma == "wgmma":
            wn = t.bn // t.warps_n if t.bn % t.warps_n == 0 else 0
            if t.bk != 1024 or t.warps_m % 4 or t.bm != 16 * t.warps_m or wn not in _WGMMA_N or t.frag_db \
                    or t.stages < 3:
                raise ValueError(f"tile {t}: wgmma needs bk=1024, warps_m a multiple of 4 with bm = 16*warps_m, "
                                 f"bn / warps_n in {_WGMMA_N}, >= 3 stages and no frag_db "
                                 "(e.g. '128x128_w8x1_s4_k1024_wg')")
        if t.fold and (t.mma != "wgmma" or self.a_twos or self.w_twos):
            raise ValueError(f"tile {t}: a folded tile (one accumulator, each plane pair's wgmma repeated by its "
                             "weight) needs the wgmma path and unsigned codes (two's complement has negative weights)")
        if t.tma:
            cm, cn = t.cluster
            if t.mma != "wgmma" or t.warps_n != 1 or cm not in (1, 2) or cn not in (1, 2) \
                    or (t.bm // cn) % 8 or (t.bn // cm) % 8:
                raise ValueError(f"tile {t}: TMA needs the wgmma path with warps_n = 1 (one MMA warpgroup per 64 "
                                 "rows) and a cluster of 1..2 x 1..2 blocks whose tile slices are multiples of 8 "
                                 "rows (e.g. '128x256_w8x1_s3_k1024_wg_f_tma_c2x1')")
        elif t.cluster != (1, 1):
            raise ValueError(f"tile {t}: clusters need the TMA pipeline (add '_tma')")
        if self.rowsum and t.split > 1:
            raise ValueError(f"tile {t}: in-kernel row sums (rowsum) are not computed by split-K tiles (_sk<s>); "
                             "use an unsplit tile or pass row_term")
        if t.split < 1 or (t.split > 1 and (t.tma or self.conv)):
            raise ValueError(f"tile {t}: split-K (_sk<s>) needs s >= 1 and the cp.async pipeline (no _tma) of a plain "
                             "GEMM (no implicit convolution), e.g. '32x32_w2x2_s2_k1024_sk4'")
        if self.conv and t.tma and (t.cluster != (1, 1) or t.stages < 3):
            raise ValueError(f"tile {t}: the implicit-GEMM convolution on the TMA pipeline needs no cluster and "
                             ">= 3 stages (e.g. '128x256_w8x1_s4_k1024_wg_tma')")
        if self.epilogue == "packed" and (t.bn % 32 or 512 % t.bn or (t.bn // t.warps_n) % 32):
            raise ValueError(f"tile {t}: the packed epilogue needs bn dividing 512 and a multiple of 32, and whole "
                             "32-column words a warp (bn / warps_n a multiple of 32)")
        if self.res and self.epilogue != "float":
            raise ValueError(f"a residual is added by the float epilogue only, not epilogue={self.epilogue!r}")
        if self.dual and (self.epilogue != "float" or self.out_dtype == "float32" or self.out_bits > 3
                          or t.bn % 32 or (t.bn // t.warps_n) % 32):
            raise ValueError(f"tile {t}: the dual output (a float16 / bfloat16 output and its planes) needs the float "
                             f"epilogue of a 16-bit dtype, planes of <= 3 bits, and whole 32-column words a warp "
                             f"(bn / warps_n a multiple of 32), got epilogue={self.epilogue!r} "
                             f"out_dtype={self.out_dtype!r} out_bits={self.out_bits}")
        if self.act not in _ACTS:
            raise ValueError(f"act must be one of {tuple(_ACTS)}, got {self.act!r}")
        if self.row_scale not in (None, False):
            raise ValueError(f"row_scale is None (read at run time) or False (none compiled in), got {self.row_scale!r}")
        if self.smem_bytes > _MAX_SMEM:
            raise ValueError(f"tile {t} needs {self.smem_bytes} bytes of shared memory, more than {_MAX_SMEM}")

    def check_call(self, relu: bool, leaky_slope: float, bias, row_scale=None) -> None:
        """ValueError unless a launch's ``relu`` / ``leaky_slope`` / ``bias`` / ``row_scale`` are what this variant
        compiled in."""
        act = act_of(relu, leaky_slope)
        if self.act not in ("any", act) or self.has_bias not in (None, bias is not None) or \
                (self.row_scale is False and row_scale is not None):
            raise ValueError(f"variant {self} compiles act={self.act!r}, has_bias={self.has_bias}, "
                             f"row_scale={self.row_scale}; the call has act={act!r} (relu={relu}, leaky_slope="
                             f"{leaky_slope}), bias {'given' if bias is not None else 'None'} and row_scale "
                             f"{'given' if row_scale is not None else 'None'}: use the variant of the call "
                             "(_variant_for) or act='any', has_bias=None, row_scale=None")

    @property
    def threads(self) -> int:
        """Threads a block: the MMA warps, plus the producer warpgroup with TMA."""
        return 32 * self.tile.warps_m * self.tile.warps_n + (128 if self.tile.tma else 0)

    @property
    def n_classes(self) -> int:
        """Accumulators an output element keeps: one when folded."""
        return 1 if self.tile.fold else n_classes(self.p, self.q, self.a_twos, self.w_twos)

    @property
    def int_thresholds(self) -> bool:
        """Whether the packed epilogue takes integer threshold words (bmma_code_thresholds): OB <= 3."""
        return self.epilogue == "packed" and self.out_bits <= 3

    @property
    def smem_bytes(self) -> int:
        t = self.tile
        pipe = t.stages * (self.p * t.bm + self.q * t.bn) * (t.bk // 8)
        align = 1024 if t.mma == "wgmma" else 0  # the kernel aligns its tiles to 1024 bytes
        if self.rowsum and align:  # the all-ones B tile of the row sums, 1 KB aligned after the stages (ONES_OFF)
            pipe = -(-pipe // 1024) * 1024 + 1024
        # the epilogue's row / column vectors (bmma_gemm.cu VEC_OFF), and the packed epilogue's code thresholds
        # (+ the integer threshold words of OB <= 3: 2^OB a column)
        codes = (1 << self.out_bits) if self.epilogue == "packed" or self.dual else 0
        per = 2 * t.bm + 3 * t.bn + codes + (codes * t.bn if self.int_thresholds else 0)
        barriers = 2 * t.stages * 8 if t.tma else 0  # TMA: the "full" and "empty" mbarriers (BAR_OFF)
        base = align + -(-pipe // 16) * 16
        # one copy (VEC_STRIDE); with TMA a copy a warpgroup where those fit (bmma_gemm.cu, WG_VEC)
        wg = t.warps_m // 4
        per_wg = base + -(-(wg * -(-per // 4) * 4 * 4) // 8) * 8 + barriers
        if t.tma and wg > 1 and per_wg <= _MAX_SMEM:
            return per_wg
        return base + -(-(per * 4) // 8) * 8 + barriers

    def defines(self) -> list[str]:
        t = self.tile
        epi = Epilogue.of(self.epilogue)
        return [
            f"TCP_P={self.p}", f"TCP_Q={self.q}", f"TCP_A_TWOS={int(self.a_twos)}", f"TCP_W_TWOS={int(self.w_twos)}",
            f"TCP_BM={t.bm}", f"TCP_BN={t.bn}", f"TCP_WARPS_M={t.warps_m}", f"TCP_WARPS_N={t.warps_n}",
            f"TCP_STAGES={t.stages}", f"TCP_BK={t.bk}", f"TCP_FRAG_DB={int(t.frag_db)}",
            f"TCP_WGMMA={int(t.mma == 'wgmma')}", f"TCP_FOLD={int(t.fold)}", f"TCP_TMA={int(t.tma)}",
            f"TCP_CM={t.cluster[0]}", f"TCP_CN={t.cluster[1]}", f"TCP_EPI={int(epi)}",
            f"TCP_OUT_T={int(_OUT_T[self.out_dtype])}",
            f"TCP_OB={self.out_bits}", f"TCP_OENC={int(_OENC[self.out_encoding])}", f"TCP_SMEM={self.smem_bytes}",
            f"TCP_CONV={int(self.conv)}", f"TCP_RES={int(self.res)}", f"TCP_DUAL={int(self.dual)}",
            f"TCP_ROWSUM={int(self.rowsum)}",
            f"TCP_SPLIT={int(t.split > 1)}", f"TCP_SPLIT_COUNTERS={SPLIT_COUNTERS}",
        ] + ([f"TCP_ACT={_ACTS[self.act]}"] if self.act != "any" else []) \
            + ([f"TCP_BIAS={int(self.has_bias)}"] if self.has_bias is not None else []) \
            + (["TCP_RSCALE=0"] if self.row_scale is False else [])

    def __str__(self) -> str:
        sign = ("s" if self.a_twos else "u") + ("s" if self.w_twos else "u")
        epi = {"int32": "i32", "float": self.out_dtype, "packed": f"{self.out_encoding}{self.out_bits}"}[self.epilogue]
        return (f"a{self.p}w{self.q}{sign}_{self.tile}_{epi}" + "_conv" * self.conv + "_res" * self.res
                + f"_dual{self.out_encoding}{self.out_bits}" * self.dual + "_rs" * self.rowsum
                + ("" if self.act == "any" else f"_{self.act}") + {None: "", True: "_b", False: "_nb"}[self.has_bias]
                + "_nrs" * (self.row_scale is False))


_ACTS = {"any": -1, "none": 0, "relu": 1, "leaky": 2}  # bmma_gemm.cu TCP_ACT


def act_of(relu: bool, leaky_slope: float) -> str:
    """The epilogue activation of a call: "none", "relu" or "leaky" (relu with a nonzero slope)."""
    return "none" if not relu else ("relu" if leaky_slope == 0.0 else "leaky")


def _warp_tiles(p: int, q: int, nc: int) -> tuple[int, int]:
    """(MT, NT): 16-row x 8-column MMA tiles per warp.  Accumulators nc*MT*NT*4 <= budget; among
    those, fewest shared-memory fragment bytes per MMA ((p*MT*512 + q*NT*256) / (p*q*MT*NT)),
    then the largest tile."""
    best = None
    for mt in (1, 2, 4):
        for nt in (2, 4, 8):
            if nc * mt * nt * 4 > _ACC_REG_BUDGET and (mt, nt) != (1, 2):
                continue
            cost = (p * mt * 512 + q * nt * 256) / (p * q * mt * nt)
            key = (cost, -mt * nt)
            if best is None or key < best[0]:
                best = (key, (mt, nt))
    return best[1]


# The tile choices' measured constants are data (bmma_gemm_tiles.json: each value with what was measured to pick it).
TILE_TABLE_PATH = Path(__file__).with_name("bmma_gemm_tiles.json")


def _tile_name(v) -> str | None:
    try:
        parse_tile(v)
        return None
    except (ValueError, TypeError, AttributeError):
        return "a tile name as str(Tile) writes it, e.g. '32x32_w2x2_s2_k1024'"


_RULES = {  # what each entry must be (validated at import: kernels/tile_tables.py, decision 0033)
    "small_tile": _tile_name,
    "small_packed_tile": _tile_name,
    "sync_tile": record(warps_m=int_in((1, 2, 4)), warps_n=int_in((1, 2, 4)), stages=int_in(range(2, 9)),
                        bk=int_in((512, 1024))),
    "words_per_step_512": int_in(range(0, 17)),  # 512 bits = 16 words
    "split_k": record(min_steps=pos_int, steps_per_run=pos_int, max_runs=pos_int),
    "tma": record(bm=int_in((64, 128, 192, 256)), max_stages=int_in(range(3, 17))),
    "conv_wide_tile": record(bm=int_in((128, 192, 256)), min_tiles_per_sm=pos_int),
    "int_threshold_tiles_per_sm": nonneg_int,
}


def _CHECK(t: dict) -> str | None:
    """The default small tiles are whole mma.sync tiles: split-K is split_k's decision, not a tile's."""
    for key in ("small_tile", "small_packed_tile"):
        tile = parse_tile(t[key])
        if tile.split != 1 or tile.mma != "sync":
            return f"{key} must be an mma.sync tile without split-K (split_k decides that), got {t[key]!r}"
    return None


_TABLE = load_table(TILE_TABLE_PATH, _RULES, _CHECK)
# the mma.sync tile of a problem that fills the SMs: 2 x 2 warps (two blocks an SM), 1024-bit steps, 3 stages
_SYNC = _TABLE["sync_tile"]
# the tile of a problem with fewer blocks than SMs: more, smaller blocks
SMALL_TILE = parse_tile(_TABLE["small_tile"])
# ... and for packed output of more than one row tile (the convolutions of a batch-8 network)
SMALL_PACKED_TILE = parse_tile(_TABLE["small_packed_tile"])
# a K of at most this many words is one 512-bit step on an mma.sync tile (not a 1024-bit step half zero-filled)
_WORDS_PER_STEP_512 = _TABLE["words_per_step_512"]
# Split-K (Tile.split) for one row tile and >= SPLIT_MIN_STEPS K steps: SPLIT_STEPS or more steps a run, at most
# SPLIT_MAX runs
SPLIT_MIN_STEPS = _TABLE["split_k"]["min_steps"]
SPLIT_STEPS = _TABLE["split_k"]["steps_per_run"]
SPLIT_MAX = _TABLE["split_k"]["max_runs"]
_WGMMA_ACC_BUDGET = 128  # int32 accumulator registers a wgmma thread may spend (ptxas adds ~90-100 more)


# The wgmma tiles run the persistent TMA pipeline (bmma_gemm.cu, TCP_TMA): two MMA warpgroups of 64 rows
# (bm = 128) and one producer warpgroup.  What had bounded the cp.async wgmma kernel was not L2 traffic but the
# float epilogue: a block spent ~45% of its time storing; the persistent kernel's producer loads the next tile
# meanwhile, and the epilogue has no bounds checks inside M x N.  Folding and clusters measured slower (table).
_TMA_BM = _TABLE["tma"]["bm"]
_TMA_MAX_STAGES = _TABLE["tma"]["max_stages"]
# Implicit convolutions (the producer gathers A; a tile is one or two K steps) whose warpgroup N leaves the
# accumulators half the budget -- w1a2 on 64 columns, ResNet-18's stages 0 / 1 -- take three MMA warpgroups (bm = 192,
# 3 stages; 512 threads cap ptxas at 128 registers, so only half the accumulators fit): the per-tile work of a consumer
# (barriers, epilogue set-up, the wgmma issue) spreads over 1.5x the rows and a scheduler keeps 4 warps instead of 3.
# Measured: the table's conv_wide_tile.  (192 x 128 spills 1.9 KB: not taken.)
_CONV_BM = _TABLE["conv_wide_tile"]["bm"]
# ... for a problem of >= this many tiles an SM at bm = 192 (at batch 8 the 128-row tile keeps every SM busy)
_CONV_MIN_TILES = _TABLE["conv_wide_tile"]["min_tiles_per_sm"]


def _deepest_tma_tile(p: int, q: int, a_twos: bool, w_twos: bool, bm: int, bn: int, epilogue: str) -> Optional[Tile]:
    """The TMA wgmma tile bm x bn (bm / 16 warps along M) with as many stages (3 .. :data:`_TMA_MAX_STAGES`) as
    shared memory holds for ``epilogue`` ("packed" or else "float"); None when not even 3 fit."""
    for stages in range(_TMA_MAX_STAGES, 2, -1):
        t = Tile(bm, bn, bm // 16, 1, stages, 1024, mma="wgmma", tma=True)
        try:
            Variant(p, q, a_twos, w_twos, t, "packed" if epilogue == "packed" else "float")
            return t
        except ValueError:  # more shared memory than a block may have
            continue
    return None


def conv_wgmma_tile(t: Tile, p: int, q: int, a_twos: bool, w_twos: bool, epilogue: str, M: int, N: int,
                    sm_count: int) -> Tile:
    """The tile an implicit convolution (or a plain GEMM of one K step: a 1x1 convolution's) runs in place of the
    picked TMA tile ``t``: three MMA warpgroups (bm =
    :data:`_CONV_BM`) with as many stages (>= 3) as fit, where the accumulators fit half the budget and the problem
    has :data:`_CONV_MIN_TILES` tiles an SM; else ``t``."""
    nc = n_classes(p, q, a_twos, w_twos)
    if not t.tma or nc * t.bn // 2 > _WGMMA_ACC_BUDGET // 2 or \
            -(-M // _CONV_BM) * -(-N // t.bn) < _CONV_MIN_TILES * sm_count:
        return t
    return _deepest_tma_tile(p, q, a_twos, w_twos, _CONV_BM, t.bn, epilogue) or t


def wgmma_tile(p: int, q: int, a_twos: bool = False, w_twos: bool = False, epilogue: str = "float",
               N: Optional[int] = None) -> Optional[Tile]:
    """The wgmma tile for (p, q): the persistent TMA kernel with bm = 128 (two MMA warpgroups), the widest
    warpgroup N whose accumulators (classes * N / 2 registers a thread) fit the 128-register budget -- or, for
    a problem of ``N`` columns narrower than that, the narrowest such width >= N (one column tile either way, so
    the same A traffic, without multiplying and storing columns past N) -- and as many stages (3..8) as shared
    memory holds for ``epilogue`` ("packed" keeps its codes there too, and needs N dividing 512); None when
    nothing fits or N would be < 64 (five or more weight classes: mma.sync)."""
    nc = n_classes(p, q, a_twos, w_twos)
    fits = [n for n in _WGMMA_N if n >= 64 and nc * n // 2 <= _WGMMA_ACC_BUDGET
            and (epilogue != "packed" or (n % 32 == 0 and 512 % n == 0))]
    if not fits:  # N = 32: measured slower than mma.sync (w2a2 8192^3: 1462 us vs 1156 us)
        return None
    wn = next((n for n in fits if N is not None and n >= N), fits[-1])
    return _deepest_tma_tile(p, q, a_twos, w_twos, _TMA_BM, wn, epilogue)


def pick_tile(p: int, q: int, a_twos: bool, w_twos: bool, M: int, N: int, sm_count: int = 132,
              arch: Optional[str] = None, epilogue: str = "float", kw: Optional[int] = None) -> Tile:
    """The default tile for an (M, N) problem whose packed rows are ``kw`` words (None: unknown).  On sm_90a
    (``arch``; default: the current CUDA device, else sm_90a) the :func:`wgmma_tile` (for ``epilogue``) when
    it exists and gives every SM a block; otherwise mma.sync with 4 warps (2 x 2), the register-bounded warp
    tile of :func:`_warp_tiles`, 1024-bit K steps, 3 stages; when that too leaves SMs idle (fewer blocks than
    SMs), :data:`SMALL_TILE` (32 x 32 outputs a block; :data:`SMALL_PACKED_TILE` for packed output of more than one
    row tile).  An mma.sync tile takes 512-bit steps when the whole K is one (``kw`` <= 16): a 1024-bit step would
    load and multiply as many zero words again.  One row tile and a long K (>= :data:`SPLIT_MIN_STEPS` steps: a
    linear layer at a small batch) is split along K (``Tile.split``)."""
    arch = arch or default_arch()
    if arch.endswith("a") and arch.startswith("sm_9"):
        wt = wgmma_tile(p, q, a_twos, w_twos, epilogue, N)
        if wt is not None and -(-M // wt.bm) * -(-N // wt.bn) >= sm_count:
            return wt
    mt, nt = _warp_tiles(p, q, n_classes(p, q, a_twos, w_twos))
    wm, wn = _SYNC["warps_m"], _SYNC["warps_n"]
    big = Tile(mt * 16 * wm, nt * 8 * wn, wm, wn, _SYNC["stages"], _SYNC["bk"])
    blocks = -(-M // big.bm) * -(-N // big.bn)
    wide = epilogue == "packed" and M > SMALL_TILE.bm and n_classes(p, q, a_twos, w_twos) * 16 <= _ACC_REG_BUDGET
    t = big if blocks >= sm_count else SMALL_PACKED_TILE if wide else SMALL_TILE
    if kw is not None and kw <= _WORDS_PER_STEP_512:
        return replace(t, bk=512)
    steps = k_steps(t, kw) if kw is not None else 0
    if M <= t.bm and steps >= SPLIT_MIN_STEPS:  # one row tile (a linear layer at a small batch) and a long K
        t = replace(t, split=min(SPLIT_MAX, steps // SPLIT_STEPS))
    return t


def k_steps(t: Tile, kw: int) -> int:
    """The pipeline's K steps over rows of ``kw`` words: bk bits each (the last one zero-filled past K)."""
    return -(-kw // (t.bk // 32))


# ------------------------------------------------------------------------------------------------
# Compiling (no GPU needed)
# ------------------------------------------------------------------------------------------------


def cubin_path(variant: Variant, arch: str = "sm_90a") -> Path:
    """Where the cubin of ``variant`` for ``arch`` lives in the disk cache."""
    return source_cubin_path(SOURCE_PATH, variant.defines(), arch)


def compile_variant(variant: Variant, arch: str = "sm_90a", *, use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin bytes, compiler log) for ``variant``; cached on disk.  Raises ``RuntimeError`` with
    NVRTC's log if the source does not compile."""
    return compile_source(SOURCE_PATH, variant.defines(), arch, f"bmma_gemm_{variant}", use_cache=use_cache)


def _compile_one(args) -> str:
    variant, arch = args
    compile_variant(variant, arch)
    return str(variant)


def precompile(variants: Iterable[Variant], arch: str = "sm_90a", workers: int | None = None) -> int:
    """Compile every variant not yet in the disk cache, in ``workers`` processes; returns how many
    were compiled."""
    todo = sorted({v for v in variants if not cubin_path(v, arch).exists()}, key=str)
    return compile_all(_compile_one, [(v, arch) for v in todo], workers)


# ------------------------------------------------------------------------------------------------
# Loading and launching (GPU)
# ------------------------------------------------------------------------------------------------


def can_run(device: torch.device) -> tuple[bool, str]:
    """Whether the kernel can run on ``device`` (a reason either way)."""
    if device.type != "cuda":
        return False, f"tensors on {device.type}: the binary tensor-core kernel needs CUDA tensors"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return False, f"b1 mma AND+popc needs sm_80 or newer, this GPU is sm_{cap[0]}{cap[1]}"
    try:
        cuda_core_api()
    except Exception as e:
        return False, str(e) if isinstance(e, ModuleNotFoundError) else f"cuda.core: {type(e).__name__}: {e}"
    return True, f"sm_{cap[0]}{cap[1]} has native BMMA AND.POPC"


def get_kernel(variant: Variant, device_index: int):
    """The loaded ``bmma_gemm`` kernel of ``variant`` on CUDA device ``device_index`` (compiled or
    read from the disk cache the first time)."""
    return load_kernel(("bmma_gemm", variant, device_index), SOURCE_PATH, variant.defines(), f"bmma_gemm_{variant}",
                       "bmma_gemm", device_index, variant.smem_bytes)


_tmaps: dict = {}
_TMAP_CACHE = 4096  # tensor maps kept (a map holds only an address, shape, strides and box: reuse is exact)


def _swizzle_128b():
    import cuda.core as cc  # lazy: cuda.core is needed on a GPU only (import tcprec must not load it)

    enum = getattr(cc, "TensorMapSwizzle", None) or cc._tensor_map.TensorMapSwizzle  # not re-exported in 1.2
    return enum.SWIZZLE_128B


class _Address:
    """A contiguous int32 CUDA tensor's address, shape and dtype (``__cuda_array_interface__``) without the tensor."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i4", "data": (t.data_ptr(), False),
                                         "strides": None, "version": 3}


def tensor_map(planes: torch.Tensor, box_rows: int):
    """The TMA descriptor of a contiguous ``(planes, rows, Kw)`` int32 bit-plane tensor with a box of one
    plane x ``box_rows`` rows x 32 words (128 bytes: one K step of the wgmma kernel), 128-byte swizzled as
    wgmma reads it; out-of-bounds boxes read zeros.  Memoised on (address, shape, box): under a CUDA graph
    the same buffers come back, and a map describes nothing but those."""
    key = (planes.data_ptr(), tuple(planes.shape), box_rows, planes.device.index)
    m = _tmaps.get(key)
    if m is None:
        from cuda.core.utils import StridedMemoryView

        # described by address, not through DLPack: a view of the tensor itself keeps it alive for as long as the
        # cached map lives (with DLPack, eager w1a2 networks at batch 256 kept every im2col buffer: ~10 GB a call)
        view = StridedMemoryView.from_cuda_array_interface(_Address(planes), stream_ptr=-1)
        m = view.as_tensor_map(box_dim=(1, box_rows, 32), swizzle=_swizzle_128b())
        if len(_tmaps) >= _TMAP_CACHE:
            _tmaps.clear()
        _tmaps[key] = m
    return m


def grid_blocks(tile: Tile, M: int, N: int) -> int:
    """Blocks of one launch: one per output tile, rounded up to whole clusters along M and N."""
    cm, cn = tile.cluster
    return -(-(-(-M // tile.bm)) // cm) * -(-(-(-N // tile.bn)) // cn) * cm * cn


# The integer thresholds cost a launch (~4 us in a graph: two serial bisections); they save ~1.5 us of epilogue a
# tile an SM: so only where every SM stores at least this many tiles (measured: the table's int_threshold_tiles_per_sm).
INT_THRESHOLD_TILES_PER_SM = _TABLE["int_threshold_tiles_per_sm"]


# Programmatic dependent launch (``pdl=True``, sm_90+; bmma_gemm.cu, grid_dependency_wait): the kernel may be scheduled
# while the previous kernel of the stream runs, and waits for it before touching memory.  Measured on an H200 in CUDA
# graphs (same process): a small GEMM after a GEMM gains ~0.4 us a call (64 x 128 x 128 w1a2 2.35 -> 1.90 us; 8192^3
# unchanged), but whole w1a2 networks at batch 8, where every GEMM follows a Triton pass that never triggers, lost
# 1-1.5% (VGG 0.510 -> 0.516 ms, ResNet-18 0.567 -> 0.575): so the convolution pipeline launches without it.


# The threshold words of calibrated scale / bias buffers, remembered (tcprec.memo.remembered) so a network's forward
# does not recompute them: the launch (32 bisection steps a word) took 6.3 us a layer, 63 us of VGG's w1a2 forward at batch
# 256 (H200 profile).
_THRESHOLDS: dict = {}


def code_thresholds(variant: Variant, col_scale, bias, out_scale, relu: bool, leaky_slope: float, N: int,
                    pdl: bool = True):
    """The packed epilogue's integer threshold words, (N, 2^OB) int32 (bmma_gemm.cu, bmma_code_thresholds),
    computed on the current stream of ``out_scale``'s device: what ``launch_bmma`` takes as ``col_thr``.
    Remembered for the same ``col_scale`` / ``bias`` / ``out_scale`` tensors (unchanged in place) and format."""
    srcs = tuple(t for t in (col_scale, bias, out_scale) if t is not None)
    extra = (variant.out_bits, variant.out_encoding, bool(relu), float(leaky_slope), int(N),
             col_scale is not None, bias is not None)
    return remembered(_THRESHOLDS, srcs,
                      lambda: _code_thresholds(variant, col_scale, bias, out_scale, relu, leaky_slope, N, pdl), extra)


def _code_thresholds(variant: Variant, col_scale, bias, out_scale, relu: bool, leaky_slope: float, N: int,
                     pdl: bool):
    dev = out_scale.device.index if out_scale.device.index is not None else torch.cuda.current_device()
    codes = 1 << variant.out_bits
    thr = torch.empty((N, codes), dtype=torch.int32, device=out_scale.device)
    kernel = load_kernel(("bmma_code_thresholds", variant, dev), SOURCE_PATH, variant.defines(),
                         f"bmma_gemm_{variant}", "bmma_code_thresholds", dev)
    cfg = launch_config((-(-N * codes // 128),), (128,), pdl=pdl, device_index=dev)
    launch(kernel, cfg, out_scale.device, ptr(col_scale), ptr(bias), ptr(out_scale), np.int32(int(relu)),
           np.float32(leaky_slope), np.int32(N), ptr(thr))
    return thr


_NO_CONV = (0,) * 14


def conv_args(conv, a_planes) -> tuple:
    """The kernel's 15 convolution arguments (bmma_gemm.cu ConvGeo) of ``conv`` = (H, W, P, Q, R, S, sh, sw, ph, pw,
    dh, dw, CWT) over input planes ``a_planes`` (p, N*H*W, Kin); zeros without a convolution."""
    if conv is None:
        return tuple(np.int32(v) for v in _NO_CONV) + (np.int64(0),)
    H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, cwt = conv
    _, rows, kin = a_planes.shape
    vals = (H, W, kin, cwt, S, R * S, sh, sw, ph, pw, dh, dw, P * Q, Q)
    return tuple(np.int32(v) for v in vals) + (np.int64(rows * kin),)


def launch_bmma(variant: Variant, a_planes, w_planes, out, M: int, N: int, Kw: int, ldo: int, *, ss: int = 1,
                relu: bool = False, row_term=None, col_term=None, row_scale=None, col_scale=None, bias=None,
                out_scale=None, leaky_slope: float = 0.0, pdl: bool = True, conv=None, residual=None,
                dual_out=None, row_affine=None) -> None:
    """Launch ``variant`` on the current stream of ``out``'s device.  Every tensor must already be
    contiguous, on that device, of the kernel's dtype (see bmma_gemm.cu's parameter list).  The packed
    epilogue of OB <= 3 bits without a row scale first computes its integer threshold words
    (:func:`code_thresholds`) when the problem has :data:`INT_THRESHOLD_TILES_PER_SM` tiles an SM; else (and
    with a row scale) it keeps the float path.  ``pdl`` (sm_90+): launch with programmatic stream serialization
    (measured above this function)."""
    dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
    variant.check_call(relu, leaky_slope, bias, row_scale)
    kernel = get_kernel(variant, dev)
    col_thr = None
    if variant.int_thresholds and row_scale is None and \
            grid_blocks(variant.tile, M, N) >= INT_THRESHOLD_TILES_PER_SM * device_sms(out.device)[0]:
        col_thr = code_thresholds(variant, col_scale, bias, out_scale, relu, leaky_slope, N, pdl)
    t = variant.tile
    blocks = grid_blocks(t, M, N)
    if t.tma:  # persistent: at most one block an SM (whole clusters), each walks its share of the tiles
        cs = t.cluster_size
        blocks = min(blocks, device_sms(out.device)[0] // cs * cs)
    splits, ws = 1, None
    if t.split > 1:  # split-K: t.split runs of K steps (fewer when K has fewer steps), blocks a tile
        steps = k_steps(t, Kw)
        per = -(-steps // min(t.split, steps))
        splits = -(-steps // per)  # every run non-empty
        if blocks > SPLIT_COUNTERS:
            raise ValueError(f"tile {t}: split-K takes at most {SPLIT_COUNTERS} tiles, got {blocks} for {M} x {N}; "
                             "use a larger tile or no split")
        ws = split_workspace(out.device, SPLIT_COUNTERS + M * N)
        blocks *= splits
    cfg = launch_config((blocks,), (variant.threads,), variant.smem_bytes, pdl, dev)
    if variant.conv != (conv is not None):
        raise ValueError(f"variant {variant} {'needs' if variant.conv else 'takes no'} convolution geometry (conv=)")
    if variant.res != (residual is not None):
        raise ValueError(f"variant {variant} {'needs' if variant.res else 'takes no'} residual (residual=)")
    if variant.dual != (dual_out is not None):
        raise ValueError(f"variant {variant} {'needs' if variant.dual else 'takes no'} planes (dual_out=)")
    if variant.rowsum != (row_affine is not None) or (row_affine is not None and row_term is not None):
        raise ValueError(f"variant {variant} {'needs' if variant.rowsum else 'takes no'} row_affine=(row_mul, "
                         "row_add), and row_affine replaces row_term (pass one of them)")
    row_mul, row_add = row_affine if row_affine is not None else (0, 0)
    maps = ()
    if t.tma:  # the implicit convolution gathers A itself: W's map stands in for A's
        w_map = tensor_map(w_planes, t.bn // t.cluster[0])
        maps = (w_map if conv is not None else tensor_map(a_planes, t.bm // t.cluster[1]), w_map)
    launch(kernel, cfg, out.device, *maps, ptr(a_planes), ptr(w_planes), ptr(out), ptr(row_term), ptr(col_term),
           ptr(row_scale), ptr(col_scale), ptr(bias), ptr(out_scale), ptr(col_thr), ptr(residual),
           np.int32(M), np.int32(N), np.int32(Kw), np.int32(ldo), np.int32(ss), np.int32(int(relu)),
           np.float32(leaky_slope), *conv_args(conv, a_planes), ptr(dual_out),
           np.int32(dual_out.shape[2] if dual_out is not None else 0), ptr(ws), np.int32(splits),
           np.int32(row_mul), np.int32(row_add))


_split_ws: dict = {}
SPLIT_COUNTERS = 4096  # split-K: the arrival counters at the workspace's start, one a tile (bmma_gemm.cu, TCP_SPLIT)


def split_workspace(device: torch.device, words: int) -> torch.Tensor:
    """A zeroed int32 workspace of >= ``words`` for split-K launches on ``device``'s current stream (bmma_gemm.cu,
    TCP_SPLIT): the kernel leaves it zero again, so one serves every launch of a stream.  Per stream, since two
    streams' launches could overlap; never freed (a CUDA graph captured with one keeps using it), a larger one is
    made when a launch needs more (sizes rounded up to powers of two)."""
    stream = torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream.cuda_stream)
    have = _split_ws.get(key)
    if have is None or have[-1].numel() < words:
        size = 1 << max(16, (words - 1).bit_length())
        _split_ws.setdefault(key, []).append(torch.zeros(size, dtype=torch.int32, device=device))
    return _split_ws[key][-1]


# ------------------------------------------------------------------------------------------------
# torch.library custom op: what tcprec.ops.matmul calls on CUDA tensors
# ------------------------------------------------------------------------------------------------


def packed_tile(t: Tile) -> Tile:
    """``t`` made fit for the packed epilogue: bn a multiple of 32 dividing 512 (else 128 or 32), and whole
    32-column words a warp (fewer, wider warps along N)."""
    if t.bn % 32 or 512 % t.bn:
        t = replace(t, bn=128 if t.bn > 128 else 32)
    while (t.bn // t.warps_n) % 32:
        t = replace(t, warps_n=t.warps_n // 2)
    return t


@functools.lru_cache(maxsize=4096)
def _variant_for(p, q, a_twos, w_twos, M, N, out_kind, out_bits, out_encoding, tile, sm_count, arch,
                 kw: Optional[int] = None, conv: bool = False, res: bool = False, dual: bool = False,
                 rowsum: bool = False, act: str = "any", has_bias: Optional[bool] = None,
                 row_scale: Optional[bool] = None) -> Variant:
    """The variant one call launches (memoised: the host path stays a few microseconds); ``act`` / ``has_bias`` /
    ``row_scale``: the call's activation, bias and (False) absent row scale, compiled in (:attr:`Variant.act`)."""
    epi = {"int32": "int32", "packed": "packed"}.get(out_kind, "float")
    t = parse_tile(tile) if tile else pick_tile(p, q, a_twos, w_twos, M, N, sm_count, arch, epi, kw)
    if (conv or rowsum) and not tile:  # split-K is for plain GEMMs with their row term given
        t = replace(t, split=1)
    if epi == "packed" or dual:
        t = packed_tile(t)
    make = lambda t: Variant(p, q, a_twos, w_twos, t, epi, out_kind if epi == "float" else "float32",  # noqa: E731
                             out_bits, out_encoding, conv, res, dual, rowsum, act, has_bias,
                             None if conv else row_scale)  # (a convolution never has one)
    if (conv or (kw is not None and kw <= t.bk // 32)) and not tile:  # (one K step: a 1x1 conv's GEMM, measured too)
        wide = conv_wgmma_tile(t, p, q, a_twos, w_twos, epi, M, N, sm_count)
        if wide != t:
            try:
                return make(wide)
            except ValueError:  # the row sums' ones or the dual thresholds left too little shared memory
                pass
    while True:
        try:
            return make(t)
        except ValueError:  # a picked tile whose stages left no room for the row sums' 1 KB of ones: one stage less
            if tile or not rowsum or t.stages <= 3 or replace(t, stages=t.stages - 1) == t:
                raise
            t = replace(t, stages=t.stages - 1)


def conv_rows(a_planes, conv) -> int:
    """GEMM rows M: the output pixels N*P*Q of the convolution ``conv`` (see :func:`conv_args`), else A's rows."""
    if conv is None:
        return a_planes.shape[1]
    H, W, P, Q = conv[:4]
    return a_planes.shape[1] // (H * W) * P * Q


def _out_shape(a_planes, w_planes, out_kind: str, out_bits: int, conv=None, out_compact: bool = False):
    M, N = conv_rows(a_planes, conv), w_planes.shape[1]
    if out_kind == "packed":
        return (out_bits, M, -(-N // 32) if out_compact else packed_words(N)), torch.int32
    return (M, N), {"int32": torch.int32, "float32": torch.float32, "float16": torch.float16,
                    "bfloat16": torch.bfloat16}[out_kind]


def _bmma_gemm(
    a_planes: torch.Tensor,  # (p, M, Kw) int32 bit planes
    w_planes: torch.Tensor,  # (q, N, Kw) int32 bit planes
    a_twos: bool,
    w_twos: bool,
    ss: int,  # step_a * step_w
    row_term: Optional[torch.Tensor],  # (M,) int32
    col_term: Optional[torch.Tensor],  # (N,) int32
    row_scale: Optional[torch.Tensor],  # (M,) float32
    col_scale: Optional[torch.Tensor],  # (N,) float32
    bias: Optional[torch.Tensor],  # (N,) float32
    relu: bool,
    out_kind: str,  # "int32" | "float32" | "float16" | "bfloat16" | "packed"
    out_bits: int,  # packed: the output format
    out_encoding: str,
    out_scale: Optional[torch.Tensor],  # packed: (1,) float32
    tile: str,  # "" picks one by shape, else str(Tile)
    leaky_slope: float = 0.0,  # with relu: y < 0 -> leaky_slope * y (LeakyReLU); 0 is ReLU
    pdl: bool = True,  # sm_90+: programmatic dependent launch (see launch_bmma)
    conv: Optional[list[int]] = None,  # implicit-GEMM convolution: (H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, CWT)
    residual: Optional[torch.Tensor] = None,  # float epilogue: (M, N) of the output dtype, added before the act
    out_compact: bool = False,  # packed: rows of ceil(N / 32) words, without the padding to 512 bits
    dual_out: Optional[torch.Tensor] = None,  # float16 / bfloat16: also (out_bits, M, ceil(N / 32)) int32 planes
    row_affine: Optional[list[int]] = None,  # (row_mul, row_add): row term from in-kernel row sums (no row_term)
) -> torch.Tensor:
    """C = a @ w.T on the binary tensor cores (see bmma_gemm.cu for the exact contract).  Registered as the
    custom op ``torch.ops.tcprec.bmma_gemm``; :func:`gemm_entry` gives eager callers this function itself.

    With ``conv``, ``a_planes`` are a convolution's NHWC input planes (p, N*H*W, Kin) and ``w_planes`` its
    weights in the tap layout (q, K, Kw): word ``t * CWT + i`` is word i of tap t = r * S + s (CWT a multiple of
    4, Kin a multiple of 4 and >= CWT, the words of a pixel past its channels zero); C has N*P*Q rows, the
    convolution's output pixels (``kernels/reference_conv_bitserial.implicit_conv_rows`` states its A in torch).

    With ``residual`` (a float out_kind): ``y = act(rd(rd(y0) + residual))``, y0 the epilogue's value before the
    activation and rd the rounding to the output dtype -- the unfused ``act(branch + residual)`` of a ResNet block,
    bit for bit (bmma_gemm.cu, TCP_RES).

    With ``out_compact`` (out_kind "packed") the planes' rows are ceil(N / 32) words, not padded to 512 bits: what a
    convolution that gathers its input windows (im2col, implicit GEMM) reads, for a fraction of the stores (N = 64:
    2 words a row instead of 16, 14 of them zeros).

    With ``dual_out`` (out_kind float16 / bfloat16, ``out_bits`` <= 3): the epilogue also writes the stored values'
    codes of ``out_bits`` / ``out_encoding`` / ``out_scale`` into ``dual_out``, planes ``(out_bits, M, ceil(N / 32))``
    int32 in compact rows -- ``quantize_pack`` of the output, bit for bit, without reading it again (a ResNet block's
    output: the float for the next block's add, the planes for its convolutions).

    With ``row_affine = (row_mul, row_add)`` (instead of ``row_term``) the kernel computes the row term itself:
    ``row_term[m] = row_mul * sum_i wt_i popc(A_i[m, :]) + row_add`` over A's rows as multiplied (an implicit
    convolution's gathered windows), the pm1 correction, from the tensor cores (A against all-ones B; bmma_gemm.cu,
    TCP_ROWSUM) -- no pass over A before the GEMM."""
    check_conv_row_scale(conv, row_scale)
    if a_planes.device.type != "cuda" or w_planes.device.type != "cuda":
        raise ValueError(f"bmma_gemm runs on CUDA tensors, got a_planes on {a_planes.device} and w_planes on "
                         f"{w_planes.device}; move both to the GPU or use the reference backend")
    if leaky_slope != 0.0 and not relu:
        raise ValueError(f"leaky_slope={leaky_slope} applies with relu=True only (y < 0 -> leaky_slope * y); "
                         "pass relu=True or leaky_slope=0.0")
    if not math.isfinite(leaky_slope):
        raise ValueError(f"leaky_slope must be finite, got {leaky_slope}")
    p, M, Kw = a_planes.shape
    q, N, Kw_w = w_planes.shape
    short_a = False
    if conv is not None:
        check_conv(a_planes, w_planes, conv)
        M, Kw = conv_rows(a_planes, conv), Kw_w
    elif Kw != Kw_w:
        if not _short_rows(Kw, Kw_w):
            raise ValueError(f"a_planes and w_planes pack different K: {Kw} vs {Kw_w} words (a_planes may have shorter "
                             "rows, a multiple of 4 words, on a TMA tile: see short_rows_ok)")
        short_a, Kw = True, Kw_w
    if out_kind not in OUT_KINDS:
        raise ValueError(f"out_kind must be one of {OUT_KINDS}, got {out_kind!r}")
    if out_compact and out_kind != "packed":
        raise ValueError(f"out_compact=True shapes packed planes: out_kind must be 'packed', got {out_kind!r}")
    if dual_out is not None:
        _check_dual(dual_out, out_kind, out_bits, out_scale, M, N, a_planes.device)
    shape, dtype = _out_shape(a_planes, w_planes, out_kind, out_bits, conv, out_compact)
    if residual is not None:
        residual = _check_residual(residual, shape, dtype, out_kind, a_planes.device)
    if out_kind == "packed":
        out = torch.empty(shape, dtype=dtype, device=a_planes.device)  # the kernel writes every word
        ldo = shape[2]
    else:
        out = torch.empty(shape, dtype=dtype, device=a_planes.device)
        ldo = N
    if row_affine is not None:
        row_affine = _check_row_affine(row_affine, row_term)
    if M == 0 or N == 0:
        return out
    variant = _variant_for(p, q, a_twos, w_twos, M, N, out_kind, out_bits, out_encoding, tile,
                           *device_sms(a_planes.device), Kw, conv is not None, residual is not None,
                           dual_out is not None, row_affine is not None, act_of(relu, leaky_slope), bias is not None,
                           None if row_scale is not None else False)
    if short_a and not variant.tile.tma:
        raise ValueError(f"a_planes rows of {a_planes.shape[2]} words (shorter than w_planes' {Kw}) are read by the TMA "
                         f"tiles only, and this call runs {variant.tile}; pass full rows (BitPlanes().padded) -- "
                         "short_rows_ok tells which calls take them")
    launch_bmma(variant, a_planes.contiguous(), w_planes.contiguous(), out, M, N, Kw, ldo, ss=ss, relu=relu,
                row_term=row_term, col_term=col_term, row_scale=row_scale, col_scale=col_scale, bias=bias,
                out_scale=out_scale, leaky_slope=leaky_slope, pdl=pdl, conv=conv, residual=residual,
                dual_out=dual_out, row_affine=row_affine)
    return out


def _short_rows(kw_a: int, kw_w: int) -> bool:
    """A rows of kw_a words that a TMA tile can read against W rows of kw_w: shorter, in whole 16-byte pieces."""
    return kw_a < kw_w and kw_a % 4 == 0


def short_rows_ok(a_planes: torch.Tensor, w_planes: torch.Tensor, a_twos: bool, w_twos: bool, out_kind: str,
                  out_bits: int = 1, out_encoding: str = "unsigned", *, residual: bool = False, dual: bool = False,
                  rowsum: bool = False) -> bool:
    """Whether :func:`_bmma_gemm` (plain GEMM, default tile) reads ``a_planes`` whose rows are shorter than
    ``w_planes``' (compact rows: ceil(K / 32) words, a multiple of 4) as they are: its tile is a TMA one, whose A box
    reads the words past the row as zeros -- no padded copy of A first (ResNet-50 w1a2: the planes a block writes for
    the next block's 1x1 conv1, 2 x 802816 rows of 8 words at batch 256)."""
    Kw, Kw_w = a_planes.shape[2], w_planes.shape[2]
    if a_planes.device.type != "cuda" or not _short_rows(Kw, Kw_w):
        return False
    v = _variant_for(a_planes.shape[0], w_planes.shape[0], a_twos, w_twos, a_planes.shape[1], w_planes.shape[1],
                     out_kind, out_bits, out_encoding, "", *device_sms(a_planes.device), Kw_w, False, residual, dual,
                     rowsum)  # (the tile does not depend on the activation / bias compiled in)
    return v.tile.tma


def _check_row_affine(row_affine, row_term) -> tuple[int, int]:
    """(row_mul, row_add) as two int32 values; row_affine and row_term are alternatives."""
    if row_term is not None:
        raise ValueError("pass row_term (a precomputed (M,) int32 row term) or row_affine=(row_mul, row_add) (the "
                         "kernel computes it from A's row sums), not both")
    vals = tuple(row_affine) if isinstance(row_affine, (tuple, list)) else ()
    if len(vals) != 2 or not all(isinstance(v, int) and -2**31 <= v < 2**31 for v in vals):
        raise ValueError(f"row_affine must be (row_mul, row_add), two int32 integers, got {row_affine!r}")
    return vals


def _check_dual(dual_out, out_kind: str, out_bits: int, out_scale, M: int, N: int, device) -> None:
    """The dual output's planes: int32 (out_bits, M, ceil(N / 32)) contiguous on the operands' device, next to a
    16-bit float output, with the planes' scale."""
    want = (out_bits, M, -(-N // 32))
    if out_kind not in ("float16", "bfloat16") or not 1 <= out_bits <= 3:
        raise ValueError(f"dual_out (the output's planes next to it) needs out_kind 'float16' or 'bfloat16' and "
                         f"out_bits 1..3, got out_kind={out_kind!r} out_bits={out_bits}")
    if not isinstance(dual_out, torch.Tensor) or dual_out.dtype != torch.int32 or tuple(dual_out.shape) != want \
            or not dual_out.is_contiguous() or dual_out.device != device:
        got = (f"{dual_out.dtype} {tuple(dual_out.shape)} on {dual_out.device}" if isinstance(dual_out, torch.Tensor)
               else type(dual_out).__name__)
        raise ValueError(f"dual_out must be a contiguous int32 tensor (out_bits, M, ceil(N / 32)) = {want} on {device}, "
                         f"got {got}")
    if out_scale is None:
        raise ValueError("dual_out needs out_scale (the planes' scale: the next layer's activation scale)")


def _check_residual(residual: torch.Tensor, shape: tuple, dtype: torch.dtype, out_kind: str,
                    device: torch.device) -> torch.Tensor:
    """The residual as the kernel reads it: (M, N) of the output dtype, contiguous and 16-byte aligned (the fp16 /
    bf16 epilogue reads 8 values at once); a misaligned or strided one is copied once."""
    if out_kind not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"residual is added by the float epilogue: out_kind must be float32, float16 or bfloat16, "
                         f"got {out_kind!r}; quantize the sum in a separate pass")
    if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != tuple(shape) or residual.dtype != dtype:
        got = (tuple(residual.shape), residual.dtype) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"residual must be a {dtype} tensor of the output's shape {tuple(shape)}, got {got}")
    if residual.device != device:
        raise ValueError(f"residual is on {residual.device} but the operands are on {device}; move it there")
    if not residual.is_contiguous() or residual.data_ptr() % 16:
        residual = residual.clone(memory_format=torch.contiguous_format)
    return residual


def check_conv(a_planes, w_planes, conv) -> None:
    """Raise ValueError unless ``conv`` (see :func:`_bmma_gemm`) describes ``a_planes`` / ``w_planes``."""
    if len(conv) != 13:
        raise ValueError(f"conv must be (H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, CWT), got {tuple(conv)}")
    H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, cwt = conv
    _, rows, kin = a_planes.shape
    kw = w_planes.shape[2]
    if min(H, W, P, Q, R, S, sh, sw, dh, dw, cwt) < 1 or min(ph, pw) < 0 or rows % (H * W):
        raise ValueError(f"conv {tuple(conv)}: sizes, strides, dilations and CWT must be >= 1, padding >= 0, and the "
                         f"input planes' {rows} rows whole H x W = {H} x {W} images")
    if not implicit_conv_fits(kin, cwt, H, W, ph, pw) or kw < R * S * cwt:
        raise ValueError(f"conv {tuple(conv)}: the tap words CWT = {cwt} and the input's row words Kin = {kin} must be "
                         f"even with Kin >= CWT (8- / 16-byte gathers), the weights' {kw} words hold R*S*CWT = "
                         f"{R * S * cwt}, H, W <= 32767 and padding <= 16383 (the kernel keeps window origins as int16); "
                         "pass padded input planes (packed_words rows) or use the im2col route")


def _signature(fn, drop: tuple, returns: str):
    """``fn``'s signature without the parameters ``drop``, returning ``returns`` (a custom op's schema)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in drop], return_annotation=returns)


def _bmma_gemm_op(*args, **kwargs) -> torch.Tensor:
    return _bmma_gemm(*args, **kwargs)


def _bmma_gemm_dual_op(*args, **kwargs) -> tuple:
    """(out, planes): :func:`_bmma_gemm` with ``dual_out`` allocated, (out_bits, M, ceil(N / 32)) int32."""
    planes = _dual_planes(*args, **kwargs)
    return _bmma_gemm(*args, dual_out=planes, **kwargs), planes


def _dual_planes(a_planes, w_planes, *args, conv=None, **kwargs) -> torch.Tensor:
    bits = args[10] if len(args) > 10 else kwargs["out_bits"]
    return a_planes.new_empty((bits, conv_rows(a_planes, conv), -(-w_planes.shape[1] // 32)), dtype=torch.int32)


# the custom ops (what torch.compile records): the schema is _bmma_gemm's without dual_out, an output written in place,
# which the dual op returns instead
_bmma_gemm_op.__signature__ = _signature(_bmma_gemm, ("dual_out",), "torch.Tensor")
_bmma_gemm_dual_op.__signature__ = _signature(_bmma_gemm, ("dual_out", "out_compact"), "tuple[torch.Tensor, torch.Tensor]")
bmma_gemm = torch.library.custom_op("tcprec::bmma_gemm", _bmma_gemm_op, mutates_args=(), device_types="cuda")
bmma_gemm_dual = torch.library.custom_op("tcprec::bmma_gemm_dual", _bmma_gemm_dual_op, mutates_args=(),
                                         device_types="cuda")


def _dual_through_op(*args, dual_out=None, **kwargs) -> torch.Tensor:
    """torch.compile's spelling of a call with ``dual_out``: the dual op, its planes copied into ``dual_out``."""
    if dual_out is None:
        return torch.ops.tcprec.bmma_gemm(*args, **kwargs)
    out, planes = torch.ops.tcprec.bmma_gemm_dual(*args, **kwargs)
    dual_out.copy_(planes)
    return out


def gemm_entry() -> Callable:
    """What a call of the bit-serial GEMM should go through: the custom ops ``torch.ops.tcprec.bmma_gemm`` (and
    ``bmma_gemm_dual`` for a call with ``dual_out``) while torch.compile traces (so the graph holds them), else the
    implementation itself -- the custom-op dispatcher costs 10-25 us of host time a call, several times the kernel's
    ~2 us on small shapes (same arguments, same result; CUDA-graph capture records the same launch either way)."""
    return _dual_through_op if torch.compiler.is_compiling() else _bmma_gemm


@bmma_gemm.register_fake
def _(a_planes, w_planes, a_twos, w_twos, ss, row_term, col_term, row_scale, col_scale, bias, relu, out_kind,
      out_bits, out_encoding, out_scale, tile, leaky_slope=0.0, pdl=True, conv=None, residual=None, out_compact=False,
      row_affine=None):
    shape, dtype = _out_shape(a_planes, w_planes, out_kind, out_bits, conv, out_compact)
    return a_planes.new_empty(shape, dtype=dtype)


@bmma_gemm_dual.register_fake
def _(a_planes, w_planes, a_twos, w_twos, ss, row_term, col_term, row_scale, col_scale, bias, relu, out_kind,
      out_bits, out_encoding, out_scale, tile, leaky_slope=0.0, pdl=True, conv=None, residual=None, row_affine=None):
    shape, dtype = _out_shape(a_planes, w_planes, out_kind, out_bits, conv)
    return (a_planes.new_empty(shape, dtype=dtype),
            a_planes.new_empty((out_bits, shape[0], -(-w_planes.shape[1] // 32)), dtype=torch.int32))
