"""``quantize_model``: float network -> quantized inference network (APNN-TC style, torchao's one verb).

What it does, in order:

1. ``torch.fx``-traces a copy of the model (modules that cannot be traced keep working through a
   plain module swap: see step 5).
2. Calibrates: runs the calibration batches and records, for every ``nn.Conv2d`` / ``nn.Linear``,
   the largest |input| and whether any input was negative -> a per-tensor activation scale
   (absmax / qmax) and the activation encoding (``uintN`` after a ReLU, ``intN`` otherwise).
3. Chooses each layer's precision: the config's (``"w1a2"``...), except the first conv and the last
   layer (``first_last``, 8 bits by default, as APNN-TC and every BNN paper keep them) and per-layer
   ``overrides`` by module name (``"float"`` keeps a layer in floating point).
4. Fuses, on the graph: conv -> BatchNorm2d (folded into a per-channel scale and bias) -> activation -> 2x2
   max/avg pool become one ``QConv2d``.  The activation: ReLU, LeakyReLU; and ReLU6 / hardtanh / a constant clamp,
   hardswish, SiLU except into a conv that runs the bit-serial GEMM, whose epilogue lacks them (they stay float ops
   after it: ``_act_of``, ``ops.qconv_plan.layer_act_unsupported``).  Linear -> ReLU become one ``QLinear``; a
   linear kept float with the erf GELU after it one ``LinearGELU`` (one GEMM with torch's GELU epilogue,
   nn/linear_gelu.py); a conv kept float keeps its BN module (folding it was slower: docs/decisions/0155).  Residual
   blocks: a conv(+BN) whose only user is an add (``+``, ``torch.add``, ``Tensor.add``; either operand
   order) of a tensor of its own shape and dtype, followed by an activation as above (or nothing), become one
   ``QConv2d`` called as ``conv(x, residual)`` at the add's place in the graph (``fuse_residual``; the INT8 /
   FP8 kernels, the bit-serial GEMM's float epilogue and the reference backend).  A pre-norm transformer layer's
   ``x + dropout(out_proj(..))`` / ``x + dropout(linear2(..))`` (eval-mode Dropout: the identity) likewise becomes
   ``linear(.., x)``, where the linear runs the ``wgmma-gemm`` route (``_fuse_linear_residuals``).
5. Chains: a ``QConv2d`` whose consumers are bit-serial ``QConv2d`` s (one calibrated format and scale)
   re-quantizes and packs its output for them in the GEMM epilogue (a ``BitPlanes`` QTensor; compact rows for
   convs that gather windows), so no float tensor exists between them; a ResNet block's output (a bit-serial
   conv with the block's add) is written as the float and its planes from one epilogue (``"planes+float"``:
   the QTensor's ``hp``) for the next block's add and convs; a consumer on the INT8 kernel gets its int8 operand (``ShiftedInt8``, written by the
   producer's epilogue); FP8 layers hand each other e4m3 codes.  Across kinds (the "fp8" precision keeps the
   first conv and the last layer at int8) an INT8-kernel layer hands an FP8 layer e4m3 codes and an FP8 layer
   hands an INT8-kernel layer int8 codes.  An output read by several INT8 (or FP8) convs (a ResNet stage's
   conv1 and 1x1 shortcut: one calibrated scale) is written once as their codes, and when residual adds read
   it too, as the codes with the float attached (the QTensor's ``hp``).
   A conv read through ``torch.flatten(y, 1)`` by linears: their weight columns are reordered to (h, w, c)
   once and the flatten becomes ``flatten_nhwc``, a view of the conv's channels_last output (no copy into NCHW
   order); bit-serial linears get the conv's planes through it (compact rows, flattened as a view).
   A max-pool read only by quantized convs (``QMaxPool2d``, docs/decisions/0137) and a LayerNorm read only by INT8 /
   FP8 linears (``QLayerNorm``: a pre-norm transformer's norms, 0162) write their readers' codes in one pass.
6. Reports: ``model.tcprec_summary`` (a ``QuantSummary``) says, per layer, the precision, formats,
   backend and what was fused; layers with no quantized path stay in float and are listed in a
   warning, never silently.
"""

from __future__ import annotations

import copy
import itertools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ..ops.matmul import BACKENDS
from ..ops.qconv import LAYER_NORM_MAX_C, _check_act
from ..ops.qconv_plan import GELU, WGMMA_GEMM, device_caps, layer_act_unsupported
from ..ops.quantize import absmax_qmax
from . import calibrate as cal
from .attention import TORCH_TWINS, TwinCall, decompose_transformers, fuse_qkv, restore_torch_modules
from .coverage import check_conv_coverage, normalize_graph, uncovered
from .linear_gelu import LinearGELU, gelu_fusable, is_erf_gelu
from .qgrouped import QGroupedConv2d, grouped_unsupported
from .qmodules import (FixedQuant, LayerPrecision, QConv2d, QLayerNorm, QLinear, QMaxPool2d, _quantize_weight,
                       act_text, activation_format, flatten_nhwc, parse_precision, weight_format)
from .speed_rule import SpeedRule, apply_speed_rule, as_speed_rule

__all__ = ["QuantConfig", "QuantSummary", "LayerRecord", "LayerPlan", "quantize_model", "plan_layers"]


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model.

    precision   the default for every conv / linear: ``"w1a2"``, ``"w2a2"``, ``"w4a4"``, ``"int8"``, ...
    first_last  precision of the first conv and the last layer (``"int8"``; ``"float"`` keeps them in
                floating point; ``None`` treats them like the rest)
    overrides   module name -> precision (or ``"float"``), e.g. ``{"features.3": "w2a2"}``
    backend     ``"auto"`` | ``"bitserial"`` | ``"int8"`` | ``"reference"`` for every quantized layer (grouped /
                depthwise convs: ``"int8"`` -> their Triton route, ``"reference"`` -> theirs, else ``"auto"``)
    fuse, chain steps 4 and 5 of the module docstring (on by default)
    fuse_residual  step 4's residual blocks (with ``fuse``): ``act(conv_bn(x) + residual)`` in one conv;
                False keeps the add and the activation as float ops (the same numbers, more passes)
    fuse_flatten   step 4's ``conv -> torch.flatten(y, 1) -> linear`` (with ``fuse``): the linears' weight columns
                reordered to (h, w, c) once and the flatten a view of the conv's channels_last output (integer
                layers: the same numbers; a float-accumulating FP8 linear sums in another order).  False keeps
                torch.flatten's NCHW copy (docs/decisions/0006)
    fp8_accum   FP8 layers on the GPU: ``"fast"`` (default) keeps Hopper's narrow fp8 accumulator over the whole
                reduction; ``"fp32"`` promotes it into fp32 every BLOCK_K products (per-layer error ~27x smaller,
                but the network's divergence from its reference is the same within 1.5 points and batch-256
                forwards ~15% slower: docs/decisions/0040, docs/numerics.md)
    activation_observer  how activation ranges are calibrated (integer layers): ``"absmax"``, ``"percentile"``,
                ``"mse"``, ``"entropy"``, ``"auto"`` (per layer, the one of those four with the smallest output
                error) or an ``Observer(method, percentile=, bins=)`` (nn/calibrate.py)
    weight_clip ``"absmax"`` | ``"mse"`` (per-channel clip search) for integer weights
    weight_grid ``"twos"`` (intN) | ``"pm"`` (pmN odd-integer codes for 2..7-bit weights: every code used)
    bias_correction  subtract the expected output error of the quantized weights from each layer's bias
    weight_rounding  ``"nearest"`` (default) | ``"adaround"`` | ``AdaRound(iters=300, max_bits=4, ...)``:
                learned up/down rounding of integer weights of 2..max_bits bits (and of fp8 layers' e4m3 weights,
                8 bits, between their two e4m3 neighbours, when ``max_bits=8``) on the calibration batches;
                ``AdaRound(inputs="quantized")`` solves each layer on the quantized model's input (its predecessors
                rounded, their inputs quantized), in model order (nn/calibrate.py ``adaround_lockstep``)
    speed_rule  ``"off"`` (default) | ``"measured"`` | ``SpeedRule(batch=256, timer=, rounds=2)``: time each quantized
                layer against its float equivalent on the model's CUDA device and keep the slower ones float
                (nn/speed_rule.py; why off by default: docs/decisions/0090)
    grouped     precision of every grouped / depthwise conv (``groups > 1``), e.g. ``"int8"`` in a ``"w4a8"`` model
                (their weights are ~1% of a MobileNet's and they run on the CUDA cores, memory-bound, at any bit
                width, while 4-bit depthwise weights cost EfficientNet-Lite0 10 points: docs/decisions/0082);
                None: like any conv.  ``overrides`` and ``first_last`` win over it
    clamped_inputs  precision of every conv / linear whose input is a clamp activation's output (``nn.ReLU6``,
                ``nn.Hardtanh``, ``F.relu6``, ``F.hardtanh``, ``torch.clamp`` with constant bounds), e.g. ``"int8"`` in an
                ``"fp8"`` model: e4m3's exponent buys nothing on a bounded range and its 3-bit mantissa costs
                15-22 dB of SQNR against int8's uniform grid there (EfficientNet-Lite0's depthwise and project convs;
                docs/decisions/0113); None: like any layer.  ``overrides``, ``first_last`` and ``grouped`` win over it
    """

    precision: str = "w1a2"
    first_last: str | None = "int8"
    overrides: Mapping[str, str] = field(default_factory=dict)
    backend: str = "auto"
    fuse: bool = True
    chain: bool = True
    fuse_residual: bool = True
    fuse_flatten: bool = True
    fp8_accum: str = "fast"
    activation_observer: "cal.Observer | str" = "absmax"
    weight_clip: str = "absmax"
    weight_grid: str = "twos"
    bias_correction: bool = False
    weight_rounding: "cal.AdaRound | str" = "nearest"
    speed_rule: "SpeedRule | str" = "off"
    grouped: str | None = None
    clamped_inputs: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "speed_rule", as_speed_rule(self.speed_rule))
        if self.fp8_accum not in ("fp32", "fast"):
            raise ValueError(f"fp8_accum must be 'fp32' or 'fast', got {self.fp8_accum!r}")
        object.__setattr__(self, "activation_observer", cal.as_observer(self.activation_observer))
        if self.weight_clip not in cal.WEIGHT_CLIPS:
            raise ValueError(f"weight_clip must be one of {cal.WEIGHT_CLIPS}, got {self.weight_clip!r}")
        if self.weight_grid not in cal.WEIGHT_GRIDS:
            raise ValueError(f"weight_grid must be one of {cal.WEIGHT_GRIDS}, got {self.weight_grid!r} "
                             "('pm' stores 2..7-bit weights as odd integers, using every code)")
        if not isinstance(self.bias_correction, bool):
            raise TypeError(f"bias_correction must be a bool, got {self.bias_correction!r}")
        cal.as_rounding(self.weight_rounding)
        parse_precision(self.precision)
        if self.first_last is not None:
            parse_precision(self.first_last)
        if self.grouped is not None:
            parse_precision(self.grouped)
        if self.clamped_inputs is not None:
            parse_precision(self.clamped_inputs)
        for k, v in dict(self.overrides).items():
            if not isinstance(k, str):
                raise TypeError(f"overrides keys are module names (str), got {k!r}")
            parse_precision(v)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclass
class LayerRecord:
    name: str
    kind: str  # "conv" | "linear"
    precision: str  # "w1a2" ... or "float"
    backend: str  # the op's backend, or why it stays float
    fused: tuple = ()
    out: str = ""
    reason: str = ""  # the speed rule's measured decision (nn/speed_rule.py), when it ran
    route: str = ""  # a linear on the INT8 backend: its GEMM's route and why ("wgmma-gemm", "triton (not ...)")

    def line(self) -> str:
        """The layer in one line, as ``QuantSummary.explain`` prints it."""
        return (f"{self.name} ({self.kind}): {self.precision}, {self.backend}"
                + (f", route {self.route}" if self.route else "")
                + (f", fused {'+'.join(self.fused)}" if self.fused else "") + (f", out {self.out}" if self.out else "")
                + (f"; speed rule: {self.reason}" if self.reason and self.reason != self.backend else ""))


@dataclass
class QuantSummary:
    layers: list[LayerRecord]
    traced: bool
    notes: list[str] = field(default_factory=list)
    speed: object = None  # nn.speed_rule.SpeedReport when the speed rule ran

    @property
    def float_layers(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.precision == "float"]

    def explain(self, name: str | None = None) -> str:
        """Every layer (or the one called ``name``) in full: precision, backend or why it stays float, fusion, output,
        and the speed rule's measured times; then the speed rule's totals."""
        recs = [r for r in self.layers if name is None or r.name == name]
        if name is not None and not recs:
            raise ValueError(f"no layer {name!r} in the summary; layers: {[r.name for r in self.layers][:8]} ...")
        lines = [r.line() for r in recs]
        return "\n".join(lines + (self.speed.lines() if self.speed is not None and name is None else []))

    def __str__(self) -> str:
        lines = [f"{'layer':28} {'kind':6} {'precision':9} {'backend':10} {'fused':22} out"]
        for r in self.layers:
            backend = f"{r.backend}/wgmma" if r.route.startswith(WGMMA_GEMM) else r.backend
            lines.append(f"{r.name:28} {r.kind:6} {r.precision:9} {backend[:10]:10} {'+'.join(r.fused):22} {r.out}")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"speed: {n}" for n in (self.speed.lines() if self.speed is not None else [])]
        return "\n".join(lines)

    def table(self):
        from rich.table import Table

        t = Table(title="quantized layers")
        for c in ("layer", "kind", "precision", "backend", "fused", "out"):
            t.add_column(c)
        for r in self.layers:
            t.add_row(r.name, r.kind, r.precision, r.backend, "+".join(r.fused), r.out)
        return t


class _Tracer(fx.Tracer):
    """torch.nn modules, tcprec pool modules (``tcprec_pool``) and the attention core (``tcprec_fx_leaf``) stay
    leaves.  ``twin_calls``: each call of a stand-in for a torch transformer module (nn/attention.py), where the
    torch module may come back (``restore_torch_modules``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.twin_calls: list[TwinCall] = []

    def call_module(self, m: nn.Module, forward, args, kwargs):
        before = len(self.graph.nodes)
        out = super().call_module(m, forward, args, kwargs)
        if isinstance(m, TORCH_TWINS):  # (the nodes it made: the last ones, tracing appends)
            made = itertools.islice(reversed(self.graph.nodes), len(self.graph.nodes) - before)
            self.twin_calls.append(TwinCall.of(self.path_of_module(m), args, kwargs, out, made))
        return out

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return hasattr(m, "tcprec_pool") or getattr(m, "tcprec_fx_leaf", False) or super().is_leaf_module(m, qualname)

    def trace(self, root, concrete_args=None) -> fx.Graph:
        """The graph, without the annotations that are strings (``from __future__ import annotations`` or
        ``x: "torch.Tensor"`` in the model's ``forward``): fx keeps them as globals of the generated code, and
        pickling that code (``torch.save`` of the converted model) fails on a ``str`` global.  Annotations are
        cosmetic in the generated code; the graph's meaning is unchanged."""
        graph = super().trace(root, concrete_args)
        for node in graph.nodes:
            if isinstance(node.type, str):
                node.type = None
        return graph


def _batches(calibration) -> list:
    """The calibration batches: tensors, or dicts of keyword arguments (``{"src": x, "src_key_padding_mask": m}``:
    the model runs ``model(**batch)``, so it calibrates under the masks it runs with)."""
    if calibration is None:
        raise ValueError("quantize_model needs calibration data for the activation scales: pass calibration=x "
                         "(a sample batch) or a list of batches")
    if isinstance(calibration, (torch.Tensor, dict)):
        calibration = [calibration]
    if isinstance(calibration, (list, tuple)) or isinstance(calibration, Iterable):
        out = [b[0] if isinstance(b, (list, tuple)) else b for b in calibration]
        bad = [type(b).__name__ for b in out if not (isinstance(b, torch.Tensor) or (
            isinstance(b, dict) and b and all(isinstance(k, str) for k in b)))]
        if not out or bad:
            raise TypeError("calibration must be a tensor, a dict of keyword arguments of the model's forward "
                            "({'src': x, 'mask': m}), or a non-empty list of those (or of (x, y) pairs); got "
                            f"{bad or 'an empty list'}")
        return out
    raise TypeError(f"calibration must be a tensor, a dict or a list of them, got {type(calibration).__name__}")


def _positional(gm: fx.GraphModule, b):
    """A batch as the traced model's positional arguments (ShapeProp takes those): a dict's values in the order of
    the placeholders, their defaults where the dict has none."""
    if not isinstance(b, dict):
        return (b,)
    args = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.target in b:
            args.append(b[n.target])
        elif n.args:
            args.append(n.args[0])
        else:
            raise ValueError(f"calibration batch has no {n.target!r}: the model's forward needs it (keys given: "
                             f"{sorted(b)})")
    unknown = sorted(set(b) - {n.target for n in gm.graph.nodes if n.op == "placeholder"})
    if unknown:
        raise ValueError(f"calibration batch keys {unknown} name no argument of the model's forward")
    return tuple(args)


@torch.no_grad()
def _calibrate(model: nn.Module, names: list[str], batches, shapes: bool = False,
               notes: list[str] | None = None) -> dict[str, tuple[float, bool]]:
    """name -> (max |input|, saw a negative input) over the calibration batches.  ``shapes`` (a traced
    model): the first batch runs through ``ShapeProp``, which records every node's output shape and dtype
    (``node.meta["tensor_meta"]``) for the residual fusion; where it fails, a plain forward runs instead
    and ``notes`` says that no residual add was fused."""
    stats: dict[str, list] = {n: [0.0, False] for n in names}
    hooks = []
    mods = dict(model.named_modules())
    for n in names:
        def pre(mod, args, n=n):
            x = args[0]
            if isinstance(x, torch.Tensor) and x.numel():
                xf = x.detach().float()
                stats[n][0] = max(stats[n][0], float(xf.abs().max()))
                stats[n][1] = stats[n][1] or bool((xf < 0).any())
        hooks.append(mods[n].register_forward_pre_hook(pre))
    try:
        for i, b in enumerate(batches):
            x = cal.batch_on(model, b)
            if shapes and i == 0:
                args = _positional(model, x)  # (a bad dict key raises here, before the forward)
                try:
                    ShapeProp(model).propagate(*args)
                    continue
                except Exception as e:  # noqa: BLE001 - any failure: calibrate without shapes, and say so
                    for n in model.graph.nodes:
                        n.meta.pop("tensor_meta", None)
                    if notes is not None:
                        notes.append(f"shape propagation failed ({type(e).__name__}: {str(e)[:120]}); "
                                     "residual adds were left unfused")
            cal.call_batch(model, x)
    finally:
        for h in hooks:
            h.remove()
    return {n: (v[0], v[1]) for n, v in stats.items()}


def _unsupported(m: nn.Module) -> str | None:
    if isinstance(m, nn.Conv2d):
        if m.groups != 1:
            return grouped_unsupported(m, None)  # QGroupedConv2d (nn/qgrouped.py)
        if isinstance(m.padding, str) or m.padding_mode != "zeros":
            return f"padding={m.padding!r}, padding_mode={m.padding_mode!r} (needs numeric zero padding)"
    return None


def _candidates(gm: nn.Module, mods, traced: bool) -> list[str]:
    """The nn.Conv2d / nn.Linear layers in execution order (module order when the model did not trace)."""
    if traced:
        order = [n.target for n in gm.graph.nodes if n.op == "call_module"
                 and type(mods[n.target]) in (nn.Conv2d, nn.Linear)]
        return list(dict.fromkeys(order))
    return [n for n, m in gm.named_modules() if type(m) in (nn.Conv2d, nn.Linear)]


def _bounds(node: fx.Node, lo_name: str, hi_name: str, lo_default=None, hi_default=None) -> tuple:
    """(lo, hi) of the clamp-like call ``node``: input first, then the two bounds, as args or by these keyword names."""
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get(lo_name, lo_default)
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get(hi_name, hi_default)
    return lo, hi


def _numeric_bounds(node: fx.Node, lo_name: str, hi_name: str, lo_default=None, hi_default=None) -> bool:
    """Whether the clamp-like call ``node`` has numeric bounds (``_bounds``)."""
    return all(isinstance(v, (int, float)) for v in _bounds(node, lo_name, hi_name, lo_default, hi_default))


def _is_clamp(node: fx.Node, mods) -> bool:
    """Whether fx ``node`` is a clamp activation with constant bounds: an ``nn.ReLU6`` / ``nn.Hardtanh`` module, an
    ``F.relu6`` call, or ``F.hardtanh`` / ``torch.clamp`` / ``x.clamp`` with numeric bounds (fx passes them as args or
    kwargs)."""
    if node.op == "call_module":
        return type(mods.get(node.target)) in (nn.ReLU6, nn.Hardtanh)
    if node.op == "call_method":  # x.clamp(lo, hi)
        return node.target in ("clamp", "clip") and _numeric_bounds(node, "min", "max")
    if node.op != "call_function":
        return False
    if node.target is F.relu6:
        return True
    if node.target is F.hardtanh:
        return _numeric_bounds(node, "min_val", "max_val", -1.0, 1.0)
    return node.target is torch.clamp and _numeric_bounds(node, "min", "max")


def _clamp_bounds(node: fx.Node, mods) -> tuple[float, float] | None:
    """(lo, hi) of a clamp-like activation node (``_is_clamp``, or a ReLU: (0, inf)), None for anything else."""
    if _act_of(node, mods) == "relu":  # (in place or not: _absorb_clamps asks that the input has no other reader)
        return 0.0, float("inf")
    return _clamp_args(node, mods)


def _clamp_args(node: fx.Node, mods) -> tuple[float, float] | None:
    """(lo, hi) of a clamp activation node (``_is_clamp``), None for anything else."""
    if node.op == "call_module":
        m = mods.get(node.target)
        return (float(m.min_val), float(m.max_val)) if type(m) in (nn.ReLU6, nn.Hardtanh) else None
    if not _is_clamp(node, mods):
        return None
    if node.op == "call_function" and node.target is F.relu6:
        return 0.0, 6.0
    hardtanh = node.target is F.hardtanh
    lo, hi = _bounds(node, "min_val", "max_val", -1.0, 1.0) if hardtanh else _bounds(node, "min", "max")
    return float(lo), float(hi)


def _saturates_inside(q: nn.Module, lo: float, hi: float) -> bool:
    """Whether quantized layer ``q``'s input quantizer gives the same codes for ``clamp(x, lo, hi)`` as for ``x``: its
    codes are unsigned integers (code 0 = value 0; negative inputs and NaN saturate to it, so any ``lo <= 0`` is
    invisible) and ``hi``, as any float dtype holds it (the smallest of its float16 / bfloat16 / float32 roundings),
    rounds (half to even, like every quantizer here) to the top code or above, so whatever the clamp cuts saturates
    anyway."""
    fmt = getattr(q, "a_fmt", None)
    if q.precision.fp8 or getattr(fmt, "encoding", None) != "unsigned" or not lo <= 0.0:
        return False
    if hi == float("inf"):
        return True
    h = min(torch.tensor(hi, dtype=d).to(torch.float32) for d in (torch.float16, torch.bfloat16, torch.float32))
    return bool(torch.round(h / q.in_scale.detach().reshape(()).to("cpu", torch.float32)) >= absmax_qmax(fmt))


def _absorb_clamps(gm: fx.GraphModule, notes: list) -> None:
    """Drop a clamp activation (ReLU, ReLU6, hardtanh, clamp) whose only readers are quantized layers taking it as
    their input, when each of their quantizers gives the same codes without it (``_saturates_inside``): bit for bit
    the same network, one elementwise pass fewer (EfficientNet's and MobileNet's ReLU6 in front of a depthwise conv the
    dense conv's epilogue does not fuse).  The clamp's input must have no other reader (an in-place clamp changed what
    those saw)."""
    mods = dict(gm.named_modules())
    quantized = (QConv2d, QGroupedConv2d, QLinear)
    for node in list(gm.graph.nodes):
        bounds = _clamp_bounds(node, mods)
        if bounds is None or not node.args or not isinstance(node.args[0], fx.Node) or len(node.args[0].users) != 1:
            continue
        readers = list(node.users)
        if not readers or any(u.op != "call_module" or not isinstance(mods.get(u.target), quantized)
                              or u.args[0] is not node or node in u.args[1:] or node in u.kwargs.values()
                              for u in readers):
            continue
        if not all(_saturates_inside(mods[u.target], *bounds) for u in readers):
            continue
        what = node.target if node.op == "call_module" else node.name
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        lo, hi = bounds
        notes.append(f"{what}: clamp({lo:g},{hi:g}) read only by {', '.join(u.target for u in readers)}, whose input "
                     "quantizers saturate inside its bounds: left to them (the same codes, one pass fewer)")


def clamped_input_layers(gm: nn.Module, mods) -> set[str]:
    """The layers (module names) of a traced ``gm`` whose input is a clamp activation's output (``_is_clamp``):
    ``QuantConfig.clamped_inputs``."""
    return {node.target for node in gm.graph.nodes
            if node.op == "call_module" and isinstance(mods.get(node.target), (nn.Conv2d, nn.Linear)) and node.args
            and isinstance(node.args[0], fx.Node) and _is_clamp(node.args[0], mods)}


def _precision_rule(cfg: QuantConfig, order: list[str], mods, gm: nn.Module | None = None):
    """name -> LayerPrecision (None: float): the override, else first_last for the first conv and the last
    layer, else ``grouped`` for a grouped conv, else ``clamped_inputs`` for a layer reading a clamp activation
    (``gm``: the traced graph; None, an untraced model: no layer is known to), else the config's precision."""
    first_conv = next((n for n in order if isinstance(mods[n], nn.Conv2d)), None)
    last = order[-1] if order else None
    clamped = clamped_input_layers(gm, mods) if cfg.clamped_inputs is not None and gm is not None else set()

    def precision_of(name: str) -> LayerPrecision | None:
        if name in cfg.overrides:
            return parse_precision(cfg.overrides[name])
        if cfg.first_last is not None and name in (first_conv, last):
            return parse_precision(cfg.first_last)
        if cfg.grouped is not None and isinstance(mods[name], nn.Conv2d) and mods[name].groups != 1:
            return parse_precision(cfg.grouped)
        if name in clamped:
            return parse_precision(cfg.clamped_inputs)
        return parse_precision(cfg.precision)

    return precision_of


def _fusable_bn(m: nn.Module, u: fx.Node | None, mods) -> bool:
    """Whether conv ``m``'s sole user ``u`` is a BatchNorm2d that quantize_model folds into it."""
    return (isinstance(m, nn.Conv2d) and u is not None and u.op == "call_module"
            and type(mods[u.target]) is nn.BatchNorm2d and mods[u.target].track_running_stats)


def _absorb_user(gm: fx.GraphModule, node: fx.Node, u: fx.Node, new: nn.Module, records: dict, what: str) -> None:
    """A layer kept float becomes ``new``, which computes its sole user ``u`` too: ``u``'s readers read the layer,
    ``u`` leaves the graph and the record says ``what`` was fused."""
    _set_module(gm, node.target, new)
    u.replace_all_uses_with(node)
    gm.graph.erase_node(u)
    rec = records[node.target]
    rec.fused = rec.fused + (what,)


@dataclass(frozen=True)
class LayerPlan:
    """One nn.Conv2d / nn.Linear as quantize_model will treat it (``plan_layers``)."""

    name: str
    kind: str  # "conv" | "linear"
    precision: LayerPrecision | None  # None: stays in float
    why_float: str | None  # why it stays in float (None when quantized)
    bn: str | None  # the BatchNorm2d folded into it (module name), or None


def plan_layers(model: nn.Module, config: QuantConfig | str = "w1a2") -> tuple[list[LayerPlan], bool]:
    """(the layers ``quantize_model(model, config)`` would quantize, in execution order; whether the model
    traces): the same tracer, first/last rule, overrides and BatchNorm folding, without calibration data.
    ``tcprec.prepare_qat`` puts fake quantization on exactly these."""
    cfg = QuantConfig(precision=config) if isinstance(config, str) else config
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"config must be a QuantConfig or a precision string like 'w1a2', got {type(config).__name__}")
    try:
        gm: nn.Module = fx.GraphModule(model, _Tracer().trace(model), model.__class__.__name__)
        traced = True
    except Exception:  # noqa: BLE001 - the module swap of quantize_model (no fusion)
        gm, traced = model, False
    mods = dict(gm.named_modules())
    unknown = [k for k in cfg.overrides if k not in mods]
    if unknown:
        raise ValueError(f"overrides name no module of the model: {unknown}; names look like {list(mods)[1:6]}")
    order = _candidates(gm, mods, traced)
    precision_of = _precision_rule(cfg, order, mods, gm if traced else None)
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"} if traced else {}
    plans = []
    for name in order:
        m, prec = mods[name], precision_of(name)
        why = _unsupported(m) or (None if prec is not None else "kept in float (config)")
        if why is None and isinstance(m, nn.Conv2d) and m.groups != 1:
            # quantize_model runs grouped convs on QGroupedConv2d; QAT's fake-quant conv and convert_qat do not
            why = f"groups={m.groups}: QAT trains groups=1 convs (quantize_model quantizes it after training)"
        bn = None
        if traced and cfg.fuse and why is None:
            u = _sole_user(nodes[name])
            if _fusable_bn(m, u, mods):
                bn = u.target
        plans.append(LayerPlan(name, "conv" if isinstance(m, nn.Conv2d) else "linear",
                               None if why else prec, why, bn))
    return plans, traced


# Activations of one encoding whatever their arguments (``inplace`` only)
_NAMED_ACTS = {nn.ReLU: "relu", nn.Hardswish: "hardswish", nn.SiLU: "silu", F.relu: "relu", torch.relu: "relu",
               torch.relu_: "relu", F.hardswish: "hardswish", F.silu: "silu"}


def _act_of(node: fx.Node, mods) -> object | None:
    """The epilogue encoding (``ops.qconv``'s canonical act) of an activation node: "relu", ("leaky", slope),
    ("clamp", lo, hi) (a clamp with constant bounds, finite lo < hi: ``nn.ReLU6``, ``nn.Hardtanh``, ``F.relu6``,
    ``F.hardtanh``, ``torch.clamp``, ``x.clamp``), "hardswish", "silu"; None for anything else."""
    if node.op == "call_module":
        m = mods[node.target]
        if type(m) is nn.LeakyReLU:
            return ("leaky", float(m.negative_slope))
        named = _NAMED_ACTS.get(type(m))
    elif node.op == "call_function":
        if node.target is F.leaky_relu:
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
            return ("leaky", float(slope)) if isinstance(slope, (int, float)) else None
        named = _NAMED_ACTS.get(node.target)
    elif node.op == "call_method":
        named = "relu" if node.target in ("relu", "relu_") else None
    else:
        return None
    if named is not None:
        return named
    bounds = _clamp_args(node, mods)
    if bounds is None:
        return None
    try:
        return _check_act(("clamp", *bounds))  # float32 bounds
    except ValueError:  # not finite lo < hi (torch.clamp(x, 0, inf)): no epilogue clamp
        return None


def _pool_of(node: fx.Node, mods) -> tuple | None:
    if node.op != "call_module":
        return None
    m = mods[node.target]
    if hasattr(m, "tcprec_pool"):
        return tuple(m.tcprec_pool)
    two = lambda v: v in (2, (2, 2))  # noqa: E731
    if type(m) is nn.MaxPool2d and two(m.kernel_size) and two(m.stride) and m.padding in (0, (0, 0)) \
            and m.dilation in (1, (1, 1)) and not m.ceil_mode and not m.return_indices:
        return ("max", 2, 2)
    if type(m) is nn.AvgPool2d and two(m.kernel_size) and two(m.stride) and m.padding in (0, (0, 0)) \
            and not m.ceil_mode:
        return ("avg", 2, 2)
    return None


def _sole_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


_ADDS = (operator.add, torch.add)


def _add_operands(node: fx.Node) -> tuple | None:
    """(a, b) of a plain two-tensor add node (``a + b``, ``torch.add(a, b)``, ``a.add(b)``; no alpha), else None."""
    is_add = ((node.op == "call_function" and node.target in _ADDS) or
              (node.op == "call_method" and node.target == "add"))
    if not is_add or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) and a is not b else None


def _same_tensor_meta(*nodes: fx.Node) -> bool:
    """Whether ShapeProp saw tensors of one shape and dtype at every node (no broadcasting add)."""
    metas = [n.meta.get("tensor_meta") for n in nodes]
    if any(m is None or not hasattr(m, "shape") for m in metas):
        return False
    return all(m.shape == metas[0].shape and m.dtype == metas[0].dtype for m in metas)


def _module_calls(g: fx.Graph) -> dict[str, int]:
    """How many call_module nodes call each module (a module called twice is shared: no rewrite may change it)."""
    calls: dict[str, int] = {}
    for n in g.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    return calls


def _fuse_residuals(gm: fx.GraphModule, records: dict) -> None:
    """``act(conv(x) + r)`` -> ``conv(x, r)`` with the add and act in the conv's epilogue (module docstring,
    step 4).  The fused call takes the add's place: ``r`` (e.g. a shortcut conv) may come after the conv."""
    g = gm.graph
    mods = dict(gm.named_modules())
    for n in list(g.nodes):  # an identity shortcut (nn.Identity) is the block input itself: its consumers see that
        if n.op == "call_module" and type(mods.get(n.target)) is nn.Identity and len(n.args) == 1 and not n.kwargs:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    calls = _module_calls(g)
    for add in list(g.nodes):
        ops = _add_operands(add)
        if ops is None or not _same_tensor_meta(add, *ops):
            continue
        for conv, res in (ops, ops[::-1]):  # the left operand first (a ResNet's branch + shortcut)
            q = mods.get(conv.target) if conv.op == "call_module" else None
            if (isinstance(q, QConv2d) and calls[conv.target] == 1 and len(conv.users) == 1 and len(conv.args) == 1
                    and not conv.kwargs and q.act is None and q.pool is None and not q.has_residual
                    and q.out_dtype == add.meta["tensor_meta"].dtype):
                break
        else:
            continue
        u = _sole_user(add)
        act = _act_of(u, mods) if u is not None else None
        if act is not None and layer_act_unsupported(act, q.a_fmt, q.w_fmt, q.backend):
            act = None  # (the bit-serial GEMM's epilogue lacks it: the add fused, the activation a float op after)
        with g.inserting_before(add):
            fused = g.call_module(conv.target, (conv.args[0], res))
        fused.meta = dict(add.meta)
        last = u if act is not None else add
        last.replace_all_uses_with(fused)
        if act is not None:
            g.erase_node(u)
        g.erase_node(add)
        g.erase_node(conv)
        q.act, q.has_residual = act, True
        rec = records[conv.target]
        rec.fused = rec.fused + ("residual",) + ((act_text(act),) if act else ())


def _through_dropouts(node: fx.Node, mods) -> tuple[fx.Node, list[fx.Node]]:
    """The node under a chain of ``nn.Dropout`` calls (eval mode: the identity) that ``node`` ends, each read only by
    the next, and those dropout nodes (outermost first)."""
    drops = []
    while node.op == "call_module" and type(mods.get(node.target)) is nn.Dropout and len(node.args) == 1 \
            and not node.kwargs and isinstance(node.args[0], fx.Node) and len(node.args[0].users) == 1:
        drops.append(node)
        node = node.args[0]
    return node, drops


def _fuse_linear_residuals(gm: fx.GraphModule, records: dict, caps, notes: list) -> None:
    """``x + dropout(linear(h))`` (either operand order; eval-mode ``nn.Dropout`` s in between are the identity) ->
    ``linear(h, x)``, the add in the linear's epilogue: a pre-norm transformer layer's ``x + _sa_block(..)`` (the
    attention's ``out_proj``) and ``x + _ff_block(..)`` (``linear2``).  Only where the linear's rows run the
    ``wgmma-gemm`` route with the residual (``ops.qconv_plan.wgmma_gemm_refusal``: an sm_90 GPU, fp16 out, no
    activation): there the add costs the kernel ~6 us of linear2's 52 (docs/decisions/0163), against a separate
    pass over (B * L, E) fp16.  The Triton kernel would give the same sum (its ``HAS_RES`` epilogue indexes a linear's
    rows as it does a 1x1 conv's pixels, and rounds as the unfused add), but it was not measured on a linear: a
    residual moves it to the ``tap_res`` tiles (64 x 64, decision 0130, tuned on ResNet's memory-bound 1x1 convs), a
    poor fit for linear2's K = 3072; so there the add stays a float op, and the summary's notes say why.  The
    reference backend (no GPU) keeps it apart too, as ``_chain_ffn`` keeps its pair, without a note."""
    g = gm.graph
    mods = dict(gm.named_modules())
    calls = _module_calls(g)
    apart: dict[str, list[str]] = {}
    for add in list(g.nodes):
        ops = _add_operands(add)
        if ops is None or not _same_tensor_meta(add, *ops):
            continue
        for top, res in (ops[::-1], ops):  # the right operand first (x + block(x))
            lin, drops = _through_dropouts(top, mods)
            q = mods.get(lin.target) if lin.op == "call_module" else None
            if (isinstance(q, QLinear) and calls[lin.target] == 1 and len(lin.users) == 1 and len(lin.args) == 1
                    and not lin.kwargs and not q.has_residual and q.act is None and q.out_fmt is None
                    and q.in_channels_last is None and q.out_dtype == add.meta["tensor_meta"].dtype
                    and (not drops or len(top.users) == 1) and res is not lin):
                break
        else:
            continue
        if q.precision.fp8 or q.layer_plan is None or q.layer_plan.backend != "int8":
            continue  # (FP8 / bit-serial / reference linears: the add a float op, no word about the route)
        plan = q.gemm_plan(caps, has_residual=True)
        if plan.route != WGMMA_GEMM:
            apart.setdefault(_wgmma_refusal(plan) or plan.route, []).append(f"{lin.target} + {res.name}")
            continue
        with g.inserting_before(add):
            fused = g.call_module(lin.target, (lin.args[0], res))
        fused.meta = dict(add.meta)
        add.replace_all_uses_with(fused)
        g.erase_node(add)
        for d in drops:  # the dropouts (eval: the identity), outermost first, then the linear's call
            g.erase_node(d)
        g.erase_node(lin)
        q.has_residual = True
        rec = records[lin.target]
        rec.fused = rec.fused + ("residual",)
        rec.route = _route_text(q, caps)
    _note_apart(notes, apart, "linear residual add(s) not fused",
                f"a linear's residual goes into its epilogue on the {WGMMA_GEMM} route only (the Triton kernel's "
                "residual tiles were tuned on convs, not measured on a linear)")


def _fuse_float_gelu(gm: fx.GraphModule, node: fx.Node, mods, records: dict) -> None:
    """A linear kept float whose only reader is the erf GELU -> ``LinearGELU`` (one GEMM with a bias + GELU
    epilogue, ``torch._addmm_activation``: what torch's fused encoder layer runs; nn/linear_gelu.py)."""
    m = mods[node.target]
    if gelu_fusable(m, node, mods):
        _absorb_user(gm, node, _sole_user(node), LinearGELU.from_linear(m), records, "gelu")


def _flatten_input(node: fx.Node, mods) -> fx.Node | None:
    """x of a ``torch.flatten(x, 1)`` node (``torch.flatten``, ``Tensor.flatten``, ``nn.Flatten()``; start_dim 1,
    end_dim -1), else None."""
    if node.op == "call_module" and type(mods.get(node.target)) is nn.Flatten:
        start, end = mods[node.target].start_dim, mods[node.target].end_dim
    elif (node.op == "call_function" and node.target is torch.flatten) or \
            (node.op == "call_method" and node.target == "flatten"):
        a, kw = node.args, node.kwargs
        start = a[1] if len(a) > 1 else kw.get("start_dim", 0)
        end = a[2] if len(a) > 2 else kw.get("end_dim", -1)
    else:
        return None
    x = node.args[0] if node.args else None
    return x if isinstance(x, fx.Node) and start == 1 and end == -1 else None


def _fuse_flatten(gm: fx.GraphModule, records: dict) -> None:
    """conv -> ``torch.flatten(y, 1)`` -> linear(s): the linears' weight columns reordered to (h, w, c) once
    (``QLinear.nhwc_input``) and the flatten replaced by ``flatten_nhwc``, a view of the conv's channels_last
    output (torch.flatten copies it into (c, h, w) order: ResNet-18's classifier input, 12.8 MB at batch 256).
    The same codes meet the same weights, so integer layers give the same results."""
    g = gm.graph
    mods = dict(gm.named_modules())
    calls = _module_calls(g)
    for f in list(g.nodes):
        x = _flatten_input(f, mods)
        if x is None or x.op != "call_module" or not isinstance(mods.get(x.target), QConv2d):
            continue
        users = list(f.users)
        C = mods[x.target].out_channels
        if not users or not all(u.op == "call_module" and isinstance(mods.get(u.target), QLinear)
                                and calls[u.target] == 1 and u.args == (f,) and not u.kwargs
                                and mods[u.target].in_channels_last is None
                                and mods[u.target].in_features % C == 0 for u in users):
            continue
        for u in users:
            mods[u.target].nhwc_input(C)
            records[u.target].fused = ("flatten",) + records[u.target].fused
        with g.inserting_before(f):
            nf = g.call_function(flatten_nhwc, (x,))
        nf.meta = dict(f.meta)
        f.replace_all_uses_with(nf)
        g.erase_node(f)


# A bit-serial ResNet block's output as the float and its planes from one epilogue ("planes+float"), not the float
# and a quantize_pack pass in each reader: measured level or faster (docs/decisions/0007).
def _dual_planes_ok(a: nn.Module, b: nn.Module, kind_of) -> bool:
    """Whether producer ``a`` can write its float output and bit-serial consumer ``b``'s planes from one pass
    ("planes+float"): the binary GEMM's epilogue or an INT8 layer's (stem_conv.cu's, or one pack pass after the
    Triton kernel), <= 3-bit codes, a 16-bit float."""
    return (kind_of(a) in ("bitserial", "int8") and b.a_fmt.bits <= 3
            and a.out_dtype in (torch.float16, torch.bfloat16))


def _chain_through_flatten(node: fx.Node, flat: fx.Node, qmods, records: dict, kind_of) -> None:
    """A conv read only through ``flatten_nhwc`` by bit-serial linears writes their planes (compact rows; with
    the float too where the conv holds a block's add: "planes+float", the only planes a residual epilogue
    writes), so the linears read the flattened planes as a view, with no float flatten or quantize pass between.
    Needs rows of whole words (C % 32 == 0) that flatten into the GEMM's padded rows (in_features % 512 == 0)."""
    a = qmods[node.target]
    lins = [qmods[u.target] for u in flat.users]  # QLinears (_fuse_flatten's rule)
    b = lins[0]
    if a.precision.fp8 or kind_of(b) != "bitserial" or a.out_channels % 32 or b.in_features % 512 \
            or any(kind_of(o) != "bitserial" or o.a_fmt != b.a_fmt or not torch.equal(o.in_scale, b.in_scale)
                   for o in lins[1:]):
        return
    to = ", ".join(u.target for u in flat.users) + " (flatten_nhwc)"
    if a.has_residual:
        if not _dual_planes_ok(a, b, kind_of):
            return
        a.chain_to(b, "planes+float")
        records[node.target].out = f"{str(a.out_dtype).removeprefix('torch.')} + packed {b.a_fmt} -> {to}"
    else:
        a.chain_to(b, "compact")
        records[node.target].out = f"packed {b.a_fmt} -> {to}"


def _fuse_max_pools(gm: fx.GraphModule, qmods: dict, calls: dict, kind_of, notes: list, records: dict) -> None:
    """A max-pool read only by quantized convs -- as their input ``x``, agreeing on the input format, scale, weight
    format, kernel kind and row layout, and as the residual a conv's epilogue adds -- becomes a ``QMaxPool2d``: one
    pass pools and writes the readers' operand (and the pooled float, for the residual adds), instead of torch's pool
    writing the pooled float and each reader quantizing it (docs/decisions/0137).  A ResNet's stem pool: read by the
    first block's conv1 and its 1x1 shortcut (ResNet-50) or identity add (ResNet-18).  Where the readers are bit-serial,
    need no float (no residual add) and the pool's one input is a quantized integer conv read by nothing else (the
    ResNet-50 stem), that conv writes the readers' codes as compact bit planes and the pool takes the max of the codes
    (``QMaxPool2d.planes_in``: the codes of the pooled float, as quantizing is monotone; docs/decisions/0172).  Said
    in the summary's notes."""
    for node in gm.graph.nodes:
        m = qmods.get(node.target) if node.op == "call_module" else None
        if type(m) is not nn.MaxPool2d or calls.get(node.target) != 1 or m.ceil_mode or m.return_indices \
                or m.dilation not in (1, (1, 1)):
            continue
        users = list(node.users)
        if not all(u.op == "call_module" and isinstance(qmods.get(u.target), QConv2d) and u.args and not u.kwargs
                   for u in users):
            continue
        x_users = [u for u in users if u.args[0] is node and node not in u.args[1:]]
        r_users = [u for u in users if u.args[0] is not node and node in u.args[1:]]  # residual adds fused in a conv
        if not x_users or len(x_users) + len(r_users) != len(users):
            continue
        readers = [qmods[u.target] for u in x_users]
        b = readers[0]
        kind = kind_of(b)
        if kind not in ("bitserial", "int8", "fp8") or any(
                kind_of(o) != kind or o.a_fmt != b.a_fmt or o.w_fmt != b.w_fmt or o.backend != b.backend
                or not torch.equal(o.in_scale, b.in_scale) or o.reads_compact != b.reads_compact for o in readers[1:]):
            continue
        q = QMaxPool2d(m, b, compact=kind == "bitserial" and b.reads_compact, with_float=bool(r_users))
        _set_module(gm, node.target, q)
        qmods[node.target] = q
        (kh, kw), (sh, sw), (ph, pw) = q.window
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        a = qmods.get(src.target) if src is not None and src.op == "call_module" else None
        if kind == "bitserial" and not r_users and isinstance(a, QConv2d) and calls.get(src.target) == 1 \
                and list(src.users) == [node] and kind_of(a) in ("int8", "bitserial") and not a.precision.fp8 \
                and not a.has_residual and a.out_fmt is None and b.a_fmt.bits <= 3:
            # the producer (a ResNet stem) writes the readers' codes as compact planes and the pool takes the max of
            # the codes (exact: quantizing is monotone) -- 2-bit planes instead of its 16-bit float written and read
            # again (ResNet-50 w1a2 at batch 256: 51 MB for 411 MB; docs/decisions/0172)
            a.chain_to(b, "compact")
            q.planes_in = True
            records[src.target].out = f"packed {b.a_fmt} -> {node.target} (max-pool of the codes)"
            notes.append(f"{node.target}: max-pool {kh}x{kw} / {sh} (padding {ph}) of {src.target}'s {b.a_fmt} "
                         f"codes: {src.target} writes its readers' operand as bit planes and the pool takes the max "
                         f"of the codes for {', '.join(u.target for u in x_users)} (the codes of the pooled float)")
            continue
        notes.append(f"{node.target}: max-pool {kh}x{kw} / {sh} (padding {ph}) fused with its readers' input "
                     f"quantization ({', '.join(u.target for u in x_users)}): one pass writes their "
                     f"{'e4m3' if b.precision.fp8 else b.a_fmt} operand"
                     + (f" and the pooled float for {', '.join(u.target for u in r_users)}'s residual add"
                        if r_users else ""))


def _fuse_layer_norms(gm: fx.GraphModule, qmods: dict, calls: dict, kind_of, notes: list) -> None:
    """An ``nn.LayerNorm`` over the last dimension read only by quantized linears -- each taking it as its one input,
    all agreeing on the precision, input format, scale, weight format and kernel kind, which must be the INT8 or FP8
    kernel -- becomes a ``QLayerNorm``: one pass normalises and writes the readers' operand, instead of torch's
    LayerNorm writing the float and each reader quantizing it (docs/decisions/0162).  A pre-norm transformer layer's
    ``norm1`` (read by the attention's fused ``qkv_proj``: nn/attention.py fuse_qkv) and ``norm2`` (read by
    ``linear1``); torchvision's ViT ``ln_1`` / ``ln_2`` likewise.  A LayerNorm with any other reader (a residual add,
    a float layer: the speed rule's or the config's) stays torch's.  Said in the summary's notes."""
    for node in gm.graph.nodes:
        m = qmods.get(node.target) if node.op == "call_module" else None
        if type(m) is not nn.LayerNorm or calls.get(node.target) != 1 or len(m.normalized_shape) != 1 \
                or m.normalized_shape[0] > LAYER_NORM_MAX_C:
            continue
        users = list(node.users)
        if not users or not all(u.op == "call_module" and isinstance(qmods.get(u.target), QLinear)
                                and u.args == (node,) and not u.kwargs for u in users):
            continue
        readers = [qmods[u.target] for u in users]
        b = readers[0]
        kind = kind_of(b)
        if kind not in ("int8", "fp8") or any(
                kind_of(o) != kind or o.precision != b.precision or o.a_fmt != b.a_fmt or o.w_fmt != b.w_fmt
                or o.backend != b.backend or not torch.equal(o.in_scale, b.in_scale) or o.in_channels_last is not None
                or o.in_features != m.normalized_shape[0] for o in readers):
            continue
        q = QLayerNorm(m, b)
        _set_module(gm, node.target, q)
        qmods[node.target] = q
        notes.append(f"{node.target}: LayerNorm({m.normalized_shape[0]}) fused with its readers' input quantization "
                     f"({', '.join(u.target for u in users)}): one pass writes their "
                     f"{'e4m3' if b.precision.fp8 else b.a_fmt} operand")


def _wgmma_refusal(plan) -> str:
    """Why ``plan`` (a linear's GEMM plan) is not on the ``wgmma-gemm`` route, as its reason says ("" if it does not)."""
    return plan.reason.partition(f"; not {WGMMA_GEMM}: ")[2]


def _note_apart(notes: list, apart: dict, what: str, where: str) -> None:
    """One note per reason of ``apart`` (reason -> the pairs a fusion left apart for it): ``"<n> <what> (<the first
    three pairs> ...): <where>; here not wgmma-gemm: <reason>"``."""
    for why, pairs in apart.items():
        notes.append(f"{len(pairs)} {what} ({', '.join(pairs[:3])}" + (" ..." if len(pairs) > 3 else "")
                     + f"): {where}; here not {WGMMA_GEMM}: {why}")


def _route_text(q: nn.Module, caps) -> str:
    """A ``QLinear`` on the INT8 backend: the route its GEMM takes on ``caps``'s device and why, for the summary
    (``wgmma-gemm`` -- ``kernels/cuda/i8_gemm.cu`` -- or the Triton kernel and why not the other); "" otherwise."""
    if not isinstance(q, QLinear) or q.precision.fp8 or q.layer_plan is None or q.layer_plan.backend != "int8":
        return ""
    plan = q.gemm_plan(caps)
    if plan.route == WGMMA_GEMM:
        return f"{WGMMA_GEMM} (kernels/cuda/i8_gemm.cu, sm_90a)"
    why = _wgmma_refusal(plan)
    name = "triton" if plan.route == "kernel" else plan.route
    return f"{name} (not {WGMMA_GEMM}: {why})" if why else name


def _chain_ffn(gm: fx.GraphModule, qmods: dict, calls: dict, kind_of, caps, records: dict, notes: list) -> None:
    """A transformer's feed-forward ``linear1 -> erf GELU -> (eval-mode Dropout ->) linear2``, both quantized INT8
    linears: where both run the ``wgmma-gemm`` route (``ops.qconv_plan.wgmma_gemm_refusal``: an sm_90 GPU, fp16,
    values-as-codes operands, K % 16 == 0) and linear2 reads ``int8`` codes, linear1 takes the GELU into its epilogue
    and writes linear2's int8 operand (``i8_gemm(..., gelu=True, out_scale=linear2.in_scale)``): no GELU pass over the
    (B * L, 4E) output, no quantize pass in linear2, no float tensor between them.  On the Triton route they stay
    apart: the Triton epilogue with the GELU and the codes measured slower than the two passes it removes
    (docs/decisions/0125); the summary's notes say so, and why the wgmma route was not taken.  The codes are those of
    the float32 GELU, not of its fp16 rounding: they can differ from the unchained pair's by one step, rarely."""
    g = gm.graph
    apart: dict[str, list[str]] = {}
    for node in list(g.nodes):
        a = qmods.get(node.target) if node.op == "call_module" else None
        if not isinstance(a, QLinear) or calls.get(node.target) != 1 or node.kwargs:
            continue
        gelu = _sole_user(node)
        if gelu is None or not is_erf_gelu(gelu, qmods) or gelu.args[0] is not node:
            continue
        drops, prev, u = [], gelu, _sole_user(gelu)
        while u is not None and u.op == "call_module" and type(qmods.get(u.target)) is nn.Dropout \
                and u.args == (prev,) and not u.kwargs:
            drops.append(u)
            prev, u = u, _sole_user(u)
        b = qmods.get(u.target) if u is not None and u.op == "call_module" else None
        if not isinstance(b, QLinear) or calls.get(u.target) != 1 or u.args[:1] != (prev,) or u.kwargs \
                or len(u.args) != 1 + b.has_residual or b.in_channels_last is not None:  # (linear2, x: the residual)
            continue
        if kind_of(a) != "int8" or kind_of(b) != "int8" or a.act is not None or a.out_fmt is not None \
                or a.has_residual:
            continue  # (FP8 / bit-serial / reference linears: float in, float out, the GELU a float op)
        pa = a.gemm_plan(caps, act=None, out_fmt=b.a_fmt, out_layout="int8")  # (the GELU: on this route only)
        pb = b.gemm_plan(caps)
        if pa.route != WGMMA_GEMM or pb.route != WGMMA_GEMM:
            p = pa if pa.route != WGMMA_GEMM else pb
            apart.setdefault(_wgmma_refusal(p) or p.route, []).append(f"{node.target} -> {u.target}")
            continue
        a.act = GELU
        a.chain_to(b, "int8")
        for d in [*drops, gelu]:  # the dropouts (eval: the identity) and the GELU, now in linear1's epilogue
            d.replace_all_uses_with(d.args[0])
            g.erase_node(d)
        rec = records[node.target]
        rec.fused = rec.fused + ("gelu",)
        rec.out = f"int8 codes {b.a_fmt} -> {u.target}"
        rec.route = _route_text(a, caps)
    _note_apart(notes, apart, "feed-forward pair(s) linear -> GELU -> linear not chained",
                f"the GELU and linear2's int8 codes go into linear1's epilogue on the {WGMMA_GEMM} route only (on the "
                "Triton route that epilogue measured slower than the two passes, docs/decisions/0125)")


def _chain_to_grouped(node: fx.Node, user: fx.Node, qmods: dict, records: dict, kind_of) -> bool:
    """A conv read only by an integer grouped / depthwise conv on the Triton route writes that layer's int8 operand
    (``ShiftedInt8``: its format and scale) in its epilogue, instead of a float the grouped layer quantizes again (an
    MBConv block's expand conv; its ReLU6 is left to the quantizer, ``_absorb_clamps``).  True when chained."""
    a, b = qmods[node.target], qmods.get(user.target) if user.op == "call_module" else None
    if not isinstance(b, QGroupedConv2d) or b.precision.fp8 or user.args[0] is not node or len(user.args) != 1 \
            or user.kwargs or b.route[0] != "triton":
        return False
    if a.has_residual and kind_of(a) == "bitserial":
        return False  # (a bit-serial conv with a residual writes a float output, and its planes only)
    a.chain_to(b, "int8")
    records[node.target].out = f"int8 codes {b.a_fmt} -> {user.target}"
    return True


def _record_chains(g: fx.Graph, qmods: dict, kind_of) -> None:
    """Each quantized layer whose input a chained producer writes (directly or through ``flatten_nhwc``) keeps that
    layout and its own kind in its plan (``QConv2d.chained_from``), so a device move can tell a chain it breaks."""
    for node in g.nodes:
        m = qmods.get(node.target) if node.op == "call_module" else None
        if not isinstance(m, (QConv2d, QLinear)) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0]
        if src.op == "call_function" and src.target is flatten_nhwc and isinstance(src.args[0], fx.Node):
            src = src.args[0]
        p = qmods.get(src.target) if src.op == "call_module" else None
        if isinstance(p, (QConv2d, QLinear)) and p.out_fmt is not None and m.layer_plan is not None:
            m.chained_from(p.out_layout, kind_of(m))


def _weight_fmt(prec: LayerPrecision, grid: str):
    return weight_format(prec) if prec.fp8 else cal.weight_format_for(prec.w_bits, grid)


def _regrid(q, float_layer: nn.Module, fmt) -> None:
    """Re-quantize a QConv2d / QLinear's weight on another grid (pmN), the same per-channel absmax rule."""
    w = float_layer.weight.detach()
    w = w.permute(0, 2, 3, 1).contiguous() if isinstance(q, QConv2d) else w[:, None, None, :]  # (K, R, S, C)
    q.w_fmt = fmt
    q.weight = _quantize_weight(w, fmt)  # buffers weight_codes / weight_scale, packed lazily


def _calibration_call(cfg: QuantConfig, gm, order, batches, stats, precision_of, mods):
    """The config's calibration on top of the absmax pass: activation clips (integer layers; FP8 layers keep
    absmax, whose 448 maps onto e4m3's range), per-channel weight clip ratios, bias-correction deltas."""
    obs = cfg.activation_observer
    layers = [n for n in order if precision_of(n) is not None and not _unsupported(mods[n])]
    ints = [n for n in layers if not precision_of(n).fp8]
    if obs.method != "absmax" and ints:
        a_fmt = lambda n: activation_format(precision_of(n), stats[n][1])  # noqa: E731
        clips = cal.activation_clips(gm, ints, batches, {n: stats[n][0] for n in ints}, obs, a_fmt)
        stats = {**stats, **{n: (clips[n], stats[n][1]) for n in ints}}
    w_ratio = {}
    if cfg.weight_clip == "mse":
        w_ratio = {n: cal.weight_clip_ratio(mods[n].weight, _weight_fmt(precision_of(n), cfg.weight_grid))
                   for n in ints}

    def clipped(n):
        w = mods[n].weight.detach().float()
        if n in w_ratio:
            lim = (w.flatten(1).abs().amax(1) * w_ratio[n]).view(-1, *([1] * (w.dim() - 1)))
            w = torch.maximum(torch.minimum(w, lim), -lim)
        return w

    def a_quant(n, x):  # the layer's input as its quantized layer sees it
        f = activation_format(precision_of(n), stats[n][1])
        s = max(float(stats[n][0]), 1e-8) / absmax_qmax(f)
        if precision_of(n).fp8:
            return (x / s).clamp(-f.max, f.max).to(torch.float8_e4m3fn).float() * s
        return torch.round(x / s).clamp(f.min, f.max) * s

    def w_nearest(n):
        return cal.dequantized_weight(clipped(n), _weight_fmt(precision_of(n), cfg.weight_grid))

    w_round, deltas = {}, {}
    ada = cal.as_rounding(cfg.weight_rounding)
    rounded = [n for n in layers if 2 <= precision_of(n).w_bits <= ada.max_bits] if ada is not None else []  # fp8: 8
    w_fmt = lambda n: _weight_fmt(precision_of(n), cfg.weight_grid)  # noqa: E731
    if rounded and ada.inputs == "quantized":  # every layer solved on the quantized model's input, in model order
        w_round, deltas = cal.adaround_lockstep(gm, layers, set(rounded), batches, clipped, w_nearest, w_fmt,
                                                a_quant, ada, cfg.bias_correction)
        return stats, w_ratio, deltas, w_round
    if rounded:
        w_round = cal.adaround_weights(gm, rounded, batches, clipped, w_fmt, a_quant, ada)
    if cfg.bias_correction and layers:
        deltas = cal.bias_deltas(gm, layers, batches, lambda n: w_round[n] if n in w_round else w_nearest(n))
    return stats, w_ratio, deltas, w_round


def _views_to_reshapes(g: fx.Graph) -> None:
    """``x.view(shape)`` -> ``x.reshape(shape)``: a quantized conv's output is NCHW over channels_last memory (and so
    is any elementwise op or pool of it), where a view that merges C with H, W (LeNet / AlexNet's
    ``x.view(x.size(0), -1)``) fails; reshape gives the same values, as a view wherever one exists.  (A
    ``view(dtype)`` reinterprets bits and stays.)"""
    for n in g.nodes:
        if n.op == "call_method" and n.target == "view" and not n.kwargs.get("dtype") \
                and not any(isinstance(a, torch.dtype) for a in n.args[1:]):
            n.target = "reshape"


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def quantize_model(model: nn.Module, config: QuantConfig | str = "w1a2", *, calibration=None,
                   inplace: bool = False, warn: bool = True, fixed: Mapping[str, FixedQuant] | None = None
                   ) -> nn.Module:
    """A quantized copy of ``model`` for inference (``torch.fx.GraphModule`` when the model traces; a copy of the
    model itself when it is one torch transformer module whose every linear stays float: docs/decisions/0131).

    ``config``: a :class:`QuantConfig` or a precision string (``"w1a2"``, ``"w2a2"``, ``"int8"``, ``"fp8"``...).
    ``calibration``: a sample batch (or a list of batches) on the model's device; a batch may be a dict of keyword
    arguments (``{"src": x, "mask": causal}``), run as ``model(**batch)``: calibrate with the masks you run with.
    ``fixed``: module name -> :class:`~tcprec.nn.qmodules.FixedQuant`, a layer whose activation scale, weight
    codes and epilogue were decided elsewhere (``tcprec.convert_qat``): used as given, not calibrated.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
    ...                         torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
    ...                         torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    >>> q = quantize_model(m, "w2a2", calibration=torch.randn(2, 3, 4, 4))
    >>> [(r.name, r.precision) for r in q.tcprec_summary.layers]
    [('0', 'w8a8'), ('2', 'w2a2'), ('5', 'w8a8')]
    """
    cfg = QuantConfig(precision=config) if isinstance(config, str) else config
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"config must be a QuantConfig or a precision string like 'w1a2', got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batches = _batches(calibration)
    wide = sorted({str(t.dtype) for t in (*model.parameters(), *model.buffers())
                   if t.is_floating_point() and t.dtype not in (torch.float32, torch.float16, torch.bfloat16)})
    if wide:
        raise ValueError(f"model has {'/'.join(wide)} parameters or buffers; quantized layers compute in float32 and "
                         "output float32, float16 or bfloat16: quantize a float32 copy (quantize_model(model.float(), "
                         "...)) and cast its output if you need float64")
    if cfg.speed_rule.mode == "measured":  # convert, time, float the slower layers, convert again (nn/speed_rule.py)
        if inplace:
            raise ValueError("inplace=True cannot be combined with speed_rule='measured': the rule converts the float "
                             "model more than once; use inplace=False (the default)")
        q = apply_speed_rule(model, cfg, batches, lambda c, probe: _convert(model, c, batches, False, False, fixed,
                                                                           probe))
        if warn:
            _warn_float(q.tcprec_summary, stacklevel=3)
        return q
    return _convert(model, cfg, batches, inplace, warn, fixed, None)


def _convert(model: nn.Module, cfg: QuantConfig, batches, inplace: bool, warn: bool, fixed, probe) -> nn.Module:
    """quantize_model without the speed rule; ``probe(gm, order)`` (the rule's) sees the calibrated float graph."""
    named_in = dict(model.named_modules())  # the original's module tree, for the coverage listing
    theirs = None if inplace else _tensor_storages(model)
    model = model if inplace else _copy_modules(model)
    model.eval()
    notes: list[str] = []
    # nn.MultiheadAttention / nn.TransformerEncoder(Layer) -> their Python path with plain nn.Linear projections and
    # the attention in F.scaled_dot_product_attention (nn/attention.py, docs/decisions/0081); torchvision's Swin
    # attention -> qkv / proj as nn.Linear around the window attention (nn/window_attention.py, decisions/0161)
    originals: dict[str, nn.Module] = {}  # name -> the torch module swapped there (for restore_torch_modules)
    model, attentions = decompose_transformers(model, originals)
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
        gm: nn.Module = fx.GraphModule(model, graph, model.__class__.__name__)
        traced = True
    except Exception as e:  # noqa: BLE001 - any tracing failure: fall back to the module swap, and say so
        gm, traced = model, False
        notes.append(f"torch.fx could not trace the model ({type(e).__name__}: {str(e)[:120]}); layers were swapped "
                     "one by one with float input and output, without fusion or chaining")
    if traced:  # F.conv2d / F.linear / Conv1d / zero pads -> plain modules (nn/coverage.py)
        notes += normalize_graph(gm)
    mods = dict(gm.named_modules())
    unknown = [k for k in cfg.overrides if k not in mods]
    if unknown:
        raise ValueError(f"overrides name no module of the model: {unknown}; names look like {list(mods)[1:6]}")
    bad = [k for k in (fixed or {}) if not isinstance(mods.get(k), (nn.Conv2d, nn.Linear))]
    if bad:
        raise ValueError(f"fixed names no nn.Conv2d / nn.Linear of the model: {bad}")

    order = _candidates(gm, mods, traced)
    stats = _calibrate(gm, order, batches, shapes=traced, notes=notes)
    if probe is not None:
        probe(gm, order)
    precision_of = _precision_rule(cfg, order, mods, gm if traced else None)
    if cfg.clamped_inputs is not None and not traced:
        notes.append(f"clamped_inputs={cfg.clamped_inputs!r} not applied: the model did not trace, so no layer's input "
                     "is known to be a clamp activation's output")
    kept_torch: dict[str, list[str]] = {}
    if traced and originals:  # every linear of a swapped module float: the user's own torch module, its fast path
        gm, kept_torch = restore_torch_modules(gm, tracer.twin_calls, originals, order,
                                               lambda n: precision_of(n) is None)
        if kept_torch:  # (the decomposition note below lists the attentions that stay decomposed)
            notes.append(f"{len(kept_torch)} torch module(s) kept as the model's own, every linear in them float "
                         "(torch's forward and fast path): " + ", ".join(
                             f"{p or '<model>'} ({type(originals[p]).__name__})" for p in list(kept_torch)[:3])
                         + (" ..." if len(kept_torch) > 3 else ""))
    live = [a for a in attentions if not any(not p or a == p or a.startswith(p + ".") for p in kept_torch)]
    if live:
        notes.insert(0, f"{len(live)} attention module(s) decomposed: the projections as linears (q/k/v/out; Swin's "
                        f"qkv / proj), the attention itself in float ({', '.join(live[:3])}"
                        + (" ..." if len(live) > 3 else "") + ")")
    dev = next((p.device for p in gm.parameters()), torch.device("cpu"))
    caps = device_caps(dev)  # each layer's backend is decided once, on this device (QConv2d.plan_on)

    # -- calibration beyond absmax, weight clipping and bias correction (nn/calibrate.py) -------------------
    stats, w_ratio, deltas, w_round = _calibration_call(cfg, gm, order, batches, stats, precision_of, mods)

    records: dict[str, LayerRecord] = {}
    for path, names in kept_torch.items():
        for n in names:
            records[n] = LayerRecord(n, "conv" if isinstance(mods[n], nn.Conv2d) else "linear", "float",
                                     "kept in float (config)", out=f"in torch's own {type(originals[path]).__name__} "
                                     f"{path or '<model>'} (every linear in it float: torch's forward)")
    new_mods: dict[str, nn.Module] = {}
    # conv / linear layers of kinds with no quantized path (Conv1d, Conv3d, transposed convs, Linear subclasses):
    # listed as float in the summary and the warning, never dropped silently
    no_path = [n for n, m in gm.named_modules() if n and n not in order and (
        isinstance(m, nn.modules.conv._ConvNd) or isinstance(m, nn.Linear) or type(m) is nn.Bilinear)]
    for n in no_path:
        m = mods[n]
        records[n] = LayerRecord(n, "conv" if isinstance(m, nn.modules.conv._ConvNd) else "linear", "float",
                                 f"no quantized {type(m).__name__} (QConv2d / QLinear cover nn.Conv2d / nn.Linear)")

    def make(name: str, bn=None, act=None, pool=None) -> nn.Module | None:
        m = mods[name]
        kind = "conv" if isinstance(m, nn.Conv2d) else "linear"
        prec = precision_of(name)
        why = _unsupported(m) or (grouped_unsupported(m, prec) if kind == "conv" and m.groups != 1 else None)
        absmax, neg = stats.get(name, (0.0, False))
        if prec is None or why:
            records[name] = LayerRecord(name, kind, "float", why or "kept in float (config)")
            return None
        fx_ = fixed.get(name) if fixed else None
        wfmt = _weight_fmt(prec, cfg.weight_grid)
        if name in w_ratio or name in deltas or name in w_round:
            m = cal.prepared_float_layer(m, w_ratio.get(name), deltas.get(name), w_round.get(name))
        if kind == "conv" and m.groups != 1:
            if fx_ is not None:
                raise ValueError(f"fixed quantization of {name!r}: a grouped conv (groups={m.groups}) takes its "
                                 "weights from the float layer; leave it out of fixed")
            q = QGroupedConv2d.from_float(m, prec, w_fmt=wfmt, in_absmax=absmax, signed_input=neg, bn=bn, act=act,
                                          backend={"reference": "reference", "int8": "triton"}.get(cfg.backend, "auto"))
            backend = q.route[0]
        elif kind == "conv":
            q = QConv2d.from_float(m, prec, in_absmax=absmax, signed_input=neg, bn=bn, act=act, pool=pool,
                                   backend=cfg.backend, fixed=fx_)
        else:
            q = QLinear.from_float(m, prec, in_absmax=absmax, signed_input=neg, act=act, backend=cfg.backend,
                                   fixed=fx_)
        if not isinstance(q, QGroupedConv2d):
            if wfmt != q.w_fmt and fx_ is None:
                _regrid(q, m, wfmt)
            q.fp8_fast_accum = cfg.fp8_accum == "fast"
            plan = q.plan_on(dev, name, caps)
            backend = "fp8" if prec.fp8 else plan.backend
        fused = tuple(x for x in (getattr(m, "tcprec_pad_folded", None) and "pad", bn is not None and "bn",
                                  act_text(act), pool and f"{pool[0]}pool") if x)
        records[name] = LayerRecord(name, kind, str(prec), backend, fused, str(q.out_dtype).replace("torch.", ""),
                                    route=_route_text(q, caps))
        new_mods[name] = q
        return q

    def fusable_act(name: str, m: nn.Module, act) -> bool:
        """Whether layer ``name``'s epilogue applies activation ``act`` (``_act_of``): a linear's ReLU; a grouped conv's
        every one; a dense conv's unless it runs the bit-serial GEMM where the binary kernel runs, whose epilogue has
        no clamp, hardswish or SiLU (``layer_act_unsupported``): then the activation stays a float op after it."""
        if act is None or not isinstance(m, nn.Conv2d):
            return act == "relu"
        if m.groups != 1:
            return True
        prec, fx_ = precision_of(name), (fixed or {}).get(name)
        a_fmt = activation_format(prec, fx_.signed_input if fx_ is not None else stats.get(name, (0.0, False))[1])
        w_fmt = fx_.weight.fmt if fx_ is not None else _weight_fmt(prec, cfg.weight_grid)
        return layer_act_unsupported(act, a_fmt, w_fmt, cfg.backend) is None

    if traced and "" not in kept_torch:  # (the whole model is torch's own: nothing to convert)
        g = gm.graph
        for node in list(g.nodes):  # nn.Identity (a block's identity shortcut) is its input: its readers read that
            if node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.Identity and len(node.args) == 1 \
                    and not node.kwargs:
                node.replace_all_uses_with(node.args[0])
                g.erase_node(node)
        _views_to_reshapes(g)
        calls = _module_calls(g)
        for node in list(g.nodes):
            if node.op != "call_module" or node.target not in order or node.target in records:
                continue
            m = mods[node.target]
            absorbed: list[fx.Node] = []
            bn = act = pool = None
            cur = node
            # a module called from several places is one module: fusing what follows one call would apply it
            # after every call, so a shared layer keeps its BN / activation / pool as separate float ops
            if cfg.fuse and calls[node.target] == 1 and precision_of(node.target) is not None and not _unsupported(m):
                u = _sole_user(cur)
                if _fusable_bn(m, u, mods):
                    bn, cur = mods[u.target], u
                    absorbed.append(u)
                    u = _sole_user(cur)
                grouped = isinstance(m, nn.Conv2d) and m.groups != 1
                if u is not None and fusable_act(node.target, m, _act_of(u, mods)):
                    act, cur = _act_of(u, mods), u
                    absorbed.append(u)
                    u = _sole_user(cur)
                if isinstance(m, nn.Conv2d) and not grouped and u is not None and _pool_of(u, mods) is not None:
                    pool, cur = _pool_of(u, mods), u
                    absorbed.append(u)
            q = make(node.target, bn, act, pool)
            if q is None:
                if cfg.fuse and calls[node.target] == 1:
                    _fuse_float_gelu(gm, node, mods, records)  # a linear kept float: one GEMM with its GELU
                continue
            _set_module(gm, node.target, q)
            if absorbed:
                absorbed[-1].replace_all_uses_with(node)
                for a in reversed(absorbed):
                    g.erase_node(a)
        if cfg.fuse and attentions:
            fuse_qkv(gm, records)  # self-attention's q / k / v: one GEMM (nn/attention.py)
        if cfg.fuse and cfg.fuse_residual:
            _fuse_residuals(gm, records)
            _fuse_linear_residuals(gm, records, caps, notes)
        if cfg.fuse and cfg.fuse_flatten:
            _fuse_flatten(gm, records)
        if cfg.fuse:
            _absorb_clamps(gm, notes)
        # -- chaining: a conv feeding only a bit-serial conv hands it packed planes -------------------
        if cfg.chain:
            qmods = dict(gm.named_modules())

            def kind_of(m: QConv2d) -> str:  # the backend decided at conversion (fp8: float8 codes on any device)
                return "fp8" if m.precision.fp8 else m.layer_plan.backend

            def is_qconv(n: fx.Node) -> bool:
                return n.op == "call_module" and isinstance(qmods.get(n.target), QConv2d)

            calls = _module_calls(g)
            for node in g.nodes:
                if not is_qconv(node) or calls[node.target] != 1:
                    continue  # (a shared conv's output format would change at every call site)
                users = list(node.users)
                if len(users) == 1 and users[0].op == "call_function" and users[0].target is flatten_nhwc:
                    _chain_through_flatten(node, users[0], qmods, records, kind_of)
                    continue
                if len(users) == 1 and _chain_to_grouped(node, users[0], qmods, records, kind_of):
                    continue
                x_users = [u for u in users if is_qconv(u) and u.args[0] is node and node not in u.args[1:]]
                r_users = [u for u in users if is_qconv(u) and node in u.args[1:] and u.args[0] is not node]
                if not x_users or len(x_users) + len(r_users) != len(users):
                    continue  # some consumer needs the float tensor
                a, b = qmods[node.target], qmods[x_users[0].target]
                kind = kind_of(b)
                if kind not in ("bitserial", "int8", "fp8"):
                    continue  # the reference backend: float in, float out
                if a.precision.fp8 != b.precision.fp8 and {kind_of(a), kind} != {"int8", "fp8"}:
                    # across kinds only between the 8-bit kernels, which share the epilogue: an INT8 layer writes
                    # e4m3 codes (OUT_MODE 4 / the pool + fp8 pass), an FP8 layer int8 codes (OUT_MODE 2); the
                    # binary GEMM's epilogue packs integer planes only
                    continue
                others = [qmods[u.target] for u in x_users[1:]]
                to = ", ".join(u.target for u in x_users)
                if kind == "bitserial":  # bit planes for every consumer, when they agree on format and scale
                    if any(kind_of(o) != kind or o.a_fmt != b.a_fmt or not torch.equal(o.in_scale, b.in_scale)
                           for o in others):
                        continue
                    gather = all(o.reads_compact for o in [b] + others)
                    if a.has_residual or r_users:
                        # the float too (a residual add reads it), or a block's add in the producer: the binary GEMM's
                        # epilogue writes the float output and its compact planes ("planes+float", <= 3 bits); so does
                        # an 8-bit thin stem's on sm_90 (stem_conv.cu: ResNet-18's), and other INT8 layers pack their
                        # float in one pass after it (what the readers would do, once).  A 1x1 reader (a bottleneck's
                        # conv1) takes them too: its GEMM pads the rows to whole 512-bit words, a copy of the planes
                        # (none where C % 512 == 0), instead of a quantize pass over the float (docs/decisions/0136)
                        if not _dual_planes_ok(a, b, kind_of):
                            continue
                        a.chain_to(b, "planes+float")
                        records[node.target].out = f"{str(a.out_dtype).removeprefix('torch.')} + packed {b.a_fmt} -> {to}"
                    else:
                        a.chain_to(b, "compact" if gather else "planes")
                        records[node.target].out = f"packed {b.a_fmt} -> {to}"
                    continue
                if len(users) == 1 and not (a.has_residual and kind_of(a) == "bitserial"):
                    # (a bit-serial conv with a residual writes a float output, and its planes only)
                    a.chain_to(b, "int8" if kind == "int8" else "planes")  # the INT8 kernel reads int8 codes
                    what = {"int8": "int8 codes", "fp8": "codes"}[kind]
                    records[node.target].out = f"{what} {b.a_fmt} -> {x_users[0].target}"
                    continue
                # several INT8 / FP8 consumers of one tensor (a ResNet stage's conv1 and 1x1 shortcut; residual
                # adds): one set of codes when they agree on the calibrated format and scale, plus the float for
                # the adds (the dual output: the QTensor's hp)
                if any(kind_of(o) != kind or o.a_fmt != b.a_fmt or not torch.equal(o.in_scale, b.in_scale)
                       for o in others):
                    continue
                if r_users and kind_of(a) == "bitserial":
                    continue  # (the binary GEMM's dual output writes planes, not int8 / float8 codes)
                if kind == "int8":
                    a.chain_to(b, "int8+float" if r_users else "int8")
                else:  # float8 codes are a plain QTensor, which any number of FP8 convs read
                    a.chain_to(b, "fp8+float" if r_users else "planes")
                dual = f"{str(a.out_dtype).removeprefix('torch.')} + " if r_users else ""
                what = "int8 codes" if kind == "int8" else "codes"
                records[node.target].out = f"{dual}{what} {b.a_fmt} -> {to}"
            _fuse_max_pools(gm, qmods, calls, kind_of, notes, records)
            _fuse_layer_norms(gm, qmods, calls, kind_of, notes)
            _chain_ffn(gm, qmods, calls, kind_of, caps, records, notes)
            _record_chains(g, qmods, kind_of)
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    elif not traced:
        for name in order:
            q = make(name)
            if q is not None:
                if isinstance(q, QConv2d):
                    q.contiguous_out = True  # its readers are unknown: plain NCHW memory, so x.view(n, -1) works
                _set_module(gm, name, q)

    covered = set(records) - set(no_path)
    covered |= {a for a in attentions if all(f"{a}.{p}_proj" in covered for p in "qkv")}  # (its in_proj_weight)
    extra = uncovered(named_in, gm, covered)  # never silent (nn/coverage.py), with reasons
    listed = {n for n, _, _ in extra}
    drop = {n for n in no_path if any(n == p or n.startswith(p + ".") for p in listed)}
    layer_records = [records[n] for n in order + no_path if n in records and n not in drop]
    for name, kind, why in extra:
        if name in cfg.overrides and parse_precision(cfg.overrides[name]) is None:
            why = f"kept in float (config); {why}"
        layer_records.append(LayerRecord(name, kind, "float", why))
    low = [r.name for r in layer_records if isinstance(mods.get(r.name), nn.Conv2d) and mods[r.name].groups != 1
           and r.precision not in ("float", "w8a8")]
    if low and cfg.grouped is None:  # measured, not guessed: docs/decisions/0082, 0086
        notes.append(f"{len(low)} grouped / depthwise conv(s) at fp8 or below 8 bits: they run 1-byte codes on the "
                     "CUDA cores at any precision, so int8 costs no time and is far more accurate (EfficientNet-Lite0 "
                     "fp8 76.8% -> 92.6%, w4a8 62.8% -> 79.6% top-1 agreement with QuantConfig(grouped='int8'); "
                     "docs/real_models.md): " + ", ".join(low[:3])
                     + (" ..." if len(low) > 3 else ""))
    summary = QuantSummary(layer_records, traced, notes)
    check_conv_coverage(summary.layers)
    gm.tcprec_summary = summary
    if theirs is not None:
        _own_tensors(gm, theirs)
    if warn:
        _warn_float(summary, stacklevel=4)
    return gm


# The copy quantize_model works on shares the caller's float tensors and owns only what survives.  A plain
# copy.deepcopy up front held a second float model for the whole conversion -- the weights twice at the peak, beside
# the quantized codes -- though conversion only reads a weight (to quantize it, fold a BatchNorm, calibrate) and the
# quantized layers keep codes: of the copied weights only the float leftovers (norms, embeddings, layers kept float,
# biases) reach the result.  Nothing in the conversion writes a model tensor in place (nn/ computes new tensors from
# the weights), so sharing them changes no number; copying the survivors at the end keeps the returned model
# independent of the caller's, as the deepcopy did (docs/decisions/0158).


def _tensor_storages(model: nn.Module) -> set[int]:
    """The data pointers of the storages of ``model``'s parameters and buffers (what ``_own_tensors`` copies)."""
    return {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}


def _copy_modules(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` with every parameter and buffer shared, not copied (they are in the deepcopy's memo):
    new module objects, free to be swapped and re-wired, over the caller's tensors."""
    memo: dict = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def _own_tensors(root: nn.Module, theirs: set[int]) -> None:
    """Replace every parameter and buffer of ``root`` whose storage is one of ``theirs`` (the caller's model's) by
    ``copy.deepcopy`` of it, through one memo (a tensor registered in several modules stays one tensor): float
    parameters kept as they were, and the quantized layers' float buffers that alias one (a bias ``.float()`` left as
    it was), so the result shares no memory with the caller's model."""
    memo: dict = {}
    for mod in root.modules():
        for tensors in (mod._parameters, mod._buffers):
            for k, t in tensors.items():
                if t is not None and t.untyped_storage().data_ptr() in theirs:
                    tensors[k] = copy.deepcopy(t, memo)


def _warn_float(summary: QuantSummary, stacklevel: int) -> None:
    """The warning listing every layer that stays float (with why) and the notes."""
    notes = summary.notes
    if summary.float_layers or notes:
        kept = ", ".join(f"{r.name} ({r.backend})" for r in summary.float_layers)
        msg = (f"{len(summary.float_layers)} layer(s) stay in floating point: {kept}. " if kept else "") + " ".join(notes)
        warnings.warn(msg.strip(), stacklevel=stacklevel)  # (at quantize_model's caller)

