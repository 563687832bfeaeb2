"""docbeam/config/files.py: a profile extends a base; what it may add, what it may not, and where paths point."""

from __future__ import annotations

import os
import textwrap

import pytest

from docbeam import config, placeholders

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = ("dataflow_cpu", "dataflow_tpu", "dataflow_tpu_v6e", "dataflow_gpu")


def write(folder, name: str, text: str) -> str:
    path = os.path.join(str(folder), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


BASE = """\
    input: {path: corpus/*.jsonl}
    output: {path: out/local}
    batching: {buckets: [64, 128, 256], tokens_per_batch: 2048}
    runner: {options: {direct_num_workers: 1}}
    """


def test_a_profile_changes_only_what_it_names_and_sections_merge_key_by_key(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(
        tmp_path,
        "child.yaml",
        """\
        extends: base.yaml
        batching: {tokens_per_batch: 4096}
        runner: {name: DataflowRunner, options: {project: my-project}}
        """,
    )
    cfg = config.load(child)
    assert cfg.batching.buckets == (64, 128, 256) and cfg.batching.tokens_per_batch == 4096
    assert cfg.runner.name == "DataflowRunner"
    assert cfg.runner.options == {"direct_num_workers": 1, "project": "my-project"}


def test_a_list_replaces_the_bases_list(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nbatching: {buckets: [512]}\n")
    assert config.load(child).batching.buckets == (512,)


def test_relative_paths_resolve_against_the_file_that_sets_them(tmp_path):
    write(tmp_path, "configs/base.yaml", BASE)
    child = write(
        tmp_path,
        "profiles/child.yaml",
        """\
        extends: ../configs/base.yaml
        output: {path: runs/today}
        runner: {compilation_cache: cache/jax}
        """,
    )
    cfg = config.load(child)
    assert cfg.input.path == str(tmp_path / "configs" / "corpus" / "*.jsonl")
    assert cfg.output.path == str(tmp_path / "profiles" / "runs" / "today")
    assert cfg.runner.compilation_cache == str(tmp_path / "profiles" / "cache" / "jax")


def test_set_overrides_apply_after_the_merge(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nrunner: {options: {project: placeholder}}\n")
    cfg = config.load(child, ["runner.options.project=real-project", "output.path=gs://b/runs/x"])
    assert cfg.runner.options["project"] == "real-project" and cfg.output.path == "gs://b/runs/x"


def test_a_chain_of_three_files_merges_in_order(tmp_path):
    write(tmp_path, "a.yaml", BASE)
    write(tmp_path, "b.yaml", "extends: a.yaml\nbatching: {tokens_per_batch: 4096}\nmodel: {dtype: bfloat16}\n")
    c = write(tmp_path, "c.yaml", "extends: b.yaml\nbatching: {tokens_per_batch: 8192}\n")
    cfg = config.load(c)
    assert cfg.batching.tokens_per_batch == 8192 and cfg.model.dtype == "bfloat16"


def test_a_missing_base_is_named_with_where_it_was_looked_for(tmp_path):
    child = write(tmp_path, "child.yaml", "extends: nowhere.yaml\n")
    with pytest.raises(config.ConfigError, match=r"child.yaml: extends: 'nowhere.yaml' is not a file .*nowhere.yaml"):
        config.load(child)


def test_a_cycle_is_refused_and_shown(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    b = write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(config.ConfigError, match=r"extends forms a cycle \(.*b.yaml -> .*a.yaml -> .*b.yaml\)"):
        config.load(b)


def test_a_key_neither_the_base_nor_the_schema_knows_is_named_with_the_file(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nbatching: {bukets: [64]}\n")
    with pytest.raises(
        config.ConfigError,
        match=r"child.yaml: batching.bukets: unknown key .*base.yaml does not "
        r"have it.*keys of batching: buckets, tokens_per_batch, shards",
    ):
        config.load(child)


def test_a_key_the_schema_knows_may_be_added_even_if_the_base_leaves_it_out(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nmodel: {dtype: bfloat16}\nrunner: {device: tpu}\n")
    cfg = config.load(child)
    assert cfg.model.dtype == "bfloat16" and cfg.runner.device == "tpu"


def test_a_section_replaced_by_a_scalar_is_a_conflict(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nbatching: 4096\n")
    with pytest.raises(config.ConfigError, match=r"child.yaml: batching: 4096 would replace a section"):
        config.load(child)


def test_extends_must_name_a_file(tmp_path):
    child = write(tmp_path, "child.yaml", "extends: [a.yaml]\n")
    with pytest.raises(config.ConfigError, match=r"extends: expected the path of a base config file"):
        config.load(child)


@pytest.mark.parametrize("name", PROFILES)
def test_every_shipped_profile_validates_and_starts_with_its_command(name):
    path = os.path.join(REPO, "configs", f"{name}.yaml")
    with open(path) as f:
        assert f.readline().startswith(f"# docbeam run --config configs/{name}.yaml")
    cfg = config.load(path)
    assert cfg.runner.name == "DataflowRunner"
    assert cfg.output.path.startswith("gs://") and "{run_date}" in cfg.output.path
    assert cfg.runner.options["sdk_container_image"].endswith(":0.1.0")


@pytest.mark.parametrize(
    "name, device", [("dataflow_tpu", "tpu"), ("dataflow_tpu_v6e", "tpu"), ("dataflow_gpu", "gpu")]
)
def test_accelerator_profiles_use_bfloat16_and_the_kernel_measured_on_the_worker(name, device):
    cfg = config.load(os.path.join(REPO, "configs", f"{name}.yaml"))
    assert (cfg.model.dtype, cfg.attention.backend, cfg.attention.fallback, cfg.attention.candidates) == (
        "bfloat16",
        "auto",
        "native",
        None,  # every backend and flash kernel, held to native before it is timed
    )
    assert cfg.runner.device == device and cfg.runner.one_model_per_vm


def test_placeholders_in_paths_are_filled_once_per_run():
    cfg = config.parse(
        {"input": {"path": "gs://b/corpus/{run_date}/*.jsonl"}, "output": {"path": "gs://b/runs/{run_date}/{run_id}"}},
        base_dir="/base",
    )
    filled = placeholders.expand(cfg, "20261130T114500Z-3f9a1c", "2026-11-30")
    assert filled.input.path == "gs://b/corpus/2026-11-30/*.jsonl"
    assert filled.output.path == "gs://b/runs/2026-11-30/20261130T114500Z-3f9a1c"


def test_a_daily_job_reuses_yesterdays_output_through_previous_run_date():
    cfg = config.parse(
        {
            "input": {"path": "gs://b/corpus/{run_date}/*.jsonl", "reuse_from": "gs://b/runs/{previous_run_date}"},
            "output": {"path": "gs://b/runs/{run_date}"},
        },
        base_dir="/base",
    )
    filled = placeholders.expand(cfg, "20260301T020000Z-3f9a1c", "2026-03-01")
    assert filled.input.reuse_from == "gs://b/runs/2026-02-28" and filled.output.path == "gs://b/runs/2026-03-01"


def test_other_braces_in_the_output_path_are_still_refused():
    with pytest.raises(config.ConfigError, match=r"output.path: must be one folder.*\{run_date\}"):
        config.parse({"input": {"path": "a"}, "output": {"path": "gs://b/{day}"}}, base_dir="/base")


def test_a_profile_whose_output_is_the_home_folder_is_still_refused(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\noutput: {path: '~'}\n")
    with pytest.raises(config.ConfigError, match=r"output.path: must name a folder"):
        config.load(child)


def test_a_path_set_on_the_command_line_stays_the_string_typed(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    with pytest.raises(config.ConfigError, match=r"output.path: must name a folder"):
        config.load(str(tmp_path / "base.yaml"), ["output.path=~"])
    cfg = config.load(str(tmp_path / "base.yaml"), ["output.path=/runs/2026-11-30"])
    assert cfg.output.path == "/runs/2026-11-30"
