"""The elements that flow between stages. Plain frozen dataclasses: picklable, comparable in tests."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    text: str
    source: str
    line: int | None  # 1-based line in a JSONL file; None for a whole-file text document
    text_offset: int = 0  # characters of the source before ``text`` (a text file's BOM): chunk offsets count them
    kept: tuple[tuple[str, object], ...] = ()  # input.keep_fields' (name, value) pairs (pipeline/stages/keep.py)


REJECTED_TAG = "rejected"  # the tagged output every stage sends its Rejected records to


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A document that will not be embedded, and why: one line in ``errors/``."""

    source: str
    line: int | None
    id: str | None
    kind: str  # a short code; counters and the report group by it
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def writable(text: str) -> str:
    """``text`` with any lone surrogate as a ``\\udxxx`` escape: an exception's message can quote the bad
    input, and errors/ is written as UTF-8, which has no encoding for them."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ChunkSpan(NamedTuple):
    """Late chunking: one chunk inside a context window (pipeline/stages/late_chunking.py)."""

    index: int  # the chunk's index: its window's, as window chunking numbers it
    start: int  # the chunk's own tokens in the context window: [start, end)
    end: int
    char_start: int  # the chunk's characters in the source text (its window's)
    char_end: int
    length: int  # its window's tokens (special and prompt tokens included): the chunk row's num_tokens
    num_chunks: int  # the document's chunks


@dataclasses.dataclass(frozen=True, eq=False)
class TokenWindow:
    """One model-length slice of a document's tokens ([CLS] … [SEP] included); not a Beam window."""

    doc_id: str
    index: int
    num_windows: int
    token_ids: np.ndarray  # int32 [length]
    doc_tokens: int  # tokens in the whole document, special tokens excluded
    truncated: bool
    char_start: int = 0  # the window's characters in the source text: [char_start, char_end), code points
    char_end: int = 0
    spans: tuple[ChunkSpan, ...] = ()  # late chunking: a context window's chunks (index: the context's number)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class WindowRef(NamedTuple):
    """What a batch keeps of each window it holds, by name: the token ids are in the batch's arrays, and
    these fields travel on to the window's vector. A tuple, so it pickles small and compares plainly."""

    doc_id: str
    index: int
    num_windows: int
    doc_tokens: int
    truncated: bool
    char_start: int = 0
    char_end: int = 0

    @classmethod
    def of(cls, window: TokenWindow) -> "WindowRef":
        return cls(
            window.doc_id,
            window.index,
            window.num_windows,
            window.doc_tokens,
            window.truncated,
            window.char_start,
            window.char_end,
        )

    @classmethod
    def chunks_of(cls, window: TokenWindow) -> list["WindowRef"]:
        """A context window's chunks, each referred to as window chunking refers to its window."""
        return [
            cls(window.doc_id, s.index, s.num_chunks, window.doc_tokens, window.truncated, s.char_start, s.char_end)
            for s in window.spans
        ]


def batch_id(bucket_len: int, windows: Iterable[WindowRef | TokenWindow], packed: bool) -> str:
    """``b<bucket>-<digest>`` (``p`` when packed) of the windows in (doc_id, index) order: the same windows
    always get the same id, whatever order they arrived in, so a retried bundle's batch keeps its id."""
    names = sorted((w.doc_id, w.index) for w in windows)
    digest = hashlib.sha1("|".join(f"{doc_id}#{index}" for doc_id, index in names).encode()).hexdigest()[:12]
    return f"{'p' if packed else 'b'}{bucket_len}-{digest}"


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """A padded block of windows of one bucket length: the unit the encoder compiles and times.

    Unpacked, row r holds window r. Packed (``batching.packing``), a row holds several windows one after
    another: ``segment_ids_BxT`` numbers them 1, 2, … (0 is padding) and ``slot_lengths_BxK`` gives each
    one's length in its row's slot k = segment - 1; ``windows`` lists them row by row, slot by slot."""

    batch_id: str
    bucket_len: int
    ids_BxT: np.ndarray  # int32 [rows, bucket_len]; padding rows and columns are 0
    lengths_B: np.ndarray  # int32 [rows]: tokens used per row; 0 marks a padding row
    windows: tuple[WindowRef, ...]  # one per window, in the order the encoder's outputs are read
    segment_ids_BxT: np.ndarray | None = None  # int32 [rows, bucket_len]; packed batches only
    slot_lengths_BxK: np.ndarray | None = None  # int32 [rows, max windows per row]; packed batches only
    # Late chunking (unpacked context windows): each row's chunks' [start, end) tokens and their windows' lengths
    # (the rows' num_tokens); ``windows`` are the chunks.
    spans_BxKx3: np.ndarray | None = None

    def __post_init__(self):
        # Whatever built the batch, its windows are read by name from here on (a plain tuple is accepted).
        if not all(type(w) is WindowRef for w in self.windows):
            object.__setattr__(self, "windows", tuple(WindowRef(*w) for w in self.windows))

    @property
    def packed(self) -> bool:
        return self.segment_ids_BxT is not None

    @property
    def rows(self) -> int:
        return self.ids_BxT.shape[0]

    @property
    def real_rows(self) -> int:
        """Windows in the batch (as many as rows with data, unless packed; late chunking's: its context windows,
        whose chunks ``windows`` lists)."""
        return int((self.lengths_B > 0).sum()) if self.spans_BxKx3 is not None else len(self.windows)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths_B.sum())

    def window_lengths(self) -> np.ndarray:
        """Each window's length, in ``windows``' order (a late chunk's: its window's)."""
        if self.spans_BxKx3 is not None:
            return self.spans_BxKx3[..., 2].ravel()[self.window_slots()]
        if not self.packed:
            return self.lengths_B[: self.real_rows]
        return self.slot_lengths_BxK.ravel()[self.window_slots()]

    def window_slots(self) -> np.ndarray:
        """Where each window's vector is in the encoder's output flattened to [rows × slots, D]."""
        if self.spans_BxKx3 is not None:
            return np.flatnonzero((self.spans_BxKx3[..., 1] > self.spans_BxKx3[..., 0]).ravel())
        if not self.packed:
            return np.arange(self.real_rows)
        return np.flatnonzero(self.slot_lengths_BxK.ravel() > 0)


@dataclasses.dataclass(frozen=True, eq=False)
class WindowEmbedding:
    doc_id: str
    index: int
    num_windows: int
    length: int
    doc_tokens: int
    truncated: bool
    vector: np.ndarray  # float32 [D], pooled but not normalised
    bucket_len: int  # where it was computed: named in a non_finite error record
    backend: str
    char_start: int = 0  # the window's characters in the source text (TokenWindow)
    char_end: int = 0
    late: bool = False  # a late chunk's vector (pooled in its context window), not a window's
