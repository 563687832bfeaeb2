"""BERT, and RoFormer (BERT with interleaved rotary positions instead of a position table): the post-norm
layer every other post-norm family varies. Config: EncoderConfig itself (models/families/common.py)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn

from models.families.common import (DTYPES, Embeddings, EncoderConfig, HubConfig, Mlp, Rope, SelfAttention, Tensors,
                                    layer_norm, rows_of)

Config = EncoderConfig
PREFIXES = ("bert.", "roformer.", "model.")


class Model(nn.Module):
    config: EncoderConfig
    attention: Callable[..., Any]

    @nn.compact
    def __call__(self, ids_BxT, lengths_B, segment_ids_BxT=None):
        cfg, dtype = self.config, DTYPES[self.config.dtype]
        rows = rows_of(ids_BxT, lengths_B, segment_ids_BxT)
        absolute = cfg.position == "absolute"
        x_BxTxD = Embeddings(cfg.vocab_size, cfg.hidden_size, cfg.layer_norm_eps, dtype,
                             position_table=cfg.max_position + cfg.position_offset if absolute else 0,
                             position_offset=cfg.position_offset, type_vocab_size=cfg.type_vocab_size,
                             name="embed")(ids_BxT, rows)
        rope = None if absolute else Rope(cfg.rope_theta, cfg.rope_style)
        for i in range(cfg.num_layers):
            x_BxTxD = PostNormLayer(cfg, self.attention, rope, name=f"layer_{i}")(x_BxTxD, rows)
        return x_BxTxD


class PostNormLayer(nn.Module):
    config: EncoderConfig
    attention: Callable[..., Any]
    rope: Rope | None = None

    @nn.compact
    def __call__(self, x_BxTxD, rows, bias=None):
        cfg, dtype = self.config, DTYPES[self.config.dtype]
        attn_BxTxD = SelfAttention(cfg.num_heads, self.attention, dtype, rope=self.rope, name="attn")(x_BxTxD, rows,
                                                                                                     bias)
        x_BxTxD = layer_norm(cfg.layer_norm_eps, dtype, "attn_norm")(x_BxTxD + attn_BxTxD)
        h_BxTxD = Mlp(cfg.intermediate_size, cfg.activation, dtype, name="mlp")(x_BxTxD)
        return layer_norm(cfg.layer_norm_eps, dtype, "mlp_norm")(x_BxTxD + h_BxTxD)


def read_config(hub: HubConfig, dtype: str) -> EncoderConfig:
    rope = hub.raw.get("model_type") == "roformer"
    if not rope:
        hub.refuse_unless("position_embedding_type", ("absolute",), "relative position embeddings")
    if rope and hub.get("embedding_size", default=hub.raw["hidden_size"]) != hub.raw["hidden_size"]:
        raise hub.error("has embedding_size != hidden_size, which needs an embedding projection this encoder "
                        "does not have")
    if rope:
        hub.refuse_unless("rotary_value", (False,), "rotary positions on the values")
    return EncoderConfig(**common_fields(hub, dtype), position="rope" if rope else "absolute",
                         rope_theta=float(hub.get("rope_theta", default=10000.0)),
                         rope_style="interleaved" if rope else "half")


def common_fields(hub: HubConfig, dtype: str) -> dict:
    """The BERT keys every post-norm family's config.json shares."""
    return dict(vocab_size=hub.get("vocab_size"), hidden_size=hub.get("hidden_size"),
                num_layers=hub.get("num_hidden_layers"), num_heads=hub.get("num_attention_heads"),
                intermediate_size=hub.get("intermediate_size"),
                max_position=hub.get("max_position_embeddings", default=512),
                type_vocab_size=hub.get("type_vocab_size", default=2),
                layer_norm_eps=hub.get("layer_norm_eps", default=1e-12),
                activation=hub.activation("hidden_act", default="gelu"), dtype=dtype)


def read_params(t: Tensors, config: EncoderConfig) -> dict:
    embed = {"word": t.embedding("embeddings.word_embeddings.weight"), "norm": t.norm("embeddings.LayerNorm")}
    if config.position == "absolute":
        embed["position"] = t.embedding("embeddings.position_embeddings.weight")
    if config.type_vocab_size:
        embed["token_type"] = t.embedding("embeddings.token_type_embeddings.weight")
    params = {"embed": embed}
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        params[f"layer_{i}"] = {
            "attn": {"qkv": t.dense(*(f"{p}.attention.self.{n}" for n in ("query", "key", "value"))),
                     "out": t.dense(f"{p}.attention.output.dense")},
            "attn_norm": t.norm(f"{p}.attention.output.LayerNorm"),
            "mlp": {"wi": t.dense(f"{p}.intermediate.dense"), "wo": t.dense(f"{p}.output.dense")},
            "mlp_norm": t.norm(f"{p}.output.LayerNorm"),
        }
    return params
