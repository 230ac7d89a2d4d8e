"""Same-process A/B of the bit-serial dual output (a ResNet block's output as the float and its planes from one
epilogue, ``nn.convert.BITSERIAL_DUAL``) against the float and a quantize_pack pass in each reader: w1a2 ResNet-18 at
batch 8 and 256, both networks built from one fp16 model, CUDA-graph time (tcprec.bench.common.time_graph_ms), min of
3 interleaved rounds, outputs compared.

Usage (GPU machine, repo root): PYTHONPATH=src python3 benchmarks/bench_net_dual_ab_device.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.bench.net import build_variant
from tcprec.nn import convert
from tcprec.nn.models import INPUT_SHAPES, build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/net_dual_ab.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    m32 = build("resnet18", device="cuda").eval()
    keep = convert.BITSERIAL_DUAL
    for batch in (8, 256):
        x32 = torch.randn(batch, *INPUT_SHAPES["resnet18"], device="cuda")
        nets = {}
        with torch.no_grad():
            for dual in (True, False):
                convert.BITSERIAL_DUAL = dual
                nets[dual] = build_variant(m32, "w1a2", x32[:4])[0]
            convert.BITSERIAL_DUAL = keep
            x = x32.half().contiguous(memory_format=torch.channels_last)
            same = torch.equal(nets[True](x), nets[False](x))
            times = {True: [], False: []}
            for _ in range(3):
                for dual in (True, False):
                    times[dual].append(time_graph_ms(nets[dual], [x]))
        row = dict(model="resnet18", batch=batch, dual_ms=min(times[True]), separate_ms=min(times[False]),
                   outputs_equal=same)
        print(row, flush=True)
        rows.append(row)
    json.dump({"command": "PYTHONPATH=src python3 benchmarks/bench_net_dual_ab_device.py", "device":
               torch.cuda.get_device_name(), "environment": environment(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
