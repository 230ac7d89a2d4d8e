"""CPU memory and time of conversion and emulated layers (issue 40), one fresh process a case.

Targets (issue 40, "Memory and CPU time"):

* ``quantize_model`` peaks at <= 3x the model's fp32 weight size above the memory held before the call
  (cases ``linear_9216x4096`` -- one nn.Linear(9216, 4096), 151 MB -- and ``alexnet``; the first forward, which
  builds the packed weights, is reported beside it);
* an emulated layer within 10x of its plain float time (``EmulatedLinear(256, 256)``, e5m10 accumulator, batch
  64, forward + backward, against nn.Linear in the same process).

Peak memory is the process's peak RSS (``resource.getrusage(...).ru_maxrss``) minus its RSS just before the call,
each case in a fresh subprocess (so one case's peak does not hide another's); time is a wall-clock median.
Threads are pinned to 1 so the ratios do not depend on the load of a shared machine.

    PYTHONPATH=src python benchmarks/cpu_memory_time.py            # writes benchmarks/results/cpu_memory_time.json
    PYTHONPATH=src python benchmarks/cpu_memory_time.py --case alexnet   # one case, JSON on stdout
    PYTHONPATH=src python benchmarks/cpu_memory_time.py --baseline /path/to/other/checkout/src   # both sides

``--baseline SRC`` runs every case a second time with ``SRC`` first on PYTHONPATH (e.g. the main branch's
checkout) in the same run, and records it beside the current tree's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

CASES = ("linear_9216x4096", "alexnet", "emulated_linear_e5m10")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_memory_time.json")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _conversion(build, x) -> dict:
    import torch

    import tcprec as tp

    torch.manual_seed(0)
    model = build().eval()
    weights_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    before, peak_before = _rss_mb(), _peak_mb()
    t0 = time.perf_counter()
    q = tp.quantize_model(model, "int8", calibration=x, warn=False)
    t_convert = time.perf_counter() - t0
    peak_convert = _peak_mb()
    with torch.no_grad():
        t0 = time.perf_counter()
        q(x)
        t_first = time.perf_counter() - t0
    peak_first = _peak_mb()
    return {"weights_fp32_mb": round(weights_mb, 1), "rss_before_mb": round(before, 1),
            "peak_before_call_mb": round(peak_before, 1),
            "convert_peak_above_before_mb": round(peak_convert - before, 1),
            "convert_peak_x_weights": round((peak_convert - before) / weights_mb, 2),
            "convert_s": round(t_convert, 2),
            "first_forward_peak_above_before_mb": round(peak_first - before, 1),
            "first_forward_peak_x_weights": round((peak_first - before) / weights_mb, 2),
            "first_forward_s": round(t_first, 2)}


def _median_time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    fn()  # warm-up (a run of seconds is its own measurement: no warm-up effect is that large)
    first = time.perf_counter() - t0
    if first > 2.0:
        return first
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _emulated() -> dict:
    import torch

    from tcprec.nn.emulated import EmulatedLinear, Recipe

    torch.manual_seed(0)
    plain = torch.nn.Linear(256, 256)
    emu = EmulatedLinear.from_module(plain, Recipe(acc="e5m10"))
    x = torch.randn(64, 256, requires_grad=True)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).square().mean().backward()
        return run

    t_plain = _median_time(step(plain), 21)
    t_emu = _median_time(step(emu), 3)
    return {"plain_ms": round(t_plain * 1e3, 3), "emulated_ms": round(t_emu * 1e3, 1),
            "ratio": round(t_emu / t_plain, 1)}


def run_case(name: str) -> dict:
    import torch

    torch.set_num_threads(1)
    if name == "linear_9216x4096":
        return _conversion(lambda: torch.nn.Linear(9216, 4096), torch.randn(8, 9216))
    if name == "alexnet":
        from tcprec.nn import models as zoo

        return _conversion(lambda: zoo.build("alexnet"), torch.randn(1, 3, 224, 224))
    if name == "emulated_linear_e5m10":
        return _emulated()
    raise ValueError(f"case must be one of {CASES}, got {name!r}")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, help="run one case in this process and print its JSON")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--baseline", metavar="SRC", help="also run every case with SRC first on PYTHONPATH")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    def case(name, src=None):
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        r = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True,
                           env=env)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        print("baseline" if src else "current", name, out, flush=True)
        return out

    detail = {name: case(name) for name in CASES}
    baseline = {name: case(name, args.baseline) for name in CASES} if args.baseline else None
    conv = {k: detail[k] for k in ("linear_9216x4096", "alexnet")}
    emu = detail["emulated_linear_e5m10"]
    summary = [{"case": k, "weights_mb": v["weights_fp32_mb"], "convert_peak_mb": v["convert_peak_above_before_mb"],
                "x_weights": v["convert_peak_x_weights"], "convert_s": v["convert_s"],
                "first_fwd_peak_mb": v["first_forward_peak_above_before_mb"]} for k, v in conv.items()]
    summary.append({"case": "EmulatedLinear(256,256) e5m10 b64 fwd+bwd", "plain_ms": emu["plain_ms"],
                    "emulated_ms": emu["emulated_ms"], "ratio": emu["ratio"]})
    if baseline:
        for k in conv:
            b = baseline[k]
            summary.append({"case": f"{k} (baseline)", "weights_mb": b["weights_fp32_mb"],
                            "convert_peak_mb": b["convert_peak_above_before_mb"], "x_weights": b["convert_peak_x_weights"],
                            "convert_s": b["convert_s"], "first_fwd_peak_mb": b["first_forward_peak_above_before_mb"]})
        b = baseline["emulated_linear_e5m10"]
        summary.append({"case": "EmulatedLinear(256,256) e5m10 b64 fwd+bwd (baseline)", "plain_ms": b["plain_ms"],
                        "emulated_ms": b["emulated_ms"], "ratio": b["ratio"]})
    targets = [{"target": f"quantize_model peak <= 3x fp32 weights ({k})", "value": f"{v['convert_peak_x_weights']}x",
                "met": v["convert_peak_x_weights"] <= 3} for k, v in conv.items()]
    targets.append({"target": "EmulatedLinear e5m10 within 10x of nn.Linear (fwd+bwd, CPU)",
                    "value": f"{emu['ratio']}x", "met": emu["ratio"] <= 10})
    import torch

    result = {"suite": "cpu_memory_time", "command": "PYTHONPATH=src python benchmarks/cpu_memory_time.py"
                         + (f" --baseline {args.baseline}" if args.baseline else ""),
              "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread, "
                        f"torch {torch.__version__}",
              "commit": _commit(), "summary": summary, "targets": targets, "detail": detail,
              "baseline": None if baseline is None else {"src": args.baseline, "detail": baseline},
              "load_note": "a shared 2-core machine: absolute times vary with other users' load; both sides of a "
                           "ratio are measured back to back in one process"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
