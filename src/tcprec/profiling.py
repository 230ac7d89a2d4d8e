"""Profile a model or an inference callable: per-layer latency, a time breakdown, every kernel with a
tensor-core flag, host<->device copies, the dtype trace of the forward pass, Chrome-trace export.

>>> import torch
>>> from tcprec.profiling import profile  # also tcprec.profile
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
>>> rep = profile(m, torch.randn(2, 8), warmup=1, iters=2)
>>> [l.name for l in rep.layers], rep.dtype_trace
(['0', '1'], 'fp32 -> 0 -> 1 -> fp32')

How it measures (``torch.profiler``, CPU + CUDA activities):

* ``warmup`` calls run first (the last one is the profiler's own warm-up step, discarded), then
  ``iters`` profiled calls, each inside a ``tcprec.inference`` scope that ends with a device
  synchronize, all under ``torch.no_grad()``.  The model runs in whatever mode it is in (call
  ``.eval()`` first).  Every number is **per inference** (the mean over ``iters``).
* Layers: forward pre/post hooks open and close a ``tcprec.layer:<name>`` scope around every leaf
  module -- one with no children, or one that sets ``tcprec_leaf = True`` (its children are then
  not hooked).  A layer called twice in one forward is one row with ``calls == 2``.
* Clock (``rep.clock``): ``"cuda"`` when the run launched device work -- a layer's time is then the
  GPU time of the kernels and copies *launched* inside its scope (matched through CUPTI correlation
  ids); ``"cpu"`` otherwise -- a layer's time is then its scope's CPU wall time.
* Opaque callables (not an ``nn.Module``, e.g. an engine replaying a CUDA graph) give kernels,
  copies and the breakdown but no layers -- unless they follow the **named-layers protocol**:
  ``callable.named_layers()`` returns ``[(name, fn), ...]`` such that ``y = x; for _, fn in layers:
  y = fn(y)`` computes the same as ``callable(x)`` (eagerly, one step at a time).  Then a second
  profiled pass times the steps one by one; an ``fn`` may expose ``tcprec_trace()`` and
  ``tcprec_kind`` like a module.
* Kernels are classified by name (:data:`KERNEL_RULES`, first match wins): category ``compute``,
  ``quantize_pack``, ``type_conversion``, ``memcpy`` or ``other``, and whether it runs on tensor
  cores.  On the CPU clock the "kernels" are the outermost aten / tcprec ops, never tensor-core.
* Breakdown: on the cuda clock, device time per category (kernels + memcpy; idle gaps are not in it,
  ``rep.wall_ms`` is the synchronized wall time); on the cpu clock, op time per category, with the
  Python time between ops in ``other`` (so it sums to ``rep.wall_ms``).
* Copies: ``Memcpy HtoD / DtoH / DtoD`` device events per inference (peer ``PtoP`` counts as DtoD).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .qtensor import BitPlanes, QTensor, ShiftedInt8

__all__ = [
    "Activity",
    "Analysis",
    "CATEGORIES",
    "Event",
    "KERNEL_RULES",
    "KernelRecord",
    "LayerTime",
    "ProfileReport",
    "analyze",
    "annotate_nsys_sqlite",
    "classify_kernel",
    "describe_value",
    "is_tensor_core_kernel",
    "kernel_rule",
    "profile",
]

CATEGORIES = ("compute", "quantize_pack", "type_conversion", "memcpy", "other")
ITER_SCOPE = "tcprec.inference"
LAYER_SCOPE = "tcprec.layer:"

# ------------------------------------------------------------------------------------------------
# Kernel classification: one table, first match wins (re.search, case-sensitive unless (?i)).
# Rows: (pattern, category, tensor_core, why).  Ours first, so a generic vendor rule can never
# claim one of our kernels; Triton kernels added to src/tcprec/kernels/triton later are found by
# reading those files (_our_triton_rules), after this explicit block.
# ------------------------------------------------------------------------------------------------
KERNEL_RULES: list[tuple[str, str, bool, str]] = [
    # --- tcprec's own kernels -------------------------------------------------------------------
    (r"^bmma_\w*", "compute", True, "our NVRTC bit-serial kernel: mma.sync b1 AND+popc (BMMA)"),
    (r"^stem_conv$", "compute", True, "our NVRTC thin-input INT8 stem conv: mma.sync m16n8k32 s8 (IMMA)"),
    (r"^stem_code_thresholds$", "quantize_pack", False, "our NVRTC stem conv's threshold words (bisection)"),
    (r"^_(float|int)_round_kernel$", "quantize_pack", False, "our Triton cast / encode (kernels/triton/cast.py)"),
    (r"^_pack_bitplanes_kernel$", "quantize_pack", False, "our Triton bit-plane packer (kernels/triton/pack.py)"),
    (r"^_im2col_bits_kernel$", "quantize_pack", False, "our Triton word gather over packed planes (im2col_bits.py)"),
    (r"^_(dgrad|wgrad)_kernel$", "compute", True, "our Triton implicit-GEMM conv backward: tl.dot"),
    (r"^_conv_fwd_kernel$", "compute", True, "our Triton implicit-GEMM conv forward (conv_fwd.py): tl.dot"),
    (r"^_sum_splits_kernel$", "compute", False, "our Triton split-K reduction (conv_bwd.py), elementwise adds"),
    (r"^_fma_gemm_kernel$", "compute", False, "our Triton emulated GEMM, one rounded FMA at a time (no tl.dot)"),
    (r"^_chunk_gemm_kernel$", "compute", True, "our Triton emulated GEMM, tl.dot per k-chunk (fp32 'ieee' skips TCs)"),
    (r"^tcprec::(cast|encode|quantize|pack\w*|im2col\w*)", "quantize_pack", False, "our torch.library ops (CPU clock)"),
    (r"^tcprec::\w*(gemm|matmul|conv)", "compute", False, "our torch.library GEMM/conv op as a CPU op"),
    # --- copies and fills -------------------------------------------------------------------------
    (r"^Memcpy", "memcpy", False, "CUPTI memcpy activity: 'Memcpy HtoD (Pageable -> Device)'"),
    (r"^Memset", "other", False, "CUPTI memset activity: a fill, not data movement"),
    # --- CUDA-core GEMMs that look like GEMMs: before the tensor-core families -------------------
    (r"simt|ffma|sgemm|dgemm|gemv|gemmSN|gemmk1|xmma_gemm_f32f32_f32f32", "compute", False,
     "SIMT / FFMA GEMMs (cutlass_80_simt_sgemm, volta_sgemm, implicit_convolve_sgemm, gemv2T)"),
    (r"splitKreduce|reduce_1Block|cublasLt::epilogue", "compute", False, "cuBLAS split-K reduction / epilogue"),
    (r"direct_kernel|dgrad2d_grouped_direct|conv_depthwise", "compute", False, "direct / depthwise conv on CUDA cores"),
    # --- tensor-core families: Hopper first -------------------------------------------------------
    (r"nvjet", "compute", True, "cuBLAS Hopper GEMMs (nvjet_tst_*, nvjet_hsh_*): wgmma"),
    (r"sm9\d_xmma|sm1\d\d_xmma|gmma|wgmma|warpgroup", "compute", True, "Hopper/Blackwell xmma: (q|h|i)gmma"),
    (r"sm[78]\d_xmma|xmma_(gemm|fprop|dgrad|wgrad)|xmma", "compute", True, "Ampere/Turing xmma (cuBLAS, cuDNN)"),
    (r"tensorop|wmma|hmma|imma|qgmma|h884|s884|h1688|s1688|i8816|16816|16832|161616", "compute", True,
     "CUTLASS tensorop / legacy cuBLAS names that carry the MMA shape (s16816gemm, i8816, h884)"),
    (r"cutlass3x_sm9|cutlass3x_sm1", "compute", True, "CUTLASS 3.x Hopper/Blackwell kernels (wgmma/tcgen05)"),
    (r"implicit_gemm|fprop|dgrad|wgrad", "compute", True, "cuDNN implicit-GEMM conv (SIMT conv matched above)"),
    (r"flash_fwd|flash_bwd|fmha|sdpa", "compute", True, "flash attention: mma / wgmma"),
    (r"triton_tem_fused_(mm|bmm|addmm|convolution)", "compute", True, "Inductor GEMM templates: tl.dot"),
    (r"(?i)(gemm|matmul)\w*(bf16|f16|tf32|fp8|e4m3|e5m2|i8)|_(tn|nt|nn|tt)_align", "compute", True,
     "other GEMMs named with a tensor-core dtype or a cuBLAS layout suffix"),
    # --- conversions: before plain copies and elementwise -----------------------------------------
    (r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose|permute", "type_conversion", False,
     "layout conversions (cuDNN's nchwToNhwcKernel, transposes)"),
    (r"(?i)(bfloat16|float16|half|float8|fp8)_copy_kernel|to_copy|convert|(?<!no)cast", "type_conversion", False,
     "dtype conversions: at::native::bfloat16_copy_kernel_cuda, Inductor *_to_copy_*, aten::to ('nocast' is not one)"),
    (r"(?i)quantiz|fp8_quant|_quant_|dequant", "quantize_pack", False, "vendor quantize / dequantize kernels"),
    (r"^aten::(to|_to_copy|type_as|half|float|bfloat16|_autocast\w*)$", "type_conversion", False, "CPU-clock casts"),
    (r"CatArrayBatchedCopy|direct_copy|copy_kernel|^aten::(copy_|clone|contiguous|cat)$", "memcpy", False,
     "device-side copies (direct_copy_kernel_cuda, torch.cat) and CPU-clock copies"),
    # --- CPU-clock compute ops (the aten op names the profiler shows on CPU) ----------------------
    (r"^aten::(conv\w*|_convolution|mkldnn\w*|linear|addmm|mm|bmm|matmul|_int_mm|_scaled_mm|baddbmm)$",
     "compute", False, "CPU-clock GEMM/conv ops"),
    (r"^aten::(view|reshape|_reshape_alias|flatten|t|transpose|permute|expand|as_strided|unsqueeze|squeeze|"
     r"empty\w*|detach|alias|select|slice|resize_|unflatten)$", "other", False, "CPU-clock views and allocations"),
    (r"^aten::", "compute", False, "any other aten op on the CPU clock (elementwise, pooling, norms)"),
    # --- CUDA-core elementwise / reduction work ---------------------------------------------------
    (r"(?i)FillFunctor|fill_kernel", "other", False, "fills (torch.zeros on the device)"),
    (r"(?i)nccl", "other", False, "collectives (before 'reduce' below: ncclDevKernel_AllReduce_*)"),
    (r"(?i)elementwise|vectorized|reduce|softmax|norm|bn_fw|bn_bw|pool|relu|gather|scatter|index|triton_(poi|red|per)_",
     "compute", False, "elementwise / reduction kernels on CUDA cores (at::native::*, Inductor pointwise)"),
]


def kernel_rule(name: str) -> tuple[str, bool, str]:
    """``(category, tensor_core, why)`` for a kernel or op name; ``("other", False, ...)`` if no rule matches."""
    if not isinstance(name, str):
        raise TypeError(f"kernel name must be a str, got {type(name).__name__}")
    for pattern, category, tc, why in _compiled_rules():
        if pattern.search(name):
            return category, tc, why
    return "other", False, "no rule matched"


def classify_kernel(name: str) -> str:
    """The breakdown category of a kernel name: one of :data:`CATEGORIES`.

    >>> classify_kernel("Memcpy HtoD (Pageable -> Device)"), classify_kernel("nvjet_tst_128x256_64x4_1x2_h_bz_TNT")
    ('memcpy', 'compute')
    """
    return kernel_rule(name)[0]


def is_tensor_core_kernel(name: str) -> bool:
    """Whether a kernel with this name runs on tensor cores (by :data:`KERNEL_RULES`).

    >>> is_tensor_core_kernel("bmma_gemm"), is_tensor_core_kernel("cutlass_80_simt_sgemm_128x32_8x5_tn_align1")
    (True, False)
    """
    return kernel_rule(name)[1]


_TRITON_DIR = Path(__file__).with_name("kernels") / "triton"
_JIT_DEF = re.compile(r"^@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", re.M)


_TOP_LEVEL = re.compile(r"^(?:@|def |class |[A-Za-z_])", re.M)


def _our_triton_rules() -> list[tuple[str, str, bool, str]]:
    """Rows for every ``@triton.jit`` function in ``kernels/triton/*.py`` (read as text, not imported):
    one whose body calls ``tl.dot`` -- itself or through a jit helper of the same file -- is
    tensor-core compute; one named for packing/rounding is quantize_pack; the rest is compute."""
    rows = []
    for path in sorted(_TRITON_DIR.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        bodies = {}
        for m in _JIT_DEF.finditer(text):
            nxt = _TOP_LEVEL.search(text, m.end())
            bodies[m.group(1)] = text[m.end(): nxt.start() if nxt else len(text)]
        dot = {n for n, b in bodies.items() if "tl.dot(" in b}
        while True:  # close over calls to jit helpers
            more = {n for n, b in bodies.items() if n not in dot and any(re.search(rf"\b{h}\(", b) for h in dot)}
            if not more:
                break
            dot |= more
        for name in bodies:
            if name in dot:
                rows.append((rf"^{name}$", "compute", True, f"our Triton kernel in {path.name}: tl.dot"))
            elif re.search(r"pack|round|cast|quant|encode|im2col", name):
                rows.append((rf"^{name}$", "quantize_pack", False, f"our Triton kernel in {path.name}"))
            else:
                rows.append((rf"^{name}$", "compute", False, f"our Triton kernel in {path.name}, no tl.dot"))
    return rows


@functools.lru_cache(maxsize=1)
def _compiled_rules() -> tuple[tuple[re.Pattern, str, bool, str], ...]:
    n_ours = next(i for i, row in enumerate(KERNEL_RULES) if row[0] == r"^Memcpy")
    rows = KERNEL_RULES[:n_ours] + _our_triton_rules() + KERNEL_RULES[n_ours:]
    return tuple((re.compile(p), c, tc, why) for p, c, tc, why in rows)


# ------------------------------------------------------------------------------------------------
# dtype trace
# ------------------------------------------------------------------------------------------------
_DTYPE_SHORT = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
for _name, _short in [("float8_e4m3fn", "fp8e4m3"), ("float8_e5m2", "fp8e5m2"), ("float8_e4m3fnuz", "fp8e4m3fnuz"),
                      ("float8_e5m2fnuz", "fp8e5m2fnuz"), ("float8_e8m0fnu", "fp8e8m0"),
                      ("float4_e2m1fn_x2", "fp4e2m1x2"), ("uint16", "uint16"), ("uint32", "uint32")]:
    if hasattr(torch, _name):
        _DTYPE_SHORT[getattr(torch, _name)] = _short


def describe_value(v: Any) -> str:
    """A short name for what flows between layers: a Tensor's dtype (``fp32``, ``int32``,
    ``fp8e4m3``), for a QTensor ``"<fmt> planes"`` (``BitPlanes`` layout), ``"<fmt> int8"`` (``ShiftedInt8``) or
    ``"<fmt> codes"`` (the others), the data's dtype for a scaled tensor (``.data`` + ``.scale``),
    and a tuple of the distinct names for containers.

    >>> describe_value(torch.zeros(2, dtype=torch.bfloat16)), describe_value((torch.zeros(1), torch.zeros(1)))
    ('bf16', 'fp32')
    """
    if isinstance(v, torch.Tensor):
        return _DTYPE_SHORT.get(v.dtype, str(v.dtype).removeprefix("torch."))
    if isinstance(v, QTensor):
        return f"{v.fmt} " + {BitPlanes: "planes", ShiftedInt8: "int8"}.get(type(v.layout), "codes")
    if isinstance(getattr(v, "data", None), torch.Tensor) and hasattr(v, "scale"):
        return describe_value(v.data)
    if isinstance(v, (tuple, list)):
        names = list(dict.fromkeys(describe_value(e) for e in v))
        return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
    if isinstance(v, dict):
        return describe_value(list(v.values()))
    return type(v).__name__


def _trace_steps(obj) -> list[str]:
    fn = getattr(obj, "tcprec_trace", None)
    if fn is None:
        return []
    steps = fn() if callable(fn) else fn
    if isinstance(steps, str) or not isinstance(steps, (list, tuple)):
        raise TypeError(f"{type(obj).__name__}.tcprec_trace() must return a list of str, got {steps!r}")
    return [str(s) for s in steps]


def _build_dtype_trace(x_desc: str, calls: list[tuple[str, str, list[str], str]], out_desc: str) -> str:
    """``calls``: ``(layer, input, internal steps, output)`` in call order.  A dtype is written only
    when it changes (or right after a layer's internal steps); repeated tokens collapse."""
    tokens = [x_desc]
    current = x_desc
    for name, ins, steps, outs in calls:
        if ins != current:
            tokens.append(ins)
        tokens.append(name)
        tokens.extend(steps)
        if steps or outs != ins:
            tokens.append(outs)
        current = outs
    tokens.append(out_desc)
    collapsed = [t for i, t in enumerate(tokens) if i == 0 or t != tokens[i - 1]]
    return " -> ".join(collapsed)


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTime:
    """One leaf layer: ``ms`` per inference (all its calls), ``share`` of the sum over layers."""

    name: str
    kind: str
    ms: float
    share: float
    calls: int = 1


@dataclass(frozen=True)
class KernelRecord:
    """One kernel (or op, on the CPU clock), aggregated by name: ``calls`` and ``total_ms`` per inference."""

    name: str
    calls: float
    total_ms: float
    tensor_core: bool
    category: str


@dataclass
class ProfileReport:
    """What :func:`profile` measured; every time is per inference, in milliseconds."""

    layers: list[LayerTime]
    breakdown: dict[str, float]
    kernels: list[KernelRecord]
    copies: dict[str, float]
    dtype_trace: str
    clock: str  # "cuda": GPU time of launched kernels/copies; "cpu": CPU wall time
    wall_ms: float  # synchronized wall time of one call
    device: str
    warmup: int
    iters: int
    notes: list[str] = field(default_factory=list)
    timeline: tuple = field(default=(), repr=False)  # Activity records: what to_sqlite writes row by row
    _trace_owner: Any = field(default=None, repr=False)
    _trace_file: str | None = field(default=None, repr=False)

    @property
    def tensor_core_ms(self) -> float:
        return sum(k.total_ms for k in self.kernels if k.tensor_core)

    def table(self, top_kernels: int = 10):
        """A ``rich.table.Table``: one row per layer, then the top kernels; the caption holds the
        clock, breakdown, copies and dtype trace."""
        from rich import box
        from rich.table import Table

        t = Table(title=f"tcprec profile on {self.device} ({self.clock} clock, {self.iters} iters)",
                  box=box.SIMPLE_HEAVY, caption_justify="left")
        t.add_column("layer / kernel", overflow="fold", max_width=60)
        t.add_column("kind")
        t.add_column("calls", justify="right")
        t.add_column("ms", justify="right")
        t.add_column("share", justify="right")
        for lay in self.layers:
            t.add_row(lay.name, lay.kind, str(lay.calls), f"{lay.ms:.4f}", f"{100 * lay.share:.1f}%")
        if not self.layers:
            t.add_row("(no per-layer times)", "", "", "", "")
        total = sum(k.total_ms for k in self.kernels) or 1.0
        t.add_section()
        for k in self.kernels[:top_kernels]:
            tag = f"{k.category}{' TC' if k.tensor_core else ''}"
            t.add_row(_shorten(k.name), tag, f"{k.calls:g}", f"{k.total_ms:.4f}", f"{100 * k.total_ms / total:.1f}%")
        bd = ", ".join(f"{c} {ms:.3f}" for c, ms in self.breakdown.items())
        cp = ", ".join(f"{d} {n:g}" for d, n in self.copies.items())
        lines = [f"wall {self.wall_ms:.3f} ms/inference; breakdown (ms): {bd}", f"copies per inference: {cp}",
                 f"dtype trace: {self.dtype_trace}", *self.notes]
        t.caption = "\n".join(lines)
        return t

    def to_json(self) -> dict:
        """A JSON-serialisable dict of everything but the trace."""
        return {
            "device": self.device,
            "clock": self.clock,
            "warmup": self.warmup,
            "iters": self.iters,
            "wall_ms": self.wall_ms,
            "tensor_core_ms": self.tensor_core_ms,
            "layers": [asdict(lay) for lay in self.layers],
            "breakdown": dict(self.breakdown),
            "kernels": [asdict(k) for k in self.kernels],
            "copies": dict(self.copies),
            "dtype_trace": self.dtype_trace,
            "notes": list(self.notes),
        }

    def to_sqlite(self, path: str | os.PathLike) -> Path:
        """Write the profile as a SQLite database laid out like ``nsys export --type sqlite``
        (``CUPTI_ACTIVITY_KIND_KERNEL`` / ``_MEMCPY`` / ``_MEMSET`` with integer ns ``start`` /
        ``end`` and names through ``StringIds``; our scopes in ``NVTX_EVENTS``) plus the report's
        tables and the ``TCPREC_KERNELS`` view (one row per kernel with its layer, duration,
        tensor-core flag and instruction class).  An existing file is replaced.  Schema and example
        queries: docs/profiling.md.

        >>> import sqlite3, tempfile, torch
        >>> rep = profile(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(1, 4), warmup=0, iters=2)
        >>> db = rep.to_sqlite(tempfile.mkdtemp() + "/p.sqlite")
        >>> sqlite3.connect(db).execute("SELECT COUNT(DISTINCT inference) FROM TCPREC_KERNELS").fetchone()
        (2,)
        """
        return _write_sqlite(self, path)

    def to_html(self, path: str | os.PathLike) -> Path:
        """Write a self-contained HTML report (no scripts, no external files): per-layer time chart,
        breakdown, kernels with the tensor-core flag, copies, dtype trace."""
        return _write_html(self, path)

    def save_chrome_trace(self, path: str | os.PathLike) -> Path:
        """Write the run's Chrome trace (open in chrome://tracing or Perfetto).  The profiler can
        export once; later calls copy that first file."""
        path = Path(path)
        if self._trace_file is not None:
            if not Path(self._trace_file).is_file():
                raise RuntimeError(f"the trace was exported to {self._trace_file}, which is gone; "
                                   "torch.profiler exports a trace only once: profile again")
            if Path(self._trace_file).resolve() != path.resolve():
                shutil.copyfile(self._trace_file, path)
            return path
        if self._trace_owner is None:
            raise RuntimeError("this report has no profiler trace (it was built from events, not by tcprec.profile)")
        path.parent.mkdir(parents=True, exist_ok=True)
        with _kineto_quiet():
            self._trace_owner.export_chrome_trace(str(path))
        self._trace_file = str(path)
        return path


def _shorten(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


# ------------------------------------------------------------------------------------------------
# events: a small neutral form of the profiler's events, so the analysis is testable without a GPU
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """``kind``: "scope" (our record_function), "op" (CPU op), "runtime" (cudaLaunchKernel & co),
    "kernel", "memcpy", "memset".  Times in microseconds on one clock; ``corr`` the CUPTI correlation
    id (runtime and device events), ``linked`` the id of the CPU op a device event belongs to."""

    name: str
    kind: str
    start: float
    end: float
    corr: int = 0
    linked: int = 0
    thread: int = 0


def _events_from_profiler(prof) -> list[Event]:
    out = []
    for e in prof.events():
        act = str(getattr(e, "activity_type", "") or "")
        start, end = float(e.time_range.start), float(e.time_range.end)
        on_cpu = e.device_type == torch.autograd.DeviceType.CPU
        if on_cpu:
            if getattr(e, "is_user_annotation", False) or act == "user_annotation":
                kind = "scope"
            elif act in ("cuda_runtime", "cuda_driver") or (not act and e.name.startswith(("cuda", "cu"))):
                kind = "runtime"
            elif act in ("cpu_op", "") and not e.is_async:
                kind = "op"
            else:
                continue
        else:
            if act == "gpu_user_annotation" or e.name.startswith((ITER_SCOPE, LAYER_SCOPE)):
                continue
            kind = ("memcpy" if act == "gpu_memcpy" or e.name.startswith("Memcpy") else
                    "memset" if act == "gpu_memset" or e.name.startswith("Memset") else "kernel")
        out.append(Event(e.name, kind, start, end, int(e.id or 0), int(getattr(e, "linked_correlation_id", 0) or 0),
                         int(e.thread or 0)))
    return out


_COPY_DIR = re.compile(r"Memcpy (HtoD|DtoH|DtoD|PtoP|HtoH)")


class _Intervals:
    """Sorted, possibly nested scopes: ``find(t)`` gives the innermost one containing time ``t``."""

    def __init__(self, scopes: list[Event]):
        self.scopes = sorted(scopes, key=lambda s: (s.start, -s.end))
        self.starts = [s.start for s in self.scopes]
        self.max_end = list(itertools.accumulate((s.end for s in self.scopes), max))

    def find(self, t: float) -> Event | None:
        # Scopes nest properly, so the innermost one containing t is the latest-starting one that
        # contains it.  Walk back from the last start <= t; stop once no earlier scope reaches t.
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.max_end[i] >= t:
            if self.scopes[i].end >= t:
                return self.scopes[i]
            i -= 1
        return None


class Activity(NamedTuple):
    """One timed thing of the profiled inferences, for the SQLite export: a device ``kernel`` /
    ``memcpy`` / ``memset`` (cuda clock) or an outermost CPU ``op`` (cpu clock), or a ``range`` (our
    inference and layer scopes).  ``layer``: the leaf layer it is attributed to (None: outside
    every layer); ``inference``: 0-based index of the profiled inference; times in microseconds."""

    name: str
    kind: str
    start: float
    end: float
    layer: str | None
    inference: int
    corr: int = 0


class Analysis(NamedTuple):
    layers: list[LayerTime]
    breakdown: dict[str, float]
    kernels: list[KernelRecord]
    copies: dict[str, float]
    clock: str
    wall_ms: float
    n_inferences: int
    unattributed_ms: float  # cuda clock: device time per inference launched outside every layer scope
    timeline: tuple = ()  # Activity records, in start order (the SQLite export's rows)


def analyze(events: list[Event], layer_kinds: dict[str, str] | None = None,
            layer_order: list[str] | None = None, layer_calls: dict[str, int] | None = None):
    """Turn events into an :class:`Analysis`, all per inference (over the ``tcprec.inference``
    scopes found).  ``layer_order`` fixes the layer rows (default: by first scope start);
    ``layer_calls`` gives their calls per inference.

    Used by :func:`profile`; public so the analysis can be tested on hand-made GPU-like events."""
    layer_kinds = layer_kinds or {}
    iter_scopes = [e for e in events if e.kind == "scope" and e.name == ITER_SCOPE]
    if not iter_scopes:
        raise RuntimeError(f"no '{ITER_SCOPE}' scopes among the profiler events: nothing was profiled")
    iters = len(iter_scopes)
    iters_iv = _Intervals(iter_scopes)
    iter_index = {id(s): i for i, s in enumerate(iters_iv.scopes)}
    timeline: list[Activity] = [Activity(s.name, "range", s.start, s.end, None, i, s.corr)
                                for i, s in enumerate(iters_iv.scopes)]
    layer_iv = _Intervals([e for e in events if e.kind == "scope" and e.name.startswith(LAYER_SCOPE)
                           and iters_iv.find(e.start) is not None])
    wall_ms = sum(s.end - s.start for s in iter_scopes) / 1e3 / iters
    for s in layer_iv.scopes:
        timeline.append(Activity(s.name, "range", s.start, s.end, s.name[len(LAYER_SCOPE):],
                                 iter_index[id(iters_iv.find(s.start))], s.corr))

    device = [e for e in events if e.kind in ("kernel", "memcpy", "memset")]
    runtime_start = {e.corr: e.start for e in events if e.kind == "runtime" and e.corr}
    # a device event's linked id names the CPU op -- or our scope, for a Triton launch outside any op
    op_start = {e.corr: e.start for e in events if e.kind in ("op", "scope") and e.corr}
    clock = "cuda" if device else "cpu"

    layer_ms: dict[str, float] = {}
    kern: dict[str, list[float]] = {}  # name -> [calls, total_us]
    copies = {"HtoD": 0.0, "DtoH": 0.0, "DtoD": 0.0}
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    unattributed_us = 0.0  # device time launched outside every layer scope (or with no launch found)

    if clock == "cuda":
        for d in device:
            # which inference: the device start (each inference ends with a synchronize inside its scope)
            launch = runtime_start.get(d.corr, op_start.get(d.linked))
            when = launch if launch is not None else d.start
            it = iters_iv.find(when) or iters_iv.find(d.start)
            if it is None:
                continue  # from the profiler's warm-up step or outside our calls
            dur = d.end - d.start
            rec = kern.setdefault(d.name, [0.0, 0.0])
            rec[0] += 1
            rec[1] += dur
            if d.kind == "memcpy":
                m = _COPY_DIR.search(d.name)
                if m and m.group(1) != "HtoH":
                    copies["DtoD" if m.group(1) == "PtoP" else m.group(1)] += 1
            lay = layer_iv.find(launch) if launch is not None else None
            if lay is not None:
                key = lay.name[len(LAYER_SCOPE):]
                layer_ms[key] = layer_ms.get(key, 0.0) + dur
            else:
                unattributed_us += dur
            timeline.append(Activity(d.name, d.kind, d.start, d.end, lay.name[len(LAYER_SCOPE):] if lay else None,
                                     iter_index[id(it)], d.corr))
    else:
        for s in layer_iv.scopes:
            key = s.name[len(LAYER_SCOPE):]
            layer_ms[key] = layer_ms.get(key, 0.0) + (s.end - s.start)
        for op in _outermost_ops([e for e in events if e.kind == "op"]):
            it = iters_iv.find(op.start)
            if it is None:
                continue
            rec = kern.setdefault(op.name, [0.0, 0.0])
            rec[0] += 1
            rec[1] += op.end - op.start
            lay = layer_iv.find(op.start)
            timeline.append(Activity(op.name, "op", op.start, op.end, lay.name[len(LAYER_SCOPE):] if lay else None,
                                     iter_index[id(it)], op.corr))

    kernels = []
    for name, (calls, total_us) in kern.items():
        category, tc, _ = kernel_rule(name)
        kernels.append(KernelRecord(name, calls / iters, total_us / 1e3 / iters, tc and clock == "cuda", category))
        breakdown[category] += total_us / 1e3 / iters
    kernels.sort(key=lambda k: -k.total_ms)
    if clock == "cpu":
        breakdown["other"] += max(0.0, wall_ms - sum(breakdown.values()))
    copies = {k: v / iters for k, v in copies.items()}

    order = list(layer_order) if layer_order is not None else sorted(
        layer_ms, key=lambda k: min(s.start for s in layer_iv.scopes if s.name == LAYER_SCOPE + k))
    total = sum(layer_ms.get(k, 0.0) for k in order)
    layers = []
    for k in order:
        ms = layer_ms.get(k, 0.0) / 1e3 / iters
        share = (layer_ms.get(k, 0.0) / total) if total > 0 else 1.0 / len(order)
        layers.append(LayerTime(k, layer_kinds.get(k, "layer"), ms, share, (layer_calls or {}).get(k, 1)))
    timeline.sort(key=lambda a: (a.start, -a.end))
    return Analysis(layers, breakdown, kernels, copies, clock, wall_ms, iters, unattributed_us / 1e3 / iters,
                    tuple(timeline))


def _outermost_ops(ops: list[Event]) -> list[Event]:
    """Ops not inside another op of the same thread (aten::conv2d, not its aten::mkldnn_convolution)."""
    out = []
    by_thread: dict[int, list[Event]] = {}
    for op in ops:
        by_thread.setdefault(op.thread, []).append(op)
    for lst in by_thread.values():
        lst.sort(key=lambda e: (e.start, -e.end))
        end = -math.inf
        for op in lst:
            if op.start >= end:
                out.append(op)
                end = op.end
            # else: nested inside the current outermost op
    return out


# ------------------------------------------------------------------------------------------------
# profile()
# ------------------------------------------------------------------------------------------------
def _check_args(model, x, warmup, iters, trace_path, record_shapes):
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}; "
                        "pass the model itself (or a lambda x: engine(x))")
    for name, v, lo in (("iters", iters, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {name}={v!r}")
    if isinstance(x, torch.Tensor):
        args = (x,)
    elif isinstance(x, (tuple, list)) and x and all(isinstance(e, torch.Tensor) for e in x):
        args = tuple(x)
    else:
        raise TypeError(f"x must be a torch.Tensor or a non-empty tuple/list of Tensors (passed positionally), "
                        f"got {type(x).__name__}; convert it with torch.as_tensor(x)")
    if trace_path is not None and not isinstance(trace_path, (str, os.PathLike)):
        raise TypeError(f"trace_path must be a path (str or os.PathLike) or None, got {type(trace_path).__name__}")
    if not isinstance(record_shapes, bool):
        raise TypeError(f"record_shapes must be True or False, got {record_shapes!r}")
    return args


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules in registration order: no children, or ``tcprec_leaf = True`` (children skipped)."""
    out, skip = [], []
    for name, mod in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in skip):
            continue
        if getattr(mod, "tcprec_leaf", False) or not any(True for _ in mod.children()):
            out.append((name or type(mod).__name__, mod))
            if any(True for _ in mod.children()):
                skip.append(name)
    return out


class _Recorder:
    """Hooks that open/close a scope per leaf call and log the dtype trace of the first call."""

    def __init__(self):
        self.open: dict[str, list] = {}
        self.tracing = False
        self.traced = False
        self.calls: list[tuple[str, str, list[str], str]] = []

    def enter(self, name: str, inputs) -> None:
        rf = torch.profiler.record_function(LAYER_SCOPE + name)
        rf.__enter__()
        self.open.setdefault(name, []).append((rf, describe_value(inputs[0]) if inputs else "none"))

    def exit(self, name: str, obj, output) -> None:
        stack = self.open.get(name)
        if not stack:
            return
        rf, ins = stack.pop()
        rf.__exit__(None, None, None)
        if self.tracing:
            self.calls.append((name, ins, _trace_steps(obj), describe_value(output)))

    def call(self, step: Callable[[], Any]):
        """Run one inference; the very first one is traced."""
        self.tracing = not self.traced
        try:
            return step()
        finally:
            self.tracing, self.traced = False, True


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def _kineto_quiet():
    """Kineto (torch.profiler's back end) logs ``USDT: ... profiler_start`` / ``profiler_stop`` on
    stderr at every session; level 6 silences its log.  It reads ``KINETO_LOG_LEVEL`` at each log
    call, so it is set around our profiler calls only -- never if the user has set it."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def _run_profiled(step: Callable[[], Any], warmup: int, iters: int, record_shapes: bool, rec: _Recorder):
    """``warmup`` calls (the last is the profiler's discarded warm-up step), then ``iters`` profiled ones."""
    from torch.profiler import ProfilerActivity, schedule

    for _ in range(max(0, warmup - 1)):
        rec.call(step)
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof_warmup = 1 if warmup > 0 else 0
    sched = schedule(wait=0, warmup=1, active=iters, repeat=1) if prof_warmup else None  # no warm-up: no schedule
    out = None
    with _kineto_quiet(), torch.profiler.profile(activities=acts, schedule=sched, record_shapes=record_shapes) as prof:
        for _ in range(prof_warmup + iters):
            with torch.profiler.record_function(ITER_SCOPE):
                out = rec.call(step)
                _sync()
            prof.step()
    return prof, out


def profile(model_or_callable, x, *, warmup: int = 3, iters: int = 10, trace_path: str | os.PathLike | None = None,
            record_shapes: bool = False) -> ProfileReport:
    """Profile ``model_or_callable(x)``: per-layer latency, breakdown, kernels, copies, dtype trace.

    ``x`` is a Tensor or a tuple/list of Tensors (passed positionally).  See the module docstring
    for what is measured and on which clock; ``trace_path`` also writes the Chrome trace.

    >>> import torch
    >>> rep = profile(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(1, 4), warmup=0, iters=1)
    >>> sorted(rep.breakdown) == sorted(CATEGORIES), rep.copies["HtoD"]
    (True, 0.0)
    """
    args = _check_args(model_or_callable, x, warmup, iters, trace_path, record_shapes)
    x_desc = describe_value(args[0])
    notes: list[str] = []
    handles = []
    kinds: dict[str, str] = {}
    rec = _Recorder()
    named = None
    try:
        if isinstance(model_or_callable, nn.Module):
            for name, mod in _leaves(model_or_callable):
                kinds[name] = type(mod).__name__
                handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: rec.enter(n, a)))
                handles.append(mod.register_forward_hook(lambda m, a, o, n=name: rec.exit(n, m, o), always_call=True))
        elif callable(getattr(model_or_callable, "named_layers", None)):
            named = _check_named_layers(model_or_callable.named_layers())
        with torch.no_grad():
            prof, out = _run_profiled(lambda: model_or_callable(*args), warmup, iters, record_shapes, rec)
    finally:
        for h in handles:
            h.remove()

    events = _events_from_profiler(prof)
    order, calls = _order_and_calls(rec.calls)
    res = analyze(events, kinds, order if handles else [], calls)
    layers, breakdown, kernels, copies, clock, wall_ms = res[:6]
    if res.n_inferences != iters:
        notes.append(f"the profiler returned {res.n_inferences} inference scopes for iters={iters}; "
                     f"numbers are per inference over {res.n_inferences}")
    if handles and clock == "cuda" and res.unattributed_ms > 0:
        notes.append(f"{res.unattributed_ms:.4f} ms/inference of device time was launched outside every leaf layer "
                     "(glue code between modules); it is in the kernels and breakdown, not in the layers")
    calls_trace = rec.calls

    if named is not None:
        layer_prof, layer_rec, layer_kinds = _profile_named(named, args, warmup, iters, record_shapes)
        order, calls = _order_and_calls(layer_rec.calls)
        layers = analyze(_events_from_profiler(layer_prof), layer_kinds, order, calls)[0]
        calls_trace = layer_rec.calls
        notes.append("per-layer times come from a separate eager pass over named_layers(); "
                     "kernels, copies and breakdown from the callable itself")
    elif not handles:
        notes.append(f"per-layer times need eager mode: {type(model_or_callable).__name__} is an opaque callable; "
                     "profile the nn.Module, or give the callable a named_layers() -> [(name, fn), ...] method")
        calls_trace = [(getattr(model_or_callable, "__name__", type(model_or_callable).__name__), x_desc,
                        _trace_steps(model_or_callable), describe_value(out))]
    if clock == "cpu":
        notes.append("cpu clock: no device work was recorded; times are CPU wall times")

    device = (torch.cuda.get_device_name() if clock == "cuda" else "cpu")
    trace = _build_dtype_trace(x_desc, calls_trace, describe_value(out))
    rep = ProfileReport(layers, breakdown, kernels, copies, trace, clock, wall_ms, device, warmup, iters, notes,
                        timeline=res.timeline, _trace_owner=prof)
    if trace_path is not None:
        rep.save_chrome_trace(trace_path)
    return rep


def _order_and_calls(calls) -> tuple[list[str], dict[str, int]]:
    order: list[str] = []
    counts: dict[str, int] = {}
    for name, *_ in calls:
        if name not in counts:
            order.append(name)
        counts[name] = counts.get(name, 0) + 1
    return order, counts


def _check_named_layers(layers) -> list[tuple[str, Callable]]:
    if not isinstance(layers, Sequence) or isinstance(layers, str):
        raise TypeError(f"named_layers() must return a list of (name, fn) pairs, got {type(layers).__name__}")
    out = []
    for i, item in enumerate(layers):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and callable(item[1])):
            raise TypeError(f"named_layers()[{i}] must be a (str, callable) pair, got {item!r}")
        out.append(item)
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"named_layers() names must be unique, got {[n for n, _ in out]}")
    return out


def _profile_named(named, args, warmup, iters, record_shapes):
    rec = _Recorder()
    kinds = {n: getattr(fn, "tcprec_kind", type(fn).__name__) for n, fn in named}

    def step():
        y = args[0] if len(args) == 1 else args
        for n, fn in named:
            rec.enter(n, (y,))
            try:
                y = fn(y)
            finally:
                rec.exit(n, fn, y)
        return y

    with torch.no_grad():
        prof, _ = _run_profiled(step, min(warmup, 1) if warmup else 0, iters, record_shapes, rec)
    return prof, rec, kinds


# ------------------------------------------------------------------------------------------------
# SQLite and HTML exports
# ------------------------------------------------------------------------------------------------
# CUPTI's copy kinds, as nsys writes them in CUPTI_ACTIVITY_KIND_MEMCPY.copyKind
_COPY_KIND = {"HtoD": 1, "DtoH": 2, "HtoH": 7, "DtoD": 8, "PtoP": 10}
_NVTX_PUSH_POP = 59  # NVTX_EVENTS.eventType of a push/pop range in nsys exports

_SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL UNIQUE);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
    start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, streamId INTEGER, correlationId INTEGER,
    demangledName INTEGER NOT NULL REFERENCES StringIds(id), shortName INTEGER NOT NULL REFERENCES StringIds(id),
    globalPid INTEGER, tcprecLayer TEXT, tcprecInference INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (
    start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, streamId INTEGER, correlationId INTEGER,
    copyKind INTEGER, bytes INTEGER, globalPid INTEGER, tcprecLayer TEXT, tcprecInference INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (
    start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, streamId INTEGER, correlationId INTEGER,
    bytes INTEGER, globalPid INTEGER, tcprecLayer TEXT, tcprecInference INTEGER);
CREATE TABLE NVTX_EVENTS (
    start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, text TEXT, globalTid INTEGER,
    tcprecInference INTEGER);
CREATE TABLE TCPREC_META (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE TCPREC_LAYERS (idx INTEGER PRIMARY KEY, name TEXT NOT NULL, kind TEXT, calls INTEGER,
    ms REAL NOT NULL, share REAL NOT NULL);
CREATE TABLE TCPREC_KERNEL_SUMMARY (name TEXT PRIMARY KEY, category TEXT, tensor_core INTEGER, calls REAL,
    total_ms REAL);
CREATE TABLE TCPREC_BREAKDOWN (category TEXT PRIMARY KEY, ms REAL);
CREATE TABLE TCPREC_COPIES (direction TEXT PRIMARY KEY, per_inference REAL);
CREATE TABLE TCPREC_DTYPE_TRACE (step INTEGER PRIMARY KEY, value TEXT NOT NULL);
"""

# The classification of every kernel name in StringIds, and the view over it.  _classify_names also
# runs on an nsys export (annotate_nsys_sqlite), so the view's query reads only nsys's own columns
# plus TCPREC_KERNEL_NAMES -- and the layer columns where this module wrote them.
_NAMES_SCHEMA = """
CREATE TABLE IF NOT EXISTS TCPREC_KERNEL_NAMES (nameId INTEGER PRIMARY KEY, category TEXT NOT NULL,
    tensor_core INTEGER NOT NULL, instruction_class TEXT NOT NULL, rule TEXT NOT NULL);
"""
_VIEW = """
CREATE VIEW TCPREC_KERNELS AS
SELECT s.value AS name, {layer} AS layer, {inference} AS inference, k.start AS start, k."end" AS "end",
       k."end" - k.start AS duration, c.tensor_core AS tensor_core, c.category AS category,
       c.instruction_class AS instruction_class, c.rule AS rule, k.correlationId AS correlationId
FROM CUPTI_ACTIVITY_KIND_KERNEL AS k
JOIN StringIds AS s ON s.id = k.shortName
JOIN TCPREC_KERNEL_NAMES AS c ON c.nameId = k.shortName;
"""


def _instruction_class(name: str, kind: str, clock: str) -> str:
    """What executes a kernel, coarsely: tensor-core MMA, CUDA-core, copy engine, or a CPU op."""
    category, tc, _ = kernel_rule(name)
    if clock == "cpu" or kind == "op":
        return "cpu op"
    if kind in ("memcpy", "memset") or category == "memcpy":
        return "copy"
    return "tensor-core mma" if tc else "cuda-core"


def _classify_names(conn, clock: str = "cuda") -> None:
    conn.executescript(_NAMES_SCHEMA)
    ids = [r[0] for r in conn.execute("SELECT DISTINCT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    for i in ids:
        (name,) = conn.execute("SELECT value FROM StringIds WHERE id = ?", (i,)).fetchone()
        category, tc, why = kernel_rule(name)
        conn.execute("INSERT OR REPLACE INTO TCPREC_KERNEL_NAMES VALUES (?, ?, ?, ?, ?)",
                     (i, category, int(tc and clock == "cuda"), _instruction_class(name, "kernel", clock), why))


def _check_out_path(path, suffixes: tuple[str, ...], what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} path {str(path)!r} is a directory; give a file name such as "
                         f"{str(path / ('profile' + suffixes[0]))!r}")
    if not path.parent.is_dir():
        raise ValueError(f"{what} path {str(path)!r}: the folder {str(path.parent)!r} does not exist; create it first")
    if path.suffix.lower() not in suffixes:
        raise ValueError(f"{what} path {str(path)!r} must end in {' or '.join(suffixes)}")
    return path


def _write_sqlite(rep: ProfileReport, path) -> Path:
    import sqlite3

    path = _check_out_path(path, (".sqlite", ".db", ".sqlite3"), "SQLite")
    if not rep.timeline:
        raise RuntimeError("this report has no timeline (it was built from an Analysis, not by tcprec.profile); "
                           "profile again to export it")
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    t0 = min(a.start for a in rep.timeline)

    def ns(t_us: float) -> int:  # nsys stores integer nanoseconds
        return round((t_us - t0) * 1000)

    conn = sqlite3.connect(tmp)
    try:
        conn.executescript(_SCHEMA)
        strings: dict[str, int] = {}

        def sid(text: str) -> int:
            if text not in strings:
                strings[text] = len(strings) + 1
                conn.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
            return strings[text]

        dev = 0 if rep.clock == "cuda" else -1  # -1: the rows are CPU ops (cpu clock)
        pid = os.getpid()
        for a in rep.timeline:
            if a.kind == "range":
                conn.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (ns(a.start), ns(a.end), _NVTX_PUSH_POP, a.corr or None, a.name, pid, a.inference))
            elif a.kind in ("kernel", "op"):
                n = sid(a.name)
                conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?)",
                             (ns(a.start), ns(a.end), dev, a.corr or None, n, n, pid, a.layer, a.inference))
            elif a.kind == "memcpy":
                m = _COPY_DIR.search(a.name)
                conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, ?, NULL, ?, ?, NULL, ?, ?, ?)",
                             (ns(a.start), ns(a.end), dev, a.corr or None, _COPY_KIND.get(m.group(1)) if m else None,
                              pid, a.layer, a.inference))
            elif a.kind == "memset":
                conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?, ?, ?, NULL, ?, NULL, ?, ?, ?)",
                             (ns(a.start), ns(a.end), dev, a.corr or None, pid, a.layer, a.inference))
        meta = {"device": rep.device, "clock": rep.clock, "warmup": rep.warmup, "iters": rep.iters,
                "wall_ms": rep.wall_ms, "tensor_core_ms": rep.tensor_core_ms, "time_unit": "ns",
                "kernel_rows": "device kernels" if rep.clock == "cuda" else "outermost CPU ops (deviceId -1)",
                "notes": "\n".join(rep.notes)}
        conn.executemany("INSERT INTO TCPREC_META VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()])
        conn.executemany("INSERT INTO TCPREC_LAYERS VALUES (?, ?, ?, ?, ?, ?)",
                         [(i, lay.name, lay.kind, lay.calls, lay.ms, lay.share) for i, lay in enumerate(rep.layers)])
        conn.executemany("INSERT INTO TCPREC_KERNEL_SUMMARY VALUES (?, ?, ?, ?, ?)",
                         [(k.name, k.category, int(k.tensor_core), k.calls, k.total_ms) for k in rep.kernels])
        conn.executemany("INSERT INTO TCPREC_BREAKDOWN VALUES (?, ?)", list(rep.breakdown.items()))
        conn.executemany("INSERT INTO TCPREC_COPIES VALUES (?, ?)", list(rep.copies.items()))
        conn.executemany("INSERT INTO TCPREC_DTYPE_TRACE VALUES (?, ?)",
                         list(enumerate(rep.dtype_trace.split(" -> "))))
        _classify_names(conn, rep.clock)
        conn.executescript(_VIEW.format(layer="k.tcprecLayer", inference="k.tcprecInference"))
        conn.commit()
    finally:
        conn.close()
    os.replace(tmp, path)
    return path


def annotate_nsys_sqlite(path: str | os.PathLike) -> Path:
    """Add tcprec's kernel classification to an ``nsys export --type sqlite`` database: the
    ``TCPREC_KERNEL_NAMES`` table (category, tensor-core flag, instruction class per kernel name)
    and the ``TCPREC_KERNELS`` view, the same view :meth:`ProfileReport.to_sqlite` writes (its
    ``layer`` / ``inference`` columns are NULL there: nsys attributes through NVTX ranges)."""
    import sqlite3

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite file at {str(path)!r}; export one with "
                                "`nsys export --type sqlite --output report.sqlite report.nsys-rep`")
    conn = sqlite3.connect(path)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        missing = {"CUPTI_ACTIVITY_KIND_KERNEL", "StringIds"} - tables
        if missing:
            raise ValueError(f"{str(path)!r} has no {', '.join(sorted(missing))}: not an nsys SQLite export with "
                             "CUDA kernels (capture with `nsys profile --trace cuda,nvtx`)")
        if "TCPREC_KERNELS" in tables:
            conn.execute("DROP VIEW TCPREC_KERNELS")
        _classify_names(conn, "cuda")
        conn.executescript(_VIEW.format(layer="NULL", inference="NULL"))
        conn.commit()
    finally:
        conn.close()
    return path


def _write_html(rep: ProfileReport, path) -> Path:
    import html

    path = _check_out_path(path, (".html", ".htm"), "HTML")
    esc = html.escape
    top = max((lay.ms for lay in rep.layers), default=0.0) or 1.0
    layer_rows = "".join(
        f"<tr><td>{esc(lay.name)}</td><td>{esc(lay.kind)}</td><td class=n>{lay.calls}</td>"
        f"<td class=n>{lay.ms:.4f}</td><td class=n>{100 * lay.share:.1f}%</td>"
        f"<td class=bar><div style='width:{100 * lay.ms / top:.1f}%'></div></td></tr>" for lay in rep.layers)
    total = sum(k.total_ms for k in rep.kernels) or 1.0
    kernel_rows = "".join(
        f"<tr{' class=tc' if k.tensor_core else ''}><td>{esc(k.name)}</td><td>{esc(k.category)}</td>"
        f"<td>{'yes' if k.tensor_core else ''}</td><td class=n>{k.calls:g}</td><td class=n>{k.total_ms:.4f}</td>"
        f"<td class=n>{100 * k.total_ms / total:.1f}%</td></tr>" for k in rep.kernels)
    small = "".join(f"<tr><td>{esc(c)}</td><td class=n>{ms:.4f}</td></tr>" for c, ms in rep.breakdown.items())
    copies = ", ".join(f"{d} {n:g}" for d, n in rep.copies.items())
    notes = "".join(f"<li>{esc(n)}</li>" for n in rep.notes)
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>tcprec profile on {esc(rep.device)}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ padding: 2px 8px; text-align: left; }}
th {{ border-bottom: 1px solid #888; }} td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
td.bar {{ width: 320px; }} td.bar div {{ background: #4a7fb5; height: 12px; }}
tr.tc td {{ background: #e6f4e6; }} code {{ background: #f3f3f3; padding: 2px 4px; }}
</style></head><body>
<h1>tcprec profile on {esc(rep.device)}</h1>
<p>{esc(rep.clock)} clock, {rep.iters} profiled inferences after {rep.warmup} warm-up calls;
wall {rep.wall_ms:.3f} ms per inference; tensor-core kernels {rep.tensor_core_ms:.4f} ms; copies per
inference: {esc(copies)}.</p>
<h2>Time per layer (ms per inference)</h2>
<table><tr><th>layer</th><th>kind</th><th>calls</th><th>ms</th><th>share</th><th></th></tr>{layer_rows}</table>
<h2>Breakdown (ms per inference)</h2><table>{small}</table>
<h2>Kernels{' (CPU ops on the cpu clock)' if rep.clock == 'cpu' else ''}</h2>
<table><tr><th>name</th><th>category</th><th>tensor core</th><th>calls</th><th>ms</th><th>share</th></tr>
{kernel_rows}</table>
<h2>dtype trace</h2><p><code>{esc(rep.dtype_trace)}</code></p>
<ul>{notes}</ul>
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
    return path
