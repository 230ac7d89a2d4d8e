"""nn/linear_gelu.py: a linear kept float whose reader is GELU runs as one GEMM with a bias + GELU epilogue.

The CPU form of ``torch._addmm_activation(use_gelu=True)`` is the exact erf GELU, so the converted model equals the
float model within float32 rounding; the fx graph has no separate gelu node after a kept linear."""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp
from tcprec.nn.linear_gelu import LinearGELU, linear_gelu

D_MODEL, HEADS, SEQ, BATCH = 32, 4, 7, 2


def _encoder(layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def _ffn_float(layers):
    return {f"layers.{i}.{n}": "float" for i in range(layers) for n in ("linear1", "linear2")}


def _gelu_nodes(gm):
    return [n for n in gm.graph.nodes if "gelu" in str(n.target).lower()]


def test_linear_gelu_is_the_linear_then_erf_gelu_on_the_cpu():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    ref = F.gelu(F.linear(x, w, b))
    assert torch.allclose(linear_gelu(x, w, b), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear_gelu(x, w, None), F.gelu(F.linear(x, w)), rtol=1e-5, atol=1e-5)
    lin = nn.Linear(16, 24)
    m = LinearGELU.from_linear(lin)
    assert m.weight is lin.weight and list(m.state_dict()) == ["weight", "bias"]


def test_kept_float_ffn_has_no_separate_gelu_and_equals_the_unfused_conversion():
    """The feed-forward linears kept float in layers whose attention is quantized (tcprec's layer stays; a layer with
    every linear float is torch's own module again: tests/test_speed_rule.py): linear1 and its GELU are one GEMM,
    and the model computes what the conversion without fusion computes (a separate GELU)."""
    enc, layers = _encoder(), 2
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    cfg = tp.QuantConfig("int8", first_last=None, overrides=_ffn_float(layers))
    q = tp.quantize_model(enc, cfg, calibration=x, warn=False)
    mods = dict(q.named_modules())
    assert all(type(mods[f"layers.{i}.linear1"]) is LinearGELU for i in range(layers))
    assert _gelu_nodes(q) == []  # the GELU is in linear1's GEMM
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert recs["layers.0.linear1"].precision == "float" and "gelu" in recs["layers.0.linear1"].fused
    assert recs["layers.0.self_attn.out_proj"].precision == "w8a8"
    unfused = tp.quantize_model(enc, replace(cfg, fuse=False), calibration=x, warn=False)
    assert len(_gelu_nodes(unfused)) == layers
    with torch.no_grad():
        y, ref = q(x), unfused(x)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4), float((y - ref).abs().max())


class _Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), act, nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_only_the_erf_gelu_fuses_into_a_float_linear():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    cfg = tp.QuantConfig("int8", first_last=None, overrides={"fc1": "float", "fc2": "float"})
    for act, fused in ((nn.GELU(), True), (nn.GELU(approximate="tanh"), False), (nn.ReLU(), False)):
        torch.manual_seed(0)
        m = _Mlp(act).eval()
        q = tp.quantize_model(m, cfg, calibration=x, warn=False)
        assert (type(q.fc1) is LinearGELU) == fused, act
        with torch.no_grad():
            assert torch.allclose(q(x), m(x), rtol=1e-5, atol=1e-5)
