"""What model families share: the config they all extend (EncoderConfig, BERT's fields), the Flax blocks they
are built from (embeddings, self-attention around whatever AttentionFn the model is handed, plain and gated
MLPs, norms, rotary positions), reading a Hub ``config.json`` in either of its forms, and mapping safetensors
tensors onto those blocks' parameters. models/encoder.py re-exports the config and the arithmetic.

A family file states only how it differs: which blocks, in which order, with which options, read from which
config keys and tensor names. No block knows a kernel, and none knows a family.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.errors import Refused


class CheckpointError(Refused, ValueError):
    """A checkpoint docbeam cannot run as its authors meant: refused at start (exit 2), naming the file and key."""


# --- the config every family extends, and the arithmetic they share -------------------------------------------

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


# --- the rows of a batch, as every layer sees them ------------------------------------------------------------

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


# --- blocks ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary positions: frequency ``scale · theta^(-2i/H)`` for pair i. ``scale`` is 1 unless the checkpoint
    stretches its context: 1/factor for linear scaling, factor^(-2/H) (with theta·factor) for fixed NTK."""

    theta: float
    style: str = "half"  # "half" (Llama, ModernBERT, GTE, Nomic) or "interleaved" (RoFormer)
    scale: float = 1.0


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
                rows.positions_BxT + self.position_offset)
        if self.type_vocab_size:  # one segment per window: token type 0 everywhere
            x_BxTxD = x_BxTxD + nn.Embed(self.type_vocab_size, self.hidden_size, dtype=self.dtype,
                                         name="token_type")(jnp.zeros((1,), jnp.int32))[0]
        return layer_norm(self.eps, self.dtype, "norm", self.norm_bias)(x_BxTxD)


class SelfAttention(nn.Module):
    """One fused QKV projection, rotary positions if any, the AttentionFn, the output projection. A local
    window and an additive bias are passed to attention only when the layer has them."""

    num_heads: int
    attention: Callable[..., Any]
    dtype: Any
    use_bias: bool = True
    rope: Rope | None = None
    local_window: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows, bias: Callable | None = None):
        B, T, D = x_BxTxD.shape
        N, H = self.num_heads, D // self.num_heads
        qkv_BxTx3D = nn.Dense(3 * D, use_bias=self.use_bias, dtype=self.dtype, name="qkv")(x_BxTxD)
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = jnp.split(qkv_BxTx3D.reshape(B, T, 3 * N, H), 3, axis=2)
        if self.rope is not None:
            q_BxTxNxH, k_BxTxNxH = (rotary(t, self.rope.theta, self.rope.style, rows.positions_BxT, self.rope.scale)
                                    for t in (q_BxTxNxH, k_BxTxNxH))
        features = {"segment_ids_BxT": rows.segment_ids_BxT, "local_window": self.local_window, "bias": bias}
        attn_BxTxNxH = self.attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, kv_lengths_B=rows.lengths_B,
                                      scale=1.0 / math.sqrt(H),
                                      **{key: value for key, value in features.items() if value is not None})
        return nn.Dense(D, use_bias=self.use_bias, dtype=self.dtype, name="out")(attn_BxTxNxH.reshape(B, T, D))


class Mlp(nn.Module):
    """BERT's feed-forward: dense, activation, dense."""

    intermediate_size: int
    activation: str
    dtype: Any

    @nn.compact
    def __call__(self, x_BxTxD):
        h_BxTxF = ACTIVATIONS[self.activation](nn.Dense(self.intermediate_size, dtype=self.dtype, name="wi")(x_BxTxD))
        return nn.Dense(x_BxTxD.shape[-1], dtype=self.dtype, name="wo")(h_BxTxF)


class GatedMlp(nn.Module):
    """GLU feed-forward: ``wo(act(a) · b)`` where ``wi`` projects to [a | b] in one matmul. GeGLU with gelu
    (ModernBERT, GTE), SwiGLU with silu (Nomic); families differ only in which half their checkpoint
    activates, which the weight mapping puts first."""

    intermediate_size: int
    activation: str
    dtype: Any
    out_bias: bool = False  # GTE's down projection has one

    @nn.compact
    def __call__(self, x_BxTxD):
        h_BxTx2F = nn.Dense(2 * self.intermediate_size, use_bias=False, dtype=self.dtype, name="wi")(x_BxTxD)
        activated_BxTxF, linear_BxTxF = jnp.split(h_BxTx2F, 2, axis=-1)
        h_BxTxF = ACTIVATIONS[self.activation](activated_BxTxF) * linear_BxTxF
        return nn.Dense(x_BxTxD.shape[-1], use_bias=self.out_bias, dtype=self.dtype, name="wo")(h_BxTxF)


# --- config.json in both forms --------------------------------------------------------------------------------

_MISSING = object()


class HubConfig:
    """A checkpoint's config.json, read by families that accept both the keys files on the Hub carry and
    those transformers 5 writes: ``get`` takes the alternatives, and every refusal names file, key and value."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        if default is _MISSING:
            raise self.error(f"has none of {', '.join(keys)}, which this family needs")
        return default

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"model.path: {self.where} {message}")

    def refuse_unless(self, key: str, allowed: tuple, why: str) -> None:
        """A key whose other values change the model in a way this family does not reproduce."""
        value = self.raw.get(key, allowed[0])
        if value not in allowed:
            raise self.error(f"sets {key}: {value!r}, which docbeam does not run ({why}); supported: "
                             f"{', '.join(repr(a) for a in allowed)}")

    def activation(self, *keys: str, default: str) -> str:
        value = self.get(*keys, default=default)
        if value not in ACTIVATIONS:
            raise self.error(f"sets {keys[0]}: {value!r}; supported: {sorted(ACTIVATIONS)}")
        return value

    def rope(self, head_dim: int, default_theta: float, layer_type: str | None = None,
             legacy_theta: tuple[str, ...] = ("rope_theta",)) -> Rope:
        """Half-style rotary positions from transformers 5's ``rope_parameters`` (flat, or nested per layer
        type) or the Hub's ``rope_theta`` / ``rope_scaling``: default, linear, or fixed NTK (GTE's ``ntk``)."""
        params = self.raw.get("rope_parameters") or {}
        if layer_type is not None:
            params = params.get(layer_type) or {}
        scaling = dict(self.raw.get("rope_scaling") or {}) if not params else {}
        theta = float(params.get("rope_theta") or self.get(*legacy_theta, default=default_theta))
        kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") \
            or "default"
        factor = float(params.get("factor") or scaling.get("factor") or 1.0)
        key = "rope_parameters" if params else "rope_scaling"
        if kind == "default":
            return Rope(theta)
        if kind == "linear":
            return Rope(theta, scale=1.0 / factor)
        if kind == "ntk" and scaling.get("mixed_b") is None:
            # The Hub's NTKScalingRotaryEmbedding (GTE): base·factor, every frequency divided by factor^(2/H).
            return Rope(theta * factor, scale=factor ** (-2.0 / head_dim))
        raise self.error(f"sets {key} {params or scaling}, a RoPE scaling docbeam does not reproduce; supported: "
                         "none, linear, ntk (fixed, without mixed_b)")


# --- safetensors → Flax parameters ----------------------------------------------------------------------------

class Tensors:
    """A checkpoint's tensors by Hugging Face name (torch [out, in] layout), with the model prefix a task head
    adds (``roberta.``, ``model.``, …) stripped, and helpers that shape them for the blocks above."""

    def __init__(self, raw: dict[str, np.ndarray], prefixes: tuple[str, ...], where: str):
        self.where = where
        self.tensors = {}
        for name, value in raw.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            self.tensors[name] = value

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> np.ndarray:
        """Old checkpoints name LayerNorm parameters gamma/beta."""
        for candidate in (name, name.replace(".weight", ".gamma"), name.replace(".bias", ".beta")):
            if candidate in self.tensors:
                return np.asarray(self.tensors[candidate], np.float32)
        raise CheckpointError(f"model.path: {self.where} has no tensor {name!r}, which this model type needs "
                              f"(first names: {sorted(self.tensors)[:5]})")

    def dense(self, *prefixes: str, bias: bool = True) -> dict:
        """One Flax Dense from one or more torch Linears side by side (fused projections)."""
        out = {"kernel": np.concatenate([self(f"{p}.weight").T for p in prefixes], axis=1)}
        if bias:
            out["bias"] = np.concatenate([self(f"{p}.bias") for p in prefixes])
        return out

    def swapped_halves(self, prefix: str) -> dict:
        """A fused, unbiased torch Linear whose output halves are [linear | activated]: GatedMlp's order is
        the other way round."""
        return {"kernel": np.concatenate(np.split(self(f"{prefix}.weight").T, 2, axis=-1)[::-1], axis=-1)}

    def norm(self, prefix: str, bias: bool = True) -> dict:
        out = {"scale": self(f"{prefix}.weight")}
        if bias:
            out["bias"] = self(f"{prefix}.bias")
        return out

    def embedding(self, name: str) -> dict:
        return {"embedding": self(name)}


# --- decoder blocks: RMSNorm, grouped-query causal self-attention ---------------------------------------------

def rms_norm(eps: float, dtype, name: str) -> nn.RMSNorm:
    """Llama-style RMSNorm (Qwen2/3): x / sqrt(mean(x²) + eps) · scale, no centring, no bias; the statistics
    in float32 as transformers computes them."""
    return nn.RMSNorm(eps, dtype=dtype, name=name)


class GroupedSelfAttention(nn.Module):
    """A decoder's self-attention: one fused projection to N query heads and K ≤ N key/value heads of
    ``head_dim`` (which need not be hidden/N: Qwen3-0.6B has 16 heads of 128 over a 1024 hidden size),
    optional per-head RMSNorm on q and k before rotary positions (Qwen3), and the AttentionFn called with
    ``causal=True`` and the K heads as they are: grouping q heads over them is the backend's job."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: Callable[..., Any]
    dtype: Any
    rope: Rope
    qkv_bias: bool = False  # Qwen2 biases q, k and v
    out_bias: bool = False
    qk_norm_eps: float | None = None  # Qwen3's per-head q/k RMSNorm; None: none (Qwen2)

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows):
        B, T, D = x_BxTxD.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_BxTxM = nn.Dense((N + 2 * K) * H, use_bias=self.qkv_bias, dtype=self.dtype, name="qkv")(x_BxTxD)
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxM.reshape(B, T, N + 2 * K, H), [N, N + K], axis=2)
        if self.qk_norm_eps is not None:
            q_BxTxNxH = rms_norm(self.qk_norm_eps, self.dtype, "q_norm")(q_BxTxNxH)
            k_BxTxKxH = rms_norm(self.qk_norm_eps, self.dtype, "k_norm")(k_BxTxKxH)
        q_BxTxNxH, k_BxTxKxH = (rotary(t, self.rope.theta, self.rope.style, rows.positions_BxT, self.rope.scale)
                                for t in (q_BxTxNxH, k_BxTxKxH))
        features = {} if rows.segment_ids_BxT is None else {"segment_ids_BxT": rows.segment_ids_BxT}
        attn_BxTxNxH = self.attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, kv_lengths_B=rows.lengths_B,
                                      scale=1.0 / math.sqrt(H), causal=True, **features)
        return nn.Dense(D, use_bias=self.out_bias, dtype=self.dtype, name="out")(attn_BxTxNxH.reshape(B, T, N * H))
