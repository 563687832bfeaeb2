"""A classifier run beside the embedding run of the same backbone and corpus: docs/s and tokens/s of each, in one
process, alternating, so the two see the same machine.

    python benchmarks/classifier.py [--repeats 3] [--docs 400] [--quick]

The backbone is the default model (all-MiniLM-L6-v2's real weights); the classifier is that backbone with BERT's
pooler and a 5-label (softmax) classifier drawn at random (std 0.2), saved as transformers'
BertForSequenceClassification, so both runs encode the same tokens and differ only in their head: a pooled,
normalised 384-wide vector per document, or 5 softmax scores of the first window (model.classifier.windows
first, the default: long documents are cut to one window, so the classifier encodes fewer tokens), and both
``windows: mean`` to score every window as the embedder encodes them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

LABELS = ("art", "law", "medicine", "science", "sport")


def classifier_from_backbone(folder: str) -> str:
    """The default model's backbone with a random pooler and classifier, as BertForSequenceClassification."""
    import torch
    import transformers

    from docbeam.models.checkpoint import TOKENIZER_FILES, resolve_dir

    source = resolve_dir(common.DEFAULT_MODEL)
    config = transformers.AutoConfig.from_pretrained(source)
    config.num_labels, config.id2label = len(LABELS), dict(enumerate(LABELS))
    config.label2id, config.architectures = {v: k for k, v in enumerate(LABELS)}, ["BertForSequenceClassification"]
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(source, config=config).eval()
    with torch.no_grad():
        for layer in (model.bert.pooler.dense, model.classifier):
            layer.weight.normal_(0.0, 0.2)
            layer.bias.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)
    return folder


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--docs", type=int, default=400, help="documents of the sample corpus")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.docs = 1, 40
    info = common.machine()
    common.print_machine("classifier vs embedding, same backbone and corpus", info)
    work = tempfile.mkdtemp(prefix="docbeam-classifier-")
    docs = common.read_documents(common.SAMPLE, args.docs)
    corpus = common.write_subset(docs, work)
    classifier = classifier_from_backbone(os.path.join(work, "classifier"))
    runs = {
        "embedding": (common.DEFAULT_MODEL, {}),
        "classifier, first window": (classifier, {}),
        "classifier, every window (mean)": (classifier, {"classifier.windows": "mean"}),
    }
    for model, settings in runs.values():  # warm: compilations cached, encoder loaded once per spec
        common.run_local_job(model, corpus, os.path.join(work, "warm"), **settings)
    measured = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, (model, settings) in runs.items():
            s = common.run_local_job(model, corpus, os.path.join(work, f"{repeat}-{len(measured[name])}"), **settings)
            measured[name].append(
                {
                    k: s[k]
                    for k in (
                        "docs_per_second",
                        "tokens_per_second",
                        "real_tokens",
                        "docs_embedded",
                        "wall_seconds",
                        "windows",
                    )
                }
            )
    best = {name: max(rows, key=lambda r: r["docs_per_second"]) for name, rows in measured.items()}
    base = best["embedding"]
    rows = [
        [
            name,
            r["docs_embedded"],
            r["windows"],
            r["real_tokens"],
            r["docs_per_second"],
            r["tokens_per_second"],
            common.ratio(r["docs_per_second"], base["docs_per_second"]),
            common.ratio(r["tokens_per_second"], base["tokens_per_second"]),
        ]
        for name, r in best.items()
    ]
    print(
        common.table(
            [
                "run",
                "documents",
                "windows",
                "tokens",
                "docs/s",
                "tokens/s",
                "docs/s ÷ embedding",
                "tokens/s ÷ embedding",
            ],
            rows,
        )
    )
    shutil.rmtree(work, ignore_errors=True)
    common.write_results(
        args,
        "classifier",
        {"machine": info, "docs": args.docs, "repeats": args.repeats, "best": best, "runs": measured},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
