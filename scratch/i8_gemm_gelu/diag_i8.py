"""Scratch: where the int8-codes epilogue's time goes (linear1 of the ViT-B encoder, M=12608, K=768, N=3072).
python diag_i8.py OUT.json [--src patched.cu] [--label L] [--ncu VARIANT]"""
import argparse, json, math, sys, time
from pathlib import Path
import torch
from tcprec.kernels.cuda import i8_gemm as L
from tcprec.kernels.reference_i8_gemm import i8_gemm_acc, i8_gemm_reference
from tcprec.timing import graph_ms_alternating

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out"); ap.add_argument("--src"); ap.add_argument("--label", default="prod")
    ap.add_argument("--ncu"); ap.add_argument("--tiles", default="pp_64x256_s5_e1,pp_64x128_s8_e1")
    a = ap.parse_args()
    if a.src:
        L.SOURCE_PATH = Path(a.src)
    M, K, N = 64 * 197, 768, 3072
    t0 = time.time()
    tiles = a.tiles.split(",")
    kinds0 = {"f16": {}, "f16_gelu": dict(gelu=True), "i8": dict(out_scale=1), "i8_gelu": dict(gelu=True, out_scale=1)}
    L.precompile([L.Variant(L.parse_tile(t), "int8" if "out_scale" in kw else "float16", bool(kw.get("gelu")), False)
                  for t in tiles for kw in kinds0.values()], "sm_90a", workers=8)
    compile_s = round(time.time() - t0, 1)
    print("compiled", compile_s, flush=True)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    rot = max(4, math.ceil(100e6 / (M * K)))
    a8 = [torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev, generator=g) for _ in range(rot)]
    w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev, generator=g)
    a_s = torch.tensor([0.01], device=dev)
    w_s = (torch.rand(N, device=dev, generator=g) + 0.5) * (3.0 / (5476.0 * K**0.5 * 0.01))
    bias = torch.randn(N, device=dev, generator=g) * 0.5
    os_ = torch.tensor([0.05], device=dev)
    kinds = {"f16": {}, "f16_gelu": dict(gelu=True), "i8": dict(out_scale=os_), "i8_gelu": dict(gelu=True, out_scale=os_)}
    res = {"label": a.label, "src": a.src, "us": {}, "check": {}, "compile_s": compile_s}
    if a.ncu:
        k, t = a.ncu.rsplit("@", 1)
        for _ in range(3):
            L.i8_gemm(a8[0], w8, a_s, w_s, bias, tile=t, **kinds[k])
        torch.cuda.synchronize(); print("ncu run done"); return
    acc = i8_gemm_acc(a8[0], w8)
    fns, names = [], []
    for t in tiles:
        for k, kw in kinds.items():
            got = L.i8_gemm(a8[0], w8, a_s, w_s, bias, tile=t, **kw)
            want = i8_gemm_reference(a8[0], w8, a_s, w_s, bias, acc=acc, **kw)
            d = (got.float() - want.float()).abs()
            res["check"][f"{k}@{t}"] = {"max": d.max().item(), "n_diff": int((d != 0).sum())}
            fns.append(lambda i, t=t, kw=kw: L.i8_gemm(a8[i % rot], w8, a_s, w_s, bias, tile=t, **kw)); names.append(f"{k}@{t}")
    ms = graph_ms_alternating(fns, calls=20, replays=5)
    res["us"] = {n: round(v * 1e3, 2) for n, v in zip(names, ms)}
    res["s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
