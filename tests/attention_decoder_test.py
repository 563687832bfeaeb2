"""Decoder attention: causal masks and grouped-query k/v (fewer key/value heads than query heads). Every
registered backend that declares them matches softmax attention computed in numpy float64, alone and with
packed windows, a local window and padding; a backend that does not declare them is refused, and one that does
must run at least one scenario on the CPU rather than skip them all (tests/attention_fixtures.py)."""

import numpy as np
import pytest
from attention_fixtures import assert_runs_a_declared_case
from conftest import REPO

from docbeam import attention
from docbeam.attention.interface import AttentionCase

B, T, N, K, H = 2, 24, 4, 2, 8  # 4 query heads over 2 key/value heads
LENGTHS = np.array([24, 15], np.int32)
SEGMENTS = np.array([[1] * 10 + [2] * 14, [1] * 15 + [0] * 9], np.int32)  # row 0 packs two windows


def reference(q, k, v, *, causal, segments=None, window=None):
    out = np.zeros(q.shape, np.float64)
    group = q.shape[2] // k.shape[2]
    for b in range(B):
        for n in range(q.shape[2]):
            for i in range(LENGTHS[b]):
                keys = np.arange(LENGTHS[b])
                if segments is not None:
                    keys = keys[segments[b, keys] == segments[b, i]]
                if causal:
                    keys = keys[keys <= i]
                if window is not None:
                    keys = keys[(keys >= i - window[0]) & (keys <= i + window[1])]
                scores = k[b, keys, n // group].astype(np.float64) @ q[b, i, n].astype(np.float64) / np.sqrt(H)
                weights = np.exp(scores - scores.max())
                out[b, i, n] = (weights / weights.sum()) @ v[b, keys, n // group]
    return out


def inputs(kv_heads=K, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, kv_heads, H)).astype(np.float32) for _ in range(2))
    return q, k, v


EXTRA_OPTIONS = {
    "native": [{"implementation": "jax_nn"}],
    # several query and key chunks, so causal skipping and windows cross chunk edges; one head per step is
    # rounded up to the two query heads that share a k/v head
    # heads_per_step 0 puts both k/v heads in one step, so the query heads' grouping over them is exercised
    "chunked": [
        {"query_chunk": 8, "key_chunk": 8},
        {"query_chunk": 8, "key_chunk": 16, "heads_per_step": 1},
        {"query_chunk": 8, "key_chunk": 8, "heads_per_step": 0},
        # the baseline benchmarks/long_context_decoder.py times the skipping against: masks alone
        {"query_chunk": 8, "key_chunk": 8, "skip_causal_blocks": False},
    ],
    # flash on CPU runs chunked; tokamax takes is_causal and grouped k/v itself; the TPU kernel (interpret
    # mode) takes causal but not grouped heads, so it meets the scenarios with as many k/v heads as q heads
    "flash": [{"kernel": "tokamax_chunked"}, {"kernel": "pallas_tpu", "interpret": True}],
}


def variants():
    return [
        pytest.param(name, options, id=f"{name}-{'-'.join(map(str, options.values())) or 'default'}")
        for name in attention.names()
        if attention.get(name).causal and attention.get(name).grouped
        for options in [{}, *EXTRA_OPTIONS.get(name, [])]
    ]


SCENARIOS = {
    "causal": dict(causal=True),
    "grouped": dict(causal=False),
    "grouped-packed": dict(causal=False, segments=SEGMENTS),  # decoders read both ways (EuroBERT), packed
    "causal-packed": dict(causal=True, segments=SEGMENTS),
    "causal-window": dict(causal=True, window=(3, 3)),
    "causal-ungrouped": dict(causal=True, kv_heads=N),
    "causal-ungrouped-packed": dict(causal=True, kv_heads=N, segments=SEGMENTS),
}


def scenario_case(scenario: str) -> AttentionCase:
    kw = SCENARIOS[scenario]
    return AttentionCase(
        "cpu",
        "float32",
        T,
        N,
        H,
        segments=kw.get("segments") is not None,
        local_window=kw.get("window"),
        causal=kw["causal"],
        num_kv_heads=kw.get("kv_heads", K),
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name, options", variants())
def test_causal_and_grouped_query_attention_match_the_softmax_reference(name, options, scenario):
    import jax

    assert name in ("native", "chunked", "flash") or name.startswith("tests.")  # what the contract promises
    backend, kw = attention.get(name), SCENARIOS[scenario]
    case = scenario_case(scenario)
    support = backend.refusal(case) or backend.supports(case, backend.parse_options(options))
    if not support.ok:  # a kernel that cannot says why: that is its contract, checked below
        assert name == "flash" and options.get("kernel") == "pallas_tpu" and "k/v heads" in support.reason
        pytest.skip(f"{name} {options} refuses {scenario}: {support.reason}")
    q, k, v = inputs(kw.get("kv_heads", K))
    fn = backend.bind(backend.parse_options(options))
    extra = {"causal": kw["causal"], "local_window": kw.get("window")}
    if kw.get("segments") is not None:
        extra["segment_ids_BxT"] = kw["segments"]
    got = np.asarray(jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=LENGTHS, scale=H**-0.5, **extra))(q, k, v))
    want = reference(q, k, v, causal=kw["causal"], segments=kw.get("segments"), window=kw.get("window"))
    for b in range(B):
        np.testing.assert_allclose(got[b, : LENGTHS[b]], want[b, : LENGTHS[b]], atol=1e-5)


@pytest.mark.parametrize("name, options", variants())
def test_every_backend_declaring_causal_and_grouped_runs_a_scenario_on_the_cpu(name, options):
    assert_runs_a_declared_case(name, options, {scenario: scenario_case(scenario) for scenario in SCENARIOS})


def test_a_backend_that_refuses_every_scenario_it_declares_fails_the_check(monkeypatch):
    monkeypatch.syspath_prepend(REPO)  # the fixture is named tests.…
    refusing = "tests.fixtures_bad_backends:attend_declares_everything_refuses_everything"
    cases = {scenario: scenario_case(scenario) for scenario in SCENARIOS}
    with pytest.raises(AssertionError, match=r"refuses every one on cpu.*never compare it: causal: not built"):
        assert_runs_a_declared_case(refusing, {}, cases)
    assert_runs_a_declared_case("native", {}, cases)  # the same check passes a backend that runs them


def test_the_reference_moves_with_causality_and_grouping():
    """Were causality or the head grouping ignored, the test above would still need to fail."""
    q, k, v = inputs()
    causal = reference(q, k, v, causal=True)
    assert np.abs(causal - reference(q, k, v, causal=False)).max() > 0.1
    swapped = reference(q, k[:, :, ::-1], v[:, :, ::-1], causal=True)  # query heads read the other kv head
    assert np.abs(causal - swapped).max() > 0.1


def test_a_backend_without_causal_or_grouped_support_is_refused():
    plain = attention.Backend(name="plain", attend=lambda q, k, v, **kw: q)
    assert "causal" in plain.refusal(AttentionCase("cpu", "float32", 64, 16, 128, causal=True)).reason
    grouped = AttentionCase("cpu", "float32", 64, 16, 128, num_kv_heads=8)
    assert "16 query heads over 8 key/value heads" in plain.refusal(grouped).reason
    q, k, v = inputs()
    with pytest.raises(ValueError, match="takes no grouped-query k/v"):
        plain.bind()(q, k, v, kv_lengths_B=LENGTHS, scale=1.0)
    with pytest.raises(ValueError, match="takes no causal"):
        plain.bind()(q, q, q, kv_lengths_B=LENGTHS, scale=1.0, causal=True)


def test_chunked_says_whether_it_skips_the_blocks_past_the_diagonal():
    chunked = attention.get("chunked")
    case = AttentionCase("cpu", "float32", 4096, N, H, causal=True, num_kv_heads=K)
    skipping = chunked.supports(case, chunked.parse_options(None)).kernel
    scanning = chunked.supports(case, chunked.parse_options({"skip_causal_blocks": False})).kernel
    assert "past the diagonal skipped" in skipping and "past the diagonal" not in scanning


def test_a_causal_layer_on_cpu_runs_square_causal_chunks_of_every_head_unless_the_options_set_them():
    from docbeam.attention.chunk_sizes import (
        ACCELERATOR_CHUNKS,
        CAUSAL_SIZES,
        TUNED_CHUNKS,
        ChunkedOptions,
        layer_chunk_sizes,
    )

    chunk, heads = CAUSAL_SIZES["cpu"]
    assert heads == 0  # every head in one batched matmul: measured faster than the table's one head per step
    assert layer_chunk_sizes(ChunkedOptions(), 4096, None, "cpu", causal=True) == (chunk, chunk, heads)
    assert layer_chunk_sizes(ChunkedOptions(), 4096, None, "cpu") == TUNED_CHUNKS[-1][1:]
    assert layer_chunk_sizes(ChunkedOptions(query_chunk=64), 4096, None, "cpu", causal=True) == (64, chunk, heads)
    assert layer_chunk_sizes(ChunkedOptions(heads_per_step=2), 4096, None, "cpu", causal=True) == (chunk, chunk, 2)
    assert layer_chunk_sizes(ChunkedOptions(), 4096, None, "gpu", causal=True) == ACCELERATOR_CHUNKS[0][1:]
    case = AttentionCase("cpu", "float32", 4096, N, H, causal=True, num_kv_heads=K)
    chunked = attention.get("chunked")
    kernel = chunked.supports(case, chunked.parse_options(None)).kernel
    assert f"chunks {chunk}x{chunk}," in kernel and "head(s) per step" not in kernel
