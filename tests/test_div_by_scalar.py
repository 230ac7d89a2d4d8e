"""kernels/triton/round.div_by_scalar: float32 x / s (IEEE, torch's x / s) as RN32(x * RN64(1 / s)).

The identity is checked in torch on values built to sit on and around the float32 midpoints that decide the
rounding (and on the integer + 1/2 boundaries the quantizers round at), for scales of every kind (random,
all-ones significands, powers of two, tiny, huge); the Triton helper itself runs through the interpreter."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tcprec.kernels.triton.round import div_by_scalar, div_for_codes  # noqa: E402


@triton.jit
def _div(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, div_by_scalar(tl.load(x_ptr + offs, mask=m), tl.load(s_ptr)), mask=m)


def _scales(gen):
    ones = [float(torch.tensor(0x3F7FFFFF + e * (1 << 23), dtype=torch.int32).view(torch.float32))
            for e in (-60, -3, 0, 5, 40)]  # significand 1.11...1
    rnd = [float(torch.rand((), generator=gen)) * 10.0 ** e for e in range(-30, 31, 6)]
    return ones + rnd + [2.0**-20, 0.5, 1.0, 8.0, 2.0**30, 0.05, 0.1, 1 / 3, 0.0123, 1e-38, 3e38]


def _values(s32, gen):
    """Random values, and values on / next to the float32 midpoints around k + 1/2 and random quotients."""
    y = torch.randn(100_000, generator=gen) * 200 * s32
    half = (torch.randint(-300, 300, (20_000,), generator=gen).float() + 0.5) * s32  # k + 1/2 boundaries
    q = torch.randn(20_000, generator=gen) * 100
    up, dn = torch.nextafter(q, torch.full_like(q, float("inf"))), q
    mid = ((up.double() + dn.double()) / 2 * s32.double()).float()  # y with y / s near a float32 midpoint
    out = [y, half, mid]
    for t in (half, mid):
        out += [torch.nextafter(t, torch.full_like(t, float("inf"))), torch.nextafter(t, torch.full_like(t, -float("inf")))]
    return torch.cat(out)


def test_identity_in_torch():
    gen = torch.Generator().manual_seed(0)
    for s in _scales(gen):
        s32 = torch.tensor(s, dtype=torch.float32)
        y = _values(s32, gen)
        got = (y.double() * (1.0 / s32.double())).float()
        want = y / s32
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same.all()), (s, y[~same][:4].tolist())


def test_special_values():
    y = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38])
    for s in (0.0, -0.0, float("inf"), float("nan"), 1e-45, -2.5, 3.4e38):
        s32 = torch.tensor(s, dtype=torch.float32)
        got = (y.double() * (1.0 / s32.double())).float()
        want = y / s32
        assert torch.equal(got.isnan(), want.isnan()), s
        ok = got.isnan() | ((got == want) & (torch.signbit(got) == torch.signbit(want)))
        assert bool(ok.all()), (s, got.tolist(), want.tolist())


def test_triton_helper_matches_division():
    gen = torch.Generator().manual_seed(1)
    for s in (0.05, 1 / 3, float(torch.tensor(0x3F7FFFFF, dtype=torch.int32).view(torch.float32)), 2.0**-7):
        s32 = torch.tensor([s], dtype=torch.float32)
        x = _values(s32[0], gen)[:4096].contiguous()
        out = torch.empty_like(x)
        _div[(triton.cdiv(x.numel(), 1024),)](x, s32, out, x.numel(), BLOCK=1024)
        assert torch.equal(out, x / s32), s


@triton.jit
def _div_codes(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, div_for_codes(tl.load(x_ptr + offs, mask=m), tl.load(s_ptr)), mask=m)


def test_div_for_codes_is_the_ieee_quotient_where_codes_can_tell():
    """Through the interpreter: the Markstein path (scales 2^-64 .. 2^64) and the float64 fallback (others) give
    x / s exactly wherever 2^-100 <= |x / s| < 2^30, and beyond 2^30 a quotient of the right sign >= 2^29.9 in
    magnitude (every code saturates); +-inf / NaN quotients stay themselves."""
    gen = torch.Generator().manual_seed(1)
    for s in _scales(gen) + [2.0**-70, 2.0**70, -0.37]:
        s32 = torch.tensor([s], dtype=torch.float32)
        y = torch.cat([_values(s32[0], gen)[::7], torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                                               3.4e38, -3.4e38, 1e-45])])
        out = torch.empty_like(y)
        _div_codes[(triton.cdiv(y.numel(), 1024),)](y, s32, out, y.numel(), BLOCK=1024)
        want = y / s32
        mid = want.isfinite() & (want.abs() >= 2.0**-100) & (want.abs() < 2.0**30)
        assert torch.equal(out[mid], want[mid]), (s, y[mid][out[mid] != want[mid]][:4].tolist())
        big = want.isfinite() & (want.abs() >= 2.0**30)
        assert bool(((out[big].sign() == want[big].sign()) & (out[big].abs() >= 2.0**29.9)).all()), s
        nf = ~want.isfinite()
        assert torch.equal(out[nf].isnan(), want[nf].isnan()) and \
            torch.equal(out[nf & ~want.isnan()], want[nf & ~want.isnan()]), s
