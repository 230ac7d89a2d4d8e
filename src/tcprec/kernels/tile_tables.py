"""Kernels' tuning rules as data: a JSON file beside each kernel (``<kernel>_tiles.json``), each entry
``{"value": ..., "measured": "what picked it", "source": "where the sweep is"}``, read and validated once at
import (decision 0033; conv_fwd's table, decision 0032, was the first).  A table that is missing an entry or
holds a value outside what its kernel can launch raises a ValueError naming the file, the entry, the value and
the allowed values -- never a half-read table.  Pure Python: ops read the route thresholds without importing Triton.

    >>> rules = {"large_rows": nonneg_int}
    >>> load_table(Path(__file__).parent / "triton" / "gemm_scatter_tiles.json", rules)["large_rows"]
    8192
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

__all__ = ["KERNELS_DIR", "load_table", "nonneg_int", "pos_int", "int_in", "record", "one_of"]

KERNELS_DIR = Path(__file__).parent  # tables of kernels/triton/<kernel>.py: KERNELS_DIR / "triton" / ...

# a rule: value -> None (valid) or what the value must be
Rule = Callable[[object], "str | None"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def nonneg_int(v) -> str | None:
    return None if _is_int(v) and v >= 0 else "an integer >= 0"


def pos_int(v) -> str | None:
    return None if _is_int(v) and v >= 1 else "an integer >= 1"


def int_in(allowed) -> Rule:
    allowed = tuple(allowed)
    return lambda v: None if _is_int(v) and v in allowed else f"one of {list(allowed)}"


def one_of(allowed, what: str = "") -> Rule:
    allowed = list(allowed)
    return lambda v: None if v in allowed else (what or f"one of {allowed}")


def record(**fields: Rule) -> Rule:
    """An object with exactly these keys, each valid under its rule."""

    def check(v) -> str | None:
        want = "{" + ", ".join(f"{k!r}: {fields[k](None) or 'any'}" for k in fields) + "}"
        if not isinstance(v, dict) or set(v) != set(fields):
            return f"an object with the keys {list(fields)}: {want}"
        bad = [k for k, rule in fields.items() if rule(v[k]) is not None]
        return None if not bad else f"{want} (bad: {', '.join(bad)})"

    return check


def load_table(path, rules: Mapping[str, Rule], check: Callable[[dict], str | None] | None = None) -> dict:
    """``{entry: value}`` of the table at ``path``, every entry of ``rules`` present and valid (``check``: a rule
    across entries, e.g. thresholds in order); ValueError naming the file, the entry, the value and what it must be."""
    path = Path(path)
    fix = f"restore {path.name} from git or re-run the sweep its entries cite"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tile table {path}: cannot read it as JSON ({e}); {fix}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"tile table {path}: expected a JSON object, got {type(doc).__name__}; {fix}")
    missing = [k for k in rules if not (isinstance(doc.get(k), dict) and "value" in doc[k])]
    if missing:
        raise ValueError(f"tile table {path}: entries {missing} missing (each {{\"value\": ...}}); it needs "
                         f"{list(rules)}; {fix}")
    out = {}
    for key, rule in rules.items():
        v = doc[key]["value"]
        why = rule(v)
        if why is not None:
            raise ValueError(f"tile table {path}: {key}.value must be {why}, got {v!r}; {fix}")
        out[key] = v
    why = check(out) if check is not None else None
    if why is not None:
        raise ValueError(f"tile table {path}: {why}; {fix}")
    return out
