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
from attention.native import MASKED
from attention.registry import register

# (longest sequence, query_chunk, key_chunk, heads_per_step) for options that leave them unset: the first
# row whose length covers the sequence, else the last. The fastest of `python benchmarks/chunk_sweep.py`
# (benchmarks/results/chunk_sweep.json; 2-core Xeon with AVX-512, under load 6-7 from other jobs, float32,
# 12 heads x 32): 10 ms at 512, 140 ms at 2048, 2.3 s at 8192, at 1.4% of native's memory at 8192.
# Runner-up pairs were within 10-30%, so the choice is noisy; heads_per_step 0 (one batched matmul) was
# 3.4x slower at 8192. (Its ratios to native are inflated: native measured 12.2 s at 8192 there, 6.0 s in
# the quieter attention-flash-cpu.json.)
TUNED_CHUNKS: tuple[tuple[int, int, int, int], ...] = ((512, 512, 256, 1), (2048, 512, 256, 2), (8192, 1024, 1024, 1))


class ChunkedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # Query rows and key columns per step of the online softmax; unset: tuned by length (TUNED_CHUNKS).
    # Lower them to lower peak memory.
    query_chunk: pydantic.PositiveInt | None = None
    key_chunk: pydantic.PositiveInt | None = None
    # 0: all heads in one batched matmul. A positive value runs that many heads per matmul, one group
    # after another in a loop: XLA:CPU's batched matmul is slow with many small (head_dim 32) batch
    # entries. Unset: tuned by length (TUNED_CHUNKS).
    heads_per_step: pydantic.NonNegativeInt | None = None


def pad_to_multiple(x_BxLx___, multiple: int):
    """Right-pads axis 1 to a multiple of ``multiple``; the padded positions are masked by length."""
    extra = -x_BxLx___.shape[1] % multiple
    return jnp.pad(x_BxLx___, [(0, 0), (0, extra)] + [(0, 0)] * (x_BxLx___.ndim - 2))


def chunk_sizes(options: ChunkedOptions, seq_len: int) -> tuple[int, int, int]:
    """(query_chunk, key_chunk, heads_per_step) for a sequence: the options' where set, else TUNED_CHUNKS'
    row for its length."""
    _, query_chunk, key_chunk, heads_per_step = next((row for row in TUNED_CHUNKS if seq_len <= row[0]),
                                                     TUNED_CHUNKS[-1])
    return (options.query_chunk or query_chunk, options.key_chunk or key_chunk,
            heads_per_step if options.heads_per_step is None else options.heads_per_step)


def supports(case: AttentionCase, options: ChunkedOptions) -> Support:
    # plain XLA: every platform, dtype and shape
    query_chunk, key_chunk, heads_per_step = chunk_sizes(options, case.seq_len)
    query_chunk, key_chunk = min(query_chunk, case.seq_len), min(key_chunk, case.seq_len)
    heads = f", {heads_per_step} head(s) per step" if heads_per_step else ""
    return Support(ok=True, kernel=f"xla online softmax, chunks {query_chunk}x{key_chunk}{heads}")


@register("chunked", options=ChunkedOptions, supports=supports,
          description="online-softmax attention over query and key chunks in plain JAX "
                      "(memory O(query_chunk * key_chunk) per head; any platform)")
def chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options: ChunkedOptions):
    """Online softmax in native's einsum form (attention/native.py): heads-major operands, q scaled once, the
    padding mask as an additive bias, and the division applied to the ``[.., head_dim]`` output once, after
    the last key chunk. Against the previous form (a select over the scores, per-step scaling), measured by
    hand in one process on XLA:CPU: 1.4x faster at 8192 tokens with all heads per matmul, 1.1-1.7x at 256,
    no difference beyond noise at 8192 with one head per step."""
    b, t, n, h = q_BxTxNxH.shape
    s = k_BxSxNxH.shape[1]
    query_chunk, key_chunk, heads_per_step = chunk_sizes(options, max(t, s))
    query_chunk, key_chunk, step = min(query_chunk, t), min(key_chunk, s), min(heads_per_step or n, n)
    q_BxNxTxH = pad_to_multiple(q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype), query_chunk).swapaxes(1, 2)
    k_BxNxSxH, v_BxNxSxH = (pad_to_multiple(x, key_chunk).swapaxes(1, 2) for x in (k_BxSxNxH, v_BxSxNxH))
    key_pos_S = jnp.arange(k_BxNxSxH.shape[2])
    bias_BxS = jnp.where(key_pos_S[None, :] < kv_lengths_B[:, None], 0.0, MASKED).astype(jnp.float32)

    # Head groups run one after another in a loop (not unrolled, so compilation stays short): XLA:CPU's
    # batched matmul is slow with many small (head_dim 32) batch entries.
    groups = -(-n // step)
    q_GxBxgxTxH, k_GxBxgxSxH, v_GxBxgxSxH = (
        jnp.pad(x, [(0, 0), (0, groups * step - n), (0, 0), (0, 0)]).reshape(b, groups, step, *x.shape[2:])
        .swapaxes(0, 1) for x in (q_BxNxTxH, k_BxNxSxH, v_BxNxSxH))
    if groups == 1:
        out_BxNxTxH = _online_softmax(q_GxBxgxTxH[0], k_GxBxgxSxH[0], v_GxBxgxSxH[0], bias_BxS, query_chunk, key_chunk)
    else:
        out_GxBxgxTxH = jax.lax.map(lambda qkv: _online_softmax(*qkv, bias_BxS, query_chunk, key_chunk),
                                    (q_GxBxgxTxH, k_GxBxgxSxH, v_GxBxgxSxH))
        out_BxNxTxH = out_GxBxgxTxH.swapaxes(0, 1).reshape(b, groups * step, -1, h)[:, :n]
    out_BxTxNxH = out_BxNxTxH.swapaxes(1, 2)[:, :t]
    # A row with no valid key averages every key (the bias is finite); pin it to zeros, as flash does.
    return jnp.where((kv_lengths_B > 0)[:, None, None, None], out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)


def _online_softmax(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, bias_BxS, query_chunk: int, key_chunk: int):
    """Heads-major, q already scaled, T and S multiples of their chunks; returns ``[B, N, T, H]`` in float32."""
    b, n, t, h = q_BxNxTxH.shape
    num_key_chunks = k_BxNxSxH.shape[2] // key_chunk
    k_KxBxNxKcxH, v_KxBxNxKcxH = (x.reshape(b, n, num_key_chunks, key_chunk, h).transpose(2, 0, 1, 3, 4)
                                  for x in (k_BxNxSxH, v_BxNxSxH))
    bias_KxBxKc = bias_BxS.reshape(b, num_key_chunks, key_chunk).swapaxes(0, 1)
    q_CxBxNxQxH = q_BxNxTxH.reshape(b, n, t // query_chunk, query_chunk, h).transpose(2, 0, 1, 3, 4)

    def attend_query_chunk(q_BxNxQxH):
        def absorb_key_chunk(carry, chunk):
            acc_BxNxQxH, max_BxNxQ, denom_BxNxQ = carry
            k_BxNxKcxH, v_BxNxKcxH, bias_BxKc = chunk
            logits_BxNxQxKc = jnp.einsum("bnqh,bnkh->bnqk", q_BxNxQxH, k_BxNxKcxH,
                                         preferred_element_type=jnp.float32) + bias_BxKc[:, None, None, :]
            # The bias is finite, so the running max is finite after the first chunk: no NaN guard needed.
            new_max_BxNxQ = jnp.maximum(max_BxNxQ, logits_BxNxQxKc.max(axis=-1))
            p_BxNxQxKc = jnp.exp(logits_BxNxQxKc - new_max_BxNxQ[..., None])
            rescale_BxNxQ = jnp.exp(max_BxNxQ - new_max_BxNxQ)
            denom_BxNxQ = denom_BxNxQ * rescale_BxNxQ + p_BxNxQxKc.sum(axis=-1)
            acc_BxNxQxH = acc_BxNxQxH * rescale_BxNxQ[..., None] + jnp.einsum(
                "bnqk,bnkh->bnqh", p_BxNxQxKc.astype(v_BxNxKcxH.dtype), v_BxNxKcxH, preferred_element_type=jnp.float32)
            return (acc_BxNxQxH, new_max_BxNxQ, denom_BxNxQ), None

        rows = q_BxNxQxH.shape[2]
        init = (jnp.zeros((b, n, rows, h), jnp.float32), jnp.full((b, n, rows), -jnp.inf, jnp.float32),
                jnp.zeros((b, n, rows), jnp.float32))
        chunks = (k_KxBxNxKcxH, v_KxBxNxKcxH, bias_KxBxKc)
        if num_key_chunks == 1:  # no loop: XLA fuses the one step like native's softmax
            (acc_BxNxQxH, _, denom_BxNxQ), _ = absorb_key_chunk(init, jax.tree.map(lambda x: x[0], chunks))
        else:
            (acc_BxNxQxH, _, denom_BxNxQ), _ = jax.lax.scan(absorb_key_chunk, init, chunks)
        return acc_BxNxQxH / denom_BxNxQ[..., None]  # denominator >= 1: the max's own term is exp(0)

    if q_CxBxNxQxH.shape[0] == 1:
        out_CxBxNxQxH = attend_query_chunk(q_CxBxNxQxH[0])[None]
    else:
        out_CxBxNxQxH = jax.lax.map(attend_query_chunk, q_CxBxNxQxH)
    return out_CxBxNxQxH.transpose(1, 2, 0, 3, 4).reshape(b, n, t, h)
