"""ModernBERT against transformers' ModernBertModel: pre-norm without biases, GeGLU, fused Wqkv, and rotary
positions with a global and a local theta, on layers alternating global and local attention (window ±4 here,
so documents of 12-64 tokens cross it), from config.json as transformers 5 writes it and as the Hub has it."""
from __future__ import annotations

import numpy as np
import pytest

from family_fixtures import (MIN_COSINE, VOCAB, assert_matches_transformers, lowest_cosine, our_vectors,
                             reference_vectors, replace, run_docbeam, save_checkpoint, token_inputs)
from models import checkpoint

LENGTHS = [40, 57, 23, 64, 12, 33]


@pytest.fixture(scope="module")
def model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=48,
        local_attention=8, global_attn_every_n_layers=2, global_rope_theta=160_000.0, local_rope_theta=10_000.0,
        initializer_range=0.3, pad_token_id=0, bos_token_id=101, cls_token_id=101, eos_token_id=102,
        sep_token_id=102, attn_implementation="eager")
    return transformers.ModernBertModel(config).eval()


def hub_config(config: dict) -> dict:
    """The keys ModernBERT's files on the Hub carry instead of transformers 5's layer_types/rope_parameters."""
    config = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    return {**config, "global_attn_every_n_layers": 2, "global_rope_theta": 160_000.0, "local_rope_theta": 10_000.0,
            "architectures": ["ModernBertForMaskedLM"]}


def hub_tensors(tensors: dict) -> dict:
    """A masked-LM checkpoint: the encoder under ``model.``, beside a head docbeam does not use."""
    out = {f"model.{name}": value for name, value in tensors.items()}
    out["head.dense.weight"] = np.zeros((32, 32), np.float32)
    return out


@pytest.fixture(scope="module", params=["transformers5", "hub"])
def folder(request, model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"modernbert-{request.param}"))
    if request.param == "hub":
        return save_checkpoint(model, path, config_rewrite=hub_config, tensor_rename=hub_tensors)
    return save_checkpoint(model, path)


def test_both_config_forms_read_as_the_same_model(folder):
    config = checkpoint.open_checkpoint(folder).config
    assert (config.global_layers, config.local_window) == ((True, False, True, False), (4, 4))
    assert (config.rope_theta, config.local_rope_theta) == (160_000.0, 10_000.0)
    assert {f.describe() for f in config.attention_features} == {"global", "local window (4, 4)"}


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_across_local_windows(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_native_jax_nn_form_matches_too(model, folder, packed):
    """native's other formulation (jax.nn.dot_product_attention, its default off CPU) takes the same
    local window and bias."""
    ids, lengths = token_inputs(LENGTHS)
    ours = our_vectors(folder, ids, lengths, packed=packed, options={"implementation": "jax_nn"})
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths)) >= MIN_COSINE


@pytest.mark.parametrize("broken", [
    pytest.param(replace(local_window=(64, 64)), id="local-layers-attend-globally"),
    pytest.param(replace(local_window=(2, 2)), id="window-too-narrow"),
    pytest.param(lambda c: replace(rope_theta=c.local_rope_theta, local_rope_theta=c.rope_theta)(c),
                 id="thetas-swapped"),
    pytest.param(replace(global_layers=(False, True, False, True)), id="global-layers-shifted"),
    pytest.param(replace(activation="silu"), id="swiglu-not-geglu"),
])
def test_each_feature_moves_the_output(model, folder, broken):
    ids, lengths = token_inputs(LENGTHS)
    ours = our_vectors(folder, ids, lengths, change=broken)
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths)) < 0.999


def test_hub_options_docbeam_does_not_run_are_refused(tmp_path, model):
    folder = save_checkpoint(model, str(tmp_path), config_rewrite=lambda c: {**hub_config(c), "norm_bias": True})
    with pytest.raises(checkpoint.CheckpointError, match="norm_bias: True"):
        checkpoint.open_checkpoint(folder)



def test_bfloat16_stays_close_to_float32(folder):
    ids, lengths = token_inputs(LENGTHS)
    f32 = our_vectors(folder, ids, lengths, packed=True)
    assert lowest_cosine(our_vectors(folder, ids, lengths, packed=True, dtype="bfloat16"), f32) >= 0.99

@pytest.mark.slow
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    from models.checkpoint import load_tokenizer

    texts = {"short": "A short note.", "long": " ".join(["ModernBERT attends locally in most layers."] * 8)}
    got = run_docbeam(folder, tmp_path, texts, batching={"buckets": [16, 32, 64, 128], "tokens_per_batch": 512,
                                                         "packing": True})
    tokenizer = load_tokenizer(folder)
    for doc_id, text in texts.items():
        ids = np.asarray([tokenizer(text)["input_ids"]], np.int32)
        assert doc_id == "short" or ids.shape[1] > 4 * 8  # the long document spans several local windows
        want = reference_vectors(model, ids, np.asarray([ids.shape[1]], np.int32))
        assert lowest_cosine(got[doc_id][None], want) >= MIN_COSINE, doc_id
