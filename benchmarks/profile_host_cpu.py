"""Host cost per conv-backward op call with every Triton launch stubbed: CPU only, ``TRITON_INTERPRET=1`` so
the Triton paths are chosen, nothing executes.  What it measures is the Python an eager call runs before its
kernels (checks, backend choice, split models, descriptors), for comparisons on one machine, back to back.

    PYTHONPATH=src python benchmarks/profile_host_cpu.py ["wgrad tma" LAYER]

The optional pair runs cProfile on that case for RESNET50_LAYERS[LAYER].
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime import autotuner as _autotuner  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402
from triton.runtime import jit as _jit  # noqa: E402

_jit.JITFunction.run = lambda self, *a, **k: None
_autotuner.Autotuner.run = lambda self, *a, **k: None
_interpreter.InterpretedFunction.run = lambda self, *a, **k: None

from tcprec.bench.conv_bwd import RESNET50_LAYERS  # noqa: E402
from tcprec.ops import conv as opc  # noqa: E402


def rate(fn, n: int = 300) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    prof = sys.argv[1:3] if len(sys.argv) > 2 else None
    for i in (2, 4, 16):
        la = RESNET50_LAYERS[i]
        g = la.geometry(8)
        dy, x, w = (torch.randn(s).half() for s in (g.output_shape, g.input_shape, g.weight_shape))
        cases = {
            "dgrad triton": lambda: opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="triton"),
            "wgrad triton": lambda: opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="triton"),
            "wgrad tma": lambda: opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="tma"),
        }
        if la.R == 1 and la.stride == 2:
            cases["dgrad tma"] = lambda: opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="tma")
        for name, fn in cases.items():
            print(f"{la.name:24} {name:14} {rate(fn):7.1f} us", flush=True)
            if prof and name == prof[0] and i == int(prof[1]):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(200):
                    fn()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
                print(s.getvalue())


if __name__ == "__main__":
    main()
