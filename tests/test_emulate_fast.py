"""The vectorised reference of the emulated-accumulator GEMM (products of many k rounded in one call, a fast
round-to-nearest-even, TwoSum skipped where float64 sums are exact) gives the bits of the straightforward
per-k loop over ``reference.cast_float`` it replaced (issue 40: 69 s -> see `tcprec bench cpu-memory-time`)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tcprec.formats import FloatFormat, as_format
from tcprec.kernels import reference as ref
from tcprec.kernels import reference_emulate as rem

FORMATS = ["e5m10", "e8m7", "e4m3", "e3m2", "e5m2", "e4m3fn", "e8m23", "e4m3fnuz", "e5m10_nospecials", "e3m2_nosub"]


def _sum_loop(parts, shape, fmt, rounding, kahan):
    """The model's running sum of ``parts`` (float64 partials, in order) into a (M, N) result: every rounding
    through ref.cast_float, every sum through round-to-odd; Kahan-compensated with ``kahan``."""
    R = lambda v: ref.cast_float(v, fmt, rounding, None)  # noqa: E731
    add = rem.add_round_to_odd
    s = torch.zeros(shape, dtype=torch.float64)
    c = torch.zeros_like(s)
    for p in parts:
        if not kahan:
            s = R(add(s, p))
            continue
        y = R(add(p, -c))
        t = R(add(s, y))
        c = R(add(R(add(t, -s)), -y))
        s = t
    return s.float()


def _loop_fma(a, b, fmt, rounding, kahan):
    """The per-k loop as it was: each product rounded to fmt (ref.cast_float), then summed by _sum_loop."""
    a64, b64 = a.double(), b.double()
    products = (ref.cast_float(a64[:, k, None] * b64[None, k, :], fmt, rounding, None) for k in range(a.shape[1]))
    return _sum_loop(products, (a.shape[0], b.shape[1]), fmt, rounding, kahan)


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
    for seed, spread in [(0, 4 if fmt.exp <= 3 else 12), (1, 4 if fmt.exp <= 3 else 12), (2, 1)]:
        a, b = _operands(seed, spread=spread)  # small formats: overflow and subnormals both; spread 1: sums in range
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


# ---- the unchecked round-to-nearest loop (docs/decisions/0044) ----------------------------------------------------


def _loop_chunk(a, b, fmt, chunk, rounding, kahan):
    """The per-chunk loop of the model: each chunk's fp32 partial sum (the reference's own) summed by _sum_loop."""
    partials = ((a[:, k0:k0 + chunk].float() @ b[k0:k0 + chunk].float()).double()
                for k0 in range(0, a.shape[1], chunk))
    return _sum_loop(partials, (a.shape[0], b.shape[1]), fmt, rounding, kahan)


def _same_bits(got, want):
    return bool(((got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("name,kahan,rounding", CASES)
def test_chunk_reference_is_bit_identical_to_the_per_chunk_loop(name, kahan, rounding):
    fmt = as_format(name)
    for seed, spread in [(0, 4 if fmt.exp <= 3 else 12), (1, 4 if fmt.exp <= 3 else 12), (2, 1)]:
        a, b = _operands(seed, K=70, spread=spread)  # spread 1: in range, known before the loop for wide formats
        for chunk in (1, 8, 32):
            got = rem.matmul_chunk(a, b, fmt, chunk, rounding, kahan)
            assert _same_bits(got, _loop_chunk(a, b, fmt, chunk, rounding, kahan)), (name, chunk, seed)


def test_unchecked_round_to_odd_equals_add_round_to_odd():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(50000, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-80, 80, (50000,), generator=g).double())
    b = torch.randn(50000, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-80, 80, (50000,), generator=g).double())
    one = torch.ones(8, dtype=torch.float64)
    tiny = torch.tensor([2.0**-60, -2.0**-60, 2.0**-53, -2.0**-53, 2.0**-54, -2.0**-54, 0.0, -0.0], dtype=torch.float64)
    a = torch.cat([a, a, one, -one, one + 2.0**-52, torch.zeros(2, dtype=torch.float64)])
    b = torch.cat([b, -a[:50000], tiny, tiny, tiny, torch.tensor([0.0, -0.0], dtype=torch.float64)])
    got, want = rem._add_odd_unchecked(a, b), rem.add_round_to_odd(a, b)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@st.composite
def _gemm_cases(draw):
    exp, man = draw(st.integers(2, 8)), draw(st.integers(0, 23))
    try:
        fmt = FloatFormat(exp, man, specials=draw(st.sampled_from(["ieee", "fn", "fnuz", "none"])),
                          subnormals=draw(st.booleans()), overflow="saturate" if draw(st.booleans()) else None)
    except ValueError:
        fmt = FloatFormat(exp, man)
    M, K, N = draw(st.integers(1, 4)), draw(st.integers(1, 40)), draw(st.integers(1, 4))
    seed, spread = draw(st.integers(0, 2**16)), draw(st.integers(0, 12))
    scale = 2.0 ** draw(st.integers(-24, max(-24, fmt.emax - 4)))  # up to overflow (the checked rerun)
    return fmt, M, K, N, seed, spread, scale, draw(st.booleans()), draw(st.sampled_from([None, "inf", "nan"]))


@settings(max_examples=60, deadline=None)
@given(case=_gemm_cases(), mode=st.sampled_from(["fma", "chunk"]), chunk=st.integers(1, 16),
       rounding=st.sampled_from(["nearest", "nearest", "toward_zero", "up"]), kahan=st.booleans())
def test_emulated_reference_equals_the_loops_on_random_formats(case, mode, chunk, rounding, kahan):
    fmt, M, K, N, seed, spread, scale, grid, special = case
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (M, K), generator=g).float())
    b = torch.randn(K, N, generator=g) * scale
    if grid:  # quarter-integer operands: exact sums, ties, cancellation to zero
        a, b = torch.round(a * 4) / 4, torch.round(b * 4) / 4
    if special:
        a[0, K // 2] = float(special)
    if mode == "fma":
        got, want = rem.matmul_fma(a, b, fmt, rounding, kahan), _loop_fma(a, b, fmt, rounding, kahan)
    else:
        got, want = rem.matmul_chunk(a, b, fmt, chunk, rounding, kahan), _loop_chunk(a, b, fmt, chunk, rounding, kahan)
    assert _same_bits(got, want)


@pytest.mark.parametrize("name", ["e8m7", "e5m10", "e4m3"])
def test_chunk_tie_broken_by_a_tiny_earlier_sum(name):
    """A fp32 partial on a midpoint of fmt after a tiny nonzero sum: the float64 sum drops the tiny part, and
    only round-to-odd breaks the tie the right way (e8m7: 1 + 2^-8 after 2^-60 rounds up to 1 + 2^-7).  Formats
    whose float64 sums are exact skip round-to-odd: there the tie needs |p| >= 2^53 * (the finest value), an overflow
    (the checked loop)."""
    fmt = as_format(name)
    tiny, mid = fmt.min_subnormal, 1 + 2.0 ** -(fmt.man + 1)
    big = mid * 2.0 ** min(60, fmt.emax + 2)  # a midpoint at or past the overflow
    a = torch.tensor([[tiny, mid], [tiny, big], [-tiny, -mid], [tiny, -mid]], dtype=torch.float32)
    b = torch.ones(2, 1)
    got, want = rem.matmul_chunk(a, b, fmt, 1), _loop_chunk(a, b, fmt, 1, "nearest", False)
    assert _same_bits(got, want)
    if name == "e8m7":
        assert got[0, 0] == 1 + 2.0 ** -7 and got[2, 0] == -(1 + 2.0 ** -7) and got[3, 0] == -1.0


@pytest.mark.parametrize("name", ["e5m10", "e8m7", "e4m3"])
@pytest.mark.parametrize("bounded", [True, False])
def test_chunk_zero_signs_through_minus_zero_partials(name, bounded):
    """The fast chunk loop sets the sign of zeros after the last step only: a -0 last partial added to a zero sum
    keeps the sign of an earlier step, which it gets by a rerun.  (Given partials: whether a BLAS returns -0 for a
    dot product of zeros is its own business.)"""
    fmt = as_format(name)
    t = fmt.min_subnormal / 4  # rounds to zero
    cols = [[-t, -0.0, -0.0],  # -0, then -0 partials: -0 (the rerun)
            [t, -0.0, -0.0],  # +0, then -0 partials: +0
            [0.0, -0.0, -0.0],  # +0 + -0 = +0
            [-0.0, -0.0, -t],  # -0 at the last step
            [1.0, -1.0, -0.0],  # 1 - 1 = +0, then + -0: +0
            [-t, t, -0.0],  # -0, then +t: +0, then + -0: +0
            [1.0, -0.0, 2.0]]  # nonzero
    parts = [torch.tensor([[c[k] for c in cols]]) for k in range(3)]  # (1, 7) fp32 partials, in order
    got = rem._accumulate_chunks(lambda: iter(parts), fmt, 1, 7, "cpu", bounded)
    s = torch.zeros(1, 7, dtype=torch.float64)
    for p in parts:  # _sum_loop without Kahan on these partials, kept in float64
        s = ref.cast_float(rem.add_round_to_odd(s, p.double()), fmt, "nearest", None)
    assert torch.equal(got.view(torch.int64), s.view(torch.int64)), (got, s)
    assert got.signbit().flatten().tolist() == [True, False, False, True, False, False, False]


@pytest.mark.parametrize("mode", ["fma", "chunk"])
@pytest.mark.parametrize("name", ["e5m10", "e4m3", "e8m7"])
def test_sums_just_past_emax_take_the_checked_loop(mode, name):
    """Equal positive operands whose sum passes 2^emax by 1%: the bound from max|a| max|b| must send them to the
    checked loop (an unchecked run would give a finite value past the format's range)."""
    fmt = as_format(name)
    K = 16
    ab = 2.0 ** fmt.emax * 1.01 / K
    a, b = torch.full((2, K), 2.0 ** -3), torch.full((K, 3), ab * 2.0**3)
    if mode == "fma":
        got, want = rem.matmul_fma(a, b, fmt), _loop_fma(a, b, fmt, "nearest", False)
    else:
        got, want = rem.matmul_chunk(a, b, fmt, 4), _loop_chunk(a, b, fmt, 4, "nearest", False)
    assert _same_bits(got, want), (got, want)
    assert float(want.max()) >= 2.0**fmt.emax


@pytest.mark.parametrize("shape", [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_empty_gemms_equal_the_loops(shape):
    M, K, N = shape
    a, b = torch.randn(M, K), torch.randn(K, N)
    for name in ("e5m10", "e8m7"):
        fmt = as_format(name)
        assert _same_bits(rem.matmul_fma(a, b, fmt), _loop_fma(a, b, fmt, "nearest", False))
        got = rem.matmul_chunk(a, b, fmt, 4)
        assert got.shape == (M, N) and _same_bits(got, _loop_chunk(a, b, fmt, 4, "nearest", False))
