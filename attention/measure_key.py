"""What auto's measurement is keyed by (attention/measure.py): the chip, the libraries, the shapes, the candidates
and their code. Anything here that changes measures again; nothing else does."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform as platform_module

from docbeam.attention import registry
from docbeam.attention.candidates import options_of, split_label


def device_kind() -> str:
    """The chip's kind as JAX names it; on CPU the processor's model too (a laptop's driver is not a c3 worker)."""
    import jax

    device = jax.devices()[0]
    kind = f"{device.platform}: {getattr(device, 'device_kind', '')}"
    if device.platform == "cpu":
        kind += f" ({cpu_model()}, {os.cpu_count()} cores)"
    return kind


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform_module.processor() or "unknown cpu"


def code_digest(label: str) -> str:
    """A digest of the code the candidate runs: for docbeam's own backends every module of attention/ (a flash
    kernel lives in attention/flash/*, chunk sizes beside chunked), for a user's the folder of its package or its
    module's file: editing a kernel measures it again."""
    fn = inspect.unwrap(registry.get(split_label(label)[0]).attend)
    try:
        source = os.path.abspath(inspect.getsourcefile(fn))
    except TypeError:
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    ours = os.path.dirname(os.path.abspath(__file__))
    if source.startswith(ours + os.sep):
        return _files_digest(ours)
    return _files_digest(os.path.dirname(source)) if source.endswith("__init__.py") else _files_digest(source)


@functools.lru_cache(maxsize=None)
def _files_digest(path: str) -> str:
    """Every .py file under ``path`` (or the one file), by name and content; read once per process."""
    files = (
        sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".py"))
        if os.path.isdir(path)
        else [path]
    )
    digest = hashlib.sha256()
    for name in files:
        try:
            with open(name, "rb") as f:
                digest.update(os.path.relpath(name, path).encode() + b"\0" + f.read())
        except OSError:
            digest.update(name.encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def library_versions() -> tuple[tuple[str, str], ...]:
    """The installed versions of what decides a kernel's speed and answer; read once per process."""
    out = []
    for name in ("docbeam", "jax", "jaxlib", "tokamax", "jax-cuda12-plugin", "libtpu"):
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(out)


def cache_key(spec, cases, rows: int, candidates, device: str, mesh, **policy) -> str:
    """``policy``: how the choice is made (the gain it needs), which changes the answer as much as the chip does."""
    facts = {
        "device": device,
        "versions": dict(library_versions()),
        "python": platform_module.python_version(),
        "cases": [repr(c) for c in cases],
        "rows": rows,
        "mesh": mesh.as_dict() if hasattr(mesh, "as_dict") else str(mesh),
        "candidates": {
            label: [options_of(spec, label).model_dump(mode="json"), code_digest(label)] for label in candidates
        },
        "tolerance": spec.verify_tolerance,
        **policy,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]
