"""The CUDA kernels' runtime: build a ``.cu`` file with NVRTC, cache the cubin on disk, load a kernel
once per device, launch it on PyTorch's current stream.  Nothing here knows a particular kernel: a
kernel module (``bmma_gemm.py``, ``stem_conv.py``) names its source, its ``-D`` defines and its entry
point, and keys what it loads by a tuple of its own.

Compiling needs no GPU (CI compiles for sm_90a); loading and launching need one.  Launches go on
``torch.cuda.current_stream``, so they work under ``torch.cuda.graph`` capture.

Cache: ``$TCPREC_CACHE_DIR/cubin`` (default ``~/.cache/tcprec/cubin``), one file per
``sha256(source with its includes, defines, arch, NVRTC and cuda-core versions)``.

The public API::

    cubin, log = compile_source(path, defines, arch, name)     # NVRTC, cached (ptxas -v log)
    kernel = load_kernel(key, path, defines, name, entry, device_index, smem_bytes)
    config = launch_config(grid, block, smem_bytes=0, pdl=False, device_index=0)   # memoised
    launch(kernel, config, device, *args)                       # args: ptr(t), np.int32(...), ...
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Hashable, Iterable, Optional

import numpy as np
import torch

from ...env import INSTALL_CUDA

__all__ = [
    "cuda_core_api",
    "arch_of",
    "default_arch",
    "source_text",
    "source_cubin_path",
    "compile_source",
    "compile_all",
    "load_kernel",
    "set_kernel_attribute",
    "launch_config",
    "launch",
    "ptr",
    "sm_count",
    "usable",
]


# ------------------------------------------------------------------------------------------------
# Compiling (no GPU needed)
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def cuda_core_api():
    """(Program, ProgramOptions, ObjectCode, Device, LaunchConfig, Stream, launch) from cuda.core 1.x,
    or from ``cuda.core.experimental`` in older releases."""
    try:
        from cuda.core import Device, LaunchConfig, ObjectCode, Program, ProgramOptions, Stream, launch
    except ImportError:
        try:
            from cuda.core.experimental import (Device, LaunchConfig, ObjectCode, Program, ProgramOptions, Stream,
                                                launch)
        except ImportError as e:
            raise ModuleNotFoundError(f"the CUDA kernels need cuda.core and NVRTC, which are not installed "
                                      f"({type(e).__name__}: {e}); {INSTALL_CUDA}") from e
    return Program, ProgramOptions, ObjectCode, Device, LaunchConfig, Stream, launch


def arch_of(capability: tuple[int, int] | None) -> str:
    """NVRTC target for a compute capability: ``sm_90a`` on Hopper (the arch-specific target), else
    ``sm_XY``; ``None`` (no GPU, e.g. CI) compiles for sm_90a."""
    if capability is None:
        return "sm_90a"
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def default_arch() -> str:
    """The current CUDA device's target, or sm_90a without a GPU (CI: what an H100 / H200 runs)."""
    if torch.cuda.is_available():
        return arch_of(torch.cuda.get_device_capability())
    return "sm_90a"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist in ("cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "cuda-bindings"):
        try:
            parts.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            pass
    return ",".join(parts)


def _cache_dir() -> Path:
    root = os.environ.get("TCPREC_CACHE_DIR")
    if root:
        return Path(root) / "cubin"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tcprec" / "cubin"


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.M)


def source_text(source: Path) -> str:
    """The text NVRTC compiles for ``source``: each ``#include "name"`` line replaced by the file ``name`` beside it
    (once: the shared headers, e.g. ``codes.cuh``, include nothing), so the cubin cache key covers the headers too."""
    def sub(m):
        inc = source.with_name(m.group(1))
        if not inc.exists():
            raise FileNotFoundError(f"{source.name} includes {m.group(1)!r}, which is not in {source.parent}")
        return inc.read_text()

    return _INCLUDE.sub(sub, source.read_text())


def source_cubin_path(source: Path, defines: list[str], arch: str = "sm_90a") -> Path:
    """Where the cubin of ``source`` compiled with ``defines`` for ``arch`` lives in the disk cache."""
    h = hashlib.sha256()
    for part in (source_text(source), " ".join(defines), arch, _versions()):
        h.update(part.encode())
        h.update(b"\0")
    return _cache_dir() / f"{h.hexdigest()[:32]}.cubin"


def compile_source(source: Path, defines: list[str], arch: str, name: str, *,
                   use_cache: bool = True) -> tuple[bytes, str]:
    """(cubin bytes, compiler log) of the CUDA C++ file ``source`` with ``-D defines`` for ``arch``,
    through NVRTC (``ptxas -v``: the log reports registers, spills and stack frame); cached on disk.
    Raises ``RuntimeError`` with NVRTC's log if the source does not compile.  Every ``.cu`` file of
    tcprec is built here."""
    path = source_cubin_path(source, defines, arch)
    log_path = path.with_suffix(".log")

    def cached() -> tuple[bytes, str]:
        return path.read_bytes(), log_path.read_text() if log_path.exists() else ""

    if not use_cache:
        return _nvrtc(source, defines, arch, name)
    if path.exists():
        return cached()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _key_lock(path):  # a process compiling this key already: wait for its cubin instead of compiling it again
        if path.exists():
            return cached()
        cubin, log = _nvrtc(source, defines, arch, name)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        log_path.write_text(log)
        os.replace(tmp, path)  # atomic, and after the log: a cubin on disk always has its log
    return cubin, log


def _nvrtc(source: Path, defines: list[str], arch: str, name: str) -> tuple[bytes, str]:
    """NVRTC: (cubin bytes, ptxas log), uncached."""
    Program, ProgramOptions, *_ = cuda_core_api()
    log = io.StringIO()
    options = ProgramOptions(arch=arch, std="c++17", define_macro=list(defines) or None, ptxas_options=["-v"],
                             name=name)  # (cuda.core refuses an empty list)
    prog = Program(source_text(source), code_type="c++", options=options)
    try:
        obj = prog.compile("cubin", logs=log)
    except Exception as e:
        raise RuntimeError(f"NVRTC could not compile {name} for {arch}: {e}\n{log.getvalue()}") from e
    return bytes(obj.code), log.getvalue()


@contextlib.contextmanager
def _key_lock(path: Path):
    """An exclusive advisory lock on ``path``'s cache key, across processes (``fcntl.flock``): the xdist workers of a
    test run, or the ranks of a job on one host, that need the same variant compile it once; the others wait and
    read the cubin (without ``fcntl``: no lock, each compiles, the atomic rename still leaves one whole file)."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        yield
        return
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_all(compile_one: Callable, items: Iterable, workers: int | None = None) -> int:
    """``compile_one(item)`` for every item, in ``workers`` spawned processes (``compile_one`` must be a
    module-level function, picklable); returns how many items there were."""
    todo = list(items)
    if not todo:
        return 0
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    if workers == 1:
        for item in todo:
            compile_one(item)
    else:
        import multiprocessing as mp  # lazy: only a parallel build needs it

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(compile_one, todo))
    return len(todo)


# ------------------------------------------------------------------------------------------------
# Loading and launching (GPU)
# ------------------------------------------------------------------------------------------------

_kernels: dict = {}
_lock = threading.Lock()


def usable(device: torch.device) -> tuple[bool, str]:
    """Whether CUDA kernels can be loaded for tensors on ``device`` (a reason either way)."""
    if device.type != "cuda":
        return False, f"tensors on {device.type}: the CUDA kernels need CUDA tensors"
    try:
        cuda_core_api()
    except Exception as e:
        return False, str(e) if isinstance(e, ModuleNotFoundError) else f"cuda.core: {type(e).__name__}: {e}"
    return True, "CUDA device and cuda.core"


def set_kernel_attribute(kernel, attr: str, value: int, device_index: int) -> None:
    """Set the CUfunction attribute ``CU_FUNC_ATTRIBUTE_<attr>`` of a loaded kernel to ``value``."""
    from cuda.bindings import driver  # lazy: the driver bindings load libcuda, which a CPU machine lacks

    a = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
    handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
    if type(handle).__name__ == "CUkernel":
        (err,) = driver.cuKernelSetAttribute(a, value, handle, driver.CUdevice(device_index))
    else:
        (err,) = driver.cuFuncSetAttribute(handle, a, value)
    if int(err) != 0:
        raise RuntimeError(f"could not set the kernel attribute {attr} = {value}: {err}")


def load_kernel(key: Hashable, source: Path, defines: list[str], name: str, entry: str, device_index: int,
                smem_bytes: int = 0, attrs: Optional[dict] = None):
    """The kernel ``entry`` of ``source`` built with ``defines`` (:func:`compile_source`) and loaded on
    CUDA device ``device_index``, memoised under ``key`` (a tuple the kernel module chooses; it should
    name the kernel, the variant and the device); allows ``smem_bytes`` of dynamic shared memory when
    that is above the 48 KB default, and sets the further CUfunction ``attrs``
    (``{"NON_PORTABLE_CLUSTER_SIZE_ALLOWED": 1}``: the names without ``CU_FUNC_ATTRIBUTE_``)."""
    k = _kernels.get(key)
    if k is not None:
        return k
    with _lock:
        k = _kernels.get(key)
        if k is None:
            _, _, ObjectCode, Device, *_ = cuda_core_api()
            Device(device_index).set_current()
            cubin, _ = compile_source(source, defines, arch_of(torch.cuda.get_device_capability(device_index)), name)
            k = ObjectCode.from_cubin(cubin).get_kernel(entry)
            if smem_bytes > 48 * 1024:
                set_kernel_attribute(k, "MAX_DYNAMIC_SHARED_SIZE_BYTES", smem_bytes, device_index)
            for attr, value in (attrs or {}).items():
                set_kernel_attribute(k, attr, value, device_index)
            _kernels[key] = k
    return k


_streams: dict = {}
_configs: dict = {}
_sms: dict = {}


def _pdl_options(device_index: int, want: bool) -> dict:
    """LaunchConfig options for programmatic dependent launch on sm_90+: the kernel may be scheduled while the
    previous kernel of the stream runs (it must wait for it, ``griddepcontrol.wait``, before touching memory)."""
    return {"programmatic_stream_serialization": True} if want and \
        torch.cuda.get_device_capability(device_index) >= (9, 0) else {}


def launch_config(grid: tuple, block: tuple, smem_bytes: int = 0, pdl: bool = False, device_index: int = 0):
    """A cuda.core LaunchConfig, memoised (building one costs microseconds; a network launches thousands).
    ``pdl``: programmatic dependent launch where the device has it (sm_90+)."""
    key = (grid, block, smem_bytes, pdl, device_index if pdl else None)
    cfg = _configs.get(key)
    if cfg is None:
        LaunchConfig = cuda_core_api()[4]
        opts = {"shmem_size": smem_bytes} if smem_bytes else {}
        cfg = _configs[key] = LaunchConfig(grid=grid, block=block, **opts, **_pdl_options(device_index, pdl))
    return cfg


def _stream_for(handle: int):
    s = _streams.get(handle)
    if s is None:
        Stream = cuda_core_api()[5]
        s = _streams[handle] = Stream.from_handle(handle)
    return s


def launch(kernel, config, device: torch.device, *args) -> None:
    """Launch ``kernel`` with ``config`` on the current PyTorch stream of ``device`` (a CUDA graph being
    captured records it).  ``args`` are the kernel's parameters as numpy scalars (:func:`ptr` for a tensor)."""
    cuda_core_api()[6](_stream_for(torch.cuda.current_stream(device).cuda_stream), config, kernel, *args)


def ptr(t: Optional[torch.Tensor]):
    """A tensor's device address as a kernel argument (a null pointer for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def sm_count(device: torch.device) -> tuple[int, str]:
    """(SM count, NVRTC arch) of a CUDA device, memoised."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _sms.get(idx)
    if n is None:
        n = _sms[idx] = (torch.cuda.get_device_properties(idx).multi_processor_count,
                         arch_of(torch.cuda.get_device_capability(idx)))
    return n
