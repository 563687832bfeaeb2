"""The whole job, end to end: real model on the sample corpus, tiny model for the variations."""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.run import run_job

pytestmark = pytest.mark.slow

TIMING_FIELDS = {
    "batch_id",
    "bucket_len",
    "rows",
    "real_tokens",
    "padded_tokens",
    "attention_backend",
    "compiled",
    "compiling_ahead",
    "compute_ms",
    "total_ms",
    "device",
    "worker",
    "started_at",
    "memory_in_use_bytes",
    "memory_peak_bytes",
}


def read_embeddings(output: str) -> dict[str, dict]:
    table = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet")))
    return {row["id"]: row for row in table.to_pylist()}


def read_jsonl(output: str, part: str) -> list[dict]:
    return [json.loads(line) for path in sorted(glob.glob(f"{output}/{part}/*.jsonl")) for line in open(path)]


def sample_texts() -> dict[str, str]:
    with gzip.open(SAMPLE, "rt") as f:
        return {d["id"]: d["text"] for d in map(json.loads, f)}


def test_sample_chunks_point_into_their_documents(sample_run, real_checkpoint_dir):
    from chunks_test import sample_chunks_point_into_their_documents  # here: the sample run is this file's

    sample_chunks_point_into_their_documents(sample_run, real_checkpoint_dir)


def test_sample_chunk_vectors_are_the_models_window_vectors(sample_run, real_checkpoint_dir):
    from chunks_test import sample_chunk_vectors_are_the_models_window_vectors

    sample_chunk_vectors_are_the_models_window_vectors(sample_run, real_checkpoint_dir)


def test_sample_run_writes_embeddings_timing_errors_and_summary(sample_run):
    output, summary = sample_run
    assert glob.glob(f"{output}/embeddings/*.parquet") and glob.glob(f"{output}/timing/*.jsonl")
    assert glob.glob(f"{output}/errors/*.jsonl")  # present even when empty: a reader need not special-case it
    assert json.load(open(f"{output}/summary.json")) == summary
    assert summary["docs_read"] == 134 == summary["docs_embedded"] + summary["docs_rejected"]
    assert summary["attention_backends"] == {"native": summary["batches"]}
    assert pq.read_schema(glob.glob(f"{output}/embeddings/*.parquet")[0]).names == [
        "id",
        "embedding",
        "num_tokens",
        "num_windows",
        "truncated",
        "content_hash",
    ]


def test_every_batch_has_a_timing_record_naming_the_kernel_that_ran(sample_run):
    output, summary = sample_run
    timing = read_jsonl(output, "timing")
    assert len(timing) == summary["batches"]
    assert all(TIMING_FIELDS <= set(t) for t in timing)
    assert {t["attention_backend"] for t in timing} == {"native"}
    assert sum(t["real_tokens"] for t in timing) == summary["real_tokens"]
    assert all(t["compute_ms"] > 0 and t["total_ms"] >= t["compute_ms"] for t in timing)
    # One compilation per (bucket, rows) shape, ahead of its batches (or at the first), none after.
    compiled = [name.split(" ")[0] for name in summary["startup"]["compiles_s"]]
    assert len(compiled) == len(set(compiled)) == summary["compiles"]
    assert {f"{t['rows']}x{t['bucket_len']},native" for t in timing} <= set(compiled)
    assert sum(t["compiled"] for t in timing) == summary["compiles"] - summary["compiles_ahead"]


def test_single_window_documents_equal_sentence_transformers(sample_run, real_checkpoint_dir):
    from sentence_transformers import SentenceTransformer

    output, _ = sample_run
    rows = {i: r for i, r in read_embeddings(output).items() if r["num_windows"] == 1}
    assert len(rows) >= 90
    texts = sample_texts()
    ids = sorted(rows, key=lambda i: (rows[i]["num_tokens"], i))
    reference = SentenceTransformer(real_checkpoint_dir, device="cpu").encode([texts[i] for i in ids], batch_size=32)
    ours = np.array([rows[i]["embedding"] for i in ids], np.float32)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, f"worst document {ids[int(cosine.argmin())]}: cosine {cosine.min()}"


@functools.lru_cache(maxsize=None)
def tokenizer_of(checkpoint_dir: str):
    """The checkpoint's tokenizer, read once per session rather than once per document."""
    from docbeam.models.checkpoint import load_tokenizer

    return load_tokenizer(checkpoint_dir)


def content_ids(checkpoint_dir: str, text: str) -> tuple[list[int], int, int]:
    """The document's own token ids, and the tokenizer's [CLS] and [SEP] ids."""
    tokenizer = tokenizer_of(checkpoint_dir)
    return tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.cls_token_id, tokenizer.sep_token_id


def windows_by_hand(ids: list[int], cls: int, sep: int, window_len: int, stride: int) -> list[list[int]]:
    """Overlapping windows written out here, not by pipeline.stages.tokenize: each holds window_len - 2 content tokens,
    the first ``stride`` of them repeated from the previous window."""
    content, windows, start = window_len - 2, [], 0
    while True:
        windows.append([cls] + ids[start : start + content] + [sep])
        if start + content >= len(ids):
            return windows
        start += content - stride


@functools.lru_cache(maxsize=None)
def jitted_encoder(checkpoint_dir: str):
    """(params, jitted mean-pooling encoder) of a checkpoint, built once per test session: a new jax.jit per call
    compiled every window length again, seconds per document."""
    import jax

    from docbeam import attention
    from docbeam.models.checkpoint import load_params, open_checkpoint
    from docbeam.models.encoder import embed_fn

    config = open_checkpoint(checkpoint_dir).config
    return load_params(checkpoint_dir, config), jax.jit(embed_fn(config, attention.get("native").bind(), "mean"))


def encode_alone(checkpoint_dir: str, windows: list[list[int]]) -> np.ndarray:
    """Mean-pooled vector of each window, one unpadded window per call, straight through the encoder."""
    import jax.numpy as jnp

    params, embed = jitted_encoder(checkpoint_dir)
    return np.stack(
        [np.asarray(embed(params, jnp.asarray([w], jnp.int32), jnp.asarray([len(w)], jnp.int32))[0]) for w in windows]
    )


def test_a_long_document_is_the_token_weighted_mean_of_its_windows(sample_run, real_checkpoint_dir):
    output, _ = sample_run
    rows = read_embeddings(output)
    long_ids = sorted((r for r in rows.values() if r["num_windows"] > 1), key=lambda r: -r["num_tokens"])
    assert len(long_ids) >= 20
    texts = sample_texts()
    for row in long_ids[:3]:
        ids, cls, sep = content_ids(real_checkpoint_dir, texts[row["id"]])
        windows = windows_by_hand(ids, cls, sep, window_len=256, stride=32)
        assert (row["num_windows"], row["num_tokens"], row["truncated"]) == (len(windows), len(ids), False)
        vectors = encode_alone(real_checkpoint_dir, windows)
        lengths = np.array([len(w) for w in windows], np.float64)
        pooled = (vectors * lengths[:, None]).sum(0) / lengths.sum()
        pooled /= np.linalg.norm(pooled)
        ours = np.asarray(row["embedding"], np.float32)
        np.testing.assert_allclose(ours, pooled, atol=2e-5, err_msg=row["id"])
        first = vectors[0] / np.linalg.norm(vectors[0])
        assert np.abs(ours - first).max() > 1e-3, f"{row['id']}: pooled like its first window alone"


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


def test_truncate_embeds_only_the_first_window_of_a_long_document(tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    summary = run_job(
        job_config(f"{folder}/good.jsonl", str(tmp_path), tiny_checkpoint_dir, tokenize={"long_documents": "truncate"})
    )
    rows, texts = read_embeddings(str(tmp_path)), sample_texts()
    assert sorted(rows) == sorted(ids) and summary["windows"] == len(ids)  # one window per document
    truncated = 0
    for doc_id, row in rows.items():
        content, cls, sep = content_ids(tiny_checkpoint_dir, texts[doc_id])
        is_long = len(content) > 126  # the tiny checkpoint's window: 128 tokens, [CLS] and [SEP] included
        assert (row["num_windows"], row["truncated"], row["num_tokens"]) == (1, is_long, len(content)), doc_id
        if is_long:
            truncated += 1
            (first,) = encode_alone(tiny_checkpoint_dir, [[cls] + content[:126] + [sep]])
            np.testing.assert_allclose(
                np.asarray(row["embedding"], np.float32), first, rtol=1e-5, atol=1e-5, err_msg=doc_id
            )
    assert truncated >= 5


def embeddings_matrix(output: str, ids: list[str]) -> np.ndarray:
    rows = read_embeddings(output)
    return np.array([rows[i]["embedding"] for i in ids], np.float32)


@pytest.fixture(scope="module")
def native_run(tiny_corpus, tiny_checkpoint_dir, tmp_path_factory) -> tuple[str, dict]:
    """The tiny model's run of good.jsonl as configured by default (native attention, one worker): the
    reference the backend and worker tests compare with, run once for them all (a pipeline costs seconds)."""
    folder, _ = tiny_corpus
    output = str(tmp_path_factory.mktemp("native"))
    return output, run_job(job_config(f"{folder}/good.jsonl", output, tiny_checkpoint_dir))


@pytest.mark.parametrize("backend", ["chunked", "flash"])
def test_switching_attention_backend_in_yaml_keeps_embeddings(
    backend, native_run, tiny_corpus, tiny_checkpoint_dir, tmp_path
):
    folder, ids = tiny_corpus
    native_output, native = native_run
    other = run_job(
        job_config(f"{folder}/good.jsonl", str(tmp_path / backend), tiny_checkpoint_dir, attention={"backend": backend})
    )
    assert other["attention_backends"] == {backend: other["batches"]}
    assert native["attention_backends"] == {"native": native["batches"]}
    diff = np.abs(embeddings_matrix(native_output, ids) - embeddings_matrix(str(tmp_path / backend), ids))
    assert diff.max() <= 1e-5


@pytest.mark.extra
def test_two_worker_processes_give_the_same_embeddings(native_run, tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    one_worker, _ = native_run
    two = job_config(
        f"{folder}/good.jsonl",
        str(tmp_path / "two"),
        tiny_checkpoint_dir,
        batching={"shards": 2},
        runner={"options": {"direct_num_workers": 2, "direct_running_mode": "multi_processing"}},
    )
    summary = run_job(two)
    worker_pids = {t["worker"].rsplit(":", 1)[1] for t in read_jsonl(str(tmp_path / "two"), "timing")}
    assert summary["docs_embedded"] == len(ids)
    assert str(os.getpid()) not in worker_pids, "the encoder ran in the test process, not in worker processes"
    assert len(worker_pids) == 2, f"batches were encoded by worker process(es) {sorted(worker_pids)}, not two"
    np.testing.assert_allclose(
        embeddings_matrix(one_worker, ids), embeddings_matrix(str(tmp_path / "two"), ids), atol=1e-5
    )


def test_packed_rows_give_the_embeddings_of_unpacked_ones_with_less_padding(tiny_corpus, tiny_checkpoint_dir, tmp_path):
    folder, ids = tiny_corpus
    batching = {"buckets": [16, 32, 64, 128], "tokens_per_batch": 512}
    plain = run_job(
        job_config(
            f"{folder}/good.jsonl",
            str(tmp_path / "plain"),
            tiny_checkpoint_dir,
            batching={**batching, "packing": False},
        )
    )
    packed = run_job(
        job_config(
            f"{folder}/good.jsonl",
            str(tmp_path / "packed"),
            tiny_checkpoint_dir,
            batching={**batching, "packing": True},
        )
    )
    assert packed["docs_embedded"] == plain["docs_embedded"] == len(ids)
    assert packed["windows"] == plain["windows"]
    timing = read_jsonl(str(tmp_path / "packed"), "timing")
    assert all(t["packed"] for t in timing) and sum(t["real_rows"] for t in timing) == packed["windows"]
    padded = {
        name: sum(t["padded_tokens"] for t in read_jsonl(str(tmp_path / name), "timing"))
        for name in ("plain", "packed")
    }
    assert padded["packed"] < padded["plain"]
    np.testing.assert_allclose(
        embeddings_matrix(str(tmp_path / "plain"), ids), embeddings_matrix(str(tmp_path / "packed"), ids), atol=1e-5
    )


def test_packing_with_a_backend_that_takes_no_segment_ids_stops_before_any_work(
    tiny_corpus, tiny_checkpoint_dir, tmp_path, monkeypatch
):
    from docbeam.attention.dispatch import AttentionPlanError
    from docbeam.config import ConfigError

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.… importable
    folder, _ = tiny_corpus
    with pytest.raises((AttentionPlanError, ConfigError), match="batching.packing"):
        run_job(
            job_config(
                f"{folder}/good.jsonl",
                str(tmp_path / "out"),
                tiny_checkpoint_dir,
                batching={"packing": True},
                attention={"backend": "tests.fixtures_user_backend:attend"},
            )
        )
    assert not os.path.exists(tmp_path / "out" / "embeddings")


def test_a_run_refused_under_the_lock_leaves_a_dead_runs_staging_for_the_next_run(
    tiny_corpus, tiny_checkpoint_dir, tmp_path, monkeypatch
):
    """A refused run touches nothing, not even the clean-up a run that goes ahead does: a dead run's staging folder
    is still there after the refusal, and the next run that goes ahead removes it."""
    from docbeam.errors import Refused
    from docbeam.pipeline.store import output as output_lib

    folder, _ = tiny_corpus
    cfg = job_config(f"{folder}/good.jsonl", str(tmp_path), tiny_checkpoint_dir)
    run_job(cfg)
    dead = "20990101T000000.000000Z-dead00"
    output_lib.mark_staging(str(tmp_path), dead, 1)
    files = {p: os.path.getmtime(p) for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)}
    monkeypatch.setattr(output_lib, "new_run_id", lambda: "20000101T000000.000000Z-ffffff")
    with pytest.raises(Refused, match="does not sort before"):
        run_job(cfg)
    assert {p: os.path.getmtime(p) for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)} == files
    monkeypatch.undo()
    run_job(cfg)
    assert not os.path.exists(output_lib.staging_dir(str(tmp_path), dead))


def test_a_run_whose_id_sorts_before_the_run_the_output_holds_is_refused_and_writes_nothing(
    tiny_corpus, tiny_checkpoint_dir, tmp_path, monkeypatch
):
    """A run planned before another run of its output committed (or on a driver whose clock is behind) would
    read as older than the rows it replaces, so it stops under the lock, before its staging folder exists."""
    from docbeam.errors import Refused
    from docbeam.pipeline.store import output as output_lib

    folder, _ = tiny_corpus
    cfg = job_config(f"{folder}/good.jsonl", str(tmp_path), tiny_checkpoint_dir)
    held = run_job(cfg)["run_id"]
    files = {p: os.path.getmtime(p) for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)}
    monkeypatch.setattr(output_lib, "new_run_id", lambda: "20000101T000000.000000Z-ffffff")
    with pytest.raises(Refused, match=f"holds run {held}, which does not sort before"):
        run_job(cfg)
    assert {p: os.path.getmtime(p) for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)} == files
    monkeypatch.undo()
    assert run_job(cfg)["run_id"] > held  # the lock was released: the next run goes ahead
