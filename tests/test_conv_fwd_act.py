"""The INT8 / FP8 conv epilogue's clamp (ReLU6, hardtanh), hardswish and SiLU -- a compiled variant (ACT_EXT) of
kernels/triton/conv_fwd.py -- through TRITON_INTERPRET=1 against kernels/reference_conv_int8_fp8.apply_act: float,
int8-code, float8-code and dual outputs, with and without a residual, on the int8 and the fp8 kernels, bit for bit
(SiLU within the bound of its exp, below); the pooled bit-planes epilogue (monotone activations only); the op level
(ops.qconv.conv2d: the INT8 kernel, its gathered thin stem, the im2col route, FP8, the reference backend, the
bit-serial refusal, the plan's stem and pool choices); bad input.  That the other variants compile to the code they
compiled to before: tests/test_conv_fwd.py::test_kernels_compile_to_wgmma_for_sm90 (no exp, no float32 division).
tests/gpu/test_conv_fwd_gpu.py repeats the kernel checks on the GPU."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels import reference_conv_int8_fp8 as rf
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import qconv
from tcprec.ops.qconv import conv2d, explain_conv2d, pack_conv_weight
from tcprec.qtensor import BitPlanes, PerChannel, PerTensor, QTensor, ShiftedInt8

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

ACTS = [("clamp", 0.0, 6.0), ("clamp", -1.0, 0.75), "hardswish", "silu"]
ACT_IDS = ["relu6", "hardtanh", "hardswish", "silu"]
# SiLU's exp is the one operation two libraries do not round alike: the interpreter runs NumPy's float32 exp (its SIMD
# routine, at most 2.52 ulp by NumPy's release notes; 2 measured against float64), apply_act torch's (SLEEF, < 1 ulp):
# the two differ relatively by < 3.6 * 2^-23.  1 + exp(-y) carries at most that (times e / (1 + e) <= 1) plus one
# rounding on either side, the division one more on either side: < 5.6 * 2^-23 (4 ulp measured on 4e6 values).  Every
# other operation is IEEE float32 in both, in the same order, so clamp and hardswish are bit for bit.
SILU_RTOL = 6 * 2.0**-23

TAP = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "FLAT": False, "num_warps": 4, "num_stages": 1}
# (N, H, W, C, K, R, S, stride, padding, dilation), config: a padded 3x3 on C = 5 (flat reduction; M = 126, K = 12:
# partial tiles both ways), and C = 64 in per-tap mode
GEOS = [((2, 7, 9, 5, 12, 3, 3, 1, 1, 1), None), ((1, 6, 7, 64, 20, 3, 3, 1, 1, 1), TAP)]


def _geo(spec):
    N, H, W, C, K, R, S, st, pd, dl = spec
    return (N, H, W, C), (K, R, S, C), dict(stride=st, padding=pd, dilation=dl)


def _int8(spec, seed):
    xs, ws, geo = _geo(spec)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, xs, generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, ws, generator=gen, dtype=torch.int8)
    return x, w, geo


def _fp8(spec, seed):
    xs, ws, geo = _geo(spec)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(xs, generator=gen) * 4).to(torch.float8_e4m3fn), torch.randn(ws, generator=gen).to(
        torch.float8_e4m3fn), geo


def _close(got: torch.Tensor, want: torch.Tensor, act, what: str = ""):
    """Bit for bit; for SiLU, float32 within SILU_RTOL (about a fifth differ in the last bits), and a lower precision
    within one step of its format, int8 codes within one code (the float32 values can straddle a rounding boundary),
    nearly all equal."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if act != "silu":
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} differ"
        return
    if want.dtype == torch.int8:
        assert (got.int() - want.int()).abs().max() <= 1, what
    elif want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        g, r = got.float(), want.float()
        assert ((g - r).abs() <= 2.0**-2 * r.abs() + 2.0**-9).all(), what  # one e4m3 step (subnormals: 2^-9)
    else:
        g, r = got.double(), want.double()
        rtol = SILU_RTOL if want.dtype == torch.float32 else torch.finfo(want.dtype).eps
        assert ((g - r).abs() <= rtol * r.abs() + 2.0**-126).all(), f"{what}: {float(((g - r) / r).abs().max())}"
    if want.dtype != torch.float32:
        assert (got == want).float().mean() > 0.95, what


def _scales(acc: torch.Tensor, gen):
    """Per-channel scales that put the pre-activation near N(0, 3^2) (the interesting part of each activation) and a
    bias of N(0, 1)."""
    K = acc.shape[-1]
    scale = 3.0 / acc.double().std().item() * (torch.rand(K, generator=gen) + 0.5)
    return scale.float(), torch.randn(K, generator=gen)


# ------------------------------------------------------------------------------------------------
# The reference itself
# ------------------------------------------------------------------------------------------------


def test_apply_act_is_the_torch_activation():
    """clamp is F.hardtanh bit for bit; hardswish's product with float32(1/6) is F.hardswish's division to 2 ulp;
    SiLU is F.silu to 2 ulp (torch's own exp routines differ); NaN: clamp -> lo (as ReLU maps NaN to 0)."""
    y = torch.cat([torch.linspace(-10, 10, 200_001), torch.randn(100_000) * 4, torch.tensor([-3.0, 3.0, -0.0, 0.0])])

    def ulps(a, b):
        return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()

    assert torch.equal(rf.apply_act(y, ("clamp", -1.0, 0.75)), F.hardtanh(y, -1.0, 0.75))
    assert torch.equal(rf.apply_act(y, ("clamp", 0, 6)), F.relu6(y))
    assert ulps(rf.apply_act(y, "hardswish"), F.hardswish(y)) <= 2
    assert ulps(rf.apply_act(y, "silu"), F.silu(y)) <= 2
    nan = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert rf.apply_act(nan, ("clamp", 0.0, 6.0)).tolist() == [0.0, 6.0, 0.0]
    h = rf.apply_act(nan, "hardswish")
    assert torch.isnan(h[0]) and h[1] == float("inf") and torch.isnan(h[2])  # -inf * 0
    assert rf.HARDSWISH_SIXTH == float(torch.tensor(1 / 6, dtype=torch.float32))


def test_parse_act_and_monotone():
    assert rf.parse_act(("clamp", 0, 6)) == (rf.ACT_CLAMP, 0.0, 6.0)
    assert rf.parse_act(["clamp", -1.0, 1.0]) == (rf.ACT_CLAMP, -1.0, 1.0)
    assert rf.parse_act("hardswish") == (rf.ACT_HARDSWISH, 0.0, 0.0) and rf.parse_act("silu")[0] == rf.ACT_SILU
    assert rf.parse_act(("leaky", 0.1)) == (rf.ACT_LEAKY, float(torch.tensor(0.1)), 0.0)  # float32, as the kernel
    assert rf.parse_act(None) == (rf.ACT_NONE, 0.0, 0.0) and rf.parse_act("relu") == (rf.ACT_RELU, 0.0, 0.0)
    from tcprec.kernels.triton.conv_grouped import ACT_CODES

    assert (ACT_CODES["clamp"], ACT_CODES["hardswish"], ACT_CODES["silu"]) == (rf.ACT_CLAMP, rf.ACT_HARDSWISH,
                                                                                rf.ACT_SILU)  # one encoding
    monotone = {None: True, "relu": True, ("leaky", 0.1): True, ("leaky", 0.0): True, ("leaky", -0.2): False,
                ("clamp", 0.0, 6.0): True, ("clamp", -1.0, 1.0): True, "hardswish": False, "silu": False}
    assert {a: rf.act_monotone(a) for a in monotone} == monotone
    # and the claim itself: hardswish and SiLU go down somewhere
    y = torch.linspace(-4, 0, 4001)
    for act in ("hardswish", "silu"):
        assert (rf.apply_act(y, act).diff() < 0).any()


@pytest.mark.parametrize("act, match", [
    (("clamp", 6.0, 0.0), r"\('clamp', lo, hi\) needs finite float32 numbers lo < hi .*got lo=6.0, hi=0.0"),
    (("clamp", 1.0, 1.0), "lo < hi"),
    (("clamp", 0.0, float("inf")), "finite float32"),
    (("clamp", float("nan"), 1.0), "finite float32"),
    (("clamp", 0.0, 1e39), "finite float32"),  # finite in float64, not in float32
    (("clamp", True, 6.0), "finite float32"),
    (("clamp", "0", 6.0), "finite float32"),
    (("clamp", 0.0), r"act must be None, 'relu', 'leaky', \('leaky', slope\), \('clamp', lo, hi\) \(ReLU6: "),
    ("relu6", r"\(ReLU6: \('clamp', 0.0, 6.0\)\), 'hardswish' or 'silu', got 'relu6'"),
    ("swish", "act must be None"),
    (("hardswish", 1.0), "act must be None"),
])
def test_bad_act(act, match):
    """The kernel, its reference and the op name the bad value, the accepted forms and ReLU6's spelling."""
    x, w = torch.zeros(1, 5, 5, 8, dtype=torch.int8), torch.zeros(4, 3, 3, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=match):
        cf.conv2d_fwd_int8(x, w, act=act)
    with pytest.raises(ValueError, match=match):
        rf.conv2d_fwd_int8(x, w, act=act)
    with pytest.raises(ValueError, match="lo < hi" if isinstance(act, tuple) and len(act) == 3 else "act must be"):
        qx = tp.quantize(torch.rand(1, 5, 5, 8), "int8")
        conv2d(qx, tp.quantize(torch.randn(4, 3, 3, 8), "int8"), act=act)


# ------------------------------------------------------------------------------------------------
# The kernels against the reference
# ------------------------------------------------------------------------------------------------


def _outputs(y_max: float):
    """(out, out_int8) pairs: float32, float16, int8 codes, float8 codes, and the two dual outputs."""
    s8 = torch.tensor([y_max / 100])  # the top few percent saturate
    s_f8 = y_max / 300.0
    return [("float32", None), ("float16", None), (("int8", s8), None), (("e4m3", s_f8), None),
            ("float16", ("int8", s8, (-128, 127, 0))), ("float16", ("e4m3", s_f8))]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("geo_cfg", GEOS, ids=["3x3-flat", "C64-tap"])
def test_int8_kernel_equals_reference(geo_cfg, act, residual):
    spec, config = geo_cfg
    x, w, geo = _int8(spec, seed=71)
    gen = torch.Generator().manual_seed(72)
    scale, bias = _scales(rf.conv2d_fwd_int8(x, w, **geo, out="int32"), gen)
    y0 = rf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, out="float32")
    res = (torch.randn(y0.shape, generator=gen) * 3).half() if residual else None
    kw = dict(**geo, scale=scale, bias=bias, act=act, residual=res)
    for out, out8 in _outputs(float(y0.abs().max())):
        got = cf.conv2d_fwd_int8(x, w, **kw, out=out, out_int8=out8, config=config)
        want = rf.conv2d_fwd_int8(x, w, **kw, out=out, out_int8=out8)
        for g, r in zip(*((got, want) if out8 is not None else ((got,), (want,)))):
            _close(g, r, act, f"out={out}, out_int8={out8}")
    # the activation is applied: the float32 result differs from the conv without it, and lies in the clamp's range
    y = cf.conv2d_fwd_int8(x, w, **kw, out="float32", config=config)
    assert not torch.equal(y, cf.conv2d_fwd_int8(x, w, **dict(kw, act=None), out="float32", config=config))
    if act[0] == "clamp":
        assert float(y.min()) == act[1] and float(y.max()) == act[2]  # both bounds reached


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
def test_fp8_kernel_equals_reference_on_its_accumulator(act, residual):
    """The FP8 kernel shares the epilogue.  Its float32 accumulator differs from the exact sum by rounding, so the
    reference's epilogue runs on the kernel's own accumulator (out="float32" with unit scales and no bias: exactly the
    accumulator), with the same tile (the same summation order); per-tensor x and per-channel w scales."""
    spec, config = GEOS[0]
    x, w, geo = _fp8(spec, seed=81)
    acc = cf.conv2d_fwd_fp8(x, w, 1.0, 1.0, **geo, out="float32", config=config)
    gen = torch.Generator().manual_seed(82)
    ws, bias = _scales(acc, gen)
    xs = torch.tensor([0.5])
    ref_kw = dict(alpha=1.0, sa=xs, sb=ws, bias=bias)
    y0 = rf.epilogue(acc, **ref_kw, out="float32")
    res = (torch.randn(y0.shape, generator=gen) * 3).half() if residual else None
    for out, out8 in _outputs(float(y0.abs().max())):
        got = cf.conv2d_fwd_fp8(x, w, xs, ws, **geo, bias=bias, act=act, residual=res, out=out, out_int8=out8,
                                config=config)
        want = rf.epilogue(acc, **ref_kw, act=act, out=out, residual=res, out_int8=out8)
        for g, r in zip(*((got, want) if out8 is not None else ((got,), (want,)))):
            _close(g, r, act, f"out={out}, out_int8={out8}")


def test_dual_codes_are_the_stored_float_codes():
    """SiLU too: the dual output's int8 codes are those of the float it stores, bit for bit (one epilogue, one
    value), whatever its exp rounded to."""
    x, w, geo = _int8(GEOS[0][0], seed=91)
    scale, bias = _scales(rf.conv2d_fwd_int8(x, w, **geo, out="int32"), torch.Generator().manual_seed(92))
    for act in ACTS:
        y, y8 = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act, out="float16",
                                   out_int8=("int8", 0.02, (-128, 127, 0)))
        assert torch.equal(y8, torch.round(torch.clamp(y.float() / 0.02, -128, 127)).to(torch.int8)), act


@pytest.mark.parametrize("act", [("clamp", 0.0, 6.0), ("clamp", -1.0, 0.75), "relu"], ids=["relu6", "hardtanh", "relu"])
def test_pooled_planes_with_clamp(act):
    """PlanesOut(pool=2) pools accumulators before the epilogue: right for a monotone activation (clamp), with
    columns of both signs (the window's min where the scale is negative) -- the planes equal torch's pool of the
    reference's float result, quantized."""
    from tcprec.formats import as_format
    from tcprec.ops.quantize import _qp_params, _static_codes
    from tcprec.packing import packed_words, unpack_bitplanes

    x, w, geo = _int8((2, 9, 10, 32, 40, 1, 1, 1, 0, 1), seed=93)
    gen = torch.Generator().manual_seed(94)
    scale, bias = _scales(rf.conv2d_fwd_int8(x, w, **geo, out="int32"), gen)
    scale = scale * (torch.randint(0, 2, scale.shape, generator=gen) * 2 - 1)
    f = as_format("int2" if act[0] == "clamp" and act[1] < 0 else "uint2")
    s = torch.tensor([0.25])
    got = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act,
                             out=cf.PlanesOut(s, f.bits, *_qp_params(f), pool=2))
    ref = rf.conv2d_fwd_int8(x, w, **geo, scale=scale, bias=bias, act=act, out="float32")
    ref = F.max_pool2d(ref.permute(0, 3, 1, 2), 2, 2).permute(0, 2, 3, 1)
    K = ref.shape[-1]
    codes = _static_codes(ref.reshape(-1, K), f, s)
    assert torch.equal(unpack_bitplanes(got, f.bits, K).to(torch.int64), codes)
    assert got.shape[-1] == packed_words(K) and len(torch.unique(codes)) >= 3


@pytest.mark.parametrize("act", ["hardswish", "silu", ("leaky", -0.5)], ids=["hardswish", "silu", "leaky-neg"])
def test_pooled_planes_refuse_an_activation_that_is_not_monotone(act):
    x, w = torch.zeros(1, 6, 6, 8, dtype=torch.int8), torch.zeros(4, 1, 1, 8, dtype=torch.int8)
    s = torch.ones(1)
    with pytest.raises(ValueError, match=r"PlanesOut\(pool=2\) pools the accumulators .*act must be None, 'relu', "
                                         r"\('leaky', slope >= 0\) or \('clamp', lo, hi\), got act=.*pool the float "
                                         r"output instead"):
        cf.conv2d_fwd_int8(x, w, act=act, out=cf.PlanesOut(s, 2, 0, 3, pool=2))
    assert cf.conv2d_fwd_int8(x, w, act=act, out=cf.PlanesOut(s, 2, 0, 3)).shape[0] == 2  # no pool: fine


def test_compile_key_names_the_compiled_activation():
    g = ConvGeometry(8, 14, 14, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1))
    cfg = cf.pick_config(g, fp8=False)
    base = cf.compile_key(g, cfg, False, "float16")
    assert cf.compile_key(g, cfg, False, "float16", act="relu") == base  # run-time codes: one variant
    assert cf.compile_key(g, cfg, False, "float16", act=("leaky", 0.1)) == base
    keys = {cf.compile_key(g, cfg, False, "float16", act=a) for a in ACTS}
    assert len(keys) == 3 and base not in keys  # the two clamps share one (run-time bounds)


# ------------------------------------------------------------------------------------------------
# ops.qconv.conv2d
# ------------------------------------------------------------------------------------------------


def _qt(shape, fmt, gen, granularity=None):
    fmt = tp.format(fmt)
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, generator=gen)
    g = granularity or PerTensor()
    scale = (torch.rand(g.scale_shape(shape), generator=gen) + 0.5).to(torch.float32)
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


# (x format, w format, N, H, W, C, K, R, stride, padding): a shifted uint8 input over a padded 3x3 (the border
# correction), a thin stem (C = 3: gathered rows, a 1x1 conv), int8 x int8 with C = 17, uint8 weights (the im2col route)
OP_CASES = [("uint8", "int8", 2, 6, 7, 24, 6, 3, 1, 1), ("uint8", "int8", 1, 9, 8, 3, 5, 3, 2, 1),
            ("int8", "int8", 1, 5, 6, 17, 4, 3, 1, 1), ("int8", "uint8", 1, 6, 5, 7, 5, 3, 1, 1)]


def _op_case(i, seed=0):
    fa, fw, N, H, W, C, K, R, st, pd = OP_CASES[i]
    gen = torch.Generator().manual_seed(seed + i)
    qx, qw = _qt((N, H, W, C), fa, gen), _qt((K, R, R, C), fw, gen, PerChannel(0))
    y = conv2d(qx, qw, backend="reference", stride=st, padding=pd)
    scale = (3.0 / y.std() * (torch.rand(K, generator=gen) + 0.5)).float()
    return qx, qw, dict(stride=st, padding=pd, scale=scale, bias=torch.randn(K, generator=gen))


@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("i", range(len(OP_CASES)), ids=["uint8-pad", "thin-stem", "int8-C17", "im2col"])
def test_op_int8_backend_equals_reference_backend(i, act):
    """backend="int8" (the Triton kernel, its gathered thin stem, or the im2col route's torch epilogue) equals the
    reference backend for the float, int8-code and dual outputs, with a residual too."""
    qx, qw, kw = _op_case(i, seed=100)
    pw = pack_conv_weight(qw)
    s = explain_conv2d(qx, pw, backend="int8", act=act, **kw)
    assert f"act={act}" in s and (("thin layer" in s) == (i == 1)) and (("_int_mm" in s) == (i == 3)), s
    y0 = conv2d(qx, qw, backend="reference", out_dtype=torch.float16, **kw)
    res = (torch.randn(y0.shape, generator=torch.Generator().manual_seed(101)) * 3).half()
    s_out = torch.tensor([float(y0.float().abs().max()) / 60])
    for extra in (dict(), dict(out_dtype=torch.float16), dict(out_dtype=torch.float16, residual=res),
                  dict(out_fmt="int8", out_scale=s_out, out_layout="int8"),
                  dict(out_fmt="int8", out_scale=s_out, out_layout="int8+float", out_dtype=torch.float16,
                       residual=res)):
        a = conv2d(qx, pw, backend="int8", act=act, **kw, **extra)
        b = conv2d(qx, qw, backend="reference", act=act, **kw, **extra)
        if isinstance(a, QTensor):
            assert isinstance(a.layout, ShiftedInt8)
            _close(a.data, b.data, act, str(extra))
            if a.hp is not None:
                _close(a.hp, b.hp, act, str(extra))
        else:
            _close(a, b, act, str(extra))


@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
def test_op_fp8_backend_applies_the_act_to_its_own_result(act):
    """The FP8 kernel's float32 result with the activation is apply_act of its result without it, bit for bit (the
    same accumulator; SiLU within its bound); the reference backend is the same activation of its exact sum."""
    gen = torch.Generator().manual_seed(110)
    x, w = torch.randn(2, 7, 9, 20, generator=gen) * 3, torch.randn(6, 3, 3, 20, generator=gen)
    qx, qw = qconv.quantize_fp8_static(x, torch.tensor([0.05])), tp.quantize(w, "e4m3", PerChannel(0))
    pw = pack_conv_weight(qw)
    kw = dict(stride=1, padding=1, bias=torch.randn(6, generator=gen))
    kw["scale"] = (3.0 / conv2d(qx, qw, backend="reference", **kw).std()).reshape(1).expand(6).contiguous()
    for backend, wt in (("fp8", pw), ("reference", qw)):
        y0 = conv2d(qx, wt, backend=backend, **kw)
        _close(conv2d(qx, wt, backend=backend, act=act, **kw), rf.apply_act(y0, act), act, backend)


def test_op_pool_after_an_activation_that_is_not_monotone():
    """A 2x2 max-pool into bit planes: with clamp the INT8 kernel's epilogue pools the accumulators; with hardswish /
    SiLU the plan declines that (pooling before the activation would be wrong) and pools the float32 result in the
    pass after the kernel.  Both equal the reference backend."""
    qx, qw, kw = _op_case(0, seed=120)
    pw = pack_conv_weight(qw)
    for act, fused in ((("clamp", 0.0, 6.0), True), ("hardswish", False), ("silu", False)):
        okw = dict(kw, act=act, pool=("max", 2, 2), out_fmt="uint2", out_scale=1.5)
        s = explain_conv2d(qx, pw, backend="int8", **okw)
        assert ("max-pool 2x2 stride 2 + quantize + pack -> uint2 bit planes (no float output)" in s) == fused, s
        assert ("separate pass: max-pool 2x2 stride 2 + re-quantize + pack" in s) == (not fused), s
        a, b = conv2d(qx, pw, backend="int8", **okw), conv2d(qx, qw, backend="reference", **okw)
        assert isinstance(a.layout, BitPlanes) and a.shape == b.shape
        if act == "silu":  # a code may differ where SiLU's exp straddles a rounding boundary
            assert (a.codes.int() - b.codes.int()).abs().max() <= 1 and (a.codes == b.codes).float().mean() > 0.95
        else:
            assert torch.equal(a.data, b.data), act


@pytest.mark.parametrize("act", ["hardswish", "silu", ("clamp", 0.0, 6.0)], ids=["hardswish", "silu", "relu6"])
def test_op_bitserial_refuses_the_new_acts(act):
    """The bit-serial GEMM's epilogue has None / ReLU / LeakyReLU only: a plan that runs it with another activation
    raises, naming the activation, what the backend applies and the fix (forced here by the emulated-GEMM hook; on
    a faked H100 by the backend rule)."""
    from tcprec.formats import as_format
    from tcprec.ops.qconv_plan import DeviceCaps, plan_conv2d

    gen = torch.Generator().manual_seed(130)
    qx, qw = _qt((1, 6, 6, 8), "uint2", gen), _qt((4, 3, 3, 8), "binary", gen, PerChannel(0))
    match = (r"act=.*: backend 'bitserial' \(the binary tensor-core GEMM: .*\) applies only None, 'relu' and "
             r"\('leaky', slope\) in its epilogue; run this layer on backend='int8' .*or pass act=None and apply the "
             r"activation to the conv's float output")
    with pytest.raises(ValueError, match=match):
        qconv._conv2d_impl(qx, qw, padding=1, act=act, _gemm=rq.bmma_gemm_reference)
    h100 = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)
    g = ConvGeometry(8, 14, 14, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1))
    fa, fw = as_format("uint2"), as_format("binary")
    with pytest.raises(ValueError, match=match):
        plan_conv2d(g, fa, fw, device=h100, act=qconv._check_act(act))
    assert plan_conv2d(g, fa, fw, device=h100, act="relu").backend == "bitserial"
    assert plan_conv2d(g, fa, fw, device=h100, act=qconv._check_act(act), backend="int8").backend == "int8"  # the fix
    # the reference backend (the CPU's for these formats) and the INT8 kernel apply it
    for backend in ("reference", "int8"):
        y = conv2d(qx, qw, padding=1, act=act, backend=backend)
        assert torch.equal(y, rf.apply_act(conv2d(qx, qw, padding=1, backend=backend), act)) or act == "silu"


def test_plan_thin_stem_takes_the_triton_route_for_acts_stem_conv_lacks():
    """stem_conv.cu applies None / ReLU / LeakyReLU (slope >= 0): a thin stem with clamp, hardswish, SiLU (or a
    negative slope, which stem_conv refuses) runs the gathered Triton route on an H100 instead; clamp keeps the fused
    pooled planes, hardswish the pool pass after the kernel."""
    from tcprec.formats import as_format
    from tcprec.ops.qconv_plan import DeviceCaps, plan_conv2d

    h100 = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)
    g = ConvGeometry(8, 32, 32, 3, 64, 3, 3, (1, 1), (1, 1), (1, 1))
    i8 = as_format("int8")

    def plan(act, **kw):
        p = plan_conv2d(g, i8, i8, device=h100, act=act, **kw)
        return p.stem, p.epilogue, p.after, p.finish

    pooled = dict(pool=("max", 2, 2), out_fmt=as_format("uint2"), out_scale_given=True)
    assert plan("relu", **pooled) == ("cuda", "planes", "", "")
    assert plan(("clamp", 0.0, 6.0), **pooled) == ("gather", "planes", "", "")
    assert plan("hardswish", **pooled) == ("gather", "float32", "finish", "pack")
    assert plan("relu", out_dtype=torch.float16)[0] == "cuda"
    for act in (("clamp", 0.0, 6.0), "hardswish", "silu", ("leaky", -0.1)):
        assert plan(act, out_dtype=torch.float16) == ("gather", "float16", "", ""), act
