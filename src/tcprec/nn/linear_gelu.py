"""A float ``nn.Linear`` followed by GELU as one GEMM with a bias + GELU epilogue, as torch's fast path runs it.

torch's fused transformer layer (``torch._transformer_encoder_layer_fwd``, the fp16 baseline of
``tcprec bench transformer``) computes ``gelu(linear1(x))`` as ``torch._addmm_activation(b1, x, w1.t(),
use_gelu=True)``: on CUDA one cuBLASLt GEMM with the GELU + bias epilogue (``CUBLASLT_EPILOGUE_GELU_BIAS``; the
profile names it ``nvjet_..._gelubias_TNN``); without cuBLASLt torch applies ``gelu(approximate="tanh")`` to the
GEMM's output, the same form (aten/src/ATen/native/cuda/Blas.cpp).  On the CPU the op is the GEMM then the exact erf
GELU (``addmm_activation_out_cpu``: ``at::gelu_``), so there it equals ``F.gelu(F.linear(x, w, b))``.  On CUDA it
therefore differs from ``F.gelu``'s default erf form by at most ~5e-4 absolute (the tanh approximation), below
fp16's resolution for |y| >= 0.5, and it is what torch's own fp16 fast path computes.

A layer that ``quantize_model`` keeps float (the speed rule, ``first_last``, an override) and whose only reader is
``F.gelu`` / ``nn.GELU`` (the erf form, ``approximate="none"``; an encoder layer's ``activation="gelu"``) becomes a
:class:`LinearGELU`: a decomposed encoder layer (one with a quantized linear left inside; with none, the layer is
torch's own again, docs/decisions/0131) is then never slower than torch's fused one for want of that epilogue (a
separate GELU pass over the (B * L, 3072) output was 0.66 ms of a 5.5 ms ViT-B forward on an H200,
docs/decisions/0125).  The weights are the same parameters (``state_dict`` keys ``weight`` / ``bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LinearGELU", "linear_gelu", "is_erf_gelu", "gelu_fusable"]


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias))`` as one GEMM with a bias + GELU epilogue (``torch._addmm_activation``,
    module docstring for the GELU form per device); ``x`` (..., in_features)."""
    lead, K = x.shape[:-1], x.shape[-1]
    if bias is None:  # (the op takes a bias to add: zeros are exact)
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    y = torch._addmm_activation(bias, x.reshape(-1, K), weight.t(), use_gelu=True)  # (M, N)
    return y.reshape(*lead, weight.shape[0])


class LinearGELU(nn.Linear):
    """An ``nn.Linear`` whose output goes through GELU in the GEMM's epilogue (:func:`linear_gelu`).

    >>> lin = nn.Linear(8, 16)
    >>> x = torch.randn(3, 8)
    >>> torch.allclose(LinearGELU.from_linear(lin)(x), F.gelu(lin(x)), atol=1e-6)  # (the CPU: erf GELU)
    True
    """

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "LinearGELU":
        """The same ``weight`` / ``bias`` parameters (shared, not copied) with the GELU fused."""
        if type(lin) is not nn.Linear:
            raise TypeError(f"LinearGELU.from_linear takes a plain nn.Linear, got {type(lin).__name__}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = lin.in_features, lin.out_features
        m.weight = lin.weight
        m.bias = lin.bias  # (a Parameter or None: registered either way)
        m.train(lin.training)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", gelu fused (one GEMM, bias + GELU epilogue)"


def is_erf_gelu(node, mods) -> bool:
    """Whether an fx node is the erf GELU: ``F.gelu(y)`` / ``torch.gelu`` / ``y.gelu()`` with ``approximate``
    absent or ``"none"``, or a plain ``nn.GELU()`` module."""
    if node.op == "call_module":
        m = mods.get(node.target)
        return type(m) is nn.GELU and m.approximate == "none"
    called = ((node.op == "call_function" and node.target in (F.gelu, torch._C._nn.gelu))
              or (node.op == "call_method" and node.target == "gelu"))
    if not called or len(node.args) != 1:
        return False
    return set(node.kwargs) <= {"approximate"} and node.kwargs.get("approximate", "none") == "none"


def gelu_fusable(linear: nn.Module, node, mods) -> bool:
    """Whether the float ``linear``, called at fx node ``node``, and the erf GELU that is that call's one reader
    become one :class:`LinearGELU`: a plain ``nn.Linear`` called without keywords, read by nothing else.  ``mods``:
    the graph's modules (``node``'s own module may already be a quantized one: the speed rule asks of its float
    twin)."""
    users = list(node.users)
    return (type(linear) is nn.Linear and not node.kwargs and len(users) == 1 and is_erf_gelu(users[0], mods)
            and users[0].args[0] is node)
