"""NVRTC compiles the bit-serial GEMM for sm_90a here, without a GPU.

One variant takes ~1.5 s of CPU to compile, so CI compiles a representative set (~30 variants,
two processes): every (p, q) pair that ``tcprec.matmul`` sends to the binary kernel by default
(p*q < 8, 16 pairs) with its large sm_90a tile (wgmma where the pair has one), some of their
mma.sync tiles, the small tile, the two's complement flavour, every float
epilogue dtype, packed outputs, and the 8x8 corner.  tests/gpu/test_matmul_gpu.py compiles (and
runs) all 64 pairs for every encoding.  The large-tile variants of the default pairs must not spill.
"""

import dataclasses
import itertools
import time

import pytest

nvrtc_reason = None
try:
    from tcprec.env import nvrtc_status

    _st = nvrtc_status(probe=False)
    if not _st["available"]:
        nvrtc_reason = _st["reason"]
except Exception as e:  # pragma: no cover
    nvrtc_reason = f"{type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(nvrtc_reason is not None, reason=f"NVRTC not importable: {nvrtc_reason}")

DEFAULT_PAIRS = [(p, q) for p in range(1, 9) for q in range(1, 9) if p * q < 8]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os

    d = tmp_path_factory.mktemp("tcprec_cache")
    old = os.environ.get("TCPREC_CACHE_DIR")
    os.environ["TCPREC_CACHE_DIR"] = str(d)  # a fresh cache: these tests really compile
    yield d
    if old is None:
        os.environ.pop("TCPREC_CACHE_DIR")
    else:
        os.environ["TCPREC_CACHE_DIR"] = old


def _variants():
    from tcprec.kernels.cuda import bmma_gemm as L

    big = lambda p, q, t=False, e="float": L.pick_tile(p, q, t, t, 10**5, 10**5, arch="sm_90a", epilogue=e)  # noqa: E731
    vs = [L.Variant(p, q, False, False, big(p, q), "float", "float16") for p, q in DEFAULT_PAIRS]
    vs += [
        L.Variant(2, 1, True, False, L.SMALL_TILE, "int32"),
        L.Variant(2, 1, False, False, L.parse_tile("64x256_w2x4_s4"), "int32"),
        L.Variant(2, 2, True, True, big(2, 2, True), "int32"),
        L.Variant(3, 2, True, True, big(3, 2, True), "float", "bfloat16"),
        L.Variant(2, 1, False, False, big(2, 1), "float", "float32"),
        L.Variant(2, 1, False, False, big(2, 1, e="packed"), "packed", out_bits=2, out_encoding="unsigned"),
        L.Variant(1, 1, False, False, L.Tile(32, 32, 2, 1, 2, 1024), "packed", out_bits=1, out_encoding="pm1"),
        L.Variant(2, 2, False, False, big(2, 2, e="packed"), "packed", out_bits=4, out_encoding="twos"),
        L.Variant(8, 8, True, True, big(8, 8, True), "int32"),
        # TMA options the defaults do not take: clusters (multicast) and a folded tile
        L.Variant(2, 1, False, False, L.parse_tile("128x128_w8x1_s4_k1024_wg_tma_c2x1"), "float", "float16"),
        L.Variant(1, 1, False, True, L.parse_tile("128x256_w8x1_s4_k1024_wg_tma_c2x2"), "int32"),
        L.Variant(2, 1, False, False, L.parse_tile("128x128_w8x1_s4_k1024_wg_f_tma_c1x2"), "packed", out_bits=1),
        # split-K (TCP_SPLIT) as pick_tile takes it for a linear layer at batch 8, with the residual and dual planes,
        # on a cp.async wgmma tile; the small packed tile of batch-8 convolutions
        L.Variant(2, 1, False, False, L.pick_tile(2, 1, False, False, 8, 4096, arch="sm_90a", kw=784), "float",
                  "float16"),
        L.Variant(2, 1, False, False, L.parse_tile("32x32_w2x1_s2_k1024_sk4"), "float", "float16", 2, res=True,
                  dual=True),
        L.Variant(2, 2, True, True, L.parse_tile("128x64_w8x1_s3_k1024_wg_sk2"), "packed", out_bits=2,
                  out_encoding="twos"),
        L.Variant(2, 1, False, False, L.pick_tile(2, 1, False, False, 6272, 128, arch="sm_90a", epilogue="packed",
                                                  kw=48), "packed", out_bits=2),
    ]
    return vs + _conv_variants()


def _conv_variants():
    """Implicit-GEMM convolutions (TCP_CONV): the w1a2 / w2a2 tiles the networks' binary convs take -- TMA with the
    gathering producer warpgroup, packed and float epilogues, and the mma.sync / small tiles of small batches."""
    from tcprec.kernels.cuda import bmma_gemm as L

    big = lambda p, q, e: L.packed_tile(L.pick_tile(p, q, False, False, 10**5, 512, arch="sm_90a", epilogue=e)) \
        if e == "packed" else L.pick_tile(p, q, False, False, 10**5, 512, arch="sm_90a", epilogue=e)  # noqa: E731
    return [
        L.Variant(2, 1, False, False, big(2, 1, "packed"), "packed", out_bits=2, conv=True),
        L.Variant(2, 1, False, False, big(2, 1, "float"), "float", "float16", conv=True),
        L.Variant(2, 2, False, False, big(2, 2, "packed"), "packed", out_bits=2, conv=True),
        L.Variant(2, 1, False, False, L.packed_tile(L.pick_tile(2, 1, False, False, 6272, 512, arch="sm_90a")),
                  "packed", out_bits=2, conv=True),
        L.Variant(2, 1, False, False, L.packed_tile(L.SMALL_TILE), "packed", out_bits=2, conv=True),
        L.Variant(8, 1, False, False, L.SMALL_TILE, "int32", conv=True),
        # ResNet blocks' residual add in the float epilogue (TCP_RES): 64- and 128-wide TMA tiles, the implicit conv,
        # bf16, and float32 / fp16 on the mma.sync tiles
        L.Variant(2, 1, False, False, L.pick_tile(2, 1, False, False, 10**5, 64, arch="sm_90a"), "float", "float16",
                  res=True),
        L.Variant(2, 1, False, False, big(2, 1, "float"), "float", "bfloat16", conv=True, res=True),
        L.Variant(2, 1, False, False, L.SMALL_TILE, "float", "float32", res=True),
        L.Variant(2, 1, False, False, L.pick_tile(2, 1, False, False, 10**5, 10**5, arch="sm_80"), "float",
                  "float16", conv=True, res=True),
        # the dual output (TCP_DUAL: the 16-bit float and its planes): a ResNet block's TMA tile with the residual, the
        # small tile, a 128-wide TMA tile with pm1 planes in bf16, three-bit two's complement planes on mma.sync
        L.Variant(2, 1, False, False, L.pick_tile(2, 1, False, False, 10**5, 64, arch="sm_90a"), "float", "float16", 2,
                  res=True, dual=True),
        L.Variant(2, 1, False, False, L.packed_tile(L.SMALL_TILE), "float", "float16", 2, res=True, dual=True),
        L.Variant(2, 1, False, False, L.packed_tile(L.pick_tile(2, 1, False, False, 6272, 512, arch="sm_90a")), "float",
                  "bfloat16", 2, "pm1", dual=True),
        L.Variant(2, 1, False, False, L.packed_tile(L.pick_tile(2, 1, False, False, 10**5, 10**5, arch="sm_80")),
                  "float", "float16", 3, "twos", res=True, dual=True),
        # in-kernel row sums (TCP_ROWSUM): the w1a2 convs' tiles as bmma_gemm picks them with row_affine -- TMA
        # (ones tile in shared memory) packed / dual, the cp.async wgmma tile, mma.sync and the small packed tile
        *_rowsum_variants(),
    ]


def _rowsum_variants():
    from tcprec.kernels.cuda import bmma_gemm as L

    pick = lambda M, N, kind, dual=False: L._variant_for(2, 1, False, False, M, N, kind, 2, "unsigned", "", 132,  # noqa: E731
                                                         "sm_90a", 36, True, False, dual, True)
    return [pick(802816, 64, "packed"), pick(25088, 64, "float16", True), pick(200704, 128, "packed"),
            pick(6272, 128, "packed"), pick(392, 512, "float16"),
            L.Variant(3, 1, True, False, L.parse_tile("64x64_w4x1_s4_k1024_wg"), "int32", conv=True, rowsum=True),
            L.Variant(2, 1, False, False, L.parse_tile("64x64_w2x2_s3_k1024"), "float", "float16", conv=True,
                      res=True, rowsum=True)]


def _sync_defaults():
    """The mma.sync large tiles of the default pairs (sm_90a's fallback, other GPUs' default)."""
    from tcprec.kernels.cuda import bmma_gemm as L

    out = []
    for p, q in DEFAULT_PAIRS:
        t = L.pick_tile(p, q, False, False, 10**5, 10**5, arch="sm_80")
        out.append(L.Variant(p, q, False, False, t, "float", "float16"))
    return out[::3]  # a third of them: CI time


def test_every_representative_variant_compiles_for_sm90a(cache):
    from tcprec.kernels.cuda import bmma_gemm as L

    vs = _variants() + _sync_defaults()
    t0 = time.perf_counter()
    n = L.precompile(vs, "sm_90a", workers=2)
    elapsed = time.perf_counter() - t0
    assert n == len(set(vs))
    for v in vs:
        path = L.cubin_path(v, "sm_90a")
        assert path.exists() and path.read_bytes()[:4] == b"\x7fELF", v
    print(f"compiled {n} variants in {elapsed:.1f} s ({elapsed / n * 2:.2f} s of CPU each)")


def _spill_bytes(log: str) -> int:
    line = next(ln for ln in log.splitlines() if "spill stores" in ln)
    return int(line.split("bytes spill stores")[0].rsplit(",", 1)[-1].strip())


def test_default_variants_do_not_spill(cache):
    """No default tile spills: mma.sync, and the TMA wgmma tiles (168 registers a thread, accumulators
    <= 128 of them) -- the cluster variants too."""
    from tcprec.kernels.cuda import bmma_gemm as L

    seen_tma = 0
    for v in _variants()[: len(DEFAULT_PAIRS)] + _variants()[-26:] + _sync_defaults():
        _, log = L.compile_variant(v, "sm_90a")  # from the cache filled above (or compiled now)
        seen_tma += v.tile.tma
        assert _spill_bytes(log) == 0 and "0 bytes stack frame" in log, (str(v), log[-400:])
    assert seen_tma >= 10  # w1a1, w1a2, w2a1, w2a2, w1a4 ... run on TMA wgmma tiles on sm_90a


def test_conv_wide_tile_rule_and_no_spills(cache):
    """Implicit convolutions of w1a2 on 64 columns with >= 2 tiles an SM, and plain GEMMs of one K step, take three
    MMA warpgroups (bm = 192, 3 stages); wider N, more weight classes or a small M keep the picked tile; the wide variants compile without
    spills (512 threads: ptxas caps them at 128 registers)."""
    from tcprec.kernels.cuda import bmma_gemm as L

    def pick(p, q, M, N, out="packed", res=False, dual=False):
        return L._variant_for(p, q, False, False, M, N, out, 2, "unsigned", None, 132, "sm_90a", 18, True, res, dual,
                              True)

    wide = [pick(2, 1, 802816, 64), pick(2, 1, 802816, 64, "float16", True, True), pick(1, 1, 802816, 128)]
    assert [(v.tile.bm, v.tile.warps_m, v.tile.stages, v.tile.tma) for v in wide[:2]] == [(192, 12, 3, True)] * 2
    assert wide[2].tile.bm == 192  # w1a1: one class, 128 columns
    for v in (pick(2, 1, 8 * 56 * 56, 64), pick(2, 1, 200704, 128), pick(2, 2, 802816, 64)):
        assert v.tile.bm != 192, str(v)
    def plain(kw, M=802816):
        return L._variant_for(2, 1, False, False, M, 64, "packed", 2, "unsigned", None, 132, "sm_90a", kw, False,
                              False, False, True)

    # a plain GEMM of one 1024-bit K step (a 1x1 convolution's: 64 channels, 2 words that hold data) is wide too;
    # two or more steps, or too few tiles, keep the two-warpgroup tile
    assert plain(2).tile.bm == 192 and plain(32).tile.bm == 192
    assert plain(48).tile.bm == 128 and plain(None).tile.bm == 128 and plain(2, 8 * 56 * 56).tile.bm == 128
    for v in wide:
        _, log = L.compile_variant(v, "sm_90a")
        assert _spill_bytes(log) == 0 and "0 bytes stack frame" in log, (str(v), log[-400:])


def test_wgmma_variants_use_warpgroup_mma_in_ptx():
    """The wgmma tile's source path emits wgmma b1 AND+popc (the SASS check is in tests/gpu)."""
    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.wgmma_tile(2, 1)
    assert t is not None and t.mma == "wgmma" and L.pick_tile(2, 1, False, False, 8192, 8192, arch="sm_90a") == t
    assert L.pick_tile(2, 1, False, False, 8192, 8192, arch="sm_80").mma == "sync"
    assert L.parse_tile(str(t)) == t
    src = L.SOURCE_PATH.read_text()
    assert "wgmma.mma_async.sync.aligned.m64n128k256.s32.b1.b1.and.popc" in src
    with pytest.raises(ValueError, match="wgmma needs bk=1024"):
        L.Variant(2, 1, tile=L.parse_tile("128x128_w8x1_s4_wg"))


def test_tma_tiles():
    """The sm_90a defaults are TMA tiles: two MMA warpgroups (bm = 128) plus a producer warpgroup, the widest
    warpgroup N whose accumulators fit 128 registers, as many stages (<= 8) as shared memory holds (the packed
    epilogue's codes included); none for five or more weight classes.  Tiles round-trip through their names,
    clusters are 1..2 x 1..2 blocks of the TMA kernel only, and a launch rounds its grid up to whole clusters."""
    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.wgmma_tile(2, 1)
    assert (t.bm, t.bn, t.warps_m, t.warps_n, t.tma, t.fold, t.cluster) == (128, 128, 8, 1, True, False, (1, 1))
    assert str(t) == "128x128_w8x1_s4_k1024_wg_tma" and L.parse_tile(str(t)) == t
    assert L.wgmma_tile(1, 1).bn == 256 and L.wgmma_tile(2, 2).bn == 64 and L.wgmma_tile(1, 4).bn == 64
    assert L.wgmma_tile(5, 1) is None and L.wgmma_tile(3, 3) is None  # 5 classes: N would be 32
    for p, q in DEFAULT_PAIRS:
        wt = L.wgmma_tile(p, q)
        if wt is not None:
            v = L.Variant(p, q, tile=wt)
            assert v.smem_bytes <= L._MAX_SMEM and v.threads == 384 and "TCP_TMA=1" in v.defines()
            bigger = dataclasses.replace(wt, stages=wt.stages + 1)
            if wt.stages < 8:
                with pytest.raises(ValueError, match="shared memory"):
                    L.Variant(p, q, tile=bigger)
    packed = L.wgmma_tile(1, 1, epilogue="packed")
    assert packed.bn == 256 and 512 % packed.bn == 0  # the packed epilogue stores whole words from registers
    assert L.Variant(1, 1, tile=packed, epilogue="packed", out_bits=8).smem_bytes \
        == L.Variant(1, 1, tile=packed).smem_bytes + 2 * 4 * 256  # + its 2^8 code thresholds in each warpgroup's copy
    with pytest.raises(ValueError, match="whole 32-column words a warp"):  # SMALL_TILE's warps own 16 columns
        L.Variant(1, 1, tile=L.SMALL_TILE, epilogue="packed")
    assert L.packed_tile(L.SMALL_TILE) == L.Tile(32, 32, 2, 1, 2, 1024)  # a picked tile is adjusted, not refused
    assert L._variant_for(2, 1, False, False, 64, 32, "packed", 2, "unsigned", "64x96_w2x2_s3", 132,
                          "sm_90a").tile == L.Tile(64, 32, 2, 1, 3)
    c = L.parse_tile("128x256_w8x1_s4_k1024_wg_tma_c2x1")
    assert c.cluster == (2, 1) and c.cluster_size == 2 and str(c).endswith("_tma_c2x1")
    assert "TCP_CM=2" in L.Variant(1, 1, tile=c).defines() and "TCP_CN=1" in L.Variant(1, 1, tile=c).defines()
    assert L.grid_blocks(c, 300, 1000) == 16  # 3 row tiles round up to 2 clusters of 2 blocks, x 4 column tiles
    assert L.grid_blocks(L.parse_tile("128x64_w8x1_s4_k1024_wg_tma_c2x2"), 129, 65) == 4
    with pytest.raises(ValueError, match="clusters need the TMA pipeline"):
        L.Variant(1, 1, tile=L.parse_tile("128x128_w8x1_s4_k1024_wg_c2x1"))
    with pytest.raises(ValueError, match="TMA needs the wgmma path with warps_n = 1"):
        L.Variant(1, 1, tile=L.parse_tile("128x128_w8x2_s4_k1024_wg_tma"))
    with pytest.raises(ValueError, match="TMA needs the wgmma path"):
        L.Variant(1, 1, tile=L.parse_tile("128x128_w8x1_s4_k1024_tma"))
    with pytest.raises(ValueError, match="cluster of 1..2 x 1..2"):
        L.Variant(1, 1, tile=L.parse_tile("128x128_w8x1_s4_k1024_wg_tma_c4x1"))
    with pytest.raises(ValueError, match="tile must look like"):
        L.parse_tile("128x128_w8x1_s4_k1024_wg_tma_cx")


def test_packed_variants_carry_the_threshold_kernel(cache):
    """Packed variants of <= 3 output bits hold a second entry, bmma_code_thresholds (the integer thresholds
    the epilogue compares C with), and stage 2^b threshold words a column; wider outputs keep the float path."""
    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.parse_tile("128x128_w8x1_s4_k1024_wg_tma")
    for bits, enc in ((1, "pm1"), (2, "unsigned"), (3, "twos"), (4, "unsigned")):
        v = L.Variant(2, 1, tile=t, epilogue="packed", out_bits=bits, out_encoding=enc)
        cubin, _ = L.compile_variant(v, "sm_90a")
        assert (b"bmma_code_thresholds" in cubin) == (bits <= 3) == v.int_thresholds, (bits, enc)
        words = (1 << bits) * t.bn if bits <= 3 else 0
        per = 2 * t.bm + 3 * t.bn  # the vectors of one copy (a copy each MMA warpgroup, 4-word aligned)
        assert v.smem_bytes == L.Variant(2, 1, tile=t).smem_bytes + 2 * 4 * (-(-(per + (1 << bits) + words) // 4) * 4 - per)
    assert b"bmma_code_thresholds" not in L.compile_variant(L.Variant(2, 1, tile=t, epilogue="float"), "sm_90a")[0]


def test_split_k_tiles_and_choice():
    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.parse_tile("32x32_w2x2_s2_k1024_sk4")
    assert t.split == 4 and str(t) == "32x32_w2x2_s2_k1024_sk4" and L.parse_tile(str(t)) == t
    v = L.Variant(2, 1, tile=t, epilogue="float", out_dtype="float16")
    assert "TCP_SPLIT=1" in v.defines() and "TCP_SPLIT=0" in L.Variant(2, 1, tile=L.SMALL_TILE).defines()
    for bad, kw in (("128x128_w8x1_s4_k1024_wg_tma_sk2", {}), ("32x32_w2x2_s2_k1024_sk2", {"conv": True}),
                    ("32x32_w2x2_s2_k1024_sk0", {})):
        with pytest.raises(ValueError, match="split-K"):
            L.Variant(2, 1, tile=L.parse_tile(bad), **kw)
    # a linear layer at batch 8 (one row tile) with a long K splits; short K, more row tiles, or a conv do not
    pick = lambda M, N, kw, e="float": L.pick_tile(2, 1, False, False, M, N, 132, "sm_90a", e, kw)  # noqa: E731
    assert pick(8, 4096, 784).split == L.SPLIT_MAX and pick(8, 512, 784).split == L.SPLIT_MAX
    assert pick(8, 4096, 128).split == 1 and pick(8, 4096, 392).split == 1  # 4 and 13 K steps
    assert pick(392, 512, 144).split == 1
    assert L._variant_for(2, 1, False, False, 8, 4096, "float16", 2, "unsigned", "", 132, "sm_90a", 784,
                          True).tile.split == 1
    # batch-8 convolutions' packed output: the 32 x 64 small tile; one row tile or float output keep 32 x 32
    assert pick(6272, 128, 48, "packed") == L.SMALL_PACKED_TILE and pick(8, 128, 48, "packed").bn == 32
    assert pick(6272, 128, 48) == L.SMALL_TILE
    assert L.pick_tile(8, 8, False, False, 6272, 128, 132, "sm_90a", "packed", 48).bn == 32  # 15 classes: registers


def test_folded_tiles():
    """A folded tile (an option no default takes since the TMA kernel: measured slower) keeps one accumulator
    and repeats each plane pair's wgmma by its weight; two's complement (a negative weight) and mma.sync tiles
    are refused."""
    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.parse_tile("128x128_w8x1_s4_k1024_wg_f_tma")
    assert t.fold and t.tma and L.parse_tile(str(t)) == t and not L.wgmma_tile(2, 1).fold
    assert L.Variant(2, 1, tile=t).n_classes == 1 and L.Variant(2, 1).n_classes == 2
    assert "TCP_FOLD=1" in L.Variant(2, 1, tile=t).defines()
    with pytest.raises(ValueError, match="folded tile.*unsigned codes"):
        L.Variant(2, 1, True, False, tile=t)
    with pytest.raises(ValueError, match="folded tile.*wgmma path"):
        L.Variant(2, 1, tile=L.parse_tile("64x128_w2x2_s3_k1024_f"))
    src = L.SOURCE_PATH.read_text()
    assert "for (int rep = 0; rep < pair_weight(i, j); ++rep) Wgmma<NT>::run(acc[0][0], da, dw);" in src


def test_cache_is_reused_and_keyed_by_variant(cache, monkeypatch):
    from tcprec.kernels.cuda import bmma_gemm as L
    from tcprec.kernels.cuda import runtime as rt

    v = _variants()[0]
    first, _ = L.compile_variant(v, "sm_90a")

    def no_nvrtc(*a):
        raise AssertionError("compiled again: the cached cubin was not reused")

    monkeypatch.setattr(rt, "_nvrtc", no_nvrtc)
    cubin, _ = L.compile_variant(v, "sm_90a")
    assert cubin == first and cubin[:4] == b"\x7fELF"
    other = L.Variant(v.p, v.q, v.a_twos, v.w_twos, v.tile, "int32")
    assert L.cubin_path(other) != L.cubin_path(v)
    assert L.cubin_path(v, "sm_80") != L.cubin_path(v, "sm_90a")


def test_compile_error_reports_nvrtc_log(cache, monkeypatch, tmp_path):
    from tcprec.kernels.cuda import bmma_gemm as L

    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void bmma_gemm() { this is not C++; }\n')
    monkeypatch.setattr(L, "SOURCE_PATH", bad)
    with pytest.raises(RuntimeError, match="NVRTC could not compile"):
        L.compile_variant(L.Variant(1, 1), "sm_90a", use_cache=False)


def test_one_source_no_per_width_files():
    from tcprec.kernels.cuda import bmma_gemm as L

    cu = sorted(p.name for p in L.SOURCE_PATH.parent.glob("*.cu"))
    # every bit width from one GEMM source, the thin-input INT8 stem conv and the s8 wgmma GEMM (decision 0163)
    assert cu == ["bmma_gemm.cu", "i8_gemm.cu", "stem_conv.cu"]
    src = L.SOURCE_PATH.read_text()
    assert "and.popc" in src and "xor.popc" not in src and ".s4" not in src and ".u4" not in src


def test_dual_variants_and_custom_op_schemas():
    """The dual output's variant rules (a 16-bit float epilogue, planes of <= 3 bits, whole 32-column words a warp),
    its name, and the custom ops: tcprec::bmma_gemm takes no dual_out (an argument written in place), which
    tcprec::bmma_gemm_dual returns instead."""
    import torch

    from tcprec.kernels.cuda import bmma_gemm as L

    t = L.packed_tile(L.SMALL_TILE)
    v = L.Variant(2, 1, False, False, t, "float", "float16", 2, res=True, dual=True)
    assert str(v).endswith("_res_dualunsigned2") and "TCP_DUAL=1" in v.defines()
    for kw, bad in ((dict(epilogue="float", out_dtype="float32", out_bits=2), "float32"),
                    (dict(epilogue="float", out_dtype="float16", out_bits=4), "out_bits=4"),
                    (dict(epilogue="packed", out_dtype="float32", out_bits=2), "epilogue='packed'")):
        with pytest.raises(ValueError, match=rf"the dual output .* needs the float epilogue of a 16-bit dtype.*{bad}"):
            L.Variant(2, 1, False, False, t, dual=True, **kw)
    with pytest.raises(ValueError, match=r"whole 32-column words a warp"):
        L.Variant(2, 1, False, False, L.SMALL_TILE, "float", "float16", 2, dual=True)  # 16 columns a warp
    main = str(torch.ops.tcprec.bmma_gemm.default._schema)
    dual = str(torch.ops.tcprec.bmma_gemm_dual.default._schema)
    assert "dual_out" not in main and "!" not in main and "out_compact" in main
    assert "dual_out" not in dual and dual.endswith("-> (Tensor, Tensor)")


def test_conv_refuses_a_row_scale():
    """The implicit convolution's kernel applies no row scale (its multiply by 1 is compiled out), so the host refuses
    one, naming the fix, before anything else is checked; so does the torch reference of the same contract."""
    import torch

    from tcprec.kernels.cuda import bmma_gemm as L

    a = torch.zeros((2, 2 * 8 * 8, 4), dtype=torch.int32)
    w = torch.zeros((1, 64, 36), dtype=torch.int32)
    conv = [8, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 4]
    with pytest.raises(ValueError, match=r"row_scale with conv: .* fold a per-tensor activation scale into col_scale"):
        L._bmma_gemm(a, w, False, False, 1, None, None, torch.ones(128), torch.ones(64), None, False, "float16", 1,
                     "unsigned", None, "", conv=conv)
    from tcprec.kernels.reference_conv_bitserial import bmma_gemm_reference  # the torch statement of the contract: the same

    with pytest.raises(ValueError, match=r"row_scale with conv: .* fold a per-tensor activation scale into col_scale"):
        bmma_gemm_reference(a, w, False, False, 1, None, None, torch.ones(128), torch.ones(64), None, False, "float16",
                            1, "unsigned", None, "", conv=conv)


def test_stem_conv_variants_compile_without_spills(cache):
    """stem_conv.cu (the thin-input INT8 stem with the planes epilogue): every output format x pool variant, the
    float16 / bfloat16 output with the planes of every format and alone, compiles for sm_90a with both entries (the conv
    and its threshold words), without spills or a stack frame, on int8 tensor-core MMAs."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from tcprec.kernels.cuda import runtime
    from tcprec.kernels.cuda import stem_conv as P

    vs = P.all_variants()
    assert len(vs) == 18 + 18 + 2 and len({str(v) for v in vs}) == len(vs)
    assert {v.fout for v in vs} == {None, torch.float16, torch.bfloat16} and sum(not v.planes for v in vs) == 2
    runtime.cuda_core_api()  # (imported once before the threads)
    with ThreadPoolExecutor(4) as ex:
        logs = list(ex.map(lambda v: P.compile_stem(v, "sm_90a"), vs))
    for v, (cubin, log) in zip(vs, logs):
        assert cubin[:4] == b"\x7fELF", v
        assert b"stem_conv" in cubin and b"stem_code_thresholds" in cubin, v
        assert "spill" in log and _spill_bytes(log) == 0 and "bytes stack frame" in log, (str(v), log[-400:])
    src = P.SOURCE_PATH.read_text()
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in src and '#include "codes.cuh"' in src


def test_shared_header_is_expanded_and_keys_the_cache(tmp_path, monkeypatch):
    """``#include "name"`` lines are replaced by the file beside the source (what NVRTC compiles and what the cache key
    hashes), so editing codes.cuh rebuilds both kernels; a missing header is named."""
    from tcprec.kernels.cuda import bmma_gemm as L
    from tcprec.kernels.cuda import runtime as R

    monkeypatch.setenv("TCPREC_CACHE_DIR", str(tmp_path / "cache"))
    text = R.source_text(L.SOURCE_PATH)
    assert "#include \"codes.cuh\"" not in text and "__device__ int threshold_word(" in text
    (tmp_path / "h.cuh").write_text("#define ANSWER 42\n")
    src = tmp_path / "k.cu"
    src.write_text('#include "h.cuh"\nextern "C" __global__ void k(int* o) { *o = ANSWER; }\n')
    assert R.source_text(src).startswith("#define ANSWER 42")
    before = R.source_cubin_path(src, [], "sm_90a")
    (tmp_path / "h.cuh").write_text("#define ANSWER 43\n")
    assert R.source_cubin_path(src, [], "sm_90a") != before
    src.write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"k.cu includes 'missing.cuh'"):
        R.source_text(src)


def test_stem_weight_words_tiles_and_bad_input():
    """The weight words (a tap's C bytes in one word, taps rounded up to a k-step of 8, channels to 32-channel words)
    in B-fragment order, the tile choice (whole units, equal shares for the 4 warps, a patch that fits), and refused
    variants / inputs."""
    import torch

    from tcprec.kernels.cuda import stem_conv as P

    w8 = torch.randint(-128, 128, (40, 3, 3, 3), dtype=torch.int8)
    wq = P.stem_weight_words(w8)
    assert wq.shape == (2, 16 * 32) and wq.dtype == torch.int32
    # (word, k-step, tile i, gq, t, e) holds tap 8 k-step + 4 e + t of channel 32 word + 8 i + gq
    f = wq.reshape(2, 2, 4, 8, 4, 2)
    rows = torch.zeros((64, 16), dtype=torch.int32)
    for word, ks, i, gq, t, e in itertools.product(range(2), range(2), range(4), range(8), range(4), range(2)):
        rows[32 * word + 8 * i + gq, 8 * ks + 4 * e + t] = f[word, ks, i, gq, t, e]
    b = rows.view(torch.uint8).reshape(64, 16, 4)
    assert torch.equal(b[:40, :9, :3].view(torch.int8), w8.reshape(40, 9, 3))
    assert int(b[:40, :9, 3].abs().sum()) == 0 and int(b[:, 9:].sum()) == 0 and int(b[40:].sum()) == 0
    v = P.StemVariant(2, "unsigned", 2)
    t = P.pick_tile(v, 56, 56, 3, 3, (2, 2), (1, 1))  # VGG: 7 units a row, 4 rows -> 7 units a warp
    assert (t.tpo, t.tqo) == (4, 56)
    res = P.StemVariant(2, "unsigned", 1, torch.float16)  # ResNet-18's (the float and its planes): 32-pixel units
    t = P.pick_tile(res, 56, 56, 7, 7, (4, 4), (1, 1), words=2, c=3)
    assert (t.tpo, t.tqo) == (4, 64)  # 8 rows would keep the SM below its 4 blocks (shared memory)
    assert P.smem_bytes(res, t, 7, 7, (4, 4), (1, 1), 2, 3) <= 228 * 1024 // 4 - 1024
    assert P.smem_bytes(res, P.StemTile(8, 64), 7, 7, (4, 4), (1, 1), 2, 3) > 228 * 1024 // 4 - 1024
    # with 4 words of channels and 4-byte pixels (the defaults: the largest block) two rows of units fit the share
    assert P.pick_tile(res, 56, 56, 7, 7, (4, 4), (1, 1)) == P.StemTile(2, 64)
    t = P.pick_tile(v, 208, 208, 3, 3, (1, 1), (1, 1))  # YOLOv2-tiny
    assert t.tqo == 56 and 4 * t.tqo >= 208
    t = P.pick_tile(v, 56, 56, 3, 3, (2, 2), (1, 1), N=8)  # batch 8: one row a block, 448 blocks
    assert (t.tpo, t.tqo) == (1, 56)
    assert P.smem_bytes(v, P.pick_tile(v, 27, 27, 11, 11, (4, 4), (1, 1)), 11, 11, (4, 4), (1, 1)) <= 227 * 1024
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory for one row of 56 outputs"):
        P.pick_tile(v, 200, 200, 60, 60, (8, 8), (2, 2))
    with pytest.raises(ValueError, match=r"1..3-bit codes, got out_bits=4"):
        P.StemVariant(4)
    with pytest.raises(ValueError, match=r"pool is 1 \(none\) or 2 \(2x2 stride 2\), got pool=0"):
        P.StemVariant(2, "unsigned", 0)
    with pytest.raises(ValueError, match=r"float output without a pool: pool=1 with fout=torch.float16, got pool=2"):
        P.StemVariant(2, "unsigned", 2, torch.float16)
    with pytest.raises(ValueError, match=r"float output is one of \['torch.float16', 'torch.bfloat16'\] or None, "
                                         r"got fout=torch.float32"):
        P.StemVariant(2, "unsigned", 1, torch.float32)
    with pytest.raises(ValueError, match=r"without planes writes the float alone: pass fout="):
        P.StemVariant(3, "unsigned", 1, torch.float16, planes=False)
    assert str(P.StemVariant(2, "twos", 1, torch.bfloat16)) == "o2t_p1_bfloat16"
    assert "TCP_FOUT=1" in P.StemVariant(pool=1, fout=torch.float16, planes=False).defines()
    with pytest.raises(ValueError, match=r"at most 4 input channels, got C=5"):
        P.stem_weight_words(torch.zeros((8, 3, 3, 5), dtype=torch.int8))
    with pytest.raises(ValueError, match=r"contiguous int8 \(N, H, W, C <= 4\) codes"):
        P.conv_planes(torch.zeros((1, 8, 8, 3)), wq, 40, 3, 3, col_scale=None, bias=None, out_scale=None)
    with pytest.raises(ValueError, match=r"pool is 0 \(none\) or 2"):
        P.conv_planes(torch.zeros((1, 8, 8, 3), dtype=torch.int8), wq, 40, 3, 3, pool=1, col_scale=None, bias=None,
                      out_scale=None)


_CHILD = """
import hashlib, pathlib, sys, time
from tcprec.kernels.cuda import runtime as rt
log, src, who = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
real = rt._nvrtc
def counted(*a):
    with log.open("a") as f:
        f.write(who + " compiles\\n")
    time.sleep(2.0)  # still holding the key's lock when the other process asks for it
    return real(*a)
rt._nvrtc = counted
cubin, _ = rt.compile_source(src, ["TCP_TEST=1"], "sm_90a", "lock_test")
print(hashlib.sha256(cubin).hexdigest())
"""


def test_processes_compiling_one_variant_compile_it_once(tmp_path):
    """Two processes asking for the same uncached variant (xdist workers, the ranks of a job): the second waits on the
    key's lock and reads the first one's cubin instead of running NVRTC again."""
    import os
    import subprocess
    import sys

    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int* x) { x[threadIdx.x] = TCP_TEST; }\n')
    log = tmp_path / "compiles.log"
    env = dict(os.environ, TCPREC_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_src_dir()), env.get("PYTHONPATH", "")) if p)
    run = [sys.executable, "-c", _CHILD, str(log), str(src)]
    a = subprocess.Popen(run + ["A"], env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(600):  # until A is inside NVRTC, holding the lock (at most 60 s)
        if log.exists() or a.poll() is not None:
            break
        time.sleep(0.1)
    b = subprocess.Popen(run + ["B"], env=env, stdout=subprocess.PIPE, text=True)
    out_a, out_b = a.communicate(timeout=300)[0], b.communicate(timeout=300)[0]
    assert a.returncode == 0 and b.returncode == 0
    assert log.read_text().splitlines() == ["A compiles"]
    assert out_a.strip() == out_b.strip() and len(out_a.strip()) == 64


def _src_dir():
    import pathlib

    import tcprec

    return pathlib.Path(tcprec.__file__).resolve().parent.parent


def test_cuda_sources_have_no_generic_lambdas():
    """A lambda with ``auto`` parameters inside a kernel compiles with NVRTC 13.5 but not with 13.0 (the H200 image's),
    which takes it for a host function in JIT mode ("host functions are not allowed in JIT mode"): one slipped
    into i8_gemm.cu once, and CI, compiling with a newer NVRTC, did not see it.  Device helpers generic in a type are
    function templates."""
    import re
    from pathlib import Path

    import tcprec.kernels.cuda as kc

    generic = re.compile(r"\[[&=]?[^\]]*\]\s*\(([^)]*)\)")
    found = []
    for path in sorted(Path(kc.__file__).parent.glob("*.cu*")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in generic.finditer(line):
                if re.search(r"\bauto\b", m.group(1)):
                    found.append(f"{path.name}:{i}: {line.strip()}")
    assert not found, "generic lambdas (NVRTC 13.0 rejects them; write a template __device__ function):\n" + "\n".join(found)


def test_epilogue_flags_compiled_in(cache):
    """A call's activation and bias are compiled into its variant (TCP_ACT / TCP_BIAS): the host picks the call's, a
    launch whose relu / slope / bias differ from a specialised variant's is refused, and the specialised ResNet conv3
    variant (ReLU, bias, residual, dual planes) is well under the size of the run-time-flags one (which compiles every
    path of each flag)."""
    from tcprec.kernels.cuda import bmma_gemm as L

    def pick(act, has_bias):
        return L._variant_for(2, 1, False, False, 802816, 256, "float16", 2, "unsigned", "", 132, "sm_90a", 16, False,
                              True, True, True, act, has_bias)

    assert L.act_of(False, 0.0) == "none" and L.act_of(True, 0.0) == "relu" and L.act_of(True, 0.1) == "leaky"
    anyv, relu = pick("any", None), pick("relu", True)
    assert "TCP_ACT=1" in relu.defines() and "TCP_BIAS=1" in relu.defines() and str(relu).endswith("_relu_b")
    assert not any(d.startswith(("TCP_ACT", "TCP_BIAS")) for d in anyv.defines())  # (the old cubins and names)
    anyv.check_call(True, 0.1, None)
    relu.check_call(True, 0.0, object())
    for call in ((False, 0.0, object()), (True, 0.1, object()), (True, 0.0, None)):
        with pytest.raises(ValueError, match="compiles act='relu', has_bias=True"):
            relu.check_call(*call)
    nrs = L._variant_for(2, 1, False, False, 802816, 256, "float16", 2, "unsigned", "", 132, "sm_90a", 16, False,
                         True, True, True, "relu", True, False)
    assert "TCP_RSCALE=0" in nrs.defines() and str(nrs).endswith("_relu_b_nrs")
    nrs.check_call(True, 0.0, object(), None)
    with pytest.raises(ValueError, match="row_scale=False.*row_scale given"):
        nrs.check_call(True, 0.0, object(), object())
    conv = L._variant_for(2, 1, False, False, 802816, 64, "packed", 2, "unsigned", "", 132, "sm_90a", 18, True,
                          False, False, True, "relu", True, False)
    assert conv.row_scale is None and "TCP_RSCALE" not in " ".join(conv.defines())  # (a convolution has none anyway)
    with pytest.raises(ValueError, match="act must be one of"):
        L.Variant(2, 1, tile=relu.tile, epilogue="float", out_dtype="float16", act="gelu")
    sizes = {}
    for v in (anyv, relu, nrs):
        cubin, log = L.compile_variant(v, "sm_90a")
        assert _spill_bytes(log) == 0, (str(v), log[-400:])
        sizes[str(v)] = len(cubin)
    assert sizes[str(relu)] < 0.7 * sizes[str(anyv)] and sizes[str(nrs)] <= sizes[str(relu)], sizes
