"""Workarounds for the Apache Beam versions docbeam was checked against, each saying why it is needed.

RunInference's module comes from ``run_inference_without_model_manager()``, called once where it is used
(pipeline/stages/encode.py), never from an import of its own. A Beam release outside ``CHECKED_BEAM`` may have fixed
or moved what a workaround patches: the process says so in its log (``check_beam_version``), and the
workaround still only touches ``sys.modules`` entries Beam treats as optional.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

log = logging.getLogger(__name__)

# The Beam releases whose RunInference imports its ModelManager as an optional dependency (a try block that
# leaves it None on an ImportError) and whose DirectRunner skips Prism once told is_interactive(); pyproject.toml
# pins 2.78.0 (2.77 was checked before it).
CHECKED_BEAM = ((2, 77), (2, 78))
MODEL_MANAGER = "apache_beam.ml.inference.model_manager"
RUN_INFERENCE = "apache_beam.ml.inference.base"


def beam_minor(version: str) -> tuple[int, int]:
    """``"2.77.0"`` → ``(2, 77)``; a version that does not start with two numbers raises naming it."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"apache-beam version {version!r}: expected MAJOR.MINOR[.PATCH]") from None


def beam_version_problem(version: str, checked: tuple = CHECKED_BEAM) -> str | None:
    """Why ``version`` is not one the workarounds were checked for, or None when it is."""
    low, high = checked
    if low <= beam_minor(version) <= high:
        return None
    return (
        f"apache-beam {version} is outside the versions pipeline/compat.py was checked for "
        f"({'.'.join(map(str, low))}–{'.'.join(map(str, high))}): check that RunInference still imports "
        f"{MODEL_MANAGER} optionally and that the DirectRunner's is_interactive() still keeps it off Prism, "
        f"then widen CHECKED_BEAM (or pin apache-beam as pyproject.toml does)"
    )


def check_beam_version() -> None:
    """Log, once per process, a Beam version the workarounds were not checked for."""
    import apache_beam

    problem = beam_version_problem(apache_beam.__version__)
    if problem:
        log.warning("%s", problem)


def run_inference_without_model_manager() -> ModuleType:
    """RunInference's module (``apache_beam.ml.inference.base``), imported without its ModelManager.

    Needed since Beam 2.7x's RunInference module imports its ModelManager when it can, and that imports torch
    (1.4 s and ~300 MB on the 2-core test machine) wherever torch is installed. docbeam never uses it, and
    RunInference treats it as optional (an ImportError leaves it None). The same try block imports ``resource``
    first and sets it to None on that ImportError: it is given back, so RunInference still reports the
    process's memory. Patches nothing when RunInference is already imported (its choice is made).
    """
    if RUN_INFERENCE in sys.modules:
        return sys.modules[RUN_INFERENCE]
    check_beam_version()
    sys.modules.setdefault(MODEL_MANAGER, None)
    import resource

    import apache_beam.ml.inference.base as run_inference

    run_inference.resource = run_inference.resource or resource
    return run_inference


DIRECT_RUNNER = "apache_beam.runners.direct.direct_runner.DirectRunner"


def is_direct_runner(name: str) -> bool:
    """Whether Beam resolves ``runner.name`` to its DirectRunner (it ignores case and a trailing "Runner")."""
    return name.lower() in ("direct", "directrunner") or name == DIRECT_RUNNER


def runner_for(name: str):
    """The runner object for ``runner.name``, or None to let Beam resolve the name from the options.

    Needed since Beam 2.7x's DirectRunner first hands the pipeline to its Prism runner, which downloads a
    binary from GitHub on first use (``urlopen`` without a timeout: a firewalled network waits out TCP's
    connect timeout on every run) and, where it can, runs the job there: not the FnApiRunner docbeam's tests
    and in-process encoder loading (pipeline/driver/run.py) are checked on. ``is_interactive()``, the public
    switch Interactive Beam uses, is what turns Prism off; everything else about the DirectRunner stays."""
    if not is_direct_runner(name):
        return None
    from apache_beam.runners.direct.direct_runner import DirectRunner

    runner = DirectRunner()
    runner.is_interactive()
    return runner
