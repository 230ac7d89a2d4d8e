"""``tcprec bench models``: torchvision's classification model definitions, quantized with the speed rule on, against
cuDNN fp16 channels_last on one GPU in one run (issue 43: none slower than fp16 at any precision).

Per model (``torchvision.models.get_model(name, weights=None)``: seeded weights, batch-norm statistics from two seeded
batches, then eval):

* ``fp32``: the reference output, TF32 off, not timed;
* ``fp16``: the model in half precision, channels_last: the baseline, its forward captured in a CUDA graph
  (median of replays, no host launch overhead), timed alternately with each quantized model
  (``bench.common.time_graphs_alternating_ms``: replays A, B, A, B, ...), each row's speedup against its own paired
  fp16 time, so that clock drift during the run lands on both sides;
* each precision (``int8``, ``fp8``, ``w1a2`` ...): ``tcprec.quantize_model`` of the fp16 model with
  ``QuantConfig(precision, speed_rule=SpeedRule(batch=batch))`` (nn/speed_rule.py: every layer whose quantized path
  measures slower than its fp16 equivalent at this batch stays fp16), calibrated on the first 16 images, timed the
  same way; ``first_last`` int8 for wXaY below 8 bits (APNN-TC's rule), none for int8 / fp8.

Per row: ms, fp16 ms, speedup, NRMSE of the logits against fp32 (and the fp16 baseline's own, ``fp16_nrmse_vs_fp32``:
a baseline already off, e.g. seeded Swin-V2's non-finite fp16 logits, explains its rows), and the layer counts:
quantized, kept fp16 by the speed rule, float for other reasons (``tcprec_summary``); ``model_itself`` where the rule
gave the fp16 model back (``SpeedReport.model_itself``): such a row times the baseline against itself, and "none
slower than fp16" does not count it as slower.  Weights are seeded, not trained: NRMSE says how far the outputs
move, not an accuracy.  torchvision is needed only here and is imported when the suite runs.

``convert_only`` (``tcprec bench models --convert-only``; suite ``models_convert``, its own JSON): the CPU check
that each definition converts and runs -- per precision ``quantize_model`` of the fp32 model (no speed rule: the
CPU's time says nothing about the GPU's), a forward on the reference kernels, NRMSE against fp32 and the layer
counts, each float layer with its reason in the details; no timing, no GPU.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from ..nn.convert import QuantConfig, quantize_model
from ..nn.speed_rule import SpeedRule
from ..precision import canonical_network_precision
from ..progress import track
from .common import environment, git_commit, print_environment, require_cuda, time_graphs_alternating_ms, write_json
from .net import nrmse

__all__ = ["run", "DEFAULT_MODELS", "PRECISIONS", "TARGETS", "torchvision_classifiers", "build_model", "parse_precisions",
           "parse_shard", "check_shard", "measure_model", "convert_model", "targets", "SUITES"]

# ~150 s on an H200 at batch 256 with int8 / fp8 / w1a2 (conversion, two speed-rule rounds, timing); the issue's
# ResNet-50 and MobileNetV2 plus three other families (compound scaling, RegNet, channel shuffle)
DEFAULT_MODELS = ("resnet50", "mobilenet_v2", "efficientnet_b0", "regnet_y_400mf", "shufflenet_v2_x1_0")
PRECISIONS = ("int8", "fp8", "w1a2")
TARGETS = {("resnet50", "int8"): 1.5, ("resnet50", "w1a2"): 2.5}  # issue 43: speedup over fp16 at batch 256
CALIBRATION_IMAGES = 16
SUITES = {False: "models", True: "models_convert"}  # by convert_only
IMAGE = 224


def _torchvision():
    try:
        import torchvision  # lazy: the suite's only user of torchvision (not a tcprec dependency)
    except ImportError as e:
        raise ImportError(f"tcprec bench models builds torchvision's model definitions, and torchvision is not "
                          f"importable here ({e}); install the build that matches torch {torch.__version__} "
                          "(pip install torchvision)") from None
    return torchvision


def torchvision_classifiers() -> list[str]:
    """Every classification model torchvision defines (``list_models(module=torchvision.models)``), sorted."""
    tv = _torchvision()
    return sorted(tv.models.list_models(module=tv.models))


def build_model(name: str, seed: int, device, image: int = IMAGE) -> torch.nn.Module:
    """torchvision's ``name`` with seeded weights; batch-norm statistics from two seeded batches of 8; eval, fp32.
    The statistics pass runs the model in eval mode with only its batch norms in train mode: a branch that runs only
    in training (inception_v3's auxiliary head, which needs 299 x 299 inputs) stays out of it, as in the model's use.
    A conv or linear whose weight the definition initialises to all zeros (the ViT heads) gets torch's default
    initialisation instead: a zero head makes every output 0, the quantized model's too, and its NRMSE against fp32
    an empty 0."""
    tv = _torchvision()
    torch.manual_seed(seed)
    m = tv.models.get_model(name, weights=None).to(device)
    for layer in m.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and not layer.weight.detach().any():
            layer.reset_parameters()
    bns = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._BatchNorm)]
    if bns:
        for b in bns:
            b.reset_running_stats()
            b.momentum = None  # cumulative average over the batches below
        g = torch.Generator(device=device).manual_seed(seed + 1)
        m.eval()
        for b in bns:
            b.train()
        with torch.no_grad():
            for _ in range(2):
                m(torch.randn((8, 3, image, image), device=device, generator=g))
    return m.eval()


def _models(models: Sequence[str], known: list[str]) -> list[str]:
    if list(models) == ["all"]:
        return known
    bad = [m for m in models if m not in known]
    if bad:
        raise ValueError(f"unknown model(s) {bad}: not torchvision classification models; choose from {known} "
                         "or 'all'")
    return list(models)


def parse_precisions(precisions: Sequence[str]) -> list[str]:
    out = [canonical_network_precision(p) for p in precisions]  # ValueError lists the accepted set
    base = [p for p in out if p in ("fp32", "fp16")]
    if base:
        raise ValueError(f"precision {base[0]!r} is not a quantized precision: fp32 (the reference) and fp16 (the "
                         "baseline) are measured for every model; choose from int8, fp8, wXaY (e.g. w1a2)")
    return out


def _counts(summary) -> dict:
    floated = set(summary.speed.floated) if summary.speed is not None else set()
    return {"quantized": sum(r.precision != "float" for r in summary.layers),
            "floated_by_rule": sum(r.precision == "float" and r.name in floated for r in summary.layers),
            "float_other": sum(r.precision == "float" and r.name not in floated for r in summary.layers)}


def _resumed(out: str, batch: int, seed: int, suite: str = "models", command: str | None = None):
    """(rows, details) of every case a previous run wrote to ``out`` at the same batch and seed, whatever its model
    or precision ([] without the file): a resumed run adds its rows to them and loses none; ValueError naming the
    difference when the file holds a run of another kind.  With ``command`` (this run's), also (the command that began
    the file, the distinct commands that resumed it, this one last): a resumed run keeps the file's command and adds
    its own to the list, so the file says how all of it was measured."""
    path = Path(out)
    if not path.exists():
        return ([], {}) if command is None else ([], {}, command, [])
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--resume: {out} is not valid JSON ({e}); move it away or run without --resume") from None
    cfg = d.get("config", {}) if isinstance(d, dict) else {}
    if not isinstance(d, dict) or d.get("suite") != suite or (cfg.get("batch"), cfg.get("seed")) != (batch, seed):
        raise ValueError(f"--resume: {out} is not a {suite} run at batch {batch}, seed {seed} (it holds suite "
                         f"{d.get('suite') if isinstance(d, dict) else None!r}, batch {cfg.get('batch')}, seed "
                         f"{cfg.get('seed')}); pass the same --batch / --seed, another --json, or drop --resume")
    rows, details = list(d.get("rows", [])), dict(d.get("details", {}))
    if command is None:
        return rows, details
    first = d.get("command") or command
    later = [c for c in d.get("resumed_with", []) if c != command] + ([command] if command != first else [])
    return rows, details, first, later


def _missing(rows: list, name: str, precisions: Sequence[str]) -> list[str]:
    """Those of ``precisions`` that ``rows`` hold no case of for model ``name`` (in their order)."""
    have = {r.get("precision") for r in rows if r.get("model") == name}
    return [p for p in precisions if p not in have]


def catalog_config(precision: str, **kw) -> QuantConfig:
    """The catalog's config of ``precision``: ``first_last`` int8 for wXaY below 8 bits (APNN-TC's rule), none for
    int8 / fp8; ``kw``: the other QuantConfig fields (the timed run's speed rule)."""
    return QuantConfig(precision, first_last=None if precision in ("int8", "fp8") else "int8", **kw)


def measure_model(name: str, precisions: Sequence[str], batch: int, seed: int, console: Console) -> tuple[list, dict]:
    """(rows, details) of one model on the current CUDA device: the fp16 baseline and each precision."""
    device = torch.device("cuda", torch.cuda.current_device())
    m32 = build_model(name, seed, device).to(memory_format=torch.channels_last)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    x = torch.randn((batch, 3, IMAGE, IMAGE), device=device, generator=g).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = m32(x).float()
    m16 = copy.deepcopy(m32).half()
    del m32
    x16 = x.half()
    with torch.no_grad():  # the baseline's own error: a non-finite fp16 model (seeded Swin-V2) explains its rows
        fp16_err = nrmse(m16(x16).float(), ref)
    rows, details = [], {}
    for p in precisions:
        row: dict = {"model": name, "precision": p, "batch": batch, "fp16_nrmse_vs_fp32": fp16_err}
        t0 = time.time()
        try:
            # (a line as each long stage starts: a case of a large model takes minutes, and a log cut short by a time
            # limit then says which stage it was in)
            console.print(f"{name} {p}: converting, the speed rule timing each layer at batch {batch} ...")
            cfg = catalog_config(p, speed_rule=SpeedRule(batch=batch))
            q = quantize_model(m16, cfg, calibration=x16[:CALIBRATION_IMAGES], warn=False)
            row["setup_s"] = round(time.time() - t0, 1)
            console.print(f"{name} {p}: converted in {row['setup_s']} s; timing against fp16 ...")
            with torch.no_grad():
                y = q(x16).float()
                row["ms"], row["fp16_ms"] = time_graphs_alternating_ms(lambda: q(x16), lambda: m16(x16))
            row["speedup"] = row["fp16_ms"] / row["ms"]  # (against the fp16 time paired with it)
            row["nrmse_vs_fp32"] = nrmse(y, ref)
            s = q.tcprec_summary
            row.update(_counts(s))
            if s.speed is not None and s.speed.model_itself:  # the rule gave the fp16 model back: its time is fp16's
                row["model_itself"] = True
            details[f"{name}/{p}"] = {"layers": [r.line() for r in s.layers], "notes": s.notes,
                                      "speed_rule": s.speed.lines() if s.speed is not None else None}
            del q
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others' numbers
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["setup_s"] = round(time.time() - t0, 1)
        rows.append(row)
        console.print(_case_line(row))
        torch.cuda.empty_cache()
    del m16
    torch.cuda.empty_cache()
    return rows, details


def convert_model(name: str, precisions: Sequence[str], batch: int, seed: int, console: Console) -> tuple[list, dict]:
    """(rows, details) of one model on the CPU (``convert_only``): each precision converted from the fp32 model with
    the catalog's first / last rule, run on ``batch`` seeded images, its NRMSE against fp32 and its layer counts."""
    m32 = build_model(name, seed, torch.device("cpu"))
    x = torch.randn((batch, 3, IMAGE, IMAGE), generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        ref = m32(x).float()
    rows, details = [], {}
    for p in precisions:
        row: dict = {"model": name, "precision": p, "batch": batch}
        t0 = time.time()
        try:
            q = quantize_model(m32, catalog_config(p), calibration=x, warn=False)
            with torch.no_grad():
                row["nrmse_vs_fp32"] = nrmse(q(x).float(), ref)
            s = q.tcprec_summary
            row.update(_counts(s))
            details[f"{name}/{p}"] = {"layers": [r.line() for r in s.layers], "notes": s.notes,
                                      "float": {r.name: r.backend for r in s.layers if r.precision == "float"}}
            del q
        except Exception as e:  # noqa: BLE001 - a case that fails is this check's finding: a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["setup_s"] = round(time.time() - t0, 1)
        rows.append(row)
        console.print(_case_line(row))
    return rows, details


def _case_line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']} {r['precision']}: [red]error[/] {r['error'][:120]}"
    if "ms" not in r:  # (convert_only)
        return (f"{r['model']} {r['precision']}: converted and ran, NRMSE {r['nrmse_vs_fp32']:.3g}, {r['quantized']} "
                f"quantized / {r['float_other']} float ({r['setup_s']} s)")
    return (f"{r['model']} {r['precision']}: {r['ms']:.3f} ms, fp16 {r['fp16_ms']:.3f} ms, {r['speedup']:.2f}x"
            + (" (the fp16 model itself, given back by the speed rule)" if r.get("model_itself") else "") + ", "
            f"NRMSE {r['nrmse_vs_fp32']:.3g}, {r['quantized']} quantized / {r['floated_by_rule']} kept fp16 by the "
            f"speed rule / {r['float_other']} float otherwise ({r['setup_s']} s)")


def targets(rows: list[dict], models: Sequence[str], catalog_size: int | None = None, timed: bool = True) -> list[dict]:
    """The issue's targets judged on ``rows``: ResNet-50's speedups, every model converts, none slower than fp16
    (``timed=False``, a ``convert_only`` run: "converts" alone).  "Every model converts" is met only by a run of the
    whole catalog (``catalog_size`` models: ``--model all``); a run of fewer models can fail it, not meet it."""
    out = []
    for (model, prec), want in TARGETS.items() if timed else ():
        r = next((r for r in rows if r["model"] == model and r["precision"] == prec and "speedup" in r), None)
        out.append({"target": f"{model} {prec} >= {want}x fp16",
                    "value": "not measured" if r is None else f"{r['speedup']:.2f}x",
                    "met": None if r is None else r["speedup"] >= want})
    failed = sorted({r["model"] for r in rows if "error" in r})
    ran = sorted({r["model"] for r in rows})
    whole = catalog_size is not None and len(models) >= catalog_size
    listed = f"listed: {len(models)}" + ("" if whole or catalog_size is None else
                                         f" of the {catalog_size} definitions; --model all judges this target")
    precs = {r["precision"] for r in rows}
    short = sorted(m for m in ran if {r["precision"] for r in rows if r["model"] == m} != precs)
    out.append({"target": "every torchvision classification model converts",
                "value": f"{len(ran) - len(failed)} of {len(ran)} models run at every precision measured ({listed})"
                         + (f"; failed: {', '.join(failed)}" if failed else "")
                         + (f"; not yet measured at every precision: {', '.join(short)}" if short else ""),
                "met": None if not ran else False if failed else (len(ran) == len(models) and not short if whole
                                                                          else None)})
    if not timed:
        return out
    cases = [r for r in rows if "speedup" in r]
    # a row whose model is the fp16 model itself (the speed rule gave it back: SpeedReport.model_itself) runs what
    # the baseline runs; its ratio is the timing noise of one graph against itself, not a slower model
    itself = [r for r in cases if r.get("model_itself")]
    judged = [r for r in cases if not r.get("model_itself")]
    slow = [r for r in judged if r["speedup"] < 1.0]
    worst = min(judged, key=lambda r: r["speedup"]) if judged else None
    out.append({"target": "no model slower than fp16 at any precision",
                "value": "not measured" if not cases else
                (f"slowest {worst['model']} {worst['precision']} {worst['speedup']:.2f}x; " if worst else "")
                + f"{len(slow)} of {len(cases)} cases below 1.0x"
                + (": " + ", ".join(f"{r['model']} {r['precision']}" for r in slow[:8]) if slow else "")
                + (f"; {len(itself)} case(s) the fp16 model itself, given back by the speed rule (timed "
                   f"{min(r['speedup'] for r in itself):.3f}-{max(r['speedup'] for r in itself):.3f}x against "
                   "itself)" if itself else ""),
                "met": None if not cases else not slow})
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N): this process measures the listed models at positions i with i % N == K."""
    try:
        k, n = (int(v) for v in str(text).split("/"))
    except ValueError:
        k = n = None
    if k is None or not (n >= 1 and 0 <= k < n):
        raise ValueError(f"--shard must be K/N with 0 <= K < N (e.g. 0/2 and 1/2 on two GPUs), got {text!r}")
    return k, n


def check_shard(shard: tuple[int, int] | None, resume: bool) -> None:
    """A shard (K, N) runs only with ``resume``: the shards merge their rows into one file."""
    if shard is not None:
        parse_shard(f"{shard[0]}/{shard[1]}")  # (validated)
        if not resume:
            raise ValueError(f"--shard {shard[0]}/{shard[1]} needs --resume: the shards merge their rows into one "
                             "--json file, which a run without --resume would overwrite")


@contextlib.contextmanager
def _locked(out: str):
    """An exclusive lock on ``out`` across processes (a file in the temp dir named by its absolute path), so that the
    shards of one catalog run read, merge and write it one at a time."""
    import fcntl  # (POSIX: the GPU machines this suite runs on)

    key = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"tcprec-bench-models-{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _merge(kept: list, kept_details: dict, mine: list, mine_details: dict) -> tuple[list, dict]:
    """The file's rows with this run's in place of theirs (by model and precision; new ones after): rows of other
    models and precisions stay as they were."""
    own = {(r["model"], r["precision"]): r for r in mine}
    rows = [own.pop((r["model"], r["precision"]), r) for r in kept]
    rows += [r for r in mine if (r["model"], r["precision"]) in own]
    details = dict(kept_details)
    details.update(mine_details)
    return rows, details


def run(models: Sequence[str] = DEFAULT_MODELS, precisions: Sequence[str] = PRECISIONS, batch: int = 256,
        out: str = "benchmarks/results/models.json", command: str = "tcprec bench models", console: Console | None = None,
        seed: int = 0, measure: Callable | None = None, catalog: Callable[[], list[str]] | None = None,
        env: dict | None = None, resume: bool = False, shard: tuple[int, int] | None = None,
        convert_only: bool = False) -> dict:
    """Run every (model, precision) case and write the JSON (module docstring).  ``measure(name, precisions, batch,
    seed, console) -> (rows, details)``, ``catalog() -> names`` and ``env`` replace the GPU, torchvision and the
    device record (tests).  ``resume``: keep the cases ``out`` already holds (a run at the same batch and seed, cut
    short, of other models or of other precisions) and measure only the (model, precision) cases it lacks --
    ``--model all`` over several sessions or machine loans, one precision at a time for the largest models; each row
    names the commit that measured it.  Under ``resume`` every write re-reads ``out`` under a lock and merges this
    run's rows into it, so several runs may share the file, and no row of another model or precision is dropped.
    ``shard=(K, N)`` (needs ``resume``): measure only the listed models at positions i with i % N == K -- N processes,
    one a GPU (``CUDA_VISIBLE_DEVICES=K``), run the catalog into one file.  ``convert_only``: the CPU conversion check
    (:func:`convert_model`, suite ``models_convert``; module docstring)."""
    console = console or Console()
    commit = git_commit()
    precisions = parse_precisions(precisions)
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    check_shard(shard, resume)
    suite = SUITES[convert_only]
    with _locked(out) if resume else contextlib.nullcontext():
        kept_rows, kept_details, first_command, resumed_with = (_resumed(out, batch, seed, suite, command) if resume
                                                                 else ([], {}, command, []))
    if measure is None and convert_only:
        measure = convert_model
    elif measure is None:
        require_cuda(command)
        measure = measure_model
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 (the reference)
        torch.backends.cuda.matmul.allow_tf32 = False
    known = (catalog or torchvision_classifiers)()
    names = _models(models, known)
    env = env if env is not None else environment()
    if env.get("gpu") and "sm_count" in env:
        print_environment(console, env)
    rows, details = kept_rows, kept_details
    done_before = [n for n in names if not _missing(rows, n, precisions)]
    mine: list[dict] = []
    mine_details: dict = {}
    todo = [n for i, n in enumerate(names) if n not in done_before and (shard is None or i % shard[1] == shard[0])]
    if resume and (rows or shard is not None):
        console.print(f"resuming {out}: {len(done_before)} model(s) kept, {len(todo)} to measure"
                      + (f" (shard {shard[0]}/{shard[1]})" if shard is not None else ""))

    def payload() -> dict:
        commits = sorted({r.get("commit") or "unknown" for r in rows}) or [commit]
        judged = names + sorted({r["model"] for r in rows} - set(names))  # (resumed: the file's other models too)
        p = {"suite": suite, "command": first_command} | ({"resumed_with": resumed_with} if resumed_with else {}) | {
             "device": "cpu" if convert_only else env.get("gpu"),
             "commit": commits[0] if len(commits) == 1 else f"per row ({', '.join(commits)})",
             "summary": [{k: r.get(k) for k in ("model", "precision", "ms", "fp16_ms", "speedup", "nrmse_vs_fp32",
                                                "fp16_nrmse_vs_fp32", "quantized", "floated_by_rule", "float_other",
                                                "model_itself", "error", "commit")
                          if k in r} for r in rows],
             "targets": targets(rows, judged, len(known), timed=not convert_only),
             "config": {"batch": batch, "image": IMAGE, "seed": seed} | (
                 {"calibration_images": batch, "speed_rule": None} if convert_only else
                 {"calibration_images": CALIBRATION_IMAGES, "speed_rule": f"SpeedRule(batch={batch})"}),
             "environment": env, "rows": rows, "details": details}
        measured = sum(not _missing(rows, n, precisions) for n in names)
        if measured < len(names):  # written after every model, so a run cut short keeps what it measured
            p["partial"] = f"{measured} of {len(names)} models"
        return p

    def save() -> Path:
        nonlocal rows, details
        if not resume:
            rows, details = mine, mine_details
            return write_json(out, payload())
        with _locked(out):  # the rows other shards wrote meanwhile, then this run's
            rows, details = _merge(*_resumed(out, batch, seed, suite), mine, mine_details)
            return write_json(out, payload())

    for name in track(todo, "bench models", label=str):
        wanted = _missing(rows, name, precisions)  # (all of them but where a resumed file holds some)
        try:
            got, det = measure(name, wanted, batch, seed, console)
        except Exception as e:  # noqa: BLE001 - a model that does not build or run in fp16 is a row, not a crash
            got, det = [{"model": name, "precision": p, "batch": batch,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"} for p in wanted], {}
            console.print(_case_line(got[0]))
        mine += [{**r, "commit": commit} for r in got]
        mine_details.update(det)
        if name != todo[-1]:
            save()
    path = save()
    result = payload()
    listed = [r for r in rows if r["model"] in names and r["precision"] in precisions]  # (this run's cases)
    console.print(table(listed, f"torchvision models, batch {batch}, " + ("converted on the CPU" if convert_only
                                                                           else str(env.get("gpu")))))
    for t in result["targets"]:
        console.print(f"target: {t['target']}: {t['value']} ({ {True: 'met', False: 'MISSED', None: '-'}[t['met']] })")
    console.print(f"wrote {path}")
    return result


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for c in ("model", "precision", "ms", "fp16 ms", "vs fp16", "NRMSE vs fp32", "quantized", "kept fp16 (rule)",
              "float (other)"):
        t.add_column(c, justify="left" if c in ("model", "precision") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], r["precision"], "error", r["error"][:50], "", "", "", "", "")
            continue
        timed = "ms" in r  # (not in a convert_only row)
        t.add_row(r["model"], r["precision"], _num(r["ms"], ".3f") if timed else "-",
                  _num(r["fp16_ms"], ".3f") if timed else "-", _num(r["speedup"], ".2f") + "x" if timed else "-",
                  _num(r["nrmse_vs_fp32"], ".3g"), str(r["quantized"]),
                  str(r["floated_by_rule"]), str(r["float_other"]))
    return t


def _num(v, spec: str) -> str:
    """A number as ``spec`` formats it; a non-finite one as the JSON file holds it ("nan", "inf")."""
    return format(v, spec) if isinstance(v, (int, float)) else str(v)
