"""tcprec.linalg on the CPU: mixed-precision LU + iterative refinement meets HPL-MxP's criterion.

On a CPU the tensor-core GEMMs are emulated (operands rounded to the factor format, fp32 products
and sums), which is the arithmetic the GPU does up to summation order; tests/gpu/ repeats the main
checks at n = 2048..4096 on CUDA.
"""

import json
import math
import warnings

import numpy as np
import pytest
import torch

import tcprec.linalg as la
from tcprec.linalg.refine import _gmres
from tcprec.linalg.lu import (
    _inv_lower_unit,
    _round_tf32,
    _tri_inv,
    canonical_factor,
    swaps_from_pivots,
)

N = 256  # order for most solves: several LU blocks at the CPU block width (64)


def independent_backward_error(A, x, b):
    """HPL-MxP scaled residual computed here, in numpy fp64, not by the library."""
    A, x, b = (t.double().numpy() for t in (A, x, b))
    if x.ndim == 1:
        x, b = x[:, None], b[:, None]
    n = A.shape[0]
    r = np.abs(b - A @ x).max(axis=0)
    den = (np.abs(A).sum(axis=1).max() * np.abs(x).max(axis=0) + np.abs(b).max(axis=0)) * n * np.finfo(np.float64).eps
    return float((r / den).max())


@pytest.fixture(scope="module")
def systems():
    return {
        "diagdom": (la.hpl_mxp_matrix(N, seed=3), la.random_rhs(N, seed=4)),
        "general": (la.random_matrix_with_cond(N, 1e2, seed=5), la.random_rhs(N, seed=6)),
    }


# ------------------------------------------------------------------------------------------------
# every factor format converges and meets the criterion
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("refine", ["gmres", "fgmres"])
@pytest.mark.parametrize("factor", la.FACTOR_FORMATS)
@pytest.mark.parametrize("kind", ["diagdom", "general"])
def test_every_factor_meets_hpl_criterion(systems, factor, kind, refine):
    A, b = systems[kind]
    x, info = la.solve(A, b, factor=factor, refine=refine, pivoting=(kind == "general"))
    be = independent_backward_error(A, x, b)
    assert x.dtype == torch.float64 and x.shape == b.shape
    assert be <= 16.0, info
    assert info.backward_error == pytest.approx(be, rel=0.2, abs=0.5)  # residuals at rounding level
    if kind == "diagdom" or factor != "fp8":  # fp8 (3 mantissa bits) may need the fallback on general A
        assert info.converged and info.path == f"lu-{factor}+{refine}", info
        assert info.iterations >= 1 and info.inner_iterations >= info.iterations
        assert info.history[-1] <= 16.0 < info.history[0]
    else:
        assert info.converged == (info.path == f"lu-fp8+{refine}")
        assert info.converged or (info.fell_back and info.reason)


@pytest.mark.parametrize("refine", la.REFINE_METHODS)
@pytest.mark.parametrize("pivoting", [True, False])
def test_classic_and_gmres_on_diagonally_dominant(systems, refine, pivoting):
    A, b = systems["diagdom"]
    x, info = la.solve(A, b, factor="bf16", refine=refine, pivoting=pivoting)
    assert info.converged and info.path == f"lu-bf16+{refine}"
    assert info.pivoting == ("partial" if pivoting else "none")
    assert independent_backward_error(A, x, b) <= 16.0
    ref = torch.linalg.solve(A, b)
    assert torch.allclose(x, ref, rtol=1e-10, atol=1e-12)


def test_gmres_needs_fewer_corrections_than_classic_on_general(systems):
    A, b = systems["general"]
    _, g = la.solve(A, b, factor="bf16", refine="gmres")
    _, c = la.solve(A, b, factor="bf16", refine="classic")
    assert g.converged and c.converged
    assert g.iterations < c.iterations  # bf16 LU of a kappa=100 matrix: classic IR crawls


def test_flexible_gmres_tracks_the_true_residual_whatever_the_preconditioner_rounds():
    """FGMRES keeps A Z = V H in fp64 however M^-1 rounds: with a preconditioner that perturbs
    every call differently (relative 1e-3), its least-squares residual is still the true one and
    reaches 1e-12; left-preconditioned GMRES on the same noisy operator stalls near the noise."""
    n = 200
    A = la.random_matrix_with_cond(n, 1e2, seed=21)
    F = la.lu_factor(A, factor="bf16")
    g = torch.Generator().manual_seed(0)

    def noisy(v):
        z = F.solve(v)
        return z * (1 + 1e-3 * torch.randn(z.shape, generator=g, dtype=torch.float64))

    r = la.random_rhs(n, seed=22)
    rel = lambda d: float(torch.linalg.vector_norm(r - A @ d) / torch.linalg.vector_norm(r))  # noqa: E731
    d, steps, est = _gmres(lambda z: A @ z, r, 60, 1e-12, precond=noisy)
    assert est <= 1e-12 and steps < 60
    assert rel(d) < 1e-11  # the estimate is the true fp64 residual (up to rounding)
    d_left, _, est_left = _gmres(lambda v: noisy(A @ v), noisy(r), 60, 1e-12)
    assert rel(d_left) > 1e-6  # the noise of M^-1 caps what the left-preconditioned solve gains


@pytest.mark.parametrize("factor", ["bf16", "fp16"])
def test_fgmres_ir_needs_one_correction_and_fewer_inner_steps_on_general(factor):
    # seeded; measured on this CPU emulation: bf16 gmres 2/15 vs fgmres 1/10, fp16 2/8 vs 1/5
    n = 512
    A = la.random_matrix_with_cond(n, 1e2, seed=1)
    b = la.random_rhs(n, seed=101)
    xg, g = la.solve(A, b, factor=factor, refine="gmres")
    xf, f = la.solve(A, b, factor=factor, refine="fgmres")
    assert f.converged and f.path == f"lu-{factor}+fgmres" and f.refine == "fgmres"
    assert independent_backward_error(A, xf, b) <= 16.0
    assert f.iterations == 1 < g.iterations  # one correction: the inner residual is the true one
    assert f.inner_iterations + 2 <= g.inner_iterations
    assert len(f.history) == 2 and f.history[-1] <= 16.0


def test_fgmres_multiple_rhs_with_a_zero_column():
    A = la.random_matrix_with_cond(N, 1e2, seed=5)
    B = la.random_rhs(N, 3, seed=9)
    B[:, 1] = 0.0  # solved by x = 0 from the start
    X, info = la.solve(A, B, factor="fp16", refine="fgmres")
    assert info.converged and info.nrhs == 3 and info.path == "lu-fp16+fgmres"
    assert bool((X[:, 1] == 0).all())
    assert independent_backward_error(A, X[:, [0, 2]], B[:, [0, 2]]) <= 16.0  # (0/0 on the zero column)
    _, one = la.solve(A, B[:, 0], factor="fp16", refine="fgmres")
    assert info.inner_iterations <= 2 * one.inner_iterations + 2  # two columns' worth, not three


@pytest.mark.parametrize("refine", ["gmres", "fgmres"])
@pytest.mark.parametrize("cond", [1e2, 1e6, 1e10, 1e12])
@pytest.mark.parametrize("factor", ["bf16", "fp32"])
def test_condition_numbers_converge_or_fall_back(cond, factor, refine):
    n = 128
    A = la.random_matrix_with_cond(n, cond, seed=11)
    b = la.random_rhs(n, seed=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, info = la.solve(A, b, factor=factor, refine=refine)
    # an accurate x warns only that it came from the fp64 fallback, and only then
    assert [str(w.message) for w in caught if "falling back" not in str(w.message)] == []
    assert any("falling back to torch.linalg.solve" in str(w.message) for w in caught) == (info.path == "fp64-fallback")
    assert independent_backward_error(A, x, b) <= 16.0
    assert info.meets_criterion
    if info.converged:
        assert info.path == f"lu-{factor}+{refine}" and info.reason == ""
    else:
        assert info.path == "fp64-fallback" and info.fell_back
        assert "GMRES-IR" in info.reason  # says why it fell back
    if cond <= 1e2:
        assert info.converged
    if cond >= 1e12 and factor == "bf16":
        assert info.fell_back  # kappa * u_bf16 ~ 1e10: no Krylov space of 30 rescues that
    # forward error <= kappa * backward error (both answers are backward stable)
    ref = torch.linalg.solve(A, b)
    assert float((x - ref).abs().max() / ref.abs().max()) < 2 * cond * 16 * n * 2.0**-52


def test_classic_ir_gives_up_and_falls_back_on_ill_conditioned():
    A = la.random_matrix_with_cond(96, 1e10, seed=2)
    b = la.random_rhs(96)
    x, info = la.solve(A, b, factor="bf16", refine="classic")
    assert info.fell_back and "classic IR" in info.reason
    assert info.backward_error <= 16.0


def test_batched_systems_are_refused_with_the_loop_to_write():
    A = torch.eye(200, dtype=torch.float64).expand(4, 200, 200) * 3
    with pytest.raises(ValueError, match=r"batching is not supported; loop over the batch"):
        la.solve(A, torch.ones(4, 200, dtype=torch.float64))


def test_fallback_warns():
    A = la.random_matrix_with_cond(96, 1e10, seed=2)
    with pytest.warns(RuntimeWarning, match="falling back to torch.linalg.solve in fp64"):
        _, info = la.solve(A, la.random_rhs(96), factor="bf16", refine="classic")
    assert info.fell_back


def test_fallback_false_raises_instead():
    A = la.random_matrix_with_cond(64, 1e12, seed=2)
    with pytest.raises(RuntimeError, match="fallback=False"):
        la.solve(A, la.random_rhs(64), factor="bf16", fallback=False)


def test_matrix_rhs_fp32_input_and_zero_rhs(systems):
    A, _ = systems["general"]
    B = la.random_rhs(N, 3, seed=9)
    X, info = la.solve(A, B, factor="fp16")
    assert X.shape == (N, 3) and info.nrhs == 3 and info.converged
    assert independent_backward_error(A, X, B) <= 16.0
    X2, info2 = la.solve(A, B, factor="fp16", refine="classic")
    assert info2.converged and independent_backward_error(A, X2, B) <= 16.0
    x32, info32 = la.solve(A.float(), B[:, 0].float())  # fp32 input: fp64 answer to the fp32 system
    assert x32.dtype == torch.float64 and info32.converged
    assert independent_backward_error(A.float().double(), x32, B[:, 0].float().double()) <= 16.0
    x0, info0 = la.solve(A, torch.zeros(N, dtype=torch.float64))
    assert info0.converged and bool((x0 == 0).all()) and info0.backward_error == 0.0


@pytest.mark.parametrize("scale", [1e-300, 1e-40, 1e40, 1e300])
@pytest.mark.parametrize("factor", ["bf16", "fp16", "fp8"])
def test_range_outside_fp32_and_fp16_is_scaled(scale, factor):
    n = 64
    A = la.hpl_mxp_matrix(n, seed=1) * scale
    b = la.random_rhs(n)
    x, info = la.solve(A, b, factor=factor, pivoting=False)
    assert info.converged, info
    assert independent_backward_error(A, x, b) <= 16.0


def test_n_equals_one_and_tiny_systems():
    x, info = la.solve(torch.tensor([[4.0]], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
    assert x.item() == 0.5 and info.converged
    A = la.hpl_mxp_matrix(5, seed=0)
    x, info = la.solve(A, torch.ones(5, dtype=torch.float64), factor="fp8", block=2)
    assert info.converged and independent_backward_error(A, x, torch.ones(5, dtype=torch.float64)) <= 16


# ------------------------------------------------------------------------------------------------
# the LU itself
# ------------------------------------------------------------------------------------------------


def _factor_error(A, F):
    n = A.shape[0]
    L = torch.tril(F.lu.double(), -1) + torch.eye(n, dtype=torch.float64)
    U = torch.triu(F.lu.double())
    PA = A if F.perm is None else A[F.perm]
    return float((PA - F.scale ** -1 * (L @ U)).abs().max() / A.abs().max())


@pytest.mark.parametrize(
    "opts",
    [
        dict(panel="recursive", trsv="trsm", options=la.LUOptions(leaf=8, trsm="trsm", lookahead=False)),
        dict(panel="recursive", trsv="blocked", options=la.LUOptions(leaf=16, trsm="inverse", lookahead=True)),
        dict(panel="getrf", trsv="blocked", options=la.LUOptions(trsm="trsm", lookahead=True)),
        dict(panel="getrf", trsv="trsm", block=50, options=la.LUOptions(trsm="inverse", lookahead=False)),
    ],
)
def test_lu_variants_agree_and_factor_accurately(opts):
    n = 160
    A = la.random_matrix_with_cond(n, 1e3, seed=7)
    F = la.lu_factor(A, factor="fp32", pivoting=True, **opts)
    assert _factor_error(A, F) < 1e-5  # fp32 factors
    ref = torch.linalg.lu_factor(A)  # same pivot sequence as LAPACK (up to ties)
    P, _, _ = torch.lu_unpack(*ref)
    assert torch.equal(F.perm, P.argmax(dim=0))
    Fb = la.lu_factor(A, factor="bf16", pivoting=True, **opts)
    assert 1e-5 < _factor_error(A, Fb) < 0.05  # bf16 updates: visibly worse, still a preconditioner
    b = la.random_rhs(n)
    x = F.solve(b)
    assert float((A @ x - b).abs().max()) < 1e-3


def _componentwise_backward_error_ok(M, F):
    """Whether the bf16 LU satisfies the componentwise backward-error bound that holds for ANY summation order
    and any split of the trailing updates (so on any BLAS, with or without look-ahead):

        |P s M - L U| <= (2 u_bf16 + u_bf16^2 + gamma_{n+1}(fp32) + gamma_n(fp64)) |L| |U|   (elementwise)

    Each entry of L U is a_ij minus at most n products l_ik u_kj.  A trailing update multiplies bf16 copies of the
    fp32 factors (each product off by <= 2 u_bf16 + u_bf16^2 relative: two operand roundings, exact product) and
    sums in fp32 (the usual gamma_{n+1} = (n+1) u / (1 - (n+1) u), the +1 for the division by the pivot; the
    fp32 panel only tightens it); the check itself runs in fp64 (gamma_n of fp64).  s = F.scale is a power of
    two (exact).  Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Thm 9.3, with the mixed-
    precision product term."""
    n = M.shape[0]
    gamma = lambda k, u: k * u / (1 - k * u)  # noqa: E731
    u_bf16, u_32, u_64 = 2.0 ** -8, 2.0 ** -24, 2.0 ** -53
    bound = 2 * u_bf16 + u_bf16 ** 2 + gamma(n + 1, u_32) + gamma(n, u_64)
    L = torch.tril(F.lu.double(), -1) + torch.eye(n, dtype=torch.float64)
    U = torch.triu(F.lu.double())
    PA = (M if F.perm is None else M[F.perm]) * F.scale
    return bool(((PA - L @ U).abs() <= bound * (L.abs() @ U.abs())).all()), L @ U, bound * (L.abs() @ U.abs())


def test_lookahead_and_serial_both_meet_the_lu_backward_error_bound():
    # Look-ahead splits the trailing update differently from the serial loop, and a BLAS guarantees no bitwise
    # result across splits (MKL on AVX-512 differs by ~1 fp32 ulp): what holds by construction is that each
    # factorization meets the order-independent bound above, so the two products agree within the sum of bounds.
    A = la.random_matrix_with_cond(200, 1e2, seed=8)
    for piv in (True, False):
        M = A + 20 * torch.eye(200, dtype=torch.float64) * (not piv)
        a = la.lu_factor(M, factor="bf16", pivoting=piv, block=32, options=la.LUOptions(lookahead=False))
        b = la.lu_factor(M, factor="bf16", pivoting=piv, block=32, options=la.LUOptions(lookahead=True))
        ok_a, lu_a, tol_a = _componentwise_backward_error_ok(M, a)
        ok_b, lu_b, tol_b = _componentwise_backward_error_ok(M, b)
        assert ok_a and ok_b
        assert (a.perm is None) == (b.perm is None) and a.scale == b.scale
        if a.perm is None or torch.equal(a.perm, b.perm):  # (a pivot near-tie may choose another row: both valid)
            assert bool(((lu_a - lu_b).abs() <= tol_a + tol_b).all())
        # the bound has teeth: a factorization missing one trailing update breaks it
        bad = la.lu_factor(M, factor="bf16", pivoting=piv, block=32, options=la.LUOptions(lookahead=True))
        bad.lu[100:, 100:] += 1e-2 * bad.lu[100:, 100:].abs().max()
        assert not _componentwise_backward_error_ok(M, bad)[0]


def test_pivoting_false_matches_unpivoted_reference():
    A = la.hpl_mxp_matrix(96, seed=2)
    F = la.lu_factor(A, factor="fp32", pivoting=False, block=40)
    assert F.perm is None
    assert _factor_error(A, F) < 1e-6


def test_breakdown_without_pivoting_falls_back():
    A = la.random_matrix_with_cond(64, 10.0, seed=1)
    A[0, 0] = 0.0  # LU without pivoting divides by zero at the first step
    x, info = la.solve(A, la.random_rhs(64), pivoting=False)
    assert info.fell_back and ("breakdown" in info.reason or "non-finite" in info.reason)
    assert info.backward_error <= 16


@pytest.mark.parametrize("seed", range(5))
def test_swaps_from_pivots_matches_sequential_interchanges(seed):
    g = torch.Generator().manual_seed(seed)
    m, w, row0 = 50, 12, 7
    piv = torch.stack([torch.randint(j, m, (1,), generator=g)[0] for j in range(w)]) + 1  # 1-based, >= j
    if seed == 0:
        piv = torch.arange(1, w + 1)  # no swaps at all
    ref = list(range(row0 + m + 1))
    for j, p in enumerate((piv - 1).tolist()):
        ref[row0 + j], ref[row0 + p] = ref[row0 + p], ref[row0 + j]
    scratch = row0 + m
    dst, src = swaps_from_pivots(piv.int(), row0, scratch)
    got = torch.arange(row0 + m + 1)
    got[dst] = got[src].clone()
    assert got[:scratch].tolist() == ref[:scratch]


# ---- triangular solves -------------------------------------------------------------------------


@pytest.mark.parametrize("m", [5, 64, 130, 257])
def test_batched_recursive_triangular_inverse(m):
    g = torch.Generator().manual_seed(m)
    T = torch.randn(3, m, m, generator=g) / m**0.5 + 4 * torch.eye(m)
    for upper, unit in ((True, False), (False, True)):
        got = _tri_inv(T, upper=upper, unit=unit, leaf=16)
        tri = torch.triu(T) if upper else torch.tril(T, -1) + torch.eye(m)
        assert torch.allclose(got @ tri, torch.eye(m).expand(3, m, m), atol=1e-4)
        assert torch.equal(got, torch.triu(got) if upper else torch.tril(got))


@pytest.mark.parametrize("pivoting", [False, True])
@pytest.mark.parametrize("trsm", ["trsm", "inverse"])
def test_blocked_and_graph_trsv_match_trsm(pivoting, trsm):
    n = 230
    A = la.hpl_mxp_matrix(n, seed=5) if not pivoting else la.random_matrix_with_cond(n, 1e2, seed=5)
    ref = la.lu_factor(A, factor="bf16", pivoting=pivoting, block=64, trsv="trsm", options=la.LUOptions(trsm=trsm))
    r = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = ref.solve(r)
    for trsv in ("blocked", "graph"):  # "graph" is eager off CUDA
        F = la.lu_factor(A, factor="bf16", pivoting=pivoting, block=64, trsv=trsv, options=la.LUOptions(trsm=trsm))
        assert torch.equal(F.lu, ref.lu)
        if trsm == "inverse" and not pivoting:  # the factorization kept both inverses of every block
            assert all(inv is not None and inv[0] is not None and inv[1] is not None for inv in F.diag_inv)
        for _ in range(2):  # second call reuses the plan and its buffers
            got = F.solve(r)
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5
            got1 = F.solve(r[:, 1])
            assert got1.shape == (n,) and float((got1 - want[:, 1]).abs().max() / want[:, 1].abs().max()) < 1e-5
        assert all(inv[0] is not None and inv[1] is not None for inv in F.diag_inv)


def test_lu_option_validation():
    A = la.hpl_mxp_matrix(16, seed=0)
    with pytest.raises(ValueError, match=r"getrf_lib must be one of \('cusolver', 'default'\)"):
        la.lu_factor(A, options=la.LUOptions(getrf_lib="magma"))
    with pytest.raises(ValueError, match=r"leaf must be a positive int .* got leaf=0"):
        la.lu_factor(A, options=la.LUOptions(leaf=0))
    with pytest.raises(ValueError, match=r"trsm must be one of \('auto', 'trsm', 'inverse'\)"):
        la.lu_factor(A, options=la.LUOptions(trsm="lapack"))
    with pytest.raises(ValueError, match=r"panel must be one of \('auto', 'recursive', 'getrf'\), got panel='calu'"):
        la.lu_factor(A, panel="calu")
    with pytest.raises(TypeError, match=r"options must be a tcprec.linalg.LUOptions .* got dict"):
        la.lu_factor(A, options={"leaf": 8})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'leaf'"):
        la.lu_factor(A, leaf=8)


def test_trsm_tf32_emulates_the_gpu_u12_gemm_on_cpu():
    """trsm_tf32=True on a CPU: U12 = inv(L11) @ A12 with both operands rounded to tf32, as the
    CUDA default computes it (the CPU default stays an fp32 GEMM)."""
    n, nb = 128, 64
    A = la.random_matrix_with_cond(n, 1e2, seed=3)
    kw = dict(factor="fp16", block=nb, panel="getrf")
    F = la.lu_factor(A, options=la.LUOptions(trsm="inverse", lookahead=False, trsm_tf32=True), **kw)
    F32 = la.lu_factor(A, options=la.LUOptions(trsm="inverse", lookahead=False), **kw)  # CPU default: fp32
    L11 = F.lu[:nb, :nb]
    assert torch.equal(L11, F32.lu[:nb, :nb])  # the first panel is the same fp32 getrf
    a12 = A.float()[F.perm[:nb], nb:]  # rows of the first block after its pivoting
    want = _round_tf32(_inv_lower_unit(L11)) @ _round_tf32(a12)
    assert torch.equal(F.lu[:nb, nb:], want)
    assert torch.allclose(F32.lu[:nb, nb:], _inv_lower_unit(L11) @ a12, rtol=0, atol=0)
    assert not torch.equal(F32.lu[:nb, nb:], want)
    with pytest.raises(ValueError, match=r"trsm_tf32 must be None .* got trsm_tf32='yes'"):
        la.lu_factor(A, options=la.LUOptions(trsm_tf32="yes"))


def test_tf32_rounding_emulation():
    x = torch.tensor([1.0, 1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-12, float("inf"), -2.5])
    y = _round_tf32(x)
    assert y.tolist() == [1.0, 1.0 + 2**-10, 1.0, 1.0 + 2**-9, 1.0, float("inf"), -2.5]  # nearest-even


def test_gemm_backend_labels_cpu_emulation():
    assert "emulation" in la.gemm_backend("bf16", "cpu")
    assert canonical_factor("bfloat16") == "bf16" and canonical_factor("E4M3") == "fp8"


# ------------------------------------------------------------------------------------------------
# bad input: each error names the value, the allowed set and the fix
# ------------------------------------------------------------------------------------------------

A8 = la.hpl_mxp_matrix(8, seed=0)
B8 = torch.ones(8, dtype=torch.float64)


@pytest.mark.parametrize(
    "A, b, kwargs, exc, match",
    [
        (A8[:6], B8, {}, ValueError, r"A must be a square matrix \(n, n\), got shape \(6, 8\)"),
        (A8, B8[:5], {}, ValueError, r"b must have shape \(8,\) or \(8, k\).*got b of shape \(5,\)"),
        (A8, torch.ones(8, 0, dtype=torch.float64), {}, ValueError, "b has no columns"),
        (torch.ones(2, 2, 2), B8, {}, ValueError, "batching is not supported; loop over the batch"),
        (torch.zeros(0, 0), torch.zeros(0), {}, ValueError, "A is empty"),
        (A8.long(), B8, {}, TypeError, r"A has dtype torch.int64.*real floating-point.*A.double\(\)"),
        (A8, B8.int(), {}, TypeError, r"b has dtype torch.int32"),
        (A8.to(torch.complex128), B8, {}, TypeError, r"complex"),
        (A8.bool(), B8, {}, TypeError, r"torch.bool"),
        (A8.tolist(), B8, {}, TypeError, r"A must be a torch.Tensor.*torch.as_tensor"),
        (A8, B8, {"factor": "fp4"}, ValueError, r"factor must be one of \('bf16', 'fp16', 'tf32', 'fp8', 'fp32'\).*'fp4'"),
        (A8, B8, {"factor": None}, ValueError, r"factor must be one of"),
        (A8, B8, {"refine": "cg"}, ValueError, r"refine must be one of \('gmres', 'fgmres', 'classic'\).*'cg'"),
        (A8, B8, {"pivoting": "rook"}, ValueError, r"pivoting must be True/'partial' or False/'none'.*'rook'"),
        (A8, B8, {"tol": 0}, ValueError, r"tol must be a positive number.*tol=0"),
        (A8, B8, {"tol": float("nan")}, ValueError, r"tol must be a positive number"),
        (A8, B8, {"max_iter": -1}, ValueError, r"max_iter must be an int >= 0, got max_iter=-1"),
        (A8, B8, {"restart": 0}, ValueError, r"restart must be an int >= 1"),
        (A8, B8, {"block": 0}, ValueError, r"block must be a positive int.*block=0"),
        (A8, B8, {"panel": "magic"}, ValueError, r"panel must be one of"),
        (A8, B8, {"trsv": "x"}, ValueError, r"trsv must be one of"),
    ],
)
def test_bad_input_raises_clear_errors(A, b, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        la.solve(A, b, **kwargs)


def test_nan_and_inf_entries_are_named():
    A = A8.clone()
    A[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"A has 1 non-finite entries \(NaN or Inf\), the first at A\[2, 5\]"):
        la.solve(A, B8)
    A = A8.clone()
    A[7, 0] = float("-inf")
    A[7, 1] = float("inf")
    with pytest.raises(ValueError, match=r"A has 2 non-finite entries.*A\[7, 0\] = -inf"):
        la.solve(A, B8)
    b = B8.clone()
    b[3] = float("nan")
    with pytest.raises(ValueError, match=r"b has 1 non-finite entries.*index \(3,\)"):
        la.solve(A8, b)


@pytest.mark.parametrize("make", ["zero_row", "zero_matrix", "zero_column"])
def test_singular_matrix_raises(make):
    A = A8.clone()
    if make == "zero_row":
        A[4] = 0.0
    elif make == "zero_column":
        A[:, 6] = 0.0
    else:
        A.zero_()
    with pytest.raises(ValueError, match="A is singular"):
        la.solve(A, B8)


# ------------------------------------------------------------------------------------------------
# matrix generators
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cond", [1.0, 1e2, 1e6, 1e10, 1e12])
def test_random_matrix_with_cond_hits_target(cond):
    A = la.random_matrix_with_cond(96, cond, seed=4)
    assert A.dtype == torch.float64 and A.shape == (96, 96)
    got = float(torch.linalg.cond(A))
    assert abs(got - cond) <= 0.1 * cond
    s = torch.linalg.svdvals(A)
    assert float(s[0]) == pytest.approx(1.0, rel=1e-10)


def test_generators_are_seeded_and_hpl_matrix_is_diagonally_dominant():
    A = la.hpl_mxp_matrix(200, seed=9)
    off = A.abs().sum(1) - A.diagonal().abs()
    assert bool((A.diagonal() > off).all())  # strict row diagonal dominance
    offdiag = A[~torch.eye(200, dtype=torch.bool)]
    assert float(offdiag.min()) >= -0.5 and float(offdiag.max()) < 0.5
    assert torch.equal(A, la.hpl_mxp_matrix(200, seed=9))
    assert not torch.equal(A, la.hpl_mxp_matrix(200, seed=10))
    assert torch.equal(la.random_matrix_with_cond(20, 5.0, seed=1), la.random_matrix_with_cond(20, 5.0, seed=1))
    assert la.random_rhs(10, 2).shape == (10, 2)
    assert la.hpl_mxp_matrix(4, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: la.hpl_mxp_matrix(0), r"n must be a positive int.*n=0"),
        (lambda: la.hpl_mxp_matrix(3.5), r"n must be a positive int"),
        (lambda: la.random_matrix_with_cond(4, 0.5), r"cond must be a finite number >= 1.*cond=0.5"),
        (lambda: la.random_matrix_with_cond(4, float("inf")), r"cond must be a finite number >= 1"),
        (lambda: la.make_matrix("hilbert", 4), r"kind must be one of \('diagdom', 'general'\)"),
    ],
)
def test_generator_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# info, CLI helpers, benchmark smoke
# ------------------------------------------------------------------------------------------------


def test_info_is_frozen_serializable_and_readable(systems):
    A, b = systems["diagdom"]
    _, info = la.solve(A, b, factor="bf16", pivoting=False)
    with pytest.raises(Exception):
        info.iterations = 3  # frozen
    d = info.to_dict()
    json.dumps(d)
    assert d["path"] == "lu-bf16+fgmres" and d["meets_criterion"]
    assert info.factor_time_s > 0 and info.refine_time_s > 0
    assert info.total_time_s >= info.factor_time_s + info.refine_time_s - 1e-6
    assert "lu-bf16+fgmres" in str(info) and "criterion" in str(info)


def test_run_solve_reports_cpu_emulation():
    r = la.run_solve(96, factor="fp16", device="cpu", kind="general")
    assert r["converged"] and r["meets_criterion"] and not r["tensor_cores"]
    assert "emulation" in r["gemm"] and r["fp64_backward_error"] <= 16
    assert r["speedup"] > 0 and r["pivoting"] == "partial"


def test_bench_solve_smoke_on_cpu(tmp_path):
    from tcprec.bench.solve import bench_solve

    out = tmp_path / "solve.json"
    res = bench_solve(sizes=(64,), factors=("bf16", "fp8"), kinds=("diagdom", "general"), device="cpu",
                      repeats=1, warmup=0, out=str(out), log=lambda *_: None)
    rows = res["rows"]
    assert [r["factor"] for r in rows] == ["fp64", "bf16", "fp8", "fp64", "bf16", "fp8"]
    assert all("error" not in r for r in rows), rows
    assert all(r["backward_error"] <= 16 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["env"]["torch"] == torch.__version__ and "bf16_matmul_8192_tflops" in saved["peak"]
    assert "x fp64" in res["table"] and math.isfinite(rows[1]["speedup"])


def test_bench_solve_skips_general_rows_slower_than_fp64_and_optional_factors():
    from tcprec.bench.solve import bench_solve

    res = bench_solve(sizes=(48, 64), factors=("bf16",), optional_factors=("fp8",), optional_budget_s=0.0,
                      kinds=("diagdom", "general"), skip_slower=("general",), device="cpu", repeats=1,
                      warmup=0, out=None, log=lambda *_: None)
    rows = {(r["n"], r["kind"], r["factor"]): r for r in res["rows"]}
    assert rows[(48, "general", "fp8")]["skipped"].startswith("skipped: optional factor")
    first = rows[(48, "general", "bf16")]
    assert "error" not in first and "skipped" not in first
    later = rows[(64, "general", "bf16")]
    if first["speedup"] < 1.0:  # tiny n on a CPU: the fp64 LAPACK solve wins, so n=64 is skipped
        assert "slower" in later["skipped"] and "n=48" in later["skipped"]
        assert "skipped" in rows[(64, "general", "fp64")]
        assert "skipped: " in res["table"]
    assert "skipped" not in rows[(64, "diagdom", "bf16")]  # only the kinds named are skipped
