"""docbeam's encoder in float32, bfloat16 and int8, on XLA and on the engine ``runner.engine: auto`` chooses
(models/engines/: OpenVINO where it passes parity and is faster on this CPU), beside ONNX Runtime float32 and int8
(its dynamic quantization of the same model, exported with torch.onnx) and OpenVINO as sentence-transformers'
``backend="openvino"`` runs it, on the same windows and machine, each held to the precision gate
(models/precision_gate.py) against docbeam's float32 vectors.

    python benchmarks/precision.py [--quick] [--corpus heldout --docs 1800] [--repeats 3]
                                   [--precisions float32,bfloat16,int8] [--engines xla,auto] [--ort-threads N]

docbeam runs as benchmarks/encoder.py times it (windows_for, the packer with configs/local.yaml's batching,
EncoderRuntime.encode per batch, every shape compiled before timing). ONNX Runtime takes the same windows
without packing (it has no segment ids) in buckets of every multiple of 16 (it compiles nothing per shape),
mean-pooled in numpy, with as many intra-op threads as this process may use. Every side loads and warms up,
then timed passes take turns (best of each kept), so the shared machine's drift moves all alike. Vectors:
each document's first window (``--long-documents truncate``), so every side embeds the same token sequences.
"""

from __future__ import annotations

import os
import re
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from benchmarks.sides import alternate

ONNX_CACHE = os.path.join(common.CORPUS_CACHE, "onnx")  # exported once per checkpoint, git-ignored


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--corpus", default="sample", help="sample (default), heldout (needs --docs) or a JSONL.gz path")
    p.add_argument("--docs", type=int, help="first N documents (default: all; --quick: 32)")
    p.add_argument("--precisions", default="float32,bfloat16,int8", help="docbeam's model.dtype values to run")
    p.add_argument(
        "--engines",
        default="xla,auto",
        help="docbeam's runner.engine values per float32/bfloat16 side (models/engines/); int8 runs xla only",
    )
    p.add_argument("--skip-onnx", action="store_true", help="leave out ONNX Runtime")
    p.add_argument("--name", default="precision", help="the results file's name (default precision: the README's)")
    p.add_argument("--skip-openvino", action="store_true", help="leave out OpenVINO")
    p.add_argument("--openvino-precisions", default="f32,bf16", help="OpenVINO INFERENCE_PRECISION_HINT values")
    p.add_argument("--ort-threads", type=int, help="ONNX Runtime intra-op threads (default: the usable CPUs)")
    p.add_argument("--repeats", type=int, help="timed passes per side, best kept (default 3; --quick 1)")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)
    from docbeam.config import load

    local = load(common.LOCAL_CONFIG)
    args.precisions = tuple(args.precisions.split(","))
    args.buckets, args.stride = local.batching.buckets, local.tokenize.stride
    args.tokens_per_batch = local.batching.tokens_per_batch
    args.docs = args.docs or (32 if args.quick else None)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.ort_threads = args.ort_threads or len(os.sched_getaffinity(0))
    return args


def windows_and_batches(args, docs, folder, settings, packing: bool, buckets: tuple[int, ...] | None = None):
    from docbeam.config import BatchingConfig, TokenizeConfig
    from docbeam.models.checkpoint import load_tokenizer
    from docbeam.pipeline.stages.packer import batch_windows
    from docbeam.pipeline.stages.tokenize import windows_for

    windows = windows_for(
        docs,
        load_tokenizer(folder),
        window_len=settings.max_seq_len,
        config=TokenizeConfig(long_documents="truncate", stride=args.stride),
    )
    batching = BatchingConfig(buckets=buckets or args.buckets, tokens_per_batch=args.tokens_per_batch, packing=packing)
    return batch_windows(windows, batching)


def timed_passes(args, batches, encode_batch, facts: dict):
    """The generator every side is: warm up (every shape once), yield, then one timed pass per turn."""
    t0 = time.perf_counter()
    seen = set()
    for batch in batches:
        if batch.ids_BxT.shape not in seen:
            seen.add(batch.ids_BxT.shape)
            encode_batch(batch)
    warmup_s = time.perf_counter() - t0
    yield
    passes, vectors = [], {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for batch in batches:
            out = encode_batch(batch)
            vectors.update({w[0]: v for w, v in zip(batch.windows, out) if w[1] == 0})
        passes.append(time.perf_counter() - t0)
        yield
    real = sum(b.real_tokens for b in batches)
    return {
        **facts,
        "real_tokens": real,
        "padded_tokens": sum(int(b.ids_BxT.size) for b in batches),
        "batches": len(batches),
        "warmup_s": warmup_s,
        "passes_s": passes,
        "best_s": min(passes),
        "tokens_per_s": real / min(passes),
        "vectors": vectors,
    }


def side_name(dtype: str, engine: str) -> str:
    """``docbeam float32`` on XLA (every result since the benchmark began), ``docbeam float32 auto`` on another
    runner.engine."""
    return f"docbeam {dtype}" if engine == "xla" else f"docbeam {dtype} {engine}"


def docbeam_side(args, docs, folder, settings, dtype: str, engine: str = "xla"):
    import dataclasses

    from benchmarks.common import standalone_spec
    from docbeam import attention
    from docbeam.attention.settings import AttentionConfig
    from docbeam.config import load
    from docbeam.pipeline.stages.encode import load_encoder

    packing = load(common.LOCAL_CONFIG).batching.packing
    packing = attention.get("native").segments if packing == "auto" else packing
    batches = windows_and_batches(args, docs, folder, settings, packing)
    t0 = time.perf_counter()
    spec = standalone_spec(
        model_path=args.model,
        dtype=dtype,
        pooling=settings.pooling,
        buckets=args.buckets,
        packing=packing,
        attention=AttentionConfig(),
    )
    runtime = load_encoder(dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine=engine)))
    # Which engine ran each batch of each bucket, and why (the timing records' engine and engine_reason).
    ran: dict[str, int] = {}

    def encode(batch):
        vectors, timing = runtime.encode(batch)
        key = f"{timing['bucket_len']} {timing['engine']}: {timing['engine_reason']}"
        ran[key] = ran.get(key, 0) + 1
        return vectors

    facts = {"side": side_name(dtype, engine), "load_s": time.perf_counter() - t0, "packing": packing, "engines": ran}
    return (yield from timed_passes(args, batches, encode, facts))


def onnx_models(model: str, folder: str) -> dict[str, str]:
    """{"float32": path, "int8": path}: the checkpoint exported by torch.onnx (last hidden state from ids and
    mask), and ONNX Runtime's dynamic quantization of it (int8 weights per channel, uint8 activations)."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel

    os.makedirs(ONNX_CACHE, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "-", model).strip("-")
    paths = {which: os.path.join(ONNX_CACHE, f"{name}-{which}.onnx") for which in ("float32", "int8")}
    if not os.path.exists(paths["float32"]):
        model = AutoModel.from_pretrained(folder).eval()

        class Hidden(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        ids = torch.ones((2, 16), dtype=torch.long)
        axes = {0: "batch", 1: "tokens"}
        torch.onnx.export(
            Hidden(),
            (ids, ids),
            paths["float32"],
            input_names=["input_ids", "attention_mask"],
            output_names=["hidden"],
            opset_version=17,
            dynamo=False,
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "hidden": axes},
        )
    if not os.path.exists(paths["int8"]):
        quantize_dynamic(paths["float32"], paths["int8"], weight_type=QuantType.QInt8, per_channel=True)
    return paths


def onnx_side(args, docs, folder, settings, which: str, path: str):
    import numpy as np
    import onnxruntime as ort

    # Every multiple of 16 up to the window: ONNX Runtime compiles nothing per shape, so it pads the least.
    batches = windows_and_batches(
        args, docs, folder, settings, packing=False, buckets=tuple(range(16, settings.max_seq_len + 1, 16))
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.ort_threads
    t0 = time.perf_counter()
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    facts = {
        "side": f"onnxruntime {which}",
        "load_s": time.perf_counter() - t0,
        "packing": False,
        "onnxruntime": ort.__version__,
        "threads": args.ort_threads,
    }

    def encode(batch):
        mask_BxT = (np.arange(batch.ids_BxT.shape[1])[None, :] < batch.lengths_B[:, None]).astype(np.int64)
        hidden_BxTxD = session.run(None, {"input_ids": batch.ids_BxT.astype(np.int64), "attention_mask": mask_BxT})[0]
        pooled_BxD = (hidden_BxTxD * mask_BxT[..., None]).sum(axis=1) / np.maximum(mask_BxT.sum(axis=1), 1)[:, None]
        return pooled_BxD[batch.window_slots()]

    return (yield from timed_passes(args, batches, encode, facts))


def compile_openvino(onnx_path: str, hint: str, threads: int):
    """The export compiled as sentence-transformers' ``backend="openvino"`` runs it on a CPU: ``hint`` (f32 or
    bf16) as INFERENCE_PRECISION_HINT, ``threads`` intra-op threads, the latency hint."""
    import openvino as ov

    core = ov.Core()
    options = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    return core.compile_model(core.read_model(onnx_path), "CPU", options)


def openvino_side(args, docs, folder, settings, hint: str, onnx_path: str):
    """OpenVINO as sentence-transformers' ``backend="openvino"`` and optimum-intel run it on a CPU: the model read
    once (the same float32 export ONNX Runtime runs), compiled with ``INFERENCE_PRECISION_HINT`` and as many
    threads as this process may use, windows sorted by length in batches of 32, each padded to its longest."""
    import numpy as np
    import openvino as ov

    from docbeam.pipeline.records import Batch

    ids_of = {}
    for b in windows_and_batches(args, docs, folder, settings, packing=False):
        for row, window in enumerate(b.windows):
            ids_of[window] = b.ids_BxT[row, : int(b.lengths_B[row])]
    ordered = sorted(ids_of.items(), key=lambda item: len(item[1]))
    batches = []
    for start in range(0, len(ordered), 32):
        group = ordered[start : start + 32]
        lengths_B = np.array([len(ids) for _, ids in group], np.int32)
        ids_BxT = np.zeros((len(group), int(lengths_B.max())), np.int32)
        for row, (_, ids) in enumerate(group):
            ids_BxT[row, : len(ids)] = ids
        batches.append(Batch(f"ov-{start}", ids_BxT.shape[1], ids_BxT, lengths_B, tuple(k for k, _ in group)))
    t0 = time.perf_counter()
    compiled = compile_openvino(onnx_path, hint, args.ort_threads)
    facts = {
        "side": f"openvino {hint}",
        "load_s": time.perf_counter() - t0,
        "packing": False,
        "openvino": ov.__version__,
        "threads": args.ort_threads,
    }

    def encode(batch):
        mask_BxT = (np.arange(batch.ids_BxT.shape[1])[None, :] < batch.lengths_B[:, None]).astype(np.int64)
        hidden_BxTxD = compiled({"input_ids": batch.ids_BxT.astype(np.int64), "attention_mask": mask_BxT})[0]
        return (hidden_BxTxD * mask_BxT[..., None]).sum(axis=1) / np.maximum(mask_BxT.sum(axis=1), 1)[:, None]

    return (yield from timed_passes(args, batches, encode, facts))


def matmul_rates(repeats: int, rows: int = 4096, d_in: int = 384, d_out: int = 1536) -> list[list]:
    """One MLP-in projection at the encoder's shape, each way a precision can run it: the profile behind the
    table above (what the dot itself costs, and what converting or quantising around it adds)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from docbeam.models import precision

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    q, scale = precision.quantize_channels(w)
    w_bf16, qx = jnp.asarray(w, jnp.bfloat16), precision.quantize_rows(x)[0]
    contract = (((1,), (0,)), ((), ()))
    ways = {
        "float32 dot": (lambda a, b: a @ b, x, jnp.asarray(w)),
        "bfloat16 everywhere (before: XLA:CPU upcasts a bf16-result dot)": (
            lambda a, b: (a.astype(jnp.bfloat16) @ b).astype(jnp.float32),
            x,
            w_bf16,
        ),
        "bfloat16 inputs, float32 accumulation (model.dtype: bfloat16)": (
            lambda a, b: jax.lax.dot_general(a.astype(jnp.bfloat16), b, contract, preferred_element_type=jnp.float32),
            x,
            w_bf16,
        ),
        "int8 dot alone (inputs already int8)": (
            lambda a, b: jax.lax.dot_general(a, b, contract, preferred_element_type=jnp.int32),
            qx,
            jnp.asarray(q),
        ),
        "int8 with per-token quantisation and rescale (model.dtype: int8)": (
            lambda a, b: precision.int8_matmul(a, b, jnp.asarray(scale)),
            x,
            jnp.asarray(q),
        ),
    }
    rows_out = []
    for name, (fn, a, b) in ways.items():
        compiled = jax.jit(fn).lower(a, b).compile()
        jax.block_until_ready(compiled(a, b))
        best = float("inf")
        for _ in range(max(repeats, 3) * 5):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(a, b))
            best = min(best, time.perf_counter() - t0)
        rows_out.append([name, best * 1e3, 2 * rows * d_in * d_out / best / 1e9])
    return rows_out


def main(argv=None) -> int:
    import numpy as np

    from docbeam.models import precision_gate
    from docbeam.models.checkpoint import open_checkpoint

    args = parse_args(argv)
    info = common.machine()
    common.print_machine("precision: docbeam (XLA, auto engine) vs ONNX Runtime and OpenVINO", info)
    checkpoint = open_checkpoint(args.model)
    folder, settings = checkpoint.folder, checkpoint.settings
    source, docs = common.corpus_documents(args, folder)
    print(
        f"{len(docs)} documents from {os.path.relpath(source, common.REPO)}, window {settings.max_seq_len} "
        f"(first window of each), buckets {list(args.buckets)}, tokens_per_batch {args.tokens_per_batch}, "
        f"best of {args.repeats}\n",
        flush=True,
    )
    engines = args.engines.split(",")
    sides = [
        docbeam_side(args, docs, folder, settings, dtype, engine)
        for dtype in args.precisions
        for engine in (engines if dtype != "int8" else ["xla"])
    ]
    if not args.skip_onnx:
        t0 = time.perf_counter()
        models = onnx_models(args.model, folder)
        sides += [onnx_side(args, docs, folder, settings, which, path) for which, path in models.items()]
        print(f"ONNX export and quantization (or cache): {time.perf_counter() - t0:.1f} s\n", flush=True)
    if not args.skip_openvino:
        onnx_float32 = onnx_models(args.model, folder)["float32"]
        sides += [
            openvino_side(args, docs, folder, settings, hint, onnx_float32)
            for hint in args.openvino_precisions.split(",")
        ]
    results = alternate(*sides)

    ids = [d.id for d in docs]
    stacked = {}
    for r in results:
        vectors = r.pop("vectors")
        stacked[r["side"]] = np.stack([vectors[i] for i in ids])
    reference_name = "docbeam float32"
    reference = stacked.get(reference_name)
    base = next((r["tokens_per_s"] for r in results if r["side"] == reference_name), None)
    rows = []
    for r in results:
        gate = None
        if reference is not None and r["side"] != reference_name and len(ids) > precision_gate.K:
            gate = precision_gate.measure(r["side"], stacked[r["side"]], reference)
            r["gate"] = {**gate.__dict__, "passed": gate.passed, "failures": gate.failures}
        rows.append(
            [
                r["side"],
                r["real_tokens"],
                r["padded_tokens"],
                r["load_s"],
                r["warmup_s"],
                r["best_s"],
                r["tokens_per_s"],
                common.ratio(r["tokens_per_s"], base),
                None if gate is None else gate.lowest_cosine,
                None if gate is None else gate.mean_cosine,
                None if gate is None else gate.recall_at_10,
                None if gate is None else ("pass" if gate.passed else "FAIL: " + "; ".join(gate.failures)),
            ]
        )
    print("## Encoder alone, steady state, by precision\n")
    print(
        common.table(
            [
                "encoder",
                "real tokens",
                "padded tokens",
                "load s",
                "warm-up s",
                f"best of {args.repeats} s",
                "tokens/s",
                "÷ docbeam float32",
                "lowest cosine",
                "mean cosine",
                "recall@10",
                "gate",
            ],
            rows,
        )
    )
    print(
        f"\ngate (models/precision_gate.py): recall@10 ≥ {precision_gate.GATES['recall@10']}, lowest cosine ≥ "
        f"{precision_gate.GATES['lowest cosine']}, against docbeam float32 on these {len(ids)} documents"
    )
    print("\n## The engine that ran each docbeam side's batches (runner.engine; warm-up and timed passes)\n")
    for r in results:
        if r.get("engines"):
            print(f"- {r['side']}: " + "; ".join(f"{why} ({n})" for why, n in sorted(r["engines"].items())))
    matmuls = matmul_rates(args.repeats)
    print("\n## One projection, 4096×384 by 384×1536, by how it runs\n")
    print(common.table(["how", "best ms", "GFLOP/s (GOP/s for int8)"], matmuls))
    common.write_results(
        args,
        args.name,
        {
            "benchmark": "precision",
            "args": vars(args),
            "machine": info,
            "docs": len(docs),
            "sides": results,
            "matmuls": matmuls,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
