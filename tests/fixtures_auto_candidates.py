"""Candidates for ``attention.backend: auto`` that a measurement must see through (tests/attention_auto_test.py).

``returns_q`` is the fastest kernel there is and wrong: it returns its queries. ``slow_native`` is right and slow: native's
output, handed back after a sleep on the host. ``raises`` fails on every call, as a kernel built for another chip does.
``native_again`` is native under another name: as fast as native, so it must lose the tie. Each takes packed rows'
segment ids, so packed buckets do not refuse them before they are measured.
"""

import time

import jax

from docbeam.attention import registry


def _native(q, k, v, **kwargs):
    return registry.get("native").bind()(q, k, v, **kwargs)


def returns_q(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
    del k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, features
    return q_BxTxNxH


def slow_native(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
    out = _native(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale, **features)
    return jax.pure_callback(_after_a_sleep, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


def _after_a_sleep(x):
    time.sleep(0.02)
    return x


def raises(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
    raise RuntimeError("kernel launch failed: no kernel image for this device")


def native_again(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
    return _native(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale, **features)


for _fn in (returns_q, slow_native, raises, native_again):
    _fn.supports_segments = True
