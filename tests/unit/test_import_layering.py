"""The import graph of mmtrain/ and dataprep/, built from the source with ast: no cycles, and the layering of
docs/architecture.md (its Rules section mirrors LAYERS below).

Every import statement counts, at module level or inside a function: an import hidden in a function still ties
the two modules together (it only hides a cycle). Importing ``a.b.c`` also runs the packages ``a.b`` and ``a``,
so the edge goes to each of them too (except the packages the importer itself sits in, which are already
running). Third-party packages, optional or not, are not part of the graph. The lazy public-API tables
(``lazy_exports`` in the ``__init__.py`` files) name modules in strings, not imports, and load on first use.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("mmtrain", "dataprep")

# layer -> ("only", allowed layers) or ("never", forbidden layers). A module is in the most specific layer
# that names it or a package above it; imports inside its own layer are always allowed.
LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mmtrain.utils": ("only", ()),
    "mmtrain.core": ("only", ("mmtrain.utils",)),
    "dataprep": ("only", ("mmtrain.core", "mmtrain.utils")),
    "mmtrain.config": ("never", ("mmtrain.model", "mmtrain.models", "mmtrain.train", "mmtrain.convert", "dataprep")),
    "mmtrain.parallel": ("never", ("mmtrain.model", "mmtrain.train", "mmtrain.data", "mmtrain.convert",
                                   "dataprep")),
    "mmtrain.data": ("never", ("mmtrain.model", "mmtrain.train", "mmtrain.parallel", "mmtrain.convert",
                               "dataprep")),
    "mmtrain.models.spec": ("only", ()),
    "mmtrain.models.families": ("only", ()),
    "mmtrain.models.contract": ("only", ("mmtrain.models.spec", "mmtrain.models.families")),
    "mmtrain.models": ("never", ("mmtrain.train", "mmtrain.data", "mmtrain.convert", "dataprep")),
    "mmtrain.model": ("never", ("mmtrain.models", "mmtrain.train", "mmtrain.data", "mmtrain.convert", "dataprep")),
    "mmtrain.convert": ("never", ("mmtrain.train", "mmtrain.data", "dataprep")),
    "mmtrain.inference": ("never", ("mmtrain.train", "mmtrain.data", "dataprep")),
    "mmtrain.train": ("never", ("dataprep",)),
    "mmtrain.quantize": ("never", ("mmtrain.train", "dataprep")),
}

# The narrow ways through a "never" rule: (layer, forbidden layer) -> the modules of it the layer may import
# (``*`` stands for one name). The config layer reads the family table and the families' torch-free config
# sections; the shared blocks (mmtrain.model) use the contract and the sharding spec, never a family.
THROUGH: dict[tuple[str, str], tuple[str, ...]] = {
    ("mmtrain.config", "mmtrain.models"): ("mmtrain.models", "mmtrain.models.families", "mmtrain.models.*",
                                           "mmtrain.models.*.config"),
    ("mmtrain.model", "mmtrain.models"): ("mmtrain.models", "mmtrain.models.spec", "mmtrain.models.contract"),
}


def table_edges() -> dict[str, dict[str, int]]:
    """The imports the family table (mmtrain/models/families.py) makes by name: the config layer loads each
    family's ``config`` module, the registry its ``family`` module (line 0: no import statement)."""
    from mmtrain.models.families import FAMILY_PACKAGES

    return {"mmtrain.config.family_sections": {f"{p}.config": 0 for p in FAMILY_PACKAGES.values()},
            "mmtrain.models.registry": {f"{p}.family": 0 for p in FAMILY_PACKAGES.values()}}


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its ``__init__``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import}, over the packages' own modules only."""
    modules = module_files(root, packages)

    def resolve(dotted: str) -> str | None:  # the longest prefix that is one of our modules
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        running = set(_ancestors(name)) | ({name} if path.name == "__init__.py" else set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, level - 1 packages up
                    pkg = here[:len(here) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is None:
                    continue
                for t in [*_ancestors(found), found]:
                    if t != name and t not in running:
                        edges.setdefault(t, node.lineno)
    return graph


def with_table_edges(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    for module, edges in table_edges().items():
        for target in edges:
            for t in [*_ancestors(target), target]:
                if t not in _ancestors(module):
                    graph.setdefault(module, {}).setdefault(t, 0)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, {})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        components.append(set(component))
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One cycle through the first module (by name) of a strongly connected component: a, b, ..., a."""
    start = min(component)
    previous = {start: None}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in graph.get(v, {}):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w in component and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("not a strongly connected component")


def layer_of(module: str) -> str | None:
    names = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return max(names, key=len) if names else None


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _let_through(layer: str, forbidden: str, target: str) -> bool:
    """Whether THROUGH lets ``layer`` import ``target`` of the ``forbidden`` layer."""
    def named(pattern: str) -> bool:
        parts, wanted = target.split("."), pattern.split(".")
        return len(parts) == len(wanted) and all(w in ("*", p) for p, w in zip(parts, wanted))
    return any(named(ok) for ok in THROUGH.get((layer, forbidden), ()))


def layering_violations(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> list[str]:
    problems = []
    for module, edges in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            continue
        kind, layers = LAYERS[layer]
        for target, line in sorted(edges.items()):
            if _in(target, layer) or target == "mmtrain":  # the root package: only the lazy public-API table
                continue
            if kind == "only":
                bad = not any(_in(target, allowed) for allowed in layers)
                rule = f"{layer} may import only {', '.join(layers) or 'itself'}"
            else:
                bad = any(_in(target, forbidden) and not _let_through(layer, forbidden, target) for forbidden in layers)
                rule = f"{layer} never imports {', '.join(layers)}"
                through = [", ".join(ok) for (where, _), ok in THROUGH.items() if where == layer]
                rule += f" but {'; '.join(through)}" if through else ""
            if bad:
                where = files[module].relative_to(REPO) if files[module].is_relative_to(REPO) else files[module]
                problems.append(f"{where}:{line}: {module} imports {target} ({rule})")
    return problems


def test_no_import_cycles():
    cycles = find_cycles(with_table_edges(import_graph(REPO)))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_layering_in_docs_architecture():
    problems = layering_violations(with_table_edges(import_graph(REPO)), module_files(REPO))
    assert not problems, "\n".join(problems)


def test_the_root_package_imports_only_mmtrain_utils():
    """Every ``import mmtrain.x`` runs ``mmtrain/__init__.py`` first, so it may import nothing that imports back."""
    assert set(import_graph(REPO)["mmtrain"]) <= {"mmtrain.utils", "mmtrain.utils.lazy"}


def test_the_rules_in_docs_architecture_are_these_layers():
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rules = doc.split("## Rules", 1)[1].split("\n## ", 1)[0]
    for (layer, forbidden), allowed in THROUGH.items():
        line = f"`{layer}` may import of `{forbidden}` only " + ", ".join(f"`{m}`" for m in allowed)
        assert line in " ".join(rules.split()), f"docs/architecture.md Rules: no sentence {line!r}"
    for layer, (kind, layers) in LAYERS.items():
        row = next((line for line in rules.splitlines() if line.strip().startswith(f"| `{layer}` ")), None)
        assert row is not None, f"docs/architecture.md Rules: no table row for `{layer}`"
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert cells[1] == kind and cells[2] == (", ".join(f"`{x}`" for x in layers) or "-"), \
            f"docs/architecture.md Rules: the row of `{layer}` says {cells[1:]}, the test has {kind} {layers}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_reports_a_cycle_hidden_in_a_function(tmp_path):
    _write(tmp_path, {
        "mmtrain/__init__.py": "",
        "mmtrain/data/__init__.py": "",
        "mmtrain/data/a.py": "from mmtrain.data.b import f\n",
        "mmtrain/data/b.py": "def f():\n    from mmtrain.data import a  # hides the cycle\n    return a\n",
        "mmtrain/data/c.py": "import numpy\nfrom mmtrain.data import a\n",
    })
    cycles = find_cycles(import_graph(tmp_path, ("mmtrain",)))
    assert cycles == [["mmtrain.data.a", "mmtrain.data.b", "mmtrain.data.a"]]


def test_the_checker_reports_an_import_across_the_layers(tmp_path):
    _write(tmp_path, {
        "mmtrain/__init__.py": "",
        "mmtrain/core/__init__.py": "",
        "mmtrain/core/x.py": "from mmtrain.utils.log import get_logger\nfrom .y import z\n",
        "mmtrain/core/y.py": "def z():\n    import mmtrain.data.blend\n",
        "mmtrain/data/__init__.py": "",
        "mmtrain/data/blend.py": "import dataprep.text\n",
        "mmtrain/utils/__init__.py": "",
        "mmtrain/utils/log.py": "",
        "dataprep/__init__.py": "",
        "dataprep/text.py": "from mmtrain.core import x\n",
    })
    graph = import_graph(tmp_path)
    assert graph["mmtrain.core.x"] == {"mmtrain.utils": 1, "mmtrain.utils.log": 1, "mmtrain.core.y": 2}
    problems = [p.split(": ", 1)[1] for p in layering_violations(graph, module_files(tmp_path))]
    assert problems == [
        "mmtrain.core.y imports mmtrain.data (mmtrain.core may import only mmtrain.utils)",
        "mmtrain.core.y imports mmtrain.data.blend (mmtrain.core may import only mmtrain.utils)",
        "mmtrain.data.blend imports dataprep (mmtrain.data never imports mmtrain.model, mmtrain.train, "
        "mmtrain.parallel, mmtrain.convert, dataprep)",
        "mmtrain.data.blend imports dataprep.text (mmtrain.data never imports mmtrain.model, mmtrain.train, "
        "mmtrain.parallel, mmtrain.convert, dataprep)",
    ]


def test_every_import_of_our_own_modules_names_a_module_that_exists():
    """A module moved or renamed without updating an importer (a lazy import inside a function included) is
    caught here, not at the first run that reaches it."""
    modules = module_files(REPO)
    missing = []
    users = [*modules.values(), *(p for d in ("tests", "bench", "examples") for p in sorted((REPO / d).rglob("*.py")))]
    for path in users:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                wanted = [node.module]
            else:
                continue
            for target in wanted:
                if target.split(".")[0] in PACKAGES and target not in modules:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {target}, which does not exist")
    assert not missing, "\n".join(missing)
