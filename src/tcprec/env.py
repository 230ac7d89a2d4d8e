"""What this machine can run: versions, the GPU, and which tensor-core paths are available (and why
the others are not).  Never raises: a missing GPU, driver or package is reported, not fatal.

>>> rep = device_report(probe_nvrtc=False)
>>> rep["torch"] == __import__("torch").__version__
True
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess

import torch

from ._version import __version__

__all__ = ["device_report", "tensor_core_paths", "nvrtc_status", "NO_GPU", "INSTALL_CUDA"]

NO_GPU = "no CUDA device: reference backend (pure torch) runs everything, results identical"
# The GPU toolchain (Triton, cuda.core, NVRTC) is the `cuda` extra: a CPU-only install does not need it.
INSTALL_CUDA = 'pip install "tcprec[cuda]"'

# Tensor-core paths tcprec uses: (path, lowest compute capability, highest or None, what runs on it).
# Hardware facts from the PTX ISA; wgmma exists on Hopper (sm_90a) only.
_PATHS = (
    ("fp16 mma (HMMA)", (7, 0), None, "fp16 GEMM/conv"),
    ("bf16 / tf32 mma (HMMA)", (8, 0), None, "bf16 and tf32 GEMM/conv"),
    ("int8 mma (IMMA)", (7, 5), None, "integer formats with p*q >= 8 bits"),
    ("binary mma b1 AND+popc (BMMA)", (8, 0), None, "bit-serial GEMM/conv for p*q < 8 bits"),
    ("fp8 mma e4m3/e5m2 (QGMMA)", (8, 9), None, "fp8, fp6 and fp4 formats (exact in e4m3/e5m2)"),
    ("wgmma (Hopper warpgroup MMA)", (9, 0), (9, 0), "fastest f16/int8/fp8/b1 path, compiled for sm_90a"),
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tensor_core_paths(capability: tuple[int, int] | None) -> list[dict]:
    """Each tensor-core path with ``available`` and a ``reason``, for a GPU of compute capability
    ``capability`` (``None``: no CUDA device).

    >>> [p["path"] for p in tensor_core_paths((8, 0)) if not p["available"]]
    ['fp8 mma e4m3/e5m2 (QGMMA)', 'wgmma (Hopper warpgroup MMA)']
    """
    rows = []
    for path, lo, hi, use in _PATHS:
        if capability is None:
            ok, reason = False, NO_GPU
        else:
            sm = f"sm_{capability[0]}{capability[1]}"
            need = f"sm_{lo[0]}{lo[1]}" + ("" if hi is None else " only" if hi == lo else f"..sm_{hi[0]}{hi[1]}")
            ok = lo <= capability and (hi is None or capability <= hi)
            reason = f"{use}: {sm} has it" if ok else f"needs {need}, this GPU is {sm}"
        rows.append({"path": path, "available": ok, "reason": reason})
    return rows


def nvrtc_status(probe: bool = True) -> dict:
    """Whether the run-time CUDA compiler works here (it needs no GPU).

    ``probe=True`` compiles a one-line kernel to an sm_90a cubin through ``cuda.core`` (~20 ms).
    cuda.core 1.x exposes ``cuda.core.Program``, older releases ``cuda.core.experimental.Program``.
    """
    status = {"cuda_core": _version("cuda-core"), "nvrtc": None, "available": False, "reason": ""}
    try:
        try:
            from cuda.core import Program, ProgramOptions
        except ImportError:
            from cuda.core.experimental import Program, ProgramOptions
    except Exception as e:  # ImportError, or a broken install raising anything at import
        status["reason"] = f"cuda.core Program not importable ({type(e).__name__}: {e}); {INSTALL_CUDA}"
        return status
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        status["nvrtc"] = f"{major}.{minor}"
    except Exception as e:
        status["reason"] = f"NVRTC library not loadable ({type(e).__name__}: {e}); {INSTALL_CUDA}"
        return status
    if not probe:
        status.update(available=True, reason="cuda.core and NVRTC import (compile not probed)")
        return status
    try:
        src = 'extern "C" __global__ void probe(int* out) { out[0] = 1; }'
        # cubin, not ptx: cuda.core asks the driver whether it can load PTX, and there may be none.
        Program(src, code_type="c++", options=ProgramOptions(arch="sm_90a")).compile("cubin")
    except Exception as e:
        status["reason"] = f"NVRTC compile of a test kernel failed ({type(e).__name__}: {e})"
        return status
    status.update(available=True, reason="compiles sm_90a cubins here (no GPU needed to compile)")
    return status


def _driver_version() -> str | None:
    """The NVIDIA driver version (nvidia-smi), else the CUDA driver API version; None if neither."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # no libcuda: nothing to report
        pass
    return None


def _tcprec_version() -> str:
    return __version__


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)"
    return (f"torch {torch.__version__} has CUDA {torch.version.cuda} but sees no device "
            "(check the driver and CUDA_VISIBLE_DEVICES)")


def device_report(probe_nvrtc: bool = True) -> dict:
    """Versions, the GPU (device 0, or the current device) and the available tensor-core paths.

    Keys: ``python``, ``platform``, ``tcprec``, ``torch``, ``torch_cuda``, ``triton``,
    ``cuda_core``, ``nvrtc`` (dict from :func:`nvrtc_status`), ``cuda_available``, ``gpu``,
    ``compute_capability``, ``sm_count``, ``gpu_memory_gib``, ``l2_cache_bytes``, ``driver``,
    ``backend`` (what runs the ops here, in words) and ``tensor_core_paths`` (list of dicts).
    GPU fields are None without a CUDA device.
    """
    rep = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tcprec": _tcprec_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cuda_core": _version("cuda-core"),
        "nvrtc": nvrtc_status(probe_nvrtc),
        "cuda_available": torch.cuda.is_available(),
        "gpu": None,
        "compute_capability": None,
        "sm_count": None,
        "gpu_memory_gib": None,
        "l2_cache_bytes": None,
        "driver": None,
    }
    capability = None
    if rep["cuda_available"]:
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        rep.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            driver=_driver_version(),
        )
        triton_ok = rep["triton"] is not None
        rep["backend"] = (
            "GPU: Triton kernels for casts and float/int8 GEMMs, NVRTC CUDA kernels for bit-serial GEMMs"
            if triton_ok else "GPU without Triton: reference backend (pure torch) on the GPU"
        )
    else:
        rep["backend"] = f"{NO_GPU} ({_no_cuda_reason()})"
    rep["tensor_core_paths"] = tensor_core_paths(capability)
    return rep
