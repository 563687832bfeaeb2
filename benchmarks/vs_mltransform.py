"""A whole `docbeam run` vs a whole Beam MLTransform + SentenceTransformerEmbeddings job: same documents, same
checkpoint, same machine, DirectRunner for both, one run, side by side.

    python benchmarks/vs_mltransform.py [--quick] [--docs 1800] [--corpus heldout|sample|PATH] [--repeats 1]

Each side is its own process, timed from launch to exit (imports, graph, model load, compilations, reading,
encoding, writing). docbeam: ``python -m pipeline.driver.cli run --config configs/local.yaml`` (what ``docbeam run``
runs) with ``tokenize.long_documents=truncate`` and a temporary ``output.path``. MLTransform: this file again,
with ``--mltransform-job``: ReadFromText + json, ``MLTransform(write_artifact_location=<temp>)`` with
``SentenceTransformerEmbeddings`` (the checkpoint folder docbeam resolves, ``max_seq_length`` = docbeam's window),
torch on ``--torch-threads``, then WriteToParquet (id, embedding). Both keep only the first window of a long
document, so both encode the same tokens; the MLTransform output is checked for one vector per document and
its cosine with docbeam's vector for the same id.

Beam 2.78 gave RunInference length-aware batching (``BatchElements(length_fn=, bucket_boundaries=)``, which takes
effect only with ``max_batch_duration_secs``: the stateful batcher keys each element by its length bucket). MLTransform's
``SentenceTransformerEmbeddings`` passes only batch sizes to it, so the third side, ``mltransform_length``, is the same
job with the handler's ``batch_elements_kwargs`` given a ``length_fn`` (the tokenizer's token count, capped at the
window) and docbeam's own buckets as the boundaries: the plain pipeline's best form. The speed-up is docbeam's
against the faster of the two MLTransform sides.

The corpus by default is ``heldout``: ``--docs`` (1,800; ``--quick`` 40) documents from
``data/make_sample.py --seed 1 --exclude data/sample/docs.jsonl.gz --fill-short-bins``, none of them in the
sample, generated once and cached under ``.cache/benchmarks/``. ``sample`` or a JSONL.gz path takes the first
``--docs`` documents of that file.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from benchmarks.mltransform_job import length_boundaries, mltransform_job
from benchmarks.processes import load_average, tail, timed_process

COSINE_FLOOR = 0.9999
# The stateful batcher's longest wait for a batch to fill: Beam suggests starting small; in a batch job the
# bundle's end flushes what is left.
MAX_BATCH_DURATION_S = 1.0


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--docs", type=int, help="documents (default 1800; --quick 40)")
    p.add_argument(
        "--corpus",
        default="heldout",
        help="heldout (generated, cached), sample (data/sample/docs.jsonl.gz) or a JSONL.gz path",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each side, alternating which goes first; the fastest of each is compared",
    )
    p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads in the MLTransform process")
    p.add_argument(
        "--mlt-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where MLTransform's sentence-transformers model runs (cuda: for a GPU machine)",
    )
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="docbeam gets an empty JAX compilation cache, as a plain `docbeam run` without "
        "JAX_COMPILATION_CACHE_DIR or runner.compilation_cache has (default: the repo's, warm after "
        "any earlier run with the same buckets; the hits are reported either way); results go to "
        "vs_mltransform-cold-cache.json",
    )
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    p.add_argument(
        "--mltransform-job",
        metavar="SPEC_JSON",
        help="run only the MLTransform job described by this file (what the benchmark launches)",
    )
    args = p.parse_args(argv)
    args.docs = args.docs or (40 if args.quick else 1800)
    return args


# --- The benchmark ---------------------------------------------------------------------------------------------


def beam_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("apache-beam")


def docbeam_rows(ours: dict) -> list[list]:
    return [
        ["docbeam device(s)", ", ".join(ours["devices"])],
        ["docbeam summary.json wall s", ours["summary_wall_s"]],
        ["docbeam Σ compute_ms s (encoder, incl. compilation)", ours["encoder_s"]],
        ["docbeam encoder share of process wall", ours["encoder_share_of_wall"]],
        [
            "docbeam Σ compile_ms s; compilations; persistent-cache hits",
            f"{ours['compile_s']:.2f}; {ours['compiles']}; {ours['compile_cache_hits']}",
        ],
        [
            "docbeam batches; padding efficiency",
            f"{ours['batches']}; {ours['real_tokens'] / ours['padded_tokens']:.3f}",
        ],
    ]


def mltransform_rows(run: dict) -> list[list]:
    metrics = run["metrics"]
    batch = metrics.get("BatchElements/batch_size", {})
    latency = next((v for k, v in metrics.items() if k.endswith("inference_batch_latency_micro_secs")), {})
    load = next((v for k, v in metrics.items() if k.endswith("load_model_latency_milli_secs")), {})
    return [
        ["RunInference batches (BatchElements)", batch.get("count")],
        [
            "batch size min / mean / max",
            f"{batch.get('min')} / {batch.get('mean', 0):.1f} / {batch.get('max')}" if batch else None,
        ],
        ["Σ inference latency s", latency["sum"] / 1e6 if latency else None],
        ["inference share of process wall", latency["sum"] / 1e6 / run["wall_s"] if latency else None],
        ["model load s", load["sum"] / 1e3 if load else None],
        ["sentence-transformers encode() batch size inside each RunInference batch", run["st_encode_batch_size"]],
        [
            "device; torch threads (intra-op; inter-op)",
            f"{run['device']}; {run['torch_threads']}; {run['torch_interop_threads']}",
        ],
        ["artifacts (files, bytes)", f"{run['artifact_files']}, {run['artifact_bytes']}"],
    ]


def truncated_tokens(docs, folder: str, window_len: int) -> int:
    """Tokens each side encodes: the attention-mask tokens of the first window (special tokens included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    total = 0
    for i in range(0, len(docs), 256):
        encoded = tokenizer([d.text for d in docs[i : i + 256]], truncation=True, max_length=window_len)
        total += sum(len(ids) for ids in encoded["input_ids"])
    return total


def run_docbeam(args, corpus: str, work: str, attempt: int) -> dict:
    out = os.path.join(work, f"docbeam-{attempt}")
    env = dict(os.environ)
    if args.cold_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-cold-", dir=work)
    overrides = [
        f"input.path={corpus}",
        f"output.path={out}",
        f"model.path={args.model}",
        "tokenize.long_documents=truncate",
        "runner.progress_seconds=0",
    ]
    command = [sys.executable, "-m", "docbeam", "run", "--config", common.LOCAL_CONFIG]
    command += [a for o in overrides for a in ("--set", o)]
    log = os.path.join(work, f"docbeam-{attempt}.log")
    load_before = load_average()
    wall, code = timed_process(command, env, log)
    if code != 0:
        raise SystemExit(f"docbeam exited {code}:\n{tail(log)}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    timing = common.read_timing(out)
    compute_s = sum(r["compute_ms"] for r in timing) / 1e3
    compile_s = sum(r["compile_ms"] for r in timing) / 1e3
    return {
        "command": " ".join(command[1:]),
        "wall_s": wall,
        "output": out,
        "load_before": load_before,
        "load_after": load_average(),
        "cold_cache": args.cold_cache,
        "summary_wall_s": summary["wall_seconds"],
        "docs": summary["docs_embedded"],
        "docs_rejected": summary["docs_rejected"],
        "real_tokens": summary["real_tokens"],
        "padded_tokens": summary["padded_tokens"],
        "batches": summary["batches"],
        "compiles": summary["compiles"],
        "encoder_s": compute_s,
        "compile_s": compile_s,
        "compile_cache_hits": sum(r.get("compile_cache_hits") or 0 for r in timing),
        "devices": sorted({r["device"] for r in timing}),
        "encoder_share_of_wall": compute_s / wall,
        "encoder_excl_compile_share_of_wall": (compute_s - compile_s) / wall,
        "summary_stages": summary.get("stages"),
    }


def run_mltransform(args, corpus: str, work: str, attempt: int, folder: str, window_len: int, length=None) -> dict:
    side = "mltransform_length" if length else "mltransform"
    job = os.path.join(work, f"{side}-{attempt}")
    os.makedirs(job)
    spec = {
        "input": corpus,
        "model_folder": folder,
        "max_seq_length": window_len,
        "torch_threads": args.torch_threads,
        "device": args.mlt_device,
        "output": os.path.join(job, "embeddings"),
        "artifacts": os.path.join(job, "artifacts"),
        "report": os.path.join(job, "report.json"),
        "length_aware": length,
    }
    spec_path = os.path.join(job, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    command = [sys.executable, os.path.abspath(__file__), "--mltransform-job", spec_path]
    log = os.path.join(work, f"{side}-{attempt}.log")
    load_before = load_average()
    wall, code = timed_process(command, dict(os.environ), log)
    if code != 0:
        raise SystemExit(f"MLTransform job exited {code}:\n{tail(log)}")
    with open(spec["report"]) as f:
        report = json.load(f)
    artifacts = [p for p in glob.glob(os.path.join(spec["artifacts"], "**"), recursive=True) if os.path.isfile(p)]
    return {
        "command": " ".join(command[1:]),
        "wall_s": wall,
        "output": spec["output"],
        "load_before": load_before,
        "load_after": load_average(),
        "device": args.mlt_device,
        "length_aware": length,
        **report,
        "artifact_files": len(artifacts),
        "artifact_bytes": sum(os.path.getsize(p) for p in artifacts),
    }


def read_vectors(files: list[str]) -> dict:
    import numpy as np
    import pyarrow.parquet as pq

    vectors = {}
    for name in files:
        table = pq.read_table(name, columns=["id", "embedding"]).to_pydict()
        for doc_id, vector in zip(table["id"], table["embedding"]):
            if doc_id in vectors:
                raise SystemExit(f"{name}: id {doc_id!r} written twice")
            vectors[doc_id] = np.asarray(vector, np.float32)
    return vectors


def agreement(docbeam_out: str, mltransform_out: str, docs) -> dict:
    """One MLTransform vector per document, and its cosine with docbeam's vector for the same id (all documents)."""
    import numpy as np

    with open(os.path.join(docbeam_out, "_manifest.json")) as f:
        manifest = json.load(f)
    ours = read_vectors(
        [os.path.join(docbeam_out, e["path"]) for e in manifest["files"] if e["path"].startswith("embeddings/")]
    )
    theirs = read_vectors(sorted(glob.glob(os.path.join(mltransform_out, "*.parquet"))))
    ids = [d.id for d in docs]
    missing = {"docbeam": sorted(set(ids) - set(ours))[:5], "mltransform": sorted(set(ids) - set(theirs))[:5]}
    common_ids = [i for i in ids if i in ours and i in theirs]
    cosines = np.array(
        [float(ours[i] @ theirs[i] / (np.linalg.norm(ours[i]) * np.linalg.norm(theirs[i]))) for i in common_ids]
    )
    worst = int(np.argmin(cosines)) if len(cosines) else None
    return {
        "docs": len(ids),
        "docbeam_vectors": len(ours),
        "mltransform_vectors": len(theirs),
        "missing": missing,
        "compared": len(common_ids),
        "lowest_cosine": float(cosines.min()) if len(cosines) else None,
        "lowest_cosine_id": common_ids[worst] if worst is not None else None,
        "mean_cosine": float(cosines.mean()) if len(cosines) else None,
        "ok": (
            len(ours) == len(theirs) == len(ids)
            and len(common_ids) == len(ids)
            and float(cosines.min()) >= COSINE_FLOOR
        ),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mltransform_job:
        return mltransform_job(args.mltransform_job)
    # Without JAX here: on a GPU or TPU this process must not hold the device docbeam's process needs.
    info = common.machine(with_jax=False)
    common.print_machine("whole process: docbeam run vs Beam MLTransform + SentenceTransformerEmbeddings", info)
    from docbeam.models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(args.model, "float32")
    folder, window_len = checkpoint.folder, checkpoint.settings.max_seq_len
    source, docs = common.corpus_documents(args, folder)
    tokens = truncated_tokens(docs, folder, window_len)
    cache = "empty (--cold-cache)" if args.cold_cache else os.environ["JAX_COMPILATION_CACHE_DIR"]
    print(
        f"{len(docs)} documents from {os.path.relpath(source, common.REPO)}, {tokens} tokens after truncation to "
        f"{window_len}; model {folder}; MLTransform on {args.mlt_device}, torch threads {args.torch_threads}; "
        f"JAX compilation cache {cache}; "
        f"{args.repeats} run(s) of each\n",
        flush=True,
    )

    import yaml

    with open(common.LOCAL_CONFIG) as f:
        buckets = yaml.safe_load(f)["batching"]["buckets"]
    length = {"boundaries": length_boundaries(buckets), "max_batch_duration_secs": MAX_BATCH_DURATION_S}
    sides = ("docbeam", "mltransform", "mltransform_length")
    runs = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="docbeam-vs-mlt-") as work:
        corpus = common.write_subset(docs, work)
        for attempt in range(args.repeats):
            order = sides[attempt % 3 :] + sides[: attempt % 3]  # each side goes first once in three runs
            for side in order:
                if side == "docbeam":
                    run = run_docbeam(args, corpus, work, attempt)
                else:
                    aware = length if side == "mltransform_length" else None
                    run = run_mltransform(args, corpus, work, attempt, folder, window_len, aware)
                runs[side].append(run)
                print(
                    f"{side} run {attempt + 1}: {run['wall_s']:.1f} s (load average {run['load_before']} before, "
                    f"{run['load_after']} after)",
                    flush=True,
                )
        ours = min(runs["docbeam"], key=lambda r: r["wall_s"])
        plain = min(runs["mltransform"], key=lambda r: r["wall_s"])
        aware = min(runs["mltransform_length"], key=lambda r: r["wall_s"])
        theirs = min(plain, aware, key=lambda r: r["wall_s"])  # the anchor's best form
        check = agreement(ours["output"], plain["output"], docs)
        check_length = agreement(ours["output"], aware["output"], docs)
    for run in runs["docbeam"] + runs["mltransform"] + runs["mltransform_length"]:
        run.pop("output", None)

    speedup = common.ratio(theirs["wall_s"], ours["wall_s"])
    print(
        "\n## Whole process, launch to exit (DirectRunner, truncate to "
        f"{window_len} tokens, float32, {info['cpus_usable']} CPUs)\n"
    )
    rows = [
        [name, r["wall_s"], len(docs), tokens, len(docs) / r["wall_s"], tokens / r["wall_s"]]
        for name, r in (
            ("docbeam run", ours),
            ("Beam MLTransform + SentenceTransformerEmbeddings", plain),
            (f"the same, length-aware batching (Beam {beam_version()}, boundaries {length['boundaries']})", aware),
        )
    ]
    print(common.table(["process", "wall s", "docs", "tokens", "docs/s", "tokens/s"], rows))
    print(
        f"\ndocbeam speed-up (the faster MLTransform's wall ÷ docbeam wall): **{speedup:.2f}×**; against plain "
        f"MLTransform {common.ratio(plain['wall_s'], ours['wall_s']):.2f}×, against length-aware "
        f"{common.ratio(aware['wall_s'], ours['wall_s']):.2f}×"
    )
    if ours["real_tokens"] != tokens:
        print(f"note: docbeam counted {ours['real_tokens']} real tokens, the tokenizer {tokens}")

    print("\n## Inside each run\n")
    print(common.table(["measure", "value"], docbeam_rows(ours)))
    for title, run, agreed in (("MLTransform", plain, check), ("MLTransform, length-aware", aware, check_length)):
        print(f"\n{title}:\n")
        print(common.table(["measure", "value"], mltransform_rows(run)))
        print(
            f"\n{title} vectors: {agreed['mltransform_vectors']} for {agreed['docs']} documents; lowest cosine "
            f"with docbeam's over {agreed['compared']}: {agreed['lowest_cosine']:.6f} ({agreed['lowest_cosine_id']}); "
            f"{'PASS' if agreed['ok'] else 'FAIL'} (one vector per document, cosine ≥ {COSINE_FLOOR})"
        )

    common.write_results(
        args,
        "vs_mltransform" + ("-cold-cache" if args.cold_cache else ""),
        {
            "machine": info,
            "args": vars(args),
            "corpus": os.path.relpath(source, common.REPO),
            "docs": len(docs),
            "tokens": tokens,
            "window_len": window_len,
            "model_folder": folder,
            "docbeam": ours,
            "mltransform": theirs,
            "mltransform_plain": plain,
            "mltransform_length": aware,
            "runs": runs,
            "docbeam_speedup": speedup,
            "docbeam_speedup_plain": common.ratio(plain["wall_s"], ours["wall_s"]),
            "docbeam_speedup_length": common.ratio(aware["wall_s"], ours["wall_s"]),
            "agreement": check,
            "agreement_length": check_length,
        },
    )
    return 0 if check["ok"] and check_length["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
