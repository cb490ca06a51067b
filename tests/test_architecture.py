"""convbn's imports run downhill and form no circle (see ARCHITECTURE.md).

Every module of ``src/convbn`` is parsed with :mod:`ast` (nothing is imported or run).
Each ``import`` / ``from ... import`` counts -- at module level, inside functions and
under ``if TYPE_CHECKING`` alike (a function-local import hides a dependency; it does
not remove it) -- with relative imports resolved against the importing module's
package. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``.

The layers, lowest first; a module may import its own layer or lower ones:

-. ``compat``      ``_compat.py``: the one door to private torch names and to torch APIs
                   newer than the declared minimum (tests/test_private_torch.py)
0. ``functional``  pure maths on tensors (no ``autograd.Function``)
1. ``autograd``    the ``torch.autograd.Function``s and the functional entry points
                   that dispatch to them (``autograd/dispatch.py``)
2. ``nn``          thin modules over the Functions
3. ``tools``       ``reference/`` (the tutorial's reference Functions and modules,
                   which production code never imports), ``memory`` (saved-bytes /
                   peak / timeline measurement, used by ``passes.convert``'s ``auto``
                   planning), ``gradcheck`` (module-level gradcheck) and ``progress``
                   (a line per stage on stderr, used by ``passes`` and the app)
4. ``passes``      the torch.fx passes (trace, match, plan, rewrite, fold)
5. ``app``         ``bench/``, ``cli*``, ``demo*``, ``__main__`` and the package's
                   own ``__init__`` (which re-exports the public API)

Inside ``passes`` each sub-package is a layer of its own, lowest first (``PASS_LAYERS``); a
module of one may import its own sub-package or a lower one, never a peer or a higher one:

0. ``graph``    fx infrastructure of both passes: the conv / linear layers, hooks, shape-only
                uses, trace hazards and thread-scoped patches, the in-place rewrite
                (``GraphForward``: the graph and its fallbacks), nested concatenations
1. ``bn``       BatchNorm recognised however it is written; returns sites and reasons as values
2. ``tracing``  the leaf policy and partial tracing (it inlines what ``bn`` recognises)
3. ``report``   what each BatchNorm became, and what runs now
4. ``check``    comparing a rewrite with the original: tolerances, training steps, guards,
                the first-call / first-backward checks a pass attaches to ``GraphForward``
5. ``plan``     which layers keep what (measures with ``check``'s runs)
6. ``fold``     ``convbn.fold`` (and its own numerical check)
6. ``convert``  ``convbn.convert`` (peer of ``fold``: neither imports the other)

``ALLOWED`` lists today's known violations, each owned by a branch that removes it; it
may only shrink: an entry whose import is gone fails the test until it is deleted.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "convbn"

LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("compat", ("convbn._compat",)),
    ("functional", ("convbn.functional",)),
    ("autograd", ("convbn.autograd",)),
    ("nn", ("convbn.nn",)),
    ("tools", ("convbn.reference", "convbn.memory", "convbn.gradcheck", "convbn.progress")),
    ("passes", ("convbn.passes",)),
    ("app", ("convbn",)),  # everything else: bench/, cli*, demo*, __main__, __init__
)

#: The sub-packages of ``convbn.passes``, lowest first; packages in one tuple are peers.
PASS_LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("graph",), ("bn",), ("tracing",), ("report",), ("check",), ("plan",), ("fold", "convert"),
)

Edge = Tuple[str, str]

#: Known violations (importer, imported) -> who removes it. Shrink only.
ALLOWED: Dict[Edge, str] = {
    # empty: no known violation (nn.FusedChain's lazy planning is a callable convert attaches)
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolve(module: str, is_package: bool, level: int, target: str) -> str:
    if level == 0:
        return target
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str, path: Path, known: Set[str]) -> Iterator[Tuple[str, int]]:
    """(imported convbn module, line) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:  # import a.b.c where a.b.c is an attribute
                    name = name.rpartition(".")[0]
                if name:
                    yield name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module or "")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                elif base in known:
                    yield base, node.lineno


def _graph() -> Tuple[Dict[str, Set[str]], Dict[Edge, str]]:
    mods = _modules()
    known = set(mods)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    where: Dict[Edge, str] = {}
    for m, path in mods.items():
        for target, line in _imports(m, path, known):
            if target != m:
                graph[m].add(target)
                where.setdefault((m, target), f"{path.relative_to(SRC.parents[1])}:{line}")
    return graph, where


def layer_of(module: str) -> Tuple[int, str]:
    """(index, name) of the layer ``module`` belongs to (longest matching prefix)."""
    best = (-1, -1, "")
    for index, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), index, name))
    assert best[0] >= 0, f"{module} is in no layer"
    return best[1], best[2]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_allowed(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    return {m: {t for t in ts if (m, t) not in ALLOWED} for m, ts in graph.items()}


def test_the_walker_sees_function_local_and_relative_imports() -> None:
    graph, where = _graph()
    assert len(graph) > 40 and "convbn.passes.convert.api" in graph
    # a relative module-level import, resolved
    assert "convbn.functional.conv" in graph["convbn.nn.fused_conv_bn"]
    # the cli imports the package's __version__ inside a function: an edge to the package
    assert "convbn" in graph["convbn.cli"]
    assert where[("convbn.cli", "convbn")].startswith("src/convbn/cli.py:")


def test_every_module_has_a_layer() -> None:
    graph, _ = _graph()
    assert layer_of("convbn.functional.conv") == (1, "functional")
    assert layer_of("convbn._compat") == (0, "compat")
    assert layer_of("convbn.passes") == (5, "passes")
    assert layer_of("convbn.bench.training")[1] == "app"
    assert layer_of("convbn.memory")[1] == "tools"
    for m in graph:
        layer_of(m)


def test_imports_run_downhill() -> None:
    graph, where = _graph()
    upward = [
        f"{where[(m, t)]}: {m} ({layer_of(m)[1]}) imports {t} ({layer_of(t)[1]})"
        for m, targets in sorted(_without_allowed(graph).items())
        for t in sorted(targets)
        if layer_of(t)[0] > layer_of(m)[0]
    ]
    assert not upward, "upward imports (a lower layer must not import a higher one):\n" + "\n".join(upward)


def pass_layer_of(module: str) -> Tuple[int, str]:
    """(rank, sub-package) of a module inside ``convbn.passes``; ``(-1, "")`` for one outside
    (or ``convbn.passes`` itself)."""
    parts = module.split(".")
    if parts[:2] != ["convbn", "passes"] or len(parts) < 3:
        return -1, ""
    for rank, names in enumerate(PASS_LAYERS):
        if parts[2] in names:
            return rank, parts[2]
    raise AssertionError(f"{module}: convbn.passes.{parts[2]} is in no PASS_LAYERS entry")


def test_passes_sub_packages_import_downhill() -> None:
    """Each sub-package of ``passes`` imports only lower ones (no peer, no loop)."""
    graph, where = _graph()
    bad = []
    for m, targets in sorted(_without_allowed(graph).items()):
        rank, pkg = pass_layer_of(m)
        for t in sorted(targets):
            trank, tpkg = pass_layer_of(t)
            if pkg and tpkg and tpkg != pkg and trank >= rank:
                bad.append(f"{where[(m, t)]}: {m} ({pkg}) imports {t} ({tpkg})")
    assert not bad, ("imports between passes/ sub-packages that do not run downhill "
                     f"(order {PASS_LAYERS}):\n" + "\n".join(bad))


def test_every_passes_module_has_a_sub_layer() -> None:
    graph, _ = _graph()
    assert pass_layer_of("convbn.passes.graph.layers") == (0, "graph")
    assert pass_layer_of("convbn.passes.fold.api")[0] == pass_layer_of("convbn.passes.convert.api")[0]
    for m in graph:
        pass_layer_of(m)


def test_no_import_cycles() -> None:
    graph, where = _graph()
    graph = _without_allowed(graph)
    report = []
    for component in _cycles(graph):
        members = set(component)
        edges = [f"  {where[(m, t)]}: {m} -> {t}" for m in component for t in sorted(graph[m] & members)]
        report.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    assert not report, "import cycles:\n" + "\n".join(report)


def test_allow_list_only_shrinks() -> None:
    graph, _ = _graph()
    stale = [f"{m} -> {t} ({owner})" for (m, t), owner in ALLOWED.items() if t not in graph.get(m, ())]
    assert not stale, "these allowed violations are gone; delete them from ALLOWED:\n" + "\n".join(stale)


def test_functional_defines_no_autograd_function() -> None:
    """``functional/`` is pure maths: no ``torch.autograd.Function`` subclass or import."""
    bad = []
    for path in sorted((SRC / "functional").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.autograd":
                bad += [f"{path.name}:{node.lineno} imports torch.autograd.{a.name}" for a in node.names if a.name == "Function"]
            if isinstance(node, ast.ClassDef):
                for b in node.bases:
                    if ast.unparse(b).split(".")[-1] == "Function":
                        bad.append(f"{path.name}:{node.lineno} class {node.name}({ast.unparse(b)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_cycle_finder(graph: Dict[str, Set[str]], cycle: List[List[str]]) -> None:
    assert _cycles(graph) == cycle


def test_resolve_relative_imports() -> None:
    assert _resolve("convbn.nn.fused_conv_bn", False, 2, "functional.conv") == "convbn.functional.conv"
    assert _resolve("convbn.nn", True, 1, "fused_conv_bn") == "convbn.nn.fused_conv_bn"
    assert _resolve("convbn.cli", False, 1, "") == "convbn"
