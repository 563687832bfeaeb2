"""The import graph of pipeline/, models/ and attention/ has no loop, counting imports inside functions too
(a deferred import is still a dependency: it only hides the loop until the function runs) and the packages
whose ``__init__`` an import runs first. Modules are named by
their folder (``pipeline.driver.run``); the code imports them under the installed name ``docbeam.pipeline.driver.run``,
which the scan reads back to the folder's name."""

from __future__ import annotations

import ast
import os

from conftest import REPO

PACKAGES = ("pipeline", "models", "attention", "docbeam")
INSTALLED = "docbeam."


def folder_name(module: str) -> str:
    """``docbeam.pipeline.x`` → ``pipeline.x``: the three folders install under ``docbeam`` (pyproject maps them)."""
    rest = module[len(INSTALLED) :] if module.startswith(INSTALLED) else module
    return rest if rest.split(".")[0] in PACKAGES[:3] else module


def modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for folder, _, names in sorted(os.walk(os.path.join(REPO, package))):
            dotted = os.path.relpath(folder, REPO).replace(os.sep, ".")
            for name in sorted(names):
                if name.endswith(".py"):
                    found[dotted if name == "__init__.py" else f"{dotted}.{name[:-3]}"] = os.path.join(folder, name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports anywhere in its body. ``from a import b`` counts as importing
    ``a.b`` when that is a module, else ``a``, and the packages above it that it runs (packages_run)."""
    known = modules()
    graph = {name: set() for name in known}
    imported = {name: set() for name in known}
    for name, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [folder_name(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                module = folder_name(node.module)
                targets = [
                    folder_name(f"{node.module}.{a.name}")
                    if folder_name(f"{node.module}.{a.name}") in known
                    else module
                    for a in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in known and t != name}
            imported[name] |= {t for t in targets if t in known}
    importing = {name for name, targets in graph.items() if targets}  # an __init__ that imports nothing is harmless
    for name, targets in imported.items():
        graph[name] |= {p for t in targets for p in packages_run(name, t, importing)}
    return graph


def packages_run(importer: str, target: str, importing: set[str]) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs first and that import project modules: each one
    above it that ``importer`` is not inside (a sibling's import finds its package started already). A sink
    importing ``docbeam.config.files`` runs ``docbeam/config/__init__.py``, which imports the sinks: a loop that
    left ``output`` without the sinks' sections whenever the sinks were imported first."""
    parts = target.split(".")
    outer = [".".join(parts[:i]) for i in range(1, len(parts))]
    # ``docbeam`` itself imports its public API on first use (a module ``__getattr__``), never at import
    outer = [p for p in outer if p != "docbeam" and p in importing]
    return {p for p in outer if p != importer and not importer.startswith(p + ".")}


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each loop (a depth-first search reporting every back edge)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_loop_finder_finds_a_loop():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_installed_name_reads_back_to_the_folder():
    assert [folder_name(m) for m in ("docbeam.pipeline.driver.run", "docbeam.attention", "docbeam", "numpy")] == [
        "pipeline.driver.run",
        "attention",
        "docbeam",
        "numpy",
    ]


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert "attention.registry" in graph and graph["pipeline.driver.run"]  # the scan sees the tree
    assert loops(graph) == [], "\n".join(" -> ".join(loop) for loop in loops(graph))
