"""The MLTransform side of benchmarks/vs_mltransform.py: the peer job as a Beam user would write it, run in a process
of its own (``python benchmarks/vs_mltransform.py --mltransform-job SPEC_JSON``), plain or with Beam 2.78's
length-aware batching."""

from __future__ import annotations

import json
import os


def mltransform_job(spec_path: str) -> int:
    """The peer as a Beam user would write it; ``spec`` names the input, model folder, output and threads."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["torch_threads"])  # DirectRunner runs the DoFns in this process
    import apache_beam as beam
    import pyarrow as pa
    from apache_beam.ml.transforms.base import MLTransform
    from apache_beam.ml.transforms.embeddings.huggingface import SentenceTransformerEmbeddings
    from apache_beam.options.pipeline_options import PipelineOptions

    settings = dict(
        model_name=spec["model_folder"],
        columns=["text"],
        max_seq_length=spec["max_seq_length"],
        load_model_args={"device": spec["device"]},
    )
    length = spec.get("length_aware")
    embed = length_aware_embeddings(settings, length) if length else SentenceTransformerEmbeddings(**settings)
    schema = pa.schema([("id", pa.string()), ("embedding", pa.list_(pa.float32()))])
    pipeline = beam.Pipeline(options=PipelineOptions(runner="DirectRunner"))
    _ = (
        pipeline
        | "ReadDocuments" >> beam.io.ReadFromText(spec["input"])
        | "ParseJson" >> beam.Map(json.loads)
        | "SelectFields" >> beam.Map(lambda raw: {"id": str(raw["id"]), "text": raw["text"]})
        | "Embed" >> MLTransform(write_artifact_location=spec["artifacts"]).with_transform(embed)
        | "ToRows" >> beam.Map(lambda row: {"id": row["id"], "embedding": [float(x) for x in row["text"]]})
        | "WriteEmbeddings"
        >> beam.io.WriteToParquet(os.path.join(spec["output"], "part"), schema, file_name_suffix=".parquet")
    )
    result = pipeline.run()
    result.wait_until_finish()

    import inspect

    from sentence_transformers import SentenceTransformer

    metrics = {}
    query = result.metrics().query()
    for m in query["distributions"]:
        d = m.committed or m.attempted
        if d is not None and d.count:
            metrics[f"{m.key.metric.namespace}/{m.key.metric.name}"] = {
                "count": d.count,
                "sum": d.sum,
                "min": d.min,
                "max": d.max,
                "mean": d.sum / d.count,
            }
    for m in query["counters"]:
        metrics[f"{m.key.metric.namespace}/{m.key.metric.name}"] = m.committed or m.attempted
    with open(spec["report"], "w") as f:
        json.dump(
            {
                "torch_threads": torch.get_num_threads(),
                "torch_interop_threads": torch.get_num_interop_threads(),
                "st_encode_batch_size": inspect.signature(SentenceTransformer.encode).parameters["batch_size"].default,
                "metrics": metrics,
            },
            f,
            indent=1,
            default=str,
        )
    return 0


def length_aware_embeddings(settings: dict, length: dict):
    """SentenceTransformerEmbeddings whose RunInference batches by token length (Beam 2.78's length-aware
    BatchElements): what a Beam user adds to MLTransform to batch documents of like length together."""
    from apache_beam.ml.transforms.embeddings import huggingface

    class LengthAwareHandler(huggingface._SentenceTransformerModelHandler):
        def batch_elements_kwargs(self):
            return {
                **super().batch_elements_kwargs(),
                "length_fn": TokenCount(settings["model_name"], settings["max_seq_length"]),
                "bucket_boundaries": length["boundaries"],
                "max_batch_duration_secs": length["max_batch_duration_secs"],
            }

    class LengthAwareEmbeddings(huggingface.SentenceTransformerEmbeddings):
        def get_model_handler(self):
            return LengthAwareHandler(
                max_seq_length=self.max_seq_length,
                model_name=self.model_name,
                load_model_args=self.load_model_args,
                min_batch_size=self.min_batch_size,
                max_batch_size=self.max_batch_size,
                large_model=self.large_model,
            )

    return LengthAwareEmbeddings(**settings)


class TokenCount:
    """A row's length in the model's tokens, capped at the window (what the encoder will see); the tokenizer is
    loaded on the worker, on first use."""

    def __init__(self, folder: str, cap: int):
        self.folder, self.cap, self._tokenizer = folder, cap, None

    def __getstate__(self):
        return {"folder": self.folder, "cap": self.cap, "_tokenizer": None}

    def __call__(self, row) -> int:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return min(len(self._tokenizer(row["text"], truncation=False)["input_ids"]), self.cap)


def length_boundaries(buckets: list[int]) -> list[int]:
    """docbeam's buckets as BatchElements' boundaries: a bucket of length L holds up to L tokens, and Beam's
    boundaries are lower-inclusive ([129] puts 1..128 in one batch key, 129.. in the next)."""
    return [b + 1 for b in sorted(buckets)[:-1]]
