"""The TMA-box wgrad kernel (kernels/triton/wgrad_tma.py) on an sm_90 GPU: tests/test_wgrad_tma.py's checks
at ResNet-50 sizes (small batch) -- against torch.nn.grad in float64 within the bound of the other conv
tests, for fp16, bf16 and fp8 (widened to fp16), every config and box policy, deterministic split-K --
and the compiled kernel: TMA loads (UTMALDG) and wgmma (HGMMA), with the row box's A operand read from
shared memory.  This is the first place the kernel meets TMA hardware: padding is TMA's zero fill at
negative coordinates, which only these tests check on the real unit."""

import pytest
import torch

from tcprec.ops import conv as opc

wt = pytest.importorskip("tcprec.kernels.triton.wgrad_tma")

from test_conv_bwd_gpu import DEV, U32, _data, _geom, check_wgrad  # noqa: E402  (the GPU bound helpers)

# (N, H, W, C, K, R, S, stride, padding, dilation)
GEOMS = [
    (4, 56, 56, 64, 64, 3, 3, 1, 1, 1),  # row box of 64, 64x64 tile
    (4, 28, 28, 128, 128, 3, 3, 1, 1, 1),  # row box of 32
    (4, 14, 14, 256, 256, 3, 3, 1, 1, 1),  # row box of 16
    (4, 7, 7, 512, 512, 3, 3, 1, 1, 1),  # 64 images x 1 pixel: the register path for dy's tile
    (4, 56, 56, 256, 128, 1, 1, 2, 0, 1),  # strided 1x1: one stride phase
    (4, 28, 28, 512, 256, 1, 1, 2, 0, 1),
    (4, 14, 14, 1024, 512, 1, 1, 2, 0, 1),
    (2, 57, 55, 8, 64, 7, 7, 2, 3, 1),  # stem geometry, odd sizes, C = 8 (one 16-byte row)
    (2, 30, 29, 40, 72, 3, 3, 2, 2, 2),  # dilation 2 with stride 2, channels not multiples of 16
]


@pytest.fixture(autouse=True)
def _sm90():
    cap = torch.cuda.get_device_capability()
    if cap[0] < 9:
        pytest.skip(f"TMA descriptors need sm_90+, this GPU is sm_{cap[0]}{cap[1]}")


def _wgrad(dy, x, g, **kw):
    return opc.conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, g.dilation, backend="tma", **kw)


# fp8 rows need 16 bytes: K and C multiples of 16 (the two geometries that are not are refused: test_fp8_refusal)
CASES = [(s, p) for s in GEOMS for p in ("fp16", "bf16", "fp8") if p != "fp8" or (s[3] % 16 == 0 and s[4] % 16 == 0)]


@pytest.mark.parametrize("spec,precision", CASES,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[:7])) + f"_s{v[7]}p{v[8]}d{v[9]}")
def test_vs_fp64(spec, precision):
    g = _geom(spec)
    dy, _, x = _data(g, seed=hash(spec) % 1000)
    dw = _wgrad(dy, x, g, precision=precision)
    assert dw.dtype == torch.float32 and dw.shape == g.weight_shape
    check_wgrad(g, precision, dy, x, dw)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_config_and_box(precision):
    """fp16: every config of CONFIGS (its row box), and the pick with the "min" and "row" box policies; bf16:
    the pick with both policies (each variant is a compile).  Within the bound; 16-bit outputs too."""
    g = _geom((4, 28, 28, 128, 128, 3, 3, 1, 1, 1))
    dy, _, x = _data(g, seed=3)
    dt = opc._DTYPE[precision]
    a, b = dy.to(dt), x.to(dt)
    pick = wt.pick(g)
    cfgs = [dict(pick, BOX="min"), dict(pick, BOX="row")] + (wt.CONFIGS if precision == "fp16" else [pick])
    for cfg in cfgs:
        check_wgrad(g, precision, dy, x, _wgrad(a, b, g, precision=precision, config=cfg))
    for out_dtype in (torch.float16, torch.bfloat16):
        for split in (1, 4):
            got = _wgrad(a, b, g, precision=precision, out_dtype=out_dtype, split_k=split)
            assert got.dtype == out_dtype
            check_wgrad(g, precision, dy, x, got)


def test_split_k_deterministic():
    g = _geom((8, 14, 14, 256, 256, 3, 3, 1, 1, 1))
    dy, _, x = (t.half() for t in _data(g, seed=4))
    runs = {s: _wgrad(dy, x, g, split_k=s) for s in (1, 7, 49)}
    assert torch.equal(runs[7], _wgrad(dy, x, g, split_k=7)), "split-K TMA wgrad is not bit-reproducible"
    assert torch.equal(runs[49], _wgrad(dy, x, g, split_k=49))
    from tcprec.kernels import reference_conv_bwd as rc

    s = rc.abs_wgrad(dy.double(), x.double(), g.weight_shape, g.stride, g.padding)
    L = g.N * g.P * g.Q
    for got in runs.values():
        assert ((got.double() - runs[1].double()).abs() <= 2 * 1.01 * L * U32 * s).all()
    assert torch.equal(_wgrad(dy, x, g), _wgrad(dy, x, g))  # the heuristic's split, twice


def test_compiled_kernel_uses_tma_and_wgmma():
    """PTX: 4-D TMA loads and wgmma with the operand types meant; SASS (when cuobjdump is at hand): UTMALDG
    and HGMMA, and for a row box HGMMA reading A from shared memory (``tnspA``: no register detour)."""
    for precision, want in (("fp16", "f16.f16"), ("bf16", "bf16.bf16")):
        dt = opc._DTYPE[precision]
        for spec, row in (((4, 28, 28, 128, 128, 3, 3, 1, 1, 1), True), ((4, 7, 7, 512, 512, 3, 3, 1, 1, 1), False)):
            g = _geom(spec)
            dy, _, x = (t.to(dt) for t in _data(g, seed=5))
            cfg = dict(wt.pick(g), BOX="row" if row else "min")
            assert (wt.plan(g, cfg, None, 132)["box"][:2] == (1, 1)) == row
            k, _ = wt.wgrad_tma(dy, x, torch.empty(g.weight_shape, device=DEV), g, config=cfg)
            ptx = k.asm["ptx"]
            assert "cp.async.bulk.tensor.4d" in ptx, "operands are not loaded by 4-D TMA"
            assert "wgmma.mma_async" in ptx and f"f32.{want}" in ptx, f"no wgmma with operand types {want}"
            try:
                sass = k.asm["sass"]
            except Exception:  # cuobjdump / nvdisasm missing: the PTX checks above are what ran
                continue
            assert "UTMALDG" in sass and "HGMMA" in sass
            if row:
                assert "tnspA" in sass, "the row box's dy tile did not reach wgmma from shared memory"


def test_auto_picks_tma_for_16_bit_3x3_and_strided_wgrad():
    """auto runs 16-bit 3x3 and strided wgrads on the TMA-box kernel on sm_90 (the graph-replay tune) and keeps
    cuBLAS for stride-1 1x1 layers; fp8 3x3 wgrads take it too (fp8 1x1: tests/gpu/test_wgrad_flat_gpu.py)."""
    for spec, want in (((64, 28, 28, 512, 256, 1, 1, 2, 0, 1), True), ((8, 28, 28, 128, 128, 3, 3, 1, 1, 1), True),
                       ((8, 14, 14, 256, 1024, 1, 1, 1, 0, 1), False)):
        g = _geom(spec)
        for dt in (torch.float16, torch.bfloat16):
            dy = torch.empty(g.output_shape, device=DEV, dtype=dt)
            x = torch.empty(g.input_shape, device=DEV, dtype=dt)
            prec = "fp16" if dt == torch.float16 else "bf16"
            s = opc.explain_conv2d_wgrad(dy, x, g.weight_shape, g.stride, g.padding, precision=prec)
            assert ("TMA-box" in s) == want, (spec, s)
        s8 = opc.explain_conv2d_wgrad(dy.half(), x.half(), g.weight_shape, g.stride, g.padding, precision="fp8")
        assert ("TMA-box" in s8) == (g.R == 3), s8  # fp8: 3x3 on the TMA-box kernel, 1x1 on GEMMs
    g = _geom((4, 28, 28, 128, 128, 3, 3, 1, 1, 1))
    dy, _, x = _data(g, seed=5)
    got = opc.conv2d_wgrad(dy.half(), x.half(), g.weight_shape, 1, 1)  # auto: the TMA kernel at its pick
    check_wgrad(g, "fp16", dy, x, got)


def test_fp8_refusal():
    """fp8 with C or K not a multiple of 16 (8-byte or 40-byte rows): refused with the rule, not run wrong."""
    g = _geom(GEOMS[-1])
    dy, _, x = _data(g)
    with pytest.raises(ValueError, match="multiples of 16 for fp8 operands"):
        _wgrad(dy, x, g, precision="fp8")
