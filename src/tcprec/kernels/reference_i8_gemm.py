"""Pure-torch INT8 GEMM with the quantized linear's epilogue: the ground truth of ``kernels/cuda/i8_gemm.cu``.

The product is exact (int8 x int8 summed in float64: every partial sum is an integer below 2^53, so any order gives
the int32 the tensor cores accumulate, for K < 2^17), then the epilogue in float32, one IEEE rounding a step, in the
kernel's order::

    y = float32(acc) * (a_scale * w_scale[n])      int32 -> float32 rounds to nearest even; the scale product first
    y = y + float32(bias[n])                        (bias given)
    y = (0.5 * y) * (1 + erf(y * 0.70710678))       (gelu: torch's default erf GELU in float32)
    out = fp16(y)                                   (no out_scale)
        = fp16(float32(fp16(y)) + float32(residual))    (residual: the unfused graph's roundings)
        = int8(round(clamp(nan_to_num(y / out_scale), -128, 127)))   (out_scale: the next layer's int8 codes,
                                                    round half to even: quantize_static's int8 codes of y)

The codes are those of the float32 y, not of its fp16 rounding: what the INT8 conv's fused epilogue writes
(``kernels/triton/conv_fwd_epilogue.py``, ``OUT_INT8``) for a ``ShiftedInt8`` operand of ``int8`` (offset 0, step 1).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["i8_gemm_reference", "i8_gemm_acc", "INV_SQRT2_F32"]

INV_SQRT2_F32 = 0.70710678  # rounded to float32 where it multiplies (the kernel's 0.70710678f)


def i8_gemm_acc(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact int32 accumulator ``a @ w.T`` of int8 ``a`` (M, K) and ``w`` (N, K), as int64 (M, N), computed in
    float64 on the tensors' device (exact: |partial sums| <= K * 2^14 < 2^53).

    >>> a = torch.tensor([[1, -2], [127, -128]], dtype=torch.int8); w = torch.tensor([[3, 4]], dtype=torch.int8)
    >>> i8_gemm_acc(a, w).flatten().tolist()
    [-5, -131]
    """
    return (a.to(torch.float64) @ w.to(torch.float64).T).to(torch.int64)  # (M, N)


def i8_gemm_reference(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, *, gelu: bool = False,
                      out_scale: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                      acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's output for int8 ``a`` (M, K), ``w`` (N, K), float32 ``a_scale`` (one element), ``w_scale`` (N,),
    optional ``bias`` (N,) fp16 / fp32, GELU, and either fp16 output (+ an fp16 ``residual`` (M, N)) or, with
    ``out_scale`` (one float32 element), int8 codes.  ``acc``: a precomputed :func:`i8_gemm_acc` (tests reuse one
    accumulator for several epilogues).

    >>> a = torch.tensor([[1, 2]], dtype=torch.int8); w = torch.tensor([[3, 4], [-1, 0]], dtype=torch.int8)
    >>> i8_gemm_reference(a, w, torch.tensor([0.5]), torch.tensor([1.0, 2.0])).tolist()
    [[5.5, -1.0]]
    >>> i8_gemm_reference(a, w, torch.tensor([0.5]), torch.tensor([1.0, 2.0]), out_scale=torch.tensor([0.25])).tolist()
    [[22, -4]]
    """
    acc = i8_gemm_acc(a, w) if acc is None else acc
    f32 = torch.float32
    sc = a_scale.to(f32).reshape(()) * w_scale.to(f32)  # (N,) one rounding
    y = acc.to(f32) * sc  # (M, N)
    if bias is not None:
        y = y + bias.to(f32)
    if gelu:
        y = (0.5 * y) * (1.0 + torch.erf(y * torch.tensor(INV_SQRT2_F32, dtype=f32, device=y.device)))
    if out_scale is not None:
        if residual is not None:
            raise ValueError("residual is added to the fp16 output; with out_scale (int8 codes) pass no residual")
        q = torch.nan_to_num(y / out_scale.to(f32).reshape(()), nan=0.0).clamp(-128.0, 127.0)
        return torch.round(q).to(torch.int8)  # round half to even
    h = y.to(torch.float16)
    if residual is not None:
        h = (h.to(f32) + residual.to(f32)).to(torch.float16)
    return h
