"""The warp-specialised INT8 GEMM (``kernels/cuda/i8_gemm.cu``) without a GPU: every shipped tile with every epilogue
compiles for sm_90a through NVRTC without spills, its PTX has the instructions meant; the pure-torch reference
(``kernels/reference_i8_gemm.py``) on closed-form cases; the entry's input errors.  The GPU side (the kernel against
the reference, CUDA graphs) is tests/gpu/test_i8_gemm_gpu.py."""

import math

import pytest
import torch
from test_cuda_compile import nvrtc_reason  # (the one NVRTC probe of the compile tests)

from tcprec.kernels.reference_i8_gemm import i8_gemm_acc, i8_gemm_reference

needs_nvrtc = pytest.mark.skipif(nvrtc_reason is not None, reason=f"NVRTC not importable: {nvrtc_reason}")


def _variants():
    """Every shipped tile with every epilogue the kernel compiles (bias, none / fp32 / fp16, is a run-time argument)."""
    from tcprec.kernels.cuda import i8_gemm as L

    kinds = [("float16", False, False), ("float16", True, False), ("float16", False, True), ("float16", True, True),
             ("int8", False, False), ("int8", True, False)]
    return [L.Variant(t, out, gelu, res) for t in L.TILES for out, gelu, res in kinds]


@needs_nvrtc
def test_every_variant_compiles_for_sm90a_without_spills():
    from tcprec.kernels.cuda import i8_gemm as L

    vs = _variants()
    L.precompile(vs, "sm_90a", workers=2)
    for v in vs:
        cubin, log = L.compile_variant(v, "sm_90a")
        assert cubin[:4] == b"\x7fELF", str(v)
        line = next(ln for ln in log.splitlines() if "spill stores" in ln)
        assert "0 bytes spill stores" in line and "0 bytes stack frame" in log, (str(v), log[-400:])


@needs_nvrtc
@pytest.mark.parametrize("name,shape,out,gelu,regs", [("pp_64x256_s5_e1", "m64n256k32", "float16", False, (232, 40)),
                                                      ("pp_64x128_s8_e1", "m64n128k32", "int8", True, (232, 40)),
                                                      ("pp3_64x128_s8_e1", "m64n128k32", "int8", True, (160, 32))])
def test_ptx_has_wgmma_s8_tma_and_setmaxnreg(name, shape, out, gelu, regs):
    from cuda.bindings import nvrtc  # (cuda.core's PTX target wants the driver; NVRTC itself does not)

    from tcprec.kernels.cuda import i8_gemm as L
    from tcprec.kernels.cuda.runtime import source_text

    v = L.Variant(L.parse_tile(name), out, gelu)
    err, prog = nvrtc.nvrtcCreateProgram(source_text(L.SOURCE_PATH).encode(), b"i8_gemm.cu", 0, [], [])
    opts = [b"--gpu-architecture=compute_90a", b"--std=c++17"] + [f"-D{d}".encode() for d in v.defines()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert int(err) == 0, err
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(prog, buf)
    ptx = buf.decode()
    assert f"wgmma.mma_async.sync.aligned.{shape}.s32.s8.s8" in ptx
    for ins in ("cp.async.bulk.tensor.2d", f"setmaxnreg.inc.sync.aligned.u32 {regs[0]}",
                f"setmaxnreg.dec.sync.aligned.u32 {regs[1]}",
                "mbarrier.try_wait.parity", "wgmma.wait_group.sync.aligned 1", "fence.mbarrier_init"):
        assert ins in ptx, ins
    assert "bar.arrive" in ptx  # the ping-pong order barrier
    assert "st.global.v4" in ptx and "shfl.sync.bfly" in ptx  # the fast epilogue's 16-byte stores, quad transpose
    if out == "int8":  # codes packed four to a word, then 16 to a lane
        assert "prmt.b32" in ptx


def test_tiles_parse_validate_and_fit_shared_memory():
    from tcprec.kernels.cuda import i8_gemm as L

    assert [str(t) for t in L.TILES] == ["pp_64x256_s5_e1", "pp_64x128_s8_e1", "pp3_64x128_s8_e1"]
    assert L.DEFAULT_TILE == L.TILES[2] and L.GELU_TILE == L.TILES[0]
    assert L.default_tile(False) == L.DEFAULT_TILE and L.default_tile(True) == L.GELU_TILE
    for t in L.TILES:
        assert L.parse_tile(str(t)) == t and t.smem_bytes <= 232448 and t.stages == L.max_stages(t)
        assert t.threads == 128 * (t.consumers + 1)
    assert L.TILES[0].smem_bytes == 210000  # the layout the H200 ran (i8_gemm.cu SMEM_BYTES)
    assert L.TILES[2].smem_bytes - L.TILES[1].smem_bytes == 128 * 8  # a third consumer's scales and biases
    with pytest.raises(ValueError, match="accumulator registers"):
        L.Tile(128, 256, 3)
    with pytest.raises(ValueError, match="consumers must be 2 or 3, got 4"):
        L.Tile(64, 128, 4, consumers=4)
    with pytest.raises(ValueError, match="at most 64 accumulators"):
        L.Tile(64, 256, 5, consumers=3)
    with pytest.raises(ValueError, match="stages must be 3..5"):
        L.Tile(64, 256, 6)
    for bad in ("128x256", "coop_128x256_s4", "pp_128x128_s6", "pp_128x128_s6_e0", "pp_128x128_s6_x1",
                "pp4_64x128_s8_e1"):
        with pytest.raises(ValueError, match="tile must look like"):
            L.parse_tile(bad)
    with pytest.raises(ValueError, match="int8 codes take no residual"):
        L.Variant(L.DEFAULT_TILE, "int8", residual=True)


# ---- the reference on closed-form cases ----

def _i8(rows):
    return torch.tensor(rows, dtype=torch.int8)


def test_reference_accumulator_is_exact_at_the_int8_extremes():
    K = 4096
    a = torch.full((2, K), -128, dtype=torch.int8)
    a[1, ::2] = 127
    w = torch.full((3, K), -128, dtype=torch.int8)
    w[2] = 1
    acc = i8_gemm_acc(a, w)
    assert acc[0, 0].item() == K * 16384 and acc[0, 2].item() == -128 * K
    assert acc[1, 0].item() == (K // 2) * (127 * -128) + (K // 2) * 16384
    assert acc.abs().max().item() < 2**31


def test_reference_epilogue_order_and_roundings():
    a, w = _i8([[3]]), _i8([[1], [7]])
    # acc = 3, 21;  scale product first: a_scale * w_scale[n], then one multiply, then the bias
    a_s, w_s = torch.tensor([0.1]), torch.tensor([0.3, 1.0])
    got = i8_gemm_reference(a, w, a_s, w_s, torch.tensor([0.5, -1.0], dtype=torch.float16))
    sc = torch.tensor(0.1, dtype=torch.float32) * torch.tensor([0.3, 1.0])
    want = (torch.tensor([3.0, 21.0]) * sc + torch.tensor([0.5, -1.0])).to(torch.float16)
    assert torch.equal(got[0], want)
    # an accumulator above 2^24 rounds to nearest even on the way to float32
    big = i8_gemm_reference(_i8([[1]]), _i8([[1]]), torch.tensor([1.0]), torch.tensor([1.0]),
                            acc=torch.tensor([[2**24 + 1]]))
    assert big.dtype == torch.float16 and big.float().item() == float(torch.tensor(2.0**24, dtype=torch.float16))


def test_reference_gelu_is_torchs_erf_gelu():
    """Equal to torch's erf GELU down to x = -2.5; below, 1 + erf(x) cancels and two erf implementations (torch's,
    the kernel's erf_f32) agree only in absolute terms (~1e-7 * |x|): the GPU test's bound."""
    acc = torch.arange(-40, 41).reshape(1, -1)
    got = i8_gemm_reference(_i8([[1]]), _i8([[1]] * 81), torch.tensor([0.125]), torch.ones(81), gelu=True, acc=acc)
    x = acc.float()[0] * 0.125
    want = torch.nn.functional.gelu(x).to(torch.float16)
    assert torch.equal(got[0][x >= -2.5], want[x >= -2.5])
    assert (got[0].float() - want.float()).abs().max().item() < 5e-6
    assert got[0, 40].item() == 0.0 and got[0, -1].item() == 5.0 and abs(got[0, 0].item()) < 1e-5


def test_reference_codes_round_half_even_clamp_and_nan():
    # y = acc * 1.0, out_scale 1.0 -> y itself: ties to even, clamp to [-128, 127]
    acc = torch.tensor([[5, 7, -5, 300, -300, 0]])
    got = i8_gemm_reference(_i8([[1]]), _i8([[1]] * 6), torch.tensor([0.5]), torch.ones(6),
                            out_scale=torch.tensor([1.0]), acc=acc)
    assert got.dtype == torch.int8 and got[0].tolist() == [2, 4, -2, 127, -128, 0]
    # a NaN y (0 * inf) is the code of 0
    nan = i8_gemm_reference(_i8([[1]]), _i8([[1]]), torch.tensor([1.0]), torch.tensor([math.inf]),
                            out_scale=torch.tensor([1.0]), acc=torch.tensor([[0]]))
    assert nan.item() == 0
    # the codes are of the float32 y (no fp16 rounding first): 1000.75 / 2 = 500.375 -> 127 (clamped); 3.0009766 / 1
    y = i8_gemm_reference(_i8([[1]]), _i8([[1]]), torch.tensor([1.5]), torch.tensor([1.0]),
                          out_scale=torch.tensor([0.001]), acc=torch.tensor([[1]]))
    assert y.item() == 127


def test_reference_residual_is_the_unfused_graphs_two_roundings():
    acc = torch.tensor([[2049, 1]])  # fp16 has 11 bits: 2049 rounds to 2048 before the add
    r = torch.tensor([[1.0, 0.5]], dtype=torch.float16)
    got = i8_gemm_reference(_i8([[1]]), _i8([[1]] * 2), torch.tensor([1.0]), torch.ones(2), residual=r, acc=acc)
    assert got[0].tolist() == [2048.0, 1.5]  # rd(rd(2049) + 1) = rd(2049) = 2048 (ties to even)


# ---- the entry's errors (checked before the device: CPU tensors reach every rule) ----

def _ok(M=4, N=8, K=32):
    return (torch.zeros(M, K, dtype=torch.int8), torch.zeros(N, K, dtype=torch.int8), torch.tensor([1.0]),
            torch.ones(N))


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0].to(torch.int16),) + a[1:], r"a must be a 2-D torch.int8 tensor \(\(M, K\)\), got torch.int16"),
    (lambda a: (a[0], a[1][:, :16].contiguous()) + a[2:], "disagree on K: 32 vs 16"),
    (lambda a: (a[0].t().contiguous().t(),) + a[1:], "row-major contiguous"),
    (lambda a: (torch.zeros(4, 24, dtype=torch.int8), torch.zeros(8, 24, dtype=torch.int8)) + a[2:],
     "K must be a positive multiple of 16 below 131072.*got K=24; zero-pad"),
    (lambda a: a[:2] + (1.0,) + a[3:], "a_scale must be a contiguous torch.float32 tensor of 1 element.*got float"),
    (lambda a: a[:3] + (torch.ones(7),), "w_scale must be .* of 8 element"),
    (lambda a: a[:3] + (torch.ones(8, dtype=torch.float64),), "w_scale must be a contiguous torch.float32"),
])
def test_bad_inputs_name_value_allowed_and_fix(mutate, match):
    from tcprec.kernels.cuda.i8_gemm import check_args

    with pytest.raises(ValueError, match=match):
        check_args(*mutate(_ok()))


def test_bad_epilogue_inputs():
    from tcprec.kernels.cuda.i8_gemm import check_args

    a, w, s, ws = _ok()
    with pytest.raises(ValueError, match="bias must be .*torch.float32 or torch.float16"):
        check_args(a, w, s, ws, torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_scale must be"):
        check_args(a, w, s, ws, out_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="pass residual=None"):
        check_args(a, w, s, ws, out_scale=s, residual=torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"residual must be a contiguous torch.float16 tensor of the output's shape \(4, 8\)"):
        check_args(a, w, s, ws, residual=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gelu must be True or False"):
        check_args(a, w, s, ws, gelu=1)
    with pytest.raises(ValueError, match="i8_gemm runs on CUDA tensors.*i8_gemm_reference"):
        check_args(a, w, s, ws, torch.ones(8, dtype=torch.float16), gelu=True)
