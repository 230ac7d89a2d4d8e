"""tcprec.emulate.matmul: the fma model equals an independent scalar oracle (exact rationals, one
rounding per operation through tcprec.cast) bit for bit; the Triton kernels (through
TRITON_INTERPRET=1 on the CPU) equal the torch reference bit for bit; Kahan helps on long K."""

from fractions import Fraction

import numpy as np
import pytest
import torch

import tcprec as tp
from tcprec import emulate
from tcprec.kernels import reference_emulate as ref_em

DET_MODES = ["nearest", "nearest_away", "toward_zero", "up", "down"]
ACC = ["e5m10", "e8m7", "e4m3", "e6m9"]


# ---- the scalar oracle -------------------------------------------------------------------------


def _odd64(x: Fraction) -> float:
    """Round an exact rational to float64 with round-to-odd (independent of TwoSum)."""
    if isinstance(x, float):  # NaN / Inf propagate as floats (Fraction + inf is a float)
        return x
    f = float(x)  # correctly rounded (nearest)
    if Fraction(f) == x:
        return f
    g = np.nextafter(f, np.inf if x > Fraction(f) else -np.inf)
    lo_odd = np.array([f]).view(np.int64)[0] & 1
    return f if lo_odd else float(g)


def _R(x: Fraction, fmt, rounding) -> Fraction:
    """One rounding of the exact value x to fmt (via round-to-odd float64, 29+ guard bits)."""
    y = float(tp.cast(torch.tensor([_odd64(x)], dtype=torch.float64), fmt, rounding, backend="reference")[0])
    return Fraction(y) if np.isfinite(y) else y


def scalar_matmul(a, b, fmt, rounding, kahan):
    fmt = tp.format(fmt)
    M, K = a.shape
    N = b.shape[1]
    out = np.zeros((M, N), np.float64)
    for m in range(M):
        for n in range(N):
            s = c = Fraction(0)
            for k in range(K):
                p = _R(Fraction(float(a[m, k])) * Fraction(float(b[k, n])), fmt, rounding)
                # (Fraction - inf is a float, so NaN / Inf flow through like IEEE arithmetic)
                if kahan:
                    y = _R(p - c, fmt, rounding)
                    t = _R(s + y, fmt, rounding)
                    c = _R(_R(t - s, fmt, rounding) - y, fmt, rounding)
                    s = t
                else:
                    s = _R(s + p, fmt, rounding)
            out[m, n] = float(s)
    return out


def _operands(seed, M=3, K=12, N=4, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * scale
    b = torch.randn(K, N, generator=g) * torch.logspace(-3, 3, K)[:, None]  # spread exponents along K
    return a, b


def _same(x, y):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    return np.array_equal(x.view(np.uint32), y.view(np.uint32)) or (np.isnan(x) == np.isnan(y)).all() and \
        np.array_equal(np.where(np.isnan(x), 0, x).view(np.uint32), np.where(np.isnan(y), 0, y).view(np.uint32))


@pytest.mark.parametrize("acc", ACC)
@pytest.mark.parametrize("kahan", [False, True])
def test_fma_equals_scalar_oracle(acc, kahan):
    a, b = _operands(1)
    for rounding in DET_MODES:
        want = scalar_matmul(a.numpy(), b.numpy(), acc, rounding, kahan)
        got = emulate.matmul(a, b, acc_fmt=acc, kahan=kahan, rounding=rounding, backend="reference")
        assert _same(got.numpy(), want), f"{acc} {rounding} kahan={kahan}:\n{got}\n{want}"


def test_fma_operand_formats_and_overflow():
    a, b = _operands(2, scale=30.0)
    want = scalar_matmul(tp.cast(a, "e4m3").numpy(), tp.cast(b, "e5m2").numpy(), "e4m3", "nearest", False)
    got = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e5m2", acc_fmt="e4m3", backend="reference")
    assert _same(got.numpy(), want)
    assert torch.isnan(got).any(), "e4m3 overflows to NaN here: the test should cover overflow"


def test_round_to_odd_add_is_exactly_rounded():
    # 1 + 2**-30 rounded toward zero to e5m10 must be 1, toward +inf must be 1 + 2**-10: a fp32 sum
    # (1.0) would give 1 for both -- the double-rounding CPD has.
    one = torch.tensor([1.0], dtype=torch.float64)
    tiny = torch.tensor([2.0**-60], dtype=torch.float64)
    s = ref_em.add_round_to_odd(one, tiny)
    assert float(tp.cast(s, "e5m10", "up")) == 1 + 2**-10
    assert float(tp.cast(s, "e5m10", "toward_zero")) == 1.0
    assert float(tp.cast(ref_em.add_round_to_odd(one, -tiny), "e5m10", "toward_zero")) == 1 - 2**-11


def test_chunk_equals_reference_model():
    # integer-valued operands: every fp32 partial sum is exact, so the model pins the bits
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 8, (5, 100), generator=g).float()
    b = torch.randint(-8, 8, (100, 6), generator=g).float()
    for acc in ("e4m3", "e5m2", "e5m10"):
        for rounding in DET_MODES:
            got = emulate.matmul(a, b, acc_fmt=acc, mode="chunk", chunk=32, rounding=rounding, backend="reference")
            s = torch.zeros(5, 6, dtype=torch.float64)
            for k0 in range(0, 100, 32):
                p = (a[:, k0:k0 + 32].double() @ b[k0:k0 + 32].double())
                s = tp.cast(s + p, acc, rounding)  # exact sums of small integers
            assert _same(got.numpy(), s.float().numpy()), (acc, rounding)


def test_kahan_reduces_error_on_long_k():
    g = torch.Generator().manual_seed(4)
    K = 1024
    a = torch.rand(2, K, generator=g)
    b = torch.rand(K, 3, generator=g)
    exact = a.double() @ b.double()
    for acc in ("e5m10", "e8m7"):
        plain = emulate.matmul(a, b, acc_fmt=acc, backend="reference").double()
        comp = emulate.matmul(a, b, acc_fmt=acc, kahan=True, backend="reference").double()
        e_plain = ((plain - exact).abs() / exact).max().item()
        e_comp = ((comp - exact).abs() / exact).max().item()
        assert e_comp < e_plain / 8, f"{acc}: kahan {e_comp:.2e} vs plain {e_plain:.2e}"
        assert e_comp <= 2 * tp.format(acc).eps, f"{acc}: kahan error {e_comp:.2e}"


def test_stochastic_is_reproducible_and_unbiased():
    a = torch.full((1, 512), 1.0)
    b = torch.full((512, 64), 0.1)
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    x1 = emulate.matmul(a, b, acc_fmt="e5m7", rounding="stochastic", generator=g1, backend="reference")
    x2 = emulate.matmul(a, b, acc_fmt="e5m7", rounding="stochastic", generator=g2, backend="reference")
    assert torch.equal(x1, x2)
    rn = emulate.matmul(a, b, acc_fmt="e5m7", backend="reference")
    exact = 512 * 0.1
    assert abs(x1.mean().item() - exact) < abs(rn.mean().item() - exact)


def test_batched_leading_dims_and_errors():
    a = torch.randn(2, 3, 8)
    b = torch.randn(8, 5)
    assert emulate.matmul(a, b, acc_fmt="fp16", backend="reference").shape == (2, 3, 5)
    with pytest.raises(ValueError, match="K"):
        emulate.matmul(a, torch.randn(7, 5), acc_fmt="fp16")
    with pytest.raises(TypeError, match="acc_fmt"):
        emulate.matmul(a, b, acc_fmt=None)
    with pytest.raises(ValueError, match="mode"):
        emulate.matmul(a, b, acc_fmt="fp16", mode="tree")
    with pytest.raises(TypeError, match="float format"):
        emulate.matmul(a, b, acc_fmt="int8")
    assert "reference" in emulate.explain_matmul(a, b, acc_fmt="fp16", backend="reference")


# ---- Triton kernels through the interpreter ----------------------------------------------------

triton_gemm = pytest.importorskip("tcprec.kernels.triton.emulate_gemm", reason="triton is a Linux dependency")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # Inf - Inf in the interpreter's numpy
@pytest.mark.parametrize("acc", ACC + ["e5m2", "e3m0"])
@pytest.mark.parametrize("kahan", [False, True])
def test_triton_fma_equals_reference(acc, kahan):
    a, b = _operands(6, M=9, K=7, N=5, scale=4.0)  # 9 x 5 with 8 x 8 blocks: masked edges
    fmt = tp.format(acc)
    for rounding in DET_MODES:
        want = ref_em.matmul_fma(a, b, fmt, rounding, kahan)
        got = triton_gemm.matmul(a, b, fmt, "fma", kahan=kahan, rounding=rounding, block_m=8, block_n=8)
        assert _same(got.numpy(), want.numpy()), f"{acc} {rounding} kahan={kahan}"


def test_triton_fma_exact_product_path():
    a = tp.cast(torch.randn(6, 10) * 10, "e4m3")
    b = tp.cast(torch.randn(10, 6), "e4m3")
    assert triton_gemm.product_is_exact(tp.format("e4m3"), tp.format("e4m3"))
    assert triton_gemm.product_is_exact(tp.format("fp16"), tp.format("fp16"))  # 11 + 11 bits
    assert not triton_gemm.product_is_exact(tp.format("bf16"), tp.format("bf16"))  # products below 2**-149
    fmt = tp.format("e5m10")
    want = ref_em.matmul_fma(a, b, fmt, "nearest", False)
    got = triton_gemm.matmul(a, b, fmt, "fma", exact_product=True, block_m=8, block_n=8)
    assert _same(got.numpy(), want.numpy())


@pytest.mark.parametrize("kahan", [False, True])
def test_triton_chunk_equals_reference(kahan):
    g = torch.Generator().manual_seed(7)
    a = torch.randint(-8, 8, (20, 70), generator=g).float()
    b = torch.randint(-8, 8, (70, 12), generator=g).float()
    for acc in ("e4m3", "e5m10"):
        fmt = tp.format(acc)
        want = ref_em.matmul_chunk(a, b, fmt, 16, "nearest", kahan)
        got = triton_gemm.matmul(a, b, fmt, "chunk", chunk=16, kahan=kahan, block_m=16, block_n=16)
        assert _same(got.numpy(), want.numpy()), acc


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # Inf - Inf in the interpreter's numpy
@pytest.mark.parametrize("kahan", [False, True])
def test_triton_chunk_overflow_tiles_fall_back(kahan):
    # rows 0..15 overflow e5m10 (sums up to ~2.3e6 > 65504): their tiles are poisoned in the fast
    # update and recomputed by the generic loop; rows 16.. stay on the fast path; every mode equals
    # the model (Inf for nearest, saturation at max for the directed modes that round inward)
    g = torch.Generator().manual_seed(8)
    a = torch.randint(-8, 8, (24, 70), generator=g).float()
    b = torch.randint(-8, 8, (70, 12), generator=g).float()
    a[:16] *= 512.0
    fmt = tp.format("e5m10")
    for rounding in DET_MODES:
        want = ref_em.matmul_chunk(a, b, fmt, 16, rounding, kahan)
        assert (want[:16].abs() >= 65504).any() and (want[16:].abs() < 16384).all()
        got = triton_gemm.matmul(a, b, fmt, "chunk", chunk=16, kahan=kahan, rounding=rounding, block_m=16, block_n=16)
        assert _same(got.numpy(), want.numpy()), (rounding, kahan)


def test_triton_can_implement_reasons():
    assert "21" in triton_gemm.can_implement(tp.format("fp32"), "nearest", "fma")
    assert "stochastic" in triton_gemm.can_implement(tp.format("fp16"), "stochastic", "fma")
    assert "power of two" in triton_gemm.can_implement(tp.format("fp16"), "nearest", "chunk", 24)
    a = torch.randn(4, 4)
    with pytest.raises(ValueError, match="21"):
        emulate.matmul(a, a, acc_fmt="fp32", backend="triton")


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tcprec.kernels import reference as ref  # noqa: E402
from tcprec.kernels.triton import round as tround  # noqa: E402


@triton.jit
def _k(x_ptr, y_ptr, n, MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr,
       QE_LOW: tl.constexpr, MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr,
       SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
       LOW_BASE: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    y = tround.round_to_format(x, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED,
                               HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    tl.store(y_ptr + offs, y, mask=offs < n)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e5m10", "e8m7", "e3m0", "e2m1", "e4m3fnuz", "e3m1_nosub", "e4m3_sat"])
def test_round_to_format_equals_reference_cast(name):
    """The device-level rounding (kernels/triton/round.py) equals the reference cast bit for bit."""
    fmt = tp.format(name)
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 1 << 12, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = torch.from_numpy(np.concatenate([bits, (rng.standard_normal(4096) * fmt.max / 3).astype(np.float32),
                                         (rng.standard_normal(4096) * fmt.min_normal * 4).astype(np.float32)]))
    for rounding in tround.MODES:
        y = torch.empty_like(x)
        _k[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), **tround.round_constexprs(fmt),
                                           MODE=tp.Rounding(rounding).code, BLOCK=1024)
        want = ref.cast_float(x, fmt, rounding)
        assert _same(y.numpy(), want.numpy()), (name, rounding)


def test_fits_16_bit_operand_dtypes():
    """Which operand formats the chunk kernel may feed to bf16/fp16 tensor cores exactly."""
    from tcprec.ops.emulate import _fits

    assert _fits(tp.format("e4m3"), torch.bfloat16) and _fits(tp.format("e4m3"), torch.float16)
    assert _fits(tp.format("e5m2"), torch.float16) and _fits(tp.format("bf16"), torch.bfloat16)
    assert not _fits(tp.format("fp16"), torch.bfloat16)  # 10 mantissa bits > 7
    assert not _fits(tp.format("bf16"), torch.float16)  # range
    assert not _fits(tp.format("int4"), torch.float16)
