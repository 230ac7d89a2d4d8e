"""Trained weights from ``tcprec train --task classify`` checkpoints (``float.pt``, ``qat.pt``), for ``tcprec run``
and ``tcprec bench net --checkpoint``.

A float checkpoint gives the float model (deployed at any precision by post-training quantization); a QAT
checkpoint gives the trained QAT model at its precision (deployed by ``convert_qat``: its own scales, no
calibration)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..nn.convert import QuantConfig, quantize_model
from .api import convert_qat, prepare_qat
from .trainer import build_model

__all__ = ["Trained", "load_trained", "deploy"]


@dataclass
class Trained:
    path: str
    model_name: str
    kind: str  # "float" | "qat"
    precision: str | None  # the QAT precision (None for a float checkpoint)
    model: nn.Module  # the float model, or the QAT model (eval mode)
    input_shape: tuple = (1, 28, 28)


def load_trained(path, device="cpu") -> Trained:
    """The model of a ``tcprec train --task classify`` checkpoint, on ``device``, in eval mode."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {p} not found; write one with `tcprec train --task classify --out DIR` "
                                "(DIR/float.pt, DIR/qat.pt)")
    st = torch.load(p, map_location=device, weights_only=False)
    if not isinstance(st, dict) or st.get("kind") not in ("float", "qat") or "model_name" not in st:
        raise ValueError(f"{p} is not a checkpoint of `tcprec train --task classify` (float.pt / qat.pt: a dict with "
                         f"kind, model_name, model); got keys {sorted(st)[:6] if isinstance(st, dict) else type(st)}")
    net = build_model(st["model_name"]).to(device)
    if st["kind"] == "float":
        net.load_state_dict(st["model"])
        return Trained(str(p), st["model_name"], "float", None, net.eval())
    qat = prepare_qat(net, st["precision"], act_quant=st.get("config", {}).get("act_quant", "lsq"))
    qat.load_state_dict(st["model"])
    return Trained(str(p), st["model_name"], "qat", st["precision"], qat.eval())


def deploy(t: Trained, precision: str | None = None, calibration: torch.Tensor | None = None) -> nn.Module:
    """The deployable model: ``convert_qat`` of a QAT checkpoint (``precision`` None or its own), or for a float
    checkpoint the float model (``precision`` None / "fp32") or ``quantize_model(model, precision)`` calibrated on
    ``calibration`` (first conv and last layer int8 for wXaY, as ``tcprec bench net``)."""

    dev = next(t.model.parameters()).device
    if t.kind == "qat":
        if precision not in (None, t.precision):
            raise ValueError(f"{t.path} was trained at {t.precision}; deploying it at {precision} would drop the "
                             "learned scales. Use --precision "
                             f"{t.precision}, or a float checkpoint for post-training quantization")
        return convert_qat(t.model, torch.zeros((2, *t.input_shape), device=dev))
    if precision in (None, "fp32", "float"):
        return t.model
    if calibration is None:
        raise ValueError("post-training quantization of a float checkpoint needs calibration images")
    first_last = None if precision in ("int8", "fp8") else "int8"
    return quantize_model(t.model, QuantConfig(precision=precision, first_last=first_last),
                          calibration=calibration.to(dev), warn=False)
