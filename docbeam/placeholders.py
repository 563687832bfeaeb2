"""Every placeholder a config may hold, and the one way each is filled or refused.

Two kinds, kept together because each launcher (``docbeam run``, ``run --dry-run``, ``validate
--for-launch``, the Flex Template launcher) handles both in the same order: fill the path placeholders
(``expand``), then refuse the profiles' stand-in names (``refuse``). Before, each launcher repeated that
pair, and a new placeholder meant finding all four.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from docbeam.errors import ConfigError

# docbeam.config.JobConfig, which imports this module (its paths may hold PATH_PLACEHOLDERS): not
# imported back, since the import graph has no loops (tests/import_graph_test.py).
JobConfig = Any

# Path placeholders, filled once per run on the driver, so daily runs land side by side.
RUN_DATE, PREVIOUS_RUN_DATE, RUN_ID = "{run_date}", "{previous_run_date}", "{run_id}"
PATH_PLACEHOLDERS = (RUN_DATE, PREVIOUS_RUN_DATE, RUN_ID)

# The shipped Dataflow profiles are runnable in form only: these names stand for the user's own. A job
# launched with them would pull an image nobody built and write to a bucket nobody owns (or someone else's).
PROFILE_PLACEHOLDERS = {"my-docbeam-project": "project", "my-docbeam-bucket": "bucket"}
# Key -> how to replace it: on the command line, and in a Flex Template launch (README "Running on Dataflow").
LAUNCH_KEYS = {
    "runner.options.project": ("YOUR_PROJECT", "the launch's project"),
    "runner.options.temp_location": ("gs://YOUR_BUCKET/dataflow/temp", "environment.tempLocation"),
    "runner.options.staging_location": ("gs://YOUR_BUCKET/dataflow/staging", "environment.stagingLocation"),
    "runner.options.sdk_container_image": (
        "REGION-docker.pkg.dev/YOUR_PROJECT/docbeam/worker-tpu:0.1.0",
        "environment.sdkContainerImage",
    ),
    "runner.options.service_account_email": (
        "docbeam-worker@YOUR_PROJECT.iam.gserviceaccount.com",
        "environment.serviceAccountEmail",
    ),
    "input.path": (f"gs://YOUR_BUCKET/corpus/{RUN_DATE}/*.jsonl.gz", "template parameter input"),
    "input.reuse_from": (f"gs://YOUR_BUCKET/runs/{PREVIOUS_RUN_DATE}", "template parameter overrides"),
    "output.path": (f"gs://YOUR_BUCKET/runs/{RUN_DATE}", "template parameter output"),
    "runner.compilation_cache": ("gs://YOUR_BUCKET/jax-cache/tpu-v5e", "template parameter compilation_cache"),
}
DATAFLOW = "DataflowRunner"


def without_path_placeholders(path: str) -> str:
    """``path`` with its path placeholders removed: what is left must still be a plain path."""
    for placeholder in PATH_PLACEHOLDERS:
        path = path.replace(placeholder, "")
    return path


def fill(path: str | None, run_id: str, run_date: str) -> str | None:
    """``{run_date}`` (UTC, YYYY-MM-DD), ``{previous_run_date}`` (the day before: where yesterday's run of a
    daily schedule wrote, for ``input.reuse_from``) and ``{run_id}`` in ``path``."""
    if path is None:
        return None
    previous = (datetime.date.fromisoformat(run_date) - datetime.timedelta(days=1)).isoformat()
    values = {RUN_DATE: run_date, PREVIOUS_RUN_DATE: previous, RUN_ID: run_id}
    for placeholder in PATH_PLACEHOLDERS:
        path = path.replace(placeholder, values[placeholder])
    return path


def expand(cfg: JobConfig, run_id: str, run_date: str) -> JobConfig:
    """The path placeholders of input, output and reuse paths filled, once per run."""
    inputs = cfg.input.model_copy(
        update={
            "path": fill(cfg.input.path, run_id, run_date),
            "reuse_from": fill(cfg.input.reuse_from, run_id, run_date),
        }
    )
    return cfg.model_copy(
        update={
            "input": inputs,
            "output": cfg.output.model_copy(update={"path": fill(cfg.output.path, run_id, run_date)}),
        }
    )


def beam_options_of(cfg: JobConfig, extra_beam_args: Sequence[str] = ()) -> dict[str, object]:
    """Beam's view of the profile's options followed by ``extra_beam_args`` (later flags win, as in a run)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    return PipelineOptions([*cfg.runner.beam_args(), *extra_beam_args]).get_all_options(retain_unknown_options=True)


def launch_values(cfg: JobConfig, beam_options: Mapping[str, object]) -> dict[str, object]:
    """What a launch would use for each of LAUNCH_KEYS: docbeam's own keys from ``cfg``, Beam's from
    ``beam_options`` (Beam's names), which hold the profile's options overridden by the launch's."""
    values = {
        "input.path": cfg.input.path,
        "input.reuse_from": cfg.input.reuse_from,
        "output.path": cfg.output.path,
        "runner.compilation_cache": cfg.runner.compilation_cache,
    }
    for key in LAUNCH_KEYS:
        if key.startswith("runner.options."):
            values[key] = beam_options.get(key.removeprefix("runner.options."))
    return values


def problems(runner: str, values: Mapping[str, object]) -> list[str]:
    """One line per value a launch must not carry: a profile placeholder, or (on Dataflow) no worker image."""
    found_problems = []
    for key, value in values.items():
        found = [(marker, what) for marker, what in PROFILE_PLACEHOLDERS.items() if value and marker in str(value)]
        if found:
            marker, what = found[0]
            example, in_launch = LAUNCH_KEYS[key]
            found_problems.append(
                f"{key} is {value!r}: {marker!r} is the profiles' placeholder {what}; set yours "
                f"(--set {key}={example}, or in a Flex Template launch: {in_launch})"
            )
    if runner == DATAFLOW and not values.get("runner.options.sdk_container_image"):
        example, in_launch = LAUNCH_KEYS["runner.options.sdk_container_image"]
        found_problems.append(
            "runner.options.sdk_container_image is not set: Dataflow workers would run Beam's "
            f"default image, which lacks docbeam (--set runner.options.sdk_container_image="
            f"{example}, or in a Flex Template launch: {in_launch})"
        )
    return found_problems


def refuse(cfg: JobConfig, beam_options: Mapping[str, object]) -> None:
    """Raises ConfigError (exit 2) naming each profile placeholder a launch of ``cfg`` with ``beam_options``
    (Beam's names, e.g. from ``beam_options_of``) would carry."""
    found = problems(cfg.runner.name, launch_values(cfg, beam_options))
    if found:
        raise ConfigError("this job would launch on placeholders:\n  " + "\n  ".join(found))
