"""cast / encode / decode are torch.library custom ops (namespace tcprec) with fake implementations:
torch.export keeps them as single opaque nodes, and torch.compile (Inductor, on the CPU) runs them
without tracing their bit manipulation.  One Inductor compile covers all three (a CPU Inductor
compile costs tens of seconds on a loaded 2-core machine); quantize / matmul / conv are not custom
ops yet."""

import pytest
import torch

import tcprec as tp


def test_ops_are_registered():
    for name in ("cast", "encode", "decode"):
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
