"""Where the encoder's compiled forward spends its time, beside OpenVINO on the same shapes: all-MiniLM-L6-v2
(or --model, a BERT-shaped checkpoint) at fixed [rows, tokens] shapes, every token real (no padding), so both
sides do the same work per call.

    python benchmarks/forward_profile.py [--quick] [--dtype bfloat16] [--shapes 4x256,8x128,16x64,32x32]
                                         [--rounds 8] [--skip-openvino]

Per shape, docbeam's forward (jitted, as EncoderRuntime runs it, unpacked rows) and OpenVINO's (the float32 ONNX
export benchmarks/precision.py makes, compiled with INFERENCE_PRECISION_HINT f32 or bf16, this process's threads)
are timed in turns, ``--rounds`` rounds of a few calls each, the median kept: the machine's drift moves both alike.
Then one profiled run of docbeam's forward: JAX's profiler records one event per XLA thunk (a fusion, a YNNPACK
dot), each event is mapped to the op its HLO metadata names, and the op groups below are summed per call. Each
projection group's GFLOP/s is its FLOPs (2 x tokens x in x out) over its time; attention's counts its two matmuls
(4 x tokens x keys x hidden). The thunks' sum is close to the call's wall time: XLA:CPU runs one thunk at a time
and spreads its work over the threads.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

# An op's group, by the module path in its HLO metadata (op_name), first match wins.
GROUPS = (
    ("q/k/v projection", r"/attn/qkv/dot_general"),
    ("attention output projection", r"/attn/out/dot_general"),
    ("MLP in projection", r"/mlp/wi/dot_general"),
    ("MLP out projection", r"/mlp/wo/dot_general"),
    ("attention: scores, softmax, values", r"/attn/attention/"),
    ("MLP activation (and its convert)", r"/mlp/"),
    ("q/k/v bias, convert, head split", r"/attn/"),
    ("norms", r"_norm/|/norm/"),
    ("embeddings", r"/embed/"),
    ("residual adds, pooling, other", r""),
)


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16", help="docbeam's model.dtype (OpenVINO: bf16 or f32 to match)")
    p.add_argument("--shapes", default="4x256,8x128,16x64,32x32", help="rows x tokens per call")
    p.add_argument("--rounds", type=int, help="timed rounds per side and shape (default 8; --quick 2)")
    p.add_argument("--skip-openvino", action="store_true")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)
    args.shapes = [tuple(int(n) for n in s.split("x")) for s in ("2x64" if args.quick else args.shapes).split(",")]
    args.rounds = args.rounds or (2 if args.quick else 8)
    return args


def group_of(op_name: str) -> str:
    return next(name for name, pattern in GROUPS if re.search(pattern, op_name))


def op_names(hlo_text: str) -> dict[str, str]:
    """Each top-level instruction's name → the op_name its metadata gives (the thunk events carry these names)."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", line)
        if m:
            names.setdefault(m.group(1), m.group(2))
    return names


def group_flops(config, rows: int, tokens: int) -> dict[str, float]:
    n, d, f, layers = rows * tokens, config.hidden_size, config.intermediate_size, config.num_layers
    return {
        "q/k/v projection": 2 * n * d * 3 * d * layers,
        "attention output projection": 2 * n * d * d * layers,
        "MLP in projection": 2 * n * d * f * layers,
        "MLP out projection": 2 * n * f * d * layers,
        "attention: scores, softmax, values": 4 * n * tokens * d * layers,
    }


def profile_groups(compiled, args_, calls: int) -> tuple[dict[str, float], float, float]:
    """({group: ms per call}, thunks' ms per call, wall ms per call) from one profiled run of ``calls`` calls."""
    import jax
    from jax._src.lib import _profiler
    from jax.profiler import ProfileData

    names = op_names(compiled.as_text())
    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = compiled(*args_)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / calls
    data = ProfileData.from_serialized_xspace(session.stop())
    by_group = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in names:
                    by_group[group_of(names[event.name])] += event.duration_ns
    per_call = {g: by_group[g] / calls / 1e6 for g, _ in GROUPS}
    return per_call, sum(per_call.values()), wall * 1e3


def load_docbeam(args):
    """(checkpoint, parameters on the device, the forward to jit): loaded once, compiled per shape."""
    import jax

    from docbeam.attention import registry
    from docbeam.models import checkpoint, encoder

    ck = checkpoint.open_checkpoint(args.model, args.dtype, with_weights=True)
    params = jax.device_put(checkpoint.load_params(ck.folder, ck.config))
    return ck, params, encoder.embed_fn(ck.config, registry.get("native").bind(), "mean")


def compile_docbeam(params, embed, ids):
    """The forward compiled for ids' [rows, tokens], every row full, and its arguments."""
    import jax
    import jax.numpy as jnp

    from docbeam.models.runtime import compiler_options

    call_args = (params, jnp.asarray(ids), jnp.full((ids.shape[0],), ids.shape[1], jnp.int32))
    options = compiler_options(jax.devices()[0].platform)  # as EncoderRuntime compiles it
    compiled = jax.jit(embed, compiler_options=options).lower(*call_args).compile()
    jax.block_until_ready(compiled(*call_args))
    return compiled, call_args


def load_openvino(args, ck):
    """The float32 export precision.py makes and runs, compiled with the hint matching --dtype (shapes are
    dynamic: one compiled model serves every shape)."""
    from benchmarks.precision import compile_openvino, onnx_models

    hint = "bf16" if args.dtype == "bfloat16" else "f32"
    return compile_openvino(onnx_models(args.model, ck.folder)["float32"], hint, len(os.sched_getaffinity(0)))


def openvino_call(model, ids):
    import numpy as np

    inputs = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones(ids.shape, np.int64)}
    model(inputs)  # warm this shape
    return lambda: model(inputs)


def median_ms(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv=None) -> int:
    import numpy as np

    args = parse_args(argv)
    info = common.machine()
    common.print_machine(f"forward profile: docbeam {args.dtype} by op group, beside OpenVINO", info)
    ck, params, embed = load_docbeam(args)
    openvino = None if args.skip_openvino else load_openvino(args, ck)
    results, rows_speed, group_rows = [], [], []
    for shape in args.shapes:
        ids = np.random.default_rng(0).integers(1000, 20000, shape).astype(np.int32)
        compiled, call_args = compile_docbeam(params, embed, ids)
        sides = {"docbeam": lambda c=compiled, a=call_args: np.asarray(c(*a))}
        if openvino is not None:
            sides["openvino"] = openvino_call(openvino, ids)
        calls = max(1, 4096 // (shape[0] * shape[1]))
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(median_ms(fn, calls))
        ms = {name: float(np.median(t)) for name, t in times.items()}
        tokens = shape[0] * shape[1]
        groups, thunks_ms, wall_ms = profile_groups(compiled, call_args, calls * 4)
        flops = group_flops(ck.config, *shape)
        results.append({"shape": list(shape), "ms": ms, "rounds_ms": times, "groups_ms": groups,
                        "thunks_ms": thunks_ms, "profiled_wall_ms": wall_ms, "flops": flops})  # fmt: skip
        ov = ms.get("openvino")
        rows_speed.append([f"{shape[0]}x{shape[1]}", ms["docbeam"], tokens / ms["docbeam"] * 1e3, ov,
                           ov and tokens / ov * 1e3, ov and common.ratio(ov, ms["docbeam"])])  # fmt: skip
        for name, _ in GROUPS:
            gf = flops.get(name)
            group_rows.append([f"{shape[0]}x{shape[1]}", name, groups[name], groups[name] / thunks_ms,
                               gf and gf / groups[name] / 1e6 if groups[name] else None])  # fmt: skip
        group_rows.append([f"{shape[0]}x{shape[1]}", f"all thunks (wall {wall_ms:.1f} ms)", thunks_ms, 1.0, None])
    print(f"\n## Per call, every token real, docbeam {args.dtype} and OpenVINO in turns (median of {args.rounds})\n")
    print(common.table(["rows x tokens", "docbeam ms", "docbeam tokens/s", "OpenVINO ms", "OpenVINO tokens/s",
                        "docbeam ÷ OpenVINO (speed)"], rows_speed))  # fmt: skip
    print(f"\n## docbeam {args.dtype}: time per call by op group (profiler thunk events)\n")
    print(common.table(["rows x tokens", "op group", "ms per call", "share", "GFLOP/s"], group_rows))
    common.write_results(args, f"forward_profile-{args.dtype}", {"machine": info, "dtype": args.dtype,
                                                                 "model": args.model, "shapes": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
