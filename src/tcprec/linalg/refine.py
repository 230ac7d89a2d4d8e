"""Iterative refinement in fp64 around a low-precision LU: classic IR and GMRES-IR.

Both loops compute the residual ``r = b - A x`` in fp64 and stop on the HPL-MxP criterion

    backward_error = ||A x - b||_inf / ((||A||_inf ||x||_inf + ||b||_inf) * n * eps64) <= tol (16)

* classic IR (Wilkinson/Moler):   x <- x + M^-1 r, with M^-1 the fp32 triangular solves.  Converges
  when kappa(A) * u_factor is well below 1.
* GMRES-IR (Carson & Higham 2017/2018; Haidar, Tomov, Dongarra & Higham, SC'18): the correction
  solves ``M^-1 A d = M^-1 r`` by left-preconditioned, restarted GMRES in fp64 (matvec with A in
  fp64, preconditioner in fp32).  Converges for much larger kappa(A) * u_factor.
* FGMRES-IR: the correction solves ``A d = r`` by right-preconditioned *flexible* GMRES (Saad 1993):
  z_j = M^-1 v_j (fp32 triangular solves), w = A z_j (fp64), and d = Z y.  The Arnoldi relation
  A Z = V H then holds to fp64 rounding whatever rounding the fp32 preconditioner commits, so the
  small least-squares problem tracks the *true* fp64 residual.  Left-preconditioned GMRES minimises
  ||M^-1 (r - A d)|| with M^-1 applied in fp32, and that rounding caps what one correction gains at
  ~1e-4 on kappa = 100 matrices, so it needs 2-3 corrections, each restarting the Krylov space
  (n = 2048, fp16 factors: 2 corrections / 11 steps; the same factors applied in fp64: 1 / 7;
  FGMRES with the fp32 apply: 1 / 7).  One flexible correction reaches fp64 accuracy.
  Same cost per inner step (one M^-1, one fp64 matvec, CGS2), plus the basis Z (restart x n fp64).

Both give up ("stagnated" / "diverged" / "max_iter") rather than loop forever; the caller then falls
back to an fp64 solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

__all__ = ["HPL_THRESHOLD", "EPS64", "scaled_residual", "RefineResult", "classic_ir", "gmres_ir", "fgmres_ir"]

HPL_THRESHOLD = 16.0
EPS64 = float(torch.finfo(torch.float64).eps)  # 2^-52, as HPL's eps (unit roundoff is 2^-53)


def _scaled(r: torch.Tensor, x: torch.Tensor, b: torch.Tensor, anorm: float) -> float:
    """Max over columns of the HPL-MxP scaled residual (host float)."""
    n = r.shape[0]
    rn = r.abs().amax(dim=0)
    den = (anorm * x.abs().amax(dim=0) + b.abs().amax(dim=0)) * (n * EPS64)
    eta = torch.where(rn == 0, torch.zeros_like(rn), rn / den)  # exact solution of a zero system: 0
    return float(eta.max())


def scaled_residual(A: torch.Tensor, x: torch.Tensor, b: torch.Tensor, anorm: float | None = None) -> float:
    """HPL-MxP scaled residual ``||Ax-b||_inf / ((||A||_inf ||x||_inf + ||b||_inf) n eps64)``,
    computed in fp64 (max over the columns of b).  <= 16 passes HPL's criterion.

    >>> import torch
    >>> A = torch.eye(3, dtype=torch.float64); b = torch.ones(3, dtype=torch.float64)
    >>> scaled_residual(A, b, b)
    0.0
    """
    A64, x64, b64 = A.double(), x.double(), b.double()
    if x64.dim() == 1:
        x64, b64 = x64.unsqueeze(1), b64.unsqueeze(1)
    if anorm is None:
        anorm = float(torch.linalg.vector_norm(A64, ord=1, dim=1).amax())  # ||A||_inf, no |A| temporary
    r = b64 - A64 @ x64
    return _scaled(r, x64, b64, anorm)


@dataclass
class RefineResult:
    x: torch.Tensor
    history: list  # backward error after 0, 1, 2, ... corrections
    iterations: int  # corrections applied
    inner_iterations: int  # preconditioner applications inside GMRES (== iterations for classic)
    converged: bool
    reason: str  # "" when converged


def _residual(A, x, b):
    return torch.addmm(b, A, x, alpha=-1.0)  # b - A x, fp64


def classic_ir(A, b, M: Callable, *, anorm: float, tol: float, max_iter: int) -> RefineResult:
    """x <- x + M^-1 (b - A x) until the scaled residual is <= tol.  A (n, n), b (n, k) fp64."""
    stall = 0

    def give_up(eta, hist):
        nonlocal stall
        if eta > 1e3 * min(hist):
            return f"classic IR diverged (backward error {eta:.3g})"
        stall = stall + 1 if eta > 0.5 * hist[-2] else 0
        if stall >= 3:
            return (f"classic IR stagnated at backward error {eta:.3g} > {tol:g} (A too ill-conditioned "
                    f"for this factor precision; GMRES-IR or a higher-precision factor may converge)")
        return ""

    # one preconditioner application per correction, so inner_iterations == iterations
    return _refine_loop(A, b, M, anorm=anorm, tol=tol, max_iter=max_iter, name="classic IR",
                        correct=lambda x, r, eta: (M(r), 1), give_up=give_up)


def _refine_loop(A, b, M: Callable, *, anorm: float, tol: float, max_iter: int, name: str,
                 correct: Callable, give_up: Callable) -> RefineResult:
    """The outer loop shared by classic IR, GMRES-IR and FGMRES-IR: x0 = M^-1 b, fp64 residuals, stop
    at ``tol``, give up on a non-finite residual, when ``give_up(eta, hist)`` returns a reason (asked
    from the first correction on) or after ``max_iter`` corrections.
    ``correct(x, r, eta) -> (d, inner steps)`` is the inner solve."""
    x = M(b)
    hist: list = []
    inner = 0
    for it in range(max_iter + 1):
        r = _residual(A, x, b)
        eta = _scaled(r, x, b, anorm)
        hist.append(eta)
        if not math.isfinite(eta):
            return RefineResult(x, hist, it, inner, False, "non-finite residual (LU factors overflowed)")
        if eta <= tol:
            return RefineResult(x, hist, it, inner, True, "")
        if it == max_iter:
            break
        if it > 0:
            reason = give_up(eta, hist)
            if reason:
                return RefineResult(x, hist, it, inner, False, reason)
        d, steps = correct(x, r, eta)
        inner += steps
        x = x + d
    return RefineResult(x, hist, max_iter, inner, False, f"{name} reached max_iter={max_iter} at "
                        f"backward error {hist[-1]:.3g} > {tol:g}")


def _gmres(apply_op: Callable, rhs: torch.Tensor, restart: int, rtol: float, precond: Callable | None = None):
    """GMRES for op(d) = rhs, starting at d = 0 (fp64, one column), at most ``restart`` steps.

    Arnoldi with classical Gram-Schmidt applied twice (CGS2: two GEMVs per step, GPU-friendly);
    the small Hessenberg least-squares problem is solved on the host with Givens rotations.
    Stops when the least-squares residual is <= ``rtol * ||rhs||_2``.

    ``precond=None``: plain GMRES on ``apply_op`` (the left-preconditioned operator M^-1 A).
    ``precond=M``: flexible right-preconditioned GMRES -- z_j = M(v_j), w = apply_op(z_j), the
    solution is Z y; the least-squares residual is then that of ``apply_op`` itself (the true
    residual when apply_op is A in fp64), even though M is inexact or rounds differently per call.
    Returns (d, steps, estimated ||rhs - op(d)||_2 / ||rhs||_2)."""
    amax_t = rhs.abs().max()
    rhs = rhs / amax_t  # the problem is linear: solve for rhs / amax so sum(x^2) cannot underflow
    amax, beta = torch.stack([amax_t, torch.linalg.vector_norm(rhs)]).tolist()  # one host sync
    if amax == 0.0 or not math.isfinite(amax) or not math.isfinite(beta):
        return torch.zeros_like(rhs), 0, 0.0
    n = rhs.shape[0]
    V = torch.empty(restart + 1, n, dtype=torch.float64, device=rhs.device)  # (m+1, n) Krylov basis
    Z = torch.empty(restart, n, dtype=torch.float64, device=rhs.device) if precond is not None else None  # (m, n)
    V[0] = rhs / beta
    H = np.zeros((restart + 1, restart))
    cs, sn = np.zeros(restart), np.zeros(restart)
    g = np.zeros(restart + 1)
    g[0] = beta
    steps = 0
    for j in range(restart):
        if Z is None:
            w = apply_op(V[j])
        else:
            Z[j] = precond(V[j])
            w = apply_op(Z[j])
        Vj = V[: j + 1]  # (j+1, n)
        h = Vj @ w
        w = w - Vj.T @ h
        h2 = Vj @ w  # second pass (CGS2) restores orthogonality lost to cancellation
        w = w - Vj.T @ h2
        h = h + h2
        hn_t = torch.linalg.vector_norm(w)
        hcol = torch.cat([h, hn_t.reshape(1)]).cpu().numpy()  # one host sync per step
        hn = float(hcol[-1])
        H[: j + 2, j] = hcol
        for i in range(j):  # apply the previous rotations to the new column
            t = cs[i] * H[i, j] + sn[i] * H[i + 1, j]
            H[i + 1, j] = -sn[i] * H[i, j] + cs[i] * H[i + 1, j]
            H[i, j] = t
        rho = math.hypot(H[j, j], H[j + 1, j])
        if rho == 0.0 or not math.isfinite(rho):
            break
        cs[j], sn[j] = H[j, j] / rho, H[j + 1, j] / rho
        H[j, j], H[j + 1, j] = rho, 0.0
        g[j + 1] = -sn[j] * g[j]
        g[j] = cs[j] * g[j]
        steps = j + 1
        if abs(g[j + 1]) <= rtol * beta or hn <= 1e-300 * beta:
            break
        V[j + 1] = w / hn
    if steps == 0:
        return torch.zeros_like(rhs), 0, 1.0
    y = np.zeros(steps)
    for i in reversed(range(steps)):  # back substitution R y = g
        y[i] = (g[i] - H[i, i + 1 : steps] @ y[i + 1 :]) / H[i, i]
    yt = torch.from_numpy(y).to(device=rhs.device, dtype=torch.float64)
    basis = V[:steps] if Z is None else Z[:steps]
    return (basis.T @ yt) * amax, steps, abs(g[steps]) / beta


def _krylov_ir(A, b, M: Callable, *, anorm: float, tol: float, max_iter: int, restart: int, name: str,
               correct: Callable) -> RefineResult:
    """The outer loop of GMRES-IR and FGMRES-IR: :func:`_refine_loop` giving up on stagnation (< 10%
    gain per correction)."""

    def give_up(eta, hist):
        if eta > 0.9 * hist[-2]:
            return (f"{name} stagnated at backward error {eta:.3g} > {tol:g} (A too ill-conditioned for "
                    f"a {restart}-step Krylov space with this factor precision)")
        return ""

    return _refine_loop(A, b, M, anorm=anorm, tol=tol, max_iter=max_iter, name=name, correct=correct,
                        give_up=give_up)


def gmres_ir(
    A, b, M: Callable, *, anorm: float, tol: float, max_iter: int, restart: int = 30
) -> RefineResult:
    """GMRES-IR: outer fp64 residuals, inner left-preconditioned GMRES (restart ``restart``) on
    ``M^-1 A d = M^-1 r``.  ``max_iter`` bounds the outer corrections."""

    def correct(x, r, eta):
        # ask the inner solve for the reduction still needed, with a 10x margin
        rtol = min(0.1, max(1e-14, 0.1 * tol / eta))
        d = torch.empty_like(x)
        steps = 0
        for c in range(x.shape[1]):
            op = lambda v: M(A @ v)  # noqa: E731  (M^-1 A v: fp64 matvec, fp32 preconditioner)
            d[:, c], st, _ = _gmres(op, M(r[:, c]), restart, rtol)
            steps += st
        return d, steps

    return _krylov_ir(A, b, M, anorm=anorm, tol=tol, max_iter=max_iter, restart=restart, name="GMRES-IR",
                      correct=correct)


# The 2-norm reduction an FGMRES correction is asked for is FGMRES_MARGIN * tol / eta: FGMRES
# tracks ||r - A d||_2, and the inf/2-norm ratio of a residual barely moves across a correction
# (n = 2048, kappa = 100: 0.13 -> 0.10 for fp16 factors, 0.093 -> 0.096 for bf16), so the new backward
# error lands near tol / 2; when it does not, the next correction finishes the job.
FGMRES_MARGIN = 0.5


def fgmres_ir(
    A, b, M: Callable, *, anorm: float, tol: float, max_iter: int, restart: int = 30
) -> RefineResult:
    """FGMRES-IR: outer fp64 residuals, inner *flexible* right-preconditioned GMRES (restart
    ``restart``) on ``A d = r`` with z_j = M^-1 v_j.  The inner least-squares residual is the true
    fp64 residual of the correction, so one correction usually reaches ``tol``; ``max_iter``
    bounds the outer corrections.  Same stopping and give-up rules as :func:`gmres_ir`."""
    n = b.shape[0]

    def correct(x, r, eta):
        # per column: the reduction its own backward error still needs (1 for columns already done)
        den = (anorm * x.abs().amax(dim=0) + b.abs().amax(dim=0)) * (n * EPS64)  # (k,)
        need = (tol * den / r.abs().amax(dim=0).clamp_min(1e-300)).tolist()
        d = torch.zeros_like(x)
        steps = 0
        for c in range(x.shape[1]):
            if need[c] >= 1.0:
                continue  # this column already meets tol
            rtol = min(0.5, FGMRES_MARGIN * need[c])
            d[:, c], st, _ = _gmres(lambda z: A @ z, r[:, c], restart, max(rtol, 1e-15), precond=M)
            steps += st
        return d, steps

    return _krylov_ir(A, b, M, anorm=anorm, tol=tol, max_iter=max_iter, restart=restart, name="FGMRES-IR",
                      correct=correct)
