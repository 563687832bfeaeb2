"""Local windows and additive per-head bias: every registered backend that declares a feature matches
softmax attention computed in numpy float64 with it, and one that does not declare it is refused by the plan
and by its bound function."""
import numpy as np
import pytest

import attention
from attention.interface import AttentionCase

B, T, N, H = 2, 40, 2, 8
LENGTHS = np.array([40, 23], np.int32)


def relative_table(seed=1):
    return np.random.default_rng(seed).standard_normal((N, 2 * T)).astype(np.float32)


def relative_bias(table):
    import jax.numpy as jnp

    def bias(q_index_T, k_index_S):
        return jnp.asarray(table)[:, (k_index_S[None, :] - q_index_T[:, None]) + T]
    return bias


def reference(q, k, v, window, table):
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        keys = np.arange(LENGTHS[b])
        for n in range(N):
            for i in range(LENGTHS[b]):
                scores = q[b, i, n].astype(np.float64) @ k[b, keys, n].T.astype(np.float64) / np.sqrt(H)
                if table is not None:
                    scores = scores + table[n, keys - i + T]
                if window is not None:
                    scores = np.where((keys >= i - window[0]) & (keys <= i + window[1]), scores, -np.inf)
                weights = np.exp(scores - scores.max())
                out[b, i, n] = (weights / weights.sum()) @ v[b, keys, n]
    return out


def variants(flag):
    return [pytest.param(name, options, id=f"{name}-{'-'.join(map(str, options.values())) or 'default'}")
            for name in attention.names() if getattr(attention.get(name), flag)
            for options in ([{}, {"implementation": "jax_nn"}] if name == "native" else [{}])]


@pytest.mark.parametrize("window, with_bias", [((5, 3), False), (None, True), ((4, 4), True)],
                         ids=["window", "bias", "window+bias"])
@pytest.mark.parametrize("name, options", variants("windows"))
def test_declared_features_match_softmax_reference(name, options, window, with_bias):
    import jax

    backend = attention.get(name)
    if with_bias and not backend.bias:
        pytest.skip(f"{name} takes no bias")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    table = relative_table() if with_bias else None
    fn = backend.bind(backend.parse_options(options))
    got = jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=LENGTHS, scale=H ** -0.5, local_window=window,
                                     bias=None if table is None else relative_bias(table)))(q, k, v)
    want = reference(q, k, v, window, table)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(got)[b, :LENGTHS[b]], want[b, :LENGTHS[b]], atol=1e-5)


def test_window_and_bias_change_the_output():
    """The reference itself: a window or a bias that changed nothing would make the test above vacuous."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    plain = reference(q, k, v, None, None)
    assert np.abs(reference(q, k, v, (5, 3), None) - plain).max() > 0.1
    assert np.abs(reference(q, k, v, None, relative_table()) - plain).max() > 0.1


def test_undeclared_feature_is_refused_by_plan_and_by_the_bound_function():
    plain = attention.Backend(name="plain", attend=lambda q, k, v, **kw: q)
    case = AttentionCase("cpu", "float32", 128, 2, 8, local_window=(64, 64))
    assert "local window" in plain.refusal(case).reason
    assert "bias" in plain.refusal(AttentionCase("cpu", "float32", 128, 2, 8, bias=True)).reason
    with pytest.raises(ValueError, match="takes no local_window"):
        plain.bind()(np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 2, 8)),
                     kv_lengths_B=np.array([4]), scale=1.0, local_window=(1, 1))
