"""kernels/cuda/runtime.py is the one NVRTC build / cache / load / launch layer: the kernel modules use only its
public API, importing one kernel module registers no other's op, and the bit-serial GEMM's tile table is data."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

CUDA = Path(__file__).resolve().parents[1] / "src" / "tcprec" / "kernels" / "cuda"


def test_kernel_modules_use_only_the_public_runtime_api():
    from tcprec.kernels.cuda import runtime

    for path in sorted(CUDA.glob("*.py")):
        if path.name in ("__init__.py", "runtime.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "runtime":
                private = [a.name for a in node.names if a.name not in runtime.__all__]
                assert not private, f"{path.name} imports {private} from runtime, which are not in runtime.__all__"
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in (None, "runtime", "codes"):
                raise AssertionError(f"{path.name} imports from the kernel module .{node.module}: "
                                     "kernel modules share only the runtime and the codes vocabulary")
    # the vocabulary (codes.py: the enums of the kernels' mode integers) imports nothing of tcprec
    tree = ast.parse((CUDA / "codes.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or "tcprec" in (n.module or ""))]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_importing_a_kernel_module_registers_only_its_own_op():
    out = _run(
        "import sys, torch, tcprec\n"
        "import tcprec.kernels.cuda.stem_conv\n"
        "print('bmma_gemm' in dir(torch.ops.tcprec), 'tcprec.kernels.cuda.bmma_gemm' in sys.modules)\n"
        "import tcprec.kernels.cuda.bmma_gemm\n"
        "print('bmma_gemm' in dir(torch.ops.tcprec))\n"
    )
    assert out.split() == ["False", "False", "True"], out


def test_tile_table_is_data_with_the_measurements_behind_it():
    from tcprec.kernels.cuda import bmma_gemm as bg

    table = json.loads(bg.TILE_TABLE_PATH.read_text())
    for name, entry in table.items():
        if name == "about":
            continue
        assert set(entry) >= {"value", "measured", "source"} and entry["measured"], name
    assert str(bg.SMALL_TILE) == table["small_tile"]["value"]
    assert str(bg.SMALL_PACKED_TILE) == table["small_packed_tile"]["value"]
    assert bg.SPLIT_MAX == table["split_k"]["value"]["max_runs"]
    assert bg.INT_THRESHOLD_TILES_PER_SM == table["int_threshold_tiles_per_sm"]["value"]
    sync = table["sync_tile"]["value"]
    t = bg.pick_tile(4, 4, False, False, 10**5, 10**5, arch="sm_80")  # a big mma.sync problem takes the sync tile
    assert (t.warps_m, t.warps_n, t.stages, t.bk) == (sync["warps_m"], sync["warps_n"], sync["stages"], sync["bk"])


def test_runtime_compiles_caches_and_names_nvrtc_errors(tmp_path, monkeypatch):
    import pytest

    from tcprec.env import nvrtc_status
    from tcprec.kernels.cuda import runtime

    st = nvrtc_status(probe=False)
    if not st["available"]:
        pytest.skip(f"NVRTC not importable: {st['reason']}")
    monkeypatch.setenv("TCPREC_CACHE_DIR", str(tmp_path))
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int* o) { *o = VALUE; }\n')
    cubin, _ = runtime.compile_source(src, ["VALUE=7"], "sm_90a", "k")
    path7 = runtime.source_cubin_path(src, ["VALUE=7"], "sm_90a")
    assert path7.read_bytes() == cubin and runtime.source_cubin_path(src, ["VALUE=8"], "sm_90a") != path7
    with pytest.raises(RuntimeError, match="NVRTC could not compile k for sm_90a"):
        runtime.compile_source(src, [], "sm_90a", "k")  # VALUE undefined
