"""The arithmetic of the low-precision all-reduce: one rounding to a format, an exactly rounded add,
the wire round trip -- in two engines that give the same bits.

* ``Ref64``: float64 tensors, every rounding by kernels/reference.py (integer arithmetic on the
  float64 bit pattern).  The ground truth; any format.
* ``Fast32``: float32 tensors and table look-ups, ~8 elementwise passes per rounding instead of the
  reference's ~50 int64/float64 ones, with 8x less memory per element (issue 40: ``tcprec train``
  with e4m3 gradients on the CPU took 55 s and 15 GB a step in the float64 engine).

Why ``Fast32`` is exact.  Rounding a float32 ``x`` to a format with ``m`` mantissa bits depends only
on x's sign, exponent, top ``m + 1`` mantissa bits (the kept bits and the round bit) and the OR of the
rest (sticky), whenever the format drops at least ``23 - m`` bits of x -- true for every float32 when
the format's normal range starts at or above float32's (``emin >= -126``, which FloatFormat enforces
for ``man > 0``).  So a table indexed by ``key = (bits >> (22 - m)) << 1 | sticky`` (``m + 11`` bits)
holds every result; it is filled by the reference itself on one representative float32 per key.  A sum
``a + b`` of two format values is formed as float32 TwoSum rounded to odd (exact when the format's
whole span fits float32's 24 bits: then the plain float32 add is exact and used), and rounding the
round-to-odd value to a format with >= 2 fewer significand bits and a quantum >= 2**-147 equals
rounding the exact sum (Boldo & Melquiond 2008; the same argument as kernels/triton/allreduce.py).
The APS scaling ``g * 2**s`` is a float32 multiply (exact scaling up; a product past float32's max
is replaced by +-max, which every mode rounds as the exact product since the format's max + half an
ulp is below it) or, for s < 0, the float64 product rounded to odd float32.
"""

from __future__ import annotations

import math

import torch

from ..formats import FloatFormat
from ..kernels import reference as ref
from ..kernels.reference_emulate import add_round_to_odd
from ..ops.cast import code_dtype, encode

__all__ = ["Ref64", "Fast32", "fast_reason", "make_arith"]

_FMAX32 = torch.finfo(torch.float32).max
_PIECE = 1 << 22  # elements per pass: bounds the temporaries (~16 MB each); fewer, larger passes parallelise better


def fast_reason(fmt: FloatFormat) -> str | None:
    """None if ``Fast32`` rounds into ``fmt`` exactly, else why not (then ``Ref64`` runs)."""
    if fmt.man > 10:
        return f"{fmt} has {fmt.man} mantissa bits; the float32 engine's tables stop at 10 (2**21 entries)"
    if fmt.emin < -126:
        return f"{fmt}'s normal range starts below float32's (emin {fmt.emin} < -126)"
    quantum = 2.0 ** (fmt.emin - fmt.man if fmt.subnormals else fmt.emin)
    if quantum < 2.0**-147:
        return f"{fmt}'s smallest quantum 2**{math.log2(quantum):.0f} is below 2**-147 (float32 round to odd)"
    return None


def make_arith(fmt: FloatFormat, rounding: str, device, fast: bool):
    """The engine for ``fmt`` (``fast`` and exact for it: Fast32, else Ref64), cached."""
    key = (fmt, rounding, torch.device(device), fast and fast_reason(fmt) is None)
    a = _ENGINES.get(key)
    if a is None:
        if len(_ENGINES) >= 32:
            _ENGINES.clear()
        a = _ENGINES[key] = (Fast32 if key[3] else Ref64)(fmt, rounding, key[2])
    return a


_ENGINES: dict = {}


class Ref64:
    """float64 values of the format; every rounding by the reference (any format)."""

    dtype = torch.float64
    name = "float64 reference"

    def __init__(self, fmt: FloatFormat, rounding: str, device):
        self.fmt, self.rounding, self.device = fmt, rounding, device
        self.wire_dtype = code_dtype(fmt)
        self.bytes_per_code = torch.empty(0, dtype=self.wire_dtype).element_size()

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """R(x) for x of this engine's dtype (or float32, exact)."""
        return ref.cast_float(x.to(self.dtype), self.fmt, self.rounding)

    def scale_round(self, g: torch.Tensor, shift: int) -> torch.Tensor:
        """R(g * 2**shift) from float32 g: the exact float64 product, rounded once."""
        return self.round(g.double() * math.ldexp(1.0, shift))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """R(a + b), exactly rounded."""
        return self.round(add_round_to_odd(a, b))

    def nan_to_inf(self, v: torch.Tensor) -> torch.Tensor:
        """A format without NaN sends a NaN result as +Inf (the reference's convention)."""
        if self.fmt.has_nan:
            return v
        return torch.nan_to_num(v, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))

    def to_codes(self, v: torch.Tensor) -> torch.Tensor:
        """Values of the format (or +-Inf) -> their nearest codes (uint8 / int16)."""
        return encode(v.float(), self.fmt, backend="reference")

    def from_codes(self, c: torch.Tensor) -> torch.Tensor:
        return ref.decode_float(c, self.fmt).to(self.dtype)

    def wire(self, v: torch.Tensor, codes: bool) -> torch.Tensor:
        """What a value looks like after the wire: codes decoded (the identity on finite values of
        the format; +-Inf may read back as NaN or +-max), or float32 values as they are."""
        return self.from_codes(self.to_codes(v)) if codes else v

    def pack(self, v: torch.Tensor, codes: bool) -> torch.Tensor:
        """Values -> what travels (codes, or float32 values)."""
        return self.to_codes(v) if codes else v.float()

    def unpack(self, w: torch.Tensor, codes: bool) -> torch.Tensor:
        return self.from_codes(w) if codes else w.to(self.dtype)


class Fast32(Ref64):
    """float32 values of the format; rounding by a table over ``m + 11`` bits of the float32 pattern
    (module doc), built once per (format, rounding, device) from the reference."""

    dtype = torch.float32
    name = "float32 tables"

    def __init__(self, fmt: FloatFormat, rounding: str, device):
        super().__init__(fmt, rounding, device)
        m = fmt.man
        self.shift = 22 - m
        self.kmask = (1 << (m + 10)) - 1
        self.low = (1 << self.shift) - 1
        keys = torch.arange(1 << (m + 11), dtype=torch.int64)
        rep = ((keys >> 1) << self.shift) | (keys & 1)  # one float32 pattern per key
        rep = torch.where(rep >= (1 << 31), rep - (1 << 32), rep).to(torch.int32).view(torch.float32)
        vals = ref.cast_float(rep, fmt, rounding)  # (2**(m+11),) float32: R of every key
        self.values = vals.to(device)
        # the wire's encode: nearest code of a value (of the format, or +-Inf / NaN)
        codes = ref.encode_float(torch.nan_to_num(rep, nan=float("inf")) if not fmt.has_nan else rep, fmt, "nearest")
        dt = self.wire_dtype
        if dt != torch.uint8:
            width = torch.iinfo(dt).bits
            codes = torch.where(codes >= (1 << (width - 1)), codes - (1 << width), codes)
        self.codes = codes.to(dt).to(device)
        self.lut = ref.decode_float(torch.arange(fmt.n_codes), fmt).to(device)  # (2**bits,) float32
        # the whole span of the format (quantum to 2**(emax + 2)) fits float32's significand: a + b is exact
        q_low = fmt.emin - fmt.man if (fmt.subnormals and fmt.zero) else fmt.emin
        self.exact_add = fmt.emax + 2 - q_low <= 24

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        """(bits >> shift) << 1 | sticky, in place on two int32 temporaries; sticky = ((bits & low) + low)
        >> shift is 1 exactly when a dropped bit is set (low < 2**shift)."""
        b = x.view(torch.int32)
        k = torch.bitwise_right_shift(b, self.shift).bitwise_and_(self.kmask).bitwise_left_shift_(1)
        t = torch.bitwise_and(b, self.low).add_(self.low).bitwise_right_shift_(self.shift)
        return k.bitwise_or_(t)

    def _look(self, table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return table.index_select(0, self._key(x).view(-1)).view(x.shape)

    def _pieces(self, fn, out: torch.Tensor, *ins: torch.Tensor) -> torch.Tensor:
        """out = fn(*ins) elementwise, in pieces (bounded temporaries)."""
        o, flat = out.view(-1), [t.reshape(-1) for t in ins]
        for i in range(0, o.numel(), _PIECE):
            o[i:i + _PIECE] = fn(*(t[i:i + _PIECE] for t in flat))
        return out

    def round(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        return self._pieces(lambda v: self._look(self.values, v), torch.empty_like(x), x)

    def scale_round(self, g: torch.Tensor, shift: int) -> torch.Tensor:
        g = g.float().contiguous()
        if shift >= 0:  # scaling up is exact (|result| <= 2**top); 2**shift split to stay in float32
            s1 = min(shift, 127)

            def f(g):
                if not shift:
                    return self._look(self.values, g)
                v = g * math.ldexp(1.0, s1)
                v = v * math.ldexp(1.0, shift - s1) if shift > s1 else v
                if bool(torch.isinf(v).any()):  # past float32's range (never under APS): +-max rounds as the
                    big = torch.copysign(torch.full_like(v, _FMAX32), v)  # exact product (module doc)
                    v = torch.where(torch.isinf(v) & torch.isfinite(g), big, v)
                return self._look(self.values, v)
        else:  # scaling down may land in float32's subnormals: the float64 product, rounded to odd

            def f(v):
                p64 = v.double() * math.ldexp(1.0, shift)
                p = p64.float()
                pb = p.view(torch.int32)
                d = p64 - p.double()
                fix = (d != 0) & ((pb & 1) == 0)
                step = torch.where((d < 0) == (pb < 0), 1, -1).to(torch.int32)
                return self._look(self.values, torch.where(fix, pb + step, pb).view(torch.float32))
        return self._pieces(f, torch.empty_like(g), g)

    def _add_rto(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b rounded to odd in float32; a float32 overflow of two finite values becomes +-max."""
        s = a + b
        if self.exact_add:
            return s
        bb = s - a
        t = (a - (s - bb)) + (b - bb)  # TwoSum: a + b = s + t exactly
        sb = s.view(torch.int32)
        fix = (t != 0) & ((sb & 1) == 0) & torch.isfinite(s)
        s = torch.where(fix, sb + torch.where((t < 0) == (sb < 0), 1, -1).to(torch.int32), sb).view(torch.float32)
        ovf = torch.isinf(s) & torch.isfinite(a) & torch.isfinite(b)
        return torch.where(ovf, torch.copysign(torch.full_like(s, _FMAX32), s), s)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = torch.broadcast_tensors(a, b)
        return self._pieces(lambda x, y: self._look(self.values, self._add_rto(x, y)), torch.empty(a.shape, device=a.device), a, b)

    def to_codes(self, v: torch.Tensor) -> torch.Tensor:
        v = v.float().contiguous()
        return self._pieces(lambda x: self._look(self.codes, x), torch.empty(v.shape, dtype=self.wire_dtype,
                                                                             device=v.device), v)

    def from_codes(self, c: torch.Tensor) -> torch.Tensor:
        return self.lut.index_select(0, (c.to(torch.int32) & (self.fmt.n_codes - 1)).view(-1)).view(c.shape)

    def wire(self, v: torch.Tensor, codes: bool) -> torch.Tensor:
        # the round trip changes only non-finite values: skip the two look-ups when there are none
        if not codes or bool(torch.isfinite(v).all()):
            return v
        return self.from_codes(self.to_codes(v))
