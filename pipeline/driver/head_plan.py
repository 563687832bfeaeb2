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
    from docbeam.pipeline import sinks
    from docbeam.selection import SelectionError, check_types, columns_named, labels_named, parse

    tree = parse(select.where)
    marks = {name: kind for sink, _ in sinks.active(cfg) for name, kind in sink.select_columns.items()}
    have = [*(f.name for f in head.row_fields()), *(c.name for c in kept.columns), *marks]
    unknown = sorted(columns_named(tree) - set(have))
    if unknown and not (kept.every_field and not kept.columns):  # a dry run of keep_fields "*": not typed yet
        raise ConfigError(
            f"output.select.where: {select.where!r} reads {unknown}, which the {head.folder}/ rows do "
            f"not have; their columns: {', '.join(have)} (a field of the input: add it to "
            "input.keep_fields)"
        )
    try:
        kinds = {f.name: arrow_kind(f.type) for f in head.row_fields()}
        # a JSON-text column holds values of several types: compared as its values, not checked here
        kinds |= {c.name: "other" if c.arrow is None else arrow_kind(c.arrow) for c in kept.columns} | marks
        check_types(tree, kinds)
    except SelectionError as e:
        raise ConfigError(f"output.select.where: {e}") from None
    labels = head.labels
    missing = sorted(labels_named(tree) - set(labels))
    if missing:
        raise ConfigError(
            f"output.select.where: {select.where!r} names labels {missing}, which "
            f"{head.carried or 'the checkpoint'} does not have; its labels: {', '.join(labels)}"
        )


def arrow_kind(arrow) -> str:
    """An Arrow column's kind as output.select's type check names them (docbeam/selection.py kind_of)."""
    import pyarrow as pa

    if pa.types.is_boolean(arrow):
        return "bool"
    if pa.types.is_integer(arrow) or pa.types.is_floating(arrow):
        return "number"
    if pa.types.is_string(arrow) or pa.types.is_large_string(arrow):
        return "string"
    return "list" if pa.types.is_list(arrow) or pa.types.is_large_list(arrow) else "other"


def check_kept_fields(head: Head, kept: KeptFields) -> None:
    """A kept field may not take the name of a column the resolved head writes: it would overwrite it.
    keep.OUTPUT_COLUMNS refuses every built-in head's column names for every run (the input's own check); this
    catches a user's head whose columns are named otherwise."""
    taken = sorted({c.name for c in head.columns()} & {c.name for c in kept.columns})
    if taken:
        raise ConfigError(
            f"input.keep_fields: {taken} name columns the {head.name} head writes to {head.folder}/, which the kept "
            "field would overwrite; remove them from the list (or rename the fields in the input)"
        )


def tokenize_for(cfg: JobConfig | EmbedConfig, head: Head) -> TokenizeConfig:
    if head.windows == "first":
        return cfg.tokenize.model_copy(update={"long_documents": "truncate"})
    return cfg.tokenize


def vector_dtype(cfg: JobConfig | EmbedConfig) -> str:
    return cfg.output.vector_dtype if isinstance(cfg, JobConfig) else "float32"


def check_head_fits_output(cfg: JobConfig | EmbedConfig, head: Head) -> None:
    """What the head's rows cannot be written with (models/heads/: ``Head.output_problem``) is refused at start."""
    problem = head.output_problem(cfg.model, cfg.output if isinstance(cfg, JobConfig) else None)
    if problem:
        raise ConfigError(problem)
