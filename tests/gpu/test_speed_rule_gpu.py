"""The speed rule on the GPU: the real CUDA-graph clock times every quantized layer of a chained ResNet-18 and the
whole model, its decisions are consistent with its own figures, a floated layer re-chains its neighbours and the
model equals the one built from the rule's overrides; a fake clock floats a chosen layer inside a bit-plane chain;
``bench models`` runs one torchvision model end to end.  No assertion depends on which side is faster."""

import copy
import json

import pytest
import torch

import tcprec as tp
from tcprec.nn import models as zoo
from tcprec.nn.speed_rule import MODEL, SpeedRule, cuda_graph_timer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


def _nrmse(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def _resnet(batch=32):
    m = zoo.build("resnet18", seed=0, device="cuda").half().to(memory_format=torch.channels_last)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn((batch, 3, 224, 224), device="cuda", generator=g).half()
    return m, x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("precision", ["int8", "w1a2"])
def test_real_clock_decisions_match_its_figures(precision):
    m, x = _resnet()
    calls = []

    def clock(layer, side, fn):
        ms = cuda_graph_timer(layer, side, fn)
        calls.append((layer, side, ms))
        return ms

    first_last = None if precision == "int8" else "int8"
    cfg = tp.QuantConfig(precision, first_last=first_last, speed_rule=SpeedRule(timer=clock))
    q = tp.quantize_model(m, cfg, calibration=x[:8], warn=False)
    s = q.tcprec_summary
    sp = s.speed
    assert sp is not None and sp.float_label == "fp16" and sp.input_shape == tuple(x[:8].shape)  # the calibration batch
    assert all(ms > 0 for _, _, ms in calls)
    quantized = [r.name for r in s.layers if r.precision != "float"]
    timed = {t.name: t for t in sp.layers}
    assert set(quantized) <= set(timed)  # every layer left quantized was timed, in the last conversion
    for t in sp.layers:
        # (by_model: the whole-model fallback; by_chain: slower alone, quantized again by the chain check)
        assert t.floated == ((t.quant_ms > t.float_ms and not t.by_chain) or bool(t.by_model))
        rec = next(r for r in s.layers if r.name == t.name)
        assert (rec.precision == "float") == t.floated and "ms" in rec.reason
    assert sp.model_ms > 0 and sp.float_model_ms > 0 and (MODEL, "float") in {(c[0], c[1]) for c in calls}
    if sp.speedup < 1.0:
        assert any("SLOWER THAN FP16" in n for n in sp.notes)
    # the rule's outcome pinned as overrides rebuilds the same structure (and the same outputs up to cuDNN's algorithm
    # choice on the fp16 layers, whose last-bit differences can move a few low-bit activation codes downstream)
    pinned = tp.quantize_model(m, tp.QuantConfig(precision, first_last=first_last, overrides=sp.overrides()),
                               calibration=x[:8], warn=False)
    assert [(r.name, r.precision, r.out) for r in pinned.tcprec_summary.layers] == \
        [(r.name, r.precision, r.out) for r in s.layers]
    with torch.no_grad():
        assert _nrmse(q(x), pinned(x)) < 5e-2


def test_fake_clock_floats_a_layer_inside_a_plane_chain():
    m, x = _resnet(batch=8)
    plain = tp.quantize_model(m, tp.QuantConfig("w1a2"), calibration=x, warn=False)
    chained = [r.name for r in plain.tcprec_summary.layers if r.out.startswith("packed")]
    assert chained, "ResNet-18 w1a2 chains bit planes between convs"
    # the victim: the first chained layer past the middle that the rule times under its own name (a twin of an
    # earlier layer takes that layer's timing, docs/decisions/0159); its own twins are floated with it
    later, victim = chained[len(chained) // 2:], None

    def clock(layer, side, fn):  # (the whole model 10% faster quantized: past SpeedRule.margin, no fallback)
        nonlocal victim
        fn()
        if victim is None and side == "quantized" and layer in later:
            victim = layer
        return 2.0 if (layer, side) == (victim, "quantized") else 0.9 if (layer, side) == (MODEL, "quantized") else 1.0

    q = tp.quantize_model(m, tp.QuantConfig("w1a2", speed_rule=SpeedRule(timer=clock)), calibration=x, warn=False)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    twins = [t.name for t in q.tcprec_summary.speed.layers if t.quant_from == victim]
    assert victim is not None and [n for n, r in recs.items() if r.precision == "float"] == \
        [n for n in recs if n == victim or n in twins]
    assert recs[victim].reason.startswith("kept fp16: w1a2 2.000 ms > fp16 1.000 ms at input (8,")
    assert all(recs[n].reason.startswith("kept fp16: w1a2 2.000 ms") and victim in recs[n].reason for n in twins)
    floated = dict.fromkeys([victim, *twins], "float")
    ref = tp.quantize_model(m, tp.QuantConfig("w1a2", overrides=floated), calibration=x, warn=False)
    with torch.no_grad():
        y, yr = q(x), ref(x)
    assert torch.isfinite(y).all() and _nrmse(y, yr) < 5e-2


def test_bench_models_one_torchvision_model(tmp_path):
    pytest.importorskip("torchvision", reason="bench models needs torchvision (installed on the GPU machine)")
    from rich.console import Console

    from tcprec.bench import models as mb

    out = tmp_path / "models.json"
    payload = mb.run(["resnet18"], ["int8"], batch=16, out=str(out), console=Console(quiet=True))
    d = json.loads(out.read_text())
    assert d["suite"] == "models" and d["summary"] == payload["summary"]
    (row,) = d["summary"]
    assert "error" not in row, row
    assert row["quantized"] + row["floated_by_rule"] >= 20 and row["ms"] > 0 and row["nrmse_vs_fp32"] < 0.1


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_real_clock_times_the_fused_qkv_of_an_encoder(precision):
    """A 2-layer ViT-B-width encoder at 64 x 197 tokens: every quantized linear is timed, each fused qkv_proj as one
    layer against the stacked fp16 linear, and its decision is its own figures' (either way); each layer left with a
    quantized linear is then timed whole against torch's fp16 layer (its fused fast path), and a layer faster as
    torch's is torch's nn.TransformerEncoderLayer again, every linear in it fp16 (docs/decisions/0135)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda().half().eval()
    x = torch.randn(8, 197, 768, device="cuda", dtype=torch.float16)
    q = tp.quantize_model(enc, tp.QuantConfig(precision, first_last=None, speed_rule=SpeedRule(batch=64)),
                          calibration=x, warn=False)
    sp = q.tcprec_summary.speed
    timed = {t.name: t for t in sp.layers}
    assert sp.input_shape == (64, 197, 768)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    whole = {n for m in sp.modules if m.floated for n in m.layers}  # kept fp16 for torch's fused layer
    for m in sp.modules:
        assert m.kind == "TransformerEncoderLayer" and m.quant_ms > 0 < m.float_ms and m.quantized
        assert m.floated == (m.float_ms < m.quant_ms)
        assert (type(q.get_submodule(m.name)) is torch.nn.TransformerEncoderLayer) == m.floated
        for n in m.layers:
            assert recs[n].precision == "float" and "as torch's fused module" in recs[n].reason
    for i in range(2):
        t = timed[f"layers.{i}.self_attn.qkv_proj"]
        assert t.members == tuple(f"layers.{i}.self_attn.{p}_proj" for p in "qkv") and t.quant_ms > 0 < t.float_ms
        for n in t.members:
            if n in whole:
                continue
            assert (recs[n].precision == "float") == t.floated and f"timed as layers.{i}.self_attn.qkv_proj" in \
                recs[n].reason
        attn = [f"layers.{i}.self_attn.{p}_proj" for p in ("q", "k", "v", "out")]
        if all(recs[n].precision == "float" for n in attn):  # torch's own attention (or layer, or encoder) again
            assert type(q.get_submodule(f"layers.{i}.self_attn")) is torch.nn.MultiheadAttention
        else:
            fused = q.get_submodule(f"layers.{i}.self_attn.qkv_proj")
            assert type(fused).__name__ == ("Linear" if t.floated else "QLinear")
    assert set(sp.overrides()) == {n for t in sp.layers if t.floated for n in t.layers} | whole
    with torch.no_grad():
        y, y16 = q(x), enc(x)
    assert _nrmse(y, y16) < 0.1


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_encoder_measured_slower_everywhere_is_torchs_own_encoder_on_cuda(precision):
    """A clock that finds every quantized linear slower (the decision fixed, the rest of the rule real): the converted
    model is an equal copy of the fp16 nn.TransformerEncoder -- torch's fused layer kernel runs, as in the fp16
    model -- and its output is the fp16 model's; the summary lists all 12 linears float with the measured reason."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda().half().eval()
    x = torch.randn(8, 197, 768, device="cuda", dtype=torch.float16)

    def clock(layer, side, fn):
        fn()
        return 2.0 if side == "quantized" and layer != MODEL else 1.0

    q = tp.quantize_model(enc, tp.QuantConfig(precision, first_last=None, speed_rule=SpeedRule(batch=64, timer=clock)),
                          calibration=x, warn=False)
    assert type(q) is torch.nn.TransformerEncoder and q is not enc
    recs = q.tcprec_summary.layers
    assert len(recs) == 12 and all(r.precision == "float" and r.reason.startswith("kept fp16: ") for r in recs)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = q(x)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_transformer_encoder_layer_fwd") == 2
    with torch.no_grad():
        y16 = enc(x)
    assert _nrmse(y, y16) < 1e-3  # the same module and weights (same kernels: equal up to run-to-run order)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_real_clock_times_a_linear_read_by_gelu_with_its_gelu(precision):
    """A ConvNeXt / ViT-style MLP in fp16 on CUDA (linear -> erf GELU -> linear over (B, L, C) rows): fc1's timings
    include its GELU on both sides (decision 0156), fc2's do not; the decisions match the figures, and a floated fc1
    is the LinearGELU the float side timed.  No assertion depends on which side is faster."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(96, 384), torch.nn.GELU(), torch.nn.Linear(384, 96)).cuda().half().eval()
    x = torch.randn(16, 784, 96, device="cuda", dtype=torch.float16)
    q = tp.quantize_model(m, tp.QuantConfig(precision, first_last=None, speed_rule=SpeedRule(batch=64)),
                          calibration=x, warn=False)
    sp = q.tcprec_summary.speed
    timed = {t.name: t for t in sp.layers}
    # fc1 is timed with its GELU either as a pass after it (.gelu) or, where the converter chains fc1 -> GELU -> fc2
    # (int8 on the wgmma-gemm route, sm_90), in its epilogue (form[0] == "gelu"); fc2 without one either way
    chained = timed["0"].form[:1] == ("gelu",)
    assert timed["0"].gelu != chained and not timed["2"].gelu and timed["2"].form[:1] != ("gelu",)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    want = "with the GELU in the GEMM's epilogue on both sides" if chained else "with the GELU after it"
    assert want in recs["0"].reason and "GELU" not in recs["2"].reason
    for t in sp.layers:
        assert t.floated == ((t.quant_ms > t.float_ms and not t.by_chain) or bool(t.by_model))
        assert t.quant_ms > 0 and t.float_ms > 0
    if recs["0"].precision == "float" and not sp.model_itself:
        assert type(q.get_submodule("0")).__name__ == "LinearGELU"
    with torch.no_grad():
        assert _nrmse(q(x), m(x)) < 0.1


def test_chain_check_on_the_bench_encoder_with_a_chain_head_slower_alone():
    """The bench's pre-norm GELU encoder (2 layers, batch 16) on the wgmma-gemm route (int8, sm_90): a clock that
    runs every side on the GPU but reports each chained linear1 slower than its float LinearGELU floats them in the
    rounds; the chain check then times the real model as decided against the chained one (the real CUDA-graph clock
    for both) and its record agrees with what was converted: heads quantized again carry its reason and their chain,
    heads left float keep their own.  No assertion depends on which side is faster."""
    from tcprec.bench.transformer import build_encoder
    from tcprec.nn.qmodules import QLinear

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the chained linear1 (GELU + codes in its epilogue) is the wgmma-gemm route's, sm_90 only")
    enc = build_encoder(768, 12, layers=2, device="cuda").half()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 197, 768, device="cuda", generator=g).half()
    heads = [f"layers.{i}.linear1" for i in (0, 1)]

    def clock(layer, side, fn):
        ms = cuda_graph_timer(layer, side, fn)
        return ms * 10 if side == "quantized" and layer in heads else ms

    q = tp.quantize_model(enc, tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=clock)),
                          calibration=x[:8], warn=False)
    sp = q.tcprec_summary.speed
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert sp.chain_check is not None
    names, ms_float, ms_quant, won = sp.chain_check
    assert set(names) == set(heads) and ms_float > 0 and ms_quant > 0
    for n in heads:
        lin1 = q.get_submodule(n)
        if won and not any(t.by_model for t in sp.layers if t.name == n):
            assert isinstance(lin1, QLinear) and lin1.act == "gelu" and lin1.out_layout == "int8"
            assert "but kept w8a8: the whole model ran faster" in recs[n].reason
        elif not won:
            assert recs[n].precision == "float" and recs[n].reason.startswith("kept fp16: w8a8 ")
    with torch.no_grad():
        assert _nrmse(q(x), copy.deepcopy(enc).float()(x.float())) < 0.05
