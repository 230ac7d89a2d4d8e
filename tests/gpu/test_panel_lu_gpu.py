"""panel_lu.cu (one CALU leaf a launch) against the torch tournament (batched getrf, same tree), and
tcprec.linalg's LU with it: P A = L U to fp32 accuracy, solves meeting HPL-MxP's criterion."""

import pytest
import torch

import tcprec.linalg as la
from tcprec.linalg.lu import _tournament

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


def _leaf(m_rows, k, w, ncols, cols, seed, variant=None):
    """Run one leaf on a random (n + 1, ncols) working matrix; return before, after, perm, dst, src."""
    from tcprec.kernels.cuda import panel_lu as P

    n = k + m_rows
    g = torch.Generator(device=DEV).manual_seed(seed)
    work = torch.randn(n + 1, ncols, device=DEV, generator=g)
    work[n].zero_()
    before = work.clone()
    perm = torch.arange(n + 1, device=DEV)
    scratch = P.PanelScratch.allocate(n, ncols, work.device)
    dst, src = P.panel_calu(work, perm, k, w, n, cols, scratch, variant)
    torch.cuda.synchronize()
    return before, work, perm, dst, src, scratch


@pytest.mark.parametrize("m_rows,k,w,threads,unroll", [
    (40, 0, 32, 256, False), (1000, 8, 32, 256, False), (1500, 3, 17, 128, False), (5000, 64, 64, 256, False),
    (40000, 0, 32, 256, False), (40000, 0, 32, 1024, True), (9000, 16, 64, 512, True), (70, 5, 64, 128, False),
    (200, 0, 1, 256, False), (3000, 0, 32, 128, True)])
def test_leaf_matches_torch_tournament(m_rows, k, w, threads, unroll):
    """Same pivot rows as the batched-getrf tournament with the kernel's tree (first-level blocks of
    ``threads`` rows, fan-in threads / width); rows moved whole within [0, cols), columns beyond untouched; top block =
    getrf's L11\\U11 of the selection; L21 U11 = A21; dst / src replay the interchange."""
    from tcprec.kernels.cuda import panel_lu as P

    ncols = k + max(w, 64) + 40
    cols = k + w + 7  # interchanges reach columns [0, cols) only
    width = 32 if w <= 32 else 64
    v = P.PanelVariant(width, threads, unroll)
    before, work, perm, dst, src, _ = _leaf(m_rows, k, w, ncols, cols, seed=m_rows + w, variant=v)
    n = k + m_rows
    sel, top = _tournament(before[k:n, k : k + w], v.threads, k, n, fan_in=v.fan_in)
    order = perm[:n]  # row i now holds original row order[i]
    assert torch.equal(order[k : k + w].cpu(), sel.cpu())
    assert sorted(order.tolist()) == list(range(n)), "perm is a permutation"
    # whole rows moved in [0, cols) outside the panel, untouched beyond
    left = torch.cat([work[:n, :k], work[:n, k + w : cols]], 1)
    assert torch.equal(left, torch.cat([before[order, :k], before[order, k + w : cols]], 1))
    assert torch.equal(work[:n, cols:], before[:n, cols:])
    # top block: getrf's packed L11\U11 of the selected rows
    torch.testing.assert_close(work[k : k + w, k : k + w], top, rtol=1e-4, atol=1e-4)
    # L21 U11 = A21 (the original rows now below the top)
    U = torch.triu(work[k : k + w, k : k + w])
    torch.testing.assert_close(work[k + w : n, k : k + w] @ U, before[order[k + w : n], k : k + w],
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(work[:k, k : k + w], before[order[:k], k : k + w])
    # dst / src: the same interchange on any other columns
    replay = before.clone()
    replay[dst] = replay[src]
    assert torch.equal(replay[:n, cols:], before[order, cols:])
    assert dst.shape == src.shape == (2 * width,)


def test_scratch_counters_reset_between_launches():
    """The tree's arrival counters are zero after a launch (the next leaf relies on it)."""
    *_, scratch = _leaf(40000, 0, 32, 96, 96, seed=1)
    assert int(scratch.cnt.abs().sum()) == 0


def _lu_error(A, F):
    """max |P A - L U| / max |A| of packed factors (A's scale is 1 here)."""
    L = torch.tril(F.lu.double(), -1) + torch.eye(A.shape[0], device=DEV, dtype=torch.float64)
    return float((A[F.perm] - L @ torch.triu(F.lu.double())).abs().max() / A.abs().max())


@pytest.mark.parametrize("n,leaf", [(2048, 32), (2500, 64), (3000, 32)])
def test_lu_with_calu_kernel(n, leaf):
    """P A = L U to fp32-LU accuracy (tf32 trailing updates off: factor fp32); the default lookahead
    queues interchanges for the side stream's columns (dst / src); a bf16 solve converges."""
    A = la.make_matrix("general", n, cond=1e2, seed=n, device=DEV)
    F = la.lu_factor(A, factor="fp32", panel="calu", leaf=leaf)
    assert F.check() is None and F.perm is not None
    err, ref = _lu_error(A, F), _lu_error(A, la.lu_factor(A, factor="fp32", panel="getrf"))
    assert err <= 20 * ref + 1e-6, (err, ref)
    b = la.random_rhs(n, seed=1, device=DEV)
    x, info = la.solve(A, b, factor="bf16", panel="calu", leaf=leaf)
    assert info.converged and la.scaled_residual(A, x, b) <= 16.0, info


def test_singular_panel_reported():
    """A zero column: the kernel picks a zero pivot (no division), the LU's check names it."""
    n = 1024
    A = la.make_matrix("general", n, cond=1e2, seed=3, device=DEV)
    A[:, 100] = 0.0
    F = la.lu_factor(A, factor="fp32", panel="calu")
    assert F.check() is not None and "pivot" in F.check()
