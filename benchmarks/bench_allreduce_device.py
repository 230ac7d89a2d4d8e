"""APS low-precision gradient all-reduce against fp32 NCCL all-reduce, on 2 or more GPUs, same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \
        torchrun --nproc-per-node 2 benchmarks/bench_allreduce_device.py

Target (issue 5): APS + compressed all-reduce of ResNet-18-sized gradients (11.7M values) faster than
plain fp32 NCCL all-reduce of the same gradients.  Written before the measurement: the prediction
from the bytes moved.  Measured: GPU time alone (what a DDP hook overlapping backward sees), calls
back to back (host cost included), the host cost per call, per-stage times, a block-size sweep of
the kernels, and the bits: the NCCL result equals one process reducing every rank's gradients as
emulated nodes through the float64 reference.  Writes benchmarks/results/emulate_allreduce_<N>gpu.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton

import tcprec as tp

OUT = Path(__file__).parent / "results"


def env() -> dict:
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001  (recorded, not fatal)
        nccl = f"unknown ({type(e).__name__})"
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                driver=torch.version.cuda, nccl=nccl, host=platform.node())


def _allreduce_prediction(numel: int, world: int, n_local: int = 1, t_nccl_before_ms: float = 0.189,
                          hbm_bytes_per_s: float = 4.3e12, latency_s: float = 15e-6) -> dict:
    """Bytes each rank moves and the time they predict, written before the measurement.  The link
    rate is what fp32 NCCL reached in the previous run (BENCHMARKS.md: 0.189 ms GPU time for 11.7M
    values); HBM at the measured copy rate (DESIGN.md: ~4.3 TB/s); ~15 us per collective call.  Two
    GPUs with one node each take the all-gather exchange (distributed/lowp.py): one all_gather of
    every node's codes, then one kernel sums them in node order and writes the mean."""
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
        pred[f"aps_e4m3_{transport}"] = dict(wire_bytes_per_rank=wire, hbm_bytes_per_rank=hbm, kernel_passes=3,
                                             collectives=2, ms=t * 1e3,
                                             speedup_vs_nccl_fp32=t_nccl_before_ms / (t * 1e3))
    return pred


def _time_dist(fn, reps: int = 40, warmup: int = 5, head_start: bool = False) -> float:
    """Median ms of ``fn`` (CUDA events), the same number of calls on every rank (do_bench sizes its
    loop per process, which can pair different collectives across ranks and hang); L2 flushed
    before each call, as do_bench does; the slowest rank's median.  ``head_start``: a ~1 ms GPU
    sleep before each call, so the host has enqueued the call before the GPU reaches it: GPU time
    alone (what a training step sees when backward keeps the GPU busy while the hook is called).
    Without it the flush (~0.1 ms of GPU time) still hides that much of the host's cost."""
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


def _loop_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    """Calls truly back to back (no flush, no sleep between them): events around ``calls`` calls,
    per call, median over ``rounds``, slowest rank.  Where the host is slower than the GPU, this is
    the host's time per call."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    per = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        per.append(a.elapsed_time(b) / calls)
    med = torch.tensor([statistics.median(per)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _host_ms(fn, calls: int = 20) -> float:
    """Host time per call when the GPU is not waited for (launch overhead of the Python side)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return t


def _kernel_ms(fn, reps: int = 30) -> float:
    """Median ms of a local kernel call (no collective), L2 flushed before each; this rank only."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        flush.zero_()
        torch.cuda._sleep(1_000_000)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def bench_allreduce(numel: int = 11_700_000) -> None:
    """fp32 NCCL all_reduce vs APS + e4m3 all-reduce (fused kernels, eager and CUDA-graph replay;
    compressed and emulate transports; the float64 reference path as "before"), per-stage times,
    and bit-exactness of the NCCL result against one process reducing every rank's gradients as
    emulated nodes."""
    import cProfile
    import pstats

    from tcprec.distributed import allreduce_lowp
    from tcprec.distributed.lowp import _all_gather_single, _wire_shape, _words, aps_top_exponent, release_graphs
    from tcprec.kernels.triton import allreduce as ka
    from tcprec.ops.cast import decode

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [numel // 62] * 61 + [numel - 61 * (numel // 62)]  # ~ResNet-18's 62 tensors
    g = torch.Generator(device="cuda").manual_seed(rank)
    flat = torch.randn(1, numel, device="cuda", generator=g) * 1e-3
    fmt = tp.format("e4m3")
    out = dict(env=env(), world=world, numel=numel, tensors=len(sizes), block=ka.BLOCK, num_warps=ka.NUM_WARPS,
               prediction=_allreduce_prediction(numel, world), rows=[],
               timing="gpu_ms: a 1 ms GPU head start before each call, so host cost is hidden (GPU time alone); "
                      "ms: L2 flushed before each call (the ~0.1 ms flush hides that much host time); "
                      "loop_ms: 20 calls back to back, per call (host cost where the host is slower); "
                      "host_ms: host time per call; medians, slowest rank")

    def add(row):
        out["rows"].append(row)
        if rank == 0:
            print(row, flush=True)
            OUT.mkdir(exist_ok=True)
            (OUT / f"emulate_allreduce_{world}gpu.json").write_text(json.dumps(out, indent=2))

    def timed(case, fn, **extra):
        row = dict(case=case, gpu_ms=_time_dist(fn, head_start=True), ms=_time_dist(fn), loop_ms=_loop_ms(fn),
                   host_ms=_host_ms(fn), **extra)
        if t_nccl is not None:
            row.update(speedup_gpu=t_nccl["gpu_ms"] / row["gpu_ms"], speedup_loop=t_nccl["loop_ms"] / row["loop_ms"])
        add(row)
        return row

    if rank == 0:
        print(json.dumps(out["env"]), json.dumps(out["prediction"], indent=1), flush=True)
    fp32 = flat[0].clone()
    t_nccl = None
    t_nccl = timed(f"nccl_fp32_allreduce_{world}gpu", lambda: dist.all_reduce(fp32))
    for transport in ("compressed", "emulate"):
        fn = lambda: allreduce_lowp(flat, sizes, fmt, transport=transport)  # noqa: E731
        timed(f"aps_e4m3_{transport}_{world}gpu", fn, backend=fn()[1].backend, target="gpu_ms below fp32 NCCL's")
    fn = lambda: allreduce_lowp(flat, sizes, fmt, graph=True)  # noqa: E731
    timed(f"aps_e4m3_compressed_{world}gpu_cuda_graph", fn, backend=fn()[1].backend)
    fn = lambda: allreduce_lowp(flat, sizes, fmt)[1].nonfinite_input  # noqa: E731  (one host sync per call)
    add(dict(case=f"aps_e4m3_compressed_{world}gpu_reading_the_nonfinite_flag", ms=_time_dist(fn),
             loop_ms=_loop_ms(fn)))
    t = _time_dist(lambda: allreduce_lowp(flat, sizes, fmt, backend="reference"), reps=3, warmup=1)
    add(dict(case=f"before_reference_path_aps_e4m3_compressed_{world}gpu", ms=t))

    # ---- host profile of the eager compressed call (rank 0 prints it) -------------------------------
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        allreduce_lowp(flat, sizes, fmt)
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(10)

    # ---- per stage of the compressed call (kernels alone, collectives alone) -------------------------
    n, T, top = world, len(sizes), aps_top_exponent(fmt)
    row = _wire_shape(numel, 1)
    lut = decode(torch.arange(fmt.n_codes), fmt).cuda()
    everyone, res = torch.empty(world * row, dtype=torch.uint8, device="cuda"), torch.empty(numel, device="cuda")
    send = torch.empty(1, 1, row, dtype=torch.uint8, device="cuda")
    state = ka.state_buffer(T, "cuda")
    default = (ka.BLOCK, ka.NUM_WARPS)
    for block, warps in dict.fromkeys([default, (1024, 4), (2048, 4), (2048, 8), (4096, 8)]):
        ka.NUM_WARPS = warps
        lay = ka.layout(sizes, numel, 1, row, torch.device("cuda"), block=block)
        ka.amax(flat, lay, state)
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        stages = dict(
            kernels_zero_fill_amax=lambda: (state.zero_(), ka.amax(flat, lay, state)),
            kernel_encode=lambda: ka.encode(flat, lay, state, send, fmt, "nearest", True, top, n),
            kernel_reduce_finish=lambda: ka.reduce_finish(everyone.view(n, row), res, lut, lay, state, fmt, "nearest",
                                                          False, True, top))
        try:
            got = {k: _kernel_ms(f) for k, f in stages.items()}
        except Exception as e:  # noqa: BLE001  (e.g. out of registers for a block size: recorded, not hidden)
            got = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        ms = torch.tensor([got.get(k, 0.0) for k in stages], device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        add(dict(case=f"stage_kernels_block{block}_warps{warps}", default=(block, warps) == default,
                 **({k: float(v) for k, v in zip(stages, ms)} if "error" not in got else got)))
    ka.NUM_WARPS = default[1]
    ka.amax(flat, ka.layout(sizes, numel, 1, row, torch.device("cuda")), state.zero_())
    for name, fn in (("nccl_all_reduce_state", lambda: dist.all_reduce(state, op=dist.ReduceOp.MAX)),
                     ("nccl_all_gather_codes", lambda: _all_gather_single(_words(everyone), _words(send)))):
        add(dict(case=f"stage_{name}", gpu_ms=_time_dist(fn, head_start=True)))

    # ---- bits: NCCL == one process reducing every rank's gradients as emulated nodes ------------------
    got = {tr: allreduce_lowp(flat, sizes, fmt, transport=tr)[0] for tr in ("compressed", "emulate")}
    got["cuda_graph"] = allreduce_lowp(flat, sizes, fmt, graph=True)[0].clone()
    nodes = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(nodes, flat)
    solo = dist.new_group([0])  # a group of one: allreduce_lowp runs without collectives
    if rank == 0:
        nodes = torch.cat(nodes)  # (world, numel): node order = rank order
        want, _ = allreduce_lowp(nodes, sizes, fmt, transport="emulate", backend="reference", group=solo)
        fused_nodes, _ = allreduce_lowp(nodes, sizes, fmt, transport="compressed", group=solo)
        same = lambda a: bool(torch.equal(a.view(torch.int32), want.view(torch.int32)))  # noqa: E731
        add(dict(case="nccl_equals_emulated_nodes", equal=all(same(v) for v in got.values()),
                 **{f"nccl_{k}": same(v) for k, v in got.items()}, one_process_fused=same(fused_nodes),
                 against="float64 reference path, one process, world nodes"))
    release_graphs()  # the captured graphs hold NCCL kernels: free them before the communicator
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    bench_allreduce()
