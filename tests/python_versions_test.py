"""docbeam installs on Python 3.11, 3.12 and 3.13: the metadata admits exactly those, and every exact pin of
pyproject.toml (the extras' too) resolves to wheels for 3.12 and 3.13, which these machines can only ask the
registry about (``pip install --dry-run --python-version``), not install."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import REPO

PYTHONS = ("3.11", "3.12", "3.13")
# apache-beam[gcp] 2.77 pins google-apitools below 0.5.32, and 0.5.31 is published as a source archive only:
# pip builds it into a wheel at install time on any Python, so the resolution gets that wheel built here first.
SOURCE_ONLY = ("google-apitools==0.5.31",)


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def exact_pins() -> dict[str, str]:
    """Every ``name==version`` of the dependencies and the extras, by normalised name."""
    found = {}
    for line in project()["dependencies"] + [r for extra in project()["optional-dependencies"].values() for r in extra]:
        requirement = Requirement(line)
        [spec] = requirement.specifier
        assert spec.operator == "==", f"pyproject.toml: {line!r} is not an exact pin; pin it with =="
        found[requirement.name.lower().replace("_", "-")] = spec.version
    return found


def test_the_metadata_admits_python_3_11_to_3_13_and_nothing_else():
    admitted = SpecifierSet(project()["requires-python"])
    assert [v for v in ("3.10", *PYTHONS, "3.14") if admitted.contains(f"{v}.0")] == list(PYTHONS)


def test_the_classifiers_name_each_admitted_python():
    versions = [c.rsplit(" :: ", 1)[1] for c in project()["classifiers"] if "." in c.rsplit(" :: ", 1)[1]]
    assert versions == list(PYTHONS)


def wheel_tags_fit(filename: str, python: str) -> bool:
    """Whether a wheel's file name says it runs on CPython ``python`` (its own cpXY, the stable ABI from an
    earlier one, or pure Python)."""
    python_tag, abi_tag = filename[:-len(".whl")].split("-")[-3:-1]
    minor = int(python.split(".")[1])
    tags = python_tag.split(".")
    return f"cp3{minor}" in tags or "py3" in tags or (
        abi_tag == "abi3" and any(t.startswith("cp3") and int(t[3:]) <= minor for t in tags))


def test_the_tag_check_tells_a_wheel_for_another_python():
    assert wheel_tags_fit("jaxlib-0.10.2-cp313-cp313-manylinux_2_27_x86_64.whl", "3.13")
    assert wheel_tags_fit("cryptography-47.0.0-cp311-abi3-manylinux_2_34_x86_64.whl", "3.13")
    assert wheel_tags_fit("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.whl", "3.13")
    assert wheel_tags_fit("jax-0.10.2-py3-none-any.whl", "3.12")
    assert not wheel_tags_fit("jaxlib-0.10.2-cp311-cp311-manylinux_2_27_x86_64.whl", "3.12")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> str:
    """docbeam's own wheel and the source-only pins built into wheels, in one folder pip is pointed at."""
    folder = str(tmp_path_factory.mktemp("wheels"))
    for what in (REPO, *SOURCE_ONLY):
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                                "--wheel-dir", folder, what], capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.full  # the registry's metadata for ~170 packages per Python, about 15 s each: `make test-all`
@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_every_pin_resolves_to_wheels_for(python, wheels, tmp_path):
    [ours] = [name for name in os.listdir(wheels) if name.startswith("docbeam-")]
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                             "--only-binary=:all:", "--python-version", python, "--find-links", wheels, "--quiet",
                             "--report", str(report), f"{os.path.join(wheels, ours)}[test,pgvector]"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    install = json.loads(report.read_text())["install"]
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in install}
    assert {name: resolved.get(name) for name in exact_pins()} == exact_pins()
    files = [i["download_info"]["url"].rsplit("/", 1)[-1] for i in install]
    assert [f for f in files if not wheel_tags_fit(f, python)] == []
