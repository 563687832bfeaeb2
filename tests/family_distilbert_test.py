"""DistilBERT against transformers' DistilBertModel: BERT's post-norm layers without token types or a pooler,
under DistilBERT's keys and tensor names, with learned positions or (``sinusoidal_pos_embds``) sinusoidal ones.
From the checkpoint as transformers 5 writes it and as the Hub's masked-LM files have it (tensors under
``distilbert.`` beside the vocabulary head)."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    assert_bfloat16_close_to_float32,
    assert_matches_transformers,
    assert_moves_output,
    assert_native_run_matches,
    assert_openvino_matches_xla,
    assert_refused,
    both_forms,
    replace,
    save_checkpoint,
    tiny_model,
    under_prefix,
)

from docbeam.models import checkpoint
from docbeam.models.families.distilbert import sinusoidal_table

POSITIONS = "embeddings.position_embeddings.weight"


def distilbert(**config):
    return tiny_model(
        "DistilBertModel", n_layers=2, hidden_dim=48, max_position_embeddings=128, attn_implementation="eager", **config
    )


@pytest.fixture(scope="module")
def model():
    return distilbert()


def hub_config(config: dict) -> dict:
    """distilbert-base-uncased's config.json carries the masked-LM architecture and an old tie flag."""
    return {**config, "architectures": ["DistilBertForMaskedLM"], "tie_weights_": True}


hub_tensors = under_prefix(
    "distilbert.",
    {"vocab_transform.weight": np.zeros((32, 32), np.float32), "vocab_projector.bias": np.zeros(8, np.float32)},
)  # the MLM head
folder = both_forms("distilbert", hub_config, hub_tensors)


def test_both_forms_read_as_the_same_encoder(folder):
    ck = checkpoint.open_checkpoint(folder)
    config = ck.config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.intermediate_size) == (32, 2, 2, 48)
    assert (config.type_vocab_size, config.max_position, config.sinusoidal_positions) == (0, 128, False)
    assert ck.settings.pooling == "mean"


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


def test_the_sinusoidal_table_is_transformers(model):
    import torch
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    theirs = create_sinusoidal_embeddings(128, 32, torch.empty(128, 32)).numpy()
    np.testing.assert_array_equal(sinusoidal_table(128, 32), theirs)


@pytest.mark.parametrize("packed", [False, True])
def test_a_sinusoidal_checkpoint_without_its_table_matches_transformers(tmp_path, packed):
    """transformers computes the table a sinusoidal checkpoint lacks; docbeam computes the same one."""
    sinusoidal = distilbert(sinusoidal_pos_embds=True)
    folder = save_checkpoint(
        sinusoidal, str(tmp_path), tensor_rename=lambda tensors: {k: v for k, v in tensors.items() if k != POSITIONS}
    )
    assert checkpoint.open_checkpoint(folder).config.sinusoidal_positions
    assert assert_matches_transformers(sinusoidal, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


def test_a_learned_checkpoint_without_its_table_is_refused(model, tmp_path):
    save_checkpoint(model, str(tmp_path), tensor_rename=lambda t: {k: v for k, v in t.items() if k != POSITIONS})
    with pytest.raises(checkpoint.CheckpointError, match=f"has no tensor '{POSITIONS}'"):
        checkpoint.open_checkpoint(str(tmp_path))  # at start: the header is held against the family's reads


def with_table(table: np.ndarray):
    return lambda tensors: {**tensors, POSITIONS: table}


@pytest.mark.parametrize(
    "sinusoidal, table",
    [
        pytest.param(False, lambda: sinusoidal_table(128, 32), id="learned-read-as-sinusoidal"),
        pytest.param(True, lambda: np.roll(sinusoidal_table(128, 32), 1, axis=0), id="sinusoidal-off-by-one"),
        pytest.param(True, lambda: np.zeros((128, 32), np.float32), id="sinusoidal-dropped"),
    ],
)
def test_positions_broken_on_purpose_move_the_output(tmp_path, sinusoidal, table):
    original = distilbert(sinusoidal_pos_embds=sinusoidal)
    folder = save_checkpoint(original, str(tmp_path), tensor_rename=with_table(table()))
    assert_moves_output(original, folder)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(activation="relu")), id="relu-not-gelu"),
        pytest.param(dict(pooling="cls"), id="first-token-pooled"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, **broken)


def test_an_activation_docbeam_does_not_have_is_refused(model, tmp_path):
    assert_refused(model, str(tmp_path), lambda c: {**c, "activation": "swish"}, "activation: 'swish'")


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
@pytest.mark.parametrize("packing", [False, True])
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path, packing):
    texts = {"short": "A short note.", "long": " ".join(["DistilBERT keeps half of BERT's layers."] * 8)}
    assert_native_run_matches(model, folder, tmp_path, texts, packing)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
