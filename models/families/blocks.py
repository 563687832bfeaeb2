"""The Flax blocks every family is built from: the rows of a batch as a layer sees them, rotary positions,
norms, embeddings, self-attention around whatever AttentionFn the model is handed (bidirectional, or a
decoder's grouped-query causal form), plain and gated MLPs, BERT's post-norm layer with the options the
post-norm families vary, and ``FamilyModel``, the shell each family's model fills in.

A family file states only how it differs: which blocks, in which order, with which options. No block knows
a kernel, and none knows a family.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from docbeam.models.families.encoder_config import ACTIVATIONS, EncoderConfig, Rope, llama3_frequencies
from docbeam.models.precision import Linear, Precision, precision_of


def rotary(
    x_BxTxNxH: jax.Array,
    theta: float,
    style: str = "half",
    positions_BxT: jax.Array | None = None,
    scale: float = 1.0,
    bands: tuple[float, float, float, float] | None = None,
) -> jax.Array:
    """Rotary position embedding; computed per position, so sequences have no length limit.

    ``half`` rotates (x[:H/2], x[H/2:]) pairs (Llama, ModernBERT); ``interleaved`` rotates (x[2i], x[2i+1])
    pairs (RoFormer). Both use frequency theta^(-2i/H) for pair i. Positions count from each row's start,
    or are given per token (packed rows restart them at each window). ``scale`` multiplies every frequency
    (RoPE scaling: 1/factor for linear, factor^(-2/H) for fixed NTK); ``bands`` rescales them as Llama 3 does.
    """
    _, T, _, H = x_BxTxNxH.shape
    inv_freq_H2 = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if scale != 1.0:
        inv_freq_H2 = inv_freq_H2 * jnp.float32(scale)
    if bands is not None:
        inv_freq_H2 = llama3_frequencies(inv_freq_H2, *bands)
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
    return jnp.concatenate(
        [jnp.ones_like(segment_ids_BxT[:, :1], bool), segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1
    )


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Each token's position inside its own window: packed rows restart positions where the segment id
    changes, so a packed window sees the positions it would alone."""
    T = segment_ids_BxT.shape[1]
    starts_BxT = segment_starts(segment_ids_BxT)
    index_T = jnp.arange(T, dtype=jnp.int32)
    start_BxT = jax.lax.cummax(jnp.where(starts_BxT, index_T[None, :], 0), axis=1)
    return index_T[None, :] - start_BxT


class Rows(NamedTuple):
    """What a layer needs about the batch besides its hidden states: valid lengths [B], segment ids [B, T]
    (packed rows; None otherwise) and each token's position inside its own window [B, T]."""

    lengths_B: jax.Array
    segment_ids_BxT: jax.Array | None
    positions_BxT: jax.Array


def rows_of(ids_BxT: jax.Array, lengths_B: jax.Array, segment_ids_BxT: jax.Array | None) -> Rows:
    """Positions restart at every packed window, so a packed window sees the positions it would alone."""
    if segment_ids_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(ids_BxT.shape[1], dtype=jnp.int32)[None, :], ids_BxT.shape)
    else:
        positions_BxT = segment_positions(segment_ids_BxT)
    return Rows(lengths_B, segment_ids_BxT, positions_BxT)


def layer_norm(eps: float, dtype, name: str, use_bias: bool = True) -> nn.LayerNorm:
    """torch's LayerNorm: the variance as the mean of squared deviations (not E[x²]−E[x]², which loses digits
    when activations are large, as they get in pre-norm residual streams)."""
    return nn.LayerNorm(eps, dtype=dtype, use_bias=use_bias, use_fast_variance=False, name=name)


class Embeddings(nn.Module):
    """Word embeddings, plus (where the family has them) absolute positions counted from ``position_offset``
    and the single token type, then a norm."""

    vocab_size: int
    hidden_size: int
    eps: float
    dtype: Any
    position_table: int = 0  # rows of the absolute position table; 0: none (rotary families)
    position_offset: int = 0  # RoBERTa and MPNet count positions from pad_token_id + 1
    type_vocab_size: int = 0
    norm_bias: bool = True

    @nn.compact
    def __call__(self, ids_BxT, rows: Rows):
        x_BxTxD = nn.Embed(self.vocab_size, self.hidden_size, dtype=self.dtype, name="word")(ids_BxT)
        if self.position_table:
            x_BxTxD = x_BxTxD + nn.Embed(self.position_table, self.hidden_size, dtype=self.dtype, name="position")(
                rows.positions_BxT + self.position_offset
            )
        if self.type_vocab_size:  # one segment per window: token type 0 everywhere
            x_BxTxD = (
                x_BxTxD
                + nn.Embed(self.type_vocab_size, self.hidden_size, dtype=self.dtype, name="token_type")(
                    jnp.zeros((1,), jnp.int32)
                )[0]
            )
        return layer_norm(self.eps, self.dtype, "norm", self.norm_bias)(x_BxTxD)


class SelfAttention(nn.Module):
    """One fused QKV projection, rotary positions if any, the AttentionFn, the output projection. A local
    window and an additive bias are passed to attention only when the layer has them."""

    num_heads: int
    attention: Callable[..., Any]
    precision: Precision
    use_bias: bool = True
    rope: Rope | None = None
    local_window: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows, bias: Callable | None = None):
        B, T, D = x_BxTxD.shape
        N, H = self.num_heads, D // self.num_heads
        qkv_BxTx3D = Linear(3 * D, self.precision, self.use_bias, name="qkv")(x_BxTxD).astype(self.precision.attention)
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = jnp.split(qkv_BxTx3D.reshape(B, T, 3 * N, H), 3, axis=2)
        if self.rope is not None:
            q_BxTxNxH, k_BxTxNxH = (
                rotary(t, self.rope.theta, self.rope.style, rows.positions_BxT, self.rope.scale)
                for t in (q_BxTxNxH, k_BxTxNxH)
            )
        features = {"segment_ids_BxT": rows.segment_ids_BxT, "local_window": self.local_window, "bias": bias}
        attn_BxTxNxH = self.attention(
            q_BxTxNxH,
            k_BxTxNxH,
            v_BxTxNxH,
            kv_lengths_B=rows.lengths_B,
            scale=1.0 / math.sqrt(H),
            **{key: value for key, value in features.items() if value is not None},
        )
        return Linear(D, self.precision, self.use_bias, name="out")(attn_BxTxNxH.reshape(B, T, D))


class Mlp(nn.Module):
    """BERT's feed-forward: dense, activation, dense."""

    intermediate_size: int
    activation: str
    precision: Precision

    @nn.compact
    def __call__(self, x_BxTxD):
        h_BxTxF = ACTIVATIONS[self.activation](Linear(self.intermediate_size, self.precision, name="wi")(x_BxTxD))
        return Linear(x_BxTxD.shape[-1], self.precision, name="wo")(h_BxTxF)


class GatedMlp(nn.Module):
    """GLU feed-forward: ``wo(act(a) · b)`` where ``wi`` projects to [a | b] in one matmul. GeGLU with gelu
    (ModernBERT, GTE), SwiGLU with silu (Nomic); families differ only in which half their checkpoint
    activates, which the weight mapping puts first."""

    intermediate_size: int
    activation: str
    precision: Precision
    out_bias: bool = False  # GTE's down projection has one

    @nn.compact
    def __call__(self, x_BxTxD):
        h_BxTx2F = Linear(2 * self.intermediate_size, self.precision, use_bias=False, name="wi")(x_BxTxD)
        activated_BxTxF, linear_BxTxF = jnp.split(h_BxTx2F, 2, axis=-1)
        h_BxTxF = ACTIVATIONS[self.activation](activated_BxTxF) * linear_BxTxF
        return Linear(x_BxTxD.shape[-1], self.precision, self.out_bias, name="wo")(h_BxTxF)


def rms_norm(eps: float, dtype, name: str, offset: float = 0.0, use_scale: bool = True) -> "RmsNorm":
    """Llama-style RMSNorm (Qwen2/3, EmbeddingGemma 2): x / sqrt(mean(x²) + eps) · scale, no centring, no bias;
    Gemma's multiplies by ``offset + scale`` (offset 1: its weights are stored around 0)."""
    return RmsNorm(eps, dtype, offset, use_scale, name=name)


class RmsNorm(nn.Module):
    """Statistics in float32, as transformers computes them; ``use_scale`` False: no weight (a v norm)."""

    eps: float
    dtype: Any
    offset: float = 0.0
    use_scale: bool = True

    @nn.compact
    def __call__(self, x_BxTx___):
        x = x_BxTx___.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        if self.use_scale:
            y = y * (self.offset + self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32))
        return y.astype(self.dtype)


class GroupedSelfAttention(nn.Module):
    """A decoder's self-attention: one fused projection to N query heads and K ≤ N key/value heads of ``head_dim``
    (not always hidden/N), optional per-head RMSNorm on q, k (and v) before rotary positions (Qwen3, Gemma), the
    AttentionFn given the K heads as they are (grouping is the backend's), causal unless read both ways."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: Callable[..., Any]
    precision: Precision
    rope: Rope
    qkv_bias: bool = False  # Qwen2 biases q, k and v
    out_bias: bool = False
    qk_norm_eps: float | None = None  # Qwen3's per-head q/k RMSNorm; None: none (Qwen2)
    norm_offset: float = 0.0  # Gemma3's q/k norms multiply by 1 + weight
    v_norm: bool = False  # EmbeddingGemma 2 normalises v too, without a weight
    causal: bool = True  # False: bidirectional (EmbeddingGemma)
    local_window: tuple[int, int] | None = None  # a sliding layer's keys (left, right); None: global
    scale: float | None = None  # the score scale; None: 1/√head_dim (Gemma3: query_pre_attn_scalar^-½)

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows):
        B, T, D = x_BxTxD.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_BxTxM = Linear((N + 2 * K) * H, self.precision, self.qkv_bias, name="qkv")(x_BxTxD)
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxM.reshape(B, T, N + 2 * K, H), [N, N + K], axis=2)
        if self.qk_norm_eps is not None:
            q_BxTxNxH = rms_norm(self.qk_norm_eps, jnp.float32, "q_norm", self.norm_offset)(q_BxTxNxH)
            k_BxTxKxH = rms_norm(self.qk_norm_eps, jnp.float32, "k_norm", self.norm_offset)(k_BxTxKxH)
            if self.v_norm:
                v_BxTxKxH = rms_norm(self.qk_norm_eps, jnp.float32, "v_norm", use_scale=False)(v_BxTxKxH)
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (
            t.astype(self.precision.attention) for t in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
        )
        q_BxTxNxH, k_BxTxKxH = (
            rotary(t, self.rope.theta, self.rope.style, rows.positions_BxT, self.rope.scale, self.rope.bands)
            for t in (q_BxTxNxH, k_BxTxKxH)
        )
        features = {
            "segment_ids_BxT": rows.segment_ids_BxT,
            "local_window": self.local_window,
            "causal": self.causal or None,
        }
        attn_BxTxNxH = self.attention(
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            kv_lengths_B=rows.lengths_B,
            scale=self.scale or 1.0 / math.sqrt(H),
            **{key: value for key, value in features.items() if value is not None},
        )
        return Linear(D, self.precision, self.out_bias, name="out")(attn_BxTxNxH.reshape(B, T, N * H))


# --- what a family's model is made of -------------------------------------------------------------------------


class FamilyModel(nn.Module):
    """Every family's model, seen from outside: token ids [B, T], valid lengths [B] and (packed rows) segment ids
    [B, T] → hidden states [B, T, D]. The rows of the batch are worked out here, once; a family writes only
    ``encode``, its blocks in order."""

    config: Any  # the family's Config (an EncoderConfig)
    attention: Callable[..., Any]

    @nn.compact
    def __call__(self, ids_BxT, lengths_B, segment_ids_BxT=None):
        # Embeddings, norms and the residual stream are float32 in every precision (models/precision.py).
        return self.encode(ids_BxT, rows_of(ids_BxT, lengths_B, segment_ids_BxT), jnp.float32)

    def encode(self, ids_BxT, rows: Rows, dtype) -> jax.Array:
        """Runs inside ``__call__``'s compact scope, so the blocks it builds are this module's children."""
        raise NotImplementedError(f"{type(self).__name__} defines no encode")


class PostNormLayer(nn.Module):
    """BERT's layer: attention, residual, norm; MLP, residual, norm. The post-norm families differ only in
    the options: rotary positions (RoFormer, GTE, Nomic), a GLU MLP (GTE, Nomic), no projection biases
    (Nomic), an additive attention bias passed per call (MPNet)."""

    config: EncoderConfig
    attention: Callable[..., Any]
    rope: Rope | None = None
    gated: bool = False  # GatedMlp instead of Mlp
    biases: bool = True  # on the attention projections and on a gated MLP's down projection

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows, bias: Callable | None = None):
        cfg, precision = self.config, precision_of(self.config.dtype)
        attn_BxTxD = SelfAttention(
            cfg.num_heads, self.attention, precision, use_bias=self.biases, rope=self.rope, name="attn"
        )(x_BxTxD, rows, bias)
        x_BxTxD = layer_norm(cfg.layer_norm_eps, jnp.float32, "attn_norm")(x_BxTxD + attn_BxTxD)
        mlp = (
            GatedMlp(cfg.intermediate_size, cfg.activation, precision, out_bias=self.biases, name="mlp")
            if self.gated
            else Mlp(cfg.intermediate_size, cfg.activation, precision, name="mlp")
        )
        return layer_norm(cfg.layer_norm_eps, jnp.float32, "mlp_norm")(x_BxTxD + mlp(x_BxTxD))


class PostNormEncoder(FamilyModel):
    """BERT's encoder, which RoFormer, RoBERTa, GTE and NomicBERT run too: embeddings (a position table for
    absolute positions, none for rotary ones), then ``num_layers`` PostNormLayers with this model's options."""

    gated: bool = False
    biases: bool = True

    def encode(self, ids_BxT, rows: Rows, dtype) -> jax.Array:
        cfg = self.config
        absolute = cfg.position == "absolute"
        x_BxTxD = Embeddings(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.layer_norm_eps,
            dtype,
            position_table=cfg.max_position + cfg.position_offset if absolute else 0,
            position_offset=cfg.position_offset,
            type_vocab_size=cfg.type_vocab_size,
            name="embed",
        )(ids_BxT, rows)
        rope = None if absolute else cfg.rope
        for i in range(cfg.num_layers):
            x_BxTxD = PostNormLayer(cfg, self.attention, rope, self.gated, self.biases, name=f"layer_{i}")(
                x_BxTxD, rows
            )
        return x_BxTxD
