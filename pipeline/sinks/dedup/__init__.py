"""output.dedup: exact, near and semantic deduplication in the embedding job, marking (never dropping) documents,
within the run and against what earlier runs kept (``input.reuse_from``). A curating sink (pipeline/sinks/registry.py):
its marks reach output.select (``not duplicate``) and the other sinks before they write.

Committed with the run: ``duplicates/`` (id, duplicate_of, kind, similarity: one row per marked document) and
``dedup_index/`` (every kept document's exact key, MinHash signature and unit vector, the earlier runs' kept ones
carried on), which the next run reads instead of recomputing. The methods: signatures.py (what is compared),
marking.py (who is marked), clusters.py (semantic's k-means), steps.py (the Beam steps and their memory bounds)."""

from __future__ import annotations

from docbeam.errors import ConfigError
from docbeam.pipeline.sinks.dedup import report
from docbeam.pipeline.sinks.dedup.settings import DUPLICATES, INDEX, NEAR_SWEEP, SEMANTIC_SWEEP, DedupConfig
from docbeam.pipeline.sinks.registry import Curated, Sink, register

__all__ = ["DUPLICATES", "INDEX", "Dedup", "DedupConfig"]


def vector_column(head) -> str | None:
    """The head's dense vector column, the one semantic dedup compares (None: it has none)."""
    return next((c.name for c in head.columns() if c.kind == "vector"), None)


@register("dedup")
class Dedup(Sink):
    section = DedupConfig
    select_columns = {"duplicate": "bool", "duplicate_kind": "string"}

    def check(self, cfg, head, kept) -> None:
        taken = sorted({c.name for c in kept.columns} & set(self.select_columns))
        if taken:
            raise ConfigError(
                f"input.keep_fields: {taken} name the columns output.dedup adds to each row for output.select "
                "(duplicate, duplicate_kind); rename the fields in the input or remove them from the list"
            )
        if cfg.output.dedup.semantic is not None and vector_column(head) is None:
            raise ConfigError(
                f"output.dedup.semantic compares each document's dense vector, and model.head resolved to "
                f"{head.name}, whose {head.folder}/ rows have none; set model.head: embedding, or drop semantic "
                "(exact and near compare the texts, with any head)"
            )

    def mark_values(self, kinds: list[str]) -> dict:
        return {"duplicate": bool(kinds), "duplicate_kind": min(kinds) if kinds else None}

    def planned(self, section, plan) -> dict:
        from docbeam.pipeline.sinks.dedup.earlier import earlier_index  # reads storage: Beam's filesystems

        earlier = earlier_index(plan)
        kinds = [
            k for k, on in (("exact", section.exact), ("near", section.near), ("semantic", section.semantic)) if on
        ]
        return {
            "settings": section.shown(),
            "against": earlier.describe(),
            "marked": dict.fromkeys(kinds, 0),
            "kept": 0,
            "earlier_compared": 0,
            "sweep": {
                **({"near": dict.fromkeys((f"{t:g}" for t in NEAR_SWEEP), 0)} if section.near else {}),
                **({"semantic": dict.fromkeys((f"{e:g}" for e in SEMANTIC_SWEEP), 0)} if section.semantic else {}),
            },
        }

    def curate(self, section, inputs, staging: str, run_id: str, plan) -> Curated:
        from docbeam.pipeline.sinks.dedup.earlier import earlier_index
        from docbeam.pipeline.sinks.dedup.graph import curate  # Beam's: once the graph is built

        return curate(section, inputs, staging, run_id, plan, earlier_index(plan), vector_column(plan.head))

    def report_tables(self, record: dict) -> list:
        return report.tables(record)

    def summary_line(self, record: dict) -> str | None:
        marked = record.get("marked") or {}
        kinds = ", ".join(f"{k} {v}" for k, v in marked.items())
        against = record.get("against") or {}
        earlier = f"; against run {against['run_id']}'s kept" if against.get("files") else ""
        return f"  dedup      {sum(marked.values())} marked ({kinds}), {record.get('kept', 0)} kept{earlier}: {DUPLICATES}/"
