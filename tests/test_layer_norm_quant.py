"""``ops.qconv.layer_norm_quantize`` (kernels/triton/layer_norm_quant.py through Triton's interpreter) against torch's
LayerNorm followed by the readers' quantizers (its reference path); ``QLayerNorm`` in converted transformers
(docs/decisions/0162).

The two LayerNorms compute their float32 statistics in different orders, so an element can round one ulp of x's
dtype apart and, where that ulp crosses a code boundary, its code one step apart: on random data here ~2 codes in a
million differ, all by one step.  The tests ask for >= 99.9% equal and every one within one step."""

import dataclasses

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.bench.transformer import build_encoder
from tcprec.formats import IntFormat
from tcprec.nn.qmodules import QLayerNorm, QLinear
from tcprec.ops import qconv as qc

OPERANDS = [("int8", "int8"), ("int8", "uint8"), ("int8", "int4"), ("int8", "pm8"), ("fp8", "e4m3"), ("fp8", "e5m2")]


def _steps(a: tp.QTensor, b: tp.QTensor) -> torch.Tensor:
    """How many codes apart each element of two quantizations of one tensor is (0: the same code)."""
    if not isinstance(a.fmt, IntFormat):
        def ordinal(c):  # sign-magnitude codes -> a signed position on the grid (+0 and -0 both 0)
            c = c.to(torch.int32)
            return torch.where(c & 0x80 != 0, -(c & 0x7F), c & 0x7F)
        return (ordinal(a.codes) - ordinal(b.codes)).abs()
    step = {"pm1": 2.0}.get(a.fmt.encoding, 1.0)  # pmN values are odd integers, two apart
    return ((a.dequantize() - b.dequantize()) / a.scale.reshape(()) / step).round().abs()


def _agree(a: tp.QTensor, b: tp.QTensor, min_equal: float = 0.999) -> None:
    assert type(a.layout) is type(b.layout) and a.shape == b.shape and a.fmt == b.fmt and a.dtype == b.dtype
    d = _steps(a, b)
    assert int(d.max()) <= 1, f"codes {int(d.max())} steps apart"
    assert float((d == 0).float().mean()) >= min_equal, f"{int((d != 0).sum())} of {d.numel()} codes differ"


def _data(shape, dtype, seed=0, affine=True):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(C, generator=g)).to(dtype) if affine else None
    b = (0.2 * torch.randn(C, generator=g)).to(dtype) if affine else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("operand, fmt", OPERANDS)
def test_kernel_codes_equal_torch_layer_norm_then_quantize(dtype, operand, fmt):
    """Rows not a multiple of the program's rows, C odd (a masked tail), (B, L, C) input; ~50k codes."""
    x, w, b = _data((3, 97, 173), dtype)
    s = torch.tensor([0.03 if operand == "int8" else 0.01])
    a = qc.layer_norm_quantize(x, w, b, 1e-5, operand, fmt, s)
    r = qc.layer_norm_quantize(x, w, b, 1e-5, operand, fmt, s, backend="reference")
    assert a.shape == (3, 97, 173)
    _agree(a, r)
    if operand == "int8":  # the reference is the readers' own quantizer on torch's LayerNorm output
        y = torch.nn.functional.layer_norm(x, (173,), w, b, 1e-5)
        q = qc.quantize_int8_static(y.reshape(-1, 1, 1, 173), fmt, s, backend="reference")
        assert torch.equal(r.data.reshape(-1), q.data.reshape(-1))


def test_row_chunks_cover_the_row_with_power_of_two_widths():
    """The kernel holds a row as chunks (CA, CB): CA the largest power of two <= C, CB the next >= the rest; the
    programs' rows and warps are powers of two for every width (Triton compiles no other num_warps)."""
    from tcprec.kernels.triton.layer_norm_quant import MAX_C, chunks, launch_params

    got = [chunks(C) for C in (1, 3, 64, 173, 768, 1280, 3072, 16384)]
    assert got == [(1, 0), (2, 1), (64, 0), (128, 64), (512, 256), (1024, 256), (2048, 1024), (16384, 0)]
    assert launch_params(768) == (512, 256, 1, 1) and launch_params(3072) == (2048, 1024, 1, 4)
    for C in range(1, MAX_C + 1):
        ca, cb, br, warps = launch_params(C)
        assert ca + cb >= C and ca >= cb and br & (br - 1) == 0 and warps & (warps - 1) == 0 and 1 <= warps <= 16, C


@pytest.mark.parametrize("operand, fmt", [("int8", "int8"), ("fp8", "e4m3")])
def test_transformer_widths_one_in_a_million(operand, fmt):
    """The bench's width (768) and ViT-L / H's (1024, 1280) in fp16, 0.5-1M codes each: >= 99.99% equal."""
    for C, R in ((768, 1024), (1024, 512), (1280, 512)):
        x, w, b = _data((R, C), torch.float16, seed=C)
        s = torch.tensor([0.03 if operand == "int8" else 0.01])
        _agree(qc.layer_norm_quantize(x, w, b, 1e-6, operand, fmt, s),
               qc.layer_norm_quantize(x, w, b, 1e-6, operand, fmt, s, backend="reference"), min_equal=0.9999)


@pytest.mark.parametrize("operand, fmt", [("int8", "int8"), ("fp8", "e4m3")])
def test_no_affine_saturation_and_constant_rows(operand, fmt):
    x, _, _ = _data((40, 64), torch.float16, seed=1, affine=False)
    x[3] = 2.5  # a constant row: all zeros after the norm
    x[5, 7] = 1e4  # one outlier: its normalised value saturates the codes
    s = torch.tensor([0.001])
    a = qc.layer_norm_quantize(x, None, None, 1e-5, operand, fmt, s)
    _agree(a, qc.layer_norm_quantize(x, None, None, 1e-5, operand, fmt, s, backend="reference"))
    assert not a.dequantize()[3].any()
    # weight without bias (nn.LayerNorm(bias=False))
    w = torch.linspace(0.5, 2.0, 64).half()
    _agree(qc.layer_norm_quantize(x, w, None, 1e-5, operand, fmt, s),
           qc.layer_norm_quantize(x, w, None, 1e-5, operand, fmt, s, backend="reference"))


def test_bad_input_names_the_value_and_the_allowed_set():
    x = torch.randn(4, 8)
    s = torch.tensor([0.1])
    with pytest.raises(ValueError, match="operand must be one of"):
        qc.layer_norm_quantize(x, None, None, 1e-5, "planes", "uint2", s)
    with pytest.raises(ValueError, match=r"weight must be None or a tensor of shape \(8,\)"):
        qc.layer_norm_quantize(x, torch.ones(7), None, 1e-5, "int8", "int8", s)
    with pytest.raises(TypeError, match="float8"):
        qc.layer_norm_quantize(x, None, None, 1e-5, "fp8", "int8", s)
    with pytest.raises(TypeError, match="integer format"):
        qc.layer_norm_quantize(x, None, None, 1e-5, "int8", "e4m3", s)
    with pytest.raises(ValueError, match="backend must be"):
        qc.layer_norm_quantize(x, None, None, 1e-5, "int8", "int8", s, backend="triton")
    with pytest.raises(ValueError, match=f"at most {qc.LAYER_NORM_MAX_C}; use backend='reference'"):
        qc.layer_norm_quantize(torch.randn(1, qc.LAYER_NORM_MAX_C + 1), None, None, 1e-5, "int8", "int8", s)
    from tcprec.kernels.triton import layer_norm_quant as lq

    assert lq.MAX_C == qc.LAYER_NORM_MAX_C  # (the op's copy of the kernel's limit)


# -- QLayerNorm in converted networks ---------------------------------------------------------------------------------

def _x(seed=1, shape=(2, 9, 32)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _nrmse(a, b) -> float:
    return float((a - b).double().norm() / b.double().norm())


def _fused(q) -> list[str]:
    return [n for n, m in q.named_modules() if isinstance(m, QLayerNorm)]


@pytest.mark.parametrize("cfg", [tp.QuantConfig("fp8", first_last=None),
                                 tp.QuantConfig("int8", first_last=None, backend="int8")], ids=["fp8", "int8"])
def test_pre_norm_encoder_norms_write_their_readers_codes(cfg):
    """What ``tcprec bench transformer`` converts: each layer's norm1 (read by qkv_proj) and norm2 (read by linear1)
    become QLayerNorms; the output is the unfused model's up to the rare one-step code."""
    enc, x = build_encoder(32, 4, 2), _x()
    q = tp.quantize_model(enc, cfg, calibration=x, warn=False)
    assert _fused(q) == ["layers.0.norm1", "layers.0.norm2", "layers.1.norm1", "layers.1.norm2"]
    ln = q.get_submodule("layers.0.norm1")
    assert ln.operand(x.device) == ("fp8" if cfg.precision == "fp8" else "int8")
    assert isinstance(ln(x), tp.QTensor) and ln(x).shape == x.shape
    notes = q.tcprec_summary.notes
    assert any(n.startswith("layers.0.norm1: LayerNorm(32) fused with its readers' input quantization "
                            "(layers.0.self_attn.qkv_proj): one pass writes their") for n in notes)
    assert any(n.startswith("layers.1.norm2: LayerNorm(32) fused") and "(layers.1.linear1)" in n for n in notes)
    assert "norm1" in str(q.tcprec_summary)
    u = tp.quantize_model(enc, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    assert not _fused(u)
    with torch.no_grad():
        a, b = q(x), u(x)
    assert a.shape == b.shape and _nrmse(a, b) < 1e-3
    assert set(q.state_dict()) == set(u.state_dict()) | {f"layers.{i}.norm{j}.in_scale" for i in (0, 1) for j in (1, 2)}


def test_post_norm_encoder_keeps_torchs_norms():
    """Post-norm: each norm's output is read by the next block and by a residual add: nothing to fuse."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=False)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    q = tp.quantize_model(enc, tp.QuantConfig("fp8", first_last=None), calibration=_x(), warn=False)
    assert not _fused(q) and not any("LayerNorm" in n for n in q.tcprec_summary.notes)


def test_a_float_or_other_precision_reader_keeps_torchs_norm():
    enc, x = build_encoder(32, 4, 1), _x()
    q = tp.quantize_model(enc, tp.QuantConfig("fp8", first_last=None, overrides={"layers.0.linear1": "float"}),
                          calibration=x, warn=False)
    assert _fused(q) == ["layers.0.norm1"] and type(q.get_submodule("layers.0.norm2")) is nn.LayerNorm
    torch.manual_seed(0)
    q = tp.quantize_model(_Block().eval(), tp.QuantConfig("fp8", first_last=None, overrides={"attn.q_proj": "int8"}),
                          calibration=x, warn=False)  # q / k / v of two precisions: not fused, nor is ln_1
    assert _fused(q) == ["ln_2"] and isinstance(q.get_submodule("attn.q_proj"), QLinear)


class _Block(nn.Module):
    """A ViT-like pre-norm block written by hand (torchvision's EncoderBlock's shape): ln_1 -> attention, ln_2 ->
    MLP, and ``tap``: the second norm's output is also added to the result (a reader that is not a linear)."""

    def __init__(self, d=32, tap=False):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 10)
        self.tap = tap

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        y = self.ln_2(x)
        x = x + self.mlp(y) + (y if self.tap else 0)
        return self.head(x[:, 0])


@pytest.mark.parametrize("tap", [False, True])
def test_vit_like_block(tap):
    torch.manual_seed(0)
    net, x = _Block(tap=tap).eval(), _x()
    cfg = tp.QuantConfig("fp8", first_last=None)
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    assert _fused(q) == (["ln_1"] if tap else ["ln_1", "ln_2"])
    u = tp.quantize_model(net, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    with torch.no_grad():
        assert _nrmse(q(x), u(x)) < 1e-3


def test_torchvision_vit():
    tv = pytest.importorskip("torchvision", reason="torchvision is not installed (the hand-written block above runs)")
    torch.manual_seed(0)
    m = tv.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64).eval()
    nn.init.normal_(m.heads.head.weight, std=0.1)  # (torchvision zeroes the head)
    x = torch.randn(2, 3, 32, 32)
    q = tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None), calibration=x, warn=False)
    assert _fused(q) == [f"encoder.layers.encoder_layer_{i}.ln_{j}" for i in (0, 1) for j in (1, 2)]
    u = tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None, chain=False), calibration=x, warn=False)
    with torch.no_grad():
        assert _nrmse(q(x), u(x)) < 1e-3


def test_speed_rule_floating_a_reader_keeps_its_norm_torchs():
    """The rule times the readers as converted (reading the norm's codes); a reader it floats gets the float norm
    again (the re-conversion decides the fusion after the rule's overrides)."""
    from tcprec.nn.speed_rule import MODEL

    qkv = "layers.0.self_attn.qkv_proj"
    table = {(qkv, "quantized"): 2.0, (qkv, "float"): 1.0, (MODEL, "quantized"): 0.9, (MODEL, "float"): 1.0}
    seen = {}

    def timer(layer, side, fn):
        seen.setdefault(layer, fn())
        return table.get((layer, side), 0.5 if side == "quantized" else 1.0)

    cfg = tp.QuantConfig("fp8", first_last=None, speed_rule=tp.SpeedRule(timer=timer))
    q = tp.quantize_model(build_encoder(32, 4, 1), cfg, calibration=_x(), warn=False)
    assert type(q.get_submodule(qkv)) is nn.Linear
    assert type(q.get_submodule("layers.0.norm1")) is nn.LayerNorm and _fused(q) == ["layers.0.norm2"]
    assert isinstance(q.get_submodule("layers.0.linear1"), QLinear)


def test_qlinear_reads_codes_of_any_leading_shape():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    m = QLinear.from_float(lin, "fp8", in_absmax=3.0, signed_input=True)
    x = torch.randn(2, 3, 16)
    ln = QLayerNorm(nn.LayerNorm(16), m)
    xa = ln(x)
    torch.testing.assert_close(m(xa), m(torch.nn.functional.layer_norm(x, (16,))), rtol=0, atol=0)
    assert m(xa).shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"QLinear expects codes of shape \(\.\.\., 16\)"):
        m(qc.quantize_fp8_static(torch.randn(2, 8), m.in_scale))
    with pytest.raises(ValueError, match=r"QLayerNorm expects a float \(\.\.\., 16\) tensor"):
        ln(torch.randn(2, 8))
    ln.half()
    assert ln.in_scale.dtype == torch.float32 and ln.weight.dtype == torch.float16


# -- the kernel compiles for sm_90 (no GPU needed) ---------------------------------------------------------------------

def test_kernel_compiles_for_sm90():
    """In a subprocess without TRITON_INTERPRET: Triton's NVIDIA backend builds the int8 and fp8 variants at the
    bench's width (the mean and variance divide with div.rn.f32, the IEEE division the interpreter computes)."""
    from _aot import run_aot

    out = run_aot(__file__, timeout=300)
    assert "div.rn.f32" in out and "OK" in out


def _aot_main():
    from _aot import compile_ptx, require_nvidia_backend

    require_nvidia_backend()
    from tcprec.kernels.triton import layer_norm_quant as lq
    from tcprec.kernels.triton.round import fp8_constexprs

    types = dict(x_ptr="*fp16", w_ptr="*fp16", b_ptr="*fp16", scale_ptr="*fp32", out_ptr="*i8", R="i32",
                 stride_xr="i32", stride_xc="i32", eps="fp32")
    def build(C, fp8):
        ca, cb, br, warps = lq.launch_params(C)
        consts = dict(C=C, HAS_W=True, HAS_B=True, BLOCK_R=br, CA=ca, CB=cb)
        if fp8:
            sig = dict(types, x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*u8")
            consts.update(ROUND=lq.ROUND_BF16.value, FP8=True, **lq._NO_INT, **fp8_constexprs(torch.float8_e4m3fn))
        else:
            sig = types
            consts.update(ROUND=lq.ROUND_FP16.value, FP8=False, LO=-128, HI=127, OFFSET=0, SHIFT=0, ENC=1, BITS=8,
                          **lq._NO_F8)
        return compile_ptx(lq._layer_norm_quant_kernel, sig, consts, num_warps=warps)

    ptx = build(768, False)
    build(768, True)
    build(3072, False)  # two chunks on 4 warps (an LLM's width)
    print("div.rn.f32" if "div.rn.f32" in ptx else "no div.rn.f32", "OK")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--aot"]:
        _aot_main()
