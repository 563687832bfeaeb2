"""Incremental runs (input.reuse_from): only new and changed documents are encoded, and the result equals
a full run — reused vectors bit for bit."""

from __future__ import annotations

import glob
import gzip
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, job_config, write_tiny_checkpoint

from docbeam.config import ConfigError
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.reuse import KEY_FIELDS, check_key, content_hash, key_differences, reusable_row


def write_corpus(path, docs: list[dict]) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def rows(output: str) -> dict[str, dict]:
    table = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet")))
    return {r["id"]: r for r in table.to_pylist()}


def timing(output: str) -> list[dict]:
    return [json.loads(line) for p in glob.glob(f"{output}/timing/*.jsonl") for line in open(p)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Corpus A (100 documents) and B: 10% of A's texts changed, 5% deleted, 5% new."""
    folder = tmp_path_factory.mktemp("corpora")
    with gzip.open(SAMPLE, "rt") as f:
        sample = [json.loads(line) for line in f]
    a = sample[:100]
    changed = {d["id"] for d in a[:10]}
    deleted = {d["id"] for d in a[10:15]}
    b = [
        {**d, "text": d["text"] + " (revised)"} if d["id"] in changed else d for d in a if d["id"] not in deleted
    ] + sample[100:105]
    return (
        write_corpus(folder / "a.jsonl", a),
        write_corpus(folder / "b.jsonl", b),
        changed,
        {d["id"] for d in sample[100:105]},
        [d["id"] for d in b],
    )


@pytest.fixture(scope="module")
def runs(corpora, tiny_checkpoint_dir, tmp_path_factory):
    a_path, b_path, *_ = corpora
    root = tmp_path_factory.mktemp("incremental")
    full_a = run_job(job_config(a_path, str(root / "a"), tiny_checkpoint_dir))
    incremental = run_job(
        job_config(b_path, str(root / "b"), tiny_checkpoint_dir, input={"reuse_from": str(root / "a")})
    )
    full_b = run_job(job_config(b_path, str(root / "b-full"), tiny_checkpoint_dir))
    return root, full_a, incremental, full_b


@pytest.mark.slow
def test_only_changed_and_new_documents_are_encoded(runs, corpora):
    root, full_a, incremental, _ = runs
    _, _, changed, new, _ = corpora
    assert incremental["docs_encoded"] == len(changed | new) == 15
    assert incremental["docs_reused"] == 85 and incremental["docs_embedded"] == 100 == incremental["docs_read"]
    assert incremental["metrics"]["counters"]["docs_reused"] == 85
    assert incremental["metrics"]["counters"]["docs_encoded"] == 15
    windows_encoded = sum(t["real_rows"] for t in timing(str(root / "b")))
    windows_of_changed_and_new = sum(r["num_windows"] for i, r in rows(str(root / "b")).items() if i in changed | new)
    assert windows_encoded == windows_of_changed_and_new == incremental["windows"]
    assert 0.7 < incremental["reused_token_share"] < 0.95
    assert incremental["reuse"]["run_id"] == full_a["run_id"]


@pytest.mark.slow
def test_the_incremental_output_equals_a_full_run_and_reused_vectors_are_bit_identical(runs, corpora):
    root, _, _, _ = runs
    _, _, changed, new, b_ids = corpora
    inc, full, previous = rows(str(root / "b")), rows(str(root / "b-full")), rows(str(root / "a"))
    assert sorted(inc) == sorted(b_ids) == sorted(full)
    ours = np.array([inc[i]["embedding"] for i in b_ids], np.float32)
    reference = np.array([full[i]["embedding"] for i in b_ids], np.float32)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.99999
    for i in set(b_ids) - changed - new:
        assert np.array_equal(np.array(inc[i]["embedding"], np.float32), np.array(previous[i]["embedding"], np.float32))
        assert inc[i]["content_hash"] == previous[i]["content_hash"]
    assert all(inc[i]["content_hash"] != previous[i]["content_hash"] for i in changed)


@pytest.mark.slow
@pytest.mark.parametrize("change, field", [("model", "weights_digest"), ("window", "window_len")])
def test_a_changed_model_or_window_encodes_everything_and_says_why(
    change, field, runs, corpora, tmp_path, real_checkpoint_dir, tiny_checkpoint_dir
):
    root, *_ = runs
    _, b_path, *_ = corpora
    model = (
        write_tiny_checkpoint(str(tmp_path / "other-model"), real_checkpoint_dir, seed=1)
        if change == "model"
        else tiny_checkpoint_dir
    )
    sections = {"model": {"max_seq_len": 64}} if change == "window" else {}
    summary = run_job(
        job_config(b_path, str(tmp_path / "out"), model, input={"reuse_from": str(root / "a")}, **sections)
    )
    assert summary["docs_reused"] == 0 and summary["docs_encoded"] == 100
    assert f"{field}: " in summary["reuse"]["reason"] and "used other settings" in summary["reuse"]["reason"]
    with pytest.raises(ConfigError, match=f"cannot be reused: .*{field}"):
        run_job(
            job_config(
                b_path,
                str(tmp_path / "refused"),
                model,
                input={"reuse_from": str(root / "a"), "reuse_mismatch": "fail"},
                **sections,
            )
        )
    assert not os.path.exists(tmp_path / "refused")


@pytest.mark.slow
def test_a_previous_run_without_a_complete_manifest_or_with_a_damaged_file_is_never_used(
    runs, corpora, tmp_path, tiny_checkpoint_dir
):
    root, *_ = runs
    _, b_path, changed, new, _ = corpora
    # Ten of B's documents that A holds unchanged: each would be reused if a broken previous run were trusted, and
    # three jobs over ten documents cost a third of three over B's hundred.
    with open(b_path) as f:
        b_docs = [json.loads(line) for line in f]
    b_path = write_corpus(tmp_path / "unchanged.jsonl", [d for d in b_docs if d["id"] not in changed | new][:10])
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("embeddings", "summary.json"):
        os.system(f"cp -r {root / 'a' / name} {partial}/")  # everything but the manifest: a run killed at commit
    damaged = tmp_path / "damaged"
    os.system(f"cp -r {root / 'a'} {damaged}")
    (parquet,) = glob.glob(f"{damaged}/embeddings/*.parquet")
    with open(parquet, "r+b") as f:
        f.truncate(100)
    flipped = tmp_path / "flipped"  # same size, one float's bits changed: only a checksum can tell
    os.system(f"cp -r {root / 'a'} {flipped}")
    (parquet,) = glob.glob(f"{flipped}/embeddings/*.parquet")
    with open(parquet, "r+b") as f:
        f.seek(os.path.getsize(parquet) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    for previous, reason in (
        (partial, "holds no committed docbeam run"),
        (damaged, "is missing or not the size its manifest says"),
        (flipped, "does not match the checksum its manifest lists"),
    ):
        summary = run_job(
            job_config(
                b_path, str(tmp_path / f"out-{previous.name}"), tiny_checkpoint_dir, input={"reuse_from": str(previous)}
            )
        )
        assert summary["docs_reused"] == 0 and reason in summary["reuse"]["reason"]


def doc(text: str) -> Document:
    return Document(id="d", text=text, source="s", line=1)


def previous_row(text: str, vector) -> dict:
    return {
        "id": "d",
        "embedding": vector,
        "num_tokens": 3,
        "num_windows": 1,
        "truncated": False,
        "content_hash": content_hash(text),
    }


def test_a_row_is_reused_only_for_the_same_text_and_a_sound_vector():
    from docbeam.models.heads.embedding import EmbeddingHead

    head = EmbeddingHead(
        name="embedding", pooling="mean", layers=(), width=2, folder="embeddings", normalize=True, truncate_dim=None
    )
    assert reusable_row(doc("same"), [previous_row("same", [0.6, 0.8])], head)["embedding"] == [0.6, 0.8]
    assert reusable_row(doc("same "), [previous_row("same", [0.6, 0.8])], head) is None
    assert reusable_row(doc("same"), [previous_row("same", [0.6, float("nan")])], head) is None
    assert reusable_row(doc("same"), [previous_row("same", [0.6, 0.8, 0.0])], head) is None
    assert reusable_row(doc("same"), [], head) is None


def test_the_content_hash_sees_every_character():
    assert content_hash("café") != content_hash("cafe\u0301")  # the tokenizer may normalise; the hash does not
    assert len(content_hash("x")) == 32


def test_key_differences_name_each_field_with_both_values():
    key = {
        "weights_digest": "a",
        "tokenizer_digest": "t",
        "window_len": 128,
        "stride": 32,
        "long_documents": "window",
        "pooling": "mean",
        "normalize": True,
        "dtype": "float32",
    }
    assert key_differences(key, key) == []
    assert key_differences({**key, "stride": 16}, key) == ["stride: 16 then, 32 now"]


def test_the_plans_reuse_key_holds_exactly_the_fields_reuse_compares(tiny_checkpoint_dir, tmp_path):
    """KEY_FIELDS is the one list of what must match: a field the plan adds there only would never be compared."""
    from docbeam.pipeline.driver.plan import make_plan

    plan = make_plan(job_config(SAMPLE, str(tmp_path / "out"), tiny_checkpoint_dir), probe_backends=False)
    assert tuple(plan.reuse_key) == KEY_FIELDS
    assert check_key(plan.reuse_key) is plan.reuse_key
    with pytest.raises(
        ValueError, match=r"fields \['attention'\] are not in .*KEY_FIELDS and \['stride'\] are missing"
    ):
        check_key({**{k: v for k, v in plan.reuse_key.items() if k != "stride"}, "attention": "flash"})


@pytest.mark.slow
def test_a_daily_job_can_reuse_the_folder_it_replaces(corpora, tiny_checkpoint_dir, tmp_path):
    a_path, b_path, changed, new, b_ids = corpora
    out = str(tmp_path / "daily")
    run_job(job_config(a_path, out, tiny_checkpoint_dir))
    summary = run_job(job_config(b_path, out, tiny_checkpoint_dir, input={"reuse_from": out}))
    assert (summary["docs_reused"], summary["docs_encoded"]) == (85, 15)
    assert sorted(rows(out)) == sorted(b_ids)
    assert len(glob.glob(f"{out}/embeddings/*.parquet")) == 1  # the previous run's file is gone after the commit


def test_a_garbled_previous_manifest_is_not_reused_and_fail_mode_refuses_it(tmp_path):
    from docbeam.pipeline.stages.reuse import decide

    (tmp_path / "_manifest.json").write_text('{"format": "docbeam.manifest/1", "run_id": ')  # cut mid-write
    key = {name: "x" for name in KEY_FIELDS}
    decision = decide(str(tmp_path), key, "encode_all")
    assert decision.source is None and "its manifest cannot be read" in decision.reason
    with pytest.raises(ConfigError, match="cannot be reused: its manifest cannot be read"):
        decide(str(tmp_path), key, "fail")


def committed_run(out: str, key: dict, rows: bytes) -> str:
    """A committed docbeam run whose embeddings file holds ``rows`` (decide() reads sizes and checksums only)."""
    from docbeam.pipeline.store import output, storage, transaction
    from docbeam.pipeline.store.lock import OutputLock

    held = OutputLock.acquire(out, "r1", heartbeat=False)
    output.mark_staging(out, "r1", held.fence.token)
    staged = f"{output.staging_dir(out, 'r1')}/embeddings/part-r1-00000-of-00001.parquet"
    storage.write_bytes(staged, rows)
    transaction.commit(out, held.fence, [staged], {"run_id": "r1"}, {"reuse_key": key})
    held.release()
    return f"{out}/embeddings/part-r1-00000-of-00001.parquet"


@pytest.mark.parametrize("where", ["a float", "the footer"])
def test_a_previous_file_damaged_at_its_size_is_not_reused_and_fail_mode_refuses_it(tmp_path, where):
    from docbeam.pipeline.stages.reuse import decide

    key = {name: "x" for name in KEY_FIELDS}
    rows = b"PAR1" + bytes(range(256)) * 4 + b"footer" + b"PAR1"
    path = committed_run(str(tmp_path / "previous"), key, rows)
    assert decide(str(tmp_path / "previous"), key, "encode_all").source is not None  # sound: reused
    damaged = bytearray(rows)
    damaged[100 if where == "a float" else -8] ^= 0x40  # one bit, same size
    with open(path, "wb") as f:
        f.write(damaged)
    decision = decide(str(tmp_path / "previous"), key, "encode_all")
    assert decision.source is None and "does not match the checksum its manifest lists" in decision.reason
    with pytest.raises(
        ConfigError,
        match="cannot be reused: its file embeddings/part-r1-00000-of-00001.parquet does not match the checksum",
    ):
        decide(str(tmp_path / "previous"), key, "fail")
