"""Progress bars for long runs: one small helper shared by the CLI, the benchmarks, training and solves.

Bars go to **stderr** (stdout stays for results, and for JSON under ``--json -``), vanish when done,
and draw only on a terminal.  ``tcprec <command> --quiet`` silences them for the whole command
(:func:`quiet`); a caller can also pass ``quiet=True`` to one bar.

>>> from tcprec.progress import bar, track
>>> with bar(3, "cases", quiet=True) as b:
...     for case in ("a", "b", "c"):
...         b.advance(description=f"case {case}", loss=0.5)
>>> [x for x in track(range(3), "steps", quiet=True)]
[0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["Bar", "bar", "quiet", "track"]

_QUIET: ContextVar[bool] = ContextVar("tcprec_progress_quiet", default=False)
_ACTIVE: ContextVar[Progress | None] = ContextVar("tcprec_progress_active", default=None)  # rich allows one live display


@contextmanager
def quiet(on: bool = True):
    """Within this block every bar of this module is silent (``--quiet`` of every command)."""
    token = _QUIET.set(bool(on) or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


class Bar:
    """One task of a rich progress display: :meth:`advance` moves it and shows ``name value`` stats
    (floats as 4 significant digits); :meth:`print` writes a line above it (on stderr)."""

    def __init__(self, progress: Progress, task):
        self._progress, self._task = progress, task

    def advance(self, n: float = 1, *, description: str | None = None, **stats) -> None:
        text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items())
        fields = {"stats": text} if stats else {}
        if description is not None:
            fields["description"] = description
        self._progress.update(self._task, advance=n, **fields)

    def update(self, *, completed: float | None = None, description: str | None = None, **stats) -> None:
        """Set the position (and the description / stats) instead of moving it."""
        self.advance(0, description=description, **stats)
        if completed is not None:
            self._progress.update(self._task, completed=completed)

    def print(self, *objects, **kwargs) -> None:
        if not self._progress.disable:
            self._progress.console.print(*objects, **kwargs)


@contextmanager
def bar(total: float | None, description: str, *, quiet: bool = False, console: Console | None = None,
        transient: bool = True) -> Iterator[Bar]:
    """A progress bar over ``total`` steps (``None``: unknown, a pulsing bar) on stderr.  Inside
    another bar it becomes one more line of the same display (rich draws one live display at a time)."""
    off = quiet or _QUIET.get()
    outer = _ACTIVE.get()
    if outer is not None and not off:
        task = outer.add_task(description, total=total, stats="")
        try:
            yield Bar(outer, task)
        finally:
            outer.remove_task(task)
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"),
                        TimeRemainingColumn(), console=console or Console(stderr=True), transient=transient,
                        disable=off, redirect_stdout=False, redirect_stderr=False)
    token = _ACTIVE.set(None if off else progress)
    try:
        with progress:
            yield Bar(progress, progress.add_task(description, total=total, stats=""))
    finally:
        _ACTIVE.reset(token)


def track(items: Iterable, description: str, *, total: int | None = None, quiet: bool = False,
          label=None) -> Iterator:
    """``for x in track(items, "gemm")``: a bar advancing once per item; ``label(x)`` (optional)
    names the item being worked on."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with bar(total, description, quiet=quiet) as b:
        for x in items:
            if label is not None:
                b.update(description=f"{description}: {label(x)}")
            yield x
            b.advance()
