"""Every shipped profile says, in its ``# plan:`` line, what it runs: the device, packed or unpacked rows, the
buckets and the backend and kernel of every bucket. The plan the driver resolves from the profile must be that
line, so a comment cannot outlive a change of the code under it (a kernel that starts taking segment ids turns
packing on and can move a bucket to another kernel); the README's backend table names the kernels the
accelerator profiles run. Each profile also plans, without refusal, on each of cpu, gpu and tpu. A multi-chip
profile's line also says its mesh and what each chip holds (the memory plan at start); the Qwen3-Embedding-8B
profile is planned from that model's config.json (tests/fixtures), since its 15 GB of weights are not here."""

from __future__ import annotations

import os
import re

import pytest

from docbeam import config
from docbeam.pipeline.driver.plan import make_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = (
    "local",
    "dataflow_cpu",
    "dataflow_gpu",
    "dataflow_gpu_2xl4",
    "dataflow_tpu",
    "dataflow_tpu_v6e",
    "dataflow_tpu_v5e_8",
)
QWEN3_8B = "dataflow_tpu_qwen3_8b"
QWEN3_8B_CONFIG = os.path.join(REPO, "data", "shapes", "qwen3-embedding-8b")  # its config.json, no weights
PLAN_LINE = re.compile(
    r"^# plan: (?P<device>\w+), (?P<rows>packed|unpacked), buckets \[(?P<buckets>[\d, ]+)\] "
    r"-> (?P<backend>\w+): (?P<kernel>[^;\n]+)(?:; mesh (?P<mesh>\{data: \d+, model: \d+\}), "
    r"(?P<per_chip>[\d.]+) GiB per chip)?$",
    re.M,
)
# How the README's backend table spells the kernels the accelerator profiles run.
README_NAMES = {"jax.nn.dot_product_attention[cudnn]": "cuDNN", "pallas.tpu.flash_attention": "Pallas flash"}


def stated_plan(text: str) -> dict:
    found = PLAN_LINE.findall(text)
    assert len(found) == 1, (
        "a profile has exactly one '# plan: <device>, packed|unpacked, buckets [..] -> <backend>: <kernel>' line"
    )
    device, rows, buckets, backend, kernel, mesh, per_chip = found[0]
    stated = {
        "device": device,
        "packed": rows == "packed",
        "buckets": [int(b) for b in buckets.split(",")],
        "backend": backend,
        "kernel": kernel.strip(),
    }
    return {**stated, "mesh": mesh, "per_chip": per_chip} if mesh else stated


def resolved_plan(path: str, sets: list[str] = ()) -> dict:
    cfg = config.load(path, list(sets))
    plan = make_plan(cfg, probe_backends=False, for_input=False, for_output=False)
    kernels = {stated_kernel(c) for c in plan.choices}
    assert len(kernels) == 1, f"{path}: its buckets run different kernels {sorted(kernels)}; one plan line per profile"
    ((backend, kernel),) = kernels
    return {
        "device": cfg.runner.device,
        "packed": plan.packing,
        "buckets": [c.case.seq_len for c in plan.choices],
        "backend": backend,
        "kernel": kernel,
        "platform": plan.platform,
        **mesh_facts(plan.memory),
    }


def stated_kernel(choice) -> tuple[str, str]:
    """How a plan line names a bucket's choice: backend and kernel, or auto's, measured on the worker's chip."""
    return ("auto", "measured on the worker") if choice.to_measure else (choice.backend, choice.kernel)


def mesh_facts(memory) -> dict:
    mesh = f"{{data: {memory.mesh.data}, model: {memory.mesh.model}}}"
    return {"mesh": mesh, "per_chip": f"{memory.needed_bytes / (1 << 30):.2f}"}


def qwen3_8b_plan(sets: list[str] = ()):
    """(config, choices, memory plan) of the Qwen3-Embedding-8B profile, planned as make_plan plans it, from the
    model's config.json (its weights, 15 GB, are not here to digest)."""
    from docbeam.attention.dispatch import choose_backends
    from docbeam.models.checkpoint import encoder_config
    from docbeam.models.encoder import attention_cases
    from docbeam.pipeline.driver.memory_at_start import memory_plan
    from docbeam.pipeline.driver.plan import resolved_packing, target_platform

    cfg = config.load(profile(QWEN3_8B), list(sets))
    encoder = encoder_config(QWEN3_8B_CONFIG, cfg.model.dtype, None)
    platform = target_platform(cfg)
    packed = resolved_packing(cfg)
    buckets = [b for b in cfg.batching.buckets if b <= cfg.model.max_seq_len]
    choices = choose_backends(cfg.attention, attention_cases(encoder, buckets, platform, packed))
    return cfg, choices, memory_plan(cfg, encoder, choices, platform)


def profile(name: str) -> str:
    return os.path.join(REPO, "configs", f"{name}.yaml")


@pytest.mark.parametrize("name", PROFILES)
def test_a_profiles_plan_line_is_the_plan_the_driver_resolves(name):
    with open(profile(name)) as f:
        stated = stated_plan(f.read())
    resolved = resolved_plan(profile(name))
    assert {k: resolved[k] for k in stated} == stated


def test_the_qwen3_8b_profiles_plan_line_is_its_plan_on_four_chips():
    with open(profile(QWEN3_8B)) as f:
        stated = stated_plan(f.read())
    cfg, choices, memory = qwen3_8b_plan()
    ((backend, kernel),) = {stated_kernel(c) for c in choices}
    resolved = {
        "device": cfg.runner.device,
        "packed": resolved_packing_of(cfg),
        "buckets": [c.case.seq_len for c in choices],
        "backend": backend,
        "kernel": kernel,
        **mesh_facts(memory),
    }
    assert resolved == stated


def resolved_packing_of(cfg) -> bool:
    from docbeam.pipeline.driver.plan import resolved_packing

    return resolved_packing(cfg)


def test_a_multi_chip_profile_names_its_mesh_in_its_plan_line():
    for name in ("dataflow_tpu_v5e_8", "dataflow_gpu_2xl4", QWEN3_8B):
        with open(profile(name)) as f:
            assert "mesh" in stated_plan(f.read()), name


def test_a_plan_line_that_disagrees_with_the_profile_is_caught(tmp_path):
    with open(profile("dataflow_gpu")) as f:
        text = f.read()
    # The profile before auto: flash packs by default, and packed rows leave cuDNN for tokamax.
    stale = text.replace("  packing: false", "  packing: auto").replace("backend: auto ", "backend: flash")
    (tmp_path / "dataflow_cpu.yaml").write_text(open(profile("dataflow_cpu")).read())
    (tmp_path / "local.yaml").write_text(open(profile("local")).read().replace("../data", f"{REPO}/data"))
    (tmp_path / "stale.yaml").write_text(stale)
    resolved = resolved_plan(str(tmp_path / "stale.yaml"))
    assert (resolved["packed"], resolved["kernel"]) == (True, "tokamax.triton")
    assert {k: resolved[k] for k in stated_plan(stale)} != stated_plan(stale)


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("device", ["cpu", "gpu", "tpu"])
def test_every_profile_plans_on_every_device_without_refusal(name, device):
    resolved = resolved_plan(profile(name), [f"runner.device={device}"])
    assert resolved["platform"] == device and resolved["buckets"]


def test_the_accelerator_profiles_measure_on_the_worker_and_local_keeps_native():
    for name in PROFILES + (QWEN3_8B,):
        cfg = config.load(profile(name), [])
        expected = ("native", None) if name in ("local", "dataflow_cpu") else ("auto", "native")
        assert (cfg.attention.backend, cfg.attention.fallback) == expected, name


def test_the_readme_names_the_kernels_auto_measures_first_on_the_accelerators():
    from docbeam.attention import flash

    with open(os.path.join(REPO, "README.md")) as f:
        flash_row = next(line for line in f if line.startswith("| `flash` |"))
    for platform in ("gpu", "tpu"):
        label = flash.KERNELS[flash.PLATFORM_KERNELS[platform][0]].label
        assert README_NAMES[label] in flash_row, (platform, label)
