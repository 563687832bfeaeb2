"""A whole ``docbeam run`` on eight virtual CPU devices: ``runner.mesh: auto`` puts all eight on the data axis
(``batching.tokens_per_batch: auto`` sizing a batch for eight), the vectors are the one-device run's, summary.json says the mesh and the chips, every timing record names the mesh;
a model split on the model axis gives them too; a job whose model cannot fit the memory it states is refused
at start (exit 2) with the bytes and the mesh that fits, before a worker starts."""

from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE

DOCS = 48  # short and long documents of the sample: both buckets, windows a batch of 8 rows does not divide


def run(tmp_path, out: str, devices: int, *sets: str) -> subprocess.CompletedProcess:
    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        with gzip.open(SAMPLE, "rt") as f:
            docs.write_text("".join(line for _, line in zip(range(DOCS), f)))
    args = ["--set", f"input.path={docs}", "--set", f"output.path={tmp_path / out}"]
    for value in sets:
        args += ["--set", value]
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PYTHONPATH": REPO,
    }
    return subprocess.run(
        [sys.executable, "-m", "docbeam", "run", "--config", os.path.join(REPO, "configs", "local.yaml"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def embeddings(output) -> dict[str, np.ndarray]:
    rows = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet"))).to_pylist()
    return {r["id"]: np.asarray(r["embedding"], np.float64) for r in rows}


def lowest_cosine(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return min(float(a[k] @ b[k] / np.linalg.norm(a[k]) / np.linalg.norm(b[k])) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh-run")
    done = {
        "one": run(tmp, "one", 1),
        "data": run(tmp, "data", 8, "runner.mesh=auto", "batching.tokens_per_batch=auto"),
        "mixed": run(tmp, "mixed", 8, "runner.mesh.data=2", "runner.mesh.model=4"),
    }
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data", "mixed"])
def test_a_run_on_eight_chips_writes_the_one_chip_vectors(runs, mesh):
    assert lowest_cosine(embeddings(runs / mesh), embeddings(runs / "one")) >= 0.99999


@pytest.mark.slow
def test_summary_and_timing_records_say_the_mesh_and_the_chips(runs):
    with open(runs / "data" / "summary.json") as f:
        summary = json.load(f)
    assert summary["mesh"] == {"data": 8, "model": 1}
    # tokens_per_batch: auto on CPU chips: 1,024 tokens a chip (4 rows of 256) on each of the 8
    assert summary["memory_plan"]["tokens_per_batch"] == 8192
    assert summary["memory_plan"]["largest_batch"]["rows_per_chip"] == 4
    assert list(summary["devices"]) == ["cpu:0 (cpu) +7"] and summary["devices"]["cpu:0 (cpu) +7"] == summary["batches"]
    records = [json.loads(line) for p in glob.glob(str(runs / "data" / "timing" / "*.jsonl")) for line in open(p)]
    assert records and all(r["mesh"] == {"data": 8, "model": 1} for r in records)
    with open(runs / "one" / "summary.json") as f:
        assert json.load(f)["mesh"] == {"data": 1, "model": 1}


@pytest.mark.slow
def test_a_model_that_cannot_fit_the_stated_memory_is_refused_at_start_naming_the_mesh_that_fits(tmp_path):
    # MiniLM's 0.08 GiB of parameters and 0.06 GiB of working memory do not fit 100 MiB, and do on two chips.
    done = run(tmp_path, "out", 8, "runner.device_memory=100MiB", "runner.mesh.data=1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the model does not fit its chips" in done.stderr
    assert "runner.mesh: {data: auto, model: 2}" in done.stderr
    assert not (tmp_path / "out").exists()


def chunk_vectors(output) -> dict[tuple, np.ndarray]:
    rows = pq.read_table(sorted(glob.glob(f"{output}/chunks/*.parquet"))).to_pylist()
    return {(r["document_id"], r["chunk_index"]): np.asarray(r["embedding"], np.float64) for r in rows}


@pytest.mark.slow
def test_late_chunks_on_a_mesh_are_the_one_chip_chunks(tmp_path):
    late = ("output.chunking=late", "output.granularity=chunk", "runner.mesh=auto")
    one, mesh = run(tmp_path, "one", 1, *late), run(tmp_path, "mesh", 4, *late)
    assert one.returncode == mesh.returncode == 0, mesh.stderr[-3000:]
    chunks = chunk_vectors(tmp_path / "mesh")
    assert len(chunks) > DOCS and lowest_cosine(chunks, chunk_vectors(tmp_path / "one")) >= 0.99999
