"""Same-process A/B of the binary networks' INT8 stems (GPU machine): the conv writing float32 at full size and the
one-pass pool + quantize + pack after it (the route before session 23), against the conv's epilogue writing the next
layer's 2-bit planes itself (``conv_fwd.PlanesOut(pool=2)``) with the table's tile and with ``pick_config(...,
pooled=True)``; and ``pack.pool_planes`` (the bit-plane max-pool after a binary layer) with the old 4096-word programs
against the default.  Batch 256, the stems as the network runs them: their windows gathered into rows, a 1x1 conv.
Every variant's planes are checked equal to the pass route's.  CUDA-graph time (tcprec.bench.common.time_graph_ms),
min of 3 interleaved rounds.

Usage (repo root): PYTHONPATH=src python3 benchmarks/bench_stem_planes_device.py [--out benchmarks/results/stem_planes.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.triton import conv_fwd as cf
from tcprec.kernels.triton import pack as tpack

# name -> (output map P = Q, gathered row bytes kp, output channels) of the stem as a 1x1 conv over gathered rows
STEMS = {"vgg": (112, 32, 96), "alexnet": (55, 384, 64), "yolov2-tiny": (416, 32, 16)}
# name -> (map, channels, compact words) of a binary layer's full-size output that a bit-plane pool halves
POOLS = {"vgg.features.10": (56, 256, 8), "vgg.features.20": (28, 512, 16)}


def _best(fns: dict, rounds: int = 3) -> dict:
    out = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k] = min(out[k], time_graph_ms(fn, []) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/stem_planes.json")
    args = ap.parse_args()
    dev, N = torch.device("cuda"), args.batch
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    for name, (P, kp, K) in STEMS.items():
        x = torch.randint(-128, 128, (N, P, P, kp), dtype=torch.int8, device=dev, generator=gen)
        w = torch.randint(-128, 128, (K, 1, 1, kp), dtype=torch.int8, device=dev, generator=gen)
        scale = torch.rand(K, device=dev, generator=gen) * 1e-3
        bias = torch.randn(K, device=dev, generator=gen)
        s = torch.tensor([0.5], device=dev)
        g = ConvGeometry(N, P, P, kp, K, 1, 1, (1, 1), (0, 0), (1, 1))
        table, pooled = cf.pick_config(g, False, dev), cf.pick_config(g, False, dev, pooled=True)
        kw = dict(scale=scale, bias=bias, act="relu")
        spec = cf.PlanesOut(s, 2, 0, 3, 0, 0, pool=2)

        def passes():
            return tpack.pool_quantize_pack(cf.conv2d_fwd_int8(x, w, **kw, out="float32", config=table), s, 2, 2, 0, 3, 0, 0)

        fns = {"float32 + pool_quantize_pack": passes,
               "planes, table tile": lambda: cf.conv2d_fwd_int8(x, w, **kw, out=spec, config=table),
               "planes, pick_config(pooled=True)": lambda: cf.conv2d_fwd_int8(x, w, **kw, out=spec, config=pooled)}
        want = passes()
        equal = {k: bool(torch.equal(fn(), want)) for k, fn in fns.items()}
        us = _best(fns)
        rows.append({"kind": "stem", "name": name, "batch": N, "gathered_row_bytes": kp, "K": K, "P": P,
                     "table": table, "pooled": pooled, "us": us, "equal": equal})
        print(name, {k: round(v, 1) for k, v in us.items()}, equal, flush=True)
    for name, (P, K, kwords) in POOLS.items():
        planes = torch.randint(-2**31, 2**31 - 1, (2, N * P * P, kwords), dtype=torch.int32, device=dev,
                               generator=gen)

        def old():  # the session-22 programs: 4096 words each
            keep, tpack.POOL_SLICED_WORDS = tpack.POOL_SLICED_WORDS, 4096
            try:
                return tpack.pool_planes(planes, (N, P, P, K), 2, 2, False)
            finally:
                tpack.POOL_SLICED_WORDS = keep

        def new():
            return tpack.pool_planes(planes, (N, P, P, K), 2, 2, False)

        equal = bool(torch.equal(old(), new()))
        us = _best({"4096-word programs": old, "default": new})
        rows.append({"kind": "pool_planes", "name": name, "batch": N, "P": P, "K": K, "words": kwords, "us": us,
                     "equal": equal})
        print(name, {k: round(v, 1) for k, v in us.items()}, equal, flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "PYTHONPATH=src python3 benchmarks/bench_stem_planes_device.py", "device":
                   torch.cuda.get_device_name(), "environment": environment(), "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
