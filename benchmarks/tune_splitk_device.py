"""Split-K for the bit-serial GEMM's cp.async tiles (GPU machine): the batch-8 networks' GEMMs of few tiles and long K.

For each shape (the linear layers and late convolutions of ResNet-18 / VGG / AlexNet at batch 8, w1a2, as their GEMMs
see them), times the tile ``pick_tile`` chooses and mma.sync tiles with split-K counts 1..16 by CUDA-graph replay, and
checks every split output equal to the unsplit one bit for bit.  Writes ``--out`` (JSON).

Usage (repo root): PYTHONPATH=src python3 benchmarks/tune_splitk_device.py --out /tmp/splitk.json
"""

from __future__ import annotations

import argparse
import json

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.kernels.cuda import bmma_gemm as L
from tcprec.kernels.cuda import runtime as R

# (name, M, N, K bits, output): the GEMM of each layer at batch 8
SHAPES = [
    ("vgg fc 25088->4096", 8, 4096, 25088, "float16"),
    ("alexnet fc 12544->4096", 8, 4096, 12544, "float16"),
    ("fc 4096->4096", 8, 4096, 4096, "float16"),
    ("resnet18 fc 25088->512", 8, 512, 25088, "float16"),
    ("resnet18 512@7 3x3", 392, 512, 4608, "packed"),
    ("resnet18 256@14 3x3", 1568, 256, 2304, "packed"),
    ("resnet18 128@28 3x3", 6272, 128, 1152, "packed"),
    ("vgg 512@14 3x3", 1568, 512, 4608, "packed"),
    ("vgg 512@28 3x3", 6272, 512, 4608, "packed"),
    ("alexnet 384->256@13 3x3", 1352, 256, 3456, "packed"),
]
TILES = ["32x32_w2x2_s2_k1024", "32x32_w2x2_s3_k1024", "32x64_w2x2_s3_k1024"]
SPLITS = [1, 2, 3, 4, 6, 8]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/splitk_tune.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    for name, M, N, K, out_kind in SHAPES:
        kw = -(-K // 512) * 16
        a = torch.randint(-2**31, 2**31 - 1, (2, M, kw), dtype=torch.int32, device=dev)
        w = torch.randint(-2**31, 2**31 - 1, (1, N, kw), dtype=torch.int32, device=dev)
        a[..., -(-K // 32):] = 0  # K's padding words are zero, as packing leaves them
        w[..., -(-K // 32):] = 0
        rt = torch.randint(-1000, 1000, (M,), dtype=torch.int32, device=dev)
        ct = torch.randint(-1000, 1000, (N,), dtype=torch.int32, device=dev)
        cs = torch.rand(N, device=dev) * 0.01
        bias = torch.randn(N, device=dev)
        osc = torch.tensor([0.5], device=dev)

        ws = [w] + [w.roll(i, 1) for i in (1, 2, 3)]  # four weight copies: as in a network, W comes from HBM

        def gemm(tile, w=w):
            return L._bmma_gemm(a, w, False, False, 2, rt, ct, None, cs, bias, True, out_kind, 2, "unsigned",
                                osc if out_kind == "packed" else None, tile, 0.0, False,
                                out_compact=out_kind == "packed")

        picked = str(L._variant_for(2, 1, False, False, M, N, out_kind, 2, "unsigned", "",
                                    *R.sm_count(dev), kw).tile)
        ref = gemm("")
        t0 = time_graph_ms(lambda wi: gemm("", wi), ws)
        rows.append({"shape": name, "M": M, "N": N, "K": K, "out": out_kind, "tile": f"picked {picked}",
                     "us": t0 * 1e3, "equal": True})
        print(f"{name:28s} picked {picked:32s} {t0 * 1e3:7.2f} us", flush=True)
        for base in TILES:
            for sk in SPLITS:
                tile = base + (f"_sk{sk}" if sk > 1 else "")
                try:
                    y = gemm(tile)
                except ValueError as e:  # e.g. a packed tile's constraints
                    print(f"  {tile}: {e}")
                    break
                same = bool(torch.equal(y, ref))
                t = time_graph_ms(lambda wi: gemm(tile, wi), ws)
                rows.append({"shape": name, "M": M, "N": N, "K": K, "out": out_kind, "tile": tile, "us": t * 1e3,
                             "equal": same})
                print(f"  {tile:34s} {t * 1e3:7.2f} us  equal={same}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
