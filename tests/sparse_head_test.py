"""The sparse head's forward (models/heads/sparse.py): a SparseEncoder checkpoint (MLMTransformer + SpladePooling)
saved by sentence-transformers' own classes gives docbeam the vectors of ``SparseEncoder.encode_document``, for
BERT, DistilBERT and ModernBERT, max and sum pooling, native and chunked, packed and unpacked; a head broken on
purpose no longer does; the vocabulary-wide logits never exist whole; and what docbeam does not reproduce is
refused at start. Rows and runs: sparse_run_test.py."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from engine_fixtures import assert_openvino_writes_what_xla_writes, first_windows
from family_fixtures import head_forward, save_checkpoint, spread_norms_and_biases, tiny_model

from docbeam import attention
from docbeam.config import ModelConfig
from docbeam.models import checkpoint, encoder
from docbeam.models.heads.registry import resolve
from docbeam.models.heads.sparse import prune

MIN_COSINE = 0.99999  # the bar, float32
WINDOW = 64
TEXTS = {
    f"d{i}": " ".join(f"{w}{i % 4}" for w in ["river", "bank", "loan", "tide", "quay", "fund"] * (1 + 2 * i))
    for i in range(8)
}  # 7 to 88 words: the longest are cut at the window, as SparseEncoder truncates
FAMILIES = {  # transformers' masked-LM class, its config, the output bias's tensor (negative: most terms zero)
    "bert": ("BertForMaskedLM", dict(num_hidden_layers=2, intermediate_size=64), "cls.predictions.bias"),
    "distilbert": (
        "DistilBertForMaskedLM",
        dict(n_layers=2, hidden_dim=48, max_position_embeddings=128),
        "vocab_projector.bias",
    ),
    "modernbert": (
        "ModernBertForMaskedLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=48,
            local_attention=8,
            global_attn_every_n_layers=2,
            global_rope_theta=160_000.0,
            local_rope_theta=10_000.0,
            pad_token_id=0,
            bos_token_id=101,
            cls_token_id=101,
            eos_token_id=102,
            sep_token_id=102,
            attn_implementation="eager",
        ),
        "decoder.bias",
    ),
}


def sparse_checkpoint(
    folder: str, family: str, pooling: str = "max", activation: str = "relu", fill_mask_transformer: bool = False
) -> str:
    """A random masked-LM (std 0.3, norms and biases spread, the output bias around -6 so most terms are zero)
    saved by SparseEncoder.save."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    model_class, settings, bias = FAMILIES[family]
    model = spread_norms_and_biases(tiny_model(model_class, **settings))  # a norm mapped wrong shows
    with torch.no_grad():
        model.get_parameter(bias).normal_(-6.0, 0.5)
    save_checkpoint(model, f"{folder}/mlm")
    os.remove(f"{folder}/mlm/sentence_bert_config.json")
    if fill_mask_transformer:  # sentence-transformers 6's spelling of MLMTransformer
        from sentence_transformers.base.modules import Transformer

        mlm = Transformer(f"{folder}/mlm", transformer_task="fill-mask", max_seq_length=WINDOW)
    else:
        mlm = MLMTransformer(f"{folder}/mlm", max_seq_length=WINDOW)
    sparse = SparseEncoder(modules=[mlm, SpladePooling(pooling, activation_function=activation)], device="cpu")
    sparse.save(f"{folder}/st")
    return f"{folder}/st"


@pytest.fixture(
    scope="module",
    params=[("bert", "max"), ("bert", "sum"), ("distilbert", "max"), ("modernbert", "max")],
    ids=lambda fp: "-".join(fp),
)
def splade(request, tmp_path_factory):
    family, pooling = request.param
    return sparse_checkpoint(str(tmp_path_factory.mktemp(f"{family}-{pooling}")), family, pooling)


def reference_vectors(folder: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(folder, device="cpu")
    return model.encode_document(texts, convert_to_tensor=True).to_dense().numpy().astype(np.float64)


def our_vectors(
    folder: str,
    texts: list[str],
    *,
    backend: str = "native",
    packed: bool = False,
    change=lambda head: head,
    block: int | None = None,
    choice: str = "auto",
) -> np.ndarray:
    """docbeam's forward on each text's first window (``change`` edits the resolved head: a test breaking it)."""
    head = change(resolve(checkpoint.open_checkpoint(folder), choice, ModelConfig(path=folder)))
    if block is not None:
        head = dataclasses.replace(head, block=block)
    return head_forward(folder, head, texts, WINDOW, backend=backend, packed=packed)


def assert_same_sparse_vectors(ours: np.ndarray, reference: np.ndarray, what) -> None:
    for a, b in zip(ours, reference, strict=True):
        assert np.array_equal(np.flatnonzero(a), np.flatnonzero(b)), what
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= MIN_COSINE, what


def test_vectors_are_sparse_encoders_on_native_and_chunked_packed_and_unpacked(splade):
    texts = list(TEXTS.values())
    reference = reference_vectors(splade, texts)
    assert 0 < (reference > 0).sum(1).max() < reference.shape[1] // 4  # sparse, yet not empty
    for backend in ("native", "chunked"):
        for packed in (False, True):
            assert_same_sparse_vectors(
                our_vectors(splade, texts, backend=backend, packed=packed), reference, (backend, packed)
            )


def test_the_vocabulary_blocks_do_not_change_the_vectors(splade):
    """A vocabulary (30522) that is no multiple of the block: padded columns are cut off, not written."""
    texts = list(TEXTS.values())[:3]
    blocked, whole = our_vectors(splade, texts, block=1000), our_vectors(splade, texts)
    assert np.array_equal(np.flatnonzero(blocked), np.flatnonzero(whole))
    assert np.abs(blocked - whole).max() < 1e-5  # another matmul tiling: a logit near 0 moves in its last bits


def test_log1p_relu_and_a_fill_mask_transformer_are_sparse_encoders(tmp_path):
    folder = sparse_checkpoint(str(tmp_path), "bert", "max", "log1p_relu", fill_mask_transformer=True)
    texts = list(TEXTS.values())
    assert_same_sparse_vectors(our_vectors(folder, texts), reference_vectors(folder, texts), "log1p_relu")


def test_model_head_sparse_on_a_bare_masked_lm_is_what_sparse_encoder_builds_for_it(tmp_path):
    """No sentence-transformers files: SparseEncoder wraps a fill-mask model in MLMTransformer + SpladePooling
    (max, relu), and so does model.head: sparse."""
    bare = os.path.dirname(sparse_checkpoint(str(tmp_path), "bert")) + "/mlm"
    texts = list(TEXTS.values())[:3]  # within the window: SparseEncoder reads the bare folder's 512 tokens
    assert_same_sparse_vectors(our_vectors(bare, texts, choice="sparse"), reference_vectors(bare, texts), "bare")


def test_a_broken_head_is_no_longer_sparse_encoders(tmp_path):
    """Each part moves the vectors: the transform's activation, the max/sum pooling, the log1p."""
    folder = sparse_checkpoint(str(tmp_path), "bert", "max")
    texts = list(TEXTS.values())
    reference = reference_vectors(folder, texts)

    def moved(change) -> float:
        ours = our_vectors(folder, texts, change=change)
        return float(np.abs(ours - reference).max() / np.abs(reference).max())

    assert (
        moved(
            lambda head: dataclasses.replace(
                head, layers=(dataclasses.replace(head.layers[0], activation="relu"), *head.layers[1:])
            )
        )
        > 1e-3
    )
    assert moved(lambda head: dataclasses.replace(head, pooling="sum")) > 1e-3
    assert moved(lambda head: dataclasses.replace(head, activation="log1p_relu")) > 1e-3


def test_the_forwards_largest_buffer_does_not_grow_with_vocabulary_times_tokens(splade):
    """XLA's memory analysis of the compiled forward at two vocabulary sizes: its temporaries grow by the
    [rows, vocabulary] output and the decoder, not by [rows, tokens, vocabulary] logits."""
    ck = checkpoint.open_checkpoint(splade)
    head = resolve(ck, "auto", ModelConfig(path=splade))
    attend = attention.get("native").bind(attention.get("native").parse_options(None))
    rows, tokens, dim = 8, 256, ck.config.hidden_size

    def temp_bytes(vocab: int) -> int:
        small = dataclasses.replace(head, width=vocab)
        forward = jax.jit(encoder.embed_fn(ck.config, attend, small.pooling, small.layers, small.reduce))
        encoder_params = jax.eval_shape(lambda: checkpoint.load_params(ck.folder, ck.config))
        blocks = -(-vocab // small.block)
        head_params = (
            *[
                {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in p.items()}
                for p in head.load_params(ck.folder)[:-1]
            ],
            {
                "kernel": jax.ShapeDtypeStruct((blocks, small.block, dim), np.float32),
                "bias": jax.ShapeDtypeStruct((blocks, small.block), np.float32),
            },
        )
        compiled = forward.lower(
            {"encoder": encoder_params, "head": head_params},
            jax.ShapeDtypeStruct((rows, tokens), np.int32),
            jax.ShapeDtypeStruct((rows,), np.int32),
        ).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    grown = temp_bytes(16 * 4096) - temp_bytes(4 * 4096)
    whole_logits = rows * tokens * 12 * 4096 * 4  # what [rows, tokens, vocab] float32 logits would add
    assert grown < whole_logits / 16, (grown, whole_logits)


def test_pruning_keeps_the_largest_terms_above_the_threshold_in_ascending_order():
    vector = np.array([0.0, 0.5, 0.2, 0.9, 0.0, 0.5, 0.1], np.float32)
    assert [a.tolist() for a in prune(vector, None, None)] == [[1, 2, 3, 5, 6], vector[[1, 2, 3, 5, 6]].tolist()]
    assert prune(vector, 0.2, None)[0].tolist() == [1, 2, 3, 5]
    assert prune(vector, None, 2)[0].tolist() == [1, 3]  # 0.9, then the tie 0.5 at the lower token id
    assert prune(vector, 0.3, 5)[0].tolist() == [1, 3, 5]


def rewrite(folder: str, name: str, change) -> None:
    path = os.path.join(folder, name)
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump(change(content), f)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            (
                "modules.json",
                lambda m: [
                    *m,
                    {
                        "idx": 2,
                        "name": "2",
                        "path": "2_Idf",
                        "type": "sentence_transformers.sparse_encoder.modules.SparseStaticEmbedding",
                    },
                ],
            ),
            "SparseStaticEmbedding.*inference-free SPLADE's per-token IDF",
        ),
        (
            ("1_SpladePooling/config.json", lambda c: {**c, "pooling_strategy": "mean"}),
            r"1_SpladePooling/config.json sets pooling_strategy: \"mean\"",
        ),
        (
            ("config_sentence_transformers.json", lambda c: {**c, "model_type": "SentenceTransformer"}),
            "model_type: 'SentenceTransformer', but its modules.json makes a SparseEncoder",
        ),
        (
            ("config_sentence_transformers.json", lambda c: {**c, "max_active_dims": 64}),
            "config_sentence_transformers.json sets max_active_dims: 64, which docbeam does not honour",
        ),
        (
            ("config.json", lambda c: {**c, "architectures": ["BertModel"]}),
            r"architectures: \[\"BertModel\"\]; docbeam runs SPLADE on the masked-LM head of BertForMaskedLM",
        ),
    ],
)
def test_what_docbeam_does_not_reproduce_is_refused_naming_it(tmp_path, edit, match):
    folder = sparse_checkpoint(str(tmp_path), "bert")
    rewrite(folder, *edit)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_splades_max_over_tokens_runs_on_openvino_at_xlas_vectors(splade, packed):
    """Exported with its vocabulary blocks unrolled (a lax.map exports as an ONNX Loop OpenVINO does not convert)."""
    head = resolve(checkpoint.open_checkpoint(splade), "auto", ModelConfig(path=splade))
    batch = first_windows(splade, list(TEXTS.values()), WINDOW, packed)
    assert_openvino_writes_what_xla_writes(splade, head, [batch], packed)


def test_the_unrolled_vocabulary_blocks_are_the_mapped_ones(splade):
    head = resolve(checkpoint.open_checkpoint(splade), "auto", ModelConfig(path=splade))
    texts = list(TEXTS.values())
    mapped = head_forward(splade, dataclasses.replace(head, block=8192), texts, WINDOW, packed=True)
    unrolled = head_forward(splade, dataclasses.replace(head, block=8192).for_export(), texts, WINDOW, packed=True)
    np.testing.assert_allclose(unrolled, mapped, rtol=1e-6, atol=1e-6)
