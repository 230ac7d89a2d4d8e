"""``tcprec tune conv-fwd``: time tile candidates of the INT8 / FP8 forward conv and write its tile table (GPU).

``kernels/triton/conv_fwd.py`` picks BLOCK_M, the largest BLOCK_N, warps and stages from a small table per class
("tap": C a multiple of 64; "flat": C >= 16 otherwise; "thin": C < 16, the stems; "tap_res" / "point_dual": a "tap"
conv whose epilogue adds a residual, 1x1 with the dual output for the latter), kept as data in ``conv_fwd_tiles.json``
beside the kernel.  This command makes that file:

1. compile every variant the sweep needs in a process pool (Triton's disk cache), so nothing compiles inside a
   timing;
2. for each class, time int8 (per-channel scale + ReLU, int8 out: the chained layer; a layer named ``name+residual``
   adds a float16 residual first, ``name+dual`` also writes the float16 result beside the codes, as a ResNet block's
   last conv does) on the class's layers at batch 256 with each candidate table value -- the current one and
   :data:`CANDIDATES` -- exactly as ``pick_config(g, tiles=..., epilogue=...)`` turns it into a launch config
   (``do_bench`` median, L2 flushed before each call);
3. per class, keep the candidate of least total time over the class's layers (the current value on a tie or when
   every candidate failed), and write the table (each value with the figures that picked it) and the sweep
   (``benchmarks/results/conv_fwd_tune.json``, the results convention).

The table is never autotuned at run time: it changes only by this command's output, reviewed in a commit.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Sequence

import torch

from ..kernels.conv_geometry import ConvGeometry
from .common import git_commit, require_cuda, time_median_ms, write_json

__all__ = ["TUNE_LAYERS", "CANDIDATES", "parse_layer", "layer_classes", "choose_tiles", "table_document", "run"]

# the layers each class is timed on (kernels/triton/conv_fwd.NETWORK_LAYERS, "+residual" / "+dual": with that
# epilogue), at batch 256
TUNE_LAYERS = ("vgg.conv3", "vgg.conv6", "resnet18.l1", "yolo.conv8", "yolo.conv2", "alexnet.conv1",
               "resnet18.l1+dual", "resnet18.l2+dual", "resnet50.l2c3+residual", "resnet50.l1c3+dual",
               "resnet50.l2c3+dual", "resnet50.l3c3+dual")
# table values tried beside the current one: (BLOCK_M, BLOCK_N cap, num_warps, num_stages)
CANDIDATES = ((128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4),
              (64, 128, 4, 3), (64, 64, 4, 3))
_SUFFIX = {"": "plain", "+residual": "residual", "+dual": "dual"}


def _cf():
    """The kernel module (imported when used: importing it imports Triton, which ``import tcprec`` does not)."""
    from ..kernels.triton import conv_fwd

    return conv_fwd


def parse_layer(name: str) -> tuple[str, str]:
    """``"resnet50.l1c3+dual"`` -> ``("resnet50.l1c3", "dual")``: the NETWORK_LAYERS entry and its epilogue
    (conv_fwd.EPILOGUES; no suffix: "plain")."""
    base, plus, tail = name.partition("+")
    return base, _SUFFIX.get(plus + tail, "?")


def geometry(name: str, batch: int) -> ConvGeometry:
    """The ConvGeometry of a NETWORK_LAYERS entry (with or without an epilogue suffix) at ``batch``."""
    cf = _cf()
    H, W, C, K, R, S, st, pd = cf.NETWORK_LAYERS[parse_layer(name)[0]]
    return ConvGeometry(batch, H, W, C, K, R, S, (st, st), (pd, pd), (1, 1))


def layer_classes(layers: Sequence[str], batch: int = 256) -> dict[str, list[str]]:
    """class -> the given layers of that class; ValueError for a name not in NETWORK_LAYERS."""
    cf = _cf()
    bad = [n for n in layers if parse_layer(n)[0] not in cf.NETWORK_LAYERS or parse_layer(n)[1] == "?"]
    if bad or not layers:
        raise ValueError(f"layers must be a non-empty list of conv_fwd.NETWORK_LAYERS names "
                         f"({', '.join(cf.NETWORK_LAYERS)}), each optionally with '+residual' or '+dual' (timed "
                         f"with that epilogue), got {list(layers)}; default: {','.join(TUNE_LAYERS)}")
    out: dict[str, list[str]] = {}
    for n in layers:
        out.setdefault(cf.shape_class(geometry(n, batch), parse_layer(n)[1]), []).append(n)
    return out


def candidates_of(current: tuple) -> list[tuple]:
    """The current table value first, then :data:`CANDIDATES` not equal to it."""
    return [tuple(current)] + [c for c in CANDIDATES if tuple(c) != tuple(current)]


def _config(name: str, g: ConvGeometry, tiles: dict, cls: str, value: tuple) -> dict:
    """The launch config pick_config makes for layer ``name`` (geometry ``g``) when ``cls``'s entry is ``value``."""
    return _cf().pick_config(g, fp8=False, tiles={**tiles, cls: tuple(value)}, epilogue=parse_layer(name)[1])


def _conv(name: str, g: ConvGeometry, x, w, scale, res, cfg):
    """One timed launch of layer ``name``: int8 codes out after the residual (if its epilogue has one), and the
    float16 result beside them for "+dual"."""
    epilogue = parse_layer(name)[1]
    kw = {"out": ("int8", 0.05)} if epilogue != "dual" else {"out": "float16", "out_int8": ("int8", 0.05)}
    return _cf().conv2d_fwd_int8(x, w, stride=g.stride, padding=g.padding, scale=scale, act="relu",
                                 residual=res if epilogue != "plain" else None, config=cfg, **kw)


def _residual(g: ConvGeometry, device, gen=None):
    return torch.randn(g.output_shape, device=device, dtype=torch.float16, generator=gen)


def choose_tiles(times: dict[str, dict[tuple, list[float]]], current: dict[str, tuple]) -> dict[str, dict]:
    """Per class: the candidate of least total time over the class's layers.

    ``times``: class -> candidate value -> ms per layer (NaN: the candidate failed on that layer, which rules it
    out).  The current value wins ties; with no candidate timed on every layer the current value stays.  Returns
    class -> {"value", "previous", "total_ms", "previous_total_ms"}.
    """
    out = {}
    for cls, cur in current.items():
        by = times.get(cls, {})
        ok = {tuple(v): sum(ms) for v, ms in by.items() if ms and all(math.isfinite(m) for m in ms)}
        cur = tuple(cur)
        best = cur
        for v, total in ok.items():
            if total < ok.get(best, math.inf):
                best = v
        out[cls] = {"value": list(best), "previous": list(cur), "total_ms": ok.get(best),
                    "previous_total_ms": ok.get(cur)}
    return out


def table_document(chosen: dict[str, dict], old_doc: dict, measured: dict[str, str], source: str) -> dict:
    """The tile-table JSON: the old document with each tuned class's value, what measured it and the source."""
    doc = json.loads(json.dumps(old_doc))  # a copy: the caller's document is not changed
    for cls, c in chosen.items():
        doc[cls] = {"value": c["value"], "measured": measured[cls], "source": source}
    return doc


def write_table(doc: dict, path) -> Path:
    """Write ``doc`` to ``path`` only if it loads back as a valid table (else ValueError, the file untouched)."""
    cf = _cf()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        cf.load_tile_table(tmp)
    except ValueError:
        tmp.unlink()
        raise
    tmp.replace(path)
    return path


def _compile_one(task):
    """Compile (and run once at batch 1) one launch config: fills Triton's disk cache for the timings."""
    name, cfg = task
    cf = _cf()
    t0 = time.time()
    try:
        g = geometry(name, 1)
        x = torch.zeros(g.input_shape, device="cuda", dtype=torch.int8)
        w = torch.zeros(g.weight_shape, device="cuda", dtype=torch.int8)
        scale = torch.full((g.K,), 1e-4, device="cuda")  # the timed call's arguments: the same compiled variant
        _conv(name, g, x, w, scale, _residual(g, "cuda"), cfg)
        torch.cuda.synchronize()
        return name, time.time() - t0, None
    except Exception as e:  # noqa: BLE001 -- reported by the caller, and the candidate's timing fails too
        return name, time.time() - t0, f"{type(e).__name__}: {e}"[:400]



def run(layers: Sequence[str] = TUNE_LAYERS, batch: int = 256, table=None,
        out="benchmarks/results/conv_fwd_tune.json", workers: int | None = None, warmup_ms: int = 10,
        rep_ms: int = 40, command: str = "tcprec tune conv-fwd", console=None) -> dict:
    """Sweep, choose, write the table to ``table`` (default: the kernel's) and the sweep to ``out``; returns the
    sweep's JSON.  Raises ``NeedsGPU`` without a CUDA device."""
    cf = _cf()
    from rich.console import Console

    console = console or Console(stderr=True)
    classes = layer_classes(layers, batch)
    dev = require_cuda("tcprec tune conv-fwd")
    table = Path(cf.TILE_TABLE_PATH if table is None else table)
    current = cf.load_tile_table(table)  # validated first: a broken table is named, not half-read
    old_doc = json.loads(table.read_text())
    # class -> candidate table value -> layer -> the launch config pick_config makes with that value
    plan = {cls: {v: {n: _config(n, geometry(n, batch), current, cls, v) for n in names}
                  for v in candidates_of(current[cls])} for cls, names in classes.items()}
    tasks = {cf.compile_key(geometry(n, batch), cfg, False, "float16+int8" if parse_layer(n)[1] == "dual" else "int8",
                            has_res=parse_layer(n)[1] != "plain"): (n, cfg)
             for by_v in plan.values() for by_n in by_v.values() for n, cfg in by_n.items()}
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=workers or min(16, os.cpu_count() or 4),
                             mp_context=get_context("spawn")) as pool:
        errors = [r for r in pool.map(_compile_one, tasks.values()) if r[2]]
    console.print(f"compiled {len(tasks)} variants in {time.time() - t0:.0f} s, {len(errors)} failed")
    for e in errors[:8]:
        console.print(f"  failed: {e}", markup=False)

    rows, times = [], {}
    for cls, by_v in plan.items():
        for v, by_n in by_v.items():
            for n, cfg in by_n.items():
                g = geometry(n, batch)
                gen = torch.Generator(dev).manual_seed(0)
                x = torch.randint(-128, 128, g.input_shape, device=dev, dtype=torch.int8, generator=gen)
                w = torch.randint(-128, 128, g.weight_shape, device=dev, dtype=torch.int8, generator=gen)
                scale = torch.full((g.K,), 1e-4, device=dev)
                res = _residual(g, dev, gen) if parse_layer(n)[1] != "plain" else None
                try:
                    ms = time_median_ms(lambda _: _conv(n, g, x, w, scale, res, cfg), [None], warmup_ms, rep_ms)
                except Exception as e:  # noqa: BLE001 -- a failed candidate is a row, and is not chosen
                    ms = math.nan
                    console.print(f"  {cls} {v} {n}: {type(e).__name__}: {e}"[:300], markup=False)
                times.setdefault(cls, {}).setdefault(v, []).append(ms)
                rows.append({"class": cls, "candidate": list(v), "layer": n, "config": cfg, "ms": ms,
                             "tops": g.flops / ms / 1e9 if math.isfinite(ms) else None})
            console.print(f"{cls:10s} {v}: " + "  ".join(f"{r['layer']} {r['tops']:.0f} T/s" if r["tops"] else
                                                        f"{r['layer']} failed" for r in rows[-len(by_n):]))
    chosen = choose_tiles(times, {cls: current[cls] for cls in classes})
    gpu = torch.cuda.get_device_name(dev)
    measured = {}
    for cls, c in chosen.items():
        per = "; ".join(f"{list(v)}: " + ", ".join(f"{r['layer']} {r['tops']:.0f}" if r["tops"] else f"{r['layer']} -"
                                                   for r in rows if r["class"] == cls and tuple(r["candidate"]) == v)
                        for v in plan[cls])
        measured[cls] = f"{gpu}, batch {batch}, int8, T/s per layer: {per}"
    commit = git_commit()
    doc = table_document(chosen, old_doc, measured, f"{command} (commit {commit or 'unknown'})")
    write_table(doc, table)
    summary = [{"class": cls, "layers": ",".join(classes[cls]), "previous": str(c["previous"]),
                "chosen": str(c["value"]), "previous ms": c["previous_total_ms"], "chosen ms": c["total_ms"]}
               for cls, c in chosen.items()]
    result = {"suite": "conv_fwd_tune", "command": command, "device": f"{gpu}, torch {torch.__version__}",
              "commit": commit, "summary": summary, "targets": [], "table": str(table), "batch": batch,
              "method": f"triton.testing.do_bench median (warmup {warmup_ms} ms, rep {rep_ms} ms, L2 flushed before "
                        "each call); int8 in, per-channel scale + ReLU, int8 out (+residual: a float16 residual "
                        "added first; +dual: the float16 result written beside the codes)", "rows": rows}
    write_json(out, result)
    console.print(f"wrote {table} and {out}")
    return result
