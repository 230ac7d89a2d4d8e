"""One precision vocabulary for the API and every command.

Three questions have precision answers, and each has one parser here:

* **a quantized layer** (``quantize_model``, ``QuantConfig``, ``tcprec run / profile / bench net``):
  ``parse_layer_precision`` -> :class:`LayerPrecision` or ``None`` (``"float"``: keep the layer in
  floating point);
* **a whole network** on the command line: ``canonical_network_precision`` -- ``"fp32"`` (the float
  model as built; ``"float"`` says the same), ``"fp16"`` (the float model in half precision, GPU) or
  any layer precision;
* **the LU factor** of ``linalg.solve`` / ``tcprec solve``: ``canonical_factor``;
* **the float convolution** (``ops.conv``, ``nn.Conv2d``): ``canonical_conv_precision``.

Every error lists the whole accepted set.  Spellings that used to mean something else are refused
with what to write instead (``quantize_model(m, "fp16")`` kept layers in the model's own dtype).

>>> parse_layer_precision("int4"), parse_layer_precision("e4m3"), parse_layer_precision("float")
(LayerPrecision(w_bits=4, a_bits=4, fp8=False), LayerPrecision(w_bits=8, a_bits=8, fp8=True), None)
>>> canonical_factor("float8_e4m3fn"), canonical_network_precision("w4a4")
('fp8', 'w4a4')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "LayerPrecision", "parse_layer_precision", "LAYER_PRECISIONS_TEXT", "canonical_network_precision",
    "NETWORK_PRECISIONS_TEXT", "canonical_factor", "FACTOR_FORMATS", "FACTOR_ALIASES",
    "canonical_conv_precision", "CONV_PRECISIONS", "CONV_ALIASES",
]


@dataclass(frozen=True)
class LayerPrecision:
    """Bit widths of one layer: ``w_bits`` / ``a_bits`` in 1..8 (integer), or ``fp8`` for e4m3 both."""

    w_bits: int = 8
    a_bits: int = 8
    fp8: bool = False

    def __post_init__(self):
        if not self.fp8:
            for name, b in (("w_bits", self.w_bits), ("a_bits", self.a_bits)):
                if not (isinstance(b, int) and 1 <= b <= 8):
                    raise ValueError(f"{name} must be 1..8 for an integer layer, got {b!r}")

    def __str__(self) -> str:
        return "fp8" if self.fp8 else f"w{self.w_bits}a{self.a_bits}"


LAYER_PRECISIONS_TEXT = ("'float' (keep the layer in floating point), 'wXaY' with X, Y in 1..8 ('w1a2', "
                         "'w4a4'), 'intN' with N in 1..8 (= wNaN: 'int8', 'int4'), 'fp8' (= 'e4m3', "
                         "'float8_e4m3fn': e4m3 weights and activations)")
_KEEP_FLOAT = ("float", "none")
_FP8 = ("fp8", "e4m3", "float8_e4m3fn", "fp8_e4m3")
_WAS_KEEP_FLOAT = ("fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16")
_NO_ENGINE = ("e5m2", "float8_e5m2", "e3m4", "fp6", "fp4", "e2m1", "mxfp8", "mxfp6", "mxfp4", "mxint8", "nvfp4")


def parse_layer_precision(text) -> LayerPrecision | None:
    """A layer precision name -> :class:`LayerPrecision`; ``"float"`` / ``None`` -> ``None``."""
    if text is None or isinstance(text, LayerPrecision):
        return text
    if not isinstance(text, str):
        raise TypeError(f"a layer precision is a name or a LayerPrecision, got {type(text).__name__}: {text!r}; "
                        f"accepted: {LAYER_PRECISIONS_TEXT}")
    t = text.strip().lower()
    if t in _KEEP_FLOAT:
        return None
    if t in _FP8:
        return LayerPrecision(fp8=True)
    m = re.fullmatch(r"int(\d)", t) or re.fullmatch(r"w(\d)a(\d)", t)
    if m:
        w, a = int(m[1]), int(m[m.lastindex])
        if 1 <= w <= 8 and 1 <= a <= 8:
            return LayerPrecision(w, a)
    if t in _WAS_KEEP_FLOAT:
        raise ValueError(
            f"{text!r} is not a layer precision: it used to mean 'keep the layer in floating point' (in the "
            f"model's own dtype, not {t}). Write 'float' for that; to run the model in half precision call "
            f"model.half() first. Accepted: {LAYER_PRECISIONS_TEXT}"
        )
    if t in _NO_ENGINE:
        raise ValueError(
            f"quantized layers have no {text!r} engine (weights and activations run as integer bit planes, INT8 "
            f"or e4m3 tensor-core GEMMs); tcprec.quantize(x, {t!r}) quantizes tensors to it. Accepted: "
            f"{LAYER_PRECISIONS_TEXT}"
        )
    raise ValueError(f"unknown layer precision {text!r}; accepted: {LAYER_PRECISIONS_TEXT}")


NETWORK_PRECISIONS_TEXT = ("'fp32' (= 'float': the float model as built), 'fp16' (the float model in half "
                           "precision, GPU), or a quantized layer precision: 'wXaY' (X, Y in 1..8), 'intN' (N in "
                           "1..8, = wNaN), 'fp8' (= 'e4m3')")


def canonical_network_precision(text: str) -> str:
    """The precision of a whole network on the command line, canonical: ``"fp32"``, ``"fp16"``,
    ``"int8"`` (w8a8 is spelled int8), ``"fp8"`` or ``"wXaY"``."""
    t = str(text).strip().lower()
    if t in ("fp32", "float32", "float"):
        return "fp32"
    if t in ("fp16", "float16", "half"):
        return "fp16"
    if t in ("bf16", "bfloat16"):
        raise ValueError(f"{text!r}: networks run in fp32 or fp16 (float) or quantized; accepted: "
                         f"{NETWORK_PRECISIONS_TEXT}")
    try:
        p = parse_layer_precision(t)
    except ValueError:
        raise ValueError(f"unknown precision {text!r}; accepted: {NETWORK_PRECISIONS_TEXT}") from None
    if p is None:  # "none"
        return "fp32"
    return "int8" if (not p.fp8 and p.w_bits == p.a_bits == 8) else str(p)


# The precision of the LU's tensor-core trailing updates (linalg.solve's factor=).
FACTOR_FORMATS = ("bf16", "fp16", "tf32", "fp8", "fp32")
FACTOR_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "tf32": "tf32",
    "fp8": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}


def _canonical(value, name: str, names: tuple, aliases: dict, purpose: str = "", example: str = "") -> str:
    """``aliases[value]`` (case and surrounding spaces ignored); ValueError naming every accepted spelling
    otherwise -- the one shape of ``canonical_factor`` and ``canonical_conv_precision``."""
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in aliases:
        other = ", ".join(k for k in aliases if k not in names)
        raise ValueError(f"{name} must be one of {names} ({purpose + '; ' if purpose else ''}also spelled {other}), "
                         f"got {name}={value!r}" + (f"; e.g. {example}" if example else ""))
    return aliases[key]


def canonical_factor(factor) -> str:
    """``"bfloat16"`` -> ``"bf16"`` etc.; ValueError naming every accepted spelling otherwise."""
    return _canonical(factor, "factor", FACTOR_FORMATS, FACTOR_ALIASES, "the precision of the LU's tensor-core updates",
                      "solve(A, b, factor='bf16')")


# The operand precision of the float tensor-core convolution (ops.conv, nn.Conv2d).
CONV_PRECISIONS = ("fp16", "bf16", "fp8")
CONV_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
                "fp8": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8"}


def canonical_conv_precision(precision) -> str:
    """``"float16"`` -> ``"fp16"`` etc. (the float tensor-core convolution's operands); ValueError naming every
    accepted spelling otherwise."""
    return _canonical(precision, "precision", CONV_PRECISIONS, CONV_ALIASES)
