"""tcprec.nn: modules for custom-precision networks (emulated training layers and quantizers)."""

from .emulated import EmulatedConv2d, EmulatedLinear, Recipe
from .quantizer import Quantizer, quantize_fn

__all__ = ["Quantizer", "quantize_fn", "Recipe", "EmulatedLinear", "EmulatedConv2d"]
