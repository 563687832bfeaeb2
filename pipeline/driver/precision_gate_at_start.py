"""The precision gate at the start of a run: a ``model.dtype`` other than float32 is held to float32's
vectors on the input's first documents (models/precision_gate.py) before the output is touched, so a reduced
precision that fails its gate is never chosen silently. ``docbeam run`` and ``validate --verify`` start here.

``model.precision_gate`` says what a failure does: ``enforce`` refuses the run (exit 2) naming the gate,
``warn`` runs and records the failure, ``off`` does not measure. Every run records what happened in
summary.json's ``precision_gate``, also where the gate could not run (and why).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from docbeam.config import JobConfig
from docbeam.models import precision_gate as gate

log = logging.getLogger(__name__)

DOCUMENTS = 300  # the input's first documents: enough for recall@10 to mean something, seconds on a CPU


def first_documents(cfg: JobConfig, limit: int) -> list:
    """The input's first ``limit`` documents, reading no further: a run's input may be one file of gigabytes."""
    from docbeam.pipeline.records import Document
    from docbeam.pipeline.stages.read import match_paths, path_records

    docs = []
    for path in match_paths(cfg.input.path):
        records = path_records(path, cfg.input)
        docs += itertools.islice((r for r in records if isinstance(r, Document)), limit - len(docs))
        records.close()  # the file it has open
        if len(docs) >= limit:
            break
    return docs


def window_vectors(plan, dtype: str, windows, batches):
    """Every window's vector [W, D] in window order, encoded as the job's workers would in ``dtype``."""
    import numpy as np

    from docbeam.pipeline.stages.encode import EncoderSpec, load_encoder

    # Loaded apart from the job's warm encoder (load_encoder, not runtime_for), in ``dtype``; the worker's gate
    # runs again for it when attention.verify is set. On the workers' mesh, which gate_record saw this machine has.
    # On XLA: this gate measures the dtype; OpenVINO is held to XLA's output at the job's dtype by its own parity
    # gate on each shape's first batch (models/engines/choose.py).
    encoder_plan = dataclasses.replace(plan.encoder_plan, dtype=dtype, checked=False, checkpoint_key=(), engine="xla")
    runtime = load_encoder(EncoderSpec(encoder_plan))
    by_window = {}
    for batch in batches:
        vectors, _ = runtime.encode(batch)
        by_window.update({(w.doc_id, w.index): v for w, v in zip(batch.windows, vectors)})
    return np.stack([by_window[(w.doc_id, w.index)] for w in windows])


def measure(plan, limit: int = DOCUMENTS) -> tuple[int, int, gate.GateResult | None]:
    """(documents read, windows, the gate's result): the input's first ``limit`` documents encoded in float32
    and in model.dtype, every window's vector compared; no result when there are too few windows for recall@10."""
    from docbeam.models.checkpoint import load_tokenizer, resolve_dir
    from docbeam.pipeline.stages.packer import batch_windows
    from docbeam.pipeline.stages.tokenize import windows_for

    cfg = plan.config
    docs = first_documents(cfg, limit)
    windows = windows_for(
        docs,
        load_tokenizer(resolve_dir(plan.model_path)),
        window_len=plan.window_len,
        config=cfg.tokenize,
        prompt=plan.prompt,
    )
    if len(windows) <= gate.K:
        return len(docs), len(windows), None
    batches = batch_windows(windows, plan.batching())
    ours, reference = (window_vectors(plan, dtype, windows, batches) for dtype in (cfg.model.dtype, "float32"))
    return len(docs), len(windows), gate.measure(cfg.model.dtype, ours, reference)


def local_chips() -> int:
    import jax

    return len(jax.local_devices())


def _not_run(dtype: str, mode: str, reason: str) -> dict:
    log.warning("docbeam: model.dtype %s runs without its precision gate: %s", dtype, reason)
    return {"dtype": dtype, "mode": mode, "status": "not run", "reason": reason}


def gate_record(plan, limit: int = DOCUMENTS) -> dict | None:
    """What summary.json's ``precision_gate`` says (None for float32, the reference itself). Raises
    ``PrecisionRefused`` naming each failed gate under ``enforce``."""
    cfg = plan.config
    dtype, mode = cfg.model.dtype, cfg.model.precision_gate
    if dtype == "float32":
        return None
    if mode == "off":
        return _not_run(dtype, mode, "model.precision_gate: off")
    if not plan.head.precision_gated:  # under enforce such a run was refused at plan (pipeline/driver/head_plan.py)
        return _not_run(
            dtype, mode, f"the gate measures embeddings, and the {plan.head.name} head writes {plan.head.folder}/ rows"
        )
    if not isinstance(cfg, JobConfig):
        return _not_run(
            dtype,
            mode,
            "docbeam.EmbedDocuments has no input to measure it on; run `docbeam validate "
            "--verify` on a sample of your documents",
        )
    if not plan.checked:
        return _not_run(
            dtype,
            mode,
            f"the encoder runs on {plan.platform}, not on this machine; run `docbeam "
            f"validate --verify` on a {plan.platform} machine",
        )
    chips = local_chips()
    if plan.memory is not None and plan.memory.mesh.devices > chips:
        return _not_run(
            dtype,
            mode,
            f"the workers' mesh {plan.memory.mesh} needs {plan.memory.mesh.devices} chips and this machine has "
            f"{chips}; run `docbeam validate --verify` on a machine like the workers",
        )
    documents, windows, result = measure(plan, limit)
    if result is None:
        return _not_run(
            dtype,
            mode,
            f"{windows} windows in the input's first {documents} documents; recall@{gate.K} needs more than {gate.K}",
        )
    if mode == "enforce":
        gate.require(result)
    elif not result.passed:
        log.warning(
            "docbeam: model.dtype %s FAILS its precision gate (%s) and runs anyway (model.precision_gate: warn)",
            dtype,
            "; ".join(result.failures),
        )
    return {
        "dtype": dtype,
        "mode": mode,
        "status": "passed" if result.passed else "failed",
        "failures": result.failures,
        "documents": documents,
        "windows": windows,
        "lowest_cosine": result.lowest_cosine,
        "mean_cosine": result.mean_cosine,
        "recall_at_10": result.recall_at_10,
    }


def checked(plan, limit: int = DOCUMENTS):
    """The plan with its gate's record (``plan.precision_gate``), said in the run's log."""
    record = gate_record(plan, limit)
    if record is not None:
        log.info("docbeam: %s", describe(record))
    return dataclasses.replace(plan, precision_gate=record)


def describe(record: dict) -> str:
    """One line for ``validate``, the run's log and its printed summary."""
    if record["status"] == "not run":
        return f"precision gate: not run ({record['reason']})"
    result = gate.GateResult(
        record["dtype"], record["windows"], record["lowest_cosine"], record["mean_cosine"], record["recall_at_10"]
    )
    return f"precision gate ({record['documents']} documents): {result.describe()}"
