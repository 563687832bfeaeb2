"""Content-dependent relative positions (DeBERTa's disentangled attention), the AttentionFn's
``relative_positions`` feature: what a family hands attention, and the arithmetic the backends share.

Beside q_i · k_j, the score of query i and key j gets, scaled by the same ``scale``:
- content → position (c2p): ``q_i · pos_key[row(i − j)]``
- position → content (p2c): ``k_j · pos_query[row(i − j)]``
where ``pos_key_RxNxH`` / ``pos_query_RxNxH`` are the family's projected relative embeddings (R rows per head)
and ``row`` maps a query − key offset to a table row (DeBERTa: log buckets, clipped to the span). Unlike an
additive ``bias(q_index, k_index)``, the term depends on the content of q and k, so a kernel needs both tables.

``dense_scores`` builds the whole ``[B, N, T, S]`` term (native); ``block_scores`` only a (query chunk, key
chunk) block from the table rows that block's offsets reach (chunked), so no ``[T, S]`` tensor exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RelativePositions:
    """What a layer with disentangled attention hands the AttentionFn (either table may be absent)."""

    row: Callable[[Any], Any]  # query − key offsets (int32, any shape) → table rows in [0, R), same shape
    pos_key_RxNxH: Any = None  # c2p: q_i · pos_key[row(i − j)]
    pos_query_RxNxH: Any = None  # p2c: k_j · pos_query[row(i − j)]

    def __post_init__(self):
        if self.pos_key_RxNxH is None and self.pos_query_RxNxH is None:
            raise ValueError("RelativePositions needs pos_key_RxNxH (c2p), pos_query_RxNxH (p2c) or both")

    @property
    def tables(self) -> tuple:
        return tuple(t for t in (self.pos_key_RxNxH, self.pos_query_RxNxH) if t is not None)

    def map_tables(self, fn) -> "RelativePositions":
        """The same positions with ``fn`` applied to each table present (a head slice, a scale)."""
        return dataclasses.replace(
            self,
            **{
                name: fn(getattr(self, name))
                for name in ("pos_key_RxNxH", "pos_query_RxNxH")
                if getattr(self, name) is not None
            },
        )


def _terms(rel: RelativePositions, q_BxNxQxH, k_BxNxKxH, rows_QxK) -> jax.Array:
    """c2p + p2c for a block: each table scored against q (or k) row by row, then the row of every
    (query, key) pair picked from ``rows_QxK`` (indices into the tables' first axis)."""
    out = 0.0
    if rel.pos_key_RxNxH is not None:
        c2p_BxNxQxR = jnp.einsum(
            "bnqh,rnh->bnqr", q_BxNxQxH, rel.pos_key_RxNxH.astype(q_BxNxQxH.dtype), preferred_element_type=jnp.float32
        )
        out = out + jnp.take_along_axis(c2p_BxNxQxR, rows_QxK[None, None], axis=-1)
    if rel.pos_query_RxNxH is not None:
        p2c_BxNxKxR = jnp.einsum(
            "bnkh,rnh->bnkr", k_BxNxKxH, rel.pos_query_RxNxH.astype(k_BxNxKxH.dtype), preferred_element_type=jnp.float32
        )
        out = out + jnp.take_along_axis(p2c_BxNxKxR, rows_QxK.T[None, None], axis=-1).swapaxes(-1, -2)
    return out


def dense_scores(rel: RelativePositions, q_BxTxNxH, k_BxSxNxH, scale: float) -> jax.Array:
    """The whole ``[B, N, T, S]`` float32 term, already scaled (native)."""
    t, s = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
    rows_TxS = rel.row(jnp.arange(t, dtype=jnp.int32)[:, None] - jnp.arange(s, dtype=jnp.int32)[None, :])
    return scale * _terms(rel, q_BxTxNxH.swapaxes(1, 2), k_BxSxNxH.swapaxes(1, 2), rows_TxS)


def block_scores(rel: RelativePositions, q_BxNxQxH, k_BxNxKxH, query_start, key_start) -> jax.Array:
    """One block's ``[B, N, Q, K]`` float32 term, for Q queries from ``query_start`` and K keys from ``key_start``
    (traced), unscaled: the caller scales q and pos_query beforehand. The block's offsets i − j span Q + K − 1
    values; where the table has fewer rows, q and k are scored against the whole table and each pair picks its
    row; otherwise only the rows those offsets reach are gathered, and pair (a, b) of the block reads the
    gathered row a − b + K − 1 (a fixed index, whatever the block)."""
    q_len, k_len = q_BxNxQxH.shape[2], k_BxNxKxH.shape[2]
    span = q_len + k_len - 1
    if rel.tables[0].shape[0] <= span:
        offsets_QxK = (query_start + jnp.arange(q_len))[:, None] - (key_start + jnp.arange(k_len))[None, :]
        return _terms(rel, q_BxNxQxH, k_BxNxKxH, rel.row(offsets_QxK.astype(jnp.int32)))
    rows_D = rel.row((query_start - key_start - (k_len - 1) + jnp.arange(span)).astype(jnp.int32))
    skew_QxK = jnp.asarray(np.arange(q_len)[:, None] - np.arange(k_len)[None, :] + k_len - 1, jnp.int32)
    return _terms(rel.map_tables(lambda table_RxNxH: table_RxNxH[rows_D]), q_BxNxQxH, k_BxNxKxH, skew_QxK)


def random_relative(
    num_heads: int,
    head_dim: int,
    seq_len: int,
    seed: int = 0,
    buckets: int = 8,
    terms: tuple[str, ...] = ("c2p", "p2c"),
) -> RelativePositions:
    """Random tables of ``2 · buckets`` rows and DeBERTa-like rows: offsets within ±buckets exact, then
    log-spaced to ``seq_len``, clipped (what the probes, the parity gate and the parity tests use)."""
    rng = np.random.default_rng(seed)
    tables = {
        name: jnp.asarray(rng.standard_normal((2 * buckets, num_heads, head_dim)).astype(np.float32)) for name in terms
    }

    def row(offset):
        far = jnp.sign(offset) * (
            buckets // 2
            + jnp.ceil(
                jnp.log(jnp.maximum(jnp.abs(offset), 1).astype(jnp.float32) / (buckets // 2))
                / np.log(max(seq_len, buckets) / (buckets // 2))
                * (buckets // 2 - 1)
            ).astype(jnp.int32)
        )
        bucket = jnp.where(jnp.abs(offset) <= buckets // 2, offset, far)
        return jnp.clip(bucket + buckets, 0, 2 * buckets - 1)

    return RelativePositions(row, tables.get("c2p"), tables.get("p2c"))
