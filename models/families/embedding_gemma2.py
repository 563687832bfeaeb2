"""EmbeddingGemma 2 (``embedding_gemma2_text``): Gemma3's bidirectional encoder (models/families/gemma3.py) with
what transformers' EmbeddingGemma2TextModel changes:
- RMSNorm weights multiply as they are (stored around 1, not Gemma3's 1 + w), and v is normalised too, without
  a weight;
- scores are not scaled (scale 1: the q/k norms fix their size);
- full layers have their own head_dim and key/value heads (``per_layer_config``; 512 and 1 by default);
- a sliding layer sees the keys within ``sliding_window`` each side, inclusive: the config's value is the
  radius, not Gemma3's width;
- per-layer embeddings, projection-only: the scaled token embeddings projected to ``hidden_size_per_layer_input``
  per layer, which gate a third residual block after each layer's MLP; then each layer's output is multiplied
  by its ``layer_scalar``;
- after the final norm, ``embedding_projection`` to ``embedding_dim``: the hidden states pooling sees.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families import gemma3
from docbeam.models.families.blocks import FamilyModel, rms_norm
from docbeam.models.families.encoder_config import ACTIVATIONS, HubConfig
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import Linear, precision_of

PREFIXES = ()  # EmbeddingGemma2TextModel saves its tensors bare; no head class wraps it
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # per_layer_config's overrides docbeam reproduces


@dataclasses.dataclass(frozen=True)
class Config(gemma3.Config):
    causal: bool = False
    query_scale: float = 1.0
    norm_offset: float = 0.0
    v_norm: bool = True
    full_head_dim: int = 512  # a full layer's head_dim and key/value heads
    full_kv_heads: int = 1
    per_layer_size: int = 512  # hidden_size_per_layer_input
    embedding_dim: int = 768

    @property
    def output_size(self) -> int:
        return self.embedding_dim

    def layer_heads(self, sliding: bool) -> tuple[int, int]:
        return (self.kv_heads, self.head_dim) if sliding else (self.full_kv_heads, self.full_head_dim)

    def attention_shape(self, features) -> tuple[int, int | None]:
        kv_heads, head_dim = self.layer_heads(features.local_window is not None)
        return head_dim, kv_heads

    def check_heads(self) -> None:
        super().check_heads()
        if self.num_heads % self.full_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of the full layers' key/value heads {self.full_kv_heads}"
            )


class Model(FamilyModel):
    """Scaled token embeddings and their per-layer projection, the layers, a final norm, the projection."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = gemma3.embed(cfg, ids_BxT, dtype)
        per_layer_BxTxLxP = PerLayerInputs(cfg, name="per_layer")(x_BxTxD)
        for i, sliding in enumerate(cfg.sliding_layers):
            x_BxTxD = Layer(cfg, self.attention, sliding, name=f"layer_{i}")(x_BxTxD, rows, per_layer_BxTxLxP[:, :, i])
        x_BxTxD = rms_norm(cfg.layer_norm_eps, dtype, "final_norm")(x_BxTxD)
        return Linear(cfg.embedding_dim, precision_of(cfg.dtype), use_bias=False, name="projection")(x_BxTxD)


class PerLayerInputs(nn.Module):
    """Projection-only per-layer embeddings: the embeddings projected to L × P, scaled by hidden^-½, normed."""

    config: Config

    @nn.compact
    def __call__(self, x_BxTxD):
        cfg = self.config
        L, P = cfg.num_layers, cfg.per_layer_size
        h_BxTxLP = Linear(L * P, precision_of(cfg.dtype), use_bias=False, name="projection")(x_BxTxD)
        h_BxTxLxP = (h_BxTxLP / math.sqrt(cfg.hidden_size)).reshape(*x_BxTxD.shape[:2], L, P)
        return rms_norm(cfg.layer_norm_eps, jnp.float32, "norm")(h_BxTxLxP)


class Layer(nn.Module):
    """Gemma3's sandwich layer, then x + norm(out(act(gate(x)) · per-layer input)), all times layer_scalar."""

    config: Config
    attention: Callable[..., Any]
    sliding: bool

    @nn.compact
    def __call__(self, x_BxTxD, rows, per_layer_BxTxP):
        cfg, precision = self.config, precision_of(self.config.dtype)
        x_BxTxD = gemma3.Layer(cfg, self.attention, self.sliding, name="block")(x_BxTxD, rows)
        gate_BxTxP = ACTIVATIONS[cfg.activation](Linear(cfg.per_layer_size, precision, False, name="gate")(x_BxTxD))
        h_BxTxD = Linear(cfg.hidden_size, precision, False, name="out")(gate_BxTxP * per_layer_BxTxP)
        x_BxTxD = x_BxTxD + rms_norm(cfg.layer_norm_eps, jnp.float32, "per_layer_norm")(h_BxTxD)
        return x_BxTxD * self.param("scalar", nn.initializers.ones, (1,), jnp.float32)


def full_layer_heads(hub: HubConfig, sliding: tuple[bool, ...]) -> tuple[int, int]:
    """(head_dim, key/value heads) of the full layers: ``per_layer_config``'s overrides of the global ones
    (transformers saves only what differs), or without it transformers' defaults, ``global_head_dim`` (512) and
    ``num_global_key_value_heads`` (1). Every full layer must share them, and no sliding layer may differ."""
    overrides = hub.raw.get("per_layer_config")
    if overrides is None:
        return hub.get("global_head_dim", default=512), hub.get("num_global_key_value_heads", default=1)
    by_layer = {int(i): dict(v) for i, v in overrides.items()}
    unknown = {key for v in by_layer.values() for key in v} - set(PER_LAYER_KEYS)
    if unknown or any(sliding[i] for i in by_layer if i < len(sliding)) or max(by_layer, default=0) >= len(sliding):
        raise hub.error(
            f"sets per_layer_config {overrides}; docbeam reproduces only {', '.join(PER_LAYER_KEYS)} "
            "overridden alike on every full_attention layer"
        )
    base = {
        "head_dim": hub.get("head_dim", default=256),
        "num_key_value_heads": hub.get("num_key_value_heads", default=hub.get("num_attention_heads")),
    }
    shapes = {
        tuple({**base, **by_layer.get(i, {})}[key] for key in PER_LAYER_KEYS)
        for i, is_sliding in enumerate(sliding)
        if not is_sliding
    }
    if len(shapes) != 1:
        raise hub.error(
            f"sets per_layer_config {overrides}, which gives the full layers different shapes "
            f"{sorted(shapes)}; docbeam runs one shape per kind of layer"
        )
    return shapes.pop()


def read_config(hub: HubConfig, dtype: str) -> Config:
    fields = gemma3.common_fields(hub, dtype)
    # transformers forces the last layer to full_attention (with a warning): so does docbeam.
    sliding = fields["sliding_layers"] = (*fields["sliding_layers"][:-1], False)
    radius = hub.get("sliding_window", default=512)
    if not isinstance(radius, int) or isinstance(radius, bool) or radius < 0:
        raise hub.error(f"sets sliding_window: {radius!r}; expected a radius in tokens (0 or more)")
    head_dim, kv_heads = full_layer_heads(hub, sliding)
    return Config(
        **fields,
        max_position=hub.get("max_position_embeddings", default=262_144),
        local_window=(radius, radius),
        full_head_dim=head_dim,
        full_kv_heads=kv_heads,
        per_layer_size=hub.get("hidden_size_per_layer_input", default=512),
        embedding_dim=hub.get("embedding_dim", default=768),
    )


def read_params(t: Tensors, config: Config) -> dict:
    params = {
        "embed": t.embedding("embed_tokens.weight"),
        "final_norm": t.norm("norm", bias=False),
        "projection": t.dense("embedding_projection", bias=False),
        "per_layer": {
            "projection": t.dense("ple.per_layer_model_projection", bias=False),
            "norm": t.norm("ple.per_layer_projection_norm", bias=False),
        },
    }
    for i in range(config.num_layers):
        p = f"layers.{i}"
        params[f"layer_{i}"] = {
            "block": gemma3.layer_params(t, p, config),
            "gate": t.dense(f"{p}.ple_block.per_layer_input_gate", bias=False),
            "out": t.dense(f"{p}.ple_block.per_layer_projection", bias=False),
            "per_layer_norm": t.norm(f"{p}.ple_block.post_per_layer_input_norm", bias=False),
            "scalar": t(f"{p}.layer_scalar"),
        }
    return params
