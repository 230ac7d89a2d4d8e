"""The vectorised reference of the emulated-accumulator GEMM (products of many k rounded in one call, a fast
round-to-nearest-even, TwoSum skipped where float64 sums are exact) gives the bits of the straightforward
per-k loop over ``reference.cast_float`` it replaced (issue 40: 69 s -> see `tcprec bench cpu-memory-time`)."""

import pytest
import torch

from tcprec.formats import as_format
from tcprec.kernels import reference as ref
from tcprec.kernels import reference_emulate as rem

FORMATS = ["e5m10", "e8m7", "e4m3", "e3m2", "e5m2", "e4m3fn", "e8m23", "e4m3fnuz", "e5m10_nospecials", "e3m2_nosub"]


def _loop_fma(a, b, fmt, rounding, kahan):
    """The per-k loop as it was (every rounding through ref.cast_float, every sum through round-to-odd)."""
    R = lambda v: ref.cast_float(v, fmt, rounding, None)  # noqa: E731
    add = rem.add_round_to_odd
    a64, b64 = a.double(), b.double()
    s = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    c = torch.zeros_like(s)
    for k in range(a.shape[1]):
        p = R(a64[:, k, None] * b64[None, k, :])
        if not kahan:
            s = R(add(s, p))
            continue
        y = R(add(p, -c))
        t = R(add(s, y))
        c = R(add(R(add(t, -s)), -y))
        s = t
    return s.float()


def _operands(seed, M=5, K=29, N=6, spread=12):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-spread, spread, (M, K), generator=g).float())
    b = torch.randn(K, N, generator=g) * torch.exp2(torch.randint(-spread, spread, (K, N), generator=g).float())
    a[0, :5] = 0.0  # zeros, -0 products
    b[3, :] = -b[3, :]
    return a, b


CASES = [(n, k, "nearest") for n in FORMATS for k in (False, True)] + \
    [(n, k, "toward_zero") for n in ("e5m10", "e4m3", "e8m7") for k in (False, True)]


@pytest.mark.parametrize("name,kahan,rounding", CASES)
def test_fma_reference_is_bit_identical_to_the_per_k_loop(name, kahan, rounding):
    fmt = as_format(name)
    for seed in range(2):
        a, b = _operands(seed, spread=4 if fmt.exp <= 3 else 12)  # small formats: overflow and subnormals both
        got = rem.matmul_fma(a, b, fmt, rounding, kahan)
        want = _loop_fma(a, b, fmt, rounding, kahan)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or \
            bool(((got == want) | (got.isnan() & want.isnan())).all() and torch.equal(got.signbit(), want.signbit()))


@pytest.mark.parametrize("name", FORMATS)
def test_fast_nearest_matches_cast_float_on_ties_specials_and_ranges(name):
    fmt = as_format(name)
    if not rem._fast_nearest_ok(fmt):
        pytest.skip(f"{fmt} takes ref.cast_float itself (no fast path to test)")  # pragma: no cover
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-160, 160, (20000,), generator=g).double())
    on_grid = ref.cast_float(x, fmt, "nearest", None)
    ties = on_grid * (1 + 2.0 ** -(fmt.man + 1))  # halfway between two neighbours (normal range)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), fmt.max, -fmt.max,
                            fmt.max * (1 + 2.0 ** -(fmt.man + 2)), fmt.max * (1 + 2.0 ** -(fmt.man + 1)), 1e300,
                            -1e-300, 5e-324, fmt.min_subnormal / 2, -fmt.min_subnormal * 1.5], dtype=torch.float64)
    x = torch.cat([x, on_grid, ties, -ties, special])
    got, want = rem._round_nearest_fast(x, fmt), ref.cast_float(x, fmt, "nearest", None)
    same = (got.view(torch.int64) == want.view(torch.int64)) | (got.isnan() & want.isnan())
    assert bool(same.all()), x[~same][:5]
