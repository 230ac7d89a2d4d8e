"""The bit-serial GEMM on the conv GEMM shapes of issue 4's networks (im2col'd operands: M = batch 256 x P x Q,
N = output channels, Kw = the im2col row's words) and 8192^3, w1a2, each with the three epilogues the
networks use -- packed 2-bit planes (a layer feeding a binary layer), float16, int32 -- timed in one run by
CUDA-graph replay; against the wgmma b1 peak (15.5 P op/s) and as bytes moved.  On the GPU machine:

    PYTHONPATH=src python3 benchmarks/bench_conv_gemm_device.py "" benchmarks/results/conv_gemm.json

(first argument: ';'-separated tile strings to try, "" = the picked tile)."""
import sys, json, torch
from tcprec.kernels.cuda import loader
from tcprec.bench.common import time_graph_ms
from tcprec.kernels.triton.im2col_bits import im2col_bits
G = torch.ops.tcprec.bmma_gemm
SH = [  # label, M, N, Kw, (H, C, stride) for im2col
 ("vgg.f4 96-256@56", 802816, 256, 32), ("vgg.f7 256-256@56", 802816, 256, 80),
 ("vgg.f14 256-512@28", 200704, 512, 80), ("vgg.f17 512-512@28", 200704, 512, 144),
 ("vgg.f24 512-512@14", 50176, 512, 144),
 ("rn.s0 64-64@56", 802816, 64, 32), ("rn.s2b 128-128@28", 200704, 128, 48),
 ("rn.s4b 256-256@14", 50176, 256, 80), ("rn.s6b 512-512@7", 12544, 512, 144),
 ("gemm 8192^3", 8192, 8192, 256),
]
def main():
    dev = "cuda"
    rows = []
    tiles = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    for label, M, N, Kw in SH:
        a = torch.randint(-2**31, 2**31 - 1, (2, M, Kw), dtype=torch.int32, device=dev)
        w = torch.randint(-2**31, 2**31 - 1, (1, N, Kw), dtype=torch.int32, device=dev)
        cs = torch.rand(N, device=dev) + 0.5; b = torch.randn(N, device=dev); osc = torch.tensor([4.0], device=dev)
        ops = 2.0 * M * N * Kw * 32 * 2
        for kind in ("packed", "float16", "int32"):
            for tile in tiles:
                try:
                    f = lambda: G(a, w, False, False, 1, None, None, None, cs, b, True, kind, 2, "unsigned", osc if kind == "packed" else None, tile, 0.0)
                    v = loader._variant_for(2, 1, False, False, M, N, kind, 2, "unsigned", tile, *loader._sm_count(a.device), Kw)
                    ms = time_graph_ms(f, calls=8)
                except Exception as e:
                    print(label, kind, tile, "ERR", str(e)[:200]); continue
                outb = {"packed": 2 * M * (-(-N // 512) * 16) * 4, "float16": 2 * M * N, "int32": 4 * M * N}[kind]
                inb = a.numel() * 4
                r = dict(label=label, M=M, N=N, Kw=Kw, kind=kind, tile=str(v.tile), us=ms * 1e3,
                         pct_peak=ops / (ms * 1e-3) / 15.5e15 * 100, GBps=(inb + outb) / (ms * 1e-3) / 1e9)
                rows.append(r)
                print(f"{label:22s} {kind:8s} {str(v.tile):28s} {ms*1e3:9.1f} us  {r['pct_peak']:5.1f}% peak  {r['GBps']:6.0f} GB/s", flush=True)
        del a, w
    json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/convgemm.json", "w"), indent=1)
if __name__ == "__main__":
    main()
