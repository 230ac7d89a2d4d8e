"""Dense linear solves to FP64 accuracy from a low-precision tensor-core LU (HPL-MxP style).

>>> import torch, tcprec.linalg as la
>>> A = la.hpl_mxp_matrix(128, seed=0)
>>> x, info = la.solve(A, torch.ones(128, dtype=torch.float64), factor="fp16")
>>> info.converged and info.backward_error <= 16
True

Modules: ``lu`` (blocked mixed-precision LU), ``refine`` (classic IR, GMRES-IR, the HPL-MxP scaled
residual), ``solver`` (``solve``: validation, refinement, fp64 fallback), ``matrices`` (test matrices),
``demo`` (``run_solve``: generate + solve + compare, for the CLI).
"""

from .demo import run_solve
from .lu import (
    FACTOR_FORMATS,
    PIVOTING_MODES,
    LUBreakdown,
    LUFactors,
    LUOptions,
    gemm_backend,
    lu_factor,
)
from .matrices import MATRIX_KINDS, hpl_mxp_matrix, make_matrix, random_matrix_with_cond, random_rhs
from .refine import HPL_THRESHOLD, scaled_residual
from .solver import DEFAULT_REFINE, REFINE_METHODS, SolveInfo, solve

__all__ = [
    "solve",
    "SolveInfo",
    "lu_factor",
    "LUFactors",
    "LUOptions",
    "LUBreakdown",
    "scaled_residual",
    "gemm_backend",
    "hpl_mxp_matrix",
    "random_matrix_with_cond",
    "random_rhs",
    "make_matrix",
    "run_solve",
    "FACTOR_FORMATS",
    "REFINE_METHODS",
    "DEFAULT_REFINE",
    "PIVOTING_MODES",
    "MATRIX_KINDS",
    "HPL_THRESHOLD",
]
