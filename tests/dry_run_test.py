"""``docbeam run --dry-run`` and ``docbeam validate --for-launch``: every shipped profile, with the user's own
project, buckets and image, builds its Dataflow job offline against the GCS emulator; as shipped, on its
placeholders, it is refused.

Beam's DataflowRunner with ``--dry_run=True`` translates the graph, pickles every DoFn and adds its own options
without submitting; these tests assert what the job would ask Dataflow for.
"""

from __future__ import annotations

import os
import re

import pytest
from gcs_emulator import gcs_emulator

from docbeam import config, placeholders
from docbeam.config import ConfigError
from docbeam.pipeline.driver import cli
from docbeam.pipeline.driver.dry_run import dry_run
from docbeam.pipeline.store import output

pytestmark = pytest.mark.gcs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "acme-embeddings"  # the user's own bucket (the emulator's)
PROJECT = "acme-prod"
IMAGES = f"us-central1-docker.pkg.dev/{PROJECT}/docbeam"
EXPECTED = {
    "dataflow_cpu": ("cpu", f"{IMAGES}/worker-cpu:0.1.0", "n2-standard-8", None),
    "dataflow_tpu": (
        "tpu",
        f"{IMAGES}/worker-tpu:0.1.0",
        "ct5lp-hightpu-1t",
        "worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1",
    ),
    "dataflow_tpu_v6e": (
        "tpu",
        f"{IMAGES}/worker-tpu:0.1.0",
        "ct6e-standard-1t",
        "worker_accelerator=type:tpu-v6e-slice;topology:1x1",
    ),
    "dataflow_gpu": (
        "gpu",
        f"{IMAGES}/worker-gpu:0.1.0",
        "g2-standard-4",
        "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver",
    ),
    "dataflow_tpu_v5e_8": (
        "tpu",
        f"{IMAGES}/worker-tpu:0.1.0",
        "ct5lp-hightpu-8t",
        "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4",
    ),
    "dataflow_gpu_2xl4": (
        "gpu",
        f"{IMAGES}/worker-gpu:0.1.0",
        "g2-standard-24",
        "worker_accelerator=type:nvidia-l4;count:2;install-nvidia-driver",
    ),
}
# The multi-chip profiles' meshes, as the memory plan resolves them on the worker's chips.
MESHES = {
    "dataflow_tpu_v5e_8": "{data: 8, model: 1}",
    "dataflow_gpu_2xl4": "{data: 2, model: 1}",
}
# What Beam's DataflowRunner adds to every job (Runner v2): absent from the profile, present in the request.
RUNNER_ADDS = ("beam_fn_api", "use_unified_worker", "use_runner_v2", "use_portable_job_submission")


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator(bucket=BUCKET) as gcs:
        yield gcs


def profile(name: str) -> str:
    return os.path.join(REPO, "configs", f"{name}.yaml")


def own_values(image: str, *, leave: str = "") -> list[str]:
    """--set values replacing every placeholder of a profile, as a user launching it would (except ``leave``)."""
    values = {
        "runner.options.project": PROJECT,
        "runner.options.temp_location": f"gs://{BUCKET}/dataflow/temp",
        "runner.options.staging_location": f"gs://{BUCKET}/dataflow/staging",
        "runner.options.sdk_container_image": image,
        "input.path": f"gs://{BUCKET}/corpus/{{run_date}}/*.jsonl.gz",
        "output.path": f"gs://{BUCKET}/runs/{{run_date}}",
        "runner.compilation_cache": f"gs://{BUCKET}/jax-cache/x",
    }
    return [f"{k}={v}" for k, v in values.items() if k != leave]


def set_args(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_profile_with_the_users_values_builds_its_dataflow_job_and_touches_no_storage(name, emulator):
    platform, image, machine, accelerator = EXPECTED[name]
    result = dry_run(config.load(profile(name), own_values(image)))

    assert result.platform == platform
    assert result.options["project"] == PROJECT
    assert result.options["sdk_container_image"] == image
    assert result.worker_pool["worker_harness_container_image"] == image
    assert result.worker_pool["sdk_harness_container_images"] == [image]
    assert result.options["machine_type"] == result.worker_pool["machine_type"] == machine
    assert list(result.service_options) == ([accelerator] if accelerator else [])
    assert result.worker_pool["max_num_workers"] == result.options["max_num_workers"] > 0
    assert result.worker_pool["disk_size_gb"] == 50
    # Several SDK processes per VM (Beam's default): why the accelerator profiles share one encoder.
    assert "use_multiple_sdk_containers" in result.experiments
    assert "no_use_multiple_sdk_containers" not in result.experiments
    # The request carries what the runner added, not only what the profile asked for.
    assert set(RUNNER_ADDS) <= set(result.experiments) == set(result.options["experiments"])
    assert result.steps > 50 and result.pickled_dofns > 20
    assert list(emulator.client.list_blobs(BUCKET)) == [], "a dry run wrote to storage"
    assert result.memory.startswith(f"mesh {MESHES.get(name, '{data: 1, model: 1}')}: per chip")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_profile_as_shipped_is_refused_naming_every_placeholder(name):
    with pytest.raises(ConfigError, match="would launch on placeholders") as refused:
        dry_run(config.load(profile(name)))
    for key in (
        "runner.options.project",
        "runner.options.temp_location",
        "runner.options.staging_location",
        "runner.options.sdk_container_image",
        "input.path",
        "output.path",
        "runner.compilation_cache",
    ):
        assert f"\n  {key} is '" in str(refused.value), f"{key} not refused:\n{refused.value}"


def test_every_value_the_profiles_mark_as_placeholder_is_one_the_check_knows():
    marked = [
        m.group(1) for name in EXPECTED for m in re.finditer(r":\s*(\S+)\s*#\s*placeholder", open(profile(name)).read())
    ]
    assert len(marked) >= 8, marked
    assert all(any(p in value for p in placeholders.PROFILE_PLACEHOLDERS) for value in marked), marked


def test_the_command_prints_the_submitted_options_and_resolved_paths_and_exits_0(emulator, capsys):
    today = output.run_date()
    code = cli.main(
        ["run", "--config", profile("dataflow_tpu"), "--dry-run", *set_args(own_values(f"{IMAGES}/worker-tpu:0.1.0"))]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    if output.run_date() != today:  # midnight UTC passed while it ran
        pytest.skip("the UTC date changed during the dry run")
    experiments = "['" + "', '".join([*RUNNER_ADDS, "use_multiple_sdk_containers"]) + "']"
    for line in (
        f"  project: {PROJECT}",
        "  machine_type: ct5lp-hightpu-1t",
        f"  sdk_container_image: {IMAGES}/worker-tpu:0.1.0",
        "  dataflow_service_options: ['worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1']",
        f"  experiments: {experiments}",
        f"  input.path: gs://{BUCKET}/corpus/{today}/*.jsonl.gz",
        f"  output.path: gs://{BUCKET}/runs/{today}",
        f"  runner.compilation_cache: gs://{BUCKET}/jax-cache/x",
    ):
        assert line in out.splitlines(), f"{line!r} not in:\n{out}"
    assert "not submitted" in out and "pickled DoFns" in out


def test_a_placeholder_project_alone_exits_2_naming_the_key_the_value_and_the_fix(emulator, capsys):
    code = cli.main(
        [
            "run",
            "--config",
            profile("dataflow_tpu"),
            "--dry-run",
            *set_args(own_values(f"{IMAGES}/worker-tpu:0.1.0", leave="runner.options.project")),
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    (problem,) = [line for line in captured.err.splitlines() if line.startswith("  ")]
    assert problem.startswith("  runner.options.project is 'my-docbeam-project'")
    assert "--set runner.options.project=" in problem


def test_launch_options_after_the_profiles_replace_its_placeholders(emulator):
    cfg = config.load(profile("dataflow_cpu"), own_values(f"{IMAGES}/worker-cpu:0.1.0", leave="runner.options.project"))
    assert dry_run(cfg, [f"--project={PROJECT}"]).options["project"] == PROJECT


def test_a_dataflow_job_without_a_worker_image_is_refused():
    cfg = config.load(profile("dataflow_cpu"), own_values("unused"))
    options = {k: v for k, v in cfg.runner.options.items() if k != "sdk_container_image"}
    cfg = cfg.model_copy(update={"runner": cfg.runner.model_copy(update={"options": options})})
    with pytest.raises(
        ConfigError,
        match=r"\n  runner.options.sdk_container_image is not set: Dataflow workers "
        r"would run Beam's default image",
    ):
        dry_run(cfg)


def test_validate_for_launch_refuses_placeholders_for_a_ci_step(capsys):
    code = cli.main(["validate", "--config", profile("dataflow_cpu"), "--for-launch"])
    captured = capsys.readouterr()
    assert code == 2 and "runner.options.project is 'my-docbeam-project'" in captured.err
    sample = os.path.join(REPO, "data", "sample", "*.jsonl.gz")
    code = cli.main(
        [
            "validate",
            "--config",
            profile("dataflow_cpu"),
            "--for-launch",
            *set_args([*own_values(f"{IMAGES}/worker-cpu:0.1.0"), f"input.path={sample}"]),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "# launch: no placeholder in runner.options.project" in out


def test_a_real_run_on_a_profile_as_shipped_is_refused_before_it_touches_anything(tmp_path, capsys):
    """A scheduler that calls `docbeam run` (no dry run, no Flex Template) on a shipped profile must not
    launch workers that write the placeholder bucket."""
    code = cli.main(["run", "--config", profile("dataflow_cpu"), "--set", f"output.path={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    assert code == 2 and "runner.options.project is 'my-docbeam-project'" in captured.err
    assert not (tmp_path / "out").exists()


def test_a_dry_run_needs_the_dataflow_runner():
    cfg = config.load(os.path.join(REPO, "configs", "local.yaml"))
    with pytest.raises(ConfigError, match=r"--dry-run builds a Dataflow job, but runner.name is 'DirectRunner'"):
        dry_run(cfg)


def test_options_dataflow_refuses_are_a_config_error(emulator):
    cfg = config.load(
        profile("dataflow_cpu"), [*own_values(f"{IMAGES}/worker-cpu:0.1.0"), "runner.options.project=My Project"]
    )
    with pytest.raises(
        ConfigError, match=r"runner.options: Dataflow refuses these options: .*Invalid Project ID \(My Project\)"
    ):
        dry_run(cfg)


def test_a_deduplicating_job_builds_for_dataflow_with_every_method_and_touches_no_storage(emulator):
    """output.dedup's steps (GroupByKeys, a side-input fit, combines) translate and pickle for Dataflow, as the
    DirectRunner and the portable runner run them (tests/dedup_run_test.py, tests/portable_test.py)."""
    image = EXPECTED["dataflow_cpu"][1]
    plain = dry_run(config.load(profile("dataflow_cpu"), own_values(image)))
    methods = ["output.dedup.exact=true", "output.dedup.near.threshold=0.8", "output.dedup.semantic.eps=0.05"]
    dedup = dry_run(config.load(profile("dataflow_cpu"), own_values(image) + methods))
    assert dedup.steps > plain.steps + 20 and dedup.pickled_dofns > plain.pickled_dofns
    assert list(emulator.client.list_blobs(BUCKET)) == [], "a dry run wrote to storage"
