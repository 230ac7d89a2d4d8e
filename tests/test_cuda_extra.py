"""The GPU toolchain is the `cuda` extra: a CPU-only install leaves it out, the test extra pulls it in,
and code that needs it names the install command when it is missing."""

import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tcprec.env import INSTALL_CUDA, nvrtc_status

ROOT = Path(__file__).resolve().parents[1]
TOOLCHAIN = ("triton", "cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc")


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()


def test_toolchain_only_in_the_cuda_extra_and_the_test_extra_includes_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert not base & set(TOOLCHAIN), base
    assert {_name(r) for r in extras["cuda"]} == set(TOOLCHAIN)
    assert "tcprec[cuda]" in extras["test"]  # the NVRTC compile tests run in CI, never skip for want of it
    readme = (ROOT / "README.md").read_text()
    assert 'pip install ".[test]"' in readme


@pytest.fixture
def no_toolchain(monkeypatch):
    """Imports of triton / cuda.core fail as on a CPU-only install."""
    from tcprec.kernels.cuda import runtime

    for mod in ("triton", "cuda", "cuda.core", "cuda.core.experimental", "cuda.bindings"):
        monkeypatch.setitem(sys.modules, mod, None)
    runtime.cuda_core_api.cache_clear()
    yield runtime
    runtime.cuda_core_api.cache_clear()


def test_missing_toolchain_names_the_extra(no_toolchain):
    with pytest.raises(ModuleNotFoundError, match=re.escape(INSTALL_CUDA)):
        no_toolchain.cuda_core_api()
    status = nvrtc_status()
    assert not status["available"] and INSTALL_CUDA in status["reason"]
    from tcprec.kernels.triton import choose_backend, triton_usable

    ok, why = triton_usable(torch.zeros(1))
    assert not ok and INSTALL_CUDA in why
    with pytest.raises(RuntimeError, match=re.escape(INSTALL_CUDA)):
        choose_backend(torch.zeros(1), "triton")


def test_cpu_paths_run_without_the_toolchain(no_toolchain, monkeypatch):
    import tcprec as tp

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite interprets Triton on the CPU; a user does not
    x = torch.randn(1000)
    assert torch.equal(tp.decode(tp.encode(x, "e4m3"), "e4m3"), tp.cast(x, "e4m3"))
    qa, qw = tp.quantize(torch.rand(8, 64), "uint2"), tp.quantize(torch.randn(16, 64), "binary")
    assert tp.matmul(qa, qw).shape == (8, 16)
