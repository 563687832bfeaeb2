"""The house rules a newcomer relies on: every module short enough to read whole, and the rooms of pipeline/
leaning on each other in one direction only, so the folder listing tells where a change belongs."""

from __future__ import annotations

import ast
import os

import pytest
from conftest import REPO
from import_graph_test import import_graph

# In ruff's layout (a call that does not fit takes a line per argument): what was 300 and 120 lines in the denser
# hand layout before the formatter, so a module still reads whole; a file is split where its concepts part, not
# to meet this number.
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 160
CODE_FOLDERS = ("docbeam", "pipeline", "models", "attention", "benchmarks", "data", "docker", "tests")

# Who may import whom, room by room (``pipeline.<room>``, a top-level package, or a ground-floor room of docbeam/).
# A room not listed as allowed is forbidden, and none has an exception: the ground floor (``docbeam.errors``, the one
# base class of a refusal; ``docbeam.config``, the typed config and what validates it) is what every floor above
# may read; models/ and attention/ import nothing from pipeline/; the stages never reach into the driver; nothing
# below the driver reaches into the tools.
ALLOWED = {
    "docbeam": {
        "docbeam.errors",
        "docbeam.config",
        "attention",
        "models",
        "pipeline.records",
        "pipeline.compat",
        "pipeline.store",
        "pipeline.telemetry",
        "pipeline.stages",
        "pipeline.sinks",
        "pipeline.driver",
        "pipeline.tools",
    },  # the public API, on top
    "docbeam.errors": set(),
    # output's fields are the registered sinks' sections (docbeam/config/input_output.py asks pipeline/sinks/ for them);
    # model.head is checked against the heads' registry (models/heads/registry.py)
    "docbeam.config": {"docbeam.errors", "attention", "models", "pipeline.store", "pipeline.sinks"},
    "attention": {"docbeam.errors"},
    "models": {"attention", "docbeam.errors"},
    "pipeline.records": set(),
    "pipeline.compat": set(),
    "pipeline.store": {"docbeam.errors", "pipeline.records"},
    "pipeline.telemetry": {"docbeam.errors", "pipeline.records", "pipeline.store"},
    "pipeline.stages": {
        "docbeam.errors",
        "docbeam.config",
        "attention",
        "models",
        "pipeline.records",
        "pipeline.compat",
        "pipeline.store",
        "pipeline.telemetry",
    },
    # A sink whole (its section, checks, writer, loader, command): read by the config for its section, so it
    # imports neither the stages nor the driver; its checks raise the config's errors.
    "pipeline.sinks": {"docbeam.errors", "docbeam.config", "models", "pipeline.store"},
    "pipeline.driver": {
        "docbeam.errors",
        "docbeam.config",
        "attention",
        "models",
        "pipeline.records",
        "pipeline.compat",
        "pipeline.store",
        "pipeline.telemetry",
        "pipeline.stages",
        "pipeline.sinks",
    },
    "pipeline.tools": {
        "docbeam.errors",
        "docbeam.config",
        "attention",
        "models",
        "pipeline.records",
        "pipeline.store",
        "pipeline.telemetry",
        "pipeline.stages",
        "pipeline.sinks",
        "pipeline.driver",
    },
}
# The ground floor's modules, in docbeam/ beside the public API: the foundation every floor above reads.
GROUND_FLOOR = {
    "docbeam.errors": "docbeam.errors",
    "docbeam.config": "docbeam.config",
    "docbeam.config.input_output": "docbeam.config",
    "docbeam.config.files": "docbeam.config",
    "docbeam.placeholders": "docbeam.config",
    "docbeam.selection": "docbeam.config",
}
COMMAND_LINE = "pipeline.driver.cli"  # the one driver module that dispatches to the tools' commands


def room(module: str) -> str:
    if module in GROUND_FLOOR:
        return GROUND_FLOOR[module]
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 1 else parts[0]


def python_files():
    for top in CODE_FOLDERS:
        for folder, _, names in sorted(os.walk(os.path.join(REPO, top))):
            yield from (os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))


def too_long(path: str) -> list[str]:
    with open(path) as f:
        text = f.read()
    name, lines = os.path.relpath(path, REPO), len(text.splitlines())
    found = [f"{name}: {lines} lines"] if lines > MAX_MODULE_LINES else []
    return found + [
        f"{name}: class {node.name} {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]


def test_every_module_and_class_is_short_enough_to_read_whole():
    found = [problem for path in python_files() for problem in too_long(path)]
    assert found == [], (
        f"split by what each holds (at most {MAX_MODULE_LINES} lines a module, {MAX_CLASS_LINES} a class): {found}"
    )


def test_the_size_rule_sees_a_long_module_and_a_long_class(tmp_path):
    path = tmp_path / "long.py"
    path.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n" * (MAX_MODULE_LINES - MAX_CLASS_LINES))
    assert [p.split(": ", 1)[1] for p in too_long(str(path))] == [
        f"{MAX_MODULE_LINES + 1} lines",
        f"class Big {MAX_CLASS_LINES + 1} lines",
    ]


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import that crosses into a room ``a``'s room may not use."""
    bad = []
    for module, targets in graph.items():
        mine = room(module)
        allowed = ALLOWED.get(mine)
        if allowed is None:
            continue
        if module == COMMAND_LINE:
            allowed = allowed | {"pipeline.tools"}
        for target in targets:
            theirs = room(target)
            if theirs != mine and theirs not in allowed and target not in allowed:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def test_every_room_of_the_project_is_known_to_the_layering_rule():
    assert {room(m) for m in import_graph()} - {"pipeline"} <= set(ALLOWED)


def test_the_rooms_lean_on_each_other_in_one_direction():
    assert crossings(import_graph()) == []


@pytest.mark.parametrize(
    "module, target",
    [
        ("pipeline.stages.encode", "pipeline.driver.plan"),
        ("pipeline.store.lock", "pipeline.stages.commit"),
        ("models.runtime", "pipeline.telemetry.observe"),
        ("attention.registry", "pipeline.records"),
        ("docbeam.errors", "docbeam.config"),
        ("docbeam.config", "pipeline.driver.plan"),
        ("pipeline.driver.run", "pipeline.tools.report"),
    ],
)
def test_the_layering_rule_refuses_an_import_against_the_grain(module, target):
    assert crossings({module: {target}}) == [f"{module} -> {target}"]
