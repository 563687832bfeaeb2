"""auto's attention measurements kept between runs (attention/measure.py): JSON files named by their key, under
``docbeam-attention/`` beside JAX's compilation cache (``runner.compilation_cache``, local or gs://), else in the
user's cache folder. So a scheduled job measures once and the next day's run reads it."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

from docbeam.attention.measure import Measurement
from docbeam.pipeline.store import storage

log = logging.getLogger(__name__)


class MeasurementCache:
    """Measurements as JSON files named by their key, under ``docbeam-attention/`` beside JAX's compilation cache
    (``runner.compilation_cache``, local or gs://), else in the user's cache folder. Only saves time: a cache that
    cannot be read or written is a warning, and a damaged entry is measured again."""

    def __init__(self, compilation_cache: str | None):
        if compilation_cache:
            self.folder = compilation_cache.rstrip("/") + "/docbeam-attention"
        else:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            self.folder = os.path.join(base, "docbeam", "attention")

    def path(self, key: str) -> str:
        return f"{self.folder}/{key}.json"

    def read(self, key: str, bucket: int) -> Measurement | None:
        path = self.path(key)
        try:
            if not storage.exists(path):
                return None
            raw = json.loads(storage.read_bytes(path))
            return dataclasses.replace(Measurement.from_dict(bucket, raw), cached=True, key=key)
        except Exception as e:  # noqa: BLE001  a damaged or unreadable entry is measured again
            log.warning("attention measurement %s cannot be used (%s: %s); measuring again", path, type(e).__name__, e)
            return None

    def write(self, measurement: Measurement) -> None:
        path = self.path(measurement.key)
        try:
            if not storage.is_remote(path):
                os.makedirs(self.folder, exist_ok=True)
            storage.write_bytes(path, json.dumps(measurement.as_dict(), indent=1, sort_keys=True).encode())
        except Exception as e:  # noqa: BLE001
            log.warning("attention measurement cannot be cached at %s (%s: %s)", path, type(e).__name__, e)


def measured_on_this_chip(attention, choices, tokens_per_batch: int, mesh, compilation_cache: str | None) -> tuple:
    """auto's choices still to be measured, measured here at the rows one chip of ``mesh`` gets per batch of
    ``tokens_per_batch`` tokens, through the cache beside ``compilation_cache``: what the driver's plan and a worker
    that measures for itself both do."""
    from docbeam.attention.measure import measure_choices
    from docbeam.pipeline.stages.packer import rows_for

    data = max(mesh.data, 1)
    return measure_choices(
        attention,
        choices,
        lambda bucket: math.ceil(rows_for(bucket, tokens_per_batch) / data),
        mesh,
        MeasurementCache(compilation_cache),
    )
