"""panel_pivot.cu (one partially pivoted LU panel a launch) against cuSOLVER's getrf on the same panel,
and tcprec.linalg's LU with it (panel="fused"): same pivots, P A = L U to fp32 accuracy, every other
column permuted exactly, solves meeting HPL-MxP's criterion."""

import pytest
import torch

import tcprec.linalg as la
from tcprec.linalg.lu import swaps_from_pivots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


@pytest.mark.parametrize("n,nb,k,cols,width,max_blocks", [
    (300, 40, 0, None, 32, None),      # two blocks, a short last leaf
    (1024, 256, 0, None, 32, None),
    (2048, 512, 512, 1536, 32, None),  # a panel below the top, columns right of `cols` left to the caller
    (4099, 1000, 77, 2000, 32, None),  # odd sizes everywhere
    (4096, 1024, 0, None, 16, None),   # 16-column leaves
    (40000, 256, 100, 1000, 32, None),  # two rows a thread
    (3000, 300, 0, None, 32, 3),       # four rows a thread, three blocks
])
def test_panel_matches_getrf(n, nb, k, cols, width, max_blocks):
    from tcprec.kernels.cuda import panel_pivot as P

    cols = n if cols is None else cols
    g = torch.Generator(device=DEV).manual_seed(n + nb)
    A = torch.randn(n + 1, n, device=DEV, generator=g)
    A[n] = 0
    W = A.clone()
    perm = torch.arange(n + 1, device=DEV)
    scratch = P.PivotScratch.allocate(nb, W.device)
    ipiv = P.panel_pivot(W, perm, k, nb, n, cols, scratch, width=width, max_blocks=max_blocks).clone()
    torch.cuda.synchronize()

    _, piv32 = torch.linalg.lu_factor(A[k:n, k : k + nb])  # cuSOLVER/MAGMA getrf, fp32
    p = perm[:n]
    diff = (ipiv.long() != piv32.long() - 1).nonzero()
    if diff.numel():  # the first difference must be a tie up to rounding (both update orders are fp32),
        j = int(diff[0])  # after which the two sequences part ways
        order = list(range(n - k))
        for i, q in enumerate((piv32.long() - 1).tolist()[: j + 1]):
            order[i], order[q] = order[q], order[i]
        theirs = k + order[j]  # getrf's pivot row of column j, as a row of A
        pos = int((p == theirs).nonzero()[0])
        lval = abs(float(W[pos, k + j])) if pos > k + j else 0.0
        assert lval >= 1 - 1e-4, f"column {j}: getrf's pivot row has multiplier {lval} here, not a tie"
        assert j >= 8, f"pivots part from getrf's already at column {j}"
    assert torch.equal(torch.sort(p).values, torch.arange(n, device=DEV)) and torch.equal(p[:k], torch.arange(k, device=DEV))
    Ap = A[p]
    other = torch.ones(n, dtype=torch.bool, device=DEV)
    other[k : k + nb] = False
    other[cols:] = False
    assert torch.equal(W[:n][:, other], Ap[:, other]), "columns outside the panel are not exactly A[perm]"
    assert torch.equal(W[:k], A[:k]) and torch.equal(W[:, cols:], A[:, cols:])
    if cols < n:  # the pivots replay the same interchanges on the caller's columns
        dst, src = swaps_from_pivots(ipiv + 1, k, scratch=n)
        R = A[:, cols:].clone()
        R.index_copy_(0, dst, R.index_select(0, src))
        assert torch.equal(R[:n], Ap[:, cols:])
    pan = W[k:n, k : k + nb].double()
    L = torch.tril(pan, -1)
    L[:nb] += torch.eye(nb, device=DEV, dtype=torch.float64)
    U = torch.triu(pan[:nb])
    ref = Ap[k:n, k : k + nb].double()
    assert float((ref - L @ U).abs().max() / ref.abs().max()) < 2e-5
    assert float(torch.tril(pan, -1).abs().max()) <= 1.0  # partial pivoting: every multiplier <= 1


def test_panel_zero_column_and_nan():
    """A zero pivot column keeps its multipliers zero (getf2's rule; the LU's breakdown check then
    reports it); a NaN is taken as the largest entry, so it reaches the factors instead of vanishing."""
    from tcprec.kernels.cuda import panel_pivot as P

    n, nb = 600, 64
    g = torch.Generator(device=DEV).manual_seed(3)
    A = torch.randn(n + 1, n, device=DEV, generator=g)
    A[:, 5] = 0
    A[n] = 0
    W = A.clone()
    perm = torch.arange(n + 1, device=DEV)
    scratch = P.PivotScratch.allocate(nb, W.device)
    P.panel_pivot(W, perm, 0, nb, n, n, scratch)
    assert float(W[5, 5]) == 0.0 and bool(torch.isfinite(W[:n, :nb]).all())
    assert bool((W[6:n, 5] == 0).all())
    B = torch.randn(n + 1, n, device=DEV, generator=g)
    B[n] = 0
    B[400, 0] = float("nan")
    perm = torch.arange(n + 1, device=DEV)
    ipiv = P.panel_pivot(B, perm, 0, nb, n, n, scratch)
    assert int(ipiv[0]) == 400 and int(perm[0]) == 400


def test_panel_bad_input():
    from tcprec.kernels.cuda import panel_pivot as P

    W = torch.zeros(65, 64, device=DEV)
    perm = torch.arange(65, device=DEV)
    s = P.PivotScratch.allocate(32, W.device)
    with pytest.raises(ValueError, match=r"row-major fp32 working matrix"):
        P.panel_pivot(W.double(), perm, 0, 32, 64, 64, s)
    with pytest.raises(ValueError, match=r"perm must be int64"):
        P.panel_pivot(W, perm.int(), 0, 32, 64, 64, s)
    with pytest.raises(ValueError, match=r"k \+ nb <= cols"):
        P.panel_pivot(W, perm, 40, 32, 64, 64, s)
    with pytest.raises(ValueError, match=r"scratch holds pivots of 32 columns, the panel has 48"):
        P.panel_pivot(W, perm, 0, 48, 64, 64, s)


@pytest.mark.parametrize("n,factor,leaf,lookahead", [(2048, "fp16", None, None), (3000, "fp16", 128, True),
                                                     (1536, "fp32", 512, False), (1024, "bf16", None, None)])
def test_lu_with_fused_panels(n, factor, leaf, lookahead):
    """The whole LU with panel='fused': a permutation with every multiplier <= 1 (partial pivoting),
    ||PA - LU|| at the format's level, solves within the HPL-MxP criterion; with fp32 updates the same
    permutation as cuSOLVER panels (with fp16 / bf16 updates the two factorizations' Schur complements
    differ at the format's rounding level, so their pivots part at the first near-tie)."""
    A = la.make_matrix("general", n, cond=1e2, seed=1, device=DEV)
    b = la.random_rhs(n, device=DEV)
    F = la.lu_factor(A, factor=factor, panel="fused", leaf=leaf, lookahead=lookahead)
    assert torch.equal(torch.sort(F.perm).values, torch.arange(n, device=DEV))
    assert float(torch.tril(F.lu, -1).abs().max()) <= 1.0
    if factor == "fp32":
        G = la.lu_factor(A, factor=factor, panel="getrf")
        agree = float((F.perm == G.perm).double().mean())
        assert agree > 0.99, agree
    LU = F.lu.double()
    Lm = torch.tril(LU, -1) + torch.eye(n, device=DEV, dtype=torch.float64)
    rel = float((A[F.perm] * F.scale - Lm @ torch.triu(LU)).abs().max() / A.abs().max())
    assert rel < {"fp16": 0.05, "bf16": 0.5, "fp32": 1e-4}[factor], rel
    x, info = la.solve(A, b, factor=factor, panel="fused", leaf=leaf, lookahead=lookahead)
    assert info.converged and info.backward_error <= 16, info
    assert info.path.startswith(f"lu-{factor}"), info.path
