"""Low-precision gradient all-reduce with Auto Precision Scaling (APS), as in CPD, exactly.

For N nodes (processes x emulated nodes per process) and each gradient tensor g:

    e   = ceil(log2(max|g| * N))            per tensor, per node; then a MAX all-reduce
    s   = top - e                           top = 2**(E-1) - 1 (E exponent bits; <= log2 max)
    q_i = R(g_i * 2**s)                     one rounding (from the exact float64 product)
    S   = R(...R(R(q_0 + q_1) + q_2)... + q_{N-1})     node by node, in node order, every add
                                                      exactly rounded (Kahan optional)
    g   = S * 2**-s / N                     the mean, as DDP expects

Since |q_i| <= 2**top / N, no partial sum exceeds 2**top <= max: no overflow for any N, any
gradient up to the float32 max.  All-zero tensors keep s = 0 and give zeros.

Transports (bit-identical; only the bytes on the wire differ):
* ``"emulate"``:    float32 values on the wire (what CPD does).
* ``"compressed"``: the format's codes as uint8 (4x fewer bytes).
Both run a reduce-scatter (``all_to_all_single``: node values of shard j go to rank j, which sums
them in node order) and an all-gather of the reduced shards.  Node order is global: node
``rank * n_local + i``, so 4 processes x 1 node and 1 process x 4 emulated nodes give the same bits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..formats import FloatFormat, as_format
from ..kernels import reference as ref
from ..kernels.reference_emulate import add_round_to_odd
from ..ops.cast import decode, encode

__all__ = ["aps_top_exponent", "check_aps_format", "allreduce_lowp", "lowp_allreduce_hook", "LowpAllreduceHook",
           "TRANSPORTS"]

log = logging.getLogger("tcprec.distributed")
TRANSPORTS = ("emulate", "compressed")
_ZERO_E = -(1 << 40)  # exponent of an all-zero tensor (any real e is larger)


def aps_top_exponent(fmt: FloatFormat) -> int:
    """The exponent APS shifts the largest sum to: 2**(E-1) - 1, capped so that 2**top <= max."""
    return min((1 << (fmt.exp - 1)) - 1, math.floor(math.log2(fmt.max)))


def check_aps_format(fmt, n_nodes: int) -> FloatFormat:
    """ValueError unless APS with ``fmt`` keeps the largest gradient of each of ``n_nodes`` nodes a
    normal number of ``fmt`` (2**top / N >= min normal); call it before training starts."""
    fmt = as_format(fmt)
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"the all-reduce format must be a float format, got {fmt}")
    if fmt.bits > 16:
        raise ValueError(f"the all-reduce format must have <= 16 bits (codes on the wire), got {fmt} ({fmt.bits} bits)")
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    top = aps_top_exponent(fmt)
    if math.ldexp(1.0, top) / n_nodes < fmt.min_normal:
        n_max = 2 ** (top - fmt.emin)
        raise ValueError(
            f"{fmt} has too few exponent bits for APS over {n_nodes} nodes: each node's share 2**{top}/{n_nodes} "
            f"falls below the smallest normal 2**{fmt.emin}, so gradients would flush to zero; use at most "
            f"{n_max} nodes or a format with more exponent bits (e.g. e4m3 or e5m2)"
        )
    return fmt


def _ceil_log2(m: torch.Tensor, n: int) -> torch.Tensor:
    """ceil(log2(m * n)) exactly, for m > 0 float32 (int64 out; via frexp, no log rounding)."""
    f, x = torch.frexp(m.double())  # m = f * 2**x, f in [0.5, 1)
    f2, x2 = torch.frexp(f * n)  # exact: 24-bit f times an integer n < 2**29
    return x.long() + torch.where(f2 > 0.5, x2.long(), x2.long() - 1)


def _round(x64: torch.Tensor, fmt, rounding) -> torch.Tensor:
    return ref.cast_float(x64, fmt, rounding)


def _reduce_in_order(vals: torch.Tensor, fmt, rounding: str, kahan: bool) -> torch.Tensor:
    """vals (N, L) float64 values of fmt -> their sum (L,), node by node, each add rounded to fmt."""
    s = vals[0].clone()
    c = torch.zeros_like(s)
    for i in range(1, vals.shape[0]):
        p = vals[i]
        if kahan:
            y = _round(add_round_to_odd(p, -c), fmt, rounding)
            t = _round(add_round_to_odd(s, y), fmt, rounding)
            c = _round(add_round_to_odd(_round(add_round_to_odd(t, -s), fmt, rounding), -y), fmt, rounding)
            s = t
        else:
            s = _round(add_round_to_odd(s, p), fmt, rounding)
    return s


@dataclass
class AllreduceInfo:
    nonfinite_input: bool = False
    nonfinite_output: bool = False
    shifts: torch.Tensor | None = None  # per tensor s (int64)


def allreduce_lowp(grads: torch.Tensor, sizes: list[int], fmt, *, aps: bool = True, kahan: bool = False,
                   transport: str = "compressed", rounding: str = "nearest", group=None) -> tuple[torch.Tensor, AllreduceInfo]:
    """The mean over all nodes of flat gradients ``grads`` (n_local, numel), reduced in ``fmt``.

    ``sizes``: the lengths of the tensors packed in a row (APS scales each one separately).
    Works without an initialised process group (one process: its n_local emulated nodes).
    Returns (mean (numel,) float32, info); on a non-finite input anywhere the mean is all NaN and
    ``info.nonfinite_input`` is True (the caller skips the step).
    """
    fmt = as_format(fmt)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got transport={transport!r}")
    if grads.dim() != 2 or sum(sizes) != grads.shape[1]:
        raise ValueError(f"grads must be (n_local, numel) with numel = sum(sizes) = {sum(sizes)}, got {tuple(grads.shape)}")
    use_dist = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if use_dist else 1
    n_local, numel = grads.shape
    n = world * n_local
    check_aps_format(fmt, n) if aps else None
    dev = grads.device
    grads = grads.float()
    info = AllreduceInfo()

    # ---- 1. per-tensor exponents and the non-finite flag: one MAX all-reduce ------------------------
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev))  # (numel,)
    amax = torch.zeros(len(sizes), device=dev).scatter_reduce(0, seg, grads.abs().amax(0), "amax")  # (T,)
    bad = ~torch.isfinite(grads).all()
    e = torch.where(amax > 0, _ceil_log2(torch.where(amax > 0, amax, 1.0), n), _ZERO_E)  # (T,) int64
    e = torch.where(torch.isfinite(amax), e, _ZERO_E)
    msg = torch.cat([e, bad.long().view(1)])
    if use_dist and world > 1:
        dist.all_reduce(msg, op=dist.ReduceOp.MAX, group=group)
    if bool(msg[-1]):
        info.nonfinite_input = True
        return torch.full((numel,), float("nan"), device=dev), info
    e = msg[:-1]
    shift = torch.where(e > _ZERO_E, aps_top_exponent(fmt) - e, 0) if aps else torch.zeros_like(e)
    info.shifts = shift
    scale = torch.ldexp(torch.ones(len(sizes), dtype=torch.float64, device=dev), shift.double())[seg]  # exact 2**s

    # ---- 2. scale and round once to fmt ---------------------------------------------------------------
    q = _round(grads.double() * scale, fmt, rounding)  # (n_local, numel) float64 values of fmt
    if not fmt.has_nan:  # keep the codes encodable: both transports see +Inf for an overflow NaN
        q = torch.nan_to_num(q, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))

    # ---- 3. reduce-scatter in node order (all_to_all), then all-gather --------------------------------
    shard = -(-numel // (4 * world)) * 4  # a multiple of 4: codes travel as int32 words (see _words)
    pad = shard * world - numel
    qp = torch.nn.functional.pad(q, (0, pad))  # (n_local, world * shard)
    send = qp.view(n_local, world, shard).transpose(0, 1).contiguous()  # (world, n_local, shard)
    wire = _to_wire(send, fmt, transport)
    if use_dist and world > 1:
        recv = torch.empty_like(wire)
        dist.all_to_all_single(_words(recv), _words(wire), group=group)  # equal splits: world blocks
    else:
        recv = wire
    vals = _from_wire(recv, fmt, transport).reshape(n, shard)  # node r*n_local + i in row order
    s = _reduce_in_order(vals, fmt, rounding, kahan)  # (shard,) float64 values of fmt
    if not fmt.has_nan:
        s = torch.nan_to_num(s, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    mine = _to_wire(s, fmt, transport)
    if use_dist and world > 1:
        everyone = torch.empty(world * shard, dtype=mine.dtype, device=dev)
        _all_gather_single(_words(everyone), _words(mine), group=group)
    else:
        everyone = mine.view(1, shard)
    total = _from_wire(everyone, fmt, transport).reshape(-1)[:numel]  # (numel,) float64

    # ---- 4. undo the shift, take the mean -------------------------------------------------------------
    out = total / scale / n
    # rounding a value near float32's max up to the next power of two in fmt can step past float32's
    # range although the exact mean cannot: clamp finite results (Inf from an overflow stays Inf)
    fmax = torch.finfo(torch.float32).max
    out = torch.where(torch.isfinite(out), out.clamp(-fmax, fmax), out).float()
    info.nonfinite_output = not bool(torch.isfinite(out).all())
    return out, info


def _words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a flat int32 tensor (gloo's all_to_all rejects uint8/int16 tensors)."""
    return t.reshape(-1).view(torch.int32)


def _all_gather_single(out, inp, group=None):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group)


def _to_wire(v64: torch.Tensor, fmt, transport: str) -> torch.Tensor:
    if transport == "emulate":
        return v64.float()  # exact: values of fmt
    return encode(v64.float(), fmt, backend="reference" if not v64.is_cuda else "auto")  # uint8 / int16 codes


def _from_wire(w: torch.Tensor, fmt, transport: str) -> torch.Tensor:
    if transport == "emulate":
        return w.double()
    return decode(w, fmt).double()


# --------------------------------------------------------------------------------------------------
# The DDP comm hook
# --------------------------------------------------------------------------------------------------


@dataclass
class HookStats:
    calls: int = 0
    nonfinite_input: int = 0
    nonfinite_output: int = 0
    last_nonfinite: bool = False
    history: list = field(default_factory=list)


class LowpAllreduceHook:
    """A DDP comm hook: ``ddp.register_comm_hook(None, hook)``.  Gradients of each bucket are reduced
    by :func:`allreduce_lowp` (per-parameter APS).  Non-finite gradients: logged, ``stats`` updated,
    and the bucket returned as NaN so that a finiteness check (``LossScaler``) skips the step."""

    def __init__(self, fmt, aps=True, kahan=False, transport="compressed", rounding="nearest", group=None):
        self.fmt = as_format(fmt)
        self.aps, self.kahan, self.transport, self.rounding, self.group = aps, kahan, transport, rounding, group
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got transport={transport!r}")
        if dist.is_available() and dist.is_initialized() and aps:
            check_aps_format(self.fmt, dist.get_world_size(group))  # before the first step, not in it
        self.stats = HookStats()
        self.__name__ = self.__qualname__ = f"lowp_allreduce_hook_{self.fmt}"  # DDP logs hooks by name

    def __call__(self, state, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        sizes = [g.numel() for g in bucket.gradients()]
        if sum(sizes) != buf.numel():  # gradients as views may not tile the buffer: treat it as one tensor
            sizes = [buf.numel()]
        out, info = allreduce_lowp(buf.view(1, -1), sizes, self.fmt, aps=self.aps, kahan=self.kahan,
                                   transport=self.transport, rounding=self.rounding, group=self.group)
        self._record(info, bucket.index())
        buf.copy_(out.view_as(buf))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def _record(self, info: AllreduceInfo, where) -> None:
        self.stats.calls += 1
        self.stats.last_nonfinite = info.nonfinite_input
        if info.nonfinite_input:
            self.stats.nonfinite_input += 1
            log.warning("non-finite gradient (NaN/Inf) in bucket %s on some rank: step must be skipped", where)
        elif info.nonfinite_output:
            self.stats.nonfinite_output += 1
            log.warning("all-reduce in %s overflowed in bucket %s (aps=%s)", self.fmt, where, self.aps)


# DDP checks the return annotation as an object; `from __future__ import annotations` made it a string
LowpAllreduceHook.__call__.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def lowp_allreduce_hook(fmt, aps: bool = True, kahan: bool = False, transport: str = "compressed",
                        rounding: str = "nearest", group=None) -> LowpAllreduceHook:
    """A DDP comm hook that all-reduces gradients in ``fmt`` with APS.

    >>> # ddp = DistributedDataParallel(model)
    >>> # ddp.register_comm_hook(None, lowp_allreduce_hook("e4m3", aps=True))
    """
    return LowpAllreduceHook(fmt, aps, kahan, transport, rounding, group)
