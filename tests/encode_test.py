"""The encoder as a worker runs it: attention planning at start, fallback, parity gate, and the
memory/compile watch over many batches."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import standalone_spec
from docbeam.attention.dispatch import AttentionPlanError, choose_backends, gate
from docbeam.attention.settings import AttentionConfig
from docbeam.models.checkpoint import open_checkpoint
from docbeam.models.encoder import attention_cases
from docbeam.pipeline.records import TokenWindow
from docbeam.pipeline.stages.encode import EncoderSpec, load_encoder
from docbeam.pipeline.stages.packer import padded_batch, rows_for

TPU_ONLY = {"kernel": "pallas_tpu"}  # the TPU kernel without interpret mode: refused on CPU


def attn(backend="native", options=None, fallback=None, **gate_settings) -> AttentionConfig:
    """The attention section typed once, as the config hands it to the driver and the workers."""
    sections = {backend: options} if options else {}
    return AttentionConfig.model_validate({"backend": backend, "fallback": fallback, **sections, **gate_settings})


def spec(model_dir, backend="native", options=None, fallback=None, **gate_settings) -> EncoderSpec:
    """Planned here, for buckets 16 and 32, as a standalone encoder is."""
    return standalone_spec(
        model_dir, "float32", "mean", attn(backend, options, fallback, **gate_settings), buckets=(16, 32)
    )


def cases(model_dir, buckets=(16, 32)):
    return attention_cases(open_checkpoint(model_dir).config, buckets, "cpu")


def test_unsupported_backend_without_fallback_fails_at_start_naming_the_bucket(tiny_checkpoint_dir):
    s = attn(backend="flash", options=TPU_ONLY)
    with pytest.raises(AttentionPlanError, match=r"cannot run bucket 16 \(cpu.*attention.fallback"):
        choose_backends(s, cases(tiny_checkpoint_dir))


def test_fallback_runs_the_bucket_and_the_timing_record_says_why(tiny_checkpoint_dir):
    s = spec(tiny_checkpoint_dir, backend="flash", options=TPU_ONLY, fallback="native")
    runtime = load_encoder(s)
    batch = padded_batch([TokenWindow("d", 0, 1, np.arange(1, 11, dtype=np.int32), 8, False)], 16, 4)
    vectors, timing = runtime.encode(batch)
    assert vectors.shape == (1, 32) and np.isfinite(vectors).all()
    assert timing["attention_requested"] == "flash" and timing["attention_backend"] == "native"
    assert "interpret" in timing["fallback_reason"]


def test_parity_gate_refuses_a_backend_that_ignores_padding(tiny_checkpoint_dir):
    s = attn(backend="fixtures_broken_backend:attend", verify=True)
    choices = choose_backends(s, cases(tiny_checkpoint_dir))
    with pytest.raises(AttentionPlanError, match="parity gate: .* differs from native"):
        gate(s, choices)


def test_parity_gate_can_fall_back_instead(tiny_checkpoint_dir):
    s = attn(backend="fixtures_broken_backend:attend", verify=True, on_mismatch="fallback", fallback="native")
    gated = gate(s, choose_backends(s, cases(tiny_checkpoint_dir)))
    assert [c.backend for c in gated] == ["native", "native"]
    assert all(c.fallback_reason.startswith("parity gate") for c in gated)


def test_parity_gate_passes_a_correct_backend(tiny_checkpoint_dir):
    s = attn(backend="chunked", verify=True)
    assert [c.backend for c in gate(s, choose_backends(s, cases(tiny_checkpoint_dir)))] == ["chunked", "chunked"]


def test_memory_stays_flat_and_compilation_stops_after_each_shapes_first_batch(tiny_checkpoint_dir):
    runtime = load_encoder(spec(tiny_checkpoint_dir))
    rng = np.random.default_rng(0)
    records = []
    for i in range(80):
        bucket = (16, 32)[i % 2]
        rows = rows_for(bucket, 256)
        n = int(rng.integers(1, rows + 1))  # full and partial batches share one shape
        windows = [
            TokenWindow(
                f"d{i}-{j}", 0, 1, rng.integers(1000, 2000, int(rng.integers(3, bucket + 1)), dtype=np.int32), 1, False
            )
            for j in range(n)
        ]
        records.append(runtime.encode(padded_batch(windows, bucket, rows))[1])
    assert [r["compiled"] for r in records[:2]] == [True, True]
    assert not any(r["compiled"] for r in records[2:])
    in_use = np.array([r["memory_in_use_bytes"] for r in records[10:]])
    assert in_use.max() - in_use[:10].min() < 64 << 20, f"memory grew by {(in_use.max() - in_use[:10].min()) >> 20} MiB"


def test_parity_gate_never_falls_back_to_the_backend_that_failed(tiny_checkpoint_dir):
    s = attn(
        backend="flash",
        options=TPU_ONLY,
        fallback="fixtures_broken_backend:attend",
        verify=True,
        on_mismatch="fallback",
    )
    choices = choose_backends(s, cases(tiny_checkpoint_dir))
    assert {c.backend for c in choices} == {"fixtures_broken_backend:attend"}  # flash refused on CPU
    with pytest.raises(AttentionPlanError, match="parity gate"):
        gate(s, choices)


def test_on_cpu_the_forward_compiles_with_xlas_memory_optimized_scheduler(tmp_path, real_checkpoint_dir):
    """Fewer intermediates live at once (models/runtime.py CPU_COMPILER_OPTIONS): the runtime's compiled forward
    (a long-document layout: chunked attention over 512 tokens) has fewer temporaries than the default schedule's,
    and the same output."""
    import jax
    from conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint(str(tmp_path / "bert"), real_checkpoint_dir, layers=4, hidden=64)
    runtime = load_encoder(standalone_spec(folder, "float32", "mean", attn("chunked"), buckets=(512,)))
    jitted = runtime.forwards["chunked"]
    ids = np.random.default_rng(0).integers(1000, 20000, (2, 512)).astype(np.int32)
    call = (runtime.params, ids, np.array([512, 460], np.int32))
    ours = jitted.lower(*call).compile()
    default = jitted.lower(*call).compile(compiler_options={"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT"})
    temp = lambda compiled: compiled.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert jax.devices()[0].platform == "cpu" and temp(ours) < temp(default)
    np.testing.assert_array_equal(np.asarray(ours(*call)), np.asarray(default(*call)))
