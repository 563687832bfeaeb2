"""data/make_sample.py: the length quotas, and the held-out corpus a benchmark draws with --fill-short-bins."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os

import pytest
from conftest import REPO


@functools.cache
def make_sample():
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(REPO, "data", "make_sample.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus(module, per_bin: list[int]):
    """Distinct documents (no shared word triples), ``per_bin[i]`` of them in length bin i."""
    docs, counts = [], {}
    for b, ((low, _, _), n) in enumerate(zip(module.LENGTH_BINS, per_bin)):
        for i in range(n):
            doc = module.Document(f"bin{b}.doc{i}", " ".join(f"w{b}x{i}y{k}" for k in range(30)))
            docs.append(doc)
            counts[doc.doc_id] = low + 1
    return docs, counts


def test_a_short_bin_fails_unless_its_quota_goes_to_the_others():
    module = make_sample()
    docs, counts = corpus(module, [40, 40, 40, 40, 40, 1])  # 100 documents would need 4 of over 1024 tokens
    with pytest.raises(ValueError, match="only 1 distinct documents of 1024-3072 tokens, need 4.*--fill-short-bins"):
        module.select(docs, counts, 100, seed=1)
    chosen = module.select(docs, counts, 100, seed=1, fill_short_bins=True)
    assert len(chosen) == len({d.doc_id for d in chosen}) == 100
    assert sum(d.doc_id.startswith("bin5.") for d in chosen) == 1


def test_without_short_bins_the_choice_is_unchanged_by_the_option():
    module = make_sample()
    docs, counts = corpus(module, [40] * 6)
    assert module.select(docs, counts, 50, seed=0) == module.select(docs, counts, 50, seed=0, fill_short_bins=True)


def test_corpus_ids_reads_the_ids_to_exclude(tmp_path):
    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"id": 7, "text": "a"}) + "\n\n" + json.dumps({"id": "b", "text": "c"}) + "\n")
    assert make_sample().corpus_ids(path) == {"7", "b"}
