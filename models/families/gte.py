"""GTE "new" (Alibaba's remote-code model, ``model_type: new`` on the Hub; ``gte`` in transformers 5): BERT's
post-norm layers with rotary positions (and the RoPE scaling a checkpoint ships: gte-*-en-v1.5 carry a
fixed NTK ``rope_scaling``), a fused qkv with biases, and GeGLU (one ``up_gate_proj``; transformers 5 splits
it in two). gte-base/large-en-v1.5, gte-multilingual-base, arctic-embed-m-v2.0."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn

from models.families.common import (DTYPES, Embeddings, EncoderConfig, GatedMlp, HubConfig, Rope, SelfAttention,
                                    Tensors, layer_norm, rows_of)

PREFIXES = ("new.", "gte.", "model.")


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    rope_scale: float = 1.0  # Rope.scale: what the checkpoint's RoPE scaling does to every frequency


class Model(nn.Module):
    config: Config
    attention: Callable[..., Any]

    @nn.compact
    def __call__(self, ids_BxT, lengths_B, segment_ids_BxT=None):
        cfg, dtype = self.config, DTYPES[self.config.dtype]
        rows = rows_of(ids_BxT, lengths_B, segment_ids_BxT)
        x_BxTxD = Embeddings(cfg.vocab_size, cfg.hidden_size, cfg.layer_norm_eps, dtype,
                             type_vocab_size=cfg.type_vocab_size, name="embed")(ids_BxT, rows)
        rope = Rope(cfg.rope_theta, scale=cfg.rope_scale)
        for i in range(cfg.num_layers):
            x_BxTxD = Layer(cfg, self.attention, rope, name=f"layer_{i}")(x_BxTxD, rows)
        return x_BxTxD


class Layer(nn.Module):
    config: Config
    attention: Callable[..., Any]
    rope: Rope

    @nn.compact
    def __call__(self, x_BxTxD, rows):
        cfg, dtype = self.config, DTYPES[self.config.dtype]
        attn_BxTxD = SelfAttention(cfg.num_heads, self.attention, dtype, rope=self.rope, name="attn")(x_BxTxD, rows)
        x_BxTxD = layer_norm(cfg.layer_norm_eps, dtype, "attn_norm")(x_BxTxD + attn_BxTxD)
        h_BxTxD = GatedMlp(cfg.intermediate_size, cfg.activation, dtype, out_bias=True, name="mlp")(x_BxTxD)
        return layer_norm(cfg.layer_norm_eps, dtype, "mlp_norm")(x_BxTxD + h_BxTxD)


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub_form = hub.raw.get("model_type") == "new"
    hub.refuse_unless("position_embedding_type", ("rope",), "GTE runs with rotary positions")
    hub.refuse_unless("layer_norm_type", ("layer_norm",), "only LayerNorm")
    hub.refuse_unless("logn_attention_scale", (False,), "log-n attention scaling")
    hub.refuse_unless("pack_qkv", (True,), "only the fused qkv_proj")
    hidden, heads = hub.get("hidden_size"), hub.get("num_attention_heads")
    rope = hub.rope(hidden // heads, 10_000.0 if hub_form else 160_000.0)
    return Config(vocab_size=hub.get("vocab_size"), hidden_size=hidden, num_layers=hub.get("num_hidden_layers"),
                  num_heads=heads, intermediate_size=hub.get("intermediate_size"),
                  max_position=hub.get("max_position_embeddings", default=8192),
                  type_vocab_size=hub.get("type_vocab_size", default=0 if hub_form else 1),
                  layer_norm_eps=hub.get("layer_norm_eps", default=1e-12),
                  activation=hub.activation("hidden_act", default="gelu"), position="rope",
                  rope_theta=rope.theta, rope_scale=rope.scale, dtype=dtype)


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
        else:
            p = f"layers.{i}"
            attn = {"qkv": t.dense(*(f"{p}.self_attn.{n}_proj" for n in "qkv")),
                    "out": t.dense(f"{p}.self_attn.o_proj")}
            norms = {"attn_norm": t.norm(f"{p}.post_attention_layernorm"),
                     "mlp_norm": t.norm(f"{p}.post_mlp_layernorm")}
            wi = t.dense(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", bias=False)
        params[f"layer_{i}"] = {"attn": attn, **norms, "mlp": {"wi": wi, "wo": t.dense(f"{p}.mlp.down_proj")}}
    return params
