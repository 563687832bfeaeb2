"""The export process (models/engines/exporter.py): a worker's shapes export in one kept child, which leaves when
idle or after a failure; a child that fails, dies or hangs is named in the error, and the next export starts
another."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from docbeam.attention.settings import AttentionConfig
from docbeam.models import checkpoint
from docbeam.models.engines.export import Recipe
from docbeam.models.engines.exporter import Exporter
from docbeam.models.engines.openvino import read_exported
from docbeam.models.heads import embedding

pytestmark = pytest.mark.slow  # each child imports JAX, jax2onnx and OpenVINO: seconds

UNPACKED = ((2, 16), (2,))  # ids and lengths: two rows of 16 tokens
WIDER = ((4, 32), (4,))


@pytest.fixture
def recipe(tiny_checkpoint_dir) -> Recipe:
    ck = checkpoint.open_checkpoint(tiny_checkpoint_dir, "float32", with_weights=True)
    return Recipe(tiny_checkpoint_dir, embedding.standalone(ck, "mean"), AttentionConfig(), "native")


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_workers_shapes_export_in_one_kept_child_that_leaves_when_idle(recipe, tmp_path):
    exporter = Exporter(idle_s=1.0)
    try:
        exporter.export((recipe, UNPACKED, str(tmp_path), "a"))
        exporter.export((recipe, WIDER, str(tmp_path), "b"))
        assert exporter.started == 1
        assert read_exported(str(tmp_path), "a") is not None and read_exported(str(tmp_path), "b") is not None
        assert wait_until(lambda: not exporter.running(), 15), "the idle child is still running"
        exporter.export((recipe, UNPACKED, str(tmp_path), "c"))
        assert exporter.started == 2 and read_exported(str(tmp_path), "c") is not None
    finally:
        exporter.close()
    assert not exporter.running()


def test_a_failed_export_names_the_childs_reason_and_the_next_export_starts_afresh(recipe, tmp_path):
    import dataclasses

    exporter = Exporter()
    try:
        missing = dataclasses.replace(recipe, model_path=str(tmp_path / "no-such-model"))
        with pytest.raises(RuntimeError, match="no-such-model"):
            exporter.export((missing, UNPACKED, str(tmp_path), "a"))
        assert not exporter.running()  # a failed child's state is unknown: it is ended
        exporter.export((recipe, UNPACKED, str(tmp_path), "a"))
        assert exporter.started == 2 and read_exported(str(tmp_path), "a") is not None
    finally:
        exporter.close()


def test_a_child_killed_mid_export_is_named_with_its_exit_and_the_next_export_replaces_it(recipe, tmp_path):
    exporter = Exporter()
    errors = []

    def export():
        try:
            exporter.export((recipe, UNPACKED, str(tmp_path), "a"))
        except RuntimeError as e:
            errors.append(str(e))

    try:
        thread = threading.Thread(target=export)
        thread.start()
        assert wait_until(lambda: exporter._proc is not None, 10)
        time.sleep(0.5)  # the child is still importing JAX (seconds)
        os.kill(exporter._proc.pid, signal.SIGKILL)
        thread.join(60)
        assert errors and f"the export process exited {-signal.SIGKILL}" in errors[0], errors
        exporter.export((recipe, UNPACKED, str(tmp_path), "a"))
        assert exporter.started == 2 and read_exported(str(tmp_path), "a") is not None
    finally:
        exporter.close()


def test_a_child_past_the_timeout_is_stopped_and_named(recipe, tmp_path):
    exporter = Exporter(timeout_s=0.5)  # a child's imports alone take seconds
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="took longer than 0.5 s"):
            exporter.export((recipe, UNPACKED, str(tmp_path), "a"))
        assert not exporter.running() and time.monotonic() - started < 30
        assert read_exported(str(tmp_path), "a") is None
    finally:
        exporter.close()


def test_a_checkpoint_rewritten_in_place_between_two_shapes_exports_from_its_new_weights(recipe, tmp_path):
    """The kept child loads the checkpoint for every shape: one rewritten in place (a user's model folder updated
    while a worker starts) must not export from the weights the child read before."""
    import dataclasses
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from docbeam.models.engines.openvino import compile_model

    folder = str(tmp_path / "model")
    shutil.copytree(recipe.model_path, folder)
    moved = dataclasses.replace(recipe, model_path=folder)
    ids = np.tile(np.arange(100, 116, dtype=np.int32), (2, 1))
    lengths = np.asarray([16, 9], np.int32)

    def vectors(key):
        return compile_model(read_exported(str(tmp_path), key), "float32", str(tmp_path), key, True, 0.0)(
            None, ids, lengths
        )

    exporter = Exporter()
    try:
        exporter.export((moved, UNPACKED, str(tmp_path), "before"))
        weights = os.path.join(folder, "model.safetensors")
        save_file({name: array * 1.5 for name, array in load_file(weights).items()}, weights)
        exporter.export((moved, UNPACKED, str(tmp_path), "after"))
        assert exporter.started == 1
    finally:
        exporter.close()
    assert not np.allclose(vectors("before"), vectors("after"), atol=1e-3)


def test_a_process_forked_mid_export_starts_its_own_child_and_leaves_the_parents_alone(recipe, tmp_path):
    from docbeam.models.engines.exporter import EXPORTER

    EXPORTER.export((recipe, UNPACKED, str(tmp_path), "a"))
    parents, before = EXPORTER._proc, EXPORTER.started
    with EXPORTER._lock:  # another thread's export in progress while the process forks
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # the lock, copied held, would hang this export for ever
            EXPORTER.export((recipe, UNPACKED, str(tmp_path), "c"))
            mine = EXPORTER._proc is not parents and EXPORTER.started == before + 1
            os._exit(0 if mine and read_exported(str(tmp_path), "c") is not None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert EXPORTER._proc is parents and EXPORTER.running()
    EXPORTER.export((recipe, WIDER, str(tmp_path), "b"))
    assert EXPORTER.started == before and read_exported(str(tmp_path), "b") is not None
