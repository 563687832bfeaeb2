"""pipeline/store/storage.py on local paths and on gs:// via the emulator, alone and inside real Beam pipelines."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.parquetio import ReadFromParquet, WriteToParquet
from apache_beam.testing.util import assert_that, equal_to
from gcs_emulator import gcs_emulator, matching

from docbeam.pipeline.store import storage


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator() as server:
        storage.pipeline_options()  # picks up --no_auth from STORAGE_EMULATOR_HOST
        yield server


@pytest.fixture
def gcs_dir(emulator, request):
    """A fresh gs:// prefix per test, so tests sharing the module's emulator never see each other's files."""
    return emulator.url(f"{request.node.name}-{uuid.uuid4().hex[:8]}")


def test_gcs_flags_follow_emulator_env(monkeypatch):
    monkeypatch.delenv(storage.EMULATOR_ENV, raising=False)
    assert storage.gcs_flags() == []
    monkeypatch.setenv(storage.EMULATOR_ENV, "http://127.0.0.1:1")
    assert storage.gcs_flags() == ["--no_auth"]


def test_local_round_trip(tmp_path):
    path = storage.join(str(tmp_path), "sub", "a.bin.gz")
    assert not storage.exists(path)
    storage.write_bytes(path, b"first")
    storage.write_bytes(path, b"second")  # overwrite goes through a rename
    assert storage.read_bytes(path) == b"second"  # .gz suffix, yet not decompressed
    assert storage.exists(path)
    assert matching(storage.join(str(tmp_path), "sub", "*")) == [path]  # no temp file left behind


@pytest.mark.gcs
def test_bytes_round_trip_on_gcs(emulator, gcs_dir):
    path = storage.join(gcs_dir, "nested", "a.bin")
    assert not storage.exists(path)
    payload = bytes(range(256)) * 1000
    storage.write_bytes(path, payload)
    assert storage.exists(path)
    assert storage.read_bytes(path) == payload
    blob_name = path.removeprefix(f"gs://{emulator.bucket}/")
    assert emulator.client.bucket(emulator.bucket).blob(blob_name).download_as_bytes() == payload


@pytest.mark.gcs
def test_match_glob_on_gcs(gcs_dir):
    for name in ("a.txt", "b.txt", "c.json", "deeper/d.txt"):
        storage.write_bytes(storage.join(gcs_dir, name), name.encode())
    (match,) = FileSystems.match([storage.join(gcs_dir, "*.txt")])
    assert sorted(m.path for m in match.metadata_list) == [storage.join(gcs_dir, n) for n in ("a.txt", "b.txt")]
    assert matching(storage.join(gcs_dir, "**.txt")) == [
        storage.join(gcs_dir, n) for n in ("a.txt", "b.txt", "deeper/d.txt")
    ]
    assert matching(storage.join(gcs_dir, "missing-*")) == []


@pytest.mark.gcs
def test_text_pipeline_round_trip(gcs_dir):
    lines = [f"line {i}" for i in range(100)]
    prefix = storage.join(gcs_dir, "out", "x")
    started = time.perf_counter()
    with beam.Pipeline(options=storage.pipeline_options()) as p:
        _ = p | "CreateLines" >> beam.Create(lines) | "WriteLines" >> beam.io.WriteToText(prefix)
    print(f"\nwrite pipeline against the emulator: {time.perf_counter() - started:.2f} s")
    assert matching(prefix + "*")  # finalised: temp files renamed into place
    with beam.Pipeline(options=storage.pipeline_options()) as p:
        read = p | "ReadLines" >> beam.io.ReadFromText(prefix + "*")
        assert_that(read, equal_to(lines), label="CheckLines")


@pytest.mark.gcs
def test_parquet_pipeline_round_trip(gcs_dir):
    rows = [{"doc_id": f"d{i}", "embedding": [float(i), float(-i)]} for i in range(20)]
    schema = pa.schema([("doc_id", pa.string()), ("embedding", pa.list_(pa.float32()))])
    prefix = storage.join(gcs_dir, "embeddings")
    with beam.Pipeline(options=storage.pipeline_options()) as p:
        _ = (
            p
            | "CreateRows" >> beam.Create(rows)
            | "WriteEmbeddings" >> WriteToParquet(prefix, schema, file_name_suffix=".parquet")
        )
    (path,) = matching(prefix + "*.parquet")
    assert storage.read_bytes(path)[:4] == b"PAR1"
    with beam.Pipeline(options=storage.pipeline_options()) as p:
        read = p | "ReadEmbeddings" >> ReadFromParquet(prefix + "*.parquet")
        assert_that(read, equal_to(rows), label="CheckRows")


@pytest.mark.gcs
def test_subprocess_reaches_emulator_through_env(gcs_dir):
    path = storage.join(gcs_dir, "from-parent.txt")
    storage.write_bytes(path, b"hello child")
    child = (
        "import sys; from pipeline.store import storage; storage.pipeline_options(); "
        "sys.stdout.write(storage.read_bytes(sys.argv[1]).decode())"
    )
    result = subprocess.run([sys.executable, "-c", child, path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello child"
