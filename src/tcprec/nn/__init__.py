"""tcprec.nn: modules for custom-precision networks -- quantized inference (QConv2d, QLinear,
quantize_model, the model zoo), emulated training layers and quantizers, and a Conv2d whose backward
runs the low-precision dgrad/wgrad kernels."""

from . import models
from .conv import Conv2d, conv2d
from .convert import QuantConfig, QuantSummary, quantize_model
from .emulated import EmulatedConv2d, EmulatedLinear, Recipe
from .qgrouped import QGroupedConv2d
from .qmodules import LayerPrecision, QConv2d, QLinear, parse_precision
from .quantizer import Quantizer, quantize_fn

__all__ = ["Quantizer", "quantize_fn", "Recipe", "EmulatedLinear", "EmulatedConv2d", "Conv2d", "conv2d",
           "QConv2d", "QGroupedConv2d", "QLinear", "LayerPrecision", "parse_precision", "QuantConfig", "QuantSummary", "quantize_model",
           "models"]
