"""``tcprec train``: the CPD experiment -- train with gradients all-reduced in a low-precision format
across N (emulated) nodes, with or without APS -- as one function of plain arguments (cli.py wires
it to typer).  Checkpoint every epoch, resume, per-epoch log, a final table and a PNG of the curves.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.fashion_mnist import load_fashion_mnist
from ..distributed.algorithms import ALGORITHMS
from ..distributed.lowp import check_aps_format
from ..distributed.nodes import EmulatedNodes
from ..progress import bar
from .models import MODELS
from .optim import LowPrecisionSGD

__all__ = ["train", "load_data", "GRAD_FORMATS"]

log = logging.getLogger("tcprec.train")
GRAD_FORMATS = ("fp32", "e4m3", "e5m2", "e3m0")
_MEAN, _STD = 0.2860, 0.3530  # Fashion-MNIST pixel statistics


def _synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable 10-class stand-in for CI: class-specific blobs plus noise, 28x28 uint8."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(10, 28, 28, generator=torch.Generator().manual_seed(12345))
    y = torch.randint(0, 10, (n,), generator=g)
    x = (0.7 * protos[y] + 0.3 * torch.rand(n, 28, 28, generator=g)) * 255
    return x.to(torch.uint8), y


def load_data(data: str, data_path=None, limit_train=None, limit_test=None, seed=0):
    """(x_train, y_train, x_test, y_test) as normalised float (N, 1, 28, 28) and int64 labels."""
    if data == "fashion-mnist":
        xtr, ytr = load_fashion_mnist(data_path, "train")
        xte, yte = load_fashion_mnist(data_path, "test")
    elif data == "synthetic":
        xtr, ytr = _synthetic(limit_train or 512, seed)
        xte, yte = _synthetic(limit_test or 256, seed + 1)
    else:
        raise ValueError(f"data must be 'fashion-mnist' or 'synthetic', got data={data!r}")
    xtr, ytr = xtr[:limit_train], ytr[:limit_train]
    xte, yte = xte[:limit_test], yte[:limit_test]
    norm = lambda x: ((x.float() / 255 - _MEAN) / _STD).unsqueeze(1)  # noqa: E731
    return norm(xtr), ytr, norm(xte), yte


@torch.no_grad()
def _evaluate(model, x, y, batch, device) -> float:
    model.eval()
    correct = 0
    for i in range(0, x.shape[0], batch):
        correct += (model(x[i:i + batch].to(device)).argmax(1).cpu() == y[i:i + batch]).sum().item()
    model.train()
    return correct / max(1, x.shape[0])


def _plot(history: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ep = [h["epoch"] for h in history]
    ax.plot(ep, [h["test_acc"] for h in history], "o-", label="test accuracy")
    ax.plot(ep, [h["train_acc"] for h in history], "s--", label="train accuracy (running)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(model: str = "resnet18", data: str = "fashion-mnist", data_path=None, grad_format: str = "e4m3",
          aps: bool = True, kahan: bool = False, nodes: int = 8, epochs: int = 1, seed: int = 0,
          batch_size: int = 256, lr: float = 0.05, momentum: float = 0.9, transport: str = "compressed",
          out_dir="runs/train", resume: bool = False, limit_train: int | None = None, limit_test: int | None = None,
          device: str = "auto", progress: bool = True, lars: bool = False, algorithm: str = "direct") -> dict:
    """Train ``model`` with gradients all-reduced in ``grad_format`` ("fp32": plain float32) across
    ``nodes`` emulated nodes (one micro-batch of batch_size/nodes each).  Returns the summary dict
    (also written to ``out_dir/metrics.json``; curves in ``out_dir/curves.png``).  ``lars``: LARS
    trust ratios (CPD's ``--use_lars``) on the weight tensors, SGD momentum, float32 master weights
    (train/optim.py); ``algorithm``: the all-reduce's reduction order (tcprec.distributed)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got model={model!r}")
    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got grad_format={grad_format!r}")
    if batch_size % nodes:
        raise ValueError(f"batch_size={batch_size} must be a multiple of nodes={nodes} (one micro-batch per node)")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got algorithm={algorithm!r}")
    if algorithm == "halving" and kahan and grad_format != "fp32":
        raise ValueError("algorithm='halving' sums a pairwise tree and has no Kahan compensation; use "
                         "--algorithm ring or direct with --kahan, or drop --kahan")
    fmt = None if grad_format == "fp32" else grad_format
    if fmt is not None and aps:
        check_aps_format(fmt, nodes)  # too few exponent bits: fail before any data is loaded
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = load_data(data, data_path, limit_train, limit_test, seed)
    net = MODELS[model]().to(dev)
    if lars:  # biases and BatchNorm parameters keep the plain step, as in LARS's reference setups
        groups = [{"params": [p for p in net.parameters() if p.dim() > 1]},
                  {"params": [p for p in net.parameters() if p.dim() <= 1], "lars": False}]
        opt = LowPrecisionSGD(groups, lr=lr, momentum=momentum, weight_decay=5e-4, lars=True, rounding="nearest")
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs))
    em = EmulatedNodes(net, n_local=nodes, fmt=fmt, aps=aps, kahan=kahan, transport=transport, algorithm=algorithm)
    config = dict(model=model, data=data, grad_format=grad_format, aps=aps, kahan=kahan, nodes=nodes, epochs=epochs,
                  seed=seed, batch_size=batch_size, lr=lr, transport=transport, limit_train=limit_train,
                  limit_test=limit_test, device=str(dev), lars=lars, algorithm=algorithm)
    history, start, skipped = [], 0, 0
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        st = torch.load(ckpt, map_location=dev, weights_only=False)
        if st["config"] != config | {"epochs": st["config"]["epochs"]}:
            raise ValueError(f"{ckpt} was written by a different configuration: {st['config']}")
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        history, start, skipped = st["history"], st["epoch"], st["skipped"]
        torch.set_rng_state(st["rng"])
        log.info("resumed from %s at epoch %d", ckpt, start)

    loss_fn = F.cross_entropy
    n_batches = xtr.shape[0] // batch_size
    for epoch in range(start, epochs):
        with bar(n_batches, f"epoch {epoch + 1}/{epochs}", quiet=not progress) as ebar:
            t0 = time.perf_counter()
            perm = torch.randperm(xtr.shape[0])
            loss_sum = correct = seen = 0
            for b in range(n_batches):
                idx = perm[b * batch_size:(b + 1) * batch_size]
                x, y = xtr[idx].to(dev), ytr[idx].to(dev)
                loss, info = em.backward(loss_fn, x, y)
                if info.nonfinite_input or info.nonfinite_output:
                    skipped += 1
                    log.warning("epoch %d batch %d: non-finite gradient after the %s all-reduce: step skipped",
                                epoch + 1, b, grad_format)
                else:
                    opt.step()
                loss_sum += loss.item() * y.shape[0]
                with torch.no_grad():
                    correct += (net(x).argmax(1) == y).sum().item() if b % 10 == 0 else 0
                    seen += y.shape[0] if b % 10 == 0 else 0
                ebar.advance(loss=loss_sum / ((b + 1) * batch_size), acc=correct / max(1, seen),
                             **{"img/s": f"{(b + 1) * batch_size / (time.perf_counter() - t0):.0f}"})
            sched.step()
            rec = dict(epoch=epoch + 1, train_loss=loss_sum / max(1, n_batches * batch_size),
                       train_acc=correct / max(1, seen), test_acc=_evaluate(net, xte, yte, 512, dev),
                       skipped_steps=skipped, seconds=time.perf_counter() - t0)
            history.append(rec)
            log.info("epoch %d: loss %.4f, test accuracy %.4f, skipped %d", rec["epoch"], rec["train_loss"],
                     rec["test_acc"], skipped)
            ebar.print(f"epoch {rec['epoch']}: loss {rec['train_loss']:.4f}  test acc {rec['test_acc']:.4f}  "
                       f"skipped {skipped}  ({rec['seconds']:.1f} s)")
            torch.save(dict(model=net.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(), history=history,
                            epoch=epoch + 1, skipped=skipped, rng=torch.get_rng_state(), config=config), ckpt)
    summary = dict(config=config, history=history, final_test_acc=history[-1]["test_acc"] if history else None,
                   skipped_steps=skipped)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2))
    if history:
        title = f"{model} {data}: grads {grad_format}, {'APS' if aps else 'no APS'}{', Kahan' if kahan else ''}, {nodes} nodes"
        _plot(history, title, out / "curves.png")
    return summary
