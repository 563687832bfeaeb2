"""Hybrid retrieval outputs beside the dense run of the same backbone: SPLADE (the sparse head), ColBERT (the
multi-vector head, bge-m3's colbert_linear layout) and bge-m3's three heads from one pass, with docs/s, tokens/s
and the bytes each output costs per document, in one process, alternating, so all see the same machine.

    python benchmarks/hybrid.py [--repeats 3] [--docs 400] [--quick]

Every run encodes the default model's backbone (all-MiniLM-L6-v2's real weights, 256-token windows, first window
only, as the sparse and multi-vector heads truncate); the heads are drawn at random, so their cost is real and
their values are not: SPLADE's masked-LM transform (std 0.02) with the decoder tied to the word embeddings and
a bias that leaves a few terms per token (the terms per document are whatever the random head gives, reported
as measured); ColBERT's 384 → 128 projection;
bge-m3's sparse_linear (384 → 1) beside that projection. Bytes per document: the representation as written
(dense float32; sparse 8 bytes a term, int32 index plus float32 value; multi-vector width × float32 a token)
and the run's Parquet files on disk divided by its documents.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

COLBERT_WIDTH = 128
TRUNCATE = ("tokenize.long_documents=truncate",)  # first windows: the sparse and multi-vector heads truncate
TERMS_PER_TOKEN = 4  # the random SPLADE head's bias leaves about this many positive logits per token


def copy_tokenizer(source: str, folder: str) -> None:
    from docbeam.models.checkpoint import TOKENIZER_FILES

    for name in TOKENIZER_FILES + ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)


def splade_from_backbone(folder: str, texts: list[str]) -> str:
    """The backbone as BertForMaskedLM with a random transform (std 0.02), the decoder tied to the word
    embeddings, and a bias set so that about TERMS_PER_TOKEN logits per token are positive."""
    import torch
    import transformers

    from docbeam.models.checkpoint import resolve_dir

    source = resolve_dir(common.DEFAULT_MODEL)
    config = transformers.AutoConfig.from_pretrained(source)
    config.architectures = ["BertForMaskedLM"]
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM.from_pretrained(source, config=config).eval()
    transform = model.cls.predictions.transform
    with torch.no_grad():
        transform.dense.weight.normal_(0.0, 0.02)
        transform.dense.bias.zero_()
        model.cls.predictions.bias.zero_()
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        batch = tokenizer(texts[:16], truncation=True, max_length=128, padding=True, return_tensors="pt")
        logits = model(**batch).logits[batch["attention_mask"].bool()]
        cut = torch.quantile(logits[:256].flatten().float(), 1.0 - TERMS_PER_TOKEN / logits.shape[-1])
        model.cls.predictions.bias.fill_(-float(cut))
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(source, folder)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))  # a bare masked-LM checkpoint: model.head: sparse names it
    return folder


def m3_from_backbone(folder: str) -> str:
    """The backbone with bge-m3's two torch heads beside it: colbert_linear.pt (384 → COLBERT_WIDTH) and
    sparse_linear.pt (384 → 1), as FlagEmbedding saves them."""
    import torch

    from docbeam.models.checkpoint import resolve_dir

    source = resolve_dir(common.DEFAULT_MODEL)
    shutil.copytree(source, folder)
    torch.manual_seed(1)
    for name, width in (("colbert_linear.pt", COLBERT_WIDTH), ("sparse_linear.pt", 1)):
        linear = torch.nn.Linear(384, width)
        with torch.no_grad():
            linear.weight.normal_(0.0, 0.1)
        torch.save(linear.state_dict(), os.path.join(folder, name))
    return folder


def bytes_per_document(summary: dict, output: str) -> dict:
    """Each representation's bytes as written (summary.json's ``representations``), their sum, and the run's
    Parquet files on disk, per document."""
    docs = max(summary["docs_embedded"], 1)
    files = glob.glob(os.path.join(output, "embeddings", "*.parquet"))
    sizes = summary.get("representations") or {}
    written = {name: figures["bytes_per_document"] for name, figures in sizes.items()}
    return {
        **written,
        "as_written": round(sum(written.values()), 1),
        "parquet": round(sum(map(os.path.getsize, files)) / docs, 1),
        "representations": sizes,
    }


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--docs", type=int, default=400, help="documents of the sample corpus")
    p.add_argument("--without-m3", action="store_true", help="leave out bge-m3's three heads")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.docs = 1, 40
    info = common.machine()
    common.print_machine("hybrid outputs vs the dense embedding, same backbone and corpus", info)
    work = tempfile.mkdtemp(prefix="docbeam-hybrid-")
    docs = common.read_documents(common.SAMPLE, args.docs)
    corpus = common.write_subset(docs, work)
    splade = splade_from_backbone(os.path.join(work, "splade"), [d.text for d in docs])
    m3 = m3_from_backbone(os.path.join(work, "m3"))
    runs = {
        "dense (embedding)": (common.DEFAULT_MODEL, {}, "embedding"),
        "SPLADE (sparse)": (splade, {"head": "sparse"}, "sparse"),
        "ColBERT (multi_vector)": (m3, {"head": "multi_vector"}, "multi_vector"),
    }
    if not args.without_m3:
        runs["bge-m3: dense + sparse + ColBERT"] = (m3, {"head": "bge_m3"}, "bge_m3")
    for model, settings, _ in runs.values():  # warm: compilations cached, encoder loaded once per spec
        common.run_local_job(model, corpus, os.path.join(work, "warm"), TRUNCATE, **settings)
    measured = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, (model, settings, head) in runs.items():
            output = os.path.join(work, f"{repeat}-{head}")
            s = common.run_local_job(model, corpus, output, TRUNCATE, **settings)
            measured[name].append(
                {
                    **{
                        k: s[k]
                        for k in (
                            "docs_per_second",
                            "tokens_per_second",
                            "real_tokens",
                            "docs_embedded",
                            "wall_seconds",
                        )
                    },
                    "bytes_per_document": bytes_per_document(s, output),
                }
            )
    best = {name: max(rows, key=lambda r: r["docs_per_second"]) for name, rows in measured.items()}
    base = best["dense (embedding)"]
    rows = [
        [
            name,
            r["docs_embedded"],
            r["real_tokens"],
            r["docs_per_second"],
            r["tokens_per_second"],
            common.ratio(r["tokens_per_second"], base["tokens_per_second"]),
            r["bytes_per_document"]["as_written"],
            r["bytes_per_document"]["parquet"],
        ]
        for name, r in best.items()
    ]
    print(
        common.table(
            [
                "run",
                "documents",
                "tokens",
                "docs/s",
                "tokens/s",
                "tokens/s ÷ dense",
                "bytes/doc as written",
                "bytes/doc Parquet",
            ],
            rows,
        )
    )
    shutil.rmtree(work, ignore_errors=True)
    common.write_results(
        args, "hybrid", {"machine": info, "docs": args.docs, "repeats": args.repeats, "best": best, "runs": measured}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
