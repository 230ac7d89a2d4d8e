"""Scratch: the warp-specialised INT8 GEMM (kernels/cuda/i8_gemm.cu) on the transformer's four GEMMs against cuBLAS
fp16, torch._int_mm and tcprec's current INT8 path (the Triton implicit kernel, QLinear's GEMM on int8 codes).

M = 64 * 197 = 12608 tokens; (K, N): qkv (768, 2304), out_proj (768, 768), linear1 (768, 3072), linear2 (3072, 768).
Every side in a CUDA graph over rotating inputs (>= 100 MB of A), timed alternately (tcprec.timing.graph_ms_alternating).
Each i8_gemm variant is checked against kernels/reference_i8_gemm.py before it is timed; a failing one is recorded in
"errors" and the run goes on.  Extra rows: linear1 with GELU + int8 codes out, linear2 with the residual added.

Tiles: i8_gemm.TILES (epilogue 0, as first written) and TILES_E1 (epilogue 1: scales staged in shared memory, 16-byte
stores), so old and new race in one run.  For every epilogue-1 tile two diagnostics are timed too ("diag_*" keys, not
checked: their output is garbage): _d1 computes the whole epilogue but stores nothing, _d2 runs the main loop only.
So  full - d1 = the output stores,  d1 - d2 = the epilogue's math and loads,  d2 = main loop + pipeline.  Each
i8_gemm row also gives "us_tile": the time one SM spends a tile (us x SMs / tiles, for >= 1 wave), against
"mma_us_tile" (the tile's MMAs at the int8 dense peak of one SM).

    PYTHONPATH=src python scratch/i8_gemm/bench.py out.json [--tiles coop_128x256_s4,pp_128x128_s6_e1] [--no-diag]
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from tcprec.kernels.cuda import i8_gemm as L  # noqa: E402
from tcprec.kernels.reference_i8_gemm import i8_gemm_acc, i8_gemm_reference  # noqa: E402
from tcprec.timing import graph_ms_alternating  # noqa: E402

PEAK_I8 = 1979e12  # H200 / H100 SXM int8 dense
M = 64 * 197
SHAPES = {"qkv": (768, 2304), "out_proj": (768, 768), "linear1": (768, 3072), "linear2": (3072, 768)}
DEV = "cuda"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiles", default=",".join(str(t) for t in L.TILES + L.TILES_E1))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--no-diag", action="store_true", help="skip the diagnostic variants of the epilogue-1 tiles")
    args = ap.parse_args()
    t0 = time.time()
    tiles = [L.parse_tile(t) for t in args.tiles.split(",")]
    diags = {t: ([] if args.no_diag or not t.epi or t.diag else list(L.diag_tiles(t))) for t in tiles}
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "M": M, "peak_i8_tops": PEAK_I8 / 1e12,
           "sms": n_sm, "tiles": [str(t) for t in tiles], "shapes": {}, "checks": {}, "errors": {}}
    variants = [L.Variant(t, o, g, r) for t in tiles for (o, g, r) in
                (("float16", False, False), ("int8", True, False), ("float16", False, True))]
    variants += [L.Variant(d, "float16", False, r) for t in tiles for d in diags[t] for r in (False, True)]
    try:
        n = L.precompile(variants, "sm_90a", workers=min(16, os.cpu_count() or 1))
    except Exception as e:  # one that does not compile fails again, alone, below, and is recorded there
        res["errors"]["precompile"] = f"{type(e).__name__}: {str(e)[:2000]}"
        n = -1
    res["compile_s"] = round(time.time() - t0, 1)
    print(f"compiled {n} variants in {res['compile_s']} s", flush=True)
    torch.manual_seed(0)
    for name, (K, N) in SHAPES.items():
        rot = max(4, math.ceil(100e6 / (M * K)))
        g = torch.Generator(device=DEV).manual_seed(1)
        a8 = [torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV, generator=g) for _ in range(rot)]
        w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=DEV, generator=g)
        a_s = torch.tensor([0.01], device=DEV)
        w_s = (torch.rand(N, device=DEV, generator=g) + 0.5) * (3.0 / (5476.0 * K**0.5 * 0.01))
        bias = torch.randn(N, device=DEV, generator=g) * 0.5
        out_scale = torch.tensor([0.05], device=DEV)
        resid = (torch.randn(M, N, device=DEV, generator=g) * 2).half()
        x16 = [torch.randn(M, K, device=DEV, dtype=torch.float16, generator=g) for _ in range(min(rot, 4))]
        w16 = (torch.randn(N, K, device=DEV, generator=g) / K**0.5).half()
        b16 = bias.half()
        acc = i8_gemm_acc(a8[0], w8)
        sides = {
            "cublas_fp16_linear_bias": lambda i: F.linear(x16[i % len(x16)], w16, b16),
            "int_mm": lambda i: torch._int_mm(a8[i % rot], w8.t()),
        }
        if name == "linear1":
            sides["cublas_fp16_linear_gelu_fused"] = lambda i: torch._addmm_activation(b16, x16[i % len(x16)], w16.t(),
                                                                                       use_gelu=True)
        if name == "linear2":
            sides["cublas_fp16_linear_bias_plus_residual"] = lambda i: F.linear(x16[i % len(x16)], w16, b16) + resid
        try:  # tcprec's current INT8 path: QLinear's GEMM (the Triton implicit kernel) on int8 codes, fp16 out
            from tcprec.nn.qmodules import QLinear
            from tcprec.ops import qconv as qc
            from tcprec.ops.qconv_operands import quantize_int8_static

            lin = torch.nn.Linear(K, N).to(DEV).half()
            q = QLinear.from_float(lin, "int8", in_absmax=3.0, signed_input=True)
            q.to(DEV)
            wq = q._op_weight(torch.device(DEV))
            xa = [quantize_int8_static(x.reshape(-1, 1, 1, K), q.a_fmt, q.in_scale) for x in x16]
            sides["tcprec_int8_current"] = lambda i: qc.conv2d(xa[i % len(xa)], wq, bias=q.bias, act=None,
                                                               out_dtype=torch.float16, backend=q.backend)
            sides["tcprec_int8_current"](0)
        except Exception as e:
            sides.pop("tcprec_int8_current", None)
            res["errors"][f"{name}/tcprec_int8_current"] = f"{type(e).__name__}: {str(e)[:500]}"
        # the i8_gemm variants, each checked before it is timed
        epis = [("bias", dict(), dict())]
        if name == "linear1":
            epis.append(("bias_gelu_codes", dict(gelu=True, out_scale=out_scale), dict(gelu=True, out_scale=out_scale)))
        if name == "linear2":
            epis.append(("bias_residual", dict(residual=resid), dict(residual=resid)))
        for epi, kw, rkw in epis:
            want = i8_gemm_reference(a8[0], w8, a_s, w_s, bias, acc=acc, **rkw)
            for t in tiles:
                key = f"i8gemm_{t}_{epi}"
                try:
                    got = L.i8_gemm(a8[0], w8, a_s, w_s, bias, tile=t, **kw)
                    torch.cuda.synchronize()
                    if got.dtype == torch.int8:
                        d = (got.int() - want.int()).abs()
                        ok = d.max().item() <= 1 and (d != 0).float().mean().item() < 1e-3
                        res["checks"][f"{name}/{key}"] = {"max_code_diff": d.max().item(), "n_diff": (d != 0).sum().item()}
                    else:
                        d = (got.float() - want.float()).abs()
                        ok = torch.equal(got, want)
                        res["checks"][f"{name}/{key}"] = {"max_abs_err": d.max().item(), "n_diff": (d != 0).sum().item()}
                    if not ok:
                        res["errors"][f"{name}/{key}"] = f"wrong: {res['checks'][f'{name}/{key}']}"
                        continue
                    sides[key] = (lambda i, t=t, kw=kw: L.i8_gemm(a8[i % rot], w8, a_s, w_s, bias, tile=t, **kw))
                except Exception as e:
                    res["errors"][f"{name}/{key}"] = f"{type(e).__name__}: {str(e)[:800]}\n{traceback.format_exc()[-800:]}"
                if "out_scale" in kw:
                    continue  # the diagnostics are of the fp16 epilogue
                for d in diags[t]:  # run once (a fault or hang shows here), not checked, then timed
                    key = f"diag_{d}_{epi}"
                    try:
                        L.i8_gemm(a8[0], w8, a_s, w_s, bias, tile=d, **kw)
                        torch.cuda.synchronize()
                        sides[key] = (lambda i, d=d, kw=kw: L.i8_gemm(a8[i % rot], w8, a_s, w_s, bias, tile=d, **kw))
                    except Exception as e:
                        res["errors"][f"{name}/{key}"] = f"{type(e).__name__}: {str(e)[:800]}"
        names = list(sides)
        try:
            ms = graph_ms_alternating([sides[k] for k in names], calls=args.calls, replays=5)
        except Exception as e:  # one side broke the capture: time them one by one
            res["errors"][f"{name}/alternating"] = f"{type(e).__name__}: {str(e)[:500]}"
            ms = []
            for k in names:
                try:
                    ms.append(graph_ms_alternating([sides[k]], calls=args.calls, replays=5)[0])
                except Exception as e2:
                    res["errors"][f"{name}/{k}/timing"] = f"{type(e2).__name__}: {str(e2)[:500]}"
                    ms.append(float("nan"))
        flop = 2 * M * N * K
        row = {k: {"us": round(v * 1e3, 2), "pct_i8_peak": round(100 * flop / (v * 1e-3) / PEAK_I8, 1)}
               for k, v in zip(names, ms)}
        by_name = {str(t): t for t in tiles}
        by_name.update({str(d): d for t in tiles for d in diags[t]})
        for k in row:  # per-tile time on one SM, against the tile's MMAs at one SM's share of the peak
            tname = next((n for n in sorted(by_name, key=len, reverse=True) if k.startswith(("i8gemm_" + n + "_",
                                                                                             "diag_" + n + "_"))), None)
            if tname is None:
                continue
            t = by_name[tname]
            n_tiles = -(-M // t.bm) * -(-N // t.bn)
            row[k]["tiles"] = n_tiles
            row[k]["us_tile"] = round(row[k]["us"] * min(n_sm, n_tiles) / n_tiles, 2)
            row[k]["mma_us_tile"] = round(2 * t.bm * t.bn * K / (PEAK_I8 / n_sm) * 1e6, 2)
        res["shapes"][name] = {"K": K, "N": N, "rot": rot, "sides": row}
        print(f"{name} (K={K}, N={N}) t={time.time() - t0:.0f}s", flush=True)
        for k in sorted(row, key=lambda k: row[k]["us"] if row[k]["us"] == row[k]["us"] else 1e9):
            extra = f"  {row[k]['us_tile']:6.2f} us/tile (MMA at peak {row[k]['mma_us_tile']:.2f})" if "us_tile" in row[k] else ""
            print(f"   {k:55s} {row[k]['us']:9.2f} us {row[k]['pct_i8_peak']:6.1f}%{extra}", flush=True)
        sides = a8 = x16 = xa = None  # free the rotating inputs before the next shape
        torch.cuda.empty_cache()
    # the four GEMMs a layer: the sum of each side, and of the best i8_gemm tile per GEMM
    summ = {}
    for side in ("cublas_fp16_linear_bias", "int_mm", "tcprec_int8_current"):
        v = [res["shapes"][s]["sides"].get(side, {}).get("us") for s in SHAPES]
        summ[side] = round(sum(v), 1) if all(x is not None for x in v) else None
    for t in tiles:
        v = [res["shapes"][s]["sides"].get(f"i8gemm_{t}_bias", {}).get("us") for s in SHAPES]
        summ[f"i8gemm_{t}_bias"] = round(sum(v), 1) if all(x is not None for x in v) else None
        for d in diags[t]:
            v = [res["shapes"][s]["sides"].get(f"diag_{d}_bias", {}).get("us") for s in SHAPES]
            summ[f"diag_{d}_bias"] = round(sum(v), 1) if all(x is not None for x in v) else None
    best = []
    for s in SHAPES:
        c = [v["us"] for k, v in res["shapes"][s]["sides"].items() if k.startswith("i8gemm_") and k.endswith("_bias")]
        best.append(min(c) if c else None)
    summ["i8gemm_best_tile_per_gemm"] = round(sum(best), 1) if all(b is not None for b in best) else None
    flops = sum(2 * M * N * K for K, N in SHAPES.values())
    if summ["i8gemm_best_tile_per_gemm"]:
        summ["i8gemm_best_pct_i8_peak"] = round(100 * flops / (summ["i8gemm_best_tile_per_gemm"] * 1e-6) / PEAK_I8, 1)
    res["sum_us"] = summ
    res["total_s"] = round(time.time() - t0, 1)
    print("sum of the four GEMMs (us):", json.dumps(summ, indent=1))
    print("errors:", json.dumps(res["errors"], indent=1)[:4000])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
