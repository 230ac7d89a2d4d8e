"""Ahead-of-time compiles for sm_90 without a GPU: a test runs its own file with ``--aot`` in a
subprocess (under TRITON_INTERPRET=1, triton.jit builds interpreter objects, not compilable ones), and
that file's ``__main__`` block prints what the test checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_aot(test_file: str, timeout: int) -> str:
    """stdout of ``python test_file --aot`` with TRITON_INTERPRET unset; skips (with the reason) where
    Triton's NVIDIA backend is missing (exit status 3), fails with stderr's tail on any other error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, test_file, "--aot"], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode == 3:
        pytest.skip(f"Triton's NVIDIA compiler is not usable here: {r.stdout.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def require_nvidia_backend() -> None:
    """In the ``--aot`` subprocess: exit with status 3 (and say why) where Triton has no NVIDIA backend."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        print(f"no NVIDIA backend in this triton: {e}")
        sys.exit(3)


def compile_ptx(fn, types: dict, consts: dict, div=(), num_warps: int = 8) -> str:
    """In the ``--aot`` subprocess: the PTX of the Triton kernel ``fn`` built for sm_90.  ``consts`` are its
    constexprs, ``types`` every other argument's type (``"*fp32"``, ``"i32"``); pointers and the integer
    arguments named in ``div`` are declared multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types[name]
            if types[name].startswith("*") or name in div:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps)).asm["ptx"]
