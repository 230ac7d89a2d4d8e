"""Grouped / depthwise convolution on the GPU (``kernels/triton/conv_grouped.py`` compiled for CUDA): the integer
sums equal the exact reference bit for bit, the FP8 float32 sums equal ``grouped_conv_f32``'s bit for bit (the
same order, exact e4m3 products: an FMA rounds like the add), the fused epilogues within a few ulp (the GPU may
contract ``acc * col + bias`` into one FMA), every e4m3 code decodes as torch does; and an EfficientNet-style
network (stem, MBConv blocks with depthwise 3x3 / 5x5, TF "same" stride-2 padding, ReLU6) quantized at int8 and
fp8 on CUDA runs every conv quantized, its depthwise convs on the Triton route, near the float model and near the
same quantized model on the CPU."""

import copy

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.kernels import reference_conv_grouped as rg
from tcprec.kernels.reference_conv_bitserial import decode_values
from tcprec.ops.qconv import quantize_fp8_static
from tcprec.ops.qconv_grouped import grouped_conv2d

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")
kg = pytest.importorskip("tcprec.kernels.triton.conv_grouped")

DEV = "cuda"
# (N, H, W, C, K, R, groups, stride, pad4 (top, bottom, left, right), dilation): EfficientNet-Lite0-sized too
CASES = [
    (8, 112, 112, 32, 32, 3, 32, (1, 1), (1, 1, 1, 1), (1, 1)),  # block 0's depthwise
    (8, 112, 112, 96, 96, 3, 96, (2, 2), (0, 1, 0, 1), (1, 1)),  # stride 2, TF "same"
    (8, 28, 28, 240, 240, 5, 240, (1, 1), (2, 2, 2, 2), (1, 1)),  # 5x5
    (4, 14, 14, 64, 128, 3, 16, (1, 1), (1, 1, 2, 0), (1, 2)),  # grouped: C/groups = 4, multiplier 2, dilation
]
ACTS = [None, "relu", ("clamp", 0.0, 6.0), ("leaky", 0.125), "hardswish", "silu"]


def _operands(case, fp8: bool, seed=0):
    N, H, W, C, K, R, g, *_ = case
    gen = torch.Generator(DEV).manual_seed(seed)
    xs = torch.randn(N, H, W, C, device=DEV, generator=gen)
    w = torch.randn(K, R, R, C // g, device=DEV, generator=gen)
    if fp8:
        return (quantize_fp8_static(xs * 3, torch.tensor([2.0 ** -6], device=DEV)),
                tp.quantize(w, "e4m3", tp.PerChannel(0)))
    return tp.quantize(xs.clamp_min(0), "uint8"), tp.quantize(w, "int8", tp.PerChannel(0))


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}_g{c[6]}_k{c[5]}_s{c[7][0]}")
def test_kernel_sums_equal_the_reference_and_epilogue_within_ulps(case, fp8):
    x, w = _operands(case, fp8)
    _, H, W, _, K, R, g, st, pad4, dil = case
    P, Q = rg.output_size(H, W, R, R, st, pad4, dil)
    if fp8:
        xv, wv = (t.codes.view(torch.float8_e4m3fn).float() for t in (x, w))
        acc = kg.grouped_conv(x.codes, 8, False, wv, g, st, pad4, dil, P, Q, out_dtype=torch.float32, x_fp8=True)
        assert torch.equal(acc, rg.grouped_conv_f32(xv, wv, g, st, pad4, dil))
    else:
        kw0 = dict(groups=g, stride=st, padding=pad4, dilation=dil, out_dtype=torch.int32)
        want = rg.grouped_conv_int_taps(decode_values(x.codes, x.fmt), decode_values(w.codes, w.fmt), g, st, pad4,
                                        dil).to(torch.int32)
        assert torch.equal(grouped_conv2d(x, w, backend="triton", **kw0), want)
        # the INT8 kernels' operand (what the layer quantizes its input to), read as it is: the same sums
        assert torch.equal(grouped_conv2d(x.to_layout(tp.ShiftedInt8()), w, backend="triton", **kw0), want)
    gen = torch.Generator(DEV).manual_seed(1)
    kw = dict(groups=g, stride=st, padding=pad4, dilation=dil, bias=torch.randn(K, device=DEV, generator=gen),
              scale=torch.rand(K, device=DEV, generator=gen) + 0.5)
    for act in ACTS:
        a = grouped_conv2d(x, w, act=act, backend="reference", **kw)
        b = grouped_conv2d(x, w, act=act, backend="triton", **kw)
        tol = float(a.abs().max()) * 2.0 ** -21  # one FMA rounding (ex2.approx in SiLU: a few ulp relative)
        torch.testing.assert_close(b, a, rtol=2.0 ** -18, atol=tol, msg=f"act={act}")


def test_every_e4m3_code_decodes_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8, device=DEV).reshape(1, 16, 16, 1)
    got = kg.grouped_conv(codes, 8, False, torch.ones(1, 1, 1, 1, device=DEV), 1, (1, 1), (0, 0, 0, 0), (1, 1),
                          16, 16, out_dtype=torch.float32, x_fp8=True)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


class _MBConv(nn.Module):
    def __init__(self, c_in, c_out, e, k, stride):
        super().__init__()
        m = c_in * e
        self.expand = nn.Sequential(nn.Conv2d(c_in, m, 1, bias=False), nn.BatchNorm2d(m), nn.ReLU6())
        pad = (k // 2,) * 4 if stride == 1 else (k // 2 - 1, k // 2, k // 2 - 1, k // 2)  # TF "same", stride 2
        self.pad = nn.ZeroPad2d(pad)
        self.dw = nn.Conv2d(m, m, k, stride, groups=m, bias=False)
        self.bn, self.act = nn.BatchNorm2d(m), nn.ReLU6()
        self.project = nn.Sequential(nn.Conv2d(m, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = stride == 1 and c_in == c_out

    def forward(self, x):
        y = self.project(self.act(self.bn(self.dw(self.pad(self.expand(x))))))
        return y + x if self.skip else y


def _efficientnet_like():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(3, 16, 3, 2, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        _MBConv(16, 24, 4, 3, 2), _MBConv(24, 24, 4, 3, 1), _MBConv(24, 40, 4, 5, 2), _MBConv(40, 40, 4, 5, 1),
        nn.Conv2d(40, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10))
    for bn in net.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
    return net.eval()


@pytest.mark.parametrize("prec,bound", [("int8", 0.02), ("fp8", 0.05)])  # CPU: 0.004 / 0.014
def test_efficientnet_like_network_quantized_end_to_end(prec, bound):
    net = _efficientnet_like().to(DEV)
    x = torch.randn(16, 3, 64, 64, device=DEV, generator=torch.Generator(DEV).manual_seed(2))
    q = tp.quantize_model(net, prec, calibration=x, warn=False)
    s = q.tcprec_summary
    convs = [r for r in s.layers if r.kind == "conv"]
    dws = [r for r in convs if r.name.endswith(".dw")]
    assert len(convs) == 14 and len(dws) == 4 and not s.float_layers
    assert all(r.backend == "triton" and r.fused == ("pad", "bn", "clamp(0,6)") for r in dws), dws
    with torch.no_grad():
        y, yq = net(x), q(x)
        assert ((yq - y).norm() / y.norm()).item() < bound
        # each depthwise layer against itself on the CPU (reference backend): the same codes, sums, epilogue
        for r in dws:
            m = q.get_submodule(r.name)
            xin = torch.randn(2, m.in_channels, 16, 16, device=DEV, generator=torch.Generator(DEV).manual_seed(3))
            cpu = copy.deepcopy(m).cpu()
            assert cpu.route[0] == "reference"
            torch.testing.assert_close(m(xin).cpu(), cpu(xin.cpu()), rtol=2.0 ** -18, atol=1e-5)


# (N, H, W, C, R, stride, pad4, dilation): the dp4a depthwise path's shapes -- 4 taps a word group (9 and 25 taps
# leave a partial last group), a channel tail (C = 40 at block 16 / 32), C % 4 != 0 (the plain loop), borders cut
DP4A_CASES = [
    (4, 28, 28, 240, 5, (1, 1), (2, 2, 2, 2), (1, 1)),
    (4, 15, 17, 40, 3, (2, 2), (0, 1, 0, 1), (1, 1)),
    (2, 9, 11, 64, 5, (1, 2), (4, 1, 1, 3), (2, 1)),
    (2, 7, 7, 6, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
]


@pytest.mark.parametrize("case", DP4A_CASES, ids=lambda c: f"C{c[3]}_k{c[4]}_s{c[5][0]}{c[5][1]}")
@pytest.mark.parametrize("fx,fw", [("uint8", "int8"), ("int8", "int8"), ("uint4", "int4"), ("int4", "int8")])
def test_depthwise_dp4a_sums_equal_the_reference(case, fx, fw):
    """8-bit weights on CUDA: the depthwise conv sums 4 taps an instruction (dp4a; the int8 operand signed, unsigned
    codes unsigned; 4-bit two's complement codes take the plain loop) -- every operand kind equals the exact sums,
    and the same call with the plain loop (w_int8=False) too."""
    N, H, W, C, R, st, pad4, dil = case
    gen = torch.Generator(DEV).manual_seed(7)
    xs = torch.rand(N, H, W, C, device=DEV, generator=gen)
    x = tp.quantize(xs if fx.startswith("u") else 2 * xs - 1, fx)
    w = tp.quantize(torch.randn(C, R, R, 1, device=DEV, generator=gen), fw, tp.PerChannel(0))
    want = rg.grouped_conv_int_taps(decode_values(x.codes, x.fmt), decode_values(w.codes, w.fmt), C, st, pad4,
                                    dil).to(torch.int32)
    kw = dict(groups=C, stride=st, padding=pad4, dilation=dil, out_dtype=torch.int32, backend="triton")
    assert torch.equal(grouped_conv2d(x, w, **kw), want)
    if fx in ("uint8", "int8", "uint4"):
        assert torch.equal(grouped_conv2d(x.to_layout(tp.ShiftedInt8()), w, **kw), want)
    P, Q = want.shape[1:3]
    wv = decode_values(w.codes, w.fmt).to(torch.int16)
    for bk in (16, 32):
        for w_int8 in (True, False):
            got = kg.grouped_conv(x.codes, x.fmt.bits, x.fmt.encoding == "twos", wv, C, st, pad4, dil, P, Q,
                                  block_k=bk, w_int8=w_int8)
            assert torch.equal(got, want), (bk, w_int8)
