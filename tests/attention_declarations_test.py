"""A feature is one declaration (attention/features.py). Declared here, in this test alone, a logit soft cap is
known to every part that reads the declarations: each backend not declaring it is refused the cases that ask
for it and its bound function refuses the argument, flash's kernels refuse it naming why, the kernel table grows
its column, and a layer asking for it is named by it and probed with it."""

import numpy as np
import pytest

from docbeam import attention
from docbeam.attention import features, flash
from docbeam.attention.dispatch import ask, probe_inputs
from docbeam.attention.features import Feature
from docbeam.attention.interface import AttentionCase, AttentionFeatures, Backend

SOFTCAP = Feature(
    "softcap",
    "softcap",
    "logit soft cap",
    "it takes no logit soft cap, which this model's layers apply (tanh at {case.softcap})",
    "{kernel} has no logit soft cap",
    describe=lambda cap: f"soft cap {cap}" if cap else "",
    default=None,
)


def capped() -> AttentionCase:
    """A case asking for the soft cap (only while it is declared)."""
    return AttentionCase("cpu", "float32", 64, 2, 8, softcap=30.0)


def passthrough(q, k, v, **kwargs):
    return q


@pytest.fixture
def softcap(monkeypatch):
    monkeypatch.setitem(features.DECLARED, SOFTCAP.name, SOFTCAP)


@pytest.mark.usefixtures("softcap")
def test_every_registered_backend_not_declaring_it_is_refused_naming_it():
    for name in attention.names():
        backend = attention.get(name)
        support = ask(backend, capped(), backend.parse_options(None))
        assert not support.ok, name
        assert "no logit soft cap" in support.reason and "(tanh at 30.0)" in support.reason, name
        assert "register it with softcap=True" in support.reason, name


@pytest.mark.usefixtures("softcap")
def test_a_backend_declaring_it_is_asked_only_its_own_check():
    declares = Backend(name="capped", attend=passthrough, softcap=True)
    assert declares.refusal(capped()) is None
    assert Backend(name="plain", attend=passthrough).refusal(capped()) is not None
    attention.register("capped_test", softcap=True)(passthrough)  # register() takes it as a keyword too
    try:
        assert attention.get("capped_test").softcap
    finally:
        from docbeam.attention import registry

        del registry._REGISTRY["capped_test"]


@pytest.mark.usefixtures("softcap")
def test_a_bound_function_refuses_the_argument_unless_declared():
    x = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="'native' takes no softcap .*softcap=True"):
        attention.get("native").bind()(x, x, x, kv_lengths_B=np.array([4]), scale=1.0, softcap=30.0)
    out = Backend(name="capped", attend=lambda q, k, v, **kw: q, softcap=True).bind()(
        x, x, x, kv_lengths_B=np.array([4]), scale=1.0, softcap=30.0
    )
    assert out.shape == x.shape


@pytest.mark.usefixtures("softcap")
def test_flash_kernels_refuse_it_and_the_table_gets_its_column():
    name, support = flash.pick_kernel(capped(), flash.FlashOptions())
    assert name is None and "chunked has no logit soft cap" in support.reason

    header, _, *rows = flash.feature_table().splitlines()
    assert header.endswith("| logit soft cap |")
    for kernel, row in zip(flash.KERNELS, rows):
        assert row.endswith(f"| no: {kernel} has no logit soft cap |")


@pytest.mark.usefixtures("softcap")
def test_a_layer_asking_for_it_is_named_by_its_declaration():
    layer = AttentionFeatures(softcap=30.0)
    assert layer.describe() == "global, soft cap 30.0"
    assert capped().with_features(AttentionFeatures()).softcap is None  # a layer's own feature, replaced per layer
    assert probe_inputs(capped())[3]["softcap"] == 30.0  # the start-up probe hands it over as the case asks


def test_without_the_declaration_the_name_is_unknown_everywhere():
    with pytest.raises(TypeError, match="unknown attention feature 'softcap'; declared: local_window"):
        AttentionCase("cpu", "float32", 64, 2, 8, softcap=30.0)
    with pytest.raises(TypeError, match="unknown attention feature 'softcap'"):
        Backend(name="capped", attend=passthrough, softcap=True)
    assert "logit soft cap" not in flash.feature_table()


def test_the_names_features_had_before_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'windows' is now called 'local_window'"):
        assert Backend(name="old", attend=passthrough, windows=True).local_window
    with pytest.warns(DeprecationWarning, match="'packed' is now called 'segments'"):
        assert AttentionCase("cpu", "float32", 64, 2, 8, packed=True).segments

    def plain(q, k, v, *, kv_lengths_B, scale):
        return q

    plain.supports_relative = True
    from docbeam.attention.registry import from_callable

    with pytest.warns(DeprecationWarning, match="'relative' is now called 'relative_positions'"):
        assert from_callable("old_plain", plain).relative_positions


def test_a_flash_kernel_naming_an_undeclared_feature_fails_at_import_not_silently():
    from docbeam.attention.flash.kernel import Kernel

    with pytest.raises(ValueError, match=r"unknown features \['windows'\].*declared: local_window"):
        Kernel("typo", lambda case, options: "", passthrough, takes={"windows": "a mask"})
