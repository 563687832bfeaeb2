"""The packer: TokenWindows → fixed-shape Batches, one state machine for the pipeline and the benchmarks.

Words, one per idea: a *window* is one TokenWindow; a *bucket* is a row length the encoder compiles; a *row*
is one row of a batch; a *batch* holds ``rows_for(bucket)`` rows of one bucket, so every (rows, bucket) shape
compiles once; a *shard* splits the windows so that no single Beam key serialises a large job. Windows the
packer has not yet put in a batch are *held*.

Padding (``packing=False``): a row holds one window, padded to the smallest bucket that fits it; a bucket's
batch goes out as soon as it has a batch's worth of windows. At the end of input what is held (fewer than a
batch per bucket) is filled across buckets, longest first (``fill_across_buckets``): a small job or an
incremental run would otherwise pay one mostly empty batch per bucket.

Packing (``packing=True``): a row holds several windows (``pack_rows``), told apart by segment ids; short
windows fill the room a longer one leaves. Packing needs windows of every length together, so a shard
gathers ``round_tokens`` new tokens, then a *round* (``packing_round``) sends full batches and holds back
under-filled rows for later windows; the end of input packs what is held (``final_packing``).

``Packer`` is that state machine; ``batch_windows`` drives one per shard over a list (the benchmarks), and
pipeline/stages/batch.py drives it from Beam state (the pipeline). Neither resolves ``batching.packing:
auto``: the job's plan does (pipeline.driver.plan.resolved_packing), and hands the packer a bool.
"""

from __future__ import annotations

import collections
import zlib
from typing import Callable, Iterable, Mapping

import numpy as np

from docbeam.config import BatchingConfig
from docbeam.pipeline.records import Batch, TokenWindow, WindowRef, batch_id

# (bucket_len, rows, contents): what one batch will hold; contents are windows, or rows of windows when packing.
Group = tuple[int, int, list]

MIN_PACKED_TOKENS = 8
# Under-filled rows a round may hold back per bucket, in batches: they wait for short windows that fill them.
HELD_BATCHES = 2


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(
        f"a window of {length} tokens fits no bucket (largest {buckets[-1]}); "
        "batching.buckets must end at or above the model's window length"
    )


def rows_for(bucket_len: int, tokens_per_batch: int) -> int:
    return max(1, tokens_per_batch // bucket_len)


def shard_for(doc_id: str, index: int, shards: int) -> int:
    """By (doc_id, index), not doc_id alone: one long document's windows spread over every shard."""
    return zlib.crc32(f"{doc_id}\x00{index}".encode()) % shards


def window_shard(window: TokenWindow, config: BatchingConfig) -> int:
    return shard_for(window.doc_id, window.index, config.shards)


def window_order(w: TokenWindow):
    """Longest first, then by id: windows are filled and packed in this order whatever order they arrived in,
    so the Beam pipeline and ``batch_windows`` make the same batches."""
    return -w.length, w.doc_id, w.index


def max_windows_per_row(bucket_len: int) -> int:
    """The most windows a packed row holds: the encoder pools one slot per window ([rows, slots, D]), and
    a window is at least [CLS] a few tokens [SEP]."""
    return max(1, bucket_len // MIN_PACKED_TOKENS)


def round_tokens(config: BatchingConfig) -> int:
    """New tokens a shard gathers between packing rounds. Two batches' worth: the first batch goes out
    soon after the job starts, and what a round holds back (less than ``HELD_BATCHES + 1`` batches per
    bucket) is packed again with the next round's windows, so rounds cost packing quality only at the margin."""
    return 2 * config.tokens_per_batch


def fill_across_buckets(items: list, config: BatchingConfig, length: Callable, order: Callable) -> list[Group]:
    """What is held at the end (windows, or packed rows) → batches. In ``order`` (longest first), each batch
    takes the bucket of the longest remaining item and as many of the next as its rows hold, so short items
    fill the empty rows of a longer bucket's batch. Shapes stay the configured ones (nothing new to compile),
    and it never pads more than one partial batch per bucket would (tests/bucket_test.py checks that on
    random bucket sets)."""
    ordered = sorted(items, key=order)
    groups = []
    while ordered:
        bucket_len = bucket_for(length(ordered[0]), config.buckets)
        rows = rows_for(bucket_len, config.tokens_per_batch)
        groups.append((bucket_len, rows, ordered[:rows]))
        ordered = ordered[rows:]
    return groups


def pack_rows(windows: list[TokenWindow], buckets: tuple[int, ...]) -> list[tuple[int, list[TokenWindow]]]:
    """Windows → packed rows ``[(bucket_len, [windows])]``. Longest first, each window goes into the open
    row whose free room fits it most tightly (best fit decreasing), else opens a row of the smallest bucket
    that fits it; so short windows fill what long ones leave, and a row's length is still a bucket's."""
    rows: list[list] = []  # [bucket_len, free tokens, windows]
    open_by_free: dict[int, list[int]] = collections.defaultdict(list)  # free tokens → open rows' indexes
    for w in sorted(windows, key=window_order):
        index = next(
            (open_by_free[free].pop() for free in range(w.length, buckets[-1] + 1) if open_by_free.get(free)), None
        )
        if index is None:
            bucket_len = bucket_for(w.length, buckets)
            rows.append([bucket_len, bucket_len, []])
            index = len(rows) - 1
        row = rows[index]
        row[1] -= w.length
        row[2].append(w)
        if row[1] > 0 and len(row[2]) < max_windows_per_row(row[0]):
            open_by_free[row[1]].append(index)
    return [(bucket_len, row) for bucket_len, _, row in rows]


def _used(row: list[TokenWindow]) -> int:
    return sum(w.length for w in row)


def _rows_by_bucket(windows: list[TokenWindow], buckets: tuple[int, ...]) -> dict[int, list]:
    by_bucket: dict[int, list] = collections.defaultdict(list)
    for bucket_len, row in pack_rows(windows, buckets):
        by_bucket[bucket_len].append(row)
    return dict(sorted(by_bucket.items()))


def packing_round(windows: list[TokenWindow], config: BatchingConfig) -> tuple[list[Group], list[TokenWindow]]:
    """``(full batches of packed rows, windows held back)``, before the end of input. Full rows go first; up
    to ``HELD_BATCHES`` batches' worth of under-filled rows per bucket (and what fills no batch) are held
    back: their windows wait for the next round's short windows, so what waits stays under
    ``HELD_BATCHES + 1`` batches per bucket."""
    groups, held_rows = [], []
    for bucket_len, bucket_rows in _rows_by_bucket(windows, config.buckets).items():
        rows = rows_for(bucket_len, config.tokens_per_batch)
        full = lambda row, n=bucket_len: _used(row) == n or len(row) == max_windows_per_row(n)
        bucket_rows = sorted(bucket_rows, key=lambda row: (not full(row), -_used(row)))  # fullest first
        send = max(sum(map(full, bucket_rows)), len(bucket_rows) - HELD_BATCHES * rows) // rows * rows
        groups += [(bucket_len, rows, bucket_rows[i : i + rows]) for i in range(0, send, rows)]
        held_rows += bucket_rows[send:]
    return groups, [w for row in held_rows for w in row]


def final_packing(windows: list[TokenWindow], config: BatchingConfig) -> list[Group]:
    """Every window in batches of packed rows, at the end of input, packed the way that pads less: into
    every bucket's rows, the rows that fill no batch filled across buckets like held windows, or into the
    longest bucket's rows alone (a row of the longest bucket holds what two shorter ones would, so the last
    few windows fill fewer batches); on a tie the shorter rows, whose attention is cheaper. So
    ``config.buckets`` must be the buckets the encoder has compiled: the job's plan leaves out those past the
    one a full window needs."""
    ways = []
    for buckets in dict.fromkeys([config.buckets, config.buckets[-1:]]):
        groups, left = [], []
        for bucket_len, bucket_rows in _rows_by_bucket(windows, buckets).items():
            rows = rows_for(bucket_len, config.tokens_per_batch)
            whole = len(bucket_rows) // rows * rows
            groups += [(bucket_len, rows, bucket_rows[i : i + rows]) for i in range(0, whole, rows)]
            left += bucket_rows[whole:]
        groups += fill_across_buckets(left, config, length=_used, order=lambda row: (-_used(row), window_order(row[0])))
        ways.append((sum(rows * bucket_len for bucket_len, rows, _ in groups), len(buckets) == 1, groups))
    return min(ways, key=lambda way: way[:2])[2]


def padded_batch(windows: list[TokenWindow], bucket_len: int, rows: int) -> Batch:
    """One window per row; a partial batch is padded with empty rows (length 0) so it reuses the compiled
    full shape."""
    if len(windows) > rows:
        raise ValueError(f"{len(windows)} windows do not fit a batch of {rows} rows")
    ids_BxT = np.zeros((rows, bucket_len), np.int32)
    lengths_B = np.zeros((rows,), np.int32)
    windows = sorted(windows, key=lambda w: (w.doc_id, w.index))  # deterministic batch contents
    for row, w in enumerate(windows):
        ids_BxT[row, : w.length] = w.token_ids
        lengths_B[row] = w.length
    return Batch(
        batch_id=batch_id(bucket_len, windows, packed=False),
        bucket_len=bucket_len,
        ids_BxT=ids_BxT,
        lengths_B=lengths_B,
        windows=tuple(map(WindowRef.of, windows)),
    )


def packed_batch(rows_of_windows: list[list[TokenWindow]], bucket_len: int, rows: int) -> Batch:
    """Packed rows → a Batch of the bucket's full shape, with segment ids (1, 2, … per window in a row; 0 is
    padding) and slot lengths; rows and their windows in (doc_id, index) order, so a batch's contents and id
    do not depend on arrival order."""
    if len(rows_of_windows) > rows:
        raise ValueError(f"{len(rows_of_windows)} packed rows do not fit a batch of {rows} rows")
    slots = max_windows_per_row(bucket_len)
    key = lambda w: (w.doc_id, w.index)  # noqa: E731
    ordered = sorted((sorted(row, key=key) for row in rows_of_windows), key=lambda row: key(row[0]))
    ids_BxT = np.zeros((rows, bucket_len), np.int32)
    segment_ids_BxT = np.zeros((rows, bucket_len), np.int32)
    slot_lengths_BxK = np.zeros((rows, slots), np.int32)
    for r, row in enumerate(ordered):
        if len(row) > slots or _used(row) > bucket_len:
            raise ValueError(
                f"a packed row of {len(row)} windows, {_used(row)} tokens, does not "
                f"fit bucket {bucket_len} ({slots} windows at most)"
            )
        start = 0
        for k, w in enumerate(row):
            ids_BxT[r, start : start + w.length] = w.token_ids
            segment_ids_BxT[r, start : start + w.length] = k + 1
            slot_lengths_BxK[r, k] = w.length
            start += w.length
    windows = [w for row in ordered for w in row]
    return Batch(
        batch_id=batch_id(bucket_len, windows, packed=True),
        bucket_len=bucket_len,
        ids_BxT=ids_BxT,
        lengths_B=slot_lengths_BxK.sum(axis=1, dtype=np.int32),
        windows=tuple(map(WindowRef.of, windows)),
        segment_ids_BxT=segment_ids_BxT,
        slot_lengths_BxK=slot_lengths_BxK,
    )


def check_packing(config: BatchingConfig) -> bool:
    """The config's ``packing``, which the packer takes only resolved: the plan's ``batching()`` is such a config."""
    if not isinstance(config.packing, bool):
        raise ValueError(
            f"the packer takes batching.packing true or false, not {config.packing!r}: the job's plan "
            "resolves auto (pipeline.driver.plan.resolved_packing; JobPlan.batching() is that config)"
        )
    return config.packing


class Packer:
    """One shard's batching state machine: ``add`` a window and get the batches that became full; ``flush``
    at the end of input and get the rest. No window is lost or sent twice.

    Its state is ``held`` (windows not yet in a batch) and ``gathered`` (per bucket, what arrived since that
    bucket's last batch: windows when padding, tokens when packing), so a Beam DoFn can keep both in Beam
    state and resume a Packer per element. ``held`` may be a lazy iterable: it is read only when a batch or
    a round needs it, since reading Beam state per element would cost O(held) each time."""

    def __init__(
        self, config: BatchingConfig, held: Iterable[TokenWindow] = (), gathered: Mapping[int, int] | None = None
    ):
        self.config = config
        self.packing = check_packing(config)
        self._earlier: Iterable[TokenWindow] | None = held
        self._held: list[TokenWindow] = []
        self.gathered: collections.Counter = collections.Counter(gathered or {})

    @property
    def held(self) -> list[TokenWindow]:
        if self._earlier is not None:
            self._held, self._earlier = [*self._earlier, *self._held], None
        return self._held

    def add(self, window: TokenWindow) -> list[Batch]:
        bucket_len = bucket_for(window.length, self.config.buckets)
        self._held.append(window)
        if self.packing:
            self.gathered[bucket_len] += window.length
            if sum(self.gathered.values()) < round_tokens(self.config):
                return []
            groups, self._held = packing_round(self.held, self.config)
            self.gathered.clear()
            return [packed_batch(rows, b, n) for b, n, rows in groups]
        self.gathered[bucket_len] += 1
        rows = rows_for(bucket_len, self.config.tokens_per_batch)
        if self.gathered[bucket_len] < rows:
            return []
        in_bucket = lambda w: bucket_for(w.length, self.config.buckets) == bucket_len  # noqa: E731
        full = [w for w in self.held if in_bucket(w)]
        self._held = [w for w in self.held if not in_bucket(w)]
        del self.gathered[bucket_len]
        return [padded_batch(full, bucket_len, rows)]

    def flush(self) -> list[Batch]:
        held, self._held, self._earlier = self.held, [], None
        self.gathered.clear()
        if self.packing:
            return [packed_batch(rows, b, n) for b, n, rows in final_packing(held, self.config)]
        return [
            padded_batch(windows, b, n)
            for b, n, windows in fill_across_buckets(held, self.config, length=lambda w: w.length, order=window_order)
        ]


def batch_windows(windows: Iterable[TokenWindow], config: BatchingConfig) -> list[Batch]:
    """The batches BucketBatches makes of these windows, without Beam (the benchmarks time the encoder on
    these): one Packer per shard, fed in arrival order, flushed at the end."""
    packers: dict[int, Packer] = {}
    batches = []
    for w in windows:
        shard = window_shard(w, config)
        batches += packers.setdefault(shard, Packer(config)).add(w)
    for shard in sorted(packers):
        batches += packers[shard].flush()
    return batches
