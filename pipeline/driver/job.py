"""``docbeam.run``: what ``docbeam run`` does, from Python, with whatever form of config the caller has.

The command line loads its YAML and calls ``run`` with the JobConfig, so the two cannot differ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from docbeam import config as config_lib
from docbeam.config import JobConfig
from docbeam.config import files as config_files

JOB_FORMS = "a JobConfig, the path of a YAML job file, or a dict of its sections (input, output, model, ...)"


def job_config(config, overrides: Sequence[str] = ()) -> JobConfig:
    """``config`` in any of JOB_FORMS, with ``overrides`` (``key.path=value``, as ``--set``) applied, validated
    as ``docbeam run`` validates it. A dict's relative paths are relative to the current folder; a file's, to
    the file."""
    if isinstance(config, (str, os.PathLike)):
        return config_lib.load(os.fspath(config), list(overrides))
    if isinstance(config, JobConfig):
        if not overrides:
            return config
        config = config.model_dump(mode="json")
    if isinstance(config, Mapping):
        raw = config_files.apply_overrides(dict(config), list(overrides))
        return config_lib.parse(raw, base_dir=os.getcwd())
    raise TypeError(f"docbeam.run(config): config must be {JOB_FORMS}; got a {type(config).__name__}")


def run(
    config,
    *,
    overrides: Sequence[str] = (),
    beam_args: Sequence[str] = (),
    force: bool = False,
    wait: bool = True,
    process_started: float | None = None,
) -> dict:
    """Runs the job to completion and returns its summary (summary.json's content), as ``docbeam run``.

    ``beam_args``: extra Beam pipeline options (``["--direct_num_workers=2"]``); ``force``: take over the output's
    lock; ``wait=False``: return once the job is submitted. Raises ``docbeam.errors.Refused`` (e.g.
    ConfigError) when the job cannot start (nothing was touched), any other error when it ran and failed
    (nothing was committed: the previous output is unchanged)."""
    from docbeam.pipeline.driver.run import run_job

    return run_job(
        job_config(config, overrides), list(beam_args), force=force, wait=wait, process_started=process_started
    )
