"""How large ``chunked``'s steps are (attention/chunked.py): its options, and, where they are left unset, the
sizes for the platform the layer runs on. A size measured on one platform applies only there: XLA compiles
the same loop differently for CPU, GPU and TPU, so a CPU sweep says nothing about the others. Each table
names where its values come from.
"""

from __future__ import annotations

import pydantic

Row = tuple[int, int, int, int]  # (longest sequence, query_chunk, key_chunk, heads_per_step)

# CPU, measured: the fastest row per length of `python benchmarks/chunk_sweep.py` (its times, peak memory,
# runner-up pairs and the machine's load are in benchmarks/results/chunk_sweep.json, whose "chosen" entry is
# this table). The first row whose length covers the sequence applies, else the last. heads_per_step > 0
# works around XLA:CPU's batched matmul, slow with many small (head_dim 32) batch entries.
TUNED_CHUNKS: tuple[Row, ...] = ((512, 512, 256, 1), (2048, 512, 256, 2), (8192, 1024, 1024, 1))
# The same sweep with q, k and v in bfloat16 (`--dtype bfloat16`; chunk_sweep-bfloat16.json's "chosen"): longer
# query chunks win there; the re-timing against the float32 table is in CHANGELOG.md (2026-12-06).
TUNED_CHUNKS_BFLOAT16: tuple[Row, ...] = ((512, 512, 256, 2), (2048, 2048, 512, 1), (8192, 2048, 512, 1))

# GPU and TPU, not measured in this repository: the chunks tokamax 0.0.12 fixes for its own XLA chunked
# kernel (``_XLA_CHUNK_SIZE = (512, 1024)`` in tokamax/_src/ops/attention/api.py), and all heads in one
# batched matmul (heads_per_step 0), as tokamax runs them; any length. Replace with a sweep on the platform.
ACCELERATOR_CHUNKS: tuple[Row, ...] = ((1 << 31, 512, 1024, 0),)

PLATFORM_CHUNKS: dict[str, tuple[Row, ...]] = {
    "cpu": TUNED_CHUNKS,
    "gpu": ACCELERATOR_CHUNKS,
    "tpu": ACCELERATOR_CHUNKS,
}
# (platform, q's dtype) → its own table where one was measured; otherwise the platform's.
DTYPE_CHUNKS: dict[tuple[str, str], tuple[Row, ...]] = {("cpu", "bfloat16"): TUNED_CHUNKS_BFLOAT16}

# Causal global layers (decoders), where no option sets them: (chunk, heads_per_step) per platform. Square
# chunks of ``chunk`` rows and keys, so the key blocks past the diagonal that each query chunk skips are
# fine-grained (a query chunk of c rows scans keys up to its last row: with T tokens the layer computes about
# (T + c) / 2T of the blocks), and every head in one batched matmul, which a causal layer's traced-length loop of
# small blocks runs faster than one head per step. CPU's pair is `python benchmarks/long_context_decoder.py`'s
# choice (benchmarks/results/long_context_decoder*.json; the figures in CHANGELOG.md, 2026-12-06). GPU and TPU,
# not measured: their table applies.
CAUSAL_SIZES: dict[str, tuple[int, int]] = {"cpu": (256, 0)}

# Local layers (``local_window``): query chunks of LOCAL_QUERY_CHUNK rows, each scanning only the keys its rows
# can see (query_chunk + left + right of them, in one step while that span is at most LOCAL_MAX_KEY_CHUNK),
# all heads per matmul, on every platform: scanning only the reachable keys is what makes a local layer
# cost T * window instead of T². On CPU one pair for float32 and bfloat16 alike, as `python
# benchmarks/chunk_sweep.py --local-window` found (benchmarks/results/chunk_sweep-local-*.json; CHANGELOG.md,
# 2026-12-06). tests/attention_parity_test.py holds the values, whatever the sizes.
LOCAL_QUERY_CHUNK = 64
LOCAL_HEADS_PER_STEP = 0
LOCAL_MAX_KEY_CHUNK = 2048


class ChunkedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # Query rows and key columns per step of the online softmax; unset: the platform's table
    # (PLATFORM_CHUNKS). Lower them to lower peak memory.
    query_chunk: pydantic.PositiveInt | None = None
    key_chunk: pydantic.PositiveInt | None = None
    # 0: all heads in one batched matmul. A positive value runs that many heads per matmul, one group
    # after another in a loop: XLA:CPU's batched matmul is slow with many small (head_dim 32) batch
    # entries. Unset: the platform's table (PLATFORM_CHUNKS).
    heads_per_step: pydantic.NonNegativeInt | None = None
    # A causal global layer stops each query chunk at its diagonal. false: scan and mask every key block, the
    # baseline benchmarks/long_context_decoder.py measures the skipping against.
    skip_causal_blocks: bool = True


def chunk_sizes(options: ChunkedOptions, seq_len: int, platform: str, dtype: str = "float32") -> tuple[int, int, int]:
    """(query_chunk, key_chunk, heads_per_step) for a sequence on ``platform`` with q in ``dtype``: the options'
    where set, else the row for its length of the (platform, dtype) table, or of the platform's (a platform
    without a table gets the accelerators' default)."""
    table = DTYPE_CHUNKS.get((platform, dtype)) or PLATFORM_CHUNKS.get(platform, ACCELERATOR_CHUNKS)
    _, query_chunk, key_chunk, heads_per_step = next((row for row in table if seq_len <= row[0]), table[-1])
    return (
        options.query_chunk or query_chunk,
        options.key_chunk or key_chunk,
        heads_per_step if options.heads_per_step is None else options.heads_per_step,
    )


def layer_chunk_sizes(
    options: ChunkedOptions,
    seq_len: int,
    local_window: tuple[int, int] | None,
    platform: str,
    causal: bool = False,
    dtype: str = "float32",
) -> tuple[int, int, int]:
    """``chunk_sizes`` for a global layer (a causal one on a platform in CAUSAL_SIZES: its square chunks and
    heads per step); for a local one the LOCAL_* sizes and one key chunk spanning a query chunk's window (capped
    at LOCAL_MAX_KEY_CHUNK); always the options' sizes where they set them."""
    query_chunk, key_chunk, heads_per_step = chunk_sizes(options, seq_len, platform, dtype)
    if local_window is None and causal and platform in CAUSAL_SIZES:
        chunk, heads = CAUSAL_SIZES[platform]
        heads = heads if options.heads_per_step is None else options.heads_per_step
        return options.query_chunk or chunk, options.key_chunk or chunk, heads
    if local_window is None:
        return query_chunk, key_chunk, heads_per_step
    query_chunk = options.query_chunk or LOCAL_QUERY_CHUNK
    span = query_chunk + sum(local_window)
    key_chunk = options.key_chunk or (span if span <= LOCAL_MAX_KEY_CHUNK else key_chunk)
    return query_chunk, key_chunk, LOCAL_HEADS_PER_STEP if options.heads_per_step is None else options.heads_per_step
