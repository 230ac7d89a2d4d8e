"""``tcprec bench net``: whole networks at fp32 / fp16 / int8 / fp8 / w2a2 / w1a2, every number from one
run on one GPU.

For each model and batch the float model (seeded weights, batch-norm statistics from seeded data)
runs in fp32 and fp16 through cuDNN with channels_last tensors (fp32 with TF32 off: true fp32), and
``tcprec.quantize_model`` builds the int8 / fp8 / wXaY versions from the fp16 model (first conv and
last layer at int8 for wXaY, as APNN-TC keeps them).  Every side is timed the same way: its forward
captured in a CUDA graph (``bench.common.time_graph_ms``; no host launch overhead anywhere), median of
replays by CUDA events.  The output error is the NRMSE against the fp32 output for the same input.

Weights are seeded, not trained (no pretrained weights for these networks exist offline), so the
NRMSE of the 1- and 2-bit networks says how far random-weight outputs move, not a task accuracy.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..nn import models as zoo
from ..nn.convert import QuantConfig, quantize_model
from ..precision import canonical_network_precision
from ..profiling import profile
from ..progress import track
from .common import environment, print_environment, require_cuda, time_graph_ms, write_json

__all__ = ["PRECISIONS", "run", "build_variant", "nrmse"]

PRECISIONS = ("fp32", "fp16", "int8", "fp8", "w2a2", "w1a2")
_TARGETS = {  # (model, batch, precision) -> required speedup over fp16 (issue 4)
    ("vgg", 256, "w1a2"): 4.0, ("resnet18", 256, "w1a2"): 4.0,
    ("alexnet", 8, "w1a2"): 1.5, ("vgg", 8, "w1a2"): 1.5, ("resnet18", 8, "w1a2"): 1.5,
}


def nrmse(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64."""
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def build_variant(model_fp32: torch.nn.Module, precision: str, calibration: torch.Tensor):
    """(model, input dtype) for one precision, on the model's device.  Quantized variants are built
    from the fp16 model on a GPU (their float glue -- residual adds, flatten -- runs in fp16), from
    the fp32 model on the CPU."""
    precision = canonical_network_precision(precision)
    if precision == "fp32":
        return model_fp32, torch.float32
    import copy

    on_gpu = next(model_fp32.parameters()).is_cuda
    base = copy.deepcopy(model_fp32).to(memory_format=torch.channels_last)
    if on_gpu or precision == "fp16":
        base = base.half()
    dt = next(base.parameters()).dtype
    if precision == "fp16":
        return base, dt
    first_last = None if precision in ("int8", "fp8") else "int8"
    cfg = QuantConfig(precision=precision, first_last=first_last)
    return quantize_model(base, cfg, calibration=calibration.to(dt), warn=False), dt


def run(models: Sequence[str] = ("alexnet", "vgg", "resnet18", "yolov2-tiny"), precisions: Sequence[str] = PRECISIONS,
        batches: Sequence[int] = (8, 256), out="benchmarks/results/net.json", plot: str | None = "benchmarks/results/net.png",
        console: Console | None = None, command: str = "tcprec bench net", seed: int = 0,
        breakdown: bool = True) -> dict:
    console = console or Console()
    device = require_cuda(command)
    precisions = [canonical_network_precision(p) for p in precisions]  # ValueError lists the accepted set
    for m in models:
        if m not in zoo.MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {sorted(zoo.MODELS)}")
    env = environment()
    print_environment(console, env)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    for name in models:
        model = zoo.build(name, seed=seed, device=device).to(memory_format=torch.channels_last)
        for batch in batches:
            g = torch.Generator(device=device).manual_seed(seed + batch)
            x = torch.randn((batch, *zoo.INPUT_SHAPES[name]), device=device, generator=g)
            x = x.to(memory_format=torch.channels_last)
            with torch.no_grad():
                ref = model(x).float()
            base: dict[str, float] = {}
            for prec in track(precisions, f"bench net {name} batch {batch}", label=str):
                row = {"model": name, "batch": batch, "precision": prec}
                t0 = time.time()
                try:
                    net, dt = build_variant(model, prec, x[: min(batch, 8)])
                    xin = x.to(dt)
                    with torch.no_grad():
                        y = net(xin).float()
                        ms = time_graph_ms(lambda: net(xin), None, calls=2 if batch > 32 else 8, replays=5)
                    row.update(ms=ms, nrmse=nrmse(y, ref), images_per_s=batch / ms * 1e3)
                    if hasattr(net, "tcprec_summary"):
                        row["layers"] = [vars(r) for r in net.tcprec_summary.layers]
                    if breakdown:
                        rep = profile(net, xin, warmup=1, iters=2)
                        console.print(rep.table(top_kernels=6))
                        prof = rep.to_json()
                        row["profile"] = {k: prof[k] for k in ("layers", "breakdown", "copies", "dtype_trace",
                                                                "tensor_core_ms", "wall_ms")}
                    base[prec] = ms
                    del net
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others' numbers
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["setup_s"] = round(time.time() - t0, 1)
                rows.append(row)
                torch.cuda.empty_cache()
            for r in rows:
                if r["model"] == name and r["batch"] == batch and "ms" in r:
                    for b in ("fp32", "fp16"):
                        if b in base:
                            r[f"speedup_vs_{b}"] = base[b] / r["ms"]
                    tgt = _TARGETS.get((name, batch, r["precision"]))
                    if tgt is not None:
                        r["target_vs_fp16"] = tgt
                        r["target_met"] = r.get("speedup_vs_fp16", 0.0) >= tgt
            console.print(table([r for r in rows if r["model"] == name and r["batch"] == batch], f"{name}, batch {batch}"))
    payload = {"command": command, "environment": env, "rows": rows}
    path = write_json(out, payload)
    console.print(f"wrote {path}")
    if plot:
        _plot(rows, plot)
        console.print(f"wrote {plot}")
    return payload


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for c in ("precision", "ms", "img/s", "vs fp32", "vs fp16", "target", "NRMSE vs fp32"):
        t.add_column(c, justify="right" if c != "precision" else "left")
    for r in rows:
        if "error" in r:
            t.add_row(r["precision"], "error", r["error"][:60], "", "", "", "")
            continue
        tgt = r.get("target_vs_fp16")
        tgt_s = "" if tgt is None else f">= {tgt}x: {'ok' if r['target_met'] else 'MISS'}"
        t.add_row(r["precision"], _f(r["ms"], ".3f"), _f(r["images_per_s"], ".0f"), _f(r.get("speedup_vs_fp32"), ".2f"),
                  _f(r.get("speedup_vs_fp16"), ".2f"), tgt_s, _f(r["nrmse"], ".3g"))
    return t


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prec in PRECISIONS:
        pts = [(r["speedup_vs_fp16"], max(r["nrmse"], 1e-7)) for r in rows
               if r["precision"] == prec and "speedup_vs_fp16" in r]
        if pts:
            ax.scatter(*zip(*pts), label=prec)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("speedup over cuDNN fp16 (CUDA-graph replay)")
    ax.set_ylabel("output NRMSE vs fp32")
    ax.set_title("tcprec bench net: error against speed (all models and batches)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
