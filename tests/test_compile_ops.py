"""cast / encode / decode, quantize / dequantize, matmul (and matmul_packed) and conv2d_dgrad / conv2d_wgrad
are torch.library custom ops (namespace tcprec) with fake implementations: torch.export keeps them as single
opaque nodes, and torch.compile (Inductor, on the CPU) runs them without tracing their bit manipulation.  Two
Inductor compiles cover them all (a CPU Inductor compile costs tens of seconds on a loaded 2-core machine)."""

import pytest
import torch

import tcprec as tp

OPS = ("cast", "encode", "decode", "quantize", "dequantize", "matmul", "conv2d_dgrad", "conv2d_wgrad")


def test_ops_are_registered():
    for name in OPS:
        assert hasattr(torch.ops.tcprec, name)


def test_export_keeps_each_op_opaque():
    class M(torch.nn.Module):
        def forward(self, x):
            return tp.decode(tp.encode(x, "int4", "toward_zero"), "int4") + tp.cast(x, "e4m3")

    ep = torch.export.export(M(), (torch.randn(64),))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert {"tcprec.cast.default", "tcprec.encode.default", "tcprec.decode.default"} <= set(targets)
    x = torch.randn(64)
    assert torch.equal(ep.module()(x), M()(x))


def test_fake_tensors_give_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5)
        assert tp.encode(x, "bf16").dtype == torch.int16 and tp.encode(x, "e4m3").shape == (3, 5)
        assert tp.cast(x, "fp6").dtype == torch.float32
        assert tp.decode(torch.empty(4, dtype=torch.uint8), "e4m3").dtype == torch.float32


def test_inductor_compiles_cast_encode_decode_on_cpu():
    def f(x):
        return tp.cast(x, "e4m3"), tp.decode(tp.encode(x, "e5m2"), "e5m2")

    x = torch.randn(1000)
    got = torch.compile(f, backend="inductor", fullgraph=True)(x)
    want = f(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_decode_range_error_still_raised_through_the_op():
    with pytest.raises(ValueError, match="code 300 is outside"):
        tp.decode(torch.tensor([300]), "e4m3")


# quantize -> dequantize / matmul / matmul_packed, and both conv backward ops, in one function: one compile


def _quant_matmul_conv(x, w, dy, xc, stochastic=True):
    qa = tp.quantize(x, "int2")  # PerTensor
    qw = tp.quantize(w, "binary", tp.PerChannel(0))
    rounding = "stochastic" if stochastic else "toward_zero"  # export cannot trace the seed's .item()
    return (
        tp.matmul(qa, qw, relu=True),
        tp.matmul(qa, qw, out_dtype=torch.int32),
        tp.matmul_packed(qa, qw, "uint2", 0.5),
        tp.quantize(x, "mxfp4").dequantize(),
        tp.quantize(x, "int4", tp.PerGroup(16), rounding=rounding).dequantize(),
        tp.conv2d_dgrad(dy, torch.ones(4, 3, 3, 2), (1, 5, 5, 2), padding=1,
                        precision="bf16", activation="relu", act_input=xc, backend="reference"),
        tp.conv2d_dgrad(tp.to_fp8(dy, "e5m2"), tp.to_fp8(torch.ones(4, 3, 3, 2)), (1, 5, 5, 2), padding=1,
                        precision="fp8", activation=("leaky_relu", 0.1), act_input=xc, config={"BLOCK_M": 16}),
        tp.conv2d_wgrad(dy, xc, (4, 3, 3, 2), padding=1, precision="fp8", backend="reference"),
    )


def _operands():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 64, generator=g), torch.randn(8, 64, generator=g), torch.randn(1, 5, 5, 4, generator=g),
            torch.randn(1, 5, 5, 2, generator=g))


def test_inductor_compiles_quantize_matmul_conv_on_cpu():
    args = _operands()
    torch.manual_seed(1)  # stochastic rounding draws its seed from the default generator, in the wrapper
    want = _quant_matmul_conv(*args)
    torch.manual_seed(1)
    got = torch.compile(_quant_matmul_conv, backend="inductor", fullgraph=True)(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


def test_export_keeps_quantize_matmul_conv_opaque():
    class M(torch.nn.Module):
        def forward(self, x, w, dy, xc):
            return _quant_matmul_conv(x, w, dy, xc, stochastic=False)

    args = _operands()
    ep = torch.export.export(M(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in ("quantize", "dequantize", "matmul", "conv2d_dgrad", "conv2d_wgrad"):
        assert f"tcprec.{name}.default" in targets
    for g, w in zip(ep.module()(*args), M()(*args)):
        assert torch.equal(g, w)


def _opcheck_cases():
    x, w, dy, xc = _operands()
    qa, qw = tp.quantize(x, "int2"), tp.quantize(w, "binary", tp.PerChannel(0))
    qg = tp.quantize(x, "e4m3", tp.PerGroup(16))
    return [
        ("quantize", (x, "int4", "channel", 0, 0, None, "nearest", -1, "reference")),
        ("quantize", (x, "mxfp4", "group", 32, 1, None, "stochastic", 7, "reference")),
        ("quantize", (x, "e4m3", "tensor", 0, 0, torch.tensor(0.25), "nearest", -1, "reference")),
        ("dequantize", (qg.codes, qg.scale, "float8_e4m3fn", "group", 16, 1, torch.bfloat16)),
        ("matmul", (qa.codes, qw.codes, "int2", "binary", qa.scale.reshape(1).expand(3).contiguous(),
                    qw.scale.reshape(8), None, False, torch.float16, "", None, "reference", "")),
        ("matmul", (qa.codes, qw.codes, "int2", "binary", None, None, None, False, torch.int32, "", None, "int8", "")),
        ("matmul", (qa.codes, qw.codes, "int2", "binary", qa.scale.reshape(1).expand(3).contiguous(),
                    qw.scale.reshape(8), torch.randn(8), True, torch.float32, "uint2", torch.tensor([0.5]),
                    "reference", "")),
        # opcheck's schema check cannot multiply CPU float8 tensors: fp8 precision from float operands here, an
        # fp8 QTensor's (data, scale) in the compile test
        ("conv2d_dgrad", (dy, None, torch.randn(4, 3, 3, 2), None, [1, 5, 5, 2], [1, 1], [1, 1], [1, 1],
                          "fp8", "leaky_relu", 0.1, xc, torch.float32, "reference", -1, False, "")),
        ("conv2d_wgrad", (dy, None, xc, None, [4, 3, 3, 2], [1, 1], [1, 1], [1, 1], "fp16", -1, torch.float16,
                          "reference", False, "")),
    ]


@pytest.mark.parametrize("i", range(len(_opcheck_cases())))
def test_opcheck(i):
    name, args = _opcheck_cases()[i]
    # schema (no mutation / aliasing), autograd registration, fake tensor vs real output, dynamic-shape AOT dispatch
    torch.library.opcheck(getattr(torch.ops.tcprec, name).default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_quantize_dequantize_keep_their_eager_gradients():
    """The ops' autograd formulas give what the torch ops inside them gave: d/dscale of decode(codes) * scale, and
    through an absmax scale to the element that sets it (codes are integers: no gradient through them)."""
    x = torch.tensor([[0.5, -2.0, 1.0], [0.25, 0.75, -0.1]], requires_grad=True)
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    q = tp.quantize(x, "int4", tp.PerChannel(0))  # scale = amax / 7 per row
    (q.dequantize() * g).sum().backward()
    vals = tp.decode(q.codes, "int4").to(torch.float32)  # two's complement values
    dscale = (vals * g).sum(1)  # (2,)
    want = torch.zeros(2, 3)
    want[0, 1] = -dscale[0] / 7  # d amax / dx = sign(x) at the row's argmax |x|
    want[1, 1] = dscale[1] / 7
    assert torch.allclose(x.grad, want, rtol=1e-6, atol=0)
    s = torch.tensor(0.25, requires_grad=True)
    q = tp.quantize(x.detach(), "int4", scale=s)
    (q.dequantize() * g).sum().backward()
    assert torch.allclose(s.grad, (tp.decode(q.codes, "int4").to(torch.float32) * g).sum(), rtol=1e-6, atol=0)


def test_device_checks_run_before_the_op():
    """A meta tensor among the operands would send an op to its fake implementation, which checks nothing: the
    wrappers check devices first."""
    dy, x = torch.randn(1, 5, 5, 4), torch.randn(1, 5, 5, 2)
    with pytest.raises(ValueError, match="all operands must be on one device"):
        tp.conv2d_wgrad(dy, x.to("meta"), (4, 3, 3, 2), padding=1)
    with pytest.raises(ValueError, match="all operands must be on one device"):
        tp.conv2d_dgrad(dy, torch.ones(4, 3, 3, 2, device="meta"), (1, 5, 5, 2), padding=1)
    with pytest.raises(ValueError, match="scale is on meta but x is on cpu"):
        tp.quantize(x, "int8", scale=torch.ones((), device="meta").expand(1, 1, 1, 2))
