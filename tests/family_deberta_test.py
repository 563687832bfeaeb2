"""DeBERTa-v2/v3 against transformers' DebertaV2Model: disentangled attention (c2p and p2c terms from one
relative table, log buckets, the 1/√(3d) scale), both as v3 sets it (shared projections, LayerNormed relative
embeddings, no positions in the input) and with v2's other options (own pos_key/pos_query projections, clipped
offsets without buckets, absolute positions and token types in the input). Documents of up to 64 tokens reach
past the buckets' exact range (±4) and the table's reach (32 and 16 offsets)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    PACKED_BATCHING,
    assert_bfloat16_close_to_float32,
    assert_close_to_transformers,
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
from docbeam.models.families import deberta

V3 = dict(
    relative_attention=True,
    position_buckets=8,
    max_relative_positions=32,
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    pos_att_type="p2c|c2p",
    position_biased_input=False,
    type_vocab_size=0,
)
V2 = dict(
    relative_attention=True,
    position_buckets=-1,
    max_relative_positions=16,
    share_att_key=False,
    pos_att_type=["c2p", "p2c"],
    position_biased_input=True,
    type_vocab_size=2,
)


@pytest.fixture(scope="module", params=["v3", "v2-options"])
def model(request):
    return tiny_model(
        "DebertaV2Model",
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=128,
        layer_norm_eps=1e-7,
        **(V3 if request.param == "v3" else V2),
    )


def hub_config(config: dict) -> dict:
    terms = config["pos_att_type"]
    return {
        **{k: v for k, v in config.items() if k != "dtype"},
        "torch_dtype": "float32",
        "pos_att_type": "|".join(terms) if isinstance(terms, list) else terms,
        "architectures": ["DebertaV2ForMaskedLM"],
    }  # a pre-training head: the backbone embeds


def hub_tensors(tensors: dict) -> dict:
    return {f"deberta.{name}": value for name, value in tensors.items()}


folder = both_forms("deberta", hub_config, hub_tensors)


@pytest.mark.parametrize("buckets, reach", [(256, 512), (8, 32), (16, 128)])
def test_buckets_are_transformers_buckets_at_every_offset(buckets, reach):
    import torch
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    offsets = np.arange(-3000, 3001)
    want = make_log_bucket_position(torch.tensor(offsets), buckets, reach).numpy()
    np.testing.assert_array_equal(np.asarray(deberta.log_bucket(jnp.asarray(offsets, jnp.int32), buckets, reach)), want)


def test_config_reads_every_option(model, folder):
    config = checkpoint.open_checkpoint(folder).config
    v3 = model.config.share_att_key
    assert config.pos_att_type == (("p2c", "c2p") if v3 else ("c2p", "p2c"))
    assert (config.position, config.span, config.norm_rel_ebd) == (
        ("relative", 8, True) if v3 else ("absolute", 16, False)
    )
    assert [f.describe() for f in config.attention_features] == ["global, disentangled relative positions"]


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_native_jax_nn_form_and_small_chunks_match_too(model, folder, packed):
    """native's other form, and chunked with blocks whose offsets reach fewer rows than the table holds."""
    assert_close_to_transformers(model, folder, packed=packed, options={"implementation": "jax_nn"})
    assert_close_to_transformers(
        model, folder, packed=packed, backend="chunked", options={"query_chunk": 4, "key_chunk": 4, "heads_per_step": 1}
    )


def without(term: str):
    """An AttentionFn wrapper dropping one term (c2p: the pos_key table; p2c: the pos_query table)."""

    def wrap(fn):
        def attend(*args, relative_positions, **kwargs):
            changed = dataclasses.replace(relative_positions, **{term: None})
            return fn(*args, relative_positions=changed, **kwargs)

        return attend

    return wrap


def swapped_tables(fn):
    def attend(*args, relative_positions, **kwargs):
        rel = relative_positions
        return fn(
            *args,
            relative_positions=dataclasses.replace(
                rel, pos_key_RxNxH=rel.pos_query_RxNxH, pos_query_RxNxH=rel.pos_key_RxNxH
            ),
            **kwargs,
        )

    return attend


def unscaled_by_terms(fn):
    """1/√d instead of 1/√(3d): the scale without the terms' factor."""
    return lambda *args, scale, **kwargs: fn(*args, scale=scale * math.sqrt(3), **kwargs)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param({"attend": without("pos_key_RxNxH")}, id="no-c2p"),
        pytest.param({"attend": without("pos_query_RxNxH")}, id="no-p2c"),
        pytest.param({"attend": swapped_tables}, id="c2p-and-p2c-tables-swapped"),
        pytest.param({"attend": unscaled_by_terms}, id="scale-without-the-terms"),
        pytest.param({"change": replace(relative_attention=False)}, id="no-relative-attention"),
    ],
)
def test_each_part_of_disentangled_attention_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, **broken)


def test_the_offset_direction_moves_the_output(model, folder, monkeypatch):
    row = deberta.relative_row
    monkeypatch.setattr(deberta, "relative_row", lambda config: lambda offset: row(config)(-offset))
    assert_moves_output(model, folder)


def test_share_att_key_and_norm_rel_ebd_move_the_output(model, folder):
    if model.config.share_att_key:  # v3: its LayerNorm on the relative table
        assert_moves_output(model, folder, change=replace(norm_rel_ebd=False))
    else:  # v2 options: the layers' own pos_key/pos_query projections, not the content ones
        assert_moves_output(model, folder, change=replace(share_att_key=True))


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("conv_kernel_size", 3, "conv_kernel_size: 3.*convolution.*supported: 0"),
        ("pos_att_type", "p2c|p2p", "pos_att_type: 'p2c|p2p'.*c2p, p2c"),
        ("embedding_size", 16, "embedding_size: 16.*embed_proj"),
        ("norm_rel_ebd", "batch_norm", "norm_rel_ebd: 'batch_norm'.*none, layer_norm"),
    ],
)
def test_what_docbeam_does_not_build_is_refused_naming_key_and_value(model, tmp_path, key, value, match):
    assert_refused(model, str(tmp_path), lambda config: {**config, key: value}, f"config.json.*{match}")


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    """Packed, on chunked: the plan asks it about relative positions and it builds the terms per block."""
    texts = {"a": "Disentangled attention, relatively.", "b": " ".join(["Offsets past the buckets' span."] * 12)}
    tokens = assert_docbeam_run_matches(
        model, folder, tmp_path, texts, batching=PACKED_BATCHING, attention={"backend": "chunked"}
    )
    assert tokens["b"].shape[1] > 2 * checkpoint.open_checkpoint(folder).config.max_relative_positions


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
