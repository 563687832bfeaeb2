"""runner.engine (models/engines/): OpenVINO compiles a shape only where it may, is held to XLA's output on the
shape's first batch, and under auto runs only where it is also measured faster; every refusal names its
reason, every record and the summary name the engine that ran, and the engine cache survives damage."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from conftest import drop_warm_encoder, job_config
from engine_fixtures import first_windows

from docbeam import config
from docbeam.attention.settings import AttentionConfig
from docbeam.models.engines import choose, openvino
from docbeam.models.engines.shapes import engine_off

TEXTS = ["a short one", "the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs"]


# --- the config: validated at the edge ---------------------------------------------------------------------------


def test_the_engine_defaults_to_auto_and_a_typo_is_refused_naming_the_choices():
    assert config.RunnerConfig().engine == "auto"
    assert config.RunnerConfig(engine="openvino").engine == "openvino"
    with pytest.raises(ValueError, match="'xla', 'openvino' or 'auto'"):
        config.RunnerConfig(engine="openvno")


# --- the parity gate: pure functions -----------------------------------------------------------------------------


def test_float32_parity_is_the_largest_difference_relative_to_the_outputs_scale():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(4, 8)).astype(np.float32) * 10
    assert choose.parity("float32", reference + 1e-4, reference)[0]  # 1e-5 of a scale of ~30
    passed, figures = choose.parity("float32", reference + 0.05, reference)
    assert not passed and "largest difference" in figures and "at most 0.0001" in figures


def test_bfloat16_parity_is_the_precision_gates_cosine_and_recall_where_there_are_enough_vectors():
    rng = np.random.default_rng(1)
    reference = rng.normal(size=(20, 16)).astype(np.float32)
    passed, figures = choose.parity("bfloat16", reference * 1.01, reference)
    assert passed and "lowest cosine 1.00000" in figures and "recall@10 1.00000" in figures
    wrong = reference.copy()
    wrong[3] = -wrong[3]  # one vector gone wrong: a mean would hide it, the lowest cosine does not
    passed, figures = choose.parity("bfloat16", wrong, reference)
    assert not passed and "below lowest cosine 0.99" in figures
    assert "recall" not in choose.parity("bfloat16", reference[:5], reference[:5])[1]  # 5 vectors: no recall@10


def test_non_finite_outputs_fail_unless_xla_gave_them_too_and_shapes_must_agree():
    reference = np.ones((3, 4), np.float32)
    ours = reference.copy()
    ours[1, 2] = np.nan
    assert choose.parity("float32", ours, reference) == (False, "non-finite outputs where XLA's are finite")
    reference[1, 0] = np.inf  # XLA's row is non-finite too: repaired or rejected downstream either way
    assert choose.parity("float32", ours, reference)[0]
    assert not choose.parity("float32", ours[:2], reference)[0]
    token_lists = [np.ones((2, 4)), np.ones((3, 4))]  # a multi-vector head: each window's kept tokens
    assert choose.parity("float32", token_lists, [t.copy() for t in token_lists])[0]


def test_auto_picks_openvino_only_past_the_minimum_gain_and_the_noise():
    assert choose.pick([1.0] * 5, [0.5] * 5) == ("openvino", "auto: OpenVINO 2.00x XLA")
    engine, why = choose.pick([1.0] * 5, [0.97] * 5)
    assert engine == "xla" and "not faster by more than 5%" in why
    noisy_ov = [0.7, 1.5, 0.1, 1.4, 0.2]  # faster in the median, but within its own spread
    assert choose.pick([1.0] * 5, noisy_ov)[0] == "xla"


def test_auto_times_each_precision_for_itself_though_float32_and_bfloat16_export_one_graph(tmp_path):
    """Both precisions export the same float32 graph (one export key); OpenVINO compiles each to its own kernels, so
    a float32 job's cached verdict must not answer a bfloat16 job (it did, on 2026-12-07: the bfloat16 sides of
    benchmarks/precision.py reported float32's timing)."""
    from docbeam.models.engines.shapes import EngineSet, ShapeForward

    out = np.ones((2, 4), np.float32)
    cached = choose.Verdict("openvino", "auto: OpenVINO 9.00x XLA", xla_ms=9.0, openvino_ms=1.0)
    choose.VerdictCache(str(tmp_path)).write(choose.verdict_key("k", "float32"), cached)

    def verdict(dtype: str) -> choose.Verdict:
        engines = EngineSet("auto", "cpu", 1, dtype, (), lambda backend: None, str(tmp_path))
        shape = ShapeForward(lambda params, x: out, lambda params, x: out.copy(), key="k")
        return engines.decide(shape, None, (None,), lambda o: o)

    assert verdict("float32").cached  # the precision it was measured at reads it
    bfloat16 = verdict("bfloat16")
    assert not bfloat16.cached and bfloat16.reason != cached.reason and bfloat16.xla_ms < 9.0


def test_an_openvino_model_that_xla_outran_is_let_go_once_the_verdict_is_in(tmp_path):
    from docbeam.models.engines.shapes import EngineSet, ShapeForward

    out = np.ones((2, 4), np.float32)
    choose.VerdictCache(str(tmp_path)).write(choose.verdict_key("k", "float32"), choose.Verdict("xla", "auto: XLA"))
    engines = EngineSet("auto", "cpu", 1, "float32", (), lambda backend: None, str(tmp_path))
    shape = ShapeForward(lambda params, x: out, lambda params, x: out.copy(), key="k")
    assert engines.decide(shape, None, (None,), lambda o: o).engine == "xla"
    assert shape.openvino is None  # its compiled model (the weights again) is freed, not kept for nothing


# --- where OpenVINO may not run ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "requested, platform, chips, dtype, backend, reason",
    [
        ("xla", "cpu", 1, "float32", "native", "runner.engine: xla"),
        ("auto", "gpu", 1, "float32", "native", "OpenVINO runs on CPU workers; this worker's chips are gpu"),
        ("openvino", "cpu", 4, "float32", "native", "runner.mesh spreads the encoder over 4"),
        ("auto", "cpu", 1, "int8", "native", "model.dtype int8: OpenVINO runs float32 and bfloat16 only"),
        ("openvino", "cpu", 1, "float32", "flash", "attention backend flash is a kernel for XLA"),
    ],
)
def test_each_place_openvino_may_not_run_is_refused_with_its_reason(requested, platform, chips, dtype, backend, reason):
    assert reason in engine_off(requested, platform, chips, dtype, backend)


def test_bfloat16_is_refused_on_a_cpu_without_native_bfloat16_and_named_by_its_capabilities():
    ov = openvino.openvino_module()

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    refused = openvino.precision_refused("bfloat16")
    assert (refused == "") == ("BF16" in capabilities)
    if refused:  # this machine: OpenVINO would emulate bfloat16, measured 20x slower than XLA
        assert "no native bfloat16" in refused and "FP32" in refused
    assert openvino.precision_refused("float32") == ""


# --- through the runtime a worker loads ---------------------------------------------------------------------------


@pytest.fixture
def users_cache(tmp_path, monkeypatch):
    """No compilation cache configured: the engine cache is in the user's cache folder, here ``tmp_path``."""
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # read by the engine cache only: JAX's is open already
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before)


def test_a_kernel_for_xla_refuses_its_shapes_and_xla_runs_them(tiny_checkpoint_dir):
    import dataclasses

    from benchmarks.common import standalone_spec
    from docbeam.pipeline.stages.encode import load_encoder

    spec = standalone_spec(tiny_checkpoint_dir, "float32", "mean", AttentionConfig(backend="chunked"), [64])
    runtime = load_encoder(dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine="openvino")))
    _, record = runtime.encode(first_windows(tiny_checkpoint_dir, TEXTS, 64, packed=False))
    assert (record["attention_backend"], record["engine"]) == ("chunked", "xla")
    assert "attention backend chunked is a kernel for XLA" in record["engine_reason"]


def test_auto_measures_once_per_cpu_and_the_next_start_reads_the_verdict(tiny_checkpoint_dir, tmp_path, users_cache):
    import dataclasses

    from benchmarks.common import standalone_spec
    from docbeam.pipeline.stages.encode import load_encoder

    spec = standalone_spec(tiny_checkpoint_dir, "float32", "mean", AttentionConfig(), [64])
    spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine="auto"))
    batch = first_windows(tiny_checkpoint_dir, TEXTS, 64, packed=False)
    first = json.loads(load_encoder(spec).encode(batch)[1]["engine_measured"])
    assert first["reason"].startswith("auto: OpenVINO") and first["xla_ms"] > 0 and first["openvino_ms"] > 0
    assert not first["cached"] and "largest difference" in first["parity"]
    folder = tmp_path / "docbeam" / "openvino"
    assert len(glob.glob(str(folder / "*.xml"))) == 1  # the exported model, as IR
    verdicts = glob.glob(str(folder / "verdicts" / "*.json"))
    if verdicts:  # a busy machine's noisy timing is not cached
        again, record = load_encoder(spec).encode(batch)
        second = json.loads(record["engine_measured"])
        assert second["cached"] and second["engine"] == first["engine"] == record["engine"]
        # parity is checked again on every start that runs OpenVINO; a shape kept on XLA never compiles it
        assert ("largest difference" in second["parity"]) == (second["engine"] == "openvino")


@pytest.mark.parametrize("cached", ["xla", "openvino"])
def test_a_shape_auto_kept_on_xla_exports_nothing_the_next_start_and_one_on_openvino_is_held_to_xla_again(
    tiny_checkpoint_dir, tmp_path, users_cache, cached
):
    """A compiled OpenVINO model that XLA outran would hold the weights twice for nothing (a large model's four
    buckets: gigabytes of a CPU worker's memory), so a cached XLA verdict skips OpenVINO altogether."""
    import dataclasses

    from benchmarks.common import standalone_spec
    from docbeam.pipeline.stages.encode import load_encoder

    spec = standalone_spec(tiny_checkpoint_dir, "float32", "mean", AttentionConfig(), [64])
    spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine="auto"))
    batch = first_windows(tiny_checkpoint_dir, TEXTS, 64, packed=False)
    load_encoder(spec).encode(batch)
    folder = tmp_path / "docbeam" / "openvino"
    (xml,) = glob.glob(str(folder / "*.xml"))
    key = os.path.basename(xml)[:-4]
    verdict = choose.Verdict(cached, f"auto: measured {cached} faster here before", xla_ms=1.0, openvino_ms=1.0)
    choose.VerdictCache(str(folder)).write(choose.verdict_key(key, "float32"), verdict)  # whatever was measured
    for path in glob.glob(str(folder / f"{key}.*")):
        os.remove(path)  # exported again only if OpenVINO is to run

    _, record = load_encoder(spec).encode(batch)
    measured = json.loads(record["engine_measured"])
    assert record["engine"] == cached and measured["cached"] and measured["reason"] == verdict.reason
    if cached == "xla":
        assert measured["parity"] == "" and not glob.glob(str(folder / "*.xml"))
    else:
        assert "largest difference" in measured["parity"] and os.path.exists(xml)


def test_a_damaged_model_or_verdict_in_the_cache_is_made_again(tiny_checkpoint_dir, tmp_path, users_cache):
    import dataclasses

    from benchmarks.common import standalone_spec
    from docbeam.pipeline.stages.encode import load_encoder

    spec = standalone_spec(tiny_checkpoint_dir, "float32", "mean", AttentionConfig(), [64])
    spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine="openvino"))
    batch = first_windows(tiny_checkpoint_dir, TEXTS, 64, packed=False)
    reference, record = load_encoder(spec).encode(batch)
    assert record["engine"] == "openvino"
    folder = tmp_path / "docbeam" / "openvino"
    for path in glob.glob(str(folder / "*.xml")):
        with open(path, "w") as f:
            f.write("<net>half a model")
    os.makedirs(folder / "verdicts", exist_ok=True)
    (folder / "verdicts" / "x.json").write_text("{not json")
    again, record = load_encoder(spec).encode(batch)
    assert record["engine"] == "openvino"
    np.testing.assert_allclose(again, reference, rtol=1e-5, atol=1e-6)
    assert choose.VerdictCache(str(folder)).read("x") is None


def test_a_run_names_the_engine_per_batch_per_bucket_in_the_summary_and_on_the_command_line(
    tiny_checkpoint_dir, tmp_path
):
    from docbeam.pipeline.driver.cli import format_summary
    from docbeam.pipeline.driver.run import run_job

    drop_warm_encoder()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS * 4)))
    out = tmp_path / "out"
    summary = run_job(job_config(str(docs), str(out), tiny_checkpoint_dir, runner={"engine": "openvino"}))
    drop_warm_encoder()
    assert summary["engines"] == {"openvino": summary["batches"]}
    for bucket in summary["buckets"].values():
        assert bucket["engines"] == {"openvino: runner.engine: openvino": bucket["batches"]}
    timings = [json.loads(line) for path in glob.glob(f"{out}/timing/*.jsonl") for line in open(path)]
    assert {t["engine"] for t in timings} == {"openvino"}
    assert sum(bool(t["engine_measured"]) for t in timings) == len(summary["buckets"])  # once per shape
    assert 'engine     ran {"openvino":' in format_summary(summary, str(out))


def test_the_engine_imports_openvino_without_sending_usage_telemetry(tmp_path):
    """OpenVINO's import would send a usage event from a forked process (a fork of JAX's threads can deadlock);
    through the engine it sends nothing unless the user opted in."""
    import subprocess
    import sys

    script = (
        "from docbeam.models.engines.openvino import openvino_module\n"
        "openvino_module().Core()\n"
        "import openvino_telemetry\n"
        "print(openvino_telemetry.Telemetry().consent)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}  # no consent file: the user never answered
    env.pop("CI", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
    assert "fork" not in done.stderr
    assert not glob.glob(str(tmp_path / "intel" / "openvino_ga_cid"))  # no client id made for sending
