"""MPNet against transformers' MPNetModel: RoBERTa-style positions plus the relative-position bucket bias
added in every layer (documents up to 64 tokens reach the logarithmic buckets past 8)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from family_fixtures import (MIN_COSINE, VOCAB, assert_matches_transformers, lowest_cosine, our_vectors,
                             reference_vectors, replace, run_docbeam, save_checkpoint, token_inputs)
from models import checkpoint
from models.families import mpnet

LENGTHS = [40, 57, 23, 64, 12, 33]


@pytest.fixture(scope="module")
def model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=130, initializer_range=0.3, layer_norm_eps=1e-5)
    model = transformers.MPNetModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # the bias table gets the embedding initialiser; make it move scores visibly
        model.encoder.relative_attention_bias.weight.normal_(0.0, 2.0)
    return model


def hub_config(config: dict) -> dict:
    return {**{k: v for k, v in config.items() if k != "dtype"}, "torch_dtype": "float32",
            "architectures": ["MPNetForMaskedLM"]}


def hub_tensors(tensors: dict) -> dict:
    return {f"mpnet.{name}": value for name, value in tensors.items()}


@pytest.fixture(scope="module", params=["transformers5", "hub"])
def folder(request, model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"mpnet-{request.param}"))
    if request.param == "hub":
        return save_checkpoint(model, path, config_rewrite=hub_config, tensor_rename=hub_tensors)
    return save_checkpoint(model, path)


def test_buckets_are_transformers_buckets_at_every_offset():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
    import torch

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
    ids, lengths = token_inputs(LENGTHS)
    ours = our_vectors(folder, ids, lengths, packed=packed, options={"implementation": "jax_nn"})
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths)) >= MIN_COSINE


def test_positions_counted_from_zero_move_the_output(model, folder):
    ids, lengths = token_inputs(LENGTHS)
    from_zero = lambda c: replace(pad_token_id=-1, max_position=c.max_position + c.position_offset)(c)  # noqa: E731
    assert lowest_cosine(our_vectors(folder, ids, lengths, change=from_zero),
                         reference_vectors(model, ids, lengths)) < 0.999


@pytest.mark.parametrize("broken", [
    pytest.param(lambda bucket: (lambda offset: bucket(-offset)), id="direction-flipped"),
    pytest.param(lambda bucket: (lambda offset: bucket(jnp.clip(offset, -7, 7))), id="no-logarithmic-buckets"),
    pytest.param(lambda bucket: (lambda offset: jnp.zeros_like(offset)), id="no-bias"),
])
def test_the_relative_bias_moves_the_output(model, folder, monkeypatch, broken):
    ids, lengths = token_inputs(LENGTHS)
    monkeypatch.setattr(mpnet, "relative_bucket", broken(mpnet.relative_bucket))
    assert lowest_cosine(our_vectors(folder, ids, lengths), reference_vectors(model, ids, lengths)) < 0.999



def test_bfloat16_stays_close_to_float32(folder):
    ids, lengths = token_inputs(LENGTHS)
    f32 = our_vectors(folder, ids, lengths, packed=True)
    assert lowest_cosine(our_vectors(folder, ids, lengths, packed=True, dtype="bfloat16"), f32) >= 0.99

@pytest.mark.slow
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "Sentence embeddings, relatively.", "b": " ".join(["Buckets grow logarithmically."] * 12)}
    got = run_docbeam(folder, tmp_path, texts, batching={"buckets": [16, 32, 64, 128], "tokens_per_batch": 512,
                                                         "packing": True})
    tokenizer = checkpoint.load_tokenizer(folder)
    for doc_id, text in texts.items():
        ids = np.asarray([tokenizer(text)["input_ids"]], np.int32)
        want = reference_vectors(model, ids, np.asarray([ids.shape[1]], np.int32))
        assert lowest_cosine(got[doc_id][None], want) >= MIN_COSINE, doc_id
