"""The job against real GCS calls: a local emulator serves input, model and output as gs:// URIs."""

from __future__ import annotations

import io
import json
import os

import pyarrow.parquet as pq
import pytest
from conftest import job_config
from gcs_emulator import gcs_emulator, matching

from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.store import storage

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


def upload_folder(emulator, local: str, prefix: str) -> None:
    bucket = emulator.client.bucket(emulator.bucket)
    for root, _, files in os.walk(local):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local)
            bucket.blob(f"{prefix}/{rel}").upload_from_filename(os.path.join(root, name))


def test_job_reads_corpus_and_model_from_gcs_and_writes_outputs_there(tiny_checkpoint_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [
        {"id": f"d{i}", "text": f"Document number {i} talks about storage buckets. " * (i % 7 + 1)} for i in range(30)
    ]
    (corpus / "part-0.jsonl").write_text("\n".join(json.dumps(d) for d in docs[:20]) + "\n")
    (corpus / "part-1.jsonl").write_text("\n".join(json.dumps(d) for d in docs[20:]) + "\n{not json}\n")
    with gcs_emulator() as gcs:
        upload_folder(gcs, str(corpus), "corpus")
        upload_folder(gcs, tiny_checkpoint_dir, "models/tiny")
        cfg = job_config(gcs.url("corpus", "part-*.jsonl"), gcs.url("runs", "today"), gcs.url("models", "tiny"))
        summary = run_job(cfg)

        listed = {b.name for b in gcs.client.list_blobs(gcs.bucket, prefix="runs/today/")}
        parquet = [n for n in listed if n.startswith("runs/today/embeddings/") and n.endswith(".parquet")]
        table = pq.read_table(io.BytesIO(storage.read_bytes(gcs.url(parquet[0])))) if len(parquet) == 1 else None
        summary_in_gcs = json.loads(storage.read_bytes(gcs.url("runs", "today", "summary.json")))
        errors = storage.read_bytes(matching(gcs.url("runs", "today", "errors", "*.jsonl"))[0]).decode()

    assert summary["docs_read"] == 31 and summary["docs_embedded"] == 30 and summary["docs_rejected"] == 1
    assert summary_in_gcs == summary
    assert table is not None and sorted(table.column("id").to_pylist()) == sorted(d["id"] for d in docs)
    assert any(n.startswith("runs/today/timing/") for n in listed)
    assert json.loads(errors.splitlines()[0])["kind"] == "malformed_json"
    assert not any("temp" in n.split("/")[2] for n in listed if n.count("/") > 2), "sink temp files left behind"


def test_planning_from_gcs_fetches_no_weights_and_refuses_pickles_at_start(tiny_checkpoint_dir):
    from docbeam.models.checkpoint import CheckpointError, open_checkpoint

    storage.pipeline_options([])
    with gcs_emulator() as gcs:
        upload_folder(gcs, tiny_checkpoint_dir, "models/tiny-plan")
        planned = open_checkpoint(gcs.url("models", "tiny-plan"))
        weights_before_load = os.path.exists(os.path.join(planned.folder, "model.safetensors"))
        loaded = open_checkpoint(gcs.url("models", "tiny-plan"), with_weights=True)
        bucket = gcs.client.bucket(gcs.bucket)
        bucket.blob("models/pickled/config.json").upload_from_filename(os.path.join(tiny_checkpoint_dir, "config.json"))
        bucket.blob("models/pickled/pytorch_model.bin").upload_from_string(b"not loaded")
        with pytest.raises(CheckpointError, match="pickle checkpoint"):
            open_checkpoint(gcs.url("models", "pickled"))
    assert planned.config.num_layers == 2 and not weights_before_load
    assert os.path.exists(os.path.join(loaded.folder, "model.safetensors"))


def test_planning_from_gcs_holds_the_config_against_the_weights_header_without_fetching_them(
    tiny_checkpoint_dir, tmp_path
):
    from docbeam.models.checkpoint import CheckpointError, open_checkpoint

    config = json.load(open(os.path.join(tiny_checkpoint_dir, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    storage.pipeline_options([])
    with gcs_emulator() as gcs:
        upload_folder(gcs, tiny_checkpoint_dir, "models/one-layer")
        gcs.client.bucket(gcs.bucket).blob("models/one-layer/config.json").upload_from_filename(
            str(tmp_path / "config.json")
        )
        with pytest.raises(CheckpointError) as refused:
            open_checkpoint(gcs.url("models", "one-layer"))
    assert f"model.path: {gcs.url('models', 'one-layer', 'model.safetensors')} holds tensors of 2 layers" in str(
        refused.value
    ), str(refused.value)


def gcs_snapshot(gcs, prefix: str) -> dict[str, bytes]:
    """What a reader of the output sees on gs://, byte for byte (the staging prefix is the run's scratch)."""
    bucket = gcs.client.bucket(gcs.bucket)
    return {
        b.name: bucket.blob(b.name).download_as_bytes()
        for b in gcs.client.list_blobs(gcs.bucket, prefix=f"{prefix}/")
        if "/_staging/" not in b.name
    }


@pytest.mark.extra
def test_on_gcs_a_failed_rerun_leaves_the_output_byte_identical_and_the_next_commit_replaces_it(
    tiny_checkpoint_dir, tmp_path
):
    from docbeam.config import ConfigError
    from docbeam.pipeline.stages.commit import RunFailed

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "text": f"Text {i} about object storage. " * (i % 5 + 1)}) + "\n"
            for i in range(20)
        )
    )
    with gcs_emulator() as gcs:
        upload_folder(gcs, str(tmp_path), "in")
        upload_folder(gcs, tiny_checkpoint_dir, "models/tiny")
        out = gcs.url("runs", "daily")

        def cfg(**sections):
            return job_config(gcs.url("in", "docs.jsonl"), out, gcs.url("models", "tiny"), **sections)

        first = run_job(cfg())
        before = gcs_snapshot(gcs, "runs/daily")
        with pytest.raises(Exception, match="nothing was embedded from 20 documents") as failed:
            run_job(cfg(input={"text_field": "body"}))
        assert isinstance(failed.value, RunFailed) or "RunFailed" in str(failed.value)
        after_failure = gcs_snapshot(gcs, "runs/daily")
        second = run_job(cfg())
        after_second = gcs_snapshot(gcs, "runs/daily")
        manifest = json.loads(after_second["runs/daily/_manifest.json"])

        bucket = gcs.client.bucket(gcs.bucket)
        bucket.blob("runs/other/notes.txt").upload_from_string(b"not docbeam's")
        with pytest.raises(ConfigError, match="no docbeam run wrote"):
            run_job(job_config(gcs.url("in", "docs.jsonl"), gcs.url("runs", "other"), gcs.url("models", "tiny")))
        notes = bucket.blob("runs/other/notes.txt").download_as_bytes()

    assert after_failure == before
    assert first["run_id"] != second["run_id"] == manifest["run_id"] and manifest["previous_run_id"] == first["run_id"]
    files = {f"runs/daily/{f['path']}" for f in manifest["files"]}
    assert set(after_second) == files | {f"runs/daily/{n}" for n in ("summary.json", "_manifest.json", "_SUCCESS")}
    assert all(second["run_id"] in name for name in files)
    assert notes == b"not docbeam's"


@pytest.mark.extra
def test_on_gcs_an_incremental_run_reuses_the_unchanged_documents_of_a_previous_run(tiny_checkpoint_dir, tmp_path):
    docs = [
        {"id": f"d{i}", "text": f"Paragraph {i} on object stores and their consistency. " * (i % 4 + 1)}
        for i in range(24)
    ]
    changed = [{**d, "text": d["text"] + " Revised."} if i < 3 else d for i, d in enumerate(docs[:-2])]
    changed.append({"id": "fresh", "text": "A document that is new today."})
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(d) + "\n" for d in changed))
    with gcs_emulator() as gcs:
        upload_folder(gcs, str(tmp_path), "in")
        upload_folder(gcs, tiny_checkpoint_dir, "models/tiny")
        model = gcs.url("models", "tiny")
        run_job(job_config(gcs.url("in", "a.jsonl"), gcs.url("runs", "a"), model))
        summary = run_job(
            job_config(
                gcs.url("in", "b.jsonl"), gcs.url("runs", "b"), model, input={"reuse_from": gcs.url("runs", "a")}
            )
        )
        tables = {
            run: pq.read_table(io.BytesIO(storage.read_bytes(path)))
            for run in ("a", "b")
            for path in matching(gcs.url("runs", run, "embeddings", "*.parquet"))
        }

    assert summary["reuse_key"]["weights_digest"].startswith("crc32c:")
    assert (summary["docs_reused"], summary["docs_encoded"], summary["docs_embedded"]) == (19, 4, 23)
    previous = {r["id"]: r for r in tables["a"].to_pylist()}
    now = {r["id"]: r for r in tables["b"].to_pylist()}
    assert sorted(now) == sorted(d["id"] for d in changed)
    assert all(now[i]["embedding"] == previous[i]["embedding"] for i in (d["id"] for d in docs[3:-2]))
