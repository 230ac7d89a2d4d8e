"""Coverage: every convolution and linear computation of a model is quantized or listed with its reason.

``quantize_model`` converts the ``nn.Conv2d`` / ``nn.Linear`` modules its ``torch.fx`` graph calls.  Real models
compute convolutions in other ways too; this pass, run on the traced graph before the conversion, rewrites what can
be rewritten exactly into those plain modules, and :func:`uncovered` lists what stays float, so nothing is silent:

* ``F.conv2d`` / ``F.linear`` / ``F.conv1d`` calls whose weight (and bias) are parameters of the model and whose
  hyper-parameters are constants -> a plain ``nn.Conv2d`` / ``nn.Linear`` sharing those parameters, at the name of
  the module that owns the weight.  This is how subclasses with their own ``forward`` are seen (EfficientNet's
  static-"same"-padding ``Conv2d``: fx traces through any module defined outside ``torch.nn``, down to its
  ``F.conv2d``); a weight the forward computes (weight standardisation) stays float, listed.
* Zero padding in front of a conv (``nn.ZeroPad2d``, ``nn.ConstantPad2d(.., 0)``, ``F.pad(x, p)`` with value 0),
  read by that conv only: folded into the conv's padding when it is symmetric (exact: the same zeros); an
  asymmetric pad (TensorFlow "same" with stride 2: ``(0, 1, 0, 1)``) is handed to the conv as its four-sided
  padding (``conv.tcprec_pad4``), which the grouped / depthwise quantized conv takes; a dense conv keeps the pad
  in front as a float op (a note says so).
* ``nn.Conv1d`` (and ``F.conv1d``) -> ``unsqueeze(-2)`` + an ``nn.Conv2d`` with a (1, k) kernel + ``squeeze(-2)``
  (the same sums).
* A conv / linear module called with its input as a keyword (``fc(input=x)``) -> the positional call ``fc(x)``.

:func:`uncovered` names what is still float after conversion: an ``nn.MultiheadAttention`` that
``nn/attention.py`` did not decompose (a subclass, ``add_bias_kv``; its packed ``in_proj_weight`` runs inside
``F.multi_head_attention_forward``), layers inside modules fx keeps as leaves (``nn.Transformer``), conv kinds without a quantized path (``Conv3d``,
``ConvTranspose``), functional calls with computed weights, and layers of a model fx could not trace.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .attention import not_decomposed

__all__ = ["normalize_graph", "uncovered", "check_conv_coverage", "COVERED_KINDS"]

# module types whose computation is a convolution or a linear map: each is quantized or listed
COVERED_KINDS = (nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear, nn.MultiheadAttention, nn.RNNBase)

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_LINEAR_ARGS = ("input", "weight", "bias")
_PAD_FNS = (F.pad, torch.constant_pad_nd)


def _bind(node: fx.Node, names: tuple) -> dict | None:
    """The call's arguments by name (positional and keyword), or None when it has unknown keywords."""
    if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
        return None
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    return out


def _param_of(gm: fx.GraphModule, node) -> tuple[str, torch.Tensor] | None:
    """(target, tensor) of a ``get_attr`` node reading a parameter or buffer that nothing else reads."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr" and len(node.users) == 1):
        return None
    try:
        t = gm.get_parameter(node.target)
    except AttributeError:
        try:
            t = gm.get_buffer(node.target)
        except AttributeError:
            return None
    return node.target, t


def _const(v) -> bool:
    return isinstance(v, (int, float, str)) or (isinstance(v, (tuple, list)) and all(isinstance(e, int) for e in v))


def _free_name(gm: fx.GraphModule, owner: str, taken: set, kind: str = "conv") -> str:
    """The owner's name when it is not a module the graph calls itself, else ``owner_conv`` / ``owner_linear``
    (unique; ``fn_...`` for a call in the root's own forward)."""
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    name = owner
    i = 0
    while name in called or name in taken or not name:
        i += 1
        name = f"{owner or 'fn'}_{kind}{'' if i == 1 else i}"
    return name


def _install(gm: fx.GraphModule, name: str, new: nn.Module) -> None:
    """Put ``new`` at ``name``; an existing placeholder there (the traced-through subclass, which fx copied as a
    plain Module holding the weight and children such as ``static_padding``) has its children moved to siblings
    ``<leaf>_<child>`` (the graph's references follow), so that replacing the conv later loses none of them."""
    parent, _, leaf = name.rpartition(".")
    root = gm.get_submodule(parent) if parent else gm
    old = getattr(root, leaf, None)
    if isinstance(old, nn.Module):
        for cname, child in list(old.named_children()):
            sib = f"{leaf}_{cname}"
            setattr(root, sib, child)
            src, dst = f"{name}.{cname}", (f"{parent}.{sib}" if parent else sib)
            for n in gm.graph.nodes:
                if n.op in ("call_module", "get_attr") and (n.target == src or n.target.startswith(src + ".")):
                    n.target = dst + n.target[len(src):]
    setattr(root, leaf, new)


def _pad4_of(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """(left, right, top, bottom) of a constant zero 2-D pad node, else None."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if type(m) in (nn.ZeroPad2d, nn.ConstantPad2d) and getattr(m, "value", 0.0) == 0.0 and len(node.args) == 1:
            p = m.padding
            return tuple(p) if len(p) == 4 else None
        return None
    if node.op == "call_function" and node.target in _PAD_FNS:
        b = _bind(node, ("input", "pad", "mode", "value"))
        if b is None or b.get("mode", "constant") != "constant" or b.get("value", 0.0) not in (0, 0.0, None):
            return None
        p = b.get("pad")
        return tuple(p) if isinstance(p, (tuple, list)) and len(p) == 4 and all(isinstance(e, int) for e in p) else None
    return None


def _numeric_padding(padding, k: tuple, dilation: tuple) -> tuple | None:
    """A conv's padding as (ph, pw); ``"valid"`` -> 0, ``"same"`` -> half the span when it is symmetric."""
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        spans = [d * (kk - 1) for kk, d in zip(k, dilation)]
        return tuple(s // 2 for s in spans) if all(s % 2 == 0 for s in spans) else None
    return tuple(padding)


def normalize_graph(gm: fx.GraphModule) -> list[str]:
    """Rewrite functional convs / linears, Conv1d and zero pads of ``gm`` into plain modules (module docstring).
    Returns notes for the summary (what was rewritten, what stays float and why)."""
    g = gm.graph
    notes: list[str] = []
    taken: set = set()
    rewritten: list[str] = []
    for node in list(g.nodes):
        if node.op == "call_module" and not node.args and set(node.kwargs) == {"input"} and isinstance(
                gm.get_submodule(node.target), (nn.modules.conv._ConvNd, nn.Linear)):
            node.args, node.kwargs = (node.kwargs["input"],), {}  # fc(input=x): the same call, positional
        if node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.Conv1d:
            _conv1d_as_2d(gm, node, node.target, gm.get_submodule(node.target))
            continue
        if node.op != "call_function" or node.target not in (F.conv2d, torch.conv2d, F.linear, torch._C._nn.linear,
                                                             F.conv1d, torch.conv1d):
            continue
        linear = node.target in (F.linear, torch._C._nn.linear)
        b = _bind(node, _LINEAR_ARGS if linear else _CONV_ARGS)
        w = _param_of(gm, b.get("weight")) if b is not None else None
        bias = b.get("bias") if b is not None else None
        bp = _param_of(gm, bias) if isinstance(bias, fx.Node) else None
        hyper = {k: v for k, v in (b or {}).items() if k not in ("input", "weight", "bias")}
        if w is None or (bias is not None and bp is None) or not all(_const(v) for v in hyper.values()):
            continue  # stays a float call; uncovered() lists it
        wt, weight = w
        owner = wt.rpartition(".")[0]
        name = _free_name(gm, owner, taken, "linear" if linear else "conv")
        taken.add(name)
        if linear:
            new = nn.Linear(weight.shape[1], weight.shape[0], bias=bp is not None, device="meta")
        else:
            one = node.target in (F.conv1d, torch.conv1d)
            k = tuple(weight.shape[2:])
            two = lambda v, d: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
            stride, dilation = two(hyper.get("stride", 1), 1), two(hyper.get("dilation", 1), 1)
            padding = hyper.get("padding", 0)
            padding = padding if isinstance(padding, str) else two(padding, 0)
            groups = hyper.get("groups", 1)
            if one:
                new = nn.Conv1d(weight.shape[1] * groups, weight.shape[0], k, stride=stride[0], dilation=dilation[0],
                                padding=padding if isinstance(padding, str) else padding[0], groups=groups,
                                bias=bp is not None, device="meta")
            else:
                pad = _numeric_padding(padding, k, dilation)
                new = nn.Conv2d(weight.shape[1] * groups, weight.shape[0], k, stride=stride,
                                padding=pad if pad is not None else padding, dilation=dilation, groups=groups,
                                bias=bp is not None, device="meta")
        new.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        if bp is not None:
            new.bias = bp[1] if isinstance(bp[1], nn.Parameter) else nn.Parameter(bp[1], requires_grad=False)
        _install(gm, name, new)
        with g.inserting_before(node):
            call = g.call_module(name, (b["input"],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        g.erase_node(node)
        for n in list(g.nodes):
            if n.op == "get_attr" and n.target in (wt, bp and bp[0]) and not n.users:
                g.erase_node(n)
        rewritten.append(name)
        if isinstance(new, nn.Conv1d):
            _conv1d_as_2d(gm, call, name, new)
    if rewritten:
        notes.append(f"{len(rewritten)} functional conv / linear call(s) (a subclass's own forward or F.conv2d / "
                     f"F.linear in a forward) became plain modules: {', '.join(rewritten[:4])}"
                     + (" ..." if len(rewritten) > 4 else ""))
    notes += _fold_pads(gm)
    g.lint()
    gm.recompile()
    return notes


def _conv1d_as_2d(gm: fx.GraphModule, node: fx.Node, name: str, conv1: nn.Conv1d) -> None:
    """``conv1d(x)`` -> ``conv2d(x.unsqueeze(-2)).squeeze(-2)`` with a (1, k) kernel: the same sums."""
    if conv1.padding_mode != "zeros" or isinstance(conv1.padding, str):
        return  # uncovered() lists it with its padding
    c2 = nn.Conv2d(conv1.in_channels, conv1.out_channels, (1, conv1.kernel_size[0]), stride=(1, conv1.stride[0]),
                   padding=(0, conv1.padding[0]), dilation=(1, conv1.dilation[0]), groups=conv1.groups,
                   bias=conv1.bias is not None, device="meta")
    c2.weight = nn.Parameter(conv1.weight.detach().unsqueeze(2), requires_grad=False)  # (K, C/g, 1, k)
    if conv1.bias is not None:
        c2.bias = nn.Parameter(conv1.bias.detach(), requires_grad=False)
    c2.tcprec_from = "Conv1d"
    _install(gm, name, c2)
    g = gm.graph
    with g.inserting_before(node):
        x2 = g.call_method("unsqueeze", (node.args[0], -2))
    with g.inserting_after(node):
        y = g.call_method("squeeze", (node, -2))
    node.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
    node.args = (x2,)


def _pad_input(pad4, mod, args):
    top, bottom, left, right = pad4
    return (F.pad(args[0], (left, right, top, bottom)),) + tuple(args[1:])


def _fold_pads(gm: fx.GraphModule) -> list[str]:
    notes = []
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_module" or type(gm.get_submodule(node.target)) is not nn.Conv2d:
            continue
        conv = gm.get_submodule(node.target)
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node) or len(src.users) != 1 or isinstance(conv.padding, str) \
                or conv.padding_mode != "zeros":
            continue
        p4 = _pad4_of(src, gm)
        if p4 is None:
            continue
        left, right, top, bottom = p4
        if min(p4) < 0:
            continue
        ph, pw = conv.padding
        if left == right and top == bottom:
            conv.padding = (ph + top, pw + left)
        elif conv.groups > 1 and conv.groups == conv.in_channels:
            # a depthwise conv takes four-sided padding (the grouped quantized conv pads its codes so)
            conv.tcprec_pad4 = (top + ph, bottom + ph, left + pw, right + pw)
            conv.padding = (0, 0)
            # the float conv still pads (calibration runs it): a pre-hook; the quantized conv replaces it
            conv.register_forward_pre_hook(functools.partial(_pad_input, conv.tcprec_pad4))
        else:
            notes.append(f"{node.target}: asymmetric zero pad {p4} kept as a float op in front of the conv")
            continue
        node.args = (src.args[0],) + tuple(node.args[1:])
        g.erase_node(src)
        if any(p4):
            conv.tcprec_pad_folded = p4
    return notes


_LEAF_REASON = {
    nn.MultiheadAttention: "nn.MultiheadAttention: in_proj / out_proj run inside F.multi_head_attention_forward "
                           "(packed in_proj_weight), which is not decomposed; they stay float",
}


def uncovered(named: dict, converted: nn.Module, covered: set) -> list[tuple[str, str, str]]:
    """(name, kind, reason) of every conv / linear module of the original model (``named``: its
    ``dict(named_modules())`` taken before conversion) that ``converted`` did not quantize
    and that is not in ``covered`` (the names the summary already lists), plus float functional calls left in a
    traced ``converted``.  A module inside another listed one (an attention's ``out_proj``) is not listed again."""
    out: list[tuple[str, str, str]] = []
    conv_mods = dict(converted.named_modules())
    listed: list[str] = []
    # the attributes the traced graph reads: a module none of whose own are read never runs in the traced (eval) forward
    read = ({n.target for n in converted.graph.nodes if n.op in ("get_attr", "call_module")}
            if isinstance(converted, fx.GraphModule) else None)
    # attribute -> the functions that take it (a weight passed to a function fx keeps whole: Swin's attention)
    readers: dict[str, set[str]] = {}
    if read is not None:
        for n in converted.graph.nodes:
            if n.op == "get_attr":
                readers.setdefault(n.target, set()).update(
                    getattr(u.target, "__name__", str(u.target)) for u in n.users
                    if u.op == "call_function" and getattr(u.target, "__module__", None) != "_operator")
    for name, m in named.items():
        if not isinstance(m, COVERED_KINDS) or name in covered:
            continue
        if not name and isinstance(converted, fx.GraphModule):
            continue  # the root's own forward is the traced graph: its calls are listed below, or were quantized
        if any(name.startswith(p + ".") for p in listed):
            continue
        kind = "conv" if isinstance(m, nn.modules.conv._ConvNd) else "linear"
        now = conv_mods.get(name)
        if now is not None and type(now).__name__ in ("QConv2d", "QLinear", "QGroupedConv2d"):
            continue
        reason = not_decomposed(m) or next((r for t, r in _LEAF_REASON.items() if isinstance(m, t)), None)
        if reason is None:
            parent = next((p for p in _leaf_parents(named, name)), None)
            if isinstance(m, (nn.Conv3d, nn.modules.conv._ConvTransposeNd)):
                reason = f"{type(m).__name__} has no quantized path"
            elif isinstance(m, (nn.Bilinear, nn.RNNBase)):
                reason = f"{type(m).__name__} has no quantized path"
            elif parent is not None:
                reason = (f"inside {parent[0]} ({type(parent[1]).__name__}), which torch.fx keeps as one leaf call "
                          "(torch's fused fast path); not decomposed")
            elif type(m).forward is not type(m).__mro__[1].forward and type(m) not in (nn.Conv1d, nn.Conv2d, nn.Linear):
                reason = f"{type(m).__name__} has its own forward and was not seen as a plain conv / linear call"
            elif read is not None and not any(t == name or t.startswith(name + ".") for t in read):
                reason = ("not run by the model's forward in eval mode (the traced graph reads none of its weights): "
                          "e.g. an auxiliary head that runs only in training")
            elif fns := sorted({f for t, fs in readers.items() if t.startswith(name + ".") for f in fs}):
                reason = (f"its weights go to {', '.join(fns)} in its parent's code, a call torch.fx keeps whole "
                          "(not decomposed into a linear / conv): stays float")
            else:
                reason = "not called as a module in the traced graph (used through its parent's code)"
        out.append((name, kind, reason))
        listed.append(name)
    if isinstance(converted, fx.GraphModule):
        for n in converted.graph.nodes:
            if n.op == "call_function" and n.target in (F.conv2d, torch.conv2d, F.conv1d, torch.conv1d, F.linear,
                                                         F.conv3d, torch._C._nn.linear):
                kind = "linear" if "linear" in str(n.target) else "conv"
                out.append((n.name, kind, f"functional {getattr(n.target, '__name__', n.target)} with a computed "
                                          "weight or non-constant arguments: stays float"))
    return out


def _leaf_parents(named: dict, name: str):
    """Ancestors of ``name`` that torch.fx treats as leaves (torch.nn modules other than containers)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        pname = ".".join(parts[:i])
        p = named.get(pname)
        if p is not None and p.__module__.startswith("torch.nn") and not isinstance(p, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            yield pname, p


def check_conv_coverage(records) -> None:
    """A model with convolutions of which none is quantized (and not because the config said so) is an error."""
    convs = [r for r in records if r.kind == "conv"]
    if convs and all(r.precision == "float" for r in convs) and any(
            not r.backend.startswith("kept in float (config)") for r in convs):
        listing = "; ".join(f"{r.name}: {r.backend}" for r in convs[:8]) + (" ..." if len(convs) > 8 else "")
        raise ValueError(f"none of the model's {len(convs)} convolution(s) could be quantized ({listing}). "
                         "Rewrite them as nn.Conv2d (or report the pattern), or keep them float explicitly with "
                         "QuantConfig(overrides={name: 'float'})")

