"""On a CUDA GPU: the compiled emulated-GEMM kernels equal the reference bit for bit (fma) or on
exact partial sums (chunk), and the all-reduce runs on CUDA tensors with both transports equal."""

import pytest
import torch

import tcprec as tp
from tcprec import emulate
from tcprec.distributed import allreduce_lowp
from tcprec.kernels import reference_emulate as ref_em

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down"]


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("acc", ["e5m10", "e8m7", "e4m3", "e6m9", "e5m2"])
@pytest.mark.parametrize("kahan", [False, True])
def test_fma_kernel_equals_reference(acc, kahan):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(70, 96, device="cuda", generator=g)
    b = torch.randn(96, 50, device="cuda", generator=g) * torch.logspace(-3, 3, 96, device="cuda")[:, None]
    for rounding in MODES:
        want = emulate.matmul(a, b, acc_fmt=acc, kahan=kahan, rounding=rounding, backend="reference")
        got = emulate.matmul(a, b, acc_fmt=acc, kahan=kahan, rounding=rounding, backend="triton")
        assert torch.equal(_bits(got), _bits(want)), (acc, rounding, kahan)


# The tests below take their rounding mode (and chunk) as parameters: every (format, mode, Kahan, chunk) is a kernel
# of its own, 3-36 s of Triton compile on one core (sm_90 compiles timed on a CPU), and five modes in one test ran
# past the per-test timeout.


@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize("acc", ["e5m10", "e8m7", "e6m9"])
@pytest.mark.parametrize("kahan", [False, True])
def test_fma_kernel_narrow_operands_exact_product_path(acc, kahan, rounding):
    # e4m3 x e4m3 products are exact and on the acc grid: the fast loop does not round them
    a = torch.randn(128, 256, device="cuda") * 8
    b = torch.randn(256, 64, device="cuda") * torch.logspace(-4, 1, 256, device="cuda")[:, None]
    want = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt=acc, kahan=kahan, rounding=rounding,
                          backend="reference")
    got = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt=acc, kahan=kahan, rounding=rounding,
                         backend="triton")
    assert torch.equal(_bits(got), _bits(want)), (acc, rounding, kahan)


@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize("kahan", [False, True])
def test_fma_fast_path_falls_back_on_overflow(kahan, rounding):
    # some 64 x 64 tiles overflow e5m10 (Inf, NaN from Inf - Inf), the others stay on the fast loop
    a = torch.randn(128, 64, device="cuda")
    b = torch.randn(64, 128, device="cuda")
    a[:64] *= 300.0
    b[:, :64] *= 300.0
    want = emulate.matmul(a, b, acc_fmt="e5m10", kahan=kahan, rounding=rounding, backend="reference")
    got = emulate.matmul(a, b, acc_fmt="e5m10", kahan=kahan, rounding=rounding, backend="triton")
    # toward_zero / directed modes saturate at max instead of Inf; Kahan turns Inf into NaN (Inf - Inf)
    big = want[:64, :64].abs()
    assert ((big >= 16384) | big.isnan()).any() and torch.isfinite(want[64:, 64:]).all() and (want[64:, 64:].abs() < 16384).all()
    assert torch.equal(_bits(got), _bits(want)), (rounding, kahan)


# Every mode at one chunk, nearest (the cvt.rn update for these two formats, and from chunk 128 on without Kahan the
# big tile) at both: the chunk changes the K loop (one tl.dot a chunk at 32, two BLOCK_K = 64 steps at 128), not the
# rounding, which is the mode's.  (The full cross product, 10 kernels x 2 a test, ran past the timeout.)
CHUNK_MODES = [("nearest", 32), ("nearest", 128), ("nearest_away", 128), ("toward_zero", 32), ("up", 128),
               ("down", 32)]


@pytest.mark.parametrize("rounding,chunk", CHUNK_MODES)
@pytest.mark.parametrize("acc", ["e5m10", "e8m7"])
@pytest.mark.parametrize("kahan", [False, True])
def test_chunk_fast_update_equals_generic_update(acc, kahan, rounding, chunk):
    # any bf16 data (inexact fp32 partial sums, values down in the subnormal range): the fast per-chunk
    # rounding and the generic one see the same partial sums, so their bits must agree
    from tcprec.kernels.triton import emulate_gemm as tk

    g = torch.Generator(device="cuda").manual_seed(1)
    a = (torch.randn(256, 512, device="cuda", generator=g) * torch.logspace(-6, 0, 512, device="cuda")).bfloat16()
    b = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    fmt = tp.format(acc)
    fast = tk.matmul(a, b, fmt, "chunk", chunk=chunk, kahan=kahan, rounding=rounding)
    slow = tk.matmul(a, b, fmt, "chunk", chunk=chunk, kahan=kahan, rounding=rounding, fast=False)
    assert torch.equal(_bits(fast), _bits(slow)), (acc, rounding, chunk, kahan)


@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize("mode", ["fma", "chunk"])
def test_fast_paths_keep_float32_subnormals(mode, rounding):
    # e8m7 (bf16) accumulators reach float32's subnormal range (< 2**-126): the fast paths' directed
    # adds / multiplies must not flush them to zero (libdevice's __nv_fadd_rd is FTZ under Triton)
    from tcprec.kernels.triton import emulate_gemm as tk

    g = torch.Generator(device="cuda").manual_seed(3)
    a = (torch.randn(64, 128, device="cuda", generator=g) * 2.0**-64).bfloat16()
    b = (torch.randn(128, 64, device="cuda", generator=g) * 2.0**-64).bfloat16()
    fmt = tp.format("e8m7")
    if mode == "fma":
        want = emulate.matmul(a.float(), b.float(), acc_fmt=fmt, rounding=rounding, backend="reference")
        got = emulate.matmul(a.float(), b.float(), acc_fmt=fmt, rounding=rounding, backend="triton")
    else:
        want = tk.matmul(a, b, fmt, "chunk", chunk=32, rounding=rounding, fast=False)
        got = tk.matmul(a, b, fmt, "chunk", chunk=32, rounding=rounding)
    sub = (want != 0) & (want.abs() < 2.0**-126)
    assert sub.sum() > 10, "the data must put results in float32's subnormal range"
    assert torch.equal(_bits(got), _bits(want)), (mode, rounding)


@pytest.mark.parametrize("chunk", [32, 64, 256])
@pytest.mark.parametrize("acc", ["e4m3", "e5m10", "e8m7"])
@pytest.mark.parametrize("kahan", [False, True])
def test_chunk_kernel_bf16_tensor_cores(kahan, acc, chunk):
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randint(-8, 8, (256, 512), device="cuda", generator=g).float()
    b = torch.randint(-8, 8, (512, 128), device="cuda", generator=g).float()
    want = ref_em.matmul_chunk(a, b, tp.format(acc), chunk, "nearest", kahan)
    got = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt=acc, mode="chunk", chunk=chunk, kahan=kahan,
                         backend="triton")
    assert torch.equal(_bits(got), _bits(want)), (acc, chunk)


def test_allreduce_on_cuda_tensors():
    flat = torch.randn(8, 10_000, device="cuda") * torch.logspace(-8, 8, 10_000, device="cuda")
    e, _ = allreduce_lowp(flat, [5000, 5000], "e4m3", transport="emulate")
    c, _ = allreduce_lowp(flat, [5000, 5000], "e4m3", transport="compressed")
    cpu, _ = allreduce_lowp(flat.cpu(), [5000, 5000], "e4m3", transport="compressed")
    assert torch.equal(_bits(e), _bits(c)) and torch.equal(_bits(c.cpu()), _bits(cpu))
