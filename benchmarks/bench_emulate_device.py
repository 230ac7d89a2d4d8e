"""Emulated GEMM throughput on the GPU, against torch in the same run.

    python benchmarks/bench_emulate_device.py                       # GEMMs (one GPU)

Targets (issue 5): fma >= 4 TFLOP/s-equivalent at 4096^3; chunk >= 50% of torch bf16 matmul.
(The APS all-reduce benchmark is benchmarks/bench_allreduce_device.py.)
Writes benchmarks/results/emulate*.json.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import tcprec as tp
from tcprec.kernels.triton import emulate_gemm as tk

OUT = Path(__file__).parent / "results"


def env() -> dict:
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                driver=torch.version.cuda, host=platform.node())


def _time(fn, slow=False):
    if slow:  # one warm-up call (compiles), then the median of a few
        return do_bench(fn, return_mode="median", warmup=1, rep=1)
    return do_bench(fn, return_mode="median", warmup=25, rep=100)


def bench_gemm(n: int, quick: bool) -> list[dict]:
    """fma: e4m3 operands (products exact and on the acc grid), fast path vs the generic loop;
    chunk: bf16 tensor cores for chunk = 32..256 against torch bf16, all timed in this run."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=g)
    b = torch.randn(n, n, device="cuda", generator=g)
    a8, b8 = tp.cast(a, "e4m3"), tp.cast(b, "e4m3")
    flops = 2 * n**3
    ab, bb = a.bfloat16(), b.bfloat16()
    t_bf16 = _time(lambda: ab @ bb)
    rows.append(dict(case=f"torch_bf16_{n}", ms=t_bf16, tflops=flops / t_bf16 / 1e9))
    print(rows[-1], flush=True)
    fma_cfgs = ((128, 64, 4), (128, 128, 4)) if not quick else ((128, 64, 4),)  # w8 and 64x128 were slower (H200)
    for acc in ("e5m10", "e8m7"):
        fmt = tp.format(acc)
        plain = None  # the non-Kahan result, for the generic-loop comparison below
        for kahan in (False, True):
            ref = None
            for bm, bn, nw in fma_cfgs:
                fn = lambda: tk.matmul(a8, b8, fmt, "fma", kahan=kahan, exact_product=True,  # noqa: E731
                                       product_on_acc_grid=True, block_m=bm, block_n=bn, num_warps=nw)
                out = fn()
                ref = out if ref is None else ref
                plain = out if (plain is None and not kahan) else plain
                t = _time(fn, slow=True)
                rows.append(dict(case=f"fma_{acc}{'_kahan' if kahan else ''}_{n}_b{bm}x{bn}w{nw}", ms=t,
                                 tflops=flops / t / 1e9, target_tflops=4.0, same_bits_as_first=bool(torch.equal(out, ref))))
                print(rows[-1], flush=True)
        if acc == "e5m10":  # before/after in the same run: the generic loop, and fp32 operands
            fn = lambda: tk.matmul(a8, b8, fmt, "fma", exact_product=True, block_m=64, block_n=64, fast=False)  # noqa
            slow = fn()
            t = _time(fn, slow=True)
            rows.append(dict(case=f"fma_{acc}_{n}_generic_loop_b64x64w4", ms=t, tflops=flops / t / 1e9,
                             same_bits_as_fast=bool(torch.equal(slow, plain))))
            print(rows[-1], flush=True)
            fn = lambda: tk.matmul(a, b, fmt, "fma", block_m=128, block_n=64, num_warps=4)  # noqa: E731
            t = _time(fn, slow=True)
            rows.append(dict(case=f"fma_{acc}_fp32_operands_{n}_b128x64w4", ms=t, tflops=flops / t / 1e9,
                             target_tflops=4.0))
            print(rows[-1], flush=True)
    a16, b16 = a8.bfloat16(), b8.bfloat16()
    # the tiles the kernel picks by default (full sweep: benchmarks/bench_emulate_chunk_device.py)
    chunk_cfgs = [(32, 32, 64, 128, 4, 4), (64, 64, 64, 128, 4, 4), (128, 64, 64, 128, 4, 4), (128, 64, 128, 256, 8, 3),
                  (256, 64, 64, 128, 4, 4), (256, 64, 128, 256, 8, 3)]
    for acc in ("e5m10", "e8m7"):
        fmt = tp.format(acc)
        for kahan in (False, True):
            for chunk, bk, bm, bn, nw, ns in chunk_cfgs:
                if kahan and (bn == 256 or chunk == 32):  # Kahan keeps s and c: the 128x256 tile spills
                    continue
                fn = lambda: tk.matmul(a16, b16, fmt, "chunk", chunk=chunk, kahan=kahan, block_m=bm,  # noqa: E731
                                       block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                try:
                    out = fn()
                    t = _time(fn)
                except Exception as e:  # e.g. out of shared memory for a config: recorded, not hidden
                    rows.append(dict(case=f"chunk{chunk}_{acc}_cfg{bm}x{bn}x{bk}", error=str(e)[:200]))
                    print(rows[-1], flush=True)
                    continue
                rows.append(dict(case=f"chunk{chunk}_{acc}{'_kahan' if kahan else ''}_{n}_b{bm}x{bn}x{bk}w{nw}s{ns}",
                                 ms=t, tflops=flops / t / 1e9, ratio_to_bf16=t_bf16 / t, target_ratio=0.5))
                print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(env())
    rows = bench_gemm(args.n, args.quick)
    for r in rows:
        print(r)
    OUT.mkdir(exist_ok=True)
    (OUT / "emulate_gemm.json").write_text(json.dumps(dict(env=env(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
