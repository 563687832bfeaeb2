"""``docbeam run --dry-run``: every shipped profile builds its Dataflow job offline, against the GCS emulator.

Beam's DataflowRunner with ``--dry_run=True`` translates the graph, pickles every DoFn and resolves the
environment without submitting; these tests assert what the job would ask Dataflow for.
"""
from __future__ import annotations

import os

import pytest

from gcs_emulator import gcs_emulator
from pipeline import cli, config
from pipeline.config import ConfigError
from pipeline.dry_run import dry_run

pytestmark = pytest.mark.gcs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER_BUCKET = "my-docbeam-bucket"  # the profiles' temp, staging, input and output bucket
IMAGES = "us-central1-docker.pkg.dev/my-docbeam-project/docbeam"
EXPECTED = {
    "dataflow_cpu": ("cpu", f"{IMAGES}/worker-cpu:0.1.0", "n2-standard-8", None),
    "dataflow_tpu": ("tpu", f"{IMAGES}/worker-tpu:0.1.0", "ct5lp-hightpu-1t",
                     "worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1"),
    "dataflow_tpu_v6e": ("tpu", f"{IMAGES}/worker-tpu:0.1.0", "ct6e-standard-1t",
                         "worker_accelerator=type:tpu-v6e-slice;topology:1x1"),
    "dataflow_gpu": ("gpu", f"{IMAGES}/worker-gpu:0.1.0", "g2-standard-4",
                     "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"),
}


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator(bucket=PLACEHOLDER_BUCKET) as gcs:
        yield gcs


def profile(name: str) -> str:
    return os.path.join(REPO, "configs", f"{name}.yaml")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_profile_as_shipped_builds_its_dataflow_job_and_touches_no_storage(name, emulator):
    platform, image, machine, accelerator = EXPECTED[name]
    result = dry_run(config.load(profile(name)))

    assert result.platform == platform
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
    assert result.steps > 50 and result.pickled_dofns > 20
    assert list(emulator.client.list_blobs(PLACEHOLDER_BUCKET)) == [], "a dry run wrote to storage"


def test_accelerator_profiles_plan_flash_for_the_workers_platform_not_the_drivers(emulator):
    tpu = dry_run(config.load(profile("dataflow_tpu")))
    gpu = dry_run(config.load(profile("dataflow_gpu")))
    assert all("pallas.tpu" in choice for choice in tpu.attention.values()), tpu.attention
    assert all(choice.startswith("flash") for choice in gpu.attention.values()), gpu.attention


def test_the_command_prints_the_options_by_beams_names_and_exits_0(emulator, capsys):
    code = cli.main(["run", "--config", profile("dataflow_tpu"), "--dry-run",
                     "--set", "runner.options.project=another-project"])
    out = capsys.readouterr().out
    assert code == 0, out
    for line in ("  project: another-project", "  machine_type: ct5lp-hightpu-1t",
                 f"  sdk_container_image: {IMAGES}/worker-tpu:0.1.0",
                 "  dataflow_service_options: ['worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1']",
                 "  experiments: ['use_multiple_sdk_containers']"):
        assert line in out.splitlines(), f"{line!r} not in:\n{out}"
    assert "not submitted" in out and "pickled DoFns" in out


def test_a_dry_run_needs_the_dataflow_runner():
    cfg = config.load(os.path.join(REPO, "configs", "local.yaml"))
    with pytest.raises(ConfigError, match=r"--dry-run builds a Dataflow job, but runner.name is 'DirectRunner'"):
        dry_run(cfg)


def test_options_dataflow_refuses_are_a_config_error(emulator):
    cfg = config.load(profile("dataflow_cpu"), ["runner.options.project=My Project"])
    with pytest.raises(ConfigError, match=r"runner.options: Dataflow refuses these options: .*Invalid Project ID \(My Project\)"):
        dry_run(cfg)
