"""``chunked``: memory-efficient attention in plain JAX, so it runs wherever XLA does.

Online softmax (Rabe & Staats, https://arxiv.org/abs/2112.05682; the FlashAttention recurrence) over key
chunks, one query chunk at a time: the largest temporary is ``[B, N, query_chunk, key_chunk]`` instead of
``[B, N, T, S]``. Scores and sums are kept in float32 whatever the input dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pydantic

from attention.interface import AttentionCase, Support
from attention.registry import register


class ChunkedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    query_chunk: pydantic.PositiveInt = 512  # query rows per step; lower it to lower peak memory
    key_chunk: pydantic.PositiveInt = 512  # key columns per step of the online softmax
    # 0: all heads in one batched matmul. A positive value runs that many heads per matmul, one group
    # after another: XLA:CPU's batched matmul is slow with many small (head_dim 32) batch entries, and
    # one head at a time made MiniLM's 256-token forward ~19% faster on a 2-core AVX2 machine.
    heads_per_step: pydantic.NonNegativeInt = 0


def pad_to_multiple(x_BxLx___, multiple: int):
    """Right-pads axis 1 to a multiple of ``multiple``; the padded positions are masked by length."""
    extra = -x_BxLx___.shape[1] % multiple
    return jnp.pad(x_BxLx___, [(0, 0), (0, extra)] + [(0, 0)] * (x_BxLx___.ndim - 2))


def split_chunks(x_BxLxNxH, chunk: int):
    """``[B, L, N, H]`` (L a multiple of chunk) → ``[L/chunk, B, chunk, N, H]``, the axis scan walks."""
    b, length, n, h = x_BxLxNxH.shape
    return x_BxLxNxH.reshape(b, length // chunk, chunk, n, h).swapaxes(0, 1)


def supports(case: AttentionCase, options: ChunkedOptions) -> Support:
    del case  # plain XLA: every platform, dtype and shape
    heads = f", {options.heads_per_step} head(s) per step" if options.heads_per_step else ""
    return Support(ok=True, kernel=f"xla online softmax, chunks {options.query_chunk}x{options.key_chunk}{heads}")


@register("chunked", options=ChunkedOptions, supports=supports,
          description="online-softmax attention over query and key chunks in plain JAX "
                      "(memory O(query_chunk * key_chunk) per head; any platform)")
def chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options: ChunkedOptions):
    n = q_BxTxNxH.shape[2]
    step = options.heads_per_step
    if not step or step >= n:
        return _chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options)
    groups = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    return jnp.concatenate([_chunked(q_BxTxNxH[:, :, g], k_BxSxNxH[:, :, g], v_BxSxNxH[:, :, g], kv_lengths_B, scale,
                                     options) for g in groups], axis=2)


def _chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options: ChunkedOptions):
    b, t, n, h = q_BxTxNxH.shape
    s = k_BxSxNxH.shape[1]
    query_chunk, key_chunk = min(options.query_chunk, t), min(options.key_chunk, s)
    q_CxBxQxNxH = split_chunks(pad_to_multiple(q_BxTxNxH, query_chunk), query_chunk)
    k_KxBxKcxNxH = split_chunks(pad_to_multiple(k_BxSxNxH, key_chunk), key_chunk)
    v_KxBxKcxNxH = split_chunks(pad_to_multiple(v_BxSxNxH, key_chunk), key_chunk)
    key_pos_KxKc = jnp.arange(k_KxBxKcxNxH.shape[0] * key_chunk).reshape(-1, key_chunk)

    def attend_query_chunk(q_BxQxNxH):
        def absorb_key_chunk(carry, chunk):
            acc_BxNxQxH, max_BxNxQ, denom_BxNxQ = carry
            k_BxKcxNxH, v_BxKcxNxH, key_pos_Kc = chunk
            logits_BxNxQxKc = jnp.einsum("bqnh,bknh->bnqk", q_BxQxNxH, k_BxKcxNxH,
                                         preferred_element_type=jnp.float32) * scale
            valid_Bx1x1xKc = (key_pos_Kc[None, :] < kv_lengths_B[:, None])[:, None, None, :]
            logits_BxNxQxKc = jnp.where(valid_Bx1x1xKc, logits_BxNxQxKc, -jnp.inf)
            new_max_BxNxQ = jnp.maximum(max_BxNxQ, logits_BxNxQxKc.max(axis=-1))
            # A row that has seen no valid key yet has max -inf; shifting by 0 instead keeps exp() at 0, not NaN.
            shift_BxNxQ = jnp.where(jnp.isfinite(new_max_BxNxQ), new_max_BxNxQ, 0.0)
            p_BxNxQxKc = jnp.exp(logits_BxNxQxKc - shift_BxNxQ[..., None])
            rescale_BxNxQ = jnp.exp(max_BxNxQ - shift_BxNxQ)
            denom_BxNxQ = denom_BxNxQ * rescale_BxNxQ + p_BxNxQxKc.sum(axis=-1)
            acc_BxNxQxH = acc_BxNxQxH * rescale_BxNxQ[..., None] + jnp.einsum(
                "bnqk,bknh->bnqh", p_BxNxQxKc.astype(v_BxKcxNxH.dtype), v_BxKcxNxH,
                preferred_element_type=jnp.float32)
            return (acc_BxNxQxH, new_max_BxNxQ, denom_BxNxQ), None

        rows = q_BxQxNxH.shape[1]
        init = (jnp.zeros((b, n, rows, h), jnp.float32), jnp.full((b, n, rows), -jnp.inf, jnp.float32),
                jnp.zeros((b, n, rows), jnp.float32))
        (acc_BxNxQxH, _, denom_BxNxQ), _ = jax.lax.scan(
            absorb_key_chunk, init, (k_KxBxKcxNxH, v_KxBxKcxNxH, key_pos_KxKc))
        # Rows with no valid key (length 0) have denominator 0: they come out as zeros.
        out_BxNxQxH = acc_BxNxQxH / jnp.where(denom_BxNxQ > 0, denom_BxNxQ, 1.0)[..., None]
        return out_BxNxQxH.swapaxes(1, 2).astype(q_BxTxNxH.dtype)

    out_CxBxQxNxH = jax.lax.map(attend_query_chunk, q_CxBxQxNxH)
    return out_CxBxQxNxH.swapaxes(0, 1).reshape(b, -1, n, h)[:, :t]
