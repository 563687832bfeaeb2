"""models/vm_cache.py and its users: a checkpoint on gs:// is copied once per VM, not once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from docbeam.models import vm_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two processes ask for the same folder at once; the fill sleeps so that the second must wait for it.
RACE = """
import json, os, sys, time
from docbeam.models import vm_cache
def fill(folder):
    time.sleep(1.0)
    open(os.path.join(folder, "weights"), "w").write("w")
folder = vm_cache.once_per_vm("models", "k1", fill)
print(json.dumps({"pid": os.getpid(), "folder": folder, "filled_by": vm_cache.filled_by(folder),
                  "weights": os.path.exists(os.path.join(folder, "weights"))}))
"""


def run_together(code: str, env: dict, n: int = 2) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_parallel_processes_wait_for_one_fill_and_share_its_folder(tmp_path):
    env = {**os.environ, vm_cache.ROOT_ENV: str(tmp_path), "PYTHONPATH": REPO}
    first, second = run_together(RACE, env)
    assert first["folder"] == second["folder"] and first["weights"] and second["weights"]
    assert first["filled_by"] == second["filled_by"] in (first["pid"], second["pid"])
    assert sorted(os.listdir(tmp_path / "models")) == ["k1", "k1.lock"], "a partial folder was left behind"


def test_a_fill_that_fails_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    monkeypatch.setenv(vm_cache.ROOT_ENV, str(tmp_path))

    def broken(folder):
        open(os.path.join(folder, "half"), "w").write("x")
        raise OSError("connection reset")

    with pytest.raises(OSError):
        vm_cache.once_per_vm("models", "k2", broken)
    folder = vm_cache.once_per_vm("models", "k2", lambda f: open(os.path.join(f, "whole"), "w").write("y"))
    assert sorted(os.listdir(folder)) == [vm_cache.COMPLETE, "whole"]


# The checkpoint from the emulator, in two processes at once: one copies, the other reuses its copy.
CHECKPOINT = """
import json, os
from docbeam.models import checkpoint, vm_cache
from docbeam.pipeline.store import storage
storage.pipeline_options([])
folder = checkpoint.resolve_dir(os.environ["MODEL"], with_weights=True)
print(json.dumps({"pid": os.getpid(), "folder": folder, "filled_by": vm_cache.filled_by(folder),
                  "weights": os.path.getsize(os.path.join(folder, "model.safetensors"))}))
"""


@pytest.mark.gcs
@pytest.mark.extra
def test_a_gcs_checkpoint_is_copied_once_per_vm_and_again_when_replaced(tiny_checkpoint_dir, tmp_path):
    from gcs_emulator import gcs_emulator
    from gcs_pipeline_test import upload_folder

    with gcs_emulator() as gcs:
        upload_folder(gcs, tiny_checkpoint_dir, "models/tiny")
        env = {**os.environ, vm_cache.ROOT_ENV: str(tmp_path), "PYTHONPATH": REPO, "MODEL": gcs.url("models", "tiny")}
        first, second = run_together(CHECKPOINT, env)
        gcs.client.bucket(gcs.bucket).blob("models/tiny/model.safetensors").upload_from_string(b"replaced")
        (replaced,) = run_together(CHECKPOINT, env, n=1)
    assert first["folder"] == second["folder"] and first["filled_by"] == second["filled_by"]
    assert first["weights"] == os.path.getsize(os.path.join(tiny_checkpoint_dir, "model.safetensors"))
    assert replaced["folder"] != first["folder"] and replaced["weights"] == len(b"replaced")
