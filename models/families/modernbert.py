"""ModernBERT: pre-norm LayerNorms without bias (after the embeddings, before each block but the first
layer's attention, and at the end), fused Wqkv, GeGLU, no biases, rotary positions with one theta on global
layers and another on local ones; every ``global_attn_every_n_layers``-th layer attends globally, the rest
within ``local_attention // 2`` tokens each side. gte-modernbert, modernbert-embed, granite-embedding r2."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families.blocks import Embeddings, FamilyModel, GatedMlp, SelfAttention, layer_norm
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig, Rope
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import precision_of

PREFIXES = ("model.",)


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    local_rope_theta: float = 10000.0  # rope_theta is the global layers'
    local_window: tuple[int, int] = (64, 64)  # keys each side on local layers
    global_layers: tuple[bool, ...] = ()  # per layer: global (True) or local

    @property
    def attention_features(self) -> tuple:
        from docbeam.attention.interface import AttentionFeatures

        kinds = [
            AttentionFeatures() if is_global else AttentionFeatures(local_window=self.local_window)
            for is_global in self.global_layers
        ]
        return tuple(dict.fromkeys(kinds))


class Model(FamilyModel):
    """Pre-norm layers, global or local as ``global_layers`` says, and a final norm."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = Embeddings(cfg.vocab_size, cfg.hidden_size, cfg.layer_norm_eps, dtype, norm_bias=False, name="embed")(
            ids_BxT, rows
        )
        for i, is_global in enumerate(cfg.global_layers):
            x_BxTxD = Layer(cfg, self.attention, is_global, i == 0, name=f"layer_{i}")(x_BxTxD, rows)
        return layer_norm(cfg.layer_norm_eps, dtype, "final_norm", use_bias=False)(x_BxTxD)


class Layer(nn.Module):
    config: Config
    attention: Callable[..., Any]
    is_global: bool
    first: bool  # the embeddings' norm is the first layer's attention norm

    @nn.compact
    def __call__(self, x_BxTxD, rows):
        cfg, precision = self.config, precision_of(self.config.dtype)
        h_BxTxD = x_BxTxD if self.first else layer_norm(cfg.layer_norm_eps, jnp.float32, "attn_norm", False)(x_BxTxD)
        rope = Rope(cfg.rope_theta if self.is_global else cfg.local_rope_theta)
        x_BxTxD = x_BxTxD + SelfAttention(
            cfg.num_heads,
            self.attention,
            precision,
            use_bias=False,
            rope=rope,
            local_window=None if self.is_global else cfg.local_window,
            name="attn",
        )(h_BxTxD, rows)
        h_BxTxD = layer_norm(cfg.layer_norm_eps, jnp.float32, "mlp_norm", False)(x_BxTxD)
        return x_BxTxD + GatedMlp(cfg.intermediate_size, cfg.activation, precision, name="mlp")(h_BxTxD)


def read_config(hub: HubConfig, dtype: str) -> Config:
    for key, why in (
        ("norm_bias", "biased norms"),
        ("attention_bias", "biased attention projections"),
        ("mlp_bias", "biased MLP projections"),
    ):
        hub.refuse_unless(key, (False,), why)
    layers, heads, hidden = hub.get("num_hidden_layers"), hub.get("num_attention_heads"), hub.get("hidden_size")
    if "layer_types" in hub.raw:  # transformers 5
        kinds = tuple(hub.raw["layer_types"])
        unknown = set(kinds) - {"full_attention", "sliding_attention"}
        if unknown or len(kinds) != layers:
            raise hub.error(f"has layer_types {list(kinds)}; expected {layers} of full_attention/sliding_attention")
        global_layers = tuple(kind == "full_attention" for kind in kinds)
    else:  # the Hub's files: layer i is global when i % global_attn_every_n_layers == 0
        every = int(hub.get("global_attn_every_n_layers", default=3))
        global_layers = tuple(i % every == 0 for i in range(layers))
    half_window = int(hub.get("local_attention", default=128)) // 2
    global_rope = hub.rope(hidden // heads, 160_000.0, "full_attention", legacy_theta=("global_rope_theta",))
    local_rope = hub.rope(hidden // heads, 10_000.0, "sliding_attention", legacy_theta=("local_rope_theta",))
    if global_rope.scale != 1.0 or local_rope.scale != 1.0:
        raise hub.error("sets a RoPE scaling, which docbeam does not reproduce for ModernBERT")
    return Config(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=hub.get("intermediate_size"),
        max_position=hub.get("max_position_embeddings", default=8192),
        type_vocab_size=0,
        layer_norm_eps=hub.get("norm_eps", default=1e-5),
        activation=hub.activation("hidden_activation", default="gelu"),
        position="rope",
        rope_theta=global_rope.theta,
        local_rope_theta=local_rope.theta,
        local_window=(half_window, half_window),
        global_layers=global_layers,
        dtype=dtype,
    )


def read_params(t: Tensors, config: Config) -> dict:
    params = {
        "embed": {
            "word": t.embedding("embeddings.tok_embeddings.weight"),
            "norm": t.norm("embeddings.norm", bias=False),
        },
        "final_norm": t.norm("final_norm", bias=False),
    }
    for i in range(config.num_layers):
        p = f"layers.{i}"
        layer = {
            "attn": {"qkv": t.dense(f"{p}.attn.Wqkv", bias=False), "out": t.dense(f"{p}.attn.Wo", bias=False)},
            "mlp_norm": t.norm(f"{p}.mlp_norm", bias=False),
            # Wi's first half is activated: GatedMlp's order already.
            "mlp": {"wi": t.dense(f"{p}.mlp.Wi", bias=False), "wo": t.dense(f"{p}.mlp.Wo", bias=False)},
        }
        if i:
            layer["attn_norm"] = t.norm(f"{p}.attn_norm", bias=False)
        params[f"layer_{i}"] = layer
    return params
