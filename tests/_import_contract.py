"""The import contract of tcprec, and the checker that enforces it (test_import_contract.py).

Layers, lowest first.  A module may import from its own layer and the layers below it, never from
above; in an *independent* layer, components do not import each other (``tcprec.nn`` and
``tcprec.linalg`` are siblings, not a stack).  Every import counts, function-local ones included, and
the module graph has no cycles.  A function-local import of a tcprec module is allowed only for a
Triton or CUDA kernel module (``tcprec.kernels.triton.<name>`` / ``tcprec.kernels.cuda.<name>``:
importing one imports Triton -- whose ``jit`` reads ``TRITON_INTERPRET`` at that moment -- or
cuda.core/NVRTC, and ``import tcprec`` loads neither), or where its line says why with ``# lazy:``.

The checker is plain ``ast``: no import of the package under test, so a cycle cannot hide behind
import order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# (layer name, components (a module or a package prefix; the root package means only its __init__),
#  independent)
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [
    ("base", ("tcprec._version", "tcprec.enums", "tcprec.env", "tcprec.formats", "tcprec.memo", "tcprec.precision",
              "tcprec.progress", "tcprec.timing"),
     False),
    ("kernels", ("tcprec.kernels",), False),
    ("ops", ("tcprec.packing", "tcprec.qtensor", "tcprec.ops"), False),
    ("libraries", ("tcprec.nn", "tcprec.linalg", "tcprec.distributed", "tcprec.runtime", "tcprec.profiling",
                   "tcprec.emulate", "tcprec.metrics", "tcprec.data"), True),
    ("workflows", ("tcprec.qat", "tcprec.train"), False),
    ("drivers", ("tcprec.bench",), True),
    ("entry", ("tcprec", "tcprec.cli"), False),
]

LAZY_KERNEL_PACKAGES = ("tcprec.kernels.triton", "tcprec.kernels.cuda")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    local: bool  # inside a function / class body, not at module level
    justified: bool  # the import's lines carry a ``# lazy:`` comment


def discover(src_root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is_package) for every .py file of ``package`` under ``src_root``."""
    mods = {}
    for p in sorted((src_root / package).rglob("*.py")):
        parts = list(p.relative_to(src_root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (p, is_pkg)
    return mods


def _targets(mod: str, is_pkg: bool, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module
    out = []
    for a in node.names:  # ``from pkg import sub`` imports the submodule pkg.sub where there is one
        out.append(f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg)
    return out


def edges(src_root: Path, package: str) -> tuple[dict, list[Edge]]:
    mods = discover(src_root, package)
    out = []
    for mod, (path, is_pkg) in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            justified = any("# lazy:" in lines[i] for i in range(node.lineno - 1, node.end_lineno))
            for dst in _targets(mod, is_pkg, node, mods):
                if dst == package or dst.startswith(package + "."):
                    while dst not in mods:  # ``import pkg.mod.attr``-style names: the module part
                        dst = dst.rsplit(".", 1)[0]
                    out.append(Edge(mod, dst, node.lineno, id(node) not in top, justified))
    return mods, out


def component(mod: str, layers=LAYERS, root: str = "tcprec") -> tuple[int, str] | None:
    """(layer index, component) of a module: the longest matching component wins."""
    best = None
    for i, (_, comps, _) in enumerate(layers):
        for c in comps:
            hit = mod == c if c == root else (mod == c or mod.startswith(c + "."))
            if hit and (best is None or len(c) > len(best[1])):
                best = (i, c)
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def check(src_root: Path, package: str = "tcprec", layers=LAYERS,
          lazy_packages=LAZY_KERNEL_PACKAGES) -> list[str]:
    """Every violation of the contract, one line each (an empty list: the tree keeps it)."""
    mods, es = edges(Path(src_root), package)
    problems = []
    for mod in mods:
        if component(mod, layers, package) is None:
            problems.append(f"{mod}: in no layer; add it to a layer of the contract (tests/_import_contract.py)")
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in es:
        if e.src == e.dst:
            continue
        graph[e.src].add(e.dst)
        # importing e.dst from outside its packages runs their __init__ first (not the root's: it runs first)
        parts = e.dst.split(".")
        for k in range(2, len(parts)):
            pkg = ".".join(parts[:k])
            if not (e.src == pkg or e.src.startswith(pkg + ".")):
                graph[e.src].add(pkg)
        a, b = component(e.src, layers, package), component(e.dst, layers, package)
        where = f"{e.src}:{e.line} imports {e.dst}"
        if a and b:
            if b[0] > a[0]:
                problems.append(f"{where}: upward ({layers[a[0]][0]} -> {layers[b[0]][0]})")
            elif a[0] == b[0] and a[1] != b[1] and layers[a[0]][2]:
                problems.append(f"{where}: sideways inside the independent layer {layers[a[0]][0]!r}")
        lazy_kernel = any(e.dst.startswith(p + ".") for p in lazy_packages)
        if e.local and not (lazy_kernel or e.justified):
            problems.append(f"{where} inside a function: import it at module level, or say why with '# lazy:'")
    for scc in _cycles(graph):
        problems.append(f"import cycle: {' <-> '.join(scc)}")
    return list(dict.fromkeys(problems))  # one line per violation, in order
