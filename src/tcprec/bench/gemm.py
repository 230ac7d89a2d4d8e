"""``tcprec bench gemm``: the bit-serial binary tensor-core GEMM against torch's fp16, int8 and fp8
GEMMs, every number from one run on one GPU.

Cases (``wXaY`` = X-bit weights, Y-bit activations; activations ``uintY``, weights ``binary``
(+-1) for X = 1 and ``intX`` otherwise):

* APNN-TC's table: M = 64, N = K = 128 .. 1024 step 128, for w1a2, w1a3, w1a4, w2a2;
* large: M = N = K in {4096, 8192, 16384} for w1a1, w1a2, w2a2, w1a4, w2a4, w3a3.

For each shape the baselines -- ``torch.matmul`` fp16, ``torch._int_mm`` int8 and
``torch._scaled_mm`` fp8 e4m3 (fp16 out) -- are timed in the same run.  The tcprec row times
the bit-serial GEMM (``bmma_gemm.gemm_entry()``: the implementation behind ``torch.ops.tcprec.bmma_gemm``, which
``tcprec.matmul`` calls in eager mode) on pre-packed bit planes with a per-tensor-scaled fp16 output (the
kernel), and ``tcprec.matmul`` from QTensors (packing the activations included).

Times: CUDA events through ``triton.testing.do_bench`` (median, warm-up, L2 flushed, inputs rotated
beyond L2), and CUDA-graph replay (``GRAPH_CALLS`` calls captured in one graph, mean per call).
TOPS = 2*M*N*K / t; the bit-serial kernel does p*q binary GEMMs, so its binary rate is
p*q*2*M*N*K / t, reported as a fraction of the measured b1 peak of the instruction the picked tile
issues: wgmma (15,500 T op/s) or mma.sync (10,250), both measured on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..formats import IntFormat
from ..ops.matmul import _col_scale, _planes, _row_scale, _terms32, matmul
from ..packing import packed_words
from ..qtensor import PerTensor, QTensor
from ..progress import track
from .common import environment, print_environment, require_cuda, rotating_buffers, time_median_ms, write_json
from .common import time_graph_ms as common_graph_ms

__all__ = ["APNN_CONFIGS", "LARGE_CONFIGS", "APNN_SIZES", "LARGE_SIZES", "BINARY_PEAK_TOPS", "WGMMA_BINARY_PEAK_TOPS", "run", "parse_config",
           "time_graph_ms"]

APNN_CONFIGS = ("w1a2", "w1a3", "w1a4", "w2a2")
LARGE_CONFIGS = ("w1a1", "w1a2", "w2a2", "w1a4", "w2a4", "w3a3")
APNN_SIZES = tuple(range(128, 1025, 128))
LARGE_SIZES = (4096, 8192, 16384)
BINARY_PEAK_TOPS = 10_250.0  # mma.sync m16n8k256 b1 AND+popc, measured on an H200
WGMMA_BINARY_PEAK_TOPS = 15_500.0  # wgmma m64nNk256 b1 AND+popc, measured on an H200
GRAPH_CALLS = 20


def parse_config(name: str):
    """``"w1a2"`` -> (activation IntFormat, weight IntFormat)."""
    try:
        wb, ab = name.lower().removeprefix("w").split("a")
        q, p = int(wb), int(ab)
    except ValueError:
        raise ValueError(f"config must look like 'w1a2' (weight bits, activation bits), got {name!r}") from None
    a_fmt = IntFormat(p, encoding="unsigned")
    w_fmt = IntFormat(q, encoding="pm1") if q == 1 else IntFormat(q, signed=True)
    return a_fmt, w_fmt


def _random_qtensor(shape, fmt, device, gen):
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, device=device, generator=gen)
    return QTensor(codes, torch.full((1,) * len(shape), 0.01, device=device), fmt, PerTensor(), shape, torch.float32)


def time_graph_ms(fn, calls: int = GRAPH_CALLS, replays: int = 5) -> float:
    """Mean ms per call of ``fn()`` captured ``calls`` times in one CUDA graph (median of replays)."""
    return common_graph_ms(fn, None, calls=calls, replays=replays)


@dataclass
class _Timed:
    ms: float | None = None
    graph_ms: float | None = None
    error: str | None = None


def _time(fn, inputs, graph: bool = True) -> _Timed:
    t = _Timed()
    try:
        t.ms = time_median_ms(fn, inputs)
        if graph:
            t.graph_ms = time_graph_ms(lambda: fn(inputs[0]))
    except Exception as e:  # a case that cannot run is reported, not hidden
        t.error = f"{type(e).__name__}: {e}"
    return t


def _baselines(M, N, K, device, l2, gen) -> dict[str, _Timed]:
    out = {}
    a16 = torch.randn(M, K, device=device, dtype=torch.float16, generator=gen)
    b16 = torch.randn(N, K, device=device, dtype=torch.float16, generator=gen)
    out["torch fp16"] = _time(lambda x: torch.matmul(x, b16.t()), rotating_buffers(a16, l2))
    a8 = torch.randint(-128, 127, (max(M, 17), K), device=device, dtype=torch.int8, generator=gen)
    b8 = torch.randint(-128, 127, (N, K), device=device, dtype=torch.int8, generator=gen)
    out["torch int8"] = _time(lambda x: torch._int_mm(x, b8.t()), rotating_buffers(a8, l2))
    try:
        af = a16.to(torch.float8_e4m3fn)
        bf = b16.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device, dtype=torch.float32)
        out["torch fp8"] = _time(lambda x: torch._scaled_mm(x, bf.t(), one, one, out_dtype=torch.float16),
                                 rotating_buffers(af, l2))
    except Exception as e:
        out["torch fp8"] = _Timed(error=f"{type(e).__name__}: {e}")
    return out


def _tcprec_case(config: str, M, N, K, device, l2, gen, tile: str = "") -> dict[str, _Timed]:
    a_fmt, w_fmt = parse_config(config)
    qa = _random_qtensor((M, K), a_fmt, device, gen)
    qw = _random_qtensor((N, K), w_fmt, device, gen)
    a_planes, w_planes = _planes(qa, M, K), _planes(qw, N, K)
    ss, rt, ct = _terms32(a_planes, w_planes, K, a_fmt, w_fmt)
    rs, cs = _row_scale(qa, M), _col_scale(qw, N)
    at, wt = a_fmt.encoding == "twos", w_fmt.encoding == "twos"

    from ..kernels.cuda import bmma_gemm as bg

    gemm = bg.gemm_entry()  # what tcprec.matmul calls in eager mode (the op without the dispatcher's host cost)

    def kernel(ap):
        return gemm(ap, w_planes, at, wt, ss, rt, ct, rs, cs, None, False, "float16", 1, "unsigned", None, tile)

    out = {"tcprec kernel": _time(kernel, rotating_buffers(a_planes, l2))}
    out["tcprec.matmul"] = _time(lambda x: matmul(x, qw, out_dtype=torch.float16, backend="bitserial", tile=tile),
                                 [qa], graph=False)
    return out


def variants_for(configs: Sequence[str], shapes: Sequence[tuple[int, int, int]], sm_count: int, tile: str = ""):
    """The kernel variants a benchmark run needs (to compile them in parallel up front)."""
    from ..kernels.cuda.bmma_gemm import Variant, parse_tile, pick_tile

    out = set()
    for c in configs:
        a_fmt, w_fmt = parse_config(c)
        at, wt = a_fmt.encoding == "twos", w_fmt.encoding == "twos"
        for M, N, K in shapes:
            t = parse_tile(tile) if tile else pick_tile(a_fmt.bits, w_fmt.bits, at, wt, M, N, sm_count,
                                                             kw=packed_words(K))
            # (the bench's matmul: float16 out, no activation, no bias -- compiled into the variant)
            out.add(Variant(a_fmt.bits, w_fmt.bits, at, wt, t, "float", "float16", act="none", has_bias=False))
    return out


def run(
    apnn_configs: Sequence[str] = APNN_CONFIGS,
    apnn_sizes: Sequence[int] = APNN_SIZES,
    large_configs: Sequence[str] = LARGE_CONFIGS,
    large_sizes: Sequence[int] = LARGE_SIZES,
    out="benchmarks/results/gemm.json",
    console: Console | None = None,
    command: str = "tcprec bench gemm",
    seed: int = 0,
    plot: bool = True,
) -> dict:
    """Run the GEMM benchmark on the current CUDA device, print the tables, write JSON (and a PNG
    plot of TOPS vs size next to it); returns the payload ``{"env", "command", "rows"}``.

    Raises ``NeedsGPU`` without a CUDA device.
    """
    console = console or Console()
    device = require_cuda("tcprec bench gemm")
    env = environment()
    print_environment(console, env)
    l2 = env["l2_cache_bytes"]
    sms = env["sm_count"] or 132
    gen = torch.Generator(device).manual_seed(seed)

    groups = [("apnn", c, (64, n, n)) for c in apnn_configs for n in apnn_sizes]
    groups += [("large", c, (n, n, n)) for c in large_configs for n in large_sizes]
    from ..kernels.cuda import bmma_gemm as bg
    from ..kernels.cuda.runtime import arch_of

    arch = arch_of(torch.cuda.get_device_capability(device))
    n_new = bg.precompile(variants_for([c for _, c, _ in groups], [s for _, _, s in groups], sms), arch)
    console.print(f"compiled {n_new} kernel variants for {arch} (NVRTC, cached on disk)")

    rows, base_cache = [], {}
    for table, config, (M, N, K) in track(groups, "bench gemm", label=lambda g: f"{g[1]} {g[2]}"):
        key = (M, N, K)
        if key not in base_cache:
            base_cache[key] = _baselines(M, N, K, device, l2, gen)
        timed = dict(base_cache[key])
        timed.update(_tcprec_case(config, M, N, K, device, l2, gen))
        a_fmt, w_fmt = parse_config(config)
        pq = a_fmt.bits * w_fmt.bits
        flops = 2.0 * M * N * K
        base = {k: v for k, v in timed.items() if k.startswith("torch")}
        for name, t in timed.items():
            tops = None if t.ms is None else flops / (t.ms * 1e-3) / 1e12
            row = {
                "table": table, "config": config, "M": M, "N": N, "K": K, "op": name,
                "ms": t.ms, "graph_ms": t.graph_ms, "tops": tops, "error": t.error,
            }
            if name.startswith("tcprec") and t.ms is not None:
                # against the peak of the instruction the picked tile issues (wgmma or mma.sync)
                tile = bg.pick_tile(a_fmt.bits, w_fmt.bits, a_fmt.encoding == "twos", w_fmt.encoding == "twos",
                                        M, N, sms, arch, kw=packed_words(K))
                peak = WGMMA_BINARY_PEAK_TOPS if tile.mma == "wgmma" else BINARY_PEAK_TOPS
                row.update(tile=str(tile), instruction=tile.mma, binary_tops=pq * tops, binary_peak_tops=peak,
                           fraction_of_binary_peak=pq * tops / peak)
                for bname, b in base.items():
                    if b.ms is not None:
                        row[f"speedup_vs_{bname.split()[1]}"] = b.ms / t.ms
                    if b.graph_ms is not None and t.graph_ms is not None:
                        row[f"graph_speedup_vs_{bname.split()[1]}"] = b.graph_ms / t.graph_ms
            rows.append(row)
        tk = timed["tcprec kernel"]
        console.print(f"{config} {M}x{N}x{K}: kernel {tk.ms if tk.ms is None else round(tk.ms * 1e3, 1)} us"
                      + (f" [red]{tk.error}" if tk.error else ""))

    payload = {"env": env, "command": command, "binary_peak_tops": {"mma.sync": BINARY_PEAK_TOPS,
                                                                     "wgmma": WGMMA_BINARY_PEAK_TOPS}, "rows": rows}
    path = write_json(out, payload)
    for table in ("apnn", "large"):
        console.print(_table([r for r in rows if r["table"] == table], table))
    if plot:
        _plot(rows, path.with_suffix(".png"), console)
    console.print(f"wrote {path}")
    return payload


def _table(rows: list[dict], which: str) -> Table:
    t = Table(title=("APNN-TC shapes (M=64, N=K)" if which == "apnn" else "large M=N=K")
              + ": kernel time (do_bench median / graph replay), same run")
    for col in ("config", "M", "N=K" if which == "apnn" else "K", "op", "us", "graph us", "TOPS", "% bin peak",
                "vs fp16", "vs int8", "vs fp8"):
        t.add_column(col, justify="left" if col in ("config", "op") else "right")

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        if not r["op"].startswith("tcprec") and r["config"] != rows[0]["config"]:
            continue  # baselines once per shape (with the first config)
        pk = r.get("fraction_of_binary_peak")
        t.add_row(r["config"] if r["op"].startswith("tcprec") else "", str(r["M"]), str(r["K"]), r["op"],
                  "[red]error" if r["error"] else f(None if r["ms"] is None else r["ms"] * 1e3, ".1f"),
                  f(None if r["graph_ms"] is None else r["graph_ms"] * 1e3, ".1f"), f(r["tops"], ".0f"),
                  f(None if pk is None else 100 * pk, ".1f"), f(r.get("speedup_vs_fp16"), ".2f"),
                  f(r.get("speedup_vs_int8"), ".2f"), f(r.get("speedup_vs_fp8"), ".2f"))
    return t


def _plot(rows: list[dict], path, console) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # plotting is a convenience; the JSON is the record
        console.print(f"[yellow]no plot: matplotlib not importable ({type(e).__name__})")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, table in zip(axes, ("apnn", "large")):
        sel = [r for r in rows if r["table"] == table and r["tops"] is not None]
        series = {}
        for r in sel:
            name = f"{r['config']} {r['op']}" if r["op"] == "tcprec kernel" else r["op"]
            series.setdefault(name, {})[r["K"]] = r["tops"]
        for name, pts in sorted(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=name, linestyle="--" if "torch" in name else "-")
        ax.set_xlabel("N = K" if table == "apnn" else "M = N = K")
        ax.set_ylabel("TOPS (2MNK / t)")
        ax.set_title("APNN-TC shapes, M = 64" if table == "apnn" else "large square")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    console.print(f"wrote {path}")
