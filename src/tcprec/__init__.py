"""tcprec: arbitrary- and mixed-precision computing on GPU tensor cores.

>>> import torch, tcprec as tp
>>> fmt = tp.format("e4m3")
>>> tp.cast(torch.tensor([1.0, 0.3]), fmt)
tensor([1.0000, 0.3125])
"""

from .formats import BlockFormat, FloatFormat, IntFormat, ROUNDING_MODES, as_format, format, preset_names, presets
from .ops.cast import cast, decode, encode

__version__ = "0.1.0"

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
    # casting
    "cast",
    "encode",
    "decode",
]
