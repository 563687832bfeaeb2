"""``native``: attention in plain XLA ops, no custom kernel. The default, and the reference every other
backend is checked against.

Two formulations of the same softmax(q·kᵀ·scale + mask)·v, both plain XLA:
- ``einsum`` (CPU's default): heads-major einsums, the padding mask as an additive bias on the scores, and
  the softmax's division applied to the ``[.., head_dim]`` output instead of the ``[.., keys]`` weights. On
  XLA:CPU it is several times faster than ``jax_nn`` (benchmarks/results/attention-native.json at 64 and 256
  tokens, attention-flash-cpu.json at 8,192): ``jax_nn`` masks with a select over the whole score tensor and
  normalises it before the second matmul.
- ``jax_nn``: ``jax.nn.dot_product_attention(implementation="xla")``, JAX's maintained reference; the default
  off CPU, where the einsum form has not been measured.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import pydantic

from docbeam.attention.interface import AttentionCase, Support, current_platform
from docbeam.attention.registry import register
from docbeam.attention.relative import dense_scores

KERNELS = {"einsum": "xla einsum softmax (mask as bias)", "jax_nn": "jax.nn.dot_product_attention (xla)"}
# Added to the scores of padded keys: finite, so a row with no valid key averages all keys instead of
# producing NaN, and far below any real score (scores are float32).
MASKED = -1e30


class NativeOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # auto: einsum on CPU (measured faster), jax_nn elsewhere.
    implementation: Literal["auto", "einsum", "jax_nn"] = "auto"


def formulation(options: NativeOptions, platform: str) -> str:
    if options.implementation != "auto":
        return options.implementation
    return "einsum" if platform == "cpu" else "jax_nn"


def supports(case: AttentionCase, options: NativeOptions) -> Support:
    if case.relative_positions and case.kv_heads != case.num_heads:
        return Support(ok=False, reason=GROUPED_RELATIVE)
    return Support(ok=True, kernel=KERNELS[formulation(options, case.platform)])


# Relative positions are projected per query head; no model has them with grouped k/v, so none is run.
GROUPED_RELATIVE = (
    "relative positions (relative_positions) with grouped-query k/v: no model has both, and the "
    "position→content term would need the tables per k/v head"
)


@register(
    "native",
    options=NativeOptions,
    supports=supports,
    segments=True,
    local_window=True,
    bias=True,
    causal=True,
    grouped=True,
    relative_positions=True,
    description="attention in plain XLA ops (einsum with a mask bias on CPU; jax.nn.dot_product_attention elsewhere)",
)
def native(
    q_BxTxNxH,
    k_BxSxKxH,
    v_BxSxKxH,
    *,
    kv_lengths_B,
    scale,
    options: NativeOptions,
    segment_ids_BxT=None,
    local_window=None,
    bias=None,
    causal=False,
    relative_positions=None,
):
    if formulation(options, current_platform()) == "jax_nn":
        t, s = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
        same_BxNxTxS = None
        if segment_ids_BxT is not None:
            same_BxNxTxS = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
        bias_1xNxTxS = None if bias is None else bias(jnp.arange(t), jnp.arange(s))[None]
        if relative_positions is not None:  # jax.nn adds the bias to the scaled scores
            relative_BxNxTxS = dense_scores(relative_positions, q_BxTxNxH, k_BxSxKxH, scale)
            bias_1xNxTxS = relative_BxNxTxS if bias_1xNxTxS is None else bias_1xNxTxS + relative_BxNxTxS
        bias_1xNxTxS = None if bias_1xNxTxS is None else bias_1xNxTxS.astype(q_BxTxNxH.dtype)
        # Grouped k/v heads (fewer than q's) are jax.nn's own case: it groups q heads over them.
        return jax.nn.dot_product_attention(
            q_BxTxNxH,
            k_BxSxKxH,
            v_BxSxKxH,
            bias=bias_1xNxTxS,
            scale=scale,
            mask=same_BxNxTxS,
            is_causal=causal,
            key_value_seq_lengths=kv_lengths_B,
            local_window_size=local_window,
            implementation="xla",
        )
    return einsum_attention(
        q_BxTxNxH,
        k_BxSxKxH,
        v_BxSxKxH,
        kv_lengths_B,
        scale,
        segment_ids_BxT,
        local_window,
        bias,
        causal,
        relative_positions,
    )


def in_window(q_index_T, k_index_S, local_window):
    """[T, S]: whether key j lies within (left, right) of query i."""
    left, right = local_window
    offset_TxS = k_index_S[None, :] - q_index_T[:, None]
    return (offset_TxS >= -left) & (offset_TxS <= right)


def einsum_attention(
    q_BxTxNxH,
    k_BxSxKxH,
    v_BxSxKxH,
    kv_lengths_B,
    scale,
    segment_ids_BxT=None,
    local_window=None,
    bias=None,
    causal=False,
    relative_positions=None,
):
    """With grouped-query k/v (K heads under N query heads), query heads are grouped [K, G] over them: k and v
    are used as they are, never repeated per query head. Without, the plain heads-major form: XLA:CPU runs a
    unit group axis several times slower at encoder shapes (CHANGELOG.md)."""
    b, t, n, h = q_BxTxNxH.shape
    s, kv_heads = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
    if segment_ids_BxT is None:  # one mask row for every query: T is 1
        valid_BxTxS = (jnp.arange(s)[None, :] < kv_lengths_B[:, None])[:, None, :]
    else:  # padding (segment 0) attends to padding: finite, and ignored downstream
        valid_BxTxS = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    if local_window is not None or causal:
        left, right = local_window or (s, s)
        valid_BxTxS = valid_BxTxS & in_window(jnp.arange(t), jnp.arange(s), (left, 0 if causal else right))[None]
    mask_bias = jnp.where(valid_BxTxS, 0.0, MASKED).astype(jnp.float32)[:, None]  # [B, 1, T or 1, S]
    if bias is not None:
        mask_bias = mask_bias + bias(jnp.arange(t), jnp.arange(s)).astype(jnp.float32)[None]  # [B, N, T, S]
    if relative_positions is not None:  # [B, N, T, S], scaled like q·k (from q before its scaling below)
        mask_bias = mask_bias + dense_scores(relative_positions, q_BxTxNxH, k_BxSxKxH, scale)
    q_BxTxNxH = q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype)
    if kv_heads == n:
        logits_BxNxTxS = (
            jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k_BxSxKxH, preferred_element_type=jnp.float32) + mask_bias
        )
        out_BxNxTxH = _softmax_times_v(logits_BxNxTxS, v_BxSxKxH, "bnts,bsnh->bnth")
        return out_BxNxTxH.transpose(0, 2, 1, 3).astype(q_BxTxNxH.dtype)
    groups = n // kv_heads
    mask_bias = mask_bias.reshape(b, -1, groups if mask_bias.shape[1] == n else 1, *mask_bias.shape[2:])
    logits_BxKxGxTxS = (
        jnp.einsum(
            "btkgh,bskh->bkgts",
            q_BxTxNxH.reshape(b, t, kv_heads, groups, h),
            k_BxSxKxH,
            preferred_element_type=jnp.float32,
        )
        + mask_bias
    )
    out_BxKxGxTxH = _softmax_times_v(logits_BxKxGxTxS, v_BxSxKxH, "bkgts,bskh->bkgth")
    return out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def _softmax_times_v(logits, v, spec: str):
    """softmax(logits) @ v with the division applied to the ``[.., head_dim]`` output, not the weights."""
    weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    out = jnp.einsum(spec, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / weights.sum(axis=-1)[..., None]
