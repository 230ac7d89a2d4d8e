"""tcprec.train: custom-precision training (emulated layers, loss scaling, low-precision optimizer)."""

from .convert import SwapReport, emulate_model
from .optim import LowPrecisionSGD
from .scaler import LossScaler

__all__ = ["emulate_model", "SwapReport", "LossScaler", "LowPrecisionSGD"]
