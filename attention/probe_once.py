"""Each backend probed once per process (``attention.dispatch.probe``), in parallel: on the DirectRunner the driver
and the worker are one process, and every probe is a compilation."""

from __future__ import annotations

import concurrent.futures
import os
import threading

from docbeam.attention.dispatch import Choice, probe
from docbeam.attention.settings import AttentionConfig

_PROBED: set[tuple[AttentionConfig, Choice]] = set()
_PROBED_LOCK = threading.Lock()


def probe_once(spec: AttentionConfig, choice: Choice) -> None:
    """``probe`` a choice unless this process has; keyed by the frozen spec and choice themselves."""
    key = (spec, choice)
    with _PROBED_LOCK:
        if key in _PROBED:
            return
    probe(spec, choice)
    with _PROBED_LOCK:
        _PROBED.add(key)


def probe_all(spec: AttentionConfig, choices) -> None:
    """``probe_once`` for every choice, in parallel threads (XLA compiles without the GIL); a failure raises
    as the sequential loop would, the first failing choice's."""
    choices = list(choices)
    workers = max(1, min(len(choices), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="docbeam-probe") as pool:
        list(pool.map(lambda choice: probe_once(spec, choice), choices))
