"""INT8 / FP8 forward convolution (Triton implicit GEMM, kernels/triton/conv_fwd.py) against cuDNN fp16
channels_last ``F.conv2d``, on the conv layers of AlexNet, the VGG-variant, ResNet-18 and YOLOv2-tiny
(issue 4) at batch 8 and 256.  One GPU session:

1. compile every kernel variant the run needs (benchmark, optional tuning, GPU tests) in a process
   pool, filling Triton's disk cache, so nothing compiles inside a timing;
2. ``--tune``: time a few tile candidates per shape class (int8, batch 256) and print them (the table
   in ``pick_config`` is edited by hand from this, never autotuned at run time);
3. per layer and batch: ours int8 (per-channel scale + bias + ReLU, int8 out: the chained layer),
   ours fp8 (device scales + bias + ReLU, fp16 out) and cuDNN fp16 (``cudnn.benchmark`` on, no bias),
   each a ``do_bench`` median (CUDA events, L2 flushed before every call) in the same process; a
   correctness check at batch 8 (int8 output bit-exact against the reference, fp8 NRMSE).

    PYTHONPATH=src python3 benchmarks/tune_conv_fwd_device.py [--tune] [--precompile-only]
        [--batches 8,256] [--layers alexnet,vgg] [--out benchmarks/results/conv_fwd.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

TUNE_LAYERS = ("vgg.conv3", "vgg.conv6", "resnet18.l1", "yolo.conv2", "alexnet.conv1", "yolo.conv8")
TUNE_TILES = ((128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4))
# The layers timed: VGG-variant and ResNet-18 3x3 (+ stems), AlexNet and YOLO all
BENCH_PREFIXES = ("alexnet", "vgg", "resnet18", "yolo")


def _geom(name, N):
    from tcprec.kernels.conv_geometry import ConvGeometry
    from tcprec.kernels.triton.conv_fwd import NETWORK_LAYERS

    H, W, C, K, R, S, st, pd = NETWORK_LAYERS[name]
    return ConvGeometry(N, H, W, C, K, R, S, (st, st), (pd, pd), (1, 1))


def _tune_configs(g, fp8):
    from tcprec.kernels.triton.conv_fwd import pick_config

    base = pick_config(g, fp8)
    out = [base]
    for bm, bn, w, s in TUNE_TILES:
        bn = min(bn, base["BLOCK_N"]) if g.K < 128 else bn  # narrow layers: vary the rows only
        c = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        if c not in out:
            out.append(c)
    return out


def plan(batches, layers, tune: bool, tests: bool):
    """(layer, N, fp8, out kind, config) launches whose compiled variants the run needs, one per compile key."""
    from tcprec.kernels.triton.conv_fwd import NETWORK_LAYERS, compile_key, pick_config

    tasks = {}

    def add(name, N, fp8, kind, cfg, fast=False):
        g = _geom(name, N)
        tasks.setdefault(compile_key(g, cfg, fp8, kind) + (fast,), (name, fp8, kind, cfg, fast))

    for name in layers:
        for N in batches:
            g = _geom(name, N)
            add(name, N, False, "int8", pick_config(g, False))
            add(name, N, True, "float16", pick_config(g, True))
            add(name, N, True, "float16", pick_config(g, True), fast=True)
    if tune:
        for name in TUNE_LAYERS:
            for cfg in _tune_configs(_geom(name, 256), False):
                add(name, 256, False, "int8", cfg)
    if tests:  # tests/gpu/test_conv_fwd_gpu.py: every network layer, configs of batch 8, int32 out too
        for name in NETWORK_LAYERS:
            cfg8 = pick_config(_geom(name, 8), False)
            for fp8, kind in ((False, "int32"), (False, "int8"), (True, "float16")):
                add(name, 8, fp8, kind, cfg8)
    return list(tasks.values())


def _compile_one(task):
    name, fp8, kind, cfg, fast = task
    t0 = time.time()
    try:
        from tcprec.kernels.triton import conv_fwd as cf

        g = _geom(name, 1)
        dev = "cuda"
        x = torch.zeros(g.input_shape, device=dev, dtype=torch.int8)
        w = torch.zeros(g.weight_shape, device=dev, dtype=torch.int8)
        geo = dict(stride=g.stride, padding=g.padding, config=cfg)
        if fp8:
            cf.conv2d_fwd_fp8(x.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn), 1.0, 1.0, out=kind,
                              fast_accum=fast, **geo)
        else:
            cf.conv2d_fwd_int8(x, w, out=kind if kind != "int8" else ("int8", 1.0), **geo)
        torch.cuda.synchronize()
        return name, time.time() - t0, None
    except Exception as e:
        return name, time.time() - t0, f"{type(e).__name__}: {e}"[:400]


def precompile(tasks, workers):
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        res = list(pool.map(_compile_one, tasks))
    errs = [r for r in res if r[2]]
    print(f"precompiled {len(tasks)} kernel variants with {workers} processes in {time.time() - t0:.0f}s, "
          f"{len(errs)} failed", flush=True)
    for e in errs[:8]:
        print("  FAILED", e, flush=True)


def _ms(fn, warmup, rep):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _inputs(g, seed=0):
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(seed)
    x8 = torch.randint(-128, 128, g.input_shape, device=dev, dtype=torch.int8, generator=gen)
    w8 = torch.randint(-128, 128, g.weight_shape, device=dev, dtype=torch.int8, generator=gen)
    xf = torch.randn(g.input_shape, device=dev, generator=gen)
    wf = torch.randn(g.weight_shape, device=dev, generator=gen) / math.sqrt(g.R * g.S * g.C)
    return x8, w8, xf, wf


def tune(warmup, rep):
    from tcprec.kernels.triton import conv_fwd as cf

    rows = []
    for name in TUNE_LAYERS:
        g = _geom(name, 256)
        x8, w8, _, _ = _inputs(g)
        scale = torch.full((g.K,), 1e-4, device="cuda")
        line = []
        for cfg in _tune_configs(g, False):
            f = lambda: cf.conv2d_fwd_int8(x8, w8, stride=g.stride, padding=g.padding, scale=scale, act="relu",  # noqa: E731
                                           out=("int8", 0.05), config=cfg)
            try:
                ms = _ms(f, warmup, rep)
            except Exception as e:  # noqa: BLE001 -- reported and skipped
                ms = float("nan")
                print(f"  tune {name} {cfg}: {type(e).__name__}: {e}"[:300])
            tops = g.flops / ms / 1e9
            line.append((ms, cfg))
            rows.append({"layer": name, "config": cfg, "ms": ms, "tops": tops})
        best = min(line, key=lambda t: t[0] if t[0] == t[0] else 1e9)
        print(f"tune {name:16s} " + "  ".join(f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}:"
                                             f"{g.flops / m / 1e9:.0f}T" for m, c in line)
              + f"  -> best {best[1]['BLOCK_M']}x{best[1]['BLOCK_N']}w{best[1]['num_warps']}s{best[1]['num_stages']}",
              flush=True)
    return rows


def bench(batches, layers, warmup, rep):
    import torch.nn.functional as F

    from tcprec.kernels import reference_conv_int8_fp8 as rf
    from tcprec.kernels.triton import conv_fwd as cf

    torch.backends.cudnn.benchmark = True
    rows = []
    for N in batches:
        for name in layers:
            g = _geom(name, N)
            x8, w8, xf, wf = _inputs(g)
            K = g.K
            geo = dict(stride=g.stride, padding=g.padding)
            scale = torch.rand(K, device="cuda") * 1e-4 + 1e-5
            bias = torch.randn(K, device="cuda") * 0.1
            xs = (xf.abs().amax() / 448).reshape(1)
            ws = (wf.abs().amax() / 448).reshape(1)
            xq, wq = (xf / xs).to(torch.float8_e4m3fn), (wf / ws).to(torch.float8_e4m3fn)
            x16 = xf.half().permute(0, 3, 1, 2)  # NCHW view of NHWC memory: channels_last
            w16 = wf.half().permute(0, 3, 1, 2)
            out_scale = 0.05

            def f_int8():
                return cf.conv2d_fwd_int8(x8, w8, **geo, scale=scale, bias=bias, act="relu", out=("int8", out_scale))

            def f_fp8():
                return cf.conv2d_fwd_fp8(xq, wq, xs, ws, **geo, bias=bias, act="relu", out="float16")

            def f_fp8_fast():
                return cf.conv2d_fwd_fp8(xq, wq, xs, ws, **geo, bias=bias, act="relu", out="float16", fast_accum=True)

            def f_cudnn():
                return F.conv2d(x16, w16, None, g.stride, g.padding)

            row = {"layer": name, "batch": N, "shape": [g.N, g.H, g.W, g.C, g.K, g.R, g.S, g.stride[0], g.padding[0]],
                   "gflop": g.flops / 1e9, "config": cf.pick_config(g, False)}
            if N <= 8:  # correctness of what is timed (the reference is float64 on the GPU)
                y = f_int8()
                ref = rf.conv2d_fwd_int8(x8, w8, **geo, scale=scale, bias=bias, act="relu", out=("int8", out_scale))
                row["int8_exact"] = bool(torch.equal(y, ref))
                y = f_fp8().double()
                ref = rf.conv2d_fwd_fp8(xq, wq, xs, ws, **geo, bias=bias, act="relu", out="float32").double()
                row["fp8_nrmse_vs_fp8_reference"] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
                y16 = f_cudnn().permute(0, 2, 3, 1).double()
                ref = rf.conv_acc(xf.half(), wf.half(), **geo)
                row["cudnn_fp16_nrmse"] = float((y16 - ref).norm() / ref.norm())
            for key, fn in (("cudnn_fp16_ms", f_cudnn), ("int8_ms", f_int8), ("fp8_ms", f_fp8),
                            ("fp8fast_ms", f_fp8_fast)):
                try:
                    row[key] = _ms(fn, warmup, rep)
                except Exception as e:  # noqa: BLE001 -- a failure is a row, not a crash
                    row[key] = float("nan")
                    row[key.replace("_ms", "_error")] = f"{type(e).__name__}: {e}"[:300]
            for p in ("int8", "fp8", "fp8fast"):
                row[f"{p}_speedup"] = row["cudnn_fp16_ms"] / row[f"{p}_ms"]
                row[f"{p}_tops"] = g.flops / row[f"{p}_ms"] / 1e9
            row["cudnn_fp16_tflops"] = g.flops / row["cudnn_fp16_ms"] / 1e9
            rows.append(row)
            print(f"N={N:3d} {name:16s} {row['gflop']:8.1f} GF  cudnn16 {row['cudnn_fp16_ms'] * 1e3:8.1f}us "
                  f"({row['cudnn_fp16_tflops']:5.0f}T)  int8 {row['int8_ms'] * 1e3:8.1f}us ({row['int8_tops']:5.0f}T, "
                  f"x{row['int8_speedup']:.2f})  fp8 {row['fp8_ms'] * 1e3:8.1f}us ({row['fp8_tops']:5.0f}T, "
                  f"x{row['fp8_speedup']:.2f}) fp8fast x{row['fp8fast_speedup']:.2f}" + (f"  exact={row['int8_exact']} fp8err={row['fp8_nrmse_vs_fp8_reference']:.1e}"
                                                  if N <= 8 else ""), flush=True)
    return rows


def summarize(rows, batches):
    out = []
    for N in batches:
        rs = [r for r in rows if r["batch"] == N]
        for p in ("int8", "fp8", "fp8fast"):
            sp = [r[f"{p}_speedup"] for r in rs if r[f"{p}_speedup"] == r[f"{p}_speedup"]]
            tot = sum(r[f"{p}_ms"] for r in rs)
            tot16 = sum(r["cudnn_fp16_ms"] for r in rs)
            out.append({"precision": p, "batch": N, "layers": len(rs),
                        "geomean_speedup": math.exp(sum(map(math.log, sp)) / len(sp)) if sp else None,
                        "wins": sum(s > 1 for s in sp), "total_ms": tot, "cudnn_fp16_total_ms": tot16,
                        "total_speedup": tot16 / tot})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,256")
    ap.add_argument("--layers", default=",".join(BENCH_PREFIXES), help="layer-name prefixes")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--with-tests", action="store_true", help="also precompile the GPU tests' variants")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/conv_fwd.json")
    args = ap.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from tcprec.bench.common import environment, write_json
    from tcprec.kernels.triton.conv_fwd import NETWORK_LAYERS

    t0 = time.time()
    env = environment()
    print(f"GPU {env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} triton {env.get('triton')}",
          flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    prefixes = tuple(p for p in args.layers.split(",") if p)
    layers = [n for n in NETWORK_LAYERS if n.startswith(prefixes)]
    if not args.no_precompile:
        precompile(plan(batches, layers, args.tune, args.with_tests), args.workers)
    if args.precompile_only:
        return
    tune_rows = tune(args.warmup_ms, args.rep_ms) if args.tune else None
    print(f"[{time.time() - t0:.0f}s] benchmark", flush=True)
    rows = bench(batches, layers, args.warmup_ms, args.rep_ms)
    summary = summarize(rows, batches)
    cmd = "PYTHONPATH=src python3 benchmarks/tune_conv_fwd_device.py " + " ".join(sys.argv[1:])
    write_json(args.out, {"env": env, "command": cmd.strip(), "method": "triton.testing.do_bench median "
                          f"(warmup {args.warmup_ms} ms, rep {args.rep_ms} ms, L2 flushed before each call); cuDNN "
                          "fp16 channels_last F.conv2d without bias, cudnn.benchmark=True; ours int8: per-channel "
                          "scale + bias + ReLU -> int8 NHWC; ours fp8 e4m3: device scales + bias + ReLU -> fp16 NHWC "
                          "(fp8: fp32 promotion every BLOCK_K products; fp8fast: fast_accum=True)",
                          "target": "int8 and fp8 faster than cuDNN fp16 at batch 256", "rows": rows,
                          "summary": summary, "tune": tune_rows})
    print(f"[{time.time() - t0:.0f}s] done; wrote {args.out}")
    for s in summary:
        print(f"{s['precision']:5s} N={s['batch']:3d}: geomean speedup vs cuDNN fp16 x{s['geomean_speedup']:.2f}, "
              f"wins {s['wins']}/{s['layers']}, total {s['total_ms']:.3f} ms vs {s['cudnn_fp16_total_ms']:.3f} ms "
              f"(x{s['total_speedup']:.2f})")


if __name__ == "__main__":
    main()
