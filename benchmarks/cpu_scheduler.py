"""XLA:CPU's scheduler for the encoder's forward: its default beside the memory-optimized one docbeam compiles with
on CPU (models/runtime.py ``CPU_COMPILER_OPTIONS``), on the same jitted forward EncoderRuntime builds.

    python benchmarks/cpu_scheduler.py [--quick] [--dtypes float32,bfloat16] [--rounds 5]
                                       [--memory-lengths 4096,8192,16384]

Per model shape and dtype, the forward is compiled once per scheduler: the compiled temporaries
(``memory_analysis().temp_size_in_bytes``, XLA's preallocated scratch: the intermediates live at once), the
largest difference between the two outputs, and the time per call, both timed in turns (``--rounds``, medians).
Shapes: all-MiniLM-L6-v2 (the shipped checkpoint) on packed batches of 8 x 128 and 4 x 256 rows, as a CPU job runs
it; random-weight ModernBERT-base and Qwen3-0.6B shapes (benchmarks/long_document.py's) on one document of
``--time-length`` tokens, and compiled only (no run) at each ``--memory-lengths`` for the temporaries' growth.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from docbeam.models.runtime import CPU_COMPILER_OPTIONS

# XLA's default schedule beside the options the encoder compiles with on CPU.
SCHEDULERS = {
    "default": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT"},
    "memory-optimized": dict(CPU_COMPILER_OPTIONS),
}
LONG_SHAPES = ("modernbert-base", "qwen3-0.6b")


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, help="timed rounds per case (default 5; --quick 1)")
    p.add_argument("--time-length", type=int, help="a long shape's timed document (default 2048; --quick 256)")
    p.add_argument("--memory-lengths", help="long shapes' compile-only lengths (default 4096,8192,16384)")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)
    args.dtypes = tuple(args.dtypes.split(","))
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.time_length = args.time_length or (256 if args.quick else 2048)
    lengths = args.memory_lengths or ("512" if args.quick else "4096,8192,16384")
    args.memory_lengths = tuple(int(n) for n in lengths.split(","))
    return args


def runtime_for(model_path: str, dtype: str, bucket: int, packing: bool):
    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.stages.encode import load_encoder

    backend = "native" if packing else "chunked"
    spec = standalone_spec(
        model_path=model_path, dtype=dtype, pooling="mean", buckets=(bucket,), packing=packing,
        attention=AttentionConfig(backend=backend),
    )  # fmt: skip
    runtime = load_encoder(spec)
    return runtime, runtime.forwards[backend]


def minilm_batches(args) -> list:
    """The first packed batch of each shape the shipped sample makes at configs/local.yaml's batching."""
    from benchmarks import precision
    from docbeam.models.checkpoint import open_checkpoint

    shaped = precision.parse_args(["--corpus", "sample"])
    checkpoint = open_checkpoint(args.model)
    _, docs = common.corpus_documents(shaped, checkpoint.folder)
    first = {}
    for batch in precision.windows_and_batches(shaped, docs, checkpoint.folder, checkpoint.settings, packing=True):
        first.setdefault(batch.ids_BxT.shape, batch)
    return list(first.values())


def compile_both(jitted, call_args: tuple) -> dict:
    return {name: jitted.lower(*call_args).compile(compiler_options=options) for name, options in SCHEDULERS.items()}


def temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(label: str, dtype: str, jitted, call_args: tuple, rounds: int, tokens: int) -> dict:
    import numpy as np

    compiled = compile_both(jitted, call_args)
    t0 = time.perf_counter()
    outputs = {name: np.asarray(c(*call_args), np.float32) for name, c in compiled.items()}  # also the warm-up
    calls = max(1, int(0.5 * len(compiled) / (time.perf_counter() - t0)))  # each round half a second or one call
    medians = {
        name: float(np.median(t)) for name, t in common.times_in_turns(compiled, call_args, rounds, calls).items()
    }
    row = {
        "case": label,
        "dtype": dtype,
        "tokens": tokens,
        "temp_bytes": {name: temp_bytes(c) for name, c in compiled.items()},
        "median_s": medians,
        "max_abs_diff": float(np.abs(outputs["default"] - outputs["memory-optimized"]).max()),
    }
    print(
        f"{label:<28} {dtype:<9} temp {row['temp_bytes']['default'] / 1e6:8.1f} -> "
        f"{row['temp_bytes']['memory-optimized'] / 1e6:8.1f} MB, {medians['default'] * 1e3:9.1f} -> "
        f"{medians['memory-optimized'] * 1e3:9.1f} ms, max |diff| {row['max_abs_diff']:.3g}",
        flush=True,
    )
    return row


def minilm_rows(args, dtype: str) -> list[dict]:
    rows = []
    for batch in minilm_batches(args):
        runtime, jitted = runtime_for(args.model, dtype, batch.bucket_len, packing=True)
        call_args = (runtime.params, batch.ids_BxT, batch.lengths_B, batch.segment_ids_BxT, batch.slot_lengths_BxK)
        label = f"MiniLM packed {batch.rows}x{batch.bucket_len}"
        rows.append(measure(label, dtype, jitted, call_args, args.rounds, int(batch.ids_BxT.size)))
    return rows


def long_rows(args, dtype: str, shape: str, folder: str) -> tuple[dict, list[dict]]:
    """(the timed row at --time-length, the compile-only temporaries at each --memory-lengths)."""
    import jax
    import numpy as np

    n = args.time_length
    runtime, jitted = runtime_for(folder, dtype, n, packing=False)
    ids = np.asarray(np.random.default_rng(0).integers(1000, 20000, (1, n)), np.int32)
    timed = measure(f"{shape} 1x{n}", dtype, jitted, (runtime.params, ids, np.array([n], np.int32)), args.rounds, n)
    memory = []
    for length in args.memory_lengths:
        runtime, jitted = runtime_for(folder, dtype, length, packing=False)
        shapes = (jax.ShapeDtypeStruct((1, length), np.int32), jax.ShapeDtypeStruct((1,), np.int32))
        compiled = compile_both(jitted, (runtime.params, *shapes))
        sizes = {name: temp_bytes(c) for name, c in compiled.items()}
        memory.append({"shape": shape, "dtype": dtype, "tokens": length, "temp_bytes": sizes})
        print(f"{shape} 1x{length:<6} {dtype:<9} compiled temp {sizes['default'] / 1e6:8.1f} -> "
              f"{sizes['memory-optimized'] / 1e6:8.1f} MB", flush=True)  # fmt: skip
    return timed, memory


def main(argv=None) -> int:
    from benchmarks import long_document

    args = parse_args(argv)
    info = common.machine()
    common.print_machine("XLA:CPU scheduler: default vs memory-optimized, the encoder's forward", info)
    work = tempfile.mkdtemp(prefix="docbeam-cpu-scheduler-")
    top = max(args.time_length, *args.memory_lengths)
    folders = {
        s: long_document.make_checkpoint(os.path.join(work, s), top, long_document.SHAPES[s]) for s in LONG_SHAPES
    }
    timed, memory = [], []
    for dtype in args.dtypes:
        timed += minilm_rows(args, dtype)
        for shape, folder in folders.items():
            row, grown = long_rows(args, dtype, shape, folder)
            timed.append(row)
            memory += grown
    print("\n## Per call: temporaries and time, default → memory-optimized (timed in turns)\n")
    print(
        common.table(
            ["case", "dtype", "temp MB (default)", "temp MB (memory-opt.)", "temp ÷", "ms (default)",
             "ms (memory-opt.)", "speed ×", "max |diff|"],
            [
                [r["case"], r["dtype"], r["temp_bytes"]["default"] / 1e6, r["temp_bytes"]["memory-optimized"] / 1e6,
                 common.ratio(r["temp_bytes"]["default"], r["temp_bytes"]["memory-optimized"]),
                 r["median_s"]["default"] * 1e3, r["median_s"]["memory-optimized"] * 1e3,
                 common.ratio(r["median_s"]["default"], r["median_s"]["memory-optimized"]), r["max_abs_diff"]]
                for r in timed
            ],
        )
    )  # fmt: skip
    print("\n## Long shapes' compiled temporaries by length (compiled only)\n")
    print(
        common.table(
            ["shape", "dtype", "tokens", "temp MB (default)", "temp MB (memory-opt.)", "temp ÷", "KB a token (memory-opt.)"],
            [
                [m["shape"], m["dtype"], m["tokens"], m["temp_bytes"]["default"] / 1e6,
                 m["temp_bytes"]["memory-optimized"] / 1e6,
                 common.ratio(m["temp_bytes"]["default"], m["temp_bytes"]["memory-optimized"]),
                 m["temp_bytes"]["memory-optimized"] / m["tokens"] / 1e3]
                for m in memory
            ],
        )
    )  # fmt: skip
    payload = {"benchmark": "cpu_scheduler", "args": vars(args), "machine": info, "schedulers": SCHEDULERS}
    common.write_results(args, "cpu_scheduler", {**payload, "timed": timed, "memory": memory})
    return 0


if __name__ == "__main__":
    sys.exit(main())
