"""MPNet: BERT's post-norm layers with RoBERTa-style positions (MPNet's padding index is always 1, so
positions start at 2) and no token types, plus a relative-position bias: one table of 32 buckets × heads,
looked up by the bucket of (key − query) and added to every layer's scores. all-mpnet-base-v2."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families import bert, roberta
from docbeam.models.families.blocks import Embeddings, FamilyModel, PostNormLayer
from docbeam.models.families.encoder_config import HubConfig
from docbeam.models.families.tensors import Tensors

PREFIXES = ("mpnet.",)
NUM_BUCKETS, MAX_DISTANCE = 32, 128  # transformers' compute_position_bias uses these, whatever the config says


@dataclasses.dataclass(frozen=True)
class Config(roberta.Config):
    """RoBERTa's positions; pad_token_id is always 1 here (MPNetEmbeddings.padding_idx, whatever the config
    says)."""

    @property
    def attention_features(self) -> tuple:
        from docbeam.attention.interface import AttentionFeatures

        return (AttentionFeatures(bias=True),)


def relative_bucket(offset):
    """Bucket of key − query offsets (T5's scheme, bidirectional): 16 buckets per direction, exact below 8,
    logarithmic up to 128 tokens, the last bucket beyond. float32 as transformers computes it."""
    half = NUM_BUCKETS // 2
    max_exact = half // 2
    n = -offset
    bucket = jnp.where(n < 0, half, 0)
    n = jnp.abs(n)
    large = max_exact + (
        jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
        / math.log(MAX_DISTANCE / max_exact)
        * (half - max_exact)
    ).astype(jnp.int32)
    return bucket + jnp.where(n < max_exact, n, jnp.minimum(large, half - 1))


def relative_bias(table_KxN):
    """The AttentionFn bias: [N, T, S] float32 from row indices (within a packed window an index difference is
    a position difference; pairs across windows are masked)."""

    def bias(q_index_T, k_index_S):
        bucket_TxS = relative_bucket(k_index_S[None, :] - q_index_T[:, None])
        return jnp.transpose(table_KxN[bucket_TxS], (2, 0, 1)).astype(jnp.float32)

    return bias


class Model(FamilyModel):
    """BERT's post-norm layers, every one adding the one relative-position bias table to its scores."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = Embeddings(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.layer_norm_eps,
            dtype,
            position_table=cfg.max_position + cfg.position_offset,
            position_offset=cfg.position_offset,
            name="embed",
        )(ids_BxT, rows)
        table_KxN = self.param("relative_bias", nn.initializers.normal(0.02), (NUM_BUCKETS, cfg.num_heads))
        bias = relative_bias(table_KxN)
        for i in range(cfg.num_layers):
            x_BxTxD = PostNormLayer(cfg, self.attention, name=f"layer_{i}")(x_BxTxD, rows, bias)
        return x_BxTxD


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub.refuse_unless("relative_attention_num_buckets", (NUM_BUCKETS,), "transformers' MPNet buckets by 32")
    fields = bert.common_fields(hub, dtype)
    return Config(**{**fields, "max_position": fields["max_position"] - 2, "type_vocab_size": 0}, pad_token_id=1)


def read_params(t: Tensors, config: Config) -> dict:
    params = {
        "embed": {
            "word": t.embedding("embeddings.word_embeddings.weight"),
            "position": t.embedding("embeddings.position_embeddings.weight"),
            "norm": t.norm("embeddings.LayerNorm"),
        },
        "relative_bias": t("encoder.relative_attention_bias.weight"),
    }
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        params[f"layer_{i}"] = t.post_norm_layer(
            tuple(f"{p}.attention.attn.{n}" for n in "qkv"),
            f"{p}.attention.attn.o",
            f"{p}.attention.LayerNorm",
            f"{p}.intermediate.dense",
            f"{p}.output.dense",
            f"{p}.output.LayerNorm",
        )
    return params
