"""Swappable attention: one signature (``interface.AttentionFn``), one registry, one file per backend.

Importing the package registers the built-in backends (``attention.backends``), so any import of
``attention.registry`` finds them; the registry itself never imports a backend.
"""

from docbeam.attention import backends  # noqa: F401  (registers native, chunked and flash
from docbeam.attention.interface import AttentionCase, AttentionFn, Backend, NoOptions, Support, current_platform
from docbeam.attention.registry import get, names, register

__all__ = [
    "AttentionCase",
    "AttentionFn",
    "Backend",
    "NoOptions",
    "Support",
    "current_platform",
    "get",
    "names",
    "register",
]
