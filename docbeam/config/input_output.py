"""The job's ``input`` and ``output`` sections: where documents come from, which of their fields travel on, and
what a run writes (granularity, vector dtype, and a section per sink beside Parquet: pipeline/sinks/). Validated
once, like every section."""

from __future__ import annotations

from typing import Literal

import pydantic

from docbeam import placeholders
from docbeam.pipeline import sinks
from docbeam.pipeline.store.paths import is_gcs, normalize_folder, split_gcs


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
    # Judged as the run will use it, normalised: /tmp/.. is the filesystem's root, gs://b/x/.. the bucket's.
    stripped = path.strip()
    normal = normalize_folder(stripped) if stripped.rstrip("/") not in ("", "gs:") else ""
    bucket_root = is_gcs(normal) and not split_gcs(normal)[1]
    home = stripped.rstrip("/") == "~"
    if stripped.rstrip("/") in ("", "gs:") or home or normal in ("", "/") or bucket_root:
        what = "your home folder" if home else "a bucket's root" if bucket_root else "the filesystem's root"
        raise ValueError(
            f"must name a folder for this job's output, not {what} ({path!r}), e.g. out/local or gs://bucket/runs/today"
        )
    return path


class SelectConfig(Section):
    """``selected/``: the ids (and optionally texts) of the documents whose row meets ``where``, committed with the
    run: a curation job's kept set (docbeam/selection.py has the grammar)."""

    where: str  # e.g. "score >= 3", "label in [en, de]"
    with_text: pydantic.StrictBool = False  # each selected line carries the document's text too

    @pydantic.field_validator("where")
    @classmethod
    def _parses(cls, where):
        from docbeam.selection import SelectionError, parse

        try:
            parse(where)
        except SelectionError as e:
            raise ValueError(str(e)) from None
        return where


class OutputFields(Section):
    """``output`` but the sinks' sections (OutputConfig adds one per registered sink)."""

    path: str  # one folder (local or gs://): no globs, no lists; docbeam replaces only its own runs there
    num_shards: pydantic.NonNegativeInt = 0  # 0: the runner decides
    mode: Literal["replace", "fail_if_exists"] = "replace"  # what to do when the folder holds an earlier run
    granularity: Literal["document", "chunk", "both"] = "document"  # chunk: one row per window, with offsets
    chunk_text: pydantic.StrictBool = True  # chunk rows carry the chunk's text (false: offsets only)
    # late: each chunk's vector pooled from a forward over its whole document (pipeline/stages/late_chunking.py)
    chunking: Literal["window", "late"] = "window"
    vector_dtype: Literal["float32", "float16", "int8", "uint8", "binary"] = "float32"

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

    @pydantic.model_validator(mode="before")
    @classmethod
    def _sinks_read_their_yaml(cls, raw):
        """A sink's YAML value as the sink reads it (e.g. ``true``: its section's defaults)."""
        if not isinstance(raw, dict):
            return raw
        return {k: sinks.SINKS[k].section.from_yaml(v) if k in sinks.SINKS else v for k, v in raw.items()}


# output.<key> for each registered sink (pipeline/sinks/), off (None) unless the YAML names it.
OutputConfig = pydantic.create_model(
    "OutputConfig",
    __base__=OutputFields,
    __module__=__name__,
    **{key: (sink.section | None, None) for key, sink in sinks.SINKS.items()},
    select=(SelectConfig | None, None),  # selected/: the documents whose row meets select.where
)
