"""The packer with packing (pipeline/stages/packer.py): several windows per row, told apart by segment ids.
``Packer.add`` returns nothing until a shard has gathered ``round_tokens`` new tokens, then a round's full
batches only, holding back what waits (bounded); ``Packer.flush`` packs everything held. Every window lands
once, whole, in a row of a configured bucket; packed rows pad less than one window per row. What the encoder
and the attention backends do with packed rows: tests/packed_encoding_test.py."""

from __future__ import annotations

import random

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from conftest import seeded_window as window
from conftest import with_packing

from docbeam.config import BatchingConfig
from docbeam.pipeline.records import TokenWindow
from docbeam.pipeline.stages.batch import BucketBatches
from docbeam.pipeline.stages.packer import (
    HELD_BATCHES,
    Packer,
    batch_windows,
    final_packing,
    max_windows_per_row,
    pack_rows,
    packed_batch,
    packing_round,
    round_tokens,
)
from docbeam.pipeline.tools.bucket_advisor import padding_efficiency

BUCKETS = (16, 32, 64)


def unpack(batch) -> dict:
    """(doc_id, index) → the token ids the batch holds for that window, read back from ids and segments."""
    out = {}
    slot = 0
    for r in range(batch.rows):
        for k in range(batch.slot_lengths_BxK.shape[1]):
            if batch.slot_lengths_BxK[r, k]:
                doc_id, index, *_ = batch.windows[slot]
                out[doc_id, index] = batch.ids_BxT[r][batch.segment_ids_BxT[r] == k + 1].tolist()
                slot += 1
    return out


def of_lengths(*lengths: int) -> list[TokenWindow]:
    return [window(f"d{i:03d}", 0, n) for i, n in enumerate(lengths)]


def lengths_of(rows) -> list:
    return [[w.length for w in row] for row in rows]


def test_short_windows_fill_the_room_a_long_one_leaves():
    # Longest first: 60 opens a row of 64, each 30 one of 32; 4 fits the 64's room exactly, 2 a 32's.
    rows = pack_rows(of_lengths(60, 4, 30, 2, 30), BUCKETS)
    assert [(b, [w.length for w in row]) for b, row in rows] == [(64, [60, 4]), (32, [30]), (32, [30, 2])]


def test_a_row_holds_no_more_windows_than_its_slots():
    rows = pack_rows(of_lengths(*[2] * 40), (32,))
    assert all(len(row) <= max_windows_per_row(32) for _, row in rows)
    assert sum(len(row) for _, row in rows) == 40


def test_packed_batch_lays_windows_out_with_segment_ids_and_slot_lengths():
    a, b, c = window("a", 0, 5), window("b", 0, 7), window("c", 0, 20)
    batch = packed_batch([[b, a], [c]], bucket_len=32, rows=4)
    assert batch.packed and batch.ids_BxT.shape == (4, 32) and batch.segment_ids_BxT.shape == (4, 32)
    assert batch.slot_lengths_BxK.shape == (4, max_windows_per_row(32))
    assert [w[0] for w in batch.windows] == ["a", "b", "c"]  # rows and windows in (doc_id, index) order
    assert batch.segment_ids_BxT[0].tolist() == [1] * 5 + [2] * 7 + [0] * 20
    assert batch.lengths_B.tolist() == [12, 20, 0, 0]
    assert batch.window_lengths().tolist() == [5, 7, 20]
    assert unpack(batch) == {
        ("a", 0): a.token_ids.tolist(),
        ("b", 0): b.token_ids.tolist(),
        ("c", 0): c.token_ids.tolist(),
    }
    assert batch.window_slots().tolist() == [0, 1, max_windows_per_row(32)]  # row 1, slot 0
    assert packed_batch([[c], [a, b]], 32, 4).batch_id == batch.batch_id


def test_packed_batch_refuses_a_row_longer_than_its_bucket():
    with pytest.raises(ValueError, match="does not fit bucket 16"):
        packed_batch([[window("a", 0, 10), window("b", 0, 10)]], bucket_len=16, rows=2)


@pytest.mark.parametrize("seed", range(3))
def test_packing_never_pads_more_than_bucketing_and_keeps_every_window_whole(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(2, 12), rng.randint(2, 64)]) for _ in range(300)]
    windows = [window(f"d{i:03d}", 0, n) for i, n in enumerate(lengths)]
    for shards in (1, 2):
        config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, shards=shards)
        packed, plain = (
            batch_windows(windows, with_packing(config, True)),
            batch_windows(windows, with_packing(config, False)),
        )
        held = {}
        for b in packed:
            assert b.ids_BxT.shape == (128 // b.bucket_len, b.bucket_len)
            assert (b.lengths_B <= b.bucket_len).all() and (
                b.segment_ids_BxT.max(axis=1) <= b.slot_lengths_BxK.shape[1]
            ).all()
            contents = unpack(b)
            assert not contents.keys() & held.keys()
            held.update(contents)
        assert held == {(w.doc_id, w.index): w.token_ids.tolist() for w in windows}
        assert sum(b.ids_BxT.size for b in packed) <= sum(b.ids_BxT.size for b in plain)
    assert padding_efficiency(lengths, BUCKETS, 128, packing=True) > padding_efficiency(lengths, BUCKETS, 128) + 0.1


def test_bucket_batches_packs_as_batch_windows_does():
    """Fewer tokens than a packing round: all is packed at the end of input, whatever the arrival order."""
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=512)
    windows = [
        window(f"doc{i // 3}", i % 3, n, num_windows=3)
        for i, n in enumerate([3, 16, 17, 40, 64, 5, 30, 9, 12, 33, 2, 15, 16, 31, 50, 8, 7, 6, 60, 20, 11, 4])
    ]
    assert sum(w.length for w in windows) < round_tokens(config)
    batches = batch_windows(windows, with_packing(config, True))
    with TestPipeline() as p:
        made = (
            p
            | beam.Create(windows[::-1])
            | BucketBatches(with_packing(config, True))
            | beam.Map(lambda b: (b.batch_id, b.windows, b.segment_ids_BxT.tolist()))
        )
        assert_that(made, equal_to([(b.batch_id, b.windows, b.segment_ids_BxT.tolist()) for b in batches]))


def test_add_returns_nothing_until_a_round_then_only_full_batches_and_what_waits_stays_bounded():
    """Each time a shard has gathered round_tokens new tokens, before the end of input: the first batches
    leave early, and what waits stays bounded whatever the input's size."""
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128)
    packer, new, rounds, sent = Packer(with_packing(config, True)), 0, 0, []
    for i in range(400):
        w = window(f"d{i:04d}", 0, 5 + i % 60)
        new += w.length
        batches = packer.add(w)
        if new < round_tokens(config):
            assert batches == [], "a batch left before its shard gathered a round's tokens"
            continue
        assert batches, "a round sent no batch"
        assert all(b.packed and len({r for r in range(b.rows) if b.lengths_B[r]}) == b.rows for b in batches)
        assert sum(w.length for w in packer.held) < (HELD_BATCHES + 1) * len(BUCKETS) * config.tokens_per_batch
        new, rounds, sent = 0, rounds + 1, sent + batches
    assert rounds > 10 and len(sent) > 10
    rest = packer.flush()
    assert packer.held == [] and packer.flush() == []
    assert sorted(w[0] for b in sent + rest for w in b.windows) == [f"d{i:04d}" for i in range(400)]


def test_a_round_sends_full_rows_first_and_holds_back_under_filled_ones_for_later_windows():
    config = BatchingConfig(buckets=(64,), tokens_per_batch=128)  # 2 rows per batch
    # Two rows fill exactly (60 + 4); six hold one 50 each, room a later 14 could fill.
    groups, held = packing_round(of_lengths(60, 60, *[50] * 6, 4, 4), config)
    assert groups[0][:2] == (64, 2) and lengths_of(groups[0][2]) == [[60, 4], [60, 4]]
    # More under-filled rows than HELD_BATCHES batches: the surplus goes out, in full batches.
    assert [lengths_of(rows) for _, _, rows in groups[1:]] == [[[50], [50]]] * (6 // 2 - HELD_BATCHES)
    assert [w.length for w in held] == [50] * (2 * HELD_BATCHES)


def test_the_end_of_input_packs_into_the_longest_bucket_when_that_pads_less():
    config = BatchingConfig(buckets=(32, 64), tokens_per_batch=128)  # 4 rows of 32, 2 of 64
    # Five 20s: five rows of 32 (two batches) or two rows of 64 (one).
    [(bucket_len, rows, packed)] = final_packing(of_lengths(*[20] * 5), config)
    assert (bucket_len, rows, lengths_of(packed)) == (64, 2, [[20, 20, 20], [20, 20]])
    # Four 30s pad alike either way: the shorter rows are kept, their attention is cheaper.
    [(bucket_len, rows, packed)] = final_packing(of_lengths(*[30] * 4), config)
    assert (bucket_len, rows, lengths_of(packed)) == (32, 4, [[30], [30], [30], [30]])


def test_bucket_batches_puts_every_window_of_a_large_input_in_one_batch():
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128)
    windows = [window(f"d{i:04d}", 0, 5 + i % 60) for i in range(400)]
    assert sum(w.length for w in windows) > 10 * round_tokens(config)  # many rounds, then the end of input
    with TestPipeline() as p:
        made = (
            p
            | beam.Create(windows)
            | BucketBatches(with_packing(config, True))
            | beam.FlatMap(lambda b: [w[:2] for w in b.windows])
        )
        assert_that(made, equal_to([(w.doc_id, w.index) for w in windows]))
