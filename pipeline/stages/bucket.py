"""BucketBatches: TokenWindows → fixed-shape padded Batches.

Each window is padded to the smallest bucket that fits; a batch holds one bucket length and
``tokens_per_batch // bucket_len`` rows, so every (bucket, rows) shape compiles once. Keys are
(bucket, shard) rather than bucket alone so no single key serialises a large job. What is left per key
at the end (fewer windows than a batch) is repacked across buckets (``repack``): a small job or an
incremental run would otherwise pay one mostly empty batch per bucket.

With ``batching.packing`` a row holds several windows (``pack_rows``): short windows fill the room a
longer one leaves in its row, told apart by segment ids. Packing needs windows of every length together,
so windows are keyed by shard alone, gathered two batches' worth at a time, packed with what the last round
left, and the full batches sent on (``_PackByShard``); under-filled rows and what fills no batch wait for
the next round, and the end of input.
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

from pipeline.driver.config import BatchingConfig
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


def packs(config: BatchingConfig) -> bool:
    """A job's plan resolves ``auto`` by its attention backends (pipeline.driver.plan.resolve_packing); here, with
    no backend to ask, ``auto`` does not pack."""
    return config.packing is True


def batch_windows(windows: list[TokenWindow], config: BatchingConfig) -> list[Batch]:
    """What BucketBatches makes of these windows, without Beam (benchmarks time the encoder on these)."""
    shard = lambda w: shard_for(w.doc_id, w.index, config.shards)  # noqa: E731
    if packs(config):
        return [pack_batch(group, bucket_len, rows) for bucket_len, rows, group in packed_stream(
            windows, config, length=lambda w: w.length, shard=shard, order=window_order)]
    return [pad_batch(group, bucket_len, rows) for bucket_len, rows, group in group_into_batches(
        windows, config, length=lambda w: w.length, shard=shard, order=window_order)]


MIN_PACKED_TOKENS = 8


def max_windows_per_row(bucket_len: int) -> int:
    """The most windows a packed row holds: the encoder pools one slot per window ([rows, slots, D]), and
    a window is at least [CLS] a few tokens [SEP]."""
    return max(1, bucket_len // MIN_PACKED_TOKENS)


def pack_rows(items: list, config: BatchingConfig, length: Callable = len, order: Callable | None = None) -> list:
    """Items → packed rows ``[(bucket_len, [items])]``. Longest first, each item goes into the open row
    whose free room fits it most tightly (best fit decreasing), else opens a row of the smallest bucket
    that fits it; so short windows fill what long ones leave, and a row's length is still a bucket's."""
    rows: list[list] = []  # [bucket_len, free tokens, items]
    open_by_free: dict[int, list[int]] = collections.defaultdict(list)  # free tokens → open rows' indexes
    for it in sorted(items, key=order or (lambda it: -length(it))):
        n = length(it)
        index = next((open_by_free[free].pop() for free in range(n, config.buckets[-1] + 1)
                      if open_by_free.get(free)), None)
        if index is None:
            bucket_len = bucket_for(n, config.buckets)
            rows.append([bucket_len, bucket_len, []])
            index = len(rows) - 1
        row = rows[index]
        row[1] -= n
        row[2].append(it)
        if row[1] > 0 and len(row[2]) < max_windows_per_row(row[0]):
            open_by_free[row[1]].append(index)
    return [(bucket_len, row_items) for bucket_len, _, row_items in rows]


# Under-filled rows a round may hold back per bucket, in batches: they wait for short windows that fill them.
HELD_BATCHES = 2


def _rows_by_bucket(items: list, config: BatchingConfig, length: Callable, order: Callable | None) -> dict:
    by_bucket: dict[int, list] = collections.defaultdict(list)
    for bucket_len, row in pack_rows(items, config, length, order):
        by_bucket[bucket_len].append(row)
    return by_bucket


def packed_batches(items: list, config: BatchingConfig, length: Callable = len, order: Callable | None = None,
                   final: bool = True) -> tuple[list, list]:
    """``([(bucket_len, rows, [row items])], items left)``: packed rows in full batches per bucket.

    Before the end (``final=False``) a round sends full rows first and holds back up to ``HELD_BATCHES``
    batches' worth of under-filled rows per bucket (and what fills no batch): their items wait for the
    next round's short windows, so what waits stays under ``HELD_BATCHES + 1`` batches per bucket.
    At the end everything goes out, packed the way that pads less: into every bucket's rows, the rows
    that fill no batch repacked across buckets like leftover windows, or into the longest bucket's rows
    alone (a row of the longest bucket holds what two shorter ones would, so the last few windows fill
    fewer batches). So ``config.buckets`` must be the buckets the encoder has compiled: the job's plan
    leaves out those past the one a full window needs."""
    used = lambda row: sum(length(it) for it in row)  # noqa: E731
    if not final:
        groups, left = [], []
        for bucket_len, bucket_rows in sorted(_rows_by_bucket(items, config, length, order).items()):
            rows = rows_for(bucket_len, config.tokens_per_batch)
            full = lambda row: used(row) == bucket_len or len(row) == max_windows_per_row(bucket_len)  # noqa: E731
            bucket_rows = sorted(bucket_rows, key=lambda row: (not full(row), -used(row)))  # fullest first
            send = max(sum(map(full, bucket_rows)), len(bucket_rows) - HELD_BATCHES * rows) // rows * rows
            groups += [(bucket_len, rows, bucket_rows[i:i + rows]) for i in range(0, send, rows)]
            left += bucket_rows[send:]
        return groups, [it for row in left for it in row]
    row_order = (lambda row: (-used(row), order(row[0]))) if order else None
    ways = []
    for buckets in dict.fromkeys([config.buckets, config.buckets[-1:]]):
        each = config.model_copy(update={"buckets": buckets})
        groups, left = [], []
        for bucket_len, bucket_rows in sorted(_rows_by_bucket(items, each, length, order).items()):
            rows = rows_for(bucket_len, config.tokens_per_batch)
            whole = len(bucket_rows) // rows * rows
            groups += [(bucket_len, rows, bucket_rows[i:i + rows]) for i in range(0, whole, rows)]
            left += bucket_rows[whole:]
        groups += repack(left, config, length=used, order=row_order)
        ways.append((sum(rows * bucket_len for bucket_len, rows, _ in groups), len(buckets) == 1, groups))
    return min(ways, key=lambda way: way[:2])[2], []


def pack_threshold(config: BatchingConfig) -> int:
    """New tokens a shard gathers between packing rounds. Two batches' worth: the first batch goes out
    soon after the job starts, and what a round leaves (less than a batch per bucket) is packed again with
    the next round's windows, so rounds cost packing quality only at the margin."""
    return 2 * config.tokens_per_batch


def packed_stream(items: list, config: BatchingConfig, length: Callable = len, shard: Callable | None = None,
                  order: Callable | None = None) -> list:
    """``[(bucket_len, rows, [row items])]`` as ``_PackByShard`` makes them from items arriving in this order."""
    buffers: dict[int, list] = collections.defaultdict(list)
    tokens: collections.Counter = collections.Counter()
    groups = []
    for it in items:
        s = shard(it) if shard else 0
        buffers[s].append(it)
        tokens[s] += length(it)
        if tokens[s] >= pack_threshold(config):
            made, buffers[s] = packed_batches(buffers[s], config, length, order, final=False)
            tokens[s] = 0
            groups += made
    for s in sorted(buffers):
        groups += packed_batches(buffers[s], config, length, order, final=True)[0]
    return groups


def pack_batch(rows_of_windows: list[list[TokenWindow]], bucket_len: int, rows: int) -> Batch:
    """Packed rows → a Batch of the bucket's full shape, with segment ids and slot lengths; rows and their
    windows in (doc_id, index) order, so a batch's contents and id do not depend on arrival order."""
    if len(rows_of_windows) > rows:
        raise ValueError(f"{len(rows_of_windows)} packed rows do not fit a batch of {rows} rows")
    slots = max_windows_per_row(bucket_len)
    key = lambda w: (w.doc_id, w.index)  # noqa: E731
    ordered = sorted((sorted(row, key=key) for row in rows_of_windows), key=lambda row: key(row[0]))
    ids_BxT = np.zeros((rows, bucket_len), np.int32)
    segment_ids_BxT = np.zeros((rows, bucket_len), np.int32)
    slot_lengths_BxK = np.zeros((rows, slots), np.int32)
    for r, row in enumerate(ordered):
        if len(row) > slots or sum(w.length for w in row) > bucket_len:
            raise ValueError(f"a packed row of {len(row)} windows, {sum(w.length for w in row)} tokens, does not "
                             f"fit bucket {bucket_len} ({slots} windows at most)")
        start = 0
        for k, w in enumerate(row):
            ids_BxT[r, start:start + w.length] = w.token_ids
            segment_ids_BxT[r, start:start + w.length] = k + 1
            slot_lengths_BxK[r, k] = w.length
            start += w.length
    windows = [w for row in ordered for w in row]
    digest = hashlib.sha1("|".join(f"{w.doc_id}#{w.index}" for w in sorted(windows, key=key)).encode()).hexdigest()[:12]
    return Batch(batch_id=f"p{bucket_len}-{digest}", bucket_len=bucket_len, ids_BxT=ids_BxT,
                 lengths_B=slot_lengths_BxK.sum(axis=1, dtype=np.int32),
                 windows=tuple((w.doc_id, w.index, w.num_windows, w.doc_tokens, w.truncated) for w in windows),
                 segment_ids_BxT=segment_ids_BxT, slot_lengths_BxK=slot_lengths_BxK)


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


def padding_efficiency(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int,
                       packing: bool = False) -> float:
    """Real ÷ padded tokens if these window lengths went through bucketing (one shard)."""
    padded = padded_tokens(lengths, buckets, tokens_per_batch, packing)
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


class _PackByShard(beam.DoFn):
    """Gathers a shard's windows until ``pack_threshold`` new tokens, packs them with what earlier rounds
    left, sends full batches on and keeps the rest (under-filled rows, what fills no batch) for the next
    round; at the end of input packs and sends everything (``packed_batches``; ``packed_stream`` is the
    same without Beam). Without a processing-time timer, as ``_BatchByKey``."""

    BUFFER = userstate.BagStateSpec("buffer", coders.PickleCoder())
    TOKENS = userstate.CombiningValueStateSpec("tokens", combine_fn=sum)
    FLUSH = userstate.TimerSpec("flush", userstate.TimeDomain.WATERMARK)

    def __init__(self, config: BatchingConfig):
        self._config = config

    def process(self, element, window=beam.DoFn.WindowParam, buffer=beam.DoFn.StateParam(BUFFER),
                tokens=beam.DoFn.StateParam(TOKENS), flush=beam.DoFn.TimerParam(FLUSH)):
        _, window_record = element
        flush.set(window.max_timestamp())
        buffer.add(window_record)
        tokens.add(window_record.length)
        if tokens.read() >= pack_threshold(self._config):
            groups, left = packed_batches(list(buffer.read()), self._config, length=lambda w: w.length,
                                          order=window_order, final=False)
            buffer.clear()
            tokens.clear()
            for w in left:
                buffer.add(w)
            for bucket_len, rows, group in groups:
                yield pack_batch(group, bucket_len, rows)

    @userstate.on_timer(FLUSH)
    def flush(self, buffer=beam.DoFn.StateParam(BUFFER), tokens=beam.DoFn.StateParam(TOKENS)):
        groups, _ = packed_batches(list(buffer.read()), self._config, length=lambda w: w.length, order=window_order)
        buffer.clear()
        tokens.clear()
        for bucket_len, rows, group in groups:
            yield pack_batch(group, bucket_len, rows)


class BucketBatches(beam.PTransform):
    def __init__(self, config: BatchingConfig):
        super().__init__()
        self._config = config

    def expand(self, windows):
        cfg = self._config
        if packs(cfg):
            return (windows
                    | "KeyByShard" >> beam.Map(lambda w: (shard_for(w.doc_id, w.index, cfg.shards), w))
                    .with_output_types(tuple[int, TokenWindow])
                    | "Pack" >> beam.ParDo(_PackByShard(cfg))
                    | "SpreadBatches" >> beam.Reshuffle())
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


def batches_per_bucket(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int,
                       packing: bool = False) -> dict[int, int]:
    """Bucket → how many batches windows of these lengths make there (one shard, leftovers repacked)."""
    config = BatchingConfig(buckets=buckets, tokens_per_batch=tokens_per_batch, packing=packing)
    make = packed_stream if packing else group_into_batches
    groups = make(lengths, config, length=int)
    return dict(sorted(collections.Counter(b for b, _, _ in groups).items()))


def padded_tokens(lengths: list[int], buckets: tuple[int, ...], tokens_per_batch: int, packing: bool = False) -> int:
    batches = batches_per_bucket(lengths, buckets, tokens_per_batch, packing)
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
