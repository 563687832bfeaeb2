"""The encoder on a device mesh (runner.mesh, models/mesh.py, attention/on_mesh.py), proven on four virtual CPU
devices: for BERT, ModernBERT (local layers), Qwen3 (grouped k/v), Gemma3 (one k/v head), DeBERTa (relative
positions) and a SPLADE head, every backend (native, chunked, a flash kernel: the Pallas TPU kernel in
interpret mode, or tokamax's for grouped k/v), unpacked and packed, the vectors of a data-only, a mixed and a
model-only mesh are the one-chip vectors; each chip holds its share of the parameters, as XLA's own memory
analysis of the compiled forward counts them.

Each family runs in a process of its own (tests/mesh_cases.py): XLA's virtual device count is read once, when
JAX starts, and this process has started it with one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from docbeam.models.mesh import MeshShape, pad_rows, padded_rows, per_device_bytes, split_dimension

MIN_COSINE = 0.99999
# Three families in `make test` (plain heads, grouped k/v, one k/v head replicated across the model axis), a
# minute each; the other three in `make test-extra`.
FAMILIES = (
    "bert",
    "qwen3",
    "gemma3",
    *(pytest.param(f, marks=pytest.mark.extra) for f in ("modernbert", "deberta", "splade")),
)
CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_cases.py")


def on_virtual_devices(count: int, *args: str, timeout: float = 900) -> str:
    """``python <args>`` in a child process that sees ``count`` virtual CPU devices; its stdout."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}", "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, dict]:
    folder = str(tmp_path_factory.mktemp(f"mesh-{request.param}"))
    return request.param, json.loads(on_virtual_devices(4, CASES, request.param, folder).splitlines()[-1])


@pytest.mark.slow
def test_every_mesh_gives_the_one_chip_vectors_with_every_backend_packed_or_not(family):
    name, found = family
    assert found["devices"] == 4
    meshes = {"4x1", "2x2"} | ({"1x4"} if name != "splade" else set())  # the SPLADE checkpoint has 2 heads
    backends = {"native", "chunked"} | ({"flash"} if name != "deberta" else set())  # no kernel takes DeBERTa's
    expected = {f"{p} {b} {m}" for p in ("unpacked", "packed") for b in backends for m in meshes}
    assert set(found["cosines"]) == expected
    low = {case: cosine for case, cosine in found["cosines"].items() if cosine < MIN_COSINE}
    assert not low, low


@pytest.mark.slow
def test_the_flash_cases_ran_a_flash_kernel_on_the_mesh(family):
    name, found = family
    flash = {case: kernel for case, kernel in found["kernels"].items() if " flash " in case}
    assert name == "deberta" or flash
    assert all("pallas" in kernel or "tokamax" in kernel for kernel in flash.values()), flash


@pytest.mark.slow
def test_each_chip_holds_its_share_of_the_parameters(family):
    _, found = family
    for mesh, sizes in found["param_bytes"].items():
        model = int(mesh.split("x")[1])
        # What XLA's memory analysis says a chip receives: the planned parameter bytes and the batch's own
        # share of rows (ids and lengths, a few KB).
        assert 0 < sizes["compiled"] - sizes["planned"] < 16_384, (mesh, sizes)
        # Megatron's split: about total / model; norms and biases, replicated, make the difference.
        assert sizes["planned"] <= sizes["total"] / model * 1.02, (mesh, sizes)


def test_a_matrix_is_split_on_its_largest_dimension_the_model_axis_divides():
    assert split_dimension((384, 1152), 4) == 1  # a fused QKV: its outputs (heads)
    assert split_dimension((1536, 384), 4) == 0  # an MLP's down projection: its inputs
    assert split_dimension((4096, 4096), 4) == 0  # square: the attention output's inputs (heads)
    assert split_dimension((30522, 384), 4) == 1  # a vocabulary 4 does not divide: the width
    assert split_dimension((30522, 384), 2) == 0  # one 2 does: the vocabulary
    assert split_dimension((384,), 4) is None  # a bias or a norm: replicated
    assert split_dimension((30, 6), 4) is None  # nothing divides: replicated
    assert split_dimension((384, 1152), 1) is None


def test_rows_a_data_axis_does_not_divide_are_padded_with_copies_of_a_real_row():
    import numpy as np

    ids = np.arange(10).reshape(5, 2)
    padded_ids, none, lengths = pad_rows([ids, None, np.array([3, 1, 2, 2, 1])], 4)
    assert padded_rows(5, 4) == 8 and padded_ids.shape == (8, 2) and none is None
    assert (padded_ids[5:] == ids[4]).all() and list(lengths[5:]) == [1, 1, 1]
    assert pad_rows([ids], 5)[0] is ids


def test_per_device_bytes_count_a_split_parameter_once_per_share_and_a_replicated_one_whole():
    import jax
    import numpy as np

    params = {"qkv": jax.ShapeDtypeStruct((64, 192), np.float32), "norm": jax.ShapeDtypeStruct((64,), np.float32)}
    assert per_device_bytes(params, 1) == (64 * 192 + 64) * 4
    assert per_device_bytes(params, 4) == 64 * 192 + 64 * 4


def test_a_mesh_that_does_not_fit_the_worker_is_refused_naming_the_chips():
    assert MeshShape(0, 2).on(8) == MeshShape(4, 2)  # data: auto takes what the model axis leaves
    with pytest.raises(ValueError, match=r"needs 8 chips, this worker has 4"):
        MeshShape(4, 2).on(4)
    with pytest.raises(ValueError, match=r"model: 3 does not divide this worker's 4 chips"):
        MeshShape(1, 3).on(4)


def test_a_mesh_of_some_of_the_chips_is_built_in_device_order():
    # jax's topology-aware ordering wants every chip of a TPU slice; a mesh of fewer is laid out in device order.
    code = (
        "from docbeam.models.mesh import MeshShape, make_mesh\n"
        "mesh = make_mesh(MeshShape(3, 1))\n"
        "print([d.id for d in mesh.devices.flat], dict(mesh.shape))"
    )
    assert on_virtual_devices(4, "-c", code).strip() == "[0, 1, 2] {'data': 3, 'model': 1}"
