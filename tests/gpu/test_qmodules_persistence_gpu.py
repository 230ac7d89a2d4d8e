"""Quantized networks persist on the GPU too (issue 40): ResNet-18 (chained layers, fused residuals, dual
outputs) at every precision the API accepts, fp16: torch.save of the whole model -> torch.load in a fresh process
-> identical outputs, eager and through a rebuilt ``tcprec.compile`` engine; state_dict into a second quantized
model; .half() keeps the scales float32."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tcprec as tp
from tcprec.nn import models as zoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")

PRECISIONS = ["int8", "fp8", "w1a1", "w1a2", "w2a2", "w4a4"]


def _quantized(p, seed=0):
    m = zoo.build("resnet18", seed=seed, device="cuda").to(dtype=torch.float16, memory_format=torch.channels_last)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 3, 224, 224, device="cuda", generator=g).half()
    return tp.quantize_model(m, p, calibration=x, warn=False), x


@pytest.mark.parametrize("p", PRECISIONS)
@torch.no_grad()
def test_save_load_in_a_fresh_process_and_state_dict_round_trip(p, tmp_path):
    """One precision a test (each fits a per-test timeout, and a failure names its precision)."""
    q, x = _quantized(p)
    torch.save(q, tmp_path / f"{p}.pt")
    torch.save(q(x), tmp_path / f"{p}.want")
    torch.save(x, tmp_path / "x.pt")
    q2, _ = _quantized(p, seed=1)
    assert not torch.equal(q2(x), q(x))
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2(x), q(x)), p
    script = textwrap.dedent(f"""
        import os, torch, tcprec
        d, p = {str(tmp_path)!r}, {p!r}
        x = torch.load(os.path.join(d, "x.pt"))
        with torch.no_grad():
            q = torch.load(os.path.join(d, p + ".pt"), weights_only=False)
            torch.save(q(x), os.path.join(d, p + ".got"))
            eng = tcprec.compile(q, x)
            torch.save(eng(x.cpu()), os.path.join(d, p + ".engine"))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = torch.load(tmp_path / f"{p}.want")
    assert torch.equal(torch.load(tmp_path / f"{p}.got"), want), p
    assert torch.equal(torch.load(tmp_path / f"{p}.engine").to(want.device), want), p


@torch.no_grad()
def test_strict_load_refuses_another_precision_on_cuda():
    q8, x = _quantized("int8")
    q4, _ = _quantized("w4a4")
    before = q4(x)
    # the first conv is int8 in both (first_last) but chains into different formats: on the GPU the refusal names
    # out_fmt there, before any precision difference further on
    with pytest.raises(ValueError, match=r"cannot load a quantized layer's state .*(precision|out_fmt)"):
        q4.load_state_dict(q8.state_dict())
    assert torch.equal(q4(x), before)


@torch.no_grad()
def test_float_casts_keep_scales_float32_on_cuda():
    q, x = _quantized("int8")
    want = q(x)
    scales = {k: v.clone() for k, v in q.state_dict().items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    q.float()
    for k, v in scales.items():
        assert torch.equal(q.state_dict()[k], v), k
    q.half()
    assert torch.equal(q(x), want)
