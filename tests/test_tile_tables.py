"""The kernels' tuning rules as data (decision 0033): split-K and the bit-serial GEMM's tiles
(kernels/cuda/bmma_gemm_tiles.json), the dgrad TMA GEMM's tiles and route thresholds (gemm_scatter_tiles.json),
the TMA-box wgrad's tile rule (wgrad_tma_tiles.json), the flat wgrad's and the strided wgrad's route thresholds
(wgrad_flat_tiles.json, conv_bwd_tiles.json) and the emulated GEMM's chunk tiles (emulate_gemm_tiles.json).

* the loaded tables make the same decisions as the literals the code held before, on a grid of shapes (the old
  rules are copied below verbatim, literals and all);
* a broken table (not JSON, an entry missing, a value out of range) raises a ValueError naming the file, the
  entry, the value and what it must be."""

import itertools
import json
from dataclasses import replace

import pytest

from tcprec.kernels import tile_tables as tt
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.cuda import bmma_gemm as L
from tcprec.kernels.triton import emulate_gemm as eg
from tcprec.kernels.triton import gemm_scatter as gs
from tcprec.kernels.triton import wgrad_tma as wt
from tcprec.ops import conv as oc


def _geoms():
    """Convolutions over batch, map size, channels, filter and stride (ResNet-50-like and odd ones)."""
    for n, hw, c, k, (r, s, pad) in itertools.product((1, 8, 32, 256), (7, 14, 28, 56), (16, 64, 128, 256, 1024),
                                                      (32, 64, 128, 256, 512, 2048), ((1, 1, 0), (1, 2, 0),
                                                                                      (3, 1, 1), (3, 2, 1))):
        yield ConvGeometry(n, hw, hw, c, k, r, r, (s, s), (pad, pad), (1, 1))


# ---- the rules as the code had them before decision 0033 (verbatim) ----------------------------------------------

def _old_wgrad_tma_pick(g):
    _SMALL_MACS = 4e9
    _MANY_TILES = 384
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    macs = g.K * g.C * g.R * g.S * g.N * g.P * g.Q
    if macs < _SMALL_MACS:
        tiles64 = cdiv(g.K, 64) * cdiv(g.C, 64) * g.R * g.S
        bm, bn, w = (64, 128, 4) if tiles64 >= _MANY_TILES else (64, 64, 4)
    elif g.K >= 512:
        bm, bn, w = 128, 256, 8
    elif g.K >= 256:
        bm, bn, w = 128, 128, 8
    elif g.K >= 128:
        bm, bn, w = (64, 128, 4) if g.R * g.S > 1 else (64, 64, 4)
    else:
        bm, bn, w = 64, 64, 4
    if g.C <= 64:
        bm, bn, w = 64, 64, 4
    elif g.C <= 128 and bn == 256:
        bn = 128
    bl = 32 if (bm, bn, 64) in wt._BAD_TILES else 64
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_L=bl, num_warps=w, num_stages=wt._stages(bm, bn, bl, w), BOX="min")


def _old_gemm_scatter_pick(g, fp8):
    LARGE_ROWS = 8192
    if g.N * g.P * g.Q >= LARGE_ROWS:
        return dict(gs.VARIANT_CONFIGS[2] if fp8 else gs.VARIANT_CONFIGS[1])
    return dict(gs.CONFIGS[3])


def _old_chunk_tile(hwcvt, kahan, chunk, fp32):
    big = hwcvt != 0 and not kahan and chunk >= 128 and not fp32
    return (128 if big else 64), (256 if big else 128), (8 if big else 4), (3 if big else 4), min(chunk, 64)


# ---- the same decisions -----------------------------------------------------------------------------------------

def test_wgrad_tma_pick_unchanged():
    n = 0
    for g in _geoms():
        assert wt.pick(g) == _old_wgrad_tma_pick(g), g
        n += 1
    assert n > 1000


def test_gemm_scatter_pick_and_routes_unchanged():
    for g in _geoms():
        for fp8 in (False, True):
            assert gs._pick(g, fp8) == _old_gemm_scatter_pick(g, fp8), (g, fp8)
    assert gs.LARGE_ROWS == 8192 and gs.MIN_ROWS_AUTO == {False: 1024, True: 0}
    assert oc._TMA_MIN_ROWS == {False: 1024, True: 0} and oc._TMA_MIN_ROWS_UNSTRIDED == 32768


def test_conv_route_thresholds_unchanged():
    assert (oc._FLAT_MIN_L, oc._FLAT_MAX_L) == (1 << 15, 1 << 19)
    assert oc._STRIDED_WGRAD_GEMM_MIN_C == 512


def test_emulate_chunk_tiles_unchanged():
    for hwcvt, kahan, chunk, fp32 in itertools.product((0, 1, 2), (False, True), (16, 32, 64, 128, 256, 1024),
                                                       (False, True)):
        assert eg.chunk_tile(hwcvt, kahan, chunk, fp32) == _old_chunk_tile(hwcvt, kahan, chunk, fp32)
    assert eg.FMA_TILE == (64, 64, 4, 1)


def test_bmma_table_values_and_split_k_unchanged():
    assert (L.SPLIT_MIN_STEPS, L.SPLIT_STEPS, L.SPLIT_MAX) == (16, 6, 4)
    assert L._SYNC == {"warps_m": 2, "warps_n": 2, "stages": 3, "bk": 1024}
    assert str(L.SMALL_TILE) == "32x32_w2x2_s2_k1024" and str(L.SMALL_PACKED_TILE) == "32x64_w2x2_s3_k1024"
    assert (L._WORDS_PER_STEP_512, L._TMA_BM, L._TMA_MAX_STAGES, L._CONV_BM, L._CONV_MIN_TILES,
            L.INT_THRESHOLD_TILES_PER_SM) == (16, 128, 8, 192, 2, 8)
    # split-K decisions on the long-K linear layers and around the threshold (sm_80: mma.sync tiles)
    for M, N, kw in itertools.product((1, 8, 32, 64), (512, 1000, 4096), (16, 32, 100, 392, 500, 784, 2048)):
        t = L.pick_tile(1, 2, False, False, M, N, sm_count=132, arch="sm_80", kw=kw)
        steps = L.k_steps(replace(t, split=1), kw)
        want = min(4, steps // 6) if M <= t.bm and steps >= 16 and kw > 16 else 1
        assert t.split == want, (M, N, kw, t)


# ---- validation -------------------------------------------------------------------------------------------------

TABLES = [(L.TILE_TABLE_PATH, L._RULES, L._CHECK), (gs.TILE_TABLE_PATH, gs._RULES, None),
          (wt.TILE_TABLE_PATH, wt._RULES, wt._CHECK), (eg.TILE_TABLE_PATH, eg._RULES, None),
          (oc._FLAT_TABLE, oc._FLAT_RULES, oc._FLAT_CHECK), (oc._CONV_BWD_TABLE, oc._CONV_BWD_RULES, None)]


@pytest.mark.parametrize("path,rules,check", TABLES, ids=lambda v: getattr(v, "name", ""))
def test_every_entry_is_validated(tmp_path, path, rules, check):
    doc = json.loads(path.read_text())
    assert set(doc) - {"about"} == set(rules), "every entry of the table has a rule (no unvalidated data)"
    assert all(isinstance(doc[k].get("measured"), str) and isinstance(doc[k].get("source"), str) for k in rules)
    tt.load_table(path, rules, check)  # the committed table is valid
    for key in rules:
        for bad in (None, -1, "x", [1], {"a": 1}):
            broken = dict(doc, **{key: dict(doc[key], value=bad)})
            f = tmp_path / path.name
            f.write_text(json.dumps(broken))
            with pytest.raises(ValueError, match=f"{path.name}: {key}.value must be .*, got {bad!r}".replace("[", r"\[")
                               .replace("{", r"\{")):
                tt.load_table(f, rules, check)
        f.write_text(json.dumps({k: v for k, v in doc.items() if k != key}))
        with pytest.raises(ValueError, match=f"entries \\['{key}'\\] missing"):
            tt.load_table(f, rules, check)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON.*restore"):
        tt.load_table(f, rules, check)


def test_cross_entry_checks():
    doc = json.loads(wt.TILE_TABLE_PATH.read_text())
    table = {k: v["value"] for k, v in doc.items() if k in wt._RULES}
    assert wt._CHECK(table) is None
    assert "by_k must go down in min_k and end with min_k 0" in wt._CHECK(dict(table, by_k=table["by_k"][:-1]))
    assert "by_k must go down in min_k" in wt._CHECK(dict(table, by_k=table["by_k"][::-1]))
    assert "min_rows < max_rows" in oc._FLAT_CHECK({"auto_1x1_rows": {"min_rows": 10, "max_rows": 5}})
    assert L._CHECK({"words_per_step_512": 16, "small_tile": "32x32_w2x2_s2_k1024",
                     "small_packed_tile": "32x64_w2x2_s3_k1024_sk2"}) is not None  # a default tile is never split
