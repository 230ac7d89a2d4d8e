"""The speed rule: a quantized model is never slower than its float self, layer by layer, by measured time.

``QuantConfig(speed_rule="measured")`` (or ``SpeedRule(batch=256)``) makes ``quantize_model`` time what it built, the
way TensorRT's builder picks a tactic per layer by timing:

1. convert as usual (``speed_rule="off"`` inside), and record every conv / linear's float input shape at the timing
   batch (the first calibration batch, its rows repeated to ``SpeedRule.batch``);
2. time each quantized layer *as the converted model runs it*: its real operand (a float tensor it quantizes and
   packs itself, or the codes / planes its chained producer wrote), its fused epilogue (BN, activation, pool, the
   residual add) and its output conversion, alone in a CUDA graph -- and the same computation in float on the
   model's dtype (the float conv / linear, channels_last, then BN, the activation, the pool and the add as the
   float model would run them: separate cuDNN / cuBLAS / elementwise kernels).  A linear whose one reader is the
   erf GELU is timed with it on both sides: the GELU pass it leaves after it quantized, against the one GEMM with
   the GELU epilogue it becomes kept float (``LinearGELU``; docs/decisions/0156);
   A fused module counts as one layer, timed as it runs: self-attention's ``qkv_proj`` (q / k / v in one quantize
   pass and one (3E, E) GEMM, nn/attention.py) against the same fused linear in float (torch's ``in_proj``); kept
   float, its three members are (``q_proj`` / ``k_proj`` / ``v_proj`` in the summary and the overrides), and they run
   as that one float GEMM.  Each distinct layer is timed once, not each layer (docs/decisions/0159): layers whose
   kernels see the same thing -- the quantized module's type and every attribute and buffer shape (precision,
   formats, geometry, backend and plan, the operand it reads and the output it writes, chained or not, its fused
   epilogue) with its operands' shapes / dtypes / strides, and on the float side the float module (type, weight
   shape, stride / padding / groups / dilation, bias, dtype), the input shapes and what the quantized one absorbed
   -- share one timing of each side a round (the float side: once), so ViT-B's 12 encoder blocks cost one block's
   timings and twin blocks get one decision; each layer keeps its own timing record, naming the layer whose time
   it took (``LayerTiming.quant_from`` / ``float_from``; its reason: ``"...; the times of layer1.0.conv1, an
   identical layer"``);
3. every layer whose quantized time is larger is kept float (an override, so the converter re-chains its
   neighbours), and the model is converted again; the layers whose operands changed are timed again, up to
   ``rounds`` conversions; a torch attention / transformer module left with no quantized linear is the user's own
   module again, torch's fast path (nn/attention.py: restore_torch_modules, docs/decisions/0131);
4. a layer-by-layer comparison misses what one quantized linear costs the module around it: torch's fused forward
   (``torch._transformer_encoder_layer_fwd``).  So each torch encoder / decoder layer, and each attention outside
   one, that still holds a quantized linear is timed whole: its nodes of the converted graph, cut out and fed what the
   converted model computes there, against the user's torch module in float called with what the float model passes
   it (timer labels: the module's name, ``"quantized"`` / ``"float"``).  Where torch's is faster, every linear in it
   is kept float, the model is converted once more and torch's module comes back (``SpeedReport.modules``, the
   linears' reasons: ``"kept fp16: its TransformerEncoderLayer layers.3 as torch's fused module 0.301 ms < quantized
   0.334 ms"``; docs/decisions/0135).  A model without such a module is not timed further;
5. a layer kept float by the rounds whose quantized form wrote a quantized reader's operand (a chain head: linear1
   with the GELU and linear2's int8 codes in its epilogue, a conv writing the next conv's codes) makes that reader
   quantize its own input again, which no per-layer timing sees: floatings that each pay alone can lose together.
   So where there is one, the model as decided is timed whole against the same model with those layers -- and the
   layers a later round kept float, whose operands a floating changed -- quantized (timer sides ``"quantized"`` / ``"quantized, chains kept"``), and the second is kept where it is faster by
   ``SpeedRule.margin`` (``SpeedReport.chain_check``; each such layer's reason: ``"w8a8 0.125 ms > fp16 0.105 ms at
   input (64,197,768), ..., but kept w8a8: the whole model ran faster with the 12 such layer(s) quantized, the chains
   they start kept (...)"``; docs/decisions/0165).  The whole-model fallback below floats them last;
6. the whole quantized model is timed against the whole float model (channels_last; with the default clock their
   two CUDA graphs replayed in turn, as the benchmarks time them: ``_time_models``).  A layer-by-layer sum misses
   what the float glue between quantized layers costs, and what a re-chained layer (one whose producer a later round
   floated, untimed after the last round) now pays; so where the whole model is not faster by ``SpeedRule.margin``
   (1%: two graphs of the same computation time ~0.3% apart), the quantized layers that saved least in their own
   timing are kept float too, a growing share at a time (``SpeedRule.fallback``: a quarter, half, three quarters,
   all of them), the model converted and timed whole again after each, until it is (their reasons: ``"kept fp16:
   the whole model was slower quantized (15.547 ms > fp16 15.339 ms); this layer saved least (w1a2 0.006 ms <= fp16
   0.007 ms at input (256,480,1,1))"``; docs/decisions/0153, 0155).  Still no faster with every layer float, the
   model itself is returned -- a copy in eval mode, the module the float side timed -- with the summary, whose notes
   say so (``SpeedReport.model_itself``); a model left slower otherwise (``fallback=()``, a layer that could not be
   timed) is said in capitals and warned.

A quantized layer whose form a later floating changed -- a chain or fusion with a neighbour kept float after the
layer's last timing (the fallback's, or the last round's): linear1's GELU and linear2's codes out of its epilogue, a
residual add or a chained operand lost -- keeps the times of the form it was timed in; its reason says what it was
timed with and what it runs with, and the notes list it (``LayerTiming.form`` / ``form_now``).

``model.tcprec_summary`` shows each decision (``LayerRecord.reason``: ``"kept fp16: w8a8 0.212 ms > fp16 0.151 ms at
input (256,32,112,112)"``), ``summary.speed`` holds the figures and ``summary.explain()`` prints them.

Timing needs the model's CUDA device: on a CPU model ``"measured"`` is a ``ValueError`` (the reference kernels' CPU
time says nothing about the GPU kernels) unless ``SpeedRule(timer=...)`` supplies the clock.  ``timer(layer, side,
fn) -> ms`` is called with the layer's name (``MODEL`` for the whole model), ``"quantized"`` or ``"float"`` (or, for
the chain check's second model, ``"quantized, chains kept"``), and a no-argument callable that runs that side once;
tests pass a fake one to drive the decision deterministically.  Of identical layers only the first (in forward order)
is named to it: the others take its figures.

The default is ``"off"`` (docs/decisions/0090): timing makes conversion depend on the clock (two conversions of one
model may float different layers, so one's ``state_dict`` need not load into the other), costs two CUDA-graph timings
per distinct layer and conversion round, and would override precisions asked for explicitly.  Ask for it where a
deployment is being built; pin its outcome with ``summary.speed.overrides()`` passed as ``QuantConfig(overrides=...)``.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..kernels.conv_geometry import ACT_LEAKY, ACT_NONE, ACT_RELU
from ..kernels.reference_conv_int8_fp8 import ACT_CLAMP, ACT_HARDSWISH, ACT_SILU, parse_act
from ..timing import graph_ms, graph_ms_alternating
from .attention import not_decomposed
from .linear_gelu import gelu_fusable, linear_gelu
from .qmodules import LayerPlan

__all__ = ["SpeedRule", "SPEED_RULES", "as_speed_rule", "SpeedReport", "LayerTiming", "ModuleTiming", "MODEL",
           "cuda_graph_timer", "apply_speed_rule"]

SPEED_RULES = ("off", "measured")
MODEL = "<model>"  # the timer's layer name for the whole model


@dataclass(frozen=True)
class SpeedRule:
    """``mode``: ``"off"`` | ``"measured"``; ``batch``: the batch (first dimension) to time at, default the first
    calibration batch's (time at the shape you deploy: a layer's winner changes with it); ``timer``: ``(layer, side,
    fn) -> ms`` (default :func:`cuda_graph_timer`, CUDA models only); ``rounds``: conversions at most (>= 1);
    ``fallback``: where the whole model is not faster than float by ``margin``, the growing shares (increasing, in
    (0, 1]) of its quantized layers, those that saved least first, kept float in turn until it is (``()``: only say
    so); ``margin``: how much faster (a fraction) the whole quantized model must time to be kept as it is -- two
    CUDA graphs of the same computation time up to ~0.3% apart on an H200, so a closer call is no measured win
    (docs/decisions/0155)."""

    mode: str = "measured"
    batch: int | None = None
    timer: Callable | None = None
    rounds: int = 2
    fallback: tuple = (0.25, 0.5, 0.75, 1.0)
    margin: float = 0.01

    def __post_init__(self):
        if self.mode not in SPEED_RULES:
            raise ValueError(f"speed_rule mode must be one of {SPEED_RULES}, got {self.mode!r}")
        if self.batch is not None and not (isinstance(self.batch, int) and self.batch >= 1):
            raise ValueError(f"SpeedRule.batch must be a positive int or None (the calibration batch), got {self.batch!r}")
        if self.timer is not None and not callable(self.timer):
            raise TypeError(f"SpeedRule.timer must be callable as timer(layer, side, fn) -> ms, got {self.timer!r}")
        if not (isinstance(self.rounds, int) and self.rounds >= 1):
            raise ValueError(f"SpeedRule.rounds must be an int >= 1, got {self.rounds!r}")
        fb = self.fallback
        if not (isinstance(fb, tuple) and all(isinstance(f, (int, float)) and 0 < f <= 1 for f in fb)
                and list(fb) == sorted(set(fb))):
            raise ValueError(f"SpeedRule.fallback must be a tuple of increasing shares in (0, 1], e.g. (0.25, 0.5, "
                             f"0.75, 1.0), or () to only report a slower whole model; got {fb!r}")
        if not (isinstance(self.margin, (int, float)) and not isinstance(self.margin, bool)
                and 0 <= self.margin < 1):
            raise ValueError(f"SpeedRule.margin must be a fraction in [0, 1) (0.01: the quantized model must time 1% "
                             f"faster than float), got {self.margin!r}")


def as_speed_rule(v) -> SpeedRule:
    """``"off"`` / ``"measured"`` / a :class:`SpeedRule` -> SpeedRule; anything else is an error naming the choices."""
    if isinstance(v, SpeedRule):
        return v
    if isinstance(v, str) and v in SPEED_RULES:
        return SpeedRule(v)
    raise ValueError(f"speed_rule must be one of {SPEED_RULES} or a SpeedRule(batch=, timer=, rounds=, fallback=, "
                     f"margin=), got {v!r}; "
                     "'measured' times each quantized layer against its float equivalent on the model's CUDA device "
                     "and keeps the slower ones float")


@dataclass
class LayerTiming:
    name: str
    precision: str  # the quantized precision that was timed ("w8a8", "fp8", ...)
    quant_ms: float
    float_ms: float
    input_shape: tuple
    floated: bool = False
    round: int = 1
    members: tuple = ()  # a fused module (self-attention's qkv_proj): the float model's layers it stands for
    by_model: str = ""  # floated by the whole-model check: what the whole model's times were ("was slower ...")
    # slower alone but quantized again by the chain check (apply_speed_rule): what the two whole models' times were
    by_chain: str = ""
    gelu: bool = False  # timed with the erf GELU that reads it (a pass quantized, the float LinearGELU's epilogue)
    # the layer whose timing of that side this one reuses (its signature is equal: the same kernels on the same
    # shapes, _signature); "" where this layer was timed itself
    quant_from: str = ""
    float_from: str = ""
    # what the quantized layer was when timed, and (set where it differs at the end) what it runs in the model
    # returned: its epilogue, output and operand change when a neighbour is kept float after its last timing (the
    # FFN chain, a residual add, chained codes: _form)
    form: tuple = ()
    form_now: tuple = ()

    @property
    def saved_ms(self) -> float:
        return self.float_ms - self.quant_ms

    @property
    def shared(self) -> bool:
        """Whether a side's time is another (identical) layer's."""
        return bool(self.quant_from or self.float_from)

    def text(self, float_label: str) -> str:
        shape = "(" + ",".join(str(s) for s in self.input_shape) + ")"
        unit = f", timed as {self.name} ({'/'.join(m.rpartition('.')[2] for m in self.members)} in one GEMM)" \
            if self.members else ""
        if self.gelu:
            unit += ", with the GELU after it: a pass quantized, the GEMM's epilogue in float"
        elif self.form[:1] == ("gelu",):  # (chained linear1: the GELU in the quantized epilogue, and in LinearGELU's)
            unit += ", with the GELU in the GEMM's epilogue on both sides"
        if self.quant_from and self.quant_from == self.float_from:
            unit += f"; the times of {self.quant_from}, an identical layer"
        elif self.shared:
            unit += "; " + " and ".join(f"the {side} time of {other}" for side, other in (
                (self.precision, self.quant_from), (float_label, self.float_from)) if other) + ", an identical layer"
        if self.form_now and self.form_now != self.form and not self.floated:
            unit += (f"; timed with {_form_text(self.form)}, it runs with {_form_text(self.form_now)} (a neighbour kept "
                     "float after its last timing; not timed again, the whole-model check times it)")
        if self.by_model:
            return (f"kept {float_label}: the whole model {self.by_model}; this layer saved least"
                    f" ({self.precision} {self.quant_ms:.3f} ms <= {float_label} {self.float_ms:.3f} ms at input "
                    f"{shape}{unit})")
        if self.floated:
            return (f"kept {float_label}: {self.precision} {self.quant_ms:.3f} ms > {float_label} {self.float_ms:.3f} ms "
                    f"at input {shape}{unit}")
        if self.by_chain:
            return (f"{self.precision} {self.quant_ms:.3f} ms > {float_label} {self.float_ms:.3f} ms at input {shape}"
                    f"{unit}, but kept {self.precision}: {self.by_chain}")
        return f"{self.precision} {self.quant_ms:.3f} ms <= {float_label} {self.float_ms:.3f} ms at input {shape}{unit}"

    @property
    def layers(self) -> tuple:
        """The float model's layer names this timing decides (its members, or itself)."""
        return self.members or (self.name,)


@dataclass
class ModuleTiming:
    """A torch transformer module (an encoder / decoder layer, a standalone attention) with quantized linears left
    after the per-layer rounds, timed whole: tcprec's module as converted against the user's torch module in float
    (its forward and fused fast path, which the quantized linears cost it).  ``floated``: torch's was faster, so
    every linear in it is kept float and the converter gives torch's module back (nn/attention.py:
    restore_torch_modules)."""

    name: str
    kind: str  # the torch class ("TransformerEncoderLayer", "MultiheadAttention", ...)
    quant_ms: float
    float_ms: float
    linears: tuple  # the float model's linear names inside it
    quantized: tuple  # those that were quantized when it was timed (the ones a floating changes)
    floated: bool = False

    def text(self, float_label: str) -> str:
        if self.floated:
            return (f"kept {float_label}: its {self.kind} {self.name} as torch's fused module {self.float_ms:.3f} ms < "
                    f"quantized {self.quant_ms:.3f} ms")
        return (f"its {self.kind} {self.name} quantized {self.quant_ms:.3f} ms <= torch's fused module "
                f"{self.float_ms:.3f} ms")

    @property
    def layers(self) -> tuple:
        """The layers its floating keeps float (those it found quantized)."""
        return self.quantized if self.floated else ()


@dataclass
class SpeedReport:
    """What the speed rule measured and decided (``model.tcprec_summary.speed``)."""

    device: str
    float_label: str  # "fp16" | "fp32" | "bf16": the float side, the model's own dtype
    input_shape: tuple
    layers: list[LayerTiming] = field(default_factory=list)
    modules: list[ModuleTiming] = field(default_factory=list)  # the module-level decisions (torch's module back)
    model_ms: float | None = None
    float_model_ms: float | None = None
    conversions: int = 0
    convert_s: float = 0.0  # wall seconds spent converting, and timing (the rule's own cost)
    timing_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    fallback: list[tuple[int, float]] = field(default_factory=list)  # the whole-model steps: (layers floated, ms)
    # the chain check (apply_speed_rule): (the layers it judged, the whole model's ms with them float, with them
    # quantized, whether they were quantized again), or None where no floated layer wrote a quantized reader's codes
    chain_check: tuple | None = None
    model_itself: bool = False  # every layer float and the converted graph no faster: the user's model came back

    @property
    def floated(self) -> list[str]:
        return [t.name for t in self.layers if t.floated]

    @property
    def speedup(self) -> float | None:
        if self.model_ms is None or self.float_model_ms is None or self.model_ms <= 0:
            return None
        return self.float_model_ms / self.model_ms

    def overrides(self) -> dict[str, str]:
        """The rule's outcome as ``QuantConfig.overrides`` (a rebuild without timing: same structure); a floated
        fused ``qkv_proj`` is its ``q_proj`` / ``k_proj`` / ``v_proj``, the names of the float model; a torch module
        floated whole is each linear in it."""
        return {n: "float" for t in [*self.layers, *self.modules] if t.floated for n in t.layers}

    def lines(self) -> list[str]:
        out = [f"speed rule (measured on {self.device}, input {tuple(self.input_shape)}, {self.conversions} "
               f"conversion(s), {self.convert_s:.1f} s converting, {self.timing_s:.1f} s timing): "
               f"{len(self.floated)} of {len(self.layers)} timed layer(s) kept {self.float_label}"
               + (f", and {whole} linear(s) for torch's modules" if (whole := sum(len(t.layers) for t in self.modules))
                  else "")]
        if shared := sum(t.shared for t in self.layers):
            out.append(f"{shared} of the {len(self.layers)} timed layer(s) took a time from an identical layer (the "
                       "same module configuration, operand and input shapes: each signature timed once a round)")
        if self.model_ms is not None and self.float_model_ms is not None:
            out.append(f"whole model: quantized {self.model_ms:.3f} ms, {self.float_label} {self.float_model_ms:.3f} ms "
                       f"({self.speedup:.2f}x)")
        if self.chain_check is not None:
            names, ms_float, ms_quant, won = self.chain_check
            out.append(f"chain check: {len(names)} layer(s) kept float alone that wrote a quantized reader's operand; "
                       f"the whole model {ms_float:.3f} ms with them float, {ms_quant:.3f} ms with them quantized: "
                       + ("quantized" if won else "kept float"))
        if self.fallback:
            out.append(f"whole model not faster than {self.float_label} at first: the quantized layers that saved "
                       "least kept float in turn: " + ", ".join(f"{n} float, {ms:.3f} ms" for n, ms in self.fallback))
        if self.modules:
            kept = [t for t in self.modules if t.floated]
            out.append(f"torch modules with quantized linears, timed whole: {len(kept)} of {len(self.modules)} faster "
                       f"as torch's float module, their linears kept {self.float_label}"
                       + (": " + ", ".join(f"{t.name} {t.float_ms:.3f} ms < {t.quant_ms:.3f} ms" for t in kept[:4])
                          + (" ..." if len(kept) > 4 else "") if kept else ""))
        return out + self.notes


def _dtype_label(dt: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dt, str(dt).replace("torch.", ""))


def cuda_graph_timer(layer: str, side: str, fn: Callable, calls: int = 4, replays: int = 5) -> float:
    """ms per call of ``fn()``: warmed up on a side stream (JIT compiles, cuDNN / cuBLAS plans), ``calls`` calls
    captured in one CUDA graph, the median of ``replays`` replays timed with CUDA events (no host launch overhead,
    the same clock as the benchmarks': ``tcprec.timing.graph_ms``)."""
    return graph_ms(lambda i: fn(), calls, replays)


def _time_models(timer, qfn: Callable, ffn: Callable, sides=("quantized", "float")) -> tuple[float, float]:
    """(quantized ms, float ms) of the two whole models.  With the default clock the two graphs are replayed in turn
    (``timing.graph_ms_alternating``, as the benchmarks time a model against its baseline): a drift of the GPU's
    clocks lands on both sides, where one side timed after the other read up to 2% slower on the H200.  A user's
    ``timer`` is called for each side, first one first, with the labels ``sides``."""
    if timer is cuda_graph_timer:
        q, f = graph_ms_alternating([lambda i: qfn(), lambda i: ffn()], 4, 5)
        return float(q), float(f)
    return float(timer(MODEL, sides[0], qfn)), float(timer(MODEL, sides[1], ffn))


def timing_input(batch: torch.Tensor, rows: int | None) -> torch.Tensor:
    """The first calibration batch with its rows repeated (or cut) to ``rows``: only the shape matters for time."""
    if rows is None or rows == batch.shape[0]:
        return batch
    reps = math.ceil(rows / batch.shape[0])
    return batch.repeat((reps,) + (1,) * (batch.dim() - 1))[:rows]


class _Probe:
    """Called by the converter with the calibrated float graph: each conv / linear's float module (a channels_last
    copy) and its input shapes (one per call) at the timing input."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.shapes: dict[str, list[tuple]] = {}
        self.floats: dict[str, nn.Module] = {}

    @torch.no_grad()
    def __call__(self, gm: nn.Module, order: list[str]) -> None:
        mods = dict(gm.named_modules())
        hooks = []
        for n in order:
            def pre(mod, args, n=n):
                if args and isinstance(args[0], torch.Tensor):
                    self.shapes.setdefault(n, []).append(tuple(args[0].shape))
            hooks.append(mods[n].register_forward_pre_hook(pre))
        try:
            gm(self.x)
        finally:
            for h in hooks:
                h.remove()
        for n in order:
            m = copy.deepcopy(mods[n])
            self.floats[n] = m.to(memory_format=torch.channels_last) if isinstance(m, nn.Conv2d) else m


def _act_fn(act) -> Callable | None:
    """The float activation the quantized epilogue replaced (``QConv2d.act`` / ``QGroupedConv2d.act``): every form
    the kernels take (``reference_conv_int8_fp8.parse_act``: ``"leaky"`` is slope 0.1, ``"leaky_relu"`` too), as the
    torch op a float model runs.  A form the kernels do not take is ``parse_act``'s ValueError (the layer is then
    left as converted, the reason in the notes), never timed as some other activation."""
    if act is None:
        return None
    mode, a, b = parse_act(act)
    if mode == ACT_NONE:
        return None
    if mode == ACT_RELU:
        return F.relu
    if mode == ACT_LEAKY:
        return lambda y: F.leaky_relu(y, a)
    if mode == ACT_CLAMP:
        return lambda y: F.hardtanh(y, a, b)
    if mode == ACT_HARDSWISH:
        return F.hardswish
    if mode == ACT_SILU:
        return F.silu
    raise ValueError(f"the speed rule has no float op for the activation {act!r} (parse_act mode {mode}); add it to "
                     "nn/speed_rule.py:_act_fn")


def _float_fn(m: nn.Module, q: nn.Module, fused: tuple, shape: tuple, device, dtype, gelu: bool = False) -> Callable:
    """What this layer runs in float and what the quantized module absorbed: conv / linear (cuDNN / cuBLAS,
    channels_last), then BN (inference: kept float, a conv keeps its BN module, docs/decisions/0155), the residual
    add, the activation, the 2x2 pool; ``gelu``: one GEMM with the GELU epilogue (the ``LinearGELU`` the converter
    makes of a linear read by the erf GELU, kept float)."""
    x = torch.randn(shape, device=device, dtype=dtype)
    if x.dim() == 4 and isinstance(m, nn.Conv2d):  # (a linear's 4-D input is (B, H, W, C), contiguous: ConvNeXt's,
        x = x.contiguous(memory_format=torch.channels_last)  # Swin's; channels_last there would time a copy too)
    with torch.no_grad():
        y0 = m(x)
    C = y0.shape[1] if y0.dim() == 4 else y0.shape[-1]
    bn = "bn" in fused and y0.dim() == 4
    if bn:
        rm, rv = torch.zeros(C, device=device, dtype=dtype), torch.ones(C, device=device, dtype=dtype)
        w, b = torch.ones(C, device=device, dtype=dtype), torch.zeros(C, device=device, dtype=dtype)
    res = torch.randn_like(y0) if getattr(q, "has_residual", False) else None
    qact = getattr(q, "act", None)
    if qact == "gelu" and isinstance(m, nn.Linear) and res is None:
        # a linear with the erf GELU in its epilogue (chained to the next linear on the wgmma route, nn/convert.py
        # _chain_ffn): the float model runs linear + GELU as one GEMM with the GELU epilogue (LinearGELU, what a kept
        # float layer becomes), not a GEMM and a GELU pass
        gelu, qact = True, None
    act = _act_fn(qact)
    pool = getattr(q, "pool", None)

    @torch.no_grad()
    def run():
        y = linear_gelu(x, m.weight, m.bias) if gelu else m(x)
        if bn:
            y = F.batch_norm(y, rm, rv, w, b, False, 0.0, 1e-5)
        if res is not None:
            y = y + res
        if act is not None:
            y = act(y)
        if pool:
            y = (F.max_pool2d if pool[0] == "max" else F.avg_pool2d)(y, pool[1], pool[2])
        return y

    return run


def _stacked(ms: list[nn.Module]) -> nn.Linear:
    """The float linears of a fused self-attention's q / k / v as the one linear torch's MHA runs (its in_proj):
    their rows stacked, in their dtype."""
    w = torch.cat([m.weight.detach() for m in ms])  # (3E, E)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=ms[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if ms[0].bias is not None:
            lin.bias.copy_(torch.cat([m.bias.detach() for m in ms]))
    return lin


def _gelu_read(q: nn.Module, qmods: dict, probe: _Probe) -> set[str]:
    """The quantized linears of the graph whose one reader is the erf GELU and which the converter, kept float,
    makes a ``LinearGELU`` (``linear_gelu.gelu_fusable``, as ``convert._fuse_float_gelu`` asks it): the
    quantized layer leaves a GELU pass in the model that its float form does not run.  Timed on both sides (the pass
    after the quantized layer, the GEMM's epilogue in float), that pass is no longer outside every timing (ConvNeXt-T
    int8: its linears and convs each won their own timing, and the model lost ~2 ms: docs/decisions/0156).  Where
    the float form keeps the GELU a pass too, both sides would run it: left out of both."""
    g = getattr(q, "graph", None)
    if not isinstance(g, fx.Graph):
        return set()
    mods = dict(q.named_modules())
    return {node.target for node in g.nodes if node.op == "call_module" and node.target in qmods
            and gelu_fusable(probe.floats.get(node.target), node, mods)}


# A layer's own name is not part of what its kernels see, but a module can hold names of layers: the plan's ``name``
# (its reason is kept: derived from the formats and the device), and a fused module's member names (their count kept)
_NAMES = {(LayerPlan, "name")}
_NAME_ATTRS = {"tcprec_fused"}


def _type_name(v) -> str:
    return f"{type(v).__module__}.{type(v).__qualname__}"


def _signature(*parts) -> tuple | object:
    """``parts`` described (:func:`_describe`); where that fails (an operand it cannot read), a key of its own: the
    call is timed by itself rather than the rule failing or sharing a time it cannot vouch for."""
    try:
        return _describe(parts)
    except Exception:  # noqa: BLE001 - see above
        return object()


def _describe(v):
    """A hashable description of ``v`` as a kernel sees it: a tensor's shape, dtype, strides, device and 16-byte
    alignment (Triton specialises on it), never its values; a dataclass (a QTensor, its layout and format, a
    precision, a plan) field by field; containers item by item; a module by :func:`_module_signature`; anything else by
    its type and ``repr`` -- a repr that names the object (an address) makes the description unique, which only costs a
    timing."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), tuple(v.stride()), str(v.device), v.data_ptr() % 16)
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format)):
        return str(v)
    if isinstance(v, nn.Module):
        return _module_signature(v)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_describe(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_describe(k), _describe(x)) for k, x in v.items()))
    if is_dataclass(v) and not isinstance(v, type):
        return (_type_name(v), tuple((f.name, _describe(getattr(v, f.name))) for f in fields(v)
                                     if (type(v), f.name) not in _NAMES))
    return (_type_name(v), repr(v))


def _module_signature(m: nn.Module) -> tuple:
    """What a module's kernels depend on, conservatively: its type and every public attribute (precision, formats,
    geometry, backend and plan, chaining, fused activation / residual / pool, output dtype and layout, a float conv's
    stride / padding / groups / dilation ...), its buffers and parameters as :func:`_describe` sees tensors (shapes,
    dtypes, layout, a ``None`` bias or BN scale), its children and how many hooks it has.  An attribute added later is
    in it without a change here; only the names of layers (``_NAMES``, ``_NAME_ATTRS``) are left out, so two
    identical layers can match."""
    attrs = tuple((k, len(v) if k in _NAME_ATTRS else _describe(v)) for k, v in vars(m).items()
                  if not k.startswith("_"))
    return (_type_name(m), attrs,
            tuple((k, _describe(b)) for k, b in m._buffers.items()),
            tuple((k, _describe(p)) for k, p in m._parameters.items()),
            tuple((k, _module_signature(c)) for k, c in m._modules.items()),
            len(m._forward_pre_hooks), len(m._forward_hooks))


def _form(m: nn.Module, gelu: bool) -> tuple:
    """What of a quantized layer's form its neighbours decide (the converter's chaining and fusions): its epilogue's
    activation, the codes it writes for the next layer, a residual add in its epilogue, the chained operand it reads,
    and a GELU pass after it (``_gelu_read``)."""
    plan = getattr(m, "layer_plan", None)
    return (getattr(m, "act", None), getattr(m, "out_layout", None) if getattr(m, "out_fmt", None) is not None
            else None, bool(getattr(m, "has_residual", False)), plan.chain_in if plan is not None else None, gelu)


def _form_text(form: tuple) -> str:
    act, out, res, chain_in, gelu = form
    parts = [f"the {act} in its epilogue" if act else "", f"{out} codes out" if out else "float out",
             "the residual add in its epilogue" if res else "", f"reading {chain_in} codes" if chain_in else "",
             "a GELU pass after it" if gelu else ""]
    return ", ".join(p for p in parts if p)


def _measure(q: nn.Module, probe: _Probe, timer, dtype, rnd: int, float_ms: dict) -> tuple[dict, list[str]]:
    """name -> LayerTiming for every quantized layer of ``q`` with a record, and notes.  A fused module (``qkv_proj``,
    ``tcprec_fused`` = its members' names, nn/attention.py: fuse_qkv) is timed as it runs -- one quantize pass, one
    (3E, E) GEMM -- against the same fused linear in float, and decides for all its members.  ``float_ms`` caches the
    float side across rounds: it depends only on the float layer, its input shapes and what the quantized module
    absorbed (the quantized side is timed again: its operands change as neighbours are re-chained).

    Each side is timed once per *signature*, not per layer (docs/decisions/0159): a quantized call by its module's
    signature (:func:`_module_signature`: configuration, geometry, backend, chaining, output, fused epilogue, weight
    shapes), its operands as they arrive (a float tensor, or a chained producer's codes / planes, with its residual:
    :func:`_describe`) and the GELU it is timed with, once per round; the float side by the float module's signature,
    the input shapes, what the quantized module absorbed and the dtype, once.  Identical layers (ViT-H's 32 encoder
    blocks, a ResNet stage's repeated blocks) then cost one timing, and get the same figures and so the same decision
    (timed separately, noise could decide two of them differently); each still has its own LayerTiming, which names
    the layer whose time it took (``quant_from`` / ``float_from``)."""
    recs = {r.name: r for r in q.tcprec_summary.layers}
    qmods = {n: m for n, m in q.named_modules()
             if n in recs and recs[n].precision != "float" and n in probe.floats}
    members: dict[str, tuple] = {}
    for n, m in q.named_modules():
        fused = tuple(getattr(m, "tcprec_fused", ()) or ())
        if fused and all(k in recs and recs[k].precision != "float" and k in probe.floats for k in fused):
            qmods[n], members[n] = m, fused
    gelu = _gelu_read(q, qmods, probe)
    quant: dict[str, float] = {}
    quant_from: dict[str, str] = {}
    timed: dict[tuple, tuple[float, str]] = {}  # this round's quantized signatures: (ms, the layer timed)
    errors: dict[str, str] = {}
    hooks = []
    for n, m in qmods.items():
        def pre(mod, args, kwargs, n=n):
            if n in errors:
                return
            sig = _signature(mod, n in gelu, args, kwargs)
            if sig not in timed:
                def run():  # (the GELU that reads it: the pass the quantized model runs after it)
                    y = mod.forward(*args, **kwargs)
                    return F.gelu(y) if n in gelu else y
                try:
                    timed[sig] = (float(timer(n, "quantized", run)), n)
                except Exception as e:  # noqa: BLE001 - an untimeable layer stays as converted, and the notes say why
                    errors[n] = f"{type(e).__name__}: {str(e)[:100]}"
                    return
            ms, first = timed[sig]
            quant[n] = quant.get(n, 0.0) + ms
            if first != n:  # (a layer called more than once: the first call's source names it)
                quant_from.setdefault(n, first)
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            q(probe.x)
    finally:
        for h in hooks:
            h.remove()
    dev = probe.x.device
    out = {}
    for n, ms in quant.items():
        if n in errors:
            continue
        first = members[n][0] if n in members else n  # (a fused module's input is its members' one input)
        shapes = probe.shapes.get(first)
        if not shapes:
            errors[n] = "its float input shape was not seen (not called with a tensor in the float model)"
            continue
        fm = _stacked([probe.floats[k] for k in members[n]]) if n in members else probe.floats[n]
        qm = qmods[n]
        key = _signature(fm, recs[first].fused, shapes, getattr(qm, "act", None),
                         bool(getattr(qm, "has_residual", False)), getattr(qm, "pool", None), n in gelu, dtype)
        if key not in float_ms:
            try:
                float_ms[key] = (sum(float(timer(n, "float", _float_fn(fm, qm, recs[first].fused, s, dev, dtype,
                                                                       n in gelu)))
                                     for s in shapes), n)
            except Exception as e:  # noqa: BLE001 - as above
                errors[n] = f"{type(e).__name__}: {str(e)[:100]}"
                continue
        fms, fsrc = float_ms[key]
        out[n] = LayerTiming(n, recs[first].precision, ms, fms, shapes[0], floated=ms > fms, round=rnd,
                             members=members.get(n, ()), gelu=n in gelu, quant_from=quant_from.get(n, ""),
                             float_from=fsrc if fsrc != n else "", form=_form(qm, n in gelu))
    notes = [f"speed rule: {n} not timed, kept as converted ({why})" for n, why in errors.items()]
    return out, notes


_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _restorable(model: nn.Module) -> dict[str, nn.Module]:
    """name -> the user's torch module, for each module timed whole: every encoder / decoder layer, and every
    attention outside one -- the granularity at which torch's fused forward is lost or kept (an encoder of float
    layers comes back by itself once they are all float; nn/attention.py: restore_torch_modules)."""
    out = {n: m for n, m in model.named_modules() if type(m) in _TORCH_LAYERS and not_decomposed(m) is None}
    out.update({n: m for n, m in model.named_modules() if type(m) is nn.MultiheadAttention
                and not_decomposed(m) is None and not any(n.startswith(p + ".") or not p for p in out)})
    return out


def _region(g: fx.Graph, path: str) -> list[fx.Node]:
    """The nodes of the converted graph that compute module ``path``'s calls, in graph order: those the tracer
    recorded inside it (``nn_module_stack``; the converter copies it to the nodes it fuses), and the nodes the
    converter made without one (a fused ``qkv_proj``, its split) that lie between two of them."""
    def inside(n):
        return any(v[0] == path for v in (n.meta.get("nn_module_stack") or {}).values())

    def bare(n):
        return not n.meta.get("nn_module_stack") and n.op not in ("placeholder", "output")

    tagged = {n for n in g.nodes if inside(n)}

    def reach(step):
        seen, stack = set(), [m for n in tagged for m in step(n) if bare(m)]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(m for m in step(n) if bare(m))
        return seen

    between = reach(lambda n: list(n.users)) & reach(lambda n: n.all_input_nodes)
    return [n for n in g.nodes if n in tagged or n in between]


class _Capture(fx.Interpreter):
    """Runs the converted graph and keeps the values of ``want`` (the inputs of the modules to time)."""

    def __init__(self, gm: fx.GraphModule, want: set):
        super().__init__(gm)
        self.want, self.got = want, {}

    def run_node(self, n):
        v = super().run_node(n)
        if n in self.want:
            self.got[n] = v
        return v


def _is_torchs(q: nn.Module, base: nn.Module, name: str) -> bool:
    """Whether the converted model holds the user's torch module (its type) at ``name`` (:data:`MODEL`: the root)."""
    path = "" if name == MODEL else name
    try:
        return type(q.get_submodule(path)) is type(base.get_submodule(path))
    except AttributeError:  # (decomposed: the path is gone from the graph module)
        return False


def _measure_modules(q: nn.Module, base: nn.Module, x: torch.Tensor, timer) -> tuple[list[ModuleTiming], list[str]]:
    """Each restorable torch module of the float model (``base``, eval, the model's dtype) with quantized linears
    left in ``q``: its calls as converted (the graph's nodes of it, cut out into one GraphModule, fed the values
    the converted model computes at the timing input) against the torch module's own calls (the arguments the float
    model passes it at the timing input).  Returns the timings and notes; nothing is timed (and ``q`` is not run)
    when no such module exists."""
    if not isinstance(q, fx.GraphModule):
        return [], []
    recs = {r.name: r for r in q.tcprec_summary.layers}
    todo = {}
    for path, m in _restorable(base).items():
        linears = tuple(n for n in recs if not path or n.startswith(path + "."))
        quantized = tuple(n for n in linears if recs[n].precision != "float")
        region = _region(q.graph, path) if quantized and path else []
        if quantized and (region or not path):
            todo[path] = (m, linears, quantized, region)
    if not todo:
        return [], []
    notes: list[str] = []
    cuts = {}
    for path, (_, _, _, region) in todo.items():
        inner = set(region)
        ins = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inner))
        outs = [n for n in region if any(u not in inner for u in n.users)]
        if region and not outs:
            notes.append(f"speed rule: {path} not timed as a whole, kept as converted (no result of it is read)")
            continue
        cuts[path] = (ins, outs)
    calls: dict[str, list] = {p: [] for p in cuts}
    hooks = [base.get_submodule(p).register_forward_pre_hook(
        lambda mod, args, kwargs, p=p: calls[p].append((args, kwargs)), with_kwargs=True) for p in cuts if p]
    cap = _Capture(q, {a for ins, _ in cuts.values() for a in ins})
    try:
        with torch.no_grad():
            base(x)
            cap.run(x)
    except Exception as e:  # noqa: BLE001 - as below, for all of them
        return [], notes + [f"speed rule: {', '.join(p or '<model>' for p in cuts)} not timed as a whole, kept as "
                            f"converted (running the models failed: {type(e).__name__}: {str(e)[:100]})"]
    finally:
        for h in hooks:
            h.remove()
    out = []
    for path, (ins, outs) in cuts.items():
        m, linears, quantized, region = todo[path]
        try:
            if not path:  # (the model itself is the layer: both whole models)
                qfn, ffn = (lambda: q(x)), (lambda: base(x))
            else:
                g = fx.Graph()
                env = {a: g.placeholder(f"in_{i}") for i, a in enumerate(ins)}
                for n in region:
                    env[n] = g.node_copy(n, env.__getitem__)
                g.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))
                sub = fx.GraphModule(q, g)  # (q's own modules, not copies)
                vals = [cap.got[a] for a in ins]
                mine, orig = calls[path], base.get_submodule(path)
                if not mine:
                    raise RuntimeError("the float model did not call it at the timing input")

                def qfn(sub=sub, vals=vals):
                    return sub(*vals)

                def ffn(mine=mine, orig=orig):
                    for a, k in mine:
                        y = orig(*a, **k)
                    return y

            with torch.no_grad():
                qms = float(timer(path or MODEL, "quantized", qfn))
                fms = float(timer(path or MODEL, "float", ffn))
        except Exception as e:  # noqa: BLE001 - an untimeable module stays as converted, and the notes say why
            notes.append(f"speed rule: {path or '<model>'} not timed as a whole, kept as converted "
                         f"({type(e).__name__}: {str(e)[:100]})")
            continue
        out.append(ModuleTiming(path or MODEL, type(m).__name__, qms, fms, linears, quantized, floated=fms < qms))
    return out, notes


def apply_speed_rule(model: nn.Module, cfg, batches: list, convert: Callable) -> nn.Module:
    """quantize_model with ``cfg.speed_rule`` measured (module docstring).  ``convert(cfg, probe)`` is the converter
    without the rule; ``probe(gm, order)`` is called with the calibrated float graph."""
    rule = cfg.speed_rule
    p = next((t for t in model.parameters() if t.is_floating_point()), None)
    dev = p.device if p is not None else torch.device("cpu")
    dtype = p.dtype if p is not None else torch.float32
    clock = rule.timer
    if clock is None:
        if dev.type != "cuda":
            raise ValueError(f"speed_rule='measured' times the layers on the model's CUDA device, but the model is on "
                             f"{dev}: its CPU time says nothing about the GPU kernels. Move the model to CUDA "
                             "(quantize_model(model.cuda(), ...)), or use speed_rule='off' (no layer is floated for "
                             "speed), or pass SpeedRule(timer=...) with your own clock")
        clock = cuda_graph_timer
    x = timing_input(batches[0], rule.batch).to(device=dev, dtype=dtype)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    probe = _Probe(x)
    off = replace(cfg, speed_rule=SpeedRule("off"))
    label = _dtype_label(dtype)
    report = SpeedReport(str(dev), label, tuple(x.shape))
    timings: dict[str, LayerTiming] = {}

    # the first conversion is only timed (a layer's kernels and time do not depend on how its weights round): it skips
    # AdaRound, the one calibration step that costs more than the timings; a model it leaves final is converted again
    timed_only = replace(off, weight_rounding="nearest") if off.weight_rounding != "nearest" else off

    def convert_with(floated, final=True):
        report.conversions += 1
        c = replace(off if report.conversions > 1 and final else timed_only,
                    overrides={**dict(cfg.overrides), **{n: "float" for n in floated}})
        t0 = time.perf_counter()
        try:
            return convert(c, probe if report.conversions == 1 else None)
        finally:
            report.convert_s += time.perf_counter() - t0

    def timer(layer, side, fn):  # (the rule's clock, its seconds counted)
        t0 = time.perf_counter()
        try:
            return clock(layer, side, fn)
        finally:
            report.timing_s += time.perf_counter() - t0

    def time_models():
        t0 = time.perf_counter()
        try:
            return _time_models(clock, lambda: q(x), lambda: base(x))
        finally:
            report.timing_s += time.perf_counter() - t0

    def faster():  # the whole quantized model measurably faster (SpeedRule.margin)
        return report.model_ms * (1 + rule.margin) <= report.float_model_ms

    def floated_now():
        return [k for t in [*timings.values(), *report.modules] if t.floated for k in t.layers]

    float_ms: dict = {}  # (the float side of each signature, timed once: _measure)
    flags = torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False,
                                       allow_tf32=torch.backends.cudnn.allow_tf32)
    with flags:
        q = convert_with(())
        for rnd in range(1, rule.rounds + 1):
            got, notes = _measure(q, probe, timer, dtype, rnd, float_ms)
            report.notes += [n for n in notes if n not in report.notes]
            timings.update(got)
            slow = [n for n, t in got.items() if t.floated]
            if not slow:
                break
            q = convert_with(floated_now())
            if rnd == rule.rounds:
                report.notes.append(f"speed rule: stopped after {rule.rounds} timing round(s); the layers re-chained "
                                    "by the last floating were not timed again (SpeedRule(rounds=) for more)")
        base = copy.deepcopy(model).eval()
        if x.dim() == 4:
            base = base.to(memory_format=torch.channels_last)
        # a torch module whose quantized linears cost it its fused forward: timed whole, against torch's module
        report.modules, notes = _measure_modules(q, base, x, timer)
        report.notes += notes
        if any(t.floated for t in report.modules):
            q = convert_with(floated_now())
            lost = [t.name for t in report.modules if t.floated and not _is_torchs(q, base, t.name)]
            if lost:
                report.notes.append(f"speed rule: {', '.join(lost)} kept float for torch's module, but the converter "
                                    "could not give torch's module back there (decomposed float linears run instead)")
        final = report.conversions > 1 or timed_only is off  # (False: q skipped the rounding optimisation)
        # a layer kept float alone that wrote a quantized reader's operand (a chain: linear1's GELU and linear2's
        # codes, a conv's codes for the next conv) makes that reader quantize its own input again: the model as
        # decided is timed against the model with those layers quantized, and the faster one is kept
        # (with them: the layers a later round kept float -- their operands changed by a floating, such as a
        # head's reader now quantizing its own input -- so the chains come back whole)
        heads = [t for t in timings.values() if t.floated and len(t.form) > 1 and t.form[1] is not None]
        if heads:
            heads += [t for t in timings.values() if t.floated and t.round > 1 and t not in heads]
            try:
                others = [k for t in [*timings.values(), *report.modules] if t.floated and t not in heads
                          for k in t.layers]
                alt = convert_with(others, final=False)
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        ms_float, ms_quant = _time_models(clock, lambda: q(x), lambda: alt(x),
                                                          ("quantized", "quantized, chains kept"))
                finally:
                    report.timing_s += time.perf_counter() - t0
                won = ms_quant * (1 + rule.margin) <= ms_float
                report.chain_check = (tuple(t.name for t in heads), ms_float, ms_quant, won)
                if won:
                    why = (f"the whole model ran faster with the {len(heads)} such layer(s) quantized, the chains they "
                           f"start kept ({ms_quant:.3f} ms < {ms_float:.3f} ms with them {label})")
                    for t in heads:
                        t.floated, t.by_chain = False, why
                    q, final = alt, False
                del alt
            except Exception as e:  # noqa: BLE001 - the per-layer decisions stand
                report.notes.append(f"speed rule: the chain check did not run ({type(e).__name__}: {str(e)[:100]})")
        try:
            with torch.no_grad():
                report.model_ms, report.float_model_ms = time_models()
                # slower as a whole: the layers that saved least are kept float, a growing share at a time (a
                # conversion without the rounding optimisation each: the kernels' time does not depend on it); the
                # layers the chain check quantized again last (alone they lose: their own saving says nothing)
                kept = sorted((t for t in timings.values() if not t.floated),
                              key=lambda t: (bool(t.by_chain), t.saved_ms))
                first = (f"was slower quantized ({report.model_ms:.3f} ms > {label} {report.float_model_ms:.3f} ms)"
                         if report.model_ms > report.float_model_ms else
                         f"was not {rule.margin:.0%} faster quantized ({report.model_ms:.3f} ms against {label} "
                         f"{report.float_model_ms:.3f} ms)")
                for share in rule.fallback:
                    if faster() or not kept:
                        break
                    for t in kept[:math.ceil(share * len(kept))]:
                        t.floated, t.by_model = True, t.by_model or first
                    q, final = convert_with(floated_now(), final=False), False
                    report.model_ms, report.float_model_ms = time_models()  # (both again: the pair is alternated)
                    report.fallback.append((len(floated_now()), report.model_ms))
        except Exception as e:  # noqa: BLE001 - the layer decisions stand; the notes say the check did not run
            report.notes.append(f"speed rule: the whole-model check did not run ({type(e).__name__}: {str(e)[:100]})")
        timed = report.model_ms is not None and report.float_model_ms is not None
        if timed and not faster() and report.fallback and all(r.precision == "float" for r in q.tcprec_summary.layers):
            # every layer float and the converted graph no faster than the model itself: the model itself, the module
            # the float side timed (a copy, eval mode), with the summary
            report.notes.append(f"speed rule: every layer kept {label}, and the converted float model was not "
                                f"{rule.margin:.0%} faster than the model itself ({report.model_ms:.3f} ms against "
                                f"{report.float_model_ms:.3f} ms): the model itself is returned (a copy in eval mode"
                                + (", channels_last)" if x.dim() == 4 else ")"))
            base.tcprec_summary, q, final = q.tcprec_summary, base, True
            report.model_ms, report.model_itself = report.float_model_ms, True
        del base
        if not final:  # the full calibration, on the final layer set
            q = convert_with(floated_now())
    report.layers = list(timings.values())
    if isinstance(q, fx.GraphModule):  # the layers a later floating changed, which no timing saw in that form
        mods = dict(q.named_modules())
        quantized = {r.name for r in q.tcprec_summary.layers if r.precision != "float"}  # (not torch's modules')
        kept = {t.name: mods[t.name] for t in report.layers
                if not t.floated and t.form and t.name in mods and set(t.layers) <= quantized}
        gl = _gelu_read(q, kept, probe)
        changed = []
        for t in report.layers:
            if t.name in kept and _form(kept[t.name], t.name in gl) != t.form:
                t.form_now = _form(kept[t.name], t.name in gl)
                changed.append(t.name)
        if changed:
            report.notes.append(f"speed rule: {len(changed)} quantized layer(s) run in another form than they were "
                                "timed in (a neighbour kept float after their last timing: a chain or fusion undone), "
                                "not timed again; the whole-model check times the result: " + ", ".join(changed[:4])
                                + (" ..." if len(changed) > 4 else ""))
    summary = q.tcprec_summary
    by_layer = {k: t for t in timings.values() for k in t.layers}  # (a fused qkv_proj decides for q / k / v)
    by_layer.update({k: t for t in report.modules for k in t.layers})  # (floated for torch's module: that reason)
    for r in summary.layers:
        t = by_layer.get(r.name)
        if t is None:
            continue
        r.reason = t.text(label)
        if t.floated:
            r.backend = r.reason
    if report.speedup is not None and report.speedup < 1.0:
        msg = (f"SPEED RULE: THE QUANTIZED MODEL IS SLOWER THAN {label.upper()}: {report.model_ms:.3f} ms against "
               f"{report.float_model_ms:.3f} ms at input {tuple(x.shape)}, with {len(report.floated)} layer(s) kept "
               f"{label}" + (f" after keeping float the quantized layers that saved least ({len(report.fallback)} "
                             "step(s))" if report.fallback else "")
               + "; the cost is outside the timed layers (float glue between them) or in timing noise")
        report.notes.append(msg)
        warnings.warn(msg, stacklevel=3)
    summary.speed = report
    return q
