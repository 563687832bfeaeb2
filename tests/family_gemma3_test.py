"""Gemma3 text models against transformers' Gemma3TextModel: EmbeddingGemma's bidirectional form (every layer
attends both ways; a sliding layer within a radius of ``sliding_window // 2`` = 4 tokens here) and the causal
form (a sliding layer sees the 7 tokens before each and itself; pooled at the last token), with 4 query heads
over 1 key/value head of 16, q/k RMSNorm, ``(1 + w)`` norms before and after attention and MLP, GeGLU, a score
scale of ``query_pre_attn_scalar^-½`` = 24^-½, and RoPE bases 1e6 (full layers) and 1e3 (sliding ones); windows
of 12-64 tokens, so each crosses the sliding window. From config.json as transformers 5 writes it and as
EmbeddingGemma-300m's has it on the Hub (``rope_theta``, ``rope_local_base_freq``, a layer pattern)."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    MIN_COSINE,
    PACKED_BATCHING,
    assert_bfloat16_close_to_float32,
    assert_close_to_transformers,
    assert_docbeam_run_matches,
    assert_matches_transformers,
    assert_moves_output,
    assert_openvino_matches_xla,
    assert_refused,
    both_forms,
    lowest_cosine,
    our_vectors,
    reference_vectors,
    replace,
    save_checkpoint,
    token_inputs,
)

from docbeam.models import checkpoint

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}


def random_gemma3(bidirectional: bool, rope: dict = ROPE):
    """A tiny random Gemma3TextModel, weights drawn with std 0.3 and the RMSNorm weights (which transformers
    initialises to 0, so that 1 + w is 1) around 0 with std 0.3, so each feature moves the output."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=LAYER_TYPES,
        rope_parameters=rope,
        use_bidirectional_attention=bidirectional,
        initializer_range=0.3,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    model = transformers.Gemma3TextModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return random_gemma3(bidirectional=True)


@pytest.fixture(scope="module")
def causal_model():
    return random_gemma3(bidirectional=False)


def hub_config(config: dict) -> dict:
    """EmbeddingGemma-300m's config.json keys (transformers 4.56): RoPE bases as rope_theta and
    rope_local_base_freq, the layer kinds as a pattern (every 2nd layer full here; 6th there)."""
    config = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters", "dtype")}
    return {
        **config,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 1_000.0,
        "rope_scaling": None,
        "_sliding_window_pattern": 2,
        "torch_dtype": "float32",
        "architectures": ["Gemma3TextModel"],
    }


def hub_tensors(tensors: dict) -> dict:
    """A Gemma3ForCausalLM checkpoint: the model under ``model.``."""
    return {f"model.{name}": value for name, value in tensors.items()}


folder = both_forms("gemma3", hub_config, hub_tensors)


@pytest.fixture(scope="module")
def causal_folder(causal_model, tmp_path_factory):
    return save_checkpoint(causal_model, str(tmp_path_factory.mktemp("gemma3-causal")))


def test_both_config_forms_read_as_the_same_model(folder):
    ck = checkpoint.open_checkpoint(folder)
    config = ck.config
    assert config.sliding_layers == (True, False, True, False) and not config.causal
    assert (config.num_heads, config.kv_heads, config.head_dim, config.query_scale) == (4, 1, 16, 24**-0.5)
    assert (config.rope_theta, config.local_rope_theta, config.norm_offset) == (1_000_000.0, 1_000.0, 1.0)
    assert config.local_window == (4, 4)  # sliding_window 8: |i - j| < 8 // 2 + 1
    assert {f.describe() for f in config.attention_features} == {"global", "local window (4, 4)"}
    assert ck.settings.pooling == "mean"


def test_the_saved_sliding_window_is_the_one_in_the_config(folder):
    """transformers writes back the window it was given (8), not the bound it turned it into (5)."""
    import json
    import os

    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["sliding_window"] == 8


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_across_sliding_windows(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("options", [{"implementation": "jax_nn"}, {"query_chunk": 8, "key_chunk": 8}])
@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_on_each_formulation(model, folder, packed, options):
    """native's form off CPU, and chunked with chunks smaller than the rows (so a sliding layer scans only the
    key chunks its window reaches)."""
    backend = "native" if "implementation" in options else "chunked"
    assert_close_to_transformers(model, folder, backend=backend, packed=packed, options=options)


@pytest.mark.parametrize(
    "backend,options", [("native", {}), ("chunked", {"query_chunk": 8, "key_chunk": 8}), ("flash", {})]
)
@pytest.mark.parametrize("packed", [False, True])
def test_causal_gemma3_matches_transformers_at_the_last_token(causal_model, causal_folder, packed, backend, options):
    ck = checkpoint.open_checkpoint(causal_folder)
    assert ck.config.causal and ck.config.local_window == (7, 0) and ck.settings.pooling == "lasttoken"
    ids, lengths = token_inputs(LENGTHS)
    ours = our_vectors(
        causal_folder, ids, lengths, backend=backend, packed=packed, options=options, pooling="lasttoken"
    )
    assert lowest_cosine(ours, reference_vectors(causal_model, ids, lengths, "lasttoken")) >= MIN_COSINE


LINEAR = {**ROPE, "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}


@pytest.mark.parametrize("form", ["transformers5", "hub"])
def test_linear_rope_scaling_on_full_layers_matches_transformers(tmp_path, form):
    """The larger causal Gemma3 checkpoints scale the full layers' positions linearly (factor 8); the Hub's
    files say so in rope_scaling, which Gemma3TextConfig applies to the full layers only."""
    scaled = random_gemma3(bidirectional=False, rope=LINEAR)

    def legacy(config: dict) -> dict:
        return {**hub_config(config), "rope_scaling": {"rope_type": "linear", "factor": 8.0}}

    folder = save_checkpoint(scaled, str(tmp_path), config_rewrite=legacy if form == "hub" else None)
    config = checkpoint.open_checkpoint(folder).config
    assert (config.rope_scale, config.local_rope_theta) == (1 / 8, 1_000.0)
    ids, lengths = token_inputs(LENGTHS)
    want = reference_vectors(scaled, ids, lengths, "lasttoken")
    for packed in (False, True):
        ours = our_vectors(folder, ids, lengths, packed=packed, pooling="lasttoken")
        assert lowest_cosine(ours, want) >= MIN_COSINE
    assert_moves_output(scaled, folder, family_pooling="lasttoken", change=replace(rope_scale=1.0))


def without_norm_offset(config):
    return replace(norm_offset=0.0)(config)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(causal=True)), id="causal-not-bidirectional"),
        pytest.param(dict(change=replace(local_window=(5, 5))), id="window-radius-sliding_window//2+1"),
        pytest.param(dict(change=replace(local_window=(8, 8))), id="window-radius-sliding_window"),
        pytest.param(dict(change=replace(local_window=(3, 3))), id="window-radius-one-short"),
        pytest.param(
            dict(change=lambda c: replace(rope_theta=c.local_rope_theta, local_rope_theta=c.rope_theta)(c)),
            id="rope-bases-swapped",
        ),
        pytest.param(dict(change=replace(local_rope_theta=1_000_000.0)), id="one-rope-base"),
        pytest.param(dict(change=without_norm_offset), id="norms-times-w-not-1+w"),
        pytest.param(dict(change=replace(qk_norm=False)), id="no-qk-norm"),
        pytest.param(dict(change=replace(query_scale=0.25)), id="scale-head_dim^-half"),
        pytest.param(dict(change=replace(sliding_layers=(False,) * 4)), id="no-sliding-layers"),
    ],
)
def test_each_feature_moves_the_output(model, folder, broken):
    assert_moves_output(model, folder, **broken)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(causal=False)), id="bidirectional-not-causal"),
        pytest.param(dict(change=replace(local_window=(8, 0))), id="causal-window-sliding_window"),
        pytest.param(dict(pooling="mean"), id="mean-pooled"),
    ],
)
def test_each_causal_feature_moves_the_output(causal_model, causal_folder, broken):
    assert_moves_output(causal_model, causal_folder, family_pooling="lasttoken", **broken)


@pytest.mark.parametrize(
    "rewrite,match",
    [
        (lambda c: {**c, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping: 50.0.*soft-capped"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias: True"),
        (
            lambda c: {
                **c,
                "rope_parameters": {
                    **c["rope_parameters"],
                    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e3},
                },
            },
            "sliding_attention.*RoPE scaling",
        ),
        (
            lambda c: {
                **c,
                "rope_parameters": {
                    **c["rope_parameters"],
                    "full_attention": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e6},
                },
            },
            "RoPE scaling",
        ),
        (lambda c: {**c, "sliding_window": None}, "sliding_window"),
        (lambda c: {**c, "layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ],
)
def test_what_docbeam_does_not_reproduce_is_refused(tmp_path, model, rewrite, match):
    assert_refused(model, str(tmp_path), rewrite, match)


def test_bfloat16_stays_close_to_float32(folder):
    assert_bfloat16_close_to_float32(folder)


@pytest.mark.slow
def test_docbeam_run_gives_causal_gemma3_last_token_vectors(causal_model, causal_folder, tmp_path):
    texts = {"short": "A short note.", "long": " ".join(["Causal Gemma3 sees the tokens before it."] * 8)}
    tokens = assert_docbeam_run_matches(
        causal_model, causal_folder, tmp_path, texts, "lasttoken", batching=PACKED_BATCHING
    )
    assert tokens["long"].shape[1] > 8


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")
def test_docbeam_run_gives_transformers_vectors(model, folder, tmp_path):
    texts = {"short": "A short note.", "long": " ".join(["Gemma attends within a window in most layers."] * 8)}
    tokens = assert_docbeam_run_matches(model, folder, tmp_path, texts, batching=PACKED_BATCHING)
    assert tokens["long"].shape[1] > 4 * 8
    assert np.all(tokens["short"] > 0)


EMBEDDINGGEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def save_embeddinggemma(model, folder: str, base: str) -> str:
    """EmbeddingGemma-300m's sentence-transformers modules, saved by sentence-transformers: mean Pooling, Dense
    32→64 and 64→32 without bias or activation (768→3072→768 there), Normalize, and its prompts."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(2)
    identity = torch.nn.Identity()
    modules = [
        Transformer(base, max_seq_length=128),
        Pooling(32, "mean"),
        Dense(32, 64, bias=False, activation_function=identity, init_weight=torch.randn(64, 32) * 0.3),
        Dense(64, 32, bias=False, activation_function=identity, init_weight=torch.randn(32, 64) * 0.3),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu", prompts=EMBEDDINGGEMMA_PROMPTS).save(folder)
    return folder


@pytest.mark.slow
def test_docbeam_run_gives_embeddinggemma_sentence_transformers_vectors(model, tmp_path):
    """`docbeam run` on EmbeddingGemma's layout gives sentence-transformers' encode_document vectors: the
    document prompt, mean pooling, both Dense modules and the normalisation."""
    from family_fixtures import run_docbeam
    from sentence_transformers import SentenceTransformer

    base = save_checkpoint(model, str(tmp_path / "base"))
    folder = save_embeddinggemma(model, str(tmp_path / "st"), base)
    settings = checkpoint.open_checkpoint(folder).settings
    assert (settings.pooling, settings.normalize, settings.document_prompt_name) == ("mean", True, "document")
    assert [(d.in_features, d.out_features, d.bias) for d in settings.dense] == [(32, 64, False), (64, 32, False)]
    texts = {"short": "A short note.", "long": " ".join(["Gemma attends within a window in most layers."] * 8)}
    got = run_docbeam(folder, tmp_path, texts, batching=PACKED_BATCHING)
    want = SentenceTransformer(folder, device="cpu").encode_document(list(texts.values()))
    assert lowest_cosine(np.stack([got[k] for k in texts]), want) >= MIN_COSINE
    assert np.allclose(np.linalg.norm(want, axis=1), 1.0, atol=1e-5)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
