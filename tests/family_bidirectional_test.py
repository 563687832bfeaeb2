"""Decoders read both ways (pplx-embed, llama-embed-nemotron): Qwen3, Qwen2, Llama and Mistral checkpoints whose
config.json says ``use_bidirectional_attention: true`` (or ``is_causal: false``, or NVIDIA's ``model_type:
llama_bidirec`` with Llama 3's RoPE scaling) against transformers' own Qwen3Model / Qwen2Model / LlamaModel /
MistralModel handed transformers' bidirectional padding mask, as those checkpoints' code does. Every layer attends
over its whole window (packed rows: its own window) on every backend, mean-pooled when no Pooling module says
otherwise; without the flag a decoder stays causal and last-token pooled (and a causal Mistral keeps its sliding
window). What docbeam does not run (voyage-4-nano's output projection, contradicting flags) is refused."""

from __future__ import annotations

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    MIN_COSINE,
    assert_close_to_transformers,
    assert_matches_transformers,
    assert_moves_output,
    assert_native_run_matches,
    assert_openvino_matches_xla,
    assert_refused,
    backends_for,
    lowest_cosine,
    our_vectors,
    reference_vectors,
    replace,
    save_checkpoint,
    spread_norms_and_biases,
    tiny_model,
    token_inputs,
)

from docbeam.models import checkpoint

CLASSES = {"qwen3": "Qwen3Model", "qwen2": "Qwen2Model", "llama": "LlamaModel", "mistral": "MistralModel"}
FLAGS = {"use_bidirectional_attention": True, "is_causal": False}  # transformers' flag, and the other spelling


def random_decoder(kind: str, sliding_window: int | None = None):
    """A tiny random decoder of transformers' own class: 4 query heads over 2 key/value heads of 16, weights and
    RMSNorm scales drawn with std 0.3 so every feature moves the output. Mistral without a sliding window unless
    one is given."""
    extra = {"head_dim": 16} if kind == "qwen3" else {"sliding_window": sliding_window} if kind == "mistral" else {}
    model = tiny_model(
        CLASSES[kind],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        rope_theta=1000.0,
        attn_implementation="eager",
        **extra,
    )
    return spread_norms_and_biases(model)


class Bidirectional:
    """transformers' decoder called as its bidirectional embedders call it: a 2-D padding mask becomes
    transformers' bidirectional 4-D mask (every valid key, none after the padding), which the model uses as is."""

    def __init__(self, decoder):
        self.decoder = decoder

    def __call__(self, input_ids, attention_mask):
        import torch
        from transformers.masking_utils import create_bidirectional_mask

        embeds = self.decoder.embed_tokens(input_ids)
        mask = create_bidirectional_mask(
            config=self.decoder.config, inputs_embeds=embeds, attention_mask=attention_mask
        )
        if mask is None:  # no padding: transformers skips the mask, and the decoder would then build a causal one
            mask = torch.zeros((input_ids.shape[0], 1, input_ids.shape[1], input_ids.shape[1]))
        return self.decoder(input_ids=input_ids, attention_mask=mask)


def flagged(flag: str):
    return lambda config: {**config, flag: FLAGS[flag]}


@pytest.fixture(scope="module", params=list(CLASSES))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def decoder(kind):
    return random_decoder(kind)


@pytest.fixture(scope="module")
def model(decoder):
    return Bidirectional(decoder)


@pytest.fixture(scope="module")
def folder(decoder, kind, tmp_path_factory):
    return save_checkpoint(
        decoder,
        str(tmp_path_factory.mktemp(f"{kind}-bidirectional")),
        config_rewrite=flagged("use_bidirectional_attention"),
    )


@pytest.mark.parametrize("flag", list(FLAGS))
def test_the_flag_reads_as_a_non_causal_mean_pooled_decoder(decoder, kind, flag, tmp_path):
    ck = checkpoint.open_checkpoint(save_checkpoint(decoder, str(tmp_path), config_rewrite=flagged(flag)))
    config = ck.config
    assert (config.causal, config.num_heads, config.kv_heads, config.head_dim) == (False, 4, 2, 16)
    assert (config.qk_norm, config.qkv_bias, config.out_bias) == {
        "qwen3": (True, False, False),
        "qwen2": (False, True, False),
    }.get(kind, (False,) * 3)
    assert [f.describe() for f in config.attention_features] == ["global"]
    assert ck.settings.pooling == "mean"  # no Pooling module: a bidirectional model's default


def test_the_plan_asks_every_backend_about_non_causal_attention(folder):
    from docbeam.models.encoder import attention_cases

    config = checkpoint.open_checkpoint(folder).config
    cases = attention_cases(config, [16, 64], "cpu", packed=True)
    assert [(c.causal, c.num_heads, c.kv_heads) for c in cases] == [(False, 4, 2)] * 2


@pytest.mark.parametrize("packed", [False, True])
def test_vectors_match_transformers_bidirectional(model, folder, packed):
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_scans_the_key_blocks_past_the_diagonal(model, folder, packed):
    """Chunks smaller than the rows: a causal layer would skip the key blocks after each query chunk; these
    layers must not."""
    assert_close_to_transformers(
        model, folder, packed=packed, backend="chunked", options={"query_chunk": 8, "key_chunk": 8}
    )


def swapped_kv_heads(native):
    """Query heads 0-1 read key/value head 1 and 2-3 head 0: the grouping the other way round."""
    return lambda q, k, v, **kwargs: native(q, k[:, :, ::-1], v[:, :, ::-1], **kwargs)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(change=replace(causal=True)), id="read-causally"),
        pytest.param(dict(pooling="lasttoken"), id="last-token-pooled"),
        pytest.param(dict(attend=swapped_kv_heads), id="kv-heads-swapped"),
        pytest.param(dict(change=replace(rope_theta=10_000.0)), id="theta-10000"),
    ],
)
def test_each_feature_moves_the_output(model, folder, packed, broken):
    assert_moves_output(model, folder, packed=packed, **broken)


def test_without_the_flag_a_decoder_stays_causal_and_last_token_pooled(decoder, kind, tmp_path):
    ck = checkpoint.open_checkpoint(save_checkpoint(decoder, str(tmp_path)))
    assert (ck.config.causal, ck.settings.pooling) == (True, "lasttoken")
    ids, lengths = token_inputs(LENGTHS)
    for packed in (False, True):
        ours = our_vectors(ck.folder, ids, lengths, packed=packed, pooling="lasttoken")
        assert lowest_cosine(ours, reference_vectors(decoder, ids, lengths, "lasttoken")) >= MIN_COSINE


@pytest.mark.parametrize(
    "rewrite, match",
    [
        pytest.param(
            {"use_bidirectional_attention": True, "is_causal": True},
            "use_bidirectional_attention: True and is_causal: True, which contradict",
            id="contradicting-flags",
        ),
        pytest.param({"is_causal": "no"}, "is_causal: 'no'; supported: true, false", id="not-a-bool"),
    ],
)
def test_flags_docbeam_cannot_read_are_refused(decoder, tmp_path, rewrite, match):
    assert_refused(decoder, str(tmp_path), lambda c: {**c, **rewrite}, match)


@pytest.mark.parametrize("packed", [False, True])
def test_a_causal_mistral_sliding_window_matches_transformers(tmp_path, packed):
    """Mistral's window: each query sees itself and the 7 tokens before it (windows here run to 64 tokens)."""
    mistral = random_decoder("mistral", sliding_window=8)
    folder = save_checkpoint(mistral, str(tmp_path))
    config = checkpoint.open_checkpoint(folder).config
    assert [f.describe() for f in config.attention_features] == ["local window (7, 0), causal"]
    ids, lengths = token_inputs(LENGTHS)
    want = reference_vectors(mistral, ids, lengths, "lasttoken")
    backends = backends_for(config.attention_features, packed)
    assert backends == ["native", "chunked", "flash"]
    for backend in backends:
        ours = our_vectors(folder, ids, lengths, backend=backend, packed=packed, pooling="lasttoken")
        assert lowest_cosine(ours, want) >= MIN_COSINE, backend
    for window in (None, 4):
        assert_moves_output(
            mistral, folder, family_pooling="lasttoken", packed=packed, change=replace(sliding_window=window)
        )


def test_a_bidirectional_mistral_sliding_window_is_refused(tmp_path):
    assert_refused(
        random_decoder("mistral"),
        str(tmp_path),
        lambda c: {**flagged("is_causal")(c), "sliding_window": 4096},
        "sliding_window: 4096 on a bidirectional Mistral",
    )


@pytest.mark.parametrize(
    "rewrite, match",
    [
        pytest.param({"mlp_bias": True}, "mlp_bias: True", id="mlp-bias"),
        pytest.param(
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0}},
            "llama3 RoPE scaling without all of",
            id="llama3-rope-incomplete",
        ),
        pytest.param(
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0}},
            "RoPE scaling docbeam does not reproduce",
            id="yarn-rope",
        ),
        pytest.param({"model_type": "llama_bidirec", "pooling": "last"}, "pooling: 'last'", id="nemotron-last-pooled"),
    ],
)
def test_llama_options_docbeam_does_not_run_are_refused(tmp_path, rewrite, match):
    assert_refused(random_decoder("llama"), str(tmp_path), lambda c: {**c, **rewrite}, match)


def test_an_output_projection_after_the_decoder_is_refused(decoder, tmp_path):
    """voyage-4-nano's form: ``num_labels`` and a root ``linear.weight`` projecting each hidden state."""
    folder = save_checkpoint(
        decoder,
        str(tmp_path),
        config_rewrite=lambda c: {**flagged("is_causal")(c), "num_labels": 8},
        tensor_rename=lambda t: {**t, "linear.weight": np.zeros((8, 64), np.float32)},
    )
    with pytest.raises(checkpoint.CheckpointError, match="'linear.weight'.*does not run"):
        checkpoint.open_checkpoint(folder)  # at start: the header is held against the family's reads


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 1000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # wavelengths 6-2,600 cross 16 and 64


def llama3_decoder():
    """A Llama with Llama 3's RoPE scaling, whose bands (wavelengths below 16, 16-64, above 64) all hold some of
    its 8 frequencies."""
    decoder = random_decoder("llama")
    import transformers

    config = transformers.LlamaConfig(**{**decoder.config.to_dict(), "rope_parameters": LLAMA3_ROPE})
    scaled = type(decoder)(config).eval()
    scaled.load_state_dict(decoder.state_dict())
    return scaled


@pytest.mark.parametrize("packed", [False, True])
def test_nvidia_llama_bidirec_with_llama3_rope_matches_transformers(tmp_path, packed):
    """llama-embed-nemotron's form: ``model_type: llama_bidirec`` (NVIDIA's LlamaBidirectionalModel, a LlamaModel
    with a padding-only mask), ``pooling: avg``, Llama 3's RoPE scaling."""
    decoder = llama3_decoder()
    folder = save_checkpoint(
        decoder,
        str(tmp_path),
        config_rewrite=lambda c: {
            **c,
            "model_type": "llama_bidirec",
            "pooling": "avg",
            "architectures": ["LlamaBidirectionalModel"],
        },
    )
    ck = checkpoint.open_checkpoint(folder)
    assert (ck.config.causal, ck.config.rope_bands, ck.settings.pooling) == (False, (8.0, 1.0, 4.0, 64.0), "mean")
    assert assert_matches_transformers(Bidirectional(decoder), folder, LENGTHS, packed) == [
        "native",
        "chunked",
        "flash",
    ]
    assert_moves_output(Bidirectional(decoder), folder, packed=packed, change=replace(rope_bands=None))


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_docbeam_run_gives_transformers_bidirectional_vectors(tmp_path, packing):
    """One whole run, on Qwen3 (the other kinds' vectors are checked above, without a whole run)."""
    decoder = random_decoder("qwen3")
    folder = save_checkpoint(decoder, str(tmp_path / "qwen3"), config_rewrite=flagged("use_bidirectional_attention"))
    texts = {"short": "A short note.", "long": " ".join(["Every token here sees every other one."] * 8)}
    assert_native_run_matches(Bidirectional(decoder), folder, tmp_path, texts, packing)


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
