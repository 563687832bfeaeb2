"""The job's ``input`` and ``output`` sections: where documents come from, which of their fields travel on, and
what a run writes (granularity, vector dtype, the sinks beside Parquet). Validated once, like every section."""

from __future__ import annotations

import re
from typing import Literal

import pydantic

from docbeam import placeholders
from docbeam.pipeline.store.paths import normalize_folder


class Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class ClassifierOptions(Section):
    """How the classifier head scores a document longer than one window: ``first``, by its first window's logits
    (transformers' pipeline truncates); ``mean``, every window's, token-weighted, before softmax or sigmoid."""

    windows: Literal["first", "mean"] = "first"


class SparseOptions(Section):
    """The sparse head (models/heads/sparse.py): ``windows`` first (SparseEncoder truncates) or all (combined as
    the SpladePooling pools: max over windows, or their sum); then, lossy, drop values below ``threshold`` and
    keep at most ``max_terms`` terms (the largest)."""

    windows: Literal["first", "all"] = "first"
    max_terms: pydantic.PositiveInt | None = None
    threshold: pydantic.PositiveFloat | None = None


class InputConfig(Section):
    path: str  # a file, a glob, a list separated by commas; local or gs://
    format: Literal["auto", "jsonl", "text"] = "auto"  # auto: *.jsonl[.gz|.bz2], *.ndjson[.gz] → jsonl; else text
    id_field: str = "id"
    text_field: str = "text"
    # Fields of each JSONL record carried to every output row as they are (their JSON types); "*": all of them.
    keep_fields: tuple[str, ...] | Literal["*"] = ()
    max_line_bytes: pydantic.PositiveInt = 1_000_000  # a JSONL line or a text file larger than this is rejected
    # A run that rejects a larger share of the documents it read fails (exit 1, nothing committed).
    max_rejected_fraction: float = pydantic.Field(0.1, ge=0.0, le=1.0)
    reuse_from: str | None = None  # an earlier docbeam output whose vectors unchanged documents carry over
    reuse_mismatch: Literal["encode_all", "fail"] = "encode_all"  # when reuse_from cannot be reused

    @pydantic.field_validator("reuse_from")
    @classmethod
    def _reuse_one_folder(cls, path):
        return None if path is None else one_folder(path)

    @pydantic.field_validator("keep_fields")
    @classmethod
    def _distinct_names(cls, fields):
        if fields == "*":
            return fields
        empty = [f for f in fields if not f.strip()]
        if empty or len(set(fields)) != len(fields):
            raise ValueError(
                f'list each field once, by its name in the JSONL records (got {list(fields)}), or "*" for all of them'
            )
        return fields

    @property
    def patterns(self) -> tuple[str, ...]:
        """The comma-separated files and globs of ``path``, in order, without repeats."""
        return tuple(dict.fromkeys(p.strip() for p in self.path.split(",") if p.strip()))


GLOB_CHARACTERS = "*?[]{}"


def one_folder(path: str) -> str:
    """An output-like path names exactly one place: no globs, no lists, not the home or a bucket's root."""
    bad = sorted({c for c in placeholders.without_path_placeholders(path) if c in GLOB_CHARACTERS + ","})
    if bad:
        raise ValueError(
            f"must be one folder, without glob characters or commas (found {' '.join(bad)}); "
            "a run replaces what is there, so it names exactly one place (placeholders: "
            f"{', '.join(placeholders.PATH_PLACEHOLDERS)})"
        )
    if path.strip().rstrip("/") in ("", "~", "gs:"):
        raise ValueError("must name a folder for this job's output, e.g. out/local or gs://bucket/runs/today")
    return path


class VertexAIConfig(Section):
    """Vector Search's batch layout beside Parquet; ``true`` in YAML is this with no restricts."""

    restricts: tuple[str, ...] = ()  # kept fields whose values become `restricts` (namespace = field name)

    def fits(self, job) -> None:
        """Restricts name kept fields, and vectors are floats: checked with the config (the head's part at plan)."""
        float_vectors("vertex_ai", job.output.vector_dtype)
        if job.input.keep_fields != "*":
            missing = [f for f in self.restricts if f not in job.input.keep_fields]
            if missing:
                raise ValueError(
                    f"output.vertex_ai.restricts names {missing}, which input.keep_fields "
                    f"{list(job.input.keep_fields)} does not keep; add them to input.keep_fields"
                )


def float_vectors(key: str, vector_dtype: str) -> None:
    if vector_dtype not in ("float32", "float16"):
        raise ValueError(
            f"output.{key} loads float vectors, but output.vector_dtype is {vector_dtype}; set "
            "output.vector_dtype: float32 (or float16)"
        )


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


class PgvectorConfig(Section):
    """Postgres with pgvector: the run's rows upserted in one transaction keyed by run id."""

    dsn: str  # a libpq connection string or URI, e.g. postgresql://user@host:5432/db (a password: use PGPASSWORD)
    table: str  # [schema.]name, created when missing

    def fits(self, job) -> None:
        float_vectors("pgvector", job.output.vector_dtype)
        if job.output.granularity == "chunk":
            raise ValueError(
                "output.pgvector loads a run's document rows, and output.granularity: chunk writes none "
                "(a load would find no rows and remove every row the output loaded before); set "
                "output.granularity: document or both"
            )

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


class SelectConfig(Section):
    """``selected/``: the ids (and optionally texts) of the documents whose row meets ``where``, committed with the
    run: a curation job's kept set (docbeam/selection.py has the grammar)."""

    where: str  # e.g. "score >= 3", "label in [en, de]"
    with_text: bool = False  # each selected line carries the document's text too

    @pydantic.field_validator("where")
    @classmethod
    def _parses(cls, where):
        from docbeam.selection import SelectionError, parse

        try:
            parse(where)
        except SelectionError as e:
            raise ValueError(str(e)) from None
        return where


# The sinks' typed sections, by their key under output (each registered in pipeline/driver/sinks.py).
SINK_SECTIONS = {"vertex_ai": VertexAIConfig, "pgvector": PgvectorConfig}


class OutputConfig(Section):
    path: str  # one folder (local or gs://): no globs, no lists; docbeam replaces only its own runs there
    num_shards: pydantic.NonNegativeInt = 0  # 0: the runner decides
    mode: Literal["replace", "fail_if_exists"] = "replace"  # what to do when the folder holds an earlier run
    granularity: Literal["document", "chunk", "both"] = "document"  # chunk: one row per window, with offsets
    chunk_text: bool = True  # chunk rows carry the chunk's text (false: offsets only)
    # late: each chunk's vector pooled from a forward over its whole document (pipeline/stages/late_chunking.py)
    chunking: Literal["window", "late"] = "window"
    vector_dtype: Literal["float32", "float16", "int8", "uint8", "binary"] = "float32"
    vertex_ai: VertexAIConfig | None = None
    pgvector: PgvectorConfig | None = None
    select: SelectConfig | None = None  # selected/: the documents whose row meets select.where

    @pydantic.field_validator("path")
    @classmethod
    def _one_plain_folder(cls, path):
        # Normalised once, here: `//`, `/./` or `/../` would otherwise make the commit's own files look
        # outside the folder to its clean-up (pipeline/store/output.inside compares plain prefixes).
        return normalize_folder(one_folder(path).strip())

    @pydantic.model_validator(mode="after")
    def _late_chunks_need_chunk_rows(self):
        if self.chunking == "late" and self.granularity == "document":
            raise ValueError(
                "output.chunking: late makes chunk rows, but output.granularity: document writes none; "
                "set output.granularity: chunk (or both), or leave output.chunking: window"
            )
        return self

    @pydantic.field_validator("vertex_ai", mode="before")
    @classmethod
    def _true_means_defaults(cls, value):
        return {} if value is True else None if value is False else value
