"""Quantized models persist like any nn.Module (issue 40): every tensor is a buffer, ``state_dict`` round-trips
exactly, a mismatched state is refused, ``torch.save`` of the whole model loads in a fresh process with identical
outputs, and float casts never touch the scales.  Every precision ``quantize_model`` accepts, on the CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import tcprec as tp  # noqa: E402
from tcprec.nn.qmodules import QConv2d, QLinear  # noqa: E402

PRECISIONS = ["int8", "fp8", "w1a1", "w1a2", "w2a2", "w3a5", "w4a4", "w8a8"]


class Block(nn.Module):
    """conv + BN + ReLU, a residual add, a pool, flatten, two linears: every fused epilogue and a view idiom."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.c1(x)))
        y = self.pool(torch.relu(self.c2(y) + y))
        return self.fc2(torch.relu(self.fc1(y.view(y.size(0), -1))))


def _model(seed=0):
    torch.manual_seed(seed)
    m = Block()
    m.bn1.running_mean.uniform_(-0.2, 0.2)
    m.bn1.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _x():
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _quantized(p, seed=0, scale=1.0):
    return tp.quantize_model(_model(seed), tp.QuantConfig(precision=p, first_last=None), calibration=_x() * scale)


def _qlayers(q):
    return [m for m in q.modules() if isinstance(m, (QConv2d, QLinear))]


@pytest.mark.parametrize("p", PRECISIONS)
def test_state_dict_holds_every_tensor_and_round_trips(p):
    q, x = _quantized(p), _x()
    assert len(_qlayers(q)) == 4 and all(str(m.precision) == str(tp.nn.qmodules.parse_precision(p))
                                         for m in _qlayers(q))
    sd = q.state_dict()
    for name, m in q.named_modules():
        if isinstance(m, (QConv2d, QLinear)):
            assert torch.equal(sd[f"{name}.weight_codes"], m.weight.qw.codes)
            assert f"{name}._extra_state" in sd
    # a second model quantized from other weights and another calibration: loading makes it the first
    q2 = _quantized(p, seed=1, scale=3.0)
    assert not torch.equal(q2(x), q(x))
    q2.load_state_dict(sd)
    assert torch.equal(q2(x), q(x))


def test_whole_model_save_load_in_a_fresh_process(tmp_path):
    x = _x()
    for p in PRECISIONS:
        q = _quantized(p)
        torch.save(q, tmp_path / f"{p}.pt")
        torch.save(q.state_dict(), tmp_path / f"{p}.sd")
        torch.save(q(x), tmp_path / f"{p}.want")
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import os, torch, tcprec
        d = {str(tmp_path)!r}
        x = torch.load(os.path.join(d, "x.pt"))
        for p in {PRECISIONS!r}:
            q = torch.load(os.path.join(d, p + ".pt"), weights_only=False)
            torch.save(q(x), os.path.join(d, p + ".got"))
            torch.save(tcprec.compile(q, x, device="cpu")(x), os.path.join(d, p + ".engine"))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for p in PRECISIONS:
        want = torch.load(tmp_path / f"{p}.want")
        assert torch.equal(torch.load(tmp_path / f"{p}.got"), want), p
        assert torch.equal(torch.load(tmp_path / f"{p}.engine"), want), p
        # a state_dict file loads (weights only) into a freshly quantized model
        q2 = _quantized(p, seed=2)
        q2.load_state_dict(torch.load(tmp_path / f"{p}.sd", weights_only=True))
        assert torch.equal(q2(x), want), p


@pytest.mark.parametrize("src,dst", [("int8", "w4a4"), ("w1a2", "w2a2"), ("fp8", "int8"), ("w2a2", "w1a2")])
def test_strict_load_refuses_another_precision(src, dst):
    q_src, q_dst, x = _quantized(src), _quantized(dst), _x()
    before = q_dst(x)
    with pytest.raises(ValueError, match="precision"):
        q_dst.load_state_dict(q_src.state_dict())
    assert torch.equal(q_dst(x), before)  # the refused load changed nothing


def test_strict_load_refuses_another_shape_and_a_missing_state():
    q = _quantized("int8")
    other = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)).eval()
    q_other = tp.quantize_model(other, tp.QuantConfig("int8", first_last=None), calibration=_x())
    sd = {k.replace("c1.", "0."): v for k, v in q.state_dict().items() if k.startswith("c1.")}
    with pytest.raises(ValueError, match="geometry"):
        q_other.load_state_dict(sd, strict=False)
    sd = {k: v for k, v in q.state_dict().items() if not k.endswith("weight_codes")}
    with pytest.raises(RuntimeError, match="weight_codes"):
        _quantized("int8", seed=3).load_state_dict(sd)
    bad = dict(q.state_dict())
    bad["c1._extra_state"] = {"version": 1, **{k: v for k, v in bad["c1._extra_state"].items() if k != "version"},
                              "w_fmt": "int4"}
    with pytest.raises(ValueError, match="w_fmt"):
        _quantized("int8").load_state_dict(bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_keeps_scales_float32_and_sets_the_output_dtype(dtype):
    q, x = _quantized("int8"), _x()
    want = q(x)
    scales = {k: v.clone() for k, v in q.state_dict().items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    h = q.to(dtype)
    assert h is q
    for k, v in scales.items():
        assert torch.equal(h.state_dict()[k], v), k  # float32, unchanged
    y = h(x.to(dtype))
    assert y.dtype == dtype
    # the same codes and scales, the epilogue rounded to 16 bits: close to the float32 result
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert torch.equal(h.float()(x), want)  # back to float32: bit-identical again


def test_double_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"\.double\(\)"):
        _quantized("w2a2").double()


@pytest.mark.parametrize("fmt", ["int8", "binary", "int2", "int3", "e4m3"])
def test_chunked_weight_quantize_and_pack_give_the_same_bits(fmt, monkeypatch):
    """The weight is quantized and packed in chunks of output channels (bounded temporaries: issue 40's memory);
    every step is per channel, so chunks of 200 elements give what one call gives."""
    from tcprec.formats import as_format
    from tcprec.nn import qmodules as qm

    f = as_format(fmt)
    for shape in [(70, 3, 3, 40), (33, 1, 1, 100), (9, 5, 5, 7)]:
        w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        monkeypatch.setattr(qm, "_CHUNK_ELEMENTS", 1 << 30)
        qa = qm._quantize_weight(w, f)
        a = qm._prepare(qa)
        monkeypatch.setattr(qm, "_CHUNK_ELEMENTS", 200)
        qb = qm._quantize_weight(w, f)
        b = qm._prepare(qb)
        assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.scale, qb.scale)
        for name in ["planes", "w_scale", "rowsum", "w8", "conv_planes"]:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape, name
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 \
                    else torch.equal(x, y), name
        assert (a.w_off, a.w_step) == (b.w_off, b.w_step)
        assert (a.conv_planes is a.planes) == (b.conv_planes is b.planes)


class AnnotatedBlock(Block):
    """The same network with string annotations (what ``from __future__ import annotations`` gives every forward)."""

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        return super().forward(x)


@pytest.mark.parametrize("p", ["int8", "w1a2"])
def test_a_model_with_string_annotations_saves_and_loads(p, tmp_path):
    torch.manual_seed(0)
    m = AnnotatedBlock().eval()
    q, x = tp.quantize_model(m, tp.QuantConfig(precision=p, first_last=None), calibration=_x()), _x()
    assert len(_qlayers(q)) == 4
    torch.save(q, tmp_path / "q.pt")
    q2 = torch.load(tmp_path / "q.pt", weights_only=False)
    assert torch.equal(q2(x), q(x))
