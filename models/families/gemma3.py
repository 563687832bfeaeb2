"""Gemma3 text models (``gemma3_text``): Qwen3's decoder blocks (grouped-query attention, per-head q/k RMSNorm,
rotary positions, a gated MLP) with Gemma's differences: every RMSNorm multiplies by ``1 + weight``, a norm
after attention and after the MLP as well as before each ("sandwich"), GeGLU with tanh GELU, the embeddings
scaled by √hidden, ``query_pre_attn_scalar^-½`` as the score scale, and ``layer_types`` mixing sliding layers
(a local window, RoPE base ``rope_local_base_freq``) with full ones (their own base). EmbeddingGemma-300m
sets ``use_bidirectional_attention``: every layer attends both ways and the sliding window becomes a radius
(below); the causal Gemma3 checkpoints attend to earlier tokens only and are pooled at the last token."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families import qwen3
from docbeam.models.families.blocks import FamilyModel, GatedMlp, GroupedSelfAttention, rms_norm
from docbeam.models.families.encoder_config import HubConfig, Rope
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import precision_of

PREFIXES = ("model.",)  # Gemma3ForCausalLM's tensors; Gemma3TextModel (EmbeddingGemma) saves them bare
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Config(qwen3.Config):
    sliding_layers: tuple[bool, ...] = ()  # per layer: sliding (True) or full
    local_window: tuple[int, int] = (256, 256)  # a sliding layer's keys (left, right): read_config's window_of
    local_rope_theta: float = 10_000.0  # rope_theta is the full layers'
    causal: bool = True  # False: use_bidirectional_attention
    query_scale: float = 1 / 16  # query_pre_attn_scalar^-½
    norm_offset: float = 1.0  # every RMSNorm multiplies by norm_offset + weight
    v_norm: bool = False

    @property
    def attention_features(self) -> tuple:
        from docbeam.attention.interface import AttentionFeatures

        kinds = [
            AttentionFeatures(local_window=self.local_window if sliding else None, causal=self.causal)
            for sliding in self.sliding_layers
        ]
        return tuple(dict.fromkeys(kinds))

    def layer_heads(self, sliding: bool) -> tuple[int, int]:
        """(key/value heads, head_dim) of a sliding or a full layer: the same in Gemma3."""
        del sliding
        return self.kv_heads, self.head_dim


class Model(FamilyModel):
    """Scaled token embeddings, sandwich layers sliding or full as ``sliding_layers`` says, a final norm."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = embed(cfg, ids_BxT, dtype)
        for i, sliding in enumerate(cfg.sliding_layers):
            x_BxTxD = Layer(cfg, self.attention, sliding, name=f"layer_{i}")(x_BxTxD, rows)
        return rms_norm(cfg.layer_norm_eps, dtype, "final_norm", cfg.norm_offset)(x_BxTxD)


def embed(cfg: Config, ids_BxT, dtype):
    """Token embeddings times √hidden (in float32: transformers rounds the factor to the weights' dtype)."""
    x_BxTxD = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, name="embed")(ids_BxT)
    return x_BxTxD * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)


class Layer(nn.Module):
    """x + norm(attention(norm(x))), then x + norm(mlp(norm(x)))."""

    config: Config
    attention: Callable[..., Any]
    sliding: bool

    @nn.compact
    def __call__(self, x_BxTxD, rows):
        cfg, precision = self.config, precision_of(self.config.dtype)

        def norm(name):
            return rms_norm(cfg.layer_norm_eps, jnp.float32, name, cfg.norm_offset)

        kv_heads, head_dim = cfg.layer_heads(self.sliding)
        rope = Rope(cfg.local_rope_theta) if self.sliding else cfg.rope
        attention = GroupedSelfAttention(
            cfg.num_heads,
            kv_heads,
            head_dim,
            self.attention,
            precision,
            rope,
            qk_norm_eps=cfg.layer_norm_eps if cfg.qk_norm else None,
            norm_offset=cfg.norm_offset,
            v_norm=cfg.v_norm,
            causal=cfg.causal,
            local_window=cfg.local_window if self.sliding else None,
            scale=cfg.query_scale,
            name="attn",
        )
        x_BxTxD = x_BxTxD + norm("post_attn_norm")(attention(norm("attn_norm")(x_BxTxD), rows))
        mlp = GatedMlp(cfg.intermediate_size, cfg.activation, precision, name="mlp")
        return x_BxTxD + norm("post_mlp_norm")(mlp(norm("mlp_norm")(x_BxTxD)))


def window_of(hub: HubConfig, bidirectional: bool) -> tuple[int, int]:
    """The keys a sliding layer sees, as transformers' masks decide them from config.json's ``sliding_window``
    S: causal, the S - 1 keys before a token and itself; bidirectional, Gemma3TextConfig turns S into the
    exclusive bound ``S // 2 + 1`` and masks ``|i - j| < S // 2 + 1``, so S // 2 keys each side."""
    size = hub.get("sliding_window")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise hub.error(f"sets sliding_window: {size!r}; expected a positive number of tokens")
    return (size // 2, size // 2) if bidirectional else (size - 1, 0)


def sliding_layers(hub: HubConfig, layers: int) -> tuple[bool, ...]:
    """transformers 5's ``layer_types``, or the Hub's pattern: every ``sliding_window_pattern``-th layer full."""
    if hub.raw.get("layer_types") is not None:
        kinds = tuple(hub.raw["layer_types"])
        if set(kinds) - set(LAYER_TYPES) or len(kinds) != layers:
            raise hub.error(f"has layer_types {list(kinds)}; expected {layers} of {', '.join(LAYER_TYPES)}")
        return tuple(kind == "sliding_attention" for kind in kinds)
    every = int(hub.get("sliding_window_pattern", "_sliding_window_pattern", default=6))
    return tuple(bool((i + 1) % every) for i in range(layers))


def local_theta(hub: HubConfig) -> float:
    """The sliding layers' RoPE base: ``rope_parameters``' sliding_attention, or the Hub's ``rope_local_base_freq``
    (Gemma3TextConfig applies a legacy ``rope_scaling`` to the full layers only)."""
    params = (hub.raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if params.get("rope_type", "default") != "default":
        raise hub.error(
            f"sets rope_parameters.sliding_attention {params}, a RoPE scaling docbeam does not reproduce "
            "on sliding layers; supported: default"
        )
    return float(params.get("rope_theta") or hub.get("rope_local_base_freq", default=10_000.0))


def common_fields(hub: HubConfig, dtype: str) -> dict:
    """What Gemma3 and EmbeddingGemma 2 read alike: shapes, layer kinds, RoPE bases, norms."""
    hub.refuse_unless("attention_bias", (False,), "biased attention projections")
    layers, heads, hidden = hub.get("num_hidden_layers"), hub.get("num_attention_heads"), hub.get("hidden_size")
    head_dim = hub.get("head_dim", default=256)
    full_rope = hub.rope(head_dim, 1_000_000.0, "full_attention")  # linear scaling (the larger Gemma3s') too
    return dict(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=hub.get("intermediate_size"),
        type_vocab_size=0,
        layer_norm_eps=hub.get("rms_norm_eps", default=1e-6),
        activation=hub.activation("hidden_activation", default="gelu_pytorch_tanh"),
        position="rope",
        rope_theta=full_rope.theta,
        rope_scale=full_rope.scale,
        local_rope_theta=local_theta(hub),
        num_kv_heads=hub.get("num_key_value_heads", default=heads),
        attention_head_dim=head_dim,
        sliding_layers=sliding_layers(hub, layers),
        dtype=dtype,
    )


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub.refuse_unless("attn_logit_softcapping", (None,), "soft-capped attention scores")
    bidirectional = bool(hub.get("use_bidirectional_attention", default=False))
    fields = common_fields(hub, dtype)
    window = window_of(hub, bidirectional) if any(fields["sliding_layers"]) else (0, 0)
    return Config(
        **fields,
        max_position=hub.get("max_position_embeddings", default=131_072),
        local_window=window,
        causal=not bidirectional,
        query_scale=float(hub.get("query_pre_attn_scalar", default=256)) ** -0.5,
    )


def layer_params(t: Tensors, p: str, config: Config) -> dict:
    """One sandwich layer's tensors (``p``: its prefix, ``layers.<i>``): Qwen3's, but Gemma's
    post_attention_layernorm follows attention, and pre_feedforward_layernorm is the one before the MLP."""
    params = qwen3.layer_params(t, p, config)
    return {
        **params,
        "post_attn_norm": t.norm(f"{p}.post_attention_layernorm", bias=False),
        "mlp_norm": t.norm(f"{p}.pre_feedforward_layernorm", bias=False),
        "post_mlp_norm": t.norm(f"{p}.post_feedforward_layernorm", bias=False),
    }


def read_params(t: Tensors, config: Config) -> dict:
    return {
        "embed": t.embedding("embed_tokens.weight"),
        "final_norm": t.norm("norm", bias=False),
        **{f"layer_{i}": layer_params(t, f"layers.{i}", config) for i in range(config.num_layers)},
    }
