"""Tile / split sweep for the flat-shift fp8 wgrad kernel (kernels/triton/wgrad_flat.py) on the 19 ResNet-50 layers,
against cuDNN's fp16 wgrad (``torch.nn.grad.conv2d_weight``, NCHW and channels_last, the faster) and the current
``ops.conv.conv2d_wgrad(precision="fp8")`` path (prepared operands, ``prepare_fp8_wgrad``), all in one run.

Every config is first checked against a float32 cuDNN wgrad of the same fp8 values (NRMSE; a config above the fp8
limit is reported, not timed): the kernel's tap-shifted TMA loads start at any element, not a 16-byte boundary.
Strided 1x1 layers run the kernel on x[:, ::s, ::s] (a stride-1 1x1 layer); the subsample pass is timed apart
(``sub_ms``).  Kernel variants are compiled first by parallel worker processes (Triton's disk cache), then timed
by CUDA-graph replay (``tcprec.bench.common.time_graph_ms``), cuDNN alike.  Prints JSON lines and a table and
writes ``$OUT/wgrad_flat_tune.json``.

``--batch-inner``: every layer (3x3 and strided ones included) in fp8 with batch-inner operands (dy stored
(K, P, Q, N), x (C, H, W, N): ``ops.conv.prepare_fp8_wgrad``'s layout when N is a multiple of 16), no subsample pass.

    PYTHONPATH=src python3 benchmarks/tune_wgrad_flat_device.py [--batch 256] [--layers 2,6,11,16] [--batch-inner]
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

from tcprec.bench.common import time_graph_ms
from tcprec.bench.conv_bwd import NRMSE_LIMITS, RESNET50_LAYERS, _nrmse
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.triton import wgrad_flat as wf
from tcprec.ops import conv as opc


BATCH_INNER = False  # set by --batch-inner (module-level: the compile workers read it from their arguments)
_BI = (3, 1, 2, 0)


def flat_geometry(g: ConvGeometry) -> ConvGeometry:
    """The stride-1 geometry the kernel runs: a strided 1x1 layer on its subsampled input (batch-inner: itself)."""
    if not BATCH_INNER and g.stride != (1, 1) and g.R == g.S == 1 and g.padding == (0, 0):
        return ConvGeometry(g.N, g.P, g.Q, g.C, g.K, 1, 1, (1, 1), (0, 0), (1, 1))
    return g


def candidates(g: ConvGeometry, fp16: bool) -> list[dict]:
    """pick()'s config first, then every config of CONFIGS (CONFIGS16) whose tile the channels fill."""
    pick = wf.pick(g, 2 if fp16 else 1, BATCH_INNER)
    out = [dict(pick, pick=True)]
    for c in (wf.CONFIGS16 if fp16 else wf.CONFIGS):
        if c["BLOCK_M"] <= max(64, g.K) and c["BLOCK_N"] <= max(64, g.C) and c != pick:
            out.append(dict(c, pick=False))
    return out


def _kcfg(c: dict) -> dict:
    return {k: v for k, v in c.items() if k != "pick"}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, cols) with a 16-byte aligned row stride (zero padding past cols)."""
    cols = t.shape[1]
    lp = -(-cols * t.element_size() // wf.ALIGN) * wf.ALIGN // t.element_size()
    buf = torch.zeros(t.shape[0], lp, dtype=t.dtype, device=t.device)
    buf[:, :cols] = t
    return buf[:, :cols]


def _fp16_mode(g: ConvGeometry) -> bool:
    """3x3 (any non-1x1) layers: fp16 NHWC flat shift vs the TMA-box kernel; 1x1 layers: fp8 K-major vs cuBLAS
    (batch-inner: fp8 everywhere)."""
    return (g.R, g.S) != (1, 1) and not BATCH_INNER


def _operands(g: ConvGeometry, gf: ConvGeometry, seed: int):
    """float32 x, dy; and the kernel's operands: fp16 NHWC (3x3 layers) or fp8 K-major matrices + scales."""
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(g.N, g.H, g.W, g.C, device="cuda", generator=gen)
    dy = torch.randn(g.N, g.P, g.Q, g.K, device="cuda", generator=gen)
    if _fp16_mode(g):
        return x, dy, (dy.half(), x.half()), None
    if BATCH_INNER:
        dyq, xq = opc.to_fp8(dy, "e5m2", memory_order=_BI), opc.to_fp8(x, "e4m3", memory_order=_BI)
        return x, dy, (dyq.data, xq.data), (dyq.scale, xq.scale)
    dyq, xq = opc.to_fp8(dy, "e5m2"), opc.to_fp8(x, "e4m3")
    xs = xq.data if gf is g else xq.data[:, ::g.stride[0], ::g.stride[1], :]
    ops = (_rows(dyq.data.permute(3, 0, 1, 2).reshape(g.K, -1)), _rows(xs.permute(3, 0, 1, 2).reshape(g.C, -1)))
    return x, dy, ops, (dyq.scale, xq.scale)


def _compile_task(layer: int, N: int, cfg: dict, split: int, batch_inner: bool) -> tuple[str, float, str | None]:
    global BATCH_INNER
    BATCH_INNER = batch_inner
    t0 = time.time()
    try:
        g = RESNET50_LAYERS[layer].geometry(N)
        gf = flat_geometry(g)
        _, _, ops, scales = _operands(g, gf, 0)
        out = torch.empty(g.weight_shape, device="cuda")
        wf.wgrad_flat(*ops, out, gf, scales=scales, split_k=split, config=cfg)
        torch.cuda.synchronize()
        return f"{layer} {cfg} {split}", time.time() - t0, None
    except Exception as e:  # noqa: BLE001 (reported)
        return f"{layer} {cfg} {split}", time.time() - t0, f"{type(e).__name__}: {e}"[:300]


def bench(fn) -> float:
    return time_graph_ms(fn, calls=20, replays=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", default=None)
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 4))
    ap.add_argument("--batch-inner", action="store_true")
    args = ap.parse_args()
    global BATCH_INNER
    BATCH_INNER = args.batch_inner
    import triton

    N = args.batch
    layers = [int(i) for i in args.layers.split(",")] if args.layers else list(range(len(RESNET50_LAYERS)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cudnn=torch.backends.cudnn.version(), sms=sms, batch=N)
    print(json.dumps(env), flush=True)
    t0 = time.time()
    plans = {}
    for i in layers:
        g = RESNET50_LAYERS[i].geometry(N)
        gf = flat_geometry(g)
        plans[i] = [(c, wf.split_for(gf, c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_L"], sms, BATCH_INNER, c["num_stages"]))
                    for c in candidates(gf, _fp16_mode(g))]
    tasks = [(i, _kcfg(c), s) for i in layers for c, s in plans[i]]
    tasks += [(i, _kcfg(c), m) for i in layers for c, s in plans[i][:1] for m in (s * 2, max(1, s // 2))]
    errors = []
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        for f in as_completed([pool.submit(_compile_task, i, N, c, s, BATCH_INNER) for i, c, s in tasks]):
            name, _, err = f.result()
            if err:
                errors.append(f"{name}: {err}")
    print(json.dumps(dict(precompiled=len(tasks), seconds=round(time.time() - t0), errors=errors[:10])), flush=True)

    rows, summary = [], []
    torch.backends.cudnn.benchmark = True
    for i in layers:
        la = RESNET50_LAYERS[i]
        g = la.geometry(N)
        gf = flat_geometry(g)
        fp16 = _fp16_mode(g)
        prec = "fp16" if fp16 else "fp8"
        st, pd = g.stride, g.padding
        x, dy, ops, scales = _operands(g, gf, i)
        w_shape = (g.K, g.C, g.R, g.S)
        if fp16:
            xf, dyf = ops[1].float(), ops[0].float()
        else:
            dq, xq = opc.to_fp8(dy, "e5m2"), opc.to_fp8(x, "e4m3")
            xf, dyf = xq.dequantize(), dq.dequantize()
        torch.backends.cudnn.allow_tf32 = False
        ref = torch.nn.grad.conv2d_weight(xf.permute(0, 3, 1, 2), w_shape, dyf.permute(0, 3, 1, 2), st, pd)
        ref = ref.permute(0, 2, 3, 1)  # (K, R, S, C)
        del xf, dyf
        xh, dyh = x.half().permute(0, 3, 1, 2), dy.half().permute(0, 3, 1, 2)
        cud = {}
        for lay, a, b in (("nchw", xh.contiguous(), dyh.contiguous()),
                          ("nhwc", xh.contiguous(memory_format=torch.channels_last),
                           dyh.contiguous(memory_format=torch.channels_last))):
            cud[lay] = bench(lambda a=a, b=b: torch.nn.grad.conv2d_weight(a, w_shape, b, st, pd))
        del xh, dyh
        best_lay = min(cud, key=cud.get)
        if fp16:
            cur = lambda: opc.conv2d_wgrad(ops[0], ops[1], g.weight_shape, st, pd)  # noqa: E731
            cur_path = opc.explain_conv2d_wgrad(ops[0], ops[1], g.weight_shape, st, pd)[:90]
        else:
            dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, st, pd)
            cur = lambda: opc.conv2d_wgrad(dyq, xq, g.weight_shape, st, pd, precision="fp8")  # noqa: E731
            cur_path = opc.explain_conv2d_wgrad(dyq, xq, g.weight_shape, st, pd, precision="fp8")[:90]
        cur_ms = bench(cur)
        sub_ms = None
        if gf is not g:
            xc = xq.data.permute(3, 0, 1, 2)  # (C, N, H, W) memory order
            sub_ms = bench(lambda: _rows(xc[:, :, ::st[0], ::st[1]].reshape(g.C, -1)))
        base = dict(N=N, layer=la.name, precision=prec, flops=g.flops, cudnn_nchw_ms=cud["nchw"],
                    cudnn_nhwc_ms=cud["nhwc"], cudnn_best_ms=cud[best_lay], cudnn_best_layout=best_lay,
                    current_ms=cur_ms, current_path=cur_path, sub_ms=sub_ms)
        print(json.dumps(base), flush=True)

        def run(cfg, split, tag):
            out = torch.empty(g.weight_shape, device="cuda")
            r = dict(base, tag=tag, cfg=_kcfg(cfg), split=split, ms=None, nrmse=None, error=None)
            call = lambda: wf.wgrad_flat(*ops, out, gf, scales=scales, split_k=split, config=_kcfg(cfg))  # noqa
            try:
                call()
                torch.cuda.synchronize()
                r["nrmse"] = _nrmse(out, ref)
                if r["nrmse"] <= NRMSE_LIMITS[prec]:
                    r["ms"] = bench(call)
                else:
                    r["error"] = f"NRMSE {r['nrmse']:.3g} above the limit: not timed"
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            if r["ms"] is not None:
                tot = r["ms"] + (sub_ms or 0.0)
                r.update(tflops=g.flops / (r["ms"] * 1e-3) / 1e12, vs_cudnn=r["cudnn_best_ms"] / r["ms"],
                         vs_cudnn_incl_sub=r["cudnn_best_ms"] / tot, vs_current=cur_ms / r["ms"])
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in base or k == "layer"}), flush=True)
            return r

        lr = [run(c, s, "config") for c, s in plans[i]]
        lr.append(run(plans[i][0][0], plans[i][0][1] * 2, "split2x"))
        if plans[i][0][1] > 1:
            lr.append(run(plans[i][0][0], plans[i][0][1] // 2, "split/2"))
        timed = [r for r in lr if r["ms"] is not None]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        pick = lr[0]
        summary.append(dict(layer=la.name, precision=prec, cudnn_best_ms=cud[best_lay], current_ms=cur_ms,
                            sub_ms=sub_ms, pick_ms=pick["ms"], best_ms=best and best["ms"],
                            best_cfg=best and dict(best["cfg"], split=best["split"]),
                            best_vs_cudnn=best and cud[best_lay] / (best["ms"] + (sub_ms or 0.0)),
                            current_vs_cudnn=cud[best_lay] / cur_ms,
                            failed=[r["error"] for r in lr if r["error"]][:3]))
        x = dy = ops = ref = None
        torch.cuda.empty_cache()

    def geo(key, prec):
        vals = [s[key] for s in summary if s[key] and s["precision"] == prec]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    print(f"\nus at N={N}:\n{'layer':28s} {'prec':5s} {'cuDNN16':>9s} {'current':>9s} {'sub':>7s} {'pick':>9s} "
          f"{'best':>9s}  best+sub/cuDNN  current/cuDNN  best config")
    for s in summary:
        def f(v, w=9):
            return "-".rjust(w) if v is None else f"{v * 1e3:{w}.1f}"
        print(f"{s['layer']:28s} {s['precision']:5s} {f(s['cudnn_best_ms'])} {f(s['current_ms'])} {f(s['sub_ms'], 7)} "
              f"{f(s['pick_ms'])} {f(s['best_ms'])}  {s['best_vs_cudnn'] or 0:14.2f}  {s['current_vs_cudnn']:13.2f}  "
              f"{s['best_cfg']}")
    tot = {f"geomean_{k}_{p}": geo(k, p) for k in ("best_vs_cudnn", "current_vs_cudnn") for p in ("fp16", "fp8")}
    tot["seconds"] = round(time.time() - t0)
    print(json.dumps(tot), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"wgrad_flat_tune_{'bi_' if BATCH_INNER else ''}{N}.json"), "w") as fh:
        json.dump(dict(env=env, rows=rows, summary=summary, totals=tot), fh, indent=1)


if __name__ == "__main__":
    main()
