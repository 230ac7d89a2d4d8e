"""Transformers for ``quantize_model``: ``nn.MultiheadAttention`` and the encoder layers, decomposed.

torch computes ``nn.MultiheadAttention`` inside ``F.multi_head_attention_forward`` (one packed ``in_proj_weight``,
``out_proj`` through ``F.linear``) and ``nn.TransformerEncoderLayer`` in eval mode through a fused kernel
(``torch._transformer_encoder_layer_fwd``) that reads the float weights of every linear.  Neither can take a
quantized weight.  :func:`decompose_transformers` swaps them, on quantize_model's copy of the model, for modules that
compute the same thing with every projection an ``nn.Linear`` called as a module, which ``torch.fx`` sees and
``quantize_model`` turns into ``QLinear`` like any other linear (first/last rule, overrides, calibration):

* :class:`MultiheadAttention`: ``q_proj``, ``k_proj``, ``v_proj`` (the three thirds of ``in_proj_weight``, or the
  separate ``q/k/v_proj_weight`` when ``kdim`` / ``vdim`` differ) and ``out_proj``; the attention itself in
  :class:`SDPAttention`.
* :class:`SDPAttention` (no parameters, a ``torch.fx`` leaf): splits heads, merges ``attn_mask`` and
  ``key_padding_mask`` as torch does (bool ``True`` = not attended, float masks added), runs
  ``F.scaled_dot_product_attention`` in the input's float dtype, merges heads.  ``need_weights=True``: the explicit
  softmax(QK^T / sqrt(d) + mask) V, returning the weights (averaged over heads unless ``average_attn_weights=False``).
  A leaf because the masks are optional: which of them are given is known only at call time.
* :class:`TransformerEncoderLayer` / :class:`TransformerEncoder` and :class:`TransformerDecoderLayer` /
  :class:`TransformerDecoder` (self-attention, cross-attention over ``memory``, feed-forward): torch's Python path (``norm_first`` both ways, any
  activation), never the fused fast path, so a quantized layer runs with quantized weights.  Outputs at padded
  positions are computed, as torch's Python path does (torch's nested-tensor fast path writes zeros there).

torchvision's Swin attention (``ShiftedWindowAttention``, ``ShiftedWindowAttentionV2``), whose linears torchvision
hands to a function fx keeps whole, is swapped likewise where torchvision is loaded: ``qkv`` and ``proj`` as
``nn.Linear`` around the window attention (nn/window_attention.py, docs/decisions/0161).

After conversion, :func:`fuse_qkv` stacks a self-attention's q / k / v QLinears (one input, one calibrated scale) into
one ``qkv_proj``: one quantize pass and one GEMM, the same numbers.  Three q / k / v kept float (the speed rule, or
overrides) become one float ``qkv_proj``, the one GEMM torch's own attention runs on its ``in_proj_weight``.

Where every linear of a swapped module stays float (the speed rule measured them slower quantized, or the config
says so), :func:`restore_torch_modules` puts the user's own torch module back -- the same weights, torch's forward
and its fused fast path, which the float model runs -- the outermost first (a whole ``TransformerEncoder``, else its
layers, else their attentions); the summary still lists each linear, float, with its reason (docs/decisions/0131).

The attention stays in float (docs/decisions/0081): its two batched GEMMs are ~4% of a ViT-B layer's FLOPs at
sequence 197, and quantizing Q, K and the softmax probabilities would add two calibrated scales per head for little.

Not decomposed (listed float by ``tcprec_summary``, with the reason): subclasses of these modules (and of
torchvision's Swin attentions),
``add_bias_kv`` / ``add_zero_attn`` attention, and modules inside a torch leaf (``nn.Transformer``).
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..qtensor import PerChannel, QTensor
from .qmodules import QLinear
from .window_attention import ShiftedWindowAttention, ShiftedWindowAttentionV2, torchvision_swaps

__all__ = ["SDPAttention", "MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder",
           "TransformerDecoderLayer", "TransformerDecoder", "decompose_transformers", "not_decomposed", "fuse_qkv",
           "TORCH_TWINS", "TwinCall", "restore_torch_modules"]


def _float_mask(mask, name: str, dtype: torch.dtype):
    """A bool mask (True = not attended) -> additive float (-inf there); a float mask as is, in ``dtype``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool or float tensor or None, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = not attended) or float (added to the scores), got {mask.dtype}; "
                        f"convert it with {name}.bool() or .float()")
    return mask.to(dtype)


class SDPAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V over ``num_heads`` heads, in ``F.scaled_dot_product_attention``.

    ``q`` (B, L, E) with ``batch_first``, else (L, B, E), or unbatched (L, E); ``k``, ``v`` likewise with S
    positions.  ``attn_mask`` (L, S) or (B * num_heads, L, S), ``key_padding_mask`` (B, S) (or (S,) unbatched): bool
    (True = not attended) or float (added).  ``is_causal``: the causal mask (torch's hint: with ``attn_mask`` given it
    is taken to be that mask; here it may also come alone).  Returns (output like ``q``, weights or None).

    >>> att = SDPAttention(2, batch_first=True)
    >>> q = torch.randn(3, 5, 8)
    >>> att(q, q, q)[0].shape
    torch.Size([3, 5, 8])
    """

    tcprec_fx_leaf = True  # quantize_model's tracer keeps it one call: the optional masks are resolved at run time

    def __init__(self, num_heads: int, batch_first: bool = False, dropout: float = 0.0):
        super().__init__()
        if not (isinstance(num_heads, int) and num_heads >= 1):
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads, self.batch_first, self.dropout = num_heads, bool(batch_first), float(dropout)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, batch_first={self.batch_first}, dropout={self.dropout}"

    def forward(self, q, k, v, attn_mask=None, key_padding_mask=None, need_weights: bool = False,
                is_causal=False, average_attn_weights: bool = True):
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() not in (2, 3):
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"attention {name} must be a float tensor of 3 dims (batched) or 2 (unbatched), "
                                 f"got {got}")
        batched = q.dim() == 3
        if not batched:  # (L, E) -> (1, L, E)
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            if isinstance(key_padding_mask, torch.Tensor):
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        B, L, E = q.shape
        S, H = k.shape[1], self.num_heads
        if E % H or k.shape[0] != B or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"attention shapes do not agree: query {tuple(q.shape)}, key {tuple(k.shape)}, value "
                             f"{tuple(v.shape)} (batch first), num_heads={H}: need one batch, key and value of one "
                             "length, and E divisible by num_heads")
        D, Ev = E // H, v.shape[2]
        qh = q.reshape(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        kh = k.reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        vh = v.reshape(B, S, H, Ev // H).transpose(1, 2)  # (B, H, S, Dv)
        causal = bool(is_causal)
        explicit = key_padding_mask is not None or need_weights  # SDPA's is_causal cannot be merged with these
        if causal and explicit and attn_mask is None:
            attn_mask = torch.full((L, S), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)  # top-left causal
        if causal and not explicit:
            attn_mask = None  # torch's rule: the mask given with the hint is the causal one; SDPA applies it
        mask = self._merged_mask(attn_mask, key_padding_mask, B, L, S, q.dtype)
        causal = causal and not explicit
        p = self.dropout if self.training else 0.0
        if need_weights:  # the explicit math path, as F.multi_head_attention_forward's
            scores = (qh * math.sqrt(1.0 / D)) @ kh.transpose(-2, -1)  # (B, H, L, S)
            if mask is not None:
                scores = scores + mask
            w = torch.softmax(scores, dim=-1)
            oh = (F.dropout(w, p) if p > 0 else w) @ vh  # (B, H, L, Dv)
            w = w.mean(dim=1) if average_attn_weights else w
        else:
            oh = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=p, is_causal=causal)
            w = None
        o = oh.transpose(1, 2).reshape(B, L, Ev)  # heads merged: (B, L, Ev)
        if not batched:
            return o.squeeze(0), (None if w is None else w.squeeze(0))
        return (o if self.batch_first else o.transpose(0, 1)), w

    def _merged_mask(self, attn_mask, key_padding_mask, B, L, S, dtype):
        """(B or 1, H or 1, L or 1, S) additive float mask, or None."""
        am = _float_mask(attn_mask, "attn_mask", dtype)
        kpm = _float_mask(key_padding_mask, "key_padding_mask", dtype)
        if am is not None:
            if am.dim() == 2 and tuple(am.shape) == (L, S):
                am = am.view(1, 1, L, S)
            elif am.dim() == 3 and tuple(am.shape) == (B * self.num_heads, L, S):
                am = am.view(B, self.num_heads, L, S)
            elif am.dim() == 3 and tuple(am.shape) == (1, L, S):
                am = am.view(1, 1, L, S)
            else:
                raise ValueError(f"attn_mask must be (L, S) = {(L, S)} or (B * num_heads, L, S) = "
                                 f"{(B * self.num_heads, L, S)}, got {tuple(am.shape)}")
        if kpm is not None:
            if tuple(kpm.shape) != (B, S):
                raise ValueError(f"key_padding_mask must be (batch, source length) = {(B, S)}, got {tuple(kpm.shape)}")
            kpm = kpm.view(B, 1, 1, S)
            am = kpm if am is None else am + kpm
        return am


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    """A plain nn.Linear holding copies of ``w`` (out, in) and ``b``."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    lin.weight.requires_grad_(w.requires_grad)
    return lin


class MultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its projections as four ``nn.Linear`` (``q_proj``, ``k_proj``, ``v_proj``,
    ``out_proj``) and the attention in :class:`SDPAttention`; the same forward signature and results.
    ``quantize_model`` quantizes the four linears; build one from a torch module with :meth:`from_torch`.

    >>> mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    >>> x = torch.randn(3, 5, 8)
    >>> torch.allclose(MultiheadAttention.from_torch(mha)(x, x, x)[0], mha(x, x, x)[0], atol=1e-6)
    True
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, kdim=None, vdim=None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if not (isinstance(embed_dim, int) and isinstance(num_heads, int) and num_heads >= 1
                and embed_dim % num_heads == 0):
            raise ValueError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim!r}, "
                             f"num_heads={num_heads!r}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.attn = SDPAttention(num_heads, batch_first, dropout)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> "MultiheadAttention":
        """The same weights, split out of ``in_proj_weight`` (or the separate q/k/v weights); copies, so the source
        is not changed."""
        why = not_decomposed(mha)
        if why:
            raise ValueError(f"cannot decompose this attention: {why}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        E = mha.embed_dim
        m.embed_dim, m.num_heads, m.batch_first = E, mha.num_heads, mha.batch_first
        m.kdim, m.vdim = mha.kdim, mha.vdim
        b = mha.in_proj_bias.detach() if mha.in_proj_bias is not None else None
        if mha._qkv_same_embed_dim:
            w = mha.in_proj_weight.detach()  # (3E, E): q, k, v rows
            ws = (w[:E], w[E:2 * E], w[2 * E:])
        else:
            ws = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        bs = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        m.q_proj, m.k_proj, m.v_proj = (_linear(w_, b_) for w_, b_ in zip(ws, bs))
        m.out_proj = _linear(mha.out_proj.weight.detach(),
                             None if mha.out_proj.bias is None else mha.out_proj.bias.detach())
        m.attn = SDPAttention(mha.num_heads, mha.batch_first, mha.dropout)
        m.train(mha.training)
        return m

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        o, w = self.attn(q, k, v, attn_mask, key_padding_mask, need_weights, is_causal, average_attn_weights)
        return self.out_proj(o), w


class TransformerEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer``'s Python path (post- or pre-norm, any activation) over a
    :class:`MultiheadAttention`: the same submodule names and results, never torch's fused kernel.  Build one with
    :meth:`from_torch`."""

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> "TransformerEncoderLayer":
        m = cls()
        m.self_attn = MultiheadAttention.from_torch(layer.self_attn)
        for name in ("linear1", "dropout", "linear2", "norm1", "norm2", "dropout1", "dropout2"):
            setattr(m, name, getattr(layer, name))
        m.norm_first = layer.norm_first
        m.activation = layer.activation  # F.relu / F.gelu (fx records the call and fuses it into linear1) or a module
        m.train(layer.training)
        return m

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


@torch.fx.wrap
def _causal_flag(is_causal) -> bool:
    """``is_causal`` as the bool a layer takes (None: False, the mask applied as given).  A graph node when traced:
    the encoder's ``is_causal`` is the traced model's input there, so the conversion happens when the model runs, in
    front of each layer, torch's own ``nn.TransformerEncoderLayer`` too (restore_torch_modules), whose slow path hands
    it to ``scaled_dot_product_attention``, which refuses None."""
    return bool(is_causal)


class TransformerEncoder(nn.Module):
    """``nn.TransformerEncoder``'s Python path: its layers in turn (then ``norm``), never the nested-tensor fast path.
    ``is_causal=None`` is not detected from the mask (that reads its values): the mask is applied as given."""

    @classmethod
    def from_torch(cls, enc: nn.TransformerEncoder) -> "TransformerEncoder":
        m = cls()
        m.layers, m.norm = nn.ModuleList(enc.layers), enc.norm  # (a new list: swapping its layers leaves enc's)
        m.train(enc.training)
        return m

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        x = src
        causal = _causal_flag(is_causal)  # (a layer may be torch's own again: nn.TransformerEncoderLayer wants a bool)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=causal, src_key_padding_mask=src_key_padding_mask)
        return x if self.norm is None else self.norm(x)


class TransformerDecoderLayer(nn.Module):
    """``nn.TransformerDecoderLayer``'s Python path (post- or pre-norm, any activation): self-attention and
    cross-attention (over ``memory``) as two :class:`MultiheadAttention` (``self_attn``, ``multihead_attn``), then
    the feed-forward block; the same submodule names and results.  Build one with :meth:`from_torch`."""

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer) -> "TransformerDecoderLayer":
        m = cls()
        m.self_attn = MultiheadAttention.from_torch(layer.self_attn)
        m.multihead_attn = MultiheadAttention.from_torch(layer.multihead_attn)
        for name in ("linear1", "dropout", "linear2", "norm1", "norm2", "norm3", "dropout1", "dropout2", "dropout3"):
            setattr(m, name, getattr(layer, name))
        m.norm_first = layer.norm_first
        m.activation = layer.activation
        m.train(layer.training)
        return m

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal):
        x = self.multihead_attn(x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                need_weights=False, is_causal=is_causal)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerDecoder(nn.Module):
    """``nn.TransformerDecoder``'s Python path: its layers in turn (then ``norm``).  ``tgt_is_causal=None`` is not
    detected from the mask (that reads its values): the mask is applied as given."""

    @classmethod
    def from_torch(cls, dec: nn.TransformerDecoder) -> "TransformerDecoder":
        m = cls()
        m.layers, m.norm = nn.ModuleList(dec.layers), dec.norm  # (a new list: swapping its layers leaves dec's)
        m.train(dec.training)
        return m

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                      memory_is_causal=memory_is_causal)
        return x if self.norm is None else self.norm(x)


def not_decomposed(m: nn.Module) -> str | None:
    """Why ``decompose_transformers`` leaves ``m`` as it is (None: it is decomposed)."""
    if type(m) is nn.MultiheadAttention:
        if m.bias_k is not None or m.add_zero_attn:
            return ("nn.MultiheadAttention with add_bias_kv / add_zero_attn is not decomposed; its in_proj / out_proj "
                    "run inside F.multi_head_attention_forward and stay float")
        return None
    if type(m) is nn.TransformerEncoderLayer:
        return not_decomposed(m.self_attn)
    if type(m) is nn.TransformerDecoderLayer:
        return not_decomposed(m.self_attn) or not_decomposed(m.multihead_attn)
    if type(m) in (nn.TransformerEncoder, nn.TransformerDecoder):
        return None
    if isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder,
                      nn.TransformerDecoderLayer, nn.TransformerDecoder)):
        return (f"{type(m).__name__} subclasses {type(m).__mro__[1].__name__} with its own code; only the torch "
                "classes themselves are decomposed")
    return None


_SWAP = {nn.MultiheadAttention: MultiheadAttention, nn.TransformerEncoderLayer: TransformerEncoderLayer,
         nn.TransformerEncoder: TransformerEncoder, nn.TransformerDecoderLayer: TransformerDecoderLayer,
         nn.TransformerDecoder: TransformerDecoder}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _traced_through(m: nn.Module) -> bool:
    """Whether torch.fx traces into ``m`` (not a torch.nn leaf other than a container, nor a tcprec leaf)."""
    torch_leaf = m.__module__.startswith("torch.nn") and not isinstance(m, _CONTAINERS)
    return not torch_leaf and not getattr(m, "tcprec_fx_leaf", False)


def decompose_transformers(model: nn.Module, originals: dict | None = None) -> tuple[nn.Module, list[str]]:
    """Swap, in place, every ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder``
    (and decoder) that torch.fx would reach for the modules of this file (module docstring), keeping every name (the
    projections add ``q_proj`` / ``k_proj`` / ``v_proj`` under the attention's name); likewise torchvision's Swin
    attentions for nn/window_attention.py's twins (the same names, plus the ``core``), where torchvision is loaded.
    Returns (the model, which is a new object when the root itself was swapped; the names of the swapped
    attentions).  ``originals`` (a dict) receives name -> the torch module swapped there (a layer's attentions too),
    unchanged by the swap, for :func:`restore_torch_modules`."""
    swapped: list[str] = []
    swaps = {**_SWAP, **torchvision_swaps()}  # (torchvision's Swin attentions where torchvision is loaded)

    def swap(m: nn.Module, name: str) -> nn.Module:
        new = m
        if type(m) in swaps and not_decomposed(m) is None:
            new = swaps[type(m)].from_torch(m)
            if originals is not None:
                originals[name] = m
                for a in ("self_attn", "multihead_attn"):  # a layer's attentions: restorable one by one
                    if isinstance(new, (TransformerEncoderLayer, TransformerDecoderLayer)) and hasattr(new, a):
                        originals[f"{name}.{a}" if name else a] = getattr(m, a)
            if isinstance(new, (MultiheadAttention, ShiftedWindowAttention)):
                swapped.append(name)
            elif isinstance(new, TransformerEncoderLayer):
                swapped.append(f"{name}.self_attn" if name else "self_attn")
            elif isinstance(new, TransformerDecoderLayer):
                swapped.extend(f"{name}.{a}" if name else a for a in ("self_attn", "multihead_attn"))
        if not _traced_through(new):
            return new
        for cname, child in list(new.named_children()):
            if isinstance(child, MultiheadAttention):
                continue  # (a decomposed layer's attention, counted above)
            c = swap(child, f"{name}.{cname}" if name else cname)
            if c is not child:
                setattr(new, cname, c)
        return new

    return swap(model, ""), swapped


def fuse_qkv(gm: fx.GraphModule, records: dict) -> list[str]:
    """Self-attention after conversion: ``q_proj``, ``k_proj`` and ``v_proj`` QLinears that read one tensor with one
    activation format and calibrated scale (their input is the same tensor) become one ``qkv_proj`` QLinear with
    their rows stacked -- per-output-channel codes and scales, so the same numbers -- and its output is split in
    three: one quantize pass and one (3E, E) GEMM instead of three of each.  Three plain float ``nn.Linear`` q / k / v
    (kept float by the speed rule or overrides) likewise become one float ``qkv_proj``, as torch's attention computes
    them (one GEMM on ``in_proj_weight``).  The fused module's ``tcprec_fused`` names its members (the speed rule
    times it as one layer and floats all three).  Returns the fused names; ``records`` (the summary's) say where each
    projection went."""
    g = gm.graph
    mods = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for n in g.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    fused = []
    for node in list(g.nodes):
        if node.op != "call_module" or not isinstance(mods.get(node.target), SDPAttention) or len(node.args) < 3:
            continue
        qkv = node.args[:3]
        if len(set(qkv)) != 3 or not all(isinstance(p, fx.Node) and p.op == "call_module" for p in qkv):
            continue
        ms = [mods.get(p.target) for p in qkv]
        x = qkv[0].args[0] if qkv[0].args else None
        a = ms[0]
        quantized = all(isinstance(m, QLinear) for m in ms)
        floated = all(type(m) is nn.Linear for m in ms)
        if not (quantized or floated) or not all(
                p.args == (x,) and not p.kwargs and len(p.users) == 1 and calls[p.target] == 1 for p in qkv):
            continue
        if floated:
            if not all(m.in_features == a.in_features and (m.bias is None) == (a.bias is None)
                       and m.weight.dtype == a.weight.dtype and m.weight.device == a.weight.device for m in ms):
                continue
            w = torch.cat([m.weight.detach() for m in ms])  # (3E, E): torch's in_proj_weight
            new = _linear(w, None if a.bias is None else torch.cat([m.bias.detach() for m in ms]))
        else:
            same = all(m.precision == a.precision and m.a_fmt == a.a_fmt and m.w_fmt == a.w_fmt
                       and m.backend == a.backend and m.out_dtype == a.out_dtype
                       and m.fp8_fast_accum == a.fp8_fast_accum and m.act is None and m.out_fmt is None
                       and m.in_channels_last is None and torch.equal(m.in_scale, a.in_scale)
                       and m.in_features == a.in_features and (m.bias is None) == (a.bias is None) for m in ms)
            if not same:
                continue
            new = copy.deepcopy(a)
            codes = torch.cat([m.weight_codes for m in ms])  # (3E, 1, 1, K): the rows of q, k, v
            scale = torch.cat([m.weight_scale for m in ms])  # (3E, 1, 1, 1)
            new.weight = QTensor(codes, scale, a.w_fmt, PerChannel(0), tuple(codes.shape), torch.float32)
            if a.bias is not None:
                new.bias = torch.cat([m.bias for m in ms])
            new.out_features = sum(m.out_features for m in ms)
        new.tcprec_fused = tuple(p.target for p in qkv)  # the float model's names (the speed rule's overrides)
        parent = qkv[0].target.rpartition(".")[0]
        name = f"{parent}.qkv_proj" if parent else "qkv_proj"
        if name in mods:
            continue
        root = gm.get_submodule(parent) if parent else gm
        setattr(root, "qkv_proj", new)
        with g.inserting_before(qkv[0]):
            y = g.call_module(name, (x,))
            parts = g.call_method("split", (y, [m.out_features for m in ms], -1))
            outs = [g.call_function(operator.getitem, (parts, i)) for i in range(3)]
        for p, o in zip(qkv, outs):
            p.replace_all_uses_with(o)
            g.erase_node(p)
            rec = records.get(p.target)
            if rec is not None:
                rec.out = f"rows of {name} (one {'float ' if floated else ''}GEMM with q/k/v)"
        fused.append(name)
    if fused:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return fused


# -- the user's own torch module back where nothing in it is quantized -------------------------------------------

# the stand-ins; quantize_model's tracer records each call of one (TwinCall)
TORCH_TWINS = (*_SWAP.values(), ShiftedWindowAttention, ShiftedWindowAttentionV2)
_CONST = (type(None), bool, int, float, str)


@dataclass
class TwinCall:
    """One call of a stand-in in the traced graph: its module name, the call's arguments and its result (fx Nodes
    where the tracer had proxies), and the nodes the tracer made during the call."""

    path: str
    args: tuple
    kwargs: dict
    out: object  # a Node, or a tuple of Node / None (an attention's (output, weights))
    made: tuple = ()

    @classmethod
    def of(cls, path: str, args, kwargs, out, made=()) -> "TwinCall":
        node = lambda v: v.node if isinstance(v, fx.Proxy) else v  # noqa: E731
        return cls(path, *(fx.node.map_aggregate(v, node) for v in (args, kwargs, out)), tuple(made))

    def region(self) -> set | None:
        """The nodes the call computed (those made during it, and any put since on the way from its result back to
        its arguments), or None when it cannot be cut out as one module call: an argument that is not a node or a
        plain constant, a result that is not a node (or a tuple of them), an input erased since, or a node inside
        that is read outside."""
        flat: list = []
        fx.node.map_aggregate((self.args, self.kwargs), flat.append)
        if not all(isinstance(a, (fx.Node, *_CONST)) for a in flat):
            return None
        ins = {a for a in flat if isinstance(a, fx.Node)}
        outs = [self.out] if isinstance(self.out, fx.Node) else list(self.out) if isinstance(self.out, tuple) else None
        if outs is None or not all(o is None or isinstance(o, fx.Node) for o in outs):
            return None
        outs = [o for o in outs if o is not None]
        if not outs or any(n._erased for n in (*ins, *outs)) or any(o in ins for o in outs):
            return None
        region = {n for n in self.made if not n._erased}  # (unused ones too: an attention's weights)
        stack = list(outs)
        seen: set = set()
        while stack:
            n = stack.pop()
            if n in ins or n in seen:
                continue
            seen.add(n)
            if n.op in ("placeholder", "output"):
                return None  # (reached the graph's input other than through the call's arguments)
            region.add(n)
            stack.extend(n.all_input_nodes)
        if any(u not in region for n in region.difference(outs) for u in n.users):
            return None
        return region


def restore_torch_modules(gm: fx.GraphModule, calls: list[TwinCall], originals: dict, layers: list[str],
                          is_float) -> tuple[nn.Module, dict[str, list[str]]]:
    """Where every linear of a stand-in stays float (``is_float(name)``: the speed rule's decision, or the config),
    the model gets the user's own torch module back (``originals``: name -> the module ``decompose_transformers``
    swapped, from quantize_model's copy): the same weights, and torch's forward with its fused fast path -- exactly
    what the float model runs, where the decomposed float layers would run the Python path.  The outermost first: a
    whole ``TransformerEncoder`` when all its layers are float, else each float layer, else each float attention; a
    module with one quantized linear inside stays decomposed.  The graph's nodes of each of its calls (``calls``:
    quantize_model's tracer records them) become one ``call_module`` with that call's arguments.

    ``layers``: the conv / linear names the graph calls.  Returns (the model: ``gm``, or the torch root itself when
    the root was swapped and everything is float; name -> the layers now inside the torch module there)."""
    def inside(p: str) -> list[str]:
        return [n for n in layers if not p or n.startswith(p + ".")]

    root = inside("")
    if "" in originals and root and all(is_float(n) for n in root):
        return originals[""], {"": root}
    g = gm.graph
    done: dict[str, list[str]] = {}
    moved: dict[fx.Node, fx.Node] = {}  # a restored call's result -> the torch module's (later calls may read it)
    for path in sorted((p for p in originals if p), key=lambda p: p.count(".")):
        names = inside(path)
        if any(path.startswith(d + ".") for d in done) or not names or not all(is_float(n) for n in names):
            continue
        now = lambda v: moved.get(v, v) if isinstance(v, fx.Node) else v  # noqa: E731
        mine = [replace(c, args=fx.node.map_aggregate(c.args, now), kwargs=fx.node.map_aggregate(c.kwargs, now))
                for c in calls if c.path == path]
        regions = [c.region() for c in mine]
        if not mine or any(r is None for r in regions):
            continue
        cut = set().union(*regions)
        if any(n.op in ("call_module", "get_attr") and (n.target == path or n.target.startswith(path + "."))
               and n not in cut for n in g.nodes):
            continue  # (something else reads a module under it)
        parent, _, leaf = path.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, originals[path])
        for c, region in zip(mine, regions):
            at = {n: i for i, n in enumerate(g.nodes)}
            with g.inserting_after(max(region, key=at.__getitem__)):
                new = g.call_module(path, tuple(c.args), dict(c.kwargs))
            outs = [(c.out, new)] if isinstance(c.out, fx.Node) else []
            if isinstance(c.out, tuple):  # (an attention's (output, weights): getitem of the torch module's tuple)
                cur = new
                for i, o in enumerate(c.out):
                    if o is not None:
                        with g.inserting_after(cur):
                            cur = g.call_function(operator.getitem, (new, i))
                        outs.append((o, cur))
            for o, r in outs:
                # the shape / dtype ShapeProp saw there: the residual fusions read them at the add after a restored
                # module (a decomposed layer after torch's layer: x + out_proj(..), x being torch's output)
                if "tensor_meta" in o.meta:
                    r.meta["tensor_meta"] = o.meta["tensor_meta"]
                o.replace_all_uses_with(r, delete_user_cb=lambda u, region=region: u not in region)
                moved[o] = r
            for n in sorted(region, key=at.__getitem__, reverse=True):
                g.erase_node(n)
        done[path] = names
    if done:
        g.lint()
        gm.recompile()
    return gm, done
