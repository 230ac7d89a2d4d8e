"""Casts on the GPU: every float32 bit pattern against ml_dtypes, the Triton kernel against the
reference at scale and in every mode, identical stochastic bits on CPU and GPU, and the compiled
kernel's loads.  Skipped without a CUDA GPU (tests/conftest.py)."""

import multiprocessing as mp
import os
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

import tcprec as tp
from tcprec.formats import IntFormat, format
from tcprec.kernels import reference as ref
from tcprec.ops.cast import choose_cast_backend

from _oracles import ML_FLOATS, ml_codes_into_shared

DEV = "cuda"
CHUNK = 1 << 28  # float32 patterns per GPU pass (divides every slice below)
TASK = 1 << 24  # patterns per CPU worker task (~100 MB of temporaries a process: pools of several workers at once)


@pytest.fixture(scope="module")
def pool():
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, min(32, (os.cpu_count() or 2)))) as p:
        yield p


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))


# Each format's 2**32 patterns in SLICES equal slices, one test each (xdist spreads them; together exhaustive).
# float16's oracle is numpy's cast, ~150 ns a pattern whose result overflows or underflows (it raises the FP flag):
# ~550 core-s of pool work for its 2**32 patterns against 25-75 for an ml_dtypes format (CPU figures, this machine).
SLICES = {"float16": 16}
CASES = [(name, i, SLICES.get(name, 4)) for name in ML_FLOATS for i in range(SLICES.get(name, 4))]


@pytest.mark.parametrize("name,part,parts", CASES, ids=[f"{n}-{i + 1}of{k}" for n, i, k in CASES])
def test_every_float32_bit_pattern_matches_ml_dtypes(name, part, parts, pool):
    """All 2**32 float32 inputs (slice ``part`` of ``parts`` here): codes (encode) and values (cast)
    of the Triton kernel equal ml_dtypes' round-to-nearest-even, bit for bit."""
    fmt = format(name)
    width = 2 if fmt.bits > 8 else 1
    span = (1 << 32) // parts
    lo = part * span
    shm = shared_memory.SharedMemory(create=True, size=width * span)
    try:
        tasks = [(shm.name, name, fmt.bits, s, TASK, lo) for s in range(lo, lo + span, TASK)]
        pool.starmap(ml_codes_into_shared, tasks)
        ml_all = np.ndarray((span,), dtype=np.uint16 if width == 2 else np.uint8, buffer=shm.buf)
        mismatches = 0
        for start in range(lo, lo + span, CHUNK):
            bits = torch.arange(start, start + CHUNK, dtype=torch.int64, device=DEV)
            x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # patterns as float32
            nan = torch.isnan(x)
            codes = tp.encode(x[~nan], fmt).to(torch.int64) & (fmt.n_codes - 1)
            raw = ml_all[start - lo:start - lo + CHUNK]  # the codes as stored (1 or 2 bytes), widened on the GPU
            raw = torch.from_numpy(raw.view(np.int16) if width == 2 else raw).to(DEV)
            want = (raw.long() & ((1 << (8 * width)) - 1))[~nan]
            mismatches += int((codes != want).sum())
            vals = tp.cast(x, fmt)
            assert bool(torch.isnan(vals[nan]).all())
            ok = _same(vals[~nan], tp.decode(want, fmt))
            mismatches += int((~ok).sum())
            if fmt.has_nan:
                assert bool(torch.isnan(tp.decode(tp.encode(x[nan], fmt), fmt)).all())
        assert mismatches == 0, f"{name}: {mismatches} mismatches over the patterns {lo:#x}..{lo + span - 1:#x}"
    finally:
        shm.close()
        shm.unlink()


FORMATS = ["e4m3", "e5m2", "e4m3fnuz", "fp6", "e2m3", "fp4", "bf16", "fp16", "tf32", "e8m0", "e3m4", "e2m0",
           "e3m1_nosub", "e4m3_sat", "int1", "int4", "int8", "uint2", "binary", "pm3"]
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic"]


@pytest.mark.parametrize("name", FORMATS)
def test_triton_equals_reference_on_gpu(name):
    fmt = format(name)
    g = torch.Generator(device=DEV).manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), device=DEV, dtype=torch.int32, generator=g)
    scale = fmt.max / 3 if not isinstance(fmt, IntFormat) else 4.0
    x = torch.cat([bits.view(torch.float32), torch.randn(1 << 22, device=DEV, generator=g) * scale])
    for mode in MODES:
        seed = 5 if mode == "stochastic" else None
        rf = (ref.cast_int, ref.encode_int) if isinstance(fmt, IntFormat) else (ref.cast_float, ref.encode_float)
        from tcprec.kernels.triton import cast as tcast

        assert bool(_same(tcast.cast(x, fmt, mode, seed), rf[0](x, fmt, mode, seed)).all()), (name, mode)
        want = rf[1](x, fmt, mode, seed)
        got = tcast.encode(x, fmt, mode, seed).long()
        m = fmt.n_codes - 1
        assert bool((((got & m) == (want & m)) | (want == -1)).all()), (name, mode)


def test_stochastic_bits_identical_on_cpu_and_gpu():
    x = torch.randn(1 << 20)
    for name in ("e4m3", "fp4", "int4"):
        cpu = tp.cast(x, name, "stochastic", generator=torch.Generator().manual_seed(3))
        gpu = tp.cast(x.to(DEV), name, "stochastic", generator=torch.Generator().manual_seed(3))
        assert torch.equal(cpu, gpu.cpu())


def test_cuda_tensors_take_the_triton_kernel():
    name, why = choose_cast_backend(torch.zeros(1, device=DEV))
    assert name == "triton" and "Triton" in why


def test_compiled_kernel_uses_16_byte_loads():
    from tcprec.kernels.triton import cast as tcast

    x = torch.randn(1 << 20, device=DEV)
    fmt = format("e4m3")
    out = torch.empty_like(x)
    k = tcast._float_round_kernel[(triton_cdiv(x.numel(), tcast.BLOCK),)](
        x, out, x.numel(), 0, torch.zeros(1, dtype=torch.int32, device=DEV), **tcast._float_constexprs(fmt), MODE=0, WRITE_CODES=False, BLOCK=tcast.BLOCK,
        num_warps=tcast.NUM_WARPS)
    ptx = k.asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert torch.equal(out, ref.cast_float(x, fmt, "nearest", None))


def triton_cdiv(a, b):
    return (a + b - 1) // b


def test_quantize_and_bitplanes_match_cpu():
    x = torch.randn(257, 1000)
    for name, gran in (("int4", tp.PerChannel(0)), ("uint2", tp.PerTensor()), ("e4m3", tp.PerGroup(100)),
                       ("mxfp4", None)):
        xx = x.abs() if name.startswith("u") else x
        xx = xx[:, :992] if name == "mxfp4" else xx
        a, b = tp.quantize(xx, name, gran), tp.quantize(xx.to(DEV), name, gran)
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale, b.scale.cpu())
    codes = torch.randint(0, 8, (129, 1000), dtype=torch.uint8)
    assert torch.equal(tp.pack_bitplanes(codes, 3), tp.pack_bitplanes(codes.to(DEV), 3).cpu())
