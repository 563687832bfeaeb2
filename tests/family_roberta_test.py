"""XLM-RoBERTa (and RoBERTa, CamemBERT: the same family) against transformers' XLMRobertaModel: BERT with
position ids counted from pad_token_id + 1 and one token type."""

from __future__ import annotations

import pytest
from family_fixtures import (
    LENGTHS,
    assert_docbeam_run_matches,
    assert_matches_transformers,
    assert_moves_output,
    assert_openvino_matches_xla,
    assert_refused,
    both_forms,
    replace,
    tiny_model,
)

from docbeam.models import checkpoint


@pytest.fixture(scope="module")
def model():
    return tiny_model(
        "XLMRobertaModel",
        model_kwargs={"add_pooling_layer": False},
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
    )


def hub_config(config: dict) -> dict:
    return {**config, "position_embedding_type": "absolute", "architectures": ["XLMRobertaModel"]}


def hub_tensors(tensors: dict) -> dict:
    return {f"roberta.{name}": value for name, value in tensors.items()}


folder = both_forms("xlmr", hub_config, hub_tensors)


def test_the_position_table_holds_two_fewer_windows_positions(folder):
    config = checkpoint.open_checkpoint(folder).config
    assert (config.max_position, config.position_offset, config.type_vocab_size) == (128, 2, 1)


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    backends = assert_matches_transformers(model, folder, LENGTHS, packed)
    assert backends == ["native", "chunked", "flash"]  # every built-in backend runs it, packed or not


def test_positions_counted_from_zero_move_the_output(model, folder):
    from_zero = lambda c: replace(pad_token_id=-1, max_position=c.max_position + c.position_offset)(c)  # noqa: E731
    assert_moves_output(model, folder, change=from_zero)


def test_other_position_embedding_types_are_refused(tmp_path, model):
    relative = lambda c: {**c, "position_embedding_type": "relative_key"}  # noqa: E731
    assert_refused(model, str(tmp_path), relative, "position_embedding_type: 'relative_key'")


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"a": "Multilingual embeddings for everyone.", "b": " ".join(["Positions start past padding."] * 12)}
    assert_docbeam_run_matches(model, folder, tmp_path, texts)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
