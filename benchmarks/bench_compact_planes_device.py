"""Device A/B for issue 4: compact activation planes (``quantize_pack(..., compact=True)``, rows without the
zero words that pad them to 512 bits) vs padded ones, for the layers that read their input through an im2col.

    PYTHONPATH=src python3 benchmarks/bench_compact_planes_device.py   # ~2 min on an H200

Same process, same networks and inputs (ResNet-18 and VGG-variant at w1a2, batch 256 and 8): the w1a2 model
timed with compact planes and with the padded ones (``tcprec.nn.qmodules.quantize_pack`` forced to
``compact=False``), twice each, alternating, plus the fp16 model; every forward in a CUDA graph.  The
outputs must be identical.  -> benchmarks/results/net_compact_planes.json
"""

from __future__ import annotations

import json
import sys

import torch

import tcprec.nn.qmodules as qm
from tcprec.bench.common import environment, time_graph_ms, write_json
from tcprec.bench.net import build_variant
from tcprec.nn import models as zoo


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    compact_pack = qm.quantize_pack

    def padded_pack(*a, compact=False, **k):
        return compact_pack(*a, **k)

    rows = []
    for name in ("resnet18", "vgg"):
        model = zoo.build(name, seed=0, device=dev).to(memory_format=torch.channels_last)
        for batch in (256, 8):
            g = torch.Generator(device=dev).manual_seed(batch)
            x = torch.randn((batch, *zoo.INPUT_SHAPES[name]), device=dev, generator=g).to(memory_format=torch.channels_last)
            fp16, _ = build_variant(model, "fp16", x[:8])
            net, dt = build_variant(model, "w1a2", x[:8])
            xin, calls = x.to(dt), (2 if batch > 32 else 8)
            row = {"model": name, "batch": batch, "precision": "w1a2"}
            with torch.no_grad():
                row["fp16_ms"] = time_graph_ms(lambda: fp16(xin), None, calls=calls, replays=5)
                outs = {}
                try:
                    for _ in range(2):
                        for mode, fn in (("compact", compact_pack), ("padded", padded_pack)):
                            qm.quantize_pack = fn
                            outs[mode] = net(xin)
                            ms = time_graph_ms(lambda: net(xin), None, calls=calls, replays=5)
                            row[f"{mode}_ms"] = min(row.get(f"{mode}_ms", ms), ms)
                finally:
                    qm.quantize_pack = compact_pack
            row["identical"] = bool(torch.equal(outs["compact"], outs["padded"]))
            row["padded_over_compact"] = row["padded_ms"] / row["compact_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            del net, fp16
            torch.cuda.empty_cache()
    write_json("benchmarks/results/net_compact_planes.json",
               {"command": "PYTHONPATH=src python3 benchmarks/bench_compact_planes_device.py", "environment": environment(),
                "rows": rows})
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
