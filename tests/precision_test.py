"""Reduced precision (models/precision.py) and its precision gate (models/precision_gate.py), on the tiny
checkpoint: where bfloat16 is spent (the compiled HLO), int8 weights per channel, and a gate that refuses a
precision that fails it, naming the gate."""

from __future__ import annotations

import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_BATCHING

from docbeam import attention
from docbeam.models import checkpoint, encoder, precision, precision_gate

PROJECTIONS = ("qkv", "out", "wi", "wo")


def compiled_hlo(folder: str, dtype: str) -> str:
    ck = checkpoint.open_checkpoint(folder, dtype)
    params = checkpoint.load_params(ck.folder, ck.config)
    embed = jax.jit(encoder.embed_fn(ck.config, attention.get("native").bind(), "mean"))
    shape = jax.ShapeDtypeStruct((2, 16), np.int32)
    return embed.lower(params, shape, jax.ShapeDtypeStruct((2,), np.int32)).compile().as_text()


def dots_and_ops(hlo: str):
    """({(projection or op name, lhs type, rhs type, result type): count}, {(opcode, result type): count})."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots, ops = collections.Counter(), collections.Counter()
    for line in hlo.splitlines():
        op = re.search(r"= (\w+)\[[^\]]*\][^ ]* ([\w\-]+)\(", line)
        if op:
            ops[(op.group(2), op.group(1))] += 1
        dot = re.search(r"= (\w+)\[[^\]]*\][^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\).*op_name=\"([^\"]+)\"", line)
        if dot:
            dots[(dot.group(4).split("/")[-2], types[dot.group(2)], types[dot.group(3)], dot.group(1))] += 1
    return dots, ops


def test_bfloat16_projections_take_bf16_inputs_and_accumulate_in_float32(tiny_checkpoint_dir):
    """XLA:CPU upcasts a dot whose result is bfloat16 (both inputs converted to float32): every projection
    must reach the compiled program as bf16 × bf16 → f32, or bfloat16 only adds converts."""
    dots, _ = dots_and_ops(compiled_hlo(tiny_checkpoint_dir, "bfloat16"))
    projections = {(name, lhs, rhs, out) for name, lhs, rhs, out in dots if name in PROJECTIONS}
    assert projections == {(name, "bf16", "bf16", "f32") for name in PROJECTIONS}


def test_bfloat16_keeps_norms_softmax_and_pooling_in_float32(tiny_checkpoint_dir):
    _, ops = dots_and_ops(compiled_hlo(tiny_checkpoint_dir, "bfloat16"))
    for opcode in ("exponential", "rsqrt", "reduce", "divide", "erf"):  # softmax, norms, pooling, gelu
        assert ops[(opcode, "f32")] and not ops[(opcode, "bf16")], opcode
    assert ops[("add", "f32")] and not ops[("add", "bf16")]  # the residual stream and the biases


def test_int8_projections_run_int8_dots_accumulated_in_int32(tiny_checkpoint_dir):
    dots, _ = dots_and_ops(compiled_hlo(tiny_checkpoint_dir, "int8"))
    projections = {(name, lhs, rhs, out) for name, lhs, rhs, out in dots if name in PROJECTIONS}
    assert projections == {(name, "s8", "s8", "s32") for name in PROJECTIONS}


@pytest.mark.parametrize("dtype, kernel_dtype", [("bfloat16", jnp.bfloat16), ("int8", np.int8)])
def test_weights_take_the_precision_once_at_load(tiny_checkpoint_dir, dtype, kernel_dtype):
    ck = checkpoint.open_checkpoint(tiny_checkpoint_dir, dtype)
    layer = checkpoint.load_params(ck.folder, ck.config)["layer_0"]
    for linear in (layer["attn"]["qkv"], layer["attn"]["out"], layer["mlp"]["wi"], layer["mlp"]["wo"]):
        assert linear["kernel"].dtype == kernel_dtype and linear["bias"].dtype == np.float32
        assert ("scale" in linear) == (dtype == "int8")
    assert layer["attn_norm"]["scale"].dtype == np.float32  # norms keep float32 weights


def test_int8_weights_per_output_channel_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    kernel_IxO = rng.standard_normal((64, 8)).astype(np.float32) * np.logspace(-3, 1, 8, dtype=np.float32)
    q_IxO, scale_O = precision.quantize_channels(kernel_IxO)
    assert q_IxO.dtype == np.int8 and scale_O.shape == (8,) and np.abs(q_IxO).max() <= 127
    error_IxO = np.abs(q_IxO * scale_O - kernel_IxO)
    assert (error_IxO <= scale_O / 2 + 1e-7).all()
    # One scale for the whole tensor would round the smallest channel (absmax ~1e-3) to zero; per channel
    # it keeps ~2 significant digits.
    small = kernel_IxO[:, 0]
    assert np.abs(q_IxO[:, 0] * scale_O[0] - small).max() < 0.01 * np.abs(small).max()


def test_int8_matmul_matches_float_within_the_quantisation_bound():
    rng = np.random.default_rng(1)
    x_NxI, kernel_IxO = rng.standard_normal((16, 64)), rng.standard_normal((64, 32))
    q_IxO, scale_O = precision.quantize_channels(kernel_IxO)
    ours = np.asarray(precision.int8_matmul(jnp.asarray(x_NxI, jnp.float32), q_IxO, scale_O))
    exact = x_NxI @ kernel_IxO
    assert np.abs(ours - exact).max() < 0.03 * np.abs(exact).max()


def test_reduced_precisions_stay_close_to_float32_on_the_tiny_model(tiny_checkpoint_dir):
    from encoder_test import inputs, ours_hidden, valid_rows

    ids, lengths = inputs(3, 24)
    f32 = valid_rows(ours_hidden(tiny_checkpoint_dir, ids, lengths), lengths)
    for dtype in ("bfloat16", "int8"):
        cos = precision_gate.cosines(
            valid_rows(ours_hidden(tiny_checkpoint_dir, ids, lengths, dtype=dtype), lengths), f32
        )
        assert cos.min() > 0.99, dtype


def test_the_gate_passes_float32_against_itself():
    vectors = np.random.default_rng(2).standard_normal((40, 16))
    result = precision_gate.require(precision_gate.measure("bfloat16", vectors, vectors))
    assert result.recall_at_10 == 1.0 and result.lowest_cosine == pytest.approx(1.0) and result.passed


def test_the_gate_refuses_one_bad_document_naming_the_cosine_gate():
    rng = np.random.default_rng(3)
    reference = rng.standard_normal((200, 64))
    vectors = reference.copy()
    vectors[7] += 0.5 * rng.standard_normal(64)  # one document off (cosine ~0.9): a mean would hide it
    result = precision_gate.measure("int8", vectors, reference)
    assert result.mean_cosine > 0.999 and result.failures == [f"lowest cosine {result.lowest_cosine:.4f} < 0.99"]
    with pytest.raises(precision.PrecisionRefused, match=r"int8 fails the precision gate \(lowest cosine 0.[0-8]"):
        precision_gate.require(result)


def test_the_gate_refuses_noisy_neighbours_naming_the_recall_gate():
    rng = np.random.default_rng(4)
    reference = rng.standard_normal((200, 32))
    vectors = reference + 0.12 * rng.standard_normal(reference.shape)  # every cosine ~0.99, neighbours reshuffled
    result = precision_gate.measure("int8", vectors, reference)
    assert result.recall_at_10 < 0.98
    with pytest.raises(precision.PrecisionRefused, match="recall@10 0.[0-9]+ < 0.98"):
        precision_gate.require(result)


def test_recall_counts_shared_neighbours():
    reference = np.eye(12) + 0.01 * np.arange(12)[:, None]
    assert precision_gate.recall_at_k(reference, reference, k=3) == 1.0
    with pytest.raises(ValueError, match="more than 10 documents"):
        precision_gate.recall_at_k(reference[:10], reference[:10])


def test_model_dtype_int8_is_a_config_choice_and_an_unknown_one_names_the_choices(tiny_checkpoint_dir):
    from docbeam import config

    assert config.ModelConfig(dtype="int8").dtype == "int8"
    with pytest.raises(ValueError, match="'int4' is not supported; use one of float32, bfloat16, int8"):
        precision.precision_of("int4")


def with_outlier_channel(source: str, folder) -> str:
    """The checkpoint with one hidden channel 300× the others after every norm (the outlier features real
    BERTs grow): a reduced-precision dot then loses the other channels' digits (bfloat16 keeps 8 bits of
    each product's mantissa; int8 has one scale per token), and neighbours reorder."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, folder)
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if "LayerNorm.weight" in n]:
        tensors[name] = tensors[name].copy()
        tensors[name][3] *= 300.0
    save_file(tensors, path)
    return str(folder)


@pytest.fixture(scope="module")
def gate_input(tmp_path_factory):
    """The sample's first 60 documents: more than enough windows for recall@10, a second's encoding."""
    import gzip

    from conftest import SAMPLE

    path = tmp_path_factory.mktemp("gate-input") / "docs.jsonl"
    with gzip.open(SAMPLE, "rt") as f:
        path.write_text("".join(line for _, line in zip(range(60), f)))
    return str(path)


@pytest.fixture(scope="module")
def outlier_checkpoint(tiny_checkpoint_dir, tmp_path_factory):
    return with_outlier_channel(tiny_checkpoint_dir, tmp_path_factory.mktemp("gate") / "outliers")


def gate_run(gate_input, output, checkpoint_dir, **model):
    """``docbeam run`` on the gate's input, the tiny model's batching, ``model`` keys set, from a YAML file."""
    import yaml
    from cli_runner import run_docbeam

    config = output.parent / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "input": {"path": gate_input},
                "output": {"path": str(output)},
                "model": {"path": checkpoint_dir, **model},
                "batching": TEST_BATCHING,
            }
        )
    )
    return run_docbeam("run", "--config", str(config))


def test_a_run_in_bfloat16_that_passes_its_gate_records_the_figures(gate_input, tiny_checkpoint_dir, tmp_path):
    result = gate_run(gate_input, tmp_path / "out", tiny_checkpoint_dir, dtype="bfloat16")
    assert result.returncode == 0, result.stderr
    gate = json.load(open(tmp_path / "out" / "summary.json"))["precision_gate"]
    assert (gate["dtype"], gate["mode"], gate["status"], gate["failures"]) == ("bfloat16", "enforce", "passed", [])
    assert gate["documents"] == 60 and gate["windows"] > 60  # long documents give several windows
    assert gate["recall_at_10"] >= 0.98 and gate["lowest_cosine"] >= 0.99
    assert "precision  bfloat16: precision gate (60 documents" in result.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_run_in_a_precision_that_fails_its_gate_is_refused_naming_the_gate(
    gate_input, outlier_checkpoint, tmp_path, dtype
):
    result = gate_run(gate_input, tmp_path / "out", outlier_checkpoint, dtype=dtype)
    assert result.returncode == 2, result.stderr
    assert re.search(rf"model.dtype: {dtype} fails the precision gate \(recall@10 0.9[0-7]\d+ < 0.98", result.stderr)
    assert not (tmp_path / "out").exists()  # refused at start: nothing written, no lock taken


def test_under_warn_a_failing_precision_runs_and_the_summary_says_which_gate_failed(
    gate_input, outlier_checkpoint, tmp_path
):
    result = gate_run(gate_input, tmp_path / "out", outlier_checkpoint, dtype="int8", precision_gate="warn")
    assert result.returncode == 0, result.stderr
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    gate = summary["precision_gate"]
    assert (gate["status"], gate["mode"]) == ("failed", "warn")
    assert len(gate["failures"]) >= 1 and gate["failures"][0].startswith("recall@10 0.9")
    assert re.search(r"precision  int8: precision gate .*: FAILS recall@10 0.9\d+ < 0.98", result.stdout)
    assert summary["docs_embedded"] == 60


def test_validate_verify_says_what_run_would_and_off_is_recorded_as_not_run(
    gate_input, outlier_checkpoint, tiny_checkpoint_dir, tmp_path
):
    from conftest import job_config

    from docbeam.pipeline.driver import precision_gate_at_start
    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.tools.validate import validation_report

    cfg = job_config(gate_input, str(tmp_path / "out"), outlier_checkpoint, model={"dtype": "int8"})
    with pytest.raises(precision.PrecisionRefused, match=r"int8 fails the precision gate \(recall@10"):
        validation_report(cfg, verify=True)
    assert "precision gate" not in validation_report(cfg)  # only --verify measures
    warn = job_config(
        gate_input, str(tmp_path / "out"), outlier_checkpoint, model={"dtype": "int8", "precision_gate": "warn"}
    )
    assert re.search(
        r"# precision gate \(60 documents\): int8 vs float32 over \d+ vectors: .*FAILS recall@10",
        validation_report(warn, verify=True),
    )
    off = job_config(
        gate_input, str(tmp_path / "out"), outlier_checkpoint, model={"dtype": "int8", "precision_gate": "off"}
    )
    assert precision_gate_at_start.gate_record(make_plan(off)) == {
        "dtype": "int8",
        "mode": "off",
        "status": "not run",
        "reason": "model.precision_gate: off",
    }
    f32 = job_config(gate_input, str(tmp_path / "out"), tiny_checkpoint_dir)
    assert precision_gate_at_start.checked(make_plan(f32)).precision_gate is None  # float32 is the reference


def test_the_gate_is_not_run_where_the_encoder_runs_elsewhere_and_says_so(gate_input, tiny_checkpoint_dir, tmp_path):
    import dataclasses

    from conftest import job_config

    from docbeam.pipeline.driver import precision_gate_at_start
    from docbeam.pipeline.driver.plan import make_plan

    cfg = job_config(gate_input, str(tmp_path / "out"), tiny_checkpoint_dir, model={"dtype": "bfloat16"})
    plan = make_plan(cfg)
    plan = dataclasses.replace(plan, encoder_plan=dataclasses.replace(plan.encoder_plan, platform="tpu", checked=False))
    record = precision_gate_at_start.gate_record(plan)
    assert record["status"] == "not run"
    assert record["reason"] == (
        "the encoder runs on tpu, not on this machine; run `docbeam validate --verify` on a tpu machine"
    )


def test_int8_is_refused_off_cpu_naming_the_platform_and_what_runs_there(tiny_checkpoint_dir):
    config = checkpoint.open_checkpoint(tiny_checkpoint_dir, "int8").config
    assert {case.dtype for case in encoder.attention_cases(config, [32], "cpu")} == {"float32"}
    with pytest.raises(
        precision.PrecisionRefused, match="model.dtype: int8 is refused on gpu: .*use one of float32, bfloat16$"
    ):
        encoder.attention_cases(config, [32], "gpu")
    bf16 = checkpoint.open_checkpoint(tiny_checkpoint_dir, "bfloat16").config
    assert {case.dtype for case in encoder.attention_cases(bf16, [32], "gpu")} == {"bfloat16"}


def test_the_gate_reads_the_first_documents_of_the_input_and_no_further(gate_input, tmp_path, monkeypatch):
    from conftest import job_config

    from docbeam.pipeline.driver import precision_gate_at_start
    from docbeam.pipeline.records import Document
    from docbeam.pipeline.stages import read

    def endless(path, config, keep=None):  # an input file of any size: the gate must stop at its limit
        for n in range(10**9):
            if n == 50:
                raise AssertionError("read past the documents the gate measures")
            yield Document(f"doc-{n}", "a text", path, n)

    monkeypatch.setattr(read, "path_records", endless)
    docs = precision_gate_at_start.first_documents(job_config(gate_input, str(tmp_path / "out"), "unused"), 40)
    assert [d.id for d in docs] == [f"doc-{n}" for n in range(40)]


def test_the_gate_is_not_run_where_the_workers_mesh_needs_more_chips_than_this_machine_has(
    gate_input, tiny_checkpoint_dir, tmp_path
):
    import dataclasses

    from conftest import job_config

    from docbeam.models.mesh import MeshShape
    from docbeam.pipeline.driver import precision_gate_at_start
    from docbeam.pipeline.driver.plan import make_plan

    plan = make_plan(job_config(gate_input, str(tmp_path / "out"), tiny_checkpoint_dir, model={"dtype": "bfloat16"}))
    eight = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, mesh=MeshShape(8, 1)))  # an 8-chip worker
    record = precision_gate_at_start.gate_record(eight)
    assert record["status"] == "not run"
    assert record["reason"].startswith("the workers' mesh {data: 8, model: 1} needs 8 chips and this machine has 1")
