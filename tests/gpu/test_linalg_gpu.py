"""tcprec.linalg on CUDA at n = 2048..4096: real tensor-core GEMMs, streams (look-ahead), cuSOLVER
panels.  Same criteria as tests/test_linalg.py: converged answers meet HPL-MxP's ||Ax-b|| / ((||A||
||x|| + ||b||) n eps) <= 16; ill-conditioned systems converge or fall back, and info says which."""

import pytest
import torch

import tcprec.linalg as la
from tcprec.linalg.lu import swaps_from_pivots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


def backward_error(A, x, b):
    return la.scaled_residual(A, x, b)


@pytest.fixture(scope="module")
def systems():
    n = 2048
    return {
        "diagdom": (la.hpl_mxp_matrix(n, seed=3, device=DEV), la.random_rhs(n, seed=4, device=DEV)),
        "general": (la.random_matrix_with_cond(n, 1e2, seed=5, device=DEV), la.random_rhs(n, seed=6, device=DEV)),
    }


@pytest.mark.parametrize("factor", la.FACTOR_FORMATS)
@pytest.mark.parametrize("kind", ["diagdom", "general"])
def test_every_factor_meets_hpl_criterion_on_gpu(systems, factor, kind):
    A, b = systems[kind]
    x, info = la.solve(A, b, factor=factor, pivoting=(kind == "general"))
    assert x.device.type == "cuda" and x.dtype == torch.float64
    assert backward_error(A, x, b) <= 16.0, info
    if kind == "diagdom" or factor != "fp8":
        assert info.converged and info.path == f"lu-{factor}+fgmres", info
    else:
        assert info.converged or (info.fell_back and info.reason)


@pytest.mark.parametrize("refine", la.REFINE_METHODS)
def test_n4096_bf16_both_refinements(refine):
    n = 4096
    A = la.hpl_mxp_matrix(n, seed=1, device=DEV)
    b = la.random_rhs(n, seed=2, device=DEV)
    for pivoting in (False, True):
        x, info = la.solve(A, b, factor="bf16", refine=refine, pivoting=pivoting)
        assert info.converged, info
        assert backward_error(A, x, b) <= 16.0
        assert "cuBLAS" in info.gemm


@pytest.mark.parametrize("cond", [1e2, 1e6, 1e10, 1e12])
def test_condition_numbers_converge_or_fall_back_on_gpu(cond):
    n = 2048
    A = la.random_matrix_with_cond(n, cond, seed=11, device=DEV)
    b = la.random_rhs(n, seed=12, device=DEV)
    x, info = la.solve(A, b, factor="bf16")
    assert backward_error(A, x, b) <= 16.0
    assert info.converged == (info.path == "lu-bf16+fgmres")
    assert info.converged or (info.path == "fp64-fallback" and info.reason)
    if cond <= 1e2:
        assert info.converged


@pytest.mark.parametrize(
    "opts",
    [
        dict(panel="recursive", options=la.LUOptions(leaf=64, lookahead=True)),
        dict(panel="recursive", trsv="trsm", options=la.LUOptions(leaf=128, lookahead=False)),
        dict(panel="getrf", options=la.LUOptions(lookahead=True, trsm="inverse")),
    ],
)
def test_lu_variants_factor_accurately_on_gpu(opts):
    n = 2048
    A = la.random_matrix_with_cond(n, 1e3, seed=7, device=DEV)
    F = la.lu_factor(A, factor="fp32", pivoting=True, block=256, **opts)
    L = torch.tril(F.lu.double(), -1) + torch.eye(n, dtype=torch.float64, device=DEV)
    U = torch.triu(F.lu.double())
    err = float((A[F.perm] - L @ U).abs().max() / A.abs().max())
    assert err < 1e-4
    b = la.random_rhs(n, device=DEV)
    assert float((A @ F.solve(b) - b).abs().max()) < 1e-2


def test_lookahead_matches_serial_factorization():
    n = 3072
    A = la.random_matrix_with_cond(n, 1e2, seed=8, device=DEV)
    a = la.lu_factor(A, factor="bf16", pivoting=True, block=512, options=la.LUOptions(lookahead=False))
    b = la.lu_factor(A, factor="bf16", pivoting=True, block=512, options=la.LUOptions(lookahead=True))
    assert torch.equal(a.perm, b.perm)
    assert float((a.lu - b.lu).abs().max()) < 1e-3 * float(a.lu.abs().max())


def test_swaps_from_pivots_on_gpu():
    g = torch.Generator().manual_seed(0)
    m, w, row0 = 300, 64, 10
    piv = torch.stack([torch.randint(j, m, (1,), generator=g)[0] for j in range(w)]) + 1
    ref = list(range(row0 + m + 1))
    for j, p in enumerate((piv - 1).tolist()):
        ref[row0 + j], ref[row0 + p] = ref[row0 + p], ref[row0 + j]
    dst, src = swaps_from_pivots(piv.int().to(DEV), row0, row0 + m)
    got = torch.arange(row0 + m + 1, device=DEV)
    got[dst] = got[src].clone()
    assert got[: row0 + m].tolist() == ref[: row0 + m]


def test_fp8_uses_tensor_cores_where_available():
    cap = torch.cuda.get_device_capability()
    label = la.gemm_backend("fp8", DEV)
    if cap >= (8, 9):
        assert "torch._scaled_mm" in label
    assert "cuBLAS bf16" in la.gemm_backend("bf16", DEV)


def test_device_mismatch_and_singular_on_gpu():
    A = la.hpl_mxp_matrix(64, device=DEV)
    with pytest.raises(ValueError, match=r"same device.*cuda.*cpu"):
        la.solve(A, torch.ones(64, dtype=torch.float64))
    A[3] = 0
    with pytest.raises(ValueError, match="A is singular"):
        la.solve(A, torch.ones(64, dtype=torch.float64, device=DEV))


def test_bench_solve_smoke_on_gpu(tmp_path):
    from tcprec.bench.solve import bench_solve

    res = bench_solve(sizes=(1024,), factors=("bf16",), kinds=("diagdom",), repeats=1,
                      out=str(tmp_path / "s.json"), log=lambda *_: None)
    rows = res["rows"]
    assert all("error" not in r for r in rows), rows
    assert rows[1]["backward_error"] <= 16 and rows[1]["speedup"] > 0
    assert res["env"]["gpu"]


def _lu_error(A, F):
    n = A.shape[0]
    L = torch.tril(F.lu.double(), -1) + torch.eye(n, dtype=torch.float64, device=A.device)
    U = torch.triu(F.lu.double())
    PA = A if F.perm is None else A[F.perm]
    return float((PA - L @ U / F.scale).abs().max() / A.abs().max())


@pytest.mark.parametrize("lib", ["cusolver", "default"])
@pytest.mark.parametrize("panel", ["getrf", "recursive"])
def test_getrf_routing_factors_accurately(lib, panel):
    n = 2560  # panels taller than 2048 rows: torch's default would pick MAGMA batched
    A = la.random_matrix_with_cond(n, 1e2, seed=14, device=DEV)
    before = torch.backends.cuda.preferred_linalg_library()
    F = la.lu_factor(A, factor="fp32", pivoting=True, panel=panel, block=512, options=la.LUOptions(getrf_lib=lib))
    assert torch.backends.cuda.preferred_linalg_library() == before  # restored
    assert _lu_error(A, F) < 1e-4
    assert float(torch.tril(F.lu, -1).abs().max()) <= 1.0 + 1e-6  # partial pivoting: |L| <= 1


def test_trsv_graph_matches_blocked_and_converges():
    n = 4096
    A = la.hpl_mxp_matrix(n, seed=3, device=DEV)
    Fg = la.lu_factor(A, factor="bf16", pivoting=False, trsv="graph")
    Fb = la.lu_factor(A, factor="bf16", pivoting=False, trsv="blocked")
    Ft = la.lu_factor(A, factor="bf16", pivoting=False, trsv="trsm")
    r = torch.randn(n, dtype=torch.float64, device=DEV)
    want = Ft.solve(r)
    for _ in range(3):
        for F in (Fg, Fb):
            got = F.solve(r)
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert Fg._graph not in (None, False)  # captured and replayed
    b = la.random_rhs(n, device=DEV)
    for trsv in ("graph", "blocked"):
        x, info = la.solve(A, b, factor="bf16", pivoting=False, trsv=trsv)
        assert info.converged and backward_error(A, x, b) <= 16.0, info


@pytest.mark.parametrize("factor", ["bf16", "fp16", "fp8"])
def test_nopivot_lookahead_matches_serial_on_gpu(factor):
    n = 4096
    A = la.hpl_mxp_matrix(n, seed=5, device=DEV)
    a = la.lu_factor(A, factor=factor, pivoting=False, block=512, options=la.LUOptions(lookahead=False))
    b = la.lu_factor(A, factor=factor, pivoting=False, block=512, options=la.LUOptions(lookahead=True), profile=True)
    assert float((a.lu - b.lu).abs().max()) < 1e-3 * float(a.lu.abs().max())
    assert "side" in b.phase_times and "panel" in b.phase_times
    assert all(inv is not None for inv in b.diag_inv)  # trsm="inverse" keeps both inverses per block
