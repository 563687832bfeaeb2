"""What the head the plan resolved (models/heads/) means for the rest of the job: which outputs can take its rows,
which columns ``output.select.where`` may read, and how its documents are tokenized."""

from __future__ import annotations

from docbeam.config import ConfigError, EmbedConfig, JobConfig, TokenizeConfig
from docbeam.models.heads import Head
from docbeam.pipeline.stages.keep import KeptFields


def check_selection(cfg: JobConfig | EmbedConfig, head: Head, kept: KeptFields) -> None:
    """``output.select.where`` reads only columns the head's rows have (or kept fields), and labels it has."""
    select = cfg.output.select if isinstance(cfg, JobConfig) else None
    if select is None:
        return
    from docbeam.selection import columns_named, labels_named, parse

    tree = parse(select.where)
    have = [
        "id",
        *(c.name for c in head.columns()),
        "num_tokens",
        "num_windows",
        "truncated",
        *(c.name for c in kept.columns),
    ]
    unknown = sorted(columns_named(tree) - set(have))
    if unknown and not (kept.every_field and not kept.columns):  # a dry run of keep_fields "*": not typed yet
        raise ConfigError(
            f"output.select.where: {select.where!r} reads {unknown}, which the {head.folder}/ rows do "
            f"not have; their columns: {', '.join(have)} (a field of the input: add it to "
            "input.keep_fields)"
        )
    labels = getattr(head, "labels", ())
    missing = sorted(labels_named(tree) - set(labels))
    if missing:
        raise ConfigError(
            f"output.select.where: {select.where!r} names labels {missing}, which "
            f"{head.carried or 'the checkpoint'} does not have; its labels: {', '.join(labels)}"
        )


def check_kept_fields(head: Head, kept: KeptFields) -> None:
    """A kept field may not take the name of a column the resolved head writes (the classifier's label, score and
    scores, the sparse and multi-vector heads' own): it would overwrite it. keep.OUTPUT_COLUMNS holds the columns
    every run writes; these are the head's, so an embedding job keeps an input field named score."""
    taken = sorted({c.name for c in head.columns()} & {c.name for c in kept.columns})
    if taken:
        raise ConfigError(
            f"input.keep_fields: {taken} name columns the {head.name} head writes to {head.folder}/, which the kept "
            "field would overwrite; remove them from the list (or rename the fields in the input)"
        )


def tokenize_for(cfg: JobConfig | EmbedConfig, head: Head) -> TokenizeConfig:
    if getattr(head, "windows", None) == "first":
        return cfg.tokenize.model_copy(update={"long_documents": "truncate"})
    return cfg.tokenize


def vector_dtype(cfg: JobConfig | EmbedConfig) -> str:
    return cfg.output.vector_dtype if isinstance(cfg, JobConfig) else "float32"


def check_head_fits_output(cfg: JobConfig | EmbedConfig, head: Head) -> None:
    """What only document vectors can feed (quantized dtypes, chunk rows, Vector Search) is refused for a head
    that writes other rows, naming the key; a reduced precision's gate measures vectors only."""
    if head.name == "embedding":
        return
    rows = f"model.head resolved to {head.name} ({head.carried}), which writes {head.folder}/ rows"
    if cfg.model.dtype != "float32" and cfg.model.precision_gate == "enforce":
        raise ConfigError(
            f"model.dtype: {cfg.model.dtype}: {rows}, and the precision gate (model.precision_gate: "
            "enforce) measures embeddings only; set model.dtype: float32, or model.precision_gate: "
            "warn (or off) to run it unmeasured"
        )
    if not isinstance(cfg, JobConfig):
        return
    out = cfg.output
    dtypes = getattr(head, "vector_dtypes", ("float32",))  # a multi-vector head writes float16 too
    # A sparse head's chunk rows are its windows' sparse vectors (pipeline/stages/window_chunks.py); late chunking
    # pools dense spans, which a vocabulary-wide reduce over every token does not.
    granularities = ("document", "chunk", "both") if head.name == "sparse" else ("document",)
    for key, value, allowed in (
        ("vector_dtype", out.vector_dtype, dtypes),
        ("granularity", out.granularity, granularities),
        ("chunking", out.chunking, ("window",)),
    ):
        if value not in allowed:
            raise ConfigError(
                f"output.{key}: {value}: {rows}, not one dense vector per document; set output.{key}: "
                f"{' or '.join(allowed)} (or model.head: embedding to embed with its backbone)"
            )
