"""Split-K of the bit-serial GEMM (``Tile.split``, bmma_gemm.cu TCP_SPLIT): several blocks a tile, each on a run of K
steps, their int32 sums added by the tile's last block.  Integer sums are exact in any order, so a split launch equals
the reference bit for bit -- every epilogue (int32, fp16 / bf16 / fp32 with residual and dual planes, packed planes),
mma.sync and cp.async wgmma tiles, tiles cut by M and N, split counts past the K steps, one workspace reused across
shapes (its arrival counters must come back to zero), inside a CUDA graph, and what ``pick_tile`` picks for a linear
layer at batch 8.  Skipped without a CUDA GPU."""

import pytest
import torch

from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.cuda import bmma_gemm as L

from bmma_cases import gemm_args  # tests/gpu/bmma_cases.py

DEV = "cuda"


def _args(M, N, Kbits, out_kind, seed, out_bits=2):
    out_scale = torch.tensor([0.4], device=DEV) if out_kind == "packed" else None
    return gemm_args(M, N, Kbits, out_kind, seed, col_term=True, out_bits=out_bits, out_scale=out_scale)


SHAPES = [(8, 4096, 25088), (8, 512, 25088), (5, 200, 9000), (40, 96, 6000), (300, 64, 4608)]


@pytest.mark.parametrize("tile", ["32x32_w2x2_s2_k1024_sk4", "32x32_w2x2_s3_k1024_sk3", "32x64_w2x2_s3_k1024_sk2",
                                  "64x64_w2x2_s3_k1024_sk8", "32x32_w2x2_s2_sk16", "128x64_w8x1_s3_k1024_wg_sk2"])
@pytest.mark.parametrize("out_kind", ["int32", "float16", "bfloat16", "float32", "packed"])
def test_split_k_equals_reference(tile, out_kind):
    for seed, (M, N, Kbits) in enumerate(SHAPES):
        args = _args(M, N, Kbits, out_kind, seed)
        kw = {"out_compact": True} if out_kind == "packed" else {}
        got = L._bmma_gemm(*args, tile, 0.1, **kw)
        want = rq.bmma_gemm_reference(*args, tile, 0.1, **kw)
        assert torch.equal(got, want), (tile, out_kind, M, N, Kbits)
        again = L._bmma_gemm(*args, tile, 0.1, **kw)  # the counters came back to zero
        assert torch.equal(again, want), (tile, out_kind, M, N, Kbits, "second call")


@pytest.mark.parametrize("out_kind", ["float16", "bfloat16"])
def test_split_k_residual_and_dual_planes(out_kind):
    M, N, Kbits = 8, 512, 25088
    args = _args(M, N, Kbits, out_kind, 7)
    args[14] = torch.tensor([0.3], device=DEV)  # the planes' scale
    r = (torch.randn(M, N, device=DEV) * 3).to(getattr(torch, out_kind))
    for tile in ("32x32_w2x2_s2_k1024_sk4", "32x32_w2x2_s2_k1024"):
        planes = torch.empty((2, M, N // 32), dtype=torch.int32, device=DEV)
        got = L._bmma_gemm(*args, tile, 0.0, residual=r, dual_out=planes)
        want_planes = torch.empty_like(planes)
        want = rq.bmma_gemm_reference(*args, tile, 0.0, residual=r, dual_out=want_planes)
        assert torch.equal(got, want) and torch.equal(planes, want_planes), tile


def test_split_k_in_a_cuda_graph_and_across_shapes():
    calls = [(_args(M, N, K, "float16", s), t) for s, ((M, N, K), t) in enumerate(
        zip(SHAPES, ["32x32_w2x2_s2_k1024_sk4", "32x32_w2x2_s2_k1024_sk3", "32x32_w2x2_s2_k1024_sk2",
                     "64x64_w2x2_s3_k1024_sk4", "32x32_w2x2_s2_k1024_sk2"]))]
    want = [rq.bmma_gemm_reference(*a, t, 0.0) for a, t in calls]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        outs = [L._bmma_gemm(*a, t, 0.0) for a, t in calls]  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [L._bmma_gemm(*a, t, 0.0) for a, t in calls]
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(outs, want))


def test_pick_tile_splits_linear_layers_at_batch_8():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t = L.pick_tile(2, 1, False, False, 8, 4096, sms, "sm_90a", "float", 25088 // 32)
    assert t.split == L.SPLIT_MAX and not t.tma
    assert L.pick_tile(2, 1, False, False, 8, 4096, sms, "sm_90a", "float", 4096 // 32).split == 1
    assert L.pick_tile(2, 1, False, False, 392, 512, sms, "sm_90a", "float", 4608 // 32).split == 1
    args = _args(8, 4096, 25088, "float16", 11)
    assert torch.equal(L._bmma_gemm(*args, "", 0.0), rq.bmma_gemm_reference(*args, "32x32_w2x2_s2_k1024", 0.0))
