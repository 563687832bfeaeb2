"""The attention registry and the backends' capability checks: names, options and refusals."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from docbeam import attention
from docbeam.attention import AttentionCase, flash, registry

USER_BACKEND = "tests.fixtures_user_backend:attend"


def case(platform="cpu", dtype="float32", seq_len=128, num_heads=2, head_dim=64):
    return AttentionCase(platform=platform, dtype=dtype, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim)


def flash_support(platform="cpu", dtype="float32", head_dim=64, **options):
    backend = attention.get("flash")
    return backend.supports(case(platform, dtype, head_dim=head_dim), backend.parse_options(options))


def test_builtin_backends_are_registered():
    assert {"native", "chunked", "flash"} <= set(attention.names())


def test_registering_a_taken_name_raises():
    with pytest.raises(ValueError, match="'native' is registered twice"):
        attention.register("native")(lambda q, k, v, *, kv_lengths_B, scale, options: q)
    assert attention.get("native").attend.__module__ == "docbeam.attention.native"


def test_unknown_backend_lists_valid_names():
    with pytest.raises(registry.UnknownBackendError, match="'flsh'") as error:
        attention.get("flsh")
    for name in ("native", "chunked", "flash"):
        assert name in str(error.value)


def test_user_backend_from_module_path_loads_and_matches_native(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1]))
    backend = attention.get(USER_BACKEND)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32) for _ in "qkv")
    kv_lengths_B = jnp.array([40, 7], jnp.int32)

    out = backend.bind()(q, k, v, kv_lengths_B=kv_lengths_B, scale=0.25)
    expected = attention.get("native").bind()(q, k, v, kv_lengths_B=kv_lengths_B, scale=0.25)

    np.testing.assert_allclose(out[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(out[1, :7], expected[1, :7], atol=1e-5)
    assert backend.supports(case(seq_len=8192), backend.parse_options(None)).ok is False


def test_user_backend_that_cannot_be_imported_names_the_spec():
    with pytest.raises(registry.UnknownBackendError, match="no_such_module:attend"):
        attention.get("no_such_module:attend")


@pytest.mark.parametrize(
    "name,raw,bad_key",
    [
        ("flash", {"blok_q": 1}, "blok_q"),
        ("flash", {"block_q": 0}, "block_q"),
        ("flash", {"kernel": "pallas"}, "kernel"),
        ("chunked", {"key_chunk": -4}, "key_chunk"),
        ("chunked", {"query_chunk": 0}, "query_chunk"),
        ("chunked", {"heads_per_step": -1}, "heads_per_step"),
        ("chunked", {"query_chunk": "big"}, "query_chunk"),
        ("flash", {"kernel": "chunkd"}, "kernel"),
        ("native", {"block_q": 128}, "block_q"),
    ],
)
def test_bad_option_is_refused_naming_the_key(name, raw, bad_key):
    with pytest.raises(pydantic.ValidationError, match=bad_key):
        attention.get(name).parse_options(raw)


def test_flash_auto_names_the_kernel_each_platform_runs():
    assert flash_support("cpu").kernel == "docbeam.chunked (xla online softmax, chunks tuned per length)"
    assert flash_support("tpu").kernel == "pallas.tpu.flash_attention"
    assert flash_support("gpu", "bfloat16").kernel == "jax.nn.dot_product_attention[cudnn]"
    assert flash_support("gpu", "float32").kernel == "tokamax.triton"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seq_len", [128, 8192])
def test_flash_auto_on_cpu_picks_docbeam_chunked_before_tokamax(dtype, seq_len):
    # The order is measured: benchmarks/results/attention-flash-cpu.json holds the figures.
    assert flash.PLATFORM_KERNELS["cpu"] == ("chunked", "tokamax_chunked")
    name, support = flash.pick_kernel(
        case("cpu", dtype, seq_len=seq_len, num_heads=12, head_dim=32), flash.FlashOptions()
    )
    assert name == "chunked" and support.ok


def test_chunked_sizes_on_cpu_come_from_the_tuned_table_unless_set():
    from docbeam.attention.chunk_sizes import TUNED_CHUNKS, ChunkedOptions, chunk_sizes

    for length, query_chunk, key_chunk, heads_per_step in TUNED_CHUNKS:
        assert chunk_sizes(ChunkedOptions(), length, "cpu") == (query_chunk, key_chunk, heads_per_step)
    assert chunk_sizes(ChunkedOptions(), 10 * TUNED_CHUNKS[-1][0], "cpu") == TUNED_CHUNKS[-1][1:]
    assert chunk_sizes(ChunkedOptions(query_chunk=64, key_chunk=48, heads_per_step=0), 8192, "cpu") == (64, 48, 0)
    assert chunk_sizes(ChunkedOptions(key_chunk=48), 1, "cpu") == (TUNED_CHUNKS[0][1], 48, TUNED_CHUNKS[0][3])


@pytest.mark.parametrize(
    "table, results",
    [("TUNED_CHUNKS", "chunk_sweep.json"), ("TUNED_CHUNKS_BFLOAT16", "chunk_sweep-bfloat16.json")],
)
def test_each_cpu_table_is_its_committed_sweeps_choice(table, results):
    from docbeam.attention import chunk_sizes

    sweep = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / results
    record = json.loads(sweep.read_text())
    assert record["args"]["dtype"] == ("bfloat16" if "BFLOAT16" in table else "float32")
    assert {str(row[0]): row[1:] for row in getattr(chunk_sizes, table)} == {
        length: (c["query_chunk"], c["key_chunk"], c["heads_per_step"]) for length, c in record["chosen"].items()
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_layers_sizes_are_both_dtypes_local_sweeps_choice(dtype):
    """One (query chunk, heads per step) for local layers, whatever q's dtype: each dtype's sweep
    (``chunk_sweep.py --local-window``) chose the pair the code holds, measured against those sizes."""
    from docbeam.attention import chunk_sizes

    sweep = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"chunk_sweep-local-{dtype}.json"
    record = json.loads(sweep.read_text())
    assert record["args"]["dtype"] == dtype and record["args"]["local_window"]
    assert record["current"] == [chunk_sizes.LOCAL_QUERY_CHUNK, chunk_sizes.LOCAL_HEADS_PER_STEP]
    chosen = record["chosen"]
    assert (chosen["query_chunk"], chosen["heads_per_step"]) == tuple(record["current"])


def test_bfloat16_q_on_cpu_takes_its_own_table_and_float32_and_other_platforms_do_not():
    from docbeam.attention.chunk_sizes import TUNED_CHUNKS, TUNED_CHUNKS_BFLOAT16, ChunkedOptions, chunk_sizes

    assert TUNED_CHUNKS_BFLOAT16 != TUNED_CHUNKS
    for length, query_chunk, key_chunk, heads_per_step in TUNED_CHUNKS_BFLOAT16:
        assert chunk_sizes(ChunkedOptions(), length, "cpu", "bfloat16") == (query_chunk, key_chunk, heads_per_step)
    assert chunk_sizes(ChunkedOptions(), 2048, "cpu", "float32") == TUNED_CHUNKS[1][1:]
    assert chunk_sizes(ChunkedOptions(), 2048, "cpu", "float16") == TUNED_CHUNKS[1][1:]
    assert chunk_sizes(ChunkedOptions(), 2048, "gpu", "bfloat16") == (512, 1024, 0)
    assert chunk_sizes(ChunkedOptions(query_chunk=64), 2048, "cpu", "bfloat16") == (64, 512, 1)
    # the kernel a case reports is the one its dtype runs
    bf16 = attention.get("chunked").supports(case("cpu", "bfloat16", seq_len=2048, num_heads=12, head_dim=32),
                                             attention.get("chunked").parse_options(None))  # fmt: skip
    assert "chunks 2048x512" in bf16.kernel


@pytest.mark.parametrize(
    "dtype, causal, kv_heads", [("float32", False, 4), ("bfloat16", False, 4), ("bfloat16", True, 2)]
)
def test_chunked_runs_the_sizes_its_case_reports_and_matches_native_with_them(monkeypatch, dtype, causal, kv_heads):
    """The sizes ``supports`` names (the plan's kernel line) are the sizes the call runs, per dtype and causality;
    at 1,100 tokens bfloat16's table splits the keys into three chunks, with padding and two packed windows."""
    from docbeam.attention import chunk_sizes
    from docbeam.attention import chunked as chunked_module

    ran = []

    def recording(*args, **kwargs):
        ran.append(chunk_sizes.layer_chunk_sizes(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(chunked_module, "layer_chunk_sizes", recording)
    t, n, h = 1100, 4, 32
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, t, kv_heads, h)), dtype) for _ in "kv")
    segments = np.zeros((2, t), np.int32)
    segments[0, :700], segments[0, 700:1050], segments[1, :900] = 1, 2, 1
    features = {"segment_ids_BxT": jnp.asarray(segments), **({"causal": True} if causal else {})}
    arguments = dict(kv_lengths_B=jnp.asarray([1050, 900]), scale=h**-0.5, **features)
    chunked = attention.get("chunked")
    out = chunked.bind(chunked.parse_options(None))(q, k, v, **arguments)
    reported = chunked.supports(attention.AttentionCase.of_call(q, k, **features), chunked.parse_options(None))
    assert ran[0] == ran[-1]  # the call's sizes, then supports' own
    query_chunk, key_chunk, heads = ran[0]
    assert f"chunks {min(query_chunk, t)}x{key_chunk}" in reported.kernel
    if dtype == "bfloat16" and not causal:
        assert (query_chunk, key_chunk) == (2048, 512)
    native = attention.get("native").bind()(*(x.astype(jnp.float32) for x in (q, k, v)), **arguments)
    valid = (segments > 0)[:, :, None, None]
    error = float(jnp.max(jnp.abs(jnp.where(valid, out.astype(jnp.float32) - native, 0))))
    assert error <= (2e-2 if dtype == "bfloat16" else 1e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_chunked_sizes_on_accelerators_are_tokamaxs_chunks_not_the_cpu_sweep(platform):
    from docbeam.attention.chunk_sizes import ChunkedOptions, chunk_sizes

    for length in (1, 512, 2048, 8192, 100_000):  # one row, whatever the length: nothing measured per length
        assert chunk_sizes(ChunkedOptions(), length, platform) == (512, 1024, 0)
    assert chunk_sizes(ChunkedOptions(heads_per_step=2), 8192, platform) == (512, 1024, 2)
    support = attention.get("chunked").supports(
        case(platform, "float32", seq_len=8192, num_heads=12, head_dim=32), attention.get("chunked").parse_options(None)
    )
    assert "chunks 512x1024" in support.kernel and "per step" not in support.kernel


def test_flash_platform_table_lists_every_auto_choice():
    table = flash.auto_kernel_table()
    for platform, kernels in flash.PLATFORM_KERNELS.items():
        assert platform in table
        assert all(f"`{kernel}`" in table for kernel in kernels)


def test_flash_refuses_cudnn_off_gpu_and_in_float32():
    off_gpu = flash_support("cpu", "bfloat16", kernel="cudnn")
    float32 = flash_support("gpu", "float32", kernel="cudnn")
    odd_head = flash_support("gpu", "bfloat16", head_dim=36, kernel="cudnn")

    assert not off_gpu.ok and "not cpu" in off_gpu.reason
    assert not float32.ok and "float32" in float32.reason
    assert not odd_head.ok and "head_dim" in odd_head.reason


def test_flash_pallas_tpu_off_tpu_needs_interpret():
    refused = flash_support("cpu", kernel="pallas_tpu")
    interpreted = flash_support("cpu", kernel="pallas_tpu", interpret=True)

    assert not refused.ok and "interpret: true" in refused.reason
    assert interpreted.ok and interpreted.kernel == "pallas.tpu.flash_attention (interpret mode)"


def test_flash_pallas_tpu_refuses_unsupported_head_dim_and_blocks():
    assert "head_dim" in flash_support("tpu", head_dim=192, kernel="pallas_tpu").reason
    assert "block_k" in flash_support("tpu", kernel="pallas_tpu", block_k=64).reason


def test_flash_with_missing_kernel_package_refuses_instead_of_failing_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # makes `import tokamax` raise ImportError

    tokamax_cpu = flash_support("cpu", kernel="tokamax_chunked")
    tokamax_gpu = flash_support("gpu", "float32")
    auto_cpu = flash_support("cpu")  # docbeam's chunked needs nothing beyond JAX

    assert not tokamax_cpu.ok and "tokamax not importable" in tokamax_cpu.reason
    assert not tokamax_gpu.ok and "tokamax not importable" in tokamax_gpu.reason
    assert auto_cpu.ok and auto_cpu.kernel.startswith("docbeam.chunked")


def test_flash_refusal_at_run_time_says_why():
    backend = attention.get("flash")
    q = jnp.zeros((1, 128, 1, 32), jnp.float32)

    with pytest.raises(ValueError, match="set flash.interpret: true"):
        backend.bind(backend.parse_options({"kernel": "pallas_tpu"}))(
            q, q, q, kv_lengths_B=jnp.array([128], jnp.int32), scale=1.0
        )


def test_entry_point_backends_register_by_name_and_a_broken_one_disables_only_itself(tmp_path, monkeypatch):
    from docbeam.attention import registry
    from docbeam.attention.interface import AttentionCase

    dist = tmp_path / "my_kernels-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernels\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[docbeam.attention]\nmy_kernel = fixtures_user_backend:attend\nbroken_kernel = no_such_module:attend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)

    assert {"my_kernel", "broken_kernel"} <= set(registry.names())
    case = AttentionCase(platform="cpu", dtype="float32", seq_len=128, num_heads=2, head_dim=32)
    mine = registry.get("my_kernel")
    assert mine.supports(case, mine.parse_options(None)).ok
    broken = registry.get("broken_kernel")
    refusal = broken.supports(case, broken.parse_options(None))
    assert not refusal.ok and "no_such_module:attend failed to load: ModuleNotFoundError" in refusal.reason


def test_current_platform_is_the_device_in_force_not_only_the_default_backend():
    with jax.default_device(jax.devices("cpu")[0]):
        assert attention.current_platform() == "cpu"
    assert attention.current_platform() == jax.default_backend()


@pytest.mark.parametrize("platform, form", [("cpu", "einsum"), ("gpu", "jax_nn"), ("tpu", "jax_nn")])
def test_native_auto_runs_the_form_its_check_names_for_the_platform_the_trace_runs_on(monkeypatch, platform, form):
    import docbeam.attention.native as native_module

    called = []
    monkeypatch.setattr(native_module, "current_platform", lambda: platform)
    monkeypatch.setattr(native_module, "einsum_attention", lambda *a: called.append("einsum") or a[0])
    monkeypatch.setattr(native_module.jax.nn, "dot_product_attention", lambda q, *a, **k: called.append("jax_nn") or q)
    native = attention.get("native")
    options = native.parse_options({})
    case = attention.AttentionCase(platform=platform, dtype="float32", seq_len=8, num_heads=1, head_dim=4)
    q = jnp.zeros((1, 8, 1, 4))
    native.bind(options)(q, q, q, kv_lengths_B=jnp.array([5]), scale=0.5)
    assert called == [form] and native.supports(case, options).kernel == native_module.KERNELS[form]
