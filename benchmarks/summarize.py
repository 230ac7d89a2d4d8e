"""Print a Markdown table from a benchmark JSON in benchmarks/results/ (for BENCHMARKS.md).

    python benchmarks/summarize.py benchmarks/results/cast.json
"""

import json
import sys


def cast_table(d: dict) -> str:
    env = d["env"]
    lines = [f"Device: {env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, triton {env.get('triton')}",
             f"Command: `{d.get('command')}`", "",
             "| op | format | rounding | B/elem | ms (median) | GB/s | of copy | target | exact | vs baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        tgt = "" if r.get("target") is None else f">= {r['target']:.0%}: {'pass' if r['passed'] else 'FAIL'}"
        base = "" if r.get("speedup_vs_baseline") is None else f"{r['speedup_vs_baseline']:.2f}x {r['baseline']}"
        lines.append(f"| {r['op']} | {r['format'] or ''} | {r['rounding'] or ''} | {r['bytes_per_element']} | "
                     f"{r['ms']:.3f} | {r['gb_per_s']:.0f} | {r['fraction_of_copy']:.1%} | {tgt} | "
                     f"{'' if r.get('exact') is None else r['exact']} | {base} |")
    return "\n".join(lines)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    print(cast_table(data) if data["rows"] and "bytes_per_element" in data["rows"][0] else json.dumps(data, indent=1)[:4000])
