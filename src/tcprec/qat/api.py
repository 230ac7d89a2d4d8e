"""``prepare_qat`` -> train -> ``convert_qat``: quantization-aware training that deploys bit-exactly.

``prepare_qat(model, config)`` asks ``quantize_model``'s own planner (``nn.convert.plan_layers``: same tracer,
first/last rule, overrides, BatchNorm folding) which layers it quantizes and swaps exactly those for
``QATConv2d`` / ``QATLinear`` (a folded BatchNorm moves into its conv, an ``nn.Identity`` takes its place).
``convert_qat(qat_model)`` rebuilds the float skeleton and calls ``quantize_model`` with every layer's learned
scales, codes and epilogue fixed (``FixedQuant``): the same ``QConv2d`` / ``QLinear`` modules, fusion and chaining,
no recalibration.  In eval mode the QAT model computes the deployed arithmetic (``layers``), so the two give
the same codes at every layer and the same outputs.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..nn.convert import LayerPlan, QuantConfig, plan_layers, quantize_model
from ..nn.qmodules import FixedQuant, parse_precision
from ..ops.cast import encode
from ..qtensor import PerChannel, QTensor
from .layers import QATConv2d, QATLinear

__all__ = ["QATInfo", "prepare_qat", "convert_qat", "qat_layers", "ACT_QUANT"]

ACT_QUANT = ("lsq", "pact")


@dataclass
class QATInfo:
    """What ``prepare_qat`` decided (kept on the model as ``model.tcprec_qat``)."""

    config: QuantConfig
    act_quant: str
    layers: list[LayerPlan]
    input_shape: tuple | None = None  # (C, H, W) of the first input seen: convert_qat's example input


def _check_config(config) -> QuantConfig:
    cfg = QuantConfig(precision=config) if isinstance(config, str) else config
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"config must be a QuantConfig or a precision string like 'w1a2', got {type(config).__name__}")
    named = [("precision", cfg.precision), ("first_last", cfg.first_last)] + \
            [(f"overrides[{k!r}]", v) for k, v in dict(cfg.overrides).items()]
    for what, text in named:
        p = parse_precision(text)
        if p is not None and p.fp8:
            raise ValueError(f"{what}={text!r}: QAT trains integer precisions (the bit-serial and INT8 engines: "
                             f"'w1a2', 'w2a2', 'w4a4', 'int8', ...); fp8 has no integer codes to learn -- use "
                             f"tcprec.quantize_model(model, 'fp8') (post-training) or pick an integer precision")
    return cfg


def _set(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def prepare_qat(model: nn.Module, config: QuantConfig | str = "w1a2", *, act_quant: str = "lsq") -> nn.Module:
    """A trainable copy of ``model`` with fake quantization on every layer ``quantize_model(model, config)``
    quantizes (``model`` is not changed).

    ``config``: a :class:`~tcprec.QuantConfig` or a precision string (``"w1a2"``, ``"w2a2"``, ``"w4a4"``,
    ``"int8"``); first conv and last layer int8 by default, per-layer ``overrides`` honoured.
    ``act_quant``: ``"lsq"`` (learned step) or ``"pact"`` (learned clip) for inputs after a ReLU.

    >>> import torch, tcprec as tp
    >>> m = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    ...                         torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
    ...                         torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))
    >>> q = tp.prepare_qat(m, "w1a2")
    >>> [type(q[i]).__name__ for i in (0, 1, 3, 6)]
    ['QATConv2d', 'Identity', 'QATConv2d', 'QATLinear']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if act_quant not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}, got {act_quant!r}")
    if hasattr(model, "tcprec_qat"):
        raise ValueError("model is already prepared for QAT (it has tcprec_qat); train it, then tcprec.convert_qat(model)")
    cfg = _check_config(config)
    plans, _ = plan_layers(model, cfg)
    qat = copy.deepcopy(model)
    mods = dict(qat.named_modules())
    for p in plans:
        if p.precision is None:
            continue
        if p.kind == "conv":
            new = QATConv2d(mods[p.name], p.precision, mods[p.bn] if p.bn else None, act_quant)
            if p.bn:
                _set(qat, p.bn, nn.Identity())
        else:
            new = QATLinear(mods[p.name], p.precision, act_quant)
        _set(qat, p.name, new.to(mods[p.name].weight.device))
    quantized = [p for p in plans if p.precision is not None]
    floats = [p for p in plans if p.precision is None]
    if not quantized:
        warnings.warn(f"prepare_qat: {type(model).__name__} has no layer to quantize (no nn.Conv2d / nn.Linear that "
                      f"{cfg.precision!r} applies to); the copy trains in float", stacklevel=2)
    elif floats:
        warnings.warn("prepare_qat: layer(s) stay in floating point as quantize_model keeps them: "
                      + ", ".join(f"{p.name} ({p.why_float})" for p in floats), stacklevel=2)
    info = QATInfo(cfg, act_quant, plans)
    qat.tcprec_qat = info
    qat.register_forward_pre_hook(_RecordShape(info))
    return qat


class _RecordShape:
    """Forward pre-hook: the first input's (C, H, W), for convert_qat's example input (a class, so that a prepared
    model pickles with torch.save)."""

    def __init__(self, info: QATInfo):
        self.info = info

    def __call__(self, mod, args):
        if self.info.input_shape is None and args and isinstance(args[0], torch.Tensor):
            self.info.input_shape = tuple(args[0].shape[1:])


def qat_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> QATConv2d / QATLinear of a prepared model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (QATConv2d, QATLinear))}


def _fixed(m: QATConv2d | QATLinear) -> FixedQuant:
    wq, s_w = m.weight_quant.codes(m.weight)  # integer values (K, C, R, S) / (N, K) float32, scales (K,)
    fmt = m.weight_quant.fmt
    vals = wq.permute(0, 2, 3, 1) if wq.dim() == 4 else wq[:, None, None, :]  # KRSC / (N, 1, 1, K)
    vals = vals.contiguous()
    codes = encode(vals, fmt, "nearest")  # exact integers of the format: the code patterns
    qw = QTensor(codes, s_w.view(-1, 1, 1, 1).contiguous(), fmt, PerChannel(0), tuple(vals.shape), torch.float32)
    scale, bias = m.epilogue() if isinstance(m, QATConv2d) else (None, None if m.bias is None else m.bias.detach())
    return FixedQuant(m.act_quant.scale().detach().reshape(1).clone(), m.act_quant.is_signed, qw, scale, bias)


@torch.no_grad()
def convert_qat(model: nn.Module, example_input: torch.Tensor | None = None) -> nn.Module:
    """The deployable model of a trained ``prepare_qat`` model: ``quantize_model``'s ``QConv2d`` / ``QLinear``,
    fusion and chaining, with the learned scales and codes (no recalibration).  Run it as it is, or through
    ``tcprec.compile``.  On the same input every layer's codes equal the QAT model's in eval mode.

    ``example_input``: a batch for tracing (shapes only); by default zeros of the first input the QAT model saw.
    """
    info = getattr(model, "tcprec_qat", None)
    if not isinstance(info, QATInfo):
        raise TypeError(f"convert_qat needs a model from tcprec.prepare_qat (got a {type(model).__name__} without "
                        "tcprec_qat): call qat = tcprec.prepare_qat(model, 'w1a2'), train qat, then convert_qat(qat); "
                        "for post-training quantization use tcprec.quantize_model(model, 'w1a2', calibration=x)")
    layers = qat_layers(model)
    fresh = [n for n, m in layers.items() if not m.act_quant.ready]
    if fresh:
        raise ValueError(f"layer(s) {fresh[:4]} never saw data, so their activation step is not set: run at least one "
                         "forward pass (training) through the QAT model before convert_qat")
    if example_input is None:
        if info.input_shape is None:
            raise ValueError("pass example_input= (the QAT model has not recorded an input shape)")
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        example_input = torch.zeros((2, *info.input_shape), device=dev)
    skeleton = copy.deepcopy(model)
    for h, fn in list(skeleton._forward_pre_hooks.items()):
        if isinstance(fn, _RecordShape):
            skeleton._forward_pre_hooks.pop(h)
    del skeleton.tcprec_qat
    fixed = {}
    for name, m in layers.items():
        if isinstance(m, QATConv2d):
            f = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                          bias=m.bias is not None)
        else:
            f = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        f = f.to(m.weight.device)
        f.weight.data.copy_(m.weight.detach())
        _set(skeleton, name, f)
        fixed[name] = _fixed(m)
    skeleton.eval()
    plans, _ = plan_layers(skeleton, info.config)
    want = {p.name: p.precision for p in info.layers if p.precision is not None}
    got = {p.name: p.precision for p in plans if p.precision is not None}
    if want != got:
        raise RuntimeError(f"the QAT model's layers {want} no longer match quantize_model's plan {got}; was the "
                           "model's structure changed after prepare_qat?")
    return quantize_model(skeleton, info.config, calibration=example_input, fixed=fixed)
