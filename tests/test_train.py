"""Loss scaling, the low-precision optimizer step, the Fashion-MNIST loader and a CPU smoke run of
the ``tcprec train`` experiment on synthetic data."""

import json
import logging

import pytest
import torch

import tcprec as tp
from tcprec.data.fashion_mnist import fashion_mnist_available, load_fashion_mnist
from tcprec.train import LossScaler, LowPrecisionSGD
from tcprec.train.cli_impl import train


def _opt(value):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), value)
    return p, torch.optim.SGD([p], lr=1.0)


def test_dynamic_loss_scale_follows_gradscaler_rules(caplog):
    sc = LossScaler("dynamic", growth_interval=3)
    assert sc.scale_value == 2.0**16
    for _ in range(3):
        p, opt = _opt(2.0**16)
        assert sc.step(opt)
        assert torch.equal(p.detach(), torch.zeros(3))  # the gradient was unscaled to 1 before the step
        sc.update()
    assert sc.scale_value == 2.0**17  # x2 after 3 clean steps
    p, opt = _opt(float("inf"))
    with caplog.at_level(logging.WARNING, logger="tcprec.train"):
        assert not sc.step(opt)
    sc.update()
    assert torch.equal(p.detach(), torch.ones(3)) and "skipped" in caplog.text
    assert sc.scale_value == 2.0**16 and sc.clean_steps == 0 and sc.skipped == 1


def test_static_scale_and_saturating_format_overflow():
    sc = LossScaler("static", init_scale=8.0)
    _, opt = _opt(8.0)
    assert sc.step(opt)
    sc.update()
    assert sc.scale_value == 8.0
    sat = LossScaler("static", init_scale=1.0, grad_format="e4m3_sat")
    _, opt = _opt(448.0)  # at the max of a saturating format: overflow is invisible otherwise
    assert not sat.step(opt)
    with pytest.raises(ValueError, match="mode"):
        LossScaler("auto")


def test_low_precision_sgd_master_weights_keep_small_updates():
    w0 = torch.ones(1000)
    p1, p2 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    with_master = LowPrecisionSGD([p1], lr=1e-3, weight_format="e5m2", rounding="nearest", master_weights=True)
    without = LowPrecisionSGD([p2], lr=1e-3, weight_format="e5m2", rounding="nearest", master_weights=False)
    for _ in range(200):
        for p, o in ((p1, with_master), (p2, without)):
            p.grad = torch.ones(1000)
            o.step()
    assert torch.equal(p2.detach(), w0), "round-to-nearest swallows 1e-3 updates of a 2-bit-mantissa weight"
    assert (p1.detach() < 1).all() and torch.equal(tp.cast(p1.detach(), "e5m2"), p1.detach())


def test_low_precision_sgd_stochastic_rounding_is_unbiased():
    p = torch.nn.Parameter(torch.ones(4000))
    opt = LowPrecisionSGD([p], lr=1e-2, momentum=0.5, weight_format="e5m2", momentum_format="e5m2",
                          master_weights=False, generator=torch.Generator().manual_seed(0))
    for _ in range(10):
        p.grad = torch.ones(4000)
        opt.step()
    # exact (fp32) trajectory of SGD with momentum 0.5
    w, buf = 1.0, 0.0
    for _ in range(10):
        buf = 0.5 * buf + 1.0 if buf else 1.0
        w -= 1e-2 * buf
    assert abs(p.detach().mean().item() - w) < 0.01
    assert torch.equal(tp.cast(p.detach(), "e5m2"), p.detach())


def test_fashion_mnist_loader():
    ok, why = fashion_mnist_available()
    if not ok:
        pytest.skip(why)
    x, y = load_fashion_mnist(split="test")
    assert x.shape == (10000, 28, 28) and x.dtype == torch.uint8
    assert torch.equal(y.bincount(), torch.full((10,), 1000))
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist(split="val")


def test_fashion_mnist_missing_folder_says_why(tmp_path):
    ok, why = fashion_mnist_available(tmp_path)
    assert not ok and "dataset-fashion-mnist" in why
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)


def test_train_smoke_checkpoint_and_resume(tmp_path):
    kw = dict(model="tiny_cnn", data="synthetic", grad_format="e4m3", aps=True, nodes=4, batch_size=64, lr=0.1,
              limit_train=512, limit_test=256, out_dir=tmp_path, progress=False, seed=0)
    s1 = train(epochs=1, **kw)
    assert len(s1["history"]) == 1 and (tmp_path / "checkpoint.pt").is_file() and (tmp_path / "curves.png").is_file()
    s2 = train(epochs=3, resume=True, **kw)
    assert [h["epoch"] for h in s2["history"]] == [1, 2, 3]
    assert s2["history"][0] == s1["history"][0]
    assert s2["final_test_acc"] > 0.5, s2["history"]  # synthetic classes are easy
    assert json.loads((tmp_path / "metrics.json").read_text())["config"]["grad_format"] == "e4m3"


def test_train_rejects_bad_setup_before_training(tmp_path):
    with pytest.raises(ValueError, match="too few exponent bits"):
        train(grad_format="e3m0", aps=True, nodes=64, batch_size=64, data="synthetic", out_dir=tmp_path)
    with pytest.raises(ValueError, match="grad_format"):
        train(grad_format="e2m1", out_dir=tmp_path)
