"""A backend with a classic bug — it ignores the padding — that capability checks cannot see and the
parity gate must catch."""

import jax
import jax.numpy as jnp


def attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    del kv_lengths_B  # the bug
    logits_BxNxTxS = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k_BxSxNxH) * scale
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits_BxNxTxS, axis=-1), v_BxSxNxH)
