"""The sinks' one registry: a sink is a ``Sink`` subclass registered under its key, the name of its section of
``output`` (``output.<key>``), and holds the whole plug-in (Beam's ``ml/rag/ingestion`` keeps one class per
database the same way): its typed section and the checks made with the config (``SinkSection.fits``), the
checks made at plan against the resolved head (``check``), the files it adds to the run's commit, a preflight,
its step after the commit and that step's summary line, and its own commands of the ``docbeam`` CLI. A sink that
*curates* (output.dedup) also marks documents before the others write (``curate``): its marks reach every other
sink's ``files`` and the columns ``output.select.where`` may read (``select_columns``).

Everything else asks this registry, never a sink by name: ``docbeam.config.input_output`` builds ``output``'s fields from
``SINKS``, the driver runs the hooks of ``active`` sinks, the CLI adds each sink's ``commands``, and a failure
after the commit is a ``SinkBehind``. This module imports nothing heavy: loading a config reads it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, ClassVar

import pydantic

from docbeam.errors import JobFailed


class SinkSection(pydantic.BaseModel):
    """A sink's typed section of ``output``, validated once with the config."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_yaml(cls, value):
        """What the YAML value becomes before validation (e.g. ``true`` meaning the defaults)."""
        return value

    def fits(self, job) -> None:
        """Checks against the rest of the job, made with the config (ValueError: the config is refused)."""

    def shown(self) -> dict:
        """The section as ``docbeam validate`` prints it (what must not be printed, e.g. a password, left out)."""
        return self.model_dump(mode="json")


@dataclasses.dataclass(frozen=True)
class SinkInputs:
    """What a sink's steps in the graph read (PCollections): the run's head ``rows`` (encoded and reused), the
    ``documents`` read (their texts), the ``removed`` ids of an incremental run (for a sink that ``needs_removed``;
    else None) and ``marked``: ``(id, kind)`` of every document a curating sink marked (None when none curates)."""

    rows: Any
    documents: Any
    removed: Any = None
    marked: Any = None


@dataclasses.dataclass(frozen=True)
class Curated:
    """What a curating sink adds to the graph: its files (PCollections of names, committed with the run), its
    ``stats`` (dicts summed into the run's statistics; summary.json's record under the sink's key is their
    ``sinks.<key>`` part) and ``marked``, ``(id, kind)`` per marked document."""

    written: tuple
    stats: Any
    marked: Any


class SinkBehind(JobFailed):
    """The run is committed to its output folder, but a sink's step after the commit failed, so the sink is one
    run behind (exit 1); its message says how to catch it up. Each sink raises its own subclass."""


@dataclasses.dataclass(frozen=True)
class SinkCommand:
    """One ``docbeam`` subcommand of a sink. ``prepare`` refuses (a ``Refused``: exit 2, nothing touched) or
    returns what ``run`` needs; ``run`` does the work and returns the line printed (an exception: exit 1)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    prepare: Callable[[argparse.Namespace], Any]
    run: Callable[[Any], str]


class Sink:
    """One sink. Subclass it, set ``section``, override the hooks it needs, and decorate it with ``register``."""

    key: ClassVar[str]  # set by register: its section, output.<key>, and its record in summary.json
    section: ClassVar[type[SinkSection]]
    needs_removed: ClassVar[bool] = False  # ``files`` is handed the ids an incremental run removed
    commands: ClassVar[tuple[SinkCommand, ...]] = ()
    # What a curating sink's marks add to each row as output.select.where reads it: {column: kind} (selection.py's
    # kinds); the value is the mark's (True and its kind) or the unmarked one (False, None).
    select_columns: ClassVar[dict[str, str]] = {}

    def check(self, cfg, head, kept) -> None:
        """At plan, against the resolved head and the typed kept fields: refuse (ConfigError) naming the key."""

    def curate(self, section, inputs: SinkInputs, staging: str, run_id: str, plan) -> Curated | None:
        """A curating sink's marks and files, made before every sink's ``files`` (None: it curates nothing)."""
        return None

    def mark_values(self, kinds: list[str]) -> dict:
        """A row's ``select_columns`` values from the kinds its marks carry ([] for an unmarked document)."""
        return {}

    def planned(self, section, plan) -> dict | None:
        """What summary.json records under the sink's key before the run (its settings); None: nothing."""
        return None

    def files(self, section, inputs: SinkInputs, staging: str, run_id: str, plan) -> tuple:
        """The PCollections of file names it writes into the staging folder, committed with the run or not at
        all, from ``inputs`` (SinkInputs)."""
        return ()

    def preflight(self, section, wait: bool) -> None:
        """Before anything is touched: refuse (a ``Refused``) what would fail after the commit. ``wait``: the
        driver waits for the job."""

    def after_commit(self, output: str, manifest: dict, section) -> dict | None:
        """Its step once the run is committed; the record summary.json keeps under its key (None: no step). A
        failure raises a ``SinkBehind``."""
        return None

    def summary_line(self, record: dict) -> str | None:
        """The command's summary line for the record of ``after_commit``."""
        return None

    def report_tables(self, record: dict) -> list[tuple[str, list[str], list[list], str]]:
        """What ``docbeam report`` shows of the record summary.json keeps under the sink's key, as tables:
        ``(title, column names, rows, a note under the title)``; none by default (the record is in the summary)."""
        return []


SINKS: dict[str, Sink] = {}


def register(key: str):
    """Class decorator: registers one instance of the sink under ``key``; a key registered twice raises."""

    def add(cls: type[Sink]) -> type[Sink]:
        if key in SINKS:
            raise ValueError(f"a sink named {key!r} is registered already")
        cls.key = key
        SINKS[key] = cls()
        return cls

    return add


def active(cfg) -> list[tuple[Sink, Any]]:
    """(sink, its typed section) for every sink the job's output section turns on, in registry order."""
    output = getattr(cfg, "output", None)
    return [
        (sink, getattr(output, key))
        for key, sink in SINKS.items()
        if output is not None and getattr(output, key) is not None
    ]


def commands() -> dict[str, SinkCommand]:
    """Every sink's commands of the ``docbeam`` CLI, by name."""
    return {command.name: command for sink in SINKS.values() for command in sink.commands}


def float_vectors(key: str, vector_dtype: str) -> None:
    """A sink that loads float vectors refuses the integer and binary dtypes (with the config)."""
    if vector_dtype not in ("float32", "float16"):
        raise ValueError(
            f"output.{key} loads float vectors, but output.vector_dtype is {vector_dtype}; set "
            "output.vector_dtype: float32 (or float16)"
        )


def needs_marks(key: str, output) -> None:
    """``output.<key>.skip_duplicates`` needs a curating sink turned on whose marks it skips (with the config)."""
    if not any(getattr(output, k, None) is not None and sink.select_columns for k, sink in SINKS.items()):
        curating = [k for k, sink in SINKS.items() if sink.select_columns]
        raise ValueError(
            f"output.{key}.skip_duplicates leaves out the documents a curating sink marks, and none is on; turn "
            f"on output.{' or output.'.join(curating)} (e.g. output.{curating[0]}: true), or drop skip_duplicates"
        )
