"""The sinks beside the head's rows: the registry (registry.py) filled with the built-in sinks, one module or
folder each. Code outside this folder asks the registry, never a sink by name."""

from docbeam.pipeline.sinks.registry import (
    SINKS,
    Curated,
    Sink,
    SinkBehind,
    SinkCommand,
    SinkInputs,
    SinkSection,
    active,
    commands,
    register,
)

# isort: split
# The built-ins, registered in this order: output's fields, the sinks' steps and the summary's lines follow it.
from docbeam.pipeline.sinks import vertex_ai  # noqa: F401

# isort: split
from docbeam.pipeline.sinks import pgvector  # noqa: F401

# isort: split
from docbeam.pipeline.sinks import dedup  # noqa: F401

__all__ = [
    "SINKS",
    "Curated",
    "Sink",
    "SinkBehind",
    "SinkCommand",
    "SinkInputs",
    "SinkSection",
    "active",
    "commands",
    "register",
]
