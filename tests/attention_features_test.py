"""Local windows, additive per-head bias and segment ids together: every registered backend (and flash kernel,
and chunked with chunks smaller and larger than the window) that declares a feature matches softmax attention
computed in numpy float64 with it, and one that does not declare it is refused by the plan and by its bound
function. A variant that declares a scenario's features must run at least one of them on the CPU rather than skip
them all (tests/attention_fixtures.py)."""

import dataclasses

import numpy as np
import pytest
from attention_fixtures import assert_runs_a_declared_case
from conftest import REPO

from docbeam import attention
from docbeam.attention.interface import AttentionCase

B, T, N, H = 3, 40, 3, 8  # 3 heads: chunked's 2 heads per step leaves a remainder group
LENGTHS = np.array([40, 23, 0], np.int32)  # full, padded, fully padded rows
# Packed rows: two windows in row 0, two and padding in row 1, only padding in row 2.
SEGMENTS = np.array([[1] * 15 + [2] * 25, [1] * 10 + [2] * 13 + [0] * 17, [0] * 40], np.int32)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    window: tuple[int, int] | None = None
    with_bias: bool = False
    packed: bool = False

    def case(self) -> AttentionCase:
        return AttentionCase(
            "cpu", "float32", T, N, H, segments=self.packed, local_window=self.window, bias=self.with_bias
        )


SCENARIOS = [
    Scenario("window", (5, 3)),
    Scenario("bias", with_bias=True),
    Scenario("window+bias", (4, 4), with_bias=True),
    Scenario("window-smaller-than-a-chunk", (1, 1)),
    Scenario("window-larger-than-the-sequence", (50, 60), with_bias=True),
    Scenario("asymmetric-right-only", (0, 7)),
    Scenario("asymmetric-left-only", (9, 0), with_bias=True),
    Scenario("packed", packed=True),
    Scenario("packed+window", (3, 6), packed=True),
    Scenario("packed+window+bias", (5, 5), with_bias=True, packed=True),
    Scenario("packed+bias", with_bias=True, packed=True),
]

VARIANTS = [
    ("native", {}),
    ("native", {"implementation": "jax_nn"}),
    ("chunked", {}),
    ("chunked", {"query_chunk": 8, "key_chunk": 8}),  # several key chunks per window: the scan path
    ("chunked", {"query_chunk": 16, "key_chunk": 12, "heads_per_step": 2}),  # chunks dividing nothing; head groups
    ("flash", {}),
    ("flash", {"kernel": "tokamax_chunked"}),
    ("flash", {"kernel": "splash_tpu", "interpret": True}),
    ("flash", {"kernel": "pallas_tpu", "interpret": True}),
    ("flash", {"kernel": "pallas_gpu", "interpret": True, "block_q": 16, "block_k": 16}),
]


def relative_table(seed=1):
    return np.random.default_rng(seed).standard_normal((N, 2 * T)).astype(np.float32)


def relative_bias(table):
    import jax.numpy as jnp

    def bias(q_index_T, k_index_S):
        return jnp.asarray(table)[:, (k_index_S[None, :] - q_index_T[:, None]) + T]

    return bias


def reference(q, k, v, window, table, packed):
    """float64 softmax over the keys each valid query may see; padded query rows are left at zero."""
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for i in range(LENGTHS[b]):
            keys = np.flatnonzero(SEGMENTS[b] == SEGMENTS[b, i]) if packed else np.arange(LENGTHS[b])
            for n in range(N):
                scores = q[b, i, n].astype(np.float64) @ k[b, keys, n].T.astype(np.float64) / np.sqrt(H)
                if table is not None:
                    scores = scores + table[n, keys - i + T]
                if window is not None:
                    scores = np.where((keys >= i - window[0]) & (keys <= i + window[1]), scores, -np.inf)
                weights = np.exp(scores - scores.max())
                out[b, i, n] = (weights / weights.sum()) @ v[b, keys, n]
    return out


def inputs(seed=0):
    """q, k, v with large garbage in padded positions: a padded key that got weight shows."""
    rng = np.random.default_rng(seed)
    valid = (np.arange(T)[None, :] < LENGTHS[:, None])[..., None, None]
    return [
        np.where(valid, rng.standard_normal((B, T, N, H)), 30 * rng.standard_normal((B, T, N, H))).astype(np.float32)
        for _ in "qkv"
    ]


def variant_label(name, options):
    return "-".join([name] + [f"{k}={v}" for k, v in options.items()])


def params():
    for name, options in VARIANTS:
        for scenario in SCENARIOS:
            yield pytest.param(name, options, scenario, id=f"{variant_label(name, options)}-{scenario.name}")


@pytest.mark.parametrize("name, options, scenario", list(params()))
def test_backend_with_features_matches_softmax_reference(name, options, scenario):
    import jax

    backend = attention.get(name)
    opts = backend.parse_options(options)
    case = scenario.case()
    support = backend.refusal(case) or backend.supports(case, opts)
    if not support.ok:
        pytest.skip(f"{name} {options} refuses {scenario.name}: {support.reason}")
    q, k, v = inputs()
    table = relative_table() if scenario.with_bias else None
    features = {
        "local_window": scenario.window,
        "bias": None if table is None else relative_bias(table),
        "segment_ids_BxT": SEGMENTS if scenario.packed else None,
    }
    fn = backend.bind(opts)
    got = np.asarray(jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=LENGTHS, scale=H**-0.5, **features))(q, k, v))
    want = reference(q, k, v, scenario.window, table, scenario.packed)
    assert np.isfinite(got).all(), "non-finite output (padded or fully padded rows included)"
    for b in range(B):
        np.testing.assert_allclose(
            got[b, : LENGTHS[b]], want[b, : LENGTHS[b]], atol=1e-5, err_msg=f"row {b} (length {LENGTHS[b]})"
        )


@pytest.mark.parametrize("name, options", [pytest.param(*v, id=variant_label(*v)) for v in VARIANTS])
def test_every_variant_runs_a_scenario_it_declares_on_the_cpu(name, options):
    assert_runs_a_declared_case(name, options, {scenario.name: scenario.case() for scenario in SCENARIOS})


def test_a_backend_that_refuses_every_scenario_it_declares_fails_the_check(monkeypatch):
    monkeypatch.syspath_prepend(REPO)  # the fixture is named tests.…
    refusing = "tests.fixtures_bad_backends:attend_declares_everything_refuses_everything"
    cases = {scenario.name: scenario.case() for scenario in SCENARIOS}
    with pytest.raises(AssertionError, match=r"refuses every one on cpu.*never compare it: window: not built"):
        assert_runs_a_declared_case(refusing, {}, cases)
    assert_runs_a_declared_case("native", {}, cases)  # the same check passes a backend that runs them


def test_every_feature_changes_the_reference():
    """The reference itself: a window, a bias or segments that changed nothing would make the test above vacuous."""
    q, k, v = inputs()
    plain = reference(q, k, v, None, None, False)
    for window in [(5, 3), (1, 1), (0, 7), (9, 0)]:
        assert np.abs(reference(q, k, v, window, None, False) - plain).max() > 0.1, window
    assert np.abs(reference(q, k, v, None, relative_table(), False) - plain).max() > 0.1
    assert np.abs(reference(q, k, v, None, None, True) - plain).max() > 0.1
    assert np.abs(reference(q, k, v, (50, 60), None, False) - plain).max() == 0  # wider than the row: global


@pytest.mark.parametrize(
    "kernel, case, reason",
    [
        ("cudnn", AttentionCase("gpu", "bfloat16", 512, 12, 64, local_window=(64, 64)), "no symmetric window"),
        ("cudnn", AttentionCase("gpu", "bfloat16", 512, 12, 64, bias=True), "no bias"),
        ("splash_tpu", AttentionCase("tpu", "float32", 512, 12, 64, bias=True), "splash_tpu adds no per-head bias"),
        ("pallas_tpu", AttentionCase("tpu", "float32", 512, 12, 64, local_window=(64, 64)), "splash_tpu runs it"),
        ("pallas_gpu", AttentionCase("gpu", "float32", 512, 12, 64, local_window=(64, 64)), "no local-window mask"),
    ],
)
def test_flash_refuses_a_feature_its_kernel_cannot_take_naming_why(kernel, case, reason):
    from docbeam.attention.flash import pick_kernel

    backend = attention.get("flash")
    options = backend.parse_options({"kernel": kernel, "interpret": True})
    name, support = pick_kernel(case, options)
    assert name is None and not support.ok and reason in support.reason


def test_flash_auto_on_tpu_and_gpu_moves_to_the_kernel_that_takes_the_feature():
    from docbeam.attention.flash import KERNELS, pick_kernel

    backend = attention.get("flash")
    options = backend.parse_options({"interpret": True})
    local = AttentionCase("tpu", "float32", 512, 12, 64, local_window=(64, 64))
    assert pick_kernel(local, options)[0] == "splash_tpu"
    assert pick_kernel(dataclasses.replace(local, local_window=None), options)[0] == "pallas_tpu"
    # On GPU cuDNN refuses the window, tokamax_triton takes it (if tokamax imports here).
    gpu_local = AttentionCase("gpu", "bfloat16", 512, 12, 64, local_window=(64, 64))
    name, support = pick_kernel(gpu_local, options)
    cudnn_refusal = KERNELS["cudnn"].feature_refusal(gpu_local, "cudnn")
    assert "no symmetric window" in (support.reason if name is None else cudnn_refusal)
    assert name in (None, "tokamax_triton")


def test_undeclared_feature_is_refused_by_plan_and_by_the_bound_function():
    plain = attention.Backend(name="plain", attend=lambda q, k, v, **kw: q)
    case = AttentionCase("cpu", "float32", 128, 2, 8, local_window=(64, 64))
    assert "local window" in plain.refusal(case).reason
    assert "bias" in plain.refusal(AttentionCase("cpu", "float32", 128, 2, 8, bias=True)).reason
    with pytest.raises(ValueError, match="takes no local_window"):
        plain.bind()(
            np.zeros((1, 4, 2, 8)),
            np.zeros((1, 4, 2, 8)),
            np.zeros((1, 4, 2, 8)),
            kv_lengths_B=np.array([4]),
            scale=1.0,
            local_window=(1, 1),
        )
