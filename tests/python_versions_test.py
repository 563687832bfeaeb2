"""docbeam installs on Python 3.11, 3.12 and 3.13: the metadata admits exactly those, each dependency is pinned
exactly once per Python (3.11 keeps the last jax for it, 3.12 and 3.13 take the lent GPU image's), and every pin
of pyproject.toml (the extras' too) resolves to wheels for 3.12 and 3.13, which these machines can only ask the
registry about (``pip install --dry-run --python-version``), not install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PYTHONS = ("3.11", "3.12", "3.13")
# apache-beam[gcp] 2.78 pins google-apitools below 0.5.32 on Python 3.11 and 3.12 (3.13: 0.5.35 or later), and
# 0.5.31 is published as a source archive only: pip builds it into a wheel at install time, so the resolution
# gets that wheel built here first.
SOURCE_ONLY = ("google-apitools==0.5.31",)


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def requirements(python: str) -> list[Requirement]:
    """The dependencies and the extras that hold on ``python`` (their environment markers evaluated for it)."""
    lines = project()["dependencies"] + [r for extra in project()["optional-dependencies"].values() for r in extra]
    found = [Requirement(line) for line in lines]
    return [
        r
        for r in found
        if r.marker is None or r.marker.evaluate({"python_version": python, "python_full_version": f"{python}.0"})
    ]


def exact_pins(python: str = "3.11") -> dict[str, str]:
    """Every ``name==version`` that holds on ``python``, by normalised name (an extra may repeat a pin)."""
    found = {}
    for requirement in requirements(python):
        [spec] = requirement.specifier
        assert spec.operator == "==", f"pyproject.toml: {requirement} is not an exact pin; pin it with =="
        name = requirement.name.lower().replace("_", "-")
        assert found.get(name, spec.version) == spec.version, (
            f"pyproject.toml: {name} is pinned to {found[name]} and {spec.version} for Python {python}; keep one"
        )
        found[name] = spec.version
    return found


@pytest.mark.parametrize("python", PYTHONS)
def test_each_dependency_is_pinned_exactly_once_on(python):
    assert set(exact_pins(python)) == set(exact_pins("3.11"))


def test_3_12_and_later_take_the_jax_of_the_lent_gpu_image_and_3_11_the_last_jax_for_it():
    assert [exact_pins(p)["jax"] for p in PYTHONS] == ["0.10.2", "0.11.2", "0.11.2"]
    assert [exact_pins(p)["jaxlib"] for p in PYTHONS] == [exact_pins(p)["jax"] for p in PYTHONS]


def test_the_metadata_admits_python_3_11_to_3_13_and_nothing_else():
    admitted = SpecifierSet(project()["requires-python"])
    assert [v for v in ("3.10", *PYTHONS, "3.14") if admitted.contains(f"{v}.0")] == list(PYTHONS)


def test_the_classifiers_name_each_admitted_python():
    versions = [c.rsplit(" :: ", 1)[1] for c in project()["classifiers"] if "." in c.rsplit(" :: ", 1)[1]]
    assert versions == list(PYTHONS)


def wheel_tags_fit(filename: str, python: str) -> bool:
    """Whether a wheel's file name says it runs on CPython ``python`` (its own cpXY, the stable ABI from an
    earlier one, or pure Python)."""
    python_tag, abi_tag = filename[: -len(".whl")].split("-")[-3:-1]
    minor = int(python.split(".")[1])
    tags = python_tag.split(".")
    return (
        f"cp3{minor}" in tags
        or "py3" in tags
        or (abi_tag == "abi3" and any(t.startswith("cp3") and int(t[3:]) <= minor for t in tags))
    )


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
                folder,
                what,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert built.returncode == 0, built.stderr[-3000:]
    return folder


def pip_dry_run(python: str, wheels: str, report, *requirements: str, no_deps: bool = False):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--find-links",
            wheels,
            "--quiet",
            "--report",
            str(report),
            *(["--no-deps"] if no_deps else []),
            *requirements,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.full  # the registry's metadata for ~170 packages per Python, about 15 s each: `make test-all`
@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_every_pin_resolves_to_wheels_for(python, wheels, tmp_path):
    """pip evaluates environment markers for the Python running it, whatever --python-version says, so from 3.11
    it would resolve 3.11's pins: the wheel's own Requires-Python is checked alone, and the pins that hold on
    ``python`` are handed to pip with their markers already evaluated. (A dependency's own markers are still
    read as 3.11's.)"""
    [ours] = [name for name in os.listdir(wheels) if name.startswith("docbeam-")]
    admitted = pip_dry_run(python, wheels, tmp_path / "ours.json", os.path.join(wheels, ours), no_deps=True)
    assert admitted.returncode == 0, admitted.stderr[-4000:]
    report = tmp_path / "report.json"
    result = pip_dry_run(
        python,
        wheels,
        report,
        *(
            f"{r.name}{r.specifier}" if not r.extras else f"{r.name}[{','.join(sorted(r.extras))}]{r.specifier}"
            for r in requirements(python)
        ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    install = json.loads(report.read_text())["install"]
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in install}
    assert {name: resolved.get(name) for name in exact_pins(python)} == exact_pins(python)
    files = [i["download_info"]["url"].rsplit("/", 1)[-1] for i in install]
    assert [f for f in files if not wheel_tags_fit(f, python)] == []
