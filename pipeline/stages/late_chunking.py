"""Late chunking (``output.chunking: late``): chunk rows pooled from token states that saw the whole document.

The chunks are window chunking's, exactly (the same windows cut the same way: index, offsets, text); only their
vectors differ. Tokenize also cuts *context windows* of up to the checkpoint's length: consecutive chunks are
grouped, greedily from the first, while their tokens fit one context window, so a document that fits the model
is one context window, and a longer one is split only between chunks, each chunk in the context window that
holds it whole. A context window is framed like a first window ([CLS], the prompt, the text, [SEP]) and carries
its chunks' token spans (``ChunkSpan``); the forward mean-pools each span (models/encoder.py ``pool_spans``)
after attention over the whole context window, so only one vector per chunk leaves the device. Context windows
are batched unpacked, apart from ordinary windows, whatever ``batching.packing`` says (``BatchContexts``).
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from docbeam.config import BatchingConfig
from docbeam.pipeline.records import Batch, ChunkSpan, TokenWindow, WindowRef, batch_id
from docbeam.pipeline.stages.packer import bucket_for, rows_for, window_shard

MIN_CHUNK_TOKENS = 8  # spans a context row has room for by default: one per 8 tokens, as packed slots


def group_chunks(positions: list[tuple[int, int]], room: int) -> list[tuple[int, int, list[int]]]:
    """Chunks' own tokens (``positions``: [first, end) in the document's tokens, in order) → context windows
    ``(first, end, [chunk indexes])``: consecutive chunks while ``end - first`` fits ``room`` tokens."""
    groups, i = [], 0
    while i < len(positions):
        first, j = positions[i][0], i
        if positions[i][1] - first > room:
            raise ValueError(
                f"a chunk of {positions[i][1] - first} tokens does not fit a context window's "
                f"{room}: the context window must be at least the chunks' window"
            )
        while j + 1 < len(positions) and positions[j + 1][1] - first <= room:
            j += 1
        groups.append((first, positions[j][1], list(range(i, j + 1))))
        i = j + 1
    return groups


def context_windows(
    chunks: list[TokenWindow],
    ids: list[int],
    positions: list[tuple[int, int]],
    leading: tuple[int, ...],
    prompt: tuple[int, ...],
    trailing: tuple[int, ...],
    context_len: int,
) -> list[TokenWindow]:
    """One document's context windows: ``chunks`` are its windows (with their character offsets), ``ids`` its
    tokens (the prompt's first, when it has separable tokens: ``prompt``), ``positions`` each chunk's own tokens
    in ``ids``; each context window is ``leading + prompt + ids[first:end] + trailing``."""
    room = context_len - len(leading) - len(prompt) - len(trailing)
    shift = len(leading) + len(prompt)
    groups = group_chunks(positions[: len(chunks)], room)
    out = []
    for number, (first, end, members) in enumerate(groups):
        spans = tuple(
            ChunkSpan(
                k,
                shift + positions[k][0] - first,
                shift + positions[k][1] - first,
                chunks[k].char_start,
                chunks[k].char_end,
                chunks[k].length,
                len(chunks),
            )
            for k in members
        )
        token_ids = np.asarray([*leading, *prompt, *ids[first:end], *trailing], np.int32)
        first_chunk = chunks[0]
        out.append(
            TokenWindow(
                first_chunk.doc_id,
                number,
                len(groups),
                token_ids,
                first_chunk.doc_tokens,
                first_chunk.truncated,
                spans[0].char_start,
                spans[-1].char_end,
                spans,
            )
        )
    return out


def spans_per_row(bucket_len: int, windows: list[TokenWindow]) -> int:
    """K of a bucket's batches: one span per ``MIN_CHUNK_TOKENS`` tokens (one compiled shape per bucket), more
    only for a row that holds more chunks (tiny windows with a large stride; a shape compiled when it comes)."""
    return max(1, bucket_len // MIN_CHUNK_TOKENS, *(len(w.spans) for w in windows))


def context_batch(windows: list[TokenWindow], bucket_len: int, rows: int) -> Batch:
    """Context windows, one per row, padded like ordinary windows; ``windows`` of the batch are their chunks,
    row by row, whose vectors the forward's [rows, K, D] output holds where the span is not empty."""
    if len(windows) > rows:
        raise ValueError(f"{len(windows)} context windows do not fit a batch of {rows} rows")
    windows = sorted(windows, key=lambda w: (w.doc_id, w.index))
    ids_BxT = np.zeros((rows, bucket_len), np.int32)
    lengths_B = np.zeros((rows,), np.int32)
    spans_BxKx3 = np.zeros((rows, spans_per_row(bucket_len, windows), 3), np.int32)
    chunks = []
    for row, w in enumerate(windows):
        ids_BxT[row, : w.length] = w.token_ids
        lengths_B[row] = w.length
        spans_BxKx3[row, : len(w.spans)] = [(s.start, s.end, s.length) for s in w.spans]
        chunks += WindowRef.chunks_of(w)
    return Batch(
        batch_id=batch_id(bucket_len, windows, packed=False).replace("b", "l", 1),
        bucket_len=bucket_len,
        ids_BxT=ids_BxT,
        lengths_B=lengths_B,
        windows=tuple(chunks),
        spans_BxKx3=spans_BxKx3,
    )


def context_batches(keyed: tuple, config: BatchingConfig):
    """One (bucket, shard)'s context windows → full batches of that bucket, the last one padded. Read as they
    come (a runner may stream a large group rather than hold it), so which windows share a batch follows the
    group's order; each batch sorts its own."""
    (bucket_len, _), windows = keyed
    rows = rows_for(bucket_len, config.tokens_per_batch)
    held = []
    for w in windows:
        held.append(w)
        if len(held) == rows:
            yield context_batch(held, bucket_len, rows)
            held = []
    if held:
        yield context_batch(held, bucket_len, rows)


class BatchContexts(beam.PTransform):
    """Context windows → Batches, grouped by (bucket, shard): not BucketBatches' stateful packer, since a
    second stateful step beside it in one pipeline loses its end-of-input timers on Beam's FnApiRunner (seen:
    the held windows never came out). A (bucket, shard)'s last batch is padded rather than filled across
    buckets: context windows are one per document or fewer, so that costs little."""

    def __init__(self, config: BatchingConfig):
        super().__init__()
        self._config = config

    def expand(self, contexts):
        cfg = self._config
        return (
            contexts
            | "KeyByBucketAndShard"
            >> beam.Map(lambda w: ((bucket_for(w.length, cfg.buckets), window_shard(w, cfg)), w))
            | "GroupContexts" >> beam.GroupByKey()
            | "ContextBatches" >> beam.FlatMap(context_batches, cfg)
        )
