"""Quantizer autograd, emulated Linear / Conv2d driven by a Recipe, and emulate_model."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec import emulate
from tcprec.nn import EmulatedConv2d, EmulatedLinear, Quantizer, Recipe
from tcprec.train import emulate_model


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def test_quantizer_rounds_forward_and_backward_separately():
    q = Quantizer(forward="e4m3", backward="e5m2")
    x = torch.tensor([0.3, 1.7, -100.0], requires_grad=True)
    y = q(x)
    assert torch.equal(y, tp.cast(x.detach(), "e4m3"))
    g = torch.tensor([0.3, 1.7, 1e-6])
    y.backward(g)
    assert torch.equal(x.grad, tp.cast(g, "e5m2"))
    assert torch.equal(Quantizer()(x), x)  # no formats: identity
    with pytest.raises(ValueError, match="rounding"):
        Quantizer("e4m3", rounding="round")


def test_recipe_is_frozen_and_validated():
    r = Recipe(act="e4m3", acc="e5m10")
    assert isinstance(r.act, tp.FloatFormat)
    with pytest.raises(Exception):
        r.act = None
    with pytest.raises(TypeError, match="float format"):
        Recipe(acc="int8")
    with pytest.raises(ValueError, match="acc_mode"):
        Recipe(acc_mode="tree")


def test_linear_without_formats_is_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 3)
    em = EmulatedLinear.from_module(ref, Recipe())
    assert em.weight is ref.weight
    x = torch.randn(2, 4, 6, requires_grad=True)
    y1 = ref(x)
    y2 = em(x)
    assert torch.allclose(y1, y2, atol=1e-6)
    gx1, = torch.autograd.grad(y1.sum(), x)
    gx2, = torch.autograd.grad(y2.sum(), x)
    assert torch.allclose(gx1, gx2, atol=1e-6)


def test_linear_rounds_every_tensor_as_the_recipe_says():
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 5)
    rc = Recipe(act="e4m3", weight="e3m2", grad_output="e5m2", grad_input="e4m3", grad_weight="e5m2", acc="e5m10")
    em = EmulatedLinear.from_module(lin, rc)
    x = torch.randn(3, 8, requires_grad=True)
    y = em(x)
    x_lp, w_lp = tp.cast(x.detach(), "e4m3"), tp.cast(lin.weight.detach(), "e3m2")
    want = emulate.matmul(x_lp, w_lp.t(), acc_fmt="e5m10") + lin.bias.detach()
    assert torch.equal(_bits(y), _bits(want))
    g = torch.randn(3, 5)
    y.backward(g)
    g_lp = tp.cast(g, "e5m2")
    assert torch.equal(_bits(x.grad), _bits(tp.cast(emulate.matmul(g_lp, w_lp, acc_fmt="e5m10"), "e4m3")))
    assert torch.equal(_bits(lin.weight.grad), _bits(tp.cast(emulate.matmul(g_lp.t(), x_lp, acc_fmt="e5m10"), "e5m2")))
    assert torch.equal(_bits(lin.bias.grad), _bits(tp.cast(g_lp.sum(0), "e5m2")))


def test_conv_without_formats_matches_torch():
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
    em = EmulatedConv2d.from_module(conv, Recipe())
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    y1 = F.conv2d(x, conv.weight, conv.bias, 2, 1)
    y2 = em(x)
    assert y2.shape == y1.shape and torch.allclose(y1, y2, atol=1e-5)
    g1 = torch.autograd.grad(y1.square().sum(), [x, conv.weight])
    g2 = torch.autograd.grad(y2.square().sum(), [x, conv.weight])
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-4)


def test_conv_with_formats_is_linear_on_im2col():
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1, bias=False)
    rc = Recipe(act="e4m3", weight="e4m3", acc="e6m9", acc_mode="chunk", chunk=8)
    y = EmulatedConv2d.from_module(conv, rc)(torch.randn(1, 2, 4, 4))
    assert y.shape == (1, 3, 4, 4)
    vals = y.detach().reshape(-1).double()
    assert torch.equal(tp.cast(vals, "e6m9"), vals), "every output is a value of the accumulator format"


def test_emulate_model_swaps_in_place_and_reports():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, groups=2),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 10), torch.nn.Linear(10, 2))
    params = list(model.parameters())
    rep = emulate_model(model, Recipe(act="e4m3", weight="e4m3", grad_output="e5m2"), skip=("5",))
    assert [n for n, _, _ in rep.swapped] == ["0", "4"]
    assert ("2", "groups=2: emulated Conv2d supports groups=1") in rep.skipped and ("5", "in skip") in rep.skipped
    assert isinstance(model[0], EmulatedConv2d) and isinstance(model[4], EmulatedLinear)
    assert list(model.parameters()) == params, "parameters are shared, not copied"
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert "swapped 2" in str(rep)
    assert len(emulate_model(model, Recipe())) == 1  # only the Linear skipped before; emulated ones are not re-wrapped
    with pytest.raises(ValueError, match="no module named"):
        emulate_model(model, Recipe(), skip=("nope",))
