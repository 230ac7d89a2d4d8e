"""Same-process A/B of session 25's two changes in whole w1a2 networks (GPU machine): the packed epilogues' threshold
words remembered per calibrated buffer instead of launched every forward (``loader.code_thresholds``' memo), and the
thin 8-bit stems that write bit planes on ``kernels/cuda/stem_conv.cu`` instead of the Triton window gather + conv
(``qconv.STEM_CUDA``).  Configs, on one network per (model, batch):

* ``before``: Triton stem, threshold words launched every call (the memo bypassed);
* ``memo``: Triton stem, threshold words remembered;
* ``stem_cuda``: both (the default).

Per config: the forward's CUDA-graph time (tcprec.bench.common.time_graph_ms, min of 3 interleaved rounds), the
per-layer GPU time of one eager profiler pass (benchmarks/profile_net_layers_device.py's attribution), and whether
the output equals ``before``'s (it must: every route is exact).

Usage (repo root): PYTHONPATH=src python3 benchmarks/bench_stem_conv_device.py [--model vgg,alexnet,yolov2-tiny]
    [--batch 256,8] [--out benchmarks/results/stem_conv.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.bench.net import build_variant
from tcprec.kernels.cuda import loader
from tcprec.nn.models import INPUT_SHAPES, build
from tcprec.ops import qconv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_net_layers_device import layer_totals, print_layer_ab  # noqa: E402

CONFIGS = ("before", "memo", "stem_cuda")


@contextmanager
def config(c: str):
    keep_stem, keep_memo = qconv.STEM_CUDA, loader.remembered
    qconv.STEM_CUDA = c == "stem_cuda"
    if c == "before":  # every call launches bmma_code_thresholds again
        loader.remembered = lambda memo, srcs, compute, extra=(): compute()
    try:
        yield
    finally:
        qconv.STEM_CUDA, loader.remembered = keep_stem, keep_memo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vgg,alexnet,yolov2-tiny")
    ap.add_argument("--batch", default="256,8")
    ap.add_argument("--precision", default="w1a2")
    ap.add_argument("--out", default="benchmarks/results/stem_conv.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.model.split(","):
        m32 = build(name, device="cuda").eval()
        for batch in (int(b) for b in args.batch.split(",")):
            x32 = torch.randn(batch, *INPUT_SHAPES[name], device="cuda")
            ys, times, layers = {}, {c: [] for c in CONFIGS}, {}
            with torch.no_grad():
                fp16, _ = build_variant(m32, "fp16", x32[:4])
                x = x32.half().contiguous(memory_format=torch.channels_last)
                t16 = time_graph_ms(fp16, [x])
                del fp16
                net = build_variant(m32, args.precision, x32[:4])[0]
                for c in CONFIGS:
                    with config(c):
                        ys[c] = net(x)
                        layers[c] = layer_totals(net, x)
                for _ in range(3):
                    for c in CONFIGS:
                        with config(c):  # (each call captures its own graph)
                            times[c].append(time_graph_ms(net, [x]))
            row = dict(model=name, batch=batch, precision=args.precision, fp16_ms=t16,
                       ms={c: min(t) for c, t in times.items()},
                       x_fp16={c: t16 / min(t) for c, t in times.items()},
                       equal_to_before={c: bool(torch.equal(ys[c], ys["before"])) for c in CONFIGS},
                       layers_us=layers)
            print(json.dumps({k: v for k, v in row.items() if k != "layers_us"}), flush=True)
            print_layer_ab(layers)
            rows.append(row)
            del net, ys
            torch.cuda.empty_cache()
    json.dump({"command": "PYTHONPATH=src python3 benchmarks/bench_stem_conv_device.py " + " ".join(sys.argv[1:]),
               "device": torch.cuda.get_device_name(), "environment": environment(),
               "note": "w1a2 networks: before (Triton stem, thresholds launched every call), memo (thresholds "
                       "remembered), stem_cuda (and the CUDA stem): graph ms (min of 3 interleaved), per-layer eager "
                       "GPU us (one profiler pass), output equal to before's",
               "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
