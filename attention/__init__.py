"""Swappable attention: one signature (``interface.AttentionFn``), one registry, one file per backend."""
from attention.interface import AttentionCase, AttentionFn, Backend, NoOptions, Support
from attention.registry import get, names, register

__all__ = ["AttentionCase", "AttentionFn", "Backend", "NoOptions", "Support", "get", "names", "register"]
