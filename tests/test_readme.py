"""The README's "API in one screen" block runs as written (on the CPU: the reference backend), with
only its problem sizes shrunk so it fits in CI (a batch of 8 and a 4096 solve take minutes
on two cores; the calls, names and arguments are the README's own)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SHRINK = [("torch.randn(8, 3, 224, 224)", "torch.randn(1, 3, 224, 224)"), ("hpl_mxp_matrix(4096", "hpl_mxp_matrix(256"),
          ("torch.ones(4096,", "torch.ones(256,")]


def _api_block() -> str:
    text = README.read_text()
    m = re.search(r"## The API in one screen\s+```python\n(.*?)```", text, re.S)
    assert m, "README has no 'API in one screen' python block"
    return m.group(1)


def test_api_in_one_screen_runs(monkeypatch):
    code = _api_block()
    for old, new in SHRINK:
        assert old in code, f"README changed: {old!r} is gone; update SHRINK"
        code = code.replace(old, new)
    monkeypatch.setattr("builtins.print", lambda *a, **k: None)
    with pytest.warns(UserWarning, match="eagerly"):  # tp.compile off the GPU says it runs eager
        ns: dict = {}
        exec(compile(code, str(README), "exec"), ns)
    assert ns["info"].backward_error <= 16 and ns["y"].shape[0] == 64


def test_training_emulation_block_runs():
    text = README.read_text()
    m = re.search(r"### Training emulation\s+```python\n(.*?)```", text, re.S)
    assert m, "README has no 'Training emulation' python block"
    ns: dict = {}
    exec(compile(m.group(1), str(README), "exec"), ns)
    import torch

    assert [n for n, _, _ in ns["report"].swapped] == ["0"]
    x = torch.randn(4, 32, requires_grad=True)
    ns["net"](x).sum().backward()
    assert x.grad is not None and ns["layer"](torch.randn(2, 256)).shape == (2, 128)
