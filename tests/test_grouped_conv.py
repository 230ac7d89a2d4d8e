"""Grouped / depthwise quantized convolution: the reference is exact (against float64 F.conv2d on the decoded
values and against the integer tap loop), the Triton direct conv equals it bit for bit (TRITON_INTERPRET=1 on the
CPU, set in conftest.py), and QGroupedConv2d / quantize_model put a depthwise MobileNet-style block on it.  FP8
(e4m3 x e4m3): the reference sums in float32 in its stated order, within the float32 bound of the exact sum, and
the Triton kernel equals it bit for bit; an fp8 model comes back with its depthwise convs quantized."""


import io
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from _aot import compile_ptx, require_nvidia_backend, run_aot

import tcprec as tp
from tcprec.kernels import reference_conv_grouped as rg
from tcprec.kernels.reference_conv_bitserial import decode_values
from tcprec.ops.qconv_grouped import choose_grouped_backend, grouped_conv2d

from _persist import assert_round_trips

# (N, H, W, C, K, R, groups, stride, pad4 (top, bottom, left, right), dilation, x format, w format)
CASES = [
    (2, 7, 6, 8, 8, 3, 8, (2, 2), (0, 1, 0, 1), (1, 1), "uint8", "int8"),  # depthwise, TF "same" stride 2
    (1, 5, 5, 6, 12, 3, 3, (1, 1), (1, 1, 2, 0), (1, 2), "int8", "int4"),  # grouped, multiplier 2, dilation
    (1, 6, 4, 4, 4, 5, 4, (1, 2), (2, 2, 2, 2), (1, 1), "uint4", "int8"),  # 5x5 depthwise
    (1, 4, 4, 4, 2, 1, 2, (1, 1), (0, 0, 0, 0), (1, 1), "int2", "int3"),   # pointwise grouped
]


def _operands(case, seed=0):
    N, H, W, C, K, R, g, st, pad4, dil, fx, fw = case
    gen = torch.Generator().manual_seed(seed)
    xs = torch.rand(N, H, W, C, generator=gen)
    x = tp.quantize(xs if fx.startswith("u") else 2 * xs - 1, fx)
    w = tp.quantize(torch.randn(K, R, R, C // g, generator=gen), fw, tp.PerChannel(0))
    return x, w


def _oracle(x, w, g, st, pad4, dil):
    xv = F.pad(decode_values(x.codes, x.fmt).permute(0, 3, 1, 2), (pad4[2], pad4[3], pad4[0], pad4[1]))
    wv = decode_values(w.codes, w.fmt).permute(0, 3, 1, 2)
    return F.conv2d(xv, wv, stride=st, dilation=dil, groups=g).permute(0, 2, 3, 1).round().to(torch.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[6]}_k{c[5]}_{c[10]}x{c[11]}")
def test_reference_exact(case):
    x, w = _operands(case)
    _, _, _, _, _, _, g, st, pad4, dil, _, _ = case
    want = _oracle(x, w, g, st, pad4, dil)
    got = grouped_conv2d(x, w, groups=g, stride=st, padding=pad4, dilation=dil, out_dtype=torch.int32,
                         backend="reference")
    assert torch.equal(got, want)
    taps = rg.grouped_conv_int_taps(decode_values(x.codes, x.fmt), decode_values(w.codes, w.fmt), g, st, pad4, dil)
    assert torch.equal(taps.to(torch.int32), want)


def test_reference_beyond_float32_uses_integer_taps():
    """Sums that float32 cannot hold exactly (bound >= 2**24) take the integer path and stay exact."""
    x = torch.full((1, 3, 3, 1), 2 ** 12, dtype=torch.int64)
    w = torch.full((1, 3, 3, 1), 2 ** 12 + 1, dtype=torch.int64)
    y = rg.grouped_conv_int(x, w, 1)
    assert y.item() == 9 * 2 ** 12 * (2 ** 12 + 1)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"g{c[6]}_k{c[5]}_{c[10]}x{c[11]}")
def test_triton_equals_reference(case):
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    x, w = _operands(case, seed=1)
    _, _, _, _, K, _, g, st, pad4, dil, _, _ = case
    kw = dict(groups=g, stride=st, padding=pad4, dilation=dil)
    ref = grouped_conv2d(x, w, out_dtype=torch.int32, backend="reference", **kw)
    assert torch.equal(grouped_conv2d(x, w, out_dtype=torch.int32, backend="triton", **kw), ref)
    gen = torch.Generator().manual_seed(2)
    bias, scale = torch.randn(K, generator=gen), torch.rand(K, generator=gen) + 0.5
    for act in (None, "relu", ("clamp", 0.0, 6.0), ("leaky", 0.125), "hardswish"):
        a = grouped_conv2d(x, w, scale=scale, bias=bias, act=act, backend="reference", **kw)
        b = grouped_conv2d(x, w, scale=scale, bias=bias, act=act, backend="triton", **kw)
        assert torch.equal(a, b), act  # the interpreter does not contract into FMAs (1 ulp on a GPU)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"g{c[6]}_k{c[5]}_{c[10]}x{c[11]}")
def test_triton_reads_the_int8_kernels_operand(case):
    """The INT8 kernels' operand (ShiftedInt8: uint8 stored as code - 128, signed formats as their value) gives the
    sums of the same codes in the Dense layout, bit for bit."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    x, w = _operands(case, seed=3)
    _, _, _, _, K, _, g, st, pad4, dil, _, _ = case
    x8 = x.to_layout(tp.ShiftedInt8())
    assert x8.data.dtype == torch.int8 and x8.fmt == x.fmt
    kw = dict(groups=g, stride=st, padding=pad4, dilation=dil)
    ref = grouped_conv2d(x, w, out_dtype=torch.int32, backend="reference", **kw)
    assert torch.equal(grouped_conv2d(x8, w, out_dtype=torch.int32, backend="triton", **kw), ref)
    assert torch.equal(grouped_conv2d(x8, w, out_dtype=torch.int32, backend="reference", **kw), ref)
    scale = torch.rand(K, generator=torch.Generator().manual_seed(4)) + 0.5
    assert torch.equal(grouped_conv2d(x8, w, scale=scale, act="relu", backend="triton", **kw),
                       grouped_conv2d(x, w, scale=scale, act="relu", backend="reference", **kw))


@pytest.mark.parametrize("fx", ["uint8", "int8", "int4", "e4m3"])
def test_depthwise_whole_channel_vectors_equal_reference(fx):
    """K = 48: the depthwise path's channel blocks divide K (EVEN_K, no channel mask) for both block widths the
    host picks (16 by default, 48 = 3 x 16; 32 leaves a masked tail), on every operand kind."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    from tcprec.kernels.triton.conv_grouped import grouped_conv

    gen = torch.Generator().manual_seed(5)
    xs = torch.rand(2, 6, 5, 48, generator=gen)
    fp8 = fx == "e4m3"
    x = tp.quantize(4 * xs - 2 if fp8 else (xs if fx.startswith("u") else 2 * xs - 1), fx)
    w = tp.quantize(torch.randn(48, 3, 3, 1, generator=gen), "e4m3" if fp8 else "int8", tp.PerChannel(0))
    kw = dict(groups=48, stride=(2, 1), padding=(1, 0, 1, 1))
    out = torch.float32 if fp8 else torch.int32
    ref = grouped_conv2d(x, w, out_dtype=out, backend="reference", **kw)
    if not fp8:
        assert torch.equal(grouped_conv2d(x.to_layout(tp.ShiftedInt8()), w, out_dtype=out, backend="triton", **kw), ref)
    assert torch.equal(grouped_conv2d(x, w, out_dtype=out, backend="triton", **kw), ref)
    if not fp8:  # the kernel at a width that leaves a masked channel tail, called directly
        wv = decode_values(w.codes, w.fmt).to(torch.int16)
        y = grouped_conv(x.codes, x.fmt.bits, x.fmt.encoding == "twos", wv, 48, (2, 1), (1, 0, 1, 1), (1, 1),
                         ref.shape[1], ref.shape[2], block_k=32)
        assert torch.equal(y, ref)


def test_grouped_conv_refuses_other_layouts():
    x = tp.quantize(torch.rand(1, 3, 3, 32), "uint2", layout=tp.BitPlanes())
    w = tp.quantize(torch.randn(32, 3, 3, 1), "int8", tp.PerChannel(0))
    with pytest.raises(TypeError, match=r"Dense\(\) or ShiftedInt8\(\) layout"):
        grouped_conv2d(x, w, groups=32)


def test_planner_says_why_and_refuses_silently_nothing():
    name, why = choose_grouped_backend(torch.device("cpu"))
    assert name == "reference" and "reference" in why
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_grouped_backend(torch.device("cpu"), "int8")
    x, w = _operands(CASES[0])
    with pytest.raises(ValueError, match="groups=3 does not fit"):
        grouped_conv2d(x, w, groups=3)
    with pytest.raises(ValueError, match="act must be None or one of"):
        grouped_conv2d(x, w, groups=8, act="gelu")
    x8, w8 = _fp8_operands(FP8_CASES[0])
    with pytest.raises(ValueError, match="e4m3 activations and e4m3 weights, got x float8_e4m3fn, w int8"):
        grouped_conv2d(x8, w, groups=8)
    with pytest.raises(ValueError, match="needs integer codes"):
        grouped_conv2d(x8, w8, groups=8, out_dtype=torch.int32)


class _Block(torch.nn.Module):
    """MobileNetV2 / EfficientNet-Lite style: expand 1x1 -> BN -> ReLU6 -> depthwise 3x3 -> BN -> ReLU6 -> project."""

    def __init__(self, c=8, e=16, act=torch.nn.ReLU6):
        super().__init__()
        self.expand = torch.nn.Conv2d(c, e, 1, bias=False)
        self.bn0, self.a0 = torch.nn.BatchNorm2d(e), act()
        self.dw = torch.nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False)
        self.bn1, self.a1 = torch.nn.BatchNorm2d(e), act()
        self.project = torch.nn.Conv2d(e, c, 1, bias=False)

    def forward(self, x):
        return self.project(self.a1(self.bn1(self.dw(self.a0(self.bn0(self.expand(x))))))) + x


def _randomize_bn(m):
    g = torch.Generator().manual_seed(3)
    for bn in m.modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
    return m.eval()


@pytest.mark.parametrize("act,fused", [(torch.nn.ReLU6, "clamp(0,6)"), (torch.nn.Hardswish, "hardswish"),
                                       (torch.nn.SiLU, "silu")])
def test_depthwise_block_quantized_with_bn_and_act_fused(act, fused):
    torch.manual_seed(0)
    m = _randomize_bn(_Block(act=act))
    x = torch.randn(4, 8, 6, 6)
    q = tp.quantize_model(m, "int8", calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["dw"].precision == "w8a8" and rec["dw"].fused == ("bn", fused) and rec["dw"].backend == "reference"
    assert not q.tcprec_summary.float_layers
    assert type(q.dw).__name__ == "QGroupedConv2d"
    with torch.no_grad():
        y, yq = m(x), q(x)
    assert ((yq - y).norm() / y.norm()).item() < 0.05  # int8 end to end: a few 1e-2 at most


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_depthwise_layer_equals_its_integer_math(backend):
    """QGroupedConv2d's output is the epilogue of the exact integer sums of its own codes, on both backends (the
    Triton one quantizes its input to the INT8 kernels' int8 operand in one pass and reads that)."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    x = torch.rand(2, 4, 5, 5)
    x[0, 0, 0, :2] = torch.tensor([0.0, 1.5])  # a zero code and a saturating input
    q = tp.nn.qgrouped.QGroupedConv2d.from_float(conv, "int8", in_absmax=1.0, signed_input=False,
                                                 act=("clamp", 0.0, 6.0), backend=backend)
    assert q.route[0] == backend
    xq = tp.quantize(x.permute(0, 2, 3, 1), "uint8", scale=q.in_scale)
    wv = decode_values(q.w_codes, q.w_fmt).permute(0, 3, 1, 2)
    C = F.conv2d(decode_values(xq.codes, xq.fmt).permute(0, 3, 1, 2), wv, padding=1, groups=4)
    col = q.in_scale * q.w_scale
    want = (C.float() * col[None, :, None, None] + conv.bias.detach()[None, :, None, None]).clamp(0, 6)
    assert torch.equal(q(x), want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_depthwise_layer_remembers_what_its_weights_give_and_follows_their_changes(backend):
    """What the conv derives from a layer's weights alone (decoded values, column scales; on the Triton route also the
    transposed taps or dp4a words and the summed-area table) is remembered for its buffers (tcprec.memo) and derived
    again when they change: load_state_dict (in place) and an in-place edit give the new weights' outputs, never the
    remembered ones; a saved and loaded layer derives them again."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    from tcprec.memo import memo_get
    from tcprec.ops import qconv_grouped as og

    x = torch.rand(2, 8, 6, 6, generator=torch.Generator().manual_seed(3))

    def layer(seed):
        torch.manual_seed(seed)
        return tp.nn.qgrouped.QGroupedConv2d.from_float(torch.nn.Conv2d(8, 8, 5, padding=2, groups=8), "int8",
                                                        in_absmax=1.0, signed_input=False, backend=backend)

    q, q2 = layer(0), layer(1)
    y0, y2 = q(x), q2(x)
    vals = memo_get(og._W_VALUES, (q.w_codes,), (backend, str(q.w_fmt)))
    assert vals is not None  # remembered by the forward ...
    assert torch.equal(q(x), y0) and memo_get(og._W_VALUES, (q.w_codes,), (backend, str(q.w_fmt))) is vals  # ... kept
    q.load_state_dict(q2.state_dict())
    assert memo_get(og._W_VALUES, (q.w_codes,), (backend, str(q.w_fmt))) is None  # the codes changed in place
    assert torch.equal(q(x), y2) and not torch.equal(y2, y0)
    fresh = layer(1)  # q2's state with layer 0's codes, never run
    with torch.no_grad():
        q.w_codes.copy_(layer(0).w_codes)
        fresh.w_codes.copy_(layer(0).w_codes)
    assert torch.equal(q(x), fresh(x)) and not torch.equal(fresh(x), y2)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), q(x))


# -- FP8: e4m3 activations and weights, float32 sums ---------------------------------------------------------------

# (N, H, W, C, K, R, groups, stride, pad4 (top, bottom, left, right), dilation)
FP8_CASES = [
    (2, 7, 6, 8, 8, 3, 8, (2, 2), (0, 1, 0, 1), (1, 1)),  # depthwise 3x3, TF "same" stride 2 (asymmetric)
    (1, 6, 5, 4, 4, 5, 4, (1, 1), (2, 2, 1, 3), (1, 1)),  # depthwise 5x5, stride 1, asymmetric
    (1, 5, 5, 6, 12, 3, 3, (1, 1), (1, 1, 2, 0), (1, 2)),  # grouped C/groups = 2, multiplier 2, dilation
]
ACTS = [None, "relu", ("clamp", 0.0, 6.0), ("clamp", -1.0, 1.0), ("leaky", 0.125), "hardswish", "silu"]


def _fp8_operands(case, seed=0):
    from tcprec.ops.qconv import quantize_fp8_static

    N, H, W, C, K, R, g, *_ = case
    gen = torch.Generator().manual_seed(seed)
    x = quantize_fp8_static(torch.randn(N, H, W, C, generator=gen) * 3, torch.tensor([2.0 ** -6]))  # wide range
    w = tp.quantize(torch.randn(K, R, R, C // g, generator=gen), "e4m3", tp.PerChannel(0))
    return x, w


def _f32(q):
    return q.codes.view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"g{c[6]}_k{c[5]}_s{c[7][0]}")
def test_fp8_reference_within_the_float32_bound_of_the_exact_sum(case):
    """|C - C*| <= n * 2**-24 * sum |x| |w|, n = R*S*Cg adds (docs/numerics.md); and it does round (not float64)."""
    x, w = _fp8_operands(case)
    *_, g, st, pad4, dil = case
    xv, wv = _f32(x), _f32(w)
    got = rg.grouped_conv_f32(xv, wv, g, st, pad4, dil)
    assert got.dtype == torch.float32

    def exact(a, b):
        a = F.pad(a.double().permute(0, 3, 1, 2), (pad4[2], pad4[3], pad4[0], pad4[1]))
        return F.conv2d(a, b.double().permute(0, 3, 1, 2), stride=st, dilation=dil, groups=g).permute(0, 2, 3, 1)

    n = wv[0].numel()
    bound = n * 2.0 ** -24 * exact(xv.abs(), wv.abs())
    assert ((got.double() - exact(xv, wv)).abs() <= bound).all()


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"g{c[6]}_k{c[5]}_s{c[7][0]}")
def test_fp8_triton_equals_reference(case):
    """The kernel's float32 accumulator equals the reference's bit for bit (same order, exact products); each fused
    activation too (the interpreter does not contract into FMAs), SiLU to a few ulp (exp's rounding)."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    from tcprec.kernels.triton.conv_grouped import grouped_conv

    x, w = _fp8_operands(case, seed=1)
    _, H, W, _, K, R, g, st, pad4, dil = case
    P, Q = rg.output_size(H, W, R, R, st, pad4, dil)
    acc = grouped_conv(x.codes, 8, False, _f32(w), g, st, pad4, dil, P, Q, out_dtype=torch.float32, x_fp8=True)
    assert torch.equal(acc, rg.grouped_conv_f32(_f32(x), _f32(w), g, st, pad4, dil))
    gen = torch.Generator().manual_seed(2)
    kw = dict(groups=g, stride=st, padding=pad4, dilation=dil, bias=torch.randn(K, generator=gen) * 4,
              scale=torch.rand(K, generator=gen) + 0.5)
    for act in ACTS:
        a = grouped_conv2d(x, w, act=act, backend="reference", **kw)
        b = grouped_conv2d(x, w, act=act, backend="triton", **kw)
        if act == "silu":
            torch.testing.assert_close(b, a, rtol=4 * 2.0 ** -23, atol=2.0 ** -20)
        else:
            assert torch.equal(a, b), act


def test_fp8_kernel_decodes_every_e4m3_code():
    """All 256 codes through a 1x1 depthwise conv with weight 1: the kernel's integer decode equals torch's cast
    (subnormals, +-448, NaN; -0 sums to +0 on both sides)."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    from tcprec.kernels.triton.conv_grouped import grouped_conv

    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16, 1)
    got = grouped_conv(codes, 8, False, torch.ones(1, 1, 1, 1), 1, (1, 1), (0, 0, 0, 0), (1, 1), 16, 16,
                       out_dtype=torch.float32, x_fp8=True)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_fp8_depthwise_layer_equals_its_reference():
    """QGroupedConv2d at fp8: e4m3 input codes with the absmax / 448 scale (as QConv2d's), per-channel e4m3 weights,
    and the output the epilogue of the float32 reference sums of those codes."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 6, 3, stride=2, groups=6)
    conv.tcprec_pad4 = (0, 1, 0, 1)
    x = torch.randn(2, 6, 7, 7)
    q = tp.nn.qgrouped.QGroupedConv2d.from_float(conv, "fp8", in_absmax=float(x.abs().max()), signed_input=True,
                                                 act="hardswish")
    assert str(q.a_fmt) == str(q.w_fmt) == "float8_e4m3fn" and q.w_codes.dtype == torch.uint8
    assert torch.equal(q.in_scale, torch.tensor([float(x.abs().max()) / 448]))
    w_amax = conv.weight.detach().flatten(1).abs().amax(1)
    torch.testing.assert_close(q.w_scale, w_amax / 448, rtol=0, atol=0)
    xv = (x.permute(0, 2, 3, 1) / q.in_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    wv = q.w_codes.view(torch.float8_e4m3fn).float()
    C = rg.grouped_conv_f32(xv, wv, 6, (2, 2), (0, 1, 0, 1))
    want = rg.epilogue(C, q.in_scale * q.w_scale, conv.bias.detach(), "hardswish").permute(0, 3, 1, 2)
    got = q(x)
    assert torch.equal(got, want)
    ref = F.hardswish(F.conv2d(F.pad(x, (0, 1, 0, 1)), conv.weight, conv.bias, stride=2, groups=6))
    assert ((got - ref).norm() / ref.norm()).item() < 0.06  # e4m3 (3 mantissa bits) on both operands: 0.037


@pytest.mark.parametrize("act,fused", [(torch.nn.ReLU6, "clamp(0,6)"), (torch.nn.SiLU, "silu")])
def test_fp8_model_quantizes_every_conv(act, fused):
    """fp8 quantize_model of an EfficientNet-style block: the depthwise conv is a QGroupedConv2d at fp8 (BN and the
    activation fused), nothing is left float, and the output stays near the float model's."""
    torch.manual_seed(0)
    m = _randomize_bn(_Block(act=act))
    x = torch.randn(4, 8, 6, 6)
    q = tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None), calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert {n: r.precision for n, r in rec.items()} == {"expand": "fp8", "dw": "fp8", "project": "fp8"}
    assert rec["dw"].fused == ("bn", fused) and rec["dw"].backend == "reference"
    assert not q.tcprec_summary.float_layers
    assert type(q.dw).__name__ == "QGroupedConv2d" and q.dw.precision.fp8
    with torch.no_grad():
        y, yq = m(x), q(x)
    assert ((yq - y).norm() / y.norm()).item() < 0.03  # fp8 end to end (measured 0.005)


@pytest.mark.parametrize("prec", ["int8", "fp8"])
def test_grouped_layer_persists(prec):
    """state_dict loads into a model quantized from other weights and makes it the same; torch.save of the whole
    model round-trips; a state of the other precision (same buffer shapes) is refused and changes nothing."""
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(4))

    def quantized(p, seed, scale=1.0):
        torch.manual_seed(seed)
        return tp.quantize_model(_randomize_bn(_Block()), tp.QuantConfig(p, first_last=None),
                                 calibration=x * scale, warn=False)

    q, q2 = quantized(prec, 0), quantized(prec, 1, 3.0)
    sd = q.state_dict()
    assert sd["dw._extra_state"]["precision"] == str(q.dw.precision) and torch.equal(sd["dw.w_codes"], q.dw.w_codes)
    assert_round_trips(q, q2, x)
    with torch.no_grad():
        other = quantized("fp8" if prec == "int8" else "int8", 0)
        before = other.dw.w_codes.clone()
        with pytest.raises(ValueError, match="precision: saved"):
            other.dw.load_state_dict({k[3:]: v for k, v in sd.items() if k.startswith("dw.")})
        assert torch.equal(other.dw.w_codes, before)


def test_fp8_model_notes_that_grouped_int8_is_free_and_more_accurate():
    """A grouped conv quantized at fp8 (or below 8 bits) is listed in the summary's notes with the measured reason to
    prefer QuantConfig(grouped='int8'); with grouped='int8' it runs at w8a8 and the note is gone."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
                            torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(2, 4, 6, 6)
    q = tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None), calibration=x, warn=False)
    assert any("grouped='int8'" in n and "2" in n for n in q.tcprec_summary.notes)
    q8 = tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None, grouped="int8"), calibration=x, warn=False)
    assert {r.name: r.precision for r in q8.tcprec_summary.layers}["2"] == "w8a8"
    assert not any("grouped='int8'" in n for n in q8.tcprec_summary.notes)


class _MBConvLike(torch.nn.Module):
    """expand 1x1 -> BN -> ReLU6 -> depthwise 3x3 (TF "same" stride 2) -> BN -> ReLU6 -> project 1x1."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.expand = nn.Sequential(nn.Conv2d(4, 16, 1), nn.BatchNorm2d(16), nn.ReLU6())
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 2, groups=16), nn.BatchNorm2d(16), nn.ReLU6())
        self.project = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.project(self.dw(self.pad(self.expand(x))))


def test_expand_conv_writes_the_depthwise_layers_int8_operand():
    """With the INT8 kernels (interpreter), the expand conv's epilogue applies its ReLU6 and writes the depthwise
    layer's int8 operand: the same output as the unchained model, bit for bit (float32 model)."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    import dataclasses

    torch.manual_seed(0)
    m = _MBConvLike().eval()
    _randomize_bn(m)
    x = torch.randn(2, 4, 9, 9)
    cfg = tp.QuantConfig("int8", backend="int8")
    q = tp.quantize_model(m, cfg, calibration=x, warn=False)
    q0 = tp.quantize_model(m, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    out = {r.name: r.out for r in q.tcprec_summary.layers}
    assert out["expand.0"] == "int8 codes uint8 -> dw.0", out
    assert q.get_submodule("expand.0").out_layout == "int8" and q0.get_submodule("expand.0").out_fmt is None
    assert {r.name: r.fused for r in q.tcprec_summary.layers}["expand.0"] == ("bn", "clamp(0,6)")
    with torch.no_grad():
        y, y0 = q(3 * x), q0(3 * x)
    assert torch.equal(y, y0)


def test_grouped_layer_refuses_an_operand_it_does_not_read():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    q = tp.nn.qgrouped.QGroupedConv2d.from_float(conv, "int8", in_absmax=1.0, signed_input=False)
    dense = tp.quantize(torch.rand(1, 5, 5, 4), "uint8")  # Dense codes: not the chained operand
    with pytest.raises(ValueError, match=r"ShiftedInt8\(\) uint8 codes"):
        q(dense)
    with pytest.raises(ValueError, match=r"ShiftedInt8\(\) uint8 codes \(N, H, W, 4\)"):
        q(tp.quantize(torch.rand(1, 5, 5, 8), "uint8", layout=tp.ShiftedInt8()))
    ok = tp.quantize(torch.rand(1, 5, 5, 4), "uint8", scale=q.in_scale, layout=tp.ShiftedInt8())
    assert torch.equal(q(ok), q(ok.dequantize().permute(0, 3, 1, 2)))


@pytest.mark.parametrize("geo", [
    # (H, W, K, R, S, stride, pad4 (top, bottom, left, right), dilation)
    (7, 7, 40, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1)),    # 5x5 "same", K = 40: a masked channel tail at both widths
    (6, 9, 16, 3, 3, (2, 2), (0, 1, 0, 1), (1, 1)),    # TF "same" stride 2
    (4, 5, 8, 5, 3, (1, 2), (4, 1, 1, 3), (2, 1)),     # dilated rows, pads wider than the map: taps cut on both sides
])
def test_depthwise_offset_summed_from_the_valid_taps_rectangle(geo):
    """The int8 operand of uint8 codes (value = 128 + x8): the kernel sums x8 * w in its loop and
    adds offset * (the weights of the pixel's valid taps) from the weights' summed-area table after it -- equal to
    the reference's integer sums bit for bit, at the image's borders too."""
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    H, W, K, R, S, st, pad4, dil = geo
    gen = torch.Generator().manual_seed(9)
    xs = torch.rand(2, H, W, K, generator=gen)
    x = tp.quantize(xs, "uint8")
    x8 = x.to_layout(tp.ShiftedInt8())
    assert tp.qtensor.int8_affine(x.fmt)[0] != 0  # the case under test: an operand with an offset
    w = tp.quantize(torch.randn(K, R, S, 1, generator=gen), "int8", tp.PerChannel(0))
    kw = dict(groups=K, stride=st, padding=pad4, dilation=dil)
    ref = grouped_conv2d(x, w, out_dtype=torch.int32, backend="reference", **kw)
    assert torch.equal(grouped_conv2d(x8, w, out_dtype=torch.int32, backend="triton", **kw), ref)


def _aot_depthwise_ptx(x_type: str, signed: bool, R: int, even_k: bool) -> str:
    """The depthwise kernel's dp4a variant (what a CUDA launch of 8-bit weights takes) built for sm_90."""
    from tcprec.kernels.triton import conv_grouped as kg

    types = {name: "i32" for name in kg._grouped_conv_kernel.arg_names}
    types.update(x_ptr=x_type, w_ptr="*i32", col_ptr="*fp32", bias_ptr="*fp32", y_ptr="*fp16", sat_ptr="*i32",
                 wq_ptr="*i32", act_a="fp32", act_b="fp32")
    consts = dict(R=R, S=R, X_BITS=8, X_TWOS=signed, X_FP8=False, X_I8=x_type == "*i8", X_OFF=128 if signed else 0,
                  X_STEP=1, DW=True, DP4A=True, EVEN_K=even_k, HAS_BIAS=True, ACT=3, OUT_ACC=False, BLOCK_M=64,
                  BLOCK_K=32)
    return compile_ptx(kg._grouped_conv_kernel, types, consts, div=("C", "K"), num_warps=4)


@pytest.mark.slow
def test_depthwise_dp4a_variant_compiles_for_sm90():
    """The dp4a path cannot run under the interpreter (inline PTX): it is built for sm_90 here, in a subprocess, and
    its sums are checked against the reference on a GPU (tests/gpu/test_grouped_conv_gpu.py).  Signed bytes (the
    int8 operand) take dp4a.s32.s32, unsigned codes dp4a.u32.s32; the 4 taps' words load 16 bytes at a time."""
    ptx = json.loads(run_aot(__file__, timeout=300).strip().splitlines()[-1])
    for name, text in ptx.items():
        want = "dp4a.s32.s32" if name.startswith("s8") else "dp4a.u32.s32"
        assert want in text, name
        assert "prmt.b32" in text, name
    assert "ld.global.v4.b32" in ptx["s8_5x5"] and "ld.global.v4.b32" in ptx["u8_3x3"]


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    require_nvidia_backend()
    report = {"s8_5x5": _aot_depthwise_ptx("*i8", True, 5, True), "u8_3x3": _aot_depthwise_ptx("*u8", False, 3, True),
              "s8_3x3_masked": _aot_depthwise_ptx("*i8", True, 3, False)}
    print(json.dumps({k: "\n".join(ln for ln in v.splitlines() if "dp4a" in ln or "prmt" in ln or "ld.global" in ln)
                      for k, v in report.items()}))
