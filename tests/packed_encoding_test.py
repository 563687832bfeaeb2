"""Packed rows in the encoder and the attention plan: the encoder gives a packed window the vector it gives it
alone; attention stays within a segment; backends that take no segment ids are refused for packed rows, and
``batching.packing: auto`` packs only when every backend the job may run takes them."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_window as window

from docbeam import attention
from docbeam.attention.dispatch import AttentionPlanError, choose_backends
from docbeam.attention.interface import AttentionCase
from docbeam.attention.registry import from_callable
from docbeam.attention.settings import AttentionConfig
from docbeam.config import BatchingConfig
from docbeam.pipeline.records import TokenWindow
from docbeam.pipeline.stages.packer import packed_batch

# --- the encoder: a packed window is encoded as if alone -------------------------------------------------


@pytest.mark.parametrize(
    "pooling, position, backend",
    [
        ("mean", "absolute", "native"),
        ("cls", "absolute", "native"),
        ("lasttoken", "absolute", "native"),
        ("mean", "rope", "native"),
        ("cls", "rope", "native"),
        ("lasttoken", "rope", "native"),
        ("mean", "rope", "chunked"),
        ("lasttoken", "rope", "chunked"),
        ("cls", "absolute", "flash"),
    ],
)  # every built-in backend takes segment ids
def test_a_packed_window_gets_the_vector_it_gets_alone(pooling, position, backend):
    from docbeam.models.encoder import Encoder, EncoderConfig, embed_fn

    config = EncoderConfig(
        vocab_size=100,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position=64,
        position=position,
    )
    attend = attention.get(backend).bind()
    params = Encoder(config, attend).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32), jnp.ones((1,), jnp.int32)
    )["params"]
    embed = jax.jit(embed_fn(config, attend, pooling))
    windows = [window("a", 0, 9), window("b", 0, 14), window("c", 0, 5), window("d", 0, 30), window("e", 0, 3)]
    packed = packed_batch([[windows[0], windows[1], windows[2]], [windows[3]], [windows[4]]], bucket_len=32, rows=4)
    out = np.asarray(embed(params, packed.ids_BxT, packed.lengths_B, packed.segment_ids_BxT, packed.slot_lengths_BxK))
    got = out.reshape(-1, out.shape[-1])[packed.window_slots()]
    alone_ids = np.zeros((5, 32), np.int32)
    for r, w in enumerate(windows):
        alone_ids[r, : w.length] = w.token_ids
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
    return AttentionCase(platform="cpu", dtype="float32", seq_len=32, num_heads=4, head_dim=8, segments=packed)


def test_a_backend_without_segment_ids_is_refused_for_packed_rows_and_names_the_key():
    def plain(q, k, v, *, kv_lengths_B, scale):
        return v

    backend = from_callable("plain_user", plain)
    assert backend.refusal(_case(False)) is None
    assert not backend.refusal(_case(True)).ok
    attention.registry._REGISTRY.setdefault("plain_user", backend)
    spec = AttentionConfig(backend="plain_user")
    with pytest.raises(AttentionPlanError, match="batching.packing"):
        choose_backends(spec, [_case(True)])
    with_fallback = AttentionConfig(backend="plain_user", fallback="native")
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
    from docbeam.attention.dispatch import probe, probe_inputs

    _, _, _, kwargs = probe_inputs(_case(True))
    assert kwargs["segment_ids_BxT"][0].max() == 2 and kwargs["segment_ids_BxT"][1].max() == 1
    spec = AttentionConfig()
    [choice] = choose_backends(spec, [_case(True)])
    probe(spec, choice)  # raises on a crash or a non-finite output


USER_BACKEND = "tests.fixtures_user_backend:attend"  # a plain AttentionFn: takes no segment ids


@pytest.mark.parametrize(
    "backend, fallback, packs",
    [
        ("native", None, True),
        ("chunked", None, True),
        ("flash", "native", True),
        (USER_BACKEND, None, False),
        ("chunked", USER_BACKEND, False),
    ],
)
def test_auto_packs_only_when_every_backend_the_job_may_run_takes_segment_ids(backend, fallback, packs, monkeypatch):
    from docbeam.config import JobConfig

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from docbeam.pipeline.driver.plan import resolved_packing

    cfg = JobConfig.model_validate(
        {
            "input": {"path": "x"},
            "output": {"path": "y"},
            "model": {"path": "m"},
            "attention": {"backend": backend, "fallback": fallback},
        }
    )
    assert cfg.batching.packing == "auto"
    assert resolved_packing(cfg) is packs
    explicit = cfg.model_copy(update={"batching": BatchingConfig(packing=False)})
    assert resolved_packing(explicit) is False


def test_a_non_finite_window_does_not_take_its_packed_row_mates_with_it(tiny_checkpoint_dir):
    """Token 7's embedding is NaN: window "bad" holds it. Packed in one row with "good", attention would carry
    the NaN into "good" (weight 0 × NaN); the runtime encodes the row's windows again, each alone."""
    from benchmarks.common import standalone_spec
    from docbeam.pipeline.stages.encode import load_encoder

    runtime = load_encoder(
        standalone_spec(
            tiny_checkpoint_dir,
            "float32",
            "mean",
            AttentionConfig(),
            (16, 32),
            packing=True,
        )
    )
    good = TokenWindow("good", 0, 1, np.arange(20, 30, dtype=np.int32), 8, False)
    bad = TokenWindow("bad", 0, 1, np.array([20, 7, 21, 22], np.int32), 2, False)
    other = TokenWindow("other", 0, 1, np.arange(40, 52, dtype=np.int32), 10, False)
    clean, _ = runtime.encode(packed_batch([[good], [other]], 32, 2))
    embedding = runtime.params["embed"]["word"]["embedding"]
    runtime.params["embed"]["word"]["embedding"] = embedding.at[7].set(jnp.nan)
    batch = packed_batch([[good, bad], [other]], 32, 2)
    assert batch.segment_ids_BxT[0].max() == 2  # bad and good share row 0
    vectors, timing = runtime.encode(batch)
    by_id = {w[0]: v for w, v in zip(batch.windows, vectors)}
    assert not np.isfinite(by_id["bad"]).all()
    np.testing.assert_allclose(by_id["good"], clean[0], atol=2e-6)
    np.testing.assert_allclose(by_id["other"], clean[1], atol=2e-6)
    assert timing["reencoded_alone"] == 2  # good and bad; other's row had no non-finite window
