"""Chunk-mode emulated GEMM sweep on one GPU (issue 5): tile configs x chunk sizes x acc formats, torch
bf16 matmul timed in the same run, every config's bits checked equal per (acc, kahan, chunk); cvt.rn
vs Veltkamp rounding on the GPU tests' data.  Kernels are compiled first in 14 parallel processes
(shared TRITON_CACHE_DIR), then timed one by one.

    TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=src python3 benchmarks/tune_emulate_chunk_device.py [--old PATH]

``--old PATH``: a copy of an earlier kernels/triton/emulate_gemm.py (absolute imports), timed on the
same data for a before/after in one run.  Writes $OUT/chunk_sweep.json (or /tmp).
"""
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

old = None
if "--old" in sys.argv:  # an earlier emulate_gemm.py, for the before/after rows
    import importlib.util
    _spec = importlib.util.spec_from_file_location("emulate_gemm_old", sys.argv[sys.argv.index("--old") + 1])
    old = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(old)

import tcprec as tp  # noqa: E402
from tcprec.kernels.triton import emulate_gemm as tk  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
rows = []
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down"]


def bits(t):
    return t.contiguous().view(torch.int32)


def log(r):
    rows.append(r)
    print(json.dumps(r), flush=True)


# ---- 0. compile every kernel below in parallel processes (shared Triton cache), then run from the cache --
CFGS = [  # chunk, bk, bm, bn, warps, stages, maxnreg
    (c, min(c, 64), bm, bn, w, st, None) for c in (32, 64, 128, 256, 4096)
    for bm, bn, w, st in ((64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4),
                          (64, 256, 4, 3), (128, 64, 4, 4))
]
TOP = {(64, 128, 4, 4, None), (128, 256, 8, 3, None), (128, 128, 8, 3, None)}


def timing_jobs():
    for acc in ("e5m10", "e8m7"):
        for kahan in (False, True):
            for hw in (True, False):
                for chunk, bk, bm, bn, nw, ns, mr in CFGS:
                    if (acc == "e8m7" or kahan or not hw) and ((bm, bn, nw, ns, mr) not in TOP or chunk == 4096):
                        continue
                    if kahan and (chunk == 32 or chunk == 4096 or not hw):
                        continue
                    yield acc, kahan, hw, chunk, bk, bm, bn, nw, ns, mr


def diag_jobs():  # cvt vs Veltkamp on the GPU test's data (the test file runs fast vs generic)
    for acc in ("e5m10", "e8m7"):
        for kahan in (False, True):
            for rounding in ("nearest",):
                for chunk in (32, 128):
                    yield acc, kahan, rounding, chunk


def warm(job):
    kind, j = job
    x = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    try:
        if kind == "t":
            acc, kahan, hw, chunk, bk, bm, bn, nw, ns, mr = j
            tk.matmul(x, x, tp.format(acc), "chunk", chunk=chunk, kahan=kahan, block_m=bm, block_n=bn, block_k=bk,
                      num_warps=nw, num_stages=ns, hw_convert=hw, max_registers=mr)
        else:
            acc, kahan, rounding, chunk = j
            for fast in (True, False):
                tk.matmul(x, x, tp.format(acc), "chunk", chunk=chunk, kahan=kahan, rounding=rounding, fast=fast)
            if rounding == "nearest":
                tk.matmul(x, x, tp.format(acc), "chunk", chunk=chunk, kahan=kahan, hw_convert=False)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # recorded by the main run when it hits the same config
        return f"{job}: {e}"[:300]


def main():
    if os.environ.get("WARM", "1") == "1":
        import multiprocessing as mp
        t0 = time.time()
        jobs = [("t", j) for j in timing_jobs()] + [("d", j) for j in diag_jobs()]
        with mp.get_context("spawn").Pool(14) as pool:
            errs = [e for e in pool.map(warm, jobs, chunksize=1) if e]
        print(json.dumps(dict(warm_jobs=len(jobs), warm_s=round(time.time() - t0, 1), errors=errs[:5])), flush=True)
    # ---- 1. diag: fast vs generic (Kahan and not), all modes ------------------------------------------------
    g = torch.Generator(device="cuda").manual_seed(1)
    a = (torch.randn(256, 512, device="cuda", generator=g) * torch.logspace(-6, 0, 512, device="cuda")).bfloat16()
    b = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    for acc, kahan, rounding, chunk in diag_jobs():
        fmt = tp.format(acc)
        t0 = time.time()
        fast = tk.matmul(a, b, fmt, "chunk", chunk=chunk, kahan=kahan, rounding=rounding)
        slow = tk.matmul(a, b, fmt, "chunk", chunk=chunk, kahan=kahan, rounding=rounding, fast=False)
        d = (bits(fast) != bits(slow))
        r = dict(diag="fast_vs_generic", acc=acc, kahan=kahan, rounding=rounding, chunk=chunk, mismatches=int(d.sum()))
        if rounding == "nearest":
            velt = tk.matmul(a, b, fmt, "chunk", chunk=chunk, kahan=kahan, hw_convert=False)
            r["cvt_vs_veltkamp_mismatches"] = int((bits(velt) != bits(fast)).sum())
        if d.any():
            idx = d.nonzero()[:3].tolist()
            r["examples"] = [(i, j, float(fast[i, j]), float(slow[i, j])) for i, j in idx]
        r["s"] = round(time.time() - t0, 1)
        log(r)

    # ---- 2. timing at 4096^3 -------------------------------------------------------------------------------
    n = int(os.environ.get("N", 4096))
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=g)
    b = torch.randn(n, n, device="cuda", generator=g)
    a16, b16 = tp.cast(a, "e4m3").bfloat16(), tp.cast(b, "e4m3").bfloat16()
    flops = 2 * n**3


    def tm(fn):
        return do_bench(fn, return_mode="median", warmup=25, rep=100)


    t_bf16 = tm(lambda: a16 @ b16)
    log(dict(case=f"torch_bf16_{n}", ms=t_bf16, tflops=flops / t_bf16 / 1e9))
    ref = {}
    for acc, kahan, hw, chunk, bk, bm, bn, nw, ns, mr in timing_jobs():
        fmt = tp.format(acc)
        fn = lambda: tk.matmul(a16, b16, fmt, "chunk", chunk=chunk, kahan=kahan, block_m=bm,  # noqa: E731
                               block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, hw_convert=hw, max_registers=mr)
        name = (f"chunk{chunk}_{acc}{'_kahan' if kahan else ''}{'' if hw else '_veltkamp'}_{n}_b{bm}x{bn}x{bk}w{nw}s{ns}"
                + (f"r{mr}" if mr else ""))
        try:
            t0 = time.time()
            out = fn()
            same = bool(torch.equal(bits(out), bits(ref.setdefault((acc, kahan, chunk), out))))
            t = tm(fn)
        except Exception as e:
            log(dict(case=name, error=str(e)[:300]))
            continue
        log(dict(case=name, ms=t, tflops=flops / t / 1e9, ratio_to_bf16=t_bf16 / t, same_bits=same,
                 first_call_s=round(time.time() - t0, 1)))
    for acc in ("e5m10",) if old is not None else ():
        fmt = tp.format(acc)
        # before: the previous kernel (HEAD), same data, same run
        for chunk, bk, bm, bn, nw, ns in ((32, 32, 128, 128, 8, 4), (128, 64, 128, 128, 8, 3), (256, 128, 128, 128, 8, 3)):
            fn = lambda: old.matmul(a16, b16, fmt, "chunk", chunk=chunk, block_m=bm, block_n=bn, block_k=bk,  # noqa
                                    num_warps=nw, num_stages=ns)
            out = fn()
            same = bool(torch.equal(bits(out), bits(ref[(acc, False, chunk)])))
            t = tm(fn)
            log(dict(case=f"before_chunk{chunk}_{acc}_{n}_b{bm}x{bn}x{bk}w{nw}s{ns}", ms=t, tflops=flops / t / 1e9,
                     ratio_to_bf16=t_bf16 / t, same_bits_as_new=same))

    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.path.join(OUT, "chunk_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
