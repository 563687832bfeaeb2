"""EuroBERT against transformers' EuroBertModel: Llama's layers read both ways. Pre-norm RMSNorm (scales drawn
around one here, so a norm mapped wrong shows), grouped-query attention (4 query heads over 2 key/value heads),
half-style rotary positions, SwiGLU, no biases, a final RMSNorm; mean-pooled. From config.json as transformers 5
writes it and as EuroBERT-210m's files have it (``rope_theta``, tensors under ``model.`` beside an MLM head)."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    MIN_COSINE,
    assert_bfloat16_close_to_float32,
    assert_close_to_transformers,
    assert_matches_transformers,
    assert_moves_output,
    assert_native_run_matches,
    assert_openvino_matches_xla,
    assert_refused,
    both_forms,
    lowest_cosine,
    our_vectors,
    reference_vectors,
    replace,
    spread_norms_and_biases,
    tiny_model,
    token_inputs,
    under_prefix,
)

from docbeam.models import checkpoint
from docbeam.models.families import blocks, qwen3


@pytest.fixture(scope="module")
def model():
    return spread_norms_and_biases(
        tiny_model(
            "EuroBertModel",
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            pad_token_id=0,
            bos_token_id=101,
            eos_token_id=102,
            mask_token_id=103,
            attn_implementation="eager",
        )
    )


def hub_config(config: dict) -> dict:
    """EuroBERT-210m's config.json keys (remote code, transformers 4.48): rope_theta and rope_scaling."""
    config = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    return {
        **config,
        "rope_theta": 1000.0,
        "rope_scaling": None,
        "torch_dtype": "float32",
        "clf_pooling": "late",
        "architectures": ["EuroBertForMaskedLM"],
    }


hub_tensors = under_prefix("model.", {"lm_head.weight": np.zeros((8, 32), np.float32)})  # EuroBertForMaskedLM
folder = both_forms("eurobert", hub_config, hub_tensors)


def test_both_forms_read_as_the_same_bidirectional_encoder(folder):
    ck = checkpoint.open_checkpoint(folder)
    config = ck.config
    assert (config.num_heads, config.kv_heads, config.head_dim, config.rope_theta, config.layer_norm_eps) == (
        4,
        2,
        8,
        1000.0,
        1e-5,
    )
    assert (config.causal, config.qk_norm, config.qkv_bias, config.out_bias) == (False, False, False, False)
    assert [f.describe() for f in config.attention_features] == ["global"]
    assert ck.settings.pooling == "mean"


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_in_small_blocks_matches_too(model, folder, packed):
    """Chunks smaller than the rows, and one k/v group a step: every key block is scanned, each k/v head read
    for its own query heads."""
    assert_close_to_transformers(
        model, folder, packed=packed, backend="chunked", options={"query_chunk": 8, "key_chunk": 8, "heads_per_step": 1}
    )


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


def swapped_kv_heads(native):
    """Query heads 0-1 read key/value head 1 and 2-3 head 0: the grouping the other way round."""
    return lambda q, k, v, **kwargs: native(q, k[:, :, ::-1], v[:, :, ::-1], **kwargs)


def centred_norm(eps, dtype, name):
    """LayerNorm without a bias where RMSNorm belongs: the same scale parameter, the mean subtracted."""
    return blocks.layer_norm(eps, dtype, name, use_bias=False)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(causal=True)), id="read-causally"),
        pytest.param(dict(attend=swapped_kv_heads), id="kv-heads-swapped"),
        pytest.param(dict(change=replace(rope_theta=10_000.0)), id="theta-10000"),
        pytest.param(dict(pooling="cls"), id="first-token-pooled"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, **broken)


def test_a_layer_norm_in_place_of_rms_norm_moves_the_output(model, folder, monkeypatch):
    monkeypatch.setattr(qwen3, "rms_norm", centred_norm)
    assert_moves_output(model, folder)


def test_repeating_kv_heads_per_query_head_changes_nothing(model, folder):
    """The grouping checked the other way: native on 2 k/v heads equals native on them repeated per query head,
    as transformers' repeat_kv does."""

    def repeated(native):
        return lambda q, k, v, **kw: native(q, *(x.repeat(q.shape[2] // x.shape[2], axis=2) for x in (k, v)), **kw)

    ids, lengths = token_inputs(LENGTHS)
    assert (
        lowest_cosine(our_vectors(folder, ids, lengths, attend=repeated), reference_vectors(model, ids, lengths))
        >= MIN_COSINE
    )


@pytest.mark.parametrize(
    "rewrite, match",
    [
        pytest.param({"mlp_bias": True}, "mlp_bias: True", id="mlp-bias"),
        pytest.param(
            {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
            "RoPE scaling docbeam does not reproduce",
            id="yarn-rope",
        ),
    ],
)
def test_options_docbeam_does_not_run_are_refused(model, tmp_path, rewrite, match):
    assert_refused(model, str(tmp_path), lambda c: {**hub_config(c), **rewrite}, match)


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
@pytest.mark.parametrize("packing", [False, True])
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path, packing):
    texts = {"short": "A short note.", "long": " ".join(["EuroBERT reads every sentence both ways."] * 8)}
    assert_native_run_matches(model, folder, tmp_path, texts, packing)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
