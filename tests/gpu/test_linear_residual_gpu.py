"""A QLinear's residual add in the epilogue of ``kernels/cuda/i8_gemm.cu`` (the ``wgmma-gemm`` route) on an sm_90
GPU, and ``quantize_model``'s fusion of a pre-norm transformer layer's two adds (nn/convert.py
``_fuse_linear_residuals``).

* On the transformer's shapes with a residual (M = 64 x 197 tokens; out_proj 768 -> 768, linear2 3072 -> 768; qkv and
  linear1 too, for the kernel's other N / K) the fused QLinear ``q(x, r)`` equals the unfused ``q(x) + r`` (fp16 out,
  torch's fp16 add) and the same layer on the Triton kernel with its ``HAS_RES`` epilogue, bit for bit, eagerly and
  replayed in a CUDA graph: all three compute ``fp16(float32(fp16(y)) + float32(r))`` of the same float32 y.
* ``tcprec bench transformer``'s encoder (4 layers, batch 64, sequence 197, fp16) converted with the residual fusion
  (both adds of every layer in out_proj's / linear2's epilogue) gives the output of the same conversion with
  ``fuse_residual=False`` bit for bit, eager and in a CUDA graph: every other kernel is the same launch on the same
  operands, and the fused sum is the unfused add's.

Skipped without a CUDA GPU of compute capability 9.0."""

import copy

import pytest
import torch
from sm90 import require_sm90

import tcprec as tp
from tcprec.bench.transformer import build_encoder
from tcprec.ops.qconv_plan import WGMMA_GEMM, device_caps

require_sm90("the wgmma-gemm route")

from cuda_graph import graphed  # noqa: E402
from test_linear_wgmma_route_gpu import DEV, SHAPES, _qlinear, _triton  # noqa: E402  (after the skips)


def _rand(shape, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, generator=g) * scale).half()


@pytest.mark.parametrize("name", list(SHAPES))
@torch.no_grad()
def test_fused_residual_equals_linear_plus_add(name):
    K, N = SHAPES[name]
    q = _qlinear(K, N, seed=len(name))
    q.plan_on(torch.device(DEV))
    plan = q.gemm_plan(device_caps(torch.device(DEV)), has_residual=True)
    assert plan.route == WGMMA_GEMM, plan.reason
    x = _rand((64, 197, K), seed=1)
    r = _rand((64, 197, N), seed=2, scale=8.0)
    q0 = copy.deepcopy(q)
    q.has_residual = True
    y = q(x, r)
    want = q0(x) + r
    assert y.dtype == torch.float16 and y.shape == (64, 197, N)
    assert torch.equal(y, want), f"{int((y != want).sum())} of {y.numel()} outputs differ from linear + add"
    assert torch.equal(y, _triton(q0, x, r)), "differs from the Triton kernel's residual epilogue"
    xs, rs = x.clone(), r.clone()
    graph, out = graphed(q, xs, rs)
    xs.copy_(_rand((64, 197, K), seed=3))
    rs.copy_(_rand((64, 197, N), seed=4, scale=8.0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, q0(xs) + rs)


@torch.no_grad()
def test_fused_encoder_equals_the_unfused_conversion():
    enc = build_encoder(768, 12, layers=4, device=DEV).half()
    x = _rand((64, 197, 768), seed=1)
    cfg = tp.QuantConfig("int8", first_last=None)
    qf = tp.quantize_model(copy.deepcopy(enc), cfg, calibration=x[:8], warn=False)
    qu = tp.quantize_model(copy.deepcopy(enc), tp.QuantConfig("int8", first_last=None, fuse_residual=False),
                           calibration=x[:8], warn=False)
    rec = {r.name: r for r in qf.tcprec_summary.layers}
    for i in range(4):
        for name in ("self_attn.out_proj", "linear2"):
            r = rec[f"layers.{i}.{name}"]
            assert "residual" in r.fused and r.route.startswith(WGMMA_GEMM), r
            assert qf.get_submodule(f"layers.{i}.{name}").has_residual
            assert not qu.get_submodule(f"layers.{i}.{name}").has_residual
    assert not any("residual add(s) not fused" in n for n in qf.tcprec_summary.notes)
    yf, yu = qf(x), qu(x)
    assert torch.equal(yf, yu), (f"{int((yf != yu).sum())} of {yf.numel()} outputs differ; max |diff| "
                                 f"{float((yf.float() - yu.float()).abs().max())}")
    xs = x.clone()
    graph, out = graphed(qf, xs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, yf)
