"""The house's layers, held: every ``import`` and ``from ... import`` in ``automodel/`` (at module
level and inside functions) goes down the floors below, or sideways within a floor without
closing a circle; nothing imports an entry point. docs/architecture.md draws the same floors
(``test_the_architecture_page_draws_these_floors``)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A module belongs to the floor of its longest listed prefix (``automodel``: the
# package's own ``__init__`` only); a module of no floor fails the test (a new room is placed
# here, and on the architecture page).
FLOORS = [
    ("entry points", ["automodel.cli", "automodel.api", "automodel.plan_cli",
                      "automodel.sweep_report"]),
    ("before a run", ["automodel.prepare"]),
    ("launching", ["automodel.launch"]),
    ("checks before launch", ["automodel.checks"]),
    ("planning", ["automodel.planning"]),
    ("training", ["automodel.recipes", "automodel.parallelize"]),
    ("libraries", ["automodel.distributed", "automodel.models", "automodel.data",
                   "automodel.checkpoint", "automodel.peft", "automodel.tracking",
                   "automodel.costing", "automodel.optim", "automodel.loss", "automodel.faults",
                   "automodel.config"]),
    ("base", ["automodel.compat", "automodel.runtime", "automodel.errors", "automodel.registry",
              "automodel.imports", "automodel.startup", "automodel.user_cache", "automodel"]),
]
ENTRY = 0


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in root.glob("automodel/**/*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _target(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _resolved(node, module: str, mods: dict) -> set[str]:
    if isinstance(node, ast.Import):
        return {_target(a.name, mods) for a in node.names} - {None}
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts if mods[module].name == "__init__.py" else parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _target(base, mods)
            for a in node.names} - {None}


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """{module: {imported automodel module: line}}, every import statement counted."""
    mods, graph = modules(root), {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolved(node, name, mods):
                    if target.startswith("automodel") and target != name:
                        edges.setdefault(target, node.lineno)
    return graph


def floor_of(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            inside = module == p or (p != "automodel" and module.startswith(p + "."))
            if inside and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else best[0]


def circles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(graph[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer_problems(graph: dict) -> list[str]:
    problems = [f"{m}: on no floor (place its room in FLOORS and docs/architecture.md)"
                for m in graph if floor_of(m) is None]
    for m, edges in sorted(graph.items()):
        for t, line in sorted(edges.items()):
            fm, ft = floor_of(m), floor_of(t)
            if None in (fm, ft):
                continue
            if ft == ENTRY or ft < fm:
                problems.append(f"{m}:{line} imports {t}: {FLOORS[fm][0]} may not import "
                                f"{'an entry point' if ft == ENTRY else FLOORS[ft][0]}")
    return problems + [f"circle: {' -> '.join(c)}" for c in circles(graph)]


def test_imports_run_down_the_floors_without_a_circle():
    problems = layer_problems(import_graph(ROOT))
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_upward_import_a_circle_and_a_module_of_no_floor(tmp_path):
    pkg = tmp_path / "automodel"
    for d in ("planning", "launch", "config", "compat", "rooms"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "planning" / "search.py").write_text(
        "def f():\n    from automodel.launch import local\n")  # (inside a function)
    (pkg / "launch" / "local.py").write_text("from ..planning import search\n")
    (pkg / "config" / "a.py").write_text("from automodel.config import b\n")
    (pkg / "config" / "b.py").write_text("import automodel.config.a\n")
    (pkg / "rooms" / "new.py").write_text("import automodel.cli\n")
    (pkg / "compat" / "core.py").write_text("from automodel.config.a import x\n")
    (pkg / "cli.py").write_text("")
    found = layer_problems(import_graph(tmp_path))
    assert sorted(found) == sorted([
        "automodel.rooms: on no floor (place its room in FLOORS and docs/architecture.md)",
        "automodel.rooms.new: on no floor (place its room in FLOORS and docs/architecture.md)",
        "automodel.planning.search:2 imports automodel.launch.local: planning may not import "
        "launching",
        "automodel.compat.core:1 imports automodel.config.a: base may not import libraries",
        "circle: automodel.config.a -> automodel.config.b",
        "circle: automodel.launch.local -> automodel.planning.search",
    ]), found


def test_the_architecture_page_draws_these_floors():
    """docs/architecture.md's table of floors, in this order, each naming its rooms."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and " | `" in line]
    drawn = [(row.split("|")[1].strip(), row.split("|")[2]) for row in rows]
    assert [name for name, _ in drawn] == [name for name, _ in FLOORS]
    for (name, rooms), (_, prefixes) in zip(drawn, FLOORS):
        for p in prefixes:
            assert f"`{p}`" in rooms, f"docs/architecture.md: floor {name!r} lacks `{p}`"
