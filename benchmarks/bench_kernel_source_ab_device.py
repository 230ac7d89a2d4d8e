"""A/B of two versions of the bit-serial GEMM's source (bmma_gemm.cu) under whole quantized networks, same process,
same inputs (GPU machine).  The networks are built once per side with ``loader.SOURCE_PATH`` pointing at that side's
source (memoised variants and kernels cleared), timed by CUDA-graph replay, alternating A, B, A, B; the outputs of
both sides are compared (a kernel change must not change them), and the per-layer kernel times of one eager forward
of each side are recorded.  The other source comes from git, e.g.

    git show 7eba2c4:src/tcprec/kernels/cuda/bmma_gemm.cu > .carry/old_bmma.cu
    PYTHONPATH=src python3 benchmarks/bench_kernel_source_ab_device.py .carry/old_bmma.cu \\
        --models vgg,resnet18 --out benchmarks/results/epilogue_ab.json

``--kernel stem_conv`` swaps the thin-stem kernel's source (kernels/cuda/stem_conv.cu) instead, e.g.

    git show HEAD:src/tcprec/kernels/cuda/stem_conv.cu > .carry/old_stem.cu
    git show HEAD:src/tcprec/kernels/cuda/codes.cuh > .carry/codes.cuh   # (included from beside the source)
    PYTHONPATH=src python3 benchmarks/bench_kernel_source_ab_device.py .carry/old_stem.cu --kernel stem_conv \\
        --models vgg,alexnet,yolov2-tiny

or, with one source, side A with loader settings changed (a tile rule off), e.g.

    PYTHONPATH=src python3 benchmarks/bench_kernel_source_ab_device.py --a-loader _CONV_MIN_TILES=1000000000 \\
        --models resnet18 --out benchmarks/results/conv_tile_ab.json

or side A with a quantize_model switch of ``tcprec.nn.convert`` changed (a graph rewrite off), e.g.

    PYTHONPATH=src python3 benchmarks/bench_kernel_source_ab_device.py --a-convert FUSE_FLATTEN=0 \\
        --models resnet18,vgg --out benchmarks/results/flatten_ab.json

``--a-set DOTTED.NAME=INT`` sets any module attribute for side A (e.g. ``tcprec.nn.convert.BITSERIAL_DUAL=0``).
A switch may change roundings (a chained conv quantizes its float32 result, the unchained network the float16 one),
so with ``--a-convert`` / ``--a-set`` the outputs are compared and recorded (``outputs_equal``, ``max_rel_diff``)
instead of required equal.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_net_layers_device import layer_kernels  # noqa: E402

from tcprec.bench.common import time_graph_ms  # noqa: E402
from tcprec.bench.net import build_variant  # noqa: E402
from tcprec.kernels.cuda import loader, stem_conv  # noqa: E402
from tcprec.nn.models import INPUT_SHAPES, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", nargs="?", default=None, help="the other kernel source (side A); side B is the tree's")
    ap.add_argument("--kernel", choices=("bmma_gemm", "stem_conv"), default="bmma_gemm",
                    help="whose source `other` replaces: the bit-serial GEMM's or the thin stem's")
    ap.add_argument("--a-loader", action="append", default=[], metavar="NAME=INT",
                    help="side A: set tcprec.kernels.cuda.loader.NAME to INT (repeatable)")
    ap.add_argument("--a-convert", action="append", default=[], metavar="NAME=INT",
                    help="side A: set tcprec.nn.convert.NAME (a quantize_model switch) to INT (repeatable)")
    ap.add_argument("--a-set", action="append", default=[], metavar="MODULE.NAME=INT",
                    help="side A: set the attribute NAME of module MODULE (dotted) to INT (repeatable)")
    ap.add_argument("--models", default="vgg")
    ap.add_argument("--precision", default="w1a2")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/kernel_source_ab.json")
    args = ap.parse_args()
    a_attrs = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.a_loader)}
    sets = [("tcprec.nn.convert." + kv) for kv in args.a_convert] + args.a_set
    a_conv = {}
    for kv in sets:  # (module, name) -> value
        path, v = kv.split("=", 1)
        mname, _, k = path.rpartition(".")
        m = importlib.import_module(mname)
        a_conv[(m, k)] = type(getattr(m, k))(int(v))
    b_conv = {mk: getattr(*mk) for mk in a_conv}
    a_name = "A (" + ", ".join([args.other] * bool(args.other) + args.a_loader + sets) + ")"
    mod = loader if args.kernel == "bmma_gemm" else stem_conv
    sides = {a_name: Path(args.other).resolve() if args.other else mod.SOURCE_PATH, "B (tree)": mod.SOURCE_PATH}
    b_attrs = {k: getattr(loader, k) for k in a_attrs}
    torch.manual_seed(0)
    rows = []
    for name in args.models.split(","):
        m32 = build(name, device="cuda").eval()
        x32 = torch.randn(args.batch, *INPUT_SHAPES[name], device="cuda")
        ref, times, layers, equal, diff = None, {k: [] for k in sides}, {}, True, 0.0
        for rnd in range(args.rounds):
            for side, src in sides.items():
                mod.SOURCE_PATH = src
                for k, v in (a_attrs if side == a_name else b_attrs).items():
                    setattr(loader, k, v)
                for (m, k), v in (a_conv if side == a_name else b_conv).items():
                    setattr(m, k, v)
                loader._variant_for.cache_clear()
                loader._kernels.clear()
                stem_conv._smem_set.clear()  # (a reloaded kernel needs its shared-memory attribute set again)
                stem_conv._THRESHOLDS.clear()
                with torch.no_grad():
                    model, dt = build_variant(m32, args.precision, x32[:4])
                    x = x32.to(dt).contiguous(memory_format=torch.channels_last)
                    y = model(x).float()
                    if ref is None:
                        ref = y
                    elif not torch.equal(y, ref):
                        if not a_conv:
                            raise SystemExit(f"{name}: the outputs of the two sources differ")
                        equal = False
                        diff = max(diff, float((y - ref).abs().max() / ref.abs().max()))
                    times[side].append(min(time_graph_ms(model, [x]) for _ in range(3)))
                    if rnd == 0:
                        layers[side] = {layer: {k: round(v, 1) for k, v in kern.items() if v >= 1}
                                        for layer, kern in layer_kernels(model, x).items() if sum(kern.values()) >= 20}
                del model
                torch.cuda.empty_cache()
                print(f"{name} b{args.batch} {args.precision} {side}: {times[side][-1]:.3f} ms", flush=True)
        rows.append(dict(model=name, batch=args.batch, precision=args.precision, outputs_equal=equal,
                         **({"max_rel_diff": diff} if a_conv else {}),
                         ms={k: min(v) for k, v in times.items()}, ms_all=times, layers_us=layers))
    mod.SOURCE_PATH = sides["B (tree)"]
    for k, v in b_attrs.items():
        setattr(loader, k, v)
    for (m, k), v in b_conv.items():
        setattr(m, k, v)
    out = dict(command=" ".join(sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
