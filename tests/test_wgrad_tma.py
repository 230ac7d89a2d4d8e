"""The TMA-box wgrad kernel (kernels/triton/wgrad_tma.py) through TRITON_INTERPRET=1 on the CPU: against
torch.nn.grad in float64 within the bound of tests/test_conv_bwd.py, for stride 1 and 2 (one launch per
stride phase of x), 1x1 / 3x3 / 7x7 filters, padding (TMA's zero fill at negative coordinates), odd sizes,
row boxes and several-row boxes; deterministic split-K; bad input; the stride-phase arithmetic; the box
choice; and an ahead-of-time compile for sm_90 whose PTX loads by TMA and multiplies by wgmma.
tests/gpu/test_wgrad_tma_gpu.py repeats the numerical checks at ResNet-50 sizes."""

import io
import json
import sys

import pytest
import torch
from _aot import require_nvidia_backend, run_aot

from tcprec.kernels import reference_conv_bwd as rc
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.ops import conv as opc

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
wt = pytest.importorskip("tcprec.kernels.triton.wgrad_tma")

from test_conv_bwd import U32, _check_wgrad, _data, _geom  # noqa: E402  (the bound helpers, after the skips)

# (N, H, W, C, K, R, S, stride, padding, dilation); C and K multiples of 8 (TMA's 16-byte rows)
GEOMS = [
    (2, 7, 7, 8, 16, 3, 3, 1, 1, 1),  # 3x3 s1 pad 1; Q = 7 <= 8: a several-row box (the register path)
    (2, 9, 11, 16, 8, 3, 3, 1, 1, 1),  # odd H, W; Q = 11 not a power of two: a row box padded to 16
    (2, 9, 9, 16, 8, 1, 1, 2, 0, 1),  # 1x1 s2: one stride phase
    (2, 9, 8, 8, 16, 3, 3, 2, 1, 1),  # 3x3 s2 pad 1: four phases, odd H
    (1, 11, 13, 8, 8, 7, 7, 2, 3, 1),  # 7x7 s2 pad 3 (a ResNet stem's geometry)
    (1, 10, 9, 8, 8, 3, 3, 2, 2, 2),  # dilation 2 with stride 2: all taps in one phase per axis
    (1, 13, 11, 8, 16, 5, 3, (3, 2), (2, 1), 1),  # stride 3 x 2, 5x3 filter
]


def _id(s):
    return "x".join(map(str, s[:7])) + f"_s{s[7]}_p{s[8]}_d{s[9]}"


def _wgrad(dy, x, g, **kw):
    return opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="tma", **kw)


@pytest.mark.parametrize("spec", GEOMS, ids=_id)
def test_fp16_vs_fp64(spec):
    g = _geom(spec)
    dy, _, x = _data(g)
    got = _wgrad(dy, x, g, precision="fp16")
    assert got.dtype == torch.float32 and got.is_contiguous()
    _check_wgrad(g, "fp16", dy, x, got)


FP8_GEOMS = [(2, 7, 7, 16, 16, 3, 3, 1, 1, 1), (2, 9, 8, 16, 32, 3, 3, 2, 1, 1)]  # fp8: C, K multiples of 16


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("spec", FP8_GEOMS, ids=_id)
def test_bf16_and_fp8_vs_fp64(spec, precision):
    """bf16 (widened to fp32 in the interpreter, exactly), and fp8: the kernel reads the fp8 codes by TMA and
    widens each tile exactly to fp16 (WIDEN; the interpreter widens to fp32), the two scales applied in the
    kernel's epilogue (split 1) or in the split sum."""
    g = _geom(spec)
    dy, _, x = _data(g, seed=1)
    for split in (1, 2):
        _check_wgrad(g, precision, dy, x, _wgrad(dy, x, g, precision=precision, split_k=split))
    if precision == "fp8":  # Float8() QTensor operands (dy K-major, as prepare_fp8_wgrad makes it) give the same bits
        dyq, xq = opc.prepare_fp8_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="tma")
        assert torch.equal(_wgrad(dyq, xq, g, precision="fp8", split_k=2), _wgrad(dy, x, g, precision="fp8",
                                                                                  split_k=2))


@pytest.mark.parametrize("box", ["row", "min", (1, 2, 8), (2, 2, 4), (4, 1, 4), (16, 1, 1)])
def test_box_shapes(box):
    """Any box (row box: BOX_N = BOX_P = 1; or several rows / images a box, reshaped to BLOCK_L rows) gives
    the same sums within the bound; boxes overhang P, Q and N (TMA zero fill).  An image box (BOX_N, 1, 1) reads dy
    as the (N, P*Q*K) matrix (DY_2D; K = 24 is not a multiple of BLOCK_M = 16: its last tile reads the next
    pixel's channels into rows of dw that are never stored), strided and not."""
    for spec in ((3, 9, 7, 8, 16, 3, 3, 1, 1, 1), (20, 5, 6, 8, 24, 3, 3, 2, 1, 1)):
        g = _geom(spec)
        dy, _, x = _data(g, seed=2)
        cfg = dict(wt.INTERPRETER_CONFIG, BOX=box)
        _check_wgrad(g, "fp16", dy, x, _wgrad(dy, x, g, config=cfg, split_k=2))


def test_out_dtype_and_strided_views():
    """An fp16 output (the fp32 sum rounded once, in the epilogue or the split sum: the same bits as
    rounding the fp32 result); NCHW-memory operands (permuted to NHWC: ops.conv copies them to a
    TMA-readable layout) give the same bits as NHWC ones.  (bf16 outputs run on the GPU test only: the
    interpreter's fp32 -> bf16 conversion does not round to nearest.)"""
    g = _geom(GEOMS[3])
    dy, _, x = (t.half() for t in _data(g, seed=3))
    for split in (1, 3):
        got = _wgrad(dy, x, g, out_dtype=torch.float16, split_k=split)
        assert got.dtype == torch.float16
        assert torch.equal(got, _wgrad(dy, x, g, split_k=split).half())
        _check_wgrad(g, "fp16", dy.double(), x.double(), got)
    want = _wgrad(dy, x, g, split_k=2)
    got = _wgrad(dy.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1),
                 x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1), g, split_k=2)
    assert torch.equal(got, want)


def test_split_k_deterministic_and_consistent():
    """The fixed-order split sum: bitwise equal across runs; across split counts equal within fp32
    reassociation (2 * 1.01 * L * u32 * sum |products|)."""
    g = _geom((2, 12, 12, 16, 16, 3, 1, 1, (1, 0), 1))  # 2 x 12 row boxes of 16: splits of 1..24 boxes
    dy, _, x = (t.half() for t in _data(g, seed=4))
    runs = {s: _wgrad(dy, x, g, split_k=s) for s in (1, 5, 24)}
    assert torch.equal(runs[5], _wgrad(dy, x, g, split_k=5)), "split-K TMA wgrad is not bit-reproducible"
    L = g.N * g.P * g.Q
    s = rc.abs_wgrad(dy.double(), x.double(), g.weight_shape, g.stride, g.padding)
    for split, got in runs.items():
        assert ((got.double() - runs[1].double()).abs() <= 2 * 1.01 * L * U32 * s).all(), split
        _check_wgrad(g, "fp16", dy.double(), x.double(), got)
    # more splits than boxes: clamped, every split non-empty
    out = torch.empty(g.weight_shape)
    _, used = wt.wgrad_tma(dy, x, out, g, split_k=1000)
    assert used == wt.plan(g, wt.INTERPRETER_CONFIG, 1000, 4)["split"] <= 24
    assert torch.equal(out, runs[24])


def test_empty_stride_phase_and_empty_batch():
    """A 1x1 image at stride 2: taps of the odd phase reach no pixel (their dw is exactly 0)."""
    g = _geom((2, 1, 1, 8, 8, 3, 3, 2, 1, 1))
    dy, _, x = _data(g, seed=5)
    got = _wgrad(dy, x, g, split_k=1)
    _check_wgrad(g, "fp16", dy, x, got)
    assert (got[:, 0] == 0).all() and (got[:, :, 2] == 0).all() and got[:, 1, 1].abs().sum() > 0
    g0 = _geom((0, 5, 5, 8, 8, 3, 3, 1, 1, 1))
    dw = _wgrad(torch.zeros(g0.output_shape), torch.zeros(g0.input_shape), g0)
    assert dw.shape == g0.weight_shape and not dw.any()


# ------------------------------------------------------------------------------------------------
# Geometry: stride phases, boxes, the tile pick, the split
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R,H,stride,pad,dil", [(3, 9, 1, 1, 1), (3, 9, 2, 1, 1), (7, 13, 2, 3, 1), (1, 9, 2, 0, 1),
                                                (3, 10, 2, 2, 2), (5, 13, 3, 2, 1), (3, 12, 4, 0, 3), (4, 11, 2, 1, 3)])
def test_phase_taps_match_brute_force(R, H, stride, pad, dil):
    """Every tap appears in exactly one phase, and tap (i, j) of a launch reads phase-view row p + row0 +
    i*row_step = the input row p*stride - pad + r*dil, for every p."""
    g = ConvGeometry(1, H, H, 8, 8, R, R, (stride, stride), (pad, pad), (dil, dil))
    seen = []
    for ph in wt.phase_launches(g):
        for i, r in enumerate(ph["taps_r"]):
            for p in range(g.P):
                h = p * stride - pad + r * dil
                assert h % stride == ph["a"]
                assert (h - ph["a"]) // stride == p + ph["row0"] + i * ph["row_step"]
            if ph["b"] == ph["a"]:
                seen.append(r)
        assert ph["empty"] == (len(range(ph["a"], H, stride)) == 0 or len(range(ph["b"], H, stride)) == 0)
        rt = ph["taps_r"]
        assert all(b - a == rt[1] - rt[0] for a, b in zip(rt, rt[1:]))  # an arithmetic progression
    assert sorted(seen) == list(range(R))


def test_choose_box():
    # 56x56: "min" takes 8 x 8 (no padding); auto the row box (both operands from shared memory)
    assert wt.choose_box(256, 56, 56, 64, "min") == (1, 8, 8)
    assert wt.choose_box(256, 56, 56, 64) == (1, 1, 64)
    assert wt.choose_box(256, 28, 28, 32) == (1, 1, 32)
    assert wt.choose_box(256, 28, 28, 64) == (4, 4, 4)  # 64 > 32: "min" -- 4 divides 28, no padding
    assert wt.choose_box(256, 14, 14, 16) == (1, 1, 16)
    assert wt.choose_box(256, 7, 7, 64) == (64, 1, 1)  # one pixel of 64 images: no padding (8 x 1 x 8: 14%)
    assert wt.choose_box(256, 7, 7, 16, "row") == (1, 1, 16)
    for N, P, Q, bl in [(3, 9, 7, 16), (256, 14, 14, 64), (2, 1, 1, 16), (1, 5, 300, 128)]:
        bn, bp, bq = wt.choose_box(N, P, Q, bl, "min")
        assert bn * bp * bq == bl and max(bn, bp, bq) <= 256
    with pytest.raises(ValueError, match="power of two"):
        wt.choose_box(8, 7, 7, 48)
    with pytest.raises(ValueError, match="box policy"):
        wt.choose_box(8, 7, 7, 64, "square")


def test_pick_and_split_on_resnet50_layers():
    from tcprec.bench.conv_bwd import RESNET50_LAYERS

    for N in (8, 256):
        for layer in RESNET50_LAYERS:
            g = layer.geometry(N)
            cfg = wt.pick(g)
            assert cfg["BOX"] == "min" and {k: v for k, v in cfg.items() if k != "BOX"} in wt.CONFIGS
            box = wt.plan(g, cfg, None, 132)["box"]
            assert box == wt.choose_box(g.N, g.P, g.Q, cfg["BLOCK_L"], "min")
            padded = box[0] * -(-g.N // box[0]) * box[1] * -(-g.P // box[1]) * box[2] * -(-g.Q // box[2])
            assert padded <= 1.15 * g.N * g.P * g.Q, (layer.name, box)  # at most ~12.5% padding
            assert 1 <= wt.split_for(g, cfg, box, 132) <= 256
    # the tiles that won the H200 graph-replay tune (results/wgrad_tma_tune.json)
    tile = {(la.name, N): (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_L"])
            for N in (8, 256) for la in RESNET50_LAYERS for c in [wt.pick(la.geometry(N))]}
    assert tile[("56x56 64->64 3x3 s1", 256)] == (64, 64, 64)
    assert tile[("28x28 128->128 3x3 s1", 256)] == (64, 128, 64)
    assert tile[("14x14 256->256 3x3 s1", 256)] == (128, 128, 64)
    assert tile[("7x7 512->512 3x3 s1", 256)] == (128, 256, 32)
    assert tile[("56x56 64->64 3x3 s1", 8)] == (64, 64, 64)
    assert tile[("7x7 512->512 3x3 s1", 8)] == (64, 128, 64)
    assert wt.choose_box(256, 56, 56, 64, "min") == (1, 8, 8)  # no padding; the row box pads 56 -> 64
    # 9 output tiles (56x56 64->64 3x3) over 12544 boxes: split to fill 132 SMs; N = 8, 7x7 512->512: 144 tiles
    g = RESNET50_LAYERS[2].geometry(256)
    assert wt.split_for(g, wt.pick(g), (1, 1, 64), 132) >= 8
    g = RESNET50_LAYERS[16].geometry(8)
    assert wt.split_for(g, wt.pick(g), (8, 1, 8), 132) <= 2


# ------------------------------------------------------------------------------------------------
# Bad input, backend choice, explanation
# ------------------------------------------------------------------------------------------------


def test_bad_inputs():
    g = _geom((2, 8, 8, 12, 16, 3, 3, 1, 1, 1))  # C = 12: 24-byte fp16 rows
    dy, _, x = _data(g)
    with pytest.raises(ValueError, match=r"backend='tma' cannot run this wgrad.*multiples of 8.*C=12"):
        _wgrad(dy, x, g)
    g = _geom((2, 8, 8, 16, 16, 3, 3, 1, 1, 1))
    dy, _, x = (t.half() for t in _data(g))
    out = torch.empty(g.weight_shape)
    g8 = _geom((2, 8, 8, 8, 16, 3, 3, 1, 1, 1))  # C = 8: 8-byte fp8 rows
    dy8, _, x8 = _data(g8)
    with pytest.raises(ValueError, match=r"multiples of 16 for fp8 operands.*C=8"):
        wt.wgrad_tma(dy8.to(torch.float8_e5m2), x8.to(torch.float8_e4m3fn), torch.empty(g8.weight_shape), g8)
    with pytest.raises(ValueError, match="float16, bfloat16 or fp8"):
        wt.wgrad_tma(dy.float(), x.float(), out, g)
    with pytest.raises(ValueError, match="one 16-bit dtype or both be fp8"):
        wt.wgrad_tma(dy, x.bfloat16(), out, g)
    with pytest.raises(ValueError, match=r"dy must be \(N, P, Q, K\)"):
        wt.wgrad_tma(dy[:1], x, out, g)
    with pytest.raises(ValueError, match=r"x must be \(N, H, W, C\)"):
        wt.wgrad_tma(dy, x[:, :7], out, g)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        wt.wgrad_tma(dy, x, out.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1), g)
    with pytest.raises(ValueError, match="unit channel stride"):
        wt.wgrad_tma(dy, x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1), out, g)
    with pytest.raises(ValueError, match="BLOCK_L must be a power of two >= 16"):
        wt.wgrad_tma(dy, x, out, g, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_L=8))
    with pytest.raises(ValueError, match="missing"):
        wt.wgrad_tma(dy, x, out, g, config=dict(BLOCK_M=16, BLOCK_N=16))
    with pytest.raises(ValueError, match="product is BLOCK_L=16"):
        wt.wgrad_tma(dy, x, out, g, config=dict(wt.INTERPRETER_CONFIG, BOX=(2, 2, 2)))
    with pytest.raises(ValueError, match="split_k"):
        wt.wgrad_tma(dy, x, out, g, split_k=0)
    with pytest.raises(ValueError, match="split_k"):
        opc.conv2d_wgrad(dy, x, g.weight_shape, 1, 1, backend="tma", split_k=0)


def test_backend_choice_and_explain(monkeypatch):
    """backend='tma' runs the wgrad kernel and says so; on sm_90 'auto' takes it for 16-bit 3x3 and strided 1x1
    wgrads (the graph-replay tunes) and fp8 3x3 ones with N not a multiple of 16, not for stride-1 1x1 layers; fp8
    strided 1x1 wgrads and fp8 3x3 ones with N a multiple of 16 take the flat kernel; dgrad's auto choice is its
    TMA kernel for big strided 1x1 layers."""
    g = _geom((2, 9, 9, 16, 8, 3, 3, 2, 1, 1))
    dy, _, x = _data(g)
    s = opc.explain_conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, backend="tma", split_k=2)
    assert "TMA-box implicit GEMM" in s and "4 launch(es)" in s and "split-K 2 ways" in s and "deterministic" in s
    g16 = _geom((2, 9, 9, 16, 16, 3, 3, 2, 1, 1))  # fp8 TMA rows: K, C multiples of 16
    dy16, _, x16 = _data(g16)
    assert "widened exactly to fp16 in registers" in opc.explain_conv2d_wgrad(
        dy16, x16, g16.weight_shape, g16.stride, g16.padding, precision="fp8", backend="tma")
    with pytest.raises(ValueError, match=r"backend='tma' cannot run this wgrad.*multiples of 16 for fp8.*K=8"):
        opc.explain_conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, precision="fp8", backend="tma")
    # pretend to be on an sm_90 GPU: auto's choice for a big strided 1x1 layer
    monkeypatch.setattr(opc, "choose_backend", lambda t, backend, kernel: ("triton", "pretend CUDA"))
    monkeypatch.setattr(opc, "_is_sm90", lambda t: True)
    big = _geom((256, 28, 28, 512, 256, 1, 1, 2, 0, 1))
    t = torch.empty(0)
    for prec in ("fp16", "bf16", "fp8"):
        assert opc._choose("wgrad", big, t, prec, "auto")[0] == ("tma" if prec != "fp8" else "flat")
        assert opc._choose("dgrad", big, t, prec, "auto")[0] == "tma"
        assert opc._choose("wgrad", big, t, prec, "tma")[0] == "tma"
    g33 = _geom((256, 28, 28, 128, 128, 3, 3, 1, 1, 1))
    assert opc._choose("wgrad", g33, t, "fp16", "auto")[0] == "tma"
    assert opc._choose("wgrad", g33, t, "fp8", "auto")[0] == "flat"  # N a multiple of 16: batch-inner operands
    assert opc._choose("wgrad", _geom((8, 28, 28, 128, 128, 3, 3, 1, 1, 1)), t, "fp8", "auto")[0] == "tma"
    assert opc._choose("wgrad", _geom((256, 14, 14, 256, 1024, 1, 1, 1, 0, 1)), t, "fp16", "auto")[0] == "gemm"


# ------------------------------------------------------------------------------------------------
# The conv-bwd benchmark's TMA column (so that its first GPU run does not fail on a CPU-testable slip)
# ------------------------------------------------------------------------------------------------


def test_benchmark_tma_column(monkeypatch):
    """``bench.conv_bwd._alt_tma`` on a (pretend sm_90) CPU row through the interpreter: checked against the
    fp32 reference, timed (timer stubbed), its fields; and the tables / summary with and without the column."""
    from rich.console import Console

    from tcprec.bench import conv_bwd as bc

    g = _geom((2, 9, 9, 16, 8, 3, 3, 1, 1, 1))
    dy, _, x = (t.half() for t in _data(g, seed=7))
    ref = rc.conv2d_wgrad(dy.double(), x.double(), g.weight_shape, g.stride, g.padding).permute(0, 3, 1, 2)
    items = [{"wgrad": (dy, x)}]

    def call(o, backend="auto"):
        return opc.conv2d_wgrad(o["wgrad"][0], o["wgrad"][1], g.weight_shape, g.stride, g.padding, backend=backend)

    monkeypatch.setattr(opc, "_is_sm90", lambda t: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bc, "_measure", lambda fn, its, w, r, graph: (fn(its[0]), bc._Timed(ms=0.5))[1])
    assert bc._alt_tma("dgrad", g, "fp16", ("fp16",), call, items, ref, 1, 1, False).timed is None
    assert bc._alt_tma("wgrad", g, "bf16", ("fp16",), call, items, ref, 1, 1, False).timed is None
    alt = bc._alt_tma("wgrad", g, "fp16", ("fp16",), call, items, ref, 1, 1, False)
    assert alt.error is None and alt.nrmse < bc.NRMSE_LIMITS["fp16"] and "TMA-box" in alt.explain
    f = alt.fields(bc._Timed(ms=1.0), bc._Timed(ms=0.75))
    assert f["alt_tma_speedup"] == 2.0 and f["alt_tma_vs_ours"] == 1.5 and f["alt_tma_timing"] == "events"
    wrong = bc._alt_tma("wgrad", g, "fp16", ("fp16",), call, items, -ref, 1, 1, False)
    assert wrong.timed is None and "not timed" in wrong.error
    assert bc._AltTma().fields(bc._Timed(ms=1.0), bc._Timed(ms=1.0))["alt_tma_speedup"] is None

    base = dict(op="wgrad", batch=256, layer="28x28 128->128 3x3 s1", precision="fp16", path="triton", win=False,
                timing="events", ours_time_ms=1.0, ours_tflops=100.0, cudnn_nchw_ms=0.6, cudnn_nhwc_ms=0.5,
                cudnn_fwd_time_ms=0.4, cudnn_best_time_ms=0.5, cudnn_fwd_ms=0.4, speedup=0.5, speedup_events=0.5,
                speedup_incl_quant=None, vs_cudnn_fwd=0.4, nrmse=1e-5, ok=True, error=None)
    rows = [dict(base, **f), dict(base, layer="14x14 256->256 3x3 s1"), dict(base, op="dgrad", **f)]
    summary = bc.summarize(rows)
    w = next(s for s in summary if s["op"] == "wgrad")
    assert w["alt_tma_rows"] == 1 and w["alt_tma_wins_vs_ours"] == 1 and w["alt_tma_geomean_speedup"] == 2.0
    assert abs(w["geomean_speedup_best_with_tma"] - (2.0 * 0.5) ** 0.5) < 1e-12
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(bc.workload_table(rows, 256))
    console.print(bc.summary_table(summary))
    assert "2.00" in console.export_text()


# ------------------------------------------------------------------------------------------------
# The kernel compiles for sm_90: TMA loads, wgmma (no GPU needed: Triton ships ptxas)
# ------------------------------------------------------------------------------------------------


def _aot_wgrad_tma(dtype: str, bm: int, bn: int, box: tuple[int, int, int], num_warps: int, num_stages: int,
                   dy_2d: bool = False):
    """``_wgrad_tma_kernel`` for sm_90 with the descriptors the wrapper builds (blocks [*box, BLOCK_M] over dy
    and [*box, BLOCK_N] over x) and the scalars of a 28x28 128->128 3x3 layer at N = 256 (the launcher's
    specialisation: multiples of 16 marked divisible, do_not_specialize args left plain)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = wt._wgrad_tma_kernel
    consts = dict(HAS_SCALE=False, SPLIT_OUT=True, UPCAST=False, WIDEN=dtype.startswith("fp8"), DY_2D=dy_2d,
                  BLOCK_M=bm, BLOCK_N=bn, BOX_N=box[0], BOX_P=box[1], BOX_Q=box[2])
    vals = dict(K=128, C=128, RSC=9 * 128)
    nospec = set(fn.do_not_specialize) | {fn.arg_names[i] for i in fn.do_not_specialize if isinstance(i, int)}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "dy_desc" and dy_2d:  # the (N, P*Q*K) matrix, box (BOX_N, BLOCK_M)
            sig[name] = f"tensordesc<{dtype}[{box[0]}, {bm}]>"
        elif name in ("dy_desc", "x_desc"):
            sig[name] = f"tensordesc<{dtype}[{box[0]}, {box[1]}, {box[2]}, {bm if name == 'dy_desc' else bn}]>"
        elif name.endswith("_ptr"):
            sig[name], attrs[(i,)] = "*fp32", [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name not in nospec and vals[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _aot_report() -> dict:
    cases = {"row_fp16_128x128x64": ("fp16", 128, 128, (1, 1, 64), 8, 4),  # 56x56's pick: a row box
             "row_bf16_64x64x16": ("bf16", 64, 64, (1, 1, 16), 4, 8),  # 14x14's BLOCK_L (64-channel tile)
             "box_fp16_128x128x64": ("fp16", 128, 128, (8, 1, 8), 8, 4),  # 7x7's pick: a several-image box
             "row_fp8_128x128x64": ("fp8e4nv", 128, 128, (1, 1, 64), 8, 4),  # fp8 tiles widened in registers
             "image_fp16_128x128x64": ("fp16", 128, 128, (64, 1, 1), 8, 4, True)}  # 7x7: 64 images, dy 2-D
    out = {}
    for name, args in cases.items():
        k = _aot_wgrad_tma(*args)
        out[name] = {"ptx": "\n".join(ln for ln in k.asm["ptx"].splitlines()
                                      if "wgmma" in ln or "cp.async" in ln or "ldmatrix" in ln),
                     "shared": k.metadata.shared}
    return out


def test_kernel_compiles_to_tma_and_wgmma_for_sm90():
    """In a subprocess: under TRITON_INTERPRET=1 triton.jit builds interpreter objects, not compilable ones."""
    rep = json.loads(run_aot(__file__, timeout=240).strip().splitlines()[-1])
    for name, want in (("row_fp16_128x128x64", "m64n128k16.f32.f16.f16"),
                       ("row_bf16_64x64x16", "m64n64k16.f32.bf16.bf16"),
                       ("box_fp16_128x128x64", "m64n128k16.f32.f16.f16"),
                       ("row_fp8_128x128x64", "m64n128k16.f32.f16.f16"),
                       ("image_fp16_128x128x64", "m64n128k16.f32.f16.f16")):
        ptx = rep[name]["ptx"]
        assert "cp.async.bulk.tensor.4d" in ptx, f"{name}: operands are not loaded by 4-D TMA"
        assert f"wgmma.mma_async.sync.aligned.{want}" in ptx, f"{name}: no wgmma {want}"
        assert 0 < rep[name]["shared"] <= 227 * 1024
    assert "cp.async.bulk.tensor.2d" in rep["image_fp16_128x128x64"]["ptx"]  # dy as the (N, P*Q*K) matrix
    # a row box, and an image box with dy as a 2-D matrix, feed wgmma from shared memory only (no ldmatrix: dy's
    # tile is never read into registers); a several-image 4-D box goes through registers
    for name in ("row_fp16_128x128x64", "row_bf16_64x64x16", "image_fp16_128x128x64"):
        assert "ldmatrix" not in rep[name]["ptx"], name
    assert "ldmatrix" in rep["box_fp16_128x128x64"]["ptx"]


if __name__ == "__main__" and sys.argv[1:] == ["--aot"]:
    require_nvidia_backend()
    print(json.dumps(_aot_report()))


def test_config_refuses_the_tile_measured_wrong():
    """128 x 256 x BLOCK_L 64 gave NRMSE ~1e-2 on the H200: refused with the fix, and absent from CONFIGS."""
    g = _geom((2, 8, 8, 256, 128, 3, 3, 1, 1, 1))
    bad = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_L=64, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match=r"\(128, 256, 64\) gave wrong results.*BLOCK_L = 32 or 16"):
        wt.config_for(g, bad)
    assert all((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_L"]) != (128, 256, 64) for c in wt.CONFIGS)
    assert wt.config_for(g, dict(bad, BLOCK_L=32))["BLOCK_L"] == 32
