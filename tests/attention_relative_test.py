"""Content-dependent relative positions (attention/relative.py) beyond parity (tests/attention_parity_test.py):
chunked computes them per block, never a [T, S] array; a backend that did not declare them is refused by the
plan and by its bound function; flash's kernels that cannot take them say why; the plan's probes carry them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from docbeam import attention
from docbeam.attention.interface import AttentionCase
from docbeam.attention.relative import random_relative


def largest_intermediate(jaxpr) -> int:
    """Elements of the largest value any equation of ``jaxpr`` (and of the loops and calls inside it) makes."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, largest_intermediate(inner))
    return largest


def traced(name: str, seq_len: int, heads: int = 2, head_dim: int = 16, **options):
    backend = attention.get(name)
    fn = backend.bind(backend.parse_options(options))
    relative = random_relative(heads, head_dim, seq_len, buckets=256)  # DeBERTa-v3's 512 rows
    q = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), jnp.float32)
    return jax.make_jaxpr(
        lambda q, k, v: fn(q, k, v, kv_lengths_B=jnp.array([seq_len]), scale=0.25, relative_positions=relative)
    )(q, q, q).jaxpr


@pytest.mark.parametrize("options", [{}, {"query_chunk": 64, "key_chunk": 64}, {"query_chunk": 256, "key_chunk": 1024}])
def test_chunked_never_builds_a_sequence_by_sequence_array_at_2048_tokens(options):
    t = 2048
    native = largest_intermediate(traced("native", t))
    chunked = largest_intermediate(traced("chunked", t, **options))
    assert native >= 2 * t * t  # the measure sees native's [B, N, T, S] scores
    assert chunked <= t * t // 4, f"chunked's largest intermediate holds {chunked} elements (T² = {t * t})"


def test_a_backend_without_relative_positions_is_refused_by_the_plan_and_its_bound_function():
    plain = attention.Backend(name="plain", attend=lambda q, k, v, **kw: q, bias=True)
    support = plain.refusal(AttentionCase("cpu", "float32", 64, 2, 8, relative_positions=True))
    assert not support.ok and "relative_positions=True" in support.reason and "DeBERTa" in support.reason
    x = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="takes no relative_positions"):
        plain.bind()(x, x, x, kv_lengths_B=np.array([4]), scale=1.0, relative_positions=random_relative(2, 8, 4))


@pytest.mark.parametrize("platform, dtype", [("tpu", "float32"), ("gpu", "bfloat16"), ("gpu", "float32")])
def test_flash_on_accelerators_refuses_relative_positions_naming_the_kernels_and_chunked(platform, dtype):
    from docbeam.attention.flash import pick_kernel

    options = attention.get("flash").parse_options({"interpret": True})
    name, support = pick_kernel(AttentionCase(platform, dtype, 512, 12, 64, relative_positions=True), options)
    assert name is None and not support.ok
    assert "content-to-position" in support.reason and "chunked" in support.reason


def test_flash_on_cpu_runs_relative_positions_on_its_chunked_kernel():
    from docbeam.attention.flash import pick_kernel

    name, support = pick_kernel(
        AttentionCase("cpu", "float32", 512, 12, 64, relative_positions=True),
        attention.get("flash").parse_options(None),
    )
    assert name == "chunked" and support.ok


def test_relative_positions_with_grouped_query_heads_are_refused_with_the_reason():
    case = AttentionCase("cpu", "float32", 64, 4, 8, num_kv_heads=2, relative_positions=True)
    for name in ("native", "chunked"):
        backend = attention.get(name)
        support = backend.supports(case, backend.parse_options(None))
        assert not support.ok and "grouped-query" in support.reason, name


def test_the_plans_probe_and_parity_gate_run_relative_positions():
    from docbeam.attention.dispatch import choose_backend, probe_inputs, verify

    case = AttentionCase("cpu", "float32", 48, 2, 8, relative_positions=True)
    _, _, _, kwargs = probe_inputs(case)
    assert kwargs["relative_positions"].pos_key_RxNxH.shape == (16, 2, 8)
    chunked, native = attention.get("chunked"), attention.get("native")
    choice = choose_backend(case, chunked, chunked.parse_options(None), None, None)
    ok, error, _ = verify(choice, chunked.bind(), native.bind())
    assert ok and error <= 1e-5
    assert choice.cases[0].features.describe() == "global, disentangled relative positions"


def test_the_plan_sends_a_bucket_flash_cannot_run_to_the_fallback_or_refuses_at_start():
    from docbeam.attention.dispatch import AttentionPlanError, choose_backend

    flash, chunked = attention.get("flash"), attention.get("chunked")
    case = AttentionCase("gpu", "bfloat16", 1024, 12, 64, relative_positions=True)
    choice = choose_backend(case, flash, flash.parse_options(None), chunked, chunked.parse_options(None))
    assert choice.backend == "chunked" and "content-to-position" in choice.fallback_reason
    with pytest.raises(AttentionPlanError, match="bucket 1024.*content-to-position.*attention.fallback"):
        choose_backend(case, flash, flash.parse_options(None), None, None)
