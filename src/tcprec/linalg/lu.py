"""Blocked right-looking LU in fp32 whose trailing updates run on tensor cores in a low precision.

The whole algorithm, for a working copy ``W`` (fp32, row-major, one spare "scratch" row at the
bottom) of ``scale * A``::

    for k in range(0, n, nb):                       # one block column per step
        panel:  factor W[k:, k:k+nb] in fp32          # partial pivoting: whole rows are swapped
        U12  =  L11^-1 @ W[k:k+nb, k+nb:]             # fp32 TRSM (or fp32/tf32 GEMM by inv(L11))
        W22 -=  lowp(L21) @ lowp(U12)                 # tensor cores, fp32 accumulate: ~all flops

``lowp`` rounds the fp32 operands to the factor format (bf16, fp16, tf32 or fp8 e4m3, with
power-of-two scales for fp16 and fp8 so nothing overflows or flushes to zero); the product is
accumulated and stored in fp32, so the factors themselves stay fp32.  On a CPU the same rounding is
done in software and the product runs in fp32 (tensor cores multiply exactly and accumulate in
fp32, so this is the same arithmetic up to summation order); ``gemm_backend()`` says which path ran.

Pivoting:

* ``"partial"`` -- partial pivoting.  The panel is one ``getrf`` call (``panel="getrf"``, the CUDA
  default), Toledo's recursive LU (``panel="recursive"``: split the columns in halves, factor the
  left half, update the right half with a TRSM and a GEMM, recurse; ``getrf`` only on leaves of
  ``leaf`` columns).  On CUDA every single-matrix getrf is routed to cuSOLVER (``getrf_lib``): torch's default sends a
  tall panel to MAGMA's batched routine, 20 ms per 8192 x 1024 panel on an H100.  Row
  interchanges become one gather/scatter of at most ``2 * width`` whole rows per leaf, computed
  on the device (no host sync).  (Tournament pivoting and three CUDA panel kernels were measured
  level with or slower than getrf in the whole LU and removed: docs/decisions/0010-0012.)
* ``"none"`` -- no pivoting (what HPL-MxP does on its diagonally dominant matrix): cuSOLVER getrf
  of the diagonal block, its two triangular inverses, then ``L21 = A21 U11^-1`` and
  ``U12 = L11^-1 A12`` as tf32 GEMMs; the inverses are kept for the triangular solves.

Accuracy on general matrices (dense random, kappa_2 = 100, partial pivoting; CPU emulation, which
reproduces the H200's refinement counts at n = 8192: GMRES-IR 3/23 fp16, 6/180 bf16).  The error is
operand rounding of L21 and U12 (each about half, adding in quadrature; the fp32 trailing matrix,
the fp32 panels and fp16's power-of-two scales add nothing measurable: fp16 factors are bit-identical
to tf32's), amplified by || |L| |U| || / ||A||, which grows faster than n (480 at n = 1024, 1250 at
2048, 8300 at 8192) while the growth factor stays ~15-60.  So ||PA - LU||_inf / ||A||_inf grows ~n:
bf16 0.061 / 0.112 / 0.202 at n = 1024 / 2048 / 4096 (CPU defaults), fp16 and tf32 8x less.  The
eigenvalues of M^-1 A cluster around 1 within a radius of 0.02 (fp16) / 0.17 (bf16) at n = 1024 and
0.03 / 0.32 at 2048 (||I - M^-1 A||_2 is far larger, 0.3-0.7 / 3-6: non-normal), and the inner
GMRES steps follow that radius: bf16's extrapolates to ~1 by n ~ 8192, where no 30-step Krylov space helps
(restarted GMRES gains ~25x per 30 steps) and larger n falls back.  On CUDA U12 = inv(L11) @ A12 is
a tf32 GEMM (``trsm_tf32``); that rounding doubles fp16's ||PA - LU|| at n = 4096 (inner steps
7 -> 10) and floors any more accurate update (bf16x3 hi/lo splits: 3 steps with an fp32 U12, 10
with the tf32 one, n = 8192).  ``refine="fgmres"`` removes the restarts between corrections.

(A random butterfly transform + no pivoting was tried for general matrices and dropped: on dense
random matrices its growth factor and kappa(L), kappa(U) ~ 1e9 made the bf16 preconditioner useless.)

``LUFactors.solve(r)`` applies ``M^-1 ~ A^-1`` in fp32 (triangular solves on the fp32 factors) to
an fp64 vector and returns fp64; it is the preconditioner of iterative refinement.  On CUDA the
solves are blocked (``trsv="blocked"``): inverted diagonal blocks + GEMVs, two cuBLAS calls per
block on pre-sliced buffers; ``trsv="graph"`` replays that sequence from a CUDA graph.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..formats import format as _format
from ..precision import FACTOR_FORMATS, canonical_factor  # noqa: F401  (re-exported: one vocabulary)

__all__ = [
    "FACTOR_FORMATS",
    "PIVOTING_MODES",
    "PANEL_METHODS",
    "TRSV_METHODS",
    "LUOptions",
    "LUFactors",
    "LUBreakdown",
    "lu_factor",
    "canonical_factor",
    "canonical_pivoting",
    "gemm_backend",
    "default_block",
]

PIVOTING_MODES = ("partial", "none")
PANEL_METHODS = ("auto", "recursive", "getrf")
TRSV_METHODS = ("auto", "trsm", "blocked", "graph")
TRSM_METHODS = ("auto", "trsm", "inverse")
GETRF_LIBS = ("cusolver", "default")

_PIVOTING_ALIASES = {"partial": "partial", "none": "none"}

# The finite range of each low format, derived from tcprec's format records (never hand-typed).
_FMAX = {"fp16": _format("fp16").max, "fp8": _format("e4m3").max}
_LOWP_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LUBreakdown(RuntimeError):
    """The low-precision LU could not be completed (zero or non-finite pivot, overflow)."""


def canonical_pivoting(pivoting) -> str:
    """``True`` -> ``"partial"``, ``False`` -> ``"none"``."""
    if pivoting is True:
        return "partial"
    if pivoting is False:
        return "none"
    key = pivoting.lower() if isinstance(pivoting, str) else None
    if key not in _PIVOTING_ALIASES:
        raise ValueError(
            f"pivoting must be True/'partial' or False/'none' (no pivoting: only for matrices that "
            f"need none, e.g. diagonally dominant), got pivoting={pivoting!r}"
        )
    return _PIVOTING_ALIASES[key]


def default_block(n: int, device: torch.device) -> int:
    """Block width: large on a GPU (the trailing GEMM's arithmetic intensity grows with it and the
    fp32 trailing matrix is read and written once per step), small on a CPU."""
    if device.type == "cuda":
        if n >= 8192:  # H100, no pivoting: 1024 beat 512 and 256 at n = 8192 (9.5 vs 10.3 / 12.4 ms)
            return 1024
        if n >= 4096:
            return 512
        return 256
    return 64


# --------------------------------------------------------------------------------------------
# Precision switches and the low-precision trailing update
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tf32(enabled: bool):
    """fp32 matmuls on CUDA use tf32 tensor cores iff ``enabled`` (restored on exit)."""
    matmul = torch.backends.cuda.matmul
    try:
        old = matmul.allow_tf32
    except (RuntimeError, AttributeError):  # a build that only has the newer fp32_precision API
        old = None
    if old is None or old == enabled:
        if old is None and hasattr(matmul, "fp32_precision"):
            prev = matmul.fp32_precision
            matmul.fp32_precision = "tf32" if enabled else "ieee"
            try:
                yield
            finally:
                matmul.fp32_precision = prev
            return
        yield
        return
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = old


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to tf32 (10 mantissa bits, nearest-even) in software, for the CPU emulation."""
    bits = x.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32), x)


def _pow2_scale(amax: float, fmax: float) -> float:
    """Largest power of two s with amax * s <= fmax (1 for zero / non-finite amax)."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    e = math.floor(math.log2(fmax / amax))
    s = 2.0 ** max(-120, min(120, e))
    while amax * s > fmax:  # guard log2 rounding
        s *= 0.5
    return s


def _pow2_scale_t(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Tensor version of _pow2_scale (no host sync), fp32 scalar tensor."""
    safe = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    e = torch.floor(torch.log2(fmax / safe.double())).clamp(-120, 120)
    s = torch.exp2(e)
    s = torch.where(safe.double() * s > fmax, s * 0.5, s)
    return s.float()


# Which torch entry point does "C -= A_lp @ B_lp with an fp32 result" on this build:
# probed once per device type and cached.  Values: 'addmm_out_dtype', 'mm_out_dtype', 'lowp_out'.
_CAPS: dict = {}


def _probe_lowp_gemm(device: torch.device, dtype: torch.dtype) -> str:
    key = ("gemm", device.type, dtype)
    if key in _CAPS:
        return _CAPS[key]
    mode = "lowp_out"
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(48, 32, generator=g).to(device)
    b = torch.randn(32, 40, generator=g).to(device)
    big = torch.randn(64, 72, generator=g).to(device)
    ref = big[8:56, 16:56] - a.to(dtype).float() @ b.to(dtype).float()
    try:
        c = big.clone()
        view = c[8:56, 16:56]  # strided, like the trailing matrix
        torch.addmm(view, a.to(dtype), b.to(dtype), alpha=-1.0, out_dtype=torch.float32, out=view)
        if torch.allclose(view, ref, rtol=1e-4, atol=1e-3):
            mode = "addmm_out_dtype"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    if mode == "lowp_out":
        try:
            out = torch.mm(a.to(dtype), b.to(dtype), out_dtype=torch.float32)
            if out.dtype == torch.float32 and torch.allclose(big[8:56, 16:56] - out, ref, rtol=1e-4, atol=1e-3):
                mode = "mm_out_dtype"
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    _CAPS[key] = mode
    return mode


def _probe_scaled_mm(device: torch.device) -> bool:
    key = ("scaled_mm", device.type)
    if key in _CAPS:
        return _CAPS[key]
    ok = False
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            a = torch.randn(32, 32, generator=g).to(device)
            b = torch.randn(32, 48, generator=g).to(device)
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=device)
            out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
            ref = a8.float() @ b8.float()
            ok = bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-2))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
    _CAPS[key] = ok
    return ok


def gemm_backend(factor: str, device) -> str:
    """Describe how the trailing update runs for ``factor`` on ``device`` (for reports)."""
    factor = canonical_factor(factor)
    device = torch.device(device)
    if device.type != "cuda":
        if factor == "fp32":
            return "CPU fp32 GEMM"
        return f"CPU emulation: operands rounded to {factor} in software, fp32 GEMM (no tensor cores)"
    if factor == "fp32":
        return "cuBLAS fp32 GEMM (tf32 off)"
    if factor == "tf32":
        return "cuBLAS tf32 tensor-core GEMM (fp32 in/out)"
    if factor == "fp8":
        if _probe_scaled_mm(device):
            return "cuBLAS fp8 e4m3 tensor-core GEMM (torch._scaled_mm, per-tensor pow2 scales, fp32 out)"
        return "fp8 e4m3 emulated (torch._scaled_mm unavailable): operands rounded, fp32 GEMM"
    mode = _probe_lowp_gemm(device, _LOWP_DTYPE[factor])
    how = {
        "addmm_out_dtype": "torch.addmm(out_dtype=float32), in place",
        "mm_out_dtype": "torch.mm(out_dtype=float32) + fp32 subtract",
        "lowp_out": f"torch.matmul with {factor} output (fp32 accumulate, {factor}-rounded result)",
    }[mode]
    return f"cuBLAS {factor} tensor-core GEMM, fp32 accumulate: {how}"


@dataclass
class _Update:
    """Prepared operands of ``C -= L @ U`` (private copies: nothing here aliases the matrix)."""

    kind: str  # "mm" (fp32 / tf32 / bf16 / fp16 / CPU emulation) or "scaled_mm" (fp8 on CUDA)
    a: torch.Tensor  # (M, K) operand as the GEMM reads it
    b: torch.Tensor  # (K, N) or (Kp, Np) column-major for scaled_mm
    alpha: float = -1.0
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None
    tf32: bool = False
    n_cols: int = 0

    def tensors(self) -> list:
        return [t for t in (self.a, self.b, self.scale_a, self.scale_b) if t is not None]


def _fp16_scales(L: torch.Tensor, U: torch.Tensor) -> tuple[float, float]:
    """Power-of-two scales putting max|L| and max|U| just under fp16's max (one host sync)."""
    amax = torch.stack([L.abs().amax(), U.abs().amax()]).tolist()
    if not all(math.isfinite(v) for v in amax):
        raise LUBreakdown("non-finite entries in the LU factors (overflow or zero pivot)")
    return _pow2_scale(amax[0], _FMAX["fp16"]), _pow2_scale(amax[1], _FMAX["fp16"])


def _prepare_update(L: torch.Tensor, U: torch.Tensor, factor: str, scales=None) -> _Update:
    """Round L (M, K) and U (K, N), fp32, to the factor format (with power-of-two scales where the
    format's range needs them; fp16 may be given ``scales`` computed once for the whole step).
    Runs on the main stream; the result may be used on another."""
    cuda = L.device.type == "cuda"
    if factor == "fp32":
        return _Update("mm", L.clone(), U)
    if factor == "tf32":
        if cuda:
            return _Update("mm", L.clone(), U, tf32=True)
        return _Update("mm", _round_tf32(L), _round_tf32(U))
    if factor == "fp8":
        return _prepare_fp8(L, U)
    dtype = _LOWP_DTYPE[factor]
    s_l = s_u = 1.0
    if factor == "fp16":  # fp16 has 5 exponent bits: scale both operands into range
        s_l, s_u = scales if scales is not None else _fp16_scales(L, U)
    l_lp = (L * s_l if s_l != 1.0 else L).to(dtype)  # (M, K)
    u_lp = (U * s_u if s_u != 1.0 else U).to(dtype)  # (K, N)
    alpha = -1.0 / (s_l * s_u)  # a power of two: exact
    if not cuda:  # tensor cores multiply exactly and accumulate in fp32: so does this
        return _Update("mm", l_lp.float(), u_lp.float(), alpha=alpha)
    return _Update("mm", l_lp, u_lp, alpha=alpha)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if x.shape[0] == rows and x.shape[1] == cols:
        return x
    out = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _prepare_fp8(L: torch.Tensor, U: torch.Tensor) -> _Update:
    """fp8 e4m3 operands with per-tensor power-of-two scales (no host sync)."""
    fmax = _FMAX["fp8"]
    s_l = _pow2_scale_t(L.abs().amax(), fmax)
    s_u = _pow2_scale_t(U.abs().amax(), fmax)
    l8 = (L * s_l).to(torch.float8_e4m3fn)  # (M, K)
    u8 = (U * s_u).to(torch.float8_e4m3fn)  # (K, N)
    inv_l, inv_u = 1.0 / s_l, 1.0 / s_u
    if L.device.type == "cuda" and _probe_scaled_mm(L.device):
        M, K = l8.shape
        N = u8.shape[1]
        kp, np_ = -(-K // 16) * 16, -(-N // 16) * 16  # _scaled_mm wants K, N multiples of 16
        a = _pad_to(l8, M, kp).contiguous()  # (M, Kp) row-major
        b = _pad_to(u8, kp, np_).t().contiguous().t()  # (Kp, Np) column-major
        return _Update("scaled_mm", a, b, scale_a=inv_l, scale_b=inv_u, n_cols=N)
    inv = inv_l * inv_u  # emulation: exact products of the e4m3 values, fp32 sums
    return _Update("mm", l8.float(), u8.float() * inv)


def _run_update(C: torch.Tensor, up: _Update) -> None:
    """C -= A_op @ B_op in place (C an fp32 view of the trailing matrix)."""
    if up.kind == "scaled_mm":
        out = torch._scaled_mm(up.a, up.b, scale_a=up.scale_a, scale_b=up.scale_b, out_dtype=torch.float32)
        C.sub_(out[:, : up.n_cols])
        return
    if up.a.dtype == torch.float32:
        with _tf32(up.tf32 and C.device.type == "cuda"):
            C.addmm_(up.a, up.b, alpha=up.alpha)
        return
    mode = _probe_lowp_gemm(C.device, up.a.dtype)
    if mode == "addmm_out_dtype":
        torch.addmm(C, up.a, up.b, alpha=up.alpha, out_dtype=torch.float32, out=C)
    elif mode == "mm_out_dtype":
        C.add_(torch.mm(up.a, up.b, out_dtype=torch.float32), alpha=up.alpha)
    else:
        C.add_(torch.matmul(up.a, up.b), alpha=up.alpha)


def _trailing_update(C: torch.Tensor, L: torch.Tensor, U: torch.Tensor, factor: str) -> None:
    """C -= lowp(L) @ lowp(U), in place.  C (M, N) fp32 view; L (M, K), U (K, N) fp32."""
    _run_update(C, _prepare_update(L, U, factor))


# --------------------------------------------------------------------------------------------
# Triangular pieces (fp32)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _getrf_lib(device: torch.device, lib: str):
    """Route torch's LU (getrf) to cuSOLVER for the duration (``lib="cusolver"``).

    torch's default heuristic sends a non-square (tall panel) getrf to MAGMA's *batched* routine
    even for a batch of one: on an H100 that was 20 ms per 8192 x 1024 panel (and a "batched
    routines are designed for small sizes" warning per call).  cuSOLVER's getrf is the fast one
    for a single tall matrix.  ``lib="default"`` leaves torch's choice alone (for comparison)."""
    if device.type != "cuda" or lib != "cusolver":
        yield
        return
    backend = torch.backends.cuda.preferred_linalg_library
    try:
        with warnings.catch_warnings():  # torch warns once that the setting is "experimental"
            warnings.simplefilter("ignore")
            prev = backend()
            backend("cusolver")
    except (RuntimeError, AttributeError, ValueError):  # a build without cuSOLVER: keep torch's choice
        yield
        return
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend(prev)


def _eye_like(T: torch.Tensor) -> torch.Tensor:
    return torch.eye(T.shape[-1], dtype=T.dtype, device=T.device).expand(T.shape)


def _tri_inv(T: torch.Tensor, upper: bool, unit: bool, leaf: int = 128) -> torch.Tensor:
    """Inverse of the upper / (unit) lower triangle of T (..., m, m), fp32 IEEE (tf32 off by the
    caller).  Only that triangle is read, so T may be a packed LU block.

    Recursive on the triangle's 2 x 2 blocks, inv([[A, 0], [C, B]]) = [[A^-1, 0], [-B^-1 C A^-1,
    B^-1]]: the two diagonal halves are stacked into one batch, so k stacked blocks of order m
    cost ~log2(m / leaf) levels of batched GEMMs and one batched triangular solve (few launches)."""
    m = T.shape[-1]
    if m <= leaf:
        return torch.linalg.solve_triangular(T, _eye_like(T), upper=upper, unitriangular=unit)
    h = m // 2
    if m % 2 == 0:
        both = _tri_inv(torch.stack([T[..., :h, :h], T[..., h:, h:]]), upper, unit, leaf)
        a_inv, b_inv = both[0], both[1]
    else:
        a_inv = _tri_inv(T[..., :h, :h], upper, unit, leaf)
        b_inv = _tri_inv(T[..., h:, h:], upper, unit, leaf)
    out = torch.zeros_like(T)
    out[..., :h, :h] = a_inv
    out[..., h:, h:] = b_inv
    if upper:  # [[A, X], [0, B]]^-1 = [[A^-1, -A^-1 X B^-1], [0, B^-1]]
        out[..., :h, h:] = -(a_inv @ T[..., :h, h:]) @ b_inv
    else:
        out[..., h:, :h] = -(b_inv @ T[..., h:, :h]) @ a_inv
    return out


def _inv_lower_unit(D: torch.Tensor) -> torch.Tensor:
    """inv(L) for the unit lower triangle of one block D (strict lower part read), fp32."""
    return torch.linalg.solve_triangular(D, _eye_like(D), upper=False, unitriangular=True)


def _inv_upper(D: torch.Tensor) -> torch.Tensor:
    """inv(U) for the upper triangle of one block D (diagonal and above read), fp32."""
    return torch.linalg.solve_triangular(D, _eye_like(D), upper=True)


def _mm_maybe_tf32(a: torch.Tensor, b: torch.Tensor, tf32: bool) -> torch.Tensor:
    """a @ b in fp32, or as a tf32 GEMM when ``tf32``: tensor cores on CUDA; on a CPU the operands
    are rounded to tf32 in software (nearest-even; cuBLAS may break ties differently), so the CPU
    emulation sees the same ~2^-11 operand error as the GPU."""
    if tf32 and a.device.type != "cuda":
        return _round_tf32(a) @ _round_tf32(b)
    with _tf32(tf32 and a.device.type == "cuda"):
        return a @ b


def _solve_lower_unit(L11: torch.Tensor, B: torch.Tensor, method: str, tf32: bool, linv=None) -> torch.Tensor:
    """L11^-1 @ B (L11 unit lower; only its strict lower triangle is read).  ``linv``: inv(L11)
    if already known (method "inverse")."""
    if method == "inverse":
        if linv is None:
            linv = _inv_lower_unit(L11)
        return _mm_maybe_tf32(linv, B, tf32)
    return torch.linalg.solve_triangular(L11, B, upper=False, unitriangular=True)


def _solve_upper_right(U11: torch.Tensor, B: torch.Tensor, method: str, tf32: bool, uinv=None) -> torch.Tensor:
    """B @ U11^-1 (U11 upper; only its upper triangle is read)."""
    if method == "inverse":
        if uinv is None:
            uinv = _inv_upper(U11)
        return _mm_maybe_tf32(B, uinv, tf32)
    return torch.linalg.solve_triangular(U11, B, upper=True, left=False)


def _lu_nopivot(D: torch.Tensor, lib: str = "cusolver") -> torch.Tensor:
    """LU without pivoting of a small square fp32 block; returns the packed factors (new tensor)."""
    if D.device.type == "cuda":
        try:
            with _getrf_lib(D.device, lib):
                lu, _, _ = torch.linalg.lu_factor_ex(D, pivot=False)
            return lu
        except (RuntimeError, NotImplementedError):
            pass
    out = D.clone()
    with _tf32(False):
        _lu_nopivot_rec(out)
    return out


def _lu_nopivot_rec(D: torch.Tensor) -> None:
    """In-place recursive LU without pivoting (CPU path; zero pivots give Inf/NaN, caught later)."""
    m = D.shape[0]
    if m <= 32:
        for j in range(m - 1):
            D[j + 1 :, j] /= D[j, j]
            D[j + 1 :, j + 1 :] -= torch.outer(D[j + 1 :, j], D[j, j + 1 :])
        return
    h = m // 2
    _lu_nopivot_rec(D[:h, :h])
    D[:h, h:] = torch.linalg.solve_triangular(D[:h, :h], D[:h, h:], upper=False, unitriangular=True)
    D[h:, :h] = torch.linalg.solve_triangular(D[:h, :h], D[h:, :h], upper=True, left=False)
    D[h:, h:].addmm_(D[h:, :h], D[:h, h:], alpha=-1.0)
    _lu_nopivot_rec(D[h:, h:])


# --------------------------------------------------------------------------------------------
# Partial pivoting: LAPACK pivots -> one gather/scatter of whole rows, on the device
# --------------------------------------------------------------------------------------------


def swaps_from_pivots(pivots: torch.Tensor, row0: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn the LAPACK pivots of a panel that starts at global row ``row0`` into index vectors
    ``dst, src`` (int64, length ``2 * w``) such that ``W[dst] = W[src]`` applies all its row
    interchanges at once.  Slots that are not needed point at the ``scratch`` row (a spare row of
    the working matrix), so the shapes are static and nothing is copied to the host.

    How: the at most 2w rows the w swaps touch are numbered compactly (sort + searchsorted), the
    swaps are replayed on that 2w-element set by ``torch.lu_unpack`` (a 2w x 2w permutation
    matrix), and the compact permutation is mapped back to global rows.
    """
    w = pivots.shape[-1]
    dev = pivots.device
    p = pivots.long() - 1  # (w,) 0-based, p[j] >= j
    keys = torch.cat([torch.arange(w, device=dev), p])  # (2w,) every row a swap touches
    s, _ = torch.sort(keys)
    first = torch.ones(2 * w, dtype=torch.bool, device=dev)
    first[1:] = s[1:] != s[:-1]
    rank = torch.cumsum(first.long(), 0) - 1  # (2w,) compact id of s[i]; ids of 0..w-1 are 0..w-1
    cpiv = rank[torch.searchsorted(s, p)]  # (w,) the swaps in compact ids, cpiv[j] >= j
    fake = torch.empty(2 * w, w, device=dev)  # lu_unpack reads only its shape when unpack_data=False
    P, _, _ = torch.lu_unpack(fake, (cpiv + 1).to(torch.int32), unpack_data=False, unpack_pivots=True)
    cperm = P.argmax(dim=0)  # (2w,) compact row now at compact slot i
    vals = torch.full((2 * w,), scratch, dtype=torch.long, device=dev)
    vals[rank] = s + row0  # compact id -> global row (unused ids stay at scratch)
    return vals, vals[cperm]


class _Swaps:
    """Row interchanges of the current panel.  Applied at once to columns [0, cols) of W (and to
    ``perm``); with look-ahead the columns [cols, n) are still being updated on the side stream,
    so their swaps are queued, in order, and applied after the join (``flush``)."""

    def __init__(self, work: torch.Tensor, perm: torch.Tensor, cols: int):
        self.work, self.perm, self.cols = work, perm, cols
        self.pending: list = []

    def apply(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        part = self.work[:, : self.cols] if self.cols < self.work.shape[1] else self.work
        part.index_copy_(0, dst, part.index_select(0, src))  # (2w, cols) gathered before any write
        self.perm.index_copy_(0, dst, self.perm.index_select(0, src))
        if self.cols < self.work.shape[1]:
            self.pending.append((dst, src))

    def flush(self) -> None:
        right = self.work[:, self.cols :]
        for dst, src in self.pending:
            right.index_copy_(0, dst, right.index_select(0, src))
        self.pending.clear()


def _leaf_getrf(work: torch.Tensor, swaps: _Swaps, k: int, w: int, n: int, cfg: "_Config") -> None:
    """Factor W[k:n, k:k+w] with getrf; apply its interchanges to whole rows of W."""
    panel = work[k:n, k : k + w]
    with _getrf_lib(work.device, cfg.getrf_lib):
        lu, piv, _ = torch.linalg.lu_factor_ex(panel)  # (n-k, w) copy, already row-permuted
    dst, src = swaps_from_pivots(piv, k, scratch=n)
    swaps.apply(dst, src)
    panel.copy_(lu)


def _panel_partial(work, swaps: _Swaps, k: int, w: int, n: int, cfg: "_Config") -> None:
    """Panel LU of W[k:n, k:k+w] with partial pivoting: one getrf (``panel="getrf"``), or Toledo's
    recursion down to leaves of ``cfg.leaf`` columns, factored by getrf (``"recursive"``)."""
    if cfg.panel == "getrf" or w <= cfg.leaf:
        _leaf_getrf(work, swaps, k, w, n, cfg)
        return
    h = w // 2
    _panel_partial(work, swaps, k, h, n, cfg)
    l11 = work[k : k + h, k : k + h]
    a12 = work[k : k + h, k + h : k + w]
    a12.copy_(torch.linalg.solve_triangular(l11, a12, upper=False, unitriangular=True))
    with _tf32(cfg.panel_tf32):
        work[k + h : n, k + h : k + w].addmm_(work[k + h : n, k : k + h], a12, alpha=-1.0)
    _panel_partial(work, swaps, k + h, w - h, n, cfg)


def _panel_nopivot(work, k: int, kb: int, n: int, cfg: "_Config"):
    """LU of the diagonal block without pivoting (cuSOLVER getrf), then L21 = A21 U11^-1.
    Returns (inv(L11), inv(U11)) when ``cfg.trsm == "inverse"`` (both are needed anyway: U11^-1
    here, L11^-1 for U12, and both again by the blocked triangular solves), else (None, None)."""
    d = work[k : k + kb, k : k + kb]
    d.copy_(_lu_nopivot(d, cfg.getrf_lib))
    linv = uinv = None
    if cfg.trsm == "inverse":
        linv, uinv = _inv_lower_unit(d), _inv_upper(d)
    if k + kb < n:
        a21 = work[k + kb : n, k : k + kb]
        a21.copy_(_solve_upper_right(d, a21, cfg.trsm, cfg.tri_tf32, uinv))
    return linv, uinv


# --------------------------------------------------------------------------------------------
# Phase timing (for benchmarks): CUDA events, resolved once at the end
# --------------------------------------------------------------------------------------------


class _PhaseTimer:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.host: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host[name] = self.host.get(name, 0.0) + time.perf_counter() - t0

    def result(self) -> dict:
        if not self.enabled:
            return {}
        out = dict(self.host)
        if self.cuda:
            torch.cuda.synchronize()
            for name, s, e in self.events:
                out[name] = out.get(name, 0.0) + s.elapsed_time(e) / 1e3
        return {k: round(v, 6) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# The factorization
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    factor: str
    pivoting: str
    block: int
    panel: str
    leaf: int
    trsm: str
    trsv: str
    panel_tf32: bool
    tri_tf32: bool
    lookahead: bool
    getrf_lib: str = "cusolver"


@dataclass(frozen=True)
class LUOptions:
    """Tuning of :func:`lu_factor` beyond its defaults (what the benchmarks and tests vary; None: the measured
    default for the device).

    leaf        getrf width of the recursive panel (``panel="recursive"``; default 128 on CUDA, 16 on a CPU)
    trsm        ``"trsm"`` (fp32 triangular solve) or ``"inverse"`` (inv(L11) @ A12 as a GEMM, tf32 on CUDA for
                low-precision factors); ``"auto"``: inverse on CUDA for low-precision factors
    trsm_tf32   whether that GEMM (and L21 = A21 inv(U11) without pivoting) runs in tf32 -- None: on CUDA for
                low-precision factors; False: fp32 (U12 is a stored factor: with partial pivoting its tf32
                rounding doubles ||PA - LU|| of fp16 factors at n = 4096); True on a CPU emulates the GPU's tf32
                GEMM by rounding its operands in software
    panel_tf32  let the GEMMs inside the recursive panel use tf32 (low-precision factors on CUDA only)
    lookahead   overlap the next panel with the trailing GEMM on a second stream (None: on CUDA; on a CPU the
                same code runs serially)
    getrf_lib   ``"cusolver"`` (torch's getrf forced onto cuSOLVER, see ``_getrf_lib``) or ``"default"``
                (torch's own choice)

    >>> import tcprec.linalg as la
    >>> la.LUOptions(trsm="trsm", lookahead=False).trsm
    'trsm'
    """

    leaf: int | None = None
    trsm: str = "auto"
    trsm_tf32: bool | None = None
    panel_tf32: bool = False
    lookahead: bool | None = None
    getrf_lib: str = "cusolver"


@dataclass
class _TrsvPlan:
    """Buffers and pre-sliced views of one blocked triangular solve with k right-hand sides: the
    loop then costs two cuBLAS calls per block and no Python slicing."""

    v: torch.Tensor  # (n, k) fp32: input, then the result
    y: torch.Tensor  # (n, k) fp32: L^-1 v
    fwd: list  # (inv(L_ii), v_i, y_i, L[b:, a:b] or None, v[b:] or None)
    bwd: list  # (inv(U_ii), y_i, v_i, U[:a, a:b] or None, y[:a] or None)


@dataclass
class LUFactors:
    """Packed fp32 LU factors of ``scale * A[perm]``.

    ``lu`` (n, n) fp32: unit lower L strictly below the diagonal, U on and above.
    ``perm`` (n,) int64 or None (no pivoting): row i of L U is row ``perm[i]`` of ``scale * A``.
    ``diag_inv``: per diagonal block of width ``block``, (inv(L_ii), inv(U_ii)) fp32 or None where
    not computed yet (the factorization keeps those it made; the rest are made on first use).
    """

    lu: torch.Tensor
    perm: torch.Tensor | None
    n: int
    scale: float
    factor: str
    pivoting: str
    block: int
    trsv: str
    phase_times: dict = field(default_factory=dict)
    diag_inv: list | None = None
    _plans: dict = field(default_factory=dict, repr=False)
    _graph: object = field(default=None, repr=False)

    @property
    def n_work(self) -> int:
        return self.lu.shape[0]  # == n (kept separate so a padded working size stays possible)

    def check(self) -> str | None:
        """None if the factors are usable, else the reason (zero / non-finite pivot)."""
        d = self.lu.diagonal()
        bad = (d == 0) | ~torch.isfinite(d)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            return f"LU breakdown in {self.factor}: pivot U[{i},{i}] = {float(d[i])!r} (zero or non-finite)"
        return None

    # ---- triangular solves with the fp32 factors ----------------------------------------
    def _blocks(self) -> list:
        nb, nw = self.block, self.n_work
        return [(a, min(a + nb, nw)) for a in range(0, nw, nb)]

    def _prepare_blocked(self) -> None:
        """Fill in the missing inverses of the diagonal blocks: all same-size blocks in one
        batched recursive inversion per triangle (a few launches, not two TRSMs per block)."""
        blocks = self._blocks()
        if self.diag_inv is None or len(self.diag_inv) != len(blocks):
            self.diag_inv = [None] * len(blocks)
        todo: dict = {}
        for i, (a, b) in enumerate(blocks):
            have = self.diag_inv[i] or (None, None)
            for t, upper in ((0, False), (1, True)):
                if have[t] is None:
                    todo.setdefault((b - a, upper), []).append(i)
        if not todo:
            return
        inv = [list(self.diag_inv[i] or (None, None)) for i in range(len(blocks))]
        with _tf32(False):
            for (size, upper), idx in todo.items():
                stack = torch.stack([self.lu[blocks[i][0] : blocks[i][1], blocks[i][0] : blocks[i][1]] for i in idx])
                res = _tri_inv(stack, upper=upper, unit=not upper)
                for j, i in enumerate(idx):
                    inv[i][1 if upper else 0] = res[j]
        self.diag_inv = [tuple(t) for t in inv]

    def _plan(self, k: int) -> _TrsvPlan:
        plan = self._plans.get(k)
        if plan is not None:
            return plan
        self._prepare_blocked()
        lu, nw = self.lu, self.n_work
        v = torch.empty(nw, k, dtype=lu.dtype, device=lu.device)
        y = torch.empty_like(v)
        fwd, bwd = [], []
        blocks = self._blocks()
        for i, (a, b) in enumerate(blocks):
            below = b < nw
            fwd.append((self.diag_inv[i][0], v[a:b], y[a:b], lu[b:, a:b] if below else None, v[b:] if below else None))
        for i in reversed(range(len(blocks))):
            a, b = blocks[i]
            bwd.append((self.diag_inv[i][1], y[a:b], v[a:b], lu[:a, a:b] if a > 0 else None, y[:a] if a > 0 else None))
        plan = _TrsvPlan(v, y, fwd, bwd)
        if len(self._plans) >= 4:  # a few column counts at most (1 for GMRES, k for classic IR)
            self._plans.clear()
        self._plans[k] = plan
        return plan

    @staticmethod
    def _run_plan(plan: _TrsvPlan) -> torch.Tensor:
        """U^-1 L^-1 plan.v, in plan.v: forward y_i = inv(L_ii) v_i, v[below] -= L[below, i] y_i;
        backward x_i = inv(U_ii) y_i, y[above] -= U[above, i] x_i.  fp32 IEEE (tf32 off)."""
        with _tf32(False):
            for inv, src, dst, off, rest in plan.fwd:
                torch.mm(inv, src, out=dst)
                if off is not None:
                    rest.addmm_(off, dst, alpha=-1.0)
            for inv, src, dst, off, rest in plan.bwd:
                torch.mm(inv, src, out=dst)
                if off is not None:
                    rest.addmm_(off, dst, alpha=-1.0)
        return plan.v

    def _tri_solve(self, v: torch.Tensor) -> torch.Tensor:
        """U^-1 L^-1 v for v (n_work, k) fp32 (a new tensor)."""
        if self.trsv == "trsm":
            y = torch.linalg.solve_triangular(self.lu, v, upper=False, unitriangular=True)
            return torch.linalg.solve_triangular(self.lu, y, upper=True)
        plan = self._plan(v.shape[1])
        plan.v.copy_(v)
        return self._run_plan(plan).clone()

    def _apply(self, r2: torch.Tensor) -> torch.Tensor:
        """M^-1 r2 for r2 (n, k) fp64 -> (n, k) fp64, no host sync (capturable)."""
        s = r2.abs().amax(dim=0).clamp_min(1e-300)  # (k,) column scales keep fp32 in range
        if self.trsv == "trsm":
            v = (r2 / s).float()
            if self.perm is not None:
                v = v.index_select(0, self.perm)  # L U y = (P b)
            y = self._tri_solve(v.contiguous())
        else:
            plan = self._plan(r2.shape[1])
            q = r2 / s
            plan.v.copy_(q.index_select(0, self.perm) if self.perm is not None else q)
            y = self._run_plan(plan)
        return y.double() * (s * self.scale)  # A^-1 = scale * (scale A)^-1

    def _build_graph(self):
        """Capture ``_apply`` for one column in a CUDA graph (the blocked solve is ~4 cuBLAS
        calls per block: replaying them costs GPU time only, no Python / launch overhead)."""
        dev = self.lu.device
        self._plan(1)  # inverses and buffers on the main stream, before any stream switch
        static_in = torch.zeros(self.n, 1, dtype=torch.float64, device=dev)
        main = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):  # warm-up outside the capture (cuBLAS handles, workspaces)
            self._apply(static_in)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self._apply(static_in)
        return graph, static_in, static_out

    def solve(self, r: torch.Tensor) -> torch.Tensor:
        """Approximate ``A^-1 r`` with the fp32 factors: r (n,) or (n, k) fp64 -> fp64."""
        vec = r.dim() == 1
        r2 = r.unsqueeze(1) if vec else r  # (n, k)
        if r2.dtype != torch.float64:
            r2 = r2.double()
        if self.trsv == "graph" and r2.shape[1] == 1 and r2.device.type == "cuda" and self._graph is not False:
            if self._graph is None:
                try:
                    self._graph = self._build_graph()
                except (RuntimeError, torch.OutOfMemoryError):  # capture unsupported here: eager
                    self._graph = False
            if self._graph is not False:
                graph, static_in, static_out = self._graph
                static_in.copy_(r2)
                graph.replay()
                out = static_out.clone()
                return out.squeeze(1) if vec else out
        out = self._apply(r2)
        return out.squeeze(1) if vec else out


def _resolve_config(n, device, factor, pivoting, block, panel, trsv, options: LUOptions | None = None) -> _Config:
    if options is None:
        options = LUOptions()
    if not isinstance(options, LUOptions):
        raise TypeError(f"options must be a tcprec.linalg.LUOptions (or None), got {type(options).__name__}: "
                        "pass options=LUOptions(leaf=..., trsm=..., ...)")
    leaf, trsm, trsm_tf32 = options.leaf, options.trsm, options.trsm_tf32
    panel_tf32, lookahead, getrf_lib = options.panel_tf32, options.lookahead, options.getrf_lib
    if block is None:
        block = default_block(n, device)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int (the LU block width), got block={block!r}")
    if panel not in PANEL_METHODS:
        raise ValueError(f"panel must be one of {PANEL_METHODS}, got panel={panel!r}")
    if trsv not in TRSV_METHODS:
        raise ValueError(f"trsv must be one of {TRSV_METHODS}, got trsv={trsv!r}")
    if trsm not in TRSM_METHODS:
        raise ValueError(f"trsm must be one of {TRSM_METHODS}, got trsm={trsm!r}")
    if getrf_lib not in GETRF_LIBS:
        raise ValueError(f"getrf_lib must be one of {GETRF_LIBS}, got getrf_lib={getrf_lib!r}")
    cuda = device.type == "cuda"
    if panel == "auto":  # CUDA: one cuSOLVER getrf per block column (fewest launches); CPU: recursive
        panel = "getrf" if cuda else "recursive"
    if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int) or leaf < 1):
        raise ValueError(f"leaf must be a positive int (getrf width of the recursive panel), got leaf={leaf!r}")
    if leaf is None:
        leaf = 128 if cuda else 16
    if trsv == "auto":  # (a graph captured per factorization costs 4-6 ms: no faster in whole solves, solve_trsv_ab.json)
        trsv = "blocked" if cuda else "trsm"
    if trsm == "auto":  # inv(L11) @ A12 as a tf32 GEMM: tensor cores, error below the low-precision updates
        trsm = "inverse" if cuda and factor not in ("fp32",) else "trsm"
    if trsm_tf32 is not None and not isinstance(trsm_tf32, bool):
        raise ValueError(f"trsm_tf32 must be None (auto: tf32 on CUDA for low-precision factors), True or "
                         f"False, got trsm_tf32={trsm_tf32!r}")
    lowp = factor != "fp32"
    return _Config(
        factor=factor,
        pivoting=pivoting,
        block=min(block, n),
        panel=panel,
        leaf=leaf,
        trsm=trsm,
        trsv=trsv,
        panel_tf32=bool(panel_tf32 and lowp and cuda),
        tri_tf32=bool(lowp and cuda) if trsm_tf32 is None else trsm_tf32,
        lookahead=bool(cuda if lookahead is None else lookahead),
        getrf_lib=getrf_lib,
    )


class _Streams:
    """Main and side stream for look-ahead; plain no-ops on a CPU (same code path, serial)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.cuda = enabled and device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.side = torch.cuda.Stream(device=device)

    def side_ctx(self):
        if not self.cuda:
            return contextlib.nullcontext()
        self.side.wait_stream(self.main)  # the side GEMM needs L21, U12 from the main stream
        return torch.cuda.stream(self.side)

    def keep(self, *tensors) -> None:
        if self.cuda:  # main-stream allocations used on the side stream must outlive its work
            for t in tensors:
                if t is not None:
                    t.record_stream(self.side)

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side)


def _factor_inplace(work: torch.Tensor, n: int, cfg: _Config, timer: _PhaseTimer):
    """Blocked right-looking LU of work[:n] (work has n+1 rows; row n is scratch).
    Returns (perm or None, diag_inv) -- diag_inv[i] = (inv(L_ii), inv(U_ii)), entries None where
    not computed.

    With ``cfg.lookahead`` (depth 1) step k updates the next block column first, hands the rest
    of the trailing GEMM to a side stream and factors panel k+1 on the main stream meanwhile, so
    the latency-bound panel hides behind the big GEMM.  Row swaps of panel k+1 reach the columns
    the side stream is updating only after the join (``_Swaps``).  Without pivoting the side
    stream also computes the rest of U12 (L11^-1 A12 beyond the next block column): only the
    next block column's share stays on the critical path."""
    partial = cfg.pivoting == "partial"
    perm = torch.arange(n + 1, device=work.device) if partial else None
    nb = cfg.block
    steps = [(k, min(nb, n - k)) for k in range(0, n, nb)]
    streams = _Streams(work.device, cfg.lookahead)
    inv: list = [None] * len(steps)

    def panel(i, cols):
        k, kb = steps[i]
        with timer("panel"):
            if partial:
                swaps = _Swaps(work, perm, cols)
                _panel_partial(work, swaps, k, kb, n, cfg)
                return swaps
            linv, uinv = _panel_nopivot(work, k, kb, n, cfg)
            inv[i] = (linv, uinv) if linv is not None else None
            return None

    def linv_of(i, k, kb):
        if cfg.trsm != "inverse":
            return None
        if inv[i] is None:
            inv[i] = (_inv_lower_unit(work[k : k + kb, k : k + kb]), None)
        return inv[i][0]

    with _tf32(False):
        panel(0, n)
        for i, (k, kb) in enumerate(steps[:-1]):
            k1, kb1 = steps[i + 1]  # == k + kb
            l11 = work[k : k + kb, k : k + kb]
            a12 = work[k : k + kb, k1:n]
            l21 = work[k1:n, k : k + kb]
            linv = linv_of(i, k, kb)
            if not cfg.lookahead or k1 + kb1 >= n:
                with timer("trsm"):
                    a12.copy_(_solve_lower_unit(l11, a12, cfg.trsm, cfg.tri_tf32, linv))
                with timer("gemm"):
                    _trailing_update(work[k1:n, k1:n], l21, a12, cfg.factor)
                panel(i + 1, n)
                continue
            if partial or cfg.factor == "fp16":
                # all of U12 on the main stream: the side stream must get private copies of L21
                # (panel k1 swaps its rows) and fp16's scales need all of U12 (one host sync)
                with timer("trsm"):
                    u12 = _solve_lower_unit(l11, a12, cfg.trsm, cfg.tri_tf32, linv)
                    a12.copy_(u12)
                with timer("gemm"):  # the next block column first ...
                    scales = _fp16_scales(l21, u12) if cfg.factor == "fp16" else None
                    _run_update(work[k1:n, k1 : k1 + kb1], _prepare_update(l21, u12[:, :kb1], cfg.factor, scales))
                    rest = _prepare_update(l21, u12[:, kb1:], cfg.factor, scales)  # private copies
                del u12
                streams.keep(*rest.tensors())
                with streams.side_ctx(), timer("side"):  # ... the rest on the side stream ...
                    _run_update(work[k1:n, k1 + kb1 : n], rest)
                del rest
            else:
                with timer("trsm"):  # U12 of the next block column only ...
                    a12[:, :kb1].copy_(_solve_lower_unit(l11, a12[:, :kb1], cfg.trsm, cfg.tri_tf32, linv))
                with timer("gemm"):
                    _trailing_update(work[k1:n, k1 : k1 + kb1], l21, a12[:, :kb1], cfg.factor)
                streams.keep(linv)
                with streams.side_ctx(), timer("side"):  # ... the rest of U12 and of the GEMM there
                    a12r = a12[:, kb1:]
                    a12r.copy_(_solve_lower_unit(l11, a12r, cfg.trsm, cfg.tri_tf32, linv))
                    _trailing_update(work[k1:n, k1 + kb1 : n], l21, a12r, cfg.factor)
            swaps = panel(i + 1, k1 + kb1)  # ... while the next panel factors here
            streams.join()
            if swaps is not None:
                swaps.flush()
    return (perm[:n] if perm is not None else None), inv


def prepare_work(A: torch.Tensor):
    """fp32 working copy (n + 1, n) of A (the last row is scratch for row swaps), ||A||_inf and
    the power-of-two ``scale`` A was multiplied by (1 unless A's range does not fit fp32).
    NaN/Inf in A surface as a non-finite norm: then A itself is checked and a ValueError raised."""
    n = A.shape[0]
    work = torch.empty(n + 1, n, dtype=torch.float32, device=A.device)
    work[:n].copy_(A)
    rows = torch.linalg.vector_norm(work[:n], ord=1, dim=1)  # fp32 row sums: ~1e-6 relative, ample for a criterion
    anorm = float(rows.max())
    scale = 1.0
    if not math.isfinite(anorm) or anorm > 2.0**100 or anorm < 2.0**-100:  # outside fp32's comfort
        a64 = A.double() if A.dtype != torch.float64 else A
        finite = torch.isfinite(a64)
        if not bool(finite.all()):
            bad = (~finite).nonzero()
            i, j = (int(v) for v in bad[0])
            raise ValueError(
                f"A has {bad.shape[0]} non-finite entries (NaN or Inf), the first at A[{i}, {j}] = "
                f"{float(a64[i, j])}; a linear solve needs finite input: clean A first (e.g. "
                f"torch.nan_to_num) or fix how it is computed"
            )
        anorm = float(torch.linalg.vector_norm(a64, ord=1, dim=1).amax())
        if anorm == 0.0:
            return work, 0.0, 1.0  # the zero matrix: the caller reports it as singular
        scale = 2.0 ** (-math.floor(math.log2(anorm)))
        work[:n].copy_(a64 * scale)
    work[n].zero_()
    return work, anorm, scale


def lu_factor(
    A: torch.Tensor,
    *,
    factor: str = "bf16",
    pivoting=True,
    block: int | None = None,
    panel: str = "auto",
    trsv: str = "auto",
    options: LUOptions | None = None,
    profile: bool = False,
    _work=None,
) -> LUFactors:
    """Mixed-precision blocked LU of a square matrix (fp32 factors, low-precision updates).

    >>> import torch, tcprec.linalg as la
    >>> A = la.hpl_mxp_matrix(64, seed=0)
    >>> F = la.lu_factor(A, factor="bf16", pivoting=False)
    >>> x = F.solve(torch.ones(64, dtype=torch.float64))  # ~A^-1 b to bf16-LU accuracy
    >>> bool((A @ x - 1).abs().max() < 1e-2)
    True

    ``block``: the block-column width (None: :func:`default_block`).  ``panel`` (partial pivoting):
    "recursive" (Toledo's recursion, getrf on leaves of ``options.leaf`` columns; the CPU default) or "getrf"
    (one getrf per block column; the CUDA default); "auto" picks by device.  ``trsv``: "trsm"
    (torch.linalg.solve_triangular), "blocked" (inverted diagonal blocks + GEMVs; default on CUDA) or "graph"
    (the blocked solve of one vector replayed from a CUDA graph) for ``LUFactors.solve``.  ``options``: an
    :class:`LUOptions` with the tuning knobs (leaf, trsm, trsm_tf32, panel_tf32, lookahead, getrf_lib); None
    takes the measured defaults.  ``profile``: record per-phase GPU time in ``phase_times`` (panel / trsm /
    gemm / side).
    """
    factor = canonical_factor(factor)
    piv = canonical_pivoting(pivoting)
    if not isinstance(A, torch.Tensor) or A.dim() != 2 or A.shape[0] != A.shape[1] or A.shape[0] == 0:
        raise ValueError(f"lu_factor needs a non-empty square matrix, got {getattr(A, 'shape', type(A))}")
    n = A.shape[0]
    cfg = _resolve_config(n, A.device, factor, piv, block, panel, trsv, options)
    timer = _PhaseTimer(profile, A.device)
    if _work is None:
        with timer("convert"):
            work, _, scale = prepare_work(A)
    else:
        work, scale = _work
    perm, inv = _factor_inplace(work, n, cfg, timer)
    F = LUFactors(
        lu=work[:n], perm=perm, n=n, scale=scale, factor=factor, pivoting=piv,
        block=cfg.block, trsv=cfg.trsv, diag_inv=inv,
    )
    F.phase_times = timer.result()
    return F
