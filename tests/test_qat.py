"""QAT (tcprec.prepare_qat / convert_qat) on the CPU: it learns where post-training quantization fails, the
deployed model computes the fake-quant model's codes at every layer, the gradients are the documented STE / LSQ
ones, and bad input is refused with the fix named."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tcprec as tp
from tcprec.nn.qmodules import QConv2d, QLinear
from tcprec.ops.quantize import quantize_static
from tcprec.qat import ActQuant, QATConv2d, QATLinear, WeightQuant, qat_layers


def _data():
    """(x_train, y_train, x_test, y_test) float (N, 1, 14, 14): Fashion-MNIST (3000 / 1000 images, 2x2-averaged)
    when the Debian package is installed, else scikit-learn's digits (8x8 upscaled to 14x14)."""
    from tcprec.data.fashion_mnist import fashion_mnist_available, load_fashion_mnist

    if fashion_mnist_available()[0]:
        xtr, ytr = load_fashion_mnist(split="train")
        xte, yte = load_fashion_mnist(split="test")
        xtr, ytr, xte, yte = xtr[:3000], ytr[:3000], xte[:1000], yte[:1000]
        prep = lambda x: F.avg_pool2d(((x.float() / 255 - 0.286) / 0.353)[:, None], 2)  # noqa: E731
        return prep(xtr), ytr, prep(xte), yte
    from sklearn.datasets import load_digits

    d = load_digits()
    x = F.interpolate(torch.from_numpy(d.images).float()[:, None] / 8 - 1, size=(14, 14), mode="bilinear")
    y = torch.from_numpy(d.target).long()
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 3 * 3, 10))


def _train(model, x, y, epochs, lr):
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        for i in range(0, x.shape[0], 100):
            idx = perm[i:i + 100]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def _acc(model, x, y) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = _data()
    fp = _train(_cnn(), xtr, ytr, epochs=3, lr=3e-3)
    qat = _train(tp.prepare_qat(fp, "w2a2"), xtr, ytr, epochs=2, lr=1e-3)
    return fp, qat, (xtr, ytr, xte, yte)


def test_qat_beats_ptq_at_w2a2(trained):
    fp, qat, (xtr, _, xte, yte) = trained
    ptq = tp.quantize_model(fp, "w2a2", calibration=xtr[:500], warn=False)
    a_fp, a_ptq, a_qat = _acc(fp, xte, yte), _acc(ptq, xte, yte), _acc(tp.convert_qat(qat), xte, yte)
    print(f"float {a_fp:.3f}  PTQ w2a2 {a_ptq:.3f}  QAT w2a2 {a_qat:.3f}")
    assert a_fp > 0.7, a_fp  # the float model learned
    # QAT wins back at least half of what PTQ lost (Fashion-MNIST: 0.846 / 0.477 / 0.845; on scikit-learn's digits,
    # the fallback without the Debian package, PTQ loses only ~2 points: 0.952 / 0.929 / 0.955)
    assert a_qat >= a_ptq + 0.5 * (a_fp - a_ptq), (a_fp, a_ptq, a_qat)
    assert a_qat >= a_fp - 0.08, (a_fp, a_ptq, a_qat)


def _inputs(model, types, x):
    """name -> the input each module of ``types`` received on ``model(x)``."""
    seen, hooks = {}, []
    for n, m in model.named_modules():
        if isinstance(m, types):
            hooks.append(m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, a[0])))
    try:
        y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen, y


@torch.no_grad()
def test_convert_equals_fake_quant_layer_by_layer(trained):
    _, qat, (_, _, xte, _) = trained
    x = xte[:200]
    dep = tp.convert_qat(qat)
    qat.eval()
    q_in, y_q = _inputs(qat, (QATConv2d, QATLinear), x)
    d_in, y_d = _inputs(dep, (QConv2d, QLinear), x)
    d_mods = dict(dep.named_modules())
    assert set(q_in) == set(d_in) and len(q_in) == 4
    for name, m in qat_layers(qat).items():
        d = d_mods[name]
        assert d.a_fmt == m.act_quant.fmt and torch.equal(d.in_scale, m.act_quant.scale().reshape(1))
        q_codes = m.act_quant.codes(q_in[name])  # (N, C, H, W) or (N, K) values
        xd = d_in[name]
        xd = xd.permute(0, 2, 3, 1) if xd.dim() == 4 else xd  # NHWC, as QConv2d quantizes it
        qd = quantize_static(xd, d.a_fmt, d.in_scale)
        d_vals = tp.decode(qd.codes, d.a_fmt)
        q_vals = q_codes.permute(0, 2, 3, 1) if q_codes.dim() == 4 else q_codes
        if isinstance(d, QLinear) and d.in_channels_last is not None:  # flatten_nhwc: (h, w, c) order
            C = d.in_channels_last
            q_vals = q_vals.reshape(q_vals.shape[0], C, -1).transpose(1, 2).reshape(q_vals.shape[0], -1)
        assert torch.equal(d_vals.float(), q_vals.float()), name
        wv, _ = m.weight_quant.codes(m.weight)
        wd = tp.decode(d.weight.qw.codes, d.w_fmt).float()
        wv = wv.permute(0, 2, 3, 1) if wv.dim() == 4 else wv[:, None, None, :]
        if isinstance(d, QLinear) and d.in_channels_last is not None:
            C = d.in_channels_last
            wv = wv.reshape(wv.shape[0], C, -1).transpose(1, 2).reshape(wv.shape)
        assert torch.equal(wd, wv), name
    assert torch.equal(y_q, y_d)
    assert torch.equal(y_q.argmax(1), y_d.argmax(1))
    assert [r.precision for r in dep.tcprec_summary.layers] == ["w8a8", "w2a2", "w2a2", "w8a8"]
    assert str(dict(dep.named_modules())["3"].w_fmt) == "pm2"  # every code of the 2-bit grid


@pytest.mark.parametrize("prec,act", [("w1a2", "lsq"), ("w1a1", "lsq"), ("w4a4", "pact")])
def test_convert_equals_fake_quant_other_precisions(prec, act):
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Flatten(), nn.Linear(16 * 5 * 5, 32), nn.ReLU(), nn.Linear(32, 10))
    q = tp.prepare_qat(m, prec, act_quant=act)
    x = torch.randn(16, 1, 10, 10)
    _train(q, x, torch.arange(16) % 10, epochs=3, lr=1e-2)
    dep = tp.convert_qat(q)
    with torch.no_grad():
        assert torch.equal(q(x), dep(x))


def test_lsq_activation_gradient_hand_computed():
    aq = ActQuant(2)
    aq.initialized.fill_(True)
    aq.signed.fill_(False)
    aq._flags = None
    with torch.no_grad():
        aq.step.fill_(0.5)
    x = torch.tensor([[0.2, 1.1, 5.0, -0.3]], requires_grad=True)
    q, s = aq(x)
    assert q.tolist() == [[0.0, 2.0, 3.0, 0.0]]  # round(clamp(x / s, 0, 3)), half to even
    (q * s).sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0, 0.0, 0.0]]  # STE inside [0, 3 s], zero outside
    # LSQ: (q - x/s) inside = (0 - 0.4) + (2 - 2.2); hi = 3 above, lo = 0 below; times 1/sqrt(N Qp), N = 4, Qp = 3
    assert aq.step.grad.item() == pytest.approx((-0.4 - 0.2 + 3 + 0) / math.sqrt(4 * 3), rel=1e-6)


def test_lsq_pm2_weight_gradient_hand_computed():
    w = torch.tensor([[0.3, -0.9, 2.0, 0.05]], requires_grad=True)
    wq = WeightQuant(w.detach(), 2)
    with torch.no_grad():
        wq.step.fill_(0.5)
    q, s = wq(w)
    assert q.tolist() == [[1.0, -1.0, 3.0, 1.0]]  # nearest odd integer of clamp(w / s, -3, 3)
    (q * s.view(-1, 1)).sum().backward()
    assert w.grad.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    # (q - w/s) inside: (1 - 0.6) + (-1 + 1.8) + (1 - 0.1); +3 for the clipped 2.0; g = 1/sqrt(4 * 3)
    assert wq.step.grad.item() == pytest.approx((0.4 + 0.8 + 3 + 0.9) / math.sqrt(12), rel=1e-6)


def test_binary_weight_forward_and_ste():
    w = torch.tensor([[0.5, -1.5, 0.0, 2.0]], requires_grad=True)
    wq = WeightQuant(w.detach(), 1)
    q, s = wq(w)
    assert q.tolist() == [[1.0, -1.0, 1.0, 1.0]] and s.item() == pytest.approx(1.0)  # sign, mean|w| = 1
    (q * s.view(-1, 1) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert w.grad.tolist() == [[1.0, 2.0, 3.0, 4.0]]  # identity STE, s not learned
    assert not list(wq.parameters())


def test_prepare_nothing_to_quantize_warns():
    m = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.ReLU())
    with pytest.warns(UserWarning, match="no layer to quantize"):
        q = tp.prepare_qat(m, "w1a2")
    assert not qat_layers(q)


def test_convert_unprepared_model_names_the_fix():
    with pytest.raises(TypeError, match="prepare_qat"):
        tp.convert_qat(_cnn())


def test_convert_before_any_forward_is_refused():
    q = tp.prepare_qat(_cnn(), "w1a2")
    with pytest.raises(ValueError, match="forward pass"):
        tp.convert_qat(q)


@pytest.mark.parametrize("config", ["fp8", tp.QuantConfig("w1a2", overrides={"3": "fp8"})])
def test_precision_the_engine_cannot_train_is_refused_at_prepare(config):
    with pytest.raises(ValueError, match="fp8"):
        tp.prepare_qat(_cnn(), config)


def test_prepare_does_not_mutate_and_follows_quantize_models_plan():
    m = _cnn()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = tp.QuantConfig("w1a2", overrides={"7": "w2a2", "3": "float"})
    with pytest.warns(UserWarning, match="stay in floating point"):
        q = tp.prepare_qat(m, cfg)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert {n: str(l.precision) for n, l in qat_layers(q).items()} == {"0": "w8a8", "7": "w2a2", "12": "w8a8"}
    assert isinstance(q[1], nn.Identity) and isinstance(q[0].bn, nn.BatchNorm2d)  # BN folded into its conv
    assert isinstance(q[4], nn.BatchNorm2d)  # conv 3 stays float: its BN stays a float op


def test_quantize_model_fixed_names_a_missing_layer():
    with pytest.raises(ValueError, match="fixed names no"):
        tp.quantize_model(_cnn(), "w1a2", calibration=torch.randn(2, 1, 14, 14), fixed={"nope": None})


def test_train_classify_checkpoints_resume_and_deploy(tmp_path):
    """`tcprec train --task classify` end to end on a few hundred images: float, QAT, the deployed engine on the
    test images (all predictions equal to the fake-quant model's), the files it promises, --resume, and the
    checkpoint loader of `tcprec run` / `tcprec bench net --checkpoint`."""
    import json

    from tcprec.data.fashion_mnist import fashion_mnist_available
    from tcprec.qat.checkpoint import deploy, load_trained
    from tcprec.qat.trainer import load_classify_data, normalize, train_classify

    data = "fashion-mnist" if fashion_mnist_available()[0] else "digits"
    kw = dict(model="tiny_cnn", precision="int8", data=data, epochs=1, qat_epochs=1, lr=0.05, batch_size=64,
              limit_train=256, limit_test=128, out_dir=tmp_path, progress=False, device="cpu")
    res = train_classify(**kw)
    assert res["deployed_agree"] == res["test_images"] == 128
    assert res["deployed_test_acc"] == res["qat_test_acc"]
    assert {p.name for p in tmp_path.iterdir()} >= {"float.pt", "qat.pt", "metrics.json", "curves.png"}
    assert json.loads((tmp_path / "metrics.json").read_text())["deployed_agree"] == 128
    again = train_classify(**kw, resume=True)  # both phases complete: nothing retrains
    assert again["history"] == res["history"] and again["qat_test_acc"] == res["qat_test_acc"]
    t = load_trained(tmp_path / "qat.pt")
    ds = load_classify_data(data, limit_train=256, limit_test=128)
    with torch.no_grad():
        acc = float((deploy(t)(normalize(ds.x_test)).argmax(1) == ds.y_test).float().mean())
    assert acc == res["deployed_test_acc"]
    with pytest.raises(ValueError, match="trained at int8"):
        deploy(t, "w1a2")


@pytest.mark.parametrize("prec", ["w1a2", "w2a2"])
def test_training_step_compiles_to_one_graph_and_matches_eager(prec):
    """torch.compile (fullgraph: no graph break, no host sync on a data-dependent value) of the QAT model's training
    forward gives eager's loss and gradients (aot_eager: the same ops, traced; fp32 on the CPU)."""
    torch.manual_seed(0)
    qat = tp.prepare_qat(_cnn(), prec)
    x, y = torch.randn(16, 1, 14, 14), torch.randint(0, 10, (16,))
    qat.train()
    qat(x)  # the first batch sets each activation step (a data-dependent initialisation, eager by design)
    ref = copy.deepcopy(qat)
    compiled = torch.compile(qat, backend="aot_eager", fullgraph=True)
    loss_c = F.cross_entropy(compiled(x), y)
    loss_c.backward()
    loss_e = F.cross_entropy(ref(x), y)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for (n, pc), (_, pe) in zip(qat.named_parameters(), ref.named_parameters()):
        assert pc.grad is not None and pe.grad is not None, n
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_train_classify_through_torch_compile_trains_the_same_model(tmp_path):
    """`tcprec train --compile`: both phases' training forward through torch.compile (aot_eager here: the same ops,
    traced) follow eager's losses, and the deployed engine still equals the fake-quant model; a bad value is refused."""
    from tcprec.data.fashion_mnist import fashion_mnist_available
    from tcprec.qat.trainer import train_classify

    data = "fashion-mnist" if fashion_mnist_available()[0] else "digits"
    kw = dict(model="tiny_cnn", precision="w1a2", data=data, epochs=1, qat_epochs=1, lr=0.05, batch_size=64,
              limit_train=256, limit_test=128, progress=False, device="cpu")
    eager = train_classify(**kw, out_dir=tmp_path / "eager")
    comp = train_classify(**kw, out_dir=tmp_path / "compiled", compile="aot_eager")
    assert comp["config"]["compile"] == "aot_eager"
    for e, c in zip(eager["history"], comp["history"]):
        assert math.isclose(e["train_loss"], c["train_loss"], rel_tol=1e-3), (e, c)
    assert comp["deployed_agree"] == comp["test_images"] == 128
    with pytest.raises(TypeError, match="compile must be"):
        train_classify(**kw, out_dir=tmp_path / "bad", compile=3)
