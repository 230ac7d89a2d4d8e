"""The persistent TMA GEMM for 1x1 convs and linears (kernels/triton/conv_fwd_tma.py) through TRITON_INTERPRET=1:
bit for bit the implicit-GEMM kernel's results (the same epilogue function, the same accumulator) for int8 and fp8
and every output mode it serves -- the raw int32 accumulator, float16 with scales / bias / activation, int8 codes, the
residual, the dual outputs, float8 codes, the shifted-operand correction -- with M, K and C not multiples of the tile
and several tiles a program; the routing (a tile-table entry naming "tma", an explicit config, the eligibility rule);
bad configs; and an ahead-of-time sm_90 compile whose PTX loads by TMA and multiplies by wgmma.
tests/gpu/test_conv_fwd_tma_gpu.py repeats the comparison at the transformer's and ResNet-50's sizes."""

import json
import re
import sys

import pytest
import torch
from _aot import require_nvidia_backend, run_aot

from tcprec.kernels.conv_geometry import ConvGeometry as G

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")
ct = pytest.importorskip("tcprec.kernels.triton.conv_fwd_tma")

# one tile shape for both kernels (the interpreter's fp8 dot is a float32 matmul: same blocks, same sums); M = 70
# rows over 32-row tiles, K = 40 channels over 16-column tiles, C = 48 over 32-wide steps: every edge is ragged
IMPLICIT = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "FLAT": False, "num_warps": 4, "num_stages": 1}
TMA = dict(IMPLICIT, kernel="tma", GROUP_M=2, NUM_PROGRAMS=5)  # 3 x 3 tiles on 5 programs: some run two
SHAPE = (2, 5, 7, 48, 40)  # N, H, W, C, K


def _codes(seed=0, fp8=False, shape=SHAPE):
    N, H, W, C, K = shape
    gen = torch.Generator().manual_seed(seed)
    if fp8:
        x = (torch.randn(N, H, W, C, generator=gen) * 4).to(torch.float8_e4m3fn)
        w = torch.randn(K, 1, 1, C, generator=gen).to(torch.float8_e4m3fn)
    else:
        x = torch.randint(-128, 128, (N, H, W, C), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (K, 1, 1, C), generator=gen, dtype=torch.int8)
    return x, w, gen


def _both(fn, **kw):
    """fn(config=...) with the implicit kernel and with the TMA GEMM; asserts the TMA GEMM ran."""
    calls = []
    real = cf.launch_tma

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    cf.launch_tma = spy
    try:
        want = fn(config=IMPLICIT, **kw)
        assert calls == []
        got = fn(config=TMA, **kw)
    finally:
        cf.launch_tma = real
    assert calls == [1], "the TMA GEMM did not run"
    return want, got


def _equal(want, got):
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


def test_tile_order_visits_every_tile_once():
    for M, K, bm, bn, gm in [(70, 40, 32, 16, 2), (12608, 2304, 128, 256, 8), (200, 64, 64, 64, 8)]:
        order = ct.tile_order(M, K, bm, bn, gm)
        assert sorted(order) == [(i, j) for i in range(-(-M // bm)) for j in range(-(-K // bn))]
    assert ct.tile_order(70, 40, 32, 16, 2)[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # 2 row blocks per weight block


@pytest.mark.parametrize("out", ["int32", "float16", "float32"])
def test_int8_raw_and_float_out(out):
    x, w, gen = _codes(1)
    if out == "int32":
        want, got = _both(lambda **k: cf.conv2d_fwd_int8(x, w, out="int32", **k))
        assert int(want.abs().max()) > 2**16  # a real reduction, not zeros
    else:
        scale, bias = torch.rand(40, generator=gen) * 1e-3, torch.randn(40, generator=gen)
        want, got = _both(lambda **k: cf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act=("leaky", 0.1), out=out,
                                                         **k))
    _equal(want, got)


def test_int8_codes_residual_and_dual():
    """int8 codes (uint8 stored shifted), a float16 residual with int8 codes out, and the dual output (float16 +
    codes of that float): ResNet-50's conv3 epilogue."""
    x, w, gen = _codes(2)
    scale = torch.rand(40, generator=gen) * 1e-3
    res = torch.randn(2, 5, 7, 40, generator=gen).half()
    _equal(*_both(lambda **k: cf.conv2d_fwd_int8(x, w, scale=scale, act="relu", out=("int8", 0.05, (0, 255, 128)),
                                                 **k)))
    _equal(*_both(lambda **k: cf.conv2d_fwd_int8(x, w, scale=scale, act="relu", residual=res, out=("int8", 0.05),
                                                 **k)))
    want, got = _both(lambda **k: cf.conv2d_fwd_int8(x, w, scale=scale, act="relu", residual=res, out="float16",
                                                     out_int8=("int8", 0.05), **k))
    _equal(want, got)
    assert len(torch.unique(want[1])) > 50


def test_int8_shifted_operands():
    """acc * acc_mul + add: a per-channel add (K,) and a per-position one (P, Q, K)."""
    x, w, gen = _codes(3)
    add_k = torch.randint(-2**20, 2**20, (40,), generator=gen, dtype=torch.int32)
    add_pq = torch.randint(-2**20, 2**20, (5, 7, 40), generator=gen, dtype=torch.int32)
    for add in (add_k, add_pq):
        _equal(*_both(lambda **k: cf.conv2d_fwd_int8(x, w, out="int32", acc_mul=3, acc_add=add, **k)))
    _equal(*_both(lambda **k: cf.conv2d_fwd_int8(x, w, scale=1e-4, out="float16", acc_mul=2, acc_add=add_k, **k)))


@pytest.mark.parametrize("out", ["float16", "e4m3", "dual_e4m3", "int8"])
def test_fp8(out):
    """fp8 operands (fp32 accumulation, promoted every BLOCK_K): float16, float8 codes, float16 + float8 codes with a
    residual, int8 codes."""
    x, w, gen = _codes(4, fp8=True)
    ws = torch.rand(40, generator=gen) + 0.5
    res = torch.randn(2, 5, 7, 40, generator=gen).half()
    kw = {"float16": dict(out="float16", bias=torch.randn(40, generator=gen)), "e4m3": dict(out=("e4m3", 0.5)),
          "dual_e4m3": dict(out="float16", out_int8=("e4m3", 0.25), residual=res), "int8": dict(out=("int8", 0.1))}[out]
    want, got = _both(lambda **k: cf.conv2d_fwd_fp8(x, w, 0.5, ws, act="relu", **kw, **k))
    _equal(want, got)
    assert (want[0] if isinstance(want, tuple) else want).float().abs().sum() > 0


def test_linear_shape_and_fast_accum():
    """A linear layer's view (M, 1, 1, C): M = 37 tokens, C = 64 (two reduction steps), K = 24."""
    x, w, _ = _codes(5, fp8=True, shape=(37, 1, 1, 64, 24))
    _equal(*_both(lambda **k: cf.conv2d_fwd_fp8(x, w, 1.0, 0.5, out="float32", fast_accum=True, **k)))
    x, w, _ = _codes(6, shape=(37, 1, 1, 64, 24))
    _equal(*_both(lambda **k: cf.conv2d_fwd_int8(x, w, out="int32", **k)))


# ------------------------------------------------------------------------------------------------
# Routing: the tile table's kernel, explicit configs, eligibility
# ------------------------------------------------------------------------------------------------


def test_classes_and_table_routing():
    """1x1 stride-1 unpadded plain convs are "point" / "point_wide" (C*K >= 2^19); an entry naming "tma" gives the
    TMA config there, never on a geometry the TMA GEMM cannot run; the shipped table keeps the implicit kernel."""
    qkv = G(64, 197, 1, 768, 2304, 1, 1, (1, 1), (0, 0), (1, 1))
    out_proj = G(64, 197, 1, 768, 768, 1, 1, (1, 1), (0, 0), (1, 1))
    conv1 = G(256, 56, 56, 256, 64, 1, 1, (1, 1), (0, 0), (1, 1))
    ds = G(256, 56, 56, 256, 512, 1, 1, (2, 2), (0, 0), (1, 1))  # a strided 1x1: not a GEMM
    assert [cf.shape_class(g) for g in (qkv, out_proj, conv1, ds)] == ["point_wide", "point_wide", "point", "tap"]
    assert cf.is_gemm(conv1) and not cf.is_gemm(ds) and cf.shape_class(conv1, "dual") == "point_dual"
    assert all(len(v) == 4 or v[4] == "implicit" for v in cf._TILES.values())  # nothing flipped before the GPU says
    assert "kernel" not in cf.pick_config(qkv, fp8=False)
    tiles = {**cf._TILES, "point_wide": (128, 256, 8, 3, "tma"), "tap": (128, 128, 4, 3, "tma")}
    cfg = cf.pick_config(qkv, fp8=False, tiles=tiles)
    assert cfg["kernel"] == "tma" and (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 256, 128)
    assert cfg["GROUP_M"] == cf.TMA_GROUP_M
    assert "kernel" not in cf.pick_config(ds, fp8=False, tiles=tiles)  # "tap" says tma, the geometry cannot
    assert "kernel" not in cf.pick_config(G(8, 9, 9, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1)), fp8=False, tiles=tiles)
    key = cf.compile_key(qkv, cfg, False, "float16")
    assert key[:-3] == cf.compile_key(qkv, {k: v for k, v in cfg.items() if k not in ("kernel", "GROUP_M")}, False,
                                      "float16") and key[-3] == "tma"


def test_table_entries_naming_the_kernel(tmp_path):
    doc = json.loads(cf.TILE_TABLE_PATH.read_text())
    doc["point_wide"]["value"] = [128, 256, 8, 3, "tma"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert cf.load_tile_table(path)["point_wide"] == (128, 256, 8, 3, "tma")
    doc["point_wide"]["value"] = [128, 256, 8, 3, "wgmma"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"point_wide.value .*kernel in \('implicit', 'tma'\).*'wgmma'"):
        cf.load_tile_table(path)


def test_planes_output_of_a_tma_class_runs_the_implicit_kernel(monkeypatch):
    """A table entry's "tma" covers the launches the TMA GEMM can run: a PlanesOut launch of that class runs the
    implicit kernel (its planes, bit for bit the implicit result), a float16 one the TMA GEMM; an explicit TMA config
    with PlanesOut is refused."""
    x, w, _ = _codes(7, shape=(1, 4, 4, 64, 32))
    spec = cf.PlanesOut(0.5, 2, 0, 3)
    want = cf.conv2d_fwd_int8(x, w, scale=1e-3, out=spec, config=IMPLICIT)
    monkeypatch.setattr(cf, "INTERPRETER_CONFIG", dict(IMPLICIT, kernel="tma", GROUP_M=8))  # a picked TMA config
    calls = []
    real = cf.launch_tma
    monkeypatch.setattr(cf, "launch_tma", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert torch.equal(cf.conv2d_fwd_int8(x, w, scale=1e-3, out=spec), want) and calls == []
    # the same picked config on a float output runs the TMA GEMM
    want = cf.conv2d_fwd_int8(x, w, scale=1e-3, out="float16", config=IMPLICIT)
    assert torch.equal(cf.conv2d_fwd_int8(x, w, scale=1e-3, out="float16"), want) and calls == [1]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"kernel='tma', but the TMA GEMM does not write packed planes"):
        cf.conv2d_fwd_int8(x, w, scale=1e-3, out=spec, config=TMA)


@pytest.mark.parametrize("geo, match", [
    (dict(padding=1), r"1x1 convs of stride 1 and padding 0, got 3x3"),
    (dict(stride=2), r"stride \(2, 2\)"),
    (dict(C=40), r"C a multiple of 16 .*got C=40"),
])
def test_tma_config_on_a_geometry_it_cannot_run(geo, match):
    C = geo.get("C", 64)
    R = 3 if "padding" in geo else 1
    x = torch.zeros(1, 6, 6, C, dtype=torch.int8)
    w = torch.zeros(8, R, R, C, dtype=torch.int8)
    kw = {k: v for k, v in geo.items() if k != "C"}
    with pytest.raises(ValueError, match=r"conv2d_fwd_int8: config asks for kernel=.tma., but .*" + match):
        cf.conv2d_fwd_int8(x, w, out="int32", config=TMA, **kw)


def test_unaligned_view_and_bad_configs():
    x = torch.zeros(1 * 2 * 2 * 64 + 8, dtype=torch.int8)[8:].view(1, 2, 2, 64)  # contiguous, 8 bytes off
    w = torch.zeros(16, 1, 1, 64, dtype=torch.int8)
    if x.data_ptr() % 16:
        with pytest.raises(ValueError, match="16-byte aligned address"):
            cf.conv2d_fwd_int8(x, w, out="int32", config=TMA)
    x = torch.zeros(1, 2, 2, 64, dtype=torch.int8)
    for bad, match in [(dict(kernel="wgmma"), r"config\['kernel'\] must be one of \('implicit', 'tma'\), got 'wgmma'"),
                       (dict(BLOCK_K=8), r"powers of two in 16..256.*'BLOCK_K': 8"),
                       (dict(BLOCK_N=48), r"'BLOCK_N': 48"),
                       (dict(NUM_PROGRAMS=0), r"config\['NUM_PROGRAMS'\] must be a positive int"),
                       (dict(GROUP_M=True), r"config\['GROUP_M'\] must be a positive int")]:
        with pytest.raises(ValueError, match=match):
            cf.conv2d_fwd_int8(x, w, out="int32", config={**TMA, **bad})


# ------------------------------------------------------------------------------------------------
# The kernel compiles for sm_90: TMA loads, wgmma, a pipelined persistent loop (no GPU needed)
# ------------------------------------------------------------------------------------------------


def _aot_tma(fp8: bool, out_mode: int, has_res: bool = False, has_add: bool = False, bm=128, bn=256, bk=128,
             warps=8, stages=3):
    """``_gemm_tma_kernel`` for sm_90 as the launcher specialises it (C, K multiples of 16 marked divisible) with the
    descriptors ``launch`` builds: x (M, C) in [BLOCK_M, BLOCK_K] boxes, w (K, C) in [BLOCK_N, BLOCK_K] ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tcprec.kernels.triton.round import fp8_constexprs

    fn = ct._gemm_tma_kernel
    xt = "fp8e4nv" if fp8 else "i8"
    ptrs = {"out_ptr": {0: "i32", 1: "fp16", 2: "i8", 3: "fp16", 4: "u8"}[out_mode], "sa_ptr": "fp32",
            "sb_ptr": "fp32", "bias_ptr": "fp32", "add_ptr": "i32" if has_add else "fp32", "oscale_ptr": "fp32",
            "res_ptr": "fp16" if has_res else "fp32", "out8_ptr": "i8"}
    consts = dict(IS_FP8=fp8, FAST_ACCUM=False, OUT_MODE=out_mode, HAS_ADD=has_add, ADD_PIX=False, INT64=False,
                  HAS_RES=has_res, OUT_LO=-128, OUT_HI=127, OUT_OFF=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                  NUM_PROGRAMS=132, **fp8_constexprs(torch.float8_e4m3fn))
    nospec = set(fn.do_not_specialize) | {fn.arg_names[i] for i in fn.do_not_specialize if isinstance(i, int)}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "x_desc":
            sig[name] = f"tensordesc<{xt}[{bm}, {bk}]>"
        elif name == "w_desc":
            sig[name] = f"tensordesc<{xt}[{bn}, {bk}]>"
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        elif name in ("alpha", "slope"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in nospec:  # K and C: multiples of 16 (the transformer's 768 / 2304)
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
    return k


def _aot_report() -> dict:
    # the transformer's int8 linear tile; fp8 with a ResNet conv3's residual + dual epilogue on 8 warps (two compiles:
    # ~15 s cold on one core)
    cases = {"int8_f16": (False, 1), "fp8_dual_res": (True, 3, True, False, 128, 128, 128, 8, 4)}
    out = {}
    for name, args in cases.items():
        k = _aot_tma(*args)
        ptx = k.asm["ptx"]
        out[name] = {"ptx": "\n".join(ln for ln in ptx.splitlines() if "wgmma" in ln or "cp.async" in ln
                                      or "div.rn" in ln or "fma.rn.f32" in ln or "mbarrier.try_wait" in ln
                                      or "mma.sync" in ln),
                     "shared": k.metadata.shared}
    return out


def test_kernel_compiles_to_tma_and_wgmma_for_sm90():
    """In a subprocess: under TRITON_INTERPRET=1, triton.jit builds interpreter objects, not compilable ones."""
    rep = json.loads(run_aot(__file__, timeout=400).strip().splitlines()[-1])
    for name, want in (("int8_f16", r"m64n(128|256)k32\.s32\.s8\.s8"),
                       ("fp8_dual_res", r"m64n128k32\.f32\.e4m3\.e4m3")):
        ptx = rep[name]["ptx"]
        assert "cp.async.bulk.tensor.2d" in ptx, f"{name}: operands are not loaded by TMA"
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\." + want, ptx), f"{name}: no wgmma {want}"
        assert "mma.sync" not in ptx and "cp.async.cg" not in ptx  # no pre-Hopper MMA, no pointer-gathered tiles
        assert "mbarrier.try_wait" in ptx, f"{name}: no pipelined (mbarrier-waited) loads"
        assert 0 < rep[name]["shared"] <= 227 * 1024
    # the shared epilogue: the int8 codes' IEEE division, no contracted multiply-add (enable_fp_fusion=False)
    assert "div.rn.f64" in rep["fp8_dual_res"]["ptx"] and "fma.rn.f32" not in rep["fp8_dual_res"]["ptx"]


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    require_nvidia_backend()
    print(json.dumps(_aot_report()))
