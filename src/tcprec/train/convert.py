"""``emulate_model(model, recipe)``: swap ``nn.Linear`` / ``nn.Conv2d`` for their emulated versions,
in place, sharing the parameters, and say what was swapped (and what was not, and why)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..nn.emulated import EmulatedConv2d, EmulatedLinear, Recipe

__all__ = ["emulate_model", "SwapReport"]


@dataclass
class SwapReport:
    swapped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, old type, new type)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)

    def __len__(self) -> int:
        return len(self.swapped)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} module(s), skipped {len(self.skipped)}"]
        lines += [f"  {n}: {a} -> {b}" for n, a, b in self.swapped]
        lines += [f"  {n}: kept ({why})" for n, why in self.skipped]
        return "\n".join(lines)


def emulate_model(model: torch.nn.Module, recipe: Recipe | dict, *, skip: tuple[str, ...] = (),
                  overrides: dict[str, Recipe] | None = None) -> SwapReport:
    """Replace every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` (in place) by ``EmulatedLinear`` /
    ``EmulatedConv2d`` computing with ``recipe``; ``skip`` lists module names to keep, ``overrides``
    gives some modules their own recipe.  Parameters are shared, so an optimizer built before the
    swap still updates them.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> rep = emulate_model(m, Recipe(act="e4m3", weight="e4m3", grad_output="e5m2"), skip=("2",))
    >>> [n for n, _, _ in rep.swapped], rep.skipped
    (['0'], [('2', 'in skip')])
    """
    if isinstance(recipe, dict):
        recipe = Recipe(**recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a tcprec.nn.Recipe (or a dict of its fields), got {type(recipe).__name__}")
    overrides = overrides or {}
    names = {n for n, _ in model.named_modules()}
    unknown = [n for n in (*skip, *overrides) if n not in names]
    if unknown:
        raise ValueError(f"no module named {unknown} in the model; module names look like {sorted(names)[1:6]}")
    report = SwapReport()
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) not in (torch.nn.Linear, torch.nn.Conv2d):  # exact types: never re-wrap
                continue
            if full in skip:
                report.skipped.append((full, "in skip"))
                continue
            rc = overrides.get(full, recipe)
            if isinstance(child, torch.nn.Conv2d):
                why = EmulatedConv2d.cannot_convert(child)
                if why:
                    report.skipped.append((full, why))
                    continue
                new = EmulatedConv2d.from_module(child, rc)
            else:
                new = EmulatedLinear.from_module(child, rc)
            setattr(parent, child_name, new)
            report.swapped.append((full, type(child).__name__, type(new).__name__))
    return report
