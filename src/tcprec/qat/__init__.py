"""tcprec.qat: quantization-aware training that deploys bit-exactly (``prepare_qat`` -> train -> ``convert_qat``).

See docs/qat.md."""

from .api import ACT_QUANT, QATInfo, convert_qat, prepare_qat, qat_layers
from .layers import QATConv2d, QATLinear
from .quantizers import ActQuant, WeightQuant, grad_scale, round_ste, weight_format_qat

__all__ = ["prepare_qat", "convert_qat", "qat_layers", "QATInfo", "QATConv2d", "QATLinear", "ActQuant",
           "WeightQuant", "round_ste", "grad_scale", "weight_format_qat", "ACT_QUANT"]
