"""tcprec.nn: modules for custom-precision networks (emulated training layers, quantizers, and
Conv2d whose backward runs the low-precision dgrad/wgrad kernels)."""

from .conv import Conv2d, conv2d
from .emulated import EmulatedConv2d, EmulatedLinear, Recipe
from .quantizer import Quantizer, quantize_fn

__all__ = ["Quantizer", "quantize_fn", "Recipe", "EmulatedLinear", "EmulatedConv2d", "Conv2d", "conv2d"]
