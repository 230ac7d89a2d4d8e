"""Tile / box / split sweep for the TMA-box wgrad kernel (kernels/triton/wgrad_tma.py) on the ResNet-50 layers it
is meant for -- the four 3x3 layers and the six strided 1x1 layers -- fp16, N = 256, against cuDNN's fp16 wgrad
(``torch.nn.grad.conv2d_weight`` on NCHW and on channels_last tensors, cudnn.benchmark on, the faster of the
two) and our current ``auto`` path, all in the same run.  Every config is first checked against an fp32 cuDNN
wgrad of the same fp16 operands (NRMSE; a config above the fp16 limit is reported, not timed): the kernel has
not run on TMA hardware before this script.

Per layer: every config of ``wgrad_tma.CONFIGS`` whose tile fits the channels, with the box policies "auto"
(row boxes: both operands from shared memory) and "min" (least padding; several rows or images a box: dy's
tile through registers), each at the heuristic split; then the best config at half, double and one split.
Kernel variants are compiled first by parallel worker processes (Triton's disk cache), then timed by CUDA-graph
replay (``tcprec.bench.common.time_graph_ms``: 20 calls a graph, median of 5 replays by CUDA events), cuDNN
alike: an eager call of these paths costs 100-360 us of host time on the H200 machine, more than most of the
kernels, so events around eager calls (``do_bench``, this script's first version) timed the host.  Prints JSON lines, a table, and writes
``$OUT/wgrad_tma_tune.json``.

    PYTHONPATH=src python3 benchmarks/tune_wgrad_tma_device.py [--batch 256] [--layers 2,6,11,16]
        [--workers 12] [--no-precompile]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch

from tcprec.bench.conv_bwd import NRMSE_LIMITS, RESNET50_LAYERS, _nrmse
from tcprec.kernels.triton._host import next_power_of_2
from tcprec.kernels.triton import wgrad_tma as wt
from tcprec.ops import conv as opc

# the 3x3 layers and the strided 1x1 layers (indices into RESNET50_LAYERS)
LAYERS = [i for i, la in enumerate(RESNET50_LAYERS) if la.R == 3 or la.stride == 2]


def candidates(g) -> list[dict]:
    """The configs to time on layer g: tiles that fit its channels x box policies, deduplicated by
    (tile, BLOCK_L, box); the kernel's default pick first."""
    out, seen = [], set()
    pick = wt.pick(g)
    for cfg in [pick] + wt.CONFIGS:
        if cfg["BLOCK_M"] > max(64, next_power_of_2(g.K)) or cfg["BLOCK_N"] > max(64, next_power_of_2(g.C)):
            continue
        for policy in ("auto", "min"):
            box = wt.choose_box(g.N, g.P, g.Q, cfg["BLOCK_L"], policy)
            key = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_L"], cfg["num_warps"], cfg["num_stages"], box)
            if key not in seen:
                seen.add(key)
                out.append(dict(cfg, BOX=box, policy=policy, pick=cfg is pick and policy == "auto"))
    return out


def _kernel_cfg(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in ("policy", "pick")}


def _data(g, seed: int = 0):
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(g.N, g.C, g.H, g.W, device="cuda", generator=gen).half()
    dy = torch.randn(g.N, g.K, g.P, g.Q, device="cuda", generator=gen).half()
    return x, dy


def _compile_task(layer: int, N: int, cfg: dict, split: int) -> tuple[str, float, str | None]:
    """In a worker process: run the variant once on the real layer (same specialisation as the timed call)."""
    t0 = time.time()
    try:
        g = RESNET50_LAYERS[layer].geometry(N)
        x, dy = _data(g)
        opc.conv2d_wgrad(dy.permute(0, 2, 3, 1).contiguous(), x.permute(0, 2, 3, 1).contiguous(), g.weight_shape,
                         g.stride, g.padding, backend="tma", config=_kernel_cfg(cfg), split_k=split)
        torch.cuda.synchronize()
        return f"{layer} {cfg}", time.time() - t0, None
    except Exception as e:  # reported; the sweep then compiles (or fails on) this variant itself
        return f"{layer} {cfg}", time.time() - t0, f"{type(e).__name__}: {e}"[:300]


def do_bench(fn) -> float:
    """ms per call by CUDA-graph replay (no host launch time in it)."""
    from tcprec.bench.common import time_graph_ms

    return time_graph_ms(fn, calls=20, replays=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", default=None, help="comma-separated indices into RESNET50_LAYERS")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 4))
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    import triton

    N = args.batch
    layers = [int(i) for i in args.layers.split(",")] if args.layers else LAYERS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cudnn=torch.backends.cudnn.version(), sms=sms, batch=N)
    print(json.dumps(env), flush=True)
    t0 = time.time()
    plans = {i: [(c, wt.plan(RESNET50_LAYERS[i].geometry(N), _kernel_cfg(c), None, sms)["split"])
                 for c in candidates(RESNET50_LAYERS[i].geometry(N))] for i in layers}
    if not args.no_precompile:
        tasks = [(i, c, s) for i in layers for c, s in plans[i]]
        errors = []
        with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
            futs = [pool.submit(_compile_task, i, N, c, s) for i, c, s in tasks]
            for f in as_completed(futs):
                name, _, err = f.result()
                if err:
                    errors.append(f"{name}: {err}")
        print(json.dumps(dict(precompiled=len(tasks), seconds=round(time.time() - t0), errors=errors[:10])), flush=True)

    rows, summary = [], []
    torch.backends.cudnn.benchmark = True
    for i in layers:
        la = RESNET50_LAYERS[i]
        g = la.geometry(N)
        st, pd = g.stride, g.padding
        x, dy = _data(g, seed=i)
        w_shape = (g.K, g.C, g.R, g.S)
        x_cl, dy_cl = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
        x_nhwc, dy_nhwc = x_cl.permute(0, 2, 3, 1), dy_cl.permute(0, 2, 3, 1)
        torch.backends.cudnn.allow_tf32 = False
        ref = torch.nn.grad.conv2d_weight(x.float(), w_shape, dy.float(), st, pd)  # fp32, same fp16 operands
        cudnn = {lay: do_bench(lambda a=a, b=b: torch.nn.grad.conv2d_weight(a, w_shape, b, st, pd))
                 for lay, a, b in (("nchw", x, dy), ("nhwc", x_cl, dy_cl))}
        best_lay = min(cudnn, key=cudnn.get)
        auto_expl = opc.explain_conv2d_wgrad(dy_nhwc, x_nhwc, g.weight_shape, st, pd)
        auto_ms = do_bench(lambda: opc.conv2d_wgrad(dy_nhwc, x_nhwc, g.weight_shape, st, pd))
        base = dict(N=N, layer=la.name, flops=g.flops, cudnn_nchw_ms=cudnn["nchw"], cudnn_nhwc_ms=cudnn["nhwc"],
                    cudnn_best_ms=cudnn[best_lay], cudnn_best_layout=best_lay, auto_ms=auto_ms, auto_explain=auto_expl)

        def run(cfg, split, tag):
            kcfg = _kernel_cfg(cfg)

            def call():
                return opc.conv2d_wgrad(dy_nhwc, x_nhwc, g.weight_shape, st, pd, backend="tma", config=kcfg,
                                        split_k=split)

            r = dict(base, tag=tag, cfg={k: v for k, v in kcfg.items() if k != "BOX"}, box=list(cfg["BOX"]),
                     policy=cfg["policy"], pick=cfg["pick"], split=split, ms=None, nrmse=None, error=None)
            try:
                got = call()
                torch.cuda.synchronize()
                r["nrmse"] = _nrmse(got.permute(0, 3, 1, 2), ref)
                if r["nrmse"] <= NRMSE_LIMITS["fp16"]:
                    r["ms"] = do_bench(call)
                else:
                    r["error"] = f"NRMSE {r['nrmse']:.3g} above the fp16 limit: not timed"
            except Exception as e:  # noqa: BLE001 (reported in the row)
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            if r["ms"] is not None:
                r.update(tflops=g.flops / (r["ms"] * 1e-3) / 1e12, vs_cudnn=r["cudnn_best_ms"] / r["ms"],
                         vs_auto=auto_ms / r["ms"])
            rows.append(r)
            print(json.dumps(r), flush=True)
            return r

        layer_rows = [run(c, s, "config") for c, s in plans[i]]
        timed = [r for r in layer_rows if r["ms"] is not None]
        if timed:  # the split around the best config's heuristic one
            best = min(timed, key=lambda r: r["ms"])
            cfg = next(c for c, _ in plans[i] if list(c["BOX"]) == best["box"]
                       and all(c[k] == v for k, v in best["cfg"].items()))
            for s in sorted({1, max(1, best["split"] // 2), best["split"] * 2} - {best["split"]}):
                layer_rows.append(run(cfg, s, "split"))
        timed = [r for r in layer_rows if r["ms"] is not None]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        pick = next((r for r in layer_rows if r["pick"] and r["tag"] == "config"), None)
        summary.append(dict(layer=la.name, cudnn_best_ms=base["cudnn_best_ms"], auto_ms=auto_ms,
                            pick_ms=pick and pick["ms"], best_ms=best and best["ms"],
                            best_cfg=best and dict(best["cfg"], BOX=best["box"], split=best["split"]),
                            pick_vs_cudnn=pick and pick["ms"] and base["cudnn_best_ms"] / pick["ms"],
                            best_vs_cudnn=best and base["cudnn_best_ms"] / best["ms"],
                            best_vs_auto=best and auto_ms / best["ms"],
                            failed=[r["error"] for r in layer_rows if r["error"]][:3]))
        x = dy = x_cl = dy_cl = x_nhwc = dy_nhwc = ref = None  # free this layer's tensors before the next one
        torch.cuda.empty_cache()

    def geo(key):
        vals = [s[key] for s in summary if s[key]]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    print(f"\nus at N={N}:\n{'layer':28s} {'cuDNN':>9s} {'auto':>9s} {'pick':>9s} {'best':>9s}  best/cuDNN  best/auto  best config")
    for s in summary:
        def f(v):
            return "-" if v is None else f"{v * 1e3:9.1f}"
        print(f"{s['layer']:28s} {f(s['cudnn_best_ms'])} {f(s['auto_ms'])} {f(s['pick_ms'])} {f(s['best_ms'])}  "
              f"{s['best_vs_cudnn'] or 0:10.2f} {s['best_vs_auto'] or 0:10.2f}  {s['best_cfg']}")
    tot = dict(geomean_pick_vs_cudnn=geo("pick_vs_cudnn"), geomean_best_vs_cudnn=geo("best_vs_cudnn"),
               geomean_best_vs_auto=geo("best_vs_auto"), seconds=round(time.time() - t0))
    print(json.dumps(tot), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "wgrad_tma_tune.json"), "w") as fh:
        json.dump(dict(env=env, summary=summary, totals=tot, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
