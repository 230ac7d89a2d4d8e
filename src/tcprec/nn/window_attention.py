"""torchvision's Swin window attention for ``quantize_model``: ``qkv`` and ``proj`` as linears that torch.fx sees.

torchvision's ``ShiftedWindowAttention`` (Swin) and ``ShiftedWindowAttentionV2`` (Swin-V2) compute everything in one
function, ``shifted_window_attention(x, self.qkv.weight, self.proj.weight, ...)``, that torchvision registers with
``torch.fx.wrap``: fx keeps it one call, so the two linears whose weights it takes are never layers of the traced
graph and stay float (24 of Swin-T's linears, 48 of Swin-S / B's).  Tracing into it instead fails: its padding and
shift mask branch on the feature map's size.

``qkv`` and ``proj`` are per-token linears, so they commute with what happens to the tokens between them:

* torchvision pads the (B, H, W, C) input to whole windows, shifts it cyclically, cuts it into windows and only then
  applies ``qkv``; :class:`ShiftedWindowAttention` applies ``qkv`` to the unpadded, unshifted input (a traced
  ``nn.Linear``) and :class:`WindowAttention` (an fx leaf) pads, shifts and partitions its output.  The padded
  tokens are not zero there: torchvision's are ``qkv(0)``, its bias, and they take part in the attention as keys and
  values, so the core pads with that row (``pad_row``; a quantized ``qkv`` gives it too: codes 0 and the bias).
* torchvision applies ``proj`` per window, then merges the windows, reverses the shift and drops the padding; the
  twin applies ``proj`` (a traced ``nn.Linear``) after the core has done all that -- the same rows, padded ones
  dropped.

The float twin computes what torchvision computes, op for op inside the windows (test_window_attention.py checks
it to float rounding in float32 and float64, against torchvision and against a re-implementation that needs no
torchvision).  The relative position bias is computed in the twin's traced forward as torchvision does it, so
Swin-V2's ``cpb_mlp`` linears stay what they were, layers of the graph.  Swin-V2 zeroes the key third of the ``qkv``
bias in every forward (on a copy); the twin's ``qkv`` carries that bias.

tcprec does not import torchvision: ``decompose_transformers`` (nn/attention.py) looks the classes up in
``sys.modules`` (:func:`torchvision_swaps`), where a model that holds one has put them.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WindowAttention", "ShiftedWindowAttention", "ShiftedWindowAttentionV2", "torchvision_swaps"]


class WindowAttention(nn.Module):
    """Swin's window attention from the ``qkv`` projection's output to the input of ``proj``: pad to whole windows
    (with ``pad_row``, what ``qkv`` gives a zero token), shift cyclically by ``shift_size`` (none along a side the
    window covers), partition into windows, attention per window and head (plus the relative position bias and, when
    shifted, torchvision's -100 mask between regions that were not adjacent), merge the windows, reverse the shift,
    drop the padding.  ``cosine``: Swin-V2's scaled cosine attention (``logit_scale`` per head, clamped at log 100)
    instead of softmax(Q K^T / sqrt(d)).

    ``qkv`` (B, H, W, 3C), ``bias`` (1, heads, N, N) with N = window area, ``logit_scale`` (heads, 1, 1) or None;
    returns (B, H, W, C).  An fx leaf: the padding and the shift depend on H and W, known only at run time.
    """

    tcprec_fx_leaf = True  # quantize_model's tracer keeps it one call: its padding and mask branch on the shape

    def __init__(self, window_size, shift_size, num_heads: int, pad_row: torch.Tensor, cosine: bool = False,
                 attention_dropout: float = 0.0):
        super().__init__()
        if len(window_size) != 2 or len(shift_size) != 2:
            raise ValueError(f"window_size and shift_size must be of length 2, got {window_size!r}, {shift_size!r}")
        self.window_size, self.shift_size = [int(s) for s in window_size], [int(s) for s in shift_size]
        self.num_heads, self.cosine, self.attention_dropout = int(num_heads), bool(cosine), float(attention_dropout)
        self.register_buffer("pad_row", pad_row.detach().clone())  # (3C,): qkv of a zero token

    def extra_repr(self) -> str:
        return (f"window_size={self.window_size}, shift_size={self.shift_size}, num_heads={self.num_heads}, "
                f"cosine={self.cosine}, attention_dropout={self.attention_dropout}")

    def forward(self, qkv: torch.Tensor, bias: torch.Tensor, logit_scale: torch.Tensor | None = None):
        if qkv.dim() != 4 or qkv.shape[-1] != self.pad_row.numel():
            raise ValueError(f"window attention takes qkv (B, H, W, {self.pad_row.numel()}), got {tuple(qkv.shape)}")
        B, H, W, C3 = qkv.shape
        C, heads = C3 // 3, self.num_heads
        wh, ww = self.window_size
        pad_b, pad_r = (wh - H % wh) % wh, (ww - W % ww) % ww
        pH, pW = H + pad_b, W + pad_r
        if pad_b or pad_r:  # torchvision pads its input with zeros in front of qkv: those tokens are qkv(0)
            x = self.pad_row.to(qkv.dtype).expand(B, pH, pW, C3).clone()
            x[:, :H, :W] = qkv
        else:
            x = qkv
        sh, sw = (0 if wh >= pH else self.shift_size[0]), (0 if ww >= pW else self.shift_size[1])
        shifted = sh + sw > 0
        if shifted:
            x = torch.roll(x, shifts=(-sh, -sw), dims=(1, 2))
        nW, N = (pH // wh) * (pW // ww), wh * ww
        x = x.view(B, pH // wh, wh, pW // ww, ww, C3).permute(0, 1, 3, 2, 4, 5).reshape(B * nW, N, C3)
        q, k, v = x.reshape(B * nW, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        if self.cosine:
            attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            attn = attn * torch.clamp(logit_scale, max=math.log(100.0)).exp()
        else:
            attn = (q * (C // heads) ** -0.5).matmul(k.transpose(-2, -1))
        attn = attn + bias
        if shifted:
            attn = attn.view(B, nW, heads, N, N) + self._shift_mask(pH, pW, sh, sw, x).unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, heads, N, N)
        attn = F.softmax(attn, dim=-1)
        attn = F.dropout(attn, p=self.attention_dropout, training=self.training)
        x = attn.matmul(v).transpose(1, 2).reshape(B * nW, N, C)
        x = x.view(B, pH // wh, pW // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5).reshape(B, pH, pW, C)
        if shifted:
            x = torch.roll(x, shifts=(sh, sw), dims=(1, 2))
        return x[:, :H, :W, :].contiguous()

    def _shift_mask(self, pH: int, pW: int, sh: int, sw: int, like: torch.Tensor) -> torch.Tensor:
        """(windows, N, N): 0 between tokens of one region of the shifted map, -100 between regions the cyclic
        shift put side by side (torchvision's mask)."""
        wh, ww = self.window_size
        mask = like.new_zeros((pH, pW))
        count = 0
        for h in ((0, -wh), (-wh, -sh), (-sh, None)):
            for w in ((0, -ww), (-ww, -sw), (-sw, None)):
                mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        mask = mask.view(pH // wh, wh, pW // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


def _relative_position_bias(table: torch.Tensor, index: torch.Tensor, window_size) -> torch.Tensor:
    """(1, heads, N, N): the per-head bias of each (query, key) offset in a window, gathered from ``table``."""
    N = window_size[0] * window_size[1]
    return table[index].view(N, N, -1).permute(2, 0, 1).contiguous().unsqueeze(0)


class ShiftedWindowAttention(nn.Module):
    """torchvision's ``ShiftedWindowAttention`` (Swin) with ``qkv`` and ``proj`` called as modules around
    :class:`WindowAttention` (``core``): the same names and results.  ``quantize_model`` quantizes the two linears;
    build one with :meth:`from_torch`."""

    _cosine = False  # (V2: scaled cosine attention)

    @classmethod
    def from_torch(cls, m: nn.Module) -> "ShiftedWindowAttention":
        """The twin of torchvision's module ``m``, sharing its submodules, parameters and buffers under the same
        names (``m`` is not changed)."""
        t = cls()
        t.window_size, t.shift_size, t.num_heads = list(m.window_size), list(m.shift_size), int(m.num_heads)
        t.attention_dropout, t.dropout = float(m.attention_dropout), float(m.dropout)
        for name, c in m.named_children():  # qkv, proj (V2: cpb_mlp)
            setattr(t, name, c)
        for name, p in m.named_parameters(recurse=False):  # relative_position_bias_table (V2: logit_scale)
            setattr(t, name, p)
        for name, b in m.named_buffers(recurse=False):  # relative_position_index (V2: relative_coords_table)
            t.register_buffer(name, b, persistent=name not in m._non_persistent_buffers_set)
        t.qkv = cls._qkv(m.qkv)
        pad = t.qkv.bias.detach() if t.qkv.bias is not None else t.qkv.weight.new_zeros(t.qkv.out_features)
        t.core = WindowAttention(t.window_size, t.shift_size, t.num_heads, pad, cosine=cls._cosine,
                                 attention_dropout=t.attention_dropout)
        t.train(m.training)
        return t

    @staticmethod
    def _qkv(qkv: nn.Linear) -> nn.Linear:
        """The ``qkv`` linear the twin calls: torchvision's."""
        return qkv

    def relative_position_bias(self) -> torch.Tensor:
        return _relative_position_bias(self.relative_position_bias_table, self.relative_position_index,
                                       self.window_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.core(self.qkv(x), self.relative_position_bias())
        return F.dropout(self.proj(o), p=self.dropout, training=self.training)


class ShiftedWindowAttentionV2(ShiftedWindowAttention):
    """torchvision's ``ShiftedWindowAttentionV2`` (Swin-V2: scaled cosine attention with ``logit_scale``, the
    relative position bias 16 sigmoid(.) of the ``cpb_mlp`` network's output) as :class:`ShiftedWindowAttention`
    does it.  ``qkv``'s bias is torchvision's with its key third zeroed, as torchvision's forward zeroes it (on a
    copy) in every call."""

    _cosine = True

    @staticmethod
    def _qkv(qkv: nn.Linear) -> nn.Linear:
        """A linear sharing torchvision's ``qkv`` weight, with the bias its forward uses."""
        if qkv.bias is None:
            return qkv
        b = qkv.bias.detach().clone()
        n = b.numel() // 3
        b[n:2 * n] = 0
        lin = nn.Linear(qkv.in_features, qkv.out_features, device="meta")  # (its weight and bias replaced next)
        lin.weight = qkv.weight
        lin.bias = nn.Parameter(b, requires_grad=qkv.bias.requires_grad)
        return lin

    def relative_position_bias(self) -> torch.Tensor:
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        return 16 * torch.sigmoid(_relative_position_bias(table, self.relative_position_index, self.window_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.core(self.qkv(x), self.relative_position_bias(), self.logit_scale)
        return F.dropout(self.proj(o), p=self.dropout, training=self.training)


def torchvision_swaps() -> dict:
    """torchvision's Swin attention classes -> their twins, where torchvision's Swin module is loaded (a model that
    holds one has loaded it), else nothing: tcprec never imports torchvision."""
    swin = sys.modules.get("torchvision.models.swin_transformer")
    if swin is None:
        return {}
    pairs = (("ShiftedWindowAttention", ShiftedWindowAttention), ("ShiftedWindowAttentionV2", ShiftedWindowAttentionV2))
    return {getattr(swin, a): t for a, t in pairs if isinstance(getattr(swin, a, None), type)}
