"""panel_cluster.cu (one partially pivoted LU leaf a launch of one thread-block cluster) against cuSOLVER's
getrf on the same leaf: the same pivots, getrf's packed L\\U (fp32 accuracy) in getf2's row order, the
interchanges applied exactly to the other columns asked for and returned for the rest; zero columns and NaN;
and tcprec.linalg's LU with it (panel="cluster")."""

import pytest
import torch

import tcprec.linalg as la

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


def _run(A, r0, c0, n, w, variant=None, cols=None, prof=None):
    from tcprec.kernels.cuda import panel_cluster as P

    W = A.clone()
    ipiv = torch.full((w,), -7, dtype=torch.int32, device=DEV)
    idx = torch.full((2, 2 * w), -7, dtype=torch.int64, device=DEV)
    P.panel_cluster(W, r0, c0, n, w, scratch=A.shape[0] - 1, ipiv=ipiv, idx=idx, variant=variant, cols=cols,
                    prof=prof)
    torch.cuda.synchronize()
    return W, ipiv, idx


@pytest.mark.parametrize("m,w,r0,c0,variant,cols", [
    (32768, 16, 0, 0, None, (0, 300)),     # the LU's first leaf at n = 32768: 16 blocks of 2048 rows
    (16000, 32, 5, 12, None, (4, 1000)),   # two rows a thread
    (4099, 32, 100, 3, None, None),         # rows not a multiple of the cluster, unaligned columns
    (1000, 13, 0, 40, None, (40, 53)),      # a narrow leaf of the 16-wide variant
    (33, 32, 0, 0, (32, 1, 16), (0, 70)),  # blocks with no rows
    (5000, 16, 0, 0, (16, 4, 4), (0, 77)),  # four rows a thread, the last ones partly empty
    (8000, 32, 7, 0, (32, 2, 8), None),
])
def test_leaf_matches_getrf(m, w, r0, c0, variant, cols):
    from tcprec.kernels.cuda import panel_cluster as P

    v = P.ClusterVariant(*variant) if variant else None
    n = r0 + m
    g = torch.Generator(device=DEV).manual_seed(m + w)
    ncol = max(c0 + w + 7, cols[1] + 5 if cols else 0)
    A = torch.randn(n + 1, ncol, device=DEV, generator=g)
    A[n] = 0  # scratch row
    prof = torch.zeros(16, 8, dtype=torch.int64, device=DEV)
    W, ipiv, idx = _run(A, r0, c0, n, w, v, cols, prof)
    lu, piv = torch.linalg.lu_factor(A[r0:n, c0 : c0 + w])
    assert torch.equal(ipiv.long(), piv.long() - 1 + r0), "pivots differ from getrf's"
    leaf = W[r0:n, c0 : c0 + w]
    err = float((leaf - lu).abs().max() / lu.abs().max())
    assert err < 1e-5, f"L\\U differs from getrf's by {err:.3g}"
    dst, src = idx
    assert int(dst.min()) >= r0 and int(src.min()) >= r0 and int(dst.max()) <= n and int(src.max()) <= n
    assert torch.equal(torch.sort(dst).values, torch.sort(src).values), "dst/src must be one permutation"
    Ap = A.clone()
    Ap.index_copy_(0, dst, A.index_select(0, src))
    inside = torch.zeros(ncol, dtype=torch.bool, device=DEV)
    if cols:
        inside[cols[0] : cols[1]] = True
    inside[c0 : c0 + w] = False
    assert torch.equal(W[:, inside], Ap[:, inside]), "the other panel columns are not exactly A permuted"
    outside = ~inside
    outside[c0 : c0 + w] = False
    assert torch.equal(W[:, outside], A[:, outside]), "columns outside cols changed"
    # the interchanges are those of the pivots: replaying getf2's swaps gives the same row order
    order = torch.arange(n + 1, device=DEV)
    for j, p in enumerate(ipiv.tolist()):
        a, b = r0 + j, p
        order[[a, b]] = order[[b, a]]
    moved = torch.arange(n + 1, device=DEV)
    moved.index_copy_(0, dst, moved.index_select(0, src))
    assert torch.equal(moved, order)
    assert int(prof[0, 3]) > 0  # the cluster barriers were timed


def test_leaf_zero_column_and_nan():
    """A zero column keeps its multipliers zero (getf2's rule) and picks the first row; a NaN is the
    largest entry, so it reaches the factors instead of vanishing."""
    m, w = 3000, 16
    g = torch.Generator(device=DEV).manual_seed(3)
    A = torch.randn(m + 1, w, device=DEV, generator=g)
    A[m] = 0
    A[:m, 4] = 0.0  # column 4 is zero: after 4 steps of elimination it is still exactly zero
    W, ipiv, idx = _run(A, 0, 0, m, w)
    assert torch.isfinite(W).all()
    assert float(W[4, 4]) == 0.0 and float(W[5:m, 4].abs().max()) == 0.0
    assert int(ipiv[4]) == 4  # all keys equal: the lowest LAPACK position
    A2 = torch.randn(m + 1, w, device=DEV, generator=g)
    A2[m] = 0
    A2[1234, 0] = float("nan")
    _, ipiv2, _ = _run(A2, 0, 0, m, w)
    assert int(ipiv2[0]) == 1234


def test_bad_input():
    from tcprec.kernels.cuda import panel_cluster as P

    W = torch.zeros(100, 40, device=DEV)
    ipiv = torch.zeros(32, dtype=torch.int32, device=DEV)
    idx = torch.zeros(2, 64, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="fp32"):
        P.panel_cluster(W.double(), 0, 0, 99, 32, 99, ipiv, idx)
    with pytest.raises(ValueError, match="n - r0 >= w"):
        P.panel_cluster(W, 80, 0, 99, 32, 99, ipiv, idx)
    with pytest.raises(ValueError, match="idx"):
        P.panel_cluster(W, 0, 0, 99, 16, 99, ipiv, idx)
    with pytest.raises(ValueError, match="cols"):
        P.panel_cluster(W, 0, 8, 99, 16, 99, ipiv, cols=(10, 30))
    with pytest.raises(ValueError, match="does not fit"):
        P.panel_cluster(torch.zeros(40001, 32, device=DEV), 0, 0, 40000, 32, 40000, ipiv, idx)
    with pytest.raises(ValueError, match="65535 rows"):
        P.panel_cluster(torch.zeros(70001, 16, device=DEV), 0, 0, 70000, 16, 70000, ipiv, idx[:, :32].contiguous())


@pytest.mark.parametrize("n,factor,lookahead,block", [(2048, "fp16", None, 1024), (3000, "fp16", False, 512),
                                                      (1536, "fp32", True, 256), (1000, "bf16", None, None)])
def test_lu_with_cluster_panels(n, factor, lookahead, block):
    """The whole LU with panel='cluster': a permutation with every multiplier <= 1, ||PA - LU|| at the
    format's level, with fp32 updates the same permutation as cuSOLVER panels, solves within HPL-MxP's
    criterion."""
    A = la.make_matrix("general", n, cond=1e2, seed=2, device=DEV)
    b = la.random_rhs(n, device=DEV)
    kw = dict(factor=factor, panel="cluster", lookahead=lookahead, block=block)
    F = la.lu_factor(A, **kw)
    assert torch.equal(torch.sort(F.perm).values, torch.arange(n, device=DEV))
    assert float(torch.tril(F.lu, -1).abs().max()) <= 1.0
    G = la.lu_factor(A, factor=factor, panel="getrf", lookahead=lookahead, block=block)
    if factor == "fp32":
        assert float((F.perm == G.perm).double().mean()) > 0.99

    def rel_err(F):
        LU = F.lu.double()
        Lm = torch.tril(LU, -1) + torch.eye(n, device=DEV, dtype=torch.float64)
        return float((A[F.perm] * F.scale - Lm @ torch.triu(LU)).abs().max() / A.abs().max())

    rel, rel_getrf = rel_err(F), rel_err(G)  # with fp16 / bf16 updates the pivots part at near-ties: compare levels
    assert rel < max(2 * rel_getrf, {"fp16": 0.02, "bf16": 0.2, "fp32": 1e-5}[factor]), (rel, rel_getrf)
    x, info = la.solve(A, b, **kw)
    assert info.converged and info.backward_error <= 16, info
    assert info.path.startswith(f"lu-{factor}"), info.path
