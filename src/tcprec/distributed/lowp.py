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

The order of the sum (``algorithm``, distributed/algorithms.py): ``"direct"`` (above: node order,
CPD's), ``"ring"`` (shard j travels the ring from node j + 1, every partial sum rounded and sent as
codes) or ``"halving"`` (recursive halving / doubling: a pairwise tree).  Node order is global: node
``rank * n_local + i``, so 4 processes x 1 node and 1 process x 4 emulated nodes give the same bits.
Each partial sum is rounded to ``fmt``, or to a wider ``acc_format``.

Transports (bit-identical; only the bytes on the wire differ):
* ``"emulate"``:    float32 values on the wire (what CPD does).
* ``"compressed"``: the format's codes as uint8 (4x fewer bytes).

Implementations, same bits (tests/test_allreduce_algorithms.py, tests/test_allreduce_fused.py,
tests/gpu/test_allreduce_gpu.py):
* CUDA tensors, ``algorithm="direct"``: the fused Triton kernels of kernels/triton/allreduce.py
  (three or four launches and a zero fill around two or three collectives, no host sync; the flags
  in ``AllreduceInfo`` are read from the device only when asked for; ``graph=True`` replays the
  whole call as one CUDA graph).  Where it moves no more bytes (one process, or two processes with
  one node each) every rank all-gathers every node's codes and reduces the whole vector itself,
  in node order as the reduce-scatter does: one collective and one kernel fewer, the same bits.
* CUDA tensors, ``algorithm="ring"`` / ``"halving"`` (``acc_format`` too): the same kernels' amax /
  encode / finish around one ``ring_step`` launch per ring step (``_allreduce_ring_fused``) or one
  ``halving_step`` launch per fold / halving level (``_allreduce_halving_fused``).
* everything else (CPU; ``direct`` with ``acc_format`` on CUDA; modes the kernels cannot do): the
  pure-torch engine (distributed/arith.py), on exact float32 tables where the format
  allows, else float64; ``backend="reference"`` forces float64, the ground truth.
"""

from __future__ import annotations

import itertools
import logging
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..enums import DETERMINISTIC_ROUNDINGS
from ..formats import FloatFormat, as_format
from ..kernels import reference as ref
from ..kernels.triton import BACKENDS, choose_backend
from ..ops.cast import code_dtype, decode
from .algorithms import ALGORITHMS, Ctx, _sendrecv, _words, all_gather_single as _all_gather_single, wire_shard
from .algorithms import run as run_algorithm
from .arith import fast_reason, make_arith

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


class AllreduceInfo:
    """What one all-reduce saw.  ``nonfinite_input``: a gradient on some node was NaN/Inf (the mean is
    all NaN: skip the step).  ``nonfinite_output``: the low-precision sum overflowed.  ``shifts``: the
    APS shift s of each tensor (int64; undefined after a non-finite input).  ``backend``: which
    implementation ran, and why.  The fused CUDA path leaves the flags on the device: the first read
    of each is one host sync, so a caller that never reads them never waits."""

    def __init__(self, nonfinite_input=False, nonfinite_output=False, shifts=None, backend: str = "",
                 bytes_received: int | None = None):
        self._input, self._output, self._shifts, self.backend = nonfinite_input, nonfinite_output, shifts, backend
        self.bytes_received = bytes_received  # data exchange, this rank (emulated: one of the N nodes)

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
                   backend: str = "auto", graph: bool = False, algorithm: str = "direct",
                   acc_format=None) -> tuple[torch.Tensor, AllreduceInfo]:
    """The mean over all nodes of flat gradients ``grads`` (n_local, numel), reduced in ``fmt``.

    ``sizes``: the lengths of the tensors packed in a row (APS scales each one separately).
    Works without an initialised process group (one process: its n_local emulated nodes).
    Returns (mean (numel,) float32, info); on a non-finite input anywhere the mean is all NaN and
    ``info.nonfinite_input`` is True (the caller skips the step).  ``info.bytes_received``: the bytes
    of the data exchange this rank received (emulated: what one of the N nodes would receive).
    ``algorithm``: the reduction order, ``"direct"`` (node order, CPD's), ``"ring"`` or ``"halving"``
    (distributed/algorithms.py); every split of the N nodes over processes gives the same bits.
    ``acc_format``: round every partial sum to this wider format instead of ``fmt`` (partial sums
    then travel as its codes); it must hold every value of ``fmt``.
    ``backend``: ``"auto"`` (CUDA: the fused Triton kernels, except ``algorithm="direct"`` with
    ``acc_format``: the torch engine; CPU: the torch engine's float32 tables), ``"triton"`` (also under
    TRITON_INTERPRET=1 on the CPU; raises where the kernels cannot run) or ``"reference"`` (the
    float64 ground truth).  All give the same bits.
    With a process group, the ranks first agree that every rank's input is valid and alike (one small
    all-reduce): bad input on any rank raises on every rank, never a hang.  On CUDA tensors that
    check runs once per layout (it costs a host sync), on CPU tensors every call.
    ``graph=True`` (CUDA tensors, fused kernels): the call is captured once per input buffer and
    layout as a CUDA graph, kernels and collectives together, and replayed after, so its host cost
    is one graph launch; every rank must make the same calls.  The returned mean is then the
    graph's own buffer, overwritten by the next call on the same buffer: copy it out before then;
    call :func:`release_graphs` before destroying the process group.

    >>> mean, info = allreduce_lowp(torch.randn(4, 10), [3, 7], "e4m3")   # 4 emulated nodes
    >>> mean.shape, info.nonfinite_input
    (torch.Size([10]), False)
    """
    use_dist = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if use_dist else 1
    fmt, acc = _validate(grads, sizes, fmt, acc_format, aps, kahan, transport, rounding, algorithm, backend,
                         use_dist and world > 1, world, group)
    n_local, numel = grads.shape
    path, why = _choose_path(grads, fmt, rounding, backend, algorithm, acc)
    if graph and not (path == "triton" and grads.is_cuda):
        raise ValueError(f"graph=True needs CUDA tensors on the fused kernels' path; this call runs {why} on "
                         f"{grads.device}: use graph=False")
    if graph and not (grads.dtype == torch.float32 and grads.is_contiguous()):
        raise ValueError(f"graph=True replays reads of the input buffer itself: it must be float32 and contiguous, "
                         f"got {grads.dtype}{'' if grads.is_contiguous() else ', not contiguous'}")
    if path == "triton":
        g32 = grads.float().contiguous()
        if algorithm == "direct":
            run = lambda: _allreduce_fused(g32, sizes, fmt, aps, kahan, transport, rounding, group,  # noqa: E731
                                           use_dist and world > 1, world, why)
        else:
            fused = _allreduce_ring_fused if algorithm == "ring" else _allreduce_halving_fused
            run = lambda: fused(g32, sizes, fmt, acc, aps, kahan, transport, rounding, group,  # noqa: E731
                                use_dist and world > 1, world, why)
        if graph:
            from ..kernels.triton import allreduce as ka

            key = (g32.data_ptr(), g32.shape, g32.device, tuple(sizes), fmt, aps, kahan, transport, rounding, group,
                   world, ka.BLOCK, algorithm, acc)
            return _allreduce_graphed(key, run, why)
        return run()
    return _allreduce_torch(grads.float(), sizes, fmt, acc, aps, kahan, transport, rounding, group,
                            use_dist and world > 1, world, why, algorithm, fast=path == "torch")


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_VALIDATED: set = set()  # CUDA layouts the ranks have agreed on (the check costs a host sync there)
# what another rank's error code means (the rank that raised it says more)
_KINDS = {1: (TypeError, "its gradients are not a floating-point tensor"),
          2: (ValueError, "its gradients do not match the tensor sizes"),
          3: (ValueError, "the format cannot hold the gradients (too few exponent bits, or a bad acc_format)"),
          4: (ValueError, "an option is not one of the allowed values")}
_SIG_FIELDS = ("numel", "number of tensors", "tensor sizes", "format", "acc_format", "algorithm", "aps", "kahan",
               "transport", "rounding", "nodes per process", "gradient dtype")


def _crc(x) -> int:
    return zlib.crc32(repr(x).encode())


def _check_acc(fmt: FloatFormat, acc) -> FloatFormat | None:
    if acc is None:
        return None
    acc = as_format(acc)
    if not isinstance(acc, FloatFormat) or acc.bits > 16:
        raise ValueError(f"acc_format must be a float format of <= 16 bits (codes on the wire), got {acc}")
    v = decode(torch.arange(fmt.n_codes), fmt)
    fin = torch.isfinite(v)
    if not torch.equal(ref.cast_float(v[fin], acc, "nearest"), v[fin]) or acc.max < fmt.max:
        raise ValueError(f"acc_format={acc} does not hold every value of {fmt}: partial sums would round the "
                         f"gradients again; pick a format with at least {fmt.man} mantissa bits and {fmt}'s range "
                         "(e.g. e5m10 or bf16), or acc_format=None")
    return acc


def _validate(grads, sizes, fmt, acc, aps, kahan, transport, rounding, algorithm, backend, use_dist, world, group):
    """Check this rank's input; with a process group, agree with every rank (one small MAX all-reduce
    of an error code and a signature of the call) before any data moves.  Returns (fmt, acc)."""
    err, kind = None, 0
    try:
        if not isinstance(grads, torch.Tensor):
            raise TypeError(f"grads must be a torch.Tensor (n_local, numel), got {type(grads).__name__}")
        if grads.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"grads must be a floating-point tensor ({', '.join(map(str, _FLOAT_DTYPES))}), got "
                            f"dtype={grads.dtype}; integer or complex gradients cannot be averaged in a float format")
        if grads.dim() != 2 or sum(sizes) != grads.shape[1] or any(int(z) < 0 for z in sizes):
            raise ValueError(f"grads must be (n_local, numel) with numel = sum(sizes) = {sum(sizes)}, got "
                             f"{tuple(grads.shape)}")
        for name, v, allowed in (("transport", transport, TRANSPORTS), ("algorithm", algorithm, ALGORITHMS),
                                 ("backend", backend, BACKENDS)):
            if v not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {name}={v!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(
                f"rounding must be one of {ROUNDINGS}, got rounding={rounding!r}"
                + ("; stochastic rounding inside the all-reduce would need random bits that every rank draws "
                   "identically for the same element and node, which is not implemented: use a deterministic mode"
                   if rounding == "stochastic" else ""))
        if algorithm == "halving" and kahan:
            raise ValueError("algorithm='halving' sums a pairwise tree and has no Kahan compensation; use "
                             "algorithm='ring' or 'direct' with kahan=True, or kahan=False")
        if algorithm == "halving" and use_dist and grads.shape[0] != 1:
            raise ValueError(f"algorithm='halving' runs one node per process when distributed, got n_local="
                             f"{grads.shape[0]}; use algorithm='ring' or 'direct' with emulated nodes per process")
        try:
            fmt = as_format(fmt)
            if not isinstance(fmt, FloatFormat):
                raise TypeError(f"the all-reduce format must be a float format, got {fmt}")
            if aps:
                check_aps_format(fmt, world * grads.shape[0])
            acc = _check_acc(fmt, acc)
        except (TypeError, ValueError) as e:
            kind = 3
            raise e
    except TypeError as e:
        err, kind = e, kind or 1
    except ValueError as e:
        err, kind = e, kind or (2 if "grads must be" in str(e) else 4)
    if not use_dist:
        if err is not None:
            raise err
        return fmt, acc
    ok_shape = err is None or kind > 2
    sig = [grads.shape[1] if ok_shape else -1, len(sizes), _crc(tuple(int(z) for z in sizes)), _crc(fmt), _crc(acc),
           _crc(algorithm), int(bool(aps)), int(bool(kahan)), _crc(transport), _crc(rounding),
           grads.shape[0] if ok_shape else -1, _crc(str(grads.dtype)) if isinstance(grads, torch.Tensor) else -1]
    cuda = dist.get_backend(group) == "nccl"
    key = (id(group), world, *sig)
    if cuda and err is None and key in _VALIDATED:
        return fmt, acc
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    code = (kind << 20) | (rank + 1) if err is not None else 0
    v = torch.tensor([code] + sig, dtype=torch.int64)
    msg = torch.cat([v, -v[1:]]).to(dev)
    dist.all_reduce(msg, op=dist.ReduceOp.MAX, group=group)
    msg = msg.cpu()
    if err is not None:
        raise err
    top = int(msg[0])
    if top:
        cls, what = _KINDS[top >> 20]
        r = (top & 0xFFFFF) - 1
        raise cls(f"rank {r} of {world} rejected this all-reduce: {what}; every rank stops here (rank {r}'s "
                  "error says what to fix)")
    hi, lo = msg[1:1 + len(sig)], -msg[1 + len(sig):]
    diff = [f for f, a, b in zip(_SIG_FIELDS, hi.tolist(), lo.tolist()) if a != b]
    if diff:
        raise ValueError(f"the {world} ranks called allreduce_lowp with different {', '.join(diff)} (this rank: "
                         f"sizes of {len(sizes)} tensors, numel {grads.shape[1]}, fmt {fmt}, algorithm "
                         f"{algorithm!r}); every rank must pass the same tensor list and options")
    if cuda:
        if len(_VALIDATED) >= 256:
            _VALIDATED.clear()
        _VALIDATED.add(key)
    return fmt, acc


# the deterministic modes: every rank must compute the same bits for the same sums
ROUNDINGS = DETERMINISTIC_ROUNDINGS
_WARNED: set = set()


def _choose_path(grads: torch.Tensor, fmt, rounding: str, backend: str, algorithm: str = "direct",
                 acc=None) -> tuple[str, str]:
    """("triton" | "torch" | "reference", why).  "torch": the pure-torch engine with its float32 tables
    where they are exact, "reference": the same engine in float64.  A CUDA call the fused kernels
    cannot do exactly runs the torch engine, and says so (once per reason); asking for "triton" then
    raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    name, why = choose_backend(grads, backend, "fused all-reduce kernels")
    if name == "reference":
        if backend == "reference":
            return "reference", why
        return "torch", "pure-torch engine on CPU" if not grads.is_cuda else why
    from ..kernels.triton import allreduce as ka

    reason = ka.can_implement(fmt, rounding)
    if reason is None and acc is not None:
        if algorithm == "direct":
            reason = f"the fused kernels of algorithm='direct' round partial sums to the wire format only, got " \
                     f"acc_format={acc}"
        elif ka.can_implement(acc, rounding) is not None:
            reason = f"acc_format={acc}: {ka.can_implement(acc, rounding)}"
    if reason is None:
        return "triton", why
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this all-reduce: {reason}; use backend='auto' or 'reference'")
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("allreduce_lowp: the fused kernels cannot run this all-reduce (%s): using the pure-torch "
                    "engine (same bits, slower)", reason)
    return "torch", f"pure-torch engine: {reason}"


_CACHE: dict = {}


def _cached(key, make):
    """Per-(sizes, device) tensor starts and per-(format, device) decode tables, made once."""
    v = _CACHE.get(key)
    if v is None:
        if len(_CACHE) >= 256:
            _CACHE.clear()
        v = _CACHE[key] = make()
    return v

def _lut(fmt, dev) -> torch.Tensor:
    """The (2**bits,) float32 decode table of ``fmt`` on ``dev``, made once."""
    return _cached(("lut", fmt, dev), lambda: decode(torch.arange(fmt.n_codes), fmt).to(dev))


def _agreed_state(grads, lay, T: int, dev, use_dist: bool, group) -> torch.Tensor:
    """The fused paths' step 1: per-tensor max |g| and the non-finite flag ((T + 2,) int32 state), agreed across
    ranks by one MAX all-reduce."""
    from ..kernels.triton import allreduce as ka

    state = ka.state_buffer(T, dev)  # (T + 2,) int32: max |g| bits, non-finite input, overflow (0 here)
    ka.amax(grads, lay, state)
    if use_dist:
        dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)
    return state


def _wire_shape(numel: int, world: int) -> int:
    # shard: a multiple of 16, so codes travel as int32 words (_words) and every row starts 16-byte aligned
    return wire_shard(numel, world)


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
    lut = _lut(fmt, dev)

    # ---- 1. per-tensor max |g| and the non-finite flag: one MAX all-reduce ---------------------------
    state = _agreed_state(grads, lay, T, dev, use_dist, group)

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
    info = _fused_info(state, T, n, top, aps, f"{why}, {how} exchange")
    bpc = torch.empty(0, dtype=wdt).element_size()
    if not use_dist:  # emulated: what one of n nodes would receive (direct order)
        info.bytes_received = 2 * (n - 1) * _wire_shape(numel, n) * bpc
    elif gathers:
        info.bytes_received = (world - 1) * n_local * shard * bpc
    else:
        info.bytes_received = (world - 1) * (n_local + 1) * shard * bpc
    return out, info


def _allreduce_ring_fused(grads, sizes, fmt, acc, aps, kahan, transport, rounding, group, use_dist, world, why):
    """algorithm='ring' (distributed/algorithms.py's _ring, the same bits) in the kernels of
    kernels/triton/allreduce.py: amax, encode (every node's values in n shards), then one ring_step
    launch per step for all of this process's nodes (decode what came in, add the node's own shard
    in S = acc_format or fmt, encode what goes out) around one send/recv, an all_gather of the
    reduced shards, and finish (the mean): n + 2 launches and n + 1 collectives, no host sync."""
    from ..kernels.triton import allreduce as ka

    n_local, numel = grads.shape
    n = world * n_local
    dev = grads.device
    T = len(sizes)
    top = aps_top_exponent(fmt)
    S = acc if acc is not None else fmt  # the format of every partial sum, and of what travels
    K = 2 if kahan else 1  # rows a node sends per step: the partial (and the compensation)
    if numel == 0:
        return torch.zeros(0, device=dev), AllreduceInfo(shifts=torch.zeros(T, dtype=torch.int64, device=dev),
                                                         backend=why)
    shard = _wire_shape(numel, n)
    lay = ka.layout(sizes, numel, n, shard, dev)  # encode's blocks walk the n shards
    lut_a, lut_s = _lut(fmt, dev), _lut(S, dev)

    # ---- 1. per-tensor max |g| and the non-finite flag: one MAX all-reduce ---------------------------
    state = _agreed_state(grads, lay, T, dev, use_dist, group)

    # ---- 2. scale and round once: every local node's values of every shard ----------------------------
    codes = transport == "compressed"
    q = torch.empty(n, n_local, shard, dtype=code_dtype(fmt) if codes else torch.float32, device=dev)
    ka.encode(grads, lay, state, q, fmt, rounding, aps, top, n)  # (n, n_local, shard): shard-major

    # ---- 3. the ring: n - 1 steps, each a send/recv between neighbours and one launch --------------------
    sdt = code_dtype(S) if codes else torch.float32
    bpc = torch.empty(0, dtype=sdt).element_size()
    rank = dist.get_rank(group) if use_dist else 0
    bufs = [torch.empty(n_local, K, shard, dtype=sdt, device=dev) for _ in range(2 if n > 2 else 1)]
    last = torch.empty(n_local, 1, shard, dtype=sdt, device=dev)  # node k's whole shard k
    recv = torch.empty(K, shard, dtype=sdt, device=dev) if use_dist else None
    if use_dist:
        nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    cur = last if n == 1 else bufs[0]
    ka.ring_step(cur, cur, q, cur, lut_a, lut_s, fmt, S, rounding, kahan, aps, rank, 0, True, n == 1)
    got = 0
    for t in range(1, n):
        prev = cur
        if use_dist:
            _sendrecv(prev[-1], nxt, recv, prv, group)
            src = recv
        else:
            src = prev[-1]
        got += K * shard * bpc
        cur = last if t == n - 1 else bufs[t % 2]
        ka.ring_step(src, prev, q, cur, lut_a, lut_s, fmt, S, rounding, kahan, aps, rank, t, False, t == n - 1)
    del q, bufs, recv

    # ---- 4. all-gather the reduced shards, then the mean ----------------------------------------------
    mine = last.view(n_local * shard)
    if use_dist:
        everyone = torch.empty(world * n_local * shard, dtype=sdt, device=dev)  # node k's shard k, node order
        _all_gather_single(_words(everyone), _words(mine), group=group)
        ag = (world - 1) * n_local * shard * bpc
    else:
        everyone, ag = mine, (n - 1) * shard * bpc  # emulated: what one of n nodes would receive
    out = torch.empty(numel, dtype=torch.float32, device=dev)
    ka.finish(everyone, out, lut_s, lay, state, S, n, aps, top)
    info = _fused_info(state, T, n, top, aps, f"{why}, ring order, {n - 1} fused steps")
    info.bytes_received = got + ag
    return out, info


def _allreduce_halving_fused(grads, sizes, fmt, acc, aps, kahan, transport, rounding, group, use_dist, world,
                             why):
    """algorithm='halving' (distributed/algorithms.py's _halving, the same bits) in the fused kernels:
    amax, encode (each node's whole vector), one halving_step launch per fold / halving level (every
    emulated node at once, in place), recursive doubling as plain send/recv of codes (no kernel), and
    finish.  Emulated: the doubling's result is each node's own chunk (one strided copy)."""
    from ..kernels.triton import allreduce as ka

    n_local, numel = grads.shape
    n = world * n_local
    if n == 1:  # no exchange: the ring's kernels give the same (q, NaN -> +Inf, the mean)
        out, info = _allreduce_ring_fused(grads, sizes, fmt, acc, aps, kahan, transport, rounding, group, use_dist,
                                          world, why)
        info.backend = f"{why}, halving order (one node: no exchange)"
        return out, info
    dev = grads.device
    T = len(sizes)
    top = aps_top_exponent(fmt)
    S = acc if acc is not None else fmt
    if numel == 0:
        return torch.zeros(0, device=dev), AllreduceInfo(shifts=torch.zeros(T, dtype=torch.int64, device=dev),
                                                         backend=why)
    P = 1 << (n.bit_length() - 1)
    r = n - P
    shard = _wire_shape(numel, P)
    L = shard * P
    lay = ka.layout(sizes, numel, 1, L, dev)
    lut_a, lut_s = _lut(fmt, dev), _lut(S, dev)
    state = _agreed_state(grads, lay, T, dev, use_dist, group)
    codes = transport == "compressed"
    q = torch.empty(1, n_local, L, dtype=code_dtype(fmt) if codes else torch.float32, device=dev)
    ka.encode(grads, lay, state, q, fmt, rounding, aps, top, n)  # (1, n_local, L): each node's whole vector
    sdt = code_dtype(S) if codes else torch.float32
    if codes and S != fmt:  # the partial sums travel as acc_format's codes: re-encode once
        v = torch.empty(n_local, 1, L, dtype=sdt, device=dev)
        ka.ring_step(v, v, q, v, lut_a, lut_s, fmt, S, rounding, False, aps, 0, 0, True, False)
        v = v.view(n_local, L)
    else:
        v = q.view(n_local, L)
    bpc = torch.empty(0, dtype=sdt).element_size()

    if not use_dist:  # ---- n emulated nodes: every level one launch over all of them, in place ----------
        if r:
            ka.halving_step(v, v, lut_s, S, rounding, aps, shard, 0, P, 0, r, True, False, False)
        d = P // 2
        while d >= 1:
            ka.halving_step(v, v, lut_s, S, rounding, aps, shard, d, P, 0, P, False, d == 1, False)
            d //= 2
        everyone = torch.diagonal(v[:P].view(P, P, shard), 0, 0, 1).t().contiguous().view(-1)  # node k's chunk k
        got = (L * bpc if r else 0) + 2 * (P - 1) * shard * bpc  # the most any one node receives
    else:  # ---- one node per process -----------------------------------------------------------------------
        k = dist.get_rank(group)
        gr = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)  # noqa: E731
        row = v.view(L)
        got = 0
        if r and k >= P:
            dist.send(_words(row), gr(k - P), group=group)
        elif r and k < r:
            recv = torch.empty(L, dtype=sdt, device=dev)
            dist.recv(_words(recv), gr(k + P), group=group)
            ka.halving_step(v, recv, lut_s, S, rounding, aps, shard, 0, P, k, 1, True, False, True)
            got += L * bpc
        if k < P:
            recv = torch.empty(L // 2, dtype=sdt, device=dev)
            d = P // 2
            while d >= 1:
                a, b = ((k ^ d) // d) * d * shard, ((k ^ d) // d) * d * shard + d * shard  # what the partner keeps
                _sendrecv(row[a:b], gr(k ^ d), recv[:d * shard], gr(k ^ d), group)
                ka.halving_step(v, recv, lut_s, S, rounding, aps, shard, d, P, k, 1, False, d == 1, True)
                got += d * shard * bpc
                d //= 2
            d = 1
            while d < P:  # recursive doubling: codes only
                lo, plo = (k // d) * d * shard, ((k ^ d) // d) * d * shard
                _sendrecv(row[lo:lo + d * shard], gr(k ^ d), row[plo:plo + d * shard], gr(k ^ d), group)
                got += d * shard * bpc
                d *= 2
            if r and k < r:
                dist.send(_words(row), gr(k + P), group=group)
        else:
            dist.recv(_words(row), gr(k - P), group=group)
            got += L * bpc
        everyone = row
    out = torch.empty(numel, dtype=torch.float32, device=dev)
    ka.finish(everyone, out, lut_s, lay, state, S, n, aps, top)
    levels = (1 if r else 0) + P.bit_length() - 1
    info = _fused_info(state, T, n, top, aps, f"{why}, halving order, {levels} fused levels")
    info.bytes_received = got
    return out, info


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
    fresh = AllreduceInfo(info._input, info._output, info._shifts, info.backend, info.bytes_received)  # flags read anew
    return out, fresh


def _allreduce_torch(grads, sizes, fmt, acc, aps, kahan, transport, rounding, group, use_dist, world, why,
                     algorithm, fast):
    """The pure-torch engine (any device): float32 tables (``fast``, where exact for the formats) or
    the float64 reference; the reduction order of ``algorithm`` (distributed/algorithms.py)."""
    n_local, numel = grads.shape
    n = world * n_local
    dev = grads.device
    fast = fast and fast_reason(fmt) is None and (acc is None or fast_reason(acc) is None)
    A = make_arith(fmt, rounding, dev, fast)  # the one rounding of each gradient, to the wire format
    S = A if acc is None else make_arith(acc, rounding, dev, fast)  # every partial sum
    info = AllreduceInfo(backend=f"{why}, {A.name}, {algorithm}")

    # ---- 1. per-tensor exponents and the non-finite flag: one MAX all-reduce ------------------------
    T = len(sizes)
    starts = [0] + list(itertools.accumulate(sizes))
    colmax = torch.maximum(grads.amax(0), -grads.amin(0)) if n_local else grads.new_zeros(numel)  # NaN kept
    amax = torch.stack([colmax[starts[t]:starts[t + 1]].max() if sizes[t] else colmax.new_zeros(())
                        for t in range(T)]) if T else colmax.new_zeros(0)  # (T,)
    bad = ~torch.isfinite(amax).all() if T else torch.tensor(False, device=dev)
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

    # ---- 2. scale and round once to fmt, tensor by tensor ----------------------------------------------
    q = torch.empty(n_local, numel, dtype=A.dtype, device=dev)
    sh = shift.tolist()
    for t in range(T):
        if sizes[t]:
            q[:, starts[t]:starts[t + 1]] = A.scale_round(grads[:, starts[t]:starts[t + 1]], int(sh[t]))
    q = A.nan_to_inf(q)  # keep the codes encodable: both transports see +Inf for an overflow NaN

    # ---- 3. the exchange and the sums, in the algorithm's order ---------------------------------------
    ctx = Ctx(world=world, rank=dist.get_rank(group) if use_dist else 0, n_local=n_local, group=group,
              use_dist=use_dist, codes=transport == "compressed", kahan=kahan)
    qbox = [q]
    del q
    total, info.bytes_received = run_algorithm(algorithm, qbox, A, S, ctx, numel)

    # ---- 4. undo the shift, take the mean -------------------------------------------------------------
    # one division by the exact scale * n (a tensor: CUDA divides by a Python-number divisor as a
    # multiply by its rounded reciprocal, which is not the correctly rounded quotient), per tensor
    out = torch.empty(numel, dtype=torch.float32, device=dev)
    fmax = torch.finfo(torch.float32).max
    for t in range(T):
        if sizes[t]:
            den = torch.tensor(math.ldexp(1.0, int(sh[t])) * n, dtype=torch.float64, device=dev)
            o = total[starts[t]:starts[t + 1]].double() / den
            # rounding a value near float32's max up to the next power of two in fmt can step past float32's
            # range although the exact mean cannot: clamp finite results (Inf from an overflow stays Inf)
            out[starts[t]:starts[t + 1]] = torch.where(torch.isfinite(o), o.clamp(-fmax, fmax), o).float()
    info._output = not bool(torch.isfinite(out).all())
    return out, info

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
                 graph=False, algorithm="direct", acc_format=None):
        self.fmt = as_format(fmt)
        self.algorithm, self.acc_format = algorithm, acc_format
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got algorithm={algorithm!r}")
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
                                   graph=self.graph, algorithm=self.algorithm, acc_format=self.acc_format)
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
                        rounding: str = "nearest", group=None, graph: bool = False, algorithm: str = "direct",
                        acc_format=None) -> LowpAllreduceHook:
    """A DDP comm hook that all-reduces gradients in ``fmt`` with APS (``algorithm``: the reduction
    order, see :func:`allreduce_lowp`).  Works under ``torchrun`` (``init_process_group("nccl")``
    reads ``env://``).

    >>> # ddp = DistributedDataParallel(model)
    >>> # ddp.register_comm_hook(None, lowp_allreduce_hook("e4m3", aps=True, algorithm="ring"))
    """
    return LowpAllreduceHook(fmt, aps, kahan, transport, rounding, group, graph, algorithm, acc_format)
