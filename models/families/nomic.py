"""NomicBERT: BERT's post-norm layers with rotary positions (half style, theta 1000), a fused Wqkv, SwiGLU,
and no biases in any projection. The Hub's config.json uses GPT-2-style keys (``n_embd``, ``n_layer``,
``n_head``, ``n_inner``, ``rotary_emb_base``, …) that transformers 5 ignores; both are read here.
nomic-embed-text v1 / v1.5."""

from __future__ import annotations

import dataclasses

from docbeam.models.families import gte
from docbeam.models.families.blocks import PostNormEncoder
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    """BERT's fields suffice (the keys map onto them); the class is what names the family."""


PREFIXES = ("nomic_bert.", "bert.", "model.")
HUB_REFUSED = (  # the Hub's keys whose other values change the model: (key, what docbeam runs, what else means)
    ("activation_function", "swiglu", "another MLP"),
    ("prenorm", False, "pre-norm layers"),
    ("qkv_proj_bias", False, "biased projections"),
    ("mlp_fc1_bias", False, "biased projections"),
    ("mlp_fc2_bias", False, "biased projections"),
    ("rotary_emb_fraction", 1.0, "partial rotary positions"),
    ("rotary_emb_interleaved", False, "interleaved rotary pairs"),
    ("rotary_emb_scale_base", None, "xPos scaling"),
    ("rotary_scaling_factor", None, "dynamic NTK scaling"),
    ("use_rms_norm", False, "RMSNorm"),
    ("causal", False, "causal attention"),
    ("parallel_block", False, "parallel attention and MLP"),
)


class Model(PostNormEncoder):
    """BERT's post-norm encoder with rotary positions (position: rope), a GLU MLP, and no projection biases."""

    gated: bool = True
    biases: bool = False


def read_config(hub: HubConfig, dtype: str) -> Config:
    for key, runs, other in HUB_REFUSED:
        hub.refuse_unless(key, (runs,), other)
    hidden, heads = hub.get("n_embd", "hidden_size"), hub.get("n_head", "num_attention_heads")
    activation = "silu" if "activation_function" in hub.raw else hub.activation("hidden_act", default="silu")
    return Config(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=hub.get("n_layer", "num_hidden_layers"),
        num_heads=heads,
        intermediate_size=hub.get("n_inner", "intermediate_size", default=4 * hidden),
        max_position=hub.get("n_positions", "max_position_embeddings", default=2048),
        type_vocab_size=hub.get("type_vocab_size", default=2),
        layer_norm_eps=hub.get("layer_norm_epsilon", "layer_norm_eps", default=1e-12),
        activation=activation,
        position="rope",
        rope_theta=hub.rope(hidden // heads, 1000.0, legacy_theta=("rotary_emb_base",)).theta,
        dtype=dtype,
    )


def read_params(t: Tensors, config: Config) -> dict:
    hub_names = t.has("emb_ln.weight")
    embed = {
        "word": t.embedding("embeddings.word_embeddings.weight"),
        "norm": t.norm("emb_ln" if hub_names else "embeddings.LayerNorm"),
    }
    if config.type_vocab_size:
        embed["token_type"] = t.embedding("embeddings.token_type_embeddings.weight")
    params = {"embed": embed}
    for i in range(config.num_layers):
        if hub_names:  # fc12 is the gate (activated), fc11 the linear half
            p = f"encoder.layers.{i}"
            attn = {"qkv": t.dense(f"{p}.attn.Wqkv", bias=False), "out": t.dense(f"{p}.attn.out_proj", bias=False)}
            norms = {"attn_norm": t.norm(f"{p}.norm1"), "mlp_norm": t.norm(f"{p}.norm2")}
            mlp = {
                "wi": t.dense(f"{p}.mlp.fc12", f"{p}.mlp.fc11", bias=False),
                "wo": t.dense(f"{p}.mlp.fc2", bias=False),
            }
            params[f"layer_{i}"] = {"attn": attn, **norms, "mlp": mlp}
        else:
            params[f"layer_{i}"] = gte.transformers_layer(t, f"layers.{i}", biases=False)
    return params
