"""GTE against transformers' GteModel: post-norm, rotary positions with the RoPE scaling the checkpoint ships,
fused qkv with biases, GeGLU. The Hub's gte-*-en-v1.5 ship a fixed NTK scaling (their remote code), which
transformers has no rope_type for; it equals transformers' linear scaling with theta·factor and factor^(2/H)
(every frequency (θs)^(-2i/H)·s^(-2/H)), so one transformers model is the reference for both forms: linear in
transformers 5's config.json, ``model_type: new`` with ``rope_scaling: {type: ntk}`` and fused tensors in the
Hub's."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
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

THETA, NTK_FACTOR, HEAD_DIM = 10_000.0, 4.0, 16


@pytest.fixture(scope="module")
def model():
    rope = {"rope_type": "linear", "rope_theta": THETA * NTK_FACTOR, "factor": NTK_FACTOR ** (2 / HEAD_DIM)}
    return tiny_model(
        "GteModel",
        num_hidden_layers=2,
        intermediate_size=48,
        type_vocab_size=1,
        rope_parameters=rope,
        attn_implementation="eager",
    )


def hub_config(config: dict) -> dict:
    config = {k: v for k, v in config.items() if k != "rope_parameters"}
    return {
        **config,
        "model_type": "new",
        "architectures": ["NewModel"],
        "position_embedding_type": "rope",
        "rope_theta": THETA,
        "rope_scaling": {"type": "ntk", "factor": NTK_FACTOR},
        "pack_qkv": True,
        "layer_norm_type": "layer_norm",
        "logn_attention_scale": False,
        "auto_map": {"AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"},
    }


def hub_tensors(tensors: dict) -> dict:
    """The Hub's names: encoder.layer.N, fused attention.qkv_proj and mlp.up_gate_proj ([up | gate])."""
    out = {}
    for name, value in tensors.items():
        if not name.startswith("layers."):
            out[f"new.{name}"] = value
            continue
        _, i, rest = name.split(".", 2)
        p = f"new.encoder.layer.{i}"
        kind = rest.rsplit(".", 1)[-1]
        if rest.startswith("self_attn.q_proj"):
            out[f"{p}.attention.qkv_proj.{kind}"] = np.concatenate(
                [tensors[f"layers.{i}.self_attn.{n}_proj.{kind}"] for n in "qkv"]
            )
        elif rest.startswith("mlp.up_proj"):
            out[f"{p}.mlp.up_gate_proj.{kind}"] = np.concatenate(
                [tensors[f"layers.{i}.mlp.up_proj.{kind}"], tensors[f"layers.{i}.mlp.gate_proj.{kind}"]]
            )
        elif not rest.startswith(("self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")):
            rest = (
                rest.replace("self_attn.o_proj", "attention.o_proj")
                .replace("post_attention_layernorm", "attn_ln")
                .replace("post_mlp_layernorm", "mlp_ln")
            )
            out[f"{p}.{rest}"] = value
    return out


folder = both_forms("gte", hub_config, hub_tensors)


def test_hub_ntk_frequencies_are_the_remote_codes():
    """NTKScalingRotaryEmbedding (Alibaba-NLP/new-impl), fixed form: base·factor, then inv_freq / factor^(2/dim)."""
    import jax.numpy as jnp

    from docbeam.models.encoder import rotary
    from docbeam.models.families.encoder_config import HubConfig

    rope = HubConfig({"rope_theta": THETA, "rope_scaling": {"type": "ntk", "factor": NTK_FACTOR}}, "config.json").rope(
        HEAD_DIM, 10_000.0
    )
    base = THETA * NTK_FACTOR
    want = 1.0 / base ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM) / NTK_FACTOR ** (2 / HEAD_DIM)
    x = jnp.zeros((1, 2, 1, HEAD_DIM)).at[:, :, :, : HEAD_DIM // 2].set(1.0)  # cos and sin of each angle at position 1
    got = np.asarray(rotary(x, rope.theta, positions_BxT=jnp.asarray([[0, 1]]), scale=rope.scale))[0, 1, 0]
    np.testing.assert_allclose(np.arctan2(got[HEAD_DIM // 2 :], got[: HEAD_DIM // 2]), want, rtol=1e-5)


def test_both_forms_read_as_the_same_rotary_positions(folder):
    config = checkpoint.open_checkpoint(folder).config
    assert config.rope_theta == THETA * NTK_FACTOR
    assert config.rope_scale == pytest.approx(NTK_FACTOR ** (-2 / HEAD_DIM))


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    backends = assert_matches_transformers(model, folder, LENGTHS, packed)
    assert backends == ["native", "chunked", "flash"]  # every built-in backend runs it, packed or not


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(replace(rope_scale=1.0), id="rope-scaling-ignored"),
        pytest.param(replace(rope_theta=THETA), id="ntk-base-unscaled"),
        pytest.param(replace(activation="silu"), id="swiglu-not-geglu"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, change=broken)


def test_rope_scalings_docbeam_does_not_reproduce_are_refused(tmp_path, model):
    dynamic = lambda c: {**hub_config(c), "rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}  # noqa: E731
    assert_refused(model, str(tmp_path), dynamic, "rope_scaling.*mixed_b")


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "General text embeddings.", "b": " ".join(["Rotary positions, stretched."] * 12)}
    assert_docbeam_run_matches(model, folder, tmp_path, texts)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
