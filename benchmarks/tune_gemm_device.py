"""One GPU session for the bit-serial GEMM: quick exactness check, a tile sweep at 8192^3 w1a2,
then ``tcprec bench gemm`` (APNN-TC table + large shapes, torch fp16 / int8 / fp8 in the same run),
a compact table printed last.  Designed to finish in < 8 minutes on an H100 / H200.

    PYTHONPATH=src python3 benchmarks/tune_gemm_device.py [--quick] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from tcprec.bench import gemm as bg
from tcprec.bench.common import environment, time_median_ms, write_json
from tcprec.kernels.cuda import bmma_gemm
from tcprec.kernels.cuda.runtime import arch_of
from tcprec.ops.matmul import _planes, matmul

# the first tile of each list is the exactness reference of the others (int32 outputs compared): mma.sync, the
# cp.async wgmma tile the TMA kernel replaced, then the TMA tiles (the default first) and their options
TUNE_TILES = ("64x128_w2x2_s3_k1024", "128x256_w8x2_s3_k1024_wg_f", "128x128_w8x1_s4_k1024_wg_tma",
              "128x64_w8x1_s5_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg_f_tma", "128x128_w8x1_s4_k1024_wg_tma_c2x1",
              "128x128_w8x1_s4_k1024_wg_tma_c1x2")
TUNE_TILES_W2A2 = ("64x64_w2x2_s3_k1024", "192x64_w12x1_s3_k1024_wg", "128x64_w8x1_s4_k1024_wg_tma",
                   "128x64_w8x1_s4_k1024_wg_tma_c2x1")
SMALL_TILES = ("32x32_w2x2_s2_k1024", "32x32_w2x2_s4", "16x16_w1x1_s2_k1024")


def check_exact(console) -> bool:
    gen = torch.Generator("cuda").manual_seed(0)
    ok = True
    for cfg in ("w1a1", "w1a2", "w2a2", "w1a4", "w3a3"):
        a_fmt, w_fmt = bg.parse_config(cfg)
        for M, N, K in ((64, 1024, 1024), (129, 255, 1000), (1024, 2048, 4096)):
            qa = bg._random_qtensor((M, K), a_fmt, "cuda", gen)
            qw = bg._random_qtensor((N, K), w_fmt, "cuda", gen)
            import tcprec as tp

            want = (tp.decode(qa.codes, a_fmt).double() @ tp.decode(qw.codes, w_fmt).double().t()).long()
            got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial").long()
            same = torch.equal(got, want)
            ok &= same
            if not same:
                console.print(f"[red]{cfg} {M}x{N}x{K}: NOT exact ({int((got != want).sum())} wrong)")
    # the wgmma tiles, forced, on shapes partial in M, N and K, every encoding mix
    import tcprec as tp
    from tcprec.formats import IntFormat

    n_wg = 0
    for (p, q), ea, ew in [((2, 1), "unsigned", "pm1"), ((2, 1), "twos", "pm1"), ((1, 1), "pm1", "pm1"),
                           ((2, 2), "unsigned", "twos"), ((2, 2), "twos", "twos"), ((1, 4), "unsigned", "twos"),
                           ((3, 2), "pm1", "unsigned"), ((2, 3), "twos", "unsigned")]:
        fa, fw = IntFormat(p, encoding=ea), IntFormat(q, encoding=ew)
        wt = bmma_gemm.wgmma_tile(p, q, ea == "twos", ew == "twos")
        if wt is None:
            continue
        for M, N, K in ((300, 1000, 600), (129, 255, 4096), (1, 8, 1), (64, 1024, 1000)):
            qa = bg._random_qtensor((M, K), fa, "cuda", gen)
            qw = bg._random_qtensor((N, K), fw, "cuda", gen)
            want = (tp.decode(qa.codes, fa).double() @ tp.decode(qw.codes, fw).double().t()).long()
            got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial", tile=str(wt)).long()
            same = torch.equal(got, want)
            ok &= same
            n_wg += 1
            if not same:
                console.print(f"[red]wgmma {wt} a{p}{ea} w{q}{ew} {M}x{N}x{K}: NOT exact "
                              f"({int((got != want).sum())} wrong)")
    console.print(f"exactness check (+{n_wg} wgmma cases): {'[green]all exact' if ok else '[red]FAILED'}")
    return ok


def tune(console, shape=(8192, 8192, 8192), config: str = "w1a2", tiles=TUNE_TILES) -> list[dict]:
    """Time the kernel (pre-packed planes, fp16 out) for each tile: do_bench median and graph replay."""
    M, N, K = shape
    a_fmt, w_fmt = bg.parse_config(config)
    at, wt = a_fmt.encoding == "twos", w_fmt.encoding == "twos"
    arch = arch_of(torch.cuda.get_device_capability())
    variants, names = [], []
    for t in tiles:
        try:
            variants.append(bmma_gemm.Variant(a_fmt.bits, w_fmt.bits, at, wt, bmma_gemm.parse_tile(t), "float", "float16"))
            names.append(t)
        except ValueError as e:
            console.print(f"[yellow]skip tile {t}: {e}")
    bmma_gemm.precompile(variants, arch)
    gen = torch.Generator("cuda").manual_seed(1)
    qa = bg._random_qtensor((M, K), a_fmt, "cuda", gen)
    qw = bg._random_qtensor((N, K), w_fmt, "cuda", gen)
    ap, wp = _planes(qa, M, K), _planes(qw, N, K)
    from tcprec.ops.matmul import _terms32

    ss, rt, ct = _terms32(ap, wp, K, a_fmt, w_fmt)
    x16, y16 = torch.randn(M, K, device="cuda", dtype=torch.float16), torch.randn(N, K, device="cuda", dtype=torch.float16)
    fp16_ms = time_median_ms(lambda x: torch.matmul(x, y16.t()), [x16])
    fp16_graph = bg.time_graph_ms(lambda: torch.matmul(x16, y16.t()))
    want = (torch.ops.tcprec.bmma_gemm(ap, wp, at, wt, ss, rt, ct, None, None, None, False, "int32", 1, "unsigned",
                                       None, names[0]))
    rows = []
    for t, v in zip(names, variants):
        _, log = bmma_gemm.compile_variant(v, arch)
        regs = next((ln.split("Used")[1].split(",")[0].strip() for ln in log.splitlines() if "Used" in ln), "?")
        spill = next((ln.split(",")[1].strip() for ln in log.splitlines() if "spill stores" in ln), "?")
        fn = lambda x, t=t: torch.ops.tcprec.bmma_gemm(x, wp, at, wt, ss, rt, ct, None, None, None,  # noqa: E731
                                                       False, "float16", 1, "unsigned", None, t)
        try:
            exact = torch.equal(torch.ops.tcprec.bmma_gemm(ap, wp, at, wt, ss, rt, ct, None, None, None, False,
                                                           "int32", 1, "unsigned", None, t), want)
            ms = time_median_ms(fn, [ap])
            gms = bg.time_graph_ms(lambda: fn(ap))
            err = None
        except Exception as e:
            ms, gms, exact, err = None, None, None, f"{type(e).__name__}: {e}"[:200]
        best = gms if gms is not None else ms
        tops = None if best is None else 2 * M * N * K / (best * 1e-3) / 1e12
        row = {"tile": t, "shape": [M, N, K], "config": config, "ms": ms, "graph_ms": gms, "tops": tops,
               "regs": regs, "spill": spill, "exact": exact, "error": err,
               "binary_fraction": None if tops is None else a_fmt.bits * w_fmt.bits * tops / (
                   bg.WGMMA_BINARY_PEAK_TOPS if v.tile.mma == "wgmma" else bg.BINARY_PEAK_TOPS),
               "speedup_vs_fp16_graph": None if gms is None else fp16_graph / gms}
        rows.append(row)
        console.print(f"{config} {M}x{N}x{K} tile {t:22s} regs {regs:>4s} {spill:22s} exact {exact} "
                      + (f"[red]{err}" if err else f"{ms * 1e3:8.1f} us (graph {gms * 1e3:8.1f}) {tops:7.0f} TOPS "
                         f"{100 * row['binary_fraction']:5.1f}% of its b1 peak {row['speedup_vs_fp16_graph']:5.2f}x fp16"))
    console.print(f"torch fp16 {M}x{N}x{K}: {fp16_ms * 1e3:.1f} us, graph {fp16_graph * 1e3:.1f} us "
                  f"({2 * M * N * K / (fp16_graph * 1e-3) / 1e12:.0f} TFLOP/s)")
    return rows


def timing_check(console, config: str = "w1a2", n: int = 8192) -> list[dict]:
    """The default kernel at n^3 timed as the tile sweep times it (one input buffer, no scales) and
    as ``tcprec bench gemm`` does (scales, inputs rotated beyond L2), in one process, to tell the
    two figures apart."""
    from tcprec.bench.common import rotating_buffers
    from tcprec.ops.matmul import _col_scale, _row_scale, _terms32

    a_fmt, w_fmt = bg.parse_config(config)
    at, wt = a_fmt.encoding == "twos", w_fmt.encoding == "twos"
    gen = torch.Generator("cuda").manual_seed(2)
    qa = bg._random_qtensor((n, n), a_fmt, "cuda", gen)
    qw = bg._random_qtensor((n, n), w_fmt, "cuda", gen)
    ap, wp = _planes(qa, n, n), _planes(qw, n, n)
    ss, rt, ct = _terms32(ap, wp, n, a_fmt, w_fmt)
    rs, cs = _row_scale(qa, n), _col_scale(qw, n)
    l2 = environment()["l2_cache_bytes"]
    rows = []
    for name, scales, rot in (("plain", False, False), ("scales", True, False), ("scales+rotating", True, True)):
        fn = lambda x, s=scales: torch.ops.tcprec.bmma_gemm(  # noqa: E731
            x, wp, at, wt, ss, rt, ct, rs if s else None, cs if s else None, None, False, "float16", 1, "unsigned",
            None, "")
        ins = rotating_buffers(ap, l2) if rot else [ap]
        ms = time_median_ms(fn, ins)
        gms = bg.time_graph_ms(lambda: fn(ap))
        rows.append({"case": name, "config": config, "n": n, "ms": ms, "graph_ms": gms})
        console.print(f"timing check {config} {n}^3 default tile, {name}: {ms * 1e3:.1f} us (graph {gms * 1e3:.1f})")
    return rows


def ncu_one(config: str = "w1a2", n: int = 8192, tile: str = "") -> None:
    """One kernel launch to profile: ncu -k bmma_gemm -c 1 python3 benchmarks/tune_gemm_device.py --ncu-one"""
    a_fmt, w_fmt = bg.parse_config(config)
    gen = torch.Generator("cuda").manual_seed(1)
    qa = bg._random_qtensor((n, n), a_fmt, "cuda", gen)
    qw = bg._random_qtensor((n, n), w_fmt, "cuda", gen)
    matmul(qa, qw, out_dtype=torch.float16, backend="bitserial", tile=tile)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes (no 16384, APNN sizes 128/512/1024)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--timing-check", action="store_true", help="time the default kernel as the sweep and the bench do")
    ap.add_argument("--ncu-one", default=None, help="launch one kernel of this tile (or 'auto') and exit")
    args = ap.parse_args()
    if args.ncu_one is not None:
        ncu_one(tile="" if args.ncu_one == "auto" else args.ncu_one)
        return
    console = Console(width=160)
    t0 = time.time()
    out = Path(args.out_dir)
    check_exact(console)
    console.print(f"[{time.time() - t0:.0f}s] tuning")
    tune_rows = []
    if not args.skip_tune:
        tune_rows = (tune(console) + tune(console, (8192, 8192, 8192), "w2a2", TUNE_TILES_W2A2)
                     + tune(console, (64, 1024, 1024), "w1a2", SMALL_TILES))
    if args.timing_check:
        timing_check(console)
    if tune_rows:  # (--skip-tune must not replace the last sweep with an empty file)
        write_json(out / "gemm_tune.json", {"env": environment(), "rows": tune_rows})
    if args.skip_bench:
        return
    console.print(f"[{time.time() - t0:.0f}s] benchmark")
    kw = {}
    if args.quick:
        kw = dict(apnn_sizes=(128, 512, 1024), large_sizes=(4096, 8192))
    payload = bg.run(out=out / "gemm.json", console=console,
                     command=shlex.join(["python3", *sys.argv]), **kw)
    console.print(f"[{time.time() - t0:.0f}s] done")
    # compact table, last
    print("\nconfig    M     N     K     kernel_us graph_us  TOPS     %binpk vs_fp16 vs_int8 vs_fp8")
    for r in payload["rows"]:
        if r["op"] != "tcprec kernel":
            continue
        f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
        print(f"{r['config']:8s} {r['M']:5d} {r['N']:5d} {r['K']:5d} {f(r['ms'] and r['ms'] * 1e3, '9.1f')} "
              f"{f(r['graph_ms'] and r['graph_ms'] * 1e3, '8.1f')} {f(r['tops'], '8.0f')} "
              f"{f(r.get('fraction_of_binary_peak') and 100 * r['fraction_of_binary_peak'], '6.1f')} "
              f"{f(r.get('speedup_vs_fp16'), '7.2f')} {f(r.get('speedup_vs_int8'), '7.2f')} "
              f"{f(r.get('speedup_vs_fp8'), '6.2f')}")
    base = {}
    for r in payload["rows"]:
        if r["op"].startswith("torch") and r["ms"]:
            base.setdefault((r["M"], r["N"], r["K"]), {})[r["op"]] = r["ms"] * 1e3
    print("baselines (us):", json.dumps({f"{k[0]}x{k[1]}x{k[2]}": {n: round(v, 1) for n, v in d.items()}
                                         for k, d in base.items()}))


if __name__ == "__main__":
    main()
