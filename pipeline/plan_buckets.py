"""``docbeam plan-buckets``: bucket boundaries and token budgets proposed from the corpus' own window
length histogram, with the padding efficiency each would give (and what the config gives now)."""
from __future__ import annotations

import itertools

from pipeline.bucket import padding_efficiency, plan_buckets
from pipeline.config import JobConfig
from pipeline.records import Document


def sample_documents(cfg: JobConfig, limit: int) -> list[Document]:
    """The first ``limit`` documents, read exactly as the job reads them (no Beam pipeline needed)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    from pipeline.read import file_records

    docs: list[Document] = []
    patterns = [p.strip() for p in cfg.input.path.split(",") if p.strip()]
    paths = sorted(m.path for result in FileSystems.match(patterns) for m in result.metadata_list)
    for path in paths:
        open_raw = lambda path=path: FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)  # noqa: E731
        records = (r for r in file_records(open_raw, path, cfg.input) if isinstance(r, Document))
        docs += itertools.islice(records, limit - len(docs))
        if len(docs) >= limit:
            break
    return docs


def window_lengths(cfg: JobConfig, docs: list[Document], window_len: int) -> list[int]:
    from models.checkpoint import load_tokenizer, resolve_dir
    from pipeline.tokenize import windows_for

    tokenizer = load_tokenizer(resolve_dir(cfg.model.path))
    return [w.length for w in windows_for(docs, tokenizer, window_len=window_len, config=cfg.tokenize)]


def propose(lengths: list[int], window_len: int, budgets=(2048, 4096, 8192), max_buckets=(4, 6, 8)) -> list[dict]:
    rows = []
    for budget, k in itertools.product(budgets, max_buckets):
        buckets = plan_buckets(lengths, max_len=window_len, tokens_per_batch=budget, max_buckets=k)
        rows.append({"tokens_per_batch": budget, "max_buckets": k, "buckets": list(buckets),
                     "padding_efficiency": round(padding_efficiency(lengths, buckets, budget), 4)})
    return rows


def describe(cfg: JobConfig, limit: int = 10_000) -> str:
    from pipeline.run import make_plan

    plan = make_plan(cfg)
    docs = sample_documents(cfg, limit)
    lengths = window_lengths(cfg, docs, plan.window_len)
    current = padding_efficiency(lengths, cfg.batching.buckets, cfg.batching.tokens_per_batch)
    out = [f"# {len(docs)} documents → {len(lengths)} windows of ≤ {plan.window_len} tokens",
           f"# now: buckets {list(cfg.batching.buckets)}, tokens_per_batch {cfg.batching.tokens_per_batch}: "
           f"padding efficiency {current:.3f}",
           "| tokens_per_batch | buckets (at most) | proposed buckets | padding efficiency |", "|---|---|---|---|"]
    rows = propose(lengths, plan.window_len)
    out += [f"| {r['tokens_per_batch']} | {r['max_buckets']} | {r['buckets']} | {r['padding_efficiency']:.3f} |"
            for r in rows]
    best = max(rows, key=lambda r: (r["padding_efficiency"] - 0.005 * r["max_buckets"], r["tokens_per_batch"]))
    out += ["# each bucket costs one compilation per worker; a larger budget means fewer, larger batches.",
            "# with one bucket fewer per half-point of efficiency, this config would be:",
            "batching:", f"  buckets: {best['buckets']}", f"  tokens_per_batch: {best['tokens_per_batch']}"]
    return "\n".join(out)
