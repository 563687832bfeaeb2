"""Backends that break the way real kernels do, for the tests that docbeam never writes what they return.

``attend_nan_at_length_7`` is the sly one: correct on the start-up probe (whose rows are full or half
length) and NaN only for rows of exactly 7 tokens, so only the per-document check can catch it.
``attend_refuses_everything`` is correct, but its check refuses every case: without a rule against that, the
parity test would skip it everywhere and never compare it. ``attend_declares_everything_refuses_everything``
is the same for the tests of each feature.
"""

import jax.numpy as jnp

from docbeam.attention import Support
from docbeam.attention.features import DECLARED
from tests.fixtures_user_backend import attend as textbook


def attend_raises(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    raise RuntimeError("kernel launch failed: out of shared memory")


def attend_wrong_layout(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    out = textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale)
    return jnp.transpose(out, (0, 2, 1, 3))  # B,N,T,H: the right size, the wrong layout


def attend_nan(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    return textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale) * jnp.nan


def attend_nan_at_length_7(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    out = textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale)
    return jnp.where((kv_lengths_B == 7)[:, None, None, None], jnp.nan, out)


def attend_check_raises(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    return textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale)


def _crashing_check(case, options):
    raise KeyError("sm_90")


attend_check_raises.supports = _crashing_check


def attend_refuses_everything(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    return textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale)


def _refuse(case, options):
    del options
    return Support(ok=False, reason=f"not built for {case.platform} (a kernel for another machine)")


attend_refuses_everything.supports = _refuse


def attend_declares_everything_refuses_everything(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
    del features
    return textbook(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale)


# Declares every feature of attention/features.py, so the plan lets every case through to its check, which refuses
# them all: the feature, decoder and relative-position parity tests would skip it everywhere unless they count.
attend_declares_everything_refuses_everything.supports = _refuse
for _feature in DECLARED:
    setattr(attend_declares_everything_refuses_everything, f"supports_{_feature}", True)
