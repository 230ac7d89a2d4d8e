"""Same-process A/B of the bit-serial convolution's two routes in whole w1a2 networks (GPU machine): the explicit
im2col over planes + GEMM (``qconv.BITSERIAL_IMPLICIT = False``), the implicit GEMM wherever the layout allows
(``True``: the kernel gathers the windows and, for pm1 weights, sums their rows on the tensor cores), and the
default rule (``"auto"``).  Per config: the forward's CUDA-graph time (tcprec.bench.common.time_graph_ms, min of 3
interleaved rounds), the per-layer GPU time of one eager profiler pass (benchmarks/profile_net_layers_device.py's
attribution), and whether the output equals the im2col network's (it must: both routes are exact).

Usage (repo root): PYTHONPATH=src python3 benchmarks/bench_net_routes_device.py [--model resnet18,vgg,alexnet]
    [--batch 8,256] [--out benchmarks/results/net_routes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.bench.net import build_variant
from tcprec.nn.models import INPUT_SHAPES, build
from tcprec.ops import qconv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_net_layers_device import layer_totals, print_layer_ab  # noqa: E402

CONFIGS = {"im2col": False, "implicit": True, "auto": "auto"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18,vgg,alexnet")
    ap.add_argument("--batch", default="8,256")
    ap.add_argument("--precision", default="w1a2")
    ap.add_argument("--out", default="benchmarks/results/net_routes.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows, keep = [], qconv.BITSERIAL_IMPLICIT
    for name in args.model.split(","):
        m32 = build(name, device="cuda").eval()
        for batch in (int(b) for b in args.batch.split(",")):
            x32 = torch.randn(batch, *INPUT_SHAPES[name], device="cuda")
            nets, ys, times, layers = {}, {}, {c: [] for c in CONFIGS}, {}
            with torch.no_grad():
                fp16, _ = build_variant(m32, "fp16", x32[:4])
                x = x32.half().contiguous(memory_format=torch.channels_last)
                t16 = time_graph_ms(fp16, [x])
                del fp16
                for c, v in CONFIGS.items():  # conversion picks the planes' layout per route: build under each
                    qconv.BITSERIAL_IMPLICIT = v
                    nets[c] = build_variant(m32, args.precision, x32[:4])[0]
                    ys[c] = nets[c](x)
                    layers[c] = layer_totals(nets[c], x)
                for _ in range(3):
                    for c, v in CONFIGS.items():
                        qconv.BITSERIAL_IMPLICIT = v  # (each call captures its own graph)
                        times[c].append(time_graph_ms(nets[c], [x]))
                qconv.BITSERIAL_IMPLICIT = keep
            row = dict(model=name, batch=batch, precision=args.precision, fp16_ms=t16,
                       ms={c: min(t) for c, t in times.items()},
                       equal_to_im2col={c: bool(torch.equal(ys[c], ys["im2col"])) for c in CONFIGS},
                       layers_us=layers)
            print(json.dumps({k: v for k, v in row.items() if k != "layers_us"}), flush=True)
            print_layer_ab(layers)
            rows.append(row)
            del nets, ys
            torch.cuda.empty_cache()
    json.dump({"command": "PYTHONPATH=src python3 benchmarks/bench_net_routes_device.py " + " ".join(sys.argv[1:]),
               "device": torch.cuda.get_device_name(), "environment": environment(),
               "note": "w1a2 networks, per bit-serial conv route: graph ms (min of 3 interleaved), per-layer eager "
                       "GPU us (one profiler pass), output equal to the im2col route's",
               "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
