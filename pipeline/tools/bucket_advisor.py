"""``docbeam propose-buckets``: bucket boundaries and token budgets proposed from the corpus' own window
length histogram, with the padding efficiency each would give (and what the config gives now).

When the sample yields no window (no file matches, the files are empty, or the job would reject every
document) there is nothing to propose from: ``proposal_report`` raises ``ConfigError`` saying what was read
and what to change.

The padding figures (``padding_efficiency``, ``padded_tokens``, ``batches_per_bucket``) count the batches the
job's own Packer makes of windows of these lengths, so advice and benchmarks/bucketing.py cannot drift from
what the pipeline pads; they live here since only advice needs them.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools

import numpy as np

from docbeam.config import BatchingConfig, ConfigError, JobConfig
from docbeam.pipeline.records import Document, Rejected, TokenWindow
from docbeam.pipeline.stages.packer import batch_windows, rows_for


def batches_per_bucket(
    lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int, packing: bool = False
) -> dict[int, int]:
    """Bucket → how many batches windows of these lengths make there: the packer's own batches (one shard,
    what is held at the end filled across buckets), on windows of these lengths."""
    config = BatchingConfig(buckets=tuple(buckets), tokens_per_batch=tokens_per_batch, packing=packing)
    # Ids in input order: among equal lengths the packer then keeps that order. A read-only zero view, no copy.
    windows = [
        TokenWindow(f"{i:09d}", 0, 1, np.broadcast_to(np.int32(0), (n,)), n, False) for i, n in enumerate(lengths)
    ]
    return dict(sorted(collections.Counter(b.bucket_len for b in batch_windows(windows, config)).items()))


def padded_tokens(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int, packing: bool = False) -> int:
    batches = batches_per_bucket(lengths, buckets, tokens_per_batch, packing)
    return sum(n * rows_for(b, tokens_per_batch) * b for b, n in batches.items())


def padding_efficiency(
    lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int, packing: bool = False
) -> float:
    """Real ÷ padded tokens if these window lengths went through the packer (one shard)."""
    padded = padded_tokens(lengths, buckets, tokens_per_batch, packing)
    return sum(lengths) / padded if padded else 1.0


def propose_buckets(
    lengths: list[int], *, max_len: int, tokens_per_batch: int, max_buckets: int, step: int = 16
) -> tuple[int, ...]:
    """Bucket boundaries (multiples of ``step``, the last ``max_len``) that minimise padded tokens for
    this length histogram, each bucket's partial last batch counted as if padded alone (an upper bound:
    the packer fills what is held at the end across buckets). Dynamic programming over boundaries."""
    if not lengths:
        return (max_len,)
    candidates = sorted({min(max_len, step * -(-n // step)) for n in lengths} | {max_len})
    sorted_lengths = sorted(lengths)

    def cost(lo: int, hi: int) -> int:  # windows with lo < length <= hi, padded to hi
        n = bisect.bisect_right(sorted_lengths, hi) - bisect.bisect_right(sorted_lengths, lo)
        rows = rows_for(hi, tokens_per_batch)
        return -(-n // rows) * rows * hi

    # best[k][j]: least padded tokens covering lengths <= candidates[j] with k buckets, the last at j.
    inf = float("inf")
    best = [[inf] * len(candidates) for _ in range(max_buckets + 1)]
    parent = [[-1] * len(candidates) for _ in range(max_buckets + 1)]
    for j, c in enumerate(candidates):
        best[1][j] = cost(0, c)
    for k in range(2, max_buckets + 1):
        for j in range(len(candidates)):
            for i in range(j):
                value = best[k - 1][i] + cost(candidates[i], candidates[j])
                if value < best[k][j]:
                    best[k][j], parent[k][j] = value, i
    last = len(candidates) - 1
    k = min(range(1, max_buckets + 1), key=lambda k: (best[k][last], k))
    chosen = []
    j = last
    while k >= 1 and j >= 0:
        chosen.append(candidates[j])
        j, k = parent[k][j], k - 1
    return tuple(sorted(chosen))


@dataclasses.dataclass
class Sample:
    """The first documents of the input as the job would read them, and what it would reject on the way."""

    unmatched: list[str] = dataclasses.field(default_factory=list)  # patterns that match no file
    files: list[str] = dataclasses.field(default_factory=list)
    documents: list[Document] = dataclasses.field(default_factory=list)
    rejected: list[Rejected] = dataclasses.field(default_factory=list)

    @property
    def read(self) -> int:
        return len(self.documents) + len(self.rejected)


def read_sample(cfg: JobConfig, limit: int) -> Sample:
    """Reads files in order until ``limit`` documents were read (rejected ones count: a corpus of rejects
    must not be read to its end). Duplicate ids are rejected as the job rejects them."""
    from docbeam.pipeline.stages.read import match_paths, path_records, same_file_key

    sample, seen_ids = Sample(), set()
    for pattern in cfg.input.patterns:
        try:
            sample.files += match_paths(pattern)
        except FileNotFoundError:
            sample.unmatched.append(pattern)
    sample.files = sorted({same_file_key(p): p for p in sample.files}.values())
    for path in sample.files:
        try:
            for record in itertools.islice(path_records(path, cfg.input), limit - sample.read):
                if isinstance(record, Document) and record.id in seen_ids:
                    record = Rejected(record.source, record.line, record.id, "duplicate_id", "id already used")
                if isinstance(record, Document):
                    seen_ids.add(record.id)
                    sample.documents.append(record)
                else:
                    sample.rejected.append(record)
        except Exception as e:  # noqa: BLE001  as in the job: an unreadable file is one rejection
            sample.rejected.append(Rejected(path, None, None, "unreadable_file", f"{type(e).__name__}: {e}"))
        if sample.read >= limit:
            break
    return sample


def tokenize_sample(
    cfg: JobConfig, docs: list[Document], window_len: int, prompt: str | None = None
) -> tuple[list[int], list[Rejected]]:
    """Window lengths of ``docs``, and the documents the tokenizer rejects (no tokens). The one call into
    pipeline.stages.tokenize, so a change to its interface is adapted here."""
    from docbeam.models.checkpoint import load_tokenizer, resolve_dir
    from docbeam.pipeline.stages.tokenize import tokenize_documents

    if not docs:
        return [], []
    tokenizer = load_tokenizer(resolve_dir(cfg.model.path))
    windows, rejected = tokenize_documents(docs, tokenizer, window_len=window_len, config=cfg.tokenize, prompt=prompt)
    return [w.length for w in windows], rejected


def nothing_to_propose(cfg: JobConfig, sample: Sample) -> str:
    """Why ``sample`` (its rejects including the tokenizer's) yields no window to plan from, for people."""
    where = f"input.path {cfg.input.path!r}"
    if not sample.files:
        return f"nothing to propose: {where} matches no file; check the path and the glob"
    files = f"{len(sample.files)} file(s) matching {where}" + (
        f" (e.g. {sample.files[0]})" if len(sample.files) > 1 else ""
    )
    if not sample.read:
        return f"nothing to propose: the {files} hold no documents; point input.path at the corpus"
    kinds = collections.Counter(r.kind for r in sample.rejected)
    first = next(r for r in sample.rejected if r.kind == kinds.most_common(1)[0][0])
    return (
        f"nothing to propose: read {sample.read} document(s) from {files}; the job would reject all of them ("
        + ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common())
        + f"), e.g. {first.source}{f' line {first.line}' if first.line else ''}: {first.reason}. "
        "Fix the input, or the input.* keys the reasons name (input.format, input.text_field, input.id_field, "
        "input.max_line_bytes), then rerun propose-buckets"
    )


def proposals(lengths: list[int], window_len: int, budgets=(2048, 4096, 8192), max_buckets=(4, 6, 8)) -> list[dict]:
    if not lengths:
        raise ValueError("no window lengths to plan buckets for")
    rows = []
    for budget, k in itertools.product(budgets, max_buckets):
        buckets = propose_buckets(lengths, max_len=window_len, tokens_per_batch=budget, max_buckets=k)
        rows.append(
            {
                "tokens_per_batch": budget,
                "max_buckets": k,
                "buckets": list(buckets),
                "padding_efficiency": round(padding_efficiency(lengths, buckets, budget), 4),
            }
        )
    return rows


def packed_proposals(lengths: list[int], window_len: int, unpacked: list[dict]) -> list[dict]:
    """With packing, short windows fill long rows, so fewer buckets pad about as little and compile less:
    per budget, the longest bucket alone, half and whole window, and each unpacked proposal, scored packed."""
    half = max(16, 16 * round(window_len / 32))
    rows = []
    for budget in sorted({r["tokens_per_batch"] for r in unpacked}):
        sets = {(window_len,), (half, window_len) if half < window_len else (window_len,)}
        sets |= {tuple(r["buckets"]) for r in unpacked if r["tokens_per_batch"] == budget}
        for buckets in sorted(sets, key=lambda b: (len(b), b)):
            rows.append(
                {
                    "tokens_per_batch": budget,
                    "buckets": list(buckets),
                    "padding_efficiency": round(padding_efficiency(lengths, buckets, budget, packing=True), 4),
                }
            )
    return rows


# What a proposal is judged by: padding efficiency, less half a point per bucket (each bucket is one more
# compilation per worker). The config's own choice is judged by the same measure, and kept unless a proposal
# beats it by more than KEEP_MARGIN: padding alone does not see what a config was measured for (time).
BUCKET_COST = 0.005
KEEP_MARGIN = 0.005


def score(row: dict) -> float:
    return row["padding_efficiency"] - BUCKET_COST * len(row["buckets"])


def proposal_report(cfg: JobConfig, limit: int = 10_000) -> str:
    """The proposal as Markdown plus a config snippet; raises ConfigError when there is nothing to propose from."""
    from docbeam.pipeline.driver.plan import make_plan

    sample = read_sample(cfg, limit)
    if not sample.documents:  # said before loading the model: nothing it could change
        raise ConfigError(nothing_to_propose(cfg, sample))
    plan = make_plan(cfg, probe_backends=False, for_output=False)
    lengths, no_tokens = tokenize_sample(cfg, sample.documents, plan.window_len, plan.prompt)
    sample.rejected += no_tokens
    if not lengths:
        raise ConfigError(nothing_to_propose(cfg, sample))
    packing = plan.packing  # as the plan resolved auto for this job's backends
    budget = plan.tokens_per_batch  # auto as the memory plan resolved it
    used = [b for b in cfg.batching.buckets if b <= plan.config.batching.buckets[-1]]
    current = {
        "tokens_per_batch": budget,
        "buckets": used,
        "padding_efficiency": round(padding_efficiency(lengths, used, budget, packing), 4),
    }
    out = [
        f"# {sample.read} documents read, {len(sample.documents) - len(no_tokens)} kept "
        f"({len(sample.rejected)} the job would reject) → {len(lengths)} windows of ≤ {plan.window_len} tokens",
        f"# now: buckets {used}, tokens_per_batch {budget}{', packed' if packing else ''}: padding efficiency "
        f"{current['padding_efficiency']:.3f}, score {score(current):.3f} (efficiency less {BUCKET_COST} per bucket)",
        "| tokens_per_batch | buckets (at most) | proposed buckets | padding efficiency | score |",
        "|---|---|---|---|---|",
    ]
    budgets = tuple(sorted({2048, 4096, 8192, budget}))
    rows = proposals(lengths, plan.window_len, budgets=budgets)
    candidates = rows
    out += [
        f"| {r['tokens_per_batch']} | {r['max_buckets']} | {r['buckets']} | {r['padding_efficiency']:.3f} | "
        f"{score(r):.3f} |"
        for r in rows
    ]
    if not packing:
        out.append(
            f"| {budget} (this config) | — | {used} | {current['padding_efficiency']:.3f} | {score(current):.3f} |"
        )
    else:
        candidates = packed_proposals(lengths, plan.window_len, rows)
        out += [
            "",
            "# batching.packing is on for this job: the same budgets with packed rows",
            "| tokens_per_batch | buckets | padding efficiency (packed) | score |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {r['tokens_per_batch']} | {r['buckets']} | {r['padding_efficiency']:.3f} | {score(r):.3f} |"
            for r in candidates
        ]
        out.append(f"| {budget} (this config) | {used} | {current['padding_efficiency']:.3f} | {score(current):.3f} |")
        out += [
            "# padding alone does not show that a packed row pays attention over its whole length: a short",
            "# bucket as well (e.g. [128, 256]) costs one compilation more and less attention; time both",
        ]
    best = max(candidates, key=lambda r: (score(r), r["tokens_per_batch"]))
    out.append("# each bucket costs one compilation per worker; a larger budget means fewer, larger batches.")
    if score(best) <= score(current) + KEEP_MARGIN:
        out += [
            f"# no proposal scores more than {KEEP_MARGIN} above this config's own choice: keep it",
            "batching:",
            f"  buckets: {used}",
            f"  tokens_per_batch: {budget}",
        ]
    else:
        out += [
            f"# the best proposal scores {score(best) - score(current):.3f} above this config's choice; with it:",
            "batching:",
            f"  buckets: {best['buckets']}",
            f"  tokens_per_batch: {best['tokens_per_batch']}",
        ]
    return "\n".join(out)
