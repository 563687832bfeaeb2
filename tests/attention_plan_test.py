"""The attention plan for models whose layers ask different things of attention (ModernBERT: global and local
layers; MPNet: a relative-position bias): one case per bucket and kind of layer, one backend per bucket that
takes every kind, a refusal of any kind sends the whole bucket to the fallback with the kind named, and the
probes and the parity gate run each kind (windows and a random relative bias)."""

import dataclasses

import jax.numpy as jnp
import pytest

from docbeam import attention
from docbeam.attention import registry
from docbeam.attention.dispatch import AttentionPlanError, choose_backends, gate, probe, probe_inputs
from docbeam.attention.interface import AttentionCase, AttentionFeatures, Backend
from docbeam.attention.settings import AttentionConfig
from docbeam.models.encoder import EncoderConfig, attention_cases

GLOBAL, LOCAL, BIASED = AttentionFeatures(), AttentionFeatures(local_window=(4, 4)), AttentionFeatures(bias=True)


@dataclasses.dataclass(frozen=True)
class LayerKindsConfig(EncoderConfig):
    """A real EncoderConfig whose layers are of the given kinds (the families that have them live in
    models/; the plan reads only ``attention_features``)."""

    kinds: tuple = (GLOBAL, LOCAL)

    @property
    def attention_features(self) -> tuple:
        return self.kinds


def config(*kinds) -> LayerKindsConfig:
    return LayerKindsConfig(
        vocab_size=100, hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32, max_position=512, kinds=kinds
    )


def spec(backend: str, fallback: str | None = None, **options) -> AttentionConfig:
    """The attention section as the YAML gives it: ``options`` nested under the backend's name."""
    return AttentionConfig.model_validate({"backend": backend, "fallback": fallback, backend: options})


@pytest.fixture
def global_only():
    """A backend that takes segment ids but no window and no bias, registered for the test's length."""
    backend = Backend(
        name="global_only",
        attend=attention.get("native").attend,
        segments=True,
        options_type=attention.get("native").options_type,
    )
    registry._REGISTRY["global_only"] = backend
    yield backend
    del registry._REGISTRY["global_only"]


def test_one_case_per_bucket_and_kind_of_layer():
    cases = attention_cases(config(GLOBAL, LOCAL), [16, 32], "cpu", packed=True)
    assert [(c.seq_len, c.local_window, c.segments) for c in cases] == [
        (16, None, True),
        (16, (4, 4), True),
        (32, None, True),
        (32, (4, 4), True),
    ]
    plain = EncoderConfig(
        vocab_size=100, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position=512
    )
    assert [c.features for c in attention_cases(plain, [16], "cpu")] == [GLOBAL]


def test_a_backend_that_takes_every_kind_runs_the_whole_bucket_and_names_each_kernel():
    choices = choose_backends(spec("chunked"), attention_cases(config(GLOBAL, LOCAL), [16, 32], "cpu"))
    assert [(c.case.seq_len, c.backend, len(c.cases)) for c in choices] == [(16, "chunked", 2), (32, "chunked", 2)]
    assert "global: xla online softmax" in choices[0].kernel and "local window (4, 4): " in choices[0].kernel


@pytest.mark.parametrize(
    "kinds, named",
    [((GLOBAL, LOCAL), "local window (4, 4) layers: it takes no local window"), ((BIASED,), "additive per-head bias")],
)
def test_a_refusal_of_any_kind_falls_the_whole_bucket_back_naming_the_kind(global_only, kinds, named):
    cases = attention_cases(config(*kinds), [16], "cpu")
    [choice] = choose_backends(spec("global_only", fallback="native"), cases)
    assert choice.backend == "native" and choice.cases == tuple(cases) and named in choice.fallback_reason
    with pytest.raises(
        AttentionPlanError, match="bucket 16.*" + named.split(":")[0].replace("(", r"\(").replace(")", r"\)")
    ):
        choose_backends(spec("global_only"), cases)


def test_flash_refusing_bias_on_tpu_falls_the_bucket_back_with_the_kernel_reason():
    cases = [AttentionCase("tpu", "float32", 128, 2, 8).with_features(kind) for kind in (GLOBAL, BIASED)]
    [choice] = choose_backends(spec("flash", fallback="native", kernel="splash_tpu", interpret=True), cases)
    assert choice.backend == "native"
    assert "per-head bias layers: splash_tpu adds no per-head bias" in choice.fallback_reason


def test_probe_inputs_carry_the_window_and_a_relative_bias_that_varies_by_head_and_offset():
    _, _, _, kwargs = probe_inputs(AttentionCase("cpu", "float32", 16, 2, 8, local_window=(3, 1), bias=True))
    assert kwargs["local_window"] == (3, 1)
    bias_NxTxS = kwargs["bias"](jnp.arange(16), jnp.arange(16))
    assert bias_NxTxS.shape == (2, 16, 16)
    assert float(jnp.abs(bias_NxTxS[0] - bias_NxTxS[1]).max()) > 0.1  # per head
    assert float(jnp.abs(bias_NxTxS[0, 0, 1] - bias_NxTxS[0, 1, 2])) == 0  # a function of the offset only
    assert float(jnp.abs(bias_NxTxS[0, 0, 1] - bias_NxTxS[0, 0, 2])) > 0


def ignoring(feature: str):
    """A backend that declares ``feature`` but drops it: only a probe that exercises it can tell."""
    native = attention.get("native")

    def attend(q, k, v, *, kv_lengths_B, scale, options, **features):
        features.pop(feature, None)
        return native.attend(q, k, v, kv_lengths_B=kv_lengths_B, scale=scale, options=options, **features)

    return Backend(
        name=f"ignores_{feature}",
        attend=attend,
        options_type=native.options_type,
        segments=True,
        local_window=True,
        bias=True,
    )


@pytest.mark.parametrize("feature, kind", [("local_window", LOCAL), ("bias", BIASED)])
def test_the_parity_gate_catches_a_backend_that_drops_a_feature_of_one_kind(feature, kind):
    backend = ignoring(feature)
    registry._REGISTRY[backend.name] = backend
    try:
        job = spec(backend.name, fallback="native")
        job = job.model_copy(update={"on_mismatch": "fallback"})
        [choice] = choose_backends(job, attention_cases(config(GLOBAL, kind), [32], "cpu"))
        assert choice.backend == backend.name
        probe(job, choice)  # finite and the right shape: only parity can tell
        [gated] = gate(job, [choice])
        assert gated.backend == "native" and "parity gate" in gated.fallback_reason
        [honest] = gate(
            spec("chunked"), choose_backends(spec("chunked"), attention_cases(config(GLOBAL, kind), [32], "cpu"))
        )
        assert honest.backend == "chunked"
    finally:
        del registry._REGISTRY[backend.name]
