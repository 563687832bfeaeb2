"""docbeam installs under one import name: the wheel holds ``docbeam/…`` and nothing at the top level that could
shadow a user's own ``pipeline``, ``models`` or ``attention`` module on a worker."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile

import pytest
from conftest import REPO

FOLDERS = ("pipeline", "models", "attention")


def setuptools_section() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def subpackages() -> set[str]:
    found = set()
    for top in ("docbeam", *FOLDERS):
        for folder, _, names in os.walk(os.path.join(REPO, top)):
            if "__init__.py" in names:
                dotted = os.path.relpath(folder, REPO).replace(os.sep, ".")
                found.add(dotted if top == "docbeam" else f"docbeam.{dotted}")
    return found


def test_pyproject_lists_every_subpackage_of_docbeam_and_the_three_folders():
    assert set(setuptools_section()["packages"]) == subpackages()


def test_the_folders_map_under_docbeam():
    assert setuptools_section()["package-dir"] == {"docbeam": "docbeam", **{f"docbeam.{f}": f for f in FOLDERS}}


@pytest.mark.slow
def test_the_wheel_holds_only_docbeam_at_the_top(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            REPO,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = [name for name in os.listdir(tmp_path) if name.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        modules = set(z.namelist())
    assert {t for t in tops if not t.endswith(".dist-info")} == {"docbeam"}
    assert {
        "docbeam/__init__.py",
        "docbeam/pipeline/driver/cli.py",
        "docbeam/models/families/__init__.py",
        "docbeam/attention/registry.py",
    } <= modules
    sources = {
        os.path.relpath(os.path.join(folder, n), REPO)
        for top in ("docbeam", *FOLDERS)
        for folder, _, names in os.walk(os.path.join(REPO, top))
        for n in names
        if n.endswith(".py")
    }
    in_wheel = {s if s.startswith("docbeam/") else f"docbeam/{s}" for s in sources}
    assert in_wheel <= modules, "a module of the tree is missing from the wheel"


def test_a_checkout_imports_only_the_three_folders_under_docbeam(tmp_path):
    probe = (
        "import docbeam, docbeam.pipeline.records, docbeam.models.heads, docbeam.attention.registry\n"
        "print(docbeam.__path__, docbeam.pipeline.records.__file__)\n"
        "try:\n    import docbeam.benchmarks\nexcept ImportError:\n    print('no docbeam.benchmarks')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == [
        f"{[os.path.join(REPO, 'docbeam')]} {os.path.join(REPO, 'pipeline', 'records.py')}",
        "no docbeam.benchmarks",
    ]
