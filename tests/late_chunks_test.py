"""output.chunking: late. A chunk's vector is the mean of its own tokens' states in a forward over the whole
document (transformers' BertModel on the document's tokens, framed once: the reference), or, past the model's
length, over the model-length window that holds the chunk; its offsets and text are window chunking's.

The reference cuts chunks and context windows here, from one tokenization of the text: chunk k's own tokens are
[k·(room − stride), … + room) of the document's tokens, and context windows take chunks from the first while
their tokens fit the checkpoint's length."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_fixtures import assert_openvino_writes_what_xla_writes
from family_fixtures import MIN_COSINE, save_checkpoint, spread_norms_and_biases, tiny_model

from docbeam import attention
from docbeam.config import TokenizeConfig
from docbeam.models import checkpoint, encoder
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.late_chunking import context_batch, group_chunks
from docbeam.pipeline.stages.tokenize import tokenize_documents

WINDOW, STRIDE, CONTEXT = 24, 6, 96  # chunks of 22 own tokens, 6 shared; context windows of 94 own tokens
WORDS = "river bank loan tide quay fund harbour ledger storm credit anchor bond".split()
TEXTS = {
    "short": " ".join(WORDS[:5]),  # one chunk
    "fits": " ".join(WORDS * 5),  # several chunks, one context window
    "long": " ".join(f"{w}{i % 7}" for i, w in enumerate(WORDS * 12)),
}  # past CONTEXT: several context windows


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    model = spread_norms_and_biases(tiny_model("BertModel", num_hidden_layers=2, intermediate_size=64))
    return model, save_checkpoint(model, str(tmp_path_factory.mktemp("late-bert")), max_seq_length=CONTEXT)


def reference_chunks(model, tokenizer, text: str, prompt: str = "") -> list[np.ndarray]:
    """Each chunk's vector: transformers' states of [CLS] + the prompt's tokens + its context's tokens + [SEP],
    mean over its own."""
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    room, context_room = WINDOW - 2 - len(prompt_ids), CONTEXT - 2 - len(prompt_ids)
    chunks, start = [], 0
    while True:
        chunks.append((start, min(start + room, len(ids))))
        if chunks[-1][1] == len(ids):
            break
        start += room - STRIDE
    out, first = [], None
    for a, b in chunks:
        if first is None or b - first > context_room:
            first = a
            end = max(e for s, e in chunks if s >= first and e - first <= context_room)
            framed = [tokenizer.cls_token_id, *prompt_ids, *ids[first:end], tokenizer.sep_token_id]
            with torch.no_grad():
                hidden = model(input_ids=torch.tensor([framed])).last_hidden_state[0].numpy().astype(np.float64)
        shift = 1 + len(prompt_ids)
        out.append(hidden[shift + a - first : shift + b - first].mean(0))
    return out


def windows_of(folder: str, context_len: int | None, prompt: str | None = None):
    tokenizer = checkpoint.load_tokenizer(folder)
    docs = [Document(doc_id, text, "docs.jsonl", i + 1) for i, (doc_id, text) in enumerate(TEXTS.items())]
    windows, rejected = tokenize_documents(
        docs, tokenizer, window_len=WINDOW, config=TokenizeConfig(stride=STRIDE), prompt=prompt, context_len=context_len
    )
    assert not rejected
    return windows


def late_vectors(
    folder: str, backend: str = "native", shift: int = 0, prompt: str | None = None
) -> dict[tuple[str, int], np.ndarray]:
    """Our late chunk vectors, by (document, chunk), from the pipeline's own windows and batch; ``shift`` moves
    every span by that many tokens (a broken variant)."""
    ck = checkpoint.open_checkpoint(folder)
    params = checkpoint.load_params(ck.folder, ck.config)
    chosen = attention.get(backend)
    embed = jax.jit(encoder.embed_fn(ck.config, chosen.bind(chosen.parse_options(None)), "cls"))
    contexts = [w for w in windows_of(folder, CONTEXT, prompt) if w.spans]
    batch = context_batch(contexts, 128, len(contexts) + 1)
    out = np.asarray(embed(params, batch.ids_BxT, batch.lengths_B, None, None, batch.spans_BxKx3[..., :2] + shift))
    vectors = out.reshape(-1, out.shape[-1])[batch.window_slots()]
    return {(w.doc_id, w.index): v for w, v in zip(batch.windows, vectors)}


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("backend", ["native", "chunked"])
def test_late_chunks_are_the_mean_of_their_tokens_in_a_forward_over_the_whole_document(bert, backend):
    model, folder = bert
    tokenizer = checkpoint.load_tokenizer(folder)
    ours = late_vectors(folder, backend)
    contexts = [w for w in windows_of(folder, CONTEXT) if w.spans]
    assert [w.num_windows for w in contexts if w.doc_id == "long"][0] > 1  # the long one needs several
    assert {w.num_windows for w in contexts if w.doc_id != "long"} == {1}
    for doc_id, text in TEXTS.items():
        reference = reference_chunks(model, tokenizer, text)
        assert len(reference) == len([k for d, k in ours if d == doc_id])
        for k, want in enumerate(reference):
            assert cosine(ours[doc_id, k], want) >= MIN_COSINE, (doc_id, k, backend)


def test_a_prompt_frames_each_context_window_once_and_is_not_pooled(bert):
    """model.prompt (e5's ``passage: ``) after [CLS] in every context window, as in every window; the chunks'
    spans are their own tokens only."""
    model, folder = bert
    tokenizer = checkpoint.load_tokenizer(folder)
    ours = late_vectors(folder, prompt="passage: ")
    for doc_id, text in TEXTS.items():
        for k, want in enumerate(reference_chunks(model, tokenizer, text, "passage: ")):
            assert cosine(ours[doc_id, k], want) >= MIN_COSINE, (doc_id, k)


def test_a_span_off_by_one_token_is_seen(bert):
    """Every chunk's span one token later: each chunk falls below the parity bar."""
    model, folder = bert
    tokenizer = checkpoint.load_tokenizer(folder)
    broken = late_vectors(folder, shift=1)
    for doc_id, text in TEXTS.items():
        reference = reference_chunks(model, tokenizer, text)
        assert max(cosine(broken[doc_id, k], want) for k, want in enumerate(reference)) < MIN_COSINE, doc_id


def test_late_chunks_differ_from_window_chunks_with_the_same_offsets(bert):
    """The same chunks (index, offsets, length) as window chunking; vectors that saw more than their window."""
    _, folder = bert
    plain = windows_of(folder, None)
    late = windows_of(folder, CONTEXT)
    assert [(w.doc_id, w.index, w.char_start, w.char_end, list(w.token_ids)) for w in plain] == [
        (w.doc_id, w.index, w.char_start, w.char_end, list(w.token_ids)) for w in late if not w.spans
    ]
    spans = {(w.doc_id, s.index): (s.char_start, s.char_end, s.length) for w in late for s in w.spans}
    assert spans == {(w.doc_id, w.index): (w.char_start, w.char_end, w.length) for w in plain}
    ck = checkpoint.open_checkpoint(folder)
    params = checkpoint.load_params(ck.folder, ck.config)
    native = attention.get("native")
    embed = jax.jit(encoder.embed_fn(ck.config, native.bind(native.parse_options(None)), "mean"))
    windowed = [w for w in plain if w.doc_id == "fits"]
    ids = np.zeros((len(windowed), WINDOW), np.int32)
    for r, w in enumerate(windowed):
        ids[r, : w.length] = w.token_ids
    by_window = np.asarray(embed(params, ids, np.asarray([w.length for w in windowed], np.int32)))
    ours = late_vectors(folder)
    assert max(cosine(ours["fits", w.index], by_window[r]) for r, w in enumerate(windowed)) < 0.999


def test_context_windows_group_consecutive_chunks_while_they_fit():
    assert group_chunks([(0, 10), (8, 18), (16, 26), (24, 30)], 20) == [(0, 18, [0, 1]), (16, 30, [2, 3])]
    assert group_chunks([(0, 5)], 5) == [(0, 5, [0])]
    with pytest.raises(ValueError, match="does not fit a context window"):
        group_chunks([(0, 10)], 9)


def run_chunks(folder: str, tmp_path, name: str, chunking: str, packing: bool, backend: str = "native"):
    """``docbeam run`` with granularity both: (chunk rows by (document, index), document rows by id)."""
    import glob
    import json

    import pyarrow.parquet as pq
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in TEXTS.items()))
    out = tmp_path / name
    summary = run_job(
        job_config(
            str(docs),
            str(out),
            folder,
            model={"max_seq_len": WINDOW},
            tokenize={"stride": STRIDE},
            attention={"backend": backend},
            batching={"buckets": [32, 64, 128], "tokens_per_batch": 512, "packing": packing},
            output={"granularity": "both", "chunking": chunking},
        )
    )
    assert summary["chunking"] == chunking and summary.get("context_len") == (CONTEXT if chunking == "late" else None)

    def read(folder_name):
        return [r for f in sorted(glob.glob(f"{out}/{folder_name}/*.parquet")) for r in pq.read_table(f).to_pylist()]

    return ({(r["document_id"], r["chunk_index"]): r for r in read("chunks")}, {r["id"]: r for r in read("embeddings")})


@pytest.mark.slow
@pytest.mark.parametrize("packing, backend", [(True, "native"), (False, "chunked")])
def test_docbeam_run_writes_late_chunks_beside_unchanged_document_vectors(bert, tmp_path, packing, backend):
    """A whole run: late chunk rows are the reference's vectors with window chunking's offsets, text and
    num_tokens; the document rows are window chunking's, bit for bit (packed windows, unpacked context windows)."""
    model, folder = bert
    tokenizer = checkpoint.load_tokenizer(folder)
    late, late_docs = run_chunks(folder, tmp_path, "late", "late", packing, backend)
    window, window_docs = run_chunks(folder, tmp_path, "window", "window", packing, backend)
    assert late_docs == window_docs
    assert late.keys() == window.keys()
    for key, row in late.items():
        assert {k: v for k, v in row.items() if k != "embedding"} == {
            k: v for k, v in window[key].items() if k != "embedding"
        }
    for doc_id, text in TEXTS.items():
        for k, want in enumerate(reference_chunks(model, tokenizer, text)):
            assert cosine(late[doc_id, k]["embedding"], want) >= MIN_COSINE, (doc_id, k)
    assert min(cosine(late[key]["embedding"], window[key]["embedding"]) for key in late) < 0.999


def test_late_chunking_is_refused_where_it_cannot_run(bert, tmp_path):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    _, folder = bert
    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')

    def plan(**sections):
        return make_plan(
            job_config(
                str(tmp_path / "docs.jsonl"),
                str(tmp_path / "out"),
                folder,
                model={"max_seq_len": WINDOW},
                tokenize={"stride": STRIDE},
                **sections,
            ),
            probe_backends=False,
        )

    with pytest.raises(ConfigError, match="output.chunking: late makes chunk rows, but output.granularity: document"):
        plan(output={"chunking": "late"})
    with pytest.raises(ConfigError, match="context windows of up to 96 tokens .* batching.buckets ends at 64; add 96"):
        plan(output={"chunking": "late", "granularity": "chunk"}, batching={"buckets": [32, 64]})
    with pytest.raises(ConfigError, match="output.chunking"):
        plan(output={"chunking": "sliding", "granularity": "chunk"})
    assert plan(output={"chunking": "late", "granularity": "chunk"}, batching={"buckets": [32, 128]}).context_len == 96


def test_context_batches_are_full_but_the_last_and_list_every_chunk_once(bert):
    from docbeam.config import BatchingConfig
    from docbeam.pipeline.stages.late_chunking import context_batches

    _, folder = bert
    contexts = [w for w in windows_of(folder, CONTEXT) if w.spans]
    batches = list(context_batches(((128, 0), iter(contexts)), BatchingConfig(tokens_per_batch=128 * 4)))
    assert [b.real_rows for b in batches] == [4, 2] and {b.ids_BxT.shape for b in batches} == {(4, 128)}
    chunks = [(w.doc_id, w.index) for b in batches for w in b.windows]
    assert sorted(chunks) == sorted((w.doc_id, s.index) for w in contexts for s in w.spans)
    assert all(len(b.window_lengths()) == len(b.windows) for b in batches)


def test_late_chunks_spans_run_on_openvino_at_xlas_vectors(bert):
    from docbeam.models.heads import embedding

    _, folder = bert
    contexts = [w for w in windows_of(folder, CONTEXT) if w.spans]
    batch = context_batch(contexts, 128, len(contexts) + 1)
    head = embedding.standalone(checkpoint.open_checkpoint(folder), "cls")
    (record,) = assert_openvino_writes_what_xla_writes(folder, head, [batch], packing=False)
    assert record["engine_measured"]  # the shape's first batch carries the parity figures
