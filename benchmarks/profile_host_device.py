"""Host-side cost per call of the conv-backward ops (no GPU timing): for a few ResNet-50 layers at N = 8,
the wall time of 200 back-to-back calls with no synchronisation inside (the launch rate; when it exceeds
the kernel time, CUDA-event timings measure the host), for each backend next to cuDNN, then a cProfile of
the slowest paths (top functions by own time).  Diagnostic only; prints, writes nothing.

    PYTHONPATH=src python3 benchmarks/profile_host_device.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from tcprec.bench.conv_bwd import RESNET50_LAYERS
from tcprec.ops import conv as opc


def rate(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    torch.backends.cudnn.benchmark = True
    names = ["56x56 64->64 3x3 s1", "7x7 512->512 3x3 s1", "56x56 256->128 1x1 s2", "28x28 512->1024 1x1 s2"]
    slow = []
    for la in [la for la in RESNET50_LAYERS if la.name in names]:
        g = la.geometry(8)
        dy = torch.randn(g.output_shape, device="cuda").half()
        x = torch.randn(g.input_shape, device="cuda").half()
        w = torch.randn(g.weight_shape, device="cuda").half()
        dyn, xn, wn = (t.permute(0, 3, 1, 2).contiguous() for t in (dy, x, w))
        a8, b8 = opc.prepare_fp8_dgrad(dy, w)
        fns = {
            "cudnn dgrad": lambda: torch.nn.grad.conv2d_input((g.N, g.C, g.H, g.W), wn, dyn, g.stride, g.padding),
            "cudnn wgrad": lambda: torch.nn.grad.conv2d_weight(xn, (g.K, g.C, g.R, g.S), dyn, g.stride, g.padding),
        }
        for be in ("auto", "triton", "tma", "gemm"):
            fns[f"dgrad {be}"] = (lambda be=be: opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend=be))
            fns[f"dgrad fp8 {be}"] = (lambda be=be: opc.conv2d_dgrad(a8, b8, g.input_shape, g.stride, g.padding,
                                                                     precision="fp8", backend=be))
            fns[f"wgrad {be}"] = (lambda be=be: opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding,
                                                                 backend=be))
        print(f"-- {la.name} N=8: host us per call (200 calls, no sync)")
        for k, fn in fns.items():
            try:
                us = rate(fn)
            except Exception as e:  # noqa: BLE001
                print(f"   {k:18} n/a ({type(e).__name__}: {str(e)[:80]})")
                continue
            print(f"   {k:18} {us:8.1f}")
            if us > 60 and len(slow) < 6 and not k.startswith("cudnn"):
                slow.append((f"{la.name} {k}", fn))
    for name, fn in slow:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(f"== cProfile {name} (50 calls)")
        print("\n".join(s.getvalue().splitlines()[6:24]))


if __name__ == "__main__":
    main()
