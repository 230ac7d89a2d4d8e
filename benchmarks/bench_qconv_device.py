"""One GPU session for the quantized forward convolution (issue 4): w1a2 (uint2 activations x binary
weights) bit-serial conv -- the Triton im2col over packed planes and the binary tensor-core GEMM timed
apart and together -- against cuDNN fp16 channels_last ``F.conv2d`` in the same process, on two VGG
layers at batch 8 and 256.  Every side is captured in a CUDA graph and timed with CUDA events
(``tcprec.bench.common.time_graph_ms``: median of replays, host launch cost excluded), inputs rotated
beyond the L2 cache.  Writes ``benchmarks/results/qconv.json``.

    PYTHONPATH=src TCPREC_CACHE_DIR=/tmp/tcache python3 benchmarks/bench_qconv_device.py [--prewarm-only]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.bench.common import environment, time_graph_ms
from tcprec.kernels import reference_gemm as rg
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops.qconv import PackedActivation, conv2d, pack_conv_weight
from tcprec.qtensor import PerChannel, PerTensor, QTensor

DEV = "cuda"
# name, H=W, C, K (3x3, stride 1, padding 1), the VGG-variant layers of the brief
LAYERS = [("vgg_56x56_256-256", 56, 256, 256), ("vgg_14x14_512-512", 14, 512, 512)]
BATCHES = (8, 256)
PEAK_BMMA_TOPS = 10_250  # mma.sync b1 AND+popc, DESIGN.md section 1
PEAK_WGMMA_B1_TOPS = 15_500


def prewarm() -> int:
    """Compile (in parallel processes) the bit-serial variants this session needs.  Uses the loader's
    private ``_variant_for`` (the exact variant a call picks); skipped with a message if it changed."""
    from tcprec.kernels.cuda import loader

    try:
        sm = loader._sm_count(torch.device(DEV))
        sm = sm if isinstance(sm, tuple) else (sm,)
        want = set()

        def add(p, q, a_twos, w_twos, M, N, kinds):
            for kind in kinds:
                bits, enc = (2, "unsigned") if kind == "packed" else (1, "unsigned")
                want.add(loader._variant_for(p, q, a_twos, w_twos, M, N, kind, bits, enc, "", *sm))

        # this benchmark
        for _, H, C, K in LAYERS:
            for n in BATCHES:
                add(2, 1, False, False, n * H * H, K, ("float16", "packed"))
        # tests/gpu/test_qconv_gpu.py
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
        import test_qconv_gpu as tq

        fmt = tp.format
        for i, (name, xs, (K, R, S), st, pd) in enumerate(tq.MODEL_LAYERS):
            g = ConvGeometry(*xs, K, R, S, tp_pair(st), tp_pair(pd), (1, 1))
            M = g.N * g.P * g.Q
            fa, fw = (fmt(f) for f in tq.PAIRS[i % len(tq.PAIRS)])
            add(fa.bits, fw.bits, fa.encoding == "twos", fw.encoding == "twos", M, K, ("int32",))
            if i in (1, 4, 6, 10, 12):
                add(2, 1, False, False, M, K, ("float32", "float16", "packed"))
        add(1, 1, False, False, 98, 64, ("int32", "packed"))
        add(2, 1, False, False, 98, 48, ("float32",))
        todo = [v for v in want if not loader.cubin_path(v, sm[1] if len(sm) > 1 else "sm_90a").exists()]
        t0 = time.time()
        n = loader.precompile(todo, sm[1] if len(sm) > 1 else "sm_90a", workers=16)
        print(f"prewarm: {len(want)} variants, compiled {n} in {time.time() - t0:.1f} s", flush=True)
        return n
    except Exception as e:  # the loader's private API moved: the calls compile lazily instead
        print(f"prewarm skipped ({type(e).__name__}: {e})", flush=True)
        return 0


def tp_pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _random_codes(shape, fmt, gen):
    return torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, device=DEV, generator=gen)


def bench_layer(name, n, H, C, K, gen, l2_bytes):
    from tcprec.kernels.cuda import loader  # noqa: F401  (registers torch.ops.tcprec.bmma_gemm)
    from tcprec.kernels.triton.im2col_bits import im2col_bits

    fa, fw = tp.format("uint2"), tp.format("binary")
    g = ConvGeometry(n, H, H, C, K, 3, 3, (1, 1), (1, 1), (1, 1))
    M, Kt = n * g.P * g.Q, 9 * C
    # inputs: packed activations (what the previous layer's packed epilogue hands over), rotated
    planes_bytes = 2 * n * H * H * (C // 8)
    copies = max(1, min(8, -(-4 * l2_bytes // max(planes_bytes, 1))))
    xs = []
    for _ in range(copies):
        codes = _random_codes((n * H * H, C), fa, gen)
        xs.append(PackedActivation(tp.pack_bitplanes(codes, 2, validate=False), fa, 0.5, (n, H, H, C)))
    wq = QTensor(_random_codes((K, 3, 3, C), fw, gen), torch.rand(K, 1, 1, 1, device=DEV) + 0.5, fw, PerChannel(0),
                 (K, 3, 3, C), torch.float32)
    pw = pack_conv_weight(wq)
    bias = torch.randn(K, device=DEV)
    # exactness of the timed path on this very shape (first input), int32 vs the float64 reference
    ref = conv2d(xs[0], wq, padding=1, out_dtype=torch.int32, backend="reference")
    got = conv2d(xs[0], pw, padding=1, out_dtype=torch.int32, backend="bitserial")
    exact = bool(torch.equal(ref, got))
    del ref, got

    oa, sa = rg.affine(fa)
    ow, sw = rg.affine(fw)
    cols0, row0 = im2col_bits(xs[0].planes, g, rowsum=True, row_mul=sa * ow, row_add=Kt * oa * ow)
    col_scale = (xs[0].scale * pw.w_scale).contiguous()

    t_im2col = time_graph_ms(lambda x: im2col_bits(x.planes, g, rowsum=True, row_mul=sa * ow,
                                                   row_add=Kt * oa * ow), xs)
    t_gemm = time_graph_ms(lambda: torch.ops.tcprec.bmma_gemm(cols0, pw.planes, False, False, sa * sw, row0, None,
                                                              None, col_scale, bias, True, "float16", 1, "unsigned",
                                                              None, ""))
    t_conv = time_graph_ms(lambda x: conv2d(x, pw, padding=1, bias=bias, act="relu", out_dtype=torch.float16), xs)
    t_conv_packed = time_graph_ms(lambda x: conv2d(x, pw, padding=1, bias=bias, act="relu", out_fmt=fa,
                                                   out_scale=0.5), xs)
    del cols0, row0

    # cuDNN fp16, channels_last, bias (ReLU not fused by cuDNN via F.conv2d; bias is)
    xh = [torch.randn(n, C, H, H, device=DEV, dtype=torch.float16).to(memory_format=torch.channels_last)
          for _ in range(max(1, min(8, -(-4 * l2_bytes // (n * H * H * C * 2)))))]
    wh = torch.randn(K, C, 3, 3, device=DEV, dtype=torch.float16).to(memory_format=torch.channels_last)
    bh = torch.randn(K, device=DEV, dtype=torch.float16)
    torch.backends.cudnn.benchmark = True
    t_cudnn = time_graph_ms(lambda x: F.conv2d(x, wh, bh, padding=1), xh)
    t_cudnn_relu = time_graph_ms(lambda x: torch.relu_(F.conv2d(x, wh, bh, padding=1)), xh)

    kw_col = rq.taps_words(g)[2]
    cols_bytes = 2 * M * kw_col * 4 + planes_bytes  # im2col: planes written + input planes read
    binops = 2 * M * K * kw_col * 32 * fa.bits * fw.bits  # AND+popc ops the GEMM issues (padded K)
    macs2 = 2 * M * K * Kt
    return {
        "layer": name, "batch": n, "M": M, "N": K, "K": Kt, "K_padded_bits": kw_col * 32, "exact": exact,
        "im2col_ms": t_im2col, "gemm_ms": t_gemm, "conv_ms": t_conv, "conv_packed_out_ms": t_conv_packed,
        "cudnn_fp16_ms": t_cudnn, "cudnn_fp16_relu_ms": t_cudnn_relu,
        "speedup_vs_cudnn_fp16": t_cudnn / t_conv, "speedup_packed_vs_cudnn_fp16": t_cudnn / t_conv_packed,
        "im2col_GBps": cols_bytes / t_im2col / 1e6,
        "im2col_bytes": cols_bytes,
        "gemm_binary_TOPS": binops / t_gemm / 1e9, "gemm_frac_mma_sync_peak": binops / t_gemm / 1e9 / PEAK_BMMA_TOPS,
        "conv_effective_TOPS": macs2 / t_conv / 1e9, "cudnn_TFLOPS": macs2 / t_cudnn / 1e9,
    }


def sweep_im2col():
    """Block sizes of the im2col kernel on the largest layer (56x56x256, batch 256, 3x3)."""
    from tcprec.kernels.triton.im2col_bits import im2col_bits

    g = ConvGeometry(256, 56, 56, 256, 256, 3, 3, (1, 1), (1, 1), (1, 1))
    gen = torch.Generator(DEV).manual_seed(1)
    planes = tp.pack_bitplanes(_random_codes((256 * 56 * 56, 256), tp.format("uint2"), gen), 2, validate=False)
    want, _ = im2col_bits(planes, g, rowsum=True, row_mul=-1, row_add=0)
    for bm in (32, 64, 128):
        for bw in (16, 32):
            for nw in (4, 8):
                f = lambda: im2col_bits(planes, g, rowsum=True, row_mul=-1, row_add=0, block_m=bm, block_w=bw,
                                        num_warps=nw)
                same = torch.equal(f()[0], want)
                print(f"im2col bm={bm} bw={bw} warps={nw}: {time_graph_ms(f, calls=8):.4f} ms same={same}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep-im2col", action="store_true")
    ap.add_argument("--prewarm-only", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/qconv.json")
    args = ap.parse_args()
    if args.sweep_im2col:
        return sweep_im2col()
    prewarm()
    if args.prewarm_only:
        return
    env = environment()
    print(f"GPU {env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} triton {env.get('triton')}")
    l2 = env.get("l2_cache_bytes") or 256 * 2**20
    gen = torch.Generator(DEV).manual_seed(0)
    rows = []
    for name, H, C, K in LAYERS:
        for n in BATCHES:
            r = bench_layer(name, n, H, C, K, gen, l2)
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            torch.cuda.empty_cache()
    out = {"benchmark": "qconv w1a2 (uint2 x binary) bit-serial conv vs cuDNN fp16 channels_last",
           "command": "PYTHONPATH=src TCPREC_CACHE_DIR=/tmp/tcache python3 benchmarks/bench_qconv_device.py",
           "timing": "CUDA graph of 32+ calls per side, median of 5 replays (CUDA events), inputs rotated > 4x L2",
           "environment": env, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"\n{'layer':22s} {'batch':>5s} {'im2col':>8s} {'gemm':>8s} {'conv':>8s} {'conv->pk':>8s} {'cudnn16':>8s} "
          f"{'x fp16':>7s} {'binTOPS':>8s} exact")
    for r in rows:
        print(f"{r['layer']:22s} {r['batch']:5d} {r['im2col_ms']:8.4f} {r['gemm_ms']:8.4f} {r['conv_ms']:8.4f} "
              f"{r['conv_packed_out_ms']:8.4f} {r['cudnn_fp16_ms']:8.4f} {r['speedup_vs_cudnn_fp16']:7.2f} "
              f"{r['gemm_binary_TOPS']:8.0f} {r['exact']}")


if __name__ == "__main__":
    main()
