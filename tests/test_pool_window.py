"""``ops.qconv.max_pool_quantize`` (kernels/triton/pool_window.py through Triton's interpreter) against torch's
max-pool followed by the readers' quantizers (its reference path), bit for bit; ``QMaxPool2d`` in converted
networks (docs/decisions/0137)."""

import dataclasses

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.nn.qmodules import QMaxPool2d
from tcprec.formats import as_format
from tcprec.ops import qconv as qc
from tcprec.ops.quantize import quantize_static

WINDOWS = [((3, 3), (2, 2), (1, 1)), ((3, 3), (2, 2), (0, 0)), ((2, 2), (2, 2), (0, 0)), ((3, 2), (1, 2), (1, 0))]
OPERANDS = [("int8", "uint8"), ("int8", "int4"), ("int8", "pm8"), ("planes", "uint2"), ("compact", "uint2"),
            ("planes", "pm1"), ("fp8", "e4m3"), ("fp8", "e5m2")]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("operand, fmt", OPERANDS)
def test_kernel_equals_torch_pool_then_quantize(window, operand, fmt):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 7, 40).half()  # C = 40: one whole and one partial 32-channel word
    x[0, 1, 2, 3] = float("nan")  # torch's pool propagates NaN; the quantizers map it as they do
    x[1, 4, 4, :] = 1e4  # saturates
    s = torch.tensor([0.05])
    a = qc.max_pool_quantize(x, window, operand, fmt, s)
    b = qc.max_pool_quantize(x, window, operand, fmt, s, backend="reference")
    assert type(a.layout) is type(b.layout) and a.shape == b.shape and a.fmt == b.fmt
    assert torch.equal(a.data, b.data)
    if operand != "fp8":  # the codes are those of torch's pooled float
        y = torch.nn.functional.max_pool2d(x.permute(0, 3, 1, 2).float(), *window).permute(0, 2, 3, 1)
        ref = quantize_static(y.nan_to_num(0.0), as_format(fmt), s)
        assert torch.equal(a.codes.to(torch.int64), ref.codes.to(torch.int64))


@pytest.mark.parametrize("operand, fmt", [("int8", "uint8"), ("planes", "uint2"), ("compact", "int2"), ("fp8", "e4m3")])
def test_whole_channel_tiles(operand, fmt):
    """C = 256: whole channel tiles (the mask constant along them), several programs along the channels."""
    torch.manual_seed(2)
    x = torch.randn(1, 5, 6, 256, dtype=torch.bfloat16)
    s = torch.tensor([0.03])
    w = qc.max_pool_window(3, 2, 1)
    a = qc.max_pool_quantize(x, w, operand, fmt, s)
    assert torch.equal(a.data, qc.max_pool_quantize(x, w, operand, fmt, s, backend="reference").data)


def test_bad_input_names_the_value_and_the_allowed_set():
    x = torch.randn(1, 4, 4, 8)
    s = torch.tensor([1.0])
    with pytest.raises(ValueError, match="operand must be one of"):
        qc.max_pool_quantize(x, qc.max_pool_window(3, 2, 1), "int4", "uint8", s)
    with pytest.raises(ValueError, match="padding <= kernel / 2"):
        qc.max_pool_quantize(x, qc.max_pool_window(2, 2, 2), "int8", "uint8", s)
    with pytest.raises(ValueError, match="float NHWC"):
        qc.max_pool_quantize(x[0], qc.max_pool_window(3, 2, 1), "int8", "uint8", s)
    with pytest.raises(TypeError, match="float8"):
        qc.max_pool_quantize(x, qc.max_pool_window(3, 2, 1), "fp8", "uint8", s)
    with pytest.raises(ValueError, match="kernel_size must be an int or a pair"):
        qc.max_pool_window((3, 3, 3), 2, 1)


class _StemPoolNet(nn.Module):
    """ResNet's front: stem conv + BN + ReLU, the 3x3 stride-2 max-pool, a bottleneck whose conv1 and 1x1 shortcut
    both read the pool."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.conv1 = nn.Sequential(nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(16, 64, 1, bias=False), nn.BatchNorm2d(64))
        self.down = nn.Sequential(nn.Conv2d(32, 64, 1, bias=False), nn.BatchNorm2d(64))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.maxpool(self.stem(x))
        y = torch.relu(self.conv2(self.conv1(x)) + self.down(x))
        return self.fc(y.mean((2, 3)))


def _net(dtype):
    torch.manual_seed(1)
    net = _StemPoolNet()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval().to(dtype=dtype, memory_format=torch.channels_last)


def test_int8_stem_pool_writes_its_readers_codes_bit_identical():
    """INT8 kernel (interpreter): the pool becomes a QMaxPool2d handing conv1 and the shortcut int8 codes; the
    network equals the unchained one (torch's pool, each reader quantizing) bit for bit."""
    x = torch.randn(2, 3, 8, 8)
    net = _net(torch.float32)
    cfg = tp.QuantConfig("int8", backend="int8")
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    pool = dict(q.named_modules())["maxpool"]
    assert isinstance(pool, QMaxPool2d) and pool.operand(x.device) == "int8"
    assert any("maxpool: max-pool 3x3 / 2 (padding 1) fused" in n and "conv1.0, down.0" in n
               for n in q.tcprec_summary.notes)
    assert isinstance(pool(x[:, :1].expand(2, 32, 8, 8).contiguous()), tp.QTensor)
    u = tp.quantize_model(net, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    assert type(dict(u.named_modules())["maxpool"]) is nn.MaxPool2d
    with torch.no_grad():
        assert torch.equal(q(x), u(x))


def test_bitserial_readers_get_planes_from_the_pool(monkeypatch):
    """As on an H100 (w1a2 readers on the binary tensor cores): the INT8 stem writes its readers' 2-bit codes as
    compact bit planes and the pool takes the max of the codes (docs/decisions/0172); on this CPU the layers run the
    reference, and the float32 network equals the unchained one (the stem's float, torch's pool, each reader
    quantizing) bit for bit: quantizing is monotone.  (A float16 network's chained codes are those of the stem's
    float32 result, as every chained layer's: the unchained one rounds to float16 first.)"""
    from tcprec.nn import convert
    from tcprec.ops.qconv_plan import DeviceCaps

    caps = DeviceCaps(torch.device("cuda", 0), False, (9, 0), True, (True, "sm_90 has native BMMA AND.POPC"), 132)
    monkeypatch.setattr(convert, "device_caps", lambda dev: caps)
    x = torch.randn(2, 3, 6, 6)
    net = _net(torch.float32)
    cfg = tp.QuantConfig("w1a2", first_last="int8")
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    pool = dict(q.named_modules())["maxpool"]
    assert isinstance(pool, QMaxPool2d) and pool.planes_in and not pool.compact and str(pool.a_fmt) == "uint2"
    stem = q.get_submodule("stem.0")
    assert stem.out_layout == "compact" and stem.out_fmt == pool.a_fmt
    assert any("maxpool: max-pool 3x3 / 2 (padding 1) of stem.0's uint2 codes" in n for n in q.tcprec_summary.notes)
    assert "pooled from its producer's planes" in repr(pool)
    with pytest.raises(ValueError, match="pools its producer's uint2 bit planes, got torch.float32"):
        pool(x)
    u = tp.quantize_model(net, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    with torch.no_grad():
        assert torch.equal(q(x), u(x))
    q.half()  # a float cast keeps the pool's scale float32
    assert pool.in_scale.dtype == torch.float32


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("fmt", ["uint2", "int3", "pm1", "int2"])
@pytest.mark.parametrize("compact", [False, True])
def test_pool_of_planes_equals_the_codes_of_the_pooled_float(window, fmt, compact):
    """``max_pool_planes`` (the Triton kernel through the interpreter, and its torch reference) of the planes of x's
    codes equals ``max_pool_quantize`` of x -- the codes of torch's pooled float -- bit for bit: unsigned, two's
    complement and pm1 codes, a channel count that is not a multiple of 32, padded and compact rows."""
    torch.manual_seed(3)
    x = torch.randn(2, 7, 9, 40) * 2
    s = torch.tensor([0.7])
    planes = qc.max_pool_quantize(x, qc.max_pool_window(1, 1, 0), "compact", fmt, s, backend="reference")
    want = qc.max_pool_quantize(x, window, "compact" if compact else "planes", fmt, s, backend="reference")
    for backend in ("auto", "reference"):
        got = qc.max_pool_planes(planes, window, compact=compact, backend=backend)
        assert got.shape == want.shape and got.layout == want.layout and torch.equal(got.data, want.data), backend
    with pytest.raises(ValueError, match="must be a BitPlanes QTensor.*max_pool_quantize pools a float"):
        qc.max_pool_planes(x, window)
    with pytest.raises(ValueError, match=r"padding \(2, 0\) must be at most half the kernel \(3, 3\)"):
        qc.max_pool_planes(planes, ((3, 3), (2, 2), (2, 0)))


def test_a_pool_with_a_float_reader_stays_torch():
    """A pool whose output some float layer reads (here the conv kept float by an override) stays torch's."""
    x = torch.randn(2, 3, 8, 8)
    q = tp.quantize_model(_net(torch.float32), tp.QuantConfig("int8", backend="int8", overrides={"down.0": "float"}),
                          calibration=x, warn=False)
    assert type(dict(q.named_modules())["maxpool"]) is nn.MaxPool2d


@pytest.mark.parametrize("operand, fmt", [("int8", "uint8"), ("compact", "uint2"), ("fp8", "e4m3")])
def test_with_float_carries_the_pooled_float(operand, fmt):
    torch.manual_seed(3)
    x = torch.randn(2, 7, 7, 40).half()
    s = torch.tensor([0.04])
    w = qc.max_pool_window(3, 2, 1)
    a = qc.max_pool_quantize(x, w, operand, fmt, s, with_float=True)
    b = qc.max_pool_quantize(x, w, operand, fmt, s, with_float=True, backend="reference")
    ref = torch.nn.functional.max_pool2d(x.permute(0, 3, 1, 2).float(), 3, 2, 1).permute(0, 2, 3, 1).half()
    assert torch.equal(a.data, b.data) and torch.equal(a.hp, ref) and torch.equal(b.hp, ref)
    assert qc.max_pool_quantize(x, w, operand, fmt, s).hp is None


class _BasicStemNet(nn.Module):
    """ResNet-18's front: the pool is read by the first block's conv1 and by its identity add."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.conv1 = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.maxpool(self.stem(x))
        return self.fc(torch.relu(self.conv2(self.conv1(x)) + x).mean((2, 3)))


def test_identity_shortcut_reads_the_pooled_float():
    """The pool feeds conv1 its codes and the block's add (fused into conv2) the pooled float: bit-identical."""
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(4)
    net = _BasicStemNet().eval()
    cfg = tp.QuantConfig("int8", backend="int8")
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    pool = dict(q.named_modules())["maxpool"]
    assert isinstance(pool, QMaxPool2d) and pool.with_float
    assert any("and the pooled float for conv2.0's residual add" in n for n in q.tcprec_summary.notes)
    u = tp.quantize_model(net, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    with torch.no_grad():
        assert torch.equal(q(x), u(x))
