"""The persistent TMA GEMM (kernels/triton/conv_fwd_tma.py) on an sm_90 GPU at real sizes: bit for bit the implicit
kernel's results -- the transformer's linears (M = 64 * 197 = 12608 rows; 768 -> 2304, 768 -> 768, 3072 -> 768) in
int8 and fp8 with float16 out and with the dual output (float16 + int8 / float8 codes, a residual), and ResNet-50's
bottleneck 1x1 convs at batch 8 (conv1 with int8 out, conv3 with the residual and the dual output) -- over several TMA
tile configs, eager and replayed from a CUDA graph.  This is the first place the kernel meets the TMA unit: the zero
fill of rows past M, channels past K and reduction columns past C is only checked here on hardware."""

import pytest
import torch

cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")
ct = pytest.importorskip("tcprec.kernels.triton.conv_fwd_tma")

DEV = "cuda"


@pytest.fixture(autouse=True)
def _sm90():
    cap = torch.cuda.get_device_capability()
    if cap[0] < 9:
        pytest.skip(f"TMA descriptors need sm_90+, this GPU is sm_{cap[0]}{cap[1]}")


# TMA tiles tried (BLOCK_K: the implicit kernel's rule, 128 where C % 128 == 0, else 64): an 8-warp 128 x 256 and a
# 4-warp 128 x 128 (each tile is a compile a case: two keep the file near a minute and a half)
TMA_TILES = [(128, 256, 8, 3), (128, 128, 4, 4)]
# name: (N, H, W, C, K)
LAYERS = {"xf.qkv": (64, 197, 1, 768, 2304), "xf.out_proj": (64, 197, 1, 768, 768),
          "xf.linear2": (64, 197, 1, 3072, 768), "r50.l1c1": (8, 56, 56, 256, 64), "r50.l1c3": (8, 56, 56, 64, 256),
          "r50.l3c3": (8, 14, 14, 256, 1024)}


def _tma_cfg(implicit: dict, tile, K: int) -> dict:
    """The TMA config of ``tile`` with the implicit config's BLOCK_K, BLOCK_N no wider than the channels need (as
    pick_config makes it)."""
    bm, bn, warps, stages = tile
    bn = min(bn, max(16, 1 << (K - 1).bit_length()))
    return dict(implicit, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, kernel="tma", GROUP_M=8)


def _data(name, fp8, seed=0):
    N, H, W, C, K = LAYERS[name]
    gen = torch.Generator(DEV).manual_seed(seed)
    if fp8:
        x = (torch.randn(N, H, W, C, device=DEV, generator=gen) * 8).to(torch.float8_e4m3fn)
        w = torch.randn(K, 1, 1, C, device=DEV, generator=gen).to(torch.float8_e4m3fn)
    else:
        x = torch.randint(-128, 128, (N, H, W, C), device=DEV, dtype=torch.int8, generator=gen)
        w = torch.randint(-128, 128, (K, 1, 1, C), device=DEV, dtype=torch.int8, generator=gen)
    scale = torch.rand(K, device=DEV, generator=gen) * 1e-4 + 1e-5
    res = torch.randn(N, H, W, K, device=DEV, generator=gen).half()
    return x, w, scale, res


def _run(fp8, x, w, scale, res, mode, cfg):
    """One launch: "f16" (float16 out, bias), "dual" (residual + float16 and int8 / e4m3 codes), "int8" (codes)."""
    kw = {"f16": dict(out="float16", bias=scale * 100),
          "dual": dict(out="float16", out_int8=("e4m3", 0.05) if fp8 else ("int8", 0.05), residual=res, act="relu"),
          "int8": dict(out=("int8", 0.05), act="relu")}[mode]
    if fp8:
        return cf.conv2d_fwd_fp8(x, w, 0.5, scale * 1e3, config=cfg, **kw)
    return cf.conv2d_fwd_int8(x, w, scale=scale, config=cfg, **kw)


def _same(a, b, what):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for u, v in zip(a, b):
        u, v = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (u, v))
        assert torch.equal(u, v), f"{what}: {int((u != v).sum())} of {u.numel()} outputs differ"


CASES = [("xf.qkv", False, "f16"), ("xf.qkv", True, "f16"), ("xf.qkv", False, "dual"), ("xf.qkv", True, "dual"),
         ("xf.out_proj", False, "f16"), ("xf.linear2", False, "f16"), ("xf.linear2", True, "f16"),
         ("r50.l1c1", False, "int8"), ("r50.l1c3", False, "dual"), ("r50.l1c3", True, "dual"),
         ("r50.l3c3", False, "dual")]


@pytest.mark.parametrize("name,fp8,mode", CASES, ids=lambda v: str(v))
def test_tma_equals_implicit(name, fp8, mode):
    """int8: against the table's implicit config (the exact int32 sums, whatever the tiles); fp8: against the implicit
    kernel with the TMA config's own tiles (the same BLOCK_K promotions and the same wgmma shapes)."""
    x, w, scale, res = _data(name, fp8)
    g = cf.geometry(x, w, 1, 0, 1, "test")
    implicit = cf.pick_config(g, fp8, torch.device(DEV), epilogue=cf.epilogue_of(mode == "dual", mode == "dual"))
    implicit.pop("kernel", None)
    implicit.pop("GROUP_M", None)
    want = _run(fp8, x, w, scale, res, mode, implicit)
    for tile in TMA_TILES:
        cfg = _tma_cfg(implicit, tile, g.K)
        if fp8:
            want = _run(fp8, x, w, scale, res, mode, {k: v for k, v in cfg.items() if k not in ("kernel", "GROUP_M")})
        _same(want, _run(fp8, x, w, scale, res, mode, cfg), f"{name} {mode} fp8={fp8} TMA {tile}")
    out = want[0] if isinstance(want, tuple) else want
    assert out.float().abs().sum() > 0


def test_cuda_graph_replay_and_few_programs():
    """Descriptors are kernel parameters: a captured launch replays with the same bits; with 3 programs (many tiles
    each: the persistent loop's tile stride and the grouped order over 99 x 9 tiles) the result is unchanged."""
    x, w, scale, res = _data("xf.qkv", False, seed=1)
    g = cf.geometry(x, w, 1, 0, 1, "test")
    cfg = _tma_cfg(cf.pick_config(g, False, torch.device(DEV)), TMA_TILES[0], g.K)
    want = _run(False, x, w, scale, res, "dual", cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _run(False, x, w, scale, res, "dual", cfg)
    for t in got:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _same(want, got, "graph replay")
    _same(want, _run(False, x, w, scale, res, "dual", dict(cfg, NUM_PROGRAMS=3)), "3 programs")
    _same(want, _run(False, x, w, scale, res, "dual", dict(cfg, GROUP_M=1)), "GROUP_M 1")


def test_compiled_kernel_uses_tma_and_wgmma():
    x, w, scale, res = _data("xf.out_proj", False)
    g = cf.geometry(x, w, 1, 0, 1, "test")
    _, kernel = cf.conv2d_fwd_int8(x, w, scale=scale, out="float16", return_kernel=True,
                                   config=_tma_cfg(cf.pick_config(g, False, torch.device(DEV)), TMA_TILES[0], g.K))
    sass = kernel.asm.get("sass") or ""
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx and "wgmma.mma_async.sync.aligned" in ptx and ".s32.s8.s8" in ptx
    if sass:  # nvdisasm present
        assert "UTMALDG" in sass and "IGMMA" in sass
