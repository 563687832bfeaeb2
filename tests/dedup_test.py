"""output.dedup's parts, without a job: what each method compares (signatures.py), who is marked (marking.py), the
clusters (clusters.py) and the section's checks. A whole run: tests/dedup_run_test.py."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from docbeam import config
from docbeam.pipeline.sinks.dedup import clusters, signatures
from docbeam.pipeline.sinks.dedup.marking import Item, Mark, mark_cluster, mark_exact, mark_near

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def text_of(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(n))


def true_jaccard(a: str, b: str, n: int = 5) -> float:
    def grams(t):
        w = signatures.words(t)
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def test_the_exact_key_ignores_unicode_composition_and_whitespace_but_nothing_else():
    text = "Café  au\tlait\n\nest   chaud."
    assert signatures.exact_key(text) == signatures.exact_key("  Cafe\u0301 au lait est chaud. ")
    assert signatures.exact_key(text) != signatures.exact_key("café au lait est chaud.")  # case is content
    assert signatures.exact_key(text) != signatures.exact_key("Café au lait est chaud!")


def test_a_signature_is_the_same_in_another_process():
    """A stored signature (dedup_index/) is compared with ones another worker computes: never Python's hash."""
    text = "The quick brown fox jumps over the lazy dog near the river bank today."
    here = signatures.signature(text, 5, 16).tolist()
    code = f"from docbeam.pipeline.sinks.dedup import signatures as s;print(s.signature({text!r}, 5, 16).tolist())"
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    )
    assert there.stdout.strip() == str(here)


def test_the_estimated_jaccard_tracks_the_true_one():
    rng = random.Random(0)
    errors = []
    for _ in range(30):
        base = text_of(rng, 120).split()
        edited = base[:]
        for _ in range(rng.randrange(1, 12)):
            edited[rng.randrange(len(edited))] = "changed"
        a, b = " ".join(base), " ".join(edited)
        estimate = signatures.estimated_jaccard(signatures.signature(a, 5, 256), signatures.signature(b, 5, 256))
        errors.append(abs(estimate - true_jaccard(a, b)))
    assert np.mean(errors) < 0.03 and max(errors) < 0.1  # sd of a 256-permutation estimate: at most 0.031


def test_texts_too_short_for_an_ngram_and_without_words_still_get_a_signature():
    one_word, no_words = signatures.signature("hello", 5, 8), signatures.signature("!!! ???", 5, 8)
    assert one_word.shape == no_words.shape == (8,)
    assert signatures.estimated_jaccard(one_word, signatures.signature("  HELLO. ", 5, 8)) == 1.0
    assert signatures.estimated_jaccard(no_words, signatures.signature("!!! !!!", 5, 8)) < 1.0


def test_a_huge_document_is_signed_in_pieces_with_the_same_result():
    rng = random.Random(1)
    text = text_of(rng, 3 * signatures.shingle_piece(32) + 17)
    whole = signatures.signature(text, 5, 32)
    shingles = signatures.shingle_hashes(text, 5)
    a, b = signatures.permutations(32)
    with np.errstate(over="ignore"):
        reference = ((shingles[:, None] * a + b) >> np.uint64(32)).min(axis=0).astype(np.uint32)
    assert len(shingles) > signatures.shingle_piece(32) and (whole == reference).all()


def test_two_documents_meet_in_a_band_as_often_as_the_s_curve_says():
    rng = random.Random(2)
    met = []
    for _ in range(200):
        base = text_of(rng, 60).split()
        edited = [w if rng.random() > 0.06 else "x" for w in base]
        a, b = (signatures.signature(" ".join(t), 5, 4 * 4) for t in (base, edited))
        met.append(bool(set(signatures.band_keys(a, 4, 4)) & set(signatures.band_keys(b, 4, 4))))
    same_band_other_index = signatures.band_keys(np.zeros(8, np.uint32), 2, 4)
    assert same_band_other_index[0] != same_band_other_index[1]  # equal values in two bands never meet
    assert 0.2 < np.mean(met) < 0.95  # about J ≈ 0.55: 1 − (1 − 0.55⁴)⁴ ≈ 0.38, never all or none
    assert signatures.candidate_probability(0.9, 14, 8) > 0.99 > 0.05 > signatures.candidate_probability(0.3, 14, 8)


def item(doc_id: str, key: str = "k", protected: bool = False) -> Item:
    return Item(doc_id, key, protected=protected)


def exact(items: list[Item]) -> tuple[list[Item], list[Mark]]:
    out = list(mark_exact(items))
    return [o for o in out if isinstance(o, Item)], [o for o in out if isinstance(o, Mark)]


def test_of_identical_documents_the_first_by_id_is_kept_and_a_protected_one_before_it():
    kept, marks = exact([item("c"), item("a"), item("b")])
    assert [(k.id, k.protected) for k in kept] == [("a", True)]  # kept a copy: later methods never mark it
    assert {(m.id, m.duplicate_of, m.kind) for m in marks} == {("b", "a", "exact"), ("c", "a", "exact")}
    kept, marks = exact([item("a"), item("z", protected=True), item("y", protected=True)])
    assert sorted(k.id for k in kept) == ["y", "z"] and [(m.id, m.duplicate_of) for m in marks] == [("a", "y")]
    kept, marks = exact([item("only")])
    assert [(k.id, k.protected) for k in kept] == [("only", False)] and marks == []


def test_near_marks_point_at_roots_only_and_never_mark_a_protected_one():
    """Pairs are (earlier, later) by priority; a protected document is never the later one. p and q: protected."""
    edges = {("a", "b"): 0.9, ("b", "c"): 0.9, ("a", "c"): 0.7, ("p", "a"): 0.85, ("p", "q"): 0.95, ("q", "e"): 0.9}
    edges = {pair: sim for pair, sim in edges.items() if pair != ("p", "q")}  # two protected: no pair between them
    marks = {m.id: m for m in mark_near(edges, 0.8)}
    assert {i: m.duplicate_of for i, m in marks.items()} == {"a": "p", "e": "q"}  # b, c: no root before them
    assert not {m.duplicate_of for m in marks.values()} & set(marks)


def test_of_several_roots_the_most_similar_then_the_first_by_id_is_named():
    marks = mark_near({("r1", "x"): 0.85, ("r2", "x"): 0.95, ("r3", "x"): 0.95, ("r1", "y"): 0.9}, 0.8)
    assert [(m.id, m.duplicate_of, m.similarity) for m in marks] == [("x", "r2", 0.95), ("y", "r1", 0.9)]


def test_a_pair_below_the_threshold_marks_nothing():
    assert mark_near({("a", "b"): 0.79}, 0.8) == []


def test_semdedup_marks_against_the_most_similar_kept_predecessor():
    v = clusters.unit([[1, 0, 0], [0.99, 0.1, 0], [0.98, 0.15, 0.05], [0, 1, 0], [0, 0.999, 0.04]])
    marks, closest = mark_cluster(["a", "b", "c", "d", "e"], v, [False] * 5, eps=0.05)
    assert [(m.id, m.duplicate_of) for m in marks] == [("b", "a"), ("c", "a"), ("e", "d")]
    assert all(0.95 <= m.similarity <= 1 for m in marks)
    assert dict(closest)["c"] == pytest.approx(float(v[2] @ v[1]))  # SemDeDup's measure: any predecessor
    marks, _ = mark_cluster(["a", "b"], v[:2], [True, True], eps=0.05)
    assert marks == []  # two documents an earlier run kept are never judged again


def test_a_cluster_the_sample_says_is_too_big_is_split():
    rng = np.random.default_rng(0)
    blobs = np.eye(8)[0] + 0.2 * np.eye(8)[1:5]  # four sub-topics of one topic, each tight
    tight = clusters.unit(np.repeat(blobs, 100, axis=0) + rng.normal(size=(400, 8)) * 0.005)
    spread = clusters.unit(-np.abs(rng.normal(size=(100, 8))))
    plan = clusters.fit(np.concatenate([tight, spread]), count=5000, clusters=2, max_cluster=500, seed=0)
    assert len(plan.centroids_KxD) == 2 and plan.split, plan.describe()
    keys = {plan.assign(v, f"d{i}", 0)[0] for i, v in enumerate(tight)}
    assert all("." in k for k in keys) and len(keys) > 1
    assert clusters.how_many(count=10, sample=10, clusters=None, max_cluster=2000) == 1
    assert clusters.how_many(count=1_000_000, sample=20_000, clusters=None, max_cluster=2000) == 1000


def test_a_topic_too_dense_to_split_is_cut_in_hash_pieces_the_same_every_run():
    same = clusters.unit(np.ones((64, 8)))  # boilerplate: one vector, 10,000 times
    plan = clusters.fit(same, count=10_000, clusters=1, max_cluster=1000, seed=3)
    keys = [plan.assign(v, f"doc{i}", 3)[0] for i, v in enumerate(same)]
    assert plan.describe()["pieces"] and len(set(keys)) > 1 and all("#" in k for k in keys)
    assert keys == [plan.assign(v, f"doc{i}", 3)[0] for i, v in enumerate(same)]


def test_semdedup_marks_do_not_depend_on_the_order_a_cluster_arrives_in():
    from docbeam.pipeline.sinks.dedup.steps import cluster_marks

    v = clusters.unit(np.ones(4))
    members = [((True, 0.0, f"d{i}"), f"d{i}", v, False) for i in range(5)]
    outcomes = set()
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        out = list(cluster_marks(("c", [members[i] for i in order]), eps=0.01, max_cluster=2))
        outcomes.add(tuple(sorted((m.id, m.duplicate_of) for m in out if isinstance(m, Mark))))
    assert len(outcomes) == 1, outcomes


def test_an_empty_sample_plans_one_cluster():
    assert clusters.fit(np.zeros((0, 4), np.float32), 0, None, 100, 0).describe()["clusters"] == 1


def job(tmp_path, dedup, **output) -> dict:
    return {"input": {"path": "docs.jsonl"}, "output": {"path": str(tmp_path), "dedup": dedup, **output}}


def test_dedup_true_is_exact_and_near_with_their_defaults(tmp_path):
    section = config.parse(job(tmp_path, True), base_dir=str(tmp_path)).output.dedup
    assert (section.exact, section.near.threshold, section.near.bands, section.semantic) == (True, 0.8, 14, None)
    semantic = config.parse(job(tmp_path, {"semantic": True}), base_dir=str(tmp_path)).output.dedup.semantic
    assert (semantic.eps, semantic.clusters, semantic.keep) == (0.05, "auto", "hard")


@pytest.mark.parametrize(
    "dedup, output, message",
    [
        ({}, {}, "names no method"),
        ({"exact": False}, {}, "names no method"),
        ({"near": {"threshold": 1.5}}, {}, "less than or equal to 1"),
        ({"semantic": {"eps": 0}}, {}, "greater than 0"),
        ({"semantic": {"keep": "hardest"}}, {}, "'hard', 'easy' or 'random'"),
        ({"semantic": {}}, {"vector_dtype": "int8"}, "output.vector_dtype: float32"),
        ({"exact": True}, {"granularity": "chunk"}, "output.granularity: document or both"),
        ({"exact": "yes"}, {}, "valid boolean"),
        ({"nearby": {}}, {}, "nearby"),
        ({"near": {"threshold": True}}, {}, "threshold takes a number or a word, not true"),
        ({"semantic": {"clusters": True}}, {}, "clusters takes a number or a word, not true"),
        ({"semantic": {"seed": -5}}, {}, "greater than or equal to 0"),
        ({"near": {"bands": 512, "rows": 64}}, {}, "32768 permutations, more than 1024"),
        ({"semantic": {"max_cluster": 50_000}}, {}, "less than or equal to 20000"),
        ({"exact": True, "history": True}, {"vertex_ai": {"skip_duplicates": True}}, "drop one"),
    ],
)
def test_a_dedup_section_that_cannot_run_is_refused_with_the_fix(tmp_path, dedup, output, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.parse(job(tmp_path, dedup, **output), base_dir=str(tmp_path))


def test_every_pair_of_methods_is_a_valid_section(tmp_path):
    methods = {"exact": True, "near": {}, "semantic": {}}
    for n in (1, 2, 3):
        for chosen in itertools.combinations(methods, n):
            config.parse(job(tmp_path, {k: methods[k] for k in chosen}), base_dir=str(tmp_path))
