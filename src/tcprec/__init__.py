"""tcprec: arbitrary- and mixed-precision computing on GPU tensor cores.

>>> import torch, tcprec as tp
>>> tp.cast(torch.tensor([1.0, 0.3]), "e4m3")
tensor([1.0000, 0.3125])
>>> qx = tp.quantize(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "int4", tp.PerChannel(0))
>>> qx.dequantize()
tensor([[ 0.8571, -2.0000],
        [ 0.5000,  0.2143]])
"""

from . import distributed, emulate, linalg, metrics, nn, profiling, qat, runtime, train
from .enums import Backend, Rounding
from .env import device_report
from .formats import BlockFormat, FloatFormat, IntFormat, ROUNDING_MODES, as_format, format, preset_names, presets
from .ops.cast import cast, decode, encode
from .ops.conv import conv2d_dgrad, conv2d_wgrad, explain_conv2d_dgrad, explain_conv2d_wgrad, to_fp8
from .ops.matmul import explain_matmul, matmul, matmul_packed
from .ops.quantize import quantize
from .nn.convert import QuantConfig, quantize_model
from .nn.speed_rule import SpeedRule
from .qat import convert_qat, prepare_qat
from .profiling import profile
from .runtime import Engine, compile  # noqa: A004
from .packing import K_PAD_BITS, pack_bitplanes, packed_words, plane_popcounts, unpack_bitplanes
from .qtensor import BitPlanes, Dense, Float8, PerChannel, PerGroup, PerTensor, QTensor, ShiftedInt8

from ._version import __version__

__all__ = [
    "__version__",
    # formats
    "IntFormat",
    "FloatFormat",
    "BlockFormat",
    "format",
    "as_format",
    "presets",
    "preset_names",
    "ROUNDING_MODES",
    "Rounding",
    "Backend",
    # casting and quantization
    "cast",
    "encode",
    "decode",
    "quantize",
    "QTensor",
    "PerTensor",
    "PerChannel",
    "PerGroup",
    "Dense",
    "BitPlanes",
    "ShiftedInt8",
    "Float8",
    # integer GEMMs on tensor cores (bit-serial binary MMA, or INT8)
    "matmul",
    "matmul_packed",
    "explain_matmul",
    # convolution backward (dgrad / wgrad) at fp16 / bf16 / fp8
    "conv2d_dgrad",
    "conv2d_wgrad",
    "explain_conv2d_dgrad",
    "explain_conv2d_wgrad",
    "to_fp8",
    # bit planes (the bit-serial GEMM's operand layout)
    "pack_bitplanes",
    "unpack_bitplanes",
    "plane_popcounts",
    "packed_words",
    "K_PAD_BITS",
    # whole networks: quantize, compile (CUDA graph, two copies per call), profile
    "QuantConfig",
    "SpeedRule",
    "quantize_model",
    "prepare_qat",
    "convert_qat",
    "compile",
    "Engine",
    "profile",
    # workflows and tools
    "emulate",
    "nn",
    "train",
    "qat",
    "distributed",
    "linalg",
    "metrics",
    "profiling",
    "runtime",
    "device_report",
]
