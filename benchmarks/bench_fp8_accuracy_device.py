"""FP8 networks against their exact reference on the GPU (issue 40): per layer with the same input codes, and
the whole network, for both accumulation modes (``QuantConfig(fp8_accum="fp32")``, the default: Hopper's fp8
MMA accumulator promoted into fp32 every BLOCK_K products; ``"fast"``: the narrow accumulator over the whole
reduction), with the time of one forward of each.

Per layer: every FP8 QConv2d / QLinear of an unchained copy (``chain=False``: float in, float out) is called on
the inputs it saw in the network, once on its GPU kernel and once on the reference backend (F.conv2d on the
decoded codes in float64), both with a float32 output so that only the accumulation differs; the error is
reported relative to ``A = sum |x_q| |w_q| |scale|`` (the bound's unit: docs/numerics.md) and as a relative L2.
Whole network: the default (chained) model against a deep copy on the reference backend, relative L2 of the
outputs.  Writes benchmarks/results/fp8_accuracy.json (or --out).

    PYTHONPATH=src python benchmarks/bench_fp8_accuracy_device.py --nets resnet18 vgg --batch 8
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.nn import models as zoo
from tcprec.nn.qmodules import QConv2d, QLinear
from tcprec.ops import qconv as qc

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8_accuracy.json")


def _rel(y, ref) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def _reference_copy(q):
    r = copy.deepcopy(q)
    for m in r.modules():
        if isinstance(m, (QConv2d, QLinear)):
            m.backend = "reference"
    return r


def _abs_bound_unit(m, args) -> torch.Tensor:
    """A = sum |x_q| |w_q| |scale| of each output (pooled like the output), float64."""
    x = args[0]
    if isinstance(m, QLinear):
        xq = qc.quantize_fp8_static(x.reshape(-1, m.in_features), m.in_scale).dequantize().double().abs()
        wq = m.weight.qw.dequantize().reshape(m.out_features, m.in_features).double().abs()
        return xq @ wq.t()
    xq = qc.quantize_fp8_static(x.permute(0, 2, 3, 1), m.in_scale).dequantize().double().abs().permute(0, 3, 1, 2)
    wq = m.weight.qw.dequantize().permute(0, 3, 1, 2).double().abs()  # KRSC -> KCRS
    a = F.conv2d(xq, wq, stride=m.stride, padding=m.padding, dilation=m.dilation)
    if m.ch_scale is not None:
        a = a * m.ch_scale.double().abs().view(1, -1, 1, 1)
    if m.pool is not None:
        a = F.max_pool2d(a, 2, 2)
    return a


@torch.no_grad()
def per_layer(m_float, x, mode: str) -> list[dict]:
    q = tp.quantize_model(m_float, tp.QuantConfig("fp8", fp8_accum=mode, chain=False), calibration=x, warn=False)
    calls = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=n: calls.append((n, mod, args)))
             for n, mod in q.named_modules() if isinstance(mod, (QConv2d, QLinear)) and mod.precision.fp8]
    q(x)
    for h in hooks:
        h.remove()
    rows = []
    for name, mod, args in calls:
        args32 = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        out_dtype, backend = mod.out_dtype, mod.backend
        mod.out_dtype = torch.float32
        try:
            y_gpu = mod(*args32).double()
            mod.backend = "reference"
            y_ref = mod(*args32).double()
        finally:
            mod.out_dtype, mod.backend = out_dtype, backend
        a = _abs_bound_unit(mod, args32)
        if isinstance(mod, QConv2d) and mod.has_residual:
            a = a + args32[1].double().abs()
        err = (y_gpu - y_ref).abs()
        k = mod.in_channels * mod.kernel_size[0] * mod.kernel_size[1] if isinstance(mod, QConv2d) else mod.in_features
        rows.append({"layer": name, "K": k, "rel_l2": _rel(y_gpu, y_ref),
                     "max_err_over_A": float((err / a.clamp_min(1e-30)).max()),
                     "max_err_over_max_ref": float(err.max() / y_ref.abs().max().clamp_min(1e-300))})
    return rows


def _time_ms(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


@torch.no_grad()
def whole_network(m_float, x, mode: str, first_last) -> dict:
    cfg = tp.QuantConfig("fp8", fp8_accum=mode, first_last=first_last)
    q = tp.quantize_model(m_float, cfg, calibration=x, warn=False)
    r = _reference_copy(q)
    y, y_ref, y_float = q(x), r(x), m_float(x)
    return {"mode": mode, "first_last": first_last, "rel_l2_vs_reference": _rel(y, y_ref),
            "rel_l2_reference_vs_float": _rel(y_ref, y_float), "forward_ms": round(_time_ms(lambda: q(x)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=["resnet18", "vgg"], choices=list(zoo.MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--first-last", default="float", help="precision of the first conv and last layer "
                    "('float' needs no int8 stem compile; 'int8' is quantize_model's default)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the point is the GPU kernels against the reference")
    dev = torch.device("cuda")
    result = {"suite": "fp8_accuracy", "command": "PYTHONPATH=src python benchmarks/bench_fp8_accuracy_device.py "
              + " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                         for k, v in vars(args).items() if k != "out"),
              "device": torch.cuda.get_device_name(dev) + f", torch {torch.__version__}",
              "commit": None, "summary": [], "targets": [], "per_layer": {}}
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        pass

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name in args.nets:
        m = zoo.build(name, device=dev).to(dtype=torch.float16, memory_format=torch.channels_last)
        c, h, w = zoo.INPUT_SHAPES[name]
        x = torch.randn(args.batch, c, h, w, device=dev, generator=torch.Generator(dev).manual_seed(0)).half()
        for mode in ("fp32", "fast"):
            t0 = time.perf_counter()
            rows = per_layer(m, x, mode)
            result["per_layer"][f"{name}/{mode}"] = rows
            net = whole_network(m, x, mode, None if args.first_last == "none" else args.first_last)
            result["summary"].append({"net": name, "fp8_accum": mode, "net_rel_l2": round(net["rel_l2_vs_reference"], 5),
                                      "ref_vs_float": round(net["rel_l2_reference_vs_float"], 4),
                                      "worst_layer_rel_l2": max(r["rel_l2"] for r in rows),
                                      "worst_err_over_A": max(r["max_err_over_A"] for r in rows),
                                      "forward_ms": net["forward_ms"], "s": round(time.perf_counter() - t0, 1)})
            print(result["summary"][-1], flush=True)
            save()
        fp32, fast = result["summary"][-2], result["summary"][-1]
        result["targets"].append({"target": f"{name} fp8 (fp8_accum='fp32') within 1% of its reference (rel L2)",
                                  "value": f"{fp32['net_rel_l2']:.4f} (fast: {fast['net_rel_l2']:.4f})",
                                  "met": fp32["net_rel_l2"] <= 0.01})
        save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
