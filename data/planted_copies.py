"""A corpus with planted copies, made from the shipped sample, for deduplication's tests and benchmark.

    python data/planted_copies.py --out planted.jsonl --truth planted_truth.json --groups 30 --singles 60 --seed 0

Each group is one original and copies of it, of the kinds a crawl holds: ``exact`` (the same text),
``whitespace`` (spacing and line breaks changed, the text in NFD), ``edited`` (a few words replaced) and
``reordered`` (its sentences in another order). Singles are originals without copies. Originals are sample
documents of at least ``MIN_WORDS`` words whose word sets overlap little (Jaccard below ``MAX_OVERLAP``), so the
sample's own near-twins do not blur the truth. Larger corpora (``--mixed``) add distinct documents made of
sentences of several sample documents. Ids are random, so the original is not always first by id. The same
arguments give the same file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import random
import re
import unicodedata

SAMPLE = pathlib.Path(__file__).parent / "sample" / "docs.jsonl.gz"
MIN_WORDS = 40
MAX_WORDS = 220
MAX_OVERLAP = 0.3
KINDS = ("exact", "whitespace", "edited", "reordered")
FILLER = "system value object method return module file data string number list type error result".split()


def sample_texts() -> list[str]:
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def originals(texts: list[str]) -> list[str]:
    """Sample documents long enough to edit, cut to MAX_WORDS words, none overlapping another much."""
    chosen, sets = [], []
    for text in texts:
        words = text.split()
        if len(words) < MIN_WORDS:
            continue
        text = " ".join(words[:MAX_WORDS]) if len(words) > MAX_WORDS else text
        own = _words(text)
        if all(len(own & s) / len(own | s) < MAX_OVERLAP for s in sets):
            chosen.append(text)
            sets.append(own)
    return chosen


def sentences(text: str) -> list[str]:
    parts = [p for p in re.split(r"(?<=[.!?])\s+|\n\n+", text) if p.strip()]
    if len(parts) < 3:  # too few sentences to reorder: reorder lines, then thirds of the words
        parts = [p for p in text.split("\n") if p.strip()]
    if len(parts) < 3:
        words = text.split()
        third = max(len(words) // 3, 1)
        parts = [" ".join(words[i : i + third]) for i in range(0, len(words), third)]
    return parts


def copy_of(text: str, kind: str, rng: random.Random) -> str:
    if kind == "exact":
        return text
    if kind == "whitespace":
        spaced = re.sub(r" ", lambda _: rng.choice([" ", "  ", "\n", " \t "]), text)
        return unicodedata.normalize("NFD", "\n " + spaced + "  \n")
    if kind == "edited":
        words = text.split(" ")
        for _ in range(max(1, len(words) // 60)):  # about one word in sixty
            words[rng.randrange(len(words))] = rng.choice(FILLER)
        return " ".join(words)
    parts = sentences(text)
    shuffled = parts[:]
    while shuffled == parts:
        rng.shuffle(shuffled)
    return " ".join(shuffled)


def mixed(texts: list[str], rng: random.Random) -> str:
    """A distinct document: sentences of four sample documents."""
    return " ".join(rng.choice(sentences(rng.choice(texts))) for _ in range(4))


def planted(groups: int, singles: int, seed: int, mixed_docs: int = 0, kinds=KINDS) -> tuple[list[dict], dict]:
    """(documents, truth): truth maps each id to ``{"group": g or None, "kind": original|exact|...|single}``."""
    rng = random.Random(seed)
    texts = sample_texts()
    pool = originals(texts)
    rng.shuffle(pool)
    if groups + singles > len(pool):
        raise SystemExit(f"--groups {groups} + --singles {singles} > the {len(pool)} distinct originals of the sample")
    docs, truth = [], {}

    def add(text: str, group, kind: str) -> None:
        doc_id = f"d{rng.getrandbits(48):012x}"
        docs.append({"id": doc_id, "text": text})
        truth[doc_id] = {"group": group, "kind": kind}

    for g, text in enumerate(pool[:groups]):
        add(text, g, "original")
        for kind in kinds:
            add(copy_of(text, kind, rng), g, kind)
    for text in pool[groups : groups + singles]:
        add(text, None, "single")
    for _ in range(mixed_docs):
        add(mixed(texts, rng), None, "mixed")
    rng.shuffle(docs)
    return docs, truth


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--groups", type=int, default=30)
    parser.add_argument("--singles", type=int, default=60)
    parser.add_argument("--mixed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    docs, truth = planted(args.groups, args.singles, args.seed, args.mixed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
