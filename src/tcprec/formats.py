"""Number formats: small frozen records whose every property is computed.

A format is one of

* ``IntFormat(bits, signed, encoding)``  -- integers of 1..8 bits: two's complement, unsigned, or
  ``pm1``, the odd-integer code of binarised networks (value = 2*code - (2**bits - 1); one bit gives
  {-1, +1}).
* ``FloatFormat(exp, man, bias, subnormals, specials, overflow, signed, zero)`` -- any binary float
  of 1..8 exponent and 0..23 mantissa bits.  fp32, tf32, bf16, fp16 and every ml_dtypes float are
  presets of this one class.
* ``BlockFormat(element, scale, block)`` -- OCP microscaling (MX): ``block`` elements share one
  power-of-two scale.

Nothing here is tabulated by hand except the names of the presets; max, min normal, eps, the code of
NaN and so on are derived from the record (as in gfloat's ``FormatInfo``).

Code layout of a FloatFormat: ``[sign][exponent: exp bits][mantissa: man bits]`` (no sign bit when
``signed=False``).  ``specials`` says which codes are not finite numbers:

* ``"ieee"``: exponent all ones is reserved: mantissa 0 is +-Inf, any other mantissa is NaN.
* ``"fn"``:   no Inf; the one code with exponent and mantissa all ones is NaN (OCP e4m3).
* ``"fnuz"``: no Inf, no -0; the code of -0 (sign bit alone) is the only NaN.
* ``"none"``: every code is a finite number (OCP fp6 / fp4).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Union

from .enums import ROUNDING_MODES

__all__ = [
    "IntFormat",
    "FloatFormat",
    "BlockFormat",
    "Format",
    "format",
    "as_format",
    "preset_names",
    "presets",
    "ROUNDING_MODES",
]


_SPECIALS = ("ieee", "fn", "fnuz", "none")
_OVERFLOW = ("saturate", "inf", "nan")
_INT_ENCODINGS = ("twos", "unsigned", "pm1")


def _check_int(name: str, value, lo: int, hi: int, cls: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int in {lo}..{hi} for {cls}, got {name}={value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {lo}..{hi} for {cls}, got {name}={value}")


# --------------------------------------------------------------------------------------------
# Integers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntFormat:
    """An integer format of 1..8 bits.

    >>> IntFormat(bits=3, signed=True).max
    3
    >>> IntFormat(bits=1, encoding="pm1").values()
    [-1, 1]
    """

    bits: int
    signed: bool | None = None
    encoding: str | None = None

    def __post_init__(self):
        _check_int("bits", self.bits, 1, 8, "IntFormat")
        enc, signed = self.encoding, self.signed
        if enc is None:
            enc = "unsigned" if signed is False else "twos"
        if enc not in _INT_ENCODINGS:
            raise ValueError(f"encoding must be one of {_INT_ENCODINGS} for IntFormat, got encoding={enc!r}")
        implied = enc != "unsigned"
        if signed is not None and bool(signed) != implied:
            raise ValueError(
                f"IntFormat(signed={signed}, encoding={enc!r}) contradicts itself: encoding {enc!r} is "
                f"{'signed' if implied else 'unsigned'}; drop signed= or pick a matching encoding"
            )
        object.__setattr__(self, "encoding", enc)
        object.__setattr__(self, "signed", implied)

    # -- derived properties ------------------------------------------------------------------
    kind = "int"

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def min(self) -> int:
        if self.encoding == "twos":
            return -(1 << (self.bits - 1))
        if self.encoding == "unsigned":
            return 0
        return -((1 << self.bits) - 1)  # pm1: code 0

    @property
    def max(self) -> int:
        if self.encoding == "twos":
            return (1 << (self.bits - 1)) - 1
        return (1 << self.bits) - 1  # unsigned, and pm1 at the top code

    @property
    def step(self) -> int:
        """Distance between neighbouring values (2 for pm1: only odd integers)."""
        return 2 if self.encoding == "pm1" else 1

    @property
    def offset(self) -> int:
        """value = step * code_index + offset, code_index in 0..2**bits-1 (the unsigned view)."""
        return self.min

    @property
    def has_nan(self) -> bool:
        return False

    def values(self) -> list[int]:
        """Every value, in code-index order (code index = value's position from the minimum)."""
        return [self.offset + self.step * i for i in range(self.n_codes)]

    def code_of(self, value: int) -> int:
        """The stored code of an integer value: the b-bit two's complement pattern, or the index."""
        if value not in range(self.min, self.max + 1, self.step):
            raise ValueError(f"{value} is not a value of {self}; values are {self.min}..{self.max} step {self.step}")
        if self.encoding == "twos":
            return value & ((1 << self.bits) - 1)
        return (value - self.offset) // self.step

    def __str__(self) -> str:
        if self.encoding == "pm1":
            return "binary" if self.bits == 1 else f"pm{self.bits}"
        return f"{'int' if self.signed else 'uint'}{self.bits}"

    def describe(self) -> str:
        return f"{self.bits}-bit {self.encoding} integer, values {self.min}..{self.max} step {self.step}"


# --------------------------------------------------------------------------------------------
# Floats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with ``exp`` exponent and ``man`` mantissa bits.

    ``bias`` defaults to the IEEE ``2**(exp-1) - 1``. ``subnormals=False`` removes the subnormal
    codes: values below the smallest normal round to 0 or to the smallest normal.  ``overflow``
    says where a finite value above ``max`` goes (default: Inf for ``specials="ieee"``, NaN for
    ``"fn"``/``"fnuz"``, ``"saturate"`` for ``"none"``).  ``signed=False`` drops the sign bit and
    ``zero=False`` makes exponent code 0 an ordinary binade (OCP's e8m0 scale format).

    >>> FloatFormat(exp=5, man=2).max
    57344.0
    >>> FloatFormat(exp=4, man=3, specials="fn").max
    448.0
    """

    exp: int
    man: int
    bias: int | None = None
    subnormals: bool = True
    specials: str = "ieee"
    overflow: str | None = None
    signed: bool = True
    zero: bool = True

    def __post_init__(self):
        _check_int("exp", self.exp, 1, 8, "FloatFormat")
        _check_int("man", self.man, 0, 23, "FloatFormat")
        if self.specials not in _SPECIALS:
            raise ValueError(f"specials must be one of {_SPECIALS}, got specials={self.specials!r}")
        bias = (1 << (self.exp - 1)) - 1 if self.bias is None else self.bias
        # bias <= 127 keeps every format inside float32's exponent range, which the one-rounding
        # cast from float32 bits relies on (see kernels/reference.py).
        _check_int("bias", bias, -(1 << self.exp), 127, "FloatFormat")
        object.__setattr__(self, "bias", bias)
        ovf = self.overflow
        if ovf is None:
            ovf = {"ieee": "inf", "fn": "nan", "fnuz": "nan", "none": "saturate"}[self.specials]
        if ovf not in _OVERFLOW:
            raise ValueError(f"overflow must be one of {_OVERFLOW}, got overflow={ovf!r}")
        object.__setattr__(self, "overflow", ovf)
        if ovf == "inf" and self.specials != "ieee":
            raise ValueError(
                f"overflow='inf' needs specials='ieee' (an Inf code), got specials={self.specials!r}; "
                "use overflow='saturate' or 'nan'"
            )
        if ovf == "nan" and not self.has_nan:
            raise ValueError(
                f"overflow='nan' needs a NaN code, but e{self.exp}m{self.man} with specials={self.specials!r} "
                "has none; use overflow='saturate'"
            )
        if self.specials == "fnuz" and not self.signed:
            raise ValueError("specials='fnuz' puts NaN on the sign bit; it needs signed=True")
        if not self.zero and self.subnormals and self.man > 0:
            raise ValueError("zero=False makes exponent code 0 a normal binade; it needs subnormals=False")
        if self.emin < -126 and self.man > 0:
            raise ValueError(
                f"e{self.exp}m{self.man} with bias {bias} and zero={self.zero} has normal numbers below 2**-126, "
                "where float32 (the cast's source) has fewer bits than the format; use bias <= 127 - int(not zero)"
            )
        if self.bits > 32:
            raise ValueError(f"a FloatFormat has at most 32 bits, got {self.bits}")
        if not (self.max > 0 and math.isfinite(self.max)):
            raise ValueError(
                f"e{self.exp}m{self.man} with specials={self.specials!r} has no positive finite value; "
                "give it more exponent or mantissa bits"
            )
        if self.max > 3.4028234663852886e38:
            raise ValueError(f"{self!r} reaches {self.max:.3g}, beyond float32; use a larger bias")

    kind = "float"

    # -- code layout -------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp + self.man

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_bit(self) -> int:
        """The code bit that holds the sign (0 for unsigned formats, which have none)."""
        return (1 << (self.exp + self.man)) if self.signed else 0

    @property
    def exp_all_ones(self) -> int:
        return (1 << self.exp) - 1

    @property
    def man_all_ones(self) -> int:
        return (1 << self.man) - 1

    # -- specials ------------------------------------------------------------------------------
    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        if self.specials == "ieee":
            return self.man > 0  # exponent all ones with a non-zero mantissa
        return self.specials in ("fn", "fnuz")

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.zero and self.specials != "fnuz"

    @property
    def code_of_nan(self) -> int | None:
        """The canonical (positive, quiet) NaN code, or None."""
        if not self.has_nan:
            return None
        if self.specials == "ieee":  # quiet NaN: top mantissa bit set
            return (self.exp_all_ones << self.man) | (1 << (self.man - 1))
        if self.specials == "fn":
            return (self.exp_all_ones << self.man) | self.man_all_ones
        return self.sign_bit  # fnuz

    @property
    def code_of_inf(self) -> int | None:
        return (self.exp_all_ones << self.man) if self.has_inf else None

    @property
    def code_of_max(self) -> int:
        """Code of the largest finite value."""
        top = self.exp_all_ones
        if self.specials == "ieee":
            return ((top - 1) << self.man) | self.man_all_ones
        if self.specials == "fn":  # top code is NaN: step one code down
            return ((top << self.man) | self.man_all_ones) - 1
        return (top << self.man) | self.man_all_ones

    @property
    def code_of_min(self) -> int:
        """Code of the smallest positive value (smallest subnormal where there are subnormals)."""
        if not self.zero:
            return 0
        return 1 if (self.subnormals and self.man > 0) else (1 << self.man)

    # -- values ----------------------------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        return (1 if self.zero else 0) - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return (self.code_of_max >> self.man) - self.bias

    @property
    def max(self) -> float:
        return self.value_of(self.code_of_max)

    def value_of(self, code: int) -> float:
        """The value of one code (a Python float; NaN and +-Inf included).

        Codes with exponent field 0 and a non-zero mantissa in a format without subnormals are
        never produced by ``encode``; they read as (signed) zero.
        """
        if not 0 <= code < self.n_codes:
            raise ValueError(f"code must be 0..{self.n_codes - 1} for {self}, got code={code}")
        if self.has_nan and (code & ~self.sign_bit) == (self.code_of_nan & ~self.sign_bit):
            if self.specials != "fnuz" or code == self.code_of_nan:
                return math.nan
        neg = bool(code & self.sign_bit)
        e = (code >> self.man) & self.exp_all_ones
        m = code & self.man_all_ones
        if self.specials == "ieee" and e == self.exp_all_ones:
            return math.nan if m else (-math.inf if neg else math.inf)
        if e == 0 and self.zero:
            v = math.ldexp(m, self.emin - self.man) if self.subnormals else 0.0
        else:
            v = math.ldexp((1 << self.man) + m, e - self.bias - self.man)
        return -v if neg else v

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal if there are no subnormals)."""
        if self.subnormals and self.man > 0 and self.zero:
            return math.ldexp(1.0, self.emin - self.man)
        return self.min_normal

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value (2**-man)."""
        return math.ldexp(1.0, -self.man)

    @property
    def precision(self) -> int:
        """Significand bits, the implicit one included."""
        return self.man + 1

    @property
    def n_finite(self) -> int:
        n = self.n_codes
        if self.specials == "ieee":
            n -= (1 << self.man) * (2 if self.signed else 1)
        elif self.specials == "fn":
            n -= 2 if self.signed else 1
        elif self.specials == "fnuz":
            n -= 1
        return n

    def with_(self, **changes) -> "FloatFormat":
        """A copy with some fields changed: ``fmt.with_(overflow="saturate")``."""
        return replace(self, **changes)

    def __str__(self) -> str:
        return _float_name(self)

    def describe(self) -> str:
        return (
            f"{self.bits}-bit float e{self.exp}m{self.man} bias {self.bias}, specials {self.specials}, "
            f"overflow {self.overflow}, max {self.max:.6g}, min normal {self.min_normal:.3g}, "
            f"min subnormal {self.min_subnormal:.3g}"
        )


# --------------------------------------------------------------------------------------------
# Block (MX) formats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockFormat:
    """OCP microscaling: ``block`` consecutive elements share one power-of-two ``scale``.

    The scale of a block is ``2**(floor(log2(amax)) - element.emax)`` (OCP MX v1.0, section 6.3),
    stored in ``scale`` (float8_e8m0fnu by default); elements are cast to ``element``.
    """

    element: Union[IntFormat, FloatFormat]
    scale: FloatFormat = field(default=None)  # type: ignore[assignment]
    block: int = 32

    def __post_init__(self):
        element = as_format(self.element)
        if isinstance(element, BlockFormat):
            raise ValueError("the element of a BlockFormat must be an IntFormat or FloatFormat, not a BlockFormat")
        object.__setattr__(self, "element", element)
        scale = _PRESETS["float8_e8m0fnu"] if self.scale is None else as_format(self.scale)
        if not isinstance(scale, FloatFormat) or scale.man != 0:
            raise ValueError(f"a BlockFormat scale must be a power-of-two float format (man=0), got {scale}")
        object.__setattr__(self, "scale", scale)
        _check_int("block", self.block, 1, 1 << 20, "BlockFormat")

    kind = "block"

    @property
    def bits(self) -> float:
        """Average bits per element, the shared scale included."""
        return self.element.bits + self.scale.bits / self.block

    @property
    def element_emax(self) -> int:
        """OCP's emax_elem: exponent of the largest power of two the element represents, in the
        element's own units (6 for int8: MXINT8 is int8 * 2**-6 with emax_elem 0, i.e. 64)."""
        if isinstance(self.element, FloatFormat):
            return self.element.emax
        return int(math.floor(math.log2(self.element.max))) if self.element.max >= 1 else 0

    def __str__(self) -> str:
        for name, fmt in _BLOCK_PRESETS.items():
            if fmt == self:
                return name
        scale = "" if self.scale == _PRESETS["float8_e8m0fnu"] else f"_s{self.scale}"
        return f"mx_{self.element}_b{self.block}{scale}"

    def describe(self) -> str:
        return f"{self.element} elements in blocks of {self.block} with a {self.scale} scale ({self.bits:.2f} bits/element)"


Format = Union[IntFormat, FloatFormat, BlockFormat]

# --------------------------------------------------------------------------------------------
# Presets and names
# --------------------------------------------------------------------------------------------

_PRESETS: dict[str, Union[IntFormat, FloatFormat]] = {
    "float32": FloatFormat(8, 23),
    "tf32": FloatFormat(8, 10),
    "bfloat16": FloatFormat(8, 7),
    "float16": FloatFormat(5, 10),
    "float8_e4m3fn": FloatFormat(4, 3, specials="fn"),
    "float8_e5m2": FloatFormat(5, 2),
    "float8_e4m3fnuz": FloatFormat(4, 3, bias=8, specials="fnuz"),
    "float8_e5m2fnuz": FloatFormat(5, 2, bias=16, specials="fnuz"),
    "float8_e4m3b11fnuz": FloatFormat(4, 3, bias=11, specials="fnuz"),
    "float8_e3m4": FloatFormat(3, 4),
    "float8_e4m3": FloatFormat(4, 3),
    "float6_e3m2fn": FloatFormat(3, 2, specials="none"),
    "float6_e2m3fn": FloatFormat(2, 3, specials="none"),
    "float4_e2m1fn": FloatFormat(2, 1, specials="none"),
    "float8_e8m0fnu": FloatFormat(8, 0, bias=127, subnormals=False, specials="fn", signed=False, zero=False),
}
for _b in range(1, 9):
    _PRESETS[f"int{_b}"] = IntFormat(_b, signed=True)
    _PRESETS[f"uint{_b}"] = IntFormat(_b, signed=False)
    _PRESETS["binary" if _b == 1 else f"pm{_b}"] = IntFormat(_b, encoding="pm1")

_ALIASES = {
    "fp32": "float32", "f32": "float32", "single": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "e4m3fnuz": "float8_e4m3fnuz", "e5m2fnuz": "float8_e5m2fnuz",
    "e4m3b11fnuz": "float8_e4m3b11fnuz",
    "fp6": "float6_e3m2fn", "e3m2": "float6_e3m2fn", "e3m2fn": "float6_e3m2fn",
    "e2m3": "float6_e2m3fn", "e2m3fn": "float6_e2m3fn",
    "fp4": "float4_e2m1fn", "e2m1": "float4_e2m1fn", "e2m1fn": "float4_e2m1fn",
    "e8m0": "float8_e8m0fnu", "e8m0fnu": "float8_e8m0fnu",
    "int": "int8", "uint": "uint8", "pm1": "binary",
}

_BLOCK_PRESETS: dict[str, BlockFormat] = {}


def _init_block_presets():
    for name, elem in (("mxfp8", "float8_e4m3fn"), ("mxfp8_e5m2", "float8_e5m2"), ("mxfp6", "float6_e3m2fn"),
                       ("mxfp6_e2m3", "float6_e2m3fn"), ("mxfp4", "float4_e2m1fn"), ("mxint8", "int8")):
        _BLOCK_PRESETS[name] = BlockFormat(_PRESETS[elem])


# Torch dtype names map onto presets, so tcprec.format(torch.float8_e4m3fn) works.
_TORCH_NAMES = {
    "torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2",
    "torch.float8_e4m3fnuz": "float8_e4m3fnuz", "torch.float8_e5m2fnuz": "float8_e5m2fnuz",
    "torch.float8_e8m0fnu": "float8_e8m0fnu", "torch.int8": "int8", "torch.uint8": "uint8",
}

_MX = re.compile(r"^mx_(.+?)_b(\d+)(?:_s(.+))?$")
_CUSTOM = re.compile(r"^e(\d+)m(\d+)(?:b(-?\d+))?((?:_[a-z]+)*)$")
_SUFFIX = {
    "ieee": ("specials", "ieee"), "fn": ("specials", "fn"), "fnuz": ("specials", "fnuz"),
    "nospecials": ("specials", "none"), "nosub": ("subnormals", False), "sat": ("overflow", "saturate"),
    "ovfinf": ("overflow", "inf"), "ovfnan": ("overflow", "nan"), "unsigned": ("signed", False),
    "nozero": ("zero", False),
}


def _float_name(f: FloatFormat) -> str:
    for name, p in _PRESETS.items():
        if p == f:
            return name
    base = f"e{f.exp}m{f.man}"
    default = FloatFormat(f.exp, f.man)
    parts = [base]
    if f.bias != default.bias:
        parts[0] += f"b{f.bias}"
    if f.specials != "ieee":
        parts.append({"fn": "fn", "fnuz": "fnuz", "none": "nospecials"}[f.specials])
    if not f.subnormals:
        parts.append("nosub")
    natural = {"ieee": "inf", "fn": "nan", "fnuz": "nan", "none": "saturate"}[f.specials]
    if f.overflow != natural:
        parts.append({"saturate": "sat", "inf": "ovfinf", "nan": "ovfnan"}[f.overflow])
    if not f.signed:
        parts.append("unsigned")
    if not f.zero:
        parts.append("nozero")
    name = "_".join(parts)
    if name in _ALIASES or name in _PRESETS:  # "e4m3" means OCP e4m3fn; spell the IEEE one out
        name += "_ieee"
    return name


def preset_names() -> list[str]:
    """Every name ``tcprec.format`` knows: presets, block presets and short aliases."""
    return list(_PRESETS) + list(_BLOCK_PRESETS) + list(_ALIASES)


def presets() -> dict[str, Format]:
    """The preset formats by canonical name (a copy)."""
    return {**_PRESETS, **_BLOCK_PRESETS}


def format(name) -> Format:  # noqa: A001 - the public verb is tcprec.format, like torch.dtype names
    """Parse a format name.

    Accepts ml_dtypes names (``float8_e4m3fn``, ``float6_e3m2fn``, ``int4``, ``uint2``), short
    aliases (``e4m3``, ``e5m2``, ``fp16``, ``bf16``, ``tf32``, ``fp6``, ``fp4``, ``binary``), MX
    block names (``mxfp8``, ``mxfp4``, ``mxint8``), torch dtypes, and custom floats ``eXmY`` with
    optional bias and suffixes: ``e3m4``, ``e5m7b12``, ``e4m3_fn_sat``, ``e6m1_nosub``.
    A bare ``eXmY`` that is not an alias is IEEE-style (Inf/NaN reserved, overflow to Inf).
    ``str(fmt)`` gives a name that parses back to an equal format.

    >>> format("e4m3").max
    448.0
    >>> str(format("e3m4_fn"))
    'e3m4_fn'
    """
    if isinstance(name, (IntFormat, FloatFormat, BlockFormat)):
        return name
    if not isinstance(name, str):
        tname = str(name)
        if tname in _TORCH_NAMES:
            return _PRESETS[_TORCH_NAMES[tname]]
        raise TypeError(f"format() takes a name or a format object, got {type(name).__name__} {name!r}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _PRESETS:
        return _PRESETS[key]
    if key in _BLOCK_PRESETS:
        return _BLOCK_PRESETS[key]
    mx = _MX.match(key)
    if mx:  # str() of a custom BlockFormat: mx_<element>_b<block>[_s<scale>]
        return BlockFormat(format(mx.group(1)), block=int(mx.group(2)),
                           scale=format(mx.group(3)) if mx.group(3) else None)
    m = _CUSTOM.match(key)
    if m:
        exp, man = int(m.group(1)), int(m.group(2))
        kwargs = {}
        if m.group(3) is not None:
            kwargs["bias"] = int(m.group(3))
        for suffix in filter(None, m.group(4).split("_")):
            if suffix not in _SUFFIX:
                raise ValueError(
                    f"unknown suffix {suffix!r} in format name {name!r}; allowed suffixes: {sorted(_SUFFIX)}"
                )
            k, v = _SUFFIX[suffix]
            kwargs[k] = v
        return FloatFormat(exp, man, **kwargs)
    close = difflib.get_close_matches(key, preset_names(), n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"unknown format {name!r}{hint} Known: ml_dtypes names (float8_e4m3fn, ...), aliases (e4m3, fp16, bf16, "
        f"tf32, fp6, fp4, int4, uint2, binary), MX names (mxfp8, mxfp4) or a custom 'eXmY'"
    )


def as_format(fmt) -> Format:
    """A format object from a format or a name (what every public function accepts)."""
    return format(fmt)


_init_block_presets()
