"""ModernBERT against transformers' ModernBertModel: pre-norm without biases, GeGLU, fused Wqkv, and rotary
positions with a global and a local theta, on layers alternating global and local attention (window ±4 here,
so documents of 12-64 tokens cross it), from config.json as transformers 5 writes it and as the Hub has it."""

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
    both_forms,
    replace,
    tiny_model,
)

from docbeam.models import checkpoint


@pytest.fixture(scope="module")
def model():
    return tiny_model(
        "ModernBertModel",
        num_hidden_layers=4,
        intermediate_size=48,
        local_attention=8,
        global_attn_every_n_layers=2,
        global_rope_theta=160_000.0,
        local_rope_theta=10_000.0,
        pad_token_id=0,
        bos_token_id=101,
        cls_token_id=101,
        eos_token_id=102,
        sep_token_id=102,
        attn_implementation="eager",
    )


def hub_config(config: dict) -> dict:
    """The keys ModernBERT's files on the Hub carry instead of transformers 5's layer_types/rope_parameters."""
    config = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    return {
        **config,
        "global_attn_every_n_layers": 2,
        "global_rope_theta": 160_000.0,
        "local_rope_theta": 10_000.0,
        "architectures": ["ModernBertForMaskedLM"],
    }


def hub_tensors(tensors: dict) -> dict:
    """A masked-LM checkpoint: the encoder under ``model.``, beside a head docbeam does not use."""
    out = {f"model.{name}": value for name, value in tensors.items()}
    out["head.dense.weight"] = np.zeros((32, 32), np.float32)
    return out


folder = both_forms("modernbert", hub_config, hub_tensors)


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
    assert_close_to_transformers(model, folder, packed=packed, options={"implementation": "jax_nn"})


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(replace(local_window=(64, 64)), id="local-layers-attend-globally"),
        pytest.param(replace(local_window=(2, 2)), id="window-too-narrow"),
        pytest.param(
            lambda c: replace(rope_theta=c.local_rope_theta, local_rope_theta=c.rope_theta)(c), id="thetas-swapped"
        ),
        pytest.param(replace(global_layers=(False, True, False, True)), id="global-layers-shifted"),
        pytest.param(replace(activation="silu"), id="swiglu-not-geglu"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, change=broken)


def test_hub_options_docbeam_does_not_run_are_refused(tmp_path, model):
    assert_refused(model, str(tmp_path), lambda c: {**hub_config(c), "norm_bias": True}, "norm_bias: True")


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"short": "A short note.", "long": " ".join(["ModernBERT attends locally in most layers."] * 8)}
    tokens = assert_docbeam_run_matches(model, folder, tmp_path, texts, batching=PACKED_BATCHING)
    assert tokens["long"].shape[1] > 4 * 8  # the long document spans several local windows


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
