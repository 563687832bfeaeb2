"""The one class that decides an exit code: whatever is refused before the pipeline starts is a ``Refused``.

``docbeam run`` exits 2 for a ``Refused`` (nothing was read, written or committed: fix the named thing and run
again) and 1 for any other failure (the job ran and failed; the previous output is unchanged). Every
start-time check raises a subclass (ConfigError, CheckpointError, AttentionPlanError, OutputRefused,
LockHeld, ...), so a new check gets exit 2 by choosing its base class, not by a list kept in the CLI.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import pydantic


class Refused(Exception):
    """The job cannot start as configured; the message names what to change. Exit 2, nothing touched."""


class ConfigError(Refused, ValueError):
    """A config that cannot run, with a message for the person who wrote it. Here, not in docbeam.config, so
    that a sink or a head can refuse a config without importing the config package that imports them."""


class UnusablePath(Refused):
    """A path the job must use at start gives an operating-system or format error (a file where a folder
    must be, a folder where a file must be, no permission, a damaged docbeam file)."""


class JobFailed(RuntimeError):
    """A start-time error raised after the pipeline started (a worker that could not load the checkpoint):
    the job ran, so it is a failure (exit 1), not a refusal."""


@contextlib.contextmanager
def refused_at_start(what: str) -> Iterator[None]:
    """Turns the OS's and the parsers' errors inside a start-time step into a ``Refused`` naming ``what``
    (e.g. "output.path out/daily"), since only the step knows which setting the error is about."""
    try:
        yield
    except Refused:
        raise
    except (OSError, ValueError) as e:  # RecursionError and others are bugs, not refusals: they stay exit 1
        raise UnusablePath(f"{what}: {type(e).__name__}: {e}; fix or remove it, or choose another path") from e


def readable(error: pydantic.ValidationError, prefix: str = "") -> str:
    """pydantic's errors as one line each naming the key, what is wrong and the value given, since its own
    text names the model's internals. Here, beside ConfigError, so that attention/ and the sinks word a section's
    errors as the config does without importing it."""
    lines = []
    for e in error.errors():
        key = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown key"
        if e["type"] == "value_error" and message.startswith(f"{key}."):
            lines.append(message)  # a check on the whole section that names the key itself
            continue
        lines.append(
            f"{key}: {message} (got {e['input']!r})" if e["type"] != "missing" else f"{key}: required, but missing"
        )
    return "; ".join(lines)
