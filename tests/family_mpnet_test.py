"""MPNet against transformers' MPNetModel: RoBERTa-style positions plus the relative-position bucket bias
added in every layer (documents up to 64 tokens reach the logarithmic buckets past 8)."""

from __future__ import annotations

import jax.numpy as jnp
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
    both_forms,
    replace,
    tiny_model,
)

from docbeam.models import checkpoint
from docbeam.models.families import mpnet


@pytest.fixture(scope="module")
def model():
    import torch

    model = tiny_model(
        "MPNetModel",
        model_kwargs={"add_pooling_layer": False},
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=130,
        layer_norm_eps=1e-5,
    )
    with torch.no_grad():  # the bias table gets the embedding initialiser; make it move scores visibly
        model.encoder.relative_attention_bias.weight.normal_(0.0, 2.0)
    return model


def hub_config(config: dict) -> dict:
    return {
        **{k: v for k, v in config.items() if k != "dtype"},
        "torch_dtype": "float32",
        "architectures": ["MPNetForMaskedLM"],
    }


def hub_tensors(tensors: dict) -> dict:
    return {f"mpnet.{name}": value for name, value in tensors.items()}


folder = both_forms("mpnet", hub_config, hub_tensors)


def test_buckets_are_transformers_buckets_at_every_offset():
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    offsets = np.arange(-700, 701)
    want = MPNetEncoder.relative_position_bucket(torch.tensor(offsets)).numpy()
    np.testing.assert_array_equal(np.asarray(mpnet.relative_bucket(jnp.asarray(offsets))), want)


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    config = checkpoint.open_checkpoint(folder).config
    assert [f.describe() for f in config.attention_features] == ["global, per-head bias"]
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_native_jax_nn_form_matches_too(model, folder, packed):
    """native's other formulation (jax.nn.dot_product_attention, its default off CPU) takes the same
    local window and bias."""
    assert_close_to_transformers(model, folder, packed=packed, options={"implementation": "jax_nn"})


def test_positions_counted_from_zero_move_the_output(model, folder):
    from_zero = lambda c: replace(pad_token_id=-1, max_position=c.max_position + c.position_offset)(c)  # noqa: E731
    assert_moves_output(model, folder, change=from_zero)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(lambda bucket: lambda offset: bucket(-offset), id="direction-flipped"),
        pytest.param(lambda bucket: lambda offset: bucket(jnp.clip(offset, -7, 7)), id="no-logarithmic-buckets"),
        pytest.param(lambda bucket: lambda offset: jnp.zeros_like(offset), id="no-bias"),
    ],
)
def test_the_relative_bias_moves_the_output(model, folder, monkeypatch, broken):
    monkeypatch.setattr(mpnet, "relative_bucket", broken(mpnet.relative_bucket))
    assert_moves_output(model, folder)


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "Sentence embeddings, relatively.", "b": " ".join(["Buckets grow logarithmically."] * 12)}
    assert_docbeam_run_matches(model, folder, tmp_path, texts, batching=PACKED_BATCHING)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
