"""bge-m3's ColBERT vectors through the multi-vector head (models/heads/multivector.py bge_m3_colbert): each
token's vector equals FlagEmbedding's published formula, in a torch reference of its own, on native and chunked
attention, packed and unpacked; colbert_linear.pt is read as plain tensors (models/checkpoint/torch_tensors.py)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from family_fixtures import MIN_COSINE, save_checkpoint, tiny_model
from multivector_head_test import TEXTS, WINDOW, lowest_token_cosine, ours

from docbeam.config import ModelConfig
from docbeam.models import checkpoint
from docbeam.models.heads.registry import resolve


def bge_m3_checkpoint(folder: str) -> str:
    """A random XLM-R (std 0.3) with bge-m3's ColBERT head beside it: colbert_linear.pt, a torch.nn.Linear 32 → 24
    saved by torch.save as FlagEmbedding saves it; returned with that Linear, for the reference."""
    import torch

    model = tiny_model(
        "XLMRobertaModel",
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
    )
    save_checkpoint(model, folder, max_seq_length=WINDOW)
    linear = torch.nn.Linear(32, 24)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.3)
        linear.bias.normal_(0.0, 0.3)
    torch.save(linear.state_dict(), os.path.join(folder, "colbert_linear.pt"))
    return folder, model, linear


def flag_embedding_colbert(model, linear, folder: str, texts: list[str]) -> list[np.ndarray]:
    """FlagEmbedding's published formula (BGEM3FlagModel): colbert_linear(h[:, 1:]) * mask[:, 1:], the first
    tokens_num - 1 vectors, L2-normalised."""
    import torch

    tokenizer = checkpoint.load_tokenizer(folder)
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer(text, truncation=True, max_length=WINDOW)["input_ids"]])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            vecs = linear(hidden[:, 1:]) * mask[:, 1:][:, :, None].float()
            vecs = torch.nn.functional.normalize(vecs[0, : int(mask.sum()) - 1], dim=-1)
        out.append(vecs.numpy().astype(np.float64))
    return out


def test_bge_m3s_colbert_vectors_are_flag_embeddings_on_native_and_chunked_packed_and_unpacked(tmp_path):
    folder, model, linear = bge_m3_checkpoint(str(tmp_path / "m3"))
    expected = flag_embedding_colbert(model, linear, folder, TEXTS)
    # auto stays bge-m3's dense vector (its sentence-transformers files); multi_vector names the ColBERT head
    assert resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder)).name == "embedding"

    def named(_auto_head):
        return resolve(checkpoint.open_checkpoint(folder), "multi_vector", ModelConfig(path=folder))

    head = named(None)
    assert (head.width, head.drop_first, head.skip_ids) == (24, True, ())
    for backend in ("native", "chunked"):
        for packed in (False, True):
            got = ours(folder, TEXTS, backend=backend, packed=packed, change=named)
            assert lowest_token_cosine(got, expected) >= MIN_COSINE, (backend, packed)
    kept_cls = ours(folder, TEXTS, change=lambda h: dataclasses.replace(named(h), drop_first=False))
    assert lowest_token_cosine(kept_cls, expected) == -1.0


def test_a_colbert_linear_that_is_not_a_linear_layers_tensors_is_refused(tmp_path):
    import torch

    folder, _, _ = bge_m3_checkpoint(str(tmp_path / "m3"))
    torch.save({"weight": torch.ones(24, 32)}, os.path.join(folder, "colbert_linear.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"colbert_linear.pt holds \['weight'\], not a linear"):
        resolve(checkpoint.open_checkpoint(folder), "multi_vector", ModelConfig(path=folder))
