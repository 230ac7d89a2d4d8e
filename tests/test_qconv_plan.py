"""The quantized convolution's plan (ops/qconv_plan.py): one pure planner decides backend, route, stem, epilogue and
the pass after it from the operands' specs and a DeviceCaps record, so the decisions for GPUs can be checked here
without one; conv2d runs the plan, explain_conv2d prints it; quantized layers re-plan on a device move."""

import dataclasses

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.formats import as_format
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import qconv
from tcprec.ops.qconv_plan import ConvPlan, DeviceCaps, format_plan, plan_conv2d

CAPS = {
    "cpu": DeviceCaps(torch.device("cpu")),
    "interp": DeviceCaps(torch.device("cpu"), interpreting=True),  # TRITON_INTERPRET=1
    "h100": DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132),
    "a100": DeviceCaps(torch.device("cuda", 0), False, (8, 0), True, (True, "sm_80 has native BMMA AND.POPC"), 108),
    "t4": DeviceCaps(torch.device("cuda", 0), False, (7, 5), True,
                     (False, "b1 mma AND+popc needs sm_80 or newer, this GPU is sm_75"), 40),
}
PRECS = {"int8": ("int8", "int8"), "u8xu8": ("uint8", "uint8"), "w1a1": ("binary", "binary"),
         "w1a2": ("uint2", "binary"), "w2a2": ("uint2", "int2"), "w4a4": ("uint4", "int4"), "fp8": ("e4m3", "e4m3")}
GEOMS = {  # C, H, W, K, R, S, stride, padding, dilation
    "stem3x3": (3, 32, 32, 64, 3, 3, 1, 1, 1), "stem7x7s2": (3, 56, 56, 64, 7, 7, 2, 3, 1),
    "pw": (64, 14, 14, 128, 1, 1, 1, 0, 1), "s2": (64, 16, 16, 128, 3, 3, 2, 1, 1), "c256": (256, 8, 8, 256, 3, 3, 1, 1, 1)}
OUTS = {"f32": {}, "f16": {"out_dtype": torch.float16}, "i32": {"out_dtype": torch.int32},
        "planes": {"out_fmt": "uint2"}, "compact": {"out_fmt": "uint2", "out_layout": "compact"},
        "int8": {"out_fmt": "uint8", "out_layout": "int8"},
        "int8+f": {"out_fmt": "uint8", "out_layout": "int8+float", "out_dtype": torch.float16},
        "fp8": {"out_fmt": "e4m3"}, "pl+f": {"out_fmt": "uint2", "out_layout": "planes+float", "out_dtype": torch.float16}}
POOLS = {"-": None, "max22": ("max", 2, 2), "avg22": ("avg", 2, 2)}

# (precision, geometry, batch, output, pool, device) -> (backend, route, stem, epilogue, after, finish).  The same
# decisions as the planner before the ConvPlan refactor: its explain text was recorded for 32256 such cases with faked
# CUDA devices and is unchanged (docs/decisions/0018).  Every act is ReLU (none for int32 output).
TABLE = {
    ("w1a2", "c256", 8, "f16", "-", "h100"): ("bitserial", "implicit", "", "float16", "", ""),
    ("w1a2", "c256", 256, "f16", "-", "h100"): ("bitserial", "implicit", "", "float16", "", ""),
    ("w1a2", "s2", 8, "compact", "-", "h100"): ("bitserial", "implicit", "", "packed", "", ""),
    ("w1a2", "s2", 8, "compact", "max22", "h100"): ("bitserial", "implicit", "", "packed", "pool_planes", ""),
    ("w1a2", "pw", 8, "planes", "-", "h100"): ("bitserial", "pointwise", "", "packed", "", ""),
    ("w1a2", "c256", 8, "f16", "max22", "h100"): ("bitserial", "implicit", "", "float16", "pool_float", ""),
    ("w1a2", "c256", 8, "f32", "avg22", "h100"): ("bitserial", "implicit", "", "float32", "finish", "torch"),
    ("w1a2", "c256", 8, "int8", "-", "h100"): ("bitserial", "implicit", "", "float32", "finish", "pack"),
    ("w1a2", "c256", 8, "pl+f", "-", "h100"): ("bitserial", "implicit", "", "float16", "", ""),
    ("w1a2", "c256", 8, "i32", "-", "h100"): ("bitserial", "implicit", "", "int32", "", ""),
    ("w1a1", "pw", 8, "f32", "-", "a100"): ("bitserial", "pointwise", "", "float32", "", ""),
    ("w2a2", "s2", 8, "planes", "-", "t4"): ("int8", "kernel", "", "planes", "", ""),  # no BMMA before sm_80
    ("w2a2", "s2", 8, "planes", "-", "cpu"): ("reference", "", "", "float32", "finish", "torch"),
    ("w2a2", "s2", 8, "planes", "-", "interp"): ("reference", "", "", "float32", "finish", "torch"),
    ("w4a4", "c256", 8, "f16", "-", "h100"): ("int8", "kernel", "", "float16", "", ""),  # p*q = 16 >= 8
    ("int8", "stem3x3", 8, "planes", "max22", "h100"): ("int8", "kernel", "cuda", "planes", "", ""),
    ("int8", "stem3x3", 8, "planes", "max22", "a100"): ("int8", "kernel", "gather", "planes", "", ""),
    ("int8", "stem7x7s2", 8, "pl+f", "-", "h100"): ("int8", "kernel", "cuda", "float16", "", ""),
    ("int8", "stem7x7s2", 8, "f16", "-", "h100"): ("int8", "kernel", "cuda", "float16", "", ""),
    ("int8", "stem3x3", 8, "int8", "-", "h100"): ("int8", "kernel", "gather", "int8", "", ""),
    ("int8", "c256", 8, "int8+f", "-", "h100"): ("int8", "kernel", "", "dual", "", ""),
    ("int8", "c256", 8, "fp8", "-", "h100"): ("int8", "kernel", "", "e4m3", "", ""),
    ("int8", "c256", 8, "fp8", "avg22", "h100"): ("int8", "kernel", "", "float32", "finish", "torch"),
    ("int8", "c256", 8, "planes", "avg22", "h100"): ("int8", "kernel", "", "float32", "finish", "torch"),
    ("int8", "c256", 8, "f16", "max22", "h100"): ("int8", "kernel", "", "float16", "pool_float", ""),
    ("int8", "c256", 8, "f32", "-", "cpu"): ("reference", "", "", "float32", "finish", "torch"),
    ("int8", "c256", 8, "int8", "-", "interp"): ("reference", "", "", "float32", "finish", "torch"),
    ("u8xu8", "c256", 8, "f32", "-", "h100"): ("int8", "im2col", "", "float32", "finish", "torch"),  # shifted w
    ("fp8", "c256", 8, "f16", "-", "h100"): ("fp8", "kernel", "", "float16", "", ""),
    ("fp8", "stem3x3", 8, "fp8", "-", "h100"): ("fp8", "kernel", "gather", "e4m3", "", ""),
    ("fp8", "c256", 8, "fp8", "max22", "h100"): ("fp8", "kernel", "", "float32", "finish", "fp8"),
    ("fp8", "c256", 8, "f32", "-", "cpu"): ("reference", "", "", "float32", "finish", "torch"),
    ("fp8", "c256", 8, "int8", "-", "h100"): ("fp8", "kernel", "", "int8", "", ""),
}


def _plan(prec, geom, N, out, pool, dev, backend="auto", x="codes") -> ConvPlan:
    C, H, W, K, R, S, st, pd, dl = GEOMS[geom]
    g = ConvGeometry(N, H, W, C, K, R, S, (st, st), (pd, pd), (dl, dl))
    fa, fw = (as_format(f) for f in PRECS[prec])
    kw = dict(OUTS[out])
    act = None if kw.get("out_dtype") == torch.int32 else "relu"
    return plan_conv2d(g, fa, fw, device=CAPS[dev], input_layout=x, act=act, pool=POOLS[pool],
                       out_scale_given="out_fmt" in kw, backend=backend, **kw)


@pytest.mark.parametrize("case", list(TABLE), ids=["/".join(map(str, c)) for c in TABLE])
def test_plan_decisions(case):
    p = _plan(*case)
    assert (p.backend, p.route, p.stem, p.epilogue, p.after, p.finish) == TABLE[case]
    assert p.passes and p.reason  # explain has something to say
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.backend = "reference"


def test_explain_formats_the_plan_it_runs():
    """explain_conv2d is format_plan of the plan conv2d runs; run(plan) is conv2d."""
    gen = torch.Generator().manual_seed(0)
    qx = tp.quantize(torch.rand(2, 6, 5, 3, generator=gen), "uint2")
    qw = tp.quantize(torch.randn(4, 3, 3, 3, generator=gen), "binary", tp.PerChannel(0))
    kw = dict(padding=1, act="relu", out_fmt="uint2", out_scale=0.5)
    plan = qconv.conv2d_plan(qx, qw, **kw)
    assert qconv.explain_conv2d(qx, qw, **kw) == format_plan(plan) == plan.explain()
    assert plan.backend == "reference" and plan.input_layout == "codes"
    want = qconv.conv2d(qx, qw, **kw)
    got = qconv.run(plan, qx, qw, out_scale=0.5)
    assert torch.equal(got.data, want.data) and got.shape == want.shape


def test_run_refuses_operands_of_another_spec():
    gen = torch.Generator().manual_seed(1)
    qx = tp.quantize(torch.rand(2, 6, 5, 3, generator=gen), "uint2")
    qw = tp.quantize(torch.randn(4, 3, 3, 3, generator=gen), "binary", tp.PerChannel(0))
    plan = qconv.conv2d_plan(qx, qw, padding=1)
    other = tp.quantize(torch.rand(1, 6, 5, 3, generator=gen), "uint2")  # another batch size
    with pytest.raises(ValueError, match=r"the plan was made for x uint2 \(2, 6, 5, 3\)"):
        qconv.run(plan, other, qw)
    with pytest.raises(ValueError, match="out_fmt=None"):
        qconv.run(plan, qx, qw, out_scale=0.5)
    with pytest.raises(TypeError, match="plan must be a ConvPlan"):
        qconv.run("reference", qx, qw)


def test_input_layout_is_part_of_the_plan():
    """The layout x arrives in is a spec field: explain's INT8 shift step says whether it was given as int8."""
    a = _plan("int8", "c256", 8, "f32", "-", "h100", x="codes")
    b = _plan("int8", "c256", 8, "f32", "-", "h100", x="int8")
    assert a.route == b.route == "kernel" and a.input_layout != b.input_layout


def _chained_net(monkeypatch):
    from tcprec.nn import convert

    monkeypatch.setattr(convert, "device_caps", lambda dev: CAPS["h100"])  # convert as on an H100
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1)).eval()
    x = torch.randn(2, 3, 8, 8)
    return tp.quantize_model(net, "w1a2", calibration=x, warn=False), x


def test_layer_plans_record_the_chain(monkeypatch):
    q, _ = _chained_net(monkeypatch)
    mods = dict(q.named_modules())
    assert mods["0"].layer_plan.backend == "int8" and mods["0"].layer_plan.name == "0"  # first / last: int8
    assert mods["0"].out_layout == "compact"  # bit planes for the next (bit-serial, 3x3) conv
    assert mods["2"].layer_plan.chain_in == "compact" and mods["2"].layer_plan.chain_kind == "bitserial"
    assert mods["4"].layer_plan.chain_in == "int8" and mods["4"].layer_plan.chain_kind == "int8"
    assert mods["0"].layer_plan.chain_in is None  # float input


def test_device_move_that_breaks_a_chain_is_refused(monkeypatch):
    """Planes chained for the binary kernel cannot feed an INT8 kernel as they are (a GPU without BMMA): the re-plan
    says which layer, which backends, and the fix; a move to the reference backend (which reads every layout) is
    fine, and re-plans the layer."""
    q, x = _chained_net(monkeypatch)
    m = dict(q.named_modules())["2"]
    with pytest.raises(ValueError, match=r"2: quantize_model chained this layer's input as 'compact' codes for the "
                                         r"bitserial backend on cuda:0; on cuda:0 the layer runs int8 .*"
                                         r"Convert on the device the model runs on"):
        m.plan_on(torch.device("cuda", 0), caps=CAPS["t4"])
    assert m.layer_plan.backend == "bitserial"  # a refused re-plan keeps the plan
    y = q.to("cpu")(x)  # the model lives on the CPU: .to re-plans every layer for it
    assert m.layer_plan.device == torch.device("cpu") and m.layer_plan.backend == "reference"
    assert m.layer_plan.chain_in == "compact" and torch.isfinite(y).all()
