"""The encoder's shared surface: the config every family extends, rotary positions, pooling, and
``embed_fn``; the model itself is the config's family (models/families/), a Flax module whose attention is
whatever AttentionFn it is given.

Family modules own the projections (one fused QKV matmul); the attention function owns only the score
computation, so swapping kernels never touches a family.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from docbeam.models.families import family_of
from docbeam.models.families.blocks import rotary, segment_positions, segment_starts
from docbeam.models.families.encoder_config import ACTIVATIONS, DTYPES, EncoderConfig, gelu_erf
from docbeam.models.heads import HeadLayer, apply_layers
from docbeam.models.precision import precision_for

# Re-exported: the base config lives in models/families/encoder_config.py, the arithmetic with the blocks
# (models/families/blocks.py).
__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "Encoder",
    "EncoderConfig",
    "POOLING_MODES",
    "embed_fn",
    "gelu_erf",
    "pool",
    "pool_segments",
    "pool_spans",
    "rotary",
    "segment_ends",
    "segment_positions",
    "segment_starts",
]


def Encoder(config: EncoderConfig, attention: Callable[..., Any]) -> nn.Module:
    """The Flax module of the config's family (models/families/): token ids [B, T] and valid lengths [B] →
    hidden states [B, T, D] (float32 in every precision). With segment ids [B, T] (packed rows: 1, 2, … per
    window, 0 for padding) each window attends only to itself and counts its positions from its own start. Named
    like the module it returns: ``Encoder(config, attend).apply(...)`` / ``.init(...)``."""
    return family_of(config).Model(config, attention)


POOLING_MODES = ("mean", "cls", "lasttoken")


def pool(hidden_BxTxD: jax.Array, lengths_B: jax.Array, mode: str) -> jax.Array:
    """Window embeddings in float32: mean over the valid tokens, the first ([CLS]) token, or the last valid
    one (``lasttoken``: decoders, whose last token is the only one that has seen the whole window; rows are
    right-padded, so it sits at length - 1)."""
    hidden_BxTxD = hidden_BxTxD.astype(jnp.float32)
    if mode == "cls":
        return hidden_BxTxD[:, 0, :]
    if mode == "lasttoken":
        last_B = jnp.maximum(lengths_B, 1) - 1
        return jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None].astype(jnp.int32), axis=1)[:, 0, :]
    if mode != "mean":
        raise ValueError(f"pooling {mode!r} is not supported; use one of {', '.join(POOLING_MODES)}")
    mask_BxT = jnp.arange(hidden_BxTxD.shape[1])[None, :] < lengths_B[:, None]
    summed_BxD = jnp.einsum("btd,bt->bd", hidden_BxTxD, mask_BxT.astype(jnp.float32))
    return summed_BxD / jnp.maximum(lengths_B, 1)[:, None].astype(jnp.float32)


def segment_ends(segment_ids_BxT: jax.Array) -> jax.Array:
    """True at each packed window's last token: where the next token's segment id differs, or the row ends."""
    return jnp.concatenate(
        [segment_ids_BxT[:, :-1] != segment_ids_BxT[:, 1:], jnp.ones_like(segment_ids_BxT[:, :1], bool)], axis=1
    )


def pool_segments(
    hidden_BxTxD: jax.Array, segment_ids_BxT: jax.Array, slot_lengths_BxK: jax.Array, mode: str
) -> jax.Array:
    """Packed rows: one float32 embedding per window slot [B, K, D]; slot k is segment k + 1. Mean over
    the slot's tokens, its first token for ``cls``, its last for ``lasttoken``; empty slots are zero."""
    K = slot_lengths_BxK.shape[1]
    in_slot_BxTxK = segment_ids_BxT[:, :, None] == jnp.arange(1, K + 1, dtype=segment_ids_BxT.dtype)
    if mode == "cls":
        in_slot_BxTxK = in_slot_BxTxK & segment_starts(segment_ids_BxT)[:, :, None]
    elif mode == "lasttoken":
        in_slot_BxTxK = in_slot_BxTxK & segment_ends(segment_ids_BxT)[:, :, None]
    elif mode != "mean":
        raise ValueError(f"pooling {mode!r} is not supported; use one of {', '.join(POOLING_MODES)}")
    summed_BxKxD = jnp.einsum("btd,btk->bkd", hidden_BxTxD.astype(jnp.float32), in_slot_BxTxK.astype(jnp.float32))
    if mode != "mean":
        return summed_BxKxD
    return summed_BxKxD / jnp.maximum(slot_lengths_BxK, 1)[..., None].astype(jnp.float32)


def pool_spans(hidden_BxTxD: jax.Array, spans_BxKx2: jax.Array) -> jax.Array:
    """Late chunking: the mean of each span's token states [B, K, D], span k of row b being tokens
    [spans[b, k, 0], spans[b, k, 1]) of a row whose tokens all attended to each other. A mask, not segment ids:
    chunks that share ``tokenize.stride`` tokens overlap. An empty span (start == end: a padding slot) is zero."""
    t_T = jnp.arange(hidden_BxTxD.shape[1])
    in_span_BxTxK = (
        (t_T[None, :, None] >= spans_BxKx2[:, None, :, 0]) & (t_T[None, :, None] < spans_BxKx2[:, None, :, 1])
    ).astype(jnp.float32)
    summed_BxKxD = jnp.einsum("btd,btk->bkd", hidden_BxTxD.astype(jnp.float32), in_span_BxTxK)
    counts_BxK = jnp.maximum(spans_BxKx2[..., 1] - spans_BxKx2[..., 0], 1).astype(jnp.float32)
    return summed_BxKxD / counts_BxK[..., None]


def embed_fn(
    config: EncoderConfig,
    attention: Callable[..., Any],
    pooling: str,
    layers: tuple[HeadLayer, ...] = (),
    reduce: Callable[..., Any] | None = None,
):
    """``(params, ids_BxT, lengths_B) -> pooled_BxD``, or with packed rows
    ``(params, ids_BxT, lengths_B, segment_ids_BxT, slot_lengths_BxK) -> pooled_BxKxD``; ready for jax.jit
    (one compile per shape). With a head's ``layers`` (models/heads/: sentence-transformers' Dense modules, a
    classifier) run on each pooled window, ``params`` is ``{"encoder": <the family's params>, "head": (<the
    head's load_params>)}`` and D is the last layer's width. Per window, before windows are combined: a layer's
    activation is not linear, so on a long document this is each window's output as the model gives it. Pooling
    ``tokens`` pools nothing: the layers run on every token and the output is [B, T, D] (packed rows too). A head's
    ``reduce`` (models/heads/sparse.py) replaces pooling and layers: it is handed every token state. With
    ``spans_BxKx2`` (late chunking, unpacked rows) each span's tokens are mean-pooled whatever ``pooling`` says
    (Jina's late chunking: a chunk has no [CLS] or last token of its own), then the layers: [B, K, D]."""
    module = Encoder(config, attention)

    def embed(params, ids_BxT, lengths_B, segment_ids_BxT=None, slot_lengths_BxK=None, spans_BxKx2=None):
        encoder_params, head = (params["encoder"], params["head"]) if layers or reduce else (params, ())
        hidden_BxTxD = module.apply({"params": encoder_params}, ids_BxT, lengths_B, segment_ids_BxT)
        if spans_BxKx2 is not None:
            if reduce is not None or pooling == "tokens":
                raise ValueError("late chunking pools spans into one vector each; this head pools no vectors")
            return apply_layers(pool_spans(hidden_BxTxD, spans_BxKx2), head, layers)
        if reduce is not None:
            return reduce(hidden_BxTxD, lengths_B, segment_ids_BxT, slot_lengths_BxK, head)
        if pooling == "tokens":  # a multi-vector head: every token's vector [B, T, D'] (the host cuts windows)
            pooled = hidden_BxTxD.astype(jnp.float32)
        elif segment_ids_BxT is None:
            pooled = pool(hidden_BxTxD, lengths_B, pooling)
        else:
            pooled = pool_segments(hidden_BxTxD, segment_ids_BxT, slot_lengths_BxK, pooling)
        return apply_layers(pooled, head, layers)

    return embed


def attention_cases(config: EncoderConfig, buckets, platform: str, packed: bool = False) -> list:
    """One case per bucket and per kind of layer the model has (``config.attention_features``: ModernBERT's
    global and local layers are two), bucket by bucket; ``choose_backends`` picks one backend per bucket that
    takes every kind."""
    from docbeam.attention import AttentionCase

    # Where every precision is first met with the platform it will run on: the plan and `validate` ask here.
    precision = precision_for(config.dtype, platform)
    dtype = jnp.dtype(precision.attention).name  # what q, k and v reach the backend in
    return [
        AttentionCase(
            platform=platform,
            dtype=dtype,
            seq_len=b,
            num_heads=config.num_heads,
            head_dim=head_dim,
            segments=packed,
            num_kv_heads=kv_heads,
        ).with_features(features)
        for b in buckets
        for features in config.attention_features
        for head_dim, kv_heads in [config.attention_shape(features)]
    ]
