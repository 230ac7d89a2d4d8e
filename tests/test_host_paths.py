"""The kernels' launch code stays cheap on the host: no Triton constexpr-function helpers in plain Python
(``triton.cdiv`` / ``triton.next_power_of_2`` cost 2-3 us a call; the launch paths used them dozens of times
a call), and the TMA wgrad split model (a loop over up to 256 splits) is memoised."""

from __future__ import annotations

import ast
import pathlib

import pytest

import tcprec.kernels.triton as kt_pkg

SLOW_HOST_HELPERS = {"triton.cdiv", "triton.next_power_of_2"}


def _jitted(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_launch_code_uses_plain_helpers():
    root = pathlib.Path(kt_pkg.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and _jitted(f)
                     for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in SLOW_HOST_HELPERS and id(node) not in jit_nodes:
                bad.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
    assert not bad, f"host code calls Triton constexpr helpers (use kernels/triton/_host.py): {bad}"


def test_host_helpers_match_triton():
    triton = pytest.importorskip("triton")
    from tcprec.kernels.triton._host import cdiv, next_power_of_2

    for a in range(0, 70):
        for b in (1, 2, 3, 7, 16, 64):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 300):
        assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_wgrad_tma_split_model_is_memoised():
    wt = pytest.importorskip("tcprec.kernels.triton.wgrad_tma")
    from tcprec.bench.conv_bwd import RESNET50_LAYERS

    g = RESNET50_LAYERS[2].geometry(256)
    cfg = wt.pick(g)
    box = wt.plan(g, cfg, None, 132)["box"]
    before = wt._split_for.cache_info()
    s1 = wt.split_for(g, cfg, box, 132)
    s2 = wt.split_for(g, dict(cfg), list(box), 132)  # an equal config as a new dict, the box as a list
    after = wt._split_for.cache_info()
    assert s1 == s2 and after.hits >= before.hits + 1
    assert wt.phase_launches(g) == wt.phase_launches(g) and wt.phase_launches(g) is not wt.phase_launches(g)
