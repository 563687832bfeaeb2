"""output.pgvector: a committed run's rows loaded into Postgres with pgvector, in ONE transaction per run.

docbeam's own commit (pipeline/store/transaction.py) comes first; then the driver loads the rows the committed
manifest lists, once their checksums match it: COPY into a temporary staging table, upsert into ``<table>`` (id
primary key, the vector or the scores, kept fields as jsonb, the run id), delete this output's rows that the run
no longer holds (``sweep``), and record the run id in ``<table>_runs``, all in one transaction. A run's rows are
every document it holds, reused ones included, so any run of an output brings the table to that run, whatever
the table missed before; rows other outputs loaded into the table are never touched. So Postgres holds either all of a run or none of it: a load that is
killed or fails rolls back, and a run id already in ``<table>_runs`` is "already applied: change nothing", so
re-applying a run (``docbeam sync-pgvector``) is always safe. A load that fails leaves the run committed in
its output folder and Postgres one run behind; the error says how to re-apply it.
"""

from __future__ import annotations

import json
import os

from docbeam.errors import Refused
from docbeam.pipeline.sinks.dedup.earlier import marked_ids
from docbeam.pipeline.sinks.pgvector.rows import (
    COPY_HEADER,
    COPY_TRAILER,
    SCORES_TABLE,
    check_files,
    committed_scores,
    load_problem,
    table_layout,
    vector_layout,
)
from docbeam.pipeline.sinks.registry import SinkBehind
from docbeam.pipeline.store import faults, storage
from docbeam.pipeline.store.output import ERRORS, in_folder
from docbeam.pipeline.store.paths import is_remote

STAGE = "docbeam_stage"
# Run ids compare as docbeam orders them (output.new_run_id: code point order), whatever the database's collation.
BY_ID = 'COLLATE "C"'


class PostgresBehind(SinkBehind):
    """The run is committed to its output folder, but its rows are not in Postgres (exit 1)."""


class PgvectorRefused(Refused):
    """output.pgvector cannot be loaded as the run is started (exit 2, nothing touched)."""


def check_can_load(wait: bool) -> None:
    """The driver loads Postgres once the run is committed: it needs psycopg, and a driver that waits."""
    if not wait:
        raise PgvectorRefused(
            "output.pgvector is loaded by the driver after the job commits, but --no-wait "
            "returns before that; run without --no-wait, or drop output.pgvector and load the "
            f"committed output afterwards with: {sync_command('<output>', '<table>')}"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise PgvectorRefused(
            f"output.pgvector needs psycopg ({e}); install it with: pip install 'docbeam[pgvector]'"
        ) from None


def load(output: str, manifest: dict, dsn: str, table: str, skip_duplicates: bool = False) -> dict:
    """Apply the committed run ``manifest`` of ``output`` to ``table`` in one transaction; what it did."""
    import psycopg

    run_id, runs = manifest["run_id"], f"{table}_runs"
    # One spelling per output in <table>_runs, whichever command loads it (`sync-pgvector out/daily` from a
    # shell, a run from its config's absolute path): the sweep and the order of runs are per output.
    output = output if is_remote(output) else os.path.abspath(output)
    check_files(output, manifest)
    layout = table_layout(manifest)
    scores = layout.kind == "scores"
    columns = SCORES_TABLE[0] if scores else ", ".join(f"{c} NOT NULL" for c in vector_layout(output, manifest)[0])
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:  # commits on leaving, rolls back on an error
        # Two first loads into a new table would race on CREATE: one at a time per table name, from here on.
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"docbeam:{table}",))
        cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, {columns}, "
            "fields jsonb NOT NULL DEFAULT '{}'::jsonb, run_id text NOT NULL)"
        )
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {runs} (run_id text PRIMARY KEY, output text NOT NULL, "
            "upserted integer NOT NULL, deleted integer NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cur.execute(f"ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS lineage text")  # tables loaded before lineages
        cur.execute(f"LOCK TABLE {runs} IN SHARE ROW EXCLUSIVE MODE")  # one load at a time per table
        lineage = lineage_of(cur, runs, output, manifest)
        cur.execute(
            f"SELECT run_id FROM {runs} WHERE ({LINEAGE} = %s AND run_id {BY_ID} > %s) OR run_id = %s "
            f"ORDER BY run_id {BY_ID} DESC LIMIT 1",
            (lineage, run_id, run_id),
        )
        newer = cur.fetchone()
        if newer is not None and newer[0] == run_id:
            return {"table": table, "run_id": run_id, "applied": False, "reason": "already applied"}
        if newer is not None:
            raise PostgresBehind(
                f"{table} already holds run {newer[0]} of the outputs {output} carries on from "
                f"({lineage}), newer than run {run_id}; an older run is never applied over a newer one"
            )
        skipped = marked_ids(output, manifest) if skip_duplicates else frozenset()
        value_columns, rejected = copy_rows(cur, table, output, manifest, scores, skipped)
        listed = ", ".join(value_columns)
        cur.execute(
            f"INSERT INTO {table} (id, {listed}, fields, run_id) SELECT id, {listed}, fields, %s "
            f"FROM {STAGE} ON CONFLICT (id) DO UPDATE SET "
            + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*value_columns, "fields", "run_id")),
            (run_id,),
        )
        upserted = cur.rowcount
        faults.before_change("delete", f"postgres:{table}")
        deleted = sweep(
            cur, table, lineage, manifest, output, [r["id"] for r in rejected if load_problem(r["id"], "") is None]
        ) + unload(cur, table, lineage, skipped)
        cur.execute(
            f"INSERT INTO {runs} (run_id, output, upserted, deleted, lineage) VALUES (%s, %s, %s, %s, %s)",
            (run_id, output, upserted, deleted, lineage),
        )
    left_out = layout.not_loaded
    return {
        "table": table,
        "run_id": run_id,
        "applied": True,
        "upserted": upserted,
        "deleted": deleted,
        **({"not_loaded": left_out} if left_out else {}),
        **({"skipped_duplicates": len(skipped)} if skip_duplicates else {}),
        **({"rejected": len(rejected), "rejections": rejected[:20]} if rejected else {}),
    }


def copy_rows(
    cur, table: str, output: str, manifest: dict, scores: bool, skipped: frozenset = frozenset()
) -> tuple[tuple[str, ...], list[dict]]:
    """The committed rows COPYed into the transaction's staging table: (the value columns it holds, the rows
    Postgres cannot take, each ``{"id", "reason"}``, left out). ``skipped``: ids not loaded (marked duplicates),
    whose rows from earlier runs the sweep then removes."""
    rejected = []

    def loadable(rows):
        for row in rows:
            if row[0] in skipped:
                continue
            problem = load_problem(row[0], row[-1])
            if problem is None:
                faults.before_change("write", f"postgres:{table}")
                yield row
            else:
                rejected.append({"id": row[0], "reason": problem})

    if scores:
        from psycopg.types.json import Jsonb

        definition, value_columns, types = SCORES_TABLE
        cur.execute(
            f"CREATE TEMP TABLE {STAGE} (id text, {definition.replace(' NOT NULL', '')}, fields jsonb) ON COMMIT DROP"
        )
        with cur.copy(f"COPY {STAGE} (id, {', '.join(value_columns)}, fields) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(types)
            for *values, fields in loadable(committed_scores(output, manifest)):
                copy.write_row((*values, Jsonb(json.loads(fields))))
        return value_columns, rejected
    columns, rows, binary = vector_layout(output, manifest)
    cur.execute(f"CREATE TEMP TABLE {STAGE} (id text, {', '.join(columns)}, fields jsonb) ON COMMIT DROP")
    names = tuple(c.split()[0] for c in columns)
    with cur.copy(f"COPY {STAGE} (id, {', '.join(names)}, fields) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(COPY_HEADER)
        for row in loadable(rows):
            copy.write(binary(row))
        copy.write(COPY_TRAILER)
    return names, rejected


FILE_LEVEL = ("unreadable_file", "truncated_file")  # errors/ kinds that name no documents


LINEAGE = "COALESCE(lineage, output)"  # a run loaded before lineages were recorded is its own output's


def lineage_of(cur, runs: str, output: str, manifest: dict, hops: int = 32) -> str:
    """The outputs a run carries on from, named by the first of them: an incremental run (``reused_from``) is
    its source's lineage, found by the source's run id in the table, else by its output's earlier runs, else by
    following the source's own manifest back; a full run whose output the table knows keeps that lineage; the
    chain's root otherwise. A run's rows are every document of its lineage, so its load sweeps that lineage:
    removals of runs the table missed included, other lineages (other outputs in the table) never."""
    from docbeam.pipeline.store.output import read_manifest

    def known(where: str, value: str) -> str | None:
        cur.execute(f"SELECT {LINEAGE} FROM {runs} WHERE {where} = %s ORDER BY run_id {BY_ID} DESC LIMIT 1", (value,))
        row = cur.fetchone()
        return row and row[0]

    current, root = manifest, output
    for _ in range(hops):
        source = current.get("reused_from") or {}
        if not source.get("run_id") or not source.get("from"):
            break
        found = known("run_id", source["run_id"]) or known("output", source["from"])
        if found:
            return found
        root = source["from"] if is_remote(source["from"]) else os.path.abspath(source["from"])
        try:
            current = read_manifest(root)
        except Exception:  # noqa: BLE001  a source gone or unreadable: the chain ends at it
            current = None
        if current is None:
            break
    return known("output", output) or root


def sweep(cur, table: str, lineage: str, manifest: dict, output: str, kept_ids: list[str]) -> int:
    """The run's rows are every document of its lineage (reused ones too), so rows of that lineage the run
    neither holds nor rejected left the input, and go: an incremental run's removals, and those of any run the
    table missed. Other lineages' rows are left alone. A rejected document's row stays (a rejection says nothing
    about whether it still exists), and so does one the load could not take (``kept_ids``). Skipped when the run
    rejected a whole file or a record without an id: those name no documents, and a flaky read must not empty
    the index of them. The rows deleted."""
    errors = [
        json.loads(line)
        for f in manifest["files"]
        if in_folder(f["path"], ERRORS)
        for line in storage.read_bytes(storage.join(output, f["path"])).decode("utf-8").splitlines()
        if line.strip()
    ]
    if any(e.get("kind") in FILE_LEVEL or e.get("id") is None for e in errors):
        return 0
    cur.execute(
        f"DELETE FROM {table} WHERE run_id <> %s AND run_id IN (SELECT run_id FROM {table}_runs WHERE "
        f"{LINEAGE} = %s) AND NOT (id = ANY(%s))",
        (manifest["run_id"], lineage, [e["id"] for e in errors] + kept_ids),
    )
    return cur.rowcount


def unload(cur, table: str, lineage: str, ids: frozenset) -> int:
    """The rows of this output's lineage whose documents the run marked as duplicates (``skip_duplicates``): gone
    whether or not the sweep ran (it is skipped when a rejection names no document); other lineages' rows stay."""
    if not ids:
        return 0
    cur.execute(
        f"DELETE FROM {table} WHERE id = ANY(%s) AND run_id IN (SELECT run_id FROM {table}_runs WHERE {LINEAGE} = %s)",
        (sorted(ids), lineage),
    )
    return cur.rowcount


def sync_command(output: str, table: str) -> str:
    return f'docbeam sync-pgvector {output} --table {table} --dsn "$DSN"'


def load_committed(output: str, manifest: dict, dsn: str, table: str, skip_duplicates: bool = False) -> dict:
    """``load``, whose failure says that the run is committed and how to bring Postgres up to it."""
    try:
        return load(output, manifest, dsn, table, skip_duplicates)
    except PostgresBehind:
        raise
    except Exception as e:  # noqa: BLE001  any failure of the load: Postgres rolled it back
        raise PostgresBehind(
            f"run {manifest['run_id']} is committed to {output}, but loading it into Postgres table {table} "
            f"failed ({type(e).__name__}: {str(e).strip()}) and was rolled back, so the table is one run behind. "
            f"Re-apply it (safe to repeat) with: {sync_command(output, table)}"
        ) from e
