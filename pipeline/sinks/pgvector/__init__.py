"""output.pgvector: once the run is committed, the driver loads its rows into Postgres with pgvector, in one
transaction keyed by run id (load.py; what it reads of the committed run: rows.py). ``docbeam sync-pgvector``
loads a committed run again, e.g. after a failed load (safe to repeat: an applied run changes nothing)."""

from __future__ import annotations

import re

import pydantic

from docbeam.errors import ConfigError, readable
from docbeam.pipeline.sinks.registry import Sink, SinkCommand, SinkSection, float_vectors, needs_marks, register

TABLE_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*\.)?[A-Za-z_][A-Za-z0-9_]*$")
# Postgres' reserved key words (its documentation's appendix C, "reserved"): unquoted, none of them names a table.
RESERVED = frozenset(
    """all analyse analyze and any array as asc asymmetric both case cast check collate column constraint
create current_catalog current_date current_role current_time current_timestamp current_user default deferrable desc
distinct do else end except false fetch for foreign from grant group having in initially intersect into lateral
leading limit localtime localtimestamp not null offset on only or order placing primary references returning
select session_user some symmetric system_user table then to trailing true union unique user using variadic when
where window with authorization binary collation concurrently cross current_schema freeze full ilike inner is
isnull join left like natural notnull outer overlaps right similar tablesample verbose""".split()
)
MAX_NAME = 63 - len("_runs")  # Postgres truncates names past 63 bytes; <table>_runs must fit too


class PgvectorConfig(SinkSection):
    """Postgres with pgvector: the run's rows upserted in one transaction keyed by run id."""

    dsn: str  # a libpq connection string or URI, e.g. postgresql://user@host:5432/db (a password: use PGPASSWORD)
    table: str  # [schema.]name, created when missing
    # only the documents output.dedup kept: a marked one is not loaded, and its row from an earlier run goes
    skip_duplicates: bool = pydantic.Field(False, strict=True)

    def fits(self, job) -> None:
        float_vectors("pgvector", job.output.vector_dtype)
        if self.skip_duplicates:
            needs_marks("pgvector", job.output)
        if job.output.granularity == "chunk":
            raise ValueError(
                "output.pgvector loads a run's document rows, and output.granularity: chunk writes none "
                "(a load would find no rows and remove every row the output loaded before); set "
                "output.granularity: document or both"
            )

    def shown(self) -> dict:
        """A password in the dsn is not shown (a scheduler keeps what ``docbeam validate`` prints)."""
        return {**self.model_dump(mode="json"), "dsn": redacted_dsn(self.dsn)}

    @pydantic.field_validator("table")
    @classmethod
    def _plain_identifier(cls, table):
        if not TABLE_NAME.match(table):
            raise ValueError(
                f"{table!r} is not a plain [schema.]name of letters, digits and underscores "
                "(it is written into SQL unquoted), e.g. docbeam_embeddings or search.docs"
            )
        reserved = [part for part in table.split(".") if part.lower() in RESERVED]
        long = [part for part in table.split(".") if len(part) > MAX_NAME]
        if reserved or long:
            raise ValueError(
                f"{table!r}: "
                + (
                    f"{reserved[0]!r} is a reserved word in Postgres"
                    if reserved
                    else f"{long[0]!r} is longer than {MAX_NAME} characters (Postgres keeps 63, and "
                    f"{long[0]}_runs must fit)"
                )
                + "; choose another name, e.g. docbeam_embeddings"
            )
        return table


PASSWORD_IN_DSN = (re.compile(r"(://[^:/@]*:)[^@]*@"), re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)"))


def redacted_dsn(dsn: str) -> str:
    """``dsn`` with any password in it shown as ``***``: what docbeam prints and logs (the config itself keeps it)."""
    uri, keyword = PASSWORD_IN_DSN
    return keyword.sub(r"\1***", uri.sub(r"\1***@", dsn))


def check_head(head) -> None:
    """What the loader takes of the head's rows, at plan (the one place this sink reads the head; what a committed
    run's rows hold, the loader reads from its manifest: rows.table_layout)."""
    if not {c.kind for c in head.columns()} - {"multi_vector"}:  # a table row takes a vector or scores, not a list
        raise ConfigError(
            f"output.pgvector: model.head resolved to {head.name}, whose {head.folder}/ rows hold a "
            "list of token vectors per document, which the pgvector sink does not load; remove "
            "output.pgvector"
        )


def sync_arguments(parser) -> None:
    parser.add_argument("output", help="the output folder (output.path) whose committed run to load")
    parser.add_argument("--table", required=True, help="output.pgvector.table, e.g. docbeam_embeddings")
    parser.add_argument("--dsn", default="", help="output.pgvector.dsn (default: libpq's PG* environment variables)")
    parser.add_argument(
        "--skip-duplicates",
        action="store_true",
        help="output.pgvector.skip_duplicates: load only the documents the run's output.dedup kept",
    )


def sync_prepare(args) -> tuple[str, dict, PgvectorConfig]:
    """The target checked as the section would be, and the output's committed manifest; refused otherwise."""
    from docbeam.pipeline.sinks.dedup.settings import DUPLICATES
    from docbeam.pipeline.store import output as output_lib
    from docbeam.pipeline.store import paths

    try:
        target = PgvectorConfig(dsn=args.dsn, table=args.table, skip_duplicates=args.skip_duplicates)
    except pydantic.ValidationError as e:
        raise ConfigError(readable(e, prefix="sync-pgvector")) from None
    output = paths.normalize_folder(args.output)
    manifest = output_lib.read_manifest(output)
    if manifest is None:
        raise output_lib.OutputRefused(f"{output} holds no committed docbeam run (no {output_lib.MANIFEST})")
    if target.skip_duplicates and not any(output_lib.in_folder(f["path"], DUPLICATES) for f in manifest["files"]):
        raise output_lib.OutputRefused(
            f"sync-pgvector --skip-duplicates: run {manifest['run_id']} of {output} was not deduplicated (no "
            f"{DUPLICATES}/: output.dedup was off), so it marks nothing to skip; leave out --skip-duplicates"
        )
    return output, manifest, target


def sync_run(prepared: tuple[str, dict, PgvectorConfig]) -> str:
    from docbeam.pipeline.sinks.pgvector import load

    output, manifest, target = prepared
    done = load.load_committed(output, manifest, target.dsn, target.table, target.skip_duplicates)
    return f"docbeam: run {done['run_id']} of {output} " + (
        f"loaded into {target.table}: {done['upserted']} rows upserted, {done['deleted']} deleted"
        if done["applied"]
        else f"was already in {target.table}: nothing changed"
    )


SYNC = SinkCommand(
    "sync-pgvector",
    "load an output's committed run into Postgres, as output.pgvector does after a run (safe to repeat: an "
    "applied run changes nothing)",
    sync_arguments,
    sync_prepare,
    sync_run,
)


@register("pgvector")
class Pgvector(Sink):
    """Adds no files to the commit: its load sweeps the output's rows that the committed run no longer holds."""

    section = PgvectorConfig
    commands = (SYNC,)

    def check(self, cfg, head, kept) -> None:
        check_head(head)

    def preflight(self, section, wait: bool) -> None:
        from docbeam.pipeline.sinks.pgvector import load

        load.check_can_load(wait)

    def after_commit(self, output: str, manifest: dict, section) -> dict:
        from docbeam.pipeline.sinks.pgvector import load

        return load.load_committed(output, manifest, section.dsn, section.table, section.skip_duplicates)

    def summary_line(self, record: dict) -> str:
        if not record["applied"]:
            return f"  pgvector   run already in {record['table']}: nothing changed"
        return f"  pgvector   {record['table']}: {record['upserted']} rows upserted, {record['deleted']} deleted"
