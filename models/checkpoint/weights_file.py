"""Where a checkpoint's model.safetensors is read for weights_check.py (beside it): the local file, or by ranged reads
of its header on gs:// (any Beam FileSystem) and on the Hub, so the driver holds config.json against the weights
of every checkpoint without downloading them."""

from __future__ import annotations

import dataclasses
import os
from typing import BinaryIO, Callable

from docbeam.models.checkpoint.source import _hub_env, _hub_offline, _hub_weights_entry, parse_hub_id, pinned_path
from docbeam.models.families.encoder_config import CheckpointError


@dataclasses.dataclass(frozen=True)
class WeightsFile:
    """A model.safetensors where it lies: ``path`` as messages name it, its size, and how to open it (an object
    with ``read``, ``seek`` and ``with``)."""

    path: str
    size: int
    open: Callable[[], BinaryIO]


def weights_to_check(path: str, folder: str, with_weights: bool) -> tuple[WeightsFile | None, bool]:
    """(the model.safetensors to hold against config.json in this process, whether to sample its values). The
    driver reads the header wherever the checkpoint is: the file in ``folder`` (a local folder, ``pkg:``, a Hub
    snapshot in the cache), else ranged reads on gs:// or the Hub online. Scattered reads of a remote file would
    cost a download, so a remote checkpoint's values are sampled by the workers, once they hold the file."""
    local = os.path.join(folder, "model.safetensors")
    remote, hub = "://" in path, path.startswith("hf://")
    if with_weights:
        return (local_file(local) if remote and os.path.isfile(local) else None), True
    if os.path.isfile(local):
        return local_file(local), True
    if hub and not _hub_offline():
        return hub_file(pinned_path(path, folder)), False
    if remote and not hub:
        return beam_file(f"{path.rstrip('/')}/model.safetensors"), False
    return None, False  # a Hub id offline whose cache lacks the weights: its digest refuses it


def local_file(path: str) -> WeightsFile:
    return WeightsFile(path, os.path.getsize(path), lambda: open(path, "rb"))


def beam_file(path: str) -> WeightsFile | None:
    """gs:// (any Beam FileSystem), whose reader fetches ranges as they are read; None where it is not."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    if not FileSystems.exists(path):
        return None
    (match,) = FileSystems.match([path])
    return WeightsFile(
        path,
        match.metadata_list[0].size_in_bytes,
        lambda: FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED),
    )


def hub_file(path: str) -> WeightsFile:
    """A pinned Hub id's model.safetensors, each ``read`` one HTTP range request (the header: two small ones)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    hub = parse_hub_id(path)
    url = hf_hub_url(hub.repo, "model.safetensors", revision=hub.revision, endpoint=_hub_env()["endpoint"])

    class Ranged:
        position = 0
        __enter__, __exit__ = (lambda self: self), (lambda self, *exc: None)

        def seek(self, position: int) -> None:
            self.position = position

        def read(self, n: int) -> bytes:
            span = f"bytes={self.position}-{self.position + n - 1}"
            answer = get_session().get(url, headers={**build_hf_headers(), "range": span})
            try:
                hf_raise_for_status(answer)
            except HfHubHTTPError as e:
                raise CheckpointError(
                    f"model.path {path!r}: the Hub refused the weights' header: {str(e).splitlines()[0]}"
                ) from None
            data = answer.content[:n] if answer.status_code == 206 else answer.content[self.position :][:n]
            self.position += len(data)
            return data

    return WeightsFile(f"{path}/model.safetensors", _hub_weights_entry(hub).size, Ranged)
