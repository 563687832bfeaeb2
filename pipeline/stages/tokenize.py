"""Tokenize: Documents → TokenWindows with the checkpoint's own fast tokenizer.

A document longer than the window is split by the tokenizer itself (``return_overflowing_tokens`` with
``stride`` overlap), each window framed by the special tokens; or, by config, only the first is kept.
A document with no tokens of its own is rejected (``no_tokens``): its lone [CLS] [SEP] window would embed
every such document as the same vector.

A prompt (``model.prompt``: e5's ``passage: ``) goes in front of every window, since each window is a model
input of its own and the model was trained to see its prompt at the start of every input. The first window
is exactly what sentence-transformers encodes (the prompt put before the text, then tokenized and truncated),
so a document that fits one window gets its vector; the later windows repeat the prompt's tokens after the
leading special tokens. A prompt whose last token merges with the text's first (one that does not end at a
token boundary) cannot be repeated token-exactly: then only the first window carries it.

A document the tokenizer raises on is rejected (``tokenizer_error``), never its batch.

Each window carries the characters it covers (``char_start``/``char_end``: its first own token's start to its
last one's end, from the tokenizer's offsets, in code points of the source text: a prompt's characters are
not counted, a text file's BOM is), so a chunk row can point back into its document (pipeline/stages/window_chunks.py).
"""

from __future__ import annotations

import dataclasses
import time
import unicodedata

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from docbeam.config import TokenizeConfig
from docbeam.pipeline.records import REJECTED_TAG, Document, Rejected, TokenWindow, writable
from docbeam.pipeline.stages.late_chunking import context_windows
from docbeam.pipeline.telemetry.observe import METRICS_NAMESPACE, StageClock


def content_tokens(window_lengths: list[int], stride: int, special: int) -> int:
    """Tokens of the document itself: each window after the first repeats ``stride`` of the previous one."""
    return sum(n - special for n in window_lengths) - stride * (len(window_lengths) - 1)


def stride_problem(stride: int, window_len: int, special: int) -> str | None:
    """Why ``stride`` cannot cut windows of ``window_len`` tokens, ``special`` of them the tokenizer's own and
    model.prompt's (None when it can): every window must hold text, and every window after the first must bring
    tokens of its own. A window the prompt fills is the prompt's problem, not the stride's."""
    room = window_len - special
    if room < 1:
        return (
            f"model.prompt does not fit the model's window of {window_len} tokens (model.max_seq_len): with the "
            f"tokenizer's special tokens it takes {special}, and every window repeats it, leaving no room for "
            "the text; shorten model.prompt, or raise model.max_seq_len up to the checkpoint's positions"
        )
    if stride < room:
        return None
    return (
        f"tokenize.stride={stride} must be smaller than a window's content ({room} tokens for window "
        f"{window_len}) once its {special} special and model.prompt tokens are set aside; e.g. "
        f"{min(32, room // 4)}"
    )


@dataclasses.dataclass(frozen=True)
class Framing:
    """The special tokens the tokenizer puts around one text ([CLS] ... [SEP], <s> ... </s>)."""

    leading: tuple[int, ...]
    trailing: tuple[int, ...]


def framing(tokenizer) -> Framing:
    framed = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    at = next(i for i in range(len(framed) - len(bare) + 1) if framed[i : i + len(bare)] == bare)
    return Framing(tuple(framed[:at]), tuple(framed[at + len(bare) :]))


def prompt_token_ids(tokenizer, prompt: str | None) -> tuple[int, ...]:
    """The prompt's own tokens: the common start of two texts that begin with it, so a token its last character
    shares with the text that follows (a byte-level BPE's leading space) is not counted as the prompt's."""
    if not prompt:
        return ()
    probes = tokenizer([prompt + "a", prompt + "1"], add_special_tokens=False)["input_ids"]
    common = 0
    while common < min(map(len, probes)) and probes[0][common] == probes[1][common]:
        common += 1
    return tuple(probes[0][:common])


def through_marks(text: str, end: int) -> int:
    """``end`` moved past the combining marks that follow it: a tokenizer that strips accents (an uncased one) ends
    its last token's offsets before a trailing combining accent, which belongs to the character the span ends on."""
    while 0 < end < len(text) and unicodedata.category(text[end]).startswith("M"):
        end += 1
    return end


def window_span(offsets: list[tuple[int, int]], shift: int) -> tuple[int, int]:
    """The characters a window's own tokens (``offsets``, special tokens left out) cover, in a text that had
    ``shift`` characters (a prompt) put before it: a token of the prompt's own clamps to 0."""
    return max(min(s for s, _ in offsets) - shift, 0), max(max(e for _, e in offsets) - shift, 0)


def prompted_windows(
    ids: list[int], prompt_ids: tuple[int, ...], framing: Framing, *, window_len: int, stride: int
) -> tuple[list[list[int]], int, list[tuple[int, int]]]:
    """Windows of one document tokenized with its prompt in front (``ids``, no special tokens), each framed and
    starting with the prompt's tokens, consecutive ones sharing ``stride`` of the document's tokens; the
    number of the document's own tokens; and where each window's own tokens are in ``ids`` ([first, end)).
    Cut as the tokenizer's own overflow cuts (tests hold the two equal)."""
    separable = tuple(ids[: len(prompt_ids)]) == prompt_ids
    repeated = list(prompt_ids) if separable else []
    content = ids[len(repeated) :]
    room = window_len - len(framing.leading) - len(framing.trailing) - len(repeated)
    starts = [0]
    while starts[-1] + room < len(content):
        starts.append(starts[-1] + room - stride)
    windows = [[*framing.leading, *repeated, *content[s : s + room], *framing.trailing] for s in starts]
    positions = [(len(repeated) + s, len(repeated) + min(s + room, len(content))) for s in starts]
    return windows, max(0, len(ids) - len(prompt_ids)), positions


def tokenize_documents(
    documents: list[Document],
    tokenizer,
    *,
    window_len: int,
    config: TokenizeConfig,
    prompt: str | None = None,
    context_len: int | None = None,
) -> tuple[list[TokenWindow], list[Rejected]]:
    """The windows of every document that has tokens, a ``no_tokens`` Rejected for each one that has none, and
    a ``tokenizer_error`` Rejected for each one the tokenizer raises on: the batch is tokenized again one
    document at a time, so one such document costs only itself; ``prompt`` goes in front of every window.
    ``context_len`` (late chunking): each document's context windows follow its windows
    (pipeline/stages/late_chunking.py)."""
    special = tokenizer.num_special_tokens_to_add(pair=False)
    prompt_ids = prompt_token_ids(tokenizer, prompt)
    problem = stride_problem(config.stride, window_len, special + len(prompt_ids))
    if problem:
        raise ValueError(problem)
    try:
        by_doc, doc_tokens_of, spans_of, cut_of = _encode(
            documents, tokenizer, window_len, config, prompt, prompt_ids, late=context_len is not None
        )
    except Exception as e:  # noqa: BLE001  which document it was is found below, one at a time
        if len(documents) > 1:
            alone = [
                tokenize_documents(
                    [d], tokenizer, window_len=window_len, config=config, prompt=prompt, context_len=context_len
                )
                for d in documents
            ]
            return [w for windows, _ in alone for w in windows], [r for _, rejected in alone for r in rejected]
        doc = documents[0]
        return [], [
            Rejected(
                doc.source,
                doc.line,
                doc.id,
                "tokenizer_error",
                writable(f"the tokenizer raised {type(e).__name__}: {e}"),
            )
        ]
    out, rejected = [], []
    for doc_index, doc in enumerate(documents):
        pieces = by_doc[doc_index]
        doc_tokens = doc_tokens_of.get(doc_index, content_tokens([len(p) for p in pieces], config.stride, special))
        if doc_tokens == 0:
            rejected.append(
                Rejected(
                    doc.source,
                    doc.line,
                    doc.id,
                    "no_tokens",
                    "the text has no tokens: the tokenizer drops all of it (e.g. only zero-width, "
                    "control or combining characters)",
                )
            )
            continue
        truncated = config.long_documents == "truncate" and len(pieces) > 1
        if truncated:
            pieces = pieces[:1]
        spans = spans_of[doc_index]
        windows = [
            TokenWindow(
                doc.id,
                i,
                len(pieces),
                p,
                doc_tokens,
                truncated,
                doc.text_offset + spans[i][0],
                doc.text_offset + through_marks(doc.text, spans[i][1]),
            )
            for i, p in enumerate(pieces)
        ]
        out += windows
        if context_len is not None:
            ids, positions, repeated = cut_of[doc_index]
            frame = framing(tokenizer)
            out += context_windows(windows, ids, positions, frame.leading, repeated, frame.trailing, context_len)
    return out, rejected


def _encode(
    documents: list[Document],
    tokenizer,
    window_len: int,
    config: TokenizeConfig,
    prompt: str | None,
    prompt_ids: tuple[int, ...],
    late: bool = False,
) -> tuple[dict[int, list], dict[int, int], dict[int, list], dict[int, tuple]]:
    """Each document's windows (by its index), its own token count where the prompt decides it, each of its
    windows' character span in its text, and (prompted or ``late``) its tokens, where each window's own tokens
    are in them and the prompt's tokens every window repeats."""
    by_doc: dict[int, list] = {}
    doc_tokens_of: dict[int, int] = {}
    spans_of: dict[int, list] = {}
    cut_of: dict[int, tuple] = {}
    frame = framing(tokenizer)
    if prompt or late:  # one tokenization of the whole text, cut here as the tokenizer's overflow cuts it
        prompt = prompt or ""
        encoded = tokenizer([prompt + d.text for d in documents], add_special_tokens=False, return_offsets_mapping=True)
        for doc_index, (ids, offsets) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"])):
            windows, doc_tokens_of[doc_index], positions = prompted_windows(
                list(ids), prompt_ids, frame, window_len=window_len, stride=config.stride
            )
            by_doc[doc_index] = [np.asarray(w, np.int32) for w in windows]
            spans_of[doc_index] = [window_span(offsets[a:b], len(prompt)) if b > a else (0, 0) for a, b in positions]
            separable = tuple(ids[: len(prompt_ids)]) == prompt_ids
            cut_of[doc_index] = (list(ids), positions, prompt_ids if separable else ())
    else:
        encoded = tokenizer(
            [d.text for d in documents],
            max_length=window_len,
            truncation=True,
            stride=config.stride,
            return_overflowing_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_offsets_mapping=True,
        )
        for ids, offsets, doc_index in zip(
            encoded["input_ids"], encoded["offset_mapping"], encoded["overflow_to_sample_mapping"]
        ):
            by_doc.setdefault(doc_index, []).append(np.asarray(ids, np.int32))
            own = offsets[len(frame.leading) : len(offsets) - len(frame.trailing)]
            spans_of.setdefault(doc_index, []).append(window_span(own, 0) if own else (0, 0))
    return by_doc, doc_tokens_of, spans_of, cut_of


def windows_for(
    documents: list[Document], tokenizer, *, window_len: int, config: TokenizeConfig, prompt: str | None = None
) -> list[TokenWindow]:
    """Only the windows, for callers that need their lengths (propose-buckets, benchmarks)."""
    return tokenize_documents(documents, tokenizer, window_len=window_len, config=config, prompt=prompt)[0]


class _TokenizeBatch(beam.DoFn):
    def __init__(
        self,
        model_dir_path: str,
        window_len: int,
        config: TokenizeConfig,
        prompt: str | None,
        context_len: int | None = None,
    ):
        self._model_path, self._window_len, self._config, self._prompt = model_dir_path, window_len, config, prompt
        self._context_len = context_len
        self._windows = Metrics.counter(METRICS_NAMESPACE, "windows")
        self._clock = StageClock("tokenize")
        self._tokenizer = None

    def setup(self):
        from docbeam.models.checkpoint import load_tokenizer, resolve_dir

        self._tokenizer = load_tokenizer(resolve_dir(self._model_path))

    def process(self, documents):
        t0 = time.perf_counter()
        windows, rejected = tokenize_documents(
            documents,
            self._tokenizer,
            window_len=self._window_len,
            config=self._config,
            prompt=self._prompt,
            context_len=self._context_len,
        )
        self._clock.add(time.perf_counter() - t0)
        self._windows.inc(len(windows))
        yield from windows
        for r in rejected:
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, r)


class Tokenize(beam.PTransform):
    """Outputs ``windows`` and ``rejected`` (documents with no tokens)."""

    def __init__(
        self,
        model_path: str,
        window_len: int,
        config: TokenizeConfig,
        prompt: str | None = None,
        context_len: int | None = None,
    ):
        super().__init__()
        self._args = (model_path, window_len, config, prompt, context_len)

    def expand(self, documents):
        # The fast tokenizer is much quicker on a list than one text at a time.
        tokenized = (
            documents
            | "Batch" >> beam.BatchElements(min_batch_size=16, max_batch_size=256)
            | "TokenizeBatch" >> beam.ParDo(_TokenizeBatch(*self._args)).with_outputs(REJECTED_TAG, main="windows")
        )
        return {"windows": tokenized.windows, "rejected": tokenized[REJECTED_TAG]}
