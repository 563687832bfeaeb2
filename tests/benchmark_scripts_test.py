"""The benchmark scripts share one bootstrap (benchmarks/bootstrap.py) and lean on nothing in tests/."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
# Run on the lent device machine against the docbeam its wheels installed, never this checkout: no bootstrap.
STANDALONE = ("device_attention.py", "device_check.py", "device_encoder.py")


def parsed(name: str) -> ast.Module:
    with open(os.path.join(BENCH, name)) as f:
        return ast.parse(f.read())


def scripts() -> list[str]:
    return sorted(
        n
        for n in os.listdir(BENCH)
        if n.endswith(".py") and n not in STANDALONE and n != "bootstrap.py" and "__main__" in ast.unparse(parsed(n))
    )


def imported(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def problems(name: str, tree: ast.Module, script: bool) -> list[str]:
    """What breaks the rule in one file: touching sys.path, an import from tests/, and (for a script) a
    module-level import of the repository's code before ``import bootstrap``."""
    touches_path = any(
        isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"
        for n in ast.walk(tree)
    )
    found = [f"{name}: touches sys.path"] if touches_path else []
    found += [f"{name}: imports {m}" for m in imported(tree) if m.split(".")[0] == "tests"]
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    first_own = next((i for i, n in enumerate(top) if imported(n)[0].split(".")[0] in ("benchmarks", "docbeam")), None)
    boot = next((i for i, n in enumerate(top) if imported(n) == ["bootstrap"]), None)
    if script and first_own is not None and (boot is None or boot > first_own):
        found.append(f"{name}: imports the repository's code before (or without) `import bootstrap`")
    return found


def test_every_script_starts_with_the_one_bootstrap_and_none_imports_from_tests():
    names = [n for n in os.listdir(BENCH) if n.endswith(".py") and n not in ("bootstrap.py", "__init__.py")]
    found = [p for n in sorted(names) for p in problems(n, parsed(n), n in scripts())]
    assert found == [], found
    assert len(scripts()) >= 20


def test_the_rule_sees_a_script_of_its_own_path_and_an_import_from_tests():
    own_path = ast.parse(
        "import os, sys\nsys.path.insert(0, os.getcwd())\nfrom benchmarks import common\nfrom tests.conftest import x\n"
    )
    assert problems("x.py", own_path, script=True) == [
        "x.py: touches sys.path",
        "x.py: imports tests.conftest",
        "x.py: imports the repository's code before (or without) `import bootstrap`",
    ]
    assert problems("y.py", ast.parse("import sys\nimport bootstrap\nfrom benchmarks import common\n"), True) == []
    assert problems("z.py", ast.parse("from benchmarks import common\n"), script=False) == []  # a library module


def test_a_script_runs_from_any_folder_without_pythonpath_and_a_plain_import_changes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = subprocess.run(
        [sys.executable, os.path.join(BENCH, "run_all.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert script.returncode == 0 and "usage: run_all.py" in script.stdout, script.stderr

    code = (
        "import os, sys\n"
        "sys.path.append(sys.argv[1])\n"
        "before = list(sys.path)\n"
        "import bootstrap\n"
        "assert sys.path == before, sys.path\n"
        "print(type(sys.stdout).__name__, os.environ.get('HF_HUB_OFFLINE'))\n"
    )
    env.pop("HF_HUB_OFFLINE", None)
    plain = subprocess.run(
        [sys.executable, "-c", code, BENCH], capture_output=True, text=True, cwd=tmp_path, env=env, check=True
    )
    assert plain.stdout.split() == ["TextIOWrapper", "None"]  # not a benchmark's process: left as it was
