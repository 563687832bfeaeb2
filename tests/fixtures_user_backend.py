"""An example user backend, loaded by ``attention.backend: tests.fixtures_user_backend:attend``.

A plain AttentionFn: no registration, no options. Its optional ``supports`` attribute is its
capability check.
"""

import jax
import jax.numpy as jnp

from docbeam.attention import AttentionCase, Support


def attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    """Textbook softmax attention with a key-length mask."""
    logits_BxNxTxS = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k_BxSxNxH, preferred_element_type=jnp.float32) * scale
    valid_Bx1x1xS = (jnp.arange(k_BxSxNxH.shape[1])[None, :] < kv_lengths_B[:, None])[:, None, None, :]
    weights_BxNxTxS = jax.nn.softmax(jnp.where(valid_Bx1x1xS, logits_BxNxTxS, -1e30), axis=-1)
    out_BxTxNxH = jnp.einsum("bnts,bsnh->btnh", weights_BxNxTxS, v_BxSxNxH.astype(jnp.float32))
    return out_BxTxNxH.astype(q_BxTxNxH.dtype)


def supports(case: AttentionCase, options) -> Support:
    del options
    if case.seq_len > 4096:
        return Support(ok=False, reason=f"materialises [T, S] scores; {case.seq_len} tokens is too many")
    return Support(ok=True, kernel="tests.fixtures_user_backend.attend")


attend.supports = supports
