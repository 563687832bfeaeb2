"""The encoder's shared surface: the config every family extends, rotary positions, pooling, and
``embed_fn``; the model itself is the config's family (models/families/), a Flax module whose attention is
whatever AttentionFn it is given.

Family modules own the projections (one fused QKV matmul); the attention function owns only the score
computation, so swapping kernels never touches a family.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # model.dtype's choices


def gelu_erf(x):
    """BERT's "gelu", the exact erf form. erf(±4) is ±1 in float32, so clipping its argument there changes
    nothing, and lets XLA:CPU skip its large-argument path: 2.3-2.6x faster than jax.nn.gelu(approximate=False)
    on a [2048, 1536] block when timed by hand (no results file), within 1e-6 of it (tests/encoder_test.py)."""
    return 0.5 * x * (1.0 + jax.lax.erf(jnp.clip(x * 0.7071067811865476, -4.0, 4.0)))


ACTIVATIONS = {
    "gelu": gelu_erf,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    position: Literal["absolute", "rope"] = "absolute"
    rope_theta: float = 10000.0
    rope_style: Literal["half", "interleaved"] = "half"  # RoFormer rotates interleaved pairs; Llama-style halves
    dtype: str = "float32"  # compute dtype; parameters stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_offset(self) -> int:
        """The first position id a window uses: BERT counts from 0 (RoBERTa overrides it)."""
        return 0

    @property
    def attention_features(self) -> tuple:
        """The distinct AttentionFeatures this model's layers call attention with (what the plan asks each
        backend's capability check about, per bucket): BERT's layers are all global, with no bias."""
        from attention.interface import AttentionFeatures

        return (AttentionFeatures(),)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")


def rotary(x_BxTxNxH: jax.Array, theta: float, style: str = "half", positions_BxT: jax.Array | None = None,
           scale: float = 1.0) -> jax.Array:
    """Rotary position embedding; computed per position, so sequences have no length limit.

    ``half`` rotates (x[:H/2], x[H/2:]) pairs (Llama, ModernBERT); ``interleaved`` rotates (x[2i], x[2i+1])
    pairs (RoFormer). Both use frequency theta^(-2i/H) for pair i. Positions count from each row's start,
    or are given per token (packed rows restart them at each window). ``scale`` multiplies every frequency
    (RoPE scaling: 1/factor for linear, factor^(-2/H) for fixed NTK).
    """
    _, T, _, H = x_BxTxNxH.shape
    inv_freq_H2 = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if scale != 1.0:
        inv_freq_H2 = inv_freq_H2 * jnp.float32(scale)
    positions_BxT = jnp.arange(T)[None, :] if positions_BxT is None else positions_BxT
    angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_H2
    x = x_BxTxNxH.astype(jnp.float32)
    if style == "interleaved":
        angles_BxTxH = jnp.repeat(angles_BxTxH2, 2, axis=-1)
        rotated = jnp.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    else:
        angles_BxTxH = jnp.concatenate([angles_BxTxH2, angles_BxTxH2], axis=-1)
        x1, x2 = jnp.split(x, 2, axis=-1)
        rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = jnp.cos(angles_BxTxH)[:, :, None, :], jnp.sin(angles_BxTxH)[:, :, None, :]
    return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)


def segment_starts(segment_ids_BxT: jax.Array) -> jax.Array:
    """True where a packed row's segment id changes: each window's first token."""
    return jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                            segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Each token's position inside its own window: packed rows restart positions where the segment id
    changes, so a packed window sees the positions it would alone."""
    T = segment_ids_BxT.shape[1]
    starts_BxT = segment_starts(segment_ids_BxT)
    index_T = jnp.arange(T, dtype=jnp.int32)
    start_BxT = jax.lax.cummax(jnp.where(starts_BxT, index_T[None, :], 0), axis=1)
    return index_T[None, :] - start_BxT


def Encoder(config: EncoderConfig, attention: Callable[..., Any]) -> nn.Module:
    """The Flax module of the config's family (models/families/): token ids [B, T] and valid lengths [B] →
    hidden states [B, T, D] (compute dtype). With segment ids [B, T] (packed rows: 1, 2, … per window, 0 for
    padding) each window attends only to itself and counts its positions from its own start. Named like the
    module it returns: ``Encoder(config, attend).apply(...)`` / ``.init(...)``."""
    from models.families import family_of

    return family_of(config).Model(config, attention)


def pool(hidden_BxTxD: jax.Array, lengths_B: jax.Array, mode: str) -> jax.Array:
    """Window embeddings in float32: mean over the valid tokens, or the first ([CLS]) token."""
    hidden_BxTxD = hidden_BxTxD.astype(jnp.float32)
    if mode == "cls":
        return hidden_BxTxD[:, 0, :]
    if mode != "mean":
        raise ValueError(f"pooling {mode!r} is not supported; use 'mean' or 'cls'")
    mask_BxT = jnp.arange(hidden_BxTxD.shape[1])[None, :] < lengths_B[:, None]
    summed_BxD = jnp.einsum("btd,bt->bd", hidden_BxTxD, mask_BxT.astype(jnp.float32))
    return summed_BxD / jnp.maximum(lengths_B, 1)[:, None].astype(jnp.float32)


def pool_segments(hidden_BxTxD: jax.Array, segment_ids_BxT: jax.Array, slot_lengths_BxK: jax.Array,
                  mode: str) -> jax.Array:
    """Packed rows: one float32 embedding per window slot [B, K, D]; slot k is segment k + 1. Mean over
    the slot's tokens, or its first token for ``cls``; empty slots are zero."""
    K = slot_lengths_BxK.shape[1]
    in_slot_BxTxK = segment_ids_BxT[:, :, None] == jnp.arange(1, K + 1, dtype=segment_ids_BxT.dtype)
    if mode == "cls":
        in_slot_BxTxK = in_slot_BxTxK & segment_starts(segment_ids_BxT)[:, :, None]
    elif mode != "mean":
        raise ValueError(f"pooling {mode!r} is not supported; use 'mean' or 'cls'")
    summed_BxKxD = jnp.einsum("btd,btk->bkd", hidden_BxTxD.astype(jnp.float32), in_slot_BxTxK.astype(jnp.float32))
    if mode == "cls":
        return summed_BxKxD
    return summed_BxKxD / jnp.maximum(slot_lengths_BxK, 1)[..., None].astype(jnp.float32)


def embed_fn(config: EncoderConfig, attention: Callable[..., Any], pooling: str):
    """``(params, ids_BxT, lengths_B) -> pooled_BxD``, or with packed rows
    ``(params, ids_BxT, lengths_B, segment_ids_BxT, slot_lengths_BxK) -> pooled_BxKxD``; ready for jax.jit
    (one compile per shape)."""
    module = Encoder(config, attention)

    def embed(params, ids_BxT, lengths_B, segment_ids_BxT=None, slot_lengths_BxK=None):
        hidden_BxTxD = module.apply({"params": params}, ids_BxT, lengths_B, segment_ids_BxT)
        if segment_ids_BxT is None:
            return pool(hidden_BxTxD, lengths_B, pooling)
        return pool_segments(hidden_BxTxD, segment_ids_BxT, slot_lengths_BxK, pooling)

    return embed

