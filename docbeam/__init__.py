"""docbeam: batch document embedding on Apache Beam. Everything installs under this one name, so nothing of
docbeam's can collide with a user's own top-level modules on a worker: the folders ``pipeline/``, ``models/`` and
``attention/`` of the source tree are ``docbeam.pipeline``, ``docbeam.models`` and ``docbeam.attention`` once
installed (pyproject.toml maps them)."""

from __future__ import annotations

import os as _os
import sys as _sys

_SOURCE_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_FOLDERS = ("pipeline", "models", "attention")


class _SourceFolders:
    """In a source checkout the three folders sit beside this one rather than inside it: this finder maps
    ``docbeam.pipeline``, ``docbeam.models`` and ``docbeam.attention`` (and nothing else: ``docbeam.benchmarks``
    is no module) to them, so a checkout on PYTHONPATH (a Beam worker subprocess, a second worktree) imports its
    own files, never those of whichever checkout was installed in editable mode."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        package, _, folder = fullname.partition(".")
        if package != __name__ or folder not in _FOLDERS:
            return None
        import importlib.util

        where = _os.path.join(_SOURCE_ROOT, folder)
        return importlib.util.spec_from_file_location(
            fullname, _os.path.join(where, "__init__.py"), submodule_search_locations=[where]
        )


if all(_os.path.isfile(_os.path.join(_SOURCE_ROOT, f, "__init__.py")) for f in _FOLDERS) and not any(
    isinstance(f, type) and f.__name__ == "_SourceFolders" and f.__module__ == __name__ for f in _sys.meta_path
):
    _sys.meta_path.insert(0, _SourceFolders)

# The public API, imported on first use: `import docbeam` stays cheap (no Beam, no JAX) for a tool that only
# needs a name from it, and a Beam worker unpickling a step pays only for what that step uses.
_PUBLIC = {
    "EmbedDocuments": "docbeam.pipeline.driver.embed",  # the embedding step, for a Beam pipeline of your own
    "AsBeamChunks": "docbeam.pipeline.stages.rag_chunks",  # rows → Beam's apache_beam.ml.rag Chunks
    "ReadBeamChunks": "docbeam.pipeline.stages.rag_chunks",  # a committed run's rows → Beam Chunks
    "run": "docbeam.pipeline.driver.job",  # what `docbeam run` does; returns the run's summary
    "EmbedConfig": "docbeam.config",
    "JobConfig": "docbeam.config",
    "ConfigError": "docbeam.config",
    "Document": "docbeam.pipeline.records",
    "Rejected": "docbeam.pipeline.records",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'docbeam' has no attribute {name!r}; its API: {', '.join(__all__)}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
