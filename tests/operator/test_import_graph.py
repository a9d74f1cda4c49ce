"""The operator's modules import one another without a circle.

Every import counts, those under `if TYPE_CHECKING:` and inside functions too: a module that names
another's types depends on it as much as one that calls it, and a circle hidden behind
TYPE_CHECKING (or a function-local import) is one refactor away from an ImportError at start-up.
It also hides the design problem the circle is a sign of: two modules that are really one object.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "flashmodel_operator"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "operator" / PACKAGE


def import_graph(package_dir: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (by stem; the package itself is `__init__`)."""
    modules = {p.stem for p in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in package_dir.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package:
                        found.add(parts[1] if len(parts) > 1 else "__init__")
            elif isinstance(node, ast.ImportFrom):
                if node.level > 1:
                    continue  # above the package: not one of its modules
                if node.level == 1:
                    parts = node.module.split(".") if node.module else []
                elif node.module and node.module.split(".")[0] == package:
                    parts = node.module.split(".")[1:]
                else:
                    continue
                if parts:
                    found.add(parts[0])
                else:
                    # `from flashmodel_operator import x`: x is a module, or a name of the package's own.
                    found.add("__init__")
                    found.update(a.name for a in node.names if a.name in modules)
        graph[path.stem] = {m for m in found if m in modules and m != path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (as a path that ends where it starts) per group of modules that reach each other.

    One per group, not every circle: the groups are what must be taken apart (Tarjan's algorithm).
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle_through(graph, set(group)) for group in groups]


def _circle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to it, inside the group: what to report."""
    start = min(group)
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & group):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_the_operators_modules_import_each_other_without_a_circle() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 20, "the package's modules were not found"
    assert "reconcile" in graph["handlers"], "the parser missed an import"
    found = [" -> ".join(c) for c in cycles(graph)]
    assert not found, "import circles among the operator's modules:\n" + "\n".join(found)


def test_a_circle_behind_type_checking_or_in_a_function_is_found(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text('GROUP = "g"\n')
    (package / "watch.py").write_text(
        "from typing import TYPE_CHECKING\nfrom flashmodel_operator import GROUP\nfrom .steps import step\n"
    )
    (package / "steps.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flashmodel_operator.watch import Watch\n"
    )
    (package / "late.py").write_text("def f():\n    import flashmodel_operator.lower\n")
    (package / "lower.py").write_text("from flashmodel_operator import late\n")
    (package / "leaf.py").write_text("import json\nfrom flashmodel_operator import GROUP\n")
    graph = import_graph(package)
    assert graph["watch"] == {"__init__", "steps"}
    assert sorted(map(sorted, cycles(graph))) == [["late", "late", "lower"], ["steps", "steps", "watch"]]
