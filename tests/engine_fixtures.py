"""The OpenVINO engine (models/engines/) held to XLA through the runtime a worker loads: the same plan loaded
twice, ``runner.engine: openvino`` and ``xla``, the same batches through both; what the job would write must
agree at the engine's parity gate, and every record must name the engine that ran and why."""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.models.engines.choose import parity


def first_windows(folder: str, texts: list[str], window: int, packed: bool):
    """Each text's first ``window`` tokens as one batch of ``window``-bucket rows: one window a row, or packed
    about two a row."""
    from family_fixtures import pack

    from docbeam.models import checkpoint
    from docbeam.pipeline.records import Batch

    tokenizer = checkpoint.load_tokenizer(folder)
    rows = [tokenizer(t, truncation=True, max_length=window)["input_ids"] for t in texts]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ids = np.zeros((len(rows), window), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    windows = tuple((f"d{i}", 0, 1, 1, False) for i in range(len(rows)))
    if not packed:
        return Batch("b", window, ids, lengths, windows)
    p_ids, p_lengths, segments, slots, _ = pack(ids, lengths, int(lengths.sum() // 2 + window))
    return Batch("b", window, p_ids, p_lengths, windows, segments, slots)


def runtimes(folder: str, head, buckets, packing: bool):
    """(XLA's runtime, OpenVINO's) of one standalone plan in float32 (benchmarks/common.py)."""
    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.stages.encode import load_encoder

    spec = standalone_spec(folder, "float32", head.pooling, AttentionConfig(), buckets, packing, head=head)
    openvino = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, engine="openvino"))
    return load_encoder(spec), load_encoder(openvino)


def assert_openvino_writes_what_xla_writes(folder: str, head, batches, packing: bool) -> list[dict]:
    """Each batch through both runtimes: OpenVINO ran it (its record says so) and its outputs pass the parity
    gate against XLA's; the OpenVINO runtime's records."""
    xla, openvino = runtimes(folder, head, sorted({b.bucket_len for b in batches}), packing)
    records = []
    for batch in batches:
        reference, xla_record = xla.encode(batch)
        ours, record = openvino.encode(batch)
        assert (xla_record["engine"], xla_record["engine_reason"]) == ("xla", "runner.engine: xla")
        assert record["engine"] == "openvino", record["engine_reason"]
        passed, figures = parity("float32", ours, reference)
        assert passed, figures
        records.append(record)
    return records
