"""Emulated GEMM and APS all-reduce throughput on the GPU, against torch in the same run.

    python benchmarks/bench_emulate_device.py                       # GEMMs (one GPU)
    torchrun --nproc-per-node 2 benchmarks/bench_emulate_device.py --allreduce   # NCCL all-reduce

Targets (issue 5): fma >= 4 TFLOP/s-equivalent at 4096^3; chunk >= 50% of torch bf16 matmul;
APS + compressed all-reduce of 11.7M gradients faster than fp32 NCCL all-reduce (same run; the
prediction from bytes moved is written next to the measurement, with per-stage times).  The NCCL
result is also checked bit-for-bit against one process with world_size emulated nodes.
Writes benchmarks/results/emulate*.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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
    chunk_cfgs = [(32, 32, 128, 128, 8, 4), (32, 32, 128, 256, 8, 3), (64, 64, 128, 128, 8, 3), (64, 64, 128, 256, 8, 3),
                  (128, 64, 128, 128, 8, 3), (128, 64, 128, 256, 8, 3), (256, 64, 128, 128, 8, 3),
                  (256, 64, 128, 256, 8, 3), (256, 128, 128, 128, 8, 3)]
    for acc in ("e5m10", "e8m7"):
        fmt = tp.format(acc)
        for kahan in (False, True):
            for chunk, bk, bm, bn, nw, ns in chunk_cfgs:
                if (kahan or acc != "e5m10") and (bn != 256 or chunk == 32 and kahan):
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


def _allreduce_prediction(numel: int, world: int, n_local: int = 1, t_nccl_before_ms: float = 0.186,
                          hbm_bytes_per_s: float = 4.3e12, latency_s: float = 15e-6) -> dict:
    """Bytes each rank moves and the time they predict, written before the measurement.  The link
    rate is what fp32 NCCL reached in the previous run (BENCHMARKS.md: 0.186 ms for 11.7M values);
    HBM at the measured copy rate (DESIGN.md: ~4.3 TB/s); ~15 us per collective call.  Two GPUs with
    one node each take the all-gather exchange (distributed/lowp.py): one all_gather of every
    node's codes, then one kernel sums them in node order and writes the mean."""
    ring_fp32 = 2 * (world - 1) / world * 4 * numel  # reduce-scatter + all-gather, bytes sent per rank
    link = ring_fp32 / (t_nccl_before_ms * 1e-3)
    pred = dict(nccl_fp32=dict(wire_bytes_per_rank=ring_fp32, link_bytes_per_s=link, ms=t_nccl_before_ms))
    n = world * n_local
    for transport, cb in (("compressed", 1), ("emulate", 4)):  # bytes per value on the wire (e4m3 code / fp32)
        wire = (world - 1) * n_local * numel * cb  # all_gather of every node's row
        hbm = (4 * numel * n_local  # amax: read the gradients
               + 4 * numel * n_local + cb * numel * n_local  # encode: read again, write the codes
               + n * numel * cb + 4 * numel)  # reduce_finish: every node's row in, fp32 mean out
        t = wire / link + hbm / hbm_bytes_per_s + 2 * latency_s
        pred[f"aps_e4m3_{transport}"] = dict(wire_bytes_per_rank=wire, hbm_bytes_per_rank=hbm, kernel_passes=4,
                                             collectives=2, ms=t * 1e3,
                                             speedup_vs_nccl_fp32=t_nccl_before_ms / (t * 1e3))
    return pred


def _time_dist(fn, reps: int = 40, warmup: int = 5, head_start: bool = False) -> float:
    """Median ms of ``fn`` (CUDA events), the same number of calls on every rank (do_bench sizes its
    loop per process, which can pair different collectives across ranks and hang); L2 flushed
    before each call, as do_bench does; the slowest rank's median.  ``head_start``: a ~1 ms GPU
    sleep before each call, so the host has enqueued the call before the GPU reaches it: GPU time
    alone (what a training step sees when backward keeps the GPU busy while the hook is called)."""
    import statistics

    import torch.distributed as dist

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        flush.zero_()
        if head_start:
            torch.cuda._sleep(2_000_000)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    med = torch.tensor([statistics.median(a.elapsed_time(b) for a, b in ev)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _host_ms(fn, calls: int = 20) -> float:
    """Host time per call when the GPU is not waited for (launch overhead of the Python side)."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return t


def bench_allreduce(numel: int = 11_700_000) -> None:
    """fp32 NCCL all_reduce vs APS + e4m3 all-reduce (fused kernels; compressed and emulate
    transports; the float64 reference path as "before"), per-stage times, and bit-exactness of the
    NCCL result against one process reducing every rank's gradients as emulated nodes."""
    import cProfile
    import pstats

    import torch.distributed as dist

    from tcprec.distributed import allreduce_lowp
    from tcprec.distributed.lowp import _all_gather_single, _wire_shape, _words, aps_top_exponent
    from tcprec.kernels.triton import allreduce as ka
    from tcprec.ops.cast import decode

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [numel // 62] * 61 + [numel - 61 * (numel // 62)]  # ~ResNet-18's 62 tensors
    g = torch.Generator(device="cuda").manual_seed(rank)
    flat = torch.randn(1, numel, device="cuda", generator=g) * 1e-3
    fmt = tp.format("e4m3")
    out = dict(env=env(), world=world, numel=numel, tensors=len(sizes),
               prediction=_allreduce_prediction(numel, world), rows=[],
               timing="ms: back to back (L2 flushed), host launch cost included where the host is slower; "
                      "gpu_ms: the same with a 1 ms GPU head start, so host cost is hidden; slowest rank's median")

    def add(row):
        out["rows"].append(row)
        if rank == 0:
            print(row, flush=True)
            OUT.mkdir(exist_ok=True)
            (OUT / f"emulate_allreduce_{world}gpu.json").write_text(json.dumps(out, indent=2))

    if rank == 0:
        print(json.dumps(out["prediction"], indent=1), flush=True)
    fp32 = flat[0].clone()
    nccl = lambda: dist.all_reduce(fp32)  # noqa: E731
    t_nccl = _time_dist(nccl)
    add(dict(case=f"nccl_fp32_allreduce_{world}gpu", ms=t_nccl, gpu_ms=_time_dist(nccl, head_start=True),
             host_ms=_host_ms(nccl)))
    for transport in ("compressed", "emulate"):
        fn = lambda: allreduce_lowp(flat, sizes, fmt, transport=transport)  # noqa: E731
        t = _time_dist(fn)
        add(dict(case=f"aps_e4m3_{transport}_{world}gpu", ms=t, speedup_vs_nccl_fp32=t_nccl / t, target="> 1",
                 met=t < t_nccl, gpu_ms=_time_dist(fn, head_start=True), host_ms=_host_ms(fn),
                 backend=fn()[1].backend))
    fn = lambda: allreduce_lowp(flat, sizes, fmt)[1].nonfinite_input  # noqa: E731  (one host sync per call)
    t = _time_dist(fn)
    add(dict(case=f"aps_e4m3_compressed_{world}gpu_reading_the_nonfinite_flag", ms=t, speedup_vs_nccl_fp32=t_nccl / t))
    ka.HW_FP8_ROUNDING = False
    fn = lambda: allreduce_lowp(flat, sizes, fmt)  # noqa: E731
    t = _time_dist(fn)
    generic = fn()[0]
    add(dict(case=f"aps_e4m3_compressed_{world}gpu_generic_rounding_no_fp8_cvt", ms=t, speedup_vs_nccl_fp32=t_nccl / t,
             gpu_ms=_time_dist(fn, head_start=True)))
    ka.HW_FP8_ROUNDING = True
    t = _time_dist(lambda: allreduce_lowp(flat, sizes, fmt, backend="reference"), reps=3, warmup=1)
    add(dict(case=f"before_reference_path_aps_e4m3_compressed_{world}gpu", ms=t, speedup_vs_nccl_fp32=t_nccl / t))

    # ---- host profile of the compressed call (rank 0 prints it) -------------------------------------
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        allreduce_lowp(flat, sizes, fmt)
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    # ---- per stage of the compressed call (same buffers; kernels alone, collectives alone) -----------
    n, T, top = world, len(sizes), aps_top_exponent(fmt)
    row = _wire_shape(numel, 1)
    starts = torch.tensor([0] + list(itertools.accumulate(sizes))[:-1], dtype=torch.int64, device="cuda")
    lut = decode(torch.arange(fmt.n_codes), fmt).cuda()
    flags = torch.zeros(T + 1, dtype=torch.int32, device="cuda")
    msg = torch.empty(T + 1, dtype=torch.int64, device="cuda")
    send = torch.empty(1, 1, row, dtype=torch.uint8, device="cuda")
    everyone, res = torch.empty(world * row, dtype=torch.uint8, device="cuda"), torch.empty(numel, device="cuda")
    ka.amax_exponents(flat, starts, n, flags, msg)
    stages = [("kernels_amax_exponents", lambda: (flags.zero_(), ka.amax_exponents(flat, starts, n, flags, msg))),
              ("nccl_all_reduce_exponents", lambda: dist.all_reduce(msg, op=dist.ReduceOp.MAX)),
              ("kernel_encode", lambda: ka.encode(flat, starts, msg, send, fmt, "nearest", True, top)),
              ("nccl_all_gather_codes", lambda: _all_gather_single(_words(everyone), _words(send))),
              ("kernel_reduce_finish", lambda: ka.reduce_finish(everyone.view(n, row), res, lut, starts, msg,
                                                                flags[T:], fmt, "nearest", False, True, top))]
    for name, fn in stages:
        add(dict(case=f"stage_{name}", ms=_time_dist(fn), gpu_ms=_time_dist(fn, head_start=True)))

    # ---- bits: NCCL == one process reducing every rank's gradients as emulated nodes ------------------
    got = {tr: allreduce_lowp(flat, sizes, fmt, transport=tr)[0] for tr in ("compressed", "emulate")}
    got["generic_rounding"] = generic
    nodes = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(nodes, flat)
    solo = dist.new_group([0])  # a group of one: allreduce_lowp runs without collectives
    if rank == 0:
        nodes = torch.cat(nodes)  # (world, numel): node order = rank order
        want, _ = allreduce_lowp(nodes, sizes, fmt, transport="emulate", backend="reference", group=solo)
        fused_nodes, _ = allreduce_lowp(nodes, sizes, fmt, transport="compressed", group=solo)
        same = lambda a: bool(torch.equal(a.view(torch.int32), want.view(torch.int32)))  # noqa: E731
        add(dict(case="nccl_equals_emulated_nodes", equal=same(got["compressed"]) and same(got["emulate"]),
                 nccl_compressed_fused=same(got["compressed"]), nccl_emulate_fused=same(got["emulate"]),
                 nccl_compressed_generic_rounding=same(got["generic_rounding"]), one_process_fused=same(fused_nodes),
                 against="float64 reference path, one process, world nodes"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--allreduce", action="store_true")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.allreduce:
        return bench_allreduce()
    print(env())
    rows = bench_gemm(args.n, args.quick)
    for r in rows:
        print(r)
    OUT.mkdir(exist_ok=True)
    (OUT / "emulate_gemm.json").write_text(json.dumps(dict(env=env(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
