"""BucketBatches: Windows → fixed-shape padded Batches.

Each window is padded to the smallest bucket that fits; a batch holds one bucket length and
``tokens_per_batch // bucket_len`` rows, so every (bucket, rows) shape compiles once. Keys are
(bucket, shard) rather than bucket alone so no single key serialises a large job.
"""
from __future__ import annotations

import hashlib
import zlib

import apache_beam as beam
import numpy as np

from pipeline.config import BatchingConfig
from pipeline.records import Batch, Window


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"a window of {length} tokens fits no bucket (largest {buckets[-1]}); "
                     "batching.buckets must end at or above the model's window length")


def rows_for(bucket_len: int, tokens_per_batch: int) -> int:
    return max(1, tokens_per_batch // bucket_len)


def shard_for(doc_id: str, index: int, shards: int) -> int:
    return zlib.crc32(f"{doc_id}\x00{index}".encode()) % shards


def pad_batch(windows: list[Window], bucket_len: int, rows: int) -> Batch:
    """A partial batch is padded with empty rows (length 0) so it reuses the compiled full shape."""
    if len(windows) > rows:
        raise ValueError(f"{len(windows)} windows do not fit a batch of {rows} rows")
    ids_BxT = np.zeros((rows, bucket_len), np.int32)
    lengths_B = np.zeros((rows,), np.int32)
    windows = sorted(windows, key=lambda w: (w.doc_id, w.index))  # deterministic batch contents and ids
    for row, w in enumerate(windows):
        ids_BxT[row, :w.length] = w.token_ids
        lengths_B[row] = w.length
    digest = hashlib.sha1("|".join(f"{w.doc_id}#{w.index}" for w in windows).encode()).hexdigest()[:12]
    return Batch(batch_id=f"b{bucket_len}-{digest}", bucket_len=bucket_len, ids_BxT=ids_BxT, lengths_B=lengths_B,
                 windows=tuple((w.doc_id, w.index, w.num_windows, w.doc_tokens, w.truncated) for w in windows))


def padding_efficiency(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int) -> float:
    """Real ÷ padded tokens if these window lengths went through bucketing (one shard)."""
    counts: dict[int, int] = {}
    for n in lengths:
        b = bucket_for(n, buckets)
        counts[b] = counts.get(b, 0) + 1
    padded = sum(-(-c // rows_for(b, tokens_per_batch)) * rows_for(b, tokens_per_batch) * b for b, c in counts.items())
    return sum(lengths) / padded if padded else 1.0


class BucketBatches(beam.PTransform):
    def __init__(self, config: BatchingConfig):
        super().__init__()
        self._config = config

    def expand(self, windows):
        cfg = self._config
        by_bucket = windows | "ByBucket" >> beam.Partition(
            lambda w, n: cfg.buckets.index(bucket_for(w.length, cfg.buckets)), len(cfg.buckets))
        batches = []
        for bucket_len, part in zip(cfg.buckets, by_bucket):
            rows = rows_for(bucket_len, cfg.tokens_per_batch)
            batches.append(
                part
                | f"Key{bucket_len}" >> beam.Map(
                    lambda w, b=bucket_len: ((b, shard_for(w.doc_id, w.index, cfg.shards)), w)
                ).with_output_types(tuple[tuple[int, int], Window])  # a deterministic key coder for state
                | f"Group{bucket_len}" >> beam.GroupIntoBatches(rows)
                | f"Pad{bucket_len}" >> beam.MapTuple(lambda key, ws, b=bucket_len, r=rows: pad_batch(list(ws), b, r)))
        return batches | "AllBuckets" >> beam.Flatten()
