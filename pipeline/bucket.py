"""BucketBatches: TokenWindows → fixed-shape padded Batches.

Each window is padded to the smallest bucket that fits; a batch holds one bucket length and
``tokens_per_batch // bucket_len`` rows, so every (bucket, rows) shape compiles once. Keys are
(bucket, shard) rather than bucket alone so no single key serialises a large job. What is left per key
at the end (fewer windows than a batch) is repacked across buckets (``repack``): a small job or an
incremental run would otherwise pay one mostly empty batch per bucket.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import zlib
from typing import Callable

import apache_beam as beam
import numpy as np
from apache_beam import coders
from apache_beam.transforms import userstate

from pipeline.config import BatchingConfig
from pipeline.records import Batch, TokenWindow


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


def batch_key(window: TokenWindow, config: BatchingConfig) -> tuple[int, int]:
    """(bucket, shard): the key a window is batched under."""
    return bucket_for(window.length, config.buckets), shard_for(window.doc_id, window.index, config.shards)


def window_order(w: TokenWindow):
    """Leftovers are repacked in this order (longest first, then by id), whatever order they arrived in."""
    return -w.length, w.doc_id, w.index


def repack(items: list, config: BatchingConfig, length: Callable = len, order: Callable | None = None) -> list:
    """Leftovers (fewer than a batch per bucket) → ``[(bucket_len, rows, items)]``.

    Longest first, each batch takes the bucket of the longest remaining item and as many of the next
    longest as its rows hold, so short leftovers fill the empty rows of a longer bucket's batch. Shapes
    stay the configured ones (nothing new to compile), and it never pads more than one partial batch
    per bucket would (tests/bucket_test.py checks that on random bucket sets)."""
    ordered = sorted(items, key=order or (lambda it: -length(it)))
    groups = []
    while ordered:
        bucket_len = bucket_for(length(ordered[0]), config.buckets)
        rows = rows_for(bucket_len, config.tokens_per_batch)
        groups.append((bucket_len, rows, ordered[:rows]))
        ordered = ordered[rows:]
    return groups


def group_into_batches(items: list, config: BatchingConfig, length: Callable = len, shard: Callable | None = None,
                       order: Callable | None = None) -> list:
    """``[(bucket_len, rows, items)]`` as BucketBatches makes them: per (bucket, shard) key, in the order given,
    full batches; then per shard, every key's leftovers repacked together."""
    by_key: dict[tuple[int, int], list] = {}
    for it in items:
        by_key.setdefault((bucket_for(length(it), config.buckets), shard(it) if shard else 0), []).append(it)
    groups, leftovers = [], {}
    for (bucket_len, s), group in sorted(by_key.items(), key=lambda kv: kv[0]):
        rows = rows_for(bucket_len, config.tokens_per_batch)
        full = len(group) // rows * rows
        groups += [(bucket_len, rows, group[i:i + rows]) for i in range(0, full, rows)]
        leftovers.setdefault(s, []).extend(group[full:])
    for s in sorted(leftovers):
        groups += repack(leftovers[s], config, length, order)
    return groups


def batch_windows(windows: list[TokenWindow], config: BatchingConfig) -> list[Batch]:
    """What BucketBatches makes of these windows, without Beam (benchmarks time the encoder on these)."""
    return [pad_batch(group, bucket_len, rows) for bucket_len, rows, group in group_into_batches(
        windows, config, length=lambda w: w.length, shard=lambda w: shard_for(w.doc_id, w.index, config.shards),
        order=window_order)]


def pad_batch(windows: list[TokenWindow], bucket_len: int, rows: int) -> Batch:
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
    padded = padded_tokens(lengths, buckets, tokens_per_batch)
    return sum(lengths) / padded if padded else 1.0


class _BatchByKey(beam.DoFn):
    """GroupIntoBatches with the batch size read from the key, and without its processing-time timer.

    Needed since that timer (declared even when unused) sends a pipeline off the DirectRunner's
    FnApiRunner onto its single-threaded BundleBasedDirectRunner, which ignores ``direct_num_workers``.
    What is left at the end of the window (for a batch job, the end of input) goes out on ``leftovers``
    as (shard, window), to be repacked across buckets.
    """

    LEFTOVERS = "leftovers"

    BUFFER = userstate.BagStateSpec("buffer", coders.PickleCoder())
    COUNT = userstate.CombiningValueStateSpec("count", combine_fn=beam.combiners.CountCombineFn())
    FLUSH = userstate.TimerSpec("flush", userstate.TimeDomain.WATERMARK)

    def __init__(self, tokens_per_batch: int):
        self._tokens_per_batch = tokens_per_batch

    def process(self, element, window=beam.DoFn.WindowParam, buffer=beam.DoFn.StateParam(BUFFER),
                count=beam.DoFn.StateParam(COUNT), flush=beam.DoFn.TimerParam(FLUSH)):
        (bucket_len, shard), window_record = element
        flush.set(window.max_timestamp())
        buffer.add(window_record)
        count.add(1)
        rows = rows_for(bucket_len, self._tokens_per_batch)
        if count.read() >= rows:
            yield pad_batch(list(buffer.read()), bucket_len, rows)
            buffer.clear()
            count.clear()

    @userstate.on_timer(FLUSH)
    def flush(self, key=beam.DoFn.KeyParam, buffer=beam.DoFn.StateParam(BUFFER), count=beam.DoFn.StateParam(COUNT)):
        _, shard = key
        for window_record in buffer.read():
            yield beam.pvalue.TaggedOutput(self.LEFTOVERS, (shard, window_record))
        buffer.clear()
        count.clear()


class BucketBatches(beam.PTransform):
    def __init__(self, config: BatchingConfig):
        super().__init__()
        self._config = config

    def expand(self, windows):
        cfg = self._config
        batched = (windows
                   | "KeyByBucketAndShard" >> beam.Map(lambda w: (batch_key(w, cfg), w))
                   .with_output_types(tuple[tuple[int, int], TokenWindow])  # a deterministic key coder for state
                   | "Batch" >> beam.ParDo(_BatchByKey(cfg.tokens_per_batch)).with_outputs(
                       _BatchByKey.LEFTOVERS, main="full"))
        repacked = (batched[_BatchByKey.LEFTOVERS]
                    | "LeftoversByShard" >> beam.GroupByKey()
                    | "RepackLeftovers" >> beam.FlatMap(
                        lambda shard_windows: [pad_batch(group, bucket_len, rows) for bucket_len, rows, group in repack(
                            list(shard_windows[1]), cfg, length=lambda w: w.length, order=window_order)]))
        return ((batched.full, repacked) | "AllBatches" >> beam.Flatten()
                | "SpreadBatches" >> beam.Reshuffle())


def batches_per_bucket(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int) -> dict[int, int]:
    """Bucket → how many batches windows of these lengths make there (one shard, leftovers repacked)."""
    groups = group_into_batches(lengths, BatchingConfig(buckets=buckets, tokens_per_batch=tokens_per_batch),
                                length=int)
    return dict(sorted(collections.Counter(b for b, _, _ in groups).items()))


def padded_tokens(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int) -> int:
    batches = batches_per_bucket(lengths, buckets, tokens_per_batch)
    return sum(n * rows_for(b, tokens_per_batch) * b for b, n in batches.items())


def propose_buckets(lengths: list[int], *, max_len: int, tokens_per_batch: int, max_buckets: int,
                    step: int = 16) -> tuple[int, ...]:
    """Bucket boundaries (multiples of ``step``, the last ``max_len``) that minimise padded tokens for
    this length histogram, each bucket's partial last batch counted as if padded alone (an upper bound:
    BucketBatches repacks them). Dynamic programming over boundaries."""
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
