"""Conv backward on the GPU: the CPU suite's numerical checks at ResNet-like sizes for every
precision and backend path, every autotuning config, deterministic split-K, the fused activation,
the autograd module, and the compiled kernels' tensor-core instructions (wgmma on sm_90, mma.sync
before)."""

import math

import pytest
import torch

from tcprec.kernels import reference_conv_bwd as rc
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import conv as opc

kt = pytest.importorskip("tcprec.kernels.triton.conv_bwd")

DEV = "cuda"
U = {"fp16": 2.0**-11, "bf16": 2.0**-8, "e4m3": 2.0**-4, "e5m2": 2.0**-3}
U_OUT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
U32 = 2.0**-24
# Hopper's fp8 wgmma accumulates up to BLOCK_K (<= 128) products in a narrower-than-fp32 register
# (~13-bit mantissa) before each promotion into fp32
FP8_ACC = 128 * 2.0**-13

# (N, H, W, C, K, R, S, stride, padding, dilation): ResNet-50 shapes at small batch, and odd ones
GEOMS = [
    (4, 28, 28, 128, 128, 3, 3, 1, 1, 1),
    (4, 56, 56, 64, 64, 3, 3, 1, 1, 1),
    (4, 28, 28, 512, 256, 1, 1, 2, 0, 1),  # 1x1 stride 2
    (4, 14, 14, 256, 1024, 1, 1, 1, 0, 1),  # 1x1 stride 1: cuBLAS under "auto"
    (2, 7, 7, 512, 512, 3, 3, 1, 1, 1),  # small M: dgrad split-K
    (2, 57, 55, 3, 64, 7, 7, 2, 3, 1),  # stem, odd sizes, C=3
    (2, 30, 29, 40, 72, 3, 3, 2, 2, 2),  # dilation + stride, channels not multiples of 16
]


def _geom(s) -> ConvGeometry:
    N, H, W, C, K, R, S, st, pd, dl = s
    return ConvGeometry(N, H, W, C, K, R, S, *(v if isinstance(v, tuple) else (v, v) for v in (st, pd, dl)))


def _data(g, seed=0):
    gen = torch.Generator(DEV).manual_seed(seed)
    dy = torch.randn(g.output_shape, generator=gen, device=DEV, dtype=torch.float64)
    w = torch.randn(g.weight_shape, generator=gen, device=DEV, dtype=torch.float64) / math.sqrt(g.C * g.R * g.S)
    x = torch.randn(g.input_shape, generator=gen, device=DEV, dtype=torch.float64)
    return dy, w, x


def _fmt_err(t, precision, fmt):
    if precision == "fp8":
        dt = opc.FP8_DTYPES[fmt]
        scale = float(t.abs().max()) / float(torch.finfo(dt).max)
        return U[fmt], scale * {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fmt] / 2
    return U[precision], {"fp16": 2.0**-25, "bf16": 2.0**-134}[precision]


def _bound(abs_sum, ref, red, ua, ea, ub, eb, max_a, max_b, out_dtype, fp8):
    rel = ua + ub + ua * ub + 1.01 * red * U32 + (FP8_ACC if fp8 else 0.0)
    floor = red * (ea * max_b + eb * max_a) * (1 + ub) + 2.0**-24
    return (1.01 * rel * abs_sum + floor) * (1 + U_OUT[out_dtype]) + 1.01 * U_OUT[out_dtype] * ref.abs()


def check_dgrad(g, precision, dy, w, got, act=None, act_input=None):
    ref = rc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation, activation=act, act_input=act_input)
    ua, ea = _fmt_err(dy, precision, "e5m2")
    ub, eb = _fmt_err(w, precision, "e4m3")
    s = rc.abs_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation)
    b = _bound(s, ref, g.K * g.R * g.S, ua, ea, ub, eb, float(dy.abs().max()), float(w.abs().max()), got.dtype,
               precision == "fp8")
    err = (got.double() - ref).abs()
    assert (err <= b).all(), f"dgrad {precision} {g}: worst err/bound {float((err / b).max()):.3g}"


def check_wgrad(g, precision, dy, x, got):
    ref = rc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation)
    ua, ea = _fmt_err(dy, precision, "e5m2")
    ub, eb = _fmt_err(x, precision, "e4m3")
    s = rc.abs_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation)
    b = _bound(s, ref, g.N * g.P * g.Q, ua, ea, ub, eb, float(dy.abs().max()), float(x.abs().max()), got.dtype,
               precision == "fp8")
    err = (got.double() - ref).abs()
    assert (err <= b).all(), f"wgrad {precision} {g}: worst err/bound {float((err / b).max()):.3g}"


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("spec", GEOMS, ids=lambda s: "x".join(map(str, s[:7])) + f"_s{s[7]}d{s[9]}")
def test_dgrad_wgrad_vs_fp64(spec, precision, backend):
    g = _geom(spec)
    dy, w, x = _data(g, seed=hash(spec) % 1000)
    if backend == "auto" and {opc._choose(op, g, dy, precision, "auto")[0] for op in ("dgrad", "wgrad")} == {"triton"}:
        pytest.skip("auto == triton for this layer")
    dx = opc.conv2d_dgrad(dy, w, g.input_shape, g.stride, g.padding, g.dilation, precision=precision, backend=backend)
    check_dgrad(g, precision, dy, w, dx)
    dw = opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, precision=precision,
                          backend=backend)
    check_wgrad(g, precision, dy, x, dw)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("spec", [(4, 56, 56, 64, 64, 3, 3, 1, 1, 1), (2, 15, 13, 24, 40, 3, 3, 1, 2, 2),
                                  (2, 17, 19, 8, 16, 7, 7, 1, 3, 1), (2, 9, 9, 16, 8, 3, 3, 1, 0, 1)],
                         ids=lambda s: "x".join(map(str, s[:7])) + f"_p{s[8]}d{s[9]}")
def test_dgrad_fprop_path_vs_fp64(spec, precision):
    """Stride-1 dgrad through cuDNN's forward conv with the rotated filter: within the same bound as
    our kernels (fp32 accumulation, one rounding to the output type); "auto" takes it."""
    g = _geom(spec)
    dy, w, _ = _data(g, seed=11)
    dyq, wq = dy.to(opc._DTYPE[precision]), w.to(opc._DTYPE[precision])
    assert "cuDNN forward conv" in opc.explain_conv2d_dgrad(dyq, wq, g.input_shape, g.stride, g.padding, g.dilation,
                                                            precision=precision)
    dx = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, g.padding, g.dilation, precision=precision,
                          backend="fprop")
    assert dx.shape == g.input_shape and dx.is_contiguous() and dx.dtype == opc._DTYPE[precision]
    check_dgrad(g, precision, dy, w, dx)
    tri = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, g.padding, g.dilation, precision=precision,
                           backend="triton")
    check_dgrad(g, precision, dy, w, tri)


def test_dgrad_fprop_refuses_what_it_cannot_do():
    g = _geom((2, 14, 14, 32, 32, 3, 3, 1, 1, 1))
    dy, w, x = (t.half() for t in _data(g))
    with pytest.raises(ValueError, match="fused activation"):
        opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, backend="fprop", activation="relu", act_input=x)
    with pytest.raises(ValueError, match="out_dtype"):
        opc.conv2d_dgrad(dy, w, g.input_shape, 1, 1, backend="fprop", out_dtype=torch.float32)
    # auto with a fused activation or an fp32 output goes to the Triton kernel, and says why not cuDNN
    assert "Triton" in opc.explain_conv2d_dgrad(dy, w, g.input_shape, 1, 1, activation="relu")
    assert "Triton" in opc.explain_conv2d_dgrad(dy, w, g.input_shape, 1, 1, out_dtype=torch.float32)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_tma_dgrad_on_gpu(precision):
    """The TMA GEMM + scatter dgrad (auto's path for strided 1x1 layers on sm_90): within the fp64 bound,
    zeros where no tap reaches, the fused ReLU equal to masking; its PTX loads by TMA and multiplies by wgmma."""
    from tcprec.kernels.triton import gemm_scatter as gs

    if _capability()[0] < 9:
        pytest.skip(f"TMA needs sm_90, this GPU is sm_{_capability()[0]}{_capability()[1]}")
    for spec in [(4, 56, 56, 256, 512, 1, 1, 2, 0, 1), (3, 15, 13, 64, 48, 1, 1, 2, 0, 1),
                 (2, 14, 14, 1024, 256, 1, 1, (2, 1), 0, 1)]:
        g = _geom(spec)
        dy, w, x = _data(g, seed=5)
        if precision == "fp8":
            dyq, wq = opc.prepare_fp8_dgrad(dy, w)
        else:
            dyq, wq = dy.to(opc._DTYPE[precision]), w.to(opc._DTYPE[precision])
        assert "TMA GEMM path" in opc.explain_conv2d_dgrad(dyq, wq, g.input_shape, g.stride, precision=precision,
                                                           backend="tma")
        dx = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, precision=precision, backend="tma")
        check_dgrad(g, precision, dy, w, dx)
        hit = torch.zeros(g.input_shape[1:3], dtype=torch.bool, device=DEV)
        hit[::g.stride[0], ::g.stride[1]] = True
        assert (dx[:, ~hit] == 0).all() and (dx[:, hit] != 0).any()
        kw = dict(precision=precision, backend="tma", out_dtype=torch.float32)
        plain = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, **kw)
        relu = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, activation="relu", act_input=x, **kw)
        assert torch.equal(relu, torch.where(x > 0, plain, torch.zeros((), dtype=plain.dtype, device=DEV)))
        if precision != "fp8":  # (fp8 wgmma accumulates BLOCK_K products narrower than fp32: only the bound)
            ref = opc.conv2d_dgrad(dyq, wq, g.input_shape, g.stride, precision=precision, backend="gemm",
                                   out_dtype=torch.float32)
            assert torch.allclose(plain, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))
    # every tile agrees with the default pick; the variants (persistent, zeros-first) bit for bit with their tile
    g0 = _geom((4, 56, 56, 256, 512, 1, 1, 2, 0, 1))
    dy0, w0, _ = _data(g0, seed=9)
    a0, b0 = opc.prepare_fp8_dgrad(dy0, w0) if precision == "fp8" else (dy0.to(opc._DTYPE[precision]),
                                                                        w0.to(opc._DTYPE[precision]))
    def run(cfg):
        return opc.conv2d_dgrad(a0, b0, g0.input_shape, 2, precision=precision, backend="tma", config=cfg)

    want = run(None)
    tiles = {tuple(sorted(c.items())): run(c) for c in gs.CONFIGS}
    for got in tiles.values():  # other tiles: the same sums, at most the output rounding apart
        assert torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=1e-3 * float(want.float().abs().max()))
    for cfg in gs.VARIANT_CONFIGS:  # the same tile, scheduled differently: the same bits
        base = {k: v for k, v in cfg.items() if k not in ("persistent", "ctas_per_sm", "zeros_first")}
        assert torch.equal(run(cfg), tiles[tuple(sorted(base.items()))]), cfg
    # auto takes it from N*P*Q >= 1024 rows with 16-bit operands (M = 392 measured slower than cuBLAS + scatter)
    big, small = _geom((8, 56, 56, 256, 512, 1, 1, 2, 0, 1)), _geom((1, 14, 14, 256, 512, 1, 1, 2, 0, 1))
    for gg, want in ((big, "TMA GEMM path"), (small, "torch")):
        e = torch.empty(gg.output_shape, device=DEV, dtype=torch.float16)
        assert want in opc.explain_conv2d_dgrad(e, torch.empty(gg.weight_shape, device=DEV, dtype=torch.float16),
                                                gg.input_shape, gg.stride)
    M = g.N * g.P * g.Q
    out = torch.empty(g.input_shape, dtype=torch.float32, device=DEV)
    if precision == "fp8":
        k = gs.dgrad_1x1_strided(dyq.data.reshape(M, g.K), wq.data.reshape(g.K, g.C).t().contiguous(), out, g,
                                 b_kmajor=True, scales=opc._scales(dyq, wq), config=gs.CONFIGS[1])
    else:
        k = gs.dgrad_1x1_strided(dyq.reshape(M, g.K), wq.reshape(g.K, g.C), out, g, b_kmajor=False,
                                 config=gs.CONFIGS[1])
    ptx = k.asm["ptx"]
    want = {"fp16": "f16.f16", "bf16": "bf16.bf16"}.get(precision, "e5m2.e4m3")
    assert "cp.async.bulk.tensor" in ptx, "operands are not loaded by TMA"
    assert "wgmma.mma_async" in ptx and f"f32.{want}" in ptx, f"no wgmma with operand types {want}"


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_every_autotune_config(precision):
    """Whatever config the autotuner picks is correct: run each one explicitly."""
    g = _geom((2, 14, 14, 256, 256, 3, 3, 1, 1, 1))
    dy, w, x = _data(g, seed=5)
    if precision == "fp8":
        dyq, wq = opc.prepare_fp8_dgrad(dy, w)
        dyk, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, 1, 1, backend="triton")
    else:
        dyq, wq, dyk, xq = dy.half(), w.half(), dy.half(), x.half()
    # the reduction blocks the autotuner may pair with this operand type (fp16 x BLOCK_K=128 would
    # overflow shared memory in the largest tile; the pruning never offers it)
    reds = (64, 128) if precision == "fp8" else (64,)
    for cfg in [c for c in kt.DGRAD_CONFIGS if c.kwargs["BLOCK_K"] in reds]:
        c = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        dx = opc.conv2d_dgrad(dyq, wq, g.input_shape, 1, 1, precision=precision, backend="triton", config=c,
                              split_k=1)
        check_dgrad(g, precision, dy, w, dx)
    for cfg in [c for c in kt.WGRAD_CONFIGS if c.kwargs["BLOCK_L"] in reds]:
        c = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        dw = opc.conv2d_wgrad(dyk, xq, g.weight_shape, 1, 1, precision=precision, backend="triton", config=c,
                              split_k=3)
        check_wgrad(g, precision, dy, x, dw)


def test_fused_activation_on_gpu():
    g = _geom((4, 28, 28, 256, 128, 1, 1, 2, 0, 1))
    dy, w, x = (t.half() for t in _data(g, seed=7))
    plain = opc.conv2d_dgrad(dy, w, g.input_shape, 2, 0)
    relu = opc.conv2d_dgrad(dy, w, g.input_shape, 2, 0, activation="relu", act_input=x)
    assert torch.equal(relu, torch.where(x > 0, plain, torch.zeros((), dtype=plain.dtype, device=DEV)))
    f32 = dict(out_dtype=torch.float32)
    plain32 = opc.conv2d_dgrad(dy, w, g.input_shape, 2, 0, **f32)
    leaky = opc.conv2d_dgrad(dy, w, g.input_shape, 2, 0, activation=("leaky_relu", 0.1), act_input=x, **f32)
    assert torch.equal(leaky, torch.where(x > 0, plain32, plain32 * 0.1))
    # 1x1 stride 1 with an activation runs the Triton kernel (fused), not cuBLAS + a mask pass
    g1 = _geom((4, 14, 14, 256, 256, 1, 1, 1, 0, 1))
    dy1, w1, x1 = (t.half() for t in _data(g1, seed=8))
    assert "epilogue" in opc.explain_conv2d_dgrad(dy1, w1, g1.input_shape, activation="relu")
    r1 = opc.conv2d_dgrad(dy1, w1, g1.input_shape, activation="relu", act_input=x1)
    check_dgrad(g1, "fp16", dy1.double(), w1.double(), r1, "relu", x1.double())


def test_split_k_deterministic_on_gpu():
    g = _geom((32, 28, 28, 128, 128, 3, 3, 1, 1, 1))
    dy, _, x = (t.half() for t in _data(g, seed=9))
    runs = [opc.conv2d_wgrad(dy, x, g.weight_shape, 1, 1, split_k=16) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:]), "split-K wgrad differs between runs"
    one = opc.conv2d_wgrad(dy, x, g.weight_shape, 1, 1, split_k=1)
    s = rc.abs_wgrad(dy, x, g.weight_shape, 1, 1)
    L = g.N * g.P * g.Q
    assert ((runs[0].double() - one.double()).abs() <= 2 * 1.01 * L * U32 * s).all()
    auto = [opc.conv2d_wgrad(dy, x, g.weight_shape, 1, 1) for _ in range(2)]  # heuristic split, autotuned tile
    assert torch.equal(auto[0], auto[1])
    gs = _geom((2, 7, 7, 512, 512, 3, 3, 1, 1, 1))
    dy2, w2, _ = (t.half() for t in _data(gs, seed=10))
    d = [opc.conv2d_dgrad(dy2, w2, gs.input_shape, 1, 1, split_k=4) for _ in range(2)]
    assert torch.equal(d[0], d[1])


def _capability():
    return torch.cuda.get_device_capability()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_compiled_kernels_use_tensor_cores(precision):
    """The PTX of the kernels that ran has wgmma (sm_90) / mma.sync (sm_80, sm_89) with the operand types
    we meant; the SASS, when cuobjdump is at hand, has HGMMA / QGMMA / HMMA."""
    cap = _capability()
    if precision == "fp8" and cap < (8, 9):
        pytest.skip(f"fp8 tensor cores need sm_89+, this GPU is sm_{cap[0]}{cap[1]}")
    g = _geom((8, 28, 28, 128, 128, 3, 3, 1, 1, 1))
    dy, w, x = _data(g, seed=11)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if dt is None:
        dyq, wq = opc.prepare_fp8_dgrad(dy, w)
        dyk, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, 1, 1, backend="triton")
        dyq, wq, scales_d = dyq.data, wq.data, opc._scales(dyq, wq)  # 0-d scales
        dyk, xq, scales_w = dyk.data, xq.data, opc._scales(dyk, xq)
    else:
        dyq, wq, dyk, xq, scales_d, scales_w = dy.to(dt), w.to(dt), dy.to(dt), x.to(dt), None, None
    out = torch.empty(g.input_shape, dtype=torch.bfloat16 if dt is None else dt, device=DEV)
    kd = kt.dgrad(dyq, wq, out, g, scales=scales_d)
    kw, _ = kt.wgrad(dyk, xq, torch.empty(g.weight_shape, device=DEV), g, scales=scales_w, split_k=2)
    types = {"fp16": "f16.f16", "bf16": "bf16.bf16"}
    # (kernel, operand types, SASS op): fp8 wgrad widens its fp8 tiles to fp16 by default (16-bit wgmma);
    # dot_f16=False keeps the fp8 wgmma variant
    cases = [(kd, types.get(precision, "e5m2.e4m3"), "QGMMA" if precision == "fp8" else "HGMMA"),
             (kw, types.get(precision, "f16.f16"), "HGMMA")]
    if precision == "fp8":
        kw8, _ = kt.wgrad(dyk, xq, torch.empty(g.weight_shape, device=DEV), g, scales=scales_w, split_k=2,
                          dot_f16=False)
        cases.append((kw8, "e5m2.e4m3", "QGMMA"))
    for k, want, want_sass in cases:
        ptx = k.asm["ptx"]
        if cap[0] == 9:
            assert "wgmma.mma_async" in ptx and f"f32.{want}" in ptx, f"no wgmma with operand types {want}"
        else:
            assert "mma.sync" in ptx
        try:
            sass = k.asm["sass"]
        except Exception:  # cuobjdump / nvdisasm missing: the PTX check above is what ran
            continue
        want_sass = want_sass if cap[0] == 9 else "HMMA"
        assert want_sass in sass, f"SASS lacks {want_sass}"


def test_autograd_module_on_gpu():
    """Gradients of a conv stack: near torch's fp32 ones (the precision's own error) and near the same
    module on the reference backend (the same math; only the accumulation order differs, but a last-bit
    difference in one layer's dx can flip the next layer's e5m2 rounding -- a 25% step -- so fp8 gets
    a wider margin).

    The fp32 bound is derived, not picked: a gradient on this chain passes through at most
    ``N_ROUND`` = 10 roundings to the precision (forward: x, three weights, three outputs; backward: dy
    and two dgrad outputs), each a relative error <= u, and its last sum (the wgrad over N*P*Q pixels)
    amplifies relative errors by kappa = ||sum |dy| |x| || / ||sum dy x||, measured from the fp32 run.
    The first layer's weight gradient cancels heavily (kappa ~ 13): its fp16 error of ~0.7% is the
    format's, not the kernels' -- the pure-torch reference backend shows the same.  The loss is scaled
    by 2**16 as torch.amp.GradScaler does: unscaled, dy ~ 1e-6 sits in fp16's subnormal range, where
    the absolute spacing 2**-24 is a ~1% relative error no eps-based bound covers."""
    from tcprec.nn.conv import Conv2d

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(64, 128, 1, stride=2), torch.nn.ReLU(),
                              torch.nn.Conv2d(128, 256, 1)).to(DEV)
    x = torch.randn(8, 64, 28, 28, device=DEV).contiguous(memory_format=torch.channels_last)
    loss_scale, n_round = 2.0**16, 10

    def grads(model):
        for p in ref.parameters():
            p.grad = None
        ((model(x) ** 2).mean() * loss_scale).backward()
        return [p.grad.clone() for p in ref.parameters()]

    convs = [m for m in ref if isinstance(m, torch.nn.Conv2d)]
    ins, douts = {}, {}
    hooks = [m.register_forward_hook(lambda mod, i, o: ins.__setitem__(mod, i[0].detach())) for m in convs]
    hooks += [m.register_full_backward_hook(lambda mod, gi, go: douts.__setitem__(mod, go[0].detach()))
              for m in convs]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the fp32 reference must be fp32, not TF32 (cuDNN's default)
    try:
        g32 = grads(ref)
        kappa = []  # per parameter, in ref.parameters() order (weight, bias per conv)
        for m in convs:
            aw = torch.nn.grad.conv2d_weight(ins[m].abs(), m.weight.shape, douts[m].abs(), m.stride, m.padding)
            kappa += [float(aw.norm() / m.weight.grad.norm()),
                      float(douts[m].abs().sum((0, 2, 3)).norm() / m.bias.grad.norm())]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        for h in hooks:
            h.remove()
    assert max(kappa) > 5, f"the first layer's weight gradient should cancel (kappa {kappa})"
    # fp8: u(e5m2) = 1/8 makes the first-order bound exceed 1; its tolerance is stated, not derived
    for precision, u, fixed, same_math in (("fp16", U["fp16"], None, 2e-3), ("bf16", U["bf16"], None, 2e-2),
                                           ("fp8", None, 0.25, 0.08)):
        def build(backend):
            return torch.nn.Sequential(*[Conv2d.from_module(m, precision=precision, backend=backend)
                                         if isinstance(m, torch.nn.Conv2d) else m for m in ref])
        g_auto, g_ref = grads(build("auto")), grads(build("reference"))
        for (n, _), a, r, f, k in zip(ref.named_parameters(), g_auto, g_ref, g32, kappa):
            tol = fixed if fixed is not None else n_round * u * k
            rel32 = float((a - f).norm() / f.norm())
            rel_same = float((a - r).norm() / r.norm())
            assert rel32 <= tol, f"{precision} {n}: relative error vs fp32 {rel32:.3g} > bound {tol:.3g} (kappa {k:.3g})"
            assert rel_same <= same_math, f"{precision} {n}: difference vs the reference backend {rel_same:.3g}"
