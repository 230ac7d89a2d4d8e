"""Test matrices for the solvers (fp64, seeded, on any device).

* ``hpl_mxp_matrix``: HPL-MxP's diagonally dominant random matrix -- off-diagonal entries uniform
  in [-0.5, 0.5), diagonal a_ii = sum_j |a_ij| (over the whole row as generated), so every row is
  strictly diagonally dominant and LU needs no pivoting.
* ``random_matrix_with_cond``: A = U diag(s) V^T with Haar-random orthogonal U, V (QR of Gaussian
  matrices, sign-corrected) and singular values geometric from 1 down to 1/cond, so the 2-norm
  condition number is ``cond`` up to rounding.
* ``random_rhs``: a seeded right-hand side.

The same seed gives the same matrix on the same device type; CPU and CUDA generators differ.
"""

from __future__ import annotations

import math

import torch

__all__ = ["hpl_mxp_matrix", "random_matrix_with_cond", "random_rhs", "make_matrix", "MATRIX_KINDS"]

MATRIX_KINDS = ("diagdom", "general")


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (the matrix order), got n={n!r}")
    return n


def _generator(device, seed: int) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got seed={seed!r}")
    return torch.Generator(device=device).manual_seed(seed)


def hpl_mxp_matrix(n: int, *, seed: int = 0, device=None, dtype=torch.float64) -> torch.Tensor:
    """HPL-MxP's diagonally dominant matrix: uniform [-0.5, 0.5) with a_ii = sum_j |a_ij|.

    >>> A = hpl_mxp_matrix(4, seed=1)
    >>> bool((A.diagonal() > (A.abs().sum(1) - A.diagonal().abs())).all())
    True
    """
    n = _check_n(n)
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = _generator(device, seed)
    A = torch.rand(n, n, generator=g, device=device, dtype=torch.float64).sub_(0.5)
    rowsum = torch.linalg.vector_norm(A, ord=1, dim=1)  # (n,) without an |A| temporary
    A.diagonal().copy_(rowsum)
    return A if dtype == torch.float64 else A.to(dtype)


def _haar_orthogonal(n: int, g: torch.Generator, device) -> torch.Tensor:
    """Haar-distributed orthogonal matrix: Q of the QR of a Gaussian, columns times sign(R_ii)."""
    a, tau = torch.geqrf(torch.randn(n, n, generator=g, device=device, dtype=torch.float64))
    sign = torch.sign(a.diagonal())
    sign[sign == 0] = 1.0
    q = torch.linalg.householder_product(a, tau)
    del a, tau
    return q.mul_(sign)  # scale column j by sign(R_jj)


def random_matrix_with_cond(
    n: int, cond: float, *, seed: int = 0, device=None, dtype=torch.float64
) -> torch.Tensor:
    """General dense matrix with 2-norm condition number ``cond``: U diag(s) V^T, s geometric
    from 1 to 1/cond, U and V Haar-random orthogonal.  Costs two fp64 QRs and one GEMM.

    >>> A = random_matrix_with_cond(32, 1e3, seed=0)
    >>> round(float(torch.linalg.cond(A)), -1)
    1000.0
    """
    n = _check_n(n)
    if isinstance(cond, bool) or not isinstance(cond, (int, float)) or not (1.0 <= cond < math.inf):
        raise ValueError(f"cond must be a finite number >= 1 (the 2-norm condition number), got cond={cond!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = _generator(device, seed)
    U = _haar_orthogonal(n, g, device)
    V = _haar_orthogonal(n, g, device)
    if n == 1:
        s = torch.ones(1, dtype=torch.float64, device=device)
    else:
        s = torch.logspace(0.0, -math.log10(cond), n, dtype=torch.float64, device=device)
    U.mul_(s)  # U diag(s): scale columns
    A = U @ V.T
    del U, V
    return A if dtype == torch.float64 else A.to(dtype)


def random_rhs(n: int, k: int | None = None, *, seed: int = 1, device=None) -> torch.Tensor:
    """Seeded fp64 right-hand side, uniform in [-0.5, 0.5), shape (n,) or (n, k)."""
    n = _check_n(n)
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = _generator(device, seed)
    shape = (n,) if k is None else (n, k)
    return torch.rand(*shape, generator=g, device=device, dtype=torch.float64).sub_(0.5)


def make_matrix(kind: str, n: int, *, cond: float = 1e2, seed: int = 0, device=None) -> torch.Tensor:
    """``kind="diagdom"`` -> hpl_mxp_matrix; ``kind="general"`` -> random_matrix_with_cond(cond)."""
    if kind == "diagdom":
        return hpl_mxp_matrix(n, seed=seed, device=device)
    if kind == "general":
        return random_matrix_with_cond(n, cond, seed=seed, device=device)
    raise ValueError(f"kind must be one of {MATRIX_KINDS}, got kind={kind!r}")
