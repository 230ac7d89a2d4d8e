"""Convolution backward (dgrad / wgrad) in fp16, bf16 and fp8: the Triton kernels (through
TRITON_INTERPRET=1 on the CPU) against torch.nn.grad in float64, within a bound derived from the
reduction length and the operand formats; fused activations; deterministic split-K; the autograd
Conv2d against torch's fp32 conv for a few training steps; bad inputs.  tests/gpu repeats the
numerical checks at scale and checks the compiled kernels use tensor-core MMA."""

import json
import sys

import pytest
import torch
from _aot import require_nvidia_backend, run_aot

from tcprec.kernels import reference_conv_bwd as rc
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import conv as opc
from tcprec.qtensor import Float8, PerTensor, QTensor

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
kt = pytest.importorskip("tcprec.kernels.triton.conv_bwd")

# (N, H, W, C, K, R, S, stride, padding, dilation)
GEOMS = [
    (2, 7, 7, 8, 16, 3, 3, 1, 1, 1),  # 3x3 stride 1, padded
    (2, 9, 8, 5, 12, 3, 3, 2, 1, 1),  # 3x3 stride 2, odd sizes and channel counts
    (1, 11, 13, 3, 8, 7, 7, 2, 3, 1),  # 7x7 stride 2 pad 3 (a ResNet stem), uneven phases
    (2, 6, 6, 16, 32, 1, 1, 1, 0, 1),  # 1x1 stride 1: a GEMM (Triton here)
    (2, 9, 9, 16, 8, 1, 1, 2, 0, 1),  # 1x1 stride 2: three of four phases have no taps
    (1, 10, 9, 6, 5, 3, 3, 2, 2, 2),  # dilation 2 with stride 2
    (1, 8, 8, 4, 4, 5, 5, 1, 0, 1),  # 5x5, no padding
    (1, 9, 7, 4, 6, 3, 1, (2, 1), (1, 0), 1),  # 3x1 filter, stride (2, 1)
]
PRECISIONS = ["fp16", "bf16", "fp8"]
U = {"fp16": 2.0**-11, "bf16": 2.0**-8, "e4m3": 2.0**-4, "e5m2": 2.0**-3}  # unit roundoff
U_OUT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
U32 = 2.0**-24


def _geom(spec) -> ConvGeometry:
    N, H, W, C, K, R, S, st, pd, dl = spec
    return ConvGeometry(N, H, W, C, K, R, S, rc.pair(st, "s"), rc.pair(pd, "p"), rc.pair(dl, "d"))


def _data(g: ConvGeometry, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(g.output_shape, generator=gen, dtype=torch.float64)
    w = torch.randn(g.weight_shape, generator=gen, dtype=torch.float64)
    x = torch.randn(g.input_shape, generator=gen, dtype=torch.float64)
    return dy, w, x


def _fmt_err(t: torch.Tensor, precision: str, fp8_fmt: str):
    """(relative rounding bound, absolute underflow bound) of t rounded to the precision."""
    if precision == "fp8":
        dt = opc.FP8_DTYPES[fp8_fmt]
        scale = float(t.abs().max()) / float(torch.finfo(dt).max)
        min_sub = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fp8_fmt]
        return U[fp8_fmt], scale * min_sub / 2
    return U[precision], {"fp16": 2.0**-25, "bf16": 2.0**-134}[precision]


def _bound(abs_sum, ref, red_len, ua, ea, ub, eb, max_a, max_b, out_dtype):
    """|computed - exact| for a sum of red_len products of rounded operands, accumulated in fp32 in
    any order and rounded once to out_dtype (Higham's gamma_n, with slack for the output rounding)."""
    rel = ua + ub + ua * ub + 1.01 * red_len * U32
    floor = red_len * (ea * max_b + eb * max_a) * (1 + ub) + 2.0**-24
    return (1.01 * rel * abs_sum + floor) * (1 + U_OUT[out_dtype]) + U_OUT[out_dtype] * ref.abs() * 1.01


def _check(op, g, precision, dy, b, got):
    """got (dgrad: from dy and the weight b; wgrad: from dy and the input b) against the fp64 reference, within the
    bound of the two operands' rounding to the precision and the fp32 sum over the reduction."""
    if op == "dgrad":
        ref = rc.conv2d_dgrad(dy, b, g.input_shape, g.stride, g.padding, g.dilation)
        abs_sum = rc.abs_dgrad(dy, b, g.input_shape, g.stride, g.padding, g.dilation)
        red = g.K * g.R * g.S
    else:
        ref = rc.conv2d_wgrad(dy, b, g.weight_shape, g.stride, g.padding, g.dilation)
        abs_sum = rc.abs_wgrad(dy, b, g.weight_shape, g.stride, g.padding, g.dilation)
        red = g.N * g.P * g.Q
    ua, ea = _fmt_err(dy, precision, "e5m2")
    ub, eb = _fmt_err(b, precision, "e4m3")
    bound = _bound(abs_sum, ref, red, ua, ea, ub, eb, float(dy.abs().max()), float(b.abs().max()), got.dtype)
    err = (got.double() - ref).abs()
    assert got.shape == ref.shape
    assert (err <= bound).all(), f"{op} {precision} {g}: max err {float(err.max()):.3g}, worst err/bound " \
                                 f"{float((err / bound).max()):.3g}"


def _check_dgrad(g, precision, dy, w, got):
    _check("dgrad", g, precision, dy, w, got)


def _check_wgrad(g, precision, dy, x, got):
    _check("wgrad", g, precision, dy, x, got)


# ------------------------------------------------------------------------------------------------
# Numerics: Triton kernels (interpreter) vs float64
# ------------------------------------------------------------------------------------------------


def _every_geom_and_precision(test):
    """``test`` over GEOMS x PRECISIONS, with ids like ``2x7x7x8x16x3x3_s1_p1_d1-fp16``."""
    by_geom = pytest.mark.parametrize("spec", GEOMS, ids=lambda s: "x".join(map(str, s[:7]))
                                      + f"_s{s[7]}_p{s[8]}_d{s[9]}")
    return pytest.mark.parametrize("precision", PRECISIONS)(by_geom(test))


@_every_geom_and_precision
def test_dgrad_triton_vs_fp64(spec, precision):
    g = _geom(spec)
    dy, w, _ = _data(g)
    got = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation, precision=precision,
                           backend="triton")
    assert got.dtype == (torch.bfloat16 if precision == "fp8" else opc._DTYPE[precision])
    _check_dgrad(g, precision, dy, w, got)


@_every_geom_and_precision
def test_wgrad_triton_vs_fp64(spec, precision):
    g = _geom(spec)
    dy, _, x = _data(g)
    got = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, precision=precision,
                           backend="triton")
    assert got.dtype == torch.float32
    _check_wgrad(g, precision, dy, x, got)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_reference_backend_vs_fp64(precision):
    g = _geom(GEOMS[1])
    dy, w, x = _data(g, seed=3)
    _check_dgrad(g, precision, dy, w, opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation,
                                                       precision=precision, backend="reference"))
    _check_wgrad(g, precision, dy, x, opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation,
                                                       precision=precision, backend="reference"))


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_gemm_path_for_pointwise_layers(precision):
    """backend='gemm' (torch.matmul / torch.mm / torch._scaled_mm) for 1x1 stride-1 layers."""
    g = _geom((2, 4, 6, 16, 32, 1, 1, 1, 0, 1))  # N*H*W = 48: every GEMM dim a multiple of 16
    dy, w, x = _data(g, seed=5)
    try:
        dx = opc.conv2d_dgrad(dy, w, g.input_shape, precision=precision, backend="gemm")
        dw = opc.conv2d_wgrad(dy, x, g.weight_shape, precision=precision, backend="gemm")
    except (RuntimeError, NotImplementedError) as e:  # torch._scaled_mm has no CPU kernel in this torch
        if precision == "fp8":
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
        raise
    _check_dgrad(g, precision, dy, w, dx)
    _check_wgrad(g, precision, dy, x, dw)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("spec", [(2, 9, 9, 16, 32, 1, 1, 2, 0, 1), (1, 7, 10, 32, 16, 1, 1, (3, 2), 0, 1),
                                  (1, 5, 5, 16, 16, 1, 1, 1, 0, 1)],
                         ids=["s2_odd", "s3x2", "s1_M25"])
def test_gemm_path_for_strided_1x1_layers(spec, precision):
    """Unpadded 1x1 layers at any stride are GEMMs over the N*P*Q touched pixels: dgrad scatters the
    rows into dx with zeros elsewhere (Triton pass, here in the interpreter), wgrad reduces over the
    strided slice of x; fp8 zero-pads a pixel count that is no multiple of 16 (M = 25 here)."""
    g = _geom(spec)
    dy, w, x = _data(g, seed=6)
    assert "GEMM path" in opc.explain_conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="gemm")
    try:
        dx = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, precision=precision, backend="gemm")
        dw = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, precision=precision, backend="gemm")
    except (RuntimeError, NotImplementedError) as e:  # torch._scaled_mm has no CPU kernel in this torch
        if precision == "fp8":
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
        raise
    _check_dgrad(g, precision, dy, w, dx)
    _check_wgrad(g, precision, dy, x, dw)
    if g.stride != (1, 1):  # the pixels no tap reaches are exactly zero
        hit = torch.zeros(g.input_shape[1:3], dtype=torch.bool)
        hit[::g.stride[0], ::g.stride[1]] = True
        assert (dx[:, ~hit] == 0).all() and (dx[:, hit] != 0).any()


def _check_fused_activations(g, dy, w, x, **kw):
    """dgrad with a fused ReLU / LeakyReLU(0.1) backward equals the plain dgrad masked afterwards; returns
    the ReLU result."""
    plain = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, **kw)
    relu = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, activation="relu", act_input=x, **kw)
    assert torch.equal(relu, torch.where(x > 0, plain, torch.zeros((), dtype=plain.dtype)))
    leaky = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, activation=("leaky_relu", 0.1),
                             act_input=x, **kw)
    assert torch.equal(leaky, torch.where(x > 0, plain, plain * 0.1))
    return relu


@pytest.mark.parametrize("scatter", ["triton", "torch"])
def test_strided_1x1_gemm_fused_activation_equals_dgrad_then_mask(scatter, monkeypatch):
    g = _geom((2, 9, 9, 16, 32, 1, 1, 2, 0, 1))
    dy, w, x = (t.half() for t in _data(g, seed=14))
    x[0, 0, 0, :] = 0.0
    if scatter == "torch":  # the non-CUDA, non-interpreter fall-back of the scatter pass
        monkeypatch.setattr(kt, "interpreting", lambda: False)
    relu = _check_fused_activations(g, dy, w, x, backend="gemm", out_dtype=torch.float32)
    tri = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, activation="relu", act_input=x,
                           backend="triton", out_dtype=torch.float32)
    assert torch.allclose(tri, relu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("spec", [(2, 9, 9, 16, 16, 1, 1, 2, 0, 1), (1, 7, 10, 32, 48, 1, 1, (3, 2), 0, 1),
                                  (2, 5, 6, 16, 16, 1, 1, 1, 0, 1)], ids=["s2_odd", "s3x2", "s1"])
def test_tma_gemm_scatter_dgrad(spec, precision):
    """backend='tma': one TMA GEMM whose epilogue writes every pixel of dx (the GEMM rows at the strided
    pixels, zeros elsewhere, odd sizes included); the fused ReLU / LeakyReLU equal masking afterwards."""
    g = _geom(spec)
    dy, w, x = _data(g, seed=21)
    assert "TMA GEMM path" in opc.explain_conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding,
                                                       precision=precision, backend="tma")
    dx = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, precision=precision, backend="tma")
    _check_dgrad(g, precision, dy, w, dx)
    hit = torch.zeros(g.input_shape[1:3], dtype=torch.bool)
    hit[::g.stride[0], ::g.stride[1]] = True
    assert (dx[:, ~hit] == 0).all() and (dx[:, hit] != 0).any()
    _check_fused_activations(g, dy, w, x, precision=precision, backend="tma", out_dtype=torch.float32)


@pytest.mark.parametrize("variant", [dict(persistent=True, ctas_per_sm=1), dict(zeros_first=True)],
                         ids=["persistent", "zeros_first"])
def test_tma_dgrad_variants_equal_the_plain_kernel(variant):
    """The persistent (grid-stride over tiles; 4 'SMs' in the interpreter, 18 tiles here) and zeros-first
    variants write the same dx bits as the one-tile-per-program kernel."""
    g = _geom((2, 13, 11, 32, 16, 1, 1, 2, 0, 1))
    dy, w, x = (t.half() for t in _data(g, seed=23))
    base = dict(kt.INTERPRETER_CONFIG, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    kw = dict(backend="tma", activation="relu", act_input=x)
    plain = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, config=base, **kw)
    other = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, config=dict(base, **variant), **kw)
    assert torch.equal(plain.view(torch.int16), other.view(torch.int16))
    assert (plain != 0).any()


def test_bench_keeps_the_least_disturbed_pass_per_row():
    """bench.conv_bwd.least_disturbed: per row, the pass with the smallest ours + cuDNN time, both sides from
    that pass; every pass's speedup kept; passes that list different rows are an error."""
    from tcprec.bench import conv_bwd as bc

    def row(layer, ours, base):
        return dict(op="dgrad", precision="fp16", batch=256, layer=layer, ours_time_ms=ours, cudnn_best_time_ms=base,
                    speedup=None if ours is None else base / ours)

    p1 = [row("a", 1.0, 2.0), row("b", 3.0, 2.0), row("c", None, 1.0)]
    p2 = [row("a", 2.0, 4.0), row("b", 1.0, 1.5), row("c", 0.5, 1.0)]
    got = bc.least_disturbed([p1, p2])
    assert [(r["ours_time_ms"], r["cudnn_best_time_ms"]) for r in got] == [(1.0, 2.0), (1.0, 1.5), (0.5, 1.0)]
    assert got[1]["pass_speedups"] == [2.0 / 3.0, 1.5] and got[2]["pass_speedups"] == [None, 2.0]
    assert bc.least_disturbed([p1]) == [dict(r, pass_speedups=[r["speedup"]]) for r in p1]
    with pytest.raises(RuntimeError, match="row order"):
        bc.least_disturbed([p1, p2[::-1]])


def test_tma_backend_rejects_what_it_cannot_run():
    g = _geom(GEOMS[1])  # 3x3
    dy, w, x = _data(g)
    with pytest.raises(ValueError, match="backend='tma'.*not an unpadded 1x1 layer"):
        opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="tma")
    g = _geom((1, 8, 8, 12, 16, 1, 1, 2, 0, 1))  # C = 12: 24-byte fp16 rows
    dy, w, x = _data(g)
    with pytest.raises(ValueError, match="multiples of 8.*C=12"):
        opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="tma")
    with pytest.raises(ValueError, match="multiples of 16.*C=12"):
        opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, precision="fp8", backend="tma")
    # wgrad has its own TMA kernel (kernels/triton/wgrad_tma.py, tests/test_wgrad_tma.py), with the same row rule
    with pytest.raises(ValueError, match="backend='tma' cannot run this wgrad.*multiples of 8.*C=12"):
        opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="tma")


def test_out_dtype_float32_and_strided_views():
    """fp32 output; operands given as permuted (NCHW-memory) views give the same bits as contiguous NHWC."""
    g = _geom(GEOMS[1])
    dy, w, x = (t.half() for t in _data(g, seed=7))
    want = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, precision="fp16", backend="triton",
                            out_dtype=torch.float32)
    dy_nchw = dy.permute(0, 3, 1, 2).contiguous()  # NCHW memory
    w_kcrs = w.permute(0, 3, 1, 2).contiguous()
    got = opc.conv2d_dgrad(dy_nchw.permute(0, 2, 3, 1), w_kcrs.permute(0, 2, 3, 1), g.input_shape, g.stride,
                           g.padding, precision="fp16", backend="triton", out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want)
    _check_dgrad(g, "fp16", dy.double(), w.double(), got)
    wa = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="triton", split_k=1)
    wb = opc.conv2d_wgrad(dy_nchw.permute(0, 2, 3, 1), x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1),
                          g.weight_shape, g.stride, g.padding, backend="triton", split_k=1)
    assert torch.equal(wa, wb)


# ------------------------------------------------------------------------------------------------
# Fused activation backward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_k", [1, 3])
def test_fused_relu_equals_dgrad_then_mask(split_k):
    g = _geom(GEOMS[1])
    dy, w, x = (t.half() for t in _data(g, seed=11))
    z = x.clone()
    z[0, 0, 0, :] = 0.0  # x == 0 is masked (torch's threshold_backward)
    plain = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="triton", split_k=split_k)
    fused = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="triton", split_k=split_k,
                             activation="relu", act_input=z)
    assert torch.equal(fused, torch.where(z > 0, plain, torch.zeros((), dtype=plain.dtype)))
    # the conv's own input (the ReLU's output) gives the same mask as the ReLU's input
    fused_out = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="triton", split_k=split_k,
                                 activation="relu", act_input=torch.relu(z))
    assert torch.equal(fused_out, fused)


@pytest.mark.parametrize("split_k", [1, 2])
def test_fused_leaky_relu_equals_dgrad_then_scale(split_k):
    g = _geom(GEOMS[0])
    dy, w, x = (t.half() for t in _data(g, seed=12))
    kw = dict(backend="triton", split_k=split_k, out_dtype=torch.float32)
    plain = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, **kw)
    fused = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, activation=("leaky_relu", 0.2),
                             act_input=x, **kw)
    assert torch.equal(fused, torch.where(x > 0, plain, plain * 0.2))
    ref = rc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, activation=("leaky_relu", 0.2), act_input=x)
    assert torch.allclose(fused.double(), ref, rtol=1e-5, atol=1e-5)


def test_fused_activation_matches_reference_backend():
    g = _geom(GEOMS[4])
    dy, w, x = (t.half() for t in _data(g, seed=13))
    for act in ("relu", "leaky_relu"):
        a = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="triton", activation=act,
                             act_input=x, out_dtype=torch.float32)
        b = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, backend="reference", activation=act,
                             act_input=x, out_dtype=torch.float32)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Split-K: deterministic, and equal to no split within fp32 reassociation
# ------------------------------------------------------------------------------------------------


def test_wgrad_split_k_deterministic():
    g = _geom((2, 12, 12, 16, 24, 3, 3, 1, 1, 1))  # L = 288 rows: splits of 128
    dy, _, x = (t.half() for t in _data(g, seed=21))
    a = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="triton", split_k=3)
    b = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="triton", split_k=3)
    one = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="triton", split_k=1)
    assert torch.equal(a, b), "split-K wgrad is not bit-reproducible"
    L = g.N * g.P * g.Q
    s = rc.abs_wgrad(dy, x, g.weight_shape, g.stride, g.padding)
    assert ((a.double() - one.double()).abs() <= 2 * 1.01 * L * U32 * s).all()


def test_dgrad_split_k_deterministic():
    g = _geom((1, 6, 6, 8, 64, 3, 3, 1, 1, 1))  # 9 taps x 4 K-blocks of 16 = 36 loop iterations
    dy, w, _ = (t.half() for t in _data(g, seed=22))
    kw = dict(backend="triton", out_dtype=torch.float32)
    a = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, split_k=4, **kw)
    b = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, split_k=4, **kw)
    one = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, split_k=1, **kw)
    assert torch.equal(a, b)
    s = rc.abs_dgrad(dy, w, g.input_shape, g.stride, g.padding)
    assert ((a.double() - one.double()).abs() <= 2 * 1.01 * g.K * 9 * U32 * s).all()


def test_split_heuristics():
    big = ConvGeometry(256, 56, 56, 64, 64, 3, 3, (1, 1), (1, 1), (1, 1))
    assert kt.wgrad_split(big, 132) > 1  # 9 output tiles, 800k rows: split
    small = ConvGeometry(8, 7, 7, 512, 512, 3, 3, (1, 1), (1, 1), (1, 1))
    assert kt.wgrad_split(small, 132) == 1  # 392 rows: splitting would cost more than it gives
    # batch 8, 9 output tiles, 6272 rows: one program a tile would leave 123 of 132 SMs idle
    assert kt.wgrad_split(ConvGeometry(8, 28, 28, 128, 128, 3, 3, (1, 1), (1, 1), (1, 1)), 132) >= 8
    assert kt.dgrad_split(big, 132) == 1
    assert kt.dgrad_split(small, 132) > 1  # 392 pixels x 512 channels: a handful of tiles


# ------------------------------------------------------------------------------------------------
# Stride-phase arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R,stride,pad,dil", [(1, 1, 0, 1), (3, 2, 1, 1), (7, 2, 3, 1), (3, 2, 2, 2), (5, 3, 2, 2),
                                              (3, 4, 0, 2), (4, 3, 1, 3), (2, 2, 0, 4)])
def test_phase_taps_match_brute_force(R, stride, pad, dil):
    g = ConvGeometry(1, 17, 17, 1, 1, R, R, (stride, stride), (pad, pad), (dil, dil))
    for a in range(stride):
        r0, n, base = g.phase_taps(0, a)
        _, step, dp, _ = g.phase_params(0)
        taps = [r0 + t * step for t in range(n)]
        want = [r for r in range(R) if (a + pad - r * dil) % stride == 0]
        assert taps == want, (a, taps, want)
        for t, r in enumerate(taps):  # dy row of output row h = a + stride*i is i + base - t*dp
            for i in range(3):
                assert (a + stride * i + pad - r * dil) // stride == i + base - t * dp


# ------------------------------------------------------------------------------------------------
# fp8 operands
# ------------------------------------------------------------------------------------------------


def test_to_fp8_scale_layout_and_float8_qtensor_operands():
    t = torch.randn(2, 5, 5, 8, dtype=torch.float64)
    q = opc.to_fp8(t, "e4m3", memory_order=(3, 0, 1, 2))
    assert q.shape == t.shape and q.data.stride() == (25, 5, 1, 50) and q.data.dtype == torch.float8_e4m3fn
    # a QTensor in the Float8() layout: one float32 scale stored (1, 1, 1, 1), dequantize() in float32
    assert isinstance(q, QTensor) and q.layout == Float8() and q.granularity == PerTensor()
    assert q.scale.shape == (1, 1, 1, 1) and q.dtype == torch.float32 and q.dequantize().dtype == torch.float32
    assert torch.equal(q.dequantize(), q.data.float() * q.scale)
    assert float(q.data.float().abs().max()) == 448.0
    assert torch.allclose(q.dequantize().double(), t, rtol=2**-4, atol=float(q.scale) * 2**-10)
    g = _geom((2, 5, 5, 8, 16, 3, 3, 1, 1, 1))
    dy, w, x = _data(g, seed=31)
    dyq, wq = opc.prepare_fp8_dgrad(dy, w)
    assert wq.data.stride()[0] == 1  # K-major weight
    a = opc.conv2d_dgrad(dyq, wq, g.input_shape, 1, 1, precision="fp8", backend="triton")
    b = opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, precision="fp8", backend="triton")
    assert torch.equal(a, b)  # same scales, same codes, same kernel
    dyk, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, 1, 1, backend="triton")
    assert dyk.data.stride()[3] == g.N * g.P * g.Q  # dy K-major: the reduction index is contiguous
    _check_wgrad(g, "fp8", dy, x, opc.conv2d_wgrad(dyk, xq, g.weight_shape, 1, 1, precision="fp8",
                                                  backend="triton"))
    with pytest.raises(TypeError, match="float8"):
        QTensor(torch.zeros(2), torch.ones(1), "e4m3", PerTensor(), (2,), torch.float32, Float8())
    with pytest.raises(TypeError, match="float32"):
        QTensor(torch.zeros(2).to(torch.float8_e5m2), torch.ones(1, dtype=torch.float64), "e5m2", PerTensor(), (2,),
                torch.float32, Float8())


# ------------------------------------------------------------------------------------------------
# Backend choice and explanation
# ------------------------------------------------------------------------------------------------


def test_explain_and_backend_choice():
    g1 = _geom((2, 4, 4, 16, 32, 1, 1, 1, 0, 1))
    dy, w, x = _data(g1)
    s = opc.explain_conv2d_dgrad(dy, w, g1.input_shape, backend="gemm")
    assert "cuBLAS" in s and "fastest GEMM" in s
    assert "reference" in opc.explain_conv2d_dgrad(dy, w, g1.input_shape)  # auto on a CPU tensor
    g2 = _geom(GEOMS[1])
    dy2, w2, x2 = _data(g2)
    s = opc.explain_conv2d_dgrad(dy2, w2, g2.input_shape, g2.stride, g2.padding, backend="triton",
                                 activation="relu")
    assert "stride-phase" in s and "4 phase(s)" in s and "relu backward fused" in s
    s = opc.explain_conv2d_wgrad(dy2, x2, g2.weight_shape, g2.stride, g2.padding, backend="triton", split_k=2)
    assert "split-K 2" in s and "deterministic" in s
    with pytest.raises(ValueError, match="only unpadded 1x1"):
        opc.conv2d_dgrad(dy2, w2, g2.input_shape, g2.stride, g2.padding, backend="gemm")


@pytest.mark.parametrize("spec", [(2, 9, 7, 5, 6, 3, 3, 1, 1), (2, 11, 10, 3, 4, 5, 3, (2, 1), 1),
                                  (1, 12, 12, 4, 4, 3, 3, 2, 2), (1, 7, 7, 3, 5, 7, 7, 3, 1), (1, 6, 6, 2, 3, 3, 3, 0, 1)])
def test_dgrad_as_rotated_forward_conv(spec):
    """The "fprop" path's identity: a stride-1 dgrad is the forward conv of dy with the filter rotated
    by 180 degrees and its channels swapped, padding d*(R-1) - pad (checked in float64 on the CPU;
    on CUDA the same function runs cuDNN)."""
    N, H, W, C, K, R, S, pad, dil = spec
    g = opc.conv_geometry((N, H, W, C), (K, R, S, C), 1, pad, dil)
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(g.output_shape, generator=gen, dtype=torch.float64)
    w = torch.randn(g.weight_shape, generator=gen, dtype=torch.float64)
    want = rc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation, dtype=torch.float64)
    got = opc._dgrad_fprop(dy, w, g)
    assert got.shape == g.input_shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 3, 3, 5), (70, 3, 3, 33), (4, 7, 7, 3), (16, 1, 1, 80)])
def test_rotate_filter_kernel(shape):
    """kernels.triton.conv_bwd.rotate_filter (the fprop path's one-pass filter copy), through the
    interpreter: out[c, r, s, k] = w[k, R-1-r, S-1-s, c]."""
    from tcprec.kernels.triton import conv_bwd as kt

    w = torch.randn(shape).half()
    got = kt.rotate_filter(w)
    assert torch.equal(got, w.flip(1, 2).permute(3, 1, 2, 0).contiguous())


def test_fprop_backend_errors():
    g = opc.conv_geometry((2, 8, 8, 4), (6, 3, 3, 4), 1, 1)
    dy, w = torch.randn(g.output_shape).half(), torch.randn(g.weight_shape).half()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, backend="fprop")
    with pytest.raises(ValueError, match="transposed conv"):
        g2 = opc.conv_geometry((2, 8, 8, 4), (6, 3, 3, 4), 2, 1)
        opc.conv2d_dgrad(torch.randn(g2.output_shape).half(), w, g2.input_shape, 2, 1, backend="fprop")
    with pytest.raises(ValueError, match="fp8 convolution"):
        opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, precision="fp8", backend="fprop")
    with pytest.raises(ValueError, match="would crop"):
        g3 = opc.conv_geometry((2, 8, 8, 4), (6, 3, 3, 4), 1, 3)
        opc.conv2d_dgrad(torch.randn(g3.output_shape).half(), w, g3.input_shape, 1, 3, backend="fprop")
    with pytest.raises(ValueError, match="only dgrad"):
        opc.conv2d_wgrad(dy, torch.randn(g.input_shape).half(), g.weight_shape, 1, 1, backend="fprop")


def test_empty_batch():
    g = _geom((0, 5, 5, 4, 8, 3, 3, 1, 1, 1))
    dy, w, x = torch.zeros(g.output_shape), torch.randn(g.weight_shape), torch.zeros(g.input_shape)
    assert opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, backend="triton").shape == g.input_shape
    dw = opc.conv2d_wgrad(dy, x, g.weight_shape, 1, 1, backend="triton")
    assert dw.shape == g.weight_shape and not dw.any()


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------


def test_bad_inputs():
    dy, w = torch.randn(2, 4, 4, 8), torch.randn(8, 3, 3, 6)
    shape = (2, 8, 8, 6)
    ok = dict(stride=2, padding=1)
    opc.conv2d_dgrad(dy, w, shape, backend="reference", **ok)  # the valid call
    with pytest.raises(ValueError, match=r"grad_out must be \(N, P, Q, K\)"):
        opc.conv2d_dgrad(dy, w, shape, stride=1, padding=1, backend="reference")
    with pytest.raises(ValueError, match="looks NCHW"):
        opc.conv2d_dgrad(dy.permute(0, 3, 1, 2), w, shape, backend="reference", **ok)
    with pytest.raises(ValueError, match="grouped convolution"):
        opc.conv2d_dgrad(dy, torch.randn(8, 3, 3, 3), shape, backend="reference", **ok)
    with pytest.raises(ValueError, match="channel mismatch"):
        opc.conv2d_dgrad(dy, torch.randn(8, 3, 3, 4), shape, backend="reference", **ok)
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        opc.conv2d_dgrad(dy, w, shape, 2, 1, 0, backend="reference")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        opc.conv2d_dgrad(dy, w, shape, 0, 1, backend="reference")
    with pytest.raises(ValueError, match="padding must be >= 0"):
        opc.conv2d_dgrad(dy, w, shape, 2, -1, backend="reference")
    with pytest.raises(TypeError, match="pair of ints"):
        opc.conv2d_dgrad(dy, w, shape, (2, 2, 2), 1, backend="reference")
    with pytest.raises(ValueError, match="does not fit"):
        opc.conv2d_dgrad(torch.randn(2, 1, 1, 8), torch.randn(8, 9, 9, 6), (2, 3, 3, 6), backend="reference")
    with pytest.raises(ValueError, match="precision must be one of"):
        opc.conv2d_dgrad(dy, w, shape, precision="fp4", backend="reference", **ok)
    with pytest.raises(ValueError, match="backend must be one of"):
        opc.conv2d_dgrad(dy, w, shape, backend="cudnn", **ok)
    with pytest.raises(ValueError, match="activation must be"):
        opc.conv2d_dgrad(dy, w, shape, activation="gelu", act_input=torch.randn(shape), backend="reference", **ok)
    with pytest.raises(ValueError, match="needs act_input"):
        opc.conv2d_dgrad(dy, w, shape, activation="relu", backend="reference", **ok)
    with pytest.raises(ValueError, match="act_input must have the input's shape"):
        opc.conv2d_dgrad(dy, w, shape, activation="relu", act_input=torch.randn(2, 6, 8, 8), backend="reference",
                         **ok)
    with pytest.raises(ValueError, match="without an activation"):
        opc.conv2d_dgrad(dy, w, shape, act_input=torch.randn(shape), backend="reference", **ok)
    with pytest.raises(ValueError, match="4-D"):
        opc.conv2d_dgrad(dy[0], w, shape, backend="reference", **ok)
    with pytest.raises(TypeError, match="floating"):
        opc.conv2d_dgrad(dy.long(), w, shape, backend="reference", **ok)
    with pytest.raises(TypeError, match=r"needs its scale, a Float8\(\) QTensor"):
        opc.conv2d_dgrad(dy.to(torch.float8_e5m2), w, shape, precision="fp8", backend="reference", **ok)
    with pytest.raises(TypeError, match="precision='fp8'"):
        opc.conv2d_dgrad(opc.to_fp8(dy, "e5m2"), w, shape, precision="fp16", backend="reference", **ok)
    with pytest.raises(ValueError, match="out_dtype"):
        opc.conv2d_dgrad(dy, w, shape, out_dtype=torch.int8, backend="reference", **ok)
    with pytest.raises(ValueError, match=r"input_shape must be 4 ints"):
        opc.conv2d_dgrad(dy, w, (2, 8, 8), backend="reference", **ok)
    x = torch.randn(shape)
    with pytest.raises(ValueError, match="split_k"):
        opc.conv2d_wgrad(dy, x, (8, 3, 3, 6), split_k=0, backend="reference", **ok)
    with pytest.raises(ValueError, match="channel mismatch"):
        opc.conv2d_wgrad(dy, x, (8, 3, 3, 5), backend="reference", **ok)


def test_triton_backend_without_cuda_or_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run the Triton implicit-GEMM conv dgrad"):
        opc.conv2d_dgrad(torch.randn(2, 4, 4, 8), torch.randn(8, 3, 3, 6), (2, 8, 8, 6), 2, 1, backend="triton")


def test_module_rejects_unsupported_layers():
    from tcprec.nn.conv import Conv2d

    with pytest.raises(ValueError, match="groups=2 is not supported"):
        Conv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
    with pytest.raises(ValueError, match="padding='same'"):
        Conv2d(4, 4, 3, padding="same")
    with pytest.raises(ValueError, match="precision"):
        Conv2d(4, 4, 3, precision="int8")


# ------------------------------------------------------------------------------------------------
# The autograd module trains like torch's fp32 conv
# ------------------------------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    """conv 3x3 -> ReLU -> conv 3x3 stride 2 -> ReLU -> conv 1x1 -> mean -> linear."""

    def __init__(self, conv=torch.nn.Conv2d, **kw):
        super().__init__()
        self.c1 = conv(3, 8, 3, padding=1, **kw)
        self.c2 = conv(8, 16, 3, stride=2, padding=1, **kw)
        self.c3 = conv(16, 16, 1, **kw)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.fc(self.c3(x).mean((2, 3)))


# (loss, gradient, parameter) relative tolerances against torch's fp32 conv: the precision's own
# rounding (measured with the reference backend: fp16 ~6e-4 on gradients, bf16 ~8e-2, as ReLU masks
# flip in a model this small), and against the same model on the reference backend: the kernels'
# accumulation order only.
_TOL = {"fp16": (1e-4, 1e-2, 1e-3, 2e-3), "bf16": (1e-3, 0.15, 1e-2, 2e-2)}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_conv2d_module_trains_like_torch_fp32(precision):
    from tcprec.nn.conv import Conv2d

    loss_tol, grad_tol, param_tol, same_math_tol = _TOL[precision]
    torch.manual_seed(0)
    ref = _Tiny()
    models = [ref, _Tiny(Conv2d, precision=precision, backend="triton"),
              _Tiny(Conv2d, precision=precision, backend="reference")]
    for m in models[1:]:
        m.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 9, 9, generator=gen, requires_grad=True)
        y = torch.randint(0, 4, (4,), generator=gen)
        runs = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            x.grad = None
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            runs.append((loss.item(), x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        (l_ref, gx_ref, g_ref), (l_tri, gx_tri, g_tri), (_, gx_emu, g_emu) = runs
        assert abs(l_tri - l_ref) <= loss_tol * abs(l_ref), f"step {step}: loss"
        assert _rel(gx_tri, gx_ref) <= grad_tol, f"step {step}: input grad"
        assert _rel(gx_tri, gx_emu) <= same_math_tol, f"step {step}: input grad vs the reference backend"
        for n in g_ref:
            assert g_tri[n].dtype == torch.float32
            assert _rel(g_tri[n], g_ref[n]) <= grad_tol, f"step {step}: {n} grad"
            assert _rel(g_tri[n], g_emu[n]) <= same_math_tol, f"step {step}: {n} grad vs the reference backend"
    for (n, p_ref), p_tri in zip(ref.named_parameters(), models[1].parameters()):
        assert _rel(p_tri.detach(), p_ref.detach()) <= param_tol, n


def test_conv2d_module_fp8_and_fused_relu():
    from tcprec.nn.conv import Conv2d

    torch.manual_seed(2)
    ref = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    (ref(torch.relu(x)) ** 2).sum().backward()
    gx_r, gw_r = x.grad.clone(), ref.weight.grad.clone()
    x.grad, ref.weight.grad = None, None
    for precision, tol in (("fp16", 2e-3), ("fp8", 0.15)):
        m = Conv2d.from_module(ref, precision=precision, input_activation="relu", backend="triton")
        (m(x) ** 2).sum().backward()
        assert float((x.grad - gx_r).norm() / gx_r.norm()) <= tol, precision
        assert float((ref.weight.grad - gw_r).norm() / gw_r.norm()) <= tol, precision
        assert "input_activation='relu'" in repr(m)
        x.grad, ref.weight.grad, ref.bias.grad = None, None, None


# ------------------------------------------------------------------------------------------------
# The kernels compile for sm_90 and lower tl.dot to wgmma (no GPU needed: Triton ships ptxas)
# ------------------------------------------------------------------------------------------------


def _aot_compile(fn_name, consts, num_warps=4, num_stages=3):
    """Compile a conv_bwd kernel ahead of time for sm_90 with Triton's NVIDIA backend, with the
    sizes and strides of a 28x28 128->128 3x3 layer at batch 256 (ints equal to 1 specialised and
    multiples of 16 marked divisible, as Triton's launcher does).  Needs TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kt, fn_name)
    a_ty, b_ty = ("fp8e5", "fp8e4nv") if consts["IS_FP8"] else ("fp16", "fp16")
    hw = dict(N=256, H=28, W=28, C=128, P=28, Q=28, K=128, R=3, S=3, str_h=1, str_w=1, pad_h=1, pad_w=1,
              dil_h=1, dil_w=1)
    if fn_name == "_dgrad_kernel":
        ptrs = {"dy_ptr": a_ty, "w_ptr": b_ty, "out_ptr": "bf16", "act_ptr": "bf16", "scale_a_ptr": "fp32",
                "scale_b_ptr": "fp32"}
        nhwc = (28 * 28 * 128, 28 * 128, 128, 1)
        vals = dict(hw, **dict(zip(("sdy_n", "sdy_p", "sdy_q", "sdy_k"), nhwc)),
                    **dict(zip(("sw_k", "sw_r", "sw_s", "sw_c"), (1152, 384, 128, 1))),
                    **dict(zip(("so_n", "so_h", "so_w", "so_c"), nhwc)),
                    **dict(zip(("sa_n", "sa_h", "sa_w", "sa_c"), nhwc)),
                    g_h=1, step_h=1, dp_h=1, inv_h=0, g_w=1, step_w=1, dp_w=1, inv_w=0, M_MAX=256 * 28 * 28, SPLIT=1)
    else:
        ptrs = {"dy_ptr": a_ty, "x_ptr": b_ty, "out_ptr": "fp32", "scale_a_ptr": "fp32", "scale_b_ptr": "fp32"}
        vals = dict(hw, sdy_n=28 * 28, sdy_p=28, sdy_q=1, sdy_k=256 * 28 * 28, sx_n=28 * 28 * 128, sx_h=28 * 128,
                    sx_w=128, sx_c=1, L=256 * 28 * 28, CHUNK=8192,
                    **dict(zip(("mag_q", "shift_q", "mag_p", "shift_p"), kt._magic(28) + kt._magic(28))))
    sig, attrs, cs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        elif name == "slope":
            sig[name] = "fp32"
        elif vals[name] == 1:
            sig[name], cs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if vals[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, cs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _aot_gemm_scatter(fp8: bool, bm=128, bn=256, bk=64, persistent=False):
    """The TMA GEMM + scatter dgrad kernel (kernels/triton/gemm_scatter.py) for sm_90: descriptors of the
    tile shapes the wrapper builds, B K-major for fp8."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tcprec.kernels.triton import gemm_scatter as gs

    fn = gs._gemm_scatter_kernel
    a_ty, b_ty, bk = ("fp8e5", "fp8e4nv", 2 * bk) if fp8 else ("fp16", "fp16", bk)
    consts = dict(STR_H=2, STR_W=2, ACT=1, HAS_SCALE=fp8, IS_FP8=fp8, FAST_ACCUM=False, B_KMAJOR=fp8, UPCAST=False,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FLATTEN=persistent, ZEROS_FIRST=False)
    sig, attrs, cs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "a_desc":
            sig[name] = f"tensordesc<{a_ty}[{bm}, {bk}]>"
        elif name == "b_desc":
            sig[name] = f"tensordesc<{b_ty}[{bn}, {bk}]>" if fp8 else f"tensordesc<{b_ty}[{bk}, {bn}]>"
        elif name.endswith("_ptr"):
            sig[name], attrs[(i,)] = ("*bf16" if name in ("out_ptr", "act_ptr") else "*fp32"), [["tt.divisibility", 16]]
        elif name == "slope":
            sig[name] = "fp32"
        elif name == "sa_c":
            sig[name], cs[name] = "constexpr", 1
        else:
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, cs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=8, num_stages=3))


def _aot_report() -> dict:
    base = dict(SPLIT_OUT=False, INT64=False, UPCAST=False, FAST_ACCUM=False, BLOCK_M=128, BLOCK_N=128)
    k16 = _aot_compile("_dgrad_kernel", dict(base, ACT=1, HAS_SCALE=False, IS_FP8=False, BLOCK_K=64, EVEN_K=True),
                       num_warps=8)
    w8 = dict(base, HAS_SCALE=True, IS_FP8=True, DY_LINEAR=True, BLOCK_L=128, SPLIT_OUT=True)
    k8 = _aot_compile("_wgrad_kernel", dict(w8, DOT_F16=False), num_warps=8)
    k8h = _aot_compile("_wgrad_kernel", dict(w8, DOT_F16=True), num_warps=8)  # the default for fp8 wgrad
    return {"dgrad_fp16": k16.asm["ptx"], "wgrad_fp8": k8.asm["ptx"], "wgrad_fp8_dot_f16": k8h.asm["ptx"],
            "tma_dgrad_fp16": _aot_gemm_scatter(False).asm["ptx"], "tma_dgrad_fp8": _aot_gemm_scatter(True).asm["ptx"],
            "tma_dgrad_fp16_persistent": _aot_gemm_scatter(False, persistent=True).asm["ptx"]}


def test_kernels_compile_to_wgmma_for_sm90():
    """In a subprocess: under TRITON_INTERPRET=1 triton.jit builds interpreter objects, not compilable ones."""
    ptx = json.loads(run_aot(__file__, timeout=120).strip().splitlines()[-1])
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ptx["dgrad_fp16"]
    assert "cp.async" in ptx["dgrad_fp16"]  # operand loads pipelined asynchronously
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3" in ptx["wgrad_fp8"]
    # fp8 wgrad's default: fp8 tiles loaded asynchronously, widened to fp16, 16-bit wgmma
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in ptx["wgrad_fp8_dot_f16"]
    assert "cp.async" in ptx["wgrad_fp8_dot_f16"]
    # the strided 1x1 dgrad: TMA tile loads, 128x256 wgmma (fp8: both operands K-major, no transpose)
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx["tma_dgrad_fp16"]
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e5m2.e4m3" in ptx["tma_dgrad_fp8"]
    assert "cp.async.bulk.tensor" in ptx["tma_dgrad_fp16"] and "cp.async.bulk.tensor" in ptx["tma_dgrad_fp8"]
    assert "cp.async.bulk.tensor" in ptx["tma_dgrad_fp16_persistent"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx["tma_dgrad_fp16_persistent"]


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    require_nvidia_backend()
    report = _aot_report()
    print(json.dumps({k: "\n".join(ln for ln in v.splitlines() if "wgmma" in ln or "cp.async" in ln)
                      for k, v in report.items()}))
