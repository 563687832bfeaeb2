"""Qwen3 (and Qwen2) against transformers' Qwen3Model / Qwen2Model: a decoder with causal, grouped-query attention
(4 query heads over 2 key/value heads of 16), per-head q/k RMSNorm, SwiGLU, no biases, pooled at the last valid
token of each window, right-padded and packed. Checkpoints in transformers 5's config form and the Hub's
(``rope_theta``, ``torch_dtype``, tensors under ``model.``), with a tokenizer of our own that, like Qwen3's,
appends ``<|endoftext|>`` and prepends nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    MIN_COSINE,
    PACKED_BATCHING,
    assert_docbeam_run_matches,
    assert_moves_output,
    assert_openvino_matches_xla,
    lowest_cosine,
    our_vectors,
    reference_vectors,
    replace,
    spread_norms_and_biases,
)

from docbeam import attention
from docbeam.config import TokenizeConfig
from docbeam.models import checkpoint
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.tokenize import tokenize_documents

LAST = "lasttoken"  # how Qwen3-Embedding pools: the last valid token, the one that has seen the whole window
WORDS = 254  # w1 … w254 are ids 1 … 254
UNK, EOS = 0, 255
VOCAB = 256


def write_tokenizer(folder: str) -> None:
    """A word-level tokenizer whose post-processor appends ``<|endoftext|>`` (Qwen3's template) and prepends
    nothing, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": UNK, **{f"w{i}": i for i in range(1, WORDS + 1)}, "<|endoftext|>": EOS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", EOS)]
    )
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
            },
            f,
        )


def random_decoder(kind: str):
    """A tiny random Qwen3Model / Qwen2Model, weights large enough (std 0.3) that each feature moves the output;
    the RMSNorm scales, which transformers initialises to ones, drawn around one so the mapping of each shows."""
    import torch
    import transformers

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        initializer_range=0.3,
        rope_theta=1000.0,
        attn_implementation="eager",
    )
    if kind == "qwen3":
        model = transformers.Qwen3Model(transformers.Qwen3Config(head_dim=16, **shape))
    else:
        model = transformers.Qwen2Model(transformers.Qwen2Config(**shape))
    return spread_norms_and_biases(model).eval()


@pytest.fixture(scope="module")
def model():
    return random_decoder("qwen3")


def hub_form(folder: str) -> None:
    """Qwen3-Embedding's config.json keys (transformers 4.51): rope_theta, torch_dtype, no layer_types; the
    tensors as Qwen3ForCausalLM names them."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    theta = config.pop("rope_parameters")["rope_theta"]
    for key in ("layer_types", "dtype"):
        config.pop(key)
    config.update(rope_theta=theta, rope_scaling=None, torch_dtype="float32", architectures=["Qwen3ForCausalLM"])
    with open(path, "w") as f:
        json.dump(config, f)
    tensors = os.path.join(folder, "model.safetensors")
    save_file({f"model.{name}": value for name, value in load_file(tensors).items()}, tensors)


def save(model, folder: str, hub: bool = False) -> str:
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    if hub:
        hub_form(folder)
    return folder


@pytest.fixture(scope="module", params=["transformers5", "hub"])
def folder(request, model, tmp_path_factory):
    return save(model, str(tmp_path_factory.mktemp(f"qwen3-{request.param}")), hub=request.param == "hub")


def token_inputs(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Windows as the tokenizer makes them: word ids, then ``<|endoftext|>``; right-padded with 0."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n] = [*rng.integers(1, WORDS + 1, n - 1), EOS]
    return ids, np.asarray(lengths, np.int32)


def last_token_vectors(folder: str, ids, lengths, **how) -> np.ndarray:
    """Ours (family_fixtures.our_vectors: ``how`` picks backend, options, packing, a change), pooled as
    Qwen3-Embedding pools."""
    return our_vectors(folder, ids, lengths, pooling=LAST, **how)


def test_both_forms_read_as_the_same_decoder(folder):
    ck = checkpoint.open_checkpoint(folder)
    config = ck.config
    assert (
        config.hidden_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.rope_theta,
        config.qk_norm,
        config.qkv_bias,
    ) == (64, 2, 4, 2, 16, 1000.0, True, False)
    assert [f.describe() for f in config.attention_features] == ["global, causal"]
    assert ck.settings.pooling == "lasttoken"  # no Pooling module: a causal model's default


def test_the_plan_asks_backends_about_grouped_causal_attention(folder):
    from docbeam.models.encoder import attention_cases

    config = checkpoint.open_checkpoint(folder).config
    (case,) = attention_cases(config, [64], "cpu", packed=True)
    assert (case.num_heads, case.kv_heads, case.head_dim) == (4, 2, 16)
    for features in config.attention_features:
        assert attention.get("native").refusal(case.with_features(features)) is None


@pytest.mark.parametrize("implementation", ["einsum", "jax_nn"])  # native's CPU form and the one off CPU
@pytest.mark.parametrize("packed", [False, True])
def test_last_token_vectors_match_transformers(model, folder, packed, implementation):
    ids, lengths = token_inputs(LENGTHS)
    ours = last_token_vectors(folder, ids, lengths, packed=packed, options={"implementation": implementation})
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths, LAST)) >= MIN_COSINE


@pytest.mark.parametrize(
    "options",
    [{}, {"query_chunk": 8, "key_chunk": 8}, {"query_chunk": 16, "key_chunk": 8, "heads_per_step": 1}],
    ids=["tuned", "small-chunks", "one-kv-group-per-step"],
)
@pytest.mark.parametrize("packed", [False, True])
def test_last_token_vectors_match_transformers_on_chunked(model, folder, packed, options):
    """chunked skips the key blocks past each query chunk's diagonal and reads each k/v head for its query heads:
    with chunks smaller than the rows, both are exercised, packed windows included."""
    ids, lengths = token_inputs(LENGTHS)
    ours = last_token_vectors(folder, ids, lengths, packed=packed, backend="chunked", options=options)
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths, LAST)) >= MIN_COSINE


@pytest.mark.parametrize("options", [{}, {"kernel": "tokamax_chunked"}], ids=["auto", "tokamax"])
@pytest.mark.parametrize("packed", [False, True])
def test_last_token_vectors_match_transformers_on_flash(model, folder, packed, options):
    ids, lengths = token_inputs(LENGTHS)
    ours = last_token_vectors(folder, ids, lengths, packed=packed, backend="flash", options=options)
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths, LAST)) >= MIN_COSINE


def without_causality(native):
    return lambda *args, **kwargs: native(*args, **{**kwargs, "causal": False})


def swapped_kv_heads(native):
    """Query heads 0-1 read key/value head 1 and 2-3 head 0: the grouping the other way round."""
    return lambda q, k, v, **kwargs: native(q, k[:, :, ::-1], v[:, :, ::-1], **kwargs)


def repeated_kv_heads(native):
    """k/v repeated to one head per query head, as transformers' repeat_kv does: the same attention."""
    return lambda q, k, v, **kwargs: native(q, *(x.repeat(q.shape[2] // x.shape[2], axis=2) for x in (k, v)), **kwargs)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(attend=without_causality), id="not-causal"),
        pytest.param(dict(attend=swapped_kv_heads), id="kv-heads-swapped"),
        pytest.param(dict(pooling="cls"), id="first-token-pooled"),
        pytest.param(dict(pooling="mean"), id="mean-pooled"),
        pytest.param(dict(change=replace(qk_norm=False)), id="no-qk-norm"),
        pytest.param(dict(change=replace(rope_theta=10_000.0)), id="theta-10000"),
    ],
)
def test_each_feature_moves_the_output(model, folder, packed, broken):
    assert_moves_output(model, folder, family_pooling=LAST, inputs=token_inputs(LENGTHS), packed=packed, **broken)


def test_bfloat16_stays_close_to_transformers(model, folder):
    ids, lengths = token_inputs(LENGTHS)
    ours = last_token_vectors(folder, ids, lengths, packed=True, change=replace(dtype="bfloat16"))
    assert lowest_cosine(ours, reference_vectors(model, ids, lengths, LAST)) >= 0.99


def test_repeating_kv_heads_per_query_head_changes_nothing(model, folder):
    """The grouping itself, checked the other way: native on K heads equals native on K heads repeated."""
    ids, lengths = token_inputs(LENGTHS)
    assert (
        lowest_cosine(
            last_token_vectors(folder, ids, lengths, attend=repeated_kv_heads),
            reference_vectors(model, ids, lengths, LAST),
        )
        >= MIN_COSINE
    )


def test_qwen2_biased_qkv_without_qk_norm_matches_transformers(tmp_path):
    qwen2 = random_decoder("qwen2")
    folder = save(qwen2, str(tmp_path))
    config = checkpoint.open_checkpoint(folder).config
    assert (config.qk_norm, config.qkv_bias, config.out_bias, config.head_dim) == (False, True, False, 16)
    ids, lengths = token_inputs(LENGTHS)
    want = reference_vectors(qwen2, ids, lengths, LAST)
    for packed in (False, True):
        assert lowest_cosine(last_token_vectors(folder, ids, lengths, packed=packed), want) >= MIN_COSINE
    assert_moves_output(qwen2, folder, family_pooling=LAST, inputs=(ids, lengths), change=replace(qkv_bias=False))


def test_sliding_window_layers_are_refused(tmp_path, model):
    folder = save(model, str(tmp_path))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "use_sliding_window": True}, f)
    with pytest.raises(checkpoint.CheckpointError, match="use_sliding_window: True.*sliding-window"):
        checkpoint.open_checkpoint(folder)


def test_every_window_of_a_long_document_ends_with_endoftext(tmp_path):
    write_tokenizer(str(tmp_path))
    tokenizer = checkpoint.load_tokenizer(str(tmp_path))
    assert tokenizer.num_special_tokens_to_add() == 1
    text = " ".join(f"w{i % WORDS + 1}" for i in range(50))
    windows, _ = tokenize_documents(
        [Document("d", text, "docs.jsonl", 1)], tokenizer, window_len=16, config=TokenizeConfig(stride=4)
    )
    assert len(windows) == 5  # 15 content tokens each, 4 shared with the previous: 15 + 4 · 11 ≥ 50
    assert all(int(w.token_ids[-1]) == EOS and EOS not in w.token_ids[:-1].tolist() for w in windows)
    assert all(int(w.token_ids[0]) != EOS for w in windows)  # nothing prepended
    assert windows[0].doc_tokens == 50
    content = [w.token_ids[:-1].tolist() for w in windows]
    assert content[1][:4] == content[0][-4:]  # the stride overlaps content, not the appended token


def test_transformers_reads_the_test_tokenizer_as_docbeam_does(tmp_path):
    """The tokenizer files are a real checkpoint's: transformers' AutoTokenizer appends the same token."""
    from transformers import AutoTokenizer

    write_tokenizer(str(tmp_path))
    text = "w3 w14 w15 w92 unknown"
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"]
    assert checkpoint.load_tokenizer(str(tmp_path))(text)["input_ids"] == theirs == [3, 14, 15, 92, UNK, EOS]


@pytest.mark.slow
@pytest.mark.extra_for(folder="hub")  # the Hub form's vectors are checked above, without a whole run
@pytest.mark.parametrize("packing", [False, True])
def test_docbeam_run_gives_transformers_last_token_vectors(model, folder, tmp_path, packing):
    texts = {"a": "w5 w9 w200", "b": " ".join(f"w{i % WORDS + 1}" for i in range(0, 700, 7)), "c": "w17 " * 30}
    tokens = assert_docbeam_run_matches(
        model,
        folder,
        tmp_path,
        texts,
        LAST,
        attention={"backend": "native"},
        batching={**PACKED_BATCHING, "packing": packing},
    )
    assert all(ids[0, -1] == EOS for ids in tokens.values())


def test_openvino_runs_the_family_at_xla_parity(folder, tmp_path):
    assert_openvino_matches_xla(folder, str(tmp_path))
