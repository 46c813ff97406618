"""The import graph of moembed: no circles, no upward edges, no edges between sibling packages (docs/architecture.md).

Every `import` and `from ... import` in every module counts, at module level or inside a function: an import
deferred into a function is still a dependency, so laziness cannot hide a circle or an upward edge.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moembed"

# (layer, group, modules or packages). A module may import from its own group and from lower layers only.
LAYERS: list[tuple[int, str, tuple[str, ...]]] = [
    (0, "core", ("moembed.errors", "moembed.fileio", "moembed.distributed", "moembed.devices", "moembed.version",
                 "moembed.progress", "moembed.figures", "moembed.heap", "moembed.inputs")),
    (1, "model", ("moembed.model",)),
    (2, "losses", ("moembed.losses",)),
    (2, "data", ("moembed.data",)),
    (3, "train", ("moembed.train",)),
    (3, "eval", ("moembed.eval",)),
    (3, "moee", ("moembed.moee",)),
    (3, "serve", ("moembed.serve",)),
    (4, "recipes", ("moembed.recipes",)),
    (5, "cli", ("moembed.cli",)),
    (5, "api", ("moembed",)),  # the package root: `from moembed import Embedder`
]
# Sibling edges that are allowed: periodic evaluation during training.
SIBLING_EDGES = {("train", "eval")}


# ---- the graph ----------------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module that `name` starts with (an attribute import names its module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Every moembed module `module` imports, anywhere in its body."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                pkg = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            # `from a import b` names the module a.b when there is one, else an attribute of a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            hit = _resolve(t, modules)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: modules it imports} for every module of the package at `root`."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {m: imports_of(ast.parse(p.read_text(encoding="utf-8"), str(p)), m, p.name == "__init__.py", modules)
            for m, p in files.items()}


# ---- the checks ---------------------------------------------------------------------------------------------------


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not: strongly connected components of more
    than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def path_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest closed path a → ... → a inside a strongly connected component, from its first module."""
    inside, start = set(component), component[0]
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return component


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer, group) of the most specific entry of `layers` that holds `module`."""
    best = None
    for layer, group, names in layers:
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[0]):
                best = (len(n), layer, group)
    return None if best is None else (best[1], best[2])


def violations(graph: dict[str, set[str]], layers=LAYERS, siblings=SIBLING_EDGES) -> list[str]:
    """Edges that go up a layer or across sibling packages, and modules in no layer."""
    out = []
    for a in sorted(graph):
        la = layer_of(a, layers)
        if la is None:
            out.append(f"{a}: in no layer (add it to LAYERS here and to docs/architecture.md)")
            continue
        for b in sorted(graph[a]):
            lb = layer_of(b, layers)
            if lb is None or la[1] == lb[1] or lb[0] < la[0] or (la[1], lb[1]) in siblings:
                continue
            how = "a higher layer" if lb[0] > la[0] else "a sibling package"
            out.append(f"{a} → {b}: {la[1]} (layer {la[0]}) imports {lb[1]} (layer {lb[0]}), {how}")
    return out


def _fmt(components: Iterable[list[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"{', '.join(c)}; e.g. " + " → ".join(path_through(c, graph)) for c in components)


# ---- tests --------------------------------------------------------------------------------------------------------


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles (groups of modules that import each other):\n" + _fmt(found, graph)


def test_no_upward_or_sibling_imports():
    found = violations(import_graph())
    assert not found, "imports against the layering (docs/architecture.md):\n" + "\n".join(found)


def test_every_package_has_a_layer():
    for p in PACKAGE.iterdir():
        if p.is_dir() and (p / "__init__.py").exists() or p.suffix == ".py" and p.stem != "__init__":
            assert layer_of(f"moembed.{p.stem}") is not None, p


def test_the_checker_finds_a_cycle_an_upward_edge_and_a_sibling_edge(tmp_path):
    """The checks can fail: a synthetic package with a circle, a lazy upward import and a sibling import."""
    root = tmp_path / "moembed"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "model/__init__.py": "",
        "model/a.py": "from moembed.model.b import f\n",
        "model/b.py": "def f():\n    from moembed.model import a  # lazy: still an edge\n",
        "model/c.py": "def g():\n    from moembed.train.loop import run\n",
        "data/__init__.py": "",
        "data/x.py": "import moembed.losses.y\n",
        "losses/__init__.py": "",
        "losses/y.py": "from ..errors import E\n",
        "train/__init__.py": "",
        "train/loop.py": "from moembed.eval import score\nrun = 1\n",
        "eval/__init__.py": "score = 1\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph["moembed.losses.y"] == {"moembed.errors"}  # relative imports resolve
    assert cycles(graph) == [["moembed.model.a", "moembed.model.b"]]
    assert path_through(cycles(graph)[0], graph) == ["moembed.model.a", "moembed.model.b", "moembed.model.a"]
    found = violations(graph)
    assert found == [
        "moembed.data.x → moembed.losses.y: data (layer 2) imports losses (layer 2), a sibling package",
        "moembed.model.c → moembed.train.loop: model (layer 1) imports train (layer 3), a higher layer",
    ]  # train → eval is the one allowed sibling edge
    assert violations({"moembed.nowhere": set()}, layers=[(0, "core", ("moembed.errors",))]) == [
        "moembed.nowhere: in no layer (add it to LAYERS here and to docs/architecture.md)"
    ]
