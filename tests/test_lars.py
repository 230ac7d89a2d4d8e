"""LARS in LowPrecisionSGD (CPD's --use_lars) against steps computed by hand."""

import math

import pytest
import torch

from tcprec.train import LowPrecisionSGD


def _hand_steps(w, g, lr, mom, wd, eta, steps):
    """Plain-Python LARS (trust ratio on g + wd * w, then SGD momentum), float64."""
    w, buf = list(w), None
    for _ in range(steps):
        wn = math.sqrt(sum(x * x for x in w))
        gn = math.sqrt(sum(x * x for x in g))
        trust = eta * wn / (gn + wd * wn)
        d = [trust * (gi + wd * wi) for gi, wi in zip(g, w)]
        buf = d if buf is None else [mom * b + di for b, di in zip(buf, d)]
        w = [wi - lr * b for wi, b in zip(w, buf)]
    return w


def test_lars_two_steps_by_hand():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # ||w|| = 5
    bias = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LowPrecisionSGD([{"params": [p]}, {"params": [bias], "lars": False}], lr=0.1, momentum=0.9,
                          weight_decay=0.01, lars=True, trust_coefficient=0.001, rounding="nearest")
    for _ in range(2):
        p.grad = torch.tensor([0.6, 0.8])  # ||g|| = 1
        bias.grad = torch.tensor([0.5])
        opt.step()
    # step 1 by hand: trust = 0.001 * 5 / (1 + 0.01 * 5) = 0.0047619..., d = trust * (0.63, 0.84)
    trust1 = 0.005 / 1.05
    assert abs(3.0 - 0.1 * trust1 * 0.63 - _hand_steps([3.0, 4.0], [0.6, 0.8], 0.1, 0.9, 0.01, 0.001, 1)[0]) < 1e-12
    want = _hand_steps([3.0, 4.0], [0.6, 0.8], 0.1, 0.9, 0.01, 0.001, 2)
    assert torch.allclose(p.detach().double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    assert p.detach()[0].item() != pytest.approx(3.0, abs=1e-4)  # it moved
    # the bias group is plain SGD momentum: 1 - 0.1 * (0.51 + (0.9 * 0.51 + 0.51 - ...))
    d1 = 0.5 + 0.01 * 1.0
    b1 = 1.0 - 0.1 * d1
    d2 = 0.5 + 0.01 * b1
    want_b = b1 - 0.1 * (0.9 * d1 + d2)
    assert abs(bias.item() - want_b) < 1e-6


def test_lars_with_master_weights_in_a_low_precision_format():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = LowPrecisionSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, lars=True, weight_format="e5m10",
                          rounding="nearest")
    for _ in range(3):
        p.grad = torch.tensor([0.6, 0.8])
        opt.step()
    # the trust ratio uses the float32 master weights; the model sees them rounded to fp16
    want = torch.tensor(_hand_steps([3.0, 4.0], [0.6, 0.8], 0.1, 0.9, 0.01, 0.001, 3))
    master = opt.state[p]["master"]
    assert torch.allclose(master.double(), want.double(), rtol=0, atol=1e-6)
    assert torch.equal(p.detach(), master.half().float())
    assert not torch.equal(master, p.detach())  # the master keeps what fp16 drops


def test_lars_zero_weights_fall_back_to_trust_one_and_bad_eta():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = LowPrecisionSGD([p], lr=0.5, lars=True, rounding="nearest")
    p.grad = torch.tensor([1.0, -2.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([-0.5, 1.0]))  # ||w|| = 0: trust 1, a plain step
    with pytest.raises(ValueError, match="trust_coefficient"):
        LowPrecisionSGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, lars=True, trust_coefficient=0.0)


def test_train_with_lars_and_ring_learns(tmp_path):
    from tcprec.train.cli_impl import train

    s = train(model="tiny_cnn", data="synthetic", grad_format="e4m3", aps=True, nodes=4, batch_size=64, lr=2.0,
              limit_train=512, limit_test=256, out_dir=tmp_path, progress=False, seed=0, epochs=2, lars=True,
              algorithm="ring")
    assert s["config"]["lars"] is True and s["config"]["algorithm"] == "ring"
    h = s["history"]
    assert h[1]["train_loss"] < h[0]["train_loss"] and s["final_test_acc"] > 0.3, h  # 10 classes: chance 0.1


def test_cli_bench_allreduce_refuses_without_two_gpus():
    from typer.testing import CliRunner

    from tcprec.cli import app

    res = CliRunner().invoke(app, ["bench", "allreduce", "--numel", "4096"], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert "needs 2 or more" in res.output
    res = CliRunner().invoke(app, ["bench", "allreduce", "--algorithm", "tree"], env={"COLUMNS": "200"})
    assert res.exit_code != 0 and "tree" in res.output
    assert "--lars" in CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
