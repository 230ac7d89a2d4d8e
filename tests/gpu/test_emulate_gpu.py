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


def test_fma_kernel_narrow_operands_exact_product_path():
    a = torch.randn(128, 256, device="cuda") * 8
    b = torch.randn(256, 64, device="cuda")
    want = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt="e5m10", backend="reference")
    got = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt="e5m10", backend="triton")
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("kahan", [False, True])
def test_chunk_kernel_bf16_tensor_cores(kahan):
    a = torch.randint(-8, 8, (256, 512), device="cuda").float()
    b = torch.randint(-8, 8, (512, 128), device="cuda").float()
    for acc in ("e4m3", "e5m10", "e8m7"):
        want = ref_em.matmul_chunk(a, b, tp.format(acc), 32, "nearest", kahan)
        got = emulate.matmul(a, b, a_fmt="e4m3", b_fmt="e4m3", acc_fmt=acc, mode="chunk", chunk=32, kahan=kahan,
                             backend="triton")
        assert torch.equal(_bits(got), _bits(want)), acc


def test_allreduce_on_cuda_tensors():
    flat = torch.randn(8, 10_000, device="cuda") * torch.logspace(-8, 8, 10_000, device="cuda")
    e, _ = allreduce_lowp(flat, [5000, 5000], "e4m3", transport="emulate")
    c, _ = allreduce_lowp(flat, [5000, 5000], "e4m3", transport="compressed")
    cpu, _ = allreduce_lowp(flat.cpu(), [5000, 5000], "e4m3", transport="compressed")
    assert torch.equal(_bits(e), _bits(c)) and torch.equal(_bits(c.cpu()), _bits(cpu))
