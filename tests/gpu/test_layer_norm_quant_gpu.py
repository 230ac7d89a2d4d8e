"""``layer_norm_quantize`` on the GPU (kernels/triton/layer_norm_quant.py) against torch's CUDA LayerNorm followed by
the readers' own quantizers, at ``tcprec bench transformer``'s shape (batch 64, sequence 197) and ViT-L / H's widths;
and the converted pre-norm encoder, its LayerNorms writing their readers' codes, in a CUDA graph (decision 0162)."""

import copy
import dataclasses

import pytest
import torch
from cuda_graph import graphed

import tcprec as tp
from tcprec.bench.transformer import build_encoder
from tcprec.formats import IntFormat
from tcprec.nn.qmodules import QLayerNorm
from tcprec.ops import qconv as qc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


def _steps(a: tp.QTensor, b: tp.QTensor) -> torch.Tensor:
    """How many codes apart each element is (sign-magnitude float8 codes as positions on the grid; int8 codes by
    their stored values, ``ShiftedInt8``'s ``data``)."""
    if not isinstance(a.fmt, IntFormat):
        def ordinal(c):
            c = c.to(torch.int32)
            return torch.where(c & 0x80 != 0, -(c & 0x7F), c & 0x7F)
        return (ordinal(a.codes.flatten()) - ordinal(b.codes.flatten())).abs()
    return (a.data.flatten().to(torch.int32) - b.data.flatten().to(torch.int32)).abs()  # ShiftedInt8: the values


@pytest.mark.parametrize("C", [768, 1024, 1280])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("operand, fmt", [("int8", "int8"), ("fp8", "e4m3")])
def test_bench_shapes_against_torch_layer_norm_then_quantize(C, dtype, operand, fmt):
    g = torch.Generator(device="cuda").manual_seed(C)
    x = (torch.randn(64, 197, C, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    b = (0.2 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    s = torch.tensor([0.03 if operand == "int8" else 0.01], device="cuda")
    a = qc.layer_norm_quantize(x, w, b, 1e-6, operand, fmt, s)
    y = torch.nn.functional.layer_norm(x, (C,), w, b, 1e-6)  # torch's CUDA LayerNorm, in x's dtype
    r = qc.quantize_fp8_static(y, s) if operand == "fp8" else qc.quantize_int8_static(y.reshape(-1, 1, 1, C), fmt, s)
    assert a.shape == tuple(x.shape) and type(a.layout) is type(r.layout) and a.fmt == r.fmt
    d = _steps(a, r)
    equal = float((d == 0).float().mean())
    assert int(d.max()) <= 1 and equal >= 0.999, f"max {int(d.max())} steps, {equal:.6f} equal"


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_converted_encoder_in_a_cuda_graph(precision):
    """The bench's encoder (2 layers, batch 16): every norm1 / norm2 a QLayerNorm; a CUDA graph replays what eager
    gives, and the output is the unfused model's (chain=False) up to the rare one-step code."""
    enc = copy.deepcopy(build_encoder(768, 12, layers=2, device="cuda")).half()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 197, 768, device="cuda", generator=g).half()
    cfg = tp.QuantConfig(precision, first_last=None)
    q = tp.quantize_model(enc, cfg, calibration=x[:8], warn=False)
    assert [n for n, m in q.named_modules() if isinstance(m, QLayerNorm)] == \
        [f"layers.{i}.norm{j}" for i in (0, 1) for j in (1, 2)]
    assert q.get_submodule("layers.0.norm1").operand(x.device) == precision
    u = tp.quantize_model(enc, dataclasses.replace(cfg, chain=False), calibration=x[:8], warn=False)
    with torch.no_grad():
        eager, unfused = q(x), u(x)
        graph, out = graphed(q, x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    with torch.no_grad():
        ref = copy.deepcopy(enc).float()(x.float()).double()

    def nrmse(a, b):
        return float((a.double() - b).norm() / b.norm())

    # The fused model's codes come from float32 where the unfused one's come from fp16 (LayerNorm's codes; on the
    # wgmma-gemm route linear1's epilogue writes linear2's codes from its float32 GELU): a share of codes differs by
    # one step, so the two differ by less than either's quantization error, and fusing costs no accuracy.
    d, e_fused, e_unfused = nrmse(eager, unfused.double()), nrmse(eager, ref), nrmse(unfused, ref)
    msg = f"{precision}: fused vs unfused {d:.2e}, vs fp32: fused {e_fused:.2e}, unfused {e_unfused:.2e}"
    assert d < e_unfused and e_fused <= 1.1 * e_unfused, msg
