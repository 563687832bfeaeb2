"""``chunked``: memory-efficient attention in plain JAX, so it runs wherever XLA does.

Online softmax (Rabe & Staats, https://arxiv.org/abs/2112.05682; the FlashAttention recurrence) over key
chunks, one query chunk at a time: the largest temporary is ``[B, N, query_chunk, key_chunk]`` instead of
``[B, N, T, S]``. Scores and sums are kept in float32 whatever the input dtype. The chunk sizes, and where
each platform's come from, are attention/chunk_sizes.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from docbeam.attention.chunk_sizes import ChunkedOptions, layer_chunk_sizes
from docbeam.attention.interface import AttentionCase, Support, current_platform
from docbeam.attention.native import GROUPED_RELATIVE, MASKED, in_window
from docbeam.attention.registry import register
from docbeam.attention.relative import RelativePositions, block_scores


def pad_to_multiple(x_BxLx___, multiple: int):
    """Right-pads axis 1 to a multiple of ``multiple``; the padded positions are masked by length."""
    extra = -x_BxLx___.shape[1] % multiple
    return jnp.pad(x_BxLx___, [(0, 0), (0, extra)] + [(0, 0)] * (x_BxLx___.ndim - 2))


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """Which keys each query chunk scans: ``steps`` key chunks of ``key_chunk`` from a start that depends on the
    chunk (all keys from 0 for a global layer); keys are padded to ``padded_len``."""

    key_chunk: int
    steps: int
    padded_len: int
    local_window: tuple[int, int] | None
    causal: bool = False  # a causal global layer: a query chunk stops after the key chunk holding its last row

    def steps_for(self, query_start, query_chunk: int):
        """How many key chunks a query chunk scans (traced): all ``steps``, but for a causal global layer only
        those up to its last row, so the blocks past the diagonal (about half) are never computed."""
        if not self.causal:
            return self.steps
        return jnp.minimum(self.steps, (query_start + query_chunk + self.key_chunk - 1) // self.key_chunk)

    def start(self, query_start):
        """First key a query chunk starting at ``query_start`` (traced) scans; its rows see keys from
        query_start - left to query_start + query_chunk - 1 + right, and ``steps * key_chunk`` covers that."""
        if self.local_window is None:
            return 0
        return jnp.clip(query_start - self.local_window[0], 0, self.padded_len - self.steps * self.key_chunk)


def key_plan(
    seq_len: int, query_chunk: int, key_chunk: int, local_window: tuple[int, int] | None, causal: bool = False
) -> KeyPlan:
    """A global layer scans every key (a causal one up to each chunk's diagonal); a local one the
    ``query_chunk + left + right`` keys a chunk's rows reach, so its cost grows with T * window instead of T²."""
    reach = seq_len if local_window is None else min(seq_len, query_chunk + sum(local_window))
    key_chunk = min(key_chunk, reach)
    steps = -(-reach // key_chunk)
    return KeyPlan(key_chunk, steps, max(seq_len, steps * key_chunk), local_window, causal and local_window is None)


def causal_window(local_window: tuple[int, int] | None, causal: bool, seq_len: int) -> tuple[int, int] | None:
    """The mask a causal layer adds: no key to the right (a local causal layer is a left-only window)."""
    if not causal:
        return local_window
    return (local_window[0] if local_window else seq_len, 0)


def supports(case: AttentionCase, options: ChunkedOptions) -> Support:
    # plain XLA: every platform, dtype and shape, with windows, bias, segment ids, causal and grouped k/v
    if case.relative_positions and case.kv_heads != case.num_heads:
        return Support(ok=False, reason=GROUPED_RELATIVE)
    window = case.local_window and causal_window(case.local_window, case.causal, case.seq_len)
    query_chunk, key_chunk, heads_per_step = layer_chunk_sizes(
        options, case.seq_len, window, case.platform, case.causal, case.dtype
    )
    query_chunk = min(query_chunk, case.seq_len)
    keys = key_plan(case.seq_len, query_chunk, key_chunk, window, case.causal and options.skip_causal_blocks)
    heads = f", {group_step(heads_per_step, case.num_heads, case.kv_heads)} head(s) per step" if heads_per_step else ""
    scanned = (
        f", {keys.steps * keys.key_chunk} keys per query chunk (local window {window})"
        if window
        else ", key blocks past the diagonal skipped"
        if keys.causal
        else ""
    )
    grouped = (
        f", {case.num_heads} query heads over {case.kv_heads} k/v heads" if case.kv_heads != case.num_heads else ""
    )
    return Support(
        ok=True, kernel=f"xla online softmax, chunks {query_chunk}x{keys.key_chunk}{heads}{scanned}{grouped}"
    )


def group_step(heads_per_step: int, num_heads: int, kv_heads: int) -> int:
    """Query heads per step: a multiple of the query heads sharing one k/v head, so a step's k/v heads are whole."""
    per_kv = num_heads // kv_heads
    return min(num_heads, -(-(heads_per_step or num_heads) // per_kv) * per_kv)


@register(
    "chunked",
    options=ChunkedOptions,
    supports=supports,
    segments=True,
    local_window=True,
    bias=True,
    causal=True,
    grouped=True,
    relative_positions=True,
    description="online-softmax attention over query and key chunks in plain JAX "
    "(memory O(query_chunk * key_chunk) per head; local windows scan only the keys they reach; "
    "any platform)",
)
def chunked(
    q_BxTxNxH,
    k_BxSxKxH,
    v_BxSxKxH,
    *,
    kv_lengths_B,
    scale,
    options: ChunkedOptions,
    segment_ids_BxT=None,
    local_window=None,
    bias=None,
    causal=False,
    relative_positions=None,
):
    """Online softmax in native's einsum form (attention/native.py): heads-major operands, q scaled once, the
    mask as an additive bias, and the division applied to the ``[.., head_dim]`` output once, after the last
    key chunk: the form XLA:CPU runs fastest (the comparison with a select over the scores: CHANGELOG.md).

    Masks (padding or segment ids, the window, causality) and ``bias`` are computed per (query chunk, key
    chunk) block from positions, so nothing ``[T, S]``-sized exists; relative positions' terms too, from the
    table rows each block reaches (attention/relative.py). A causal global layer stops each query chunk at its
    diagonal; grouped-query k/v (K heads under N) are read as they are, never repeated."""
    b, t, n, h = q_BxTxNxH.shape
    s, kv_heads = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
    window = local_window and causal_window(local_window, causal, s)
    query_chunk, key_chunk, heads_per_step = layer_chunk_sizes(
        options, max(t, s), window, current_platform(), causal, jnp.dtype(q_BxTxNxH.dtype).name
    )
    query_chunk, step = min(query_chunk, t), group_step(heads_per_step, n, kv_heads)
    per_kv = n // kv_heads
    keys = key_plan(s, query_chunk, key_chunk, window, causal and options.skip_causal_blocks)
    q_BxNxTxH = pad_to_multiple(q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype), query_chunk).swapaxes(1, 2)
    k_BxKxSxH, v_BxKxSxH = (pad_to_length(x, keys.padded_len).swapaxes(1, 2) for x in (k_BxSxKxH, v_BxSxKxH))
    # Head groups run one after another in a loop (not unrolled, so compilation stays short): XLA:CPU's
    # batched matmul is slow with many small (head_dim 32) batch entries.
    groups = -(-n // step)
    masks = BlockMasks(
        kv_lengths_B,
        causal_window(local_window, causal, s),
        bias,
        None if segment_ids_BxT is None else pad_to_multiple(segment_ids_BxT, query_chunk),
        None if segment_ids_BxT is None else pad_to_length(segment_ids_BxT, keys.padded_len),
        groups * step,
        head_tables(relative_positions, scale, groups * step),
    )
    q_GxBxgxTxH = (
        jnp.pad(q_BxNxTxH, [(0, 0), (0, groups * step - n), (0, 0), (0, 0)])
        .reshape(b, groups, step, *q_BxNxTxH.shape[2:])
        .swapaxes(0, 1)
    )
    k_GxBxgxSxH, v_GxBxgxSxH = (
        jnp.pad(x, [(0, 0), (0, (groups * step - n) // per_kv), (0, 0), (0, 0)])
        .reshape(b, groups, step // per_kv, *x.shape[2:])
        .swapaxes(0, 1)
        for x in (k_BxKxSxH, v_BxKxSxH)
    )
    if groups == 1:
        out_BxNxTxH = _online_softmax(q_GxBxgxTxH[0], k_GxBxgxSxH[0], v_GxBxgxSxH[0], masks, 0, query_chunk, keys)
    else:
        out_GxBxgxTxH = jax.lax.map(
            lambda g_qkv: _online_softmax(*g_qkv[1], masks, g_qkv[0] * step, query_chunk, keys),
            (jnp.arange(groups), (q_GxBxgxTxH, k_GxBxgxSxH, v_GxBxgxSxH)),
        )
        out_BxNxTxH = out_GxBxgxTxH.swapaxes(0, 1).reshape(b, groups * step, -1, h)[:, :n]
    out_BxTxNxH = out_BxNxTxH.swapaxes(1, 2)[:, :t]
    # A row with no valid key averages every key (the bias is finite); pin it to zeros, as flash does.
    return jnp.where((kv_lengths_B > 0)[:, None, None, None], out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)


def head_tables(relative: RelativePositions | None, scale: float, padded_heads: int) -> RelativePositions | None:
    """The tables padded to whole head groups, pos_query scaled (q is scaled already; k is not)."""
    if relative is None:
        return None
    scaled = dataclasses.replace(
        relative, pos_query_RxNxH=None if relative.pos_query_RxNxH is None else relative.pos_query_RxNxH * scale
    )
    return scaled.map_tables(lambda t_RxNxH: jnp.pad(t_RxNxH, [(0, 0), (0, padded_heads - t_RxNxH.shape[1]), (0, 0)]))


def pad_to_length(x_BxLx___, length: int):
    """Right-pads axis 1 to ``length`` (zeros: padding's segment id, and keys masked by length)."""
    return jnp.pad(x_BxLx___, [(0, 0), (0, length - x_BxLx___.shape[1])] + [(0, 0)] * (x_BxLx___.ndim - 2))


@dataclasses.dataclass(frozen=True)
class BlockMasks:
    """What decides a block's additive bias: padding by length (or segment ids, padded with 0), the local
    window, and the model's bias function."""

    kv_lengths_B: jax.Array
    local_window: tuple[int, int] | None
    bias: Callable | None
    query_segments_BxT: jax.Array | None
    key_segments_BxS: jax.Array | None
    padded_heads: int  # heads rounded up to whole head groups: the bias is padded to as many
    relative: RelativePositions | None = None  # its tables padded to padded_heads, pos_query scaled

    def block_bias(self, query_pos_Q, key_pos_K, head_start, heads: int):
        """``[B, heads or 1, Q or 1, K]`` float32, added to the block's scores. Masked entries get MASKED
        (finite), so a row whose block is all masked stays finite and later blocks outweigh it."""
        if self.query_segments_BxT is None:  # one mask row for every query: Q is 1
            valid_BxQxK = (key_pos_K[None, :] < self.kv_lengths_B[:, None])[:, None, :]
        else:  # padding (segment 0) attends to padding: finite, and ignored downstream
            q_seg_BxQ = jax.lax.dynamic_slice_in_dim(self.query_segments_BxT, query_pos_Q[0], query_pos_Q.shape[0], 1)
            k_seg_BxK = jax.lax.dynamic_slice_in_dim(self.key_segments_BxS, key_pos_K[0], key_pos_K.shape[0], 1)
            valid_BxQxK = q_seg_BxQ[:, :, None] == k_seg_BxK[:, None, :]
        if self.local_window is not None:
            valid_BxQxK = valid_BxQxK & in_window(query_pos_Q, key_pos_K, self.local_window)[None]
        bias_BxNxQxK = jnp.where(valid_BxQxK, 0.0, MASKED).astype(jnp.float32)[:, None]
        if self.bias is not None:
            bias_NxQxK = self.bias(query_pos_Q, key_pos_K).astype(jnp.float32)
            if heads != bias_NxQxK.shape[0]:  # this head group's rows (dynamic_slice would clamp past the end)
                bias_NxQxK = jnp.pad(bias_NxQxK, [(0, self.padded_heads - bias_NxQxK.shape[0]), (0, 0), (0, 0)])
                bias_NxQxK = jax.lax.dynamic_slice_in_dim(bias_NxQxK, head_start, heads, 0)
            bias_BxNxQxK = bias_BxNxQxK + bias_NxQxK[None]
        return bias_BxNxQxK

    def relative_scores(self, q_BxNxQxH, k_BxNxKxH, query_start, key_start, head_start):
        """``[B, heads, Q, K]``: this head group's relative-position terms for the block (0 without them)."""
        if self.relative is None:
            return 0.0
        heads = q_BxNxQxH.shape[1]
        group = self.relative.map_tables(lambda t_RxNxH: jax.lax.dynamic_slice_in_dim(t_RxNxH, head_start, heads, 1))
        return block_scores(group, q_BxNxQxH, k_BxNxKxH, query_start, key_start)


def _per_kv_head(equation: str, x_BxNxQxE, y_BxKxCxF):
    """``equation`` over each head's last two axes (``"qh,kh->qk"``: scores; ``"qk,kh->qh"``: weighted values),
    with each of K k/v heads read by its N/K query heads (grouped-query attention), never repeated."""
    b, n, q_len = x_BxNxQxE.shape[:3]
    kv_heads = y_BxKxCxF.shape[1]
    x_side, rest = equation.split(",")
    y_side, out = rest.split("->")
    if kv_heads == n:
        return jnp.einsum(f"bn{x_side},bn{y_side}->bn{out}", x_BxNxQxE, y_BxKxCxF, preferred_element_type=jnp.float32)
    return jnp.einsum(
        f"bjg{x_side},bj{y_side}->bjg{out}",
        x_BxNxQxE.reshape(b, kv_heads, n // kv_heads, *x_BxNxQxE.shape[2:]),
        y_BxKxCxF,
        preferred_element_type=jnp.float32,
    ).reshape(b, n, q_len, -1)


def _online_softmax(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, masks: BlockMasks, head_start, query_chunk: int, keys: KeyPlan):
    """Heads ``head_start ..`` of the layer, heads-major, q already scaled and T a multiple of query_chunk, keys
    padded to ``keys.padded_len`` (K k/v heads, N a multiple of K); returns ``[B, N, T, H]`` in float32."""
    b, n, t, h = q_BxNxTxH.shape
    kv_heads = k_BxKxSxH.shape[1]
    q_CxBxNxQxH = q_BxNxTxH.reshape(b, n, t // query_chunk, query_chunk, h).transpose(2, 0, 1, 3, 4)

    def attend_query_chunk(chunk_index, q_BxNxQxH):
        query_start = chunk_index * query_chunk
        query_pos_Q = query_start + jnp.arange(query_chunk)
        key_start = keys.start(query_start)

        def absorb_key_chunk(carry, chunk):
            acc_BxNxQxH, max_BxNxQ, denom_BxNxQ = carry
            k_BxKxKcxH, v_BxKxKcxH, key_pos_Kc = chunk
            logits_BxNxQxKc = (
                _per_kv_head("qh,kh->qk", q_BxNxQxH, k_BxKxKcxH)
                + masks.block_bias(query_pos_Q, key_pos_Kc, head_start, n)
                + masks.relative_scores(q_BxNxQxH, k_BxKxKcxH, query_start, key_pos_Kc[0], head_start)
            )
            # The bias is finite, so the running max is finite after the first chunk: no NaN guard needed.
            new_max_BxNxQ = jnp.maximum(max_BxNxQ, logits_BxNxQxKc.max(axis=-1))
            p_BxNxQxKc = jnp.exp(logits_BxNxQxKc - new_max_BxNxQ[..., None])
            rescale_BxNxQ = jnp.exp(max_BxNxQ - new_max_BxNxQ)
            denom_BxNxQ = denom_BxNxQ * rescale_BxNxQ + p_BxNxQxKc.sum(axis=-1)
            acc_BxNxQxH = acc_BxNxQxH * rescale_BxNxQ[..., None] + _per_kv_head(
                "qk,kh->qh", p_BxNxQxKc.astype(v_BxKxKcxH.dtype), v_BxKxKcxH
            )
            return (acc_BxNxQxH, new_max_BxNxQ, denom_BxNxQ), None

        init = (
            jnp.zeros((b, n, query_chunk, h), jnp.float32),
            jnp.full((b, n, query_chunk), -jnp.inf, jnp.float32),
            jnp.zeros((b, n, query_chunk), jnp.float32),
        )
        if keys.causal:  # as many key chunks as reach this query chunk's diagonal: a loop of traced length

            def absorb_chunk_at(i, carry):
                start = i * keys.key_chunk
                k_BxKxKcxH, v_BxKxKcxH = (
                    jax.lax.dynamic_slice_in_dim(x, start, keys.key_chunk, 2) for x in (k_BxKxSxH, v_BxKxSxH)
                )
                return absorb_key_chunk(carry, (k_BxKxKcxH, v_BxKxKcxH, start + jnp.arange(keys.key_chunk)))[0]

            acc_BxNxQxH, _, denom_BxNxQ = jax.lax.fori_loop(
                0, keys.steps_for(query_start, query_chunk), absorb_chunk_at, init
            )
            return acc_BxNxQxH / denom_BxNxQ[..., None]
        span = keys.steps * keys.key_chunk
        k_KxBxKxKcxH, v_KxBxKxKcxH = (
            jax.lax.dynamic_slice_in_dim(x, key_start, span, 2)
            .reshape(b, kv_heads, keys.steps, keys.key_chunk, h)
            .transpose(2, 0, 1, 3, 4)
            for x in (k_BxKxSxH, v_BxKxSxH)
        )
        key_pos_KxKc = (key_start + jnp.arange(span)).reshape(keys.steps, keys.key_chunk)
        chunks = (k_KxBxKxKcxH, v_KxBxKxKcxH, key_pos_KxKc)
        if keys.steps == 1:  # no loop: XLA fuses the one step like native's softmax
            (acc_BxNxQxH, _, denom_BxNxQ), _ = absorb_key_chunk(init, jax.tree.map(lambda x: x[0], chunks))
        else:
            (acc_BxNxQxH, _, denom_BxNxQ), _ = jax.lax.scan(absorb_key_chunk, init, chunks)
        return acc_BxNxQxH / denom_BxNxQ[..., None]  # denominator >= 1: the max's own term is exp(0)

    if q_CxBxNxQxH.shape[0] == 1:
        out_CxBxNxQxH = attend_query_chunk(0, q_CxBxNxQxH[0])[None]
    else:
        out_CxBxNxQxH = jax.lax.map(lambda iq: attend_query_chunk(*iq), (jnp.arange(q_CxBxNxQxH.shape[0]), q_CxBxNxQxH))
    return out_CxBxNxQxH.transpose(1, 2, 0, 3, 4).reshape(b, n, t, h)
