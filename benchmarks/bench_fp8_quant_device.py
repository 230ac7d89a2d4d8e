"""fp8 quantisation of conv operands, one run: ``ops.conv.to_fp8`` (amax by ``vector_norm``, then the one-pass
Triton quantiser ``kernels/triton/fp8_quant.py`` writing the requested memory order) against the torch formula
it replaced (``amax(|x|)``, ``(x.float() / scale).clamp(-max, max)`` copied into the permuted buffer), both
timed by CUDA-graph replay on the same GPU, with the bytes moved (read x once, write the codes once) as GB/s.
Writes ``$OUT/fp8_quant.json`` (default benchmarks/results).

    PYTHONPATH=src python3 benchmarks/bench_fp8_quant_device.py
"""

from __future__ import annotations

import json
import os

import torch

from tcprec.bench.common import environment, time_graph_ms
from tcprec.kernels.triton import fp8_quant as fq
from tcprec.ops import conv as opc

CASES = [  # (name, NHWC shape, dtype, fp8 format, destination memory order)
    ("x 256x56x56x256 -> batch-inner", (256, 56, 56, 256), torch.float16, "e4m3", (3, 1, 2, 0)),
    ("dy 256x28x28x512 -> batch-inner", (256, 28, 28, 512), torch.float16, "e5m2", (3, 1, 2, 0)),
    ("dy 256x56x56x64 -> (K, N, P, Q)", (256, 56, 56, 64), torch.float16, "e5m2", (3, 0, 1, 2)),
    ("w 512x3x3x512 -> (R, S, C, K)", (512, 3, 3, 512), torch.float32, "e4m3", (1, 2, 3, 0)),
    ("x 8x56x56x256 -> NHWC", (8, 56, 56, 256), torch.float16, "e4m3", (0, 1, 2, 3)),
]


def torch_formula(t: torch.Tensor, fmt: str, order) -> torch.Tensor:
    dt = opc.FP8_DTYPES[fmt]
    fmax = float(torch.finfo(dt).max)
    amax = t.abs().amax().float()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    inv = tuple(order.index(d) for d in range(t.dim()))
    data = torch.empty([t.shape[d] for d in order], dtype=dt, device=t.device).permute(inv)
    return data.copy_((t.float() / scale).clamp_(-fmax, fmax))


def main() -> None:
    env = environment()
    print(json.dumps({k: env.get(k) for k in ("gpu", "torch", "triton")}))
    rows = []
    for name, shape, dtype, fmt, order in CASES:
        x = torch.randn(shape, device="cuda").to(dtype)
        ours = opc.to_fp8(x, fmt, memory_order=order)
        ref = torch_formula(x, fmt, order)
        same = torch.equal(ours.data.view(torch.uint8), ref.view(torch.uint8))
        t_ours = time_graph_ms(lambda: opc.to_fp8(x, fmt, memory_order=order), calls=10)
        # the quantiser alone at a few tiles (scale and destination fixed): the default and alternatives
        tiles = {}
        for blk in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4)):
            tiles["x".join(map(str, blk))] = time_graph_ms(
                lambda blk=blk: fq.quantize_fp8(x, ours.scale, ours.data, block=blk), calls=10)
        t_ref = time_graph_ms(lambda: torch_formula(x, fmt, order), calls=10)
        gb = x.numel() * (x.element_size() + 1) / 1e9
        r = dict(case=name, shape=shape, dtype=str(dtype), fmt=fmt, order=order, same_bits=same, ours_ms=t_ours,
                 torch_ms=t_ref, speedup=t_ref / t_ours, ours_gb_per_s=gb / (t_ours * 1e-3),
                 torch_gb_per_s=gb / (t_ref * 1e-3), quantiser_ms_by_tile=tiles)
        rows.append(r)
        print(f"{name:36s} ours {t_ours:.3f} ms ({r['ours_gb_per_s']:.0f} GB/s)  torch {t_ref:.3f} ms  "
              f"x{r['speedup']:.1f}  same bits {same}  tiles {', '.join(f'{k} {v:.3f}' for k, v in tiles.items())}",
              flush=True)
        del x, ours, ref
        torch.cuda.empty_cache()
    out = os.path.join(os.environ.get("OUT", "benchmarks/results"), "fp8_quant.json")
    with open(out, "w") as fh:
        json.dump(dict(env=env, command="PYTHONPATH=src python3 benchmarks/bench_fp8_quant_device.py", rows=rows), fh,
                  indent=1)


if __name__ == "__main__":
    main()
