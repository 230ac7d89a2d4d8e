"""Operands of the bit-serial GEMM's GPU tests (test_gemm_residual_gpu, test_gemm_splitk_gpu): w1a2 bit planes, the
pm1-style row term, optional column term, column scale and bias, as ``bmma_gemm._bmma_gemm``'s positional arguments.
(A helper module, not a test file: pytest puts tests/gpu on sys.path when it collects the tests beside it.)"""

import torch

from tcprec.packing import pack_bitplanes

DEV = "cuda"


def gemm_args(M, N, Kbits, out_kind, seed, *, relu=True, col_term=False, out_bits=1, out_scale=None) -> list:
    """[a, w, a_twos, w_twos, ss, row_term, col_term, row_scale, col_scale, bias, relu, out_kind, out_bits,
    out_encoding, out_scale] with 2-bit unsigned activations and 1-bit weights, seeded."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    a = pack_bitplanes(torch.randint(0, 4, (M, Kbits), device=DEV, generator=gen, dtype=torch.int32), 2,
                       validate=False)
    w = pack_bitplanes(torch.randint(0, 2, (N, Kbits), device=DEV, generator=gen, dtype=torch.int32), 1,
                       validate=False)
    row_term = -torch.randint(0, 3 * Kbits, (M,), device=DEV, generator=gen, dtype=torch.int32)
    ct = torch.randint(-50, 50, (N,), device=DEV, generator=gen, dtype=torch.int32) if col_term else None
    col_scale = torch.rand(N, device=DEV, generator=gen) * 0.02 + 0.005
    bias = torch.randn(N, device=DEV, generator=gen)
    return [a, w, False, False, 2, row_term, ct, None, col_scale, bias, relu, out_kind, out_bits, "unsigned", out_scale]
