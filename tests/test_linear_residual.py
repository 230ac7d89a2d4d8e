"""A linear's residual add in its epilogue on the ``wgmma-gemm`` route (ops/qconv_plan.py ``wgmma_gemm_refusal``,
ops/qconv.py ``_wgmma_gemm``) and the converter's fusion of a pre-norm transformer layer's two adds
(nn/convert.py ``_fuse_linear_residuals``), decided for faked devices without a GPU.  The layers then run the
float64 reference here, or -- with the route forced and ``i8_gemm`` swapped for ``reference_i8_gemm`` -- the route's
own glue.  The kernel itself: tests/gpu/test_linear_residual_gpu.py."""

import operator

import pytest
import torch
import torch.nn.functional as F
from test_linear_wgmma_route import A100, F16, H100, _encoder, _x
from test_linear_wgmma_route import _convert as _route_convert
from torch import nn

import tcprec as tp
from tcprec.formats import as_format
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.nn import convert
from tcprec.nn.qmodules import QLinear
from tcprec.nn.speed_rule import _float_fn
from tcprec.ops import qconv as qc
from tcprec.ops import qconv_plan
from tcprec.ops.qconv_plan import WGMMA_GEMM, DeviceCaps, plan_conv2d


def _plan(caps=H100, K=768, N=768, **kw):
    g = ConvGeometry(64, 1, 1, K, N, 1, 1, (1, 1), (0, 0), (1, 1))
    kw.setdefault("out_dtype", F16)
    if kw.get("out_fmt") is not None:
        kw.setdefault("out_scale_given", True)
    return plan_conv2d(g, as_format("int8"), as_format("int8"), device=caps, input_layout="int8", **kw)


# -- the route --------------------------------------------------------------------------------------------------------


def test_the_route_takes_a_residual_into_fp16_out():
    p = _plan(has_residual=True)
    assert p.route == WGMMA_GEMM and p.epilogue == "float16" and p.after == "", p.reason
    assert "+ fp16 residual" in p.explain()


@pytest.mark.parametrize("kw, why", [
    ({"out_fmt": "int8", "out_layout": "int8"}, "residual with int8 codes out"),
    ({"out_dtype": torch.float32}, "kernel writes float16"),
    ({"caps": A100}, "sm_80"),
])
def test_a_residual_off_the_route_names_why(kw, why):
    p = _plan(has_residual=True, **kw)
    assert p.route == "kernel" and why in p.reason.partition(f"not {WGMMA_GEMM}: ")[2], p.reason


def test_a_residual_with_an_activation_or_a_pool_is_refused():
    # the GELU: the kernel applies it before the add; the plan wants act(y + residual) -- not the route, and the
    # Triton kernel has no GELU (a ValueError that says where it runs)
    assert "GELU before the residual add" in qconv_plan.wgmma_gemm_refusal(
        qconv_plan._replace(_plan(has_residual=True), act="gelu"))
    with pytest.raises(ValueError, match="act='gelu'"):
        _plan(has_residual=True, act="gelu")
    assert "a pool is not in the kernel's epilogue" in qconv_plan.wgmma_gemm_refusal(
        qconv_plan._replace(_plan(), pool=("max", 2, 2)))


def _force_route(monkeypatch):
    """The route forced on the CPU: a faked device that runs Triton, the refusal's device checks patched (its other
    conditions kept), ``i8_gemm`` replaced by its pure-torch reference; returns the calls seen."""
    from tcprec.kernels.cuda import i8_gemm as L
    from tcprec.kernels.reference_i8_gemm import i8_gemm_reference

    seen = []

    def fake(a, w, a_scale, w_scale, bias=None, *, gelu=False, out_scale=None, residual=None, tile=None):
        seen.append((tuple(a.shape), gelu, out_scale is not None,
                     None if residual is None else (tuple(residual.shape), residual.dtype, residual.is_contiguous())))
        return i8_gemm_reference(a, w, a_scale, w_scale, bias, gelu=gelu, out_scale=out_scale, residual=residual)

    refusal = qconv_plan.wgmma_gemm_refusal
    monkeypatch.setattr(L, "i8_gemm", fake)
    monkeypatch.setattr(qconv_plan, "wgmma_gemm_refusal",
                        lambda p: refusal(qconv_plan._replace(p, device=H100)))
    monkeypatch.setattr(qc, "device_caps", lambda dev: DeviceCaps(torch.device("cpu"), interpreting=True))
    qconv_plan.plan_conv2d.cache_clear()
    return seen


def test_the_route_hands_i8_gemm_the_residual_and_equals_the_torch_epilogue(monkeypatch):
    """``_wgmma_gemm``'s glue with the residual: the (M, N) fp16 rows of the residual, and the reference kernel's
    ``fp16(fp16(y) + r)`` equals the torch epilogue's (``_finish_float``, the Triton ``HAS_RES`` order) bit for bit,
    and the unfused ``fp16 linear + fp16 add``."""
    seen = _force_route(monkeypatch)
    try:
        torch.manual_seed(0)
        lin = nn.Linear(64, 48).half()
        x = torch.randn(3, 5, 64).half()
        q = QLinear.from_float(lin, "int8", in_absmax=float(x.abs().max()), signed_input=True)
        xa = qc.quantize_int8_static(x.reshape(-1, 1, 1, 64), q.a_fmt, q.in_scale, backend="reference")
        r = (torch.randn(15, 1, 1, 48) * 4).half()
        plan = qc.conv2d_plan(xa, q.weight, bias=q.bias, out_dtype=F16, backend="int8", residual=r)
        assert plan.route == WGMMA_GEMM, plan.reason
        y = qc.run(plan, xa, q.weight, bias=q.bias, residual=r)
        assert seen[-1] == ((15, 64), False, False, ((15, 48), F16, True))
        want = qc.conv2d(xa, q.weight, bias=q.bias, out_dtype=F16, backend="reference", residual=r)
        plain = qc.conv2d(xa, q.weight, bias=q.bias, out_dtype=F16, backend="reference")
        assert y.dtype == F16 and torch.equal(y, want) and torch.equal(y, plain + r)
        # through the module: m(x, residual) with the (..., N) residual
        q.has_residual = True
        out = q(x, r.reshape(3, 5, 48))
        assert out.shape == (3, 5, 48) and seen[-1][3] == ((15, 48), F16, True)
        q.has_residual = False
        assert torch.equal(out, q(x) + r.reshape(3, 5, 48))
    finally:
        monkeypatch.undo()
        qconv_plan.plan_conv2d.cache_clear()


def test_a_residual_linear_refuses_bad_residuals():
    torch.manual_seed(0)
    q = QLinear.from_float(nn.Linear(16, 8).half(), "int8", in_absmax=1.0, signed_input=True)
    x = torch.randn(2, 3, 16).half()
    with pytest.raises(ValueError, match=r"was not fused with a residual add.*call it as m\(x\)"):
        q(x, torch.zeros(2, 3, 8).half())
    q.has_residual = True
    assert "residual" in repr(q) and "residual" in "+".join(q.tcprec_trace())
    with pytest.raises(ValueError, match=r"was fused with a residual add.*m\(x, residual\)"):
        q(x)
    with pytest.raises(ValueError, match=r"output's shape \(2, 3, 8\).*no broadcasting.*got \(8,\)"):
        q(x, torch.zeros(8).half())
    with pytest.raises(ValueError, match=r"output's shape \(2, 3, 8\).*got \(3, 2, 8\)"):
        q(x, torch.zeros(3, 2, 8).half())
    with pytest.raises(ValueError, match=r"residual must have the output's dtype out_dtype=torch.float16"):
        q(x, torch.zeros(2, 3, 8))
    with pytest.raises(TypeError, match="residual must be a float tensor"):
        q(x, 1.0)
    y = q(x, torch.ones(2, 3, 8).half().transpose(0, 1).contiguous().transpose(0, 1))  # a non-contiguous residual
    assert y.shape == (2, 3, 8)


# -- the converter ---------------------------------------------------------------------------------------------------


DROPOUT = 0.1  # (eval-mode Dropouts between the linear and its add: the fusion skips them)


def _convert(monkeypatch, caps, dtype=F16, **kw):
    return _route_convert(monkeypatch, caps, dtype, dropout=DROPOUT, **kw)


def _adds(q):
    return [n for n in q.graph.nodes if n.op == "call_function" and n.target is operator.add]


RES = ("self_attn.out_proj", "linear2")


def test_converter_fuses_both_adds_on_the_route(monkeypatch):
    q, _ = _convert(monkeypatch, H100)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert _adds(q) == [] and not any("dropout" in str(n.target) for n in q.graph.nodes)
    for i in range(2):
        for name in RES:
            m, r = q.get_submodule(f"layers.{i}.{name}"), rec[f"layers.{i}.{name}"]
            assert m.has_residual and r.fused == ("residual",) and r.route.startswith(WGMMA_GEMM), r
            assert "fused residual" in q.tcprec_summary.explain(f"layers.{i}.{name}")
        a = q.get_submodule(f"layers.{i}.linear1")  # the FFN chain still holds, into a linear2 with a residual
        assert a.act == "gelu" and a.out_layout == "int8" and rec[f"layers.{i}.linear1"].fused == ("gelu",)
    assert not any("residual add(s) not fused" in n for n in q.tcprec_summary.notes)
    for name in ("layers.0.self_attn.out_proj", "layers.0.linear2"):
        node = next(n for n in q.graph.nodes if n.op == "call_module" and n.target == name)
        assert len(node.args) == 2  # (h, x): the residual is the layer's input / the attention block's output
    # a fused state loads into another fused conversion, not into an unfused one
    q0, _ = _convert(monkeypatch, H100, fuse_residual=False)
    other, _ = _convert(monkeypatch, H100)
    other.load_state_dict(q.state_dict())
    with pytest.raises(ValueError, match="cannot load"):
        q0.load_state_dict(q.state_dict())


def test_fused_equals_unfused_exactly(monkeypatch):
    """The fused model's output is the unfused one's bit for bit: on the reference backend (what a CPU runs), and
    with the route forced and i8_gemm swapped for its reference (the route's glue, every linear on it)."""
    q, x = _convert(monkeypatch, H100)
    q0, _ = _convert(monkeypatch, H100, fuse_residual=False)
    assert len(_adds(q0)) == 4 and not any(getattr(m, "has_residual", False) for m in q0.modules())
    with torch.no_grad():
        y, y0 = q(x), q0(x)
    assert y.dtype == F16 and y.shape == x.shape and torch.equal(y, y0)
    seen = _force_route(monkeypatch)
    for m in [*q.modules(), *q0.modules()]:
        if isinstance(m, QLinear):
            m.backend = "int8"  # (on the faked device, "auto" is the reference backend)
    try:
        with torch.no_grad():
            ys, ys0 = q(x), q0(x)
        assert sum(s[3] is not None for s in seen) == 4  # the four fused linears ran the route with their residual
        assert torch.equal(ys, ys0)
        assert float((ys.double() - y.double()).norm() / y.double().norm()) < 1e-2  # (the route vs the reference)
    finally:
        monkeypatch.undo()
        qconv_plan.plan_conv2d.cache_clear()


@pytest.mark.parametrize("caps, dtype, why", [(A100, F16, "sm_80"), (H100, torch.float32, "kernel writes float16")])
def test_converter_keeps_the_adds_off_the_route_and_says_so(monkeypatch, caps, dtype, why):
    q, _ = _convert(monkeypatch, caps, dtype)
    assert len(_adds(q)) == 4
    assert not any(getattr(m, "has_residual", False) for m in q.modules())
    note = [n for n in q.tcprec_summary.notes if "residual add(s) not fused" in n]
    assert len(note) == 1 and note[0].startswith("4 linear residual add(s)"), note
    assert "layers.0.self_attn.out_proj + " in note[0] and why in note[0]


def test_converter_on_the_cpu_neither_fuses_nor_notes():
    q = tp.quantize_model(_encoder(dropout=DROPOUT).half(), tp.QuantConfig("int8", first_last=None), calibration=_x(),
                          warn=False)
    assert len(_adds(q)) == 4 and not any("residual add(s) not fused" in n for n in q.tcprec_summary.notes)


def test_converter_fuses_either_operand_order_and_no_broadcast(monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            x = self.drop(self.a(x)) + x  # the linear on the left
            x = torch.add(x, self.b(x))  # torch.add
            return self.c(x) + x[:, :1]  # a broadcast add: not fused

    monkeypatch.setattr(convert, "device_caps", lambda dev: H100)
    torch.manual_seed(0)
    m = Block().half().eval()
    x = _x()
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None), calibration=x, warn=False)
    assert q.a.has_residual and q.b.has_residual and not q.c.has_residual
    q0 = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None, fuse_residual=False), calibration=x, warn=False)
    with torch.no_grad():
        assert torch.equal(q(x), q0(x))


def test_speed_rule_times_a_residual_linear_against_f_linear_plus_add():
    torch.manual_seed(0)
    lin = nn.Linear(32, 64)
    q = QLinear.from_float(lin, "int8", in_absmax=1.0, signed_input=True)
    q.has_residual = True
    torch.manual_seed(5)
    run = _float_fn(lin, q, ("residual",), (3, 32), torch.device("cpu"), torch.float32)
    torch.manual_seed(5)
    x = torch.randn(3, 32)
    res = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(run(), F.linear(x, lin.weight, lin.bias) + res)
    q.has_residual = False
    torch.manual_seed(5)
    with torch.no_grad():
        assert torch.equal(_float_fn(lin, q, (), (3, 32), torch.device("cpu"), torch.float32)(),
                           F.linear(x, lin.weight, lin.bias))
