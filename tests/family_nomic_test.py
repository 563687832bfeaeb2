"""NomicBERT against transformers' NomicBertModel: post-norm, rotary positions with theta 1000, SwiGLU, no
biases, from transformers 5's config.json and from the Hub's GPT-2-style keys (n_embd, n_layer, …, which
transformers 5 ignores) with the Hub's tensor names (emb_ln, attn.Wqkv, mlp.fc11/fc12/fc2, norm1/norm2)."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    PACKED_BATCHING,
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
    return tiny_model("NomicBertModel", num_hidden_layers=2, intermediate_size=48, attn_implementation="eager")


HUB_KEYS = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "n_inner",
    "max_position_embeddings": "n_positions",
    "layer_norm_eps": "layer_norm_epsilon",
}


def hub_config(config: dict) -> dict:
    """nomic-embed-text-v1.5's config.json keys, and its options at the values docbeam runs."""
    dropped = ("rope_parameters", "hidden_act", "head_dim")
    config = {HUB_KEYS.get(k, k): v for k, v in config.items() if k not in dropped}
    return {
        **config,
        "rotary_emb_base": 1000,
        "activation_function": "swiglu",
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "causal": False,
        "architectures": ["NomicBertModel"],
        "auto_map": {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
    }


def hub_tensors(tensors: dict) -> dict:
    out = {}
    for name, value in tensors.items():
        if name.startswith("embeddings.LayerNorm"):
            out[name.replace("embeddings.LayerNorm", "emb_ln")] = value
        elif not name.startswith("layers."):
            out[name] = value
        else:
            _, i, rest = name.split(".", 2)
            p = f"encoder.layers.{i}"
            if rest == "self_attn.q_proj.weight":
                out[f"{p}.attn.Wqkv.weight"] = np.concatenate(
                    [tensors[f"layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"]
                )
            elif rest not in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                for old, new in (
                    ("self_attn.o_proj", "attn.out_proj"),
                    ("mlp.up_proj", "mlp.fc11"),
                    ("mlp.gate_proj", "mlp.fc12"),
                    ("mlp.down_proj", "mlp.fc2"),
                    ("post_attention_layernorm", "norm1"),
                    ("post_mlp_layernorm", "norm2"),
                ):
                    rest = rest.replace(old, new)
                out[f"{p}.{rest}"] = value
    return out


folder = both_forms("nomic", hub_config, hub_tensors)


def test_both_forms_read_as_the_same_model(folder):
    config = checkpoint.open_checkpoint(folder).config
    assert (config.hidden_size, config.num_layers, config.intermediate_size, config.rope_theta) == (32, 2, 48, 1000.0)


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    backends = assert_matches_transformers(model, folder, LENGTHS, packed)
    assert backends == ["native", "chunked", "flash"]  # every built-in backend runs it, packed or not


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(replace(rope_theta=10_000.0), id="theta-10000"),
        pytest.param(replace(activation="gelu"), id="geglu-not-swiglu"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, change=broken)


def test_hub_options_docbeam_does_not_run_are_refused(tmp_path, model):
    half = lambda c: {**hub_config(c), "rotary_emb_fraction": 0.5}  # noqa: E731
    assert_refused(model, str(tmp_path), half, "rotary_emb_fraction: 0.5.*partial rotary")


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "search_document: a short one.", "b": " ".join(["Rotary positions with a small base."] * 12)}
    assert_docbeam_run_matches(model, folder, tmp_path, texts, batching=PACKED_BATCHING)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
