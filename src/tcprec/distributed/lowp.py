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

Two implementations, same bits (tests/test_allreduce_fused.py, tests/gpu/test_allreduce_gpu.py):
* CUDA tensors: the fused Triton kernels of kernels/triton/allreduce.py (three or four launches
  and a zero fill around two or three collectives, no host sync; the flags in ``AllreduceInfo``
  are read from the device only when asked for; ``graph=True`` replays the whole call as one CUDA
  graph).  Where it moves no more bytes (one process, or two processes with
  one node each) every rank all-gathers every node's codes and reduces the whole vector itself,
  in node order as the reduce-scatter does: one collective and one kernel fewer, the same bits.
  Formats or modes those kernels cannot do exactly (``can_implement`` says why: stochastic
  rounding, formats of more than 16 bits) run the reference, with a warning.
* everything else (CPU): the pure-torch float64 reference below, the ground truth.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..enums import DETERMINISTIC_ROUNDINGS
from ..formats import FloatFormat, as_format
from ..kernels import reference as ref
from ..kernels.reference_emulate import add_round_to_odd
from ..kernels.triton import BACKENDS, choose_backend
from ..ops.cast import code_dtype, decode, encode

__all__ = ["aps_top_exponent", "check_aps_format", "allreduce_lowp", "lowp_allreduce_hook", "LowpAllreduceHook",
           "release_graphs", "TRANSPORTS"]

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


class AllreduceInfo:
    """What one all-reduce saw.  ``nonfinite_input``: a gradient on some node was NaN/Inf (the mean is
    all NaN: skip the step).  ``nonfinite_output``: the low-precision sum overflowed.  ``shifts``: the
    APS shift s of each tensor (int64; undefined after a non-finite input).  ``backend``: which
    implementation ran, and why.  The fused CUDA path leaves the flags on the device: the first read
    of each is one host sync, so a caller that never reads them never waits."""

    def __init__(self, nonfinite_input=False, nonfinite_output=False, shifts=None, backend: str = ""):
        self._input, self._output, self._shifts, self.backend = nonfinite_input, nonfinite_output, shifts, backend

    @staticmethod
    def _read(v):
        v = v() if callable(v) else v
        return bool(v) if isinstance(v, torch.Tensor) else v

    @property
    def nonfinite_input(self) -> bool:
        self._input = self._read(self._input)
        return self._input

    @property
    def nonfinite_output(self) -> bool:
        self._output = self._read(self._output)
        return self._output

    @property
    def shifts(self) -> torch.Tensor | None:
        if callable(self._shifts):
            self._shifts = self._shifts()
        return self._shifts

    def __repr__(self) -> str:
        return (f"AllreduceInfo(nonfinite_input={self.nonfinite_input}, nonfinite_output={self.nonfinite_output}, "
                f"backend={self.backend!r})")


def allreduce_lowp(grads: torch.Tensor, sizes: list[int], fmt, *, aps: bool = True, kahan: bool = False,
                   transport: str = "compressed", rounding: str = "nearest", group=None,
                   backend: str = "auto", graph: bool = False) -> tuple[torch.Tensor, AllreduceInfo]:
    """The mean over all nodes of flat gradients ``grads`` (n_local, numel), reduced in ``fmt``.

    ``sizes``: the lengths of the tensors packed in a row (APS scales each one separately).
    Works without an initialised process group (one process: its n_local emulated nodes).
    Returns (mean (numel,) float32, info); on a non-finite input anywhere the mean is all NaN and
    ``info.nonfinite_input`` is True (the caller skips the step).
    ``backend``: ``"auto"`` (fused Triton kernels on CUDA, the reference elsewhere), ``"triton"``
    (also under TRITON_INTERPRET=1 on the CPU; raises where the kernels cannot run) or ``"reference"``.
    ``graph=True`` (CUDA tensors, fused kernels): the call is captured once per input buffer and
    layout as a CUDA graph, kernels and collectives together, and replayed after, so its host cost
    is one graph launch; every rank must make the same calls.  The returned mean is then the
    graph's own buffer, overwritten by the next call on the same buffer: copy it out before then;
    call :func:`release_graphs` before destroying the process group.

    >>> mean, info = allreduce_lowp(torch.randn(4, 10), [3, 7], "e4m3")   # 4 emulated nodes
    >>> mean.shape, info.nonfinite_input
    (torch.Size([10]), False)
    """
    fmt = as_format(fmt)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got transport={transport!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"rounding must be one of {ROUNDINGS}, got rounding={rounding!r}"
            + ("; stochastic rounding inside the all-reduce would need random bits that every rank draws "
               "identically for the same element and node, which is not implemented: use a deterministic mode"
               if rounding == "stochastic" else ""))
    if grads.dim() != 2 or sum(sizes) != grads.shape[1]:
        raise ValueError(f"grads must be (n_local, numel) with numel = sum(sizes) = {sum(sizes)}, got {tuple(grads.shape)}")
    use_dist = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if use_dist else 1
    n_local, numel = grads.shape
    n = world * n_local
    check_aps_format(fmt, n) if aps else None
    path, why = _choose_path(grads, fmt, rounding, backend)
    if graph and not (path == "triton" and grads.is_cuda):
        raise ValueError(f"graph=True needs CUDA tensors on the fused kernels' path; this call runs {why} on "
                         f"{grads.device}: use graph=False")
    if graph and not (grads.dtype == torch.float32 and grads.is_contiguous()):
        raise ValueError(f"graph=True replays reads of the input buffer itself: it must be float32 and contiguous, "
                         f"got {grads.dtype}{'' if grads.is_contiguous() else ', not contiguous'}")
    if path == "triton":
        g32 = grads.float().contiguous()
        run = lambda: _allreduce_fused(g32, sizes, fmt, aps, kahan, transport, rounding, group,  # noqa: E731
                                       use_dist and world > 1, world, why)
        if graph:
            from ..kernels.triton import allreduce as ka

            key = (g32.data_ptr(), g32.shape, g32.device, tuple(sizes), fmt, aps, kahan, transport, rounding, group,
                   world, ka.BLOCK)
            return _allreduce_graphed(key, run, why)
        return run()
    return _allreduce_reference(grads.float(), sizes, fmt, aps, kahan, transport, rounding, group,
                                use_dist and world > 1, world, why)


# the deterministic modes: every rank must compute the same bits for the same sums
ROUNDINGS = DETERMINISTIC_ROUNDINGS
_WARNED: set = set()


def _choose_path(grads: torch.Tensor, fmt, rounding: str, backend: str) -> tuple[str, str]:
    """("triton" | "reference", why).  A CUDA tensor whose format or mode the fused kernels cannot do
    exactly runs the reference, and says so (once per reason); asking for "triton" then raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    name, why = choose_backend(grads, backend, "fused all-reduce kernels")
    if name == "reference":
        return name, why
    from ..kernels.triton import allreduce as ka

    reason = ka.can_implement(fmt, rounding)
    if reason is None:
        return "triton", why
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this all-reduce: {reason}; use backend='reference'")
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("allreduce_lowp: the fused kernels cannot run this all-reduce (%s): using the pure-torch "
                    "reference (float64, much slower)", reason)
    return "reference", f"pure-torch reference: {reason}"


_CACHE: dict = {}


def _cached(key, make):
    """Per-(sizes, device) tensor starts and per-(format, device) decode tables, made once."""
    v = _CACHE.get(key)
    if v is None:
        if len(_CACHE) >= 256:
            _CACHE.clear()
        v = _CACHE[key] = make()
    return v


def _wire_shape(numel: int, world: int) -> int:
    # shard: a multiple of 16, so codes travel as int32 words (_words) and every row starts 16-byte aligned
    return -(-numel // (16 * world)) * 16


def _gathers(world: int, n_local: int) -> bool:
    """The all-gather exchange (every rank gets every node's codes and reduces the whole vector)
    moves (world - 1) * n_local values per rank; reduce-scatter + all-gather move (world - 1) / world
    * (n_local + 1).  All-gather is no more bytes for one process, or two with one node each, and
    it is one collective and one kernel fewer."""
    return world == 1 or (world == 2 and n_local == 1)


def _allreduce_fused(grads, sizes, fmt, aps, kahan, transport, rounding, group, use_dist, world, why):
    """The same algorithm as _allreduce_reference, in the kernels of kernels/triton/allreduce.py."""
    from ..kernels.triton import allreduce as ka

    n_local, numel = grads.shape
    n = world * n_local
    dev = grads.device
    T = len(sizes)
    top = aps_top_exponent(fmt)
    if numel == 0:
        return torch.zeros(0, device=dev), AllreduceInfo(shifts=torch.zeros(T, dtype=torch.int64, device=dev),
                                                         backend=why)
    gathers = _gathers(world, n_local)
    shard = _wire_shape(numel, 1 if gathers else world)
    lay = ka.layout(sizes, numel, 1 if gathers else world, shard, dev)  # cached: tensor starts, block tables
    lut = _cached(("lut", fmt, dev), lambda: decode(torch.arange(fmt.n_codes), fmt).to(dev))  # (2**bits,) f32

    # ---- 1. per-tensor max |g| and the non-finite flag: one MAX all-reduce ---------------------------
    state = ka.state_buffer(T, dev)  # (T + 2,) int32: max |g| bits, non-finite input, overflow (0 here)
    ka.amax(grads, lay, state)
    if use_dist:
        dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)

    # ---- 2. scale, round once, lay out for the exchange (compressed: codes; emulate: float32) -------
    wdt = torch.float32 if transport == "emulate" else code_dtype(fmt)  # uint8 up to 8 bits, int16 up to 16
    out = torch.empty(numel, dtype=torch.float32, device=dev)
    if gathers:
        # ---- 3a. all-gather every node's codes; sum in node order and take the mean in one kernel ----
        send = torch.empty(1, n_local, shard, dtype=wdt, device=dev)  # (1, n_local, row)
        ka.encode(grads, lay, state, send, fmt, rounding, aps, top, n)
        if use_dist:
            everyone = torch.empty(world * n_local * shard, dtype=wdt, device=dev)  # (world, n_local, row)
            _all_gather_single(_words(everyone), _words(send), group=group)
        else:
            everyone = send
        ka.reduce_finish(everyone.view(n, shard), out, lut, lay, state, fmt, rounding, kahan, aps, top)
        how = "all-gather"
    else:
        # ---- 3b. reduce-scatter in node order (all_to_all), all-gather, then the mean ------------------
        send = torch.empty(world, n_local, shard, dtype=wdt, device=dev)  # (world, n_local, shard)
        ka.encode(grads, lay, state, send, fmt, rounding, aps, top, n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(_words(recv), _words(send), group=group)
        mine = torch.empty(shard, dtype=wdt, device=dev)
        ka.reduce(recv.view(n, shard), mine, lut, fmt, rounding, kahan, aps)  # rows: node r * n_local + i
        everyone = torch.empty(world * shard, dtype=wdt, device=dev)
        _all_gather_single(_words(everyone), _words(mine), group=group)
        ka.finish(everyone, out, lut, lay, state, fmt, n, aps, top)
        how = "reduce-scatter"
    return out, _fused_info(state, T, n, top, aps, f"{why}, {how} exchange")


def _fused_info(state: torch.Tensor, T: int, n: int, top: int, aps: bool, backend: str) -> AllreduceInfo:
    """AllreduceInfo over the fused path's device state; each flag is read (one sync) when asked."""

    def shifts():
        amax = state[:T].view(torch.float32)  # the all-reduced max |g| of each tensor
        ok = (amax > 0) & torch.isfinite(amax)
        e = torch.where(ok, _ceil_log2(torch.where(ok, amax, 1.0), n), _ZERO_E)
        return torch.where(e > _ZERO_E, top - e, 0) if aps else torch.zeros_like(e)

    return AllreduceInfo(nonfinite_input=lambda: state[T], nonfinite_output=lambda: state[T + 1], shifts=shifts,
                         backend=backend)


_GRAPHS: dict = {}  # (input address, layout, options) -> (CUDA graph, its output, info maker)
_NO_GRAPH: dict = {}  # the same keys, where capture failed: why


def release_graphs() -> None:
    """Free the CUDA graphs that ``graph=True`` captured.  Call it before
    ``dist.destroy_process_group()``: a graph holding NCCL kernels keeps its communicator alive,
    and tearing the process group down under a live graph hung (H200 x2, torch 2.11)."""
    if _GRAPHS and torch.cuda.is_available():
        torch.cuda.synchronize()
    _GRAPHS.clear()
    _NO_GRAPH.clear()


def _allreduce_graphed(key, run, why):
    """Replay a CUDA graph of the fused path for this input buffer and layout (captured on the
    first call, after two eager warm-up calls that compile the kernels and set up the
    communicator); where capture fails, say so once and run eagerly."""
    hit = _GRAPHS.get(key)
    if hit is None:
        if key in _NO_GRAPH:
            return run()
        run()
        run()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out, info = run()
        except Exception as e:  # noqa: BLE001  (reported, then the eager path: no silent fall-back)
            _NO_GRAPH[key] = f"{type(e).__name__}: {e}"
            log.warning("allreduce_lowp(graph=True): CUDA graph capture failed (%s); running eagerly", _NO_GRAPH[key])
            return run()
        if len(_GRAPHS) >= 16:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        hit = _GRAPHS[key] = (graph, out, info)
    graph, out, info = hit
    graph.replay()
    fresh = AllreduceInfo(info._input, info._output, info._shifts, info.backend)  # flags read anew
    return out, fresh


def _allreduce_reference(grads, sizes, fmt, aps, kahan, transport, rounding, group, use_dist, world, why):
    """The ground truth: float64 tensors, every rounding by kernels/reference.py."""
    n_local, numel = grads.shape
    n = world * n_local
    dev = grads.device
    info = AllreduceInfo(backend=why)

    # ---- 1. per-tensor exponents and the non-finite flag: one MAX all-reduce ------------------------
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev))  # (numel,)
    amax = torch.zeros(len(sizes), device=dev).scatter_reduce(0, seg, grads.abs().amax(0), "amax")  # (T,)
    bad = ~torch.isfinite(grads).all()
    e = torch.where(amax > 0, _ceil_log2(torch.where(amax > 0, amax, 1.0), n), _ZERO_E)  # (T,) int64
    e = torch.where(torch.isfinite(amax), e, _ZERO_E)
    msg = torch.cat([e, bad.long().view(1)])
    if use_dist:
        dist.all_reduce(msg, op=dist.ReduceOp.MAX, group=group)
    if bool(msg[-1]):
        info._input = True
        return torch.full((numel,), float("nan"), device=dev), info
    e = msg[:-1]
    shift = torch.where(e > _ZERO_E, aps_top_exponent(fmt) - e, 0) if aps else torch.zeros_like(e)
    info._shifts = shift
    # exact 2**s from the exponent bits: torch.ldexp is x * pow(2, s), and CUDA's pow is not specified
    # to be exact (on an H200 this path rounded the exact e4m3 tie -23 to -22 where the CPU gives -24)
    scale = ((shift + 1023) << 52).view(torch.float64)[seg]

    # ---- 2. scale and round once to fmt ---------------------------------------------------------------
    q = _round(grads.double() * scale, fmt, rounding)  # (n_local, numel) float64 values of fmt
    if not fmt.has_nan:  # keep the codes encodable: both transports see +Inf for an overflow NaN
        q = torch.nan_to_num(q, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))

    # ---- 3. reduce-scatter in node order (all_to_all), then all-gather --------------------------------
    shard = _wire_shape(numel, world)
    pad = shard * world - numel
    qp = torch.nn.functional.pad(q, (0, pad))  # (n_local, world * shard)
    send = qp.view(n_local, world, shard).transpose(0, 1).contiguous()  # (world, n_local, shard)
    wire = _to_wire(send, fmt, transport)
    if use_dist:
        recv = torch.empty_like(wire)
        dist.all_to_all_single(_words(recv), _words(wire), group=group)  # equal splits: world blocks
    else:
        recv = wire
    vals = _from_wire(recv, fmt, transport).reshape(n, shard)  # node r*n_local + i in row order
    s = _reduce_in_order(vals, fmt, rounding, kahan)  # (shard,) float64 values of fmt
    if not fmt.has_nan:
        s = torch.nan_to_num(s, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    mine = _to_wire(s, fmt, transport)
    if use_dist:
        everyone = torch.empty(world * shard, dtype=mine.dtype, device=dev)
        _all_gather_single(_words(everyone), _words(mine), group=group)
    else:
        everyone = mine.view(1, shard)
    total = _from_wire(everyone, fmt, transport).reshape(-1)[:numel]  # (numel,) float64

    # ---- 4. undo the shift, take the mean -------------------------------------------------------------
    # one division by the exact scale * n (a tensor: CUDA divides by a Python-number divisor as a
    # multiply by its rounded reciprocal, which is not the correctly rounded quotient)
    out = total / (scale * n)
    # rounding a value near float32's max up to the next power of two in fmt can step past float32's
    # range although the exact mean cannot: clamp finite results (Inf from an overflow stays Inf)
    fmax = torch.finfo(torch.float32).max
    out = torch.where(torch.isfinite(out), out.clamp(-fmax, fmax), out).float()
    info._output = not bool(torch.isfinite(out).all())
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

    def __init__(self, fmt, aps=True, kahan=False, transport="compressed", rounding="nearest", group=None,
                 graph=False):
        self.fmt = as_format(fmt)
        self.aps, self.kahan, self.transport, self.rounding, self.group = aps, kahan, transport, rounding, group
        self.graph = graph  # CUDA-graph replay per bucket buffer (allreduce_lowp(graph=True))
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
                                   transport=self.transport, rounding=self.rounding, group=self.group,
                                   graph=self.graph)
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
                        rounding: str = "nearest", group=None, graph: bool = False) -> LowpAllreduceHook:
    """A DDP comm hook that all-reduces gradients in ``fmt`` with APS.

    >>> # ddp = DistributedDataParallel(model)
    >>> # ddp.register_comm_hook(None, lowp_allreduce_hook("e4m3", aps=True))
    """
    return LowpAllreduceHook(fmt, aps, kahan, transport, rounding, group, graph)
