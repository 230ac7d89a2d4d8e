"""Where a quantized network's time goes: per layer, per kernel (GPU machine).

For each model, batch and precision: the forward's CUDA-graph time, then one eager torch.profiler pass whose kernels
are attributed to the leaf layer that launched them (each layer's forward is a ``record_function`` range; a kernel
belongs to the range holding its launch call, matched through the profiler's correlation ids, which also catches
Triton and cuda-core launches that torch's own op tree does not list).  Eager-only work (checks that copy to the
host) shows up too; graph replay has none of it.

Usage (repo root): PYTHONPATH=src python3 benchmarks/profile_net_layers_device.py --model resnet18,vgg
    --batch 8,256 --precision w1a2,fp16 [--graph-only]
"""

from __future__ import annotations

import argparse
import bisect
import collections

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tcprec.bench.common import time_graph_ms
from tcprec.bench.net import build_variant
from tcprec.nn.models import INPUT_SHAPES, build


def layer_kernels(model, x, iters: int = 3) -> dict:
    """{leaf layer: {kernel name: us per forward}}, plus "(outside layers)"."""
    hooks = []
    for n, mod in model.named_modules():
        if len(list(mod.children())) == 0 or getattr(mod, "tcprec_leaf", False):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=n: setattr(m, "_tcprec_rf", record_function("L:" + n).__enter__())))
            hooks.append(mod.register_forward_hook(lambda m, a, o: m._tcprec_rf.__exit__(None, None, None)))
    try:
        for _ in range(2):
            model(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                model(x)
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    events = list(prof.profiler.kineto_results.events())
    ranges = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[2:]) for e in events
                    if e.name().startswith("L:") and e.device_type().name == "CPU")
    starts = [r[0] for r in ranges]
    gpu = collections.defaultdict(list)
    for e in events:
        if e.device_type().name == "CUDA" and not e.name().startswith("L:"):
            gpu[e.correlation_id()].append((e.name(), e.duration_ns() / 1000))
    out = collections.OrderedDict((n, collections.OrderedDict()) for _, _, n in ranges)
    out["(outside layers)"] = collections.OrderedDict()
    for e in events:
        if e.device_type().name != "CPU" or e.correlation_id() not in gpu or e.name().startswith("L:"):
            continue
        i = bisect.bisect_right(starts, e.start_ns()) - 1
        d = out[ranges[i][2]] if i >= 0 and e.start_ns() <= ranges[i][1] else out["(outside layers)"]
        for name, us in gpu.pop(e.correlation_id()):
            d[name] = d.get(name, 0.0) + us / iters
    return out


def layer_totals(model, x) -> dict:
    """{leaf layer: us per forward} of the layers that launched GPU work (``layer_kernels`` summed a layer)."""
    return {k: round(sum(d.values()), 1) for k, d in layer_kernels(model, x).items() if sum(d.values()) > 0}


def print_layer_ab(layers: dict) -> None:
    """Per-layer us of several configurations ({config: layer_totals}) side by side, in the first one's layer order."""
    first = next(iter(layers.values()))
    for lay in first:
        print(f"  {lay:28s} " + "  ".join(f"{c} {t.get(lay, 0.0):7.1f}" for c, t in layers.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", default="8,256")
    ap.add_argument("--precision", default="w1a2,fp16")
    ap.add_argument("--graph-only", action="store_true", help="only the CUDA-graph time of each forward")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.model.split(","):
        m32 = build(name, device="cuda").eval()
        for batch in (int(b) for b in args.batch.split(",")):
            x32 = torch.randn(batch, *INPUT_SHAPES[name], device="cuda")
            for prec in args.precision.split(","):
                with torch.no_grad():
                    model, dt = build_variant(m32, prec, x32[:4])
                    x = x32.to(dt).contiguous(memory_format=torch.channels_last)
                    print(f"=== {name} batch {batch} {prec}: graph {time_graph_ms(model, [x]):.3f} ms", flush=True)
                    if args.graph_only:
                        continue
                    total = 0.0
                    for layer, kernels in layer_kernels(model, x).items():
                        us = sum(kernels.values())
                        total += us
                        if us > 0:
                            print(f"  {layer:24s} {us:8.1f} us  " + "; ".join(
                                f"{k[:36]} {v:.1f}" for k, v in kernels.items() if v >= 0.05), flush=True)
                    print(f"  eager kernel sum {total:.1f} us")


if __name__ == "__main__":
    main()
