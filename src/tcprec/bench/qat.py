"""``tcprec bench qat``: train on Fashion-MNIST, quantize (PTQ int8, QAT w2a2 / w1a2 / w1a1), deploy, and measure
-- every number from one run on one GPU.

Per model: float training (fp16 autocast, ``qat.trainer.fit``), the fp32 test accuracy; int8 post-training
quantization (``quantize_model`` calibrated on 512 training images); for each QAT precision the fine-tuning from the
float weights, the fake-quant model's test accuracy (eval mode: the deployed arithmetic), ``convert_qat`` and the
deployed ``tcprec.compile`` engine on all test images: accuracy and how many predictions equal the fake-quant model's.
Timings: the training step (QAT vs the float model's fp16-autocast step, both synchronised mid-epoch steps), and the
deployed engines' forward at batch 256 beside the fp16 / fp32 float model (``time_graph_ms``: CUDA-graph replays).
The JSON is rewritten after every stage, so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import copy
import time

import torch
from rich.console import Console

from ..nn.convert import QuantConfig, quantize_model
from ..qat import convert_qat, prepare_qat
from ..qat.trainer import (augment, build_model, evaluate, evaluate_deployed, fit, load_classify_data, normalize,
                           predict)
from .common import environment, print_environment, require_cuda, time_graph_ms, write_json

__all__ = ["run"]


def _latency(fn, x) -> float:
    with torch.no_grad():
        return time_graph_ms(lambda: fn(x), None, calls=2, replays=5)


def _step_ms(model, ds, batch_size: int, steps: int = 10, compiled: bool = False) -> float:
    """ms per training step (fp16 autocast forward, backward, SGD step) of a copy of ``model`` on one fixed batch:
    CUDA events around ``steps`` steps after 3 warm-up steps (which include ``torch.compile``'s compilation when
    ``compiled``: the model, not the optimizer step, is compiled -- on both sides of a comparison)."""
    import torch.nn.functional as F

    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)
    if compiled:
        m = torch.compile(m)
    scaler = torch.amp.GradScaler("cuda")
    x = augment(ds.x_train[:batch_size]).contiguous(memory_format=torch.channels_last)
    y = ds.y_train[:batch_size]

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(m(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        step()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    st.record()
    for _ in range(steps):
        step()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) / steps


def run(models=("resnet18", "vgg"), precisions=("w2a2", "w1a2", "w1a1"), vgg_precisions=("w1a2",), epochs: int = 15,
        qat_epochs: int = 6, vgg_epochs: int = 10, vgg_qat_epochs: int = 5, batch_size: int = 256, lr: float = 0.1,
        qat_lr: float = 0.02, distill: float = 0.5, limit_train=None, data_path=None, budget_s: float = 540.0,
        compile_step: bool = True,
        out="benchmarks/results/qat.json", command: str = "tcprec bench qat", console: Console | None = None) -> dict:

    t_start = time.time()
    console = console or Console()
    dev = require_cuda(command)
    env = environment()
    print_environment(console, env)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 (and the exact integer convs need it off)
    torch.backends.cuda.matmul.allow_tf32 = False
    ds = load_classify_data("fashion-mnist", data_path, dev, limit_train)
    payload = {"suite": "qat", "command": command, "device": env.get("gpu"), "commit": env.get("commit"),
               "environment": env, "config": dict(epochs=epochs, qat_epochs=qat_epochs, vgg_epochs=vgg_epochs,
                                                  vgg_qat_epochs=vgg_qat_epochs, batch_size=batch_size, lr=lr,
                                                  qat_lr=qat_lr, distill=distill, limit_train=limit_train,
                                                  compile_step=compile_step),
               "summary": [], "targets": [], "runs": {}, "skipped": []}

    def save():
        payload["wall_s"] = round(time.time() - t_start, 1)
        payload["targets"] = _targets(payload["summary"])
        write_json(out, payload)

    left = lambda: budget_s - (time.time() - t_start)  # noqa: E731
    x256 = normalize(ds.x_test[:256]).contiguous(memory_format=torch.channels_last)
    qat_epoch_s: dict[str, float] = {}
    for name in models:
        ep, qep, precs = (epochs, qat_epochs, precisions) if name == "resnet18" else \
            (vgg_epochs, vgg_qat_epochs, vgg_precisions)
        if payload["runs"] and left() < 0.35 * budget_s:
            payload["skipped"].append(f"{name}: {left():.0f} s left")
            console.print(f"[yellow]skipping {name}: {left():.0f} s left")
            continue
        torch.manual_seed(0)
        net = build_model(name).to(dev).to(memory_format=torch.channels_last)
        st = fit(net, ds, epochs=ep, lr=lr, batch_size=batch_size,
                 schedule="onecycle", title=f"{name} float", progress=True)
        acc = evaluate(net, ds.x_test, ds.y_test)
        fp16_step = _step_ms(net, ds, batch_size)
        fp16_step_c = _step_ms(net, ds, batch_size, compiled=True) if compile_step else None
        net.eval()
        n16 = copy.deepcopy(net).half()
        row = {"model": name, "precision": "fp32", "method": "float", "test_acc": acc,
               "train_step_ms": fp16_step, "train_step_ms_compiled": fp16_step_c, "latency_ms_b256": _latency(net, x256),
               "epochs": ep, "train_s": round(sum(h["seconds"] for h in st["history"]), 1)}
        payload["summary"].append(row)
        payload["summary"].append({"model": name, "precision": "fp16", "method": "float (same weights)",
                                   "latency_ms_b256": _latency(n16, x256.half())})
        payload["runs"][f"{name}/float"] = st["history"]
        console.print(f"{name} fp32: {acc:.4f} (fp16-autocast step {fp16_step} ms)")
        save()
        if name == "resnet18":  # int8 post-training quantization, calibrated on 512 training images
            calib = normalize(ds.x_train[:512]).contiguous(memory_format=torch.channels_last)
            q8 = quantize_model(net, QuantConfig("int8", first_last=None), calibration=calib, warn=False)
            dep = evaluate_deployed(q8, ds)
            payload["summary"].append({"model": name, "precision": "int8", "method": "PTQ", "test_acc": dep["test_acc"],
                                       "latency_ms_b256": _latency(q8, x256), "delta_vs_fp32": dep["test_acc"] - acc})
            console.print(f"{name} int8 PTQ: {dep['test_acc']:.4f}")
            save()
        for prec in precs:
            float_epoch = sorted(h["seconds"] for h in st["history"])[len(st["history"]) // 2]
            est = qat_epoch_s.get(name, 2.5 * float_epoch) * qep + 20  # the last QAT run's epochs, + conversion
            if left() < est:
                payload["skipped"].append(f"{name} {prec}: {left():.0f} s left, needs ~{est:.0f} s")
                console.print(f"[yellow]skipping {name} {prec}: {left():.0f} s left")
                save()
                continue
            qat = prepare_qat(net, prec)
            teacher = net if distill > 0 else None
            qs = fit(qat, ds, epochs=qep, lr=qat_lr, batch_size=batch_size, wd=5e-5, schedule="cosine",
                     label_smoothing=0.0, teacher=teacher, distill=distill, title=f"{name} QAT {prec}", progress=True,
                     seed=1)
            qat_epoch_s[name] = sorted(h["seconds"] for h in qs["history"])[len(qs["history"]) // 2]
            qat_step = _step_ms(qat, ds, batch_size)  # without the distillation teacher: the QAT model's own step
            qat_step_c = _step_ms(qat, ds, batch_size, compiled=True) if compile_step else None
            qpred = predict(qat, ds.x_test)
            qacc = float((qpred == ds.y_test).float().mean())
            t0 = time.time()
            deployed = convert_qat(qat)
            dep = evaluate_deployed(deployed, ds, reference=qpred)
            with torch.no_grad():  # logits of the first 256 test images, both sides
                qat.eval()
                lq = qat(x256)
                ld = deployed(x256)
            r = {"model": name, "precision": prec, "method": "QAT", "test_acc_fake_quant": qacc,
                 "test_acc": dep["test_acc"], "delta_vs_fp32": dep["test_acc"] - acc,
                 "agree": f"{dep['agree']}/{dep['n']}", "logits_equal_b256": bool(torch.equal(lq, ld)),
                 "train_step_ms": qat_step, "step_vs_fp16_autocast": (qat_step / fp16_step) if qat_step and fp16_step
                 else None, "train_step_ms_compiled": qat_step_c,
                 "step_vs_fp16_autocast_compiled": (qat_step_c / fp16_step_c) if qat_step_c and fp16_step_c else None,
                 "latency_ms_b256": _latency(deployed, x256), "epochs": qep,
                 "convert_eval_s": round(time.time() - t0, 1)}
            payload["summary"].append(r)
            payload["runs"][f"{name}/{prec}"] = qs["history"]
            payload.setdefault("layers", {})[f"{name}/{prec}"] = [vars(x) for x in deployed.tcprec_summary.layers]
            console.print(f"{name} {prec}: fake-quant {qacc:.4f}, deployed {dep['test_acc']:.4f}, "
                          f"agree {dep['agree']}/{dep['n']}, step {qat_step} ms vs {fp16_step} ms")
            save()
            del qat, deployed
            torch.cuda.empty_cache()
    save()
    return payload


def _targets(rows: list[dict]) -> list[dict]:
    by = {(r["model"], r["precision"]): r for r in rows}
    fp = by.get(("resnet18", "fp32"), {}).get("test_acc")
    out = []

    def add(target, value, met):
        out.append({"target": target, "value": value, "met": met})

    if fp is not None:
        add("ResNet-18 fp32 >= 94.0%", f"{100 * fp:.2f}%", fp >= 0.94)
    for prec, tol in (("w2a2", 1.0), ("w1a2", 1.5)):
        r = by.get(("resnet18", prec))
        if r and fp is not None:
            add(f"ResNet-18 {prec} >= fp32 - {tol}", f"{100 * r['test_acc']:.2f}% ({100 * (r['test_acc'] - fp):+.2f})",
                r["test_acc"] >= fp - tol / 100)
    r8 = by.get(("resnet18", "int8"))
    if r8 and fp is not None:
        add("ResNet-18 int8 PTQ >= fp32 - 0.3", f"{100 * r8['test_acc']:.2f}% ({100 * (r8['test_acc'] - fp):+.2f})",
            r8["test_acc"] >= fp - 0.003)
    vf, vq = by.get(("vgg", "fp32")), by.get(("vgg", "w1a2"))
    if vf and vq:
        add("VGG-variant w1a2 >= fp32 - 1.5", f"{100 * vq['test_acc']:.2f}% ({100 * (vq['test_acc'] - vf['test_acc']):+.2f})",
            vq["test_acc"] >= vf["test_acc"] - 0.015)
    for r in rows:
        if r.get("method") == "QAT":
            a, n = map(int, r["agree"].split("/"))
            add(f"{r['model']} {r['precision']}: deployed == fake-quant predictions", r["agree"], a == n)
            # both sides under torch.compile when measured (the issue: "works under torch.compile for speed"), else eager
            ratio = r.get("step_vs_fp16_autocast_compiled") or r.get("step_vs_fp16_autocast")
            if ratio is not None:
                how = "compiled" if r.get("step_vs_fp16_autocast_compiled") else "eager"
                add(f"{r['model']} {r['precision']}: QAT step <= 2x fp16-autocast step ({how}, both sides)",
                    f"{ratio:.2f}x (eager {r['step_vs_fp16_autocast']:.2f}x)" if r.get("step_vs_fp16_autocast")
                    else f"{ratio:.2f}x", ratio <= 2.0)
    return out
