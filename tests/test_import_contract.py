"""The import contract (tests/_import_contract.py): layers formats -> kernels -> ops -> libraries ->
drivers -> entry points, imports only downward (function-local ones too), no cycles; and the checker
catches each kind of violation on a planted tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from _import_contract import LAYERS, check

SRC = Path(__file__).resolve().parents[1] / "src"


def test_tcprec_keeps_the_contract():
    problems = check(SRC)
    assert problems == [], "\n".join(problems)


# A synthetic package with the same layer scheme, for the checker itself.
_LAYERS = [("base", ("pkg.base",), False), ("kernels", ("pkg.kernels",), False), ("ops", ("pkg.ops",), False),
           ("libraries", ("pkg.nn", "pkg.linalg"), True), ("entry", ("pkg",), False)]

_CLEAN = {
    "__init__.py": "from . import nn, linalg\n",
    "base.py": "X = 1\n",
    "kernels/__init__.py": "",
    "kernels/reference.py": "from ..base import X\n",
    "kernels/triton/__init__.py": "",
    "kernels/triton/k.py": "from ..reference import X\n",
    "ops/__init__.py": "from .a import f\n",
    "ops/a.py": ("from ..kernels.reference import X\n\n"
                 "def f():\n    from ..kernels.triton import k  # a Triton kernel module: lazy is allowed\n"
                 "    return k\n"),
    "nn/__init__.py": "from ..ops import f\n",
    "linalg/__init__.py": "from ..ops.a import f\n\ndef g():\n    import json  # not ours\n    return json\n",
}


def _tree(tmp_path: Path, changes: dict[str, str]) -> Path:
    files = dict(_CLEAN)
    files.update(changes)
    for rel, text in files.items():
        p = tmp_path / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def _check(tmp_path, changes):
    return check(_tree(tmp_path, changes), "pkg", _LAYERS, ("pkg.kernels.triton",))


def test_checker_passes_the_clean_tree(tmp_path):
    assert _check(tmp_path, {}) == []


@pytest.mark.parametrize("changes, expected", [
    # an upward import at module level
    ({"kernels/reference.py": "from ..ops.a import f\n"}, "pkg.kernels.reference:1 imports pkg.ops.a: upward"),
    # an upward import hidden in a function (with a justification: still upward)
    ({"base.py": "X = 1\n\ndef h():\n    from .nn import f  # lazy: no excuse\n    return f\n"},
     "pkg.base:4 imports pkg.nn: upward (base -> libraries)"),
    # a sideways import between independent siblings
    ({"linalg/__init__.py": "from ..nn import f\n"}, "pkg.linalg:1 imports pkg.nn: sideways"),
    # a function-local import of a non-kernel module without a reason
    ({"nn/__init__.py": "def f():\n    from ..ops.a import f\n    return f\n"},
     "pkg.nn:2 imports pkg.ops.a inside a function"),
    # a cycle inside one layer through a function-local import
    ({"ops/b.py": "from .a import f\n", "ops/a.py": "X = 1\n\ndef f():\n    from .b import f  # lazy: cycle\n"},
     "import cycle: pkg.ops.a <-> pkg.ops.b"),
    # a module in no layer
    ({"stray.py": "X = 2\n"}, "pkg.stray: in no layer"),
])
def test_checker_catches_planted_violations(tmp_path, changes, expected):
    problems = _check(tmp_path, changes)
    assert any(expected in p for p in problems), problems


def test_checker_sees_a_cycle_through_a_package_init(tmp_path):
    """pkg.ops.sub.b -> pkg.ops.a -> pkg.ops.sub.c: importing c from outside runs pkg/ops/sub/__init__.py,
    which imports b -- a cycle no single import line shows (tcprec.qtensor -> tcprec.ops.* was one)."""
    problems = _check(tmp_path, {
        "ops/a.py": "from .sub.c import Y\n\ndef f():\n    pass\n",
        "ops/sub/__init__.py": "from .b import Z\n",
        "ops/sub/b.py": "from ..a import f\nZ = 1\n",
        "ops/sub/c.py": "Y = 1\n",
    })
    assert any(p.startswith("import cycle:") and "pkg.ops.sub" in p for p in problems), problems


def test_every_layer_component_exists():
    """A renamed package must not leave a stale entry behind (it would silently cover nothing)."""
    for _, comps, _ in LAYERS:
        for c in comps:
            rel = Path(*c.split("."))
            assert (SRC / rel).is_dir() or (SRC / rel).with_suffix(".py").is_file(), c
