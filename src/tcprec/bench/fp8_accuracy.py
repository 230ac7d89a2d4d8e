"""``tcprec bench fp8-accuracy``: FP8 networks against their exact reference on the GPU (issue 40).

Per layer and whole network, for both accumulation modes (``QuantConfig(fp8_accum="fp32")``, the default: Hopper's
fp8 MMA accumulator promoted into fp32 every BLOCK_K products; ``"fast"``: the narrow accumulator over the whole
reduction), with the time of one forward of each.

Per layer: every FP8 QConv2d / QLinear of an unchained copy (``chain=False``: float in, float out) is called on
the inputs it saw in the network, once on its GPU kernel and once on the reference backend (F.conv2d on the
decoded codes in float64), both with a float32 output so that only the accumulation differs; the error is
reported relative to ``A = sum |x_q| |w_q| |scale|`` (the bound's unit: docs/numerics.md) and as a relative L2.
Whole network: the default (chained) model against a deep copy on the reference backend, relative L2 of the
outputs.  Decision 0040 reads its numbers from ``benchmarks/results/fp8_accuracy.json``.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from ..nn import models as zoo
from ..nn import QConv2d, QLinear, QuantConfig, quantize_model
from ..ops import qconv as qc
from .common import git_commit, require_cuda, write_json

__all__ = ["ACCUM_MODES", "TARGET_REL_L2", "run"]

ACCUM_MODES = ("fp32", "fast")
TARGET_REL_L2 = 0.01  # a network's fp8 output (fp8_accum="fp32") within 1% of its reference, relative L2


def _rel(y, ref) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def _reference_copy(q):
    r = copy.deepcopy(q)
    for m in r.modules():
        if isinstance(m, (QConv2d, QLinear)):
            m.backend = "reference"
    return r


def _abs_bound_unit(m, args) -> torch.Tensor:
    """A = sum |x_q| |w_q| |scale| of each output (pooled like the output), float64."""
    x = args[0]
    if isinstance(m, QLinear):
        xq = qc.quantize_fp8_static(x.reshape(-1, m.in_features), m.in_scale).dequantize().double().abs()
        wq = m.weight.qw.dequantize().reshape(m.out_features, m.in_features).double().abs()
        return xq @ wq.t()
    xq = qc.quantize_fp8_static(x.permute(0, 2, 3, 1), m.in_scale).dequantize().double().abs().permute(0, 3, 1, 2)
    wq = m.weight.qw.dequantize().permute(0, 3, 1, 2).double().abs()  # KRSC -> KCRS
    a = F.conv2d(xq, wq, stride=m.stride, padding=m.padding, dilation=m.dilation)
    if m.ch_scale is not None:
        a = a * m.ch_scale.double().abs().view(1, -1, 1, 1)
    if m.pool is not None:
        a = F.max_pool2d(a, 2, 2)
    return a


@torch.no_grad()
def per_layer(m_float, x, mode: str) -> list[dict]:
    """Each FP8 layer of an unchained copy: its GPU kernel against its reference backend on the same inputs."""
    q = quantize_model(m_float, QuantConfig("fp8", fp8_accum=mode, chain=False), calibration=x, warn=False)
    calls = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=n: calls.append((n, mod, args)))
             for n, mod in q.named_modules() if isinstance(mod, (QConv2d, QLinear)) and mod.precision.fp8]
    try:
        q(x)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for name, mod, args in calls:
        args32 = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        out_dtype, backend = mod.out_dtype, mod.backend
        mod.out_dtype = torch.float32  # on the copy q, restored below: only the accumulation differs
        try:
            y_gpu = mod(*args32).double()
            mod.backend = "reference"
            y_ref = mod(*args32).double()
        finally:
            mod.out_dtype, mod.backend = out_dtype, backend
        a = _abs_bound_unit(mod, args32)
        if isinstance(mod, QConv2d) and mod.has_residual:
            a = a + args32[1].double().abs()
        err = (y_gpu - y_ref).abs()
        k = mod.in_channels * mod.kernel_size[0] * mod.kernel_size[1] if isinstance(mod, QConv2d) else mod.in_features
        rows.append({"layer": name, "K": k, "rel_l2": _rel(y_gpu, y_ref),
                     "max_err_over_A": float((err / a.clamp_min(1e-30)).max()),
                     "max_err_over_max_ref": float(err.max() / y_ref.abs().max().clamp_min(1e-300))})
    return rows


def _time_ms(fn, reps=20) -> float:
    """Median of ``reps`` calls timed with CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


@torch.no_grad()
def whole_network(m_float, x, mode: str, first_last) -> dict:
    """The chained FP8 network against a deep copy on the reference backend, and that reference against float."""
    q = quantize_model(m_float, QuantConfig("fp8", fp8_accum=mode, first_last=first_last), calibration=x, warn=False)
    r = _reference_copy(q)
    y, y_ref, y_float = q(x), r(x), m_float(x)
    return {"mode": mode, "first_last": first_last, "rel_l2_vs_reference": _rel(y, y_ref),
            "rel_l2_reference_vs_float": _rel(y_ref, y_float), "forward_ms": round(_time_ms(lambda: q(x)), 3)}



def run(nets: Sequence[str] = ("resnet18", "vgg"), batch: int = 8, first_last: str | None = "float",
        out="benchmarks/results/fp8_accuracy.json", command: str = "tcprec bench fp8-accuracy",
        console=None) -> dict:
    """Measure every net at both accumulation modes, write JSON to ``out`` after each row, return it.

    ``first_last``: precision of the first conv and last layer (``"float"`` needs no int8 stem compile; ``None``:
    the same FP8 as the rest).  Raises ``NeedsGPU`` without a CUDA device: the point is the GPU kernels.
    """
    from rich.console import Console

    console = console or Console(stderr=True)
    dev = require_cuda("tcprec bench fp8-accuracy")
    result = {"suite": "fp8_accuracy", "command": command,
              "device": torch.cuda.get_device_name(dev) + f", torch {torch.__version__}",
              "commit": git_commit(), "summary": [], "targets": [], "per_layer": {}}
    for name in nets:
        m = zoo.build(name, device=dev).to(dtype=torch.float16, memory_format=torch.channels_last)
        c, h, w = zoo.INPUT_SHAPES[name]
        x = torch.randn(batch, c, h, w, device=dev, generator=torch.Generator(dev).manual_seed(0)).half()
        for mode in ACCUM_MODES:
            t0 = time.perf_counter()
            rows = per_layer(m, x, mode)
            result["per_layer"][f"{name}/{mode}"] = rows
            net = whole_network(m, x, mode, first_last)
            result["summary"].append({"net": name, "fp8_accum": mode,
                                      "net_rel_l2": round(net["rel_l2_vs_reference"], 5),
                                      "ref_vs_float": round(net["rel_l2_reference_vs_float"], 4),
                                      "worst_layer_rel_l2": max(r["rel_l2"] for r in rows),
                                      "worst_err_over_A": max(r["max_err_over_A"] for r in rows),
                                      "forward_ms": net["forward_ms"], "s": round(time.perf_counter() - t0, 1)})
            console.print(result["summary"][-1], markup=False)
            write_json(out, result)
        fp32, fast = result["summary"][-2], result["summary"][-1]
        result["targets"].append({"target": f"{name} fp8 (fp8_accum='fp32') within 1% of its reference (rel L2)",
                                  "value": f"{fp32['net_rel_l2']:.4f} (fast: {fast['net_rel_l2']:.4f})",
                                  "met": fp32["net_rel_l2"] <= TARGET_REL_L2})
        write_json(out, result)
    console.print(f"wrote {out}")
    return result
