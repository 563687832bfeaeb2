"""bge-m3's three heads from one encoder pass (models/heads/bge_m3.py): each document's dense vector, lexical
weights and ColBERT vectors equal FlagEmbedding's published formulas (BGEM3FlagModel.encode, in a torch reference
of this file's own) on native and chunked attention, packed and unpacked; keeping special tokens or summing a token
id's weights is caught; a sparse_linear.pt that holds anything but a linear layer's tensors is refused."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from bge_m3_test import bge_m3_checkpoint
from family_fixtures import MIN_COSINE
from multivector_head_test import TEXTS, WINDOW, first_windows

from docbeam import attention
from docbeam.config import ModelConfig
from docbeam.models import checkpoint, encoder
from docbeam.models.heads.registry import resolve
from docbeam.pipeline.records import WindowEmbedding

SPARSE_TOLERANCE = 1e-5


def m3_checkpoint(folder: str):
    """bge_m3_test's checkpoint plus sparse_linear.pt (Linear 32 → 1, std 0.3, as FlagEmbedding saves it) and
    the tokenizer's eos_token: bge-m3's XLM-R tokenizer names its closing </s> so, and FlagEmbedding drops it."""
    import torch

    folder, model, colbert = bge_m3_checkpoint(folder)
    sparse = torch.nn.Linear(32, 1)
    with torch.no_grad():
        sparse.weight.normal_(0.0, 0.3)
        sparse.bias.normal_(0.05, 0.1)  # some tokens' weights are > 0, some are cut by the relu
    torch.save(sparse.state_dict(), os.path.join(folder, "sparse_linear.pt"))
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        with open(path) as f:
            settings = json.load(f)
        with open(path, "w") as f:
            json.dump({**settings, "eos_token": "[SEP]"}, f)
    return folder, model, colbert, sparse


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    return m3_checkpoint(str(tmp_path_factory.mktemp("m3") / "model"))


def flag_embedding(model, colbert, sparse, folder: str, texts: list[str], combine=max) -> list[dict]:
    """BGEM3FlagModel.encode's three outputs per text, from its published formulas: dense = normalize(h[:, 0]);
    lexical weights = relu(sparse_linear(h)) per token, for each token id the max (``combine``) of its weights,
    cls/eos/pad/unk ids dropped, weights > 0 kept; colbert = normalize(colbert_linear(h[:, 1:])), tokens_num - 1."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    out = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=WINDOW, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            weights = torch.relu(sparse(hidden))[0, :, 0].tolist()
            vectors = torch.nn.functional.normalize(colbert(hidden[:, 1:]), dim=-1)[0, : ids.shape[1] - 1]
            dense = torch.nn.functional.normalize(hidden[:, 0], dim=-1)[0]
        lexical = {}
        for w, i in zip(weights, ids[0].tolist()):
            if i not in unused and w > 0:
                lexical[i] = combine(lexical[i], w) if i in lexical else w
        out.append({"dense": dense.numpy(), "lexical": lexical, "colbert": vectors.numpy()})
    return out


def ours(
    folder: str, texts: list[str], *, backend: str = "native", packed: bool = False, change=lambda head: head
) -> list[dict]:
    """docbeam's forward, window cut and rows for each text's first window (``change`` edits the head)."""
    ck = checkpoint.open_checkpoint(folder, with_weights=True)
    head = change(resolve(ck, "bge_m3", ModelConfig(path=folder, head="bge_m3")))
    params = {"encoder": checkpoint.load_params(ck.folder, ck.config), "head": head.load_params(ck.folder)}
    attend = attention.get(backend).bind(attention.get(backend).parse_options(None))
    forward = jax.jit(encoder.embed_fn(ck.config, attend, head.pooling, head.layers, head.reduce))
    batch = first_windows(ck.folder, texts, packed)
    out = forward(
        params, batch.ids_BxT, batch.lengths_B, *((batch.segment_ids_BxT, batch.slot_lengths_BxK) if packed else ())
    )
    tokens = head.window_vectors(np.asarray(out), batch)
    return [
        head.document_row(
            [WindowEmbedding(w.doc_id, 0, 1, len(t), len(t), False, head.compact_window(t), WINDOW, backend)]
        )
        for w, t in zip(batch.windows, tokens)
    ]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.atleast_2d(np.asarray(a, np.float64)), np.atleast_2d(np.asarray(b, np.float64))
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def differences(rows: list[dict], expected: list[dict]) -> list[str]:
    """What of docbeam's rows is not FlagEmbedding's: [] when every vector's cosine is ≥ MIN_COSINE and the
    lexical weights have the same token ids and values within SPARSE_TOLERANCE."""
    found = []
    for i, (row, want) in enumerate(zip(rows, expected, strict=True)):
        if cosines(row["embedding"], want["dense"]).min() < MIN_COSINE:
            found.append(f"d{i}: dense")
        if (
            len(row["multi_vector"]) != len(want["colbert"])
            or cosines(row["multi_vector"], want["colbert"]).min() < MIN_COSINE
        ):
            found.append(f"d{i}: colbert")
        sparse = row["sparse_embedding"]
        if sparse["indices"] != sorted(want["lexical"]):
            found.append(f"d{i}: sparse token ids")
        elif (
            np.abs(np.subtract(sparse["values"], [want["lexical"][t] for t in sparse["indices"]])).max(initial=0)
            > SPARSE_TOLERANCE
        ):
            found.append(f"d{i}: sparse weights")
    return found


def test_the_three_representations_are_flag_embeddings_on_native_and_chunked_packed_and_unpacked(m3):
    folder, model, colbert, sparse = m3
    expected = flag_embedding(model, colbert, sparse, folder, TEXTS)
    assert all(0 < len(e["lexical"]) < len(e["colbert"]) for e in expected)  # the relu and the max both cut terms
    for backend in ("native", "chunked"):
        for packed in (False, True):
            assert differences(ours(folder, TEXTS, backend=backend, packed=packed), expected) == [], (backend, packed)


def test_keeping_special_tokens_or_summing_a_tokens_weights_is_caught(m3):
    folder, model, colbert, sparse = m3
    expected = flag_embedding(model, colbert, sparse, folder, TEXTS)
    head = resolve(checkpoint.open_checkpoint(folder), "bge_m3", ModelConfig(path=folder, head="bge_m3"))
    assert len(head.unused_ids) == 4  # [CLS], [SEP] (the eos), [PAD], [UNK]
    kept = ours(folder, TEXTS, change=lambda h: dataclasses.replace(h, unused_ids=()))
    assert "d0: sparse token ids" in differences(kept, expected)
    summed = flag_embedding(model, colbert, sparse, folder, TEXTS, combine=lambda a, b: a + b)
    assert any(d.endswith("sparse weights") for d in differences(ours(folder, TEXTS), summed))


def test_pruning_keeps_the_largest_lexical_weights(m3):
    folder, model, colbert, sparse = m3
    expected = flag_embedding(model, colbert, sparse, folder, TEXTS[:2])
    rows = ours(folder, TEXTS[:2], change=lambda h: dataclasses.replace(h, max_terms=3))
    for row, want in zip(rows, expected):
        top = sorted(sorted(want["lexical"], key=lambda t: -want["lexical"][t])[:3])
        assert row["sparse_embedding"]["indices"] == top


def test_a_sparse_linear_that_is_not_a_linear_layers_tensors_is_refused(tmp_path):
    import torch

    folder, *_ = m3_checkpoint(str(tmp_path / "m3"))

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"weight": torch.ones(1, 32), "bias": Payload()}, os.path.join(folder, "sparse_linear.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"sparse_linear.pt is refused: its pickle names posix.system"):
        resolve(checkpoint.open_checkpoint(folder), "bge_m3", ModelConfig(path=folder, head="bge_m3"))
    torch.save({"weight": torch.ones(2, 32), "bias": torch.ones(2)}, os.path.join(folder, "sparse_linear.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"sparse_linear.pt holds a weight of shape \[2, 32\]"):
        resolve(checkpoint.open_checkpoint(folder), "bge_m3", ModelConfig(path=folder, head="bge_m3"))
    os.remove(os.path.join(folder, "sparse_linear.pt"))
    with pytest.raises(checkpoint.CheckpointError, match="model.head: bge_m3, but .* has no sparse_linear.pt"):
        resolve(checkpoint.open_checkpoint(folder), "bge_m3", ModelConfig(path=folder, head="bge_m3"))


def test_auto_stays_bge_m3s_dense_vector(m3):
    folder = m3[0]
    assert resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder)).name == "embedding"


def test_a_non_finite_window_does_not_take_its_packed_row_mates_outputs_with_it(m3):
    """As for the multi-vector head: token 7's embedding is NaN; "bad" shares a packed row with "good", which the
    runtime encodes again alone, so its three outputs are the clean run's and "bad" is refused."""
    import jax.numpy as jnp

    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.records import TokenWindow
    from docbeam.pipeline.stages.encode import load_encoder
    from docbeam.pipeline.stages.packer import packed_batch

    folder = m3[0]
    head = resolve(checkpoint.open_checkpoint(folder), "bge_m3", ModelConfig(path=folder, head="bge_m3"))
    spec = standalone_spec(folder, "float32", "mean", AttentionConfig(), (16, 32), packing=True, head=head)
    runtime = load_encoder(spec)
    good = TokenWindow("good", 0, 1, np.array([101, 2000, 1010, 2000, 1012, 102], np.int32), 4, False)
    bad = TokenWindow("bad", 0, 1, np.array([101, 7, 2003, 102], np.int32), 2, False)
    clean, _ = runtime.encode(packed_batch([[good]], 32, 2))
    words = runtime.params["encoder"]["embed"]["word"]["embedding"]
    runtime.params["encoder"]["embed"]["word"]["embedding"] = words.at[7].set(jnp.nan)
    batch = packed_batch([[good, bad]], 32, 2)
    vectors, timing = runtime.encode(batch)
    by_id = {w[0]: head.compact_window(v) for w, v in zip(batch.windows, vectors)}
    assert timing["reencoded_alone"] == 2 and not by_id["bad"].finite()
    again = head.compact_window(clean[0])
    assert again.colbert.shape == (5, 24) and again.sparse.indices.tolist() == sorted(set(again.sparse.indices))
    for got, want in (
        (by_id["good"].dense, again.dense),
        (by_id["good"].colbert, again.colbert),
        (by_id["good"].sparse.values, again.sparse.values),
    ):
        np.testing.assert_allclose(got, want, atol=2e-6)
    window = WindowEmbedding("bad", 0, 1, 4, 4, False, by_id["bad"], 32, "native")
    assert head.document_row([window]).startswith("the bge-m3 output has NaN")


@pytest.mark.parametrize(
    "sets, match",
    [
        ({"output": {"vector_dtype": "int8"}}, "output.vector_dtype: int8: model.head resolved to bge_m3"),
        ({"output": {"granularity": "chunk"}}, "output.granularity: chunk: model.head resolved to bge_m3"),
        ({"model": {"head": "bge_m3", "sparse": {"windows": "all"}}}, "model.sparse.windows: all: the bge_m3 head"),
    ],
)
def test_what_the_bge_m3_head_does_not_write_is_refused_at_start(tmp_path, m3, sets, match):
    from conftest import job_config

    from docbeam.pipeline.driver.plan import make_plan

    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    sets = {"model": {"head": "bge_m3"}, **sets}
    with pytest.raises((checkpoint.CheckpointError, ValueError), match=match):
        make_plan(job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), m3[0], **sets), probe_backends=False)
