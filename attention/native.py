"""``native``: XLA's own attention. The default and the reference every other backend is checked against."""
from __future__ import annotations

import jax

from attention.registry import register


@register("native", description="XLA attention (jax.nn.dot_product_attention, implementation='xla')")
def native(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options):
    del options
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, scale=scale,
                                        key_value_seq_lengths=kv_lengths_B, implementation="xla")
