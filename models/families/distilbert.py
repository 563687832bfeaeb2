"""DistilBERT: BERT's post-norm encoder (models/families/blocks.py's PostNormEncoder) without token types or a
pooler, under its own keys (``dim``, ``n_layers``, ``n_heads``, ``hidden_dim``, ``activation``) and tensor
names, LayerNorm eps fixed at 1e-12. Positions come from a table, learned or (``sinusoidal_pos_embds``)
sinusoidal; transformers saves either table, and computes the sinusoidal one only when a checkpoint lacks it,
as docbeam does. msmarco-distilbert, and the encoder of distilbert-base-uncased SPLADE models and classifiers."""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.models.families.blocks import PostNormEncoder
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors

PREFIXES = ("distilbert.",)  # DistilBertForMaskedLM / ForSequenceClassification; DistilBertModel saves them bare


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    sinusoidal_positions: bool = False  # config.json's sinusoidal_pos_embds


class Model(PostNormEncoder):
    """BERT's encoder: a position table, no token type (type_vocab_size 0), post-norm layers with biases."""


def read_config(hub: HubConfig, dtype: str) -> Config:
    return Config(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hub.get("dim", "hidden_size"),
        num_layers=hub.get("n_layers", "num_hidden_layers"),
        num_heads=hub.get("n_heads", "num_attention_heads"),
        intermediate_size=hub.get("hidden_dim"),
        max_position=hub.get("max_position_embeddings", default=512),
        type_vocab_size=0,
        layer_norm_eps=1e-12,
        activation=hub.activation("activation", default="gelu"),
        sinusoidal_positions=bool(hub.get("sinusoidal_pos_embds", default=False)),
        dtype=dtype,
    )


def sinusoidal_table(positions: int, dim: int) -> np.ndarray:
    """transformers' create_sinusoidal_embeddings: angle pos / 10000^(2⌊j/2⌋/dim), sine on even columns and
    cosine on odd ones, computed in float64."""
    angles = np.arange(positions)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)[None, :]
    table = np.empty((positions, dim), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])
    return table


def read_params(t: Tensors, config: Config) -> dict:
    positions = "embeddings.position_embeddings.weight"
    table = (
        t.embedding(positions)
        if t.has(positions) or not config.sinusoidal_positions
        else {"embedding": sinusoidal_table(config.max_position, config.hidden_size)}
    )
    params = {
        "embed": {
            "word": t.embedding("embeddings.word_embeddings.weight"),
            "position": table,
            "norm": t.norm("embeddings.LayerNorm"),
        }
    }
    for i in range(config.num_layers):
        p = f"transformer.layer.{i}"
        params[f"layer_{i}"] = t.post_norm_layer(
            tuple(f"{p}.attention.{n}_lin" for n in "qkv"),
            f"{p}.attention.out_lin",
            f"{p}.sa_layer_norm",
            f"{p}.ffn.lin1",
            f"{p}.ffn.lin2",
            f"{p}.output_layer_norm",
        )
    return params
