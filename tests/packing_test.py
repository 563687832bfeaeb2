"""batching.packing: several windows per row, told apart by segment ids. Every window lands once, whole
and in a row of a configured bucket; packed rows pad less than one window per row; the encoder gives a
packed window the vector it gives it alone; backends that take no segment ids are refused."""
from __future__ import annotations

import os
import random

import apache_beam as beam
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

import attention
from attention.interface import AttentionCase
from attention.plan import AttentionPlanError, AttentionSpec, choose_backends
from attention.registry import from_callable
from pipeline.stages.bucket import (HELD_BATCHES, BucketBatches, batch_windows, max_windows_per_row, pack_batch, pack_rows,
                                    pack_threshold, packed_batches, padding_efficiency, window_order)
from pipeline.driver.config import BatchingConfig
from pipeline.records import TokenWindow

BUCKETS = (16, 32, 64)


def window(doc_id: str, index: int, length: int, num_windows: int = 1, seed: int = 0) -> TokenWindow:
    token_ids = np.random.default_rng(hash((doc_id, index, seed)) % 2**32).integers(5, 90, length).astype(np.int32)
    return TokenWindow(doc_id, index, num_windows, token_ids, doc_tokens=length - 2, truncated=False)


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


def test_short_windows_fill_the_room_a_long_one_leaves():
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, packing=True)
    # Longest first: 60 opens a row of 64, each 30 one of 32; 4 fits the 64's room exactly, 2 a 32's.
    assert pack_rows([60, 4, 30, 2, 30], config, length=int) == [(64, [60, 4]), (32, [30]), (32, [30, 2])]


def test_a_row_holds_no_more_windows_than_its_slots():
    config = BatchingConfig(buckets=(32,), tokens_per_batch=128, packing=True)
    rows = pack_rows([2] * 40, config, length=int)
    assert all(len(row) <= max_windows_per_row(32) for _, row in rows)
    assert sum(len(row) for _, row in rows) == 40


def test_pack_batch_lays_windows_out_with_segment_ids_and_slot_lengths():
    a, b, c = window("a", 0, 5), window("b", 0, 7), window("c", 0, 20)
    batch = pack_batch([[b, a], [c]], bucket_len=32, rows=4)
    assert batch.packed and batch.ids_BxT.shape == (4, 32) and batch.segment_ids_BxT.shape == (4, 32)
    assert batch.slot_lengths_BxK.shape == (4, max_windows_per_row(32))
    assert [w[0] for w in batch.windows] == ["a", "b", "c"]  # rows and windows in (doc_id, index) order
    assert batch.segment_ids_BxT[0].tolist() == [1] * 5 + [2] * 7 + [0] * 20
    assert batch.lengths_B.tolist() == [12, 20, 0, 0]
    assert batch.window_lengths().tolist() == [5, 7, 20]
    assert unpack(batch) == {("a", 0): a.token_ids.tolist(), ("b", 0): b.token_ids.tolist(),
                             ("c", 0): c.token_ids.tolist()}
    assert batch.window_slots().tolist() == [0, 1, max_windows_per_row(32)]  # row 1, slot 0
    assert pack_batch([[c], [a, b]], 32, 4).batch_id == batch.batch_id


def test_pack_batch_refuses_a_row_longer_than_its_bucket():
    with pytest.raises(ValueError, match="does not fit bucket 16"):
        pack_batch([[window("a", 0, 10), window("b", 0, 10)]], bucket_len=16, rows=2)


@pytest.mark.parametrize("seed", range(3))
def test_packing_never_pads_more_than_bucketing_and_keeps_every_window_whole(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(2, 12), rng.randint(2, 64)]) for _ in range(300)]
    windows = [window(f"d{i:03d}", 0, n) for i, n in enumerate(lengths)]
    for shards in (1, 2):
        packed = batch_windows(windows, BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, shards=shards,
                                                       packing=True))
        plain = batch_windows(windows, BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, shards=shards))
        held = {}
        for b in packed:
            assert b.ids_BxT.shape == (128 // b.bucket_len, b.bucket_len)
            assert (b.lengths_B <= b.bucket_len).all() and (b.segment_ids_BxT.max(axis=1) <= b.slot_lengths_BxK.shape[1]).all()
            contents = unpack(b)
            assert not contents.keys() & held.keys()
            held.update(contents)
        assert held == {(w.doc_id, w.index): w.token_ids.tolist() for w in windows}
        assert sum(b.ids_BxT.size for b in packed) <= sum(b.ids_BxT.size for b in plain)
    assert padding_efficiency(lengths, BUCKETS, 128, packing=True) > padding_efficiency(lengths, BUCKETS, 128) + 0.1


def test_bucket_batches_packs_as_batch_windows_does():
    """Fewer tokens than a packing round: all is packed at the end of input, whatever the arrival order."""
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=512, packing=True)
    windows = [window(f"doc{i // 3}", i % 3, n, num_windows=3) for i, n in enumerate(
        [3, 16, 17, 40, 64, 5, 30, 9, 12, 33, 2, 15, 16, 31, 50, 8, 7, 6, 60, 20, 11, 4])]
    assert sum(w.length for w in windows) < pack_threshold(config)
    batches = batch_windows(windows, config)
    with TestPipeline() as p:
        made = (p | beam.Create(windows[::-1]) | BucketBatches(config)
                | beam.Map(lambda b: (b.batch_id, b.windows, b.segment_ids_BxT.tolist())))
        assert_that(made, equal_to([(b.batch_id, b.windows, b.segment_ids_BxT.tolist()) for b in batches]))


def test_a_packing_round_sends_full_batches_and_keeps_what_waits_bounded():
    """What _PackByShard does each time a shard has gathered pack_threshold new tokens, before the end of input:
    the first batches leave early, and what waits stays bounded whatever the input's size."""
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, packing=True)
    windows = [window(f"d{i:04d}", 0, 5 + i % 60) for i in range(400)]
    left, sent, rounds, new = [], 0, 0, 0
    for w in windows:
        left.append(w)
        new += w.length
        if new >= pack_threshold(config):
            groups, left = packed_batches(left, config, length=lambda w: w.length, order=window_order, final=False)
            assert groups, "a round sent no batch"
            assert all(len(rows) == n for _, n, rows in groups)  # only full batches leave before the end
            assert sum(w.length for w in left) < (HELD_BATCHES + 1) * len(BUCKETS) * config.tokens_per_batch
            sent, rounds, new = sent + len(groups), rounds + 1, 0
    assert rounds > 10 and sent > 10


def test_a_round_sends_full_rows_first_and_holds_back_under_filled_ones_for_later_windows():
    config = BatchingConfig(buckets=(64,), tokens_per_batch=128, packing=True)  # 2 rows per batch
    # Two rows fill exactly (60 + 4); six hold one 50 each, room a later 14 could fill.
    groups, left = packed_batches([60, 60] + [50] * 6 + [4, 4], config, length=int, final=False)
    assert groups[0] == (64, 2, [[60, 4], [60, 4]])
    # More under-filled rows than HELD_BATCHES batches: the surplus goes out, in full batches.
    assert [rows for _, _, rows in groups[1:]] == [[[50], [50]]] * (6 // 2 - HELD_BATCHES)
    assert left == [50] * (2 * HELD_BATCHES)


def test_the_end_of_input_packs_into_the_longest_bucket_when_that_pads_less():
    config = BatchingConfig(buckets=(32, 64), tokens_per_batch=128, packing=True)  # 4 rows of 32, 2 of 64
    # Five 20s: five rows of 32 (two batches) or two rows of 64 (one).
    assert packed_batches([20] * 5, config, length=int) == ([(64, 2, [[20, 20, 20], [20, 20]])], [])
    # Four 30s pad alike either way: the shorter rows are kept, their attention is cheaper.
    assert packed_batches([30] * 4, config, length=int) == ([(32, 4, [[30], [30], [30], [30]])], [])


def test_bucket_batches_puts_every_window_of_a_large_input_in_one_batch():
    config = BatchingConfig(buckets=BUCKETS, tokens_per_batch=128, packing=True)
    windows = [window(f"d{i:04d}", 0, 5 + i % 60) for i in range(400)]
    assert sum(w.length for w in windows) > 10 * pack_threshold(config)  # many rounds, then the end of input
    with TestPipeline() as p:
        made = p | beam.Create(windows) | BucketBatches(config) | beam.FlatMap(lambda b: [w[:2] for w in b.windows])
        assert_that(made, equal_to([(w.doc_id, w.index) for w in windows]))


# --- the encoder: a packed window is encoded as if alone -------------------------------------------------

@pytest.mark.parametrize("pooling, position, backend", [
    ("mean", "absolute", "native"), ("cls", "absolute", "native"), ("lasttoken", "absolute", "native"),
    ("mean", "rope", "native"), ("cls", "rope", "native"), ("lasttoken", "rope", "native"),
    ("mean", "rope", "chunked"), ("lasttoken", "rope", "chunked"),
    ("cls", "absolute", "flash")])  # every built-in backend takes segment ids
def test_a_packed_window_gets_the_vector_it_gets_alone(pooling, position, backend):
    from models.encoder import Encoder, EncoderConfig, embed_fn

    config = EncoderConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                           max_position=64, position=position)
    attend = attention.get(backend).bind()
    params = Encoder(config, attend).init(jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32),
                                          jnp.ones((1,), jnp.int32))["params"]
    embed = jax.jit(embed_fn(config, attend, pooling))
    windows = [window("a", 0, 9), window("b", 0, 14), window("c", 0, 5), window("d", 0, 30), window("e", 0, 3)]
    packed = pack_batch([[windows[0], windows[1], windows[2]], [windows[3]], [windows[4]]], bucket_len=32, rows=4)
    out = np.asarray(embed(params, packed.ids_BxT, packed.lengths_B, packed.segment_ids_BxT,
                           packed.slot_lengths_BxK))
    got = out.reshape(-1, out.shape[-1])[packed.window_slots()]
    alone_ids = np.zeros((5, 32), np.int32)
    for r, w in enumerate(windows):
        alone_ids[r, :w.length] = w.token_ids
    alone = np.asarray(embed(params, alone_ids, np.array([w.length for w in windows], np.int32)))
    np.testing.assert_allclose(got, alone, atol=2e-6)


@pytest.mark.parametrize("implementation", ["einsum", "jax_nn"])
def test_native_attends_only_within_a_segment(implementation):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 12, 2, 8)), jnp.float32) for _ in range(3))
    segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3], jnp.int32)
    backend = attention.get("native")
    attend = backend.bind(backend.parse_options({"implementation": implementation}))
    out = np.asarray(attend(q, k, v, kv_lengths_B=jnp.asarray([9]), scale=0.3, segment_ids_BxT=segments))
    for lo, hi in ((0, 5), (5, 9)):
        alone = attend(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], kv_lengths_B=jnp.asarray([hi - lo]), scale=0.3)
        np.testing.assert_allclose(out[:, lo:hi], np.asarray(alone), atol=1e-6)
    assert np.isfinite(out).all()


# --- the capability check -------------------------------------------------------------------------------

def _case(packed: bool) -> AttentionCase:
    return AttentionCase(platform="cpu", dtype="float32", seq_len=32, num_heads=4, head_dim=8, packed=packed)


def test_a_backend_without_segment_ids_is_refused_for_packed_rows_and_names_the_key():
    def plain(q, k, v, *, kv_lengths_B, scale):
        return v

    backend = from_callable("plain_user", plain)
    spec = AttentionSpec(backend="plain_user", options=backend.parse_options(None))
    assert backend.refusal(_case(False)) is None
    assert not backend.refusal(_case(True)).ok
    attention.registry._REGISTRY.setdefault("plain_user", backend)
    with pytest.raises(AttentionPlanError, match="batching.packing"):
        choose_backends(spec, [_case(True)])
    native = attention.get("native")
    with_fallback = AttentionSpec(backend="plain_user", options=backend.parse_options(None), fallback="native",
                                  fallback_options=native.parse_options(None))
    [choice] = choose_backends(with_fallback, [_case(True)])
    assert choice.backend == "native" and "segment ids" in choice.fallback_reason


def test_a_user_backend_that_declares_segment_ids_is_handed_them():
    seen = {}

    def mine(q, k, v, *, kv_lengths_B, scale, segment_ids_BxT=None):
        seen["segments"] = segment_ids_BxT
        return v

    mine.supports_segments = True
    backend = from_callable("mine_segments", mine)
    assert backend.segments and backend.refusal(_case(True)) is None
    v = jnp.ones((1, 4, 1, 2))
    backend.bind()(v, v, v, kv_lengths_B=jnp.asarray([4]), scale=1.0, segment_ids_BxT=jnp.asarray([[1, 1, 2, 2]]))
    assert seen["segments"].tolist() == [[1, 1, 2, 2]]


def test_packed_probes_run_native_with_two_windows_in_a_row():
    from attention.plan import probe, probe_inputs

    _, _, _, kwargs = probe_inputs(_case(True))
    assert kwargs["segment_ids_BxT"][0].max() == 2 and kwargs["segment_ids_BxT"][1].max() == 1
    native = attention.get("native")
    spec = AttentionSpec(backend="native", options=native.parse_options(None))
    [choice] = choose_backends(spec, [_case(True)])
    probe(spec, choice)  # raises on a crash or a non-finite output


USER_BACKEND = "tests.fixtures_user_backend:attend"  # a plain AttentionFn: takes no segment ids


@pytest.mark.parametrize("backend, fallback, packs", [("native", None, True), ("chunked", None, True),
                                                      ("flash", "native", True), (USER_BACKEND, None, False),
                                                      ("chunked", USER_BACKEND, False)])
def test_auto_packs_only_when_every_backend_the_job_may_run_takes_segment_ids(backend, fallback, packs, monkeypatch):
    from pipeline.driver.config import JobConfig

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pipeline.driver.plan import resolved_packing

    cfg = JobConfig.model_validate({"input": {"path": "x"}, "output": {"path": "y"}, "model": {"path": "m"},
                                    "attention": {"backend": backend, "fallback": fallback}})
    assert cfg.batching.packing == "auto"
    assert resolved_packing(cfg) is packs
    explicit = cfg.model_copy(update={"batching": BatchingConfig(packing=False)})
    assert resolved_packing(explicit) is False


def test_a_non_finite_window_does_not_take_its_packed_row_mates_with_it(tiny_checkpoint_dir):
    """Token 7's embedding is NaN: window "bad" holds it. Packed in one row with "good", attention would carry
    the NaN into "good" (weight 0 × NaN); the runtime encodes the row's windows again, each alone."""
    from pipeline.stages.encode import load_encoder, standalone_spec

    native = attention.get("native")
    runtime = load_encoder(standalone_spec(tiny_checkpoint_dir, "float32", "mean",
                                           AttentionSpec("native", native.parse_options(None)), (16, 32), packing=True))
    good = TokenWindow("good", 0, 1, np.arange(20, 30, dtype=np.int32), 8, False)
    bad = TokenWindow("bad", 0, 1, np.array([20, 7, 21, 22], np.int32), 2, False)
    other = TokenWindow("other", 0, 1, np.arange(40, 52, dtype=np.int32), 10, False)
    clean, _ = runtime.encode(pack_batch([[good], [other]], 32, 2))
    embedding = runtime.params["embed"]["word"]["embedding"]
    runtime.params["embed"]["word"]["embedding"] = embedding.at[7].set(jnp.nan)
    batch = pack_batch([[good, bad], [other]], 32, 2)
    assert batch.segment_ids_BxT[0].max() == 2  # bad and good share row 0
    vectors, timing = runtime.encode(batch)
    by_id = {w[0]: v for w, v in zip(batch.windows, vectors)}
    assert not np.isfinite(by_id["bad"]).all()
    np.testing.assert_allclose(by_id["good"], clean[0], atol=2e-6)
    np.testing.assert_allclose(by_id["other"], clean[1], atol=2e-6)
    assert timing["reencoded_alone"] == 2  # good and bad; other's row had no non-finite window
