"""XLM-RoBERTa (and RoBERTa, CamemBERT: the same family) against transformers' XLMRobertaModel: BERT with
position ids counted from pad_token_id + 1 and one token type."""
from __future__ import annotations

import numpy as np
import pytest

from family_fixtures import (MIN_COSINE, VOCAB, assert_matches_transformers, lowest_cosine, our_vectors,
                             reference_vectors, replace, run_docbeam, save_checkpoint, token_inputs)
from models import checkpoint

LENGTHS = [40, 57, 23, 64, 12, 33]


@pytest.fixture(scope="module")
def model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.XLMRobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, initializer_range=0.3)
    return transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()


def hub_config(config: dict) -> dict:
    return {**config, "position_embedding_type": "absolute", "architectures": ["XLMRobertaModel"]}


def hub_tensors(tensors: dict) -> dict:
    return {f"roberta.{name}": value for name, value in tensors.items()}


@pytest.fixture(scope="module", params=["transformers5", "hub"])
def folder(request, model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"xlmr-{request.param}"))
    if request.param == "hub":
        return save_checkpoint(model, path, config_rewrite=hub_config, tensor_rename=hub_tensors)
    return save_checkpoint(model, path)


def test_the_position_table_holds_two_fewer_windows_positions(folder):
    config = checkpoint.open_checkpoint(folder).config
    assert (config.max_position, config.position_offset, config.type_vocab_size) == (128, 2, 1)


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    backends = assert_matches_transformers(model, folder, LENGTHS, packed)
    assert backends == ["native", "chunked", "flash"]  # every built-in backend runs it, packed or not


def test_positions_counted_from_zero_move_the_output(model, folder):
    ids, lengths = token_inputs(LENGTHS)
    from_zero = lambda c: replace(pad_token_id=-1, max_position=c.max_position + c.position_offset)(c)  # noqa: E731
    ours = our_vectors(folder, ids, lengths, change=from_zero)
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths)) < 0.999


def test_other_position_embedding_types_are_refused(tmp_path, model):
    relative = lambda c: {**c, "position_embedding_type": "relative_key"}  # noqa: E731
    folder = save_checkpoint(model, str(tmp_path), config_rewrite=relative)
    with pytest.raises(checkpoint.CheckpointError, match="position_embedding_type: 'relative_key'"):
        checkpoint.open_checkpoint(folder)


@pytest.mark.slow
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "Multilingual embeddings for everyone.", "b": " ".join(["Positions start past padding."] * 12)}
    got = run_docbeam(folder, tmp_path, texts)
    tokenizer = checkpoint.load_tokenizer(folder)
    for doc_id, text in texts.items():
        ids = np.asarray([tokenizer(text)["input_ids"]], np.int32)
        want = reference_vectors(model, ids, np.asarray([ids.shape[1]], np.int32))
        assert lowest_cosine(got[doc_id][None], want) >= MIN_COSINE, doc_id
