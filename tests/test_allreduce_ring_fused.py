"""The fused kernels of the ring and halving orders (kernels/triton/allreduce.py: ``ring_step``, one
launch per step; ``halving_step``, one launch per level) equal the float64 engine's orders
(distributed/algorithms.py) bit for bit, through Triton's interpreter on the CPU: emulated nodes
N = 2, 3, 4, 8, e4m3 / e5m2 / e3m0 (APS on and off), partial sums in acc_format e5m10, Kahan (ring),
both transports; and three gloo processes (the send / recv paths, halving's fold of a third node).
tests/gpu/test_allreduce_gpu.py repeats this on CUDA.  Blocks are 64 elements (as
test_allreduce_fused.py) so that 476 values cross block and shard boundaries."""

import pytest
import torch

from tcprec.distributed import allreduce_lowp

from _aot import compile_ptx, require_nvidia_backend, run_aot
from _dist import gloo_group, run_ranks, save_rank
from test_allreduce_fused import SIZES, _same, node_grads

ka = pytest.importorskip("tcprec.kernels.triton.allreduce", reason="triton is a Linux dependency of tcprec")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(ka, "BLOCK", 64)


def _check(flat, fmt, aps, kahan, rounding, acc=None, algorithm="ring"):
    for transport in ("compressed", "emulate"):
        kw = dict(aps=aps, kahan=kahan, transport=transport, rounding=rounding, algorithm=algorithm, acc_format=acc)
        want, iw = allreduce_lowp(flat, SIZES, fmt, backend="reference", **kw)
        got, ig = allreduce_lowp(flat, SIZES, fmt, backend="triton", **kw)
        tag = (fmt, aps, kahan, rounding, acc, transport, flat.shape[0])
        assert _same(got, want), tag
        assert f"{algorithm} order" in ig.backend and "fused" in ig.backend, ig.backend
        assert ig.nonfinite_input == iw.nonfinite_input and ig.nonfinite_output == iw.nonfinite_output, tag
        if not iw.nonfinite_input:  # (the engine stops before the exchange; the kernels, without a host sync, do not)
            assert torch.equal(ig.shifts, iw.shifts) and ig.bytes_received == iw.bytes_received, tag


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_steps_equal_the_engine(n):
    flat = torch.stack([node_grads(i) for i in range(n)])
    _check(flat, "e4m3", True, False, "nearest")
    _check(flat, "e3m0", True, n == 8, "nearest")  # Kahan at N = 8: 7 steps carrying the compensation


@pytest.mark.parametrize("fmt,aps,kahan,rounding,acc", [
    ("e4m3", True, True, "up", None),
    ("e5m2", True, False, "down", None),
    ("e3m0", False, False, "nearest", None),  # overflowing partial sums: Inf, Inf - Inf = NaN -> +Inf on the wire
    ("e5m2", False, True, "toward_zero", None),
    ("e4m3", True, False, "nearest", "e5m10"),  # partial sums in fp16: int16 codes travel
    ("e3m0", True, True, "up", "e5m10"),
])
def test_ring_formats_kahan_and_acc_format(fmt, aps, kahan, rounding, acc):
    flat = torch.stack([node_grads(i) for i in range(3)])
    _check(flat, fmt, aps, kahan, rounding, acc)


def test_ring_nonfinite_input():
    flat = torch.stack([node_grads(i) for i in range(3)])
    flat[2, 300] = float("nan")
    _check(flat, "e4m3", True, False, "nearest")
    got, info = allreduce_lowp(flat, SIZES, "e4m3", algorithm="ring", backend="triton")
    assert info.nonfinite_input and torch.isnan(got).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_halving_levels_equal_the_engine(n):
    flat = torch.stack([node_grads(i) for i in range(n)])
    _check(flat, "e4m3", True, False, "nearest", algorithm="halving")
    if n in (3, 8):  # 3: a folded node; 8: three levels
        _check(flat, "e3m0", False, False, "up", algorithm="halving")
        _check(flat, "e5m2", True, False, "down", "e5m10", algorithm="halving")


def test_what_the_fused_kernels_refuse_is_stated():
    flat = torch.stack([node_grads(i) for i in range(2)])
    with pytest.raises(ValueError, match="round partial sums to the wire format only"):
        allreduce_lowp(flat, SIZES, "e4m3", algorithm="direct", acc_format="e5m10", backend="triton")
    for alg in ("ring", "halving"):  # (graph=True on CUDA: tests/gpu)
        with pytest.raises(ValueError, match="graph=True needs CUDA tensors"):
            allreduce_lowp(flat, SIZES, "e4m3", algorithm=alg, graph=True, backend="triton")


# ---- three processes (gloo): send / recv between ranks; halving folds the third node ------------------


# (algorithm, fmt, aps, kahan, rounding, acc_format, transports)
CONFIGS = [("ring", "e4m3", True, False, "nearest", None, ("compressed", "emulate")),
           ("ring", "e5m2", True, True, "up", "e5m10", ("compressed",)),
           ("halving", "e4m3", True, False, "nearest", None, ("compressed", "emulate")),
           ("halving", "e3m0", False, False, "up", "e5m10", ("compressed",))]


def _worker(rank, world, port, out_dir):
    ka.BLOCK = 64
    with gloo_group(rank, world, port):
        res = {}
        for n_local in (1, 2):
            mine = torch.stack([node_grads(rank * n_local + i) for i in range(n_local)])
            for alg, fmt, aps, kahan, rounding, acc, transports in CONFIGS:
                if alg == "halving" and n_local > 1:
                    continue  # one node per process when distributed
                for transport in transports:
                    out, info = allreduce_lowp(mine, SIZES, fmt, aps=aps, kahan=kahan, rounding=rounding,
                                               algorithm=alg, acc_format=acc, transport=transport, backend="triton")
                    res[(n_local, alg, fmt, acc, transport)] = (out, info.backend, info.bytes_received)
        save_rank(res, out_dir, rank)


def test_gloo_three_processes_fused_equal_emulation():
    world = 3
    res = run_ranks(_worker, world)
    for n_local in (1, 2):
        flat = torch.stack([node_grads(i) for i in range(n_local * world)])
        for alg, fmt, aps, kahan, rounding, acc, transports in CONFIGS:
            if alg == "halving" and n_local > 1:
                continue
            for transport in transports:
                want, iw = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, rounding=rounding, algorithm=alg,
                                          acc_format=acc, transport=transport, backend="reference")
                got_bytes = []
                for r in range(world):
                    got, backend, nbytes = res[r][(n_local, alg, fmt, acc, transport)]
                    assert f"{alg} order" in backend and _same(got, want), (n_local, alg, fmt, acc, transport, r)
                    got_bytes.append(nbytes)
                if n_local == 1:  # one node per process: the emulation counts what the busiest node receives
                    assert max(got_bytes) == iw.bytes_received, (alg, fmt, transport, got_bytes, iw.bytes_received)


# ---- the step kernels compile for sm_90 (no GPU needed) ------------------------------------------------


def test_ring_and_halving_steps_compile_for_sm90():
    """In a subprocess without TRITON_INTERPRET: Triton's NVIDIA backend builds both step kernels
    (codes with the fp8 hardware rounding, int16 codes of acc_format, Kahan, float32 values)."""
    out = run_aot(__file__, timeout=300)
    assert out.count("cvt.rn.satfinite.e4m3x2.f32") == 2 and "OK" in out


def _aot_main():
    require_nvidia_backend()
    from tcprec.formats import format
    from tcprec.kernels.triton.cast import _float_constexprs

    fn = ka._ring_step_kernel
    seen = []
    for fmt, acc, kahan, codes, hw, first, last in (("e4m3", "e4m3", False, True, 1, False, False),
                                                    ("e4m3", "e5m10", True, True, 0, False, False),
                                                    ("e5m2", "e5m2", True, False, 0, True, False),
                                                    ("e3m0", "e3m0", False, True, 0, False, True)):
        a, s = format(fmt), format(acc)
        consts = dict(**_float_constexprs(s), MODE=0, KAHAN=kahan, FIRST=first, LAST=last,
                      KO=1 if last or not kahan else 2, CODES=codes, N_CODES_A=a.n_codes,
                      DEC_A=ka._BITCAST_FORMATS.get(a, 0), N_CODES=s.n_codes, DEC=ka._BITCAST_FORMATS.get(s, 0), HW=hw,
                      BLOCK=2048)
        wire = ("*i16" if s.bits > 8 else "*u8") if codes else "*fp32"
        types = dict(recv_ptr=wire, prev_ptr=wire, q_ptr="*u8" if codes else "*fp32", out_ptr=wire, lut_a_ptr="*fp32",
                     lut_s_ptr="*fp32", n_local="i32", n="i32", shard="i32", rank="i32", t="i32")
        ptx = compile_ptx(fn, types, consts, div=("shard",))
        seen += [m for m in ("cvt.rn.satfinite.e4m3x2.f32",) if m in ptx]
    fn = ka._halving_step_kernel
    for acc, codes, hw, fold, last, dist_ in (("e4m3", True, 1, False, True, False),
                                              ("e5m10", True, 0, True, False, True),
                                              ("e3m0", False, 0, False, True, True)):
        s = format(acc)
        consts = dict(**_float_constexprs(s), MODE=0, FOLD=fold, LAST=last, DIST=dist_, CODES=codes, N_CODES=s.n_codes,
                      DEC=ka._BITCAST_FORMATS.get(s, 0), HW=hw, BLOCK=2048)
        wire = ("*i16" if s.bits > 8 else "*u8") if codes else "*fp32"
        types = dict(v_ptr=wire, recv_ptr=wire, lut_ptr="*fp32", L="i32", shard="i32", d="i32", P="i32", rank="i32")
        ptx = compile_ptx(fn, types, consts, div=("L", "shard"))
        seen += [m for m in ("cvt.rn.satfinite.e4m3x2.f32",) if m in ptx]
    print(*seen, "OK")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--aot"]:
        _aot_main()
