"""A linear kept float with its GELU on the GPU (docs/decisions/0125), in a ViT-B encoder layer (768, 12 heads,
197 tokens): linear1 + GELU is one torch._addmm_activation (cuBLASLt's GELU + bias epilogue), no separate GELU runs,
and the layer equals the unfused conversion."""

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tcprec as tp
from tcprec.bench.transformer import build_encoder
from tcprec.nn.linear_gelu import LinearGELU

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")

DEV = "cuda"
D, H, L, B = 768, 12, 197, 64


def _nrmse(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _layer(dtype):
    enc = build_encoder(D, H, layers=1, device=DEV)
    x = torch.randn(B, L, D, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    with torch.no_grad():
        ref = enc(x).float()
    return copy.deepcopy(enc).to(dtype), x.to(dtype), ref


def test_kept_float_ffn_is_one_gemm_with_gelu():
    """The feed-forward linears kept float, the attention int8 (tcprec's layer stays; a layer with every linear float
    is torch's own layer again, docs/decisions/0131): linear1 + GELU is one GEMM, and the layer computes what the
    conversion without fusion (a separate GELU) computes."""
    base, x, ref = _layer(torch.float16)
    cfg = tp.QuantConfig("int8", first_last=None, overrides={"layers.0.linear1": "float", "layers.0.linear2": "float"})
    q = tp.quantize_model(base, cfg, calibration=x[:8], warn=False)
    assert type(q.get_submodule("layers.0.linear1")) is LinearGELU
    assert type(q.get_submodule("layers.0.self_attn.qkv_proj")).__name__ == "QLinear"
    with torch.no_grad(), _OpLog() as log:
        y = q(x)
    assert "aten._addmm_activation" in log.ops and "aten.gelu" not in log.ops
    unfused = tp.quantize_model(base, replace(cfg, fuse=False), calibration=x[:8], warn=False)
    with torch.no_grad():
        y_sep = unfused(x)
    assert _nrmse(y, y_sep) < 5e-3  # (the epilogue's tanh GELU on CUDA against the erf GELU: they agree)
