"""The reduction orders of the low-precision all-reduce, each written once for N logical nodes that live
``n_local`` to a process: one process with N emulated nodes, N processes with one node each, and any
split between, run the same additions on the same values -- the same bits (CPD's contract).

Every algorithm takes the rounded, scaled gradients ``q`` (n_local, numel) of this process's nodes
(values of the wire format) and returns the reduced total (numel,) on every rank, each add rounded by
the engine ``S`` (distributed/arith.py), and the bytes one rank receives (one node when emulating).
Shards are multiples of 16 elements (codes travel as int32 words).

``direct`` (CPD's order; the default)
    S = R(..R(R(q_0 + q_1) + q_2).. + q_{N-1}) in node order.  Reduce-scatter by all_to_all (rank j
    gets shard j of every node), all_gather of the reduced shards.  Received per rank: (world - 1) /
    world x (n_local + 1) x size codes: 2 (N - 1) / N x size with one node per rank.
``ring``
    Shard j (of N) starts at node j + 1 and travels the ring j + 1, j + 2, .., j, each node adding its
    own value: S_j = R(..R(q_{j+1} + q_{j+2}).. + q_j), every partial sum rounded to the wire format
    and sent as codes (with Kahan, the compensation travels beside it: twice the reduce-scatter bytes).
    N - 1 steps between neighbours only.  Received per rank: 2 (N - 1) / N x size.
``halving``
    Recursive halving / doubling over P = 2**floor(log2 N) nodes (Rabenseifner): first the N - P extra
    nodes fold into nodes 0..N-P-1 (v_i = R(v_i + v_{P+i})), then log2 P exchanges with partner
    i ^ d (d = P/2 .. 1) in which the lower half of the partner pair keeps the lower half of its
    chunks, sum R(lower group + upper group) -- a pairwise tree of depth log2 P (rounding error grows
    with log N, not N) -- then recursive doubling gathers, and the extra nodes get the result.
    2 log2 P + 2 latencies instead of 2 (N - 1); bytes 2 (P - 1) / P x size, plus size twice on
    the folded nodes when N is not a power of two.  One node per process when distributed; no Kahan
    (a compensated pairwise combine is not CPD's sequence: use ring or direct).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ALGORITHMS", "Ctx", "wire_shard", "run", "model_bytes"]

ALGORITHMS = ("direct", "ring", "halving")


def wire_shard(numel: int, parts: int) -> int:
    """Shard length when ``numel`` values are cut in ``parts``: a multiple of 16."""
    return -(-numel // (16 * parts)) * 16


@dataclass
class Ctx:
    world: int
    rank: int
    n_local: int
    group: object
    use_dist: bool
    codes: bool  # compressed transport: codes on the wire (else float32 values)
    kahan: bool

    @property
    def n(self) -> int:
        return self.world * self.n_local


def _words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a flat int32 tensor (gloo's collectives reject uint8 / int16 tensors)."""
    return t.reshape(-1).view(torch.int32)


def all_gather_single(out, inp, group=None):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group)


def _sendrecv(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to global rank ``dst`` and receive from ``src`` at once (no ordering deadlock)."""
    ops = [dist.P2POp(dist.isend, _words(send), dst, group), dist.P2POp(dist.irecv, _words(recv), src, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _grank(ctx: Ctx, r: int) -> int:
    return dist.get_global_rank(ctx.group, r) if ctx.group is not None else r


def _gather_shards(mine: torch.Tensor, S, ctx: Ctx, numel: int) -> tuple[torch.Tensor, int]:
    """Every rank's reduced shards (n_local, shard) of this process -> the whole total (numel,), each
    value through the wire (codes decoded on every rank, own shards included: the same bits)."""
    w = S.pack(mine, ctx.codes)
    if ctx.use_dist:
        everyone = torch.empty((ctx.world,) + tuple(w.shape), dtype=w.dtype, device=w.device)
        all_gather_single(_words(everyone), _words(w.contiguous()), group=ctx.group)
    else:
        everyone = w
    return S.unpack(everyone, ctx.codes).reshape(-1)[:numel], (ctx.world - 1) * w.numel() * w.element_size()


def _reduce_in_order(rows, n: int, S, kahan: bool) -> torch.Tensor:
    """rows(i) -> values (L,) of node i; their sum, node by node, each add rounded by S (Kahan optional).
    Rows are decoded one at a time (memory: two rows, not n)."""
    s = rows(0).clone()
    c = torch.zeros_like(s)
    for i in range(1, n):
        s, c = _kahan_step(S, s, c, rows(i), kahan)
    return s


def _kahan_step(S, s, c, p, kahan: bool):
    """One add of p to the running sum s (compensation c): y = R(p - c); t = R(s + y);
    c = R(R(t - s) - y); or plain s = R(s + p)."""
    if not kahan:
        return S.add(s, p), c
    y = S.add(p, -c)
    t = S.add(s, y)
    c = S.add(S.add(t, -s), -y)
    return t, c


# ---- direct ---------------------------------------------------------------------------------------


def _direct(qbox, A, S, ctx: Ctx, numel: int):
    n_local, world = ctx.n_local, ctx.world
    shard = wire_shard(numel, world)
    wire = A.pack(qbox.pop(), ctx.codes)  # (n_local, numel) codes (or float32): the values are not needed after
    if ctx.use_dist:
        wp = torch.nn.functional.pad(wire, (0, shard * world - numel))  # (n_local, world * shard)
        send = wp.view(n_local, world, shard).transpose(0, 1).contiguous()  # (world, n_local, shard)
        del wire, wp
        recv = torch.empty_like(send)
        dist.all_to_all_single(_words(recv), _words(send), group=ctx.group)  # equal splits: world blocks
        del send
        recv = recv.view(ctx.n, shard)  # node r * n_local + i in row order
    else:
        recv, shard = wire, numel  # one process: every node's whole row (no padding needed: no exchange)
    s = S.nan_to_inf(_reduce_in_order(lambda i: A.unpack(recv[i], ctx.codes).to(S.dtype), ctx.n, S, ctx.kahan))
    total, ag = _gather_shards(s.view(1, shard), S, ctx, numel)
    return total, (world - 1) * n_local * shard * recv.element_size() + ag


# ---- ring -----------------------------------------------------------------------------------------


def _ring(qbox, A, S, ctx: Ctx, numel: int):
    q = qbox.pop()
    n, n_local = ctx.n, ctx.n_local
    shard = wire_shard(numel, n)
    qp = torch.nn.functional.pad(q.to(S.dtype), (0, shard * n - numel)).view(n_local, n, shard)
    del q
    rows = torch.arange(n_local, device=qp.device)
    nodes = ctx.rank * n_local + rows  # this process's nodes k
    p = qp[rows, (nodes - 1) % n]  # (n_local, shard): node k starts shard k - 1
    c = torch.zeros_like(p)
    got = 0
    nxt, prv = _grank(ctx, (ctx.rank + 1) % ctx.world), _grank(ctx, (ctx.rank - 1) % ctx.world)
    # codes: a NaN partial of a format without NaN is sent as +Inf (nan_to_inf, as before the all-gather;
    # such a format has no NaN code).  Once NaN or Inf, the shard's total is +-Inf either way.
    sent = (lambda x: S.nan_to_inf(x)) if ctx.codes else (lambda x: x)  # noqa: E731
    for t in range(1, n):
        # node k receives the partial of node k - 1 (through the wire), adds its own value of that shard
        p, c = sent(p), (sent(c) if ctx.kahan else c)
        if ctx.use_dist and ctx.world > 1:
            out = S.pack(torch.stack([p[-1], c[-1]]) if ctx.kahan else p[-1:], ctx.codes).contiguous()
            inc = torch.empty_like(out)
            _sendrecv(out, nxt, inc, prv, ctx.group)
            inc = S.unpack(inc, ctx.codes)
            got += inc.numel() * out.element_size()
            first_p, first_c = inc[:1], (inc[1:2] if ctx.kahan else c[:1])
        else:
            first_p, first_c = S.wire(p[-1:], ctx.codes), (S.wire(c[-1:], ctx.codes) if ctx.kahan else c[:1])
            got += shard * (2 if ctx.kahan else 1) * (S.bytes_per_code if ctx.codes else 4)
        prev_p = torch.cat([first_p, S.wire(p[:-1], ctx.codes)])
        prev_c = torch.cat([first_c, S.wire(c[:-1], ctx.codes)]) if ctx.kahan else c
        p, c = _kahan_step(S, prev_p, prev_c, qp[rows, (nodes - t - 1) % n], ctx.kahan)
    p = S.nan_to_inf(p)  # node k now holds shard k, whole
    total, ag = _gather_shards(p, S, ctx, numel)
    if not ctx.use_dist:  # emulated: what one node of N would receive in the all-gather
        ag = (n - 1) * shard * (S.bytes_per_code if ctx.codes else 4)
    return total, got + ag


# ---- halving / doubling ---------------------------------------------------------------------------


def _halving(qbox, A, S, ctx: Ctx, numel: int):
    q = qbox.pop()
    n = ctx.n
    if ctx.kahan:
        raise ValueError("algorithm='halving' sums a pairwise tree and has no Kahan compensation; use "
                         "algorithm='ring' or 'direct' with kahan=True, or kahan=False")
    if ctx.use_dist and ctx.world > 1 and ctx.n_local != 1:
        raise ValueError(f"algorithm='halving' runs one node per process when distributed, got n_local="
                         f"{ctx.n_local}; use algorithm='ring' or 'direct' with emulated nodes per process")
    P = 1 << (n.bit_length() - 1)
    r = n - P
    shard = wire_shard(numel, P)
    L = shard * P
    bpc = S.bytes_per_code if ctx.codes else 4
    mine = list(range(n)) if not ctx.use_dist else [ctx.rank]
    v = {k: torch.nn.functional.pad(q[i].to(S.dtype), (0, L - numel)) for i, k in enumerate(mine)}
    del q
    got = {k: 0 for k in mine}

    sent = (lambda x: S.nan_to_inf(x)) if ctx.codes else (lambda x: x)  # noqa: E731  (as in _ring)

    def exchange(pairs):
        """pairs: {node: (partner, lo, hi)}: every node sends its values of chunks [lo, hi) to its partner
        and receives as many (the partner's [lo, hi) of its own entry) -> {node: received, through the wire}."""
        out = {}
        for k, (pk, a, b) in pairs.items():
            if ctx.use_dist:
                send = S.pack(sent(v[k][a * shard:b * shard]), ctx.codes).contiguous()
                recv = torch.empty_like(send)
                _sendrecv(send, _grank(ctx, pk), recv, _grank(ctx, pk), ctx.group)
                out[k] = S.unpack(recv, ctx.codes)
            else:
                _, pa, pb = pairs[pk]
                out[k] = S.wire(sent(v[pk][pa * shard:pb * shard]), ctx.codes)
            got[k] += (b - a) * shard * bpc
        return out

    # ---- fold the extra nodes P..n-1 into 0..r-1 (whole vectors) ----------------------------------
    if r:
        if ctx.use_dist:
            k = ctx.rank
            if k >= P or k < r:
                pk = k - P if k >= P else k + P
                w = S.pack(sent(v[k]), ctx.codes).contiguous()
                if k >= P:
                    dist.send(_words(w), _grank(ctx, pk), group=ctx.group)
                else:
                    recv = torch.empty_like(w)
                    dist.recv(_words(recv), _grank(ctx, pk), group=ctx.group)
                    v[k] = S.add(v[k], S.unpack(recv, ctx.codes))
                    got[k] += L * bpc
        else:
            for k in range(r):
                v[k] = S.add(v[k], S.wire(sent(v[k + P]), ctx.codes))
                got[k] += L * bpc

    active = [k for k in mine if k < P]
    lo = {k: 0 for k in active}
    hi = {k: P for k in active}
    # ---- recursive halving: lower partner keeps the lower half; sum R(lower group + upper group) -----
    d = P // 2
    while d >= 1:
        keep, sendr = {}, {}
        for k in active:
            mid = (lo[k] + hi[k]) // 2
            keep[k], sendr[k] = ((lo[k], mid), (mid, hi[k])) if not k & d else ((mid, hi[k]), (lo[k], mid))
        rec = exchange({k: (k ^ d, *sendr[k]) for k in active})  # the partner sends what I keep
        for k in active:
            a, b = keep[k]
            own = v[k][a * shard:b * shard]
            low_first = (own, rec[k]) if not k & d else (rec[k], own)
            v[k] = v[k].clone()
            v[k][a * shard:b * shard] = S.add(*low_first)
            lo[k], hi[k] = a, b
        d //= 2
    # node k < P holds chunk k, whole; NaN -> +Inf where the format has no NaN (as the other orders)
    for k in active:
        v[k][k * shard:(k + 1) * shard] = S.nan_to_inf(v[k][k * shard:(k + 1) * shard])
    # ---- recursive doubling: exchange what each holds (codes: no arithmetic) -------------------------
    d = 1
    while d < P:
        rec = exchange({k: (k ^ d, lo[k], hi[k]) for k in active})
        for k in active:
            plo, phi = _partner_range(lo[k], hi[k], k, d)
            v[k][plo * shard:phi * shard] = rec[k]
            lo[k], hi[k] = min(lo[k], plo), max(hi[k], phi)
        d *= 2
    # ---- the extra nodes receive the result ------------------------------------------------------------
    if r:
        if ctx.use_dist:
            k = ctx.rank
            if k < r:
                dist.send(_words(S.pack(v[k], ctx.codes).contiguous()), _grank(ctx, k + P), group=ctx.group)
            elif k >= P:
                w = torch.empty(L, dtype=S.pack(v[k][:1], ctx.codes).dtype, device=v[k].device)
                dist.recv(_words(w), _grank(ctx, k - P), group=ctx.group)
                v[k] = S.unpack(w, ctx.codes)
                got[k] += L * bpc
        else:
            for k in range(r):
                got[k + P] += L * bpc
    # every value through the wire once more: every rank decodes the same codes (own chunk included)
    k0 = mine[0]
    total = S.wire(v[k0], ctx.codes)[:numel]
    return total, max(got.values()) if not ctx.use_dist else got[ctx.rank]


def _partner_range(lo: int, hi: int, k: int, d: int) -> tuple[int, int]:
    """In recursive doubling at distance d, node k holds [lo, hi) (hi - lo = d chunks); its partner
    k ^ d holds the adjacent block of d chunks on the other side."""
    return (hi, hi + d) if not k & d else (lo - d, lo)


# ---- entry points ---------------------------------------------------------------------------------


_ALGOS = {"direct": _direct, "ring": _ring, "halving": _halving}


def run(algorithm: str, qbox: list, A, S, ctx: Ctx, numel: int) -> tuple[torch.Tensor, int]:
    """``qbox``: [q], the rounded gradients (n_local, numel), handed over (the algorithm frees them as
    soon as they are packed).  Returns (total (numel,) values of S's format, bytes received by this
    rank -- or by one node, emulated)."""
    total, got = _ALGOS[algorithm](qbox, A, S, ctx, numel)
    if algorithm == "direct" and not ctx.use_dist:  # emulated: what one node of N would receive
        shard = wire_shard(numel, ctx.n)
        bpc_a = A.bytes_per_code if ctx.codes else 4
        bpc_s = S.bytes_per_code if ctx.codes else 4
        got = (ctx.n - 1) * shard * (bpc_a + bpc_s)
    return total, got


def model_bytes(algorithm: str, numel: int, n: int, bytes_per_code: int, kahan: bool = False) -> int:
    """Bytes one node receives in the data exchange, one node per rank, ``n`` nodes (the formula each
    algorithm's code counts)."""
    if n == 1:
        return 0
    if algorithm == "direct":
        return 2 * (n - 1) * wire_shard(numel, n) * bytes_per_code
    if algorithm == "ring":
        return (n - 1) * wire_shard(numel, n) * bytes_per_code * (3 if kahan else 2)
    if algorithm == "halving":
        P = 1 << (n.bit_length() - 1)
        shard = wire_shard(numel, P)
        extra = 2 * shard * P * bytes_per_code if n != P else 0  # a folded node: whole vector in and out
        return 2 * (P - 1) * shard * bytes_per_code + (extra // 2)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got algorithm={algorithm!r}")
