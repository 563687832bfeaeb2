"""Tokenize: Documents → TokenWindows with the checkpoint's own fast tokenizer.

A document longer than the window is split by the tokenizer itself (``return_overflowing_tokens`` with
``stride`` overlap), each window framed by the special tokens; or, by config, only the first is kept.
A document with no tokens of its own is rejected (``no_tokens``): its lone [CLS] [SEP] window would embed
every such document as the same vector. A document the tokenizer raises on is rejected (``tokenizer_error``),
never its batch.
"""
from __future__ import annotations

import time

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline.config import TokenizeConfig
from pipeline.observe import METRICS_NAMESPACE, StageClock
from pipeline.records import Document, Rejected, TokenWindow, writable

REJECTED_TAG = "rejected"


def content_tokens(window_lengths: list[int], stride: int, special: int) -> int:
    """Tokens of the document itself: each window after the first repeats ``stride`` of the previous one."""
    return sum(n - special for n in window_lengths) - stride * (len(window_lengths) - 1)


def stride_problem(stride: int, window_len: int, special: int) -> str | None:
    """Why ``stride`` cannot cut windows of ``window_len`` tokens, ``special`` of them the tokenizer's own
    (None when it can): every window after the first must bring tokens of its own."""
    if stride < window_len - special:
        return None
    return (f"tokenize.stride={stride} must be smaller than a window's content ({window_len - special} tokens "
            f"for window {window_len}); e.g. 32")


def tokenize_documents(documents: list[Document], tokenizer, *, window_len: int,
                       config: TokenizeConfig) -> tuple[list[TokenWindow], list[Rejected]]:
    """The windows of every document that has tokens, a ``no_tokens`` Rejected for each one that has none,
    and a ``tokenizer_error`` Rejected for each one the tokenizer raises on: the batch is tokenized again one
    document at a time, so one such document costs only itself."""
    special = tokenizer.num_special_tokens_to_add(pair=False)
    problem = stride_problem(config.stride, window_len, special)
    if problem:
        raise ValueError(problem)
    try:
        encoded = tokenizer([d.text for d in documents], max_length=window_len, truncation=True,
                            stride=config.stride, return_overflowing_tokens=True, return_attention_mask=False,
                            return_token_type_ids=False)
    except Exception as e:  # noqa: BLE001  which document it was is found below, one at a time
        if len(documents) > 1:
            alone = [tokenize_documents([d], tokenizer, window_len=window_len, config=config) for d in documents]
            return [w for windows, _ in alone for w in windows], [r for _, rejected in alone for r in rejected]
        doc = documents[0]
        return [], [Rejected(doc.source, doc.line, doc.id, "tokenizer_error",
                             writable(f"the tokenizer raised {type(e).__name__}: {e}"))]
    by_doc: dict[int, list] = {}
    for ids, doc_index in zip(encoded["input_ids"], encoded["overflow_to_sample_mapping"]):
        by_doc.setdefault(doc_index, []).append(np.asarray(ids, np.int32))
    out, rejected = [], []
    for doc_index, doc in enumerate(documents):
        pieces = by_doc[doc_index]
        doc_tokens = content_tokens([len(p) for p in pieces], config.stride, special)
        if doc_tokens == 0:
            rejected.append(Rejected(doc.source, doc.line, doc.id, "no_tokens",
                                     "the text has no tokens: the tokenizer drops all of it (e.g. only zero-width, "
                                     "control or combining characters)"))
            continue
        truncated = config.long_documents == "truncate" and len(pieces) > 1
        if truncated:
            pieces = pieces[:1]
        out += [TokenWindow(doc.id, i, len(pieces), p, doc_tokens, truncated) for i, p in enumerate(pieces)]
    return out, rejected


def windows_for(documents: list[Document], tokenizer, *, window_len: int, config: TokenizeConfig) -> list[TokenWindow]:
    """Only the windows, for callers that need their lengths (propose-buckets, benchmarks)."""
    return tokenize_documents(documents, tokenizer, window_len=window_len, config=config)[0]


class _TokenizeBatch(beam.DoFn):
    def __init__(self, model_dir_path: str, window_len: int, config: TokenizeConfig):
        self._model_path, self._window_len, self._config = model_dir_path, window_len, config
        self._windows = Metrics.counter(METRICS_NAMESPACE, "windows")
        self._clock = StageClock("tokenize")
        self._tokenizer = None

    def setup(self):
        from models.checkpoint import load_tokenizer, resolve_dir

        self._tokenizer = load_tokenizer(resolve_dir(self._model_path))

    def process(self, documents):
        t0 = time.perf_counter()
        windows, rejected = tokenize_documents(documents, self._tokenizer, window_len=self._window_len,
                                               config=self._config)
        self._clock.add(time.perf_counter() - t0)
        self._windows.inc(len(windows))
        yield from windows
        for r in rejected:
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, r)


class Tokenize(beam.PTransform):
    """Outputs ``windows`` and ``rejected`` (documents with no tokens)."""

    def __init__(self, model_path: str, window_len: int, config: TokenizeConfig):
        super().__init__()
        self._args = (model_path, window_len, config)

    def expand(self, documents):
        # The fast tokenizer is much quicker on a list than one text at a time.
        tokenized = (documents
                     | "Batch" >> beam.BatchElements(min_batch_size=16, max_batch_size=256)
                     | "TokenizeBatch" >> beam.ParDo(_TokenizeBatch(*self._args))
                     .with_outputs(REJECTED_TAG, main="windows"))
        return {"windows": tokenized.windows, "rejected": tokenized[REJECTED_TAG]}
