"""EmbeddingGemma 2 against transformers' EmbeddingGemma2TextModel: Gemma3's bidirectional encoder with norms
that multiply by w (not 1 + w), a weightless v norm, unscaled scores, full layers of their own shape (4 query
heads over 1 key/value head of 32, where sliding layers have 2 of 16), a sliding radius of ``sliding_window`` =
4 tokens each side, inclusive, projection-only per-layer embeddings gating every layer, each layer's
``layer_scalar``, and ``embedding_projection`` to 24 dimensions; windows of 12-64 tokens."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    PACKED_BATCHING,
    assert_bfloat16_close_to_float32,
    assert_close_to_transformers,
    assert_docbeam_run_matches,
    assert_matches_transformers,
    assert_moves_output,
    assert_openvino_matches_xla,
    assert_refused,
    replace,
    save_checkpoint,
)
from family_gemma3_test import LAYER_TYPES, ROPE  # the same layer kinds and RoPE bases as the Gemma3 tests'

from docbeam.models import checkpoint


@pytest.fixture(scope="module")
def model():
    """A tiny random EmbeddingGemma2TextModel, weights drawn with std 0.3, RMSNorm weights around 1 and each
    layer_scalar around 1 (transformers initialises both to ones), so each feature moves the output."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.EmbeddingGemma2TextConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=4,
        layer_types=LAYER_TYPES,
        rope_parameters=ROPE,
        hidden_size_per_layer_input=8,
        embedding_dim=24,
        initializer_range=0.3,
        attn_implementation="eager",
    )
    model = transformers.EmbeddingGemma2TextModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.normal_(1.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_checkpoint(model, str(tmp_path_factory.mktemp("embedding_gemma2")))


def test_the_config_reads_as_the_model(folder):
    config, settings = checkpoint.open_checkpoint(folder).config, checkpoint.open_checkpoint(folder).settings
    assert (config.layer_heads(True), config.layer_heads(False)) == ((2, 16), (1, 32))
    assert config.sliding_layers == (True, False, True, False) and not config.causal
    assert (config.query_scale, config.norm_offset, config.v_norm) == (1.0, 0.0, True)
    assert (config.local_window, config.per_layer_size, config.output_size) == ((4, 4), 8, 24)
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 1_000.0)
    assert settings.pooling == "mean"


def test_the_plan_asks_backends_about_each_kind_of_layer_in_its_own_shape(folder):
    from docbeam.models.encoder import attention_cases

    cases = attention_cases(checkpoint.open_checkpoint(folder).config, [64], "cpu")
    assert {(c.local_window, c.head_dim, c.kv_heads) for c in cases} == {((4, 4), 16, 2), (None, 32, 1)}


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_across_sliding_windows(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("options", [{"implementation": "jax_nn"}, {"query_chunk": 8, "key_chunk": 8}])
@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_on_each_formulation(model, folder, packed, options):
    backend = "native" if "implementation" in options else "chunked"
    assert_close_to_transformers(model, folder, backend=backend, packed=packed, options=options)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(local_window=(3, 3))), id="window-radius-exclusive"),
        pytest.param(dict(change=replace(local_window=(2, 2))), id="window-radius-sliding_window//2"),
        pytest.param(dict(change=replace(local_window=(5, 5))), id="window-radius-one-too-wide"),
        pytest.param(dict(change=replace(causal=True)), id="causal"),
        pytest.param(
            dict(change=lambda c: replace(rope_theta=c.local_rope_theta, local_rope_theta=c.rope_theta)(c)),
            id="rope-bases-swapped",
        ),
        pytest.param(dict(change=replace(norm_offset=1.0)), id="norms-times-1+w-not-w"),
        pytest.param(dict(change=replace(v_norm=False)), id="no-v-norm"),
        pytest.param(dict(change=replace(qk_norm=False)), id="no-qk-norm"),
        pytest.param(dict(change=replace(query_scale=0.25)), id="scores-scaled"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, **broken)


def without_per_layer_embeddings(tensors: dict) -> dict:
    """The per-layer projection zeroed: every layer's gate multiplies zeros, so its third block adds nothing."""
    return {
        **tensors,
        "ple.per_layer_model_projection.weight": np.zeros_like(tensors["ple.per_layer_model_projection.weight"]),
    }


def without_layer_scalars(tensors: dict) -> dict:
    return {name: np.ones_like(v) if name.endswith("layer_scalar") else v for name, v in tensors.items()}


@pytest.mark.parametrize("edit", [without_per_layer_embeddings, without_layer_scalars])
def test_checkpoints_without_per_layer_features_move_the_output(model, tmp_path, edit):
    """The same model's checkpoint with per-layer embeddings (or layer scalars) taken out is no longer
    transformers' model: they are there, and the parity tests would see them go."""
    broken = save_checkpoint(model, str(tmp_path), tensor_rename=edit)
    assert_moves_output(model, broken)


@pytest.mark.parametrize(
    "rewrite,match",
    [
        (lambda c: {**c, "per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config.*full_attention"),
        (lambda c: {**c, "per_layer_config": {"1": {"intermediate_size": 8}}}, "per_layer_config"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias: True"),
        (lambda c: {**c, "sliding_window": -1}, "sliding_window: -1"),
    ],
)
def test_what_docbeam_does_not_reproduce_is_refused(tmp_path, model, rewrite, match):
    assert_refused(model, str(tmp_path), rewrite, match)


def test_full_layers_default_to_transformers_global_shape(tmp_path, model):
    """A config.json without per_layer_config: transformers' defaults, head_dim 512 over 1 key/value head."""
    import json
    import os

    folder = save_checkpoint(model, str(tmp_path))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.pop("per_layer_config")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    # config.json alone: these weights have the per-layer shapes, which open_checkpoint holds it against
    assert checkpoint.encoder_config(folder).layer_heads(False) == (1, 512)


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.slow
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"short": "A short note.", "long": " ".join(["Per-layer embeddings gate every layer."] * 8)}
    tokens = assert_docbeam_run_matches(model, folder, tmp_path, texts, batching=PACKED_BATCHING)
    assert tokens["long"].shape[1] > 4 * 8
    config = checkpoint.open_checkpoint(folder).config
    assert config.output_size == 24 != config.hidden_size


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
