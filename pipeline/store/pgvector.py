"""output.pgvector: a committed run's rows loaded into Postgres with pgvector, in ONE transaction per run.

docbeam's own commit (pipeline/store/transaction.py) comes first; then the driver loads the rows the committed
manifest lists: COPY into a temporary staging table, upsert into ``<table>`` (id primary key, the vector,
kept fields as jsonb, the run id), delete the ids the run removed (``removed/``), and record the run id in
``<table>_runs``, all in one transaction. So Postgres holds either all of a run or none of it: a load that is
killed or fails rolls back, and a run id already in ``<table>_runs`` is "already applied: change nothing", so
re-applying a run (``docbeam sync-pgvector``) is always safe. A load that fails leaves the run committed in
its output folder and Postgres one run behind; the error says how to re-apply it.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import numpy as np

from docbeam.pipeline.errors import JobFailed, Refused
from docbeam.pipeline.store import faults, storage
from docbeam.pipeline.store.output import EMBEDDINGS, ERRORS, REMOVED, SCORES, SUMMARY, in_folder
from docbeam.pipeline.store.paths import is_remote

ROW_COLUMNS = ("id", "embedding", "num_tokens", "num_windows", "truncated", "content_hash")  # not kept fields
SCORE_COLUMNS = ("id", "label", "score", "scores", "num_tokens", "num_windows", "truncated", "content_hash")
# A classifier's run (scores/) loads into a table of its own shape: the label, the top score, every label's
# score in id2label order (the names: the manifest's head.labels), the kept fields.
SCORES_TABLE = ("label text, score real NOT NULL, scores real[] NOT NULL", ("label", "score", "scores"),
                ["text", "text", "float4", "float4[]", "jsonb"])
STAGE = "docbeam_stage"


class PostgresBehind(JobFailed):
    """The run is committed to its output folder, but its rows are not in Postgres (exit 1)."""


class PgvectorRefused(Refused):
    """output.pgvector cannot be loaded as the run is started (exit 2, nothing touched)."""


def check_can_load(wait: bool) -> None:
    """The driver loads Postgres once the run is committed: it needs psycopg, and a driver that waits."""
    if not wait:
        raise PgvectorRefused("output.pgvector is loaded by the driver after the job commits, but --no-wait "
                              "returns before that; run without --no-wait, or drop output.pgvector and load the "
                              f"committed output afterwards with: {sync_command('<output>', '<table>')}")
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise PgvectorRefused(f"output.pgvector needs psycopg ({e}); install it with: pip install "
                              "'docbeam[pgvector]'") from None


def rows_folder(manifest: dict) -> str:
    """Where the committed run's rows are: its head's folder (a run before heads wrote embeddings/)."""
    return (manifest.get("head") or {}).get("folder", EMBEDDINGS)


def committed_scores(output: str, manifest: dict) -> Iterator[tuple]:
    """``(id, label, score, scores, kept fields as JSON)`` for every row of the committed scores files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    json_columns = {name for name, kind in (manifest.get("kept_fields") or {}).items() if kind == "json"}
    for f in manifest["files"]:
        if not in_folder(f["path"], SCORES):
            continue
        table = pq.read_table(pa.BufferReader(storage.read_bytes(storage.join(output, f["path"]))))
        kept = table.select([c for c in table.column_names if c not in SCORE_COLUMNS]).to_pylist()
        for row, fields in zip(table.select(["id", "label", "score", "scores"]).to_pylist(), kept):
            fields = {k: json.loads(v) if k in json_columns and v is not None else v for k, v in fields.items()}
            yield (row["id"], row["label"], row["score"], row["scores"],
                   json.dumps(fields, ensure_ascii=False, default=str))


def committed_rows(output: str, manifest: dict) -> Iterator[tuple[str, np.ndarray, str]]:
    """``(id, float32 vector, kept fields as JSON)`` for every row of the committed embeddings files. A kept
    column of JSON text (the manifest's ``kept_fields`` type ``json``: values of no one Arrow type) goes in as
    the JSON value it holds, not as a string."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    json_columns = {name for name, kind in (manifest.get("kept_fields") or {}).items() if kind == "json"}
    for f in manifest["files"]:
        if not in_folder(f["path"], EMBEDDINGS):
            continue
        table = pq.read_table(pa.BufferReader(storage.read_bytes(storage.join(output, f["path"]))))
        flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        vectors = np.asarray(flat, np.float32).reshape(table.num_rows, -1)
        kept = table.select([c for c in table.column_names if c not in ROW_COLUMNS]).to_pylist()
        for doc_id, vector, fields in zip(table.column("id").to_pylist(), vectors, kept):
            fields = {k: json.loads(v) if k in json_columns and v is not None else v for k, v in fields.items()}
            yield doc_id, vector, json.dumps(fields, ensure_ascii=False, default=str)


# Postgres' binary COPY: its signature, no flags, no header extension; a field count of -1 ends the data.
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)


def binary_row(doc_id: str, vector: np.ndarray, fields: str) -> bytes:
    """One tuple of binary COPY into (id text, embedding vector, fields jsonb): each field a length and its
    bytes; pgvector's binary vector is its dimension, a reserved 0 and big-endian float4s, so each float32
    goes in exactly as written, without a decimal round trip (ten times faster than text on a 384-wide vector)."""
    parts = [doc_id.encode("utf-8"), struct.pack(">hh", len(vector), 0) + vector.astype(">f4").tobytes(),
             b"\x01" + fields.encode("utf-8")]  # jsonb's binary form: version 1, then the JSON text
    return struct.pack(">h", len(parts)) + b"".join(struct.pack(">i", len(p)) + p for p in parts)


def removed_ids(output: str, manifest: dict) -> list[str]:
    """The ids the run removed (an incremental run's ``removed/``; none for a full run)."""
    return [line for f in manifest["files"] if in_folder(f["path"], REMOVED)
            for line in storage.read_bytes(storage.join(output, f["path"])).decode("utf-8").splitlines() if line]


def dimension(output: str) -> int:
    summary = json.loads(storage.read_bytes(storage.join(output, SUMMARY)))
    return int(summary["embedding_dim"])  # the width written (after model.truncate_dim)


def load(output: str, manifest: dict, dsn: str, table: str) -> dict:
    """Apply the committed run ``manifest`` of ``output`` to ``table`` in one transaction; what it did."""
    import psycopg

    run_id, runs = manifest["run_id"], f"{table}_runs"
    # One spelling per output in <table>_runs, whichever command loads it (`sync-pgvector out/daily` from a
    # shell, a run from its config's absolute path): a full run's sweep finds the earlier runs by it.
    output = output if is_remote(output) else os.path.abspath(output)
    scores = rows_folder(manifest) == SCORES
    columns = SCORES_TABLE[0] if scores else f"embedding vector({dimension(output)}) NOT NULL"
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:  # commits on leaving, rolls back on an error
        cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, {columns}, "
                    "fields jsonb NOT NULL DEFAULT '{}'::jsonb, run_id text NOT NULL)")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {runs} (run_id text PRIMARY KEY, output text NOT NULL, "
                    "upserted integer NOT NULL, deleted integer NOT NULL, "
                    "applied_at timestamptz NOT NULL DEFAULT now())")
        cur.execute(f"LOCK TABLE {runs} IN SHARE ROW EXCLUSIVE MODE")  # one load at a time per table
        cur.execute(f"SELECT run_id FROM {runs} WHERE run_id >= %s ORDER BY run_id DESC LIMIT 1", (run_id,))
        latest = cur.fetchone()
        if latest is not None and latest[0] == run_id:
            return {"table": table, "run_id": run_id, "applied": False, "reason": "already applied"}
        if latest is not None:
            raise PostgresBehind(f"{table} already holds run {latest[0]}, newer than run {run_id} of {output}; "
                                 "an older run is never applied over a newer one")
        check_follows(cur, runs, table, manifest)
        value_columns = copy_rows(cur, table, output, manifest, scores)
        listed = ", ".join(value_columns)
        cur.execute(f"INSERT INTO {table} (id, {listed}, fields, run_id) SELECT id, {listed}, fields, %s "
                    f"FROM {STAGE} ON CONFLICT (id) DO UPDATE SET "
                    + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*value_columns, "fields", "run_id")), (run_id,))
        upserted = cur.rowcount
        faults.before_change("delete", f"postgres:{table}")
        cur.execute(f"DELETE FROM {table} WHERE id = ANY(%s)", (removed_ids(output, manifest),))
        deleted = cur.rowcount + sweep_full_run(cur, table, output, manifest)
        cur.execute(f"INSERT INTO {runs} (run_id, output, upserted, deleted) VALUES (%s, %s, %s, %s)",
                    (run_id, output, upserted, deleted))
    return {"table": table, "run_id": run_id, "applied": True, "upserted": upserted, "deleted": deleted}


def copy_rows(cur, table: str, output: str, manifest: dict, scores: bool) -> tuple[str, ...]:
    """The committed rows COPYed into the transaction's staging table; the value columns it holds."""
    if scores:
        definition, value_columns, types = SCORES_TABLE
        cur.execute(f"CREATE TEMP TABLE {STAGE} (id text, {definition.replace(' NOT NULL', '')}, fields jsonb) "
                    "ON COMMIT DROP")
        with cur.copy(f"COPY {STAGE} (id, {', '.join(value_columns)}, fields) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            from psycopg.types.json import Jsonb

            for *values, fields in committed_scores(output, manifest):
                faults.before_change("write", f"postgres:{table}")
                copy.write_row((*values, Jsonb(json.loads(fields))))
        return value_columns
    dim = dimension(output)
    cur.execute(f"CREATE TEMP TABLE {STAGE} (id text, embedding vector({dim}), fields jsonb) ON COMMIT DROP")
    with cur.copy(f"COPY {STAGE} (id, embedding, fields) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(COPY_HEADER)
        for row in committed_rows(output, manifest):
            faults.before_change("write", f"postgres:{table}")
            copy.write(binary_row(*row))
        copy.write(COPY_TRAILER)
    return ("embedding",)


FILE_LEVEL = ("unreadable_file", "truncated_file")  # errors/ kinds that name no documents


def sweep_full_run(cur, table: str, output: str, manifest: dict) -> int:
    """A full run replaces its output, so its documents are all this output has: rows an earlier run of the
    same output loaded that this run neither wrote nor rejected left the input, and go (an incremental run
    lists its removals in ``removed/`` instead). Rows of other outputs loaded into the table are left alone.
    Skipped when the run rejected a whole file: a file it could not read names no documents, and a flaky read
    must not empty the index of that file's documents. The rows deleted."""
    if (manifest.get("reused_from") or {}).get("run_id"):
        return 0
    errors = [json.loads(line) for f in manifest["files"] if in_folder(f["path"], ERRORS)
              for line in storage.read_bytes(storage.join(output, f["path"])).decode("utf-8").splitlines()
              if line.strip()]
    if any(e.get("kind") in FILE_LEVEL for e in errors):
        return 0
    cur.execute(f"DELETE FROM {table} WHERE run_id <> %s AND run_id IN (SELECT run_id FROM {table}_runs WHERE "
                "output = %s) AND NOT (id = ANY(%s))",
                (manifest["run_id"], output, [e["id"] for e in errors if e.get("id") is not None]))
    return cur.rowcount


def check_follows(cur, runs: str, table: str, manifest: dict) -> None:
    """An incremental run's removals are relative to its reuse source: applied over a table that missed that
    run, the source's own removals would never be deleted. So the source must be applied first (unless the
    table has applied nothing yet: then this run is its first)."""
    source = (manifest.get("reused_from") or {}).get("run_id")
    if source is None:
        return
    cur.execute(f"SELECT count(*), count(*) FILTER (WHERE run_id = %s) FROM {runs}", (source,))
    applied, has_source = cur.fetchone()
    if applied and not has_source:
        origin = manifest["reused_from"].get("from")
        raise PostgresBehind(f"run {manifest['run_id']} carries over run {source} of {origin}, which {table} has "
                             f"not applied, so that run's removals would be missed; apply it first "
                             f"({sync_command(origin, table)}), then this run")


def sync_command(output: str, table: str) -> str:
    return f'docbeam sync-pgvector {output} --table {table} --dsn "$DSN"'


def load_committed(output: str, manifest: dict, dsn: str, table: str) -> dict:
    """``load``, whose failure says that the run is committed and how to bring Postgres up to it."""
    try:
        return load(output, manifest, dsn, table)
    except PostgresBehind:
        raise
    except Exception as e:  # noqa: BLE001  any failure of the load: Postgres rolled it back
        raise PostgresBehind(
            f"run {manifest['run_id']} is committed to {output}, but loading it into Postgres table {table} "
            f"failed ({type(e).__name__}: {str(e).strip()}) and was rolled back, so the table is one run behind. "
            f"Re-apply it (safe to repeat) with: {sync_command(output, table)}") from e
