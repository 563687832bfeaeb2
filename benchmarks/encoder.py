"""docbeam's encoder vs sentence-transformers on the same checkpoint, texts and machine; then the whole
pipeline vs the encoder alone.

    python benchmarks/encoder.py [--quick] [--docs N] [--dtype float32|bfloat16] [--backend native]

docbeam is timed as the pipeline runs it: windows from pipeline.tokenize.windows_for, batches from
pipeline.bucket, EncoderRuntime.encode per batch, every shape compiled once before timing. Both sides
count real tokens (attention-mask tokens after truncation to the window length); with the default
``--long-documents truncate`` they encode exactly the same token sequences.
"""
from __future__ import annotations

import json
import datetime
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

common.bootstrap()


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--docs", type=int, help="first N documents of the sample corpus (default: all; --quick: 16)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--backend", default="native", help="docbeam attention backend (default: %(default)s)")
    p.add_argument("--attention-options", default="{}", type=json.loads,
                   help='the backend\'s options as JSON, e.g. \'{"heads_per_step": 1}\' for chunked')
    p.add_argument("--buckets", help="comma-separated bucket lengths (default: configs/local.yaml's)")
    p.add_argument("--tokens-per-batch", type=int, help="default: configs/local.yaml's; --quick: 1024")
    p.add_argument("--long-documents", choices=("truncate", "window"), default="truncate",
                   help="truncate: both sides encode the same first window (default); window: docbeam "
                        "encodes every window, so its token count exceeds sentence-transformers'")
    p.add_argument("--repeats", type=int, help="timed passes over the corpus, best kept (default 3; --quick 1)")
    p.add_argument("--st-device", choices=("cpu", "cuda", "skip"), default="cpu",
                   help="where sentence-transformers runs; cuda is skipped (and says so) when torch has no CUDA")
    p.add_argument("--st-batch-size", type=int, default=32)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--skip-pipeline", action="store_true", help="leave out the end-to-end pipeline run")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)

    from pipeline.config import load

    local = load(common.LOCAL_CONFIG)
    args.buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else local.batching.buckets
    args.tokens_per_batch = args.tokens_per_batch or (1024 if args.quick else local.batching.tokens_per_batch)
    args.docs = args.docs or (16 if args.quick else None)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.stride = local.tokenize.stride
    return args


def docbeam_side(args, docs, folder, settings) -> dict:
    import numpy as np

    from models.checkpoint import load_tokenizer
    import attention
    from attention.plan import AttentionSpec
    from pipeline.bucket import batch_windows
    from pipeline.config import BatchingConfig, TokenizeConfig
    from pipeline.encode import EncoderRuntime, EncoderSpec
    from pipeline.tokenize import windows_for

    cache = common.CacheEvents()
    tokenizer = load_tokenizer(folder)
    t0 = time.perf_counter()
    windows = windows_for(docs, tokenizer, window_len=settings.max_seq_len,
                          config=TokenizeConfig(long_documents=args.long_documents, stride=args.stride))
    tokenize_s = time.perf_counter() - t0
    batches = batch_windows(windows, BatchingConfig(buckets=args.buckets, tokens_per_batch=args.tokens_per_batch))

    t0 = time.perf_counter()
    runtime = EncoderRuntime(EncoderSpec(
        model_path=args.model, dtype=args.dtype, pooling=settings.pooling, buckets=args.buckets,
        attention=AttentionSpec(backend=args.backend,
                                options=attention.get(args.backend).parse_options(args.attention_options))))
    load_s = time.perf_counter() - t0

    shapes: dict[tuple, dict] = {}
    t0 = time.perf_counter()
    for batch in batches:
        shape = batch.ids_BxT.shape
        if shape not in shapes:
            _, timing = runtime.encode(batch)
            shapes[shape] = {"bucket": shape[1], "rows": shape[0], "compile_ms": timing["compile_ms"],
                             "first_call_ms": timing["total_ms"], "steady_ms": []}
    warmup_s = time.perf_counter() - t0
    cache_after_warmup = cache.snapshot()

    passes, vectors = [], {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for batch in batches:
            out, timing = runtime.encode(batch)
            shapes[batch.ids_BxT.shape]["steady_ms"].append(timing["total_ms"])
            vectors.update({w[0]: v for w, v in zip(batch.windows, out) if w[1] == 0})
        passes.append(time.perf_counter() - t0)

    real = sum(b.real_tokens for b in batches)
    for s in shapes.values():
        s["batches"] = len(s["steady_ms"]) // args.repeats
        s["steady_ms"] = float(np.mean(s["steady_ms"]))
    return {
        "windows": len(windows), "batches": len(batches), "real_tokens": real,
        "padded_tokens": sum(int(b.ids_BxT.size) for b in batches), "tokenize_s": tokenize_s,
        "load_s": load_s, "warmup_s": warmup_s, "compile_s": sum(s["compile_ms"] for s in shapes.values()) / 1e3,
        "passes_s": passes, "best_s": min(passes), "tokens_per_s": real / min(passes),
        "shapes": sorted(shapes.values(), key=lambda s: s["bucket"]),
        "attention_kernels": {b: c.kernel for b, c in runtime.choices.items()},
        "device": str(runtime.device), **cache_after_warmup, "vectors": vectors,
    }


def sentence_transformers_side(args, texts, folder, window_len) -> dict:
    import torch

    if args.st_device == "cuda" and not torch.cuda.is_available():
        return {"skipped": f"torch {torch.__version__} has no CUDA"}
    torch.set_num_threads(args.torch_threads)
    from sentence_transformers import SentenceTransformer

    t0 = time.perf_counter()
    model = SentenceTransformer(folder, device=args.st_device)
    if args.dtype == "bfloat16":
        model.to(torch.bfloat16)
    load_s = time.perf_counter() - t0
    if model.max_seq_length != window_len:
        raise SystemExit(f"sentence-transformers truncates at {model.max_seq_length}, docbeam at {window_len}: "
                         "the comparison would not encode the same tokens")
    real = 0
    for i in range(0, len(texts), 64):
        real += int(model.preprocess(texts[i:i + 64])["attention_mask"].sum())

    def encode(some):
        return model.encode(some, batch_size=args.st_batch_size, convert_to_numpy=True, show_progress_bar=False)

    t0 = time.perf_counter()
    encode(texts[:2 * args.st_batch_size])
    warmup_s = time.perf_counter() - t0
    passes = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        embeddings = encode(texts)
        passes.append(time.perf_counter() - t0)
    return {"device": args.st_device, "torch_threads": torch.get_num_threads(), "real_tokens": real,
            "load_s": load_s, "warmup_s": warmup_s, "passes_s": passes, "best_s": min(passes),
            "tokens_per_s": real / min(passes), "embeddings": embeddings}


def pipeline_side(args, docs, tmp) -> dict:
    from pipeline.config import load
    from pipeline.run import run_job

    out = os.path.join(tmp, "out")
    overrides = [f"input.path={common.write_subset(docs, tmp)}", f"output.path={out}", f"model.path={args.model}",
                 f"model.dtype={args.dtype}", f"attention.backend={args.backend}",
                 f"attention.{args.backend}={json.dumps(args.attention_options)}",
                 f"batching.buckets=[{','.join(map(str, args.buckets))}]",
                 f"batching.tokens_per_batch={args.tokens_per_batch}",
                 f"tokenize.long_documents={args.long_documents}", "runner.progress_seconds=0"]
    summary = run_job(load(common.LOCAL_CONFIG, overrides))
    timing = common.read_timing(out)
    real = sum(r["real_tokens"] for r in timing)
    compute_s = sum(r["compute_ms"] for r in timing) / 1e3
    compile_s = sum(r["compile_ms"] for r in timing) / 1e3
    starts = [datetime.datetime.fromisoformat(r["started_at"]).timestamp() for r in timing]
    ends = [s + r["total_ms"] / 1e3 for s, r in zip(starts, timing)]
    after_first_s = max(ends) - min(starts)
    return {"overrides": overrides, "batches": len(timing), "compiles": summary["compiles"], "real_tokens": real,
            "wall_seconds": summary["wall_seconds"], "summary_tokens_per_s": summary["tokens_per_second"],
            "compute_s": compute_s, "compile_s": compile_s, "wall_after_first_batch_s": after_first_s,
            "compute_tokens_per_s": real / compute_s,
            "compute_excl_compile_tokens_per_s": real / (compute_s - compile_s) if compute_s > compile_s else None,
            "wall_after_first_batch_tokens_per_s": real / after_first_s}


def cosine_agreement(docbeam_vectors: dict, st_embeddings, docs) -> float:
    """Lowest cosine between docbeam's and sentence-transformers' embedding of a document."""
    import numpy as np

    ours = np.stack([docbeam_vectors[d.id] for d in docs]).astype(np.float32)
    theirs = np.asarray(st_embeddings, np.float32)
    ours /= np.linalg.norm(ours, axis=1, keepdims=True)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    return float((ours * theirs).sum(axis=1).min())


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine()
    common.print_machine("encoder: docbeam vs sentence-transformers, and pipeline vs encoder alone", info)
    from models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(args.model, args.dtype)
    folder, window_len = checkpoint.folder, checkpoint.settings.max_seq_len
    docs = common.read_documents(common.SAMPLE, args.docs)
    print(f"{len(docs)} documents, window {window_len}, buckets {list(args.buckets)}, tokens_per_batch "
          f"{args.tokens_per_batch}, dtype {args.dtype}, backend {args.backend}, long documents "
          f"{args.long_documents}, best of {args.repeats}\n", flush=True)

    ours = docbeam_side(args, docs, folder, checkpoint.settings)
    vectors = ours.pop("vectors")
    theirs = ({"skipped": "--st-device skip"} if args.st_device == "skip"
              else sentence_transformers_side(args, [d.text for d in docs], folder, window_len))
    agreement = None
    if "embeddings" in theirs:
        embeddings = theirs.pop("embeddings")
        if args.long_documents == "truncate":
            agreement = cosine_agreement(vectors, embeddings, docs)
    whole = None
    if not args.skip_pipeline:
        with tempfile.TemporaryDirectory(prefix="docbeam-bench-") as tmp:
            whole = pipeline_side(args, docs, tmp)

    rows = [[f"docbeam ({args.backend})", ours["device"], ours["real_tokens"], ours["padded_tokens"],
             ours["load_s"], ours["compile_s"], ours["warmup_s"], ours["best_s"], ours["tokens_per_s"]]]
    if "skipped" in theirs:
        rows.append(["sentence-transformers", f"skipped: {theirs['skipped']}"] + [None] * 7)
    else:
        rows.append(["sentence-transformers", theirs["device"], theirs["real_tokens"], None, theirs["load_s"], None,
                     theirs["warmup_s"], theirs["best_s"], theirs["tokens_per_s"]])
    print(f"## Encoder alone, steady state ({args.dtype})\n")
    print(common.table(["encoder", "device", "real tokens", "padded tokens", "load s",
                        "compile s", "warm-up s", f"best of {args.repeats} s", "tokens/s"], rows))
    speedup = common.ratio(ours["tokens_per_s"], theirs.get("tokens_per_s"))
    if speedup is not None:
        print(f"\ndocbeam ÷ sentence-transformers tokens/s: **{speedup:.2f}×**")
        if ours["real_tokens"] != theirs["real_tokens"]:
            print(f"note: real token counts differ ({ours['real_tokens']} vs {theirs['real_tokens']}): "
                  "rates, not the same work"
                  + (" (--long-documents window)" if args.long_documents == "window" else ""))
    if agreement is not None:
        print(f"lowest cosine(docbeam, sentence-transformers) over {len(docs)} documents: {agreement:.6f}")
    print(f"persistent compile cache during warm-up: {ours['cache_hits']} hits, {ours['cache_misses']} misses")

    print("\n## docbeam per shape\n")
    print(common.table(["bucket", "rows", "batches", "compile ms", "first call ms", "steady ms/batch"],
                       [[s["bucket"], s["rows"], s["batches"], s["compile_ms"], s["first_call_ms"], s["steady_ms"]]
                        for s in ours["shapes"]]))

    if whole:
        base = ours["tokens_per_s"]
        excl_compile, after_first = (whole["compute_excl_compile_tokens_per_s"],
                                     whole["wall_after_first_batch_tokens_per_s"])
        print("\n## Pipeline end to end vs encoder alone\n")
        print(common.table(["measure", "seconds", "tokens/s", "÷ encoder alone"], [
            ["encoder alone, steady state", ours["best_s"], base, 1.0],
            ["pipeline Σ compute_ms", whole["compute_s"], whole["compute_tokens_per_s"],
             common.ratio(whole["compute_tokens_per_s"], base)],
            ["pipeline Σ (compute_ms − compile_ms)", whole["compute_s"] - whole["compile_s"],
             excl_compile, common.ratio(excl_compile, base)],
            ["pipeline wall after first batch", whole["wall_after_first_batch_s"],
             after_first, common.ratio(after_first, base)],
            ["pipeline whole job (summary.json)", whole["wall_seconds"], whole["summary_tokens_per_s"],
             common.ratio(whole["summary_tokens_per_s"], base)],
        ]))
        print(f"\npipeline: {whole['batches']} batches, {whole['compiles']} compilations, {whole['real_tokens']} real "
              "tokens; compute_ms includes compilation on a batch that compiled")

    name = f"encoder-{args.dtype}" + ("" if args.backend == "native" else f"-{args.backend}") + (
        "-" + "-".join(f"{k}{v}" for k, v in args.attention_options.items()) if args.attention_options else "")
    common.write_results(args, name, {
        "benchmark": "encoder", "args": vars(args), "machine": info, "docs": len(docs), "window_len": window_len,
        "docbeam": ours, "sentence_transformers": theirs, "docbeam_over_st": speedup, "lowest_cosine": agreement,
        "pipeline": whole})
    return 0


if __name__ == "__main__":
    sys.exit(main())
