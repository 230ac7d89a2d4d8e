"""Quantized inference modules: ``QConv2d`` and ``QLinear``.

Each holds its weight already quantized (and, for the bit-serial backend, already packed into bit
planes: ``ops.qconv.pack_conv_weight``), a calibrated per-tensor activation scale, and the float
epilogue folded from the layers it absorbed (batch-norm -> per-channel scale and bias, ReLU /
LeakyReLU -- and, but on the bit-serial GEMM, ReLU6 / hardtanh, hardswish, SiLU -- 2x2 pooling).  Float tensors in,
float tensors out (NCHW, channels_last memory), so a module drops into any network; when ``quantize_model`` finds
that a conv feeds only another quantized conv, it sets ``out_fmt`` / ``out_scale`` and the pair exchanges packed
activations (a ``QTensor`` in the ``BitPlanes`` layout) instead, never materialising a float tensor between them.

A ``QConv2d`` fused with a residual block's add (``has_residual``, set by ``quantize_model``) is called as
``m(x, residual)`` and computes ``act(conv_bn(x) + residual)`` in its epilogue; a conv whose output is both
a residual and the input of INT8 convs returns a ``ShiftedInt8`` QTensor carrying the float too (``hp``), of FP8
convs the e4m3 QTensor with ``hp``, of bit-serial convs the ``BitPlanes`` QTensor with ``hp``: its consumers take the
codes as ``x`` and the float as ``residual``.

Precision of a layer: weights and activations are integer formats of 1..8 bits (``binary`` = pm1
weights for 1 bit, two's complement ``intN`` otherwise; activations ``uintN`` when calibration saw no
negative input, ``intN`` otherwise), or ``e4m3`` for both (the FP8 path).

Persistence: a module's state is its registered buffers -- the weight's codes (``weight_codes``, KRSC, as
``tcprec.encode`` gives them) and per-output-channel scales (``weight_scale``), the activation scale, the folded
epilogue -- plus an extra state (``get_extra_state``) naming the precision, formats and geometry.  The packed forms
the kernels read (bit planes, int8 / float8 views: ``ops.qconv.PackedConvWeight``) are derived from the codes on
first use and never saved, so ``state_dict`` / ``load_state_dict`` round-trip exactly, ``torch.save`` of the whole
model stores one tensor per weight, and loading a state of another precision, format or geometry is refused.
The scales stay float32 under ``.half()`` / ``.bfloat16()`` (which set the output dtype); ``.double()`` is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch import nn

from ..formats import FloatFormat, IntFormat, as_format
from ..kernels.conv_geometry import ConvGeometry
from ..ops import qconv as qc
from ..ops.qconv_plan import (GELU, WGMMA_GEMM, ConvPlan, DeviceCaps, device_caps, layer_act_unsupported, layer_backend,
                              plan_conv2d)
from ..ops.quantize import absmax_qmax, quantize, quantize_pack, quantize_static
from ..qtensor import BitPlanes, PerChannel, QTensor, ShiftedInt8

__all__ = ["LayerPrecision", "parse_precision", "QConv2d", "QLinear", "QMaxPool2d", "QLayerNorm", "flatten_nhwc",
           "weight_format", "activation_format", "FixedQuant", "LayerPlan", "act_text"]

from ..precision import LayerPrecision, parse_layer_precision  # noqa: E402  (re-exported)


def parse_precision(text) -> LayerPrecision | None:
    """``"w1a2"`` / ``"w4a4"`` / ``"int4"`` (= w4a4) / ``"int8"`` / ``"fp8"`` (= ``"e4m3"``) -> LayerPrecision;
    ``"float"`` / None -> None.  The vocabulary is ``tcprec.precision``'s, shared with the CLI."""
    return parse_layer_precision(text)


def weight_format(p: LayerPrecision):
    if p.fp8:
        return as_format("e4m3")
    return as_format("binary") if p.w_bits == 1 else as_format(f"int{p.w_bits}")


def activation_format(p: LayerPrecision, signed: bool):
    if p.fp8:
        return as_format("e4m3")
    return as_format(f"int{p.a_bits}" if signed else f"uint{p.a_bits}")


@dataclass(frozen=True)
class FixedQuant:
    """A layer's quantization decided elsewhere (``tcprec.convert_qat``: the scales QAT learned), used by
    ``from_float`` as given -- no calibration, no weight rounding, no BatchNorm folding.

    in_scale      one-element float32 tensor: the input's per-tensor scale
    signed_input  False: ``uintN`` input codes (after a ReLU), True: ``intN``
    weight        QTensor of the weight codes, ``(K, R, S, C)`` for a conv, ``(N, 1, 1, K)`` for a linear, with
                  ``PerChannel(0)`` scales; its format is the layer's weight format (``binary``, ``pmN``, ``intN``)
    scale, bias   the epilogue's per-channel float32 scale (a folded BatchNorm; None: none) and bias (None: none)
    """

    in_scale: torch.Tensor
    signed_input: bool
    weight: "object"  # QTensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def check(self, prec: LayerPrecision, what: str) -> None:
        fw = self.weight.fmt
        if prec.fp8 or not isinstance(fw, IntFormat) or fw.bits != prec.w_bits:
            raise ValueError(f"{what}: fixed weight format {fw} does not match precision {prec}")
        s = self.in_scale
        if not (isinstance(s, torch.Tensor) and s.numel() == 1 and s.dtype == torch.float32):
            raise TypeError(f"{what}: fixed in_scale must be a one-element float32 tensor, got {s!r}")


# Rows (output channels) quantized or packed at a time: quantize / encode / bit-plane packing hold ~140 bytes an
# element at their peak (float64 and int64 temporaries), so ~1M elements a chunk keep that ~150 MB whatever the
# layer's size, instead of ~40x the weight (AlexNet's fc6, 205 MB of fp32: 7.7 GB; issue 40).  Every step is per
# output channel, so the chunked result is the same bits.
_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(rows: int, per_row: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _quantize_weight(w: torch.Tensor, fmt):
    """Per-output-channel scales along axis 0: absmax for multi-bit codes; mean |w| for binary (the
    L2-optimal scale of sign(w), XNOR-Net) -- absmax would map every weight to +-max|w|.  In chunks of rows."""
    w = w.detach()
    codes = scales = None
    for r0, r1 in _row_chunks(w.shape[0], w[0].numel()):
        wc = w[r0:r1].float()
        if isinstance(fmt, IntFormat) and fmt.encoding == "pm1":
            s = wc.abs().flatten(1).mean(1).clamp_min(torch.finfo(torch.float32).tiny)
            q = quantize(wc, fmt, PerChannel(0), scale=s.view(-1, *([1] * (w.dim() - 1))))
        else:
            q = quantize(wc, fmt, PerChannel(0))
        if codes is None:  # the result allocated once: chunks' temporaries reuse one another's memory
            codes = torch.empty(w.shape, dtype=q.codes.dtype, device=w.device)
            scales = torch.empty((w.shape[0], *q.scale.shape[1:]), dtype=q.scale.dtype, device=w.device)
        codes[r0:r1] = q.codes
        scales[r0:r1] = q.scale
        del wc, q
    return QTensor(codes, scales, fmt, PerChannel(0), tuple(w.shape), torch.float32)


def _fold_bn(out_ch: int, bias: torch.Tensor | None, bn: nn.BatchNorm2d | None, device):
    """Per-channel (scale, bias) of bn(conv + bias) = conv * scale + bias'."""
    b = torch.zeros(out_ch, device=device) if bias is None else bias.detach().float()
    if bn is None:
        return None, (None if bias is None else b)
    inv = (bn.running_var.float() + bn.eps).rsqrt()
    g = bn.weight.detach().float() if bn.weight is not None else torch.ones_like(inv)
    beta = bn.bias.detach().float() if bn.bias is not None else torch.zeros_like(inv)
    scale = g * inv
    return scale, (b - bn.running_mean.float()) * scale + beta


def _prepare(qw):
    """Pack the weight once (bit planes in the im2col word layout; the int8 path reads its codes), in chunks of
    output channels (every packed field is per channel: the same bits as one call)."""
    chunks = _row_chunks(qw.shape[0], qw.codes[0].numel())
    if len(chunks) == 1:
        return qc.pack_conv_weight(qw)
    dims = {"planes": 1, "conv_planes": 1, "w_scale": 0, "rowsum": 0, "w8": 0}  # the K axis of each field
    out: dict = {}
    shared = True  # conv_planes is planes (each tap already an even number of words)
    for r0, r1 in chunks:
        part = qc.pack_conv_weight(QTensor(qw.codes[r0:r1], qw.scale[r0:r1], qw.fmt, PerChannel(0),
                                           (r1 - r0, *qw.shape[1:]), qw.dtype))
        shared = shared and part.conv_planes is part.planes
        for name, d in dims.items():
            t = getattr(part, name)
            if t is None or (name == "conv_planes" and shared):
                continue
            if name not in out:  # each field allocated once (see _quantize_weight)
                shape = list(t.shape)
                shape[d] = qw.shape[0]
                out[name] = torch.empty(shape, dtype=t.dtype, device=t.device)
            out[name].narrow(d, r0, r1 - r0).copy_(t)
        w_off, w_step = part.w_off, part.w_step
        del part
    f8 = qc._fp8_dtype(qw.fmt)  # float8 codes: a view of the codes, as pack_conv_weight makes it
    w8 = qw.codes.contiguous().view(f8) if f8 is not None else out.get("w8")  # (K, R, S, C)
    planes = out.get("planes")  # (q, K, Kw_col) int32
    return qc.PackedConvWeight(qw, planes, out["w_scale"], out.get("rowsum"), w8, w_off, w_step,
                               conv_planes=planes if shared else out.get("conv_planes"))


def _quantize_input(x_nhwc: torch.Tensor, m: "_QBase", compact: bool = False):
    """Float NHWC -> the op's activation operand with the calibrated scale, sync-free (capturable):
    bit planes in one fused kernel for the bit-serial backend (``compact``: rows without their padding
    words, for a convolution that reads its input through an im2col), e4m3 codes for FP8, the INT8 conv's
    int8 operand (a ``ShiftedInt8`` QTensor, one fused kernel on CUDA) for the int8 backend, uint8 codes otherwise."""
    op = _input_operand(m, x_nhwc.device)
    if op == "fp8":
        return qc.quantize_fp8_static(x_nhwc, m.in_scale)  # QTensor of e4m3 codes (N, H, W, C)
    if op == "planes":
        N, H, W, C = x_nhwc.shape
        planes = quantize_pack(x_nhwc.reshape(N * H * W, C), m.a_fmt, m.in_scale, compact=compact)  # (bits, NHW, Kw)
        return qc.planes_qtensor(planes, m.a_fmt, m.in_scale, (N, H, W, C))
    if op == "int8":
        return qc.quantize_int8_static(x_nhwc, m.a_fmt, m.in_scale)  # (N, H, W, C) int8 operand
    return quantize_static(x_nhwc, m.a_fmt, m.in_scale)  # QTensor (N, H, W, C) codes


def _input_operand(m, device: torch.device) -> str | None:
    """The operand a quantized layer ``m`` (or a ``QMaxPool2d`` standing for its readers) takes on ``device``: "fp8"
    (e4m3 codes), "planes" (bit planes: the bit-serial backend), "int8" (the INT8 kernel's codes), or None (uint8
    codes from torch ops: the reference backend)."""
    if m.precision.fp8:
        return "fp8"
    name, _ = layer_backend(m.a_fmt, m.w_fmt, device_caps(device), m.backend)
    return {"bitserial": "planes", "int8": "int8"}.get(name)


@dataclass(frozen=True)
class LayerPlan:
    """What ``quantize_model`` decided for one layer on one device: the backend its convolution runs (and why:
    ``ops.qconv_plan.layer_backend``) and, when a chained producer hands it codes instead of a float tensor, that
    operand's layout (``OUT_LAYOUTS``) and the kind of layer the chain was made for.  A device move re-plans it
    (``_QBase._apply``) and refuses a move after which the chain's consumer would run another kernel kind."""

    name: str
    device: torch.device
    backend: str
    reason: str
    chain_in: str | None = None  # the producer's out_layout, when this layer reads a chained operand
    chain_kind: str | None = None  # "bitserial" | "int8" | "fp8": the kind the chain was made for


def _kind(m: "_QBase", backend: str) -> str:
    """The layer kind the chaining rules use: the backend, or "fp8" for an FP8 layer on any device (its operand is
    float8 codes on the FP8 kernel and on the reference alike)."""
    return "fp8" if m.precision.fp8 else backend


def check_extra_state(module: nn.Module, state, what: str, fix: str) -> None:
    """``module.set_extra_state``'s check, shared by the quantized layer types: ``state`` must be a version-1 tcprec
    state equal to ``module.get_extra_state()`` on every key of ``module._STATE_KEYS``; else a ValueError naming each
    differing key with both values, and ``fix``."""
    name = type(module).__name__
    if not isinstance(state, dict) or state.get("version") != 1:
        raise ValueError(f"{name}: the state_dict's extra state is {state!r:.80}, not a tcprec quantized layer's "
                         "(version 1); save it with state_dict() of a tcprec.quantize_model model")
    mine = module.get_extra_state()
    bad = [k for k in module._STATE_KEYS if _norm(state.get(k)) != _norm(mine[k])]
    if bad:
        diff = ", ".join(f"{k}: saved {state.get(k)!r}, this module {mine[k]!r}" for k in bad)
        raise ValueError(f"cannot load {what} state into a different one ({diff}); {fix}")


def _check_before_load(module: nn.Module, state_dict, prefix: str) -> None:
    """Check the extra state before any buffer is overwritten: a refused load leaves the module as it was."""
    key = prefix + "_extra_state"
    if key in state_dict:
        module.set_extra_state(state_dict[key])


class _QBase(nn.Module):
    tcprec_leaf = True  # profiling: one layer, however many kernels it launches
    layer_plan: LayerPlan | None = None  # set by quantize_model (plan_on); None for a module built by hand

    # FP8 layers on the GPU: True (the default) keeps Hopper's narrow fp8 MMA accumulator over the whole reduction;
    # False promotes it into fp32 every BLOCK_K products (QuantConfig(fp8_accum="fp32"); docs/decisions/0040).
    fp8_fast_accum = True

    def _init_common(self, prec: LayerPrecision, in_absmax: float, signed_input: bool, out_dtype, backend: str,
                     device, fixed: FixedQuant | None = None):
        self.precision = prec
        if fixed is not None:
            fixed.check(prec, type(self).__name__)
            signed_input = fixed.signed_input
        self.a_fmt = activation_format(prec, signed_input)
        self.w_fmt = weight_format(prec) if fixed is None else fixed.weight.fmt
        qmax = absmax_qmax(self.a_fmt)
        s = max(float(in_absmax), 1e-8) / qmax
        s = torch.tensor([s], dtype=torch.float32, device=device) if fixed is None else \
            fixed.in_scale.detach().reshape(1).to(device).clone()
        self.register_buffer("in_scale", s)  # with the weights
        self.out_dtype = out_dtype
        self.backend = backend
        self.out_fmt = None  # set by quantize_model when the output feeds another quantized conv
        self.out_layout = "planes"  # ... as bit planes (a bit-serial consumer), int8 codes (INT8 ones), or both
        self.register_buffer("out_scale", None)
        self.has_residual = False  # set by quantize_model: forward(x, residual) adds it before the activation

    # -- the weight: codes and scales are the state; the packed forms are derived ------------------------
    @property
    def weight(self) -> qc.PackedConvWeight:
        """The packed weight the kernels read, built from ``weight_codes`` / ``weight_scale`` on first use and
        rebuilt whenever those buffers change (a load, a move: the key is their storage and version)."""
        codes, scale = self.weight_codes, self.weight_scale
        key = (codes.data_ptr(), codes._version, codes.device, scale.data_ptr(), scale._version)
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            qw = QTensor(codes, scale, self.w_fmt, PerChannel(0), tuple(codes.shape), torch.float32)
            cached = (key, _prepare(qw))
            self.__dict__["_packed"] = cached
        return cached[1]

    def _op_weight(self, device: torch.device):
        """The weight as this forward hands it to ``ops.qconv.conv2d`` on ``device``: the packed form (``weight``, built
        once and kept) where a kernel reads its bit planes or int8 / float8 views; on the float64 reference (off
        CUDA) the codes' QTensor, all that backend reads -- so a model run on the CPU never builds and keeps the
        packed forms (for int8 weights the planes and the int8 view are each as large as the codes: two more copies
        of the weights, docs/decisions/0158).  The same codes and scales either way, so the same results.  The
        backend is the one ``plan_on`` decided for ``device`` (``layer_plan``), decided here only without a plan."""
        plan = self.layer_plan
        backend = plan.backend if plan is not None and plan.device == device else \
            layer_backend(self.a_fmt, self.w_fmt, device_caps(device), self.backend)[0]
        if backend != "reference":
            return self.weight
        codes = self.weight_codes
        return QTensor(codes, self.weight_scale, self.w_fmt, PerChannel(0), tuple(codes.shape), torch.float32)

    @weight.setter
    def weight(self, qw: QTensor) -> None:
        if not isinstance(qw, QTensor) or qw.fmt != self.w_fmt or not isinstance(qw.granularity, PerChannel):
            raise TypeError(f"weight must be a per-channel QTensor of {self.w_fmt}, got {qw!r:.80}")
        self.register_buffer("weight_codes", qw.codes.contiguous())  # (K, R, S, C) codes
        self.register_buffer("weight_scale", qw.scale.to(torch.float32).contiguous())  # (K, 1, 1, 1)
        self.__dict__.pop("_packed", None)

    def __getstate__(self):  # pickling (torch.save, deepcopy): the buffers only, never the derived packed views
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    _STATE_KEYS = ("kind", "precision", "w_fmt", "a_fmt", "geometry", "act", "pool", "has_residual", "out_fmt",
                   "out_layout", "in_channels_last")

    def get_extra_state(self) -> dict:
        """What the buffers mean: saved with them, checked by ``set_extra_state`` on load."""
        geometry = ((self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding, self.dilation)
                    if isinstance(self, QConv2d) else (self.in_features, self.out_features))
        return {"version": 1, "kind": type(self).__name__, "precision": str(self.precision), "w_fmt": str(self.w_fmt),
                "a_fmt": str(self.a_fmt), "geometry": tuple(geometry), "act": self.act,
                "pool": getattr(self, "pool", None), "has_residual": bool(self.has_residual),
                "out_fmt": None if self.out_fmt is None else str(self.out_fmt), "out_layout": self.out_layout,
                "in_channels_last": getattr(self, "in_channels_last", None)}

    def set_extra_state(self, state) -> None:
        """Refuse a state saved from a layer of another kind, precision, format, geometry or fusion: its codes
        would load into buffers of the same shape and silently mean other numbers."""
        check_extra_state(self, state, "a quantized layer's", "build the target with the same quantize_model config, "
                          "calibration sign and device kind (chaining), or torch.save / torch.load the whole model")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _check_before_load(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def plan_on(self, device, name: str | None = None, caps=None) -> LayerPlan:
        """Decide this layer's backend on ``device`` once and keep it (``layer_plan``); ``quantize_model`` calls it at
        conversion, a device move calls it again (``_apply``).  ``caps``: the device's ``DeviceCaps`` (default: its
        own, ``ops.qconv_plan.device_caps``)."""
        old = self.layer_plan
        caps = caps if caps is not None else device_caps(torch.device(device))
        backend, why = layer_backend(self.a_fmt, self.w_fmt, caps, self.backend)
        name = name if name is not None else (old.name if old is not None else type(self).__name__)
        plan = LayerPlan(name, caps.device, backend, why, old.chain_in if old else None,
                         old.chain_kind if old else None)
        self._check_chain(plan)
        self.layer_plan = plan
        return plan

    def chained_from(self, layout: str, kind: str) -> None:
        """Record that a chained producer hands this layer its input as ``layout`` (``OUT_LAYOUTS``), chosen for
        this layer running as ``kind`` (set by ``quantize_model``)."""
        if self.layer_plan is None:
            raise ValueError(f"{type(self).__name__}.chained_from needs the layer's plan first (plan_on(device))")
        self.layer_plan = replace(self.layer_plan, chain_in=layout, chain_kind=kind)

    def _check_chain(self, plan: LayerPlan) -> None:
        """A chained input was laid out for the kernel kind this layer ran at conversion; the float64 reference
        reads every layout (the same codes), another kernel kind would not read it as it is: refuse."""
        if plan.chain_in is None or _kind(self, plan.backend) in (plan.chain_kind, "reference"):
            return
        old = self.layer_plan.device if self.layer_plan is not None else "the conversion device"
        raise ValueError(
            f"{plan.name}: quantize_model chained this layer's input as {plan.chain_in!r} codes for the "
            f"{plan.chain_kind} backend on {old}; on {plan.device} the layer runs {plan.backend} ({plan.reason}), "
            f"which does not read that layout, so the chaining cannot be honoured.  Convert on the device the model "
            f"runs on (quantize_model(model.to('{plan.device}'), ...)), or with QuantConfig(chain=False) for a model "
            f"that moves between device kinds")

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` / ``.cuda()`` move every buffer; a float cast (``.half()``, ``.bfloat16()``, ``.float()``,
        ``.to(dtype)``) sets the output dtype and keeps the scales and the epilogue in float32 (rounding them to
        16 bits would change every result); ``.double()`` is refused.  A move re-plans the layer on the new device
        (``plan_on``) before any buffer moves, and refuses a move that would break a chain (``_check_chain``)."""
        lo, hi = fn(torch.empty(0, dtype=torch.float16)), fn(torch.empty(0, dtype=torch.float64))
        cast = lo.dtype if lo.dtype == hi.dtype else None  # a cast sends both probes to one dtype
        if cast is not None and cast not in _OUT_DTYPES:
            raise ValueError(f"{type(self).__name__} outputs one of {sorted(map(_short, _OUT_DTYPES))}, not {cast}: "
                             "keep the quantized model in float32 (or .half() / .bfloat16()) and cast its output, "
                             "e.g. model(x).double()")
        if self.layer_plan is not None:
            dev = fn(self.in_scale).device  # (a probe does not move for fns that keep the device: memory_format)
            if dev != self.layer_plan.device:
                self.plan_on(dev)
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if buf.is_floating_point() and moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)  # scales stay float32, on fn's device
            self._buffers[name] = moved
        if cast is not None:
            self.out_dtype = cast
        self.__dict__.pop("_packed", None)
        return self

    def chain_to(self, nxt: "QConv2d", layout: str = "planes") -> None:
        """Emit ``nxt``'s input directly: bit planes for a bit-serial ``nxt`` (the fused re-quantize + pack
        epilogue), int8 codes (``ShiftedInt8``) for an INT8 one, e4m3 codes (a QTensor) for an FP8 one;
        ``"int8+float"`` / ``"fp8+float"`` / ``"planes+float"``: the codes with the float output attached
        (the QTensor's ``hp``), for an output that is also a residual
        block's shortcut; ``"compact"``: planes without padding words, for a consumer that gathers windows."""
        if layout not in qc.OUT_LAYOUTS:
            raise ValueError(f"layout must be one of {qc.OUT_LAYOUTS}, got {layout!r}")
        self.out_fmt = nxt.a_fmt
        self.out_scale = nxt.in_scale
        self.out_layout = layout

    def tcprec_trace(self) -> list[str]:
        """The steps inside this layer, for ``tcprec.profile``'s dtype trace."""
        if self.out_fmt is None:
            out = _short(self.out_dtype)
        else:
            out = (f"{_short(self.out_dtype)} + {self.out_fmt} codes" if self.out_layout == "fp8+float" else
                   f"{self.out_fmt} codes" if isinstance(self.out_fmt, FloatFormat) else
                   f"{self.out_fmt} int8 codes" if self.out_layout == "int8" else
                   f"{_short(self.out_dtype)} + {self.out_fmt} int8 codes" if self.out_layout == "int8+float" else
                   f"{_short(self.out_dtype)} + {self.out_fmt} planes" if self.out_layout == "planes+float" else
                   f"{self.out_fmt} planes")
        acc = "fp32" if self.precision.fp8 else "int32"
        epi = "+".join(x for x in ("scale/bias", getattr(self, "has_residual", False) and "residual", self._act_name(),
                                   getattr(self, "pool", None) and "pool") if x)
        return [f"{self.a_fmt} x {self.w_fmt} weights", acc, epi, out]

    def _act_name(self) -> str | None:
        return act_text(getattr(self, "act", None))


def act_text(act) -> str | None:
    """A fused activation (``ops.qconv``'s canonical forms) as the summary and the trace name it: "relu", "leaky(0.1)",
    "clamp(0,6)" (ReLU6), "hardswish", "silu"; None for None."""
    if act is None or isinstance(act, str):
        return act
    return f"{act[0]}({','.join(f'{v:g}' for v in act[1:])})"


_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _norm(v):
    """Lists and tuples alike (a state that went through a serializer may turn one into the other)."""
    return tuple(_norm(x) for x in v) if isinstance(v, (list, tuple)) else v


def _short(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, str(dt))


class QConv2d(_QBase):
    """A conv (+ folded BN, activation, pooling) at integer or FP8 precision, NHWC inside.

    Build with ``QConv2d.from_float(conv, precision, in_absmax=..., signed_input=..., bn=, act=, pool=)``
    or through ``tcprec.quantize_model``.  ``act``: None, "relu", ("leaky", slope); and ("clamp", lo, hi) (ReLU6:
    ("clamp", 0.0, 6.0)), "hardswish", "silu" unless the layer runs the bit-serial GEMM where the binary kernel runs
    (``ops.qconv_plan.layer_act_unsupported``: its epilogue has none of them).
    """

    @classmethod
    def from_float(cls, conv: nn.Conv2d, precision, *, in_absmax: float, signed_input: bool, bn=None,
                   act=None, pool=None, backend: str = "auto", out_dtype=None,
                   fixed: FixedQuant | None = None) -> "QConv2d":
        m = cls()
        prec = parse_precision(precision)
        if prec is None:
            raise ValueError("QConv2d needs a quantized precision ('w1a2', 'int8', 'fp8', ...), got 'float'")
        if conv.groups != 1:
            raise ValueError(f"QConv2d supports groups=1 only, got groups={conv.groups} (keep this layer in float)")
        if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            raise ValueError(f"QConv2d needs numeric zero padding, got padding={conv.padding!r} "
                             f"padding_mode={conv.padding_mode!r}")
        act = qc._check_act(act)  # (the canonical form; a bad one raises, naming the allowed ones)
        if act == GELU:
            raise ValueError(f"act must be None, 'relu', ('leaky', slope), ('clamp', lo, hi) (ReLU6: ('clamp', 0.0, "
                             f"6.0)), 'hardswish' or 'silu' for a QConv2d (the erf GELU is fused by a QLinear on the "
                             f"{WGMMA_GEMM} route only), got act={act!r}; apply F.gelu to the conv's output")
        m._init_common(prec, in_absmax, signed_input, out_dtype or conv.weight.dtype, backend, conv.weight.device,
                       fixed)
        why = layer_act_unsupported(act, m.a_fmt, m.w_fmt, backend)
        if why:
            raise ValueError(f"QConv2d {prec}: {why}")
        m.stride, m.padding, m.dilation = tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation)
        m.in_channels, m.out_channels, m.kernel_size = conv.in_channels, conv.out_channels, tuple(conv.kernel_size)
        m.act, m.pool = act, pool
        w = conv.weight.detach().permute(0, 2, 3, 1).contiguous()  # (K, R, S, C): NHWC filters
        if fixed is not None:
            if fixed.weight.shape != tuple(w.shape):
                raise ValueError(f"fixed weight codes have shape {fixed.weight.shape}, the conv's KRSC is {tuple(w.shape)}")
            m.weight = fixed.weight  # buffers weight_codes (K, R, S, C), weight_scale (K, 1, 1, 1)
            scale, bias = fixed.scale, fixed.bias
        else:
            m.weight = _quantize_weight(w, m.w_fmt)  # buffers weight_codes (K, R, S, C), weight_scale (K, 1, 1, 1)
            scale, bias = _fold_bn(conv.out_channels, conv.bias, bn, w.device)
        m.register_buffer("ch_scale", scale)
        m.register_buffer("ch_bias", bias)
        return m

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, {self.precision} ({self.w_fmt} x {self.a_fmt}), act={self.act}, "
                f"pool={self.pool}, out={'packed ' + str(self.out_fmt) if self.out_fmt is not None else _short(self.out_dtype)}"
                + (", residual" if self.has_residual else ""))

    def forward(self, x, residual=None):
        """``x``: float NCHW, or the operand a chained producer emitted (packed planes, int8 codes);
        ``residual`` (a layer fused with its block's add, ``has_residual``): float NCHW of the output's
        shape, or the producer's QTensor carrying the float (``hp``)."""
        if self.has_residual != (residual is not None):
            raise ValueError(f"this QConv2d {'was' if self.has_residual else 'was not'} fused with a residual add "
                             f"(has_residual={self.has_residual}): call it as "
                             f"{'m(x, residual)' if self.has_residual else 'm(x)'}")
        if isinstance(x, torch.Tensor):
            if x.dim() != 4 or x.shape[1] != self.in_channels:
                raise ValueError(f"QConv2d expects (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
            xn = x.permute(0, 2, 3, 1)  # NHWC (a view for channels_last input)
            x = _quantize_input(xn, self, compact=self.reads_compact)
        elif self.layer_plan is not None and x.device != self.layer_plan.device:
            self.plan_on(x.device)  # a chained operand on another device (e.g. a load with map_location): re-plan
        res = None if residual is None else self._residual_nhwc(residual, x.shape)
        y = qc.conv2d(x, self._op_weight(x.device), stride=self.stride, padding=self.padding,
                      dilation=self.dilation, scale=self.ch_scale, bias=self.ch_bias, act=self.act, pool=self.pool,
                      out_dtype=self.out_dtype, out_fmt=self.out_fmt, out_scale=self.out_scale,
                      out_layout=self.out_layout, backend=self.backend, residual=res,
                      fp8_fast_accum=self.fp8_fast_accum)
        if not isinstance(y, torch.Tensor):
            return y
        y = y.permute(0, 3, 1, 2)  # NCHW view, channels_last memory
        return y.contiguous() if self.contiguous_out else y

    contiguous_out = False  # quantize_model sets it where it cannot see the readers (an untraced model)

    @property
    def reads_compact(self) -> bool:
        """Whether this conv takes bit-plane input in compact rows (no padding words): it gathers windows (im2col or
        implicit GEMM, which takes compact rows only where ceil(C / 32) is even: ``ops.qconv.implicit_conv``) -- every
        conv but a 1x1 stride-1 unpadded one, whose planes are the GEMM operand as they are.  What its quantizer and a
        chained producer write."""
        pointwise = self.kernel_size == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)
        return not pointwise

    def _residual_nhwc(self, residual, x_nhwc: tuple) -> torch.Tensor:
        """The residual as NHWC (N, P, Q, K): the float a producer's QTensor carries (``hp``), or an NCHW tensor
        permuted (a view for channels_last memory)."""
        if isinstance(residual, QTensor):
            if residual.hp is None:
                both = {BitPlanes: "'planes+float'", ShiftedInt8: "'int8+float'"}.get(type(residual.layout),
                                                                                       "'fp8+float'")
                raise ValueError(f"the residual is a {residual.layout!r} QTensor without its float (hp): the producer "
                                 f"must write both (out_layout={both})")
            return residual.hp
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a float NCHW tensor or a QTensor with hp (a producer's dual output), "
                            f"got {type(residual).__name__}")
        N, H, W, _ = x_nhwc
        g = ConvGeometry(N, H, W, self.in_channels, self.out_channels, *self.kernel_size, self.stride, self.padding,
                         self.dilation)
        want = (N, self.out_channels, g.P, g.Q)
        if tuple(residual.shape) != want:
            raise ValueError(f"residual must have the output's NCHW shape {want}, got {tuple(residual.shape)}")
        return residual.permute(0, 2, 3, 1)


class QLinear(_QBase):
    """A Linear (+ ReLU) at integer or FP8 precision; float in, float out.  Fused with a residual add
    (``has_residual``, set by ``quantize_model`` for a pre-norm transformer layer's ``x + out_proj(..)`` /
    ``x + linear2(..)`` on the ``wgmma-gemm`` route: nn/convert.py ``_fuse_linear_residuals``) it is called as
    ``m(x, residual)`` and returns ``act(linear(x) + residual)``, the sum rounded as the unfused add rounds it."""

    @classmethod
    def from_float(cls, lin: nn.Linear, precision, *, in_absmax: float, signed_input: bool, act=None,
                   backend: str = "auto", out_dtype=None, fixed: FixedQuant | None = None) -> "QLinear":
        m = cls()
        prec = parse_precision(precision)
        if prec is None:
            raise ValueError("QLinear needs a quantized precision ('w1a2', 'int8', 'fp8', ...), got 'float'")
        if act not in (None, "relu", GELU):
            raise ValueError(f"QLinear fuses act=None, 'relu' or 'gelu' (the erf GELU: on the {WGMMA_GEMM} route, "
                             f"sm_90, and the reference backend), got {act!r}")
        m._init_common(prec, in_absmax, signed_input, out_dtype or lin.weight.dtype, backend, lin.weight.device,
                       fixed)
        m.in_features, m.out_features, m.act = lin.in_features, lin.out_features, act
        w = lin.weight.detach()[:, None, None, :]  # (N_out, 1, 1, K): a 1x1 conv over one pixel
        if fixed is not None:
            if fixed.weight.shape != tuple(w.shape) or fixed.scale is not None:
                raise ValueError(f"fixed weight codes of a linear are (N, 1, 1, K) = {tuple(w.shape)} with no epilogue "
                                 f"scale, got {fixed.weight.shape} and scale={fixed.scale is not None}")
            m.weight = fixed.weight
            m.register_buffer("bias", None if fixed.bias is None else fixed.bias.detach().float())
            return m
        m.weight = _quantize_weight(w, m.w_fmt)  # buffers weight_codes (N_out, 1, 1, K), weight_scale
        m.register_buffer("bias", None if lin.bias is None else lin.bias.detach().float())
        return m

    in_channels_last = None  # C when nhwc_input(C) reordered the weight's columns

    def extra_repr(self) -> str:
        order = "" if self.in_channels_last is None else f", input=flatten_nhwc(C={self.in_channels_last})"
        return (f"{self.in_features}, {self.out_features}, {self.precision} ({self.w_fmt} x {self.a_fmt}), "
                f"act={self.act}{order}" + (", residual" if self.has_residual else ""))

    def nhwc_input(self, channels: int) -> None:
        """Take the flattened input in (h, w, c) order (``flatten_nhwc`` of an NCHW activation of ``channels``
        channels) instead of torch.flatten's (c, h, w): the quantized weight's columns are permuted once, so the
        flatten is a view of a channels_last activation (or of a chained conv's planes) rather than a copy.  The
        codes and per-output-channel scales are the same numbers, so integer results are unchanged."""
        if self.in_channels_last is not None:
            raise ValueError(f"nhwc_input was already applied (C={self.in_channels_last})")
        K = self.in_features
        if not (isinstance(channels, int) and channels >= 1 and K % channels == 0):
            raise ValueError(f"channels must be a positive divisor of in_features={K}, got {channels!r}")
        codes = self.weight_codes
        codes = codes.reshape(self.out_features, channels, K // channels).transpose(1, 2)  # (N_out, HW, C)
        self.weight_codes = codes.reshape(self.weight_codes.shape).contiguous()
        self.__dict__.pop("_packed", None)
        self.in_channels_last = channels

    def forward(self, x, residual=None) -> torch.Tensor:
        """``x``: float (..., in_features), or the packed planes a chained conv wrote, flattened (``flatten_nhwc``
        of a ``BitPlanes`` QTensor: shape (B, 1, 1, in_features)), or the int8 / float8 codes of shape
        (..., in_features) a ``QLayerNorm`` wrote (the output is then (..., out_features), as for a float x).
        ``residual`` (a linear fused with the add after it, ``has_residual``): a float tensor of the output's shape
        (..., out_features) in ``out_dtype``, added in the epilogue before the activation."""
        if self.has_residual != (residual is not None):
            raise ValueError(f"this QLinear {'was' if self.has_residual else 'was not'} fused with a residual add "
                             f"(has_residual={self.has_residual}): call it as "
                             f"{'m(x, residual)' if self.has_residual else 'm(x)'}")
        if isinstance(x, QTensor):
            if self.layer_plan is not None and x.device != self.layer_plan.device:
                self.plan_on(x.device)  # a chained operand on another device: re-plan (refuses a broken chain)
            if isinstance(x.layout, BitPlanes):
                lead, xa = x.shape[:1], x
                if x.shape != (*lead, 1, 1, self.in_features):
                    raise ValueError(f"QLinear expects planes of shape (B, 1, 1, {self.in_features}), got {x.shape}")
            else:
                if x.shape[-1] != self.in_features or x.hp is not None:
                    raise ValueError(f"QLinear expects codes of shape (..., {self.in_features}) without a float (hp), "
                                     f"got {x.shape}" + (" with hp" if x.hp is not None else ""))
                lead = x.shape[:-1]
                rows = (math.prod(lead), 1, 1, self.in_features)
                xa = replace(x, data=x.data.reshape(rows), scale=x.scale.reshape(1, 1, 1, 1),
                             shape=rows)  # (B, 1, 1, K) NHWC: a view of the codes
        elif not isinstance(x, torch.Tensor) or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"QLinear expects (..., {self.in_features}), got {got}")
        else:
            lead = x.shape[:-1]
            xa = _quantize_input(x.reshape(-1, 1, 1, self.in_features), self)  # (B, 1, 1, K) NHWC
        res = None if residual is None else self._residual_rows(residual, tuple(lead))
        y = qc.conv2d(xa, self._op_weight(xa.device), bias=self.bias, act=self.act, out_dtype=self.out_dtype,
                      backend=self.backend, fp8_fast_accum=self.fp8_fast_accum, out_fmt=self.out_fmt,
                      out_scale=self.out_scale, out_layout=self.out_layout, residual=res)
        if isinstance(y, QTensor):  # chained (_chain_ffn): the next linear's int8 codes, (..., out_features)
            shape = (*lead, self.out_features)
            return replace(y, data=y.data.reshape(shape), scale=y.scale.reshape((1,) * len(shape)), shape=shape)
        return y.reshape(*lead, self.out_features)

    def _residual_rows(self, residual, lead: tuple) -> torch.Tensor:
        """The residual (..., out_features) as the output rows (B, 1, 1, out_features) the epilogue adds it to (its
        dtype and device: ``ops.qconv``'s check, which names them)."""
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a float tensor of the output's shape {(*lead, self.out_features)}, got "
                            f"{type(residual).__name__}")
        want = (*lead, self.out_features)
        if tuple(residual.shape) != want:
            raise ValueError(f"residual must have the output's shape {want} (no broadcasting: the epilogue adds it "
                             f"element by element), got {tuple(residual.shape)}")
        return residual.reshape(-1, 1, 1, self.out_features)  # (B, 1, 1, N): a view of a contiguous residual

    def gemm_plan(self, caps: DeviceCaps, *, act="same", out_fmt="same", out_layout: str | None = None,
                  has_residual: bool | None = None) -> ConvPlan:
        """The plan (``ops.qconv_plan.plan_conv2d``) of this linear's rows on a device of ``caps``, reading the INT8
        kernels' int8 operand, with this layer's epilogue -- or ``act`` / ``out_fmt`` / ``out_layout`` /
        ``has_residual`` instead (what a chaining or a residual fusion would give it).  Its ``route`` says whether
        the rows run the ``wgmma-gemm`` GEMM and its ``reason`` why (not); the number of rows does not enter any
        decision, so one row stands for them."""
        act = self.act if act == "same" else act
        out_fmt = self.out_fmt if out_fmt == "same" else out_fmt
        out_layout = out_layout or (self.out_layout if out_fmt is not None else "planes")
        has_residual = self.has_residual if has_residual is None else has_residual
        g = ConvGeometry(1, 1, 1, self.in_features, self.out_features, 1, 1, (1, 1), (0, 0), (1, 1))
        return plan_conv2d(g, self.a_fmt, self.w_fmt, device=caps, input_layout="int8", act=act,
                           out_dtype=self.out_dtype, out_fmt=out_fmt, out_scale_given=out_fmt is not None,
                           backend=self.backend, out_layout=out_layout, has_residual=has_residual,
                           fast_accum=self.fp8_fast_accum)

    def plan_on(self, device, name: str | None = None, caps=None) -> LayerPlan:
        """``_QBase.plan_on``; a linear fused with the erf GELU (``act="gelu"``, chained by ``quantize_model`` on the
        ``wgmma-gemm`` route) refuses a device whose plan has no epilogue for it (another GPU: the Triton kernel's),
        naming the fix, instead of failing at its first forward."""
        caps = caps if caps is not None else device_caps(torch.device(device))
        if self.act == GELU and not self.precision.fp8:
            backend = layer_backend(self.a_fmt, self.w_fmt, caps, self.backend)[0]
            if backend != "reference":
                try:
                    self.gemm_plan(caps)
                except ValueError as e:
                    who = name or (self.layer_plan.name if self.layer_plan is not None else "QLinear")
                    raise ValueError(f"{who}: quantize_model fused the GELU and the next linear's codes into this "
                                     f"linear's epilogue on the {WGMMA_GEMM} route; on {caps.device} it cannot run "
                                     f"({e}).  Convert on the device the model runs on") from None
        return super().plan_on(device, name, caps)


def flatten_nhwc(x):
    """``torch.flatten(x, 1)`` of an NCHW activation in (h, w, c) order: a view of channels_last memory (a copy
    otherwise), where torch.flatten copies into (c, h, w) order.  For the packed planes a chained conv wrote
    (a ``BitPlanes`` QTensor of shape (N, H, W, C), C % 32 == 0) the planes of the flattened rows (N, 1, 1, H * W * C):
    a view of compact rows (what the bit-serial epilogue writes).  ``quantize_model`` puts it between a conv and a
    ``QLinear`` whose weight it reordered the same way (``QLinear.nhwc_input``)."""
    if isinstance(x, torch.fx.Proxy):  # re-traced when a pickled GraphModule is loaded: stay one graph node
        return x.tracer.create_proxy("call_function", flatten_nhwc, (x,), {})
    if isinstance(x, QTensor) and isinstance(x.layout, BitPlanes):
        N, H, W, C = x.shape
        K = H * W * C
        if C % 32 or K % 512:
            raise ValueError(f"flatten_nhwc of planes needs C % 32 == 0 and H * W * C % 512 == 0 (rows of whole words "
                             f"that flatten into the GEMM's padded rows), got shape {x.shape}")
        hp = None if x.hp is None else x.hp.reshape(N, 1, 1, K)
        planes = x.data[:, :, : C // 32]  # (padded rows, from the reference backend: a copy below)
        return qc.planes_qtensor(planes.reshape(x.data.shape[0], N, K // 32), x.fmt, x.scale, (N, 1, 1, K), hp)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"flatten_nhwc expects an NCHW tensor (N, C, H, W) or a BitPlanes QTensor, got {got}")
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)


class QMaxPool2d(nn.Module):
    """An ``nn.MaxPool2d`` read only by quantized convolutions of one input format, scale and kernel kind (a ResNet's
    stem pool: the first block's conv1 and 1x1 shortcut), which it hands their operand directly: one pass pools the
    float input and writes the int8 codes, bit planes or float8 codes (``ops.qconv.max_pool_quantize``) -- the codes
    each reader's own quantizer computes from torch's pooled float, bit for bit -- so no pooled float is written and
    no reader quantizes it again (docs/decisions/0137).  With ``planes_in`` its producer (a ResNet-50 stem) already
    writes the readers' <= 3-bit codes as bit planes and the pool takes the max of the codes (``ops.qconv.
    max_pool_planes``: the codes of the pooled float, quantizing being monotone; docs/decisions/0172).
    ``quantize_model`` makes it (``QuantConfig(chain=True)``).  Off the kernels' devices (the reference backend) it
    runs torch's pool and the readers' quantizer."""

    def __init__(self, pool: nn.MaxPool2d, reader: "QConv2d", compact: bool, with_float: bool = False):
        super().__init__()
        if pool.ceil_mode or pool.return_indices or pool.dilation not in (1, (1, 1)):
            raise ValueError(f"QMaxPool2d takes a max-pool without ceil_mode, return_indices or dilation, got {pool}")
        self.window = qc.max_pool_window(pool.kernel_size, pool.stride, pool.padding)
        self.precision, self.a_fmt, self.w_fmt, self.backend = reader.precision, reader.a_fmt, reader.w_fmt, reader.backend
        self.compact = bool(compact)  # bit planes without padding words (readers that gather windows)
        self.with_float = bool(with_float)  # the pooled float too (the QTensor's hp): a residual add reads the pool
        # its producer hands it the readers' codes as bit planes (quantize_model chains a ResNet stem so): the pool
        # then takes the max of the codes (ops.qconv.max_pool_planes), the codes of the pooled float
        self.planes_in = False
        self.register_buffer("in_scale", reader.in_scale.detach().clone())

    def extra_repr(self) -> str:
        (kh, kw), (sh, sw), (ph, pw) = self.window
        return (f"kernel_size=({kh}, {kw}), stride=({sh}, {sw}), padding=({ph}, {pw}) -> the {self.a_fmt} operand of "
                f"its {self.precision} readers" + (" (compact planes)" if self.compact else "")
                + (" and the pooled float" if self.with_float else "")
                + (", pooled from its producer's planes" if self.planes_in else ""))

    def operand(self, device: torch.device) -> str | None:
        """What the readers take on ``device`` (``ops.qconv.MAX_POOL_OPERANDS``), as ``_quantize_input`` decides it;
        None on the reference backend (uint8 codes from torch ops)."""
        op = _input_operand(self, device)
        return "compact" if op == "planes" and self.compact else op

    def forward(self, x):
        if self.planes_in:
            if not isinstance(x, QTensor) or not isinstance(x.layout, BitPlanes) or x.element_format != self.a_fmt:
                got = (f"a {x.element_format} {x.layout!r} QTensor" if isinstance(x, QTensor) else
                       f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
                raise ValueError(f"QMaxPool2d(planes_in=True) pools its producer's {self.a_fmt} bit planes, got {got}: "
                                 "run the converted model as quantize_model built it")
            return qc.max_pool_planes(x, self.window, compact=self.compact,
                                      backend="auto" if self.operand(x.device) is not None else "reference")
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.dtype.is_floating_point:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"QMaxPool2d expects a float (N, C, H, W) tensor, got {got}")
        op = self.operand(x.device)
        if op is None:
            y = torch.nn.functional.max_pool2d(x, *self.window).permute(0, 2, 3, 1)
            q = _quantize_input(y, self, compact=self.compact)
            return replace(q, hp=y.contiguous()) if self.with_float else q
        return qc.max_pool_quantize(x.permute(0, 2, 3, 1), self.window, op, "e4m3" if op == "fp8" else self.a_fmt,
                                    self.in_scale, with_float=self.with_float)

    def _apply(self, fn, recurse: bool = True):
        """A move takes the scale along; a float cast (``.half()``) keeps it float32, as the quantized layers do."""
        moved = fn(self.in_scale)
        self.in_scale = moved if moved.dtype == torch.float32 else self.in_scale.to(device=moved.device)
        return self

    def tcprec_trace(self) -> list[str]:
        """The steps inside this layer, for ``tcprec.profile``'s dtype trace."""
        if self.planes_in:
            return [f"{self.a_fmt} planes", "max-pool of the codes", f"{self.a_fmt} planes"]
        return ["max-pool", f"{'e4m3' if self.precision.fp8 else self.a_fmt} codes"]


class QLayerNorm(nn.Module):
    """An ``nn.LayerNorm`` over the last dimension read only by quantized linears of one input format, scale and kernel
    kind (a pre-norm transformer's ``norm1``, read by the attention's fused ``qkv_proj``, and ``norm2``, read by the
    feed-forward's first linear), which it hands their operand directly: one pass normalises the float input and
    writes the int8 or float8 codes (``ops.qconv.layer_norm_quantize``) -- the codes each reader's own quantizer
    computes from torch's LayerNorm output, but where the two LayerNorms' float32 statistics round an element one ulp
    of x's dtype apart -- so no normalised float is written and no reader quantizes it again (docs/decisions/0162).
    ``quantize_model`` makes it (``QuantConfig(chain=True)``).  Off the kernels' devices (the reference backend) it
    runs torch's LayerNorm and the readers' quantizer.  The weight and bias stay the LayerNorm's parameters (the same
    ``state_dict`` names), the readers' scale is the buffer ``in_scale``."""

    def __init__(self, norm: nn.LayerNorm, reader: "QLinear"):
        super().__init__()
        shape = tuple(norm.normalized_shape)
        if len(shape) != 1 or shape[0] > qc.LAYER_NORM_MAX_C:
            raise ValueError(f"QLayerNorm normalises the last dimension of 1..{qc.LAYER_NORM_MAX_C} elements, got "
                             f"normalized_shape={shape}")
        if not isinstance(reader, QLinear) or reader.in_features != shape[0]:
            raise ValueError(f"QLayerNorm's reader must be a QLinear of in_features={shape[0]}, got {reader!r:.80}")
        self.normalized_shape, self.eps = shape, float(norm.eps)
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)  # the parameters (None without affine)
        self.precision, self.a_fmt, self.w_fmt = reader.precision, reader.a_fmt, reader.w_fmt
        self.backend = reader.backend
        self.register_buffer("in_scale", reader.in_scale.detach().clone())

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps:g}, affine={self.weight is not None} -> the "
                f"{'e4m3' if self.precision.fp8 else self.a_fmt} operand of its {self.precision} readers")

    def operand(self, device: torch.device) -> str | None:
        """What the readers take on ``device``, as ``_input_operand`` decides it: "int8" / "fp8"
        (``ops.qconv.LAYER_NORM_OPERANDS``), None on the reference backend (uint8 codes from torch ops)."""
        return _input_operand(self, device)

    def forward(self, x):
        C = self.normalized_shape[0]
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] != C:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"QLayerNorm expects a float (..., {C}) tensor, got {got}")
        op = self.operand(x.device)
        if op is None:
            y = torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            return quantize_static(y, self.a_fmt, self.in_scale)  # QTensor (..., C): the reference backend's codes
        if op not in qc.LAYER_NORM_OPERANDS:
            raise ValueError(f"QLayerNorm writes {qc.LAYER_NORM_OPERANDS} operands; its {self.precision} readers take "
                             f"{op!r} on {x.device}: convert on the device the model runs on")
        return qc.layer_norm_quantize(x, self.weight, self.bias, self.eps, op, "e4m3" if op == "fp8" else self.a_fmt,
                                      self.in_scale)

    def _apply(self, fn, recurse: bool = True):
        """Moves and casts reach the weight and bias as in ``nn.LayerNorm``; the scale stays float32, as the quantized
        layers keep theirs."""
        s = self.in_scale
        super()._apply(fn, recurse)
        if self.in_scale.dtype != torch.float32:
            self.in_scale = s.to(device=self.in_scale.device)
        return self

    def tcprec_trace(self) -> list[str]:
        """The steps inside this layer, for ``tcprec.profile``'s dtype trace."""
        return ["layer-norm (fp32)", f"{'e4m3' if self.precision.fp8 else self.a_fmt} codes"]
