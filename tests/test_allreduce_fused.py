"""The fused all-reduce kernels (kernels/triton/allreduce.py) equal the float64 reference of
distributed/lowp.py bit for bit, run through Triton's interpreter on the CPU (tests/gpu repeats this
on CUDA).  Blocks are shrunk to 64 elements so that small inputs cross every block case: a block
inside one tensor (one float32 multiply, or the float64 round-to-odd path when s < 0 or s > 127),
a block straddling tensors (per-element lookup), padding of the last shard."""

import numpy as np
import pytest
import torch

from tcprec.distributed import allreduce_lowp
from tcprec.formats import FloatFormat, format

from _aot import compile_ptx, require_nvidia_backend, run_aot
from _dist import gloo_group, run_ranks, save_rank
from _oracles import same_float

ka = pytest.importorskip("tcprec.kernels.triton.allreduce", reason="triton is a Linux dependency of tcprec")

FMAX = torch.finfo(torch.float32).max
SIZES = [7, 150, 1, 33, 100, 140, 40, 5]  # 476 values: tensor 3 is all zero on every node


def node_grads(node: int) -> torch.Tensor:
    """Node ``node``'s flat gradient: ordinary, all-zero, huge (up to the float32 max, with tiny
    values beside it), tiny (1e-38 and float32 subnormals), a 1e-30..1e30 spread, signed zeros."""
    g = torch.Generator().manual_seed(1000 + node)
    r = lambda n: torch.randn(n, generator=g)  # noqa: E731
    t = [r(7) * 1e-3,
         r(150) * torch.logspace(-4, 0, 150),
         r(1) * 5.0,
         torch.zeros(33),
         (torch.rand(100, generator=g) * 2 - 1) * FMAX,
         r(140) * 1e-38,
         r(40) * torch.logspace(-30, 30, 40),
         torch.tensor([0.0, -0.0, 1.0, -2.0 ** -149, 2.0 ** -140])]
    t[4][:3] = torch.tensor([FMAX, -FMAX, 1e-30]) if node % 2 == 0 else torch.tensor([1e-30, 3.0, -1e-40])
    t[5][:4] = torch.tensor([2.0 ** -149, -2.0 ** -148, 3 * 2.0 ** -149, 1e-39])
    return torch.cat(t)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits, or NaN in both (NaN payloads are not part of the contract)."""
    return bool(same_float(a.numpy(), b.numpy()).all())


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(ka, "BLOCK", 64)


def _check(flat, fmt, aps, kahan, rounding, sizes=SIZES):
    for transport in ("compressed", "emulate"):
        want, iw = allreduce_lowp(flat, sizes, fmt, aps=aps, kahan=kahan, transport=transport, rounding=rounding,
                                  backend="reference")
        got, ig = allreduce_lowp(flat, sizes, fmt, aps=aps, kahan=kahan, transport=transport, rounding=rounding,
                                 backend="triton")
        tag = (fmt, aps, kahan, rounding, transport, flat.shape[0])
        bad = ~torch.from_numpy(same_float(got.numpy(), want.numpy()))
        assert not bad.any(), (tag, bad.nonzero()[:5].flatten().tolist(), got[bad][:5].tolist(), want[bad][:5].tolist())
        assert ig.nonfinite_input == iw.nonfinite_input and ig.nonfinite_output == iw.nonfinite_output, tag
        if not iw.nonfinite_input:
            assert torch.equal(ig.shifts, iw.shifts), tag
        assert "fused" in ig.backend and "reference" in iw.backend


@pytest.mark.parametrize("rounding", ["nearest", "up"])
@pytest.mark.parametrize("kahan", [False, True])
@pytest.mark.parametrize("aps", [True, False])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m0"])
def test_fused_equals_reference(fmt, aps, kahan, rounding):
    flat = torch.stack([node_grads(i) for i in range(3)])
    _check(flat, fmt, aps, kahan, rounding)


@pytest.mark.parametrize("n_local", [1, 8])
@pytest.mark.parametrize("kahan", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m0"])
def test_one_and_eight_nodes(fmt, kahan, n_local):
    flat = torch.stack([node_grads(i) for i in range(n_local)])
    _check(flat, fmt, True, kahan, "nearest" if kahan else "up")
    if fmt == "e4m3" and not kahan:
        _check(flat, fmt, False, kahan, "nearest")


def test_exact_ties_after_scaling():
    # values that APS scales onto exact midpoints of e4m3's grid (23 * 2**-21 -> 23, between 22 and 24)
    m = torch.arange(17, 32, 2, dtype=torch.float32)  # odd: every one a tie in [16, 32)
    g = torch.cat([m, -m, torch.tensor([2.0**7 - 1])]) * 2.0**-21  # max 127 * 2**-21: e = -14, s = 21
    for n_local in (1, 3):
        _check(torch.stack([g] * n_local), "e4m3", True, False, "nearest", sizes=[g.numel()])


@pytest.mark.parametrize("rounding", ["nearest_away", "toward_zero", "down"])
def test_other_directed_modes(rounding):
    flat = torch.stack([node_grads(i) for i in range(3)])
    for fmt in ("e4m3", "e5m2"):
        _check(flat, fmt, True, rounding == "down", rounding)


@pytest.mark.parametrize("fmt", ["e5m10", "bf16", "e2m3", "e4m3fnuz"])
def test_16_bit_codes_and_other_specials(fmt):
    # int16 codes on the wire (e5m10, bf16); a format without NaN (e2m3: NaN -> +Inf, saturating);
    # NaN on the sign bit and no -0 (fnuz).  Without APS, bf16 sums past float32's max in every mode.
    flat = torch.stack([node_grads(i) for i in range(3)])
    if fmt != "e2m3":  # e2m3 has too few exponent bits for APS over 3 nodes (check_aps_format raises)
        _check(flat, fmt, True, fmt == "bf16", "nearest")
    for rounding in ("toward_zero", "up"):  # past the format's max: saturate / Inf / NaN by mode
        _check(flat, fmt, False, fmt == "bf16", rounding)


def test_signed_zeros_when_negation_is_zero_minus_x(monkeypatch):
    """Triton up to 3.6 compiles a float ``-x`` as ``0 - x``, which gives +0 for x = +0 (later
    versions emit a sign flip).  The Kahan sums negate their compensation (``q - c`` with c = +0):
    with ``0 - x``, -0 + -(+0) became +0 and a sum of -0's came out +0, so on the H200 (Triton 3.6)
    bf16 / Kahan / toward_zero differed from the reference in the sign of zero.  Here the
    interpreter is given that old rule; the kernels must not depend on it."""
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpreterBuilder, "create_fneg"):
        pytest.skip("this Triton's interpreter already negates floats as 0 - x")
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fneg",
                        lambda self, x: self.unary_op(x, lambda a: np.subtract(np.zeros_like(a), a)))
    # every node holds -0 and values that round to -0 toward zero (|x| < bf16's smallest subnormal)
    flat = torch.stack([node_grads(i) for i in range(3)])
    for fmt, rounding in (("bf16", "toward_zero"), ("e4m3", "nearest"), ("e5m2", "up")):
        _check(flat, fmt, False, True, rounding)


def test_nonfinite_input_flag():
    flat = torch.stack([node_grads(i) for i in range(3)])
    for bad in (float("nan"), float("-inf")):
        f = flat.clone()
        f[1, 200] = bad
        _check(f, "e4m3", True, False, "nearest")
        got, info = allreduce_lowp(f, SIZES, "e4m3", backend="triton", transport="emulate")
        assert info.nonfinite_input and not info.nonfinite_output
        assert torch.isnan(got).all()


def test_single_tensor_and_uneven_shapes():
    for numel in (1, 63, 64, 65, 130):
        g = torch.Generator().manual_seed(numel)
        flat = torch.randn(3, numel, generator=g) * 1e-2
        _check(flat, "e4m3", True, True, "nearest", sizes=[numel])
        _check(flat, "e5m2", True, False, "up", sizes=[1] * numel)
    # empty tensors among the sizes (equal starts: the per-block tensor table must agree with the
    # device's search, the largest t whose start is <= the index)
    flat = torch.stack([node_grads(i) for i in range(3)])
    _check(flat, "e4m3", True, False, "nearest", sizes=[0, 70, 0, 0, 200, 1, 0, 205, 0])


def test_graph_needs_the_fused_cuda_path():
    with pytest.raises(ValueError, match="graph=True needs CUDA tensors"):
        allreduce_lowp(torch.ones(2, 4), [4], "e4m3", graph=True)
    with pytest.raises(ValueError, match="graph=True needs CUDA tensors"):
        allreduce_lowp(torch.ones(2, 4), [4], "e4m3", graph=True, backend="triton")


def test_fast_path_availability_is_stated():
    assert ka.can_implement(format("e4m3"), "nearest") is None
    assert "stochastic" in ka.can_implement(format("e4m3"), "stochastic")
    assert "16 bits" in ka.can_implement(FloatFormat(exp=8, man=10), "nearest")
    for backend in ("triton", "reference", "auto"):  # the all-reduce refuses it up front, on every path
        with pytest.raises(ValueError, match="rounding must be one of.*stochastic rounding inside the all-reduce"):
            allreduce_lowp(torch.ones(2, 4), [4], "e4m3", rounding="stochastic", backend=backend)
    with pytest.raises(ValueError, match="rounding must be one of"):
        allreduce_lowp(torch.ones(2, 4), [4], "e4m3", rounding="nearest_even")
    _, info = allreduce_lowp(torch.ones(2, 4), [4], "e4m3")  # a CPU tensor: the torch engine, and it says so
    assert "pure-torch engine" in info.backend and "float32 tables" in info.backend


def test_launcher_reuses_the_compiled_kernel(monkeypatch):
    """The direct launch (no GPU here: a stand-in for Triton's JIT function and compiled kernel)
    passes every argument in signature order, constexprs in place, on a 3-d grid; a new
    specialization (alignment, an integer becoming a multiple of 16) compiles again."""
    calls = []

    class Compiled:
        function, run = object(), object()

        def __getitem__(self, grid):
            return lambda *a: calls.append(("direct", grid, a))

    class Fn:
        arg_names = ["x_ptr", "n", "K", "BLOCK"]

        def __getitem__(self, grid):
            def run(*a, **k):
                calls.append(("jit", grid, a, k))
                return Compiled()
            return run

    monkeypatch.setattr(ka._Launcher, "direct", True)
    launch = ka._Launcher(Fn())
    x = torch.zeros(8)
    launch((4,), (x, 5), dict(K=3, BLOCK=64), ("k",))
    launch((4,), (x, 7), dict(K=3, BLOCK=64), ("k",))
    launch((4,), (x, 32), dict(K=3, BLOCK=64), ("k",))
    assert [c[0] for c in calls] == ["jit", "direct", "jit"]
    assert calls[1][1] == (4, 1, 1) and calls[1][2] == (x, 7, 3, 64)


# ---- two processes (gloo): the fused path with real collectives -------------------------------


CONFIGS = [("e4m3", True, False, "nearest"), ("e5m2", True, True, "up"), ("e3m0", True, False, "nearest"),
           ("e5m10", False, False, "down")]


def _worker(rank, world, port, out_dir):
    ka.BLOCK = 64
    with gloo_group(rank, world, port):
        res = {}
        for n_local in (1, 2):  # 1: the all-gather exchange; 2: reduce-scatter (lowp._gathers)
            mine = torch.stack([node_grads(rank * n_local + i) for i in range(n_local)])  # node order: rank-major
            for fmt, aps, kahan, rounding in CONFIGS:
                for transport in ("emulate", "compressed"):
                    out, info = allreduce_lowp(mine, SIZES, fmt, aps=aps, kahan=kahan, transport=transport,
                                               rounding=rounding, backend="triton")
                    res[(n_local, fmt, aps, kahan, rounding, transport)] = (out, info.backend)
        save_rank(res, out_dir, rank)


def test_gloo_two_processes_fused_equal_reference_nodes():
    world = 2
    res = run_ranks(_worker, world)
    for n_local, exchange in ((1, "all-gather"), (2, "reduce-scatter")):
        flat = torch.stack([node_grads(i) for i in range(n_local * world)])
        for fmt, aps, kahan, rounding in CONFIGS:
            want, _ = allreduce_lowp(flat, SIZES, fmt, aps=aps, kahan=kahan, transport="emulate", rounding=rounding,
                                     backend="reference")
            for r in range(world):
                for transport in ("emulate", "compressed"):
                    got, backend = res[r][(n_local, fmt, aps, kahan, rounding, transport)]
                    assert exchange in backend
                    assert _same(got, want), (n_local, fmt, transport, r)


# ---- the kernels compile for sm_90 (no GPU needed) ------------------------------------------------


def test_kernels_compile_for_sm90():
    """In a subprocess without TRITON_INTERPRET: Triton's NVIDIA backend builds every kernel (the
    float64 mean divides with div.rn.f64, the correctly rounded division the reference does)."""
    out = run_aot(__file__, timeout=300)
    assert "div.rn.f64" in out and "OK" in out


def _aot_main():
    require_nvidia_backend()
    from tcprec.kernels.triton.cast import _float_constexprs

    fmt = format("e4m3")
    fc = _float_constexprs(fmt)
    aps = dict(APS=True, TOP=7)
    compile_ptx(ka._amax_kernel, dict(g_ptr="*fp32", state_ptr="*i32", blk_ptr="*i32", starts_ptr="*i64",
                                      n_local="i32", numel="i32", T="i32"), dict(BLOCK=2048), div=("numel",))
    for codes, hw in ((True, 1), (False, 0)):
        compile_ptx(ka._encode_kernel, dict(g_ptr="*fp32", send_ptr="*u8" if codes else "*fp32", state_ptr="*i32",
                                            blk_ptr="*i32", starts_ptr="*i64", n_local="i32", numel="i32",
                                            shard="i32", T="i32", n="i32"),
                    dict(**aps, **fc, MODE=0, CODES=codes, HW=hw, BLOCK=2048), div=("numel", "shard"))
    compile_ptx(ka._reduce_kernel, dict(recv_ptr="*u8", out_ptr="*u8", lut_ptr="*fp32", n="i32", shard="i32"),
                dict(**fc, MODE=3, KAHAN=True, CODES=True, N_CODES=256, DEC=1, HW=0, BLOCK=2048), div=("shard",))
    mean = dict(wire_ptr="*u8", out_ptr="*fp32", lut_ptr="*fp32", state_ptr="*i32", blk_ptr="*i32",
                starts_ptr="*i64", numel="i32", T="i32", inv_n="fp32", n="i32")
    ptx = compile_ptx(ka._finish_kernel, mean, dict(**aps, N_POW2=False, LOG2N=0, CODES=True, N_CODES=256, DEC=0,
                                                    BLOCK=2048), div=("numel",))
    compile_ptx(ka._finish_kernel, dict(mean, wire_ptr="*fp32"),
                dict(**aps, N_POW2=True, LOG2N=1, CODES=False, N_CODES=256, DEC=2, BLOCK=2048), div=("numel",))
    for codes, hw, dec, pow2 in ((True, 1, 1, True), (False, 0, 0, False)):
        rf = compile_ptx(ka._reduce_finish_kernel, dict(mean, row="i32", wire_ptr="*u8" if codes else "*fp32"),
                         dict(**fc, **aps, N_POW2=pow2, LOG2N=1 if pow2 else 0, MODE=0, KAHAN=not codes,
                              CODES=codes, N_CODES=256, DEC=dec, HW=hw, BLOCK=2048), div=("numel", "row"))
        if hw:
            assert "cvt.rn.satfinite.e4m3x2.f32" in rf, "the fp8 rounding is not the hardware conversion"
    print("div.rn.f64" if "div.rn.f64" in ptx else "no div.rn.f64", "OK")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--aot"]:
        _aot_main()
