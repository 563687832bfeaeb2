"""A user backend that leaks: every call keeps 3 MB of host memory for good, through a host callback (as a
kernel wrapper that caches per call would). ``attention.backend: tests.fixtures_leaky_backend:attend``."""

import jax
import numpy as np

from docbeam.attention.native import einsum_attention

LEAK_BYTES_PER_CALL = 3 << 20
_KEPT: list[np.ndarray] = []


def _keep(_):
    _KEPT.append(np.ones(LEAK_BYTES_PER_CALL, np.uint8))  # ones, not zeros: the pages are really touched


def attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale):
    """Native's einsum attention, plus a host callback that keeps 3 MB per call."""
    jax.debug.callback(_keep, kv_lengths_B)
    return einsum_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale)
