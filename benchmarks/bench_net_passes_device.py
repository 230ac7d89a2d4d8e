"""The per-pass A/B of session 19's network changes (issue 4), each pair timed in this one run on one GPU (CUDA-graph
replay of 10 launches, best of 5 rounds), outputs compared for equality:

* thin network inputs quantized as wide flat rows (quant_bytes.flat_rows) vs tiled by their 3 channels;
* row sums of long rows (a linear layer at batch 8) with whole rows a program vs 32 x 32 tiles;
* a max-pooled float output pooled in its own dtype (pack.pool_cast) vs torch's float32 max-pool + cast;
* the bit-serial GEMM's packed output in compact rows vs rows padded to 512 bits;
* the bit-serial GEMM's float16 epilogue with the residual and the dual planes output vs quantize_pack of the output.

Usage (GPU machine, repo root): PYTHONPATH=src python3 benchmarks/bench_net_passes_device.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from tcprec.bench.common import environment
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.cuda import loader
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.kernels.triton import im2col_bits as ib
from tcprec.kernels.triton import pack as tpack
from tcprec.kernels.triton import quant_bytes as qb

DEV = "cuda"


def graph_us(f, rounds: int = 5, per: int = 10) -> float:
    """Best-of-``rounds`` time of one call, from a CUDA graph of ``per`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per):
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    best = float("inf")
    for _ in range(rounds):
        e0.record()
        for _ in range(5):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / (5 * per))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/net_passes.json")
    args = ap.parse_args()
    rows = []

    def row(name, shape, a_name, a_us, b_name, b_us, equal):
        rows.append({"pass": name, "shape": shape, a_name: round(a_us, 2), b_name: round(b_us, 2),
                     "ratio": round(a_us / b_us, 2), "outputs_equal": bool(equal)})
        print(f"{name:34s} {shape:28s} {a_name} {a_us:8.1f} us  {b_name} {b_us:8.1f} us  equal {equal}", flush=True)

    sc = torch.tensor([0.03], device=DEV)
    for B in (8, 256):  # the networks' 3-channel input, fp16 NHWC -> int8 codes
        x = torch.randn(B, 3, 224, 224, device=DEV).half().contiguous(memory_format=torch.channels_last)
        x = x.permute(0, 2, 3, 1)
        f = lambda: qb.pool_quantize_int8(x, sc, 0, 8, -128, 127, 0, 0, 1)  # noqa: E731
        new, t_new = f(), graph_us(f)
        keep, qb.FLAT_BELOW_C = qb.FLAT_BELOW_C, 1  # tiled by the channels, as before
        old, t_old = f(), graph_us(f)
        qb.FLAT_BELOW_C = keep
        row("thin input -> int8 codes", f"{B}x224x224x3 fp16", "tiled_by_channels_us", t_old, "flat_rows_us", t_new,
            torch.equal(old, new))
    for M, Kw in ((8, 784), (8, 392), (256, 784)):  # a linear layer's row sums (pm1 weights)
        planes = torch.randint(-2**31, 2**31 - 1, (2, M, Kw), dtype=torch.int32, device=DEV)
        g = ConvGeometry(M, 1, 1, Kw * 32, 16, 1, 1, (1, 1), (0, 0), (1, 1))
        f = lambda: ib.im2col_bits(planes, g, store=False, rowsum=True, row_mul=3, row_add=5)  # noqa: E731
        new, t_new = f()[1], graph_us(f)
        keep, ib.ROWSUM_BLOCK_W = ib.ROWSUM_BLOCK_W, 32
        fo = lambda: ib.im2col_bits(planes, g, store=False, rowsum=True, row_mul=3, row_add=5, block_m=32)  # noqa: E731
        old, t_old = fo()[1], graph_us(fo)
        ib.ROWSUM_BLOCK_W = keep
        row("row sums of long rows", f"{M} rows x {Kw} words x 2", "tiles_32x32_us", t_old, "whole_rows_us", t_new,
            torch.equal(old, new))
    for B, HW, C in ((8, 14, 512), (8, 13, 256), (256, 14, 512)):  # the last conv's 2x2 max-pool before the classifier
        y32 = torch.randn(B, HW, HW, C, device=DEV)
        y16 = y32.half()
        fo = lambda: rq.pool_nhwc(y32, ("max", 2, 2)).half()  # noqa: E731
        fn = lambda: tpack.pool_cast(y16, 2)  # noqa: E731
        row("max-pool of a float output", f"{B}x{HW}x{HW}x{C}", "torch_fp32_pool_cast_us", graph_us(fo),
            "pool_cast_fp16_us", graph_us(fn), torch.equal(rq.pool_nhwc(y16.float(), ("max", 2, 2)).half(), fn()))
    gemm = loader.gemm_entry()
    for M, N, Kw, what in ((802816, 64, 32, "ResNet-18 stage 0, batch 256"), (25088, 64, 32, "stage 0, batch 8"),
                           (200704, 128, 48, "stage 1, batch 256")):
        gen = torch.Generator(DEV).manual_seed(M)
        a = torch.randint(-2**31, 2**31 - 1, (2, M, Kw), dtype=torch.int32, device=DEV, generator=gen)
        w = torch.randint(-2**31, 2**31 - 1, (1, N, Kw), dtype=torch.int32, device=DEV, generator=gen)
        col = (torch.rand(N, device=DEV, generator=gen) + 0.5) * 0.01
        bias = torch.randn(N, device=DEV, generator=gen)
        rt = torch.randint(-100, 100, (M,), dtype=torch.int32, device=DEV, generator=gen)
        osc = torch.tensor([0.7], device=DEV)
        res = torch.randn(M, N, device=DEV, generator=gen).half()

        def call(kind, **extra):
            return gemm(a, w, False, False, 2, rt, None, None, col, bias, True, kind, 2, "unsigned",
                        osc if kind == "packed" or "dual_out" in extra else None, "", 0.0, **extra)

        pad = call("packed")
        comp = call("packed", out_compact=True)
        row("packed output rows", f"{M}x{N}x{Kw * 32}b ({what})", "padded_us", graph_us(lambda: call("packed")),
            "compact_us", graph_us(lambda: call("packed", out_compact=True)),
            torch.equal(pad[:, :, :comp.shape[2]], comp))
        d = torch.empty((2, M, -(-N // 32)), dtype=torch.int32, device=DEV)
        y = call("float16", residual=res, dual_out=d)
        t_res = graph_us(lambda: call("float16", residual=res))
        t_dual = graph_us(lambda: call("float16", residual=res, dual_out=d))
        t_pack = graph_us(lambda: tpack.quantize_pack(y, osc, 2, 0, 3, 0, 0, compact=True))
        q = tpack.quantize_pack(y, osc, 2, 0, 3, 0, 0, compact=True)
        row("fp16 + residual, then quantize_pack", f"{M}x{N}x{Kw * 32}b ({what})", "separate_pass_us", t_res + t_pack,
            "dual_epilogue_us", t_dual, torch.equal(q, d))
        rows[-1].update(gemm_residual_us=round(t_res, 2), quantize_pack_us=round(t_pack, 2))
    json.dump({"command": "PYTHONPATH=src python3 benchmarks/bench_net_passes_device.py", "device":
               torch.cuda.get_device_name(), "environment": environment(), "rows": rows}, open(args.out, "w"), indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
