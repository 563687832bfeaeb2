"""The device check (benchmarks/device_check.sh) works on the lent GPU machine as it stands: its arithmetic, its
carried wheels, and a rehearsal here that installs only those wheels, with pip's network off, into a fresh venv
of what that machine's image has, then runs the same script with small sizes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from packaging.requirements import Requirement

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import device_check  # noqa: E402
import device_encoder  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "device_check.sh")


def pins(path: str) -> dict[str, str]:
    with open(path) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return {(r := Requirement(line)).name.lower(): str(r.specifier)[2:] for line in lines if line}


def test_the_carried_tokamax_and_pydantic_are_docbeams_pins():
    from python_versions_test import exact_pins

    carried = pins(os.path.join(REPO, "benchmarks", "device_wheels.txt"))
    assert {name: carried[name] for name in ("tokamax", "pydantic")} == {
        name: exact_pins()[name] for name in ("tokamax", "pydantic")
    }
    assert "apache-beam" not in carried
    assert pins(os.path.join(REPO, "benchmarks", "device_wheels_py312.txt")) == {"flax": exact_pins("3.12")["flax"]}


def test_flops_per_token_of_a_bert_layer_counts_projections_mlp_and_both_attention_products():
    config = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1}
    assert device_encoder.flops_per_token(config, length=10) == 2 * (4 * 16 + 2 * 4 * 8 + 2 * 4 * 10)


def test_flops_per_token_of_modernbert_counts_the_gated_mlp_and_only_the_window_on_local_layers():
    config = {
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 3,
        "local_attention": 4,
        "global_attn_every_n_layers": 3,
    }
    per_layer = 4 * 16 + 3 * 4 * 8
    assert device_encoder.flops_per_token(config, length=100) == 2 * (3 * per_layer + 2 * 4 * (100 + 5 + 5))


def test_a_row_fails_on_its_own_error_or_a_sides_and_not_on_a_refusal():
    rows = [
        {"variant": "flash/cudnn", "refused": "cudnn runs on NVIDIA GPUs, not cpu"},
        {"variant": "native", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED"},
        {"shape": "minilm", "docbeam": {"tokens_per_s": 1.0}, "sentence_transformers": {"error": "OSError: x"}},
    ]
    assert device_check.errors(rows) == rows[1:]


# Run in a child: apache_beam made unimportable, then every module of the two packages imported,
# their subpackages' too (attention/flash/, models/families/, ...).
WITHOUT_BEAM = """
import importlib, pkgutil, sys

class NoBeam:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "apache_beam":
            raise ImportError("apache_beam is not installed on the lent GPU machine")

sys.meta_path.insert(0, NoBeam())
for package in ("docbeam.attention", "docbeam.models"):
    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.startswith("docbeam.")))
"""


def test_every_module_of_the_encoder_and_attention_packages_imports_without_beam():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_BEAM],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'docbeam.models.runtime'" in result.stdout and "'docbeam.attention.flash.tokamax'" in result.stdout


def test_the_beam_blocker_blocks_beam():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_BEAM.split("for package")[0] + "import apache_beam"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "apache_beam is not installed on the lent GPU machine" in result.stderr


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """A fresh Python 3.11 venv of what the lent machine's image has (benchmarks/device_image.txt)."""
    venv = tmp_path_factory.mktemp("image") / "venv"
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "-r", os.path.join(REPO, "benchmarks", "device_image.txt")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    return python


@pytest.mark.slow
@pytest.mark.full  # ~5 minutes of installs for the image's venv, then ~2 of CPU: `make test-all`
def test_the_rehearsal_installs_only_the_carried_wheels_offline_and_runs_every_row(image, tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    built = subprocess.run(
        ["bash", SCRIPT, "wheels", str(wheels)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert any(
        name.endswith("-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl") and "pydantic_core" in name
        for name in os.listdir(wheels)
    ), "the lease's Python 3.12 wheels were not downloaded"
    # pip's network and this machine's own wheel folders off: the carried folder alone must do.
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    ran = subprocess.run(
        ["bash", SCRIPT, "run", str(wheels), "--small"],
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **offline,
            "PYTHON": image,
            "OUT": str(out),
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1",
            "JAX_PLATFORMS": "cpu",
        },
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    results = json.loads((out / "device_check.json").read_text())
    machine = results["machine"]
    assert machine["beam_imported"] is False and machine["versions"]["apache-beam"] is None
    assert not machine["docbeam_from"].startswith(REPO), "the checkout ran, not the carried wheel"
    assert machine["versions"]["sentence-transformers"] == "6.0.1" and machine["versions"]["tokamax"] == "0.0.12"
    rows = results["attention"]
    assert {r["layer"] for r in rows} == {"padded", "packed", "local_window", "causal_grouped"}
    assert {r["variant"] for r in rows if "seconds" in r} == {"native", "chunked", "flash/tokamax_chunked"}
    assert {r["picked"] for r in rows if r["variant"] == "flash"} == {"chunked"}
    assert max(r["max_abs_diff"] for r in rows if r["dtype"] == "float32" and "max_abs_diff" in r) < 1e-5
    assert all(r["refused"] for r in rows if r["variant"] in ("flash/cudnn", "flash/tokamax_triton"))
    assert [(r["shape"], r["length"]) for r in results["encoder"]] == [
        (s, n) for s in device_encoder.SHAPES for n in device_encoder.SMALL_LENGTHS
    ]
    assert all(
        r["docbeam"]["share_of_matmul_rate"] > 0 and r["sentence_transformers"]["tokens_per_s"] > 0
        for r in results["encoder"]
    )
