"""The quantized convolution's plan: what ``ops.qconv.conv2d`` runs, decided once, by one pure function.

``plan_conv2d(geometry, formats, options, device)`` takes the operands' *specs* (formats, shapes, the layout x
comes in) and a :class:`DeviceCaps` record (what the device can run) and returns a frozen :class:`ConvPlan`:

* ``backend`` and ``reason``: ``"bitserial"`` (binary tensor cores, while p*q < 8), ``"int8"``, ``"fp8"`` or
  ``"reference"`` (float64 ``F.conv2d``, any device) -- the rule of ``ops.matmul.int_backend_rule``;
* ``route``: how that backend reads its input (bit-serial: ``"implicit"`` GEMM / ``"pointwise"`` / ``"im2col"``;
  INT8: the Triton ``"kernel"``, ``"wgmma-gemm"`` (a linear's rows on ``kernels/cuda/i8_gemm.cu``, sm_90a: see
  :func:`wgmma_gemm_refusal`) or ``"im2col"`` + ``torch._int_mm``; FP8: ``"kernel"``);
* ``stem``: a thin (C < 16) spatial layer's special path: ``"gather"`` (windows gathered into rows, a 1x1 conv) or
  ``"cuda"`` (``kernels/cuda/stem_conv.cu`` on sm_90);
* ``epilogue``: what the GEMM / kernel writes (``"int32"``, a float dtype, ``"packed"`` / ``"planes"`` bit planes,
  ``"int8"`` / ``"e4m3"`` / ``"e5m2"`` codes, ``"dual"``: a float and its codes);
* ``after``: the pass that follows it (``"pool_planes"``, ``"pool_float"``, ``"pack_float"``, ``"finish"``: the
  float32 result's pool / activation / re-quantize, by ``finish``: ``"pack"`` / ``"fp8"`` in one Triton pass or
  ``"torch"``);
* ``passes``: the same decisions in words, which ``explain_conv2d`` prints.

``ops.qconv.conv2d`` validates the tensors, calls :func:`plan_conv2d` with :func:`device_caps` of their device,
and runs the plan (``ops.qconv.run``); ``explain_conv2d`` formats it.  Neither re-derives a decision.  The only
function here that looks at the machine is :func:`device_caps`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..enums import Backend, backend_names
from ..formats import FloatFormat, IntFormat, as_format
from ..kernels import reference_conv_bitserial as rq
from ..kernels import reference_gemm as rg
from ..kernels.conv_geometry import ConvGeometry
from ..kernels.reference_conv_int8_fp8 import ACT_CLAMP, act_monotone, parse_act
from ..kernels.triton._host import interpreting
from ..qtensor import float8_dtype as _fp8_dtype
from ..qtensor import int8_affine as _int8_affine
from .matmul import BACKENDS as _INT_BACKENDS
from .matmul import int_backend_rule

__all__ = ["ConvPlan", "DeviceCaps", "device_caps", "layer_backend", "layer_act_unsupported", "plan_conv2d",
           "format_plan", "implicit_conv", "wgmma_gemm_refusal", "POOLS", "OUT_LAYOUTS", "BACKENDS", "THIN_C",
           "WGMMA_GEMM", "GELU"]

POOLS = (None, ("max", 2, 2), ("avg", 2, 2), ("max", 2, 1))
BACKENDS = _INT_BACKENDS + backend_names(Backend.FP8)  # matmul's, and the float8 tensor cores
OUT_LAYOUTS = ("planes", "compact", "int8", "int8+float", "fp8+float", "planes+float")
_PLANE_LAYOUTS = ("planes", "compact")
_INT8_LAYOUTS = ("int8", "int8+float")
_DUAL_LAYOUTS = ("int8+float", "fp8+float", "planes+float")
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
_KIND = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_DUAL_DTYPES = (torch.float16, torch.bfloat16)  # the bit-serial epilogue's float output next to its planes
_INT32_LIMIT = 1 << 31
_FP8_KIND = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}  # the conv kernels' out=(kind, out_scale)
# The fused max-pools of the one-pass re-quantize kernels (bit planes and int8): pool -> stride.
_FUSED_POOLS = {("max", 2, 2): 2, ("max", 2, 1): 1}
# What x comes as: a QTensor of codes, bit planes (padded or compact rows), int8 codes, float8 codes.
INPUT_LAYOUTS = ("codes", "planes", "compact", "int8", "fp8")
# The INT8 route of a linear's rows on the hand-written warp-specialised wgmma GEMM (kernels/cuda/i8_gemm.cu, sm_90a;
# docs/decisions/0163: 171.6 us for the transformer's four GEMMs a layer against 229.8 for the
# Triton kernel on the H200), and the one activation only its epilogue (and the torch epilogues) applies: the erf GELU
# of a transformer's linear1, fused when linear1 hands linear2 its int8 codes (nn/convert.py _chain_ffn).
WGMMA_GEMM = "wgmma-gemm"
GELU = "gelu"
_I8G_K_ALIGN, _I8G_K_MAX = 16, 1 << 17  # kernels/cuda/i8_gemm.py K_ALIGN / K_MAX (importing it loads cuda.core)


def _check_pool(pool):
    """``pool`` as one of :data:`POOLS` (a list becomes a tuple), or ValueError."""
    if isinstance(pool, list):
        pool = tuple(pool)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS} ((kind, kernel, stride)), got pool={pool!r}")
    return pool


# ------------------------------------------------------------------------------------------------
# The device, as the planner sees it
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCaps:
    """What a device can run, as far as the convolution's plan depends on it.

    ``device``: the torch device (named in reasons); ``interpreting``: ``TRITON_INTERPRET=1`` (Triton kernels run on
    the CPU); ``capability``: CUDA compute capability (None off CUDA); ``cuda_kernels``: NVRTC-built kernels can be
    loaded (``kernels/cuda/runtime.usable``); ``bitserial``: ``bmma_gemm.can_run``'s (ok, reason); ``sm_count``:
    streaming multiprocessors (off CUDA 132, the H100 / H200 the implicit-GEMM rule was measured on)."""

    device: torch.device
    interpreting: bool = False
    capability: tuple[int, int] | None = None
    cuda_kernels: bool = False
    bitserial: tuple[bool, str] = (False, "tensors on cpu: the binary tensor-core kernel needs CUDA tensors")
    sm_count: int = 132

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def triton(self) -> bool:
        """Whether Triton kernels run here (a CUDA device, or the interpreter)."""
        return self.cuda or self.interpreting


_CAPS: dict = {}


def device_caps(device: torch.device) -> DeviceCaps:
    """The :class:`DeviceCaps` of ``device`` (queried once per device and ``TRITON_INTERPRET`` setting)."""
    device = torch.device(device)
    interp = interpreting()
    key = (device, interp)
    caps = _CAPS.get(key)
    if caps is not None:
        return caps
    if device.type != "cuda":
        caps = DeviceCaps(device, interp, None, False,
                          (False, f"tensors on {device.type}: the binary tensor-core kernel needs CUDA tensors"), 132)
    else:
        from ..kernels.cuda import bmma_gemm, runtime  # lazy: CUDA kernel modules

        caps = DeviceCaps(device, interp, tuple(torch.cuda.get_device_capability(device)),
                          runtime.usable(device)[0], bmma_gemm.can_run(device), runtime.sm_count(device)[0])
    _CAPS[key] = caps
    return caps


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvPlan:
    """One convolution's plan (module docstring).  The first group is what was asked, the second what was
    decided; ``passes`` says the decisions in words."""

    geometry: ConvGeometry
    a_fmt: IntFormat | FloatFormat
    w_fmt: IntFormat | FloatFormat
    act: object
    pool: object
    out_dtype: torch.dtype
    out_fmt: IntFormat | FloatFormat | None
    out_layout: str  # an integer out_fmt as bit planes, int8 codes (ShiftedInt8), or with the float too (OUT_LAYOUTS)
    has_residual: bool  # a residual added in the epilogue, before the activation
    input_layout: str  # INPUT_LAYOUTS
    fast_accum: bool
    device: DeviceCaps
    has_scale: bool = False  # a per-channel ``scale`` (a folded BatchNorm) multiplies the column scale

    backend: str = ""
    reason: str = ""
    route: str = ""
    stem: str = ""
    epilogue: str = ""
    after: str = ""
    finish: str = ""
    passes: tuple = ()

    @property
    def dual(self) -> bool:
        """The float result and its int8 / float8 codes or bit planes (``out_layout="int8+float"`` / ``"fp8+float"`` /
        ``"planes+float"``)."""
        return self.out_layout in _DUAL_LAYOUTS

    @property
    def fused(self) -> bool:
        """Whether the kernel's epilogue does everything (scale, bias, activation, the output dtype or packed
        planes); pooling is a separate pass."""
        return self.pool is None

    @property
    def pool_float(self) -> bool:
        """A max-pool of a float output pools the output dtype: rounding is monotone, so the pool of the rounded
        values is the rounding of the float32 pool, bit for bit (the kernel writes its final dtype at full size and
        ``pack.pool_cast`` pools it: half the bytes of float32, no torch pool and cast)."""
        return (self.pool is not None and tuple(self.pool) in _FUSED_POOLS and self.out_fmt is None
                and self.out_dtype in _KIND and not self.dual and not self.has_residual)

    @property
    def pool_codes(self) -> bool:
        """A max-pool whose result is re-quantized to packed planes pools the codes instead: quantizing is
        monotone, so max then quantize = quantize then max (the bit-serial epilogue packs at full size, a
        bit-plane pass pools; no float tensor)."""
        return (self.pool is not None and tuple(self.pool) in _FUSED_POOLS and isinstance(self.out_fmt, IntFormat)
                and self.out_layout in _PLANE_LAYOUTS)

    def explain(self) -> str:
        return format_plan(self)


def format_plan(plan: ConvPlan) -> str:
    """``explain_conv2d``'s text: the backend, why, the shapes, and the passes -- all read from ``plan``."""
    g = plan.geometry
    M, Kt = g.N * g.P * g.Q, g.R * g.S * g.C
    head = (f"{plan.backend}: {plan.reason}; conv {g.N}x{g.H}x{g.W}x{g.C} * {g.K}x{g.R}x{g.S}x{g.C}, stride "
            f"{g.stride}, padding {g.padding}, dilation {g.dilation} -> {g.N}x{g.P}x{g.Q}x{g.K}; GEMM M={M} N={g.K} "
            f"K={Kt}")
    return head + "; passes: " + " -> ".join(plan.passes)


# ------------------------------------------------------------------------------------------------
# The planner
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # pure: a network's layers plan once per (input spec, device), then look it up
def plan_conv2d(g: ConvGeometry, a_fmt, w_fmt, *, device: DeviceCaps, input_layout: str = "codes", act=None,
                pool=None, out_dtype=torch.float32, out_fmt=None, out_scale_given: bool = False, backend: str = "auto",
                out_layout: str = "planes", has_residual: bool = False, fast_accum: bool = True,
                force_bitserial: bool = False, has_scale: bool = False) -> ConvPlan:
    """The :class:`ConvPlan` of a convolution of geometry ``g`` with ``a_fmt`` activations (arriving as
    ``input_layout``) and ``w_fmt`` weights on ``device``; raises ValueError / TypeError naming a bad argument, its
    allowed values and the fix.  ``act`` and ``pool`` as checked by ``ops.qconv`` (canonical forms).
    ``force_bitserial``: the test hook that runs the bit-serial pipeline with an emulated GEMM.  ``has_scale``: a
    per-channel ``scale`` is passed (the wgmma GEMM's epilogue has none).  ``act="gelu"`` (the erf GELU) is applied by
    the wgmma GEMM's epilogue and by the torch epilogues (``reference``, the INT8 im2col route) only; elsewhere it is a
    ValueError."""
    fa, fw = a_fmt, w_fmt
    fp8 = _fp8_dtype(fa) is not None
    if fp8 != (_fp8_dtype(fw) is not None):
        raise TypeError(f"x is {fa} but w is {fw}: conv2d multiplies two integer formats or two float8 formats; "
                        "quantize both to integers or both to e4m3 (quantize_fp8_static, tcprec.quantize(w, 'e4m3', "
                        "PerChannel(0)))")
    if not fp8 and fa.encoding == "pm1" and max(g.padding) > 0:
        raise ValueError(
            f"x is {fa} (pm1: values +-1, +-3, ...; no zero) but padding={g.padding}: spatial padding adds zeros, which "
            "a pm1 code cannot hold, and the bit-serial kernel's pm1 correction counts every one of the K terms. Use "
            "unsigned or two's complement activations (e.g. 'uint2' after a ReLU, 'int2'), or padding=0"
        )
    pool = _check_pool(pool)
    if out_fmt is not None:
        out_fmt = as_format(out_fmt)
        if not isinstance(out_fmt, IntFormat) and _fp8_dtype(out_fmt) is None:
            raise TypeError(f"out_fmt must be an integer format or e4m3 / e5m2 (the next layer's activations), "
                            f"got {out_fmt}")
        if not out_scale_given:
            raise ValueError("out_fmt needs out_scale (one positive float: the next layer's activation scale)")
        if out_dtype == torch.int32:
            raise ValueError("out_fmt re-quantizes the float result; leave out_dtype at its default with out_fmt")
    if out_layout not in OUT_LAYOUTS:
        raise ValueError(f"out_layout must be one of {OUT_LAYOUTS} (an integer out_fmt as bit planes for a bit-serial "
                         f"layer -- 'compact': without the padding words, for one that gathers windows -- or one "
                         f"int8 per element for an INT8 layer), got {out_layout!r}")
    if out_layout in _INT8_LAYOUTS and not isinstance(out_fmt, IntFormat):
        raise ValueError(f"out_layout={out_layout!r} writes integer codes for the next INT8 layer: it needs an integer "
                         f"out_fmt (e.g. 'uint8'), got out_fmt={out_fmt}")
    if out_layout == "planes+float" and not isinstance(out_fmt, IntFormat):
        raise ValueError(f"out_layout='planes+float' writes the float output and its bit planes for the next bit-serial "
                         f"layers: it needs an integer out_fmt (e.g. 'uint2'), got out_fmt={out_fmt}")
    if out_layout == "fp8+float" and not isinstance(out_fmt, FloatFormat):
        raise ValueError(f"out_layout='fp8+float' writes the float output and the next FP8 layer's codes: it needs "
                         f"out_fmt='e4m3' or 'e5m2', got out_fmt={out_fmt}")
    elif out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    if has_residual and out_dtype not in _KIND:
        raise ValueError(f"residual is added in the float epilogue: out_dtype must be one of "
                         f"{[str(d) for d in _KIND]}, got {out_dtype}; pass the network's float dtype")
    if out_dtype == torch.int32 and (act is not None or pool is not None):
        raise ValueError("scale, bias, act and pool apply to the scaled float result; out_dtype=torch.int32 returns the "
                         "raw integer convolution, so pass a float out_dtype (or out_fmt) to use them")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    spec = dict(geometry=g, a_fmt=fa, w_fmt=fw, act=act, pool=pool, out_dtype=out_dtype, out_fmt=out_fmt,
                out_layout=out_layout, has_residual=has_residual, input_layout=input_layout,
                fast_accum=bool(fast_accum), device=device, has_scale=bool(has_scale))
    if fp8:
        if out_dtype == torch.int32 and out_fmt is None:
            raise ValueError("float8 operands accumulate in float32: out_dtype=torch.int32 (the raw integer "
                             "convolution) is for integer formats; pass a float out_dtype")
        name, why = layer_backend(fa, fw, device, backend)
        plan = ConvPlan(**spec, backend=name, reason=why, route="kernel" if name == "fp8" else "")
        return _decide(_check_fusion(_check_gelu(_check_act_backend(plan))))
    if backend == "fp8":
        raise ValueError(f"backend='fp8' needs float8 operands (e4m3 / e5m2), got {fa} x {fw}; use 'int8' or 'auto'")
    K_true = g.R * g.S * g.C
    bound = K_true * max(abs(fa.min), abs(fa.max)) * max(abs(fw.min), abs(fw.max))
    if bound >= _INT32_LIMIT:
        raise ValueError(f"R*S*C = {K_true} with {fa} x {fw} can reach |C| = {bound} >= 2^31, beyond the int32 "
                         "accumulator; split the input channels and add the partial results in float")
    if force_bitserial:
        name, why = "bitserial", "forced (test hook: emulated GEMM)"
    else:
        name, why = layer_backend(fa, fw, device, backend)
    route, base = "", why
    if name == "int8":
        route, how = _int8_route(fa, fw, device)
        if route == "kernel":
            why = why.replace("torch._int_mm", "the Triton INT8 conv")
        why = f"{why}; {how}"
    plan = ConvPlan(**spec, backend=name, reason=why, route=route)
    if route == "kernel" and _gemm_rows(g):  # a linear's rows: the wgmma GEMM where it gives the same answer
        refusal = wgmma_gemm_refusal(plan)
        if refusal is None:
            why = (f"{base.replace('torch._int_mm', 'i8_gemm')}; {WGMMA_GEMM}: a linear's rows on the warp-specialised "
                   "wgmma GEMM kernels/cuda/i8_gemm.cu (sm_90a), the same float32 epilogue as the Triton kernel's")
            plan = _replace(plan, route=WGMMA_GEMM, reason=why)
        else:
            plan = _replace(plan, reason=f"{why}; not {WGMMA_GEMM}: {refusal}")
    return _decide(_check_fusion(_check_gelu(_check_act_backend(plan))))


def _gemm_rows(g: ConvGeometry) -> bool:
    """Whether the convolution is a linear's rows: a 1x1 filter, stride 1, no padding, over 1x1 images (``QLinear``
    runs its (M, K) input as M such images), so that the (M, K) int8 codes and the (N, K) weight are a plain GEMM."""
    return (g.H, g.W, g.R, g.S, g.stride, g.padding) == (1, 1, 1, 1, (1, 1), (0, 0))


def wgmma_gemm_refusal(p: ConvPlan) -> str | None:
    """Why the INT8 plan ``p`` of a linear's rows cannot run ``kernels/cuda/i8_gemm.cu`` and give exactly the Triton
    kernel's answer, or None when it can.  The kernel multiplies int8 codes *as values* (no offset correction) and
    applies ``float32(acc) * (a_scale * w_scale[n]) + bias[n]`` (+ the erf GELU) in float32, then writes fp16 or the
    next layer's ``int8`` codes -- the Triton kernel's operations in its order (``col = x_scale * w_scale[k]`` rounded
    once, one multiply, one add, one rounding to fp16; the codes by IEEE division, clamp, round half to even), so the
    outputs are bit-identical.  Every condition:

    * an sm_90 GPU (wgmma and setmaxnreg: sm_90a) that loads the NVRTC-built CUDA kernels;
    * both operands stored as their values (``qtensor.int8_affine`` = (0, 1)): a ``uint8`` / ``pm8`` operand is stored
      shifted (``code - 128``) and needs a row-sum correction the kernel lacks;
    * K a multiple of 16 (TMA's 16-byte row pitch) below 2^17 (exact int32 sums);
    * no per-channel ``scale`` (a folded BatchNorm: the Triton kernel rounds one more product), no pool, act None or
      the erf GELU;
    * output fp16 (``out_dtype`` float32 / bfloat16: the kernel writes fp16 only), or the next layer's ``int8`` codes
      (``out_layout="int8"``, ``out_fmt`` int8: the kernel's codes are two's complement, offset 0);
    * a residual (a pre-norm transformer layer's ``x + out_proj(..)`` / ``x + linear2(..)``: nn/convert.py
      ``_fuse_linear_residuals``) with fp16 out only and without an activation: the kernel adds the (M, N) fp16
      residual to the fp16 output, ``fp16(float32(fp16(y)) + float32(r))`` (``reference_i8_gemm``), which is the
      Triton epilogue's ``HAS_RES`` (``conv_fwd_epilogue``: the branch rounded to the residual's dtype, one float32
      add, the sum rounded) and the torch epilogues' (``qconv._finish_float``) for an fp16 residual -- so the sum is
      the Triton route's bit for bit.  Its GELU comes before the add, the plan's activation after it
      (``act(conv + residual)``): a residual with an activation, or with int8 codes out (the kernel adds it to fp16
      only), stays on the Triton kernel.
    """
    caps, g = p.device, p.geometry
    if not caps.cuda:
        return f"tensors on {caps.device.type}, the kernel needs an sm_90 GPU"
    if caps.capability != (9, 0):
        cc = caps.capability
        return f"the GPU is sm_{cc[0]}{cc[1]}, the kernel's wgmma / setmaxnreg need sm_90a (H100 / H200)"
    if not caps.cuda_kernels:
        return "the NVRTC-built CUDA kernels cannot be loaded here (kernels/cuda/runtime.usable)"
    for what, fmt in (("x", p.a_fmt), ("w", p.w_fmt)):
        off, step = _int8_affine(fmt)
        if (off, step) != (0, 1):
            return (f"{what}'s {fmt} codes are stored shifted (value = {off} + {step} * int8): the kernel multiplies "
                    "the int8 codes as values and has no row-sum correction")
    if g.C % _I8G_K_ALIGN or g.C >= _I8G_K_MAX:
        return f"K = {g.C} is not a multiple of {_I8G_K_ALIGN} below {_I8G_K_MAX} (TMA row pitch, exact int32 sums)"
    if p.has_scale:
        return "a per-channel scale (folded BatchNorm) is not in the kernel's epilogue"
    if p.pool is not None:
        return "a pool is not in the kernel's epilogue"
    if p.has_residual and p.out_fmt is not None:
        return ("a residual with int8 codes out: the kernel adds the residual to its fp16 output only (the unfused "
                "graph quantizes the sum)")
    if p.has_residual and p.act is not None:
        return (f"a residual with act={p.act!r}: the kernel applies its GELU before the residual add, the plan's "
                "activation is after it (act(y + residual))")
    if p.act not in (None, GELU):
        return f"act={p.act!r}: the kernel's epilogue applies None or the erf GELU only"
    if p.out_fmt is None:
        if p.out_dtype != torch.float16:
            return (f"out_dtype={p.out_dtype}: the kernel writes float16 (or the next layer's int8 codes); a "
                    "float32 / bfloat16 model keeps the Triton kernel")
        return None
    if p.out_layout != "int8" or not isinstance(p.out_fmt, IntFormat) or p.out_fmt.bits != 8 or \
            p.out_fmt.encoding != "twos":
        return (f"out_fmt={p.out_fmt} with out_layout={p.out_layout!r}: the kernel writes float16 or int8 codes "
                "(two's complement, offset 0) only")
    return None


def _check_gelu(plan: ConvPlan) -> ConvPlan:
    """``act="gelu"``: the erf GELU is in the wgmma GEMM's epilogue and the torch epilogues (``reference``, the INT8
    im2col route) only; the Triton INT8 / FP8 kernels' epilogue measured slower with it (docs/decisions/0125), and the
    bit-serial GEMM's has none.  Anywhere else: a ValueError that says where it runs."""
    if plan.act != GELU or plan.backend == "reference" or (plan.backend == "int8" and plan.route == "im2col"):
        return plan
    if plan.route == WGMMA_GEMM:
        return plan
    raise ValueError(f"act='gelu' (the erf GELU) is applied by the {WGMMA_GEMM} route's epilogue (a linear's rows on "
                     f"kernels/cuda/i8_gemm.cu, sm_90) and the torch epilogues only; this plan runs backend "
                     f"{plan.backend!r} ({plan.reason}); pass act=None and apply F.gelu to the float output, or "
                     "convert the model on the device it runs on")


def layer_backend(a_fmt, w_fmt, device: DeviceCaps, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason): the backend a convolution of ``a_fmt`` activations and ``w_fmt`` weights runs on
    ``device`` (``backend``: the caller's choice, "auto" for the rule) -- the first decision of :func:`plan_conv2d`,
    which needs no shape, so a quantized layer can make it once per device (``nn.qmodules``).  Integer formats:
    ``ops.matmul``'s rule (bit-serial while p*q < 8, INT8 otherwise, the float64 reference off CUDA); float8: the FP8
    tensor cores on CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    if _fp8_dtype(a_fmt) is not None:
        return _choose_fp8_backend(a_fmt, w_fmt, device, backend)
    if backend == "fp8":
        raise ValueError(f"backend='fp8' needs float8 operands (e4m3 / e5m2), got {a_fmt} x {w_fmt}; use 'int8' or "
                         "'auto'")
    name, why = int_backend_rule(a_fmt, w_fmt, device.device, device.bitserial, backend)
    if name == "reference":
        why = why.replace("pure-torch bit-serial reference", "float64 F.conv2d on the decoded codes")
    return name, why


def _choose_fp8_backend(fa, fw, caps: DeviceCaps, backend: str) -> tuple[str, str]:
    pair_ = f"{fa} activations x {fw} weights"
    dev = caps.device
    if backend in ("bitserial", "int8"):
        raise ValueError(f"backend={backend!r} multiplies integer formats; {pair_} run on backend='fp8' "
                         "(FP8 tensor cores), 'reference' or 'auto'")
    if backend == "reference":
        return "reference", f"asked for the float64 F.conv2d on the decoded fp8 values ({pair_}, on {dev})"
    if caps.cuda or (backend == "fp8" and caps.interpreting):
        how = "asked for" if backend == "fp8" else f"{pair_}:"
        return "fp8", f"{how} the FP8 tensor cores (Triton implicit-GEMM conv, wgmma e4m3/e5m2)"
    if backend == "fp8":
        raise RuntimeError(f"backend='fp8' needs CUDA tensors (or TRITON_INTERPRET=1), got {dev}; use 'reference'")
    return "reference", f"tensors on {dev.type}: float64 F.conv2d on the decoded fp8 values ({pair_})"


def _int8_route(fa: IntFormat, fw: IntFormat, caps: DeviceCaps) -> tuple[str, str]:
    """("kernel" | "im2col", why) for the int8 backend."""
    if not caps.triton:
        return "im2col", f"on {caps.device.type} without the Triton interpreter: im2col on the codes + torch._int_mm"
    if fw.bits == 8 and fw.encoding != "twos":
        return "im2col", (f"{fw} weights are stored shifted (code - 128), whose correction needs each window's sum of "
                          "x: im2col on the codes + torch._int_mm")
    return "kernel", "Triton implicit-GEMM INT8 conv (no im2col buffer)"


def _extended_act(act) -> bool:
    """Whether ``act`` is one of the activations beyond ReLU / LeakyReLU (clamp, hardswish, SiLU), which only the
    INT8 / FP8 kernels' and the torch epilogues apply (and the erf GELU, which only the wgmma GEMM's and the torch
    epilogues apply)."""
    return act == GELU or parse_act(act)[0] >= ACT_CLAMP


def _bitserial_act_error(act, reason: str) -> str:
    return (f"act={act!r}: backend 'bitserial' (the binary tensor-core GEMM: {reason}) applies only None, 'relu' and "
            f"('leaky', slope) in its epilogue; run this layer on backend='int8' (the INT8 conv's epilogue has "
            f"('clamp', lo, hi), 'hardswish' and 'silu'), or pass act=None and apply the activation to the conv's "
            "float output")


def _check_act_backend(plan: ConvPlan) -> ConvPlan:
    """The activation against the backend: the bit-serial GEMM's epilogue applies None, ReLU and LeakyReLU only, and
    says so rather than running the activation as a separate pass."""
    if plan.backend == "bitserial" and _extended_act(plan.act):
        raise ValueError(_bitserial_act_error(plan.act, plan.reason))
    return plan


# A GPU on which the binary tensor-core GEMM runs: where a layer that takes it on any device takes it.
_BITSERIAL_GPU = DeviceCaps(torch.device("cuda"), False, (9, 0), True, (True, "on a GPU that runs the binary kernel"))


def layer_act_unsupported(act, a_fmt, w_fmt, backend: str = "auto") -> str | None:
    """Why a quantized layer of ``a_fmt`` activations and ``w_fmt`` weights (``backend``: its choice) cannot apply
    ``act`` (canonical, ``ops.qconv``'s forms) in its epilogue on every device it may run on; None when it can.
    Clamp, hardswish and SiLU are in every epilogue but the bit-serial GEMM's, which the layer runs wherever the
    binary kernel does when :func:`layer_backend` picks it there (``backend='bitserial'``, or ``'auto'`` with
    p*q < 8): such a layer refuses them on the CPU too (where it runs the reference, which has them), so that the
    model it is part of runs on the GPU.  ``nn.qmodules.QConv2d`` refuses such an ``act``; ``quantize_model`` leaves
    the activation after the layer, a float op.

    >>> from tcprec.formats import as_format
    >>> layer_act_unsupported("silu", as_format("uint2"), as_format("int2")).split(":")[0]
    "act='silu'"
    >>> layer_act_unsupported("silu", as_format("uint8"), as_format("int8")) is None
    True
    """
    if not _extended_act(act):
        return None
    name, why = layer_backend(a_fmt, w_fmt, _BITSERIAL_GPU, backend)
    return _bitserial_act_error(act, why) if name == "bitserial" else None


def _check_fusion(plan: ConvPlan) -> ConvPlan:
    """The residual and the dual output: which epilogues take them (the INT8 / FP8 kernels' and the torch
    ones; the bit-serial GEMM's takes a residual into a float output only), and says so rather than falling back
    to separate passes."""
    what = [w for w, on in (("residual=", plan.has_residual), (f"out_layout={plan.out_layout!r}", plan.dual)) if on]
    if not what:
        return plan
    what = " and ".join(what)
    if plan.pool is not None:
        raise ValueError(f"{what} cannot be combined with pool={plan.pool} (the block output is not pooled); pass "
                         "pool=None and pool in a separate layer")
    if plan.has_residual and isinstance(plan.out_fmt, IntFormat) and \
            plan.out_layout not in _INT8_LAYOUTS + ("planes+float",):
        raise ValueError(f"residual= writes a float output, INT8 codes, float8 codes or the float and its planes: "
                         f"out_fmt={plan.out_fmt} with out_layout={plan.out_layout!r} is not one of them; use "
                         "out_fmt=None, an integer out_fmt with out_layout in ('int8', 'int8+float', 'planes+float'), "
                         "or out_fmt e4m3 / e5m2")
    if plan.out_layout == "planes+float" and plan.backend not in ("bitserial", "reference", "int8"):
        raise ValueError(f"out_layout='planes+float' (the float output and its bit planes) is written by the "
                         f"'bitserial', 'int8' and 'reference' backends, not {plan.backend!r}; an FP8 layer writes its "
                         "float and float8 codes with out_layout='fp8+float'")
    if plan.backend == "bitserial" and plan.out_fmt is not None and (
            plan.out_layout != "planes+float" or plan.out_fmt.bits > 3 or plan.out_dtype not in _DUAL_DTYPES):
        raise ValueError(f"{what}: backend 'bitserial' (the binary tensor-core GEMM) adds a residual into a float "
                         f"output (out_fmt=None), or writes it with its planes (out_layout='planes+float', out_fmt of "
                         f"<= 3 bits, out_dtype float16 / bfloat16), not out_fmt={plan.out_fmt} with out_layout="
                         f"{plan.out_layout!r} and out_dtype={plan.out_dtype}; backends that write other codes with "
                         "it: 'int8', 'fp8', 'reference'")
    return plan


# -- per backend: route, stem, epilogue, the pass after it, and the words for each -----------------------------


def _decide(p: ConvPlan) -> ConvPlan:
    """Fill in the decisions below the backend (module docstring) and the passes that say them."""
    if p.backend == "bitserial":
        return _decide_bitserial(p)
    if p.route == WGMMA_GEMM:
        return _decide_gemm(p)
    if p.backend == "fp8" or p.route == "kernel":
        return _decide_kernel(p)
    out = _out_words(p)
    res = ", residual" if p.has_residual else ""
    steps = (("float64 F.conv2d on decoded codes" if p.backend == "reference" else
              "im2col on codes (torch gather) + torch._int_mm (INT8 tensor cores)"),
             f"epilogue in torch (scale, bias{res}, act={p.act}, pool={p.pool}) -> {out}")
    raw = p.out_dtype == torch.int32 and p.out_fmt is None
    return _replace(p, epilogue="int32" if raw else "float32", after="" if raw else "finish",
                    finish="" if raw else _finish_kind(p), passes=steps)


def _replace(p: ConvPlan, **kw) -> ConvPlan:
    from dataclasses import replace

    return replace(p, **kw)


def _out_words(p: ConvPlan) -> str:
    """The result, in explain's words."""
    if p.out_dtype == torch.int32 and p.out_fmt is None:
        return "int32"
    if p.dual and isinstance(p.out_fmt, FloatFormat):
        return f"{_KIND[p.out_dtype]} + {p.out_fmt} codes (float8 QTensor with hp)"
    if isinstance(p.out_fmt, FloatFormat):
        return f"{p.out_fmt} QTensor"
    if p.out_layout == "int8":
        return f"{p.out_fmt} ShiftedInt8 QTensor"
    if p.out_layout == "planes+float":
        return f"{_KIND[p.out_dtype]} + packed {p.out_fmt} planes (BitPlanes QTensor with hp)"
    if p.dual:
        return f"{_KIND[p.out_dtype]} + {p.out_fmt} codes (ShiftedInt8 QTensor with hp)"
    if p.out_fmt is not None:
        return f"packed {p.out_fmt} planes"
    return str(p.out_dtype).removeprefix("torch.")


def _finish_kind(p: ConvPlan) -> str:
    """How a float32 result becomes the output (``qconv._finish_float``): "pack" (max-pool + quantize (+ pack) to
    planes / int8 codes in one Triton pass), "fp8" (max-pool + quantize to float8 codes in one Triton pass) or
    "torch" (torch passes; the reference backend and the CPU without the interpreter)."""
    one_pass = p.backend != "reference" and p.device.triton and (p.pool is None or tuple(p.pool) in _FUSED_POOLS)
    if one_pass and isinstance(p.out_fmt, IntFormat):
        return "pack"
    if one_pass and isinstance(p.out_fmt, FloatFormat):
        return "fp8"
    return "torch"


def _after_words(p: ConvPlan, out: str, requant: str) -> list[str]:
    """The passes after a GEMM that wrote float32 (pool, re-quantize / cast)."""
    pool = f"{p.pool[0]}-pool {p.pool[1]}x{p.pool[1]} stride {p.pool[2]}" if p.pool is not None else None
    fin = _finish_kind(p)
    if fin in ("pack", "fp8"):
        what = ("re-quantize to int8 codes" if p.out_layout == "int8" else
                f"quantize to {p.out_fmt} codes" if fin == "fp8" else "re-quantize + pack")
        return [f"separate pass: {pool + ' + ' if pool else ''}{what} (one Triton kernel)"]
    steps = [f"separate pass: {pool} (torch, float32)"] if pool else []
    return steps + [f"separate pass: {requant if p.out_fmt is not None else 'cast to ' + out}"]


def _pool_float_words(p: ConvPlan, out: str) -> str:
    how = "one Triton kernel" if p.device.triton else "torch"
    return f"separate pass: max-pool 2x2 stride {p.pool[2]} on the {out} output ({how})"


# -- a linear's rows on the wgmma GEMM (kernels/cuda/i8_gemm.cu)


def _decide_gemm(p: ConvPlan) -> ConvPlan:
    """The ``wgmma-gemm`` route: one launch of i8_gemm on the (M, K) int8 rows and the (N, K) int8 weight, its fused
    epilogue writing fp16 (+ a residual) or the next layer's int8 codes (``wgmma_gemm_refusal`` has checked that it
    can)."""
    g = p.geometry
    kind = "int8" if p.out_fmt is not None else "float16"
    act = ", erf GELU" if p.act == GELU else ""
    res = ", + fp16 residual" if p.has_residual else ""
    steps = (f"CUDA i8_gemm.cu (warp-specialised ping-pong wgmma, sm_90a) on the ({g.N}, {g.C}) int8 rows x "
             f"({g.K}, {g.C}) int8 weight with fused epilogue (scale, bias{act}{res}) -> {_out_words(p)}",)
    return _replace(p, epilogue=kind, passes=steps)


# -- the bit-serial pipeline


def implicit_conv(g: ConvGeometry, kin: int, p: int = 2, q: int = 1, a_twos: bool = False,
                  w_twos: bool = False, sm_count: int = 132) -> bool:
    """Whether a bit-serial convolution over input planes with ``kin``-word rows runs as an implicit GEMM
    (``bmma_gemm`` with ``conv``: no im2col buffer), for p-bit activations and q-bit weights.  Never a 1x1
    stride-1 one (its planes are the operand as they are); only rows that hold whole 8-byte taps (``kin`` even, at
    least the tap's words) -- padded planes always do, compact ones when ceil(C / 32) is even.  Then where it
    measured faster (docs/decisions/0008): taps without padding words (ceil(C / 32) even), and where the GEMM runs
    the wgmma tile (``bmma_gemm.wgmma_tile``: when it gives the ``sm_count`` SMs a tile each) at most two column tiles
    of it; none on this format pair: no."""
    if g.is_pointwise:
        return False
    cwt = rq.conv_tap_words(g.C)
    if not rq.implicit_conv_fits(kin, cwt, g.H, g.W, *g.padding):
        return False
    from ..kernels.cuda.bmma_gemm import wgmma_tile

    t = wgmma_tile(p, q, a_twos, w_twos, N=g.K)
    if cwt != -(-g.C // 32) or t is None:
        return False
    col_tiles = -(-g.K // t.bn)
    return col_tiles <= 2 or -(-(g.N * g.P * g.Q) // t.bm) * col_tiles < sm_count  # (fewer: mma.sync tiles)


def _input_words(p: ConvPlan) -> int:
    """The words of a row of the bit planes the bit-serial pipeline reads: compact rows as given, else padded (a
    Dense or ShiftedInt8 QTensor's codes are packed with padded rows)."""
    C = p.geometry.C
    return -(-C // 32) if p.input_layout == "compact" else rq.packed_words(C)


def _bitserial_kind(p: ConvPlan):
    """(out_kind, relu, leaky slope, packed format) of the GEMM call: the kernel's epilogue applies
    the activation always, and writes the final dtype / packed planes unless a pooling pass follows."""
    if p.out_dtype == torch.int32 and p.out_fmt is None:
        return "int32", False, 0.0, None
    relu = p.act is not None
    slope = p.act[1] if isinstance(p.act, tuple) else 0.0
    if p.pool_float:  # the final dtype at full size, then one max-pool pass
        return _KIND[p.out_dtype], relu, slope, None
    if p.dual:  # "planes+float": the float output, and its planes written by the same epilogue (dual_out)
        return _KIND[p.out_dtype], relu, slope, p.out_fmt
    if (not p.fused and not p.pool_codes) or p.out_layout == "int8":  # int8: the one-pass quantizer follows
        return "float32", relu, slope, None
    if p.out_fmt is not None:
        return "packed", relu, slope, p.out_fmt
    return _KIND[p.out_dtype], relu, slope, None


def _decide_bitserial(p: ConvPlan) -> ConvPlan:
    g = p.geometry
    out = _out_words(p)
    Cw = -(-g.C // 32)
    cwt = rq.conv_tap_words(g.C)
    row_corr = rg.affine(p.w_fmt)[0] != 0  # pm1 weights: a row-sum correction
    twos_a, twos_w = p.a_fmt.encoding == "twos", p.w_fmt.encoding == "twos"
    if implicit_conv(g, _input_words(p), p.a_fmt.bits, p.w_fmt.bits, twos_a, twos_w, p.device.sm_count):
        route = "implicit"
        steps = [f"implicit GEMM: the kernel gathers {g.R * g.S} taps x {cwt} words a pixel from the packed planes "
                 f"({p.a_fmt.bits} planes; padded rows, or compact ones when ceil(C / 32) = {Cw} is even)"]
        if row_corr:
            steps.append("the pm1 weights' row correction from the gathered rows' sums on the tensor cores (in "
                         "the GEMM)")
    elif g.is_pointwise:
        route = "pointwise"
        steps = ["no im2col (1x1 stride 1: the input planes are the operand"
                 + ("; the pm1 weights' row correction from their row sums on the tensor cores, in the GEMM)"
                    if row_corr else ")")]
    else:
        route = "im2col"
        steps = [f"Triton im2col over packed planes ({g.R * g.S} taps x {Cw} words a pixel, "
                 f"{rq.taps_words(g)[2]} words a row, {p.a_fmt.bits} planes)"]
    kind, relu, slope, _ = _bitserial_kind(p)
    act = [f"LeakyReLU({slope})" if slope else "ReLU"] if relu else []
    fused = ["scale", "bias"] + act + ([out] if kind == "packed" or p.pool_float
                                       or (p.fused and p.out_layout != "int8") else ["float32"])
    steps.append(f"bmma_gemm with fused epilogue ({', '.join(fused if kind != 'int32' else ['int32'])})")
    after, finish = "", ""
    if p.dual or kind == "int32":
        pass
    elif kind == "packed" and p.pool is not None:  # max-pool on the codes (plan.pool_codes)
        after = "pool_planes"
        steps.append(f"separate pass: max-pool 2x2 stride {p.pool[2]} on the packed codes (one Triton kernel)")
    elif kind == "packed":
        pass
    elif p.pool_float:
        after = "pool_float"
        steps.append(_pool_float_words(p, out))
    elif not (p.fused and p.out_fmt is None):
        after, finish = "finish", _finish_kind(p)
        if not p.fused or p.out_layout == "int8":
            steps += _after_words(p, out, "re-quantize + pack")
    return _replace(p, route=route, epilogue=kind, after=after, finish=finish, passes=tuple(steps))


# -- the 8-bit kernels (INT8 / FP8 Triton implicit-GEMM convs; the CUDA thin stem)


# Thin layers (the C = 3 stems): the implicit GEMM's FLAT mode decodes (r, s, c) per element and ran them
# at 9-22 T op/s on the H200 (benchmarks/results/conv_fwd.json; the VGG stem took 12.9 of ~34 ms of the w1a2
# network at batch 256).  For C < THIN_C with a spatial filter the 8-bit codes are gathered once into
# (N, P, Q, Kp), Kp = R*S*C rounded up to 32 (zeros in the padding and the tail), and the same kernel runs
# it as a 1x1 convolution in TAP mode (contiguous reduction blocks, the fused epilogue unchanged).
# The sums are the same integers (exact); the cost is the gather pass and Kp / (R*S*C) more MMA work.
# Rounding to 32 instead of 64 bytes (H100, same process, graph replay at batch 256, outputs equal):
# YOLOv2-tiny (27 -> 32 instead of 64: 44M rows) int8 9.32 -> 8.48 ms, fp8 12.53 -> 11.69 ms; VGG -2%; others level.
THIN_C = 16
_STEM_KP = 32


def _thin_stem(g: ConvGeometry) -> bool:
    return g.C < THIN_C and g.R * g.S > 1


def _stem_kp(g: ConvGeometry) -> int:
    """A thin stem's gathered row length: R*S*C rounded up to a whole reduction block."""
    return -(-(g.R * g.S * g.C) // _STEM_KP) * _STEM_KP


def _int8_out(p: ConvPlan) -> bool:
    """Whether the INT8 / FP8 kernel's epilogue writes the next layer's ShiftedInt8 QTensor itself."""
    return p.out_layout == "int8" and p.pool is None


def _fp8_out(p: ConvPlan) -> bool:
    """Whether the INT8 / FP8 kernel's epilogue writes the next FP8 layer's float8 codes itself (no pool), alone."""
    return isinstance(p.out_fmt, FloatFormat) and p.pool is None and not p.dual


def _planes_out(p: ConvPlan) -> bool:
    """Whether the INT8 kernel's epilogue writes the next bit-serial layer's planes itself ((2x2 stride-2 max-pool
    ->) quantize -> pack, ``conv_fwd.PlanesOut``): an 8-bit stem in front of binary layers.  Other pools (and a
    pool behind an activation that is not monotone -- hardswish, SiLU, a negative LeakyReLU slope: the kernel pools
    accumulators, ``act_monotone``), and the FP8 kernel, write float32 for the one-pass quantizer."""
    return (p.backend == "int8" and p.route == "kernel" and isinstance(p.out_fmt, IntFormat)
            and p.out_layout in _PLANE_LAYOUTS
            and (p.pool is None or (tuple(p.pool) == ("max", 2, 2) and act_monotone(p.act))))


def _kernel_out(p: ConvPlan) -> str:
    """What the INT8 / FP8 kernel writes: the raw accumulator, the final float dtype, the next INT8 layer's
    int8 codes, the next FP8 layer's float8 codes ("e4m3" / "e5m2"), both ("dual": the float dtype and its
    int8 / float8 codes), the next bit-serial layer's planes ("planes"), or float32 for a pass that follows
    (pooling, re-quantization)."""
    if p.out_dtype == torch.int32 and p.out_fmt is None:
        return "int32"
    if _planes_out(p):
        return "planes"
    if _int8_out(p):
        return "int8"
    if _fp8_out(p):
        return _FP8_KIND[_fp8_dtype(p.out_fmt)]
    if p.out_layout == "planes+float":  # the float; its planes from stem_conv's epilogue or one pass over it
        return _KIND[p.out_dtype]
    if p.dual:  # no pool (_check_fusion)
        return "dual"
    return _KIND[p.out_dtype] if (p.fused or p.pool_float) and p.out_fmt is None else "float32"


def _stem_pad(p: ConvPlan) -> int | None:
    """The int8 code whose value is 0 (what a padded tap holds in stem_conv), or None when no code is or the sum
    needs a multiplier (stem_conv adds a per-channel correction only: codes of unit step, weights unshifted)."""
    oa, sa = _int8_affine(p.a_fmt)
    if (oa and sa != 1) or _int8_affine(p.w_fmt) != (0, 1):
        return None
    return -oa if -128 <= -oa <= 127 else None


def _stem_act(act) -> bool:
    """Whether stem_conv.cu's epilogue applies ``act``: None, ReLU, LeakyReLU of slope >= 0 (``stem_conv._act``); the
    others (clamp, hardswish, SiLU, a negative slope) keep the Triton route, whose epilogue has them."""
    return act is None or act == "relu" or (isinstance(act, tuple) and act[0] == "leaky" and act[1] >= 0)


def _stem_out(p: ConvPlan) -> str | None:
    """What stem_conv.cu would write for this INT8 conv: "planes" (pooled or not, <= 3 bits), "dual" (a 16-bit float
    output and its <= 3-bit planes, ``out_layout="planes+float"``), "float" (a 16-bit float alone), or None (another
    output, or an activation it lacks: the Triton route)."""
    from ..kernels.cuda import stem_conv as sc

    fmt = p.out_fmt
    codes_ok = isinstance(fmt, IntFormat) and fmt.bits <= 3 and fmt.encoding in sc.ENCODINGS
    if not _stem_act(p.act):
        return None
    if _planes_out(p):
        return "planes" if codes_ok else None
    if p.has_residual or p.pool is not None or p.out_dtype not in sc.FLOAT_OUTS:
        return None
    if p.out_layout == "planes+float":
        return "dual" if codes_ok else None
    return "float" if fmt is None else None


def stem_variant(p: ConvPlan, out: str):
    """The stem_conv.cu variant that writes ``out`` (``_stem_out``) for this plan."""
    from ..kernels.cuda import stem_conv as sc

    if out == "float":
        return sc.StemVariant(pool=1, fout=p.out_dtype, planes=False)
    fout = p.out_dtype if out == "dual" else None
    return sc.StemVariant(p.out_fmt.bits, p.out_fmt.encoding, 2 if p.pool else 1, fout)


def _stem_cuda(p: ConvPlan) -> bool:
    """Whether this INT8 conv runs kernels/cuda/stem_conv.cu (docs/decisions/0004): a thin stem (C <= 4 channels, a
    spatial filter) that writes what the kernel writes (``_stem_out``), on an sm_90 GPU that runs the CUDA kernels,
    with a code for value 0 and a patch that fits."""
    from ..kernels.cuda import stem_conv as sc

    g, caps = p.geometry, p.device
    out = _stem_out(p) if p.backend == "int8" and p.route == "kernel" else None
    if not (out and caps.cuda and _thin_stem(g) and g.C <= sc.MAX_C and _stem_pad(p) is not None):
        return False
    if not caps.cuda_kernels or caps.capability < (9, 0):
        return False
    PO, QO = (g.P // 2, g.Q // 2) if p.pool else (g.P, g.Q)
    try:
        sc.pick_tile(stem_variant(p, out), PO, QO, g.R, g.S, g.stride, g.dilation, g.N,
                     words=min(-(-g.K // 32), sc.MAX_WORDS), c=g.C)
    except ValueError:  # the input patch of one row of outputs does not fit in shared memory
        return False
    return True


def _decide_kernel(p: ConvPlan) -> ConvPlan:
    g = p.geometry
    out = _out_words(p)
    res = ", residual" if p.has_residual else ""
    kind = _kernel_out(p)
    shown = out if kind == "dual" or kind in _FP8_KIND.values() else kind  # what the epilogue writes
    if kind == "planes":
        shown = (f"{'max-pool 2x2 stride 2 + ' if p.pool else ''}quantize + pack -> {p.out_fmt} "
                 f"{'compact ' if p.out_layout == 'compact' else ''}bit planes (no float output)")
    gather = "one Triton pass" if p.device.triton else "torch passes"
    stem = "gather" if _thin_stem(g) else ""
    stem_steps = ([f"thin layer (C = {g.C} < {THIN_C}): its {g.R}x{g.S}x{g.C} windows gathered into "
                   f"{_stem_kp(g)}-byte rows ({gather}), run as a 1x1 conv"] if stem else [])
    if p.backend == "fp8":
        acc = "fast_accum" if p.fast_accum else "fp32 promotion every BLOCK_K"
        steps = stem_steps + [f"Triton implicit-GEMM FP8 conv conv2d_fwd_fp8 ({acc}) "
                              f"with fused epilogue (scale, bias{res}, act={p.act}) -> {shown}"]
    else:
        oa = _int8_affine(p.a_fmt)[0]
        how = "as given: ShiftedInt8 QTensor" if p.input_layout == "int8" else "torch pass"
        shift = ([f"x stored as code - 128 ({how}), exact correction for the taps inside the image "
                  f"({'(P, Q, K) table' if max(g.padding) > 0 else '(K,) vector'}, cached)"] if oa else [])
        if _stem_cuda(p):
            stem = "cuda"
            shift = ([f"x stored as code - 128 ({how}), padded taps hold code {_stem_pad(p)} (value 0): exact (K,) "
                      "correction, cached"] if oa else [])
            stem_steps = [f"CUDA stem_conv.cu (C = {g.C}): each block copies its input patch to shared memory once, "
                          f"{g.R}x{g.S} taps x one {g.C}-byte pixel word on mma.m16n8k32.s8, no gather pass"]
        cuda_stem = stem == "cuda"
        steps = shift + stem_steps + [
            f"{'CUDA direct' if cuda_stem else 'Triton implicit-GEMM'} INT8 conv "
            f"{'stem_conv' if cuda_stem else 'conv2d_fwd_int8'} with fused epilogue (scale, bias{res}, act={p.act}) -> "
            f"{shown}" if kind != "int32" else "Triton implicit-GEMM INT8 conv conv2d_fwd_int8 -> int32"]
    after, finish = "", ""
    if p.out_layout == "planes+float":  # stem_conv's (float, planes), or the float for one pack pass
        if stem == "cuda":
            steps[-1] += f" + the {p.out_fmt} compact bit planes of it (same epilogue)"
        else:
            after = "pack_float"
            steps.append(f"separate pass: quantize + pack the stored float -> {p.out_fmt} compact bit planes")
    elif kind in ("planes", "int8", "dual", "int32") or _fp8_out(p):
        pass
    elif p.pool_float:
        after = "pool_float"
        steps.append(_pool_float_words(p, out))
    elif not (kind != "float32" or (p.fused and p.out_fmt is None)):
        after, finish = "finish", _finish_kind(p)
        steps += _after_words(p, out, "re-quantize")
    return _replace(p, stem=stem, epilogue=kind, after=after, finish=finish, passes=tuple(steps))
