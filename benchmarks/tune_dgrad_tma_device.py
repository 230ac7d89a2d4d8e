"""Tile sweep for the strided 1x1 dgrad TMA kernel (kernels/triton/gemm_scatter.py) on the six strided
1x1 ResNet-50 layers, fp16 and fp8, N = 256 and 8, with the path it replaces (cuBLAS GEMM + the Triton
scatter pass, backend="gemm") and cuDNN's fp16 dgrad (NCHW) timed in the same run; prints JSON lines
and writes $OUT/dgrad_tma_tune.json.  Kernel times by CUDA-graph replay (tcprec.bench.common.time_graph_ms;
events around eager calls timed the host on the H200 machine, 100-160 us a call for these paths).

    PYTHONPATH=src python3 benchmarks/tune_dgrad_tma_device.py
"""

from __future__ import annotations

import json
import os

import torch
from tcprec.bench.common import time_graph_ms
from tcprec.bench.conv_bwd import RESNET50_LAYERS
from tcprec.kernels.triton import gemm_scatter as gs
from tcprec.ops import conv as opc


def do_bench(fn) -> float:
    """ms per call by CUDA-graph replay (no host launch time in it)."""
    return time_graph_ms(fn, calls=20, replays=5)


def main() -> None:
    rows = []
    layers = [la for la in RESNET50_LAYERS if la.R == 1 and la.stride == 2]
    for N in (256, 8):
        for la in layers:
            g = la.geometry(N)
            dy = torch.randn(g.output_shape, device="cuda").half()
            w = torch.randn(g.weight_shape, device="cuda").half()
            dyn, wn = dy.permute(0, 3, 1, 2).contiguous(), w.permute(0, 3, 1, 2).contiguous()
            cudnn = do_bench(lambda: torch.nn.grad.conv2d_input((N, g.C, g.H, g.W), wn, dyn, stride=2))
            for precision in ("fp16", "fp8"):
                a, b = opc.prepare_fp8_dgrad(dy, w) if precision == "fp8" else (dy, w)
                kw = dict(precision=precision)
                base = do_bench(lambda: opc.conv2d_dgrad(a, b, g.input_shape, 2, backend="gemm", **kw))
                for cfg in gs.CONFIGS + gs.VARIANT_CONFIGS + [None]:  # None: the default pick
                    try:
                        t = do_bench(lambda: opc.conv2d_dgrad(a, b, g.input_shape, 2, backend="tma", config=cfg, **kw))
                        err = None
                    except Exception as e:  # noqa: BLE001 (reported in the row)
                        t, err = None, f"{type(e).__name__}: {e}"[:200]
                    r = dict(N=N, layer=la.name, precision=precision, cfg=cfg, tma_ms=t, gemm_scatter_ms=base,
                             cudnn_fp16_ms=cudnn, error=err,
                             vs_gemm=None if t is None else base / t, vs_cudnn=None if t is None else cudnn / t)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out, "dgrad_tma_tune.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
