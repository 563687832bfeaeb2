"""The packer without packing (pipeline/stages/packer.py, driven in Beam by pipeline/stages/batch.py): a window is
padded to the smallest bucket that fits; ``Packer.add`` returns a bucket's batch the moment it has a batch's worth
of windows, and nothing before; ``Packer.flush`` fills what is held across buckets, longest first. Every window
lands in exactly one batch, of its bucket's one fixed shape."""

from __future__ import annotations

import collections
import random

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from conftest import with_packing

from docbeam.config import BatchingConfig
from docbeam.pipeline.records import TokenWindow, WindowRef
from docbeam.pipeline.stages.batch import BucketBatches
from docbeam.pipeline.stages.packer import (
    Packer,
    batch_windows,
    bucket_for,
    fill_across_buckets,
    padded_batch,
    rows_for,
    shard_for,
)

BUCKETS = (16, 32, 64)
CONFIG = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128)  # rows per batch: 8 at 16, 4 at 32, 2 at 64


def window(doc_id: str, index: int, length: int, num_windows: int = 1) -> TokenWindow:
    token_ids = np.arange(101, 101 + length, dtype=np.int32)
    return TokenWindow(doc_id, index, num_windows, token_ids, doc_tokens=length - 2, truncated=False)


def ids(batches) -> list[list[str]]:
    return [[doc_id for doc_id, *_ in b.windows] for b in batches]


# --- arithmetic --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, bucket", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)])
def test_a_window_goes_to_the_smallest_bucket_that_fits(length, bucket):
    assert bucket_for(length, BUCKETS) == bucket


def test_a_window_longer_than_every_bucket_names_batching_buckets():
    with pytest.raises(ValueError, match=r"65 tokens fits no bucket \(largest 64\).*batching\.buckets"):
        bucket_for(65, BUCKETS)


@pytest.mark.parametrize(
    "bucket_len, tokens_per_batch, rows", [(16, 512, 32), (64, 512, 8), (96, 512, 5), (512, 512, 1), (1024, 512, 1)]
)
def test_rows_fill_the_token_budget_and_never_drop_below_one(bucket_len, tokens_per_batch, rows):
    assert rows_for(bucket_len, tokens_per_batch) == rows


def test_shard_is_deterministic_in_range_and_spread():
    shards = [shard_for(f"doc{i}", i % 3, 4) for i in range(400)]
    assert shards == [shard_for(f"doc{i}", i % 3, 4) for i in range(400)]
    counts = collections.Counter(shards)
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 60  # 100 expected per shard
    assert shard_for("doc", 0, 1) == 0


def test_shard_depends_on_the_window_index():
    assert len({shard_for("doc", i, 8) for i in range(32)}) > 1


# --- one batch ---------------------------------------------------------------------------------------------


def test_a_padded_batch_has_the_full_shape_with_zero_padding_rows_and_columns():
    batch = padded_batch([window("b", 0, 5), window("a", 1, 3, num_windows=2)], bucket_len=8, rows=4)
    assert batch.ids_BxT.shape == (4, 8) and batch.ids_BxT.dtype == np.int32 and not batch.packed
    assert batch.lengths_B.tolist() == [3, 5, 0, 0]
    assert batch.ids_BxT.tolist() == [
        [101, 102, 103, 0, 0, 0, 0, 0],
        [101, 102, 103, 104, 105, 0, 0, 0],
        [0] * 8,
        [0] * 8,
    ]
    assert batch.windows == (("a", 1, 2, 1, False, 0, 0), ("b", 0, 1, 3, False, 0, 0))  # ..., char_start, char_end
    assert (batch.bucket_len, batch.rows, batch.real_rows, batch.real_tokens) == (8, 4, 2, 8)
    assert batch.batch_id.startswith("b8-")


def test_a_padded_batch_id_depends_on_contents_not_order():
    windows = [window("b", 0, 5), window("a", 0, 3), window("a", 1, 4)]
    assert padded_batch(windows, 8, 4).batch_id == padded_batch(windows[::-1], 8, 4).batch_id
    assert padded_batch(windows, 8, 4).batch_id != padded_batch(windows[:2], 8, 4).batch_id


def test_a_padded_batch_refuses_more_windows_than_rows():
    with pytest.raises(ValueError, match="3 windows do not fit a batch of 2 rows"):
        padded_batch([window("a", i, 4) for i in range(3)], bucket_len=8, rows=2)


# --- the state machine ---------------------------------------------------------------------------------------


def test_add_returns_nothing_until_a_bucket_has_a_batch_of_windows_then_exactly_that_batch():
    packer = Packer(with_packing(CONFIG, False))
    assert packer.add(window("long", 0, 60)) == []
    for i in range(7):
        assert packer.add(window(f"s{i}", 0, 10)) == []  # 7 of bucket 16's 8 rows
    assert packer.add(window("mid", 0, 20)) == []
    [batch] = packer.add(window("s7", 0, 10))
    assert (batch.bucket_len, batch.rows, batch.real_rows) == (16, 8, 8)
    assert ids([batch]) == [[f"s{i}" for i in range(8)]]
    assert sorted(w.doc_id for w in packer.held) == ["long", "mid"]  # other buckets wait
    assert packer.add(window("s8", 0, 10)) == []  # bucket 16 starts over


def test_flush_fills_what_is_held_across_buckets_longest_first_then_holds_nothing():
    packer = Packer(with_packing(CONFIG, False))
    for w in (window("a", 0, 5), window("b", 0, 60), window("c", 0, 20), window("d", 0, 3), window("e", 0, 30)):
        assert packer.add(w) == []
    # Longest first: 60 takes a batch of 64 (2 rows) with the next longest, 30; the rest fill a batch of 32.
    batches = packer.flush()
    assert [(b.bucket_len, b.rows) for b in batches] == [(64, 2), (32, 4)]
    assert ids(batches) == [["b", "e"], ["a", "c", "d"]]
    assert packer.held == [] and packer.flush() == []


@pytest.mark.parametrize("packing", [False, True])
def test_a_packer_resumed_from_its_state_makes_the_batches_of_one_that_never_stopped(packing):
    """What the Beam DoFn does: per window a fresh Packer from (held, gathered) in Beam state."""
    rng = random.Random(3)
    windows = [window(f"d{i:03d}", 0, rng.randint(2, 64)) for i in range(200)]
    whole, resumed, held, gathered = Packer(with_packing(CONFIG, packing)), [], [], {}
    expected = [b for w in windows for b in whole.add(w)] + whole.flush()
    for w in windows:
        packer = Packer(with_packing(CONFIG, packing), held=iter(held), gathered=gathered)
        resumed += packer.add(w)
        held, gathered = list(packer.held), dict(packer.gathered)
    resumed += Packer(with_packing(CONFIG, packing), held=held, gathered=gathered).flush()
    assert len(expected) > 10 and [b.batch_id for b in resumed] == [b.batch_id for b in expected]


@pytest.mark.parametrize("packing", ["auto", None, 1])
def test_the_packer_refuses_anything_but_a_resolved_bool_and_names_the_key(packing):
    with pytest.raises(ValueError, match="batching.packing true or false.*resolved_packing"):
        Packer(with_packing(CONFIG, packing))
    with pytest.raises(ValueError, match="batching.packing"):
        BucketBatches(with_packing(CONFIG, packing))


def test_no_window_is_lost_or_sent_twice_and_every_batch_has_its_buckets_shape():
    rng = random.Random(0)
    for _ in range(50):
        config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=rng.choice([64, 128, 512]))
        windows = [window(f"d{i:03d}", rng.randint(0, 2), rng.randint(1, 64)) for i in range(rng.randint(0, 120))]
        packer = Packer(with_packing(config, False))
        full = [b for w in windows for b in packer.add(w)]
        batches = full + packer.flush()
        assert sorted(w[:2] for b in batches for w in b.windows) == sorted((w.doc_id, w.index) for w in windows)
        assert all(b.ids_BxT.shape == (rows_for(b.bucket_len, config.tokens_per_batch), b.bucket_len) for b in batches)
        assert all(b.real_rows == b.rows for b in full)  # before the end, only full batches leave


# --- filling across buckets ----------------------------------------------------------------------------------


def test_held_windows_fill_the_empty_rows_of_a_longer_buckets_batch():
    # One window of 60 and one of 5 are held: one batch of 64 holds both (128 padded tokens) where a batch per
    # bucket would pad 256.
    assert fill_across_buckets([5, 60], CONFIG, length=int, order=lambda n: -n) == [(64, 2, [60, 5])]


def test_filling_across_buckets_never_pads_more_than_a_partial_batch_per_bucket():
    rng = random.Random(0)
    for _ in range(500):
        buckets = tuple(sorted(rng.sample(range(8, 520, 8), rng.randint(1, 8))))
        config = BatchingConfig(buckets=buckets, tokens_per_batch=rng.choice([96, 128, 500, 2048, 8192]))
        lows = (0,) + buckets[:-1]
        held = [
            rng.randint(lo + 1, b)
            for lo, b in zip(lows, buckets)
            for _ in range(rng.randint(0, rows_for(b, config.tokens_per_batch) - 1))
        ]
        groups = fill_across_buckets(held, config, length=int, order=lambda n: -n)
        assert sorted(it for _, _, group in groups for it in group) == sorted(held)
        assert all(len(group) <= rows and max(group) <= b for b, rows, group in groups)
        one_per_bucket = sum(b * rows_for(b, config.tokens_per_batch) for b in {bucket_for(n, buckets) for n in held})
        assert sum(b * rows for b, rows, _ in groups) <= one_per_bucket, (buckets, config.tokens_per_batch, held)


# --- in Beam -------------------------------------------------------------------------------------------------


def per_key_counts(windows: list[TokenWindow], config: BatchingConfig) -> collections.Counter:
    return collections.Counter(
        (bucket_for(w.length, config.buckets), shard_for(w.doc_id, w.index, config.shards)) for w in windows
    )


def full_batches(windows: list[TokenWindow], config: BatchingConfig) -> list[int]:
    """The bucket of each full batch of one bucket's own windows that every (bucket, shard) key must make."""
    return sorted(
        b
        for (b, _), n in per_key_counts(windows, config).items()
        for _ in range(n // rows_for(b, config.tokens_per_batch))
    )


def one_partial_batch_per_key_tokens(windows: list[TokenWindow], config: BatchingConfig) -> int:
    """Padded tokens if what each key holds at the end made its own partial batch (what filling across buckets
    must not exceed)."""
    return sum(
        -(-n // rows_for(b, config.tokens_per_batch)) * rows_for(b, config.tokens_per_batch) * b
        for (b, _), n in per_key_counts(windows, config).items()
    )


def problems(batch, by_id: dict, config: BatchingConfig) -> list[str]:
    """What is wrong with one batch's shape, padding or rows: nothing, for a good batch."""
    out = []
    if batch.ids_BxT.shape != (rows_for(batch.bucket_len, config.tokens_per_batch), batch.bucket_len):
        out.append(f"{batch.batch_id}: shape {batch.ids_BxT.shape}")
    if len({shard_for(doc_id, index, config.shards) for doc_id, index, *_ in batch.windows}) != 1:
        out.append(f"{batch.batch_id}: windows of several shards")
    for row, (doc_id, index, *_) in enumerate(batch.windows):
        w = by_id[doc_id, index]
        if batch.ids_BxT[row].tolist() != w.token_ids.tolist() + [0] * (batch.bucket_len - w.length):
            out.append(f"{batch.batch_id}: row {row} is not {doc_id}#{index} padded with zeros")
        if batch.lengths_B[row] != w.length:
            out.append(f"{batch.batch_id}: row {row} has length {batch.lengths_B[row]}, not {w.length}")
    if batch.lengths_B[batch.real_rows :].any() or batch.ids_BxT[batch.real_rows :].any():
        out.append(f"{batch.batch_id}: padding rows are not all zero with length 0")
    return out


LENGTHS = [3, 16, 17, 40, 64, 5, 30, 9, 12, 33, 2, 15, 16, 31, 50, 8, 7, 6, 60, 20, 11, 4, 18, 19, 45, 13, 14, 10]


@pytest.mark.parametrize("shards", [1, 3])
def test_bucket_batches_put_every_window_once_in_full_then_padded_batches(shards):
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, shards=shards)  # rows: 8, 4, 2
    windows = [window(f"doc{i // 3}", i % 3, n, num_windows=3) for i, n in enumerate(LENGTHS)]
    by_id = {(w.doc_id, w.index): w for w in windows}

    with TestPipeline() as p:
        batches = p | beam.Create(windows) | BucketBatches(with_packing(config, False))
        assert_that(
            batches
            | "Placed"
            >> beam.FlatMap(
                lambda b: [(d, i, b.bucket_len >= bucket_for(by_id[d, i].length, BUCKETS)) for d, i, *_ in b.windows]
            ),
            equal_to([(w.doc_id, w.index, True) for w in windows]),
            label="EveryWindowOnceInABucketItFits",
        )
        assert_that(
            batches | "Problems" >> beam.FlatMap(problems, by_id, config), equal_to([]), label="FixedShapesZeroPadding"
        )
        padded = batches | "Padded" >> beam.Map(lambda b: b.ids_BxT.size) | beam.CombineGlobally(sum)
        assert_that(
            padded | beam.Map(lambda n: n <= one_partial_batch_per_key_tokens(windows, config)),
            equal_to([True]),
            label="NoMorePaddingThanOnePartialBatchPerKey",
        )
        fulls = (
            batches
            | beam.Filter(
                lambda b: (
                    b.real_rows == b.rows
                    and all(bucket_for(by_id[d, i].length, BUCKETS) == b.bucket_len for d, i, *_ in b.windows)
                )
            )
            | beam.Map(lambda b: b.bucket_len)
        )
        assert_that(
            fulls
            | beam.combiners.ToList()
            | beam.Map(
                lambda got: all(
                    got.count(b) >= n for b, n in collections.Counter(full_batches(windows, config)).items()
                )
            ),
            equal_to([True]),
            label="EveryKeyFillsItsFullBatches",
        )


@pytest.mark.parametrize("shards", [1, 3])
def test_batch_windows_makes_the_batches_bucket_batches_makes(shards):
    """The benchmarks time the encoder on batch_windows' batches: they must be the pipeline's."""
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, shards=shards)
    windows = [window(f"doc{i // 3}", i % 3, n, num_windows=3) for i, n in enumerate(LENGTHS)]
    by_id = {(w.doc_id, w.index): w for w in windows}
    batches = batch_windows(windows, with_packing(config, False))
    assert sorted(w for b in batches for w in b.windows) == sorted(WindowRef.of(w) for w in windows)
    assert [p for b in batches for p in problems(b, by_id, config)] == []
    with TestPipeline() as p:
        made = (
            p
            | beam.Create(windows)
            | BucketBatches(with_packing(config, False))
            | beam.Map(lambda b: (b.batch_id, b.windows))
        )
        assert_that(made, equal_to([(b.batch_id, b.windows) for b in batches]))


def test_windows_that_fill_no_batch_reach_a_later_group_by_key():
    # Regression: with beam.GroupIntoBatches, a batch flushed only at the end of the window reached a later
    # GroupByKey after it had completed on the DirectRunner (apache/beam#28716): a small job crashed or lost
    # its documents.
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128)  # 8 rows of 16: three windows fill no batch
    windows = [window(f"doc{i}", 0, 5) for i in range(3)]

    with TestPipeline() as p:
        doc_ids = (
            p
            | beam.Create(windows)
            | BucketBatches(with_packing(config, False))
            | beam.FlatMap(lambda b: [(doc_id, index) for doc_id, index, *_ in b.windows])
            | "GroupWindows" >> beam.GroupByKey()  # as PoolDocuments does
            | beam.Keys()
        )
        assert_that(doc_ids, equal_to(["doc0", "doc1", "doc2"]), label="EveryDocumentArrives")
