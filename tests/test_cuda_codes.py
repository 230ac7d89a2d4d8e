"""The integers the CUDA kernels take as defines / arguments have one name on each side: the Python enums of
kernels/cuda/codes.py and the enumerators of the .cu sources must agree value for value (read from the source text:
no compiler needed)."""

import re

import pytest
import torch

from tcprec.kernels.cuda import bmma_gemm, stem_conv
from tcprec.kernels.cuda.codes import Act, Encoding, Epilogue, OutType
from tcprec.kernels.cuda.runtime import source_text


def _enumerators(text: str) -> dict[str, int]:
    """NAME -> value of every ``enum : int { NAME = v, ... };`` in a CUDA source."""
    out = {}
    for body in re.findall(r"enum\s*:\s*int\s*\{([^}]*)\}", text):
        for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body):
            out[name] = int(value)
    return out


BMMA = _enumerators(source_text(bmma_gemm.SOURCE_PATH))
STEM = _enumerators(source_text(stem_conv.SOURCE_PATH))


@pytest.mark.parametrize("enum, prefix, names, source", [
    (Epilogue, "EPI_", {"INT32": "INT32", "FLOAT": "FLOAT", "PACKED": "PACKED"}, BMMA),
    (OutType, "OUT_", {"FLOAT32": "F32", "FLOAT16": "F16", "BFLOAT16": "BF16"}, BMMA),
    (Encoding, "ENC_", {"TWOS": "TWOS", "UNSIGNED": "UNSIGNED", "PM1": "PM1"}, BMMA),
    (Encoding, "ENC_", {"TWOS": "TWOS", "UNSIGNED": "UNSIGNED", "PM1": "PM1"}, STEM),
    (OutType, "FOUT_", {"FLOAT16": "F16", "BFLOAT16": "BF16"}, STEM),
    (Act, "ACT_", {"NONE": "NONE", "RELU": "RELU", "LEAKY": "LEAKY"}, STEM),
])
def test_python_and_cuda_names_agree(enum, prefix, names, source):
    for py, cu in names.items():
        assert source[prefix + cu] == int(enum[py]), (prefix + cu, enum[py])


def test_defines_carry_the_enum_values():
    v = bmma_gemm.Variant(1, 1, False, False, bmma_gemm.Tile(32, 32, 2, 1, 2, 1024), "packed", out_bits=2,
                          out_encoding="pm1")
    d = dict(x.split("=") for x in v.defines())
    assert d["TCP_EPI"] == str(int(Epilogue.PACKED)) and d["TCP_OENC"] == str(int(Encoding.PM1))
    s = stem_conv.StemVariant(2, "twos", 1, fout=torch.bfloat16)
    d = dict(x.split("=") for x in s.defines())
    assert d["TCP_FOUT"] == str(int(OutType.BFLOAT16)) and d["TCP_OENC"] == str(int(Encoding.TWOS))
    with pytest.raises(ValueError, match="encoding must be one of"):
        Encoding.of("sign-magnitude")
