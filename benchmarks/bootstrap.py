"""The first import of every script here: ``import bootstrap``.

``python benchmarks/<name>.py`` puts benchmarks/ first on sys.path, where attention.py would shadow the
``attention`` package and ``benchmarks`` itself cannot be imported. For such a script this module puts the
repository root first instead, then sets what must be set before JAX is imported (``common.bootstrap``: the
compile cache, offline Hugging Face, stdout kept for the results file). Imported any other way (a test importing
``benchmarks.readme``) it changes nothing: that process has its own sys.path, environment and stdout.
"""

from __future__ import annotations

import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "benchmarks")


def run_as_script() -> bool:
    """Whether this process's main module is a script of benchmarks/ (``python benchmarks/<name>.py``)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(main_file) and os.path.dirname(os.path.abspath(main_file)) == BENCH_DIR


if run_as_script():
    sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") not in (REPO, BENCH_DIR)]
    importlib.import_module("benchmarks.common").bootstrap()
