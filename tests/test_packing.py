"""Bit planes: layout, round trips, the Triton kernel (interpreter) against the reference, errors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest may do it too)

import pytest
import torch

import tcprec.packing as packing
from tcprec.ops.quantize import quantize
from tcprec.packing import (
    K_PAD_BITS,
    pack_bitplanes,
    pack_bitplanes_reference,
    packed_words,
    plane_popcounts,
    unpack_bitplanes,
)
from tcprec.qtensor import PerChannel

KS = [1, 31, 32, 33, 511, 512, 513, 1000]
BITS = list(range(1, 9))


def _codes(shape, bits, seed=0, dtype=torch.uint8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=g).to(dtype)


def test_packed_words_pads_to_512_bits():
    assert K_PAD_BITS == 512
    assert [packed_words(k) for k in (0, 1, 511, 512, 513, 1000, 1024, 1025)] == [0, 16, 16, 16, 32, 32, 32, 48]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("K", KS)
def test_reference_round_trip(bits, K):
    for lead in [(), (3,), (2, 3)]:
        codes = _codes(lead + (K,), bits, seed=bits * 1000 + K)
        planes = pack_bitplanes(codes, bits, backend="reference")
        assert planes.dtype == torch.int32
        assert planes.shape == (bits,) + lead + (packed_words(K),)
        back = unpack_bitplanes(planes, bits, K)
        assert back.dtype == torch.uint8
        assert torch.equal(back, codes)


@pytest.mark.parametrize("bits", BITS)
def test_triton_equals_reference(bits):
    # Interpreter runs are slow: one launch per K, small leading dims (7 rows: a partial row tile).
    for K in KS:
        codes = _codes((7, K), bits, seed=bits * 7919 + K)
        got = pack_bitplanes(codes, bits, backend="triton")
        want = pack_bitplanes_reference(codes, bits)
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got, want), f"bits={bits} K={K}"
        assert torch.equal(unpack_bitplanes(got, bits, K), codes)


def test_triton_leading_dims_and_wide_code_dtype():
    codes = _codes((2, 3, 70), 5, seed=3, dtype=torch.int64)  # int64 codes, 3-d, non-uint8
    got = pack_bitplanes(codes, 5, backend="triton")
    assert got.shape == (5, 2, 3, 16)
    assert torch.equal(got, pack_bitplanes_reference(codes, 5))
    # a non-contiguous view packs the same as its contiguous copy
    wide = _codes((4, 130), 3, seed=4)
    view = wide[:, 1:129:2]  # (4, 64), stride 2 along K
    assert torch.equal(pack_bitplanes(view, 3, backend="triton"), pack_bitplanes(view.contiguous(), 3, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_explicit_layout(backend):
    # K=1: one code, padded to 16 words (512 bits) of which only bit 0 of word 0 can be set
    p = pack_bitplanes(torch.tensor([[1]], dtype=torch.uint8), 1, backend=backend)
    assert p.shape == (1, 1, 16)
    assert p[0, 0].tolist() == [1] + [0] * 15

    # LSB-first: element k is bit k % 32 of word k // 32; planes hold bit b of every code
    K = 513
    codes = torch.zeros(1, K, dtype=torch.uint8)
    codes[0, 0] = 0b101  # plane 0 and plane 2
    codes[0, 31] = 0b010  # plane 1, bit 31 of word 0 -> the int32 sign bit
    codes[0, 32] = 0b001  # plane 0, bit 0 of word 1
    codes[0, 512] = 0b100  # plane 2, bit 0 of word 16 (second 512-bit chunk)
    p = pack_bitplanes(codes, 3, backend=backend)
    assert p.shape == (3, 1, 32)
    want = torch.zeros(3, 1, 32, dtype=torch.int32)
    want[0, 0, 0] = 1
    want[2, 0, 0] = 1
    want[1, 0, 0] = -(2**31)
    want[0, 0, 1] = 1
    want[2, 0, 16] = 1
    assert torch.equal(p, want)

    # a full word: codes 0..31 with bits=5 -> plane b word 0 = mask of k with bit b set
    codes = torch.arange(32, dtype=torch.uint8).view(1, 32)
    p = pack_bitplanes(codes, 5, backend=backend)
    for b in range(5):
        mask = sum(1 << k for k in range(32) if (k >> b) & 1)
        assert (int(p[b, 0, 0]) & 0xFFFFFFFF) == mask
        assert p[b, 0, 1:].eq(0).all()  # zero padding


def test_plane_popcounts_equals_direct_count():
    codes = _codes((2, 5, 1000), 4, seed=11)
    planes = pack_bitplanes(codes, 4)
    pc = plane_popcounts(planes)
    assert pc.dtype == torch.int32 and pc.shape == (4, 2, 5)
    direct = torch.stack([((codes.long() >> b) & 1).sum(-1) for b in range(4)]).to(torch.int32)
    assert torch.equal(pc, direct)
    # arbitrary words, negative ones included, against Python's bin().count
    words = torch.randint(-(2**31), 2**31, (3, 4, 16), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    words[0, 0, 0] = -1  # all 32 bits
    words[0, 0, 1] = -(2**31)  # only the sign bit
    w32 = words.to(torch.int32)
    want = [[sum(bin(int(v) & 0xFFFFFFFF).count("1") for v in row) for row in plane] for plane in words.tolist()]
    assert plane_popcounts(w32).tolist() == want


def test_bitplanes_feed_the_bit_serial_product():
    """sum_{i,j} 2**(i+j) popc(a_i AND w_j) over the packed planes equals the integer matmul."""
    p, q, M, N, K = 2, 3, 5, 4, 600
    a = _codes((M, K), p, seed=1)
    w = _codes((N, K), q, seed=2)
    pa, pw = pack_bitplanes(a, p), pack_bitplanes(w, q)  # (p, M, Kw), (q, N, Kw)
    c = torch.zeros(M, N, dtype=torch.int64)
    for i in range(p):
        for j in range(q):
            anded = pa[i][:, None, :] & pw[j][None, :, :]  # (M, N, Kw) int32
            c += plane_popcounts(anded).long() << (i + j)
    assert torch.equal(c, a.long() @ w.long().T)


def test_qtensor_to_bitplanes():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    qx = quantize(x, "int3", PerChannel(0))
    planes = qx.to_bitplanes()
    assert planes.shape == (3, 6, 16)
    assert torch.equal(unpack_bitplanes(planes, 3, 40), qx.codes)
    with pytest.raises(TypeError, match="integer format"):
        quantize(x, "e4m3").to_bitplanes()
    with pytest.raises(TypeError, match="integer format"):
        quantize(x[:, :32], "mxfp8").to_bitplanes()


def test_bad_inputs():
    codes = _codes((2, 8), 2)
    for bits in (0, 9):
        with pytest.raises(ValueError, match=f"bits must be 1..8.*bits={bits}"):
            pack_bitplanes(codes, bits)
    with pytest.raises(TypeError, match="bits must be an int"):
        pack_bitplanes(codes, 2.0)
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        pack_bitplanes(codes.float(), 2)
    with pytest.raises(TypeError, match="dtype=torch.bool"):
        pack_bitplanes(codes.bool(), 1)
    with pytest.raises(ValueError, match=r"0\.\.3.*e\.g\. 4"):
        pack_bitplanes(torch.tensor([[1, 4]], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match=r"e\.g\. -1"):
        pack_bitplanes(torch.tensor([[-1, 0]], dtype=torch.int8), 2)
    with pytest.raises(ValueError, match="0-d"):
        pack_bitplanes(torch.tensor(1, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        pack_bitplanes(codes, 2, backend="cuda")
    planes = pack_bitplanes(codes, 2)
    with pytest.raises(ValueError, match="Kw=16"):
        unpack_bitplanes(planes[..., :8], 2, 8)
    with pytest.raises(ValueError, match="bits=3"):
        unpack_bitplanes(planes, 3, 8)
    with pytest.raises(TypeError, match="int32"):
        unpack_bitplanes(planes.long(), 2, 8)
    with pytest.raises(TypeError, match="int32"):
        plane_popcounts(planes.float())


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pack_bitplanes(_codes((2, 8), 2), 2, backend="triton")
    # auto falls back to the reference and says why
    name, why = packing.choose_pack_backend(_codes((2, 8), 2), "auto")
    assert name == "reference" and "CUDA" in why
