"""QTensor layouts (tcprec.qtensor): every layout stores the dense path's codes and dequantizes to its values, over
every code point of each format; bad layouts name the allowed set; the ops read every form."""

import dataclasses
import io

import pytest
import torch

import tcprec as tp
from tcprec.kernels.reference import code_dtype
from tcprec.ops import qconv
from tcprec.packing import pack_bitplanes, packed_words
from tcprec.qtensor import LAYOUTS, BitPlanes, Dense, Float8, QTensor, ShiftedInt8, int8_affine

INT_FORMATS = ["int1", "int2", "int3", "int4", "int8", "uint1", "uint2", "uint4", "uint7", "uint8", "binary", "pm2",
               "pm8"]
FLOAT_FORMATS = ["e4m3", "e5m2", "float6_e2m3fn", "float4_e2m1fn"]
ALL_LAYOUTS = [Dense(), BitPlanes(), BitPlanes(compact=True), ShiftedInt8(), Float8()]


def _supports(layout, fmt) -> bool:
    if isinstance(layout, (BitPlanes, ShiftedInt8)):
        return isinstance(fmt, tp.IntFormat)
    if isinstance(layout, Float8):
        return str(fmt) in ("float8_e4m3fn", "float8_e5m2")
    return True


def _every_code(fmt, shape_rows: int = 3) -> torch.Tensor:
    """float32 (rows, n_codes + 7): every finite value of ``fmt`` (scale 1 quantizes each to its own code), in each
    row, then 7 of them again so that K is never a whole number of 32-bit words (pm formats have no zero to pad with)."""
    codes = torch.arange(fmt.n_codes, dtype=torch.int64).to(code_dtype(fmt))
    v = tp.decode(codes, fmt).float()
    v = v[torch.isfinite(v)]
    row = torch.cat([v, v.repeat(7)[:7]])
    return row.expand(shape_rows, -1).contiguous()


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=repr)
@pytest.mark.parametrize("name", INT_FORMATS + FLOAT_FORMATS)
def test_every_layout_round_trips_to_the_dense_values(name, layout):
    fmt = tp.format(name)
    x = _every_code(fmt)  # (3, K)
    if not _supports(layout, fmt):
        with pytest.raises(TypeError, match=r"stores .* got fmt=|Float8\(\) stores e4m3 / e5m2"):
            tp.quantize(x, fmt, scale=1.0, layout=layout)
        return
    dense = tp.quantize(x, fmt, scale=1.0)
    q = tp.quantize(x, fmt, scale=1.0, layout=layout)
    assert q.layout == layout and q.shape == dense.shape and q.fmt == dense.fmt
    assert torch.equal(q.codes, dense.codes), (name, layout)
    assert torch.equal(q.dequantize(), dense.dequantize()), (name, layout)
    assert torch.equal(q.dequantize(), x)  # every code point, scale 1: the values themselves
    assert torch.equal(q.to_layout(Dense()).data, dense.data)
    assert torch.equal(dense.to_layout(layout).data, q.data)
    K = x.shape[-1]
    if isinstance(layout, BitPlanes):  # the packing module's planes, rows flattened; compact: the real words
        full = pack_bitplanes(dense.codes, fmt.bits)  # (bits, 3, packed_words(K))
        words = -(-K // 32) if layout.compact else packed_words(K)
        assert q.data.shape == (fmt.bits, 3, words) and torch.equal(q.data, full[..., :words])
    elif isinstance(layout, ShiftedInt8):  # decode(code) = offset + step * data, every value in int8
        off, step = int8_affine(fmt)
        assert q.data.dtype == torch.int8 and q.data.is_contiguous()
        assert torch.equal(off + step * q.data.long(), tp.decode(dense.codes, fmt).long())
    elif isinstance(layout, Float8):  # the same bits as torch's float8 dtype
        assert q.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        assert torch.equal(q.data.view(torch.uint8), dense.codes) and torch.equal(q.data.float(), x)


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=repr)
def test_layouts_with_absmax_scales_granularities_and_save(layout):
    """Per-channel / per-group absmax scales, a 3-d tensor: the same codes and values in every layout; a QTensor in
    any layout survives torch.save / torch.load."""
    fmt = "e4m3" if isinstance(layout, Float8) else "int3"
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    for g in (tp.PerTensor(), tp.PerChannel(1), tp.PerGroup(16)):
        dense, q = tp.quantize(x, fmt, g), tp.quantize(x, fmt, g, layout=layout)
        assert torch.equal(q.codes, dense.codes) and torch.equal(q.scale, dense.scale), g
        assert torch.equal(q.dequantize(), dense.dequantize()), g
        assert q.dequantize(torch.float64).dtype == torch.float64
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
        assert back.layout == layout and torch.equal(back.codes, q.codes) and torch.equal(back.dequantize(), q.dequantize())
    moved = q.to("cpu")
    assert moved.layout == layout and torch.equal(moved.codes, q.codes)


def test_bit_planes_switch_rows_without_unpacking():
    """Padded <-> compact re-pads / slices the stored words; a 1-d tensor is one row."""
    q = tp.quantize(torch.rand(5, 3, 40), "uint2", layout=BitPlanes())
    c = q.to_layout(BitPlanes(compact=True))
    assert c.data.shape == (2, 15, 2) and torch.equal(c.to_layout(BitPlanes()).data, q.data)
    one = tp.quantize(torch.rand(40), "uint2", layout=BitPlanes())
    assert one.data.shape == (2, 1, 16) and torch.equal(one.codes, tp.quantize(one.dequantize(), "uint2",
                                                                               scale=one.scale).codes)


@pytest.mark.parametrize("bad", ["dense", "planes", BitPlanes, 3, tp.PerTensor()])
def test_bad_layout_names_the_allowed_set(bad):
    allowed = r"layout must be one of Dense\(\), BitPlanes\(compact=False\|True\), ShiftedInt8\(\), Float8\(\)"
    with pytest.raises(TypeError, match=allowed):
        tp.quantize(torch.rand(4, 8), "uint2", layout=bad)
    qt = tp.quantize(torch.rand(4, 8), "uint2")
    with pytest.raises(TypeError, match=allowed):
        qt.to_layout(bad)
    with pytest.raises(TypeError, match=allowed):
        dataclasses.replace(qt, layout=bad)


def test_layout_and_data_errors():
    with pytest.raises(TypeError, match=r"BitPlanes\(compact=\) must be True or False, got compact='yes'"):
        BitPlanes(compact="yes")
    with pytest.raises(ValueError, match=r"packs along the last axis; a 0-d tensor has none \(use Dense\(\)\)"):
        tp.quantize(torch.tensor(0.5), "uint2", layout=BitPlanes())
    with pytest.raises(TypeError, match=r"stores integer codes .* got fmt=float8_e4m3fn; use Dense\(\) \(every format\) "
                                        r"or Float8\(\)"):
        tp.quantize(torch.rand(4, 8), "e4m3", layout=ShiftedInt8())
    with pytest.raises(TypeError, match=r"Float8\(\) stores e4m3 / e5m2 codes .* got fmt=int4"):
        tp.quantize(torch.rand(4, 8), "int4", layout=Float8())
    with pytest.raises(TypeError, match="stores integer codes"):
        tp.quantize(torch.rand(4, 32), "mxfp4", layout=BitPlanes())
    q = tp.quantize(torch.rand(4, 40), "uint2", layout=BitPlanes())
    with pytest.raises(ValueError, match=r"must be int32 \(bits, rows, words\) = \(2, 4, 16\), got int32 \(2, 4, 2\)"):
        dataclasses.replace(q, data=q.data[..., :2])
    s = tp.quantize(torch.rand(4, 40), "uint2", layout=ShiftedInt8())
    with pytest.raises(TypeError, match=r"must be a contiguous int8 tensor of shape \(4, 40\), got int8 \(40, 4\)"):
        dataclasses.replace(s, data=s.data.t().contiguous().t().t())
    with pytest.raises(TypeError, match=r"hp must be None or a float tensor of the codes' shape \(4, 40\)"):
        dataclasses.replace(s, hp=torch.zeros(40, 4))
    with pytest.raises(TypeError, match=r"hp must be None or a float tensor"):
        dataclasses.replace(s, hp=torch.zeros(4, 40, dtype=torch.int32))
    assert set(LAYOUTS) == {Dense, BitPlanes, ShiftedInt8, Float8}


def test_matmul_reads_every_layout():
    gen = torch.Generator().manual_seed(3)
    a_hp, w_hp = torch.randn(6, 70, generator=gen), torch.randn(5, 70, generator=gen)
    qa, qw = tp.quantize(a_hp, "int3"), tp.quantize(w_hp, "binary", tp.PerChannel(0))
    want = tp.matmul(qa, qw)
    for la in ALL_LAYOUTS[:4]:
        for lw in ALL_LAYOUTS[:4]:
            assert torch.equal(tp.matmul(qa.to_layout(la), qw.to_layout(lw)), want), (la, lw)


def test_conv2d_reads_every_activation_layout():
    """conv2d takes the activations as Dense codes, BitPlanes (padded or compact rows) or ShiftedInt8, the same
    result; a Float8() QTensor is refused with the fix (its Dense form)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(1, 5, 6, 40, generator=gen)
    qw = tp.quantize(torch.randn(4, 3, 3, 40, generator=gen), "int2", tp.PerChannel(0))
    want = qconv.conv2d(tp.quantize(x, "uint2"), qw, padding=1)
    for layout in ALL_LAYOUTS[1:4]:
        got = qconv.conv2d(tp.quantize(x, "uint2", layout=layout), qw, padding=1)
        assert torch.equal(got, want), layout
    q8 = tp.quantize(x, "e4m3")
    w8 = tp.quantize(torch.randn(4, 3, 3, 40, generator=gen), "e4m3", tp.PerChannel(0))
    with pytest.raises(ValueError, match=r"Float8\(\) layout; conv2d reads Dense\(\) .* x.to_layout\(tcprec.Dense\(\)\)"):
        qconv.conv2d(q8.to_layout(Float8()), w8, padding=1)
    assert torch.equal(qconv.conv2d(q8.to_layout(Float8()).to_layout(Dense()), w8, padding=1),
                       qconv.conv2d(q8, w8, padding=1))


def test_qtensor_is_one_class_for_every_kernel_operand():
    """The static quantizers and the conv's outputs are QTensors whose layout says what they hold."""
    x = torch.rand(1, 2, 3, 40)
    s = torch.tensor([0.1])
    assert qconv.pack_activation(x, "uint2", s).layout == BitPlanes()
    assert qconv.quantize_int8_static(x, "uint8", s).layout == ShiftedInt8()
    assert qconv.quantize_fp8_static(x, s).layout == Dense()
    assert isinstance(qconv.pack_activation(x, "uint2", s), QTensor)


@pytest.mark.parametrize("module", ["tcprec.qtensor", "tcprec.ops.quantize", "tcprec.ops.qconv_operands",
                                    "tcprec.ops.conv"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_conv_backward_reads_float8_qtensors():
    """conv2d_dgrad / conv2d_wgrad take e4m3 / e5m2 QTensors in the Float8() layout with one scale: to_fp8 makes them,
    tcprec.quantize(..., layout=Float8()) stores the same data and scale (the same result; its dtype, the original
    float's, does not change the conv); another layout is refused with the fix."""
    gen = torch.Generator().manual_seed(6)
    dy_hp, w_hp, x_hp = (torch.randn(2, 4, 4, 8, generator=gen), torch.randn(8, 3, 3, 5, generator=gen),
                         torch.randn(2, 4, 4, 5, generator=gen))
    dy8, w8, x8 = tp.to_fp8(dy_hp, "e5m2"), tp.to_fp8(w_hp, "e4m3"), tp.to_fp8(x_hp, "e4m3")
    assert all(isinstance(q, QTensor) and q.layout == Float8() and q.granularity == tp.PerTensor()
               for q in (dy8, w8, x8))
    assert str(dy8.fmt) == "float8_e5m2" and str(w8.fmt) == "float8_e4m3fn"
    assert torch.equal(dy8.dequantize(), dy8.data.float() * dy8.scale)
    kw = dict(padding=1, precision="fp8", backend="reference")
    want_dx = tp.conv2d_dgrad(dy8, w8, (2, 4, 4, 5), **kw)
    want_dw = tp.conv2d_wgrad(dy8, x8, (8, 3, 3, 5), **kw)
    q = tp.quantize(w_hp, "e4m3", layout=Float8())  # absmax per tensor: the same data and scale as to_fp8
    assert torch.equal(q.data.view(torch.uint8), w8.data.view(torch.uint8)) and torch.equal(q.scale, w8.scale)
    assert torch.equal(tp.conv2d_dgrad(dy8, q, (2, 4, 4, 5), **kw), want_dx)
    qdy = QTensor(dy8.data, dy8.scale, "e5m2", tp.PerTensor(), dy8.shape, torch.bfloat16, Float8())  # built by hand
    assert torch.equal(tp.conv2d_wgrad(qdy, x8, (8, 3, 3, 5), **kw), want_dw)
    with pytest.raises(TypeError, match=r"takes fp8 QTensors in the Float8\(\) layout with one scale"):
        tp.conv2d_dgrad(dy8.to_layout(Dense()), w8, (2, 4, 4, 5), **kw)
