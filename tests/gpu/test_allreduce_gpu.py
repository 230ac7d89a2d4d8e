"""On CUDA: the fused all-reduce kernels (the default for CUDA tensors) equal the float64 reference
bit for bit (NaN compared as NaN), for emulated nodes on one GPU and, with two GPUs, through NCCL."""

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tcprec.distributed import EmulatedNodes, allreduce_lowp
from tcprec.distributed.lowp import release_graphs
from tcprec.train.models import MODELS

from _dist import run_ranks, save_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FMAX = torch.finfo(torch.float32).max


def resnet18_like(w: int) -> list[int]:
    """50 tensor sizes of a ResNet-18-like net of base width w (conv weights, BN vectors, fc): blocks
    inside one tensor and blocks straddling small tensors."""
    a, b, c, d = w, 2 * w, 4 * w, 8 * w
    return ([a * 3 * 49, a, a] + [a * a * 9, a, a] * 4 + [b * a * 9, b, b, b * b * 9, b, b, b * a, b, b]
            + [b * b * 9, b, b] * 2 + [c * b * 9, c, c, c * c * 9, c, c, c * b, c, c] + [c * c * 9, c, c] * 2
            + [d * c * 9 // 8, d, d] + [d * 10, 10])


SIZES = resnet18_like(64)  # 2.9M values
# A quarter of the width (187k values), for the tests that compare with the CPU engine (its cost grows with
# values x nodes): still 11 to 91 kernel blocks a shard with a ragged last block, a short last shard, tensors
# spanning up to 18 blocks and blocks straddling up to 100 small tensors (_spans_blocks checks it).
SMALL = resnet18_like(16)


def node_grads(node: int, device="cuda", sizes=SIZES) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(100 + node)
    parts = []
    for i, n in enumerate(sizes):
        t = torch.randn(n, device=device, generator=g) * 10.0 ** ((i % 13) - 8)
        if i == 5:
            t.zero_()  # an all-zero tensor
        elif i == 7:
            t = (torch.rand(n, device=device, generator=g) * 2 - 1) * FMAX  # up to the float32 max: s < 0
            t[:3] = torch.tensor([FMAX, 1e-30, -1e-40], device=device)
        elif i == 9:
            t = t * 1e-30  # tiny: s ~ 100 (2**s still a float32)
            t[:2] = torch.tensor([2.0**-149, -(2.0**-148)], device=device)
        elif i == 11:
            t = torch.randn(n, device=device, generator=g) * 1e-40  # float32 subnormals only: s > 127
            t[0] = -(2.0**-149)
        parts.append(t)
    return torch.cat(parts)


def _spans_blocks(sizes, parts: int) -> None:
    """The kernels' cases with ``sizes`` cut in ``parts`` shards (kernels/triton/allreduce.py): several
    blocks a shard, a ragged last block, a short last shard."""
    from tcprec.distributed.algorithms import wire_shard
    from tcprec.kernels.triton import allreduce as ka

    shard = wire_shard(sum(sizes), parts)
    assert shard > 2 * ka.BLOCK and shard % ka.BLOCK and sum(sizes) - (parts - 1) * shard < shard, (parts, shard)


def _covers_shifts(info) -> None:
    """APS shifts below 0 (2**s < 1) and above 127 (2**s past float32) both occurred, and zero tensors (s = 0)."""
    s = info.shifts.cpu()
    assert bool((s < 0).any() and (s > 127).any() and (s == 0).any()), s.tolist()


def _bad(a, b) -> torch.Tensor:
    a, b = a.cpu(), b.cpu()
    return ~((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b)))


def _same(a, b) -> bool:
    return not bool(_bad(a, b).any())


def _explain(flat, got, want, ig, iw, kw, fmt) -> str:
    """Where fused and reference differ: tensors, shifts, values, and the CPU reference there."""
    bad = _bad(got, want)
    idx = bad.nonzero().flatten()
    starts = torch.tensor([0] + list(itertools.accumulate(SIZES))[:-1])
    segs = torch.searchsorted(starts, idx, right=True) - 1
    cpu, _ = allreduce_lowp(flat.cpu(), SIZES, fmt, backend="reference", **kw)
    first = idx[:6]
    return (f"{int(bad.sum())} differ, tensors {sorted(set(segs.tolist()))[:12]}, shifts fused "
            f"{ig.shifts.cpu()[segs.unique()].tolist()[:12]} reference {iw.shifts.cpu()[segs.unique()].tolist()[:12]}; "
            f"at {first.tolist()}: fused {got.cpu()[first].tolist()} reference {want.cpu()[first].tolist()} "
            f"cpu reference {cpu[first].tolist()} inputs {flat.cpu()[:, first].tolist()}")


# (fmt, aps, kahan, rounding, local node counts): few variants, since each compiles its kernels
CASES = [("e4m3", True, False, "nearest", (1, 3, 8)), ("e5m2", True, True, "down", (3,)),
         ("e3m0", True, False, "up", (8,)), ("bf16", False, True, "toward_zero", (3,)),
         ("e4m3", False, False, "nearest", (3,))]


@pytest.mark.parametrize("fmt,aps,kahan,rounding,n_locals", CASES)
def test_fused_equals_reference_cuda(fmt, aps, kahan, rounding, n_locals):
    for n_local in n_locals:
        flat = torch.stack([node_grads(i) for i in range(n_local)])
        for transport in ("compressed", "emulate"):
            kw = dict(aps=aps, kahan=kahan, transport=transport, rounding=rounding)
            want, iw = allreduce_lowp(flat, SIZES, fmt, backend="reference", **kw)
            got, ig = allreduce_lowp(flat, SIZES, fmt, **kw)  # auto: the fused kernels on CUDA
            tag = (fmt, aps, kahan, rounding, transport, n_local)
            assert "fused" in ig.backend, (tag, ig.backend)
            assert _same(got, want), (tag, _explain(flat, got, want, ig, iw, kw, fmt))
            assert (ig.nonfinite_input, ig.nonfinite_output) == (iw.nonfinite_input, iw.nonfinite_output), tag
            assert torch.equal(ig.shifts, iw.shifts), tag


def test_exact_ties_after_scaling_cuda():
    """APS scales these onto exact e4m3 midpoints (23 * 2**-21 -> 23): fused, the reference on CUDA
    and the reference on the CPU agree (the CUDA reference once took 2**s from torch.ldexp)."""
    m = torch.arange(17, 32, 2, dtype=torch.float32)
    g = (torch.cat([m, -m, torch.tensor([127.0])]) * 2.0**-21).view(1, -1)
    want, _ = allreduce_lowp(g, [g.numel()], "e4m3")  # CPU: the reference
    for backend in ("auto", "reference"):
        got, _ = allreduce_lowp(g.cuda(), [g.numel()], "e4m3", backend=backend)
        assert _same(got, want), (backend, got.cpu().tolist(), want.tolist())


def test_graph_replays_equal_the_reference_cuda():
    """graph=True: captured once per buffer, replayed after; each replay sees the buffer's current
    values (the second call below changes them in place) and reports its own flags."""
    for n_local in (1, 3):
        flat = torch.stack([node_grads(i) for i in range(n_local)])
        for fmt, kw in (("e4m3", dict()), ("e5m2", dict(kahan=True, rounding="down", transport="emulate"))):
            for step in range(3):
                if step == 2:
                    flat.mul_(-0.5)
                want, iw = allreduce_lowp(flat, SIZES, fmt, backend="reference", **kw)
                got, ig = allreduce_lowp(flat, SIZES, fmt, graph=True, **kw)
                assert _same(got, want), (n_local, fmt, step, int(_bad(got, want).sum()))
                assert torch.equal(ig.shifts, iw.shifts) and not ig.nonfinite_input
        flat[0, 7] = float("nan")
        got, ig = allreduce_lowp(flat, SIZES, "e4m3", graph=True)
        assert ig.nonfinite_input and torch.isnan(got).all()


def test_nonfinite_input_cuda():
    flat = torch.stack([node_grads(i) for i in range(2)])
    flat[1, 12345] = float("nan")
    got, info = allreduce_lowp(flat, SIZES, "e4m3")
    assert info.nonfinite_input and torch.isnan(got).all()


def test_stochastic_rounding_is_refused():
    flat = torch.stack([node_grads(i) for i in range(2)])[:, :1000]
    with pytest.raises(ValueError, match="rounding must be one of.*stochastic rounding inside the all-reduce"):
        allreduce_lowp(flat, [1000], "e4m3", rounding="stochastic")


# ---- two GPUs, NCCL ------------------------------------------------------------------------------------


NCCL_CASES = [c[:4] for c in CASES[:2]]  # the kernels compiled above serve these too


def _nccl_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        res = {}
        for n_local in (1, 2):  # 1: the all-gather exchange; 2: reduce-scatter
            mine = torch.stack([node_grads(rank * n_local + i) for i in range(n_local)])  # node order: rank-major
            for fmt, aps, kahan, rounding in NCCL_CASES:
                for transport in ("compressed", "emulate"):
                    out, info = allreduce_lowp(mine, SIZES, fmt, aps=aps, kahan=kahan, transport=transport,
                                               rounding=rounding)
                    res[(n_local, fmt, transport)] = (out.cpu(), info.backend)
            for step in range(2):  # the CUDA graph path: NCCL collectives captured with the kernels
                out, info = allreduce_lowp(mine, SIZES, "e4m3", graph=True)
                res[(n_local, "e4m3", f"graph{step}")] = (out.cpu(), info.backend)
        save_rank(res, out_dir, rank)
    finally:
        release_graphs()  # before the communicator goes (a live graph holding NCCL kernels hung teardown)
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_equal_reference_nodes():
    world = 2
    res = run_ranks(_nccl_worker, world)
    for n_local, exchange in ((1, "all-gather"), (2, "reduce-scatter")):
        flat = torch.stack([node_grads(i) for i in range(n_local * world)])
        for fmt, aps, kahan, rounding in NCCL_CASES:
            want, _ = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, transport="emulate", rounding=rounding,
                                     backend="reference")
            for r in range(world):
                for transport in ("compressed", "emulate") + (("graph0", "graph1") if fmt == "e4m3" else ()):
                    got, backend = res[r][(n_local, fmt, transport)]
                    assert "fused" in backend and exchange in backend, backend
                    assert _same(got, want), (n_local, fmt, transport, r, int(_bad(got, want).sum()))


# ---- the reduction orders (ring, halving) and the torch engine's float32 tables on CUDA ----------


@pytest.mark.parametrize("algorithm,kahan", [("ring", False), ("ring", True), ("halving", False), ("direct", True)])
@pytest.mark.parametrize("n", [3, 8])
def test_orders_on_cuda_equal_cpu(algorithm, kahan, n):
    """The torch engine on CUDA tensors (what ring / halving run on GPUs, and direct with acc_format)
    gives the CPU's bits: emulated nodes on one GPU, against the same nodes on the CPU (SMALL: the
    CPU engine's cost grows with values x nodes)."""
    _spans_blocks(SMALL, n if algorithm == "ring" else 1 << (n.bit_length() - 1) if algorithm == "halving" else 1)
    flat = torch.stack([node_grads(i, sizes=SMALL) for i in range(n)])
    for fmt, acc in (("e4m3", None), ("e5m2", None), ("e4m3", "e5m10")):
        kw = dict(aps=True, kahan=kahan, algorithm=algorithm, acc_format=acc)
        got, info = allreduce_lowp(flat, SMALL, fmt, **kw)
        want, iw = allreduce_lowp(flat.cpu(), SMALL, fmt, **kw)
        _covers_shifts(iw)
        assert torch.equal(info.shifts.cpu(), iw.shifts), (algorithm, kahan, n, fmt, acc)
        # direct without acc_format, ring and halving (with or without) run the fused kernels (their own backend
        # string); direct with acc_format runs the torch engine with its float32 tables
        fused = (algorithm == "direct" and acc is None) or algorithm in ("ring", "halving")
        assert got.is_cuda and ("fused" in info.backend if fused else "float32 tables" in info.backend), info.backend
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), (algorithm, kahan, n, fmt, acc)


# the fused ring (one ring_step launch per step) and halving (one halving_step launch per level): formats,
# APS on / off, Kahan, acc_format, both transports
RING_CASES = [("e4m3", True, False, "nearest", None), ("e5m2", True, True, "down", None),
              ("e3m0", True, False, "up", None), ("e4m3", False, False, "nearest", None),
              ("e4m3", True, True, "nearest", "e5m10"), ("bf16", False, True, "toward_zero", None)]


@pytest.mark.parametrize("algorithm,n,case", [("ring", 2, 0)] + [("ring", 3, i) for i in range(len(RING_CASES))]
                         + [("ring", 8, 0), ("ring", 8, 1), ("ring", 8, 4)]
                         + [("halving", n, i) for n, i in ((2, 0), (3, 0), (3, 2), (3, 3), (5, 4), (8, 0), (8, 2))])
def test_ring_and_halving_fused_equal_cpu_cuda(algorithm, n, case):
    """The fused ring / halving kernels on CUDA (emulated nodes on one GPU) give the CPU engine's bits
    and bytes (halving: no Kahan; its cases drop the compensation).  SMALL: as in the test above."""
    fmt, aps, kahan, rounding, acc = RING_CASES[case]
    kahan = kahan and algorithm == "ring"
    _spans_blocks(SMALL, n if algorithm == "ring" else 1 << (n.bit_length() - 1))
    flat = torch.stack([node_grads(i, sizes=SMALL) for i in range(n)])
    for transport in ("compressed", "emulate"):
        kw = dict(aps=aps, kahan=kahan, rounding=rounding, transport=transport, algorithm=algorithm, acc_format=acc)
        got, ig = allreduce_lowp(flat, SMALL, fmt, **kw)
        want, iw = allreduce_lowp(flat.cpu(), SMALL, fmt, **kw)
        if aps:
            _covers_shifts(iw)
        assert "fused" in ig.backend and f"{algorithm} order" in ig.backend, ig.backend
        assert _same(got, want), (fmt, aps, kahan, rounding, acc, transport, n, int(_bad(got, want).sum()))
        assert ig.bytes_received == iw.bytes_received and ig.nonfinite_output == iw.nonfinite_output
        assert torch.equal(ig.shifts.cpu(), iw.shifts.cpu())


@pytest.mark.parametrize("algorithm,n,most", [("ring", 2, 2 + 4), ("ring", 8, 8 + 4), ("halving", 8, 3 + 3 + 2)])
def test_fused_orders_launch_a_handful_of_kernels(algorithm, n, most):
    """One call is a handful of GPU kernels (ring: zero fill, amax, encode, N steps, finish; halving:
    zero fill, amax, encode, log2 N levels, the emulated gather, finish), not the engine's thousands
    of torch ops: counted with the profiler on the second call (the first compiles)."""
    from torch.profiler import ProfilerActivity, profile

    flat = torch.stack([node_grads(i) for i in range(n)])
    allreduce_lowp(flat, SIZES, "e4m3", algorithm=algorithm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        allreduce_lowp(flat, SIZES, "e4m3", algorithm=algorithm)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert 0 < len(kernels) <= most, (algorithm, n, len(kernels), kernels[:20])


@pytest.mark.parametrize("algorithm", ["ring", "halving"])
def test_ring_and_halving_graph_replays_equal_eager(algorithm):
    """graph=True captures the fused ring / halving call (kernels only, emulated nodes) and replays it:
    the same bits as an eager call, for two different inputs in the same buffer."""
    flat = torch.stack([node_grads(i) for i in range(3)]).contiguous()
    kw = dict(algorithm=algorithm, acc_format="e5m10")
    try:
        for scale in (1.0, 1e-3):
            flat.mul_(scale)
            want, _ = allreduce_lowp(flat, SIZES, "e4m3", **kw)
            got, info = allreduce_lowp(flat, SIZES, "e4m3", graph=True, **kw)
            assert f"{algorithm} order" in info.backend and _same(got, want), (algorithm, scale)
    finally:
        release_graphs()


def _orders_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        res = {}
        for alg in ("direct", "ring", "halving"):
            out, info = allreduce_lowp(node_grads(rank).view(1, -1), SIZES, "e4m3", algorithm=alg)
            assert "fused" in info.backend, info.backend
            res[alg] = out.cpu()
        save_rank(res, out_dir, rank)
    finally:
        release_graphs()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL runs one rank per GPU)")
def test_orders_nccl_equal_emulation():
    world = 2
    res = run_ranks(_orders_worker, world)
    flat = torch.stack([node_grads(i) for i in range(world)]).cpu()
    for alg in ("direct", "ring", "halving"):
        want, _ = allreduce_lowp(flat, SIZES, "e4m3", algorithm=alg)
        for r in range(world):
            assert torch.equal(res[r][alg].view(torch.int32), want.view(torch.int32)), (alg, r)


# ---- tcprec train --algorithm on a GPU: the emulated nodes sum in exactly the chosen order -------------------------


@pytest.mark.parametrize("algorithm", ["direct", "ring", "halving"])
def test_emulated_nodes_on_cuda_sum_in_the_chosen_order(algorithm):
    """EmulatedNodes(algorithm=) on CUDA (what `tcprec train --algorithm` and `tcprec bench cpd` run) reduces the 8
    nodes' gradients to the CPU engine's bits of the same gradients in that order (one backward: cuDNN's may not
    repeat bit for bit)."""
    torch.manual_seed(0)
    net = MODELS["tiny_cnn"]().cuda()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 1, 28, 28, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()
    em = EmulatedNodes(net, n_local=8, fmt="e4m3", algorithm=algorithm)
    _, flat = em.node_grads(F.cross_entropy, x, y)
    want, _ = allreduce_lowp(flat.cpu(), [p.numel() for p in em.params], "e4m3", algorithm=algorithm)
    got, _ = em.reduce(flat)
    assert got.is_cuda and torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), algorithm
