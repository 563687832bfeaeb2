"""BERT, and RoFormer (BERT with interleaved rotary positions instead of a position table): the post-norm
encoder every other post-norm family varies (models/families/blocks.py's PostNormEncoder). Config:
EncoderConfig itself (models/families/encoder_config.py)."""

from __future__ import annotations

from docbeam.models.families.blocks import PostNormEncoder
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors

Config = EncoderConfig
PREFIXES = ("bert.", "roformer.", "model.")


class Model(PostNormEncoder):
    """Absolute positions from a table (BERT), or interleaved rotary ones (RoFormer): EncoderConfig.position."""


def read_config(hub: HubConfig, dtype: str) -> EncoderConfig:
    rope = hub.raw.get("model_type") == "roformer"
    if not rope:
        hub.refuse_unless("position_embedding_type", ("absolute",), "relative position embeddings")
    if rope and hub.get("embedding_size", default=hub.raw["hidden_size"]) != hub.raw["hidden_size"]:
        raise hub.error(
            "has embedding_size != hidden_size, which needs an embedding projection this encoder does not have"
        )
    if rope:
        hub.refuse_unless("rotary_value", (False,), "rotary positions on the values")
    return EncoderConfig(
        **common_fields(hub, dtype),
        position="rope" if rope else "absolute",
        rope_theta=float(hub.get("rope_theta", default=10000.0)),
        rope_style="interleaved" if rope else "half",
    )


def common_fields(hub: HubConfig, dtype: str) -> dict:
    """The BERT keys every post-norm family's config.json shares."""
    return dict(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hub.get("hidden_size"),
        num_layers=hub.get("num_hidden_layers"),
        num_heads=hub.get("num_attention_heads"),
        intermediate_size=hub.get("intermediate_size"),
        max_position=hub.get("max_position_embeddings", default=512),
        type_vocab_size=hub.get("type_vocab_size", default=2),
        layer_norm_eps=hub.get("layer_norm_eps", default=1e-12),
        activation=hub.activation("hidden_act", default="gelu"),
        dtype=dtype,
    )


def embedding_params(t: Tensors, config: EncoderConfig) -> dict:
    """BERT's embeddings: words, positions where absolute, token types where the config has them, the norm."""
    embed = {"word": t.embedding("embeddings.word_embeddings.weight"), "norm": t.norm("embeddings.LayerNorm")}
    if config.position == "absolute":
        embed["position"] = t.embedding("embeddings.position_embeddings.weight")
    if config.type_vocab_size:
        embed["token_type"] = t.embedding("embeddings.token_type_embeddings.weight")
    return embed


def read_params(t: Tensors, config: EncoderConfig) -> dict:
    params = {"embed": embedding_params(t, config)}
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        params[f"layer_{i}"] = {
            "attn": {
                "qkv": t.dense(*(f"{p}.attention.self.{n}" for n in ("query", "key", "value"))),
                "out": t.dense(f"{p}.attention.output.dense"),
            },
            "attn_norm": t.norm(f"{p}.attention.output.LayerNorm"),
            "mlp": {"wi": t.dense(f"{p}.intermediate.dense"), "wo": t.dense(f"{p}.output.dense")},
            "mlp_norm": t.norm(f"{p}.output.LayerNorm"),
        }
    return params
