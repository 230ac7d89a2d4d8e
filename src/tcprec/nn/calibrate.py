"""Calibration: activation clipping ranges, weight clipping and grids, bias correction (``QuantConfig``'s
``activation_observer``, ``weight_clip``, ``weight_grid``, ``bias_correction``).

Activation ranges (per tensor, from the calibration batches), :class:`Observer`:

* ``"absmax"``: the largest |x| seen (the default; what every earlier release did).
* ``"percentile"``: the ``percentile``-th percentile of |x| (e.g. 99.99).
* ``"mse"``: the clip c minimising the expected squared error of the quantizer: for a histogram of |x| (``bins``
  bins over [0, absmax]), rounding noise (c / qmax)^2 / 12 on the mass below c plus the clipping error
  (x - c)^2 above it -- ACIQ's model (Banner et al. 2019), searched over every bin edge.
* ``"entropy"``: TensorRT's entropy calibration: the threshold whose ``qmax + 1``-level quantized histogram has
  the smallest KL divergence from the clipped reference histogram (outliers folded into the last bin).
* ``"auto"``: per layer, the one of those four clips whose quantized input gives the smallest squared error of
  the layer's output (float weights) over the calibration batches.

Weights: per-output-channel scales always; ``weight_clip="mse"`` searches each channel's clip ratio (100 ratios in
[0.2, 1]) minimising ||w - q(w)||^2 with the layer's actual grid; ``weight_grid="pm"`` stores weights of 2..7 bits
as odd integers -(2^N - 1)..(2^N - 1) (``pmN``: every one of the 2^N codes used, symmetric, no zero) instead of two's
complement (which, symmetric, never uses -2^(N-1)).  ``weight_rounding=AdaRound()`` (Nagel et al. 2020) chooses, per
weight, rounding down or up on that grid (e4m3's for fp8 layers; same scales) to minimise the layer's output error on
the calibration batches (:func:`adaround_weights`).  ``bias_correction``: the expected output error of the
quantized weights, E[conv(x, w_q - w)] per output channel over the calibration batches (Nagel et al. 2019,
empirical), is subtracted from the bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..formats import FloatFormat, as_format
from ..ops.quantize import absmax_qmax, quantize
from ..qtensor import PerChannel

__all__ = ["Observer", "OBSERVER_METHODS", "WEIGHT_CLIPS", "WEIGHT_GRIDS", "as_observer", "clip_from_histogram",
           "activation_clips", "weight_clip_ratio", "dequantized_weight", "prepared_float_layer", "bias_deltas",
           "AdaRound", "WEIGHT_ROUNDINGS", "ADAROUND_INPUTS", "as_rounding", "adaround_weights", "adaround_lockstep"]

OBSERVER_METHODS = ("absmax", "percentile", "mse", "entropy", "auto")
WEIGHT_CLIPS = ("absmax", "mse")
WEIGHT_GRIDS = ("twos", "pm")
WEIGHT_ROUNDINGS = ("nearest", "adaround")
ADAROUND_INPUTS = ("float", "quantized")


@dataclass(frozen=True)
class Observer:
    """How an activation's clipping range is chosen: ``Observer("percentile", percentile=99.99)``."""

    method: str = "absmax"
    percentile: float = 99.99
    bins: int = 2048

    def __post_init__(self):
        if self.method not in OBSERVER_METHODS:
            raise ValueError(f"Observer method must be one of {OBSERVER_METHODS}, got {self.method!r}")
        if not (isinstance(self.percentile, (int, float)) and 50.0 < self.percentile <= 100.0):
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile!r} (e.g. 99.99)")
        if not (isinstance(self.bins, int) and 128 <= self.bins <= 1 << 16):
            raise ValueError(f"bins must be an int in 128..65536, got {self.bins!r} (TensorRT uses 2048)")


def batch_on(model, b):
    """A calibration batch on ``model``'s device and in its float dtype: a tensor, or a dict of keyword arguments
    (``{"src": x, "mask": causal}``) whose floating-point tensors take the float dtype (bool masks stay bool)."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    dt = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def on(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device=dev, dtype=dt) if v.is_floating_point() else v.to(device=dev)
    return {k: on(v) for k, v in b.items()} if isinstance(b, dict) else b.to(device=dev, dtype=dt)


def call_batch(model, b):
    """``model(b)``, or ``model(**b)`` for a dict batch (keyword arguments: the input and its masks)."""
    return model(**b) if isinstance(b, dict) else model(b)


def _run_batches(model, batches, hooks) -> None:
    """Run the calibration batches through ``model`` (on its device, in its float dtype), then remove the
    forward hooks that observed them, whatever happens."""
    try:
        for b in batches:
            call_batch(model, batch_on(model, b))
    finally:
        for h in hooks:
            h.remove()

def as_observer(v) -> Observer:
    if isinstance(v, Observer):
        return v
    if isinstance(v, str):
        return Observer(v)
    raise TypeError(f"activation_observer must be an Observer or one of {OBSERVER_METHODS}, got {type(v).__name__}")


def clip_from_histogram(hist, amax: float, method: str, qmax: float, percentile: float = 99.99) -> float:
    """The clip of |x| for a histogram ``hist`` of |x| over [0, amax] (equal bins) and a quantizer of ``qmax``
    steps above zero (255 for uint8, 127 for int8)."""
    h = np.asarray(hist, dtype=np.float64)
    n = h.size
    if amax <= 0 or h.sum() == 0 or method == "absmax":
        return float(amax)
    width = amax / n
    edges = np.arange(1, n + 1) * width  # candidate clips: each bin's upper edge
    if method == "percentile":
        cdf = np.cumsum(h) / h.sum()
        i = int(np.searchsorted(cdf, percentile / 100.0))
        i = min(i, n - 1)
        lo = cdf[i - 1] if i else 0.0
        frac = (percentile / 100.0 - lo) / max(cdf[i] - lo, 1e-300)
        return float((i + min(max(frac, 0.0), 1.0)) * width)
    if method == "mse":
        mid = (np.arange(n) + 0.5) * width
        # suffix sums over bins j >= i of h, h*m, h*m^2: the clipping error of clip edges[i-1]
        s0 = np.cumsum(h[::-1])[::-1]
        s1 = np.cumsum((h * mid)[::-1])[::-1]
        s2 = np.cumsum((h * mid * mid)[::-1])[::-1]
        below = np.cumsum(h)  # mass at or below edge i
        c = edges
        nxt = np.append(np.arange(1, n), n)  # the first bin above edge i
        a0 = np.where(nxt < n, s0[np.minimum(nxt, n - 1)], 0.0)
        a1 = np.where(nxt < n, s1[np.minimum(nxt, n - 1)], 0.0)
        a2 = np.where(nxt < n, s2[np.minimum(nxt, n - 1)], 0.0)
        clip_err = a2 - 2 * c * a1 + c * c * a0 + a0 * width * width / 12
        round_err = below * (c / qmax) ** 2 / 12
        return float(c[int(np.argmin(clip_err + round_err))])
    if method == "entropy":
        return _entropy_clip(h, width, int(qmax) + 1)
    raise ValueError(f"method must be one of {OBSERVER_METHODS}, got {method!r}")


def _entropy_clip(h: np.ndarray, width: float, levels: int) -> float:
    """TensorRT's entropy calibration over thresholds at bin edges ``levels``..n."""
    n = h.size
    if n <= levels:
        return float(n * width)
    best, best_i = np.inf, n
    for i in range(levels, n + 1):
        ref = h[:i].copy()
        ref[i - 1] += h[i:].sum()  # the outliers clip onto the threshold
        # quantize h[:i] into `levels` chunks, then expand each chunk evenly over its non-empty bins
        bounds = (np.arange(levels) * i) // levels
        sums = np.add.reduceat(h[:i], bounds)
        nz = (h[:i] > 0).astype(np.float64)
        cnt = np.add.reduceat(nz, bounds)
        per = np.where(cnt > 0, sums / np.maximum(cnt, 1), 0.0)
        q = np.repeat(per, np.diff(np.append(bounds, i))) * nz
        p = ref / ref.sum()
        qs = q.sum()
        if qs == 0:
            continue
        q = q / qs
        m = p > 0
        qm = np.where(q[m] > 0, q[m], 1e-12)  # (a folded outlier bin may be empty in q: smooth it)
        kl = float(np.sum(p[m] * np.log(p[m] / qm)))
        if kl < best:
            best, best_i = kl, i
    return float((best_i + 0.5) * width) if best_i < n else float(n * width)


@torch.no_grad()
def activation_clips(model: nn.Module, names: list[str], batches, absmax: dict, observer: Observer,
                     fmt_of) -> dict[str, float]:
    """name -> clip of the input of module ``name``: one pass over the batches filling a histogram of |x| over
    [0, absmax[name]] per layer, then :func:`clip_from_histogram` on the grid of ``fmt_of(name)`` (the input's
    integer format); ``"auto"``: a second pass measuring each candidate clip's output error."""
    qmax_of = lambda n: absmax_qmax(as_format(fmt_of(n)))  # noqa: E731
    mods = dict(model.named_modules())
    hists = {n: torch.zeros(observer.bins, dtype=torch.float64) for n in names if absmax.get(n, 0.0) > 0}
    hooks = []
    for n in hists:
        def pre(mod, args, n=n):
            x = args[0]
            if isinstance(x, torch.Tensor) and x.numel():
                h = torch.histc(x.detach().float().abs().flatten(), observer.bins, 0.0, absmax[n])
                hists[n] += h.double().cpu()
        hooks.append(mods[n].register_forward_pre_hook(pre))
    _run_batches(model, batches, hooks)
    if observer.method != "auto":
        return {n: clip_from_histogram(hists[n].numpy(), absmax[n], observer.method, qmax_of(n), observer.percentile)
                if n in hists else absmax.get(n, 0.0) for n in names}
    cands = {n: sorted({clip_from_histogram(hists[n].numpy(), absmax[n], m, qmax_of(n), observer.percentile)
                        for m in OBSERVER_METHODS[:-1]}) for n in hists}
    errs = _output_errors(model, cands, batches, fmt_of)
    return {n: cands[n][int(np.argmin(errs[n]))] if n in hists else absmax.get(n, 0.0) for n in names}


def _layer_out(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(mod, nn.Conv2d):  # (a conv with tcprec_pad4 pads in an earlier pre-hook: x is padded here)
        return F.conv2d(x, mod.weight.to(x.dtype), None, mod.stride, mod.padding, mod.dilation, mod.groups)
    return F.linear(x, mod.weight.to(x.dtype))  # (x is float32 here; an fp16 model's weight is cast to it)


@torch.no_grad()
def _output_errors(model: nn.Module, cands: dict, batches, fmt_of) -> dict[str, list[float]]:
    """name -> for each candidate clip c of ``cands[name]``, sum ||layer(q_c(x)) - layer(x)||^2 over the batches,
    where q_c rounds to ``fmt_of(name)`` with the scale c / qmax."""
    mods = dict(model.named_modules())
    errs = {n: [0.0] * len(c) for n, c in cands.items()}
    hooks = []
    for n in cands:
        fmt = as_format(fmt_of(n))

        def pre(mod, args, n=n, fmt=fmt):
            x = args[0]
            if not isinstance(x, torch.Tensor):
                return
            x = x.detach().float()
            ref = _layer_out(mod, x)
            for i, c in enumerate(cands[n]):
                s = max(c, 1e-8) / absmax_qmax(fmt)
                errs[n][i] += float((_layer_out(mod, torch.round(x / s).clamp(fmt.min, fmt.max) * s) - ref)
                                    .double().pow(2).sum())
        hooks.append(mods[n].register_forward_pre_hook(pre))
    _run_batches(model, batches, hooks)
    return errs


def weight_clip_ratio(w: torch.Tensor, fmt, ratios: int = 100) -> torch.Tensor:
    """Per output channel (axis 0), the clip ratio r in [0.2, 1] of max|w| whose per-channel quantization
    (scale r * max|w| / qmax) has the smallest squared error.  (K,) float32."""
    fmt = as_format(fmt)
    wf = w.detach().float().flatten(1)  # (K, n)
    amax = wf.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny)  # (K,)
    qmax = absmax_qmax(fmt)
    lo, hi = (fmt.min, fmt.max)
    best = torch.full_like(amax, float("inf"))
    best_r = torch.ones_like(amax)
    for r in torch.linspace(0.2, 1.0, ratios).tolist():
        s = (amax * r / qmax)[:, None]
        if fmt.encoding == "pm1":  # odd integers: round (v - 1) / 2, then back
            v = (torch.round((wf / s - 1) / 2) * 2 + 1).clamp(lo, hi)
        else:
            v = torch.round(wf / s).clamp(lo, hi)
        err = ((v * s - wf) ** 2).sum(1)
        better = err < best
        best = torch.where(better, err, best)
        best_r = torch.where(better, torch.full_like(best_r, r), best_r)
    return best_r


def weight_format_for(bits: int, grid: str):
    """The weight format of ``bits`` bits on ``grid``: ``intN`` ("twos"), ``pmN`` ("pm", 2..7 bits)."""
    if grid == "pm" and 2 <= bits <= 7:
        return as_format(f"pm{bits}")
    return as_format("binary") if bits == 1 else as_format(f"int{bits}")


def dequantized_weight(w: torch.Tensor, fmt) -> torch.Tensor:
    """Per-output-channel absmax quantization of ``w`` (axis 0) and back: what the quantized layer computes with."""
    fmt = as_format(fmt)
    if getattr(fmt, "encoding", None) == "pm1" and fmt.bits == 1:  # (a FloatFormat, e4m3, has no encoding)
        s = w.detach().float().abs().flatten(1).mean(1).clamp_min(torch.finfo(torch.float32).tiny)
        return quantize(w.detach().float(), fmt, PerChannel(0), scale=s.view(-1, *([1] * (w.dim() - 1)))).dequantize()
    return quantize(w.detach().float(), fmt, PerChannel(0)).dequantize()


def prepared_float_layer(m: nn.Module, clip_ratio: torch.Tensor | None, bias_delta: torch.Tensor | None,
                         weight: torch.Tensor | None = None) -> nn.Module:
    """A float copy of conv / linear ``m`` whose weight is clipped per channel to ``clip_ratio * max|w|`` (so the
    layer's absmax quantization lands on that clip) -- or is ``weight`` (a weight already on the layer's grid, e.g.
    AdaRound's, whose absmax gives the same scale) -- and whose bias is reduced by ``bias_delta``; ``m`` is untouched.
    Attributes the conversion reads (``tcprec_pad4``, ``tcprec_pad_folded``) are kept."""
    new = nn.Module.__new__(type(m))
    new.__dict__ = dict(m.__dict__)
    new._parameters = dict(m._parameters)
    new._buffers = dict(m._buffers)
    new._modules = dict(m._modules)
    w = m.weight.detach()
    if weight is not None:
        new._parameters["weight"] = nn.Parameter(weight.to(w.dtype).to(w.device), requires_grad=False)
    elif clip_ratio is not None:
        lim = (w.float().flatten(1).abs().amax(1) * clip_ratio.to(w.device)).view(-1, *([1] * (w.dim() - 1)))
        new._parameters["weight"] = nn.Parameter(torch.maximum(torch.minimum(w.float(), lim), -lim).to(w.dtype),
                                                 requires_grad=False)
    if bias_delta is not None:
        b = m.bias.detach() if m.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        new._parameters["bias"] = nn.Parameter(b - bias_delta.to(b.dtype).to(b.device), requires_grad=False)
    return new


@torch.no_grad()
def _channel_errors(mod: nn.Module, x: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """The layer's output error from the weight error ``dw`` on input ``x``, (K, positions): every output position of
    every image per output channel (a conv's (N, K, P, Q) as (K, N*P*Q); a linear's (..., K) as (K, rows))."""
    e = _apply(mod, x, dw, None)
    return e.transpose(0, 1).flatten(1) if isinstance(mod, nn.Conv2d) else e.reshape(-1, e.shape[-1]).t()


def bias_deltas(model: nn.Module, names: list[str], batches, w_dq) -> dict[str, torch.Tensor]:
    """name -> E[layer(x; w_dq(name) - w)] per output channel (mean over batch and positions) over the batches."""
    mods = dict(model.named_modules())
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for n in names:
        m = mods[n]
        dw = (w_dq(n).to(m.weight.device) - m.weight.detach().float()).to(m.weight.dtype)

        def pre(mod, args, n=n, dw=dw):
            x = args[0]
            if not isinstance(x, torch.Tensor):
                return
            e = _channel_errors(mod, x, dw)  # (a conv with tcprec_pad4 pads in an earlier pre-hook: x is padded)
            sums[n] = sums.get(n, 0) + e.double().sum(1)
            counts[n] = counts.get(n, 0) + e.shape[1]
        hooks.append(m.register_forward_pre_hook(pre))
    _run_batches(model, batches, hooks)
    return {n: (sums[n] / counts[n]).float() for n in sums}



# -- AdaRound: learned rounding of the weights on their grid ---------------------------------------------------


@dataclass(frozen=True)
class AdaRound:
    """Rounding optimisation of integer weights (Nagel et al. 2020, "Up or down?"), and of e4m3 ones (fp8 layers, 8
    bits), layer by layer: each weight rounds down or up on its grid (for e4m3: to one of its two adjacent e4m3
    values; the scale the layer uses, unchanged), chosen by minimising the layer's output
    error ``|| q(x) W_round - x W ||^2`` over every output position of the calibration batches (``q(x)``: the
    layer's quantized input), with the rectified-sigmoid relaxation and the annealed regulariser
    that pushes every choice to 0 or 1.  Layers with more than ``max_bits`` weight bits round to nearest.
    ``iters`` Adam steps at ``lr`` per layer: a few hundred keep it CPU-feasible.

    ``inputs``: where ``x`` comes from.  ``"float"`` (the default): the float model's input of the layer, quantized
    -- every layer is solved from one pass.  ``"quantized"``: the quantized model's input (every layer upstream already
    rounded, its inputs quantized, its bias corrected), against the float model's output -- so each layer also
    absorbs the error its predecessors left (AdaRound's "asymmetric reconstruction"; AIMET and BRECQ use it); the
    layers are solved in model order in one pass over the calibration batch and the float batch side by side
    (:func:`adaround_lockstep`).  ``"quantized"`` needs tensor calibration batches (not keyword dicts)."""

    iters: int = 300
    max_bits: int = 4
    reg: float = 0.01
    lr: float = 0.05
    seed: int = 0
    inputs: str = "float"

    def __post_init__(self):
        for k, lo, hi in (("iters", 1, 100_000), ("max_bits", 2, 8), ("seed", 0, 1 << 62)):
            v = getattr(self, k)
            if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
                raise ValueError(f"AdaRound {k} must be an int in {lo}..{hi}, got {v!r}")
        for k in ("reg", "lr"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"AdaRound {k} must be a positive number, got {v!r}")
        if self.inputs not in ADAROUND_INPUTS:
            raise ValueError(f"AdaRound inputs must be one of {ADAROUND_INPUTS}, got {self.inputs!r} ('quantized': "
                             "the quantized model's inputs, each layer correcting its predecessors' error)")


def as_rounding(v) -> AdaRound | None:
    """``"nearest"`` -> None, ``"adaround"`` -> ``AdaRound()``, an ``AdaRound`` as given."""
    if isinstance(v, AdaRound):
        return v
    if isinstance(v, str) and v in WEIGHT_ROUNDINGS:
        return None if v == "nearest" else AdaRound()
    raise ValueError(f"weight_rounding must be one of {WEIGHT_ROUNDINGS} or an AdaRound(...), got {v!r}")


def _grid(fmt) -> tuple[float, float, int, int]:
    """(step, offset, kmin, kmax): the weight values are scale * (step * k + offset), k in kmin..kmax."""
    if fmt.encoding == "pm1":  # odd integers -(2^N - 1)..(2^N - 1)
        return 2.0, 1.0, int((fmt.min - 1) // 2), int((fmt.max - 1) // 2)
    return 1.0, 0.0, int(fmt.min), int(fmt.max)


def _neighbours(u: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """(lo, gap, nearest, vmin, vmax) of the real-valued codes ``u`` (``w / scale``) on ``fmt``'s grid: the grid
    value at or below each, the distance to the next one up, the nearest one, the grid's ends.  An integer grid's gap
    is its step; a float format's (e4m3) is its spacing at ``u``: 2^(e - man) in the binade [2^e, 2^(e+1)) of ``u``
    (rounding down, towards -inf, stays in the binade of ``u`` or the one below), 2^(emin - man) below the smallest
    normal (subnormals)."""
    if isinstance(fmt, FloatFormat):
        if not fmt.subnormals:
            raise ValueError(f"AdaRound on a float grid needs a format with subnormals, got {fmt!r} (e.g. e4m3)")
        e = torch.floor(torch.log2(u.abs().clamp_min(math.ldexp(1.0, fmt.emin)))).clamp_min(fmt.emin)
        gap = torch.exp2(e - fmt.man)
        lo = torch.floor(u / gap) * gap
        vmax = float(fmt.max)
        nearest = (u.float().clamp(-vmax, vmax).to(torch.float8_e4m3fn).to(u.dtype) if fmt == as_format("e4m3")
                   else torch.where(u - lo < lo + gap - u, lo, lo + gap).clamp(-vmax, vmax))
        return lo, gap, nearest, -vmax, vmax
    step, off, kmin, kmax = _grid(fmt)
    k = (u - off) / step
    return (step * torch.floor(k) + off, torch.full_like(u, step), step * torch.round(k).clamp(kmin, kmax) + off,
            step * kmin + off, step * kmax + off)


def _rect_sigmoid(v: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(v) * 1.2 - 0.1).clamp(0.0, 1.0)


def adaround_layer(w: torch.Tensor, scale: torch.Tensor, fmt, x: torch.Tensor, target: torch.Tensor,
                   opts: AdaRound) -> torch.Tensor:
    """The AdaRound codes' dequantized weight (same shape as ``w``, on the grid ``scale * (step k + offset)``).

    ``w``: (G, Kg, I) float32, G groups of Kg outputs over I inputs; ``scale``: (G, Kg, 1) per output channel;
    ``x``: (P, G, I) the layer's quantized inputs at P positions; ``target``: (P, G, Kg) the float layer's outputs
    there.  The element holding each channel's largest code keeps its nearest rounding, so the channel's absmax --
    hence the scale the quantized layer derives from the weight -- is unchanged."""
    if x.shape[0] > x.shape[2]:  # more positions than inputs: the Gram form is cheaper and the same loss
        xg = x.transpose(0, 1)  # (G, P, I)
        gram = (xg.transpose(1, 2) @ xg, xg.transpose(1, 2) @ target.transpose(0, 1), float(target.double().pow(2).sum()))
        return _adaround(w, scale, fmt, opts, gram=gram)
    return _adaround(w, scale, fmt, opts, samples=(x, target))


def _adaround(w, scale, fmt, opts: AdaRound, samples=None, gram=None) -> torch.Tensor:
    """AdaRound on the loss sum ||x W_q^T - t||^2, from ``samples`` (x (P, G, I), t (P, G, Kg)) or from its Gram
    form ``gram`` = (H = x^T x (G, I, I), C = x^T t (G, I, Kg), T = ||t||^2): tr(W_q H W_q^T) - 2 tr(W_q C) + T."""
    lo, gap, nearest, vmin, vmax = _neighbours(w / scale, fmt)  # (G, Kg, I) in units of the scale
    rest = ((w / scale - lo) / gap).clamp(0.01, 0.99)
    v = (-torch.log(1.2 / (rest + 0.1) - 1.0)).requires_grad_(True)  # h(v) = rest at the start
    top = nearest.abs() == nearest.abs().amax(-1, keepdim=True)  # (G, Kg, I): the channel's extreme codes stay

    def loss_of(wq):  # (G, Kg, I) -> the summed squared output error
        if samples is not None:
            x, t = samples
            return (torch.einsum("pgi,gki->pgk", x, wq) - t).pow(2).sum()
        H, C, T = gram
        return ((wq @ H) * wq).sum() - 2 * (wq * C.transpose(1, 2)).sum() + T

    # the output error in units of nearest rounding's: the regulariser's weight means the same on every layer
    with torch.no_grad():
        power = loss_of(scale * nearest).clamp_min(1e-30)
    opt = torch.optim.Adam([v], lr=opts.lr)
    warm = opts.iters // 5
    with torch.enable_grad():
        for it in range(opts.iters):
            h = _rect_sigmoid(v)
            k = torch.where(top, nearest, (lo + gap * h).clamp(vmin, vmax))
            loss = loss_of(scale * k) / power
            if it >= warm:  # beta anneals 20 -> 2 after the warm-up
                beta = 2 + 18 * (1 - (it - warm) / max(1, opts.iters - warm))
                loss = loss + opts.reg * (1 - (2 * h - 1).abs().pow(beta)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        k = torch.where(top, nearest, (lo + gap * (_rect_sigmoid(v) >= 0.5).to(lo.dtype)).clamp(vmin, vmax))
        wq = scale * k
        return wq if loss_of(wq) <= loss_of(scale * nearest) else scale * nearest


def _gram_update(s: dict, mod: nn.Module, xq: torch.Tensor, x: torch.Tensor) -> None:
    """Add a batch's positions to ``s``: H += x_q^T x_q, M += x_q^T x per group, T += ||x W^T||^2, and the rows
    themselves while there are no more of them than inputs."""
    if isinstance(mod, nn.Conv2d):
        G = mod.groups
        # (N, C*R*S, L) patches (a conv with tcprec_pad4 was padded by an earlier pre-hook)
        cols = lambda t: F.unfold(t, mod.kernel_size, mod.dilation, mod.padding, mod.stride)  # noqa: E731
        pq, pf = cols(xq), cols(x)
        pq = pq.transpose(1, 2).reshape(-1, G, pq.shape[1] // G)  # (N*L, G, Cg*R*S)
        pf = pf.transpose(1, 2).reshape(-1, G, pf.shape[1] // G)
    else:
        pq, pf = xq.reshape(-1, 1, x.shape[-1]), x.reshape(-1, 1, x.shape[-1])
    gq, gf = pq.transpose(0, 1), pf.transpose(0, 1)  # (G, P, I)
    s["H"] = s["H"] + (gq.transpose(1, 2) @ gq).double()  # (G, I, I)
    s["M"] = s["M"] + (gq.transpose(1, 2) @ gf).double()  # (G, I, I): x_q^T x
    w0 = mod.weight.detach().float().reshape(gq.shape[0], -1, gq.shape[2])  # (G, Kg, I)
    s["T"] += float((gf @ w0.transpose(1, 2)).double().pow(2).sum())  # ||x W0^T||^2
    s["n"] += pq.shape[0]
    if s["n"] <= pq.shape[2]:
        s["rows"].append((pq, pf))
    else:
        s["rows"] = []


@torch.no_grad()
def adaround_weights(model: nn.Module, names: list[str], batches, w_of, fmt_of, a_quant, opts: AdaRound,
                     budget_bytes: int = 256 << 20) -> dict[str, torch.Tensor]:
    """name -> the AdaRound weight of conv / linear ``name`` (its shape, float32, on its device), for the layers
    ``names``.  ``w_of(name)``: the float weight the layer quantizes (clipped, if clipping); ``fmt_of(name)``: its
    integer format; ``a_quant(name, x)``: the layer's input as its quantized layer sees it (quantized and back).

    The loss is over every output position of the batches, kept as Gram matrices (H = x_q^T x_q and x_q^T x per
    group: G I^2 numbers a layer), or as the rows themselves while they are fewer than the inputs (a linear layer
    on a few samples).  Passes over the batches each gather at most ``budget_bytes`` of them; then each layer is
    optimised on its own."""
    mods = dict(model.named_modules())
    chunks, cur, size = [], [], 0
    for n in names:  # passes whose statistics fit the budget
        m = mods[n]
        G = m.groups if isinstance(m, nn.Conv2d) else 1
        b = 2 * G * m.weight[0].numel() ** 2 * 8
        if cur and size + b > budget_bytes:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    if cur:
        chunks.append(cur)
    out = {}
    for chunk in chunks:
        st: dict[str, dict] = {n: {"H": 0, "M": 0, "T": 0.0, "rows": [], "n": 0} for n in chunk}
        hooks = []
        for n in chunk:
            m = mods[n]

            def pre(mod, args, n=n):
                x = args[0]
                if not isinstance(x, torch.Tensor):
                    return
                x = x.detach().float()
                _stats_of(mod, st[n], a_quant(n, x), x)
            hooks.append(m.register_forward_pre_hook(pre))
        _run_batches(model, batches, hooks)
        for n in chunk:
            out[n] = _solve(mods[n], st.pop(n), w_of(n), as_format(fmt_of(n)), opts)
    return out


def _solve(m: nn.Module, s: dict, w: torch.Tensor, fmt, opts: AdaRound) -> torch.Tensor:
    """The AdaRound weight of layer ``m`` (its shape, float32) from its statistics ``s`` (:func:`_gram_update`)
    and ``w``, the float weight it quantizes (clipped, if clipping)."""
    w = w.detach().float()
    G = m.groups if isinstance(m, nn.Conv2d) else 1
    wg = w.reshape(G, w.shape[0] // G, -1)  # (G, Kg, I)
    w0 = m.weight.detach().float().reshape(G, w.shape[0] // G, -1)  # the float layer's (unclipped) weight
    scale = (w.flatten(1).abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny)
             / absmax_qmax(fmt)).reshape(G, -1, 1)
    if s["rows"]:
        x = torch.cat([r[0] for r in s["rows"]])
        t = torch.einsum("pgi,gki->pgk", torch.cat([r[1] for r in s["rows"]]), w0)
        return _adaround(wg, scale, fmt, opts, samples=(x, t)).reshape(w.shape)
    C = s["M"] @ w0.double().transpose(1, 2)  # (G, I, Kg): x_q^T t
    return _adaround(wg.double(), scale.double(), fmt, opts, gram=(s["H"], C, s["T"])).float().reshape(w.shape)


def _stats_of(mod: nn.Module, s: dict, xq: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`_gram_update` over ``xq`` / ``x``, a few images at a time for a conv (its patches are R*S times the
    input)."""
    if isinstance(mod, nn.Conv2d):
        per = max(1, (1 << 24) // max(1, x[0].numel() * mod.weight[0, 0].numel()))
        for i in range(0, x.shape[0], per):
            _gram_update(s, mod, xq[i: i + per], x[i: i + per])
    else:
        _gram_update(s, mod, xq, x)


def _apply(mod: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if isinstance(mod, nn.Conv2d):  # (x was padded by the tcprec_pad4 pre-hook, if any)
        return F.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups)
    return F.linear(x, w, b)


@torch.no_grad()
def adaround_lockstep(model: nn.Module, layers: list[str], rounded: set, batches, w_of, w_dq, fmt_of, a_quant,
                      opts: AdaRound, bias_correction: bool) -> tuple[dict, dict]:
    """AdaRound on the quantized model's inputs (``AdaRound(inputs="quantized")``): ``(name -> rounded weight for
    the layers in rounded, name -> bias-correction delta for every layer of layers)`` (no deltas without
    ``bias_correction``).

    One forward of the calibration batches concatenated, twice over: the float half ``x`` and the quantized half.
    Each quantized layer (``layers``, in any order: the forward visits them in the model's) sees both halves: a
    layer in ``rounded`` is solved on its quantized-half input ``a_quant(name, x_q)`` against its float output
    ``x W^T``; then the quantized half leaves it as the quantized layer computes it -- input quantized, the rounded
    weight (or ``w_dq(name)``, nearest rounding), the bias less ``E[x (W_q - W)^T]`` (bias correction, per layer
    on the float half, as :func:`bias_deltas`) -- and the float half as the float layer does."""
    if any(not isinstance(b, torch.Tensor) for b in batches):
        raise ValueError("AdaRound(inputs='quantized') needs tensor calibration batches, got keyword-argument dicts; "
                         "use AdaRound(inputs='float') for a model called with keyword arguments")
    mixing = [n or type(model).__name__ for n, m in model.named_modules() if getattr(m, "batch_first", True) is False]
    if mixing:  # (the halves travel along dim 0: a sequence-first module would mix them, silently)
        raise ValueError(f"AdaRound(inputs='quantized') stacks the float and quantized calibration batches along dim "
                         f"0, but {mixing[:3]} (batch_first=False) mixes positions along dim 0, so the halves would "
                         "leak into each other; build the model with batch_first=True, or use AdaRound(inputs='float')")
    mods = dict(model.named_modules())
    xs = torch.cat([b for b in batches])
    B = xs.shape[0]
    out_w, deltas = {}, {}
    hooks = []
    for n in layers:
        def fwd(mod, args, out, n=n):
            x = args[0]
            if not isinstance(x, torch.Tensor) or x.shape[0] != 2 * B:
                raise ValueError(f"AdaRound(inputs='quantized'): {n!r} was called with a batch of "
                                 f"{tuple(x.shape)[:1]}, not the {2 * B} calibration images; the lockstep forward "
                                 "needs every layer to see the whole batch once")
            xf, xq = x[:B].detach().float(), a_quant(n, x[B:].detach().float())
            if n in rounded:
                st = {"H": 0, "M": 0, "T": 0.0, "rows": [], "n": 0}
                _stats_of(mod, st, xq, xf)
                out_w[n] = _solve(mod, st, w_of(n), as_format(fmt_of(n)), opts)
            wq = out_w[n] if n in rounded else w_dq(n).float()
            b = mod.bias.detach().float() if mod.bias is not None else None
            if bias_correction:
                e = _channel_errors(mod, xf, wq - mod.weight.detach().float())
                d = (e.double().sum(1) / e.shape[1]).float()  # (K,), as bias_deltas sums it
                deltas[n] = d
                b = -d if b is None else b - d
            yq = _apply(mod, xq, wq, b)
            return torch.cat([out[:B], yq.to(out.dtype)])
        hooks.append(mods[n].register_forward_hook(fwd))
    _run_batches(model, [torch.cat([xs, xs])], hooks)
    missing = [n for n in layers if n in rounded and n not in out_w]
    if missing:
        raise ValueError(f"AdaRound(inputs='quantized'): layers {missing[:4]} did not run on the calibration batch")
    return out_w, deltas
