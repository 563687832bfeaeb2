"""``attention.backend: auto``: per bucket, the candidate measured correct and fastest on this chip runs; a wrong
kernel is never run however fast, a slow one never chosen, a raising one refused with its reason, a tie goes to
native; the measurement is cached and read back, measured again when its key changes, and a cached choice is held
to native again before it runs (attention/measure.py)."""

import dataclasses
import json
import os

import pytest

from docbeam.attention import candidates, measure, measure_key, registry
from docbeam.attention.dispatch import AttentionPlanError, choose_backends
from docbeam.attention.interface import AttentionCase
from docbeam.attention.measure import Measurement, Trial, pick
from docbeam.attention.settings import AttentionConfig
from docbeam.config import ConfigError
from docbeam.models.mesh import MeshShape
from docbeam.pipeline.stages.measurement_cache import MeasurementCache

WRONG, SLOW, RAISES, TWIN = (
    f"tests.fixtures_auto_candidates:{name}" for name in ("returns_q", "slow_native", "raises", "native_again")
)
CASE = AttentionCase("cpu", "float32", 64, 4, 16, segments=True)


@pytest.fixture(autouse=True)
def fresh_process_memo(monkeypatch):
    """Each test measures for itself: the process's memo of measurements is emptied."""
    monkeypatch.setattr(measure, "_MEASURED", {})
    monkeypatch.setattr(measure, "BUDGET_S", 0.2)


def auto(*candidates, **more) -> AttentionConfig:
    return AttentionConfig.model_validate({"backend": "auto", "candidates": list(candidates) or None, **more})


def test_a_wrong_kernel_and_a_slow_kernel_are_never_chosen_and_both_are_recorded():
    m = measure.measure_bucket(auto(WRONG, SLOW, "chunked"), (CASE,), 4, (WRONG, SLOW, "chunked"), "cpu: test")
    assert m.chosen in ("native", "chunked")
    wrong, slow, native = m.trial(WRONG), m.trial(SLOW), m.trial("native")
    assert wrong.verdict == "mismatch" and wrong.error > m.tolerance and "differs from native" in wrong.reason
    assert wrong.time_ms is None  # never timed, let alone run
    assert slow.verdict == "passed" and slow.error <= m.tolerance
    assert slow.time_ms > 10 * native.time_ms  # the 20 ms sleep on every call
    assert {t.candidate for t in m.trials} == {"native", WRONG, SLOW, "chunked"}


def test_a_candidate_that_raises_is_refused_with_its_reason_and_one_refused_by_its_check_too():
    unpacked_only = "tests.fixtures_user_backend:attend"  # takes no segment ids: a packed bucket is refused
    m = measure.measure_bucket(auto(RAISES, unpacked_only), (CASE,), 2, (RAISES, unpacked_only), "cpu: test")
    assert m.trial(RAISES).verdict == "failed"
    assert "RuntimeError: kernel launch failed: no kernel image for this device" in m.trial(RAISES).reason
    assert m.trial(unpacked_only).verdict == "refused" and "segment" in m.trial(unpacked_only).reason
    assert m.chosen == "native" and m.why == "the only candidate that passed"


def trial(name, ms, spread=0.01, verdict="passed"):
    return Trial(name, verdict, time_ms=ms, spread_ms=spread)


@pytest.mark.parametrize(
    ("trials", "chosen", "why"),
    [
        ([trial("native", 10.0), trial("flash", 5.0)], "flash", "fastest: 2.00x native"),
        ([trial("native", 10.0), trial("flash", 9.7)], "native", "a tie"),  # 3% is within MIN_GAIN
        ([trial("native", 10.0, 1.0), trial("flash", 8.5, 1.0)], "native", "a tie"),  # 15% within 20% noise
        ([trial("native", 10.0), trial("flash", 12.0)], "native", "fastest"),
        ([trial("native", None, verdict="mismatch"), trial("flash", 12.0)], "flash", "native did not pass"),
        ([trial("native", 1.0, verdict="mismatch"), trial("flash", 1.0, verdict="failed")], "", "no candidate"),
    ],
)
def test_the_fastest_that_passed_runs_and_a_tie_within_the_noise_goes_to_native(trials, chosen, why):
    got, reason = pick(trials)
    assert got == chosen and why in reason


def test_native_under_another_name_loses_the_tie():
    m = measure.measure_bucket(auto(TWIN), (CASE,), 4, (TWIN,), "cpu: test")
    assert m.trial(TWIN).verdict == "passed"
    assert m.chosen == "native", m.describe()


def test_native_too_large_to_time_and_nothing_else_correct_runs_native_as_without_auto(monkeypatch):
    monkeypatch.setattr(measure, "NATIVE_MEMORY_SHARE", 1e-9)  # native too large to time: only the candidates
    m = measure.measure_bucket(auto(WRONG), (CASE,), 2, (WRONG,), "cpu: test")
    assert m.chosen == "native" and "untimed" in m.why and m.trial(WRONG).verdict == "mismatch"


def test_nothing_that_can_run_stops_the_job_naming_each_candidate(monkeypatch):
    def refuses(case, options):
        return measure.Support(ok=False, reason="not today")

    native = registry.get("native")
    monkeypatch.setitem(registry._REGISTRY, "native", dataclasses.replace(native, supports=refuses))
    with pytest.raises(
        AttentionPlanError, match="no candidate can run bucket 64.*native: refused \\(not today\\).*mismatch"
    ):
        measure.measure_bucket(auto(WRONG), (CASE,), 2, (WRONG,), "cpu: test")


def test_native_too_large_for_the_chip_is_refused_with_the_figure_and_still_the_reference(monkeypatch):
    monkeypatch.setattr(measure, "NATIVE_MEMORY_SHARE", 1e-9)
    m = measure.measure_bucket(auto("chunked", WRONG), (CASE,), 2, ("chunked", WRONG), "cpu: test")
    assert m.trial("native").verdict == "refused" and "GiB" in m.trial("native").reason
    assert m.trial(WRONG).verdict == "mismatch"  # held to native's output, computed a head at a time
    assert m.chosen == "chunked" and m.trial("chunked").error < 1e-5


def test_the_measurement_is_cached_read_on_the_second_run_and_measured_again_when_its_key_changes(
    tmp_path, monkeypatch
):
    spec, cache = auto("chunked", WRONG), MeasurementCache(str(tmp_path / "jax-cache"))
    first = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    assert not first.cached and first.measure_s > 0
    assert os.listdir(tmp_path / "jax-cache" / "docbeam-attention") == [f"{first.key}.json"]
    monkeypatch.setattr(measure, "_MEASURED", {})  # the next day's process

    def never(*args, **kwargs):
        raise AssertionError("measured again although the cache holds it")

    monkeypatch.setattr(measure, "measure_bucket", never)
    second = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    assert second.cached and second.chosen == first.chosen and second.measure_s == 0
    assert second.trial(WRONG).verdict == "mismatch"
    monkeypatch.undo()
    monkeypatch.setattr(measure, "_MEASURED", {})
    monkeypatch.setattr(measure, "BUDGET_S", 0.2)
    monkeypatch.setattr(measure_key, "library_versions", lambda: (("jax", "99.0"),))  # an upgrade
    third = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    assert not third.cached and third.key != first.key
    for changed in (dataclasses.replace(CASE, dtype="bfloat16"), dataclasses.replace(CASE, seq_len=32)):
        assert measure.cache_key(spec, (changed,), 4, ("chunked",), "d", MeshShape()) != measure.cache_key(
            spec, (CASE,), 4, ("chunked",), "d", MeshShape()
        )
    assert measure.cache_key(spec, (CASE,), 4, ("chunked",), "d", MeshShape(2, 1)) != measure.cache_key(
        spec, (CASE,), 4, ("chunked",), "d", MeshShape()
    )


def test_a_tampered_cache_that_names_a_wrong_kernel_is_not_trusted(tmp_path, caplog):
    spec, cache = auto("chunked", WRONG), MeasurementCache(str(tmp_path))
    first = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    path = cache.path(first.key)
    raw = json.loads(open(path).read())
    for name, t in raw["candidates"].items():
        t["verdict"] = "chosen" if name == WRONG else "passed"
    raw["chosen"] = WRONG
    raw["tolerance"] = 1e30  # the file's own tolerance is never the one it is held to
    open(path, "w").write(json.dumps(raw))
    measure._MEASURED.clear()
    again = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    assert again.chosen != WRONG and not again.cached
    assert "is not used: it differs from native" in caplog.text
    assert json.loads(open(path).read())["chosen"] == again.chosen  # the cache is written right


def test_a_cache_file_naming_code_outside_the_candidates_is_never_imported(tmp_path, caplog):
    """A tampered gs:// cache cannot make a worker import and run a function of its choosing."""
    spec, cache = auto("chunked"), MeasurementCache(str(tmp_path))
    first = measure.measured(spec, (CASE,), 2, MeshShape(1, 1), cache)
    raw = json.loads(open(cache.path(first.key)).read())
    raw["candidates"] = {"os:abort": {"verdict": "chosen", "time_ms": 0.001}, "native": {"verdict": "passed"}}
    raw["chosen"] = "os:abort"
    open(cache.path(first.key), "w").write(json.dumps(raw))
    measure._MEASURED.clear()
    again = measure.measured(spec, (CASE,), 2, MeshShape(1, 1), cache)
    assert again.chosen in ("native", "chunked") and "measuring again" in caplog.text
    assert "os:abort" not in registry._REGISTRY


@pytest.mark.parametrize("damage", ["{not json", '{"chosen": 5}', '{"chosen": "native", "candidates": []}', "[]"])
def test_a_damaged_cache_entry_is_measured_again_with_a_warning(tmp_path, caplog, damage):
    spec, cache = auto("chunked"), MeasurementCache(str(tmp_path))
    key = measure.cache_key(
        spec, (CASE,), 2, ("native", "chunked"), measure.device_kind(), MeshShape(1, 1), min_gain=measure.MIN_GAIN
    )
    os.makedirs(cache.folder)
    open(cache.path(key), "w").write(damage)
    m = measure.measured(spec, (CASE,), 2, MeshShape(1, 1), cache)
    assert not m.cached and "cannot be used" in caplog.text


def test_a_cache_file_claiming_zero_rows_is_measured_again(tmp_path, caplog):
    spec, cache = auto("chunked", WRONG), MeasurementCache(str(tmp_path))
    first = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    raw = json.loads(open(cache.path(first.key)).read())
    raw.update(rows_per_chip=0, chosen=WRONG)
    for name, t in raw["candidates"].items():
        t["verdict"] = "chosen" if name == WRONG else "passed"
    open(cache.path(first.key), "w").write(json.dumps(raw))
    measure._MEASURED.clear()
    again = measure.measured(spec, (CASE,), 4, MeshShape(1, 1), cache)
    assert again.chosen != WRONG and "for other rows or candidates" in caplog.text


def test_a_second_job_of_the_process_choosing_alike_has_an_equal_choice_so_it_finds_the_warm_encoder(tmp_path):
    spec, cache = auto("chunked"), MeasurementCache(str(tmp_path))
    first = measure.measured(spec, (CASE,), 2, MeshShape(1, 1), cache)
    second = measure.measured(spec, (CASE,), 2, MeshShape(1, 1), cache)
    assert second.cached and not first.cached and second == first and hash(second) == hash(first)


def test_the_key_holds_native_and_every_module_of_the_kernels():
    with_native = AttentionConfig.model_validate({"backend": "auto", "native": {"implementation": "jax_nn"}})
    assert measure.cache_key(with_native, (CASE,), 2, ("native", "chunked"), "d", MeshShape()) != measure.cache_key(
        auto(), (CASE,), 2, ("native", "chunked"), "d", MeshShape()
    )
    flash_digest = measure_key.code_digest("flash[cudnn]")
    assert flash_digest == measure_key.code_digest("chunked")  # docbeam's own: every module of attention/
    assert measure_key.code_digest(TWIN) != flash_digest


def test_a_cache_that_cannot_be_written_only_warns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    m = measure.measured(auto("chunked"), (CASE,), 2, MeshShape(1, 1), MeasurementCache(str(blocker)))
    assert m.chosen and "cannot be cached" in caplog.text


def test_default_candidates_are_every_backend_and_each_flash_kernel_with_your_plug_ins():
    labels = candidates.default_candidates()
    assert {"native", "chunked", "flash[tokamax_chunked]", "flash[cudnn]", "flash[pallas_tpu]"} <= set(labels)
    assert "flash" not in labels  # its kernels one by one instead
    assert "flash[chunked]" not in labels  # the chunked backend itself: measured once
    assert set(labels) >= set(registry.names()) - {"flash"}


def test_a_chip_of_a_mesh_is_measured_at_its_share_of_heads_and_rows():
    case = AttentionCase("cpu", "float32", 64, 8, 16, num_kv_heads=2)
    # 2 k/v heads over a model axis of 4: replicated, each chip gathering one per query head (attention/on_mesh.py)
    assert measure.chip_case(case, 4).num_heads == 2 and measure.chip_case(case, 4).kv_heads == 2
    assert measure.chip_case(case, 2).num_heads == 4 and measure.chip_case(case, 2).kv_heads == 1
    biased = AttentionCase("cpu", "float32", 64, 8, 16, bias=True)
    assert measure.chip_case(biased, 4).num_heads == 8  # GSPMD: every head on every chip


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"backend": "auto", "fallback": "chunked"}, "attention.fallback: 'chunked' with attention.backend: auto"),
        ({"backend": "native", "candidates": ["chunked"]}, "attention.candidates is read only with"),
        ({"backend": "auto", "candidates": ["nope"]}, "attention.candidates: unknown backend 'nope'"),
        ({"backend": "auto", "candidates": ["flash[nope]"]}, "has no kernel 'nope'; its kernels: pallas_tpu"),
        ({"backend": "auto", "candidates": ["native[x]"]}, "backend 'native' has no kernel option"),
        ({"backend": "auto", "candidates": ["auto"]}, "'auto' is what chooses among the candidates"),
        ({"backend": "auto", "candidates": []}, "an empty list measures nothing"),
        ({"backend": "auto", "candidates": ["chunked"], "native": {"implementation": "jax_nn"}, "flash": {}}, "flash"),
    ],
)
def test_auto_settings_are_checked_at_load_naming_the_key(section, message):
    from docbeam import config

    raw = {"input": {"path": "x"}, "output": {"path": "/tmp/o"}, "attention": section}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        config.parse(raw, base_dir="/")


def test_options_of_a_candidate_are_read_and_auto_plans_native_until_measured():
    spec = AttentionConfig.model_validate(
        {"backend": "auto", "candidates": ["flash[chunked]"], "flash": {"block_q": 256}, "fallback": "native"}
    )
    assert candidates.options_of(spec, "flash[chunked]").kernel == "chunked"
    assert candidates.options_of(spec, "flash[chunked]").block_q == 256
    (choice,) = choose_backends(spec, [CASE])
    assert (choice.requested, choice.backend, choice.to_measure) == ("auto", "native", True)


def test_a_worker_on_another_kind_of_chip_measures_for_itself(tmp_path, monkeypatch):
    """The driver measured on a TPU (say); this worker is a CPU: it measures its own, once per process."""
    from docbeam.attention.dispatch import Choice
    from docbeam.pipeline.stages import encode

    spec = auto("chunked", WRONG)
    elsewhere = Measurement(64, 4, "tpu: TPU v5 lite", "chunked", "fastest", (Trial("chunked", "chosen"),), 1e-5, 1.0)
    planned = Choice(CASE, "auto", "chunked", "", measurement=elsewhere)

    class Plan:
        attention, mesh = spec, MeshShape(1, 1)

    class Spec:
        plan, tokens_per_batch, compilation_cache = Plan, 256, str(tmp_path)

    (mine,) = encode.measured_here(Spec, (planned,))
    assert mine.measurement.device == measure.device_kind() != elsewhere.device
    assert mine.measurement.rows == 4 and mine.measurement.trial(WRONG).verdict == "mismatch"
    assert encode.measured_here(Spec, (mine,)) == (mine,)  # measured on this chip: kept as it is


def test_a_named_backend_is_not_measured():
    (choice,) = choose_backends(AttentionConfig(backend="chunked"), [CASE])
    assert choice.measurement is None and not choice.to_measure
