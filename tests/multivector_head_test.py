"""The multi-vector head (models/heads/multivector.py): a sentence-transformers MultiVectorEncoder checkpoint's
per-token document vectors are ``encode_document``'s (each token's cosine ≥ 0.99999, the same kept tokens in the
same order) on native and chunked attention, packed and unpacked, and in a whole ``docbeam run``; breaking the
projection, the normalisation or the skiplist moves them; what docbeam does not reproduce is refused at start."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import string

import engine_fixtures
import jax
import numpy as np
import pytest
from engine_fixtures import assert_openvino_writes_what_xla_writes
from family_fixtures import MIN_COSINE, save_checkpoint, tiny_model

from docbeam import attention
from docbeam.config import ModelConfig
from docbeam.models import checkpoint, encoder
from docbeam.models.heads.registry import resolve
from docbeam.pipeline.records import Batch

WINDOW = 48
PROJECTED = 16
TEXTS = [
    f"The {w}, by the river's bank: a loan (or two) for {w}! Is it {i}?" * (1 + i)
    for i, w in enumerate(["tide", "quay", "fund", "ledger", "harbour", "ferry"])
]  # some cut at the window


def mve_checkpoint(
    folder: str, *, skiplist=tuple(string.punctuation), normalize: bool = True, prompts: dict | None = None
) -> str:
    """A random BERT (weights std 0.3) as sentence-transformers' own MultiVectorEncoder: Transformer, a Dense
    projection 32 → 16 (std 0.3), MultiVectorMask, Normalize, saved with ``.save()``."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    bert = save_checkpoint(tiny_model("BertModel", num_hidden_layers=2, intermediate_size=64), folder + "-bert")
    dense = Dense(
        32,
        PROJECTED,
        bias=True,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
        module_output_name="token_embeddings",
    )
    with torch.no_grad():
        dense.linear.weight.normal_(0.0, 0.3)
        dense.linear.bias.normal_(0.0, 0.3)
    modules = [Transformer(bert, max_seq_length=WINDOW), dense, MultiVectorMask(skiplist_words=list(skiplist))]
    MultiVectorEncoder(
        modules=modules + ([Normalize(module_input_name="token_embeddings")] if normalize else []), prompts=prompts
    ).save(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return mve_checkpoint(str(tmp_path_factory.mktemp("mve") / "model"))


def reference(folder: str, texts: list[str]) -> list[np.ndarray]:
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(folder, device="cpu")
    return [np.asarray(v, np.float64) for v in model.encode_document(texts, convert_to_numpy=True)]


def ours(
    folder: str, texts: list[str], *, backend: str = "native", packed: bool = False, change=lambda head: head
) -> list[np.ndarray]:
    """docbeam's forward and the head's window cut on each text's first window (``change`` edits the head)."""
    ck = checkpoint.open_checkpoint(folder, with_weights=True)
    head = change(resolve(ck, "auto", ModelConfig(path=folder)))
    params = checkpoint.load_params(ck.folder, ck.config)
    params = {"encoder": params, "head": head.load_params(ck.folder)} if head.layers else params
    attend = attention.get(backend).bind(attention.get(backend).parse_options(None))
    forward = jax.jit(encoder.embed_fn(ck.config, attend, head.pooling, head.layers))
    batch = first_windows(ck.folder, texts, packed)
    out = forward(
        params, batch.ids_BxT, batch.lengths_B, *((batch.segment_ids_BxT, batch.slot_lengths_BxK) if packed else ())
    )
    return [np.asarray(v, np.float64) for v in head.window_vectors(np.asarray(out), batch)]


def first_windows(folder: str, texts: list[str], packed: bool) -> Batch:
    """Each text's first window (docbeam's tokenizer, WINDOW tokens) as one batch, packed about two windows a row
    or one window a row."""
    return engine_fixtures.first_windows(folder, texts, WINDOW, packed)


def lowest_token_cosine(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The lowest cosine of any token's vector to its counterpart; -1 when any document keeps other tokens."""
    if [len(x) for x in a] != [len(y) for y in b]:
        return -1.0
    return min(
        float(((x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)).min()) for x, y in zip(a, b)
    )


def test_the_checkpoint_resolves_to_the_multi_vector_head(folder):
    head = resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder))
    assert (head.name, head.pooling, head.width, head.folder) == ("multi_vector", "tokens", PROJECTED, "embeddings")
    assert [layer.kind for layer in head.layers] == ["dense", "l2"]
    assert len(head.skip_ids) == len(string.punctuation)  # every ASCII punctuation mark is one BERT token


def test_token_vectors_are_encode_documents_on_native_and_chunked_packed_and_unpacked(folder):
    expected = reference(folder, TEXTS)
    assert all(len(v) < WINDOW for v in expected)  # punctuation dropped: fewer vectors than tokens
    for backend in ("native", "chunked"):
        for packed in (False, True):
            got = ours(folder, TEXTS, backend=backend, packed=packed)
            assert [len(v) for v in got] == [len(v) for v in expected], (backend, packed)
            assert lowest_token_cosine(got, expected) >= MIN_COSINE, (backend, packed)
            assert max(np.abs(np.linalg.norm(v, axis=1) - 1).max() for v in got) < 1e-5


def test_breaking_the_projection_the_normalisation_or_the_skiplist_moves_the_vectors(folder):
    expected = reference(folder, TEXTS)

    def without(kind):
        return lambda head: dataclasses.replace(
            head,
            layers=tuple(x for x in head.layers if x.kind != kind),
            **({"normalize": False} if kind == "l2" else {"dense": ()}),
        )

    no_projection = ours(folder, TEXTS, change=without("dense"))
    assert no_projection[0].shape[1] == 32 != PROJECTED  # the projection is what makes them 16 wide
    no_normalisation = ours(folder, TEXTS, change=without("l2"))
    assert max(np.abs(np.linalg.norm(v, axis=1) - 1).max() for v in no_normalisation) > 1e-2
    assert max(np.abs(a - b).max() for a, b in zip(no_normalisation, expected)) > 1e-2
    assert (
        lowest_token_cosine(ours(folder, TEXTS, change=lambda h: dataclasses.replace(h, skip_ids=())), expected) == -1.0
    )  # punctuation kept: other tokens
    tanh = ours(
        folder,
        TEXTS,
        change=lambda h: dataclasses.replace(
            h, layers=(dataclasses.replace(h.layers[0], activation="tanh"), *h.layers[1:])
        ),
    )
    assert lowest_token_cosine(tanh, expected) < 0.999


def test_a_skiplist_of_its_own_is_the_checkpoints(tmp_path):
    """The skiplist is read from the checkpoint (here: only commas and a word that is no token), not assumed."""
    folder = mve_checkpoint(str(tmp_path / "model"), skiplist=(",", "notatokenword"))
    expected = reference(folder, TEXTS[:3])
    got = ours(folder, TEXTS[:3])
    assert lowest_token_cosine(got, expected) >= MIN_COSINE
    assert resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder)).skip_ids == (1010,)


def rewrite(folder: str, name: str, edit) -> None:
    path = os.path.join(folder, name)
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(data), f)


@pytest.mark.parametrize(
    "name, edit, match",
    [
        (
            "2_MultiVectorMask/config.json",
            lambda c: {**c, "keep_only_token_ids": [5]},
            "2_MultiVectorMask/config.json sets keep_only_token_ids: \\[5\\]",
        ),
        ("2_MultiVectorMask/config.json", lambda c: {**c, "skiplist_tasks": ["query"]}, "sets skiplist_tasks"),
        (
            "modules.json",
            lambda m: (
                m
                + [
                    {
                        "idx": 4,
                        "name": "4",
                        "path": "4_Pool",
                        "type": "sentence_transformers.multi_vector_encoder.modules.HierarchicalTokenPooling",
                    }
                ]
            ),
            "module '4' of type .*HierarchicalTokenPooling.*which docbeam does not run: it runs only sentence-transformers' "
            "Transformer, Dense, MultiVectorMask, Normalize",
        ),
        (
            "modules.json",
            lambda m: [m[0], m[3], m[1], m[2]],
            "in the order .*Transformer, Dense..., MultiVectorMask, Normalize",
        ),
        (
            "1_Dense/config.json",
            lambda c: {**c, "module_input_name": "sentence_embedding"},
            "1_Dense/config.json sets module_input_name",
        ),
        (
            "3_Normalize/config.json",
            lambda c: {**c, "module_input_name": "sentence_embedding"},
            "3_Normalize/config.json sets module_input_name",
        ),
    ],
)
def test_what_the_head_does_not_reproduce_is_refused_naming_it(tmp_path, name, edit, match):
    folder = mve_checkpoint(str(tmp_path / "model"))
    rewrite(folder, name, edit)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.open_checkpoint(folder)


def test_asking_for_another_head_of_a_multi_vector_checkpoint_is_refused(folder, tiny_checkpoint_dir):
    with pytest.raises(checkpoint.CheckpointError, match="model.head: embedding, but .* MultiVectorEncoder"):
        resolve(checkpoint.open_checkpoint(folder), "embedding", ModelConfig(path=folder))
    with pytest.raises(checkpoint.CheckpointError, match="model.head: multi_vector, but .* does not set model_type"):
        resolve(checkpoint.open_checkpoint(tiny_checkpoint_dir), "multi_vector", ModelConfig(path=tiny_checkpoint_dir))


@pytest.mark.parametrize(
    "sets, match",
    [
        ({"output": {"vector_dtype": "int8"}}, "output.vector_dtype: int8: model.head resolved to multi_vector"),
        ({"output": {"granularity": "chunk"}}, "output.granularity: chunk: model.head resolved to multi_vector"),
        ({"output": {"vertex_ai": True}}, "output.vertex_ai: model.head resolved to multi_vector"),
        (
            {"output": {"pgvector": {"dsn": "postgresql://localhost/db", "table": "t"}}},
            "output.pgvector: model.head resolved to multi_vector",
        ),
    ],
)
def test_outputs_that_take_one_vector_per_document_are_refused(tmp_path, folder, sets, match):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    with pytest.raises(ConfigError, match=match):
        make_plan(job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), folder, **sets), probe_backends=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "packing, vector_dtype, prompts",
    [(False, "float32", None), (True, "float16", {"document": "passage: ", "query": "query: "})],
)
def test_a_docbeam_run_writes_encode_documents_vectors(tmp_path, packing, vector_dtype, prompts):
    """Unpacked float32, then reused by an incremental run; packed float16 with the checkpoint's document prompt."""
    import pyarrow.parquet as pq
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    folder = mve_checkpoint(str(tmp_path / "model"), prompts=prompts)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i, text in enumerate(TEXTS):
            f.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
    sections = {
        "output": {"vector_dtype": vector_dtype},
        "batching": {"buckets": [16, 32, 48], "tokens_per_batch": 256, "packing": packing},
    }
    summary = run_job(job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), folder, **sections))
    from docbeam.pipeline.driver.cli import format_summary

    text = format_summary(summary, str(tmp_path / "out"))  # the CLI's lines name the head that ran, not embedding
    assert "head       multi_vector → embeddings/" in text and "head       embedding" not in text
    if not prompts:
        again = run_job(
            job_config(
                str(tmp_path / "docs.jsonl"),
                str(tmp_path / "again"),
                folder,
                input={"reuse_from": str(tmp_path / "out")},
                **sections,
            )
        )
        assert again["docs_reused"] == len(TEXTS) and again["representations"] == summary["representations"]
    rows = pq.read_table(glob.glob(str(tmp_path / "out" / "embeddings" / "*.parquet"))).to_pylist()
    got = {r["id"]: np.asarray(r["multi_vector"], np.float64) for r in rows}
    expected = reference(folder, TEXTS)
    ordered = [got[f"d{i}"] for i in range(len(TEXTS))]
    cosine = lowest_token_cosine(ordered, expected)
    assert cosine >= (MIN_COSINE if vector_dtype == "float32" else 0.9999)
    assert [r["num_windows"] for r in rows] == [1] * len(rows)  # long documents: the first window, as ST truncates
    vectors = sum(len(v) for v in expected)
    assert summary["representations"] == {
        "multi_vector": {
            "vectors_per_document": round(vectors / len(TEXTS), 2),
            "bytes_per_document": round(vectors * PROJECTED * np.dtype(vector_dtype).itemsize / len(TEXTS), 2),
        }
    }


def test_a_non_finite_window_does_not_take_its_packed_row_mates_token_vectors_with_it(folder):
    """As for pooled vectors (packed_encoding_test.py): token 7's embedding is NaN; "bad" shares a packed row with
    "good", whose token vectors the runtime encodes again alone, so they are the clean run's, cut the same way."""
    import jax.numpy as jnp

    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.records import TokenWindow
    from docbeam.pipeline.stages.encode import load_encoder
    from docbeam.pipeline.stages.packer import packed_batch

    head = resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder))
    spec = standalone_spec(folder, "float32", "mean", AttentionConfig(), (16, 32), packing=True, head=head)
    runtime = load_encoder(spec)
    good = TokenWindow("good", 0, 1, np.array([101, 2000, 1010, 2017, 1012, 102], np.int32), 4, False)  # , and .
    bad = TokenWindow("bad", 0, 1, np.array([101, 7, 2003, 102], np.int32), 2, False)
    clean, _ = runtime.encode(packed_batch([[good]], 32, 2))
    assert clean[0].shape == (4, PROJECTED)  # its comma and full stop are skipped
    words = runtime.params["encoder"]["embed"]["word"]["embedding"]
    runtime.params["encoder"]["embed"]["word"]["embedding"] = words.at[7].set(jnp.nan)
    batch = packed_batch([[good, bad]], 32, 2)
    vectors, timing = runtime.encode(batch)
    by_id = {w[0]: v for w, v in zip(batch.windows, vectors)}
    assert not np.isfinite(by_id["bad"]).all() and timing["reencoded_alone"] == 2
    np.testing.assert_allclose(by_id["good"], clean[0], atol=2e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_token_vectors_run_on_openvino_at_xlas(folder, packed):
    head = resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder))
    batch = first_windows(folder, TEXTS, packed)
    assert_openvino_writes_what_xla_writes(folder, head, [batch], packed)
