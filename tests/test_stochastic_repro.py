"""What "the same seed gives the same bits on CPU and GPU" covers (README, docs/numerics.md): the per-call seed
is drawn from the generator on the generator's device (torch's default CPU generator when none is given), and
the CPU reference and the Triton kernel turn one seed into the same bits.  So a CPU ``torch.Generator`` (or
``torch.manual_seed``) gives the same bits for a tensor on either device; a CUDA generator has its own stream."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import tcprec as tp  # noqa: E402


def _x():
    return torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 3


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "fp6", "int4", "bf16"])
def test_one_cpu_generator_seed_gives_the_same_bits_on_both_backends(fmt):
    pytest.importorskip("triton")
    x = _x()
    ref = tp.cast(x, fmt, "stochastic", torch.Generator().manual_seed(11), backend="reference")
    tri = tp.cast(x, fmt, "stochastic", torch.Generator().manual_seed(11), backend="triton")  # the GPU kernel
    assert torch.equal(ref, tri)
    other = tp.cast(x, fmt, "stochastic", torch.Generator().manual_seed(12), backend="reference")
    assert not torch.equal(ref, other)  # the seed matters


def test_default_generator_follows_torch_manual_seed():
    x = _x()
    torch.manual_seed(5)
    a = tp.cast(x, "e4m3", "stochastic", backend="reference")
    torch.manual_seed(5)
    b = tp.cast(x, "e4m3", "stochastic", backend="reference")
    assert torch.equal(a, b)


def test_successive_calls_draw_successive_seeds():
    x = _x()
    g = torch.Generator().manual_seed(1)
    a, b = tp.cast(x, "e4m3", "stochastic", g), tp.cast(x, "e4m3", "stochastic", g)
    g.manual_seed(1)
    assert torch.equal(tp.cast(x, "e4m3", "stochastic", g), a) and not torch.equal(a, b)
