"""The warp-specialised INT8 GEMM (``kernels/cuda/i8_gemm.cu``) on an sm_90 GPU against its pure-torch reference
(``kernels/reference_i8_gemm.py``): every shipped tile (``i8_gemm.TILES``) and every epilogue, on the transformer's
shapes (M = 12608 tokens, 197, 128, 1; N 768, 2304, 3072, 264, 100, 99; K 768, 3072, 64), and under CUDA-graph
replay with new inputs and scales.  Without GELU the float32 epilogue is the same IEEE operations in the same order,
so the fp16 output and the codes must equal the reference bit for bit; with GELU, erf_f32 (erf.cuh) and torch's erf
differ in the last float32 bits, so fp16 within one fp16 ulp + 2e-6 (1 + erf(x) cancels for x < -3) and codes within
+-1 at < 0.1% of outputs (ties); erf_f32 itself within 2 ulp of float64 erf on every float32.  Skipped without a CUDA
GPU of compute capability 9.0."""

import pytest
import torch
from cuda_graph import graphed
from sm90 import require_sm90

from tcprec.kernels.reference_i8_gemm import i8_gemm_acc, i8_gemm_reference

require_sm90("i8_gemm")

from tcprec.kernels.cuda import i8_gemm as L  # noqa: E402

DEV = "cuda"
TILES = [str(t) for t in L.TILES]
EPILOGUES = {  # name -> (bias dtype or None, gelu, codes out, residual)
    "f16": (None, False, False, False),
    "f16_bias32": (torch.float32, False, False, False),
    "f16_bias16_gelu": (torch.float16, True, False, False),
    "i8_bias32_gelu": (torch.float32, True, True, False),
    "i8_bias16": (torch.float16, False, True, False),
    "i8_gelu": (None, True, True, False),
    "f16_bias32_res": (torch.float32, False, False, True),
}
PLAIN_SHAPES = [(12608, 2304, 768), (12608, 768, 3072), (197, 3072, 768), (197, 768, 3072), (1, 100, 64),
                (197, 99, 64), (1, 2304, 768)]
# full tiles (the fast epilogues), ragged M, N % 16 == 8 (codes: the general epilogue; fp16: fast on full N tiles),
# N % 8 != 0 (the general epilogue only)
EPI_SHAPES = [(12608, 3072, 768), (197, 2304, 768), (128, 264, 768), (197, 100, 3072), (37, 99, 64), (1, 768, 3072)]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every variant these tests launch, compiled in parallel first (a cold cache: ~2-5 s each)."""
    vs = [L.Variant(L.parse_tile(t), "int8" if e[2] else "float16", e[1], e[3]) for t in TILES for e in EPILOGUES.values()]
    L.precompile(vs, "sm_90a")


def _operands(M, N, K, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV, generator=g)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=DEV, generator=g)
    a_scale = torch.tensor([0.01], device=DEV)
    # y = acc * a_scale * w_scale ~ 3 standard deviations of 1: acc's std is ~74^2 sqrt(K)
    w_scale = (torch.rand(N, device=DEV, generator=g) + 0.5) * (3.0 / (5476.0 * K**0.5 * 0.01))
    return a, w, a_scale, w_scale, g


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-14)))
    return torch.exp2(e - 10)


def _check(got, want, gelu: bool, codes: bool, what: str):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if not gelu:
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{what}: {bad.shape[0]} outputs differ, first at {bad[:4].tolist()}: " \
                                 f"{got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}"
    elif codes:
        d = (got.int() - want.int()).abs()
        assert d.max().item() <= 1 and (d != 0).float().mean().item() < 1e-3, \
            f"{what}: max code diff {d.max().item()}, {(d != 0).sum().item()} of {d.numel()} differ"
    else:
        err = (got.float() - want.float()).abs()
        tol = _ulp16(want) + 2e-6
        assert bool((err <= tol).all()), f"{what}: max err {err.max().item()} (where want is " \
                                         f"{want.flatten()[err.argmax()].item()})"


@pytest.mark.parametrize("tile", TILES)
def test_plain_fp16_equals_reference(tile):
    for seed, (M, N, K) in enumerate(PLAIN_SHAPES):
        a, w, a_s, w_s, _ = _operands(M, N, K, seed)
        got = L.i8_gemm(a, w, a_s, w_s, tile=tile)
        want = i8_gemm_reference(a, w, a_s, w_s)
        _check(got, want, False, False, f"{tile} {M}x{N}x{K}")


@pytest.mark.parametrize("epi", list(EPILOGUES))
@pytest.mark.parametrize("tile", TILES)
def test_epilogues_equal_reference(tile, epi):
    bias_t, gelu, codes, res = EPILOGUES[epi]
    for seed, (M, N, K) in enumerate(EPI_SHAPES):
        a, w, a_s, w_s, g = _operands(M, N, K, 100 + seed)
        bias = None if bias_t is None else (torch.randn(N, device=DEV, generator=g) * 0.5).to(bias_t)
        out_scale = torch.tensor([0.05], device=DEV) if codes else None
        residual = (torch.randn(M, N, device=DEV, generator=g) * 2).half() if res else None
        got = L.i8_gemm(a, w, a_s, w_s, bias, gelu=gelu, out_scale=out_scale, residual=residual, tile=tile)
        want = i8_gemm_reference(a, w, a_s, w_s, bias, gelu=gelu, out_scale=out_scale, residual=residual)
        _check(got, want, gelu, codes, f"{tile} {epi} {M}x{N}x{K}")
        if codes:  # the codes are not all clamped or all zero: the scale exercises the range
            assert 10 < got.float().std().item() < 100, got.float().std().item()


def test_accumulator_exact_at_the_int8_extremes():
    """Every product -128 * -128 (the largest), K = 3072: acc = 3 * 2^24, exact in int32 and in float32."""
    M, N, K = 300, 200, 3072
    a = torch.full((M, K), -128, dtype=torch.int8, device=DEV)
    w = torch.full((N, K), -128, dtype=torch.int8, device=DEV)
    w[1::2] = 127
    one = torch.tensor([2.0**-16], device=DEV)
    for tile in TILES:
        got = L.i8_gemm(a, w, one, torch.ones(N, device=DEV), tile=tile)
        assert torch.equal(got, i8_gemm_reference(a, w, one, torch.ones(N, device=DEV))), tile
        assert got[0, 0].item() == 768.0  # 3 * 2^24 * 2^-16


@pytest.mark.parametrize("tile", TILES)
def test_codes_of_inf_nan_and_huge_values(tile):
    """The codes epilogues (fast: a full 64 x 256 tile; general: N = 264) clamp +-inf and huge y to 127 / -128 and
    write NaN (0 * inf) as 0, as the reference does."""
    for M, N, K in ((64, 256, 64), (64, 264, 64)):
        a, w, a_s, w_s, _ = _operands(M, N, K, 5)
        a[0] = 0  # row 0: acc = 0, so 0 * inf = NaN where w_scale is inf
        w_s[0::4] = float("inf")
        w_s[1::4] = 1e30
        for os in (0.05, 1e-30):
            out_scale = torch.tensor([os], device=DEV)
            got = L.i8_gemm(a, w, a_s, w_s, out_scale=out_scale, tile=tile)
            want = i8_gemm_reference(a, w, a_s, w_s, out_scale=out_scale)
            _check(got, want, False, True, f"{tile} {M}x{N}x{K} out_scale {os}")
        assert got[0, 0].item() == 0 and set(got[1:, 0].unique().tolist()) <= {-128, 0, 127}


@pytest.mark.parametrize("tile", TILES)
def test_cuda_graph_replays_with_new_inputs_and_scales(tile):
    M, N, K = 12608, 3072, 768
    a, w, a_s, w_s, g = _operands(M, N, K, 7)
    bias = torch.randn(N, device=DEV, generator=g).half()
    out_scale = torch.tensor([0.05], device=DEV)
    graph, out = graphed(lambda: L.i8_gemm(a, w, a_s, w_s, bias, gelu=True, out_scale=out_scale, tile=tile))
    for step in range(3):
        a.copy_(torch.randint(-128, 128, (M, K), dtype=torch.int8, device=DEV, generator=g))
        a_s.fill_(0.01 * (1 + step))
        out_scale.fill_(0.05 * (1 + step))
        graph.replay()
        torch.cuda.synchronize()
        want = i8_gemm_reference(a, w, a_s, w_s, bias, gelu=True, out_scale=out_scale)
        _check(out, want, True, True, f"{tile} graph replay {step}")


def test_shared_accumulator_reference_is_the_same():
    """(the tests build one reference a case; i8_gemm_acc on the GPU equals the CPU's int64 product)"""
    a, w, *_ = _operands(64, 48, 3072, 3)
    assert torch.equal(i8_gemm_acc(a, w).cpu(), a.cpu().long() @ w.cpu().long().T)


_ERF_CHECK = r'''
#include "erf.cuh"
// |v - ref| in units of the last place of ref's float32 binade (the subnormal spacing below 2^-126)
__device__ double ulps(float v, double ref) {
    const double m = fabs(ref);
    const int e = m > 0.0 ? max(ilogb(m), -126) : -126;
    return fabs((double)v - ref) / ldexp(1.0, e - 23);
}
// every float32 bit pattern: erf_f32's and erff's errors against float64 erf (max, count above 1 ulp); +-inf -> +-1
// and NaN -> NaN for erf_f32 (bad[2] counts misses)
extern "C" __global__ void erf_error(unsigned int* max_bits, unsigned long long* bad) {
    const unsigned int u = blockIdx.x * blockDim.x + threadIdx.x;
    const float x = __uint_as_float(u), mine = erf_f32(x);
    if (!isfinite(x)) {
        const bool ok = x != x ? mine != mine : mine == (x > 0.0f ? 1.0f : -1.0f);
        if (!ok) atomicAdd(bad + 2, 1ull);
        return;
    }
    const double ref = erf((double)x);
    const float d0 = (float)ulps(mine, ref), d1 = (float)ulps(erff(x), ref);
    const unsigned int m0 = __reduce_max_sync(__activemask(), __float_as_uint(d0));
    const unsigned int m1 = __reduce_max_sync(__activemask(), __float_as_uint(d1));
    if ((threadIdx.x & 31) == 0) {
        atomicMax(max_bits, m0);
        atomicMax(max_bits + 1, m1);
    }
    if (d0 > 1.0f) atomicAdd(bad, 1ull);
    if (d1 > 1.0f) atomicAdd(bad + 1, 1ull);
}
'''


def test_erf_f32_error_on_every_float(tmp_path):
    """The GELU epilogue's erf (``kernels/cuda/erf.cuh``) on all 2^32 float32 bit patterns: within 2 ulp of float64
    erf (the toolkit's erff, measured beside it, is not asserted: it changes with the toolkit), +-inf -> +-1, NaN ->
    NaN."""
    import shutil

    from tcprec.kernels.cuda.runtime import launch, launch_config, load_kernel, ptr

    shutil.copy(L.SOURCE_PATH.with_name("erf.cuh"), tmp_path / "erf.cuh")
    src = tmp_path / "erf_error.cu"
    src.write_text(_ERF_CHECK)
    dev = torch.device(DEV, torch.cuda.current_device())
    k = load_kernel(("erf_error", str(src)), src, [], "erf_error", "erf_error", dev.index)
    max_bits = torch.zeros(2, dtype=torch.int32, device=dev)
    bad = torch.zeros(3, dtype=torch.int64, device=dev)
    launch(k, launch_config((1 << 22,), (1024,)), dev, ptr(max_bits), ptr(bad))
    torch.cuda.synchronize()
    mine, cuda = max_bits.view(torch.float32).tolist()
    over = bad.tolist()
    assert over[2] == 0, f"{over[2]} of +-inf / NaN wrong"
    assert mine <= 2.0, f"erf_f32: max error {mine:.3f} ulp, {over[0]} inputs above 1 ulp (erff: {cuda:.3f}, {over[1]})"
