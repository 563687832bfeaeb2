"""Heads: what turns the encoder's token states into one kind of output row.

A head has two halves. Inside the jitted forward it pools each window's token states (``pooling``) and runs
its ``layers`` (dense projections with an activation, layer norms) on the pooled vector, so a window leaves the
device as one short vector: a sentence embedding, or a classifier's logits. Outside, on the host, it turns a
document's window vectors into its row (``document_row``).

Everything the rest of the job needs of a head, the head declares here, so no caller asks a head its name or
probes it: its ``columns`` (each of a ``Column`` kind that the writer, the sinks, Beam Chunks and the report read),
the output settings it takes (``vector_dtypes``, ``chunk_column``, ``chunkings``, ``precision_gated``, checked by
``output_problem``), how its forward ends (``reduce``, ``window_vectors``), its part of the reuse key, its summary
line. The registry of heads, built-in and your own, is ``registry.py``; adding a head is one module, one
registry line and its reference test (docs/development.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from docbeam.models.families.encoder_config import ACTIVATIONS

# What a dense layer of a head may apply after its projection (sentence-transformers' Dense modules name
# identity or tanh; classifier heads name the family's activations).
LAYER_ACTIVATIONS = {"identity": lambda x: x, "tanh": jnp.tanh, **ACTIVATIONS}
# What every head's row says of its document besides the head's own columns: the id first, these after them.
SHARED_COLUMNS = ("id", "num_tokens", "num_windows", "truncated", "content_hash")
# The kinds of column a head writes: a sink, Beam Chunks and the report know what to do with each kind, never
# with a head. vector: a fixed-size list of ``dim`` values of ``dtype`` (output.vector_dtype); sparse_vector:
# ascending int32 ``indices`` below ``dim`` and their float32 ``values``; multi_vector: a list of such vectors
# (one per token); label: a string (null for a regression); score: a float32; scores: ``dim`` float32s.
COLUMN_KINDS = ("vector", "sparse_vector", "multi_vector", "label", "score", "scores")
# Each kind's column as every built-in head names it, which the sinks and Beam Chunks read by name: a kept input
# field is refused these names whatever the head (on a dense run a kept sparse_embedding would become Vertex AI's
# sparse vector, a kept scores would stop ReadBeamChunks mid-pipeline). A user's head that names its columns
# otherwise has its own refused too (pipeline/driver/head_plan.py check_kept_fields).
KIND_COLUMNS = {
    "vector": "embedding",
    "sparse_vector": "sparse_embedding",
    "multi_vector": "multi_vector",
    "label": "label",
    "score": "score",
    "scores": "scores",
}


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a head's rows, by kind; summary.json and the manifest list them (``head.columns``), so a
    committed output says what its rows hold without the code of the head that wrote them."""

    name: str
    kind: str  # one of COLUMN_KINDS
    dim: int | None = None  # values per vector, the vocabulary of a sparse one, the labels of scores
    dtype: str = "float32"  # the values of a vector or multi_vector as written

    def __post_init__(self):
        if self.kind not in COLUMN_KINDS:
            raise ValueError(f"column {self.name!r}: kind {self.kind!r} is not one of {', '.join(COLUMN_KINDS)}")

    def field(self):
        """Its Arrow field, as the row files are written."""
        import pyarrow as pa

        from docbeam.models.heads.vector_types import VALUE_TYPES, embedding_type

        types = {
            "vector": lambda: embedding_type(self.dim, self.dtype),
            "sparse_vector": lambda: pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))]),
            "multi_vector": lambda: pa.list_(pa.list_(VALUE_TYPES[self.dtype], self.dim)),
            "label": pa.string,
            "score": pa.float32,
            "scores": lambda: pa.list_(pa.float32(), self.dim),
        }
        return pa.field(self.name, types[self.kind]())

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dim": self.dim, "dtype": self.dtype}


def shared_fields() -> tuple[list, list]:
    """The Arrow fields every row has before and after the head's own columns."""
    import pyarrow as pa

    return [pa.field("id", pa.string())], [
        pa.field("num_tokens", pa.int32()),
        pa.field("num_windows", pa.int32()),
        pa.field("truncated", pa.bool_()),
        pa.field(
            "content_hash", pa.string()
        ),  # of the text embedded: an incremental run reuses a row whose hash matches
    ]


@dataclasses.dataclass(frozen=True)
class HeadLayer:
    """One step after pooling: ``dense`` is ``activation(x @ kernel + bias)``, ``norm`` a LayerNorm of ``eps``,
    ``l2`` an L2 normalisation (``x / max(|x|, 1e-12)``, torch's normalize); its parameters are ``{"kernel",
    "bias"}``, ``{"scale", "bias"}`` (a zero bias where the checkpoint has none) or ``{}``."""

    kind: Literal["dense", "norm", "l2"]
    activation: str = "identity"
    eps: float = 1e-5


class NonFinite(str):
    """A document whose window vectors or row hold NaN or inf: the reason, which the pipeline records as its
    ``non_finite`` rejection (a head never writes such a row)."""


@dataclasses.dataclass(frozen=True)
class Head:
    """A resolved head: frozen and hashable, handed to the workers inside the encoder's spec.

    The class attributes below are declarations with the value most heads have; a head overrides the ones it
    differs in (a dataclass field of the same name, or a class attribute)."""

    name: str  # its registry entry (``model.head``), or the ``package.module:Class`` it was loaded from
    pooling: str  # "mean" | "cls" | "lasttoken": each window's token states → one vector; "tokens": none
    layers: tuple[HeadLayer, ...]  # run on the pooled vector inside the forward
    width: int  # values per window that leave the forward
    folder: str  # the output folder its rows are written to (``ROWS_FOLDER``, or ``scores``)
    carried: str | None = None  # the task head config.json names ("BertForSequenceClassification"), if any
    vector_dtype: str = "float32"  # output.vector_dtype, as the run writes it

    # How the forward ends. ``reduce(hidden_BxTxD, lengths_B, segment_ids_BxT, slot_lengths_BxK, params)`` →
    # [B, width] (packed: [B, K, width]; per token, [B, T, ...]) replaces pooling and ``layers`` for a head that
    # needs every token state (sparse.py); ``window_vectors(out, batch)`` → each window's list of token vectors,
    # for a head whose forward gives one vector per token (multivector.py). None: pool, then the layers.
    reduce = None
    window_vectors = None
    # Declarations, class attributes (not fields) so that a subclass overrides them with a class attribute or a
    # field of its own. What it takes of the output settings (``output_problem``):
    vector_dtypes = ("float32",)  # output.vector_dtype's values its rows can be written in
    quantized = False  # output.vector_dtype quantizes its ``embedding`` column after it (pipeline/stages/vectors.py)
    chunk_column = None  # the column a chunk row carries (``chunk_value``); None: no chunk rows
    chunkings = ("window",)  # output.chunking's values (late: pooled spans of a context window)
    precision_gated = False  # model.precision_gate measures its rows (it measures document embeddings)
    # What the rest of the job reads of its rows:
    labels = ()  # the labels a row's ``label`` names (output.select.where may name them)
    windows = "all"  # "first": a document's row is its first window's, so documents are cut there
    normalize = False  # its vectors are L2-normalised (part of the reuse key)
    truncate_dim = None  # its vectors keep their first truncate_dim dimensions (part of the reuse key)
    verb = "embedded"  # what the summary says it did to a document

    @property
    def dim(self) -> int:
        """Values per document row's vector column."""
        return self.width

    @property
    def counts_labels(self) -> bool:
        """Whether summary.json counts its rows by ``label``."""
        return False

    def load_params(self, folder: str) -> tuple[dict, ...]:
        """The parameters of ``layers``, in float32 (numpy), from the checkpoint ``folder``."""
        raise NotImplementedError

    def for_export(self) -> "Head":
        """This head as an exported forward runs it (models/engines/: OpenVINO): itself, unless the form jit runs
        does not export and another computing the same does (sparse.py's vocabulary blocks)."""
        return self

    def compact_window(self, vector_W):
        """What a window's output crosses to ``document_row`` as (the vector itself; the sparse head's nonzero
        terms: its vocabulary-wide vectors are mostly zeros)."""
        return vector_W

    def columns(self) -> list[Column]:
        """The row's own columns; SHARED_COLUMNS and the kept fields are around them."""
        raise NotImplementedError

    def row_fields(self) -> list:
        """Every Arrow field of its row files, in order (the kept fields follow them)."""
        before, after = shared_fields()
        return [*before, *(c.field() for c in self.columns()), *after]

    def document_row(self, windows: list) -> dict | NonFinite:
        """One document's row from its windows (objects with index, num_windows, length, vector, doc_tokens,
        truncated, bucket_len, backend), or why it cannot be written."""
        raise NotImplementedError

    def chunk_value(self, window_vector):
        """A window's value of ``chunk_column`` in its chunk row (output.granularity: chunk or both)."""
        raise NotImplementedError

    def row_stats(self, row: dict) -> dict:
        """Its numbers of one row for summary.json (``representations``: what a row holds, and its bytes)."""
        return {}

    def reuse_key(self) -> Any:
        """What must match for an earlier run's row to be carried over (pipeline/stages/reuse.py)."""
        raise NotImplementedError

    def reusable(self, row: dict) -> bool:
        """Whether an earlier run's row read back is sound enough to carry over (its vector's length, finite)."""
        raise NotImplementedError

    def details(self) -> str:
        """What ``docbeam validate`` says of it after its name and folder (the classifier: its labels), or ""."""
        return ""

    def summary_line(self) -> str | None:
        """The run's one line about its head, or None where it says nothing worth a line."""
        return f"{self.name} → {self.folder}/"

    def describe(self) -> dict:
        """What summary.json and the manifest say of the head and its columns."""
        return {
            "name": self.name,
            "pooling": self.pooling,
            "folder": self.folder,
            "width": self.width,
            "checkpoint_head": self.carried,
            "columns": [c.describe() for c in self.columns()],
            "verb": self.verb,
            **({"line": self.summary_line()} if self.summary_line() else {}),
        }

    def output_problem(self, model, output) -> str | None:
        """Why its rows cannot be written with these settings (``model`` and ``output``: the job's sections;
        output None for docbeam.EmbedDocuments, which has none), naming the key and the fix; None if they can."""
        rows = f"model.head resolved to {self.name} ({self.carried}), which writes {self.folder}/ rows"
        if not self.precision_gated and model.dtype != "float32" and model.precision_gate == "enforce":
            return (
                f"model.dtype: {model.dtype}: {rows}, and the precision gate (model.precision_gate: "
                "enforce) measures embeddings only; set model.dtype: float32, or model.precision_gate: "
                "warn (or off) to run it unmeasured"
            )
        if output is None:
            return None
        granularities = ("document", "chunk", "both") if self.chunk_column else ("document",)
        for key, value, allowed in (
            ("vector_dtype", output.vector_dtype, self.vector_dtypes),
            ("granularity", output.granularity, granularities),
            ("chunking", output.chunking, self.chunkings),
        ):
            if value not in allowed:
                return (
                    f"output.{key}: {value}: {rows}, not one dense vector per document; set output.{key}: "
                    f"{' or '.join(allowed)} (or model.head: embedding to embed with its backbone)"
                )
        return None


def window_facts(windows: list) -> dict:
    """The columns every head's row has about the document's tokens and windows."""
    return {
        "num_tokens": int(windows[0].doc_tokens),
        "num_windows": len(windows),
        "truncated": bool(windows[0].truncated),
    }


def non_finite(windows: list, broken: list, what: str) -> NonFinite:
    where = ", ".join(sorted({f"bucket {w.bucket_len} with attention {w.backend}" for w in broken or windows}))
    return NonFinite(
        f"the {what} has NaN or inf values ({len(broken)} of {len(windows)} window(s) non-finite; "
        f"computed at {where}); not written"
    )


ROWS_FOLDER = "embeddings"  # where a head's rows go unless it names another folder (the classifier: scores)


def apply_layers(pooled_xD: jax.Array, params: tuple[dict, ...], layers: tuple[HeadLayer, ...]) -> jax.Array:
    """A head's layers on pooled vectors [..., D], in float32 at full matmul precision (they are a sliver of the
    work, and a classifier's logits or a Dense projection should not lose digits the encoder kept)."""
    for layer, p in zip(layers, params, strict=True):
        if layer.kind == "dense":
            pooled_xD = LAYER_ACTIVATIONS[layer.activation](
                jnp.einsum("...d,de->...e", pooled_xD, p["kernel"], precision=jax.lax.Precision.HIGHEST) + p["bias"]
            )
        elif layer.kind == "l2":
            pooled_xD = pooled_xD / jnp.maximum(jnp.linalg.norm(pooled_xD, axis=-1, keepdims=True), 1e-12)
        else:
            mean = pooled_xD.mean(-1, keepdims=True)
            var = jnp.square(pooled_xD - mean).mean(-1, keepdims=True)
            pooled_xD = (pooled_xD - mean) * jax.lax.rsqrt(var + layer.eps) * p["scale"] + p["bias"]
    return pooled_xD
