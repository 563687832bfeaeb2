"""Documents → embeddings: ``EncodeDocuments``, the middle of every docbeam job (hash, tokenize, bucket, encode,
pool), composed of the stages beside it.

``docbeam run`` (pipeline/driver/run.py ``build``) puts it between its reader and its writer; ``EmbedDocuments``
(pipeline/driver/embed.py) between the user's steps, so both compute a vector with the same graph.
"""

from __future__ import annotations

import apache_beam as beam

from docbeam.pipeline.stages.batch import BucketBatches
from docbeam.pipeline.stages.encode import Encode, EncoderSpec
from docbeam.pipeline.stages.late_chunking import BatchContexts
from docbeam.pipeline.stages.reuse import content_hash
from docbeam.pipeline.stages.tokenize import Tokenize
from docbeam.pipeline.stages.write import PoolDocuments


class EncodeDocuments(beam.PTransform):
    """Documents (unique ids) → ``embeddings`` (one row per document: id, embedding as a list of float32 values,
    num_tokens, num_windows, truncated, content_hash), ``rejected`` (no tokens, non-finite vectors),
    ``windows`` (each window's WindowEmbedding), ``timing`` (one dict per batch) and ``startup``.

    ``plan`` is the job plan (pipeline/driver/plan.py ``JobPlan``; the stages read it, never import the
    driver): its prompt, window, tokenize section, batching, context windows, kept fields and head."""

    def __init__(self, plan, spec: EncoderSpec):
        super().__init__()
        self._plan, self._spec = plan, spec

    def expand(self, documents):
        plan = self._plan
        hashes = documents | "HashContents" >> beam.Map(
            lambda d, prompt: (d.id, content_hash(d.text, prompt)), plan.prompt
        )
        tokenized = documents | "Tokenize" >> Tokenize(
            plan.model_path, plan.window_len, plan.tokenize, plan.prompt, plan.context_len
        )
        windows = tokenized["windows"]
        if plan.context_len:  # late chunking's context windows: batched unpacked, apart (late_chunking.py)
            windows, contexts = windows | "SplitContexts" >> beam.Partition(lambda w, _: int(bool(w.spans)), 2)
        batches = windows | "BucketByLength" >> BucketBatches(plan.batching())
        if plan.context_len:
            batches = (
                batches,
                contexts | "BatchContexts" >> BatchContexts(plan.batching()),
            ) | "AllBatches" >> beam.Flatten()
        total_windows = tokenized["windows"] | "CountWindows" >> beam.combiners.Count.Globally()
        encoded = batches | "Encode" >> Encode(self._spec, total_windows)
        windows = chunks = encoded["windows"]
        if plan.context_len:
            windows, chunks = encoded["windows"] | "SplitLateChunks" >> beam.Partition(lambda w, _: int(w.late), 2)
        kept = {"kept": documents | "KeptFields" >> beam.Map(lambda d: (d.id, d.kept))} if plan.kept.columns else {}
        pooled = {"windows": windows, "hashes": hashes, **kept} | "PoolDocuments" >> PoolDocuments(plan.head)
        rejected = (tokenized["rejected"], pooled["rejected"]) | "Rejected" >> beam.Flatten()
        return {
            "embeddings": pooled["embeddings"],
            "rejected": rejected,
            "windows": windows,
            "chunks": chunks,
            "timing": encoded["timing"],
            "startup": encoded["startup"],
        }
