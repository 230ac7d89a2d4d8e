"""The ``wgmma-gemm`` route (ops/qconv_plan.py): a QLinear's rows on ``kernels/cuda/i8_gemm.cu`` on an sm_90 GPU.

* On the transformer's shapes (M = 64 x 197 tokens; qkv 768 -> 2304, out_proj 768 -> 768, linear1 768 -> 3072,
  linear2 3072 -> 768) a QLinear on the route equals the same layer on the Triton kernel bit for bit, eagerly and
  replayed in a CUDA graph: the epilogues are the same float32 operations in the same order
  (``col = a_scale * w_scale[n]`` rounded once, ``float32(acc) * col + bias``, one rounding to fp16).  The Triton
  route is forced by passing ``scale=ones``: the plan then refuses the wgmma GEMM (no per-channel scale in its
  epilogue), and ``col * 1.0`` is ``col`` exactly, so both sides compute the same numbers.
* linear1 -> GELU -> linear2 chained (linear1 writes linear2's int8 codes after the erf GELU, ``quantize_model``'s
  ``_chain_ffn``): the codes are the kernel reference's (``reference_i8_gemm``, gelu + out_scale) within the kernel's
  GELU tolerance (+-1 code at < 0.1% of them: erf_f32 vs torch's erf); against the unchained pair (fp16 GEMM output,
  torch's fp16 GELU, linear2's own quantizer) +-1 code at < 2% of them (the unchained pair rounds y and GELU(y) to
  fp16 before quantizing, each a shift of up to |code| * 2^-11 steps); linear2's output within NRMSE 5e-3 of the
  unchained one.
* ``tcprec bench transformer``'s encoder (4 layers, batch 64, sequence 197) converted on the route runs, eager and in a
  CUDA graph, and its NRMSE against fp32 is within 1.5x of the same conversion on the Triton route.

Skipped without a CUDA GPU of compute capability 9.0."""

import copy

import pytest
import torch
import torch.nn.functional as F
from cuda_graph import graphed
from sm90 import require_sm90
from torch import nn

import tcprec as tp
from tcprec.bench.transformer import build_encoder
from tcprec.kernels.reference_i8_gemm import i8_gemm_reference
from tcprec.nn.qmodules import QLinear
from tcprec.ops import qconv as qc
from tcprec.ops import qconv_plan

require_sm90("the wgmma-gemm route")

DEV = "cuda"
M = 64 * 197
SHAPES = {"qkv": (768, 2304), "out_proj": (768, 768), "linear1": (768, 3072), "linear2": (3072, 768)}


def _qlinear(K, N, seed, x_absmax=4.0, signed=True):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N).to(DEV).half()
    return QLinear.from_float(lin, "int8", in_absmax=x_absmax, signed_input=signed).eval()


def _x(K, seed, rows=M):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, K, device=DEV, generator=g).half()


def _triton(q: QLinear, x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """The same layer (and residual ``r``) on the Triton kernel: ``scale=ones`` makes the plan refuse the wgmma GEMM,
    and multiplies the column scale by 1.0 (exact)."""
    xa = qc.quantize_int8_static(x.reshape(-1, 1, 1, q.in_features), q.a_fmt, q.in_scale)
    ones = torch.ones(q.out_features, device=DEV)
    res = None if r is None else r.reshape(-1, 1, 1, q.out_features)
    plan = qc.conv2d_plan(xa, q.weight, bias=q.bias, scale=ones, out_dtype=torch.float16, residual=res)
    assert plan.route == "kernel" and "per-channel scale" in plan.reason, plan.reason
    y = qc.run(plan, xa, q.weight, bias=q.bias, scale=ones, residual=res)
    return y.reshape(*x.shape[:-1], q.out_features)


@pytest.mark.parametrize("name", list(SHAPES))
@torch.no_grad()
def test_route_equals_the_triton_route_bit_for_bit(name):
    K, N = SHAPES[name]
    q = _qlinear(K, N, seed=K + N)
    x = _x(K, seed=N)
    xa = qc.quantize_int8_static(x.reshape(-1, 1, 1, K), q.a_fmt, q.in_scale)
    plan = qc.conv2d_plan(xa, q.weight, bias=q.bias, out_dtype=torch.float16)
    assert plan.route == qconv_plan.WGMMA_GEMM and "i8_gemm" in qc.explain_conv2d(xa, q.weight, bias=q.bias,
                                                                                   out_dtype=torch.float16)
    y = q(x)
    assert y.dtype == torch.float16 and y.shape == (M, N)
    assert torch.equal(y, _triton(q, x))
    # in a CUDA graph, replayed on new values of the same buffer
    x_static = x.clone()
    g, out = graphed(q, x_static)
    x2 = _x(K, seed=N + 1)
    x_static.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _triton(q, x2))


@pytest.mark.parametrize("rows", [1, 197, 1000])
@torch.no_grad()
def test_route_other_row_counts(rows):
    q = _qlinear(768, 2304, seed=3)
    x = _x(768, seed=rows, rows=rows)
    assert torch.equal(q(x), _triton(q, x))


@torch.no_grad()
def test_chained_pair_against_the_kernel_reference_and_the_unchained_pair():
    K, H = SHAPES["linear1"]
    x = _x(K, seed=7).reshape(64, 197, K)
    torch.manual_seed(0)
    l1, l2 = nn.Linear(K, H).to(DEV).half(), nn.Linear(H, K).to(DEV).half()
    h = F.gelu(l1(x))
    a = QLinear.from_float(l1, "int8", in_absmax=float(x.abs().max()), signed_input=True).eval()
    b = QLinear.from_float(l2, "int8", in_absmax=float(h.abs().max()), signed_input=True).eval()
    assert str(b.a_fmt) == "int8"
    unchained_h = F.gelu(a(x))  # fp16 GEMM output, torch's fp16 GELU
    want = b(unchained_h)
    c = copy.deepcopy(a)
    c.act = "gelu"
    c.chain_to(b, "int8")
    plan = c.gemm_plan(qconv_plan.device_caps(torch.device(DEV)))
    assert plan.route == qconv_plan.WGMMA_GEMM and plan.epilogue == "int8", plan.explain()
    codes = c(x)
    assert isinstance(codes, tp.QTensor) and codes.shape == (64, 197, H) and codes.data.dtype == torch.int8
    # the kernel reference of the chained epilogue: +-1 code at < 0.1% (erf_f32 against torch's erf)
    x8 = qc.quantize_int8_static(x.reshape(-1, 1, 1, K), a.a_fmt, a.in_scale).data.reshape(-1, K)
    w8 = a.weight_codes.view(torch.int8).reshape(H, K)
    ref = i8_gemm_reference(x8, w8, a.in_scale, a.weight_scale.reshape(H), a.bias, gelu=True, out_scale=b.in_scale)
    d = (codes.data.reshape(-1, H).to(torch.int32) - ref.to(torch.int32)).abs()
    assert int(d.max()) <= 1 and float((d != 0).float().mean()) < 1e-3, (int(d.max()), float((d != 0).float().mean()))
    # the unchained pair's codes (linear2 quantizing torch's fp16 GELU): +-1 code at < 2%
    own = qc.quantize_int8_static(unchained_h.reshape(-1, 1, 1, H), b.a_fmt, b.in_scale).data.reshape(-1, H)
    d = (codes.data.reshape(-1, H).to(torch.int32) - own.to(torch.int32)).abs()
    assert int(d.max()) <= 1 and float((d != 0).float().mean()) < 0.02, (int(d.max()), float((d != 0).float().mean()))
    got = b(codes)
    assert got.shape == want.shape == (64, 197, K)
    e = float((got.double() - want.double()).norm() / want.double().norm())
    assert e < 5e-3, e


def _nrmse(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@torch.no_grad()
def test_converted_encoder_on_the_route_against_the_triton_route(monkeypatch):
    enc32 = build_encoder(768, 12, layers=4, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    x32 = torch.randn(64, 197, 768, device=DEV, generator=g)
    ref = enc32(x32).float()
    enc = copy.deepcopy(enc32).half()
    x = x32.half()
    cfg = tp.QuantConfig("int8", first_last=None)
    # the Triton route: the planner refuses the wgmma GEMM (so the converter chains nothing either)
    monkeypatch.setattr(qconv_plan, "wgmma_gemm_refusal", lambda p: "test: the Triton route")
    qconv_plan.plan_conv2d.cache_clear()
    try:
        qt = tp.quantize_model(enc, cfg, calibration=x[:8], warn=False)
        rec = {r.name: r for r in qt.tcprec_summary.layers}
        assert rec["layers.0.linear1"].route.startswith("triton") and "gelu" not in rec["layers.0.linear1"].fused
        assert any("not chained" in n for n in qt.tcprec_summary.notes)
        yt = qt(x)
    finally:
        monkeypatch.undo()
        qconv_plan.plan_conv2d.cache_clear()
    qw = tp.quantize_model(enc, cfg, calibration=x[:8], warn=False)
    rec = {r.name: r for r in qw.tcprec_summary.layers}
    for i in range(4):
        r1, r2 = rec[f"layers.{i}.linear1"], rec[f"layers.{i}.linear2"]
        assert r1.route.startswith("wgmma-gemm") and r2.route.startswith("wgmma-gemm")
        assert "gelu" in r1.fused and r1.out == f"int8 codes int8 -> layers.{i}.linear2"
        assert rec[f"layers.{i}.self_attn.out_proj"].route.startswith("wgmma-gemm")
    yw = qw(x)
    x_static = x.clone()
    graph, out = graphed(qw, x_static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, yw)
    et, ew = _nrmse(yt, ref), _nrmse(yw, ref)
    assert ew <= 1.5 * et, f"NRMSE vs fp32: wgmma route {ew:.5f}, Triton route {et:.5f}"
