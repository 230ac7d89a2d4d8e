"""The speed rule times each distinct layer signature once (nn/speed_rule.py: _module_signature, _describe;
docs/decisions/0159): identical layers share one timing per side and round, layers that differ in anything their
kernels see are timed apart, and each layer keeps its own decision and reason.  Fake clock, CPU; no timing asserted."""

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.nn.speed_rule import MODEL, SpeedRule, _describe, _module_signature
from tcprec.qtensor import BitPlanes, PerTensor, QTensor

X = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def _block(variant=None):
    """conv 8 -> 8 3x3 + BN + ReLU; ``variant`` changes one thing the kernels see."""
    kw = {"kernel_size": 3, "padding": 1}
    if variant == "kernel":
        kw = {"kernel_size": 5, "padding": 2}
    elif variant == "dilation":
        kw = {"kernel_size": 3, "padding": 2, "dilation": 2}
    elif variant == "groups":
        kw["groups"] = 2
    elif variant == "bias":
        kw["bias"] = False
    act = nn.ReLU6() if variant == "act" else nn.ReLU()
    bn = nn.Identity() if variant == "no bn" else nn.BatchNorm2d(8)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(8, 8, **kw), bn=bn, act=act))


def _net(variant=None):
    """stem, blocks a and b (twins), block c (a's twin unless ``variant``), pooled head."""
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(
        stem=nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 8, 3, padding=1), bn=nn.BatchNorm2d(8), act=nn.ReLU())),
        a=_block(), b=_block(), c=_block(variant),
        pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), head=nn.Linear(8, 10)))
    with torch.no_grad():  # (BN statistics that differ between the blocks: values, which no kernel sees)
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


class Clock:
    """ms by layer name and side (default 1.0; the whole model 10% faster quantized: no fallback); every call kept."""

    def __init__(self, table=None):
        self.table, self.calls = table or {}, []

    def __call__(self, layer, side, fn):
        fn()
        self.calls.append((layer, side))
        if layer == MODEL:
            return 0.9 if side == "quantized" else 1.0
        return self.table.get((layer, side), 1.0)


def _quantize(model, clock, **kw):
    cfg = tp.QuantConfig("int8", first_last=None, speed_rule=SpeedRule(timer=clock), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tp.quantize_model(model, cfg, calibration=X, warn=False)


def _layer_calls(clock, side=None):
    return [(n, s) for n, s in clock.calls if n != MODEL and (side is None or s == side)]


def test_identical_blocks_are_timed_once_per_signature_and_round():
    # round 1: stem, a (b and c are a's twins: a's times), head, each side once; "stem" is slower quantized, so a
    # second round times the quantized side again, once per signature: a (for b and c) and head; the float side not
    clock = Clock({("stem.conv", "quantized"): 2.0})
    q = _quantize(_net(), clock)
    sp = q.tcprec_summary.speed
    assert sp.conversions == 2 and sp.floated == ["stem.conv"]
    assert _layer_calls(clock, "float") == [("stem.conv", "float"), ("a.conv", "float"), ("head", "float")]
    assert _layer_calls(clock, "quantized") == [("stem.conv", "quantized"), ("a.conv", "quantized"),
                                                ("head", "quantized"),  # round 1
                                                ("a.conv", "quantized"), ("head", "quantized")]  # round 2
    # each layer still has its own timing, saying whose times it took
    by = {t.name: t for t in sp.layers}
    assert sorted(by) == ["a.conv", "b.conv", "c.conv", "head", "stem.conv"]
    assert [(by[n].quant_from, by[n].float_from, by[n].round) for n in ("a.conv", "b.conv", "c.conv")] == [
        ("", "", 2), ("a.conv", "a.conv", 2), ("a.conv", "a.conv", 2)]
    assert by["b.conv"].quant_ms == by["a.conv"].quant_ms and by["b.conv"].float_ms == by["a.conv"].float_ms


def test_twins_are_decided_alike_and_each_named_with_its_reason():
    clock = Clock({("a.conv", "quantized"): 2.0})  # a slower quantized: so are its twins, by the same timing
    q = _quantize(_net(), clock)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    sp = q.tcprec_summary.speed
    assert sp.floated == ["a.conv", "b.conv", "c.conv"]
    assert sp.overrides() == dict.fromkeys(["a.conv", "b.conv", "c.conv"], "float")
    assert recs["a.conv"].reason == "kept fp32: w8a8 2.000 ms > fp32 1.000 ms at input (4,8,6,6)"
    for n in ("b.conv", "c.conv"):
        want = "kept fp32: w8a8 2.000 ms > fp32 1.000 ms at input (4,8,6,6); the times of a.conv, an identical layer"
        assert recs[n].precision == "float" and recs[n].reason == want and recs[n].backend == want
        assert want in q.tcprec_summary.explain(n)
    assert recs["stem.conv"].reason == "w8a8 1.000 ms <= fp32 1.000 ms at input (4,3,6,6)"
    text = "\n".join(sp.lines())
    assert "3 of 5 timed layer(s) kept fp32" in text
    assert "2 of the 5 timed layer(s) took a time from an identical layer" in text


# which sides of block c are timed by themselves when it differs from a in one thing
@pytest.mark.parametrize("variant, timed", [
    ("kernel", {"quantized", "float"}),  # weight shape
    ("dilation", {"quantized", "float"}),  # geometry, same output shape
    ("groups", {"quantized", "float"}),  # another kernel (the grouped one)
    ("act", {"quantized", "float"}),  # ReLU6 in the epilogue / after the float conv
    ("no bn", {"quantized", "float"}),  # no BN scale in the epilogue (a None buffer) / no BN pass in float
    ("bias", {"float"}),  # the float conv without a bias; quantized, BN folds one in either way: a's kernels
])
def test_a_layer_that_differs_in_one_thing_is_timed_apart(variant, timed):
    clock = Clock()
    q = _quantize(_net(variant), clock)
    assert {s for n, s in _layer_calls(clock) if n == "c.conv"} == timed
    assert ("b.conv", "quantized") not in clock.calls and ("b.conv", "float") not in clock.calls  # (the twin)
    c = {t.name: t for t in q.tcprec_summary.speed.layers}["c.conv"]
    assert c.quant_from == ("" if "quantized" in timed else "a.conv")
    assert c.float_from == ("" if "float" in timed else "a.conv")


def test_another_precision_shares_only_the_float_side():
    clock = Clock()
    q = _quantize(_net(), clock, overrides={"c.conv": "w4a8"})
    assert {s for n, s in _layer_calls(clock) if n == "c.conv"} == {"quantized"}
    c = {t.name: t for t in q.tcprec_summary.speed.layers}["c.conv"]
    assert (c.precision, c.quant_from, c.float_from) == ("w4a8", "", "a.conv")
    assert c.text("fp32").endswith("; the fp32 time of a.conv, an identical layer")


def test_the_signature_holds_every_attribute_and_buffer_but_the_layer_names():
    q = _quantize(_net(), Clock())
    a, b = q.get_submodule("a.conv"), q.get_submodule("b.conv")
    assert a.layer_plan.name != b.layer_plan.name and _module_signature(a) == _module_signature(b)
    base = _module_signature(a)
    for k in (k for k in vars(a) if not k.startswith("_")):  # any public attribute changed: another signature
        old = getattr(a, k)
        setattr(a, k, ("changed", old))
        try:
            assert _module_signature(a) != base, k
        finally:
            setattr(a, k, old)
    for k, buf in list(a._buffers.items()):  # a buffer's shape, dtype or presence
        others = (torch.ones(1),) if buf is None else (None, buf.double(), torch.zeros(buf.numel() + 1))
        for other in others:
            a._buffers[k] = other
            try:
                assert _module_signature(a) != base, k
            finally:
                a._buffers[k] = buf
    a.tcprec_fused = ("x.q_proj", "x.k_proj", "x.v_proj")  # a fused module's member names: their count only
    b.tcprec_fused = ("y.q_proj", "y.k_proj", "y.v_proj")
    assert _module_signature(a) == _module_signature(b)


def test_operands_are_described_by_what_a_kernel_sees():
    x = torch.randn(2, 8, 4, 4)
    assert _describe(x) == _describe(torch.randn(2, 8, 4, 4))  # values: no
    assert _describe(x) != _describe(x.contiguous(memory_format=torch.channels_last))  # strides
    assert _describe(x) != _describe(x.half()) and _describe(x) != _describe(x[:1])
    assert _describe(x) != _describe(torch.randn(2 * 8 * 4 * 4 + 1)[1:].view(2, 8, 4, 4))  # alignment
    planes = tp.quantize(torch.randn(4, 64), "int2", PerTensor(), layout=BitPlanes())
    compact = tp.quantize(torch.randn(4, 64), "int2", PerTensor(), layout=BitPlanes(compact=True))
    assert isinstance(planes, QTensor) and _describe(planes) != _describe(compact)
    assert _describe(planes) == _describe(tp.quantize(torch.randn(4, 64), "int2", PerTensor(), layout=BitPlanes()))


def test_chained_twins_share_and_an_output_of_another_kind_does_not():
    """On the INT8 kernels (interpreter) the blocks chain int8 codes: a and b read codes and write codes (twins), c
    reads codes and writes the float the pool reads: its quantized side is timed by itself, its float side is a's."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    clock = Clock()
    q = _quantize(_net(), clock, backend="int8")
    outs = {r.name: r.out for r in q.tcprec_summary.layers}
    assert outs["a.conv"] == "int8 codes uint8 -> b.conv" and outs["b.conv"] == "int8 codes uint8 -> c.conv"
    assert outs["c.conv"] == "float32"
    assert _layer_calls(clock, "quantized") == [(n, "quantized") for n in ("stem.conv", "a.conv", "c.conv", "head")]
    by = {t.name: t for t in q.tcprec_summary.speed.layers}
    assert (by["b.conv"].quant_from, by["b.conv"].float_from) == ("a.conv", "a.conv")
    assert (by["c.conv"].quant_from, by["c.conv"].float_from) == ("", "a.conv")
