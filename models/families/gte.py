"""GTE "new" (Alibaba's remote-code model, ``model_type: new`` on the Hub; ``gte`` in transformers 5): BERT's
post-norm layers with rotary positions (and the RoPE scaling a checkpoint ships: gte-*-en-v1.5 carry a
fixed NTK ``rope_scaling``), a fused qkv with biases, and GeGLU (one ``up_gate_proj``; transformers 5 splits
it in two). gte-base/large-en-v1.5, gte-multilingual-base, arctic-embed-m-v2.0."""

from __future__ import annotations

import dataclasses

from docbeam.models.families.blocks import PostNormEncoder
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors

PREFIXES = ("new.", "gte.", "model.")


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    """BERT's fields suffice (rope_scale carries the checkpoint's RoPE scaling); the class names the family."""


class Model(PostNormEncoder):
    """BERT's post-norm encoder with rotary positions (position: rope), a GLU MLP, and biases everywhere."""

    gated: bool = True


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub_form = hub.raw.get("model_type") == "new"
    hub.refuse_unless("position_embedding_type", ("rope",), "GTE runs with rotary positions")
    hub.refuse_unless("layer_norm_type", ("layer_norm",), "only LayerNorm")
    hub.refuse_unless("logn_attention_scale", (False,), "log-n attention scaling")
    hub.refuse_unless("pack_qkv", (True,), "only the fused qkv_proj")
    hidden, heads = hub.get("hidden_size"), hub.get("num_attention_heads")
    rope = hub.rope(hidden // heads, 10_000.0 if hub_form else 160_000.0)
    return Config(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=hub.get("num_hidden_layers"),
        num_heads=heads,
        intermediate_size=hub.get("intermediate_size"),
        max_position=hub.get("max_position_embeddings", default=8192),
        type_vocab_size=hub.get("type_vocab_size", default=0 if hub_form else 1),
        layer_norm_eps=hub.get("layer_norm_eps", default=1e-12),
        activation=hub.activation("hidden_act", default="gelu"),
        position="rope",
        rope_theta=rope.theta,
        rope_scale=rope.scale,
        dtype=dtype,
    )


def read_params(t: Tensors, config: Config) -> dict:
    embed = {"word": t.embedding("embeddings.word_embeddings.weight"), "norm": t.norm("embeddings.LayerNorm")}
    if config.type_vocab_size:
        embed["token_type"] = t.embedding("embeddings.token_type_embeddings.weight")
    params = {"embed": embed}
    hub_names = t.has("encoder.layer.0.attention.qkv_proj.weight")
    for i in range(config.num_layers):
        if hub_names:  # up_gate_proj is [up | gate] and gate is activated
            p = f"encoder.layer.{i}"
            attn = {"qkv": t.dense(f"{p}.attention.qkv_proj"), "out": t.dense(f"{p}.attention.o_proj")}
            norms = {"attn_norm": t.norm(f"{p}.attn_ln"), "mlp_norm": t.norm(f"{p}.mlp_ln")}
            wi = t.swapped_halves(f"{p}.mlp.up_gate_proj")
            params[f"layer_{i}"] = {"attn": attn, **norms, "mlp": {"wi": wi, "wo": t.dense(f"{p}.mlp.down_proj")}}
        else:
            params[f"layer_{i}"] = transformers_layer(t, f"layers.{i}", biases=True)
    return params


def transformers_layer(t: Tensors, p: str, biases: bool) -> dict:
    """One layer's parameters under the names transformers 5 gives GTE's layers, which its NomicBERT port
    shares: separate q/k/v projections, post-attention and post-MLP norms, gate_proj the activated half."""
    return {
        "attn": {
            "qkv": t.dense(*(f"{p}.self_attn.{n}_proj" for n in "qkv"), bias=biases),
            "out": t.dense(f"{p}.self_attn.o_proj", bias=biases),
        },
        "attn_norm": t.norm(f"{p}.post_attention_layernorm"),
        "mlp_norm": t.norm(f"{p}.post_mlp_layernorm"),
        "mlp": {
            "wi": t.dense(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", bias=False),
            "wo": t.dense(f"{p}.mlp.down_proj", bias=biases),
        },
    }
