"""The device check's attention part (benchmarks/device_check.py): every backend and flash kernel against native,
per length, dtype and kind of layer, in one process. Each row: which kernel the plan picked (or why the
backend refused), the largest difference from native's output, the best time of a few calls, and the compiled
executable's peak memory as XLA's buffer assignment states it (arguments + outputs + temporaries: per case,
with no process per case, which a lease of minutes cannot afford)."""

from __future__ import annotations

import time

import numpy as np

LENGTHS = (512, 2048, 8192, 32768)
SMALL_LENGTHS = (128,)  # the rehearsal: one length, every backend, dtype and layer
DTYPES = ("float32", "bfloat16")
# (label, backend, options): native first, the reference of every other row. ``flash`` itself is not timed: its
# row says which of the flash/<kernel> rows ``kernel: auto`` picked for the case, as the plan would.
VARIANTS = (
    ("native", "native", {}),
    ("chunked", "chunked", {}),
    ("flash/cudnn", "flash", {"kernel": "cudnn"}),
    ("flash/tokamax_triton", "flash", {"kernel": "tokamax_triton"}),
    ("flash/tokamax_chunked", "flash", {"kernel": "tokamax_chunked"}),
)  # pallas_gpu: superseded by triton
LAYERS = ("padded", "packed", "local_window", "causal_grouped")


def shape(small: bool) -> dict:
    """Heads, head size, key/value heads of the grouped case and the local window: ModernBERT's 64-wide heads
    and ±64 window, 8 heads so that native's float32 scores at 32k tokens (34 GB) fit the chip twice."""
    if small:
        return {"heads": 2, "head_dim": 16, "kv_heads": 1, "window": (8, 8)}
    return {"heads": 8, "head_dim": 64, "kv_heads": 2, "window": (64, 64)}


def layer_case(layer: str, platform: str, dtype: str, length: int, dims: dict):
    from docbeam.attention import AttentionCase

    return AttentionCase(
        platform=platform,
        dtype=dtype,
        seq_len=length,
        num_heads=dims["heads"],
        head_dim=dims["head_dim"],
        segments=layer == "packed",
        local_window=dims["window"] if layer == "local_window" else None,
        causal=layer == "causal_grouped",
        num_kv_heads=dims["kv_heads"] if layer == "causal_grouped" else None,
    )


def inputs(case, seed: int = 0) -> dict:
    """q, k, v in the case's dtype, one row whose last eighth is padding; packed rows hold two windows."""
    import jax
    import jax.numpy as jnp

    t, valid = case.seq_len, case.seq_len - case.seq_len // 8
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    dtype = jnp.dtype(case.dtype)
    args = {
        "q": jax.random.normal(kq, (1, t, case.num_heads, case.head_dim), dtype),
        "k": jax.random.normal(kk, (1, t, case.kv_heads, case.head_dim), dtype),
        "v": jax.random.normal(kv, (1, t, case.kv_heads, case.head_dim), dtype),
        "lengths": jnp.asarray([valid], jnp.int32),
    }
    if case.segments:
        position = jnp.arange(t)[None, :]
        args["segments"] = jnp.where(position < valid, 1 + (position >= t // 2), 0).astype(jnp.int32)
    return args


def refusal(backend, options, case) -> tuple[str, str]:
    """(kernel, "") when the backend runs the case, else ("", why not), as the plan would answer."""
    refused = backend.refusal(case)
    if refused is not None:
        return "", refused.reason
    support = backend.supports(case, options)
    return (support.kernel or backend.name, "") if support.ok else ("", support.reason)


def compiled_call(backend, options, case, args: dict):
    """The bound backend jitted for these arguments, compiled: (compiled, its peak bytes)."""
    import jax

    attend = backend.bind(options)
    features = {"local_window": case.local_window, "causal": case.causal}

    def run(q, k, v, lengths, segments=None):
        return attend(q, k, v, kv_lengths_B=lengths, scale=case.head_dim**-0.5, segment_ids_BxT=segments, **features)

    compiled = jax.jit(run).lower(**args).compile()
    stats = compiled.memory_analysis()
    peak = (
        None
        if stats is None
        else int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)
    )
    return compiled, peak


def best_seconds(fn, repeats: int = 5, within_s: float = 2.0) -> float:
    """The fastest of up to ``repeats`` calls after one warm call, fewer when the calls take ``within_s``."""
    fn().block_until_ready()
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > within_s:
            break
    return best


def run_variant(label: str, backend_name: str, raw_options: dict, case, args: dict, reference) -> tuple[dict, object]:
    from docbeam import attention

    backend = attention.get(backend_name)
    options = backend.parse_options(raw_options)
    row = {"variant": label}
    row["kernel"], row["refused"] = refusal(backend, options, case)
    if row["refused"]:
        return row, None
    compiled, row["peak_bytes"] = compiled_call(backend, options, case, args)
    out = compiled(**args)
    row["seconds"] = best_seconds(lambda: compiled(**args))
    if reference is not None:
        valid = int(args["lengths"][0])  # padded query rows carry no meaning: compared up to the valid length
        diff = np.abs(np.asarray(out[:, :valid], np.float32) - np.asarray(reference[:, :valid], np.float32))
        row["max_abs_diff"] = float(diff.max())
    return row, out


def picked(case) -> dict:
    """The ``flash`` row: the kernel ``kernel: auto`` picks for the case (its flash/<kernel> row holds the
    figures), or why none can run it."""
    from docbeam.attention.flash import FlashOptions, pick_kernel

    name, support = pick_kernel(case, FlashOptions())
    return {"variant": "flash", "picked": name, "kernel": support.kernel, "refused": support.reason}


def run(small: bool, deadline: float, save=lambda rows: None) -> list[dict]:
    """Every variant × length × dtype × layer, lengths ascending, until ``deadline`` (time.time()), each length
    given an even share of the time left so that a slow one cannot starve 32k; what a share leaves out is a row
    saying so. ``save(rows)`` after each case, so a killed run keeps what ran."""
    import jax

    from docbeam.attention.interface import current_platform

    platform, dims, rows = current_platform(), shape(small), []
    lengths = SMALL_LENGTHS if small else LENGTHS
    for index, length in enumerate(lengths):
        share_ends = time.time() + (deadline - time.time()) / (len(lengths) - index)
        for dtype in DTYPES:
            for layer in LAYERS:
                case = layer_case(layer, platform, dtype, length, dims)
                args, reference = inputs(case), None
                rows.append({"length": length, "dtype": dtype, "layer": layer, **picked(case)})
                for label, backend_name, raw_options in VARIANTS:
                    where = {"length": length, "dtype": dtype, "layer": layer}
                    if time.time() > share_ends:
                        rows.append(
                            {**where, "variant": label, "skipped": "this length's share of the check's time ran out"}
                        )
                        continue
                    try:
                        row, out = run_variant(label, backend_name, raw_options, case, args, reference)
                    except Exception as e:  # noqa: BLE001  (an out-of-memory or a kernel's failure is a finding)
                        row, out = {"variant": label, "error": f"{type(e).__name__}: {str(e)[:400]}"}, None
                    if label == "native":
                        reference = out
                    rows.append({**where, **row})
                    del out
                jax.clear_caches()
                save(rows)
    return rows
