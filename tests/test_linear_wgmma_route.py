"""The ``wgmma-gemm`` route of a linear's rows (ops/qconv_plan.py ``wgmma_gemm_refusal``) and the converter's
linear1 -> GELU -> linear2 chaining on it (nn/convert.py ``_chain_ffn``), decided for faked devices without a GPU
(the layers then run the float64 reference here, which reads and writes the same operands).  The kernel itself:
tests/gpu/test_linear_wgmma_route_gpu.py and tests/gpu/test_i8_gemm_gpu.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp
from tcprec.formats import as_format
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.nn import convert
from tcprec.nn.qmodules import QConv2d, QLinear
from tcprec.nn.speed_rule import _float_fn
from tcprec.ops import qconv as qc
from tcprec.ops.qconv_plan import WGMMA_GEMM, DeviceCaps, plan_conv2d

H100 = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)
A100 = DeviceCaps(torch.device("cuda", 0), False, (8, 0), True, (True, "sm_80 has native BMMA AND.POPC"), 108)
NO_NVRTC = DeviceCaps(torch.device("cuda", 0), False, (9, 0), False, (False, "no cuda.core"), 132)
CPU = DeviceCaps(torch.device("cpu"))
F16 = torch.float16


def _plan(caps=H100, a="int8", w="int8", K=768, N=3072, rows=(1, 1), R=1, **kw):
    g = ConvGeometry(64, *rows, K, N, R, R, (1, 1), (R // 2, R // 2), (1, 1))
    kw.setdefault("out_dtype", F16)
    if kw.get("out_fmt") is not None:
        kw.setdefault("out_scale_given", True)
    return plan_conv2d(g, as_format(a), as_format(w), device=caps, input_layout="int8", **kw)


def test_route_where_every_condition_holds():
    for kw in ({}, {"act": "gelu"}, {"out_fmt": "int8", "out_layout": "int8"},
               {"act": "gelu", "out_fmt": "int8", "out_layout": "int8"}, {"w": "int4"}, {"a": "uint7"}, {"K": 16}):
        p = _plan(**kw)
        assert p.backend == "int8" and p.route == WGMMA_GEMM, (kw, p.reason)
        assert p.epilogue == ("int8" if "out_fmt" in kw else "float16") and p.after == ""
        text = p.explain()
        assert f"{WGMMA_GEMM}: a linear's rows" in text and "i8_gemm.cu" in text and "Triton implicit" not in text
        assert ("erf GELU" in text) == ("act" in kw)


@pytest.mark.parametrize("kw, why", [
    ({"caps": A100}, "sm_80"),
    ({"caps": NO_NVRTC}, "NVRTC"),
    ({"a": "uint8"}, "x's uint8 codes are stored shifted"),
    ({"K": 100}, "K = 100 is not a multiple of 16"),
    ({"out_dtype": torch.float32}, "kernel writes float16"),
    ({"out_dtype": torch.bfloat16}, "kernel writes float16"),
    ({"act": "relu"}, "act='relu'"),
    ({"has_scale": True}, "per-channel scale"),
    ({"has_residual": True, "out_fmt": "int8", "out_layout": "int8"}, "residual with int8 codes out"),
    ({"out_fmt": "uint8", "out_layout": "int8"}, "two's complement"),
    ({"out_fmt": "int8", "out_layout": "int8+float"}, "two's complement"),
])
def test_triton_route_names_why_not(kw, why):
    p = _plan(**kw)
    assert p.backend == "int8" and p.route == "kernel", p.reason
    assert f"not {WGMMA_GEMM}: " in p.reason and why in p.reason.partition(f"not {WGMMA_GEMM}: ")[2], p.reason


def test_only_a_linears_rows_are_considered():
    """Convolutions (spatial images, a 3x3 filter) keep the Triton kernel without a word about the GEMM; off CUDA the
    reference backend has no route."""
    for kw in ({"rows": (14, 14)}, {"rows": (8, 8), "R": 3}):
        p = _plan(**kw)
        assert p.route == "kernel" and WGMMA_GEMM not in p.reason
    p = _plan(caps=CPU)
    assert p.backend == "reference" and p.route == ""
    w = _plan(w="uint8")  # shifted weights: im2col + torch._int_mm
    assert w.route == "im2col"


def test_gelu_only_where_an_epilogue_applies_it():
    with pytest.raises(ValueError, match=r"act='gelu'.*wgmma-gemm route's epilogue.*sm_80"):
        _plan(caps=A100, act="gelu")
    with pytest.raises(ValueError, match=r"act='gelu'.*backend 'bitserial'"):
        _plan(a="uint2", w="binary", act="gelu", out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"act='gelu'.*'fp8'"):
        _plan(a="e4m3", w="e4m3", act="gelu")
    assert _plan(caps=CPU, act="gelu").backend == "reference"  # the torch epilogue applies it
    assert _plan(w="uint8", act="gelu").route == "im2col"
    with pytest.raises(ValueError, match=r"for a QConv2d.*got act='gelu'"):
        QConv2d.from_float(nn.Conv2d(8, 4, 1), "int8", act="gelu", in_absmax=1.0, signed_input=True)
    with pytest.raises(ValueError, match=r"QLinear fuses act=None, 'relu' or 'gelu'"):
        QLinear.from_float(nn.Linear(16, 8), "int8", act="tanh", in_absmax=1.0, signed_input=True)


def test_run_refuses_a_scale_the_plan_was_not_made_with():
    p = _plan(rows=(1, 1), K=16, N=8)
    x = tp.quantize(torch.randn(64, 1, 1, 16), "int8", layout=tp.ShiftedInt8())
    w = tp.quantize(torch.randn(8, 1, 1, 16), "int8", tp.PerChannel(0))
    with pytest.raises(ValueError, match="no per-channel scale"):
        qc.run(p, x, w, scale=torch.ones(8))


def test_the_reference_gelu_is_the_kernels_float32_operations():
    """On the reference backend (CPU) a QLinear with act='gelu' applies ``(0.5 * y) * (1 + erf(y * 0.70710678f))`` in
    float32, the wgmma GEMM epilogue's (``reference_i8_gemm``), to the float32 GEMM result."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x = torch.randn(5, 32)
    q = QLinear.from_float(lin, "int8", act="gelu", in_absmax=float(x.abs().max()), signed_input=True)
    plain = copy.deepcopy(q)
    plain.act = None
    y = plain(x)
    want = (0.5 * y) * (1.0 + torch.erf(y * torch.tensor(0.70710678, dtype=torch.float32)))
    assert torch.equal(q(x), want)


# -- the converter ---------------------------------------------------------------------------------------------------


def _encoder(layers=2, d=32, dropout=0.0):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=dropout, activation="gelu", batch_first=True,
                                       norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def _x(d=32, dtype=F16):
    return torch.randn(2, 7, d, generator=torch.Generator().manual_seed(1)).to(dtype)


def _convert(monkeypatch, caps, dtype=F16, dropout=0.0, **kw):
    monkeypatch.setattr(convert, "device_caps", lambda dev: caps)
    enc = _encoder(dropout=dropout).to(dtype)
    x = _x(dtype=dtype)
    return tp.quantize_model(enc, tp.QuantConfig("int8", first_last=None, **kw), calibration=x, warn=False), x


def _gelu_nodes(q):
    return [n for n in q.graph.nodes if n.op == "call_function" and n.target is F.gelu]


def test_converter_chains_the_ffn_on_the_route(monkeypatch):
    q, x = _convert(monkeypatch, H100)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    for i in range(2):
        a, b = q.get_submodule(f"layers.{i}.linear1"), q.get_submodule(f"layers.{i}.linear2")
        assert a.act == "gelu" and a.out_layout == "int8" and a.out_fmt == b.a_fmt == as_format("int8")
        assert torch.equal(a.out_scale, b.in_scale) and b.layer_plan.chain_in == "int8"
        r = rec[f"layers.{i}.linear1"]
        assert r.fused == ("gelu",) and r.out == f"int8 codes int8 -> layers.{i}.linear2"
        assert r.route.startswith(WGMMA_GEMM) and rec[f"layers.{i}.linear2"].route.startswith(WGMMA_GEMM)
        assert "route wgmma-gemm" in q.tcprec_summary.explain(f"layers.{i}.linear1")
    assert _gelu_nodes(q) == [] and "layers.0.dropout" not in [n.target for n in q.graph.nodes]
    assert "int8/wgmma" in str(q.tcprec_summary)
    # runs here on the reference backend (float64 sums, the same float32 GELU), close to the unchained model
    q0, _ = _convert(monkeypatch, H100, chain=False)
    assert len(_gelu_nodes(q0)) == 2 and q0.get_submodule("layers.0.linear1").act is None
    with torch.no_grad():
        y, y0 = q(x), q0(x)
    assert y.shape == x.shape and y.dtype == F16
    assert float((y.double() - y0.double()).norm() / y0.double().norm()) < 5e-3
    # a state saved from the chained model loads into another chained conversion, not into the unchained one
    other, _ = _convert(monkeypatch, H100)
    other.load_state_dict(q.state_dict())
    with pytest.raises(ValueError, match="cannot load"):
        q0.load_state_dict(q.state_dict())


@pytest.mark.parametrize("caps, dtype, why", [(A100, F16, "sm_80"), (H100, torch.float32, "kernel writes float16"),
                                              (NO_NVRTC, F16, "NVRTC")])
def test_converter_keeps_the_pair_apart_off_the_route_and_says_so(monkeypatch, caps, dtype, why):
    q, _ = _convert(monkeypatch, caps, dtype)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    for i in range(2):
        a = q.get_submodule(f"layers.{i}.linear1")
        assert a.act is None and a.out_fmt is None and rec[f"layers.{i}.linear1"].fused == ()
        assert rec[f"layers.{i}.linear1"].route.startswith("triton (not wgmma-gemm")
    assert len(_gelu_nodes(q)) == 2
    note = [n for n in q.tcprec_summary.notes if "not chained" in n]
    assert len(note) == 1 and "layers.0.linear1 -> layers.0.linear2" in note[0] and "0125" in note[0]
    assert why in note[0]


def test_converter_on_the_cpu_neither_chains_nor_notes():
    q = tp.quantize_model(_encoder().half(), tp.QuantConfig("int8", first_last=None), calibration=_x(), warn=False)
    assert len(_gelu_nodes(q)) == 2 and not any("not chained" in n for n in q.tcprec_summary.notes)
    assert all(r.route == "" for r in q.tcprec_summary.layers)


def test_a_gelu_linear_refuses_a_device_without_the_route():
    lin = nn.Linear(32, 64).half()
    q = QLinear.from_float(lin, "int8", act="gelu", in_absmax=1.0, signed_input=True)
    assert q.plan_on(torch.device("cuda", 0), "l1", caps=H100).backend == "int8"
    with pytest.raises(ValueError, match=r"l1: .*wgmma-gemm route; on cuda:0 it cannot run.*Convert on the device"):
        q.plan_on(torch.device("cuda", 0), "l1", caps=A100)
    assert q.plan_on(torch.device("cpu"), caps=CPU).backend == "reference"  # the reference applies it


def test_speed_rule_times_a_gelu_linear_against_the_float_gemm_with_the_gelu_epilogue():
    """The chained linear1's float twin is the LinearGELU a kept-float linear1 becomes (one GEMM, GELU epilogue)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 64)
    q = QLinear.from_float(lin, "int8", act="gelu", in_absmax=1.0, signed_input=True)
    run = _float_fn(lin, q, ("gelu",), (3, 32), torch.device("cpu"), torch.float32)
    y = run()
    assert y.shape == (3, 64) and torch.all(y > -0.2)  # a GELU's output (min -0.17)


def test_the_route_hands_i8_gemm_the_rows_and_wraps_its_output(monkeypatch):
    """The glue of ``ops.qconv._wgmma_gemm``, on the CPU: the route forced (a faked device that runs Triton, the
    refusal patched) and ``i8_gemm`` replaced by its pure-torch reference, the layer's fp16 output and its chained int8
    codes are the reference backend's (the same float32 epilogue) for the same operands."""
    from tcprec.kernels.cuda import i8_gemm as L
    from tcprec.kernels.reference_i8_gemm import i8_gemm_reference
    from tcprec.ops import qconv_plan

    seen = []

    def fake(a, w, a_scale, w_scale, bias=None, *, gelu=False, out_scale=None, residual=None, tile=None):
        seen.append((tuple(a.shape), tuple(w.shape), a.dtype, w.dtype, tuple(a_scale.shape), tuple(w_scale.shape),
                     gelu, out_scale is not None, tile))
        return i8_gemm_reference(a, w, a_scale, w_scale, bias, gelu=gelu, out_scale=out_scale, residual=residual)

    monkeypatch.setattr(L, "i8_gemm", fake)
    monkeypatch.setattr(qconv_plan, "wgmma_gemm_refusal", lambda p: None)
    monkeypatch.setattr(qc, "device_caps", lambda dev: DeviceCaps(torch.device("cpu"), interpreting=True))
    qconv_plan.plan_conv2d.cache_clear()
    try:
        torch.manual_seed(0)
        lin1, lin2 = nn.Linear(32, 48).half(), nn.Linear(48, 16).half()
        x = torch.randn(3, 5, 32).half()
        a = QLinear.from_float(lin1, "int8", in_absmax=float(x.abs().max()), signed_input=True)
        b = QLinear.from_float(lin2, "int8", in_absmax=1.0, signed_input=True)
        xa = qc.quantize_int8_static(x.reshape(-1, 1, 1, 32), a.a_fmt, a.in_scale, backend="reference")
        plan = qc.conv2d_plan(xa, a.weight, bias=a.bias, out_dtype=F16, backend="int8")
        assert plan.route == WGMMA_GEMM, plan.reason
        y = qc.run(plan, xa, a.weight, bias=a.bias)
        want = qc.conv2d(xa, a.weight, bias=a.bias, out_dtype=F16, backend="reference")
        assert y.shape == (15, 1, 1, 48) and y.dtype == F16 and torch.equal(y, want)
        assert seen[-1] == ((15, 32), (48, 32), torch.int8, torch.int8, (1,), (48,), False, False, None)
        a.act = "gelu"
        a.chain_to(b, "int8")
        codes = qc.conv2d(xa, a.weight, bias=a.bias, act="gelu", out_dtype=F16, out_fmt=b.a_fmt, out_scale=b.in_scale,
                          out_layout="int8", backend="int8")
        ref = qc.conv2d(xa, a.weight, bias=a.bias, act="gelu", out_dtype=F16, out_fmt=b.a_fmt, out_scale=b.in_scale,
                        out_layout="int8", backend="reference")
        assert seen[-1][6:8] == (True, True)
        assert isinstance(codes.layout, tp.ShiftedInt8) and codes.shape == (15, 1, 1, 48)
        assert torch.equal(codes.data, ref.data) and torch.equal(codes.scale.reshape(1), b.in_scale)
    finally:
        monkeypatch.undo()
        qconv_plan.plan_conv2d.cache_clear()
