"""``EmbedDocuments``: docbeam's embedding step for a Beam pipeline of the user's own, and the encoder spec the
workers build from.

``EmbedDocuments`` puts ``EncodeDocuments`` (pipeline/stages/encode_documents.py) between the user's steps, as
``docbeam run`` puts it between its reader and its writer, so both compute a vector with the same graph. The plan
(pipeline/driver/plan.py) is made once, where the transform is constructed: a config that cannot run fails
there, on the driver, as ``docbeam run`` fails at start.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Mapping

import apache_beam as beam

from docbeam import config as config_lib
from docbeam.config import ConfigError, EmbedConfig, JobConfig
from docbeam.config import files as config_files
from docbeam.pipeline.driver import precision_gate_at_start
from docbeam.pipeline.driver.plan import JobPlan, make_plan
from docbeam.pipeline.records import REJECTED_TAG, Document, Rejected
from docbeam.pipeline.stages.encode import EncoderSpec
from docbeam.pipeline.stages.encode_documents import EncodeDocuments
from docbeam.pipeline.stages.parse import document_of_record
from docbeam.pipeline.stages.rag_chunks import CHUNK_KINDS, ChunksWithTexts, check_ids, other_fields

CONFIG_FORMS = (
    "a JobConfig or EmbedConfig, the path of a YAML job file, or a dict of its sections "
    "(model, tokenize, batching, attention, runner; input and output are optional)"
)


def encoder_spec(plan: JobPlan, profile_batches: int = 0, profile_dir: str | None = None, job: str = "") -> EncoderSpec:
    """What each worker builds its encoder from, for run ``job``. Profiles are taken only where there is a
    folder to put them and batches to profile (a profiling job's folder is its own, so it loads its own
    encoder; the others may find the process's warm one)."""
    cfg = plan.config
    return EncoderSpec(
        plan=plan.encoder_plan,
        profile_batches=profile_batches,
        profile_dir=profile_dir if profile_batches else None,
        progress_seconds=cfg.runner.progress_seconds,
        one_model_per_vm=cfg.runner.one_model_per_vm,
        compilation_cache=cfg.runner.compilation_cache,
        worker_env=tuple(sorted(cfg.runner.worker_env.items())),
        tokens_per_batch=plan.tokens_per_batch,
        job=job,
    )


def embed_config(config) -> tuple[EmbedConfig, str, str]:
    """``config`` in any of CONFIG_FORMS → (its EmbedConfig, the id field, the text field of dict documents).

    A whole job (one with input or output) is validated as ``docbeam run`` validates it, so a job's YAML
    configures the transform as it is; its input section names the fields (id and text otherwise)."""
    if isinstance(config, JobConfig):
        sections = {name: getattr(config, name) for name in EmbedConfig.model_fields}
        return EmbedConfig(**sections), config.input.id_field, config.input.text_field
    if isinstance(config, EmbedConfig):
        return config, "id", "text"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        raw = config_files.load_layers(path, JobConfig)
        return _from_raw(raw, os.path.dirname(os.path.abspath(path)), path)
    if isinstance(config, Mapping):
        return _from_raw(dict(config), os.getcwd(), "config")
    raise TypeError(f"EmbedDocuments(config): config must be {CONFIG_FORMS}; got a {type(config).__name__}")


def _from_raw(raw: dict, base_dir: str, source: str) -> tuple[EmbedConfig, str, str]:
    if "input" in raw or "output" in raw:
        return embed_config(config_lib.parse(raw, base_dir=base_dir, source=source))
    return config_lib.parse_embed(raw, base_dir=base_dir, source=source), "id", "text"


def document_of(item, id_field: str, text_field: str) -> Document | Rejected:
    """One element of the user's PCollection → a Document, or the Rejected saying why it is not one (as the
    JSONL reader rejects a line: an id that is a string or an integer, a text that is a non-empty string).
    A ``docbeam.Document`` gets the same check on its ``id`` and ``text`` (its fields are the user's to fill,
    not typed by anyone), and an integer id becomes its string, as a dict's does."""

    def reject(kind, reason, doc_id=None):
        return Rejected(source="", line=None, id=doc_id, kind=kind, reason=reason)

    if isinstance(item, Document):
        line_ok = item.line is None or isinstance(item.line, int) and not isinstance(item.line, bool)
        offset_ok = type(item.text_offset) is int and item.text_offset >= 0
        kept_ok = isinstance(item.kept, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in item.kept
        )
        if not isinstance(item.source, str) or not line_ok or not offset_ok or not kept_ok:
            return reject(
                "not_a_document",
                f"a docbeam.Document's source must be a string, its line an integer or None, its text_offset an "
                f"integer >= 0 and its kept (name, value) pairs; got source {_short(item.source)}, line "
                f"{_short(item.line)}, text_offset {_short(item.text_offset)}, kept {_short(item.kept)}",
            )
        record = document_of_record(
            {"id": item.id, "text": item.text}, source=item.source, line=item.line, id_field="id", text_field="text"
        )
        return dataclasses.replace(item, id=record.id) if isinstance(record, Document) else record
    if not isinstance(item, Mapping):
        return reject(
            "not_a_document",
            f"expected a dict with {id_field!r} and {text_field!r} or a docbeam.Document, got a {type(item).__name__}",
        )
    return document_of_record(item, source="", line=None, id_field=id_field, text_field=text_field)


def _short(value) -> str:
    text = (
        repr(value) if not isinstance(value, int) or abs(value) < 10**20 else f"an integer of {value.bit_length()} bits"
    )
    return text if len(text) <= 80 else text[:77] + "..."


def _checked(item, id_field: str, text_field: str):
    try:
        record = document_of(item, id_field, text_field)
    except Exception as e:  # noqa: BLE001  whatever an element holds, it is an error row, never a crashed pipeline
        record = Rejected("", None, None, "not_a_document", f"the element could not be read: {type(e).__name__}")
    yield record if isinstance(record, Document) else beam.pvalue.TaggedOutput(REJECTED_TAG, record)


def keep_one_of_duplicates(item):
    """Of documents sharing an id, one is embedded (the same one in whatever order they arrive: the first by
    source, line and text); each other is a ``duplicate_id`` error, since rows are joined back by id."""
    doc_id, docs = item
    ordered = sorted(docs, key=lambda d: (d.source, d.line or 0, d.text))
    yield ordered[0]
    for dup in ordered[1:]:
        yield beam.pvalue.TaggedOutput(
            REJECTED_TAG,
            Rejected(
                dup.source, dup.line, doc_id, "duplicate_id", f"id {doc_id!r} is given more than once; one was embedded"
            ),
        )


class EmbedDocuments(beam.PTransform):
    """docbeam's embedding step inside a Beam pipeline of your own: documents → ``{"embeddings", "errors",
    "timing"}``.

    ``config``: any of CONFIG_FORMS. Its runner section's name and options are not read (the pipeline is
    yours); progress, worker_env, one_model_per_vm and compilation_cache are. Documents: dicts with an id and
    a text field (``id_field``/``text_field``; by default the config's input section's, else ``id`` and
    ``text``) or ``docbeam.Document``. Each becomes one embeddings row (a dict: id, embedding as a list of
    float32 values, num_tokens, num_windows, truncated, content_hash) or one errors row (a ``docbeam.Rejected``:
    id, kind, reason; ``to_json()`` is the line ``docbeam run`` writes to errors/), never a crash: a dict or a
    Document without an id or text, a repeated id (one is embedded, the others are duplicate_id errors), a text
    with no tokens.
    ``timing`` has one dict per batch, as timing/*.jsonl. The config is checked and the checkpoint planned here,
    once, where the transform is made. ``beam_chunks=True`` adds ``chunks``: each row as Beam's own
    ``apache_beam.ml.rag.types.Chunk`` with its document's text and its dict's other fields as metadata
    (pipeline/stages/rag_chunks.py), for Beam's ingestion writers; ``beam_chunk_ids="uuid5"`` gives them UUIDs
    made from the ids.
    """

    def __init__(
        self,
        config,
        *,
        id_field: str | None = None,
        text_field: str | None = None,
        beam_chunks: bool = False,
        beam_chunk_ids: str = "docbeam",
    ):
        super().__init__()
        cfg, default_id, default_text = embed_config(config)
        self._fields = (id_field or default_id, text_field or default_text)
        # A dtype other than float32 says it runs without its gate (no input here to measure it on).
        self.plan = precision_gate_at_start.checked(make_plan(cfg, for_input=False, for_output=False))
        self._chunk_ids = beam_chunks_ids(self.plan.head, beam_chunk_ids) if beam_chunks else None
        self._spec = encoder_spec(self.plan, job=f"embed-{uuid.uuid4().hex[:12]}")  # this pipeline's step

    @property
    def embedding_dim(self) -> int:
        """The width of every vector this transform outputs (after any Dense modules and truncate_dim)."""
        return self.plan.width

    def expand(self, items):
        checked = items | "CheckDocuments" >> beam.FlatMap(_checked, *self._fields).with_outputs(
            REJECTED_TAG, main="documents"
        )
        unique = (
            checked.documents
            | "KeyById" >> beam.Map(lambda d: (d.id, d))
            | "GroupById" >> beam.GroupByKey()
            | "DropDuplicates" >> beam.FlatMap(keep_one_of_duplicates).with_outputs(REJECTED_TAG, main="documents")
        )
        embedded = unique.documents | "Encode" >> EncodeDocuments(self.plan, self._spec)
        errors = (checked[REJECTED_TAG], unique[REJECTED_TAG], embedded["rejected"]) | "AllErrors" >> beam.Flatten()
        out = {"embeddings": embedded["embeddings"], "errors": errors, "timing": embedded["timing"]}
        if self._chunk_ids is not None:
            texts = unique.documents | "TextById" >> beam.Map(lambda d: (d.id, d.text))
            fields = items | "OtherFields" >> beam.FlatMap(other_fields, *self._fields)
            out["chunks"] = {
                "rows": embedded["embeddings"],
                "texts": texts,
                "fields": fields,
            } | "BeamChunks" >> ChunksWithTexts(self._chunk_ids)
        return out


def beam_chunks_ids(head, ids: str) -> str:
    """``ids`` when the head's rows become Beam Chunks (a dense or sparse vector each); else a refusal naming it."""
    if not {c.kind for c in head.columns()} & CHUNK_KINDS:
        raise ConfigError(
            f"EmbedDocuments(beam_chunks=True): model.head resolved to {head.name}, whose rows hold "
            "neither embedding nor sparse_embedding, and a Beam Chunk holds those; set model.head: "
            "embedding or sparse, or leave beam_chunks out"
        )
    return check_ids(ids)
