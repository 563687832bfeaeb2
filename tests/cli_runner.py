"""``docbeam`` in this process: what ``python -m docbeam`` would print and return, without paying a
fresh interpreter's 3-4 s of importing Beam and JAX per call (and with JAX's compile caches warm across calls).

A test keeps a real subprocess only where a separate process is the thing on trial: it is killed or signalled,
its exit status is read as a scheduler reads it, a library reads an environment variable at import time, or
what a fresh process imports is checked.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback

from conftest import REPO


@contextlib.contextmanager
def _environment(env: dict[str, str] | None):
    """``env`` replaces os.environ for the call (as subprocess's ``env=`` does), then the old one comes back."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _folder(cwd: str | os.PathLike):
    """The call runs in ``cwd``, which is also first on sys.path, as ``python -m`` puts it there (a backend named
    ``tests.fixtures_bad_backends:...`` is imported relative to it)."""
    before, path = os.getcwd(), list(sys.path)
    os.chdir(cwd)
    sys.path.insert(0, os.fspath(cwd))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path


@contextlib.contextmanager
def _logging_restored():
    """cli._setup_logging adds a log file and a console handler to the root logger and sets levels; the console
    handler holds this call's captured stream, which must not receive the next call's records."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    own = {name: logging.getLogger(name).level for name in ("docbeam",)}
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
        for name, own_level in own.items():
            logging.getLogger(name).setLevel(own_level)


def run_docbeam(
    *args: str, cwd: str | os.PathLike = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``docbeam *args`` run by ``docbeam.pipeline.driver.cli.main`` here: its stdout, stderr and exit code as a
    subprocess would give them (an uncaught exception: its traceback on stderr and code 1, as Python's)."""
    from docbeam.pipeline.driver import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    argv = list(sys.argv)
    sys.argv = ["docbeam", *args]
    try:
        with (
            _environment(env),
            _folder(cwd),
            _logging_restored(),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            try:
                code = cli.main(list(args)) or 0  # `sys.exit(main())`: None is 0
            except SystemExit as e:  # argparse's usage errors (2), --help (0), an explicit sys.exit
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except Exception:  # noqa: BLE001  what the interpreter would do with it
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["docbeam", *args], code, stdout.getvalue(), stderr.getvalue())
