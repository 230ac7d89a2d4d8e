"""``solve``: FP64-accurate ``A x = b`` from a low-precision tensor-core LU + fp64 refinement.

    validate -> fp32 working copy of A -> mixed-precision LU (lu.py) -> refinement (refine.py)
             -> backward error <= 16 ?  yes: done   no / LU broke down: torch.linalg.solve in fp64

``info.path`` says which branch produced x; x is never returned without its backward error.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .lu import LUBreakdown, canonical_factor, canonical_pivoting, gemm_backend, lu_factor, prepare_work
from .refine import HPL_THRESHOLD, classic_ir, fgmres_ir, gmres_ir, scaled_residual

__all__ = ["solve", "SolveInfo", "REFINE_METHODS", "DEFAULT_REFINE"]

REFINE_METHODS = ("gmres", "fgmres", "classic")
# Flexible GMRES-IR by default: same run on the H200 (docs/decisions/0016, general matrices,
# fp16 LU with partial pivoting), 1 outer correction instead of 3 and 343.6 vs 416.5 ms at n = 32768 (2.11x vs
# 1.74x fp64 torch.linalg.solve), 109.7 vs 128.9 ms at 16384, 46.8 vs 54.3 ms at 8192.
DEFAULT_REFINE = "fgmres"
_DEFAULT_MAX_ITER = {"classic": 50, "gmres": 10, "fgmres": 10}
_REFINERS = {"gmres": gmres_ir, "fgmres": fgmres_ir, "classic": classic_ir}


@dataclass(frozen=True)
class SolveInfo:
    """What ``solve`` did.

    ``backward_error`` is the HPL-MxP scaled residual of the returned x
    (``||Ax-b||_inf / ((||A||_inf ||x||_inf + ||b||_inf) n eps64)``, max over columns of b);
    ``path`` is ``"lu-{factor}+{refine}"`` (gmres / fgmres / classic) when refinement converged,
    ``"fp64-fallback"`` when x came from ``torch.linalg.solve`` in fp64 (``reason`` says why).
    """

    path: str
    converged: bool
    backward_error: float
    iterations: int
    inner_iterations: int
    reason: str
    factor: str
    refine: str
    pivoting: str
    n: int
    nrhs: int
    block: int
    device: str
    tol: float
    factor_time_s: float
    refine_time_s: float
    fallback_time_s: float
    total_time_s: float
    history: tuple = ()
    gemm: str = ""
    phase_times: dict = field(default_factory=dict)

    @property
    def meets_criterion(self) -> bool:
        """backward_error <= 16 (HPL-MxP)."""
        return self.backward_error <= HPL_THRESHOLD

    @property
    def fell_back(self) -> bool:
        return self.path == "fp64-fallback"

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["history"] = list(self.history)
        d["meets_criterion"] = self.meets_criterion
        return d

    def __str__(self) -> str:
        s = (f"{self.path}: backward error {self.backward_error:.3g} (criterion <= 16: "
             f"{'met' if self.meets_criterion else 'NOT met'}), {self.iterations} refinement steps"
             f" ({self.inner_iterations} inner), factor {self.factor_time_s * 1e3:.1f} ms, refine "
             f"{self.refine_time_s * 1e3:.1f} ms, total {self.total_time_s * 1e3:.1f} ms")
        if self.reason:
            s += f"; reason: {self.reason}"
        return s


def _as_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise TypeError(f"{name} must be a torch.Tensor (or numpy array), got {type(x).__name__}; "
                    f"convert with torch.as_tensor({name})")


def _check_dtype(t: torch.Tensor, name: str) -> None:
    if t.is_complex() or not t.is_floating_point():
        raise TypeError(
            f"{name} has dtype {t.dtype}; solve needs a real floating-point tensor (float64, float32, "
            f"float16 or bfloat16; complex systems are not supported): convert with {name}.double()"
        )


def _validate(A, b):
    A = _as_tensor(A, "A")
    b = _as_tensor(b, "b")
    _check_dtype(A, "A")
    _check_dtype(b, "b")
    if A.dim() > 2 and A.shape[-1] == A.shape[-2]:
        raise ValueError(
            f"A has batch dimensions (shape {tuple(A.shape)}): batching is not supported; loop over the batch, "
            f"e.g. torch.stack([tcprec.linalg.solve(A[i], b[i]) for i in range({A.shape[0]})]) (each system gets "
            "its own LU and refinement)"
        )
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be a square matrix (n, n), got shape {tuple(A.shape)}; solve handles "
                         f"square systems only (use torch.linalg.lstsq for least squares)")
    n = A.shape[0]
    if n == 0:
        raise ValueError("A is empty (shape (0, 0)); solve needs n >= 1")
    if b.dim() not in (1, 2) or b.shape[0] != n:
        raise ValueError(f"b must have shape ({n},) or ({n}, k) to match A of shape {tuple(A.shape)}, "
                         f"got b of shape {tuple(b.shape)}")
    if b.dim() == 2 and b.shape[1] == 0:
        raise ValueError(f"b has no columns (shape {tuple(b.shape)}); pass at least one right-hand side")
    if A.device != b.device:
        raise ValueError(f"A and b must be on the same device, got A on {A.device} and b on {b.device}; "
                         f"move one with .to(A.device)")
    finite_b = torch.isfinite(b)
    if not bool(finite_b.all()):
        bad = (~finite_b).nonzero()
        raise ValueError(f"b has {bad.shape[0]} non-finite entries (NaN or Inf), the first at index "
                         f"{tuple(int(v) for v in bad[0])}; a linear solve needs finite input")
    return A.detach(), b.detach()


def _check_options(factor, refine, tol, max_iter, restart):
    factor = canonical_factor(factor)
    if refine not in REFINE_METHODS:
        raise ValueError(f"refine must be one of {REFINE_METHODS} (GMRES-IR, flexible GMRES-IR or classic "
                         f"iterative refinement), got refine={refine!r}")
    if tol is None:
        tol = HPL_THRESHOLD
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 < tol < math.inf):
        raise ValueError(f"tol must be a positive number (the target scaled residual, in units of "
                         f"n*eps64; HPL's criterion is 16), got tol={tol!r}")
    if max_iter is None:
        max_iter = _DEFAULT_MAX_ITER[refine]
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be an int >= 0, got max_iter={max_iter!r}")
    if isinstance(restart, bool) or not isinstance(restart, int) or restart < 1:
        raise ValueError(f"restart must be an int >= 1 (GMRES steps per outer iteration), got restart={restart!r}")
    return factor, float(tol), max_iter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fp64_solve(A64: torch.Tensor, b64: torch.Tensor) -> torch.Tensor:
    try:
        return torch.linalg.solve(A64, b64)
    except torch.linalg.LinAlgError as e:  # exactly singular in fp64 too
        raise ValueError(
            f"A is singular: the fp64 fallback torch.linalg.solve failed too ({e}). A singular system "
            f"has no unique solution; check A for zero or linearly dependent rows/columns, or use "
            f"torch.linalg.lstsq for a least-squares answer"
        ) from None


def solve(
    A,
    b,
    *,
    factor: str = "bf16",
    refine: str = DEFAULT_REFINE,
    tol: float | None = None,
    max_iter: int | None = None,
    pivoting=True,
    block: int | None = None,
    restart: int = 30,
    fallback: bool = True,
    **lu_options,
):
    """Solve ``A x = b`` to fp64 accuracy with a low-precision tensor-core LU + fp64 refinement.

    >>> import torch, tcprec.linalg as la
    >>> A = la.hpl_mxp_matrix(256, seed=0)
    >>> b = torch.ones(256, dtype=torch.float64)
    >>> x, info = la.solve(A, b, factor="bf16")
    >>> info.path, info.backward_error <= 16
    ('lu-bf16+fgmres', True)

    Args:
        A: (n, n) real floating tensor (any device; fp64 residuals are computed on it).
        b: (n,) or (n, k).
        factor: precision of the LU's trailing-matrix GEMMs: "bf16", "fp16", "tf32", "fp8"
            (e4m3) or "fp32".  Factors are stored and applied in fp32.
        refine: "fgmres" (flexible right-preconditioned GMRES-IR, the default: its inner
            residual is the true fp64 one, so one correction usually suffices -- fewer inner
            steps on general matrices), "gmres" (GMRES-IR, left-preconditioned) or "classic"
            iterative refinement.
        tol: target HPL-MxP scaled residual (default 16, HPL's criterion).
        max_iter: outer refinement steps (default 10 for fgmres and gmres, 50 for classic).
        pivoting: True/"partial" (partial pivoting), False/"none" (only for matrices that need
            none, e.g. diagonally dominant: HPL-MxP's).
        block: LU block width (default: 64 on CPU, 256-1024 on GPU by size).
        restart: GMRES steps per outer iteration (gmres and fgmres).
        fallback: if False, raise instead of falling back to fp64 (for experiments).
        **lu_options: the other keywords of ``lu_factor`` (panel, trsv, options=LUOptions(...),
            profile).

    Returns:
        ``(x, info)``: x float64 with b's shape; ``info`` a :class:`SolveInfo`.

    Raises:
        TypeError / ValueError for bad input (names the value, the allowed set and the fix);
        ValueError if A is singular (the fp64 fallback fails too).
    """
    t_start = time.perf_counter()
    A, b = _validate(A, b)
    factor, tol, max_iter = _check_options(factor, refine, tol, max_iter, restart)
    piv = canonical_pivoting(pivoting)
    device = A.device
    n = A.shape[0]
    vec = b.dim() == 1
    with torch.no_grad():
        A64 = A if A.dtype == torch.float64 else A.double()
        b64 = (b.unsqueeze(1) if vec else b).double()  # (n, k)
        nrhs = b64.shape[1]
        # extreme scales (1e308 * A: its norms overflow, 1e-308 * A: they underflow) are solved as the same system
        # scaled by powers of two, exact: A = 2^ea A_s, b = 2^eb b_s, A_s y = b_s, x = 2^(eb - ea) y.  The
        # HPL scaled residual is invariant under that scaling, so info.backward_error is x's.
        ea, A64 = _equilibrate(A64)
        eb, b64 = _equilibrate(b64)

        # ---- factor ----------------------------------------------------------------------
        reason, F, res = "", None, None
        work, anorm, scale = prepare_work(A64)  # raises on NaN/Inf in A
        if anorm == 0.0:
            raise ValueError("A is singular: it is the zero matrix; a singular system has no unique solution")
        try:
            F = lu_factor(A64, factor=factor, pivoting=piv, block=block, _work=(work, scale), **lu_options)
            reason = F.check() or ""
        except LUBreakdown as e:
            reason = str(e)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, torch.linalg.LinAlgError) as e:
            reason = f"LU failed: {e}"
        del work
        _sync(device)
        t_factor = time.perf_counter()

        # ---- refine --------------------------------------------------------------------
        if not reason:
            run = _REFINERS[refine]
            kwargs = {"restart": restart} if refine != "classic" else {}
            try:
                res = run(A64, b64, F.solve, anorm=anorm, tol=tol, max_iter=max_iter, **kwargs)
                if not res.converged:
                    reason = res.reason
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, torch.linalg.LinAlgError) as e:
                reason = f"refinement failed: {e}"
        _sync(device)
        t_refine = time.perf_counter()

        # ---- accept or fall back -------------------------------------------------------------
        block_used = F.block if F is not None else (block or 0)
        phase_times = dict(F.phase_times) if F is not None else {}
        F = None  # free the fp32 factors before a fallback needs the memory
        if res is not None and res.converged:
            x, eta, path, converged = res.x, res.history[-1], f"lu-{factor}+{refine}", True
        else:
            if not fallback:
                raise RuntimeError(f"mixed-precision solve did not converge and fallback=False: {reason}")
            warnings.warn(f"solve: the {factor} LU + {refine} refinement did not reach fp64 accuracy ({reason}); "
                          "falling back to torch.linalg.solve in fp64 (info.path == 'fp64-fallback'; "
                          "fallback=False raises instead)", RuntimeWarning, stacklevel=2)
            x = _fp64_solve(A64, b64)
            eta = scaled_residual(A64, x, b64, anorm)
            path, converged = "fp64-fallback", False
            if not math.isfinite(eta):
                raise ValueError(f"A is singular or too ill-conditioned for fp64: the fp64 fallback produced "
                                 f"non-finite values ({reason})")
        _sync(device)
        t_end = time.perf_counter()

    if eta > tol and eta > HPL_THRESHOLD:
        warnings.warn(
            f"solve: the returned x has backward error {eta:.3g} > {max(tol, HPL_THRESHOLD):g} "
            f"(path {path}); A is probably numerically singular", RuntimeWarning, stacklevel=2,
        )
    info = SolveInfo(
        path=path,
        converged=converged,
        backward_error=float(eta),
        iterations=res.iterations if res is not None else 0,
        inner_iterations=res.inner_iterations if res is not None else 0,
        reason=reason,
        factor=factor,
        refine=refine,
        pivoting=piv,
        n=n,
        nrhs=nrhs,
        block=block_used,
        device=str(device),
        tol=tol,
        factor_time_s=t_factor - t_start,
        refine_time_s=t_refine - t_factor,
        fallback_time_s=(t_end - t_refine) if path == "fp64-fallback" else 0.0,
        total_time_s=t_end - t_start,
        history=tuple(res.history) if res is not None else (),
        gemm=gemm_backend(factor, device),
        phase_times=phase_times,
    )
    if eb != ea:
        x = _ldexp(x, eb - ea)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"the solution of A x = b overflows float64 (max|A| ~ 2^{ea}, max|b| ~ 2^{eb}); scale b "
                             "down (solve A y = b / s, then x = s * y in a wider representation)")
    x = x.squeeze(1) if vec else x
    return x, info


_EQ_RANGE = 2.0 ** 256  # outside [2^-256, 2^256] a norm or a residual of n terms could leave float64's range


def _ldexp(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t * 2**k`` for any int k, exact unless the result is subnormal: in steps whose factor is a normal double,
    monotone toward the result, so no intermediate overflows or underflows where the result does not."""
    while k:
        step = max(-1000, min(1000, k))
        t = t * math.ldexp(1.0, step)
        k -= step
    return t


def _equilibrate(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(e, t * 2**-e) with max|t * 2**-e| in [0.5, 1) when max|t| lies outside [2^-256, 2^256]; (0, t) otherwise
    (also for a zero or non-finite t, which the checks after report)."""
    amax = float(t.abs().max())
    if amax == 0.0 or not math.isfinite(amax) or 1.0 / _EQ_RANGE <= amax <= _EQ_RANGE:
        return 0, t
    e = math.frexp(amax)[1]
    return e, _ldexp(t, -e)
