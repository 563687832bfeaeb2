"""docbeam: batch document embedding on Apache Beam. Everything installs under this one name, so nothing of
docbeam's can collide with a user's own top-level modules on a worker: the folders ``pipeline/``, ``models/`` and
``attention/`` of the source tree are ``docbeam.pipeline``, ``docbeam.models`` and ``docbeam.attention`` once
installed (pyproject.toml maps them)."""
from __future__ import annotations

import os as _os

_SOURCE_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_FOLDERS = ("pipeline", "models", "attention")

# In a source checkout the three folders sit beside this one rather than inside it: let the import system find
# them there too, so a checkout on PYTHONPATH (a Beam worker subprocess, a second worktree) imports its own
# files, never those of whichever checkout was installed in editable mode.
if all(_os.path.isfile(_os.path.join(_SOURCE_ROOT, f, "__init__.py")) for f in _FOLDERS) and \
        _SOURCE_ROOT not in __path__:
    __path__.append(_SOURCE_ROOT)
