"""``tcprec train --task classify``: float training (or a float checkpoint), QAT fine-tuning, then the deployed
engine evaluated on the whole test set.

Data stays on the device as uint8 (Fashion-MNIST: 47 MB); each batch is normalised and augmented there in one
go (random crop of the zero-padded image, horizontal flip).  Float training runs under fp16 autocast with
channels_last tensors; SGD (Nesterov) with a OneCycle schedule and label smoothing.  QAT starts from the float
weights: SGD with a cosine schedule, no weight decay on the learned steps and BatchNorm, optional distillation
from the float model (KL at temperature 1 mixed with the label loss).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..data.fashion_mnist import load_fashion_mnist
from ..nn.qmodules import parse_precision
from ..progress import bar as progress_bar
from ..runtime import compile as tcompile
from ..train.models import MODELS

from .api import convert_qat, prepare_qat

__all__ = ["TrainData", "load_classify_data", "augment", "fit", "evaluate", "predict", "evaluate_deployed",
           "train_classify", "MEAN", "STD"]

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST pixel statistics


@dataclass
class TrainData:
    """uint8 images (N, H, W) and int64 labels, on the training device."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str


def load_classify_data(data: str = "fashion-mnist", data_path=None, device="cpu", limit_train=None,
                       limit_test=None) -> TrainData:
    """Fashion-MNIST (Debian ``dataset-fashion-mnist``) or scikit-learn's 8x8 ``digits`` (upscaled to 28x28),
    as uint8 tensors on ``device``."""
    if data == "fashion-mnist":

        xtr, ytr = load_fashion_mnist(data_path, "train")
        xte, yte = load_fashion_mnist(data_path, "test")
    elif data == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.from_numpy(d.images).float()[:, None] / 16.0  # (1797, 1, 8, 8) in [0, 1]
        x = (F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)[:, 0] * 255).round().to(torch.uint8)
        y = torch.from_numpy(d.target).long()
        g = torch.Generator().manual_seed(0)
        p = torch.randperm(x.shape[0], generator=g)
        x, y = x[p], y[p]
        xtr, ytr, xte, yte = x[:1400], y[:1400], x[1400:], y[1400:]
    else:
        raise ValueError(f"data must be 'fashion-mnist' or 'digits', got data={data!r}")
    xtr, ytr, xte, yte = xtr[:limit_train], ytr[:limit_train], xte[:limit_test], yte[:limit_test]
    dev = torch.device(device)
    return TrainData(xtr.to(dev), ytr.to(dev), xte.to(dev), yte.to(dev), data)


def normalize(x_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (N, H, W) -> float32 (N, 1, H, W), Fashion-MNIST's mean / std."""
    return ((x_u8.float() / 255 - MEAN) / STD).unsqueeze(1)


def augment(x_u8: torch.Tensor, pad: int = 2, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of the zero-padded (``pad``) image and a random horizontal flip, for a whole batch on its device;
    float32 (N, 1, H, W) normalised."""
    N, H, W = x_u8.shape
    dev = x_u8.device
    xp = F.pad(x_u8, (pad, pad, pad, pad))  # (N, H + 2p, W + 2p) uint8, zero border
    dy = torch.randint(0, 2 * pad + 1, (N,), device=dev, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (N,), device=dev, generator=generator)
    rows = (dy[:, None] + torch.arange(H, device=dev))[:, :, None]  # (N, H, 1)
    cols = (dx[:, None] + torch.arange(W, device=dev))[:, None, :]  # (N, 1, W)
    flip = torch.rand(N, device=dev, generator=generator) < 0.5
    cols = torch.where(flip[:, None, None], cols.flip(-1), cols)
    x = xp[torch.arange(N, device=dev)[:, None, None], rows, cols]  # (N, H, W) uint8
    return normalize(x)


@torch.no_grad()
def predict(model: nn.Module, x_u8: torch.Tensor, batch: int = 1000) -> torch.Tensor:
    """argmax predictions (N,) of ``model`` in eval mode (float32 input, channels_last on CUDA)."""
    model.eval()
    out = []
    for i in range(0, x_u8.shape[0], batch):
        x = normalize(x_u8[i:i + batch])
        if x.is_cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(model(x).argmax(1))
    return torch.cat(out)


def evaluate(model: nn.Module, x_u8: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    return float((predict(model, x_u8, batch) == y).float().mean())


def _param_groups(model: nn.Module, wd: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() <= 1 or n.endswith(".step") else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def fit(model: nn.Module, data: TrainData, *, epochs: int, lr: float, batch_size: int = 256, wd: float = 5e-4,
        schedule: str = "onecycle", label_smoothing: float = 0.1, teacher: nn.Module | None = None,
        distill: float = 0.5, amp: bool = True, progress: bool = True, state: dict | None = None,
        on_epoch=None, title: str = "train", seed: int = 0, compile: bool | str = False) -> dict:  # noqa: A002
    """Train ``model`` in place; returns ``state`` (history, optimizer, scheduler, epoch) for checkpoints.
    ``on_epoch(state)`` runs after every epoch (checkpointing); ``state`` from an earlier call resumes.
    ``compile``: run the training forward through ``torch.compile`` (True: the default backend; a string: that
    backend) -- the same parameters and the same model, compiled once (the fake quantizers are many small ops that
    only the compiler fuses: docs/qat.md measures 1.6x the fp16 step compiled against 3-6x eager); evaluation
    stays eager."""
    if not isinstance(compile, (bool, str)):
        raise TypeError(f"compile must be True / False or a torch.compile backend name, got {compile!r}")
    dev = data.x_train.device
    fwd = (torch.compile(model, backend=compile) if isinstance(compile, str) else torch.compile(model)) \
        if compile else model
    opt = torch.optim.SGD(_param_groups(model, wd), lr=lr, momentum=0.9, nesterov=True)
    steps = data.x_train.shape[0] // batch_size
    if steps < 1:
        raise ValueError(f"batch_size={batch_size} exceeds the {data.x_train.shape[0]} training images")
    if schedule == "onecycle":
        if epochs * steps < 4:
            raise ValueError(f"the OneCycle schedule needs at least 4 steps, got {epochs * steps} (epochs={epochs}, "
                             f"{steps} batches of {batch_size}): train longer or use smaller batches")
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps,
                                                    pct_start=min(0.5, max(0.25, 2 / (epochs * steps))))
    elif schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / (epochs * steps))))
    else:
        raise ValueError(f"schedule must be 'onecycle' or 'cosine', got {schedule!r}")
    state = state or {"history": [], "epoch": 0}
    if "opt" in state:
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    g = torch.Generator(device=dev).manual_seed(seed + 1000 * state["epoch"])
    use_amp = amp and dev.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for epoch in range(state["epoch"], epochs):
        with progress_bar(steps, f"{title} {epoch + 1}/{epochs}", quiet=not progress, transient=False) as bar:
            model.train()
            t0 = time.perf_counter()
            perm = torch.randperm(data.x_train.shape[0], device=dev, generator=g)
            loss_sum = torch.zeros((), device=dev)
            correct = torch.zeros((), device=dev)
            step_times = []
            for b in range(steps):
                ts = time.perf_counter()
                idx = perm[b * batch_size:(b + 1) * batch_size]
                x = augment(data.x_train[idx], generator=g)
                if x.is_cuda:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = data.y_train[idx]
                with torch.autocast(dev.type, dtype=torch.float16, enabled=use_amp):
                    out = fwd(x)
                    loss = F.cross_entropy(out.float(), y, label_smoothing=label_smoothing)
                    if teacher is not None:
                        with torch.no_grad():
                            t = teacher(x).float()
                        kd = F.kl_div(F.log_softmax(out.float(), 1), F.log_softmax(t, 1), reduction="batchmean",
                                      log_target=True)
                        loss = (1 - distill) * loss + distill * kd
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                loss_sum += loss.detach() * y.shape[0]
                correct += (out.argmax(1) == y).sum()
                if progress and (b % 20 == 0 or b == steps - 1):  # float() synchronizes: not every step
                    seen = (b + 1) * batch_size
                    bar.update(completed=b + 1, loss=float(loss_sum) / seen, acc=float(correct) / seen,
                               **{"img/s": f"{seen / (time.perf_counter() - t0):.0f}"})
                if dev.type == "cuda" and b in (steps // 2, steps // 2 + 1, steps // 2 + 2):
                    torch.cuda.synchronize()
                    step_times.append(time.perf_counter() - ts)
            seen = steps * batch_size
            rec = {"epoch": epoch + 1, "train_loss": float(loss_sum) / seen, "train_acc": float(correct) / seen,
                   "test_acc": evaluate(model, data.x_test, data.y_test), "seconds": time.perf_counter() - t0,
                   "lr": sched.get_last_lr()[0]}
            if step_times:
                rec["step_ms"] = 1e3 * sorted(step_times)[len(step_times) // 2]
            state["history"].append(rec)
            state.update(epoch=epoch + 1, opt=opt.state_dict(), sched=sched.state_dict())
            bar.update(completed=steps, loss=rec["train_loss"], acc=rec["train_acc"], test=rec["test_acc"],
                       **{"img/s": f"{seen / rec['seconds']:.0f}"})
            if on_epoch:
                on_epoch(state)
    return state


def evaluate_deployed(deployed: nn.Module, data: TrainData, batch: int = 256, reference=None) -> dict:
    """Accuracy of the deployed model on the whole test set through ``tcprec.compile`` (a CUDA graph on a GPU; the
    last batch padded to ``batch``), the engine's latency at ``batch`` and -- given ``reference`` predictions (the
    QAT model's) -- how many predictions agree."""

    dev = data.x_test.device
    N = data.x_test.shape[0]
    b = min(batch, N)
    example = normalize(data.x_test[:b])
    eng = tcompile(deployed, example, device=dev)
    preds, logits = [], []
    for i in range(0, N, b):
        x = normalize(data.x_test[i:i + b])
        n = x.shape[0]
        if n < b:
            x = torch.cat([x, x.new_zeros((b - n, *x.shape[1:]))])
        y = eng(x)[:n]
        logits.append(y.float())
        preds.append(y.argmax(1))
    pred = torch.cat(preds)
    res = {"test_acc": float((pred == data.y_test).float().mean()), "n": N, "engine_mode": eng.mode}
    if eng.mode == "cuda-graph":
        eng._static_in.copy_(example)
        ts = []
        for _ in range(3):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(20):
                eng.replay()
            en.record()
            torch.cuda.synchronize()
            ts.append(st.elapsed_time(en) / 20)
        res["latency_ms"] = sorted(ts)[1]
        res["latency_batch"] = b
    if reference is not None:
        res["agree"] = int((pred == reference).sum())
    res["pred"] = pred
    res["logits"] = torch.cat(logits)
    return res


def _plot(history: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    for phase, mark in (("float", "o-"), ("qat", "s-")):
        h = [r for r in history if r["phase"] == phase]
        if h:
            x = [r["step"] for r in h]
            ax[0].plot(x, [r["test_acc"] for r in h], mark, label=f"{phase} test")
            ax[0].plot(x, [r["train_acc"] for r in h], mark, alpha=0.4, label=f"{phase} train")
            ax[1].plot(x, [r["train_loss"] for r in h], mark, label=phase)
    ax[0].set_xlabel("epoch")
    ax[0].set_ylabel("accuracy")
    ax[1].set_xlabel("epoch")
    ax[1].set_ylabel("train loss")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_model(name: str) -> nn.Module:

    if name not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got model={name!r}")
    return MODELS[name]()


def _resumable_fit(module: nn.Module, data: TrainData, ckpt: Path, resume: bool, device, record: dict, *,
                   epochs: int, **fit_kw) -> dict:
    """``fit`` that saves ``{"model", "state", **record}`` to ``ckpt`` after every epoch and, with ``resume``,
    starts from that checkpoint when it exists (a finished phase is not trained again); returns fit's state."""
    state = None
    if resume and ckpt.is_file():
        st = torch.load(ckpt, map_location=device, weights_only=False)
        module.load_state_dict(st["model"])
        state = st["state"]

    def save(s):
        torch.save({"model": module.state_dict(), "state": s, **record}, ckpt)

    if state is None or state["epoch"] < epochs:
        state = fit(module, data, epochs=epochs, state=state, on_epoch=save, **fit_kw)
    return state


def train_classify(model: str = "resnet18", precision: str = "w1a2", data: str = "fashion-mnist", data_path=None,
                   epochs: int = 15, qat_epochs: int = 8, init=None, lr: float = 0.2, qat_lr: float = 0.02,
                   batch_size: int = 256, distill: float = 0.0, act_quant: str = "lsq", out_dir="runs/qat",
                   resume: bool = False, limit_train=None, limit_test=None, device: str = "auto", seed: int = 0,
                   progress: bool = True, console=None, compile: bool | str = False) -> dict:  # noqa: A002
    """Float training (``epochs``; or ``init``, a float checkpoint), QAT at ``precision`` (``qat_epochs``), then the
    deployed engine on the test set.  Writes ``out_dir``/float.pt, qat.pt, metrics.json, curves.png.  ``compile``:
    both phases' training forward through ``torch.compile`` (``fit``)."""

    prec = parse_precision(precision)  # ValueError names the vocabulary
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ds = load_classify_data(data, data_path, dev, limit_train, limit_test)
    net = build_model(model).to(dev)
    if dev.type == "cuda":
        net = net.to(memory_format=torch.channels_last)
    config = dict(model=model, precision=precision, data=data, epochs=epochs, qat_epochs=qat_epochs, lr=lr,
                  qat_lr=qat_lr, batch_size=batch_size, distill=distill, act_quant=act_quant, seed=seed,
                  limit_train=limit_train, limit_test=limit_test, init=str(init) if init else None, compile=compile)
    say = console.print if console is not None else print
    # -- float phase --
    fckpt = out / "float.pt"
    if init is not None:
        st = torch.load(init, map_location=dev, weights_only=False)
        net.load_state_dict(st["model"] if "model" in st else st)
        fstate = {"history": [], "epoch": epochs, "loaded": str(init)}
    else:
        fstate = _resumable_fit(net, ds, fckpt, resume, dev, dict(config=config, kind="float", model_name=model),
                                epochs=epochs, lr=lr, batch_size=batch_size, schedule="onecycle", progress=progress,
                                title="float", seed=seed, compile=compile)
    float_acc = evaluate(net, ds.x_test, ds.y_test)
    say(f"float {model}: test accuracy {float_acc:.4f}")
    history = [dict(r, phase="float", step=r["epoch"]) for r in fstate["history"]]
    result = {"config": config, "float_test_acc": float_acc}
    if prec is None:
        result["history"] = history
        (out / "metrics.json").write_text(json.dumps(result, indent=2))
        _plot(history, f"{model} {data}: float", out / "curves.png")
        return result
    # -- QAT phase --
    qat = prepare_qat(net, precision, act_quant=act_quant)
    teacher = None
    if distill > 0:
        import copy

        teacher = copy.deepcopy(net).eval()
    qckpt = out / "qat.pt"
    qstate = _resumable_fit(qat, ds, qckpt, resume, dev,
                            dict(config=config, kind="qat", model_name=model, precision=precision),
                            epochs=qat_epochs, lr=qat_lr, batch_size=batch_size, wd=5e-5, schedule="cosine",
                            label_smoothing=0.0, teacher=teacher, distill=distill, progress=progress,
                            title=f"QAT {precision}", seed=seed + 1, compile=compile)
    history += [dict(r, phase="qat", step=len(fstate["history"]) + r["epoch"]) for r in qstate["history"]]
    qat_pred = predict(qat, ds.x_test)
    qat_acc = float((qat_pred == ds.y_test).float().mean())
    deployed = convert_qat(qat)
    dep = evaluate_deployed(deployed, ds, reference=qat_pred)
    result.update(qat_test_acc=qat_acc, deployed_test_acc=dep["test_acc"], deployed_agree=dep["agree"],
                  test_images=dep["n"], engine_mode=dep["engine_mode"], latency_ms=dep.get("latency_ms"),
                  latency_batch=dep.get("latency_batch"), history=history)
    say(f"QAT {precision}: fake-quant test accuracy {qat_acc:.4f}; deployed engine ({dep['engine_mode']}) "
        f"{dep['test_acc']:.4f} on {dep['n']} images, predictions equal on {dep['agree']}/{dep['n']}"
        + (f", {dep['latency_ms']:.3f} ms at batch {dep['latency_batch']}" if "latency_ms" in dep else ""))
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    _plot(history, f"{model} {data}: float then QAT {precision}", out / "curves.png")
    return result
