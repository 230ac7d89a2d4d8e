"""Low-precision all-reduce with APS: exact properties in one process (emulated nodes), and
multi-process runs with gloo (2 and 4 processes, spawned) that must give the same bits."""

import logging

import pytest
import torch

import tcprec as tp
from tcprec.distributed import EmulatedNodes, allreduce_lowp, check_aps_format, lowp_allreduce_hook
from tcprec.train import LossScaler

from _dist import gloo_group, run_ranks, save_rank

SIZES = [7, 100, 1, 33, 16]  # tensor 3 (33 values) is all zero on every node
CONFIGS = [("e4m3", True, False), ("e5m2", True, True), ("e3m0", True, False), ("e4m3", False, False),
           ("e5m10", True, False)]


def node_grads(node: int) -> torch.Tensor:
    """The flat gradient of global node ``node`` (deterministic, wide dynamic range)."""
    g = torch.Generator().manual_seed(1000 + node)
    parts = []
    for i, n in enumerate(SIZES):
        scale = 10.0 ** (3 * i - 6)
        t = torch.randn(n, generator=g) * scale * torch.logspace(-4, 0, n)
        parts.append(torch.zeros(n) if i == 3 else t)
    return torch.cat(parts)


def _bits(t):
    return t.view(torch.int32)


# ---- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,aps,kahan", CONFIGS)
def test_transports_agree_and_zero_tensor(fmt, aps, kahan):
    flat = torch.stack([node_grads(i) for i in range(4)])
    out_e, info = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, transport="emulate")
    out_c, _ = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, transport="compressed")
    assert torch.equal(_bits(out_e), _bits(out_c))
    zero = slice(sum(SIZES[:3]), sum(SIZES[:4]))
    assert torch.equal(out_e[zero], torch.zeros(33)), "all-zero tensor must give zeros"
    if aps:
        assert torch.isfinite(out_e).all()
        assert int(info.shifts[3]) == 0


def test_aps_no_overflow_up_to_fp32_max():
    fmax = torch.finfo(torch.float32).max
    for n in (2, 16, 256):
        g = torch.Generator().manual_seed(n)
        flat = (torch.rand(n, 64, generator=g) * 2 - 1) * fmax  # gradients up to the float32 max
        flat[:, 0] = fmax
        for fmt in ("e4m3", "e5m2"):
            out, info = allreduce_lowp(flat, [64], fmt, aps=True)
            assert torch.isfinite(out).all(), (n, fmt)
            exact = flat.double().mean(0)
            err = ((out.double() - exact).abs().max() / fmax).item()
            # recursive summation in fmt: |error| <= (n - 1) u sum|g| / n + scaling (n tiny ulps); u = eps/2
            assert err <= n * tp.format(fmt).eps, (n, fmt, err)
        # without APS the same gradients overflow e4m3 (NaN) -- the reason APS exists
        out, info = allreduce_lowp(flat, [64], "e4m3", aps=False)
        assert info.nonfinite_output


def test_too_few_exponent_bits_raise_before_training():
    check_aps_format("e3m0", 32)
    with pytest.raises(ValueError, match="too few exponent bits.*at most 32 nodes"):
        check_aps_format("e3m0", 64)
    with pytest.raises(ValueError, match="too few exponent bits"):
        EmulatedNodes(torch.nn.Linear(2, 2), n_local=64, fmt="e3m0")
    with pytest.raises(ValueError, match="too few exponent bits"):
        allreduce_lowp(torch.ones(64, 3), [3], "e3m0")


def test_nonfinite_gradient_detected_and_logged(caplog):
    m = torch.nn.Linear(3, 1)
    nodes = EmulatedNodes(m, n_local=2, fmt="e4m3")
    x = torch.randn(4, 3)
    x[3, 0] = float("inf")
    with caplog.at_level(logging.WARNING, logger="tcprec.distributed"):
        _, info = nodes.backward(lambda o, y: ((o - y) ** 2).mean(), x, torch.zeros(4, 1))
    assert info.nonfinite_input and "non-finite" in caplog.text
    scaler = LossScaler("dynamic", init_scale=1.0)
    p_before = m.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert scaler.step(opt) is False and torch.equal(m.weight, p_before)


# ---- multiple processes (gloo) -----------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


def _loss(o, y):
    return ((o - y) ** 2).mean()


def _worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port):
        res = {}
        mine = node_grads(rank).view(1, -1)
        for fmt, aps, kahan in CONFIGS:
            for transport in ("emulate", "compressed"):
                out, _ = allreduce_lowp(mine, SIZES, fmt, aps=aps, kahan=kahan, transport=transport)
                res[(fmt, aps, kahan, transport)] = out
        bad = mine.clone()
        if rank == world - 1:
            bad[0, 5] = float("nan")
        res["nan"] = allreduce_lowp(bad, SIZES, "e4m3")[1].nonfinite_input
        # DDP with the comm hook: each rank one micro-batch of the same global batch
        model = torch.nn.parallel.DistributedDataParallel(_model())
        model.register_comm_hook(None, lowp_allreduce_hook("e4m3", aps=True, transport="compressed"))
        x, y = _batch()
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        res["ddp"] = [p.grad.clone() for p in model.parameters()]
        # emulated nodes under a process group: 2 local nodes per rank
        m2 = _model()
        EmulatedNodes(m2, n_local=2, fmt="e5m2").backward(_loss, x.chunk(world)[rank].repeat(2, 1),
                                                          y.chunk(world)[rank].repeat(2, 1))
        res["nodes2"] = [p.grad.clone() for p in m2.parameters()]
        save_rank(res, out_dir, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_equal_emulated_nodes(world):
    res = run_ranks(_worker, world)
    flat = torch.stack([node_grads(i) for i in range(world)])
    for fmt, aps, kahan in CONFIGS:
        want, _ = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, transport="emulate")  # one process
        for r in range(world):
            for transport in ("emulate", "compressed"):
                got = res[r][(fmt, aps, kahan, transport)]
                assert torch.equal(_bits(got), _bits(want)), (fmt, aps, kahan, transport, r)
    assert all(res[r]["nan"] for r in range(world))
    # DDP + hook == one process with `world` emulated nodes (same micro-batches)
    m = _model()
    x, y = _batch()
    EmulatedNodes(m, n_local=world, fmt="e4m3", transport="emulate").backward(_loss, x, y)
    for r in range(world):
        for p, g in zip(m.parameters(), res[r]["ddp"]):
            assert torch.equal(_bits(p.grad), _bits(g))
    # world processes x 2 emulated nodes == one process x 2*world nodes, node order rank-major
    m2 = _model()
    xs = torch.cat([x.chunk(world)[r].repeat(2, 1) for r in range(world)])
    ys = torch.cat([y.chunk(world)[r].repeat(2, 1) for r in range(world)])
    EmulatedNodes(m2, n_local=2 * world, fmt="e5m2").backward(_loss, xs, ys)
    for p, g in zip(m2.parameters(), res[0]["nodes2"]):
        assert torch.equal(_bits(p.grad), _bits(g))
