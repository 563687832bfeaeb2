"""The benchmark scripts (``python benchmarks/<name>.py``), each beginning with ``import bootstrap``.

A script imported as ``benchmarks.<name>`` (by a test, or by another script) runs that line too, so this folder
goes on sys.path: at the end, where its attention.py shadows nothing."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
if _HERE not in _sys.path:
    _sys.path.append(_HERE)
