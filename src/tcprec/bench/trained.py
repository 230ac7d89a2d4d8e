"""``tcprec bench net --checkpoint PATH ...``: trained networks (``tcprec train --task classify`` checkpoints) at
their precisions -- test accuracy on the 10,000 Fashion-MNIST images against speedup over the fp16 model, one run.

A float checkpoint runs at fp32, fp16 and every quantized precision asked for (post-training quantization,
calibrated on 512 training images); a QAT checkpoint runs at its own precision (``convert_qat``), beside its
architecture in fp16 (the speed baseline).  Every side is timed as ``tcprec bench net`` times it (a CUDA graph of
the forward, median of replays) and evaluated through ``tcprec.compile`` on the whole test set.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..qat.checkpoint import deploy, load_trained
from ..qat.layers import QATConv2d
from ..qat.trainer import evaluate_deployed, load_classify_data, normalize
from .common import environment, print_environment, require_cuda, time_graph_ms, write_json

__all__ = ["run_trained"]


def run_trained(checkpoints: Sequence, precisions: Sequence[str] = ("fp32", "fp16", "int8", "w2a2", "w1a2"),
                batches: Sequence[int] = (256,), out="benchmarks/results/net_trained.json",
                plot: str | None = "benchmarks/results/net_trained.png", data_path=None, console: Console | None = None,
                command: str = "tcprec bench net --checkpoint") -> dict:

    console = console or Console()
    dev = require_cuda(command)
    env = environment()
    print_environment(console, env)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ds = load_classify_data("fashion-mnist", data_path, dev, limit_train=512)
    calib = normalize(ds.x_train[:512]).contiguous(memory_format=torch.channels_last)
    rows: list[dict] = []
    for path in checkpoints:
        t = load_trained(path, dev)
        todo = list(precisions) if t.kind == "float" else ["fp16", t.precision]
        for batch in batches:
            x = normalize(ds.x_test[:batch]).contiguous(memory_format=torch.channels_last)
            for prec in todo:
                row = {"checkpoint": str(path), "model": t.model_name, "kind": t.kind, "precision": prec,
                       "batch": batch}
                try:
                    if prec == "fp16":
                        net = copy.deepcopy(t.model).half().eval()
                        if t.kind == "qat":  # the architecture in fp16 (speed baseline): QAT layers back to float
                            net = _float_skeleton(t.model).half().eval()
                        xin = x.half()
                    else:
                        net, xin = deploy(t, None if t.kind == "qat" else prec, calib), x
                    with torch.no_grad():
                        row["ms"] = time_graph_ms(lambda: net(xin), None, calls=2, replays=5)
                    if prec != "fp16" and batch == max(batches):
                        row["test_acc"] = evaluate_deployed(net, ds, batch=batch)["test_acc"]
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
            base = next((r["ms"] for r in rows if r["checkpoint"] == str(path) and r["batch"] == batch
                         and r["precision"] == "fp16" and "ms" in r), None)
            for r in rows:
                if r["checkpoint"] == str(path) and r["batch"] == batch and "ms" in r and base:
                    r["speedup_vs_fp16"] = base / r["ms"]
    t_ = Table(title="trained networks: Fashion-MNIST test accuracy against speed")
    for c in ("checkpoint", "precision", "batch", "ms", "vs fp16", "test acc"):
        t_.add_column(c)
    for r in rows:
        t_.add_row(r["checkpoint"][-40:], r["precision"], str(r["batch"]), f"{r.get('ms', float('nan')):.3f}",
                   f"{r.get('speedup_vs_fp16', float('nan')):.2f}",
                   f"{100 * r['test_acc']:.2f}%" if "test_acc" in r else r.get("error", "-")[:40])
    console.print(t_)
    summary = [{k: r.get(k) for k in ("model", "kind", "precision", "batch", "ms", "speedup_vs_fp16", "test_acc")}
               for r in rows]
    payload = {"suite": "net_trained", "command": command, "device": env.get("gpu"), "commit": None,
               "summary": summary, "targets": [], "environment": env, "rows": rows}
    write_json(out, payload)
    if plot:
        _plot(rows, plot)
    return payload


def _float_skeleton(qat_model):
    """The QAT model's architecture with plain float layers (for the fp16 speed baseline)."""
    from torch import nn

    m = copy.deepcopy(qat_model)
    for name, mod in list(m.named_modules()):
        if not hasattr(mod, "act_quant"):
            continue
        if isinstance(mod, QATConv2d):
            f = nn.Conv2d(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                          bias=mod.bias is not None)
            f = nn.Sequential(f, mod.bn) if mod.bn is not None else f
        else:
            f = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        parent, _, leaf = name.rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, leaf, f.to(mod.weight.device))
    return m


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if "test_acc" in r and "speedup_vs_fp16" in r:
            ax.scatter(r["speedup_vs_fp16"], 100 * r["test_acc"])
            ax.annotate(f"{r['model']} {r['precision']}", (r["speedup_vs_fp16"], 100 * r["test_acc"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("speedup over the fp16 model (CUDA-graph replay)")
    ax.set_ylabel("Fashion-MNIST test accuracy (%)")
    ax.set_title("tcprec bench net --checkpoint: accuracy against speed")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
