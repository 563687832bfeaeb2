"""The docbeam command as a scheduled job uses it: exit codes, overrides, messages for people."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_runner import run_docbeam
from conftest import REPO, checkout_env

LOCAL = os.path.join(REPO, "configs", "local.yaml")


def docbeam(*args, cwd=REPO) -> subprocess.CompletedProcess:
    """The real command in a fresh process: only for the end-to-end exit codes (0, 1, 2) a scheduler reads; every
    other test calls ``run_docbeam`` in this process."""
    return subprocess.run(
        [sys.executable, "-m", "docbeam", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=checkout_env(),
    )


def test_validate_prints_resolved_config_and_the_backend_for_every_bucket(tmp_path):
    result = run_docbeam("validate", "--config", LOCAL, "--set", "attention.backend=chunked", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"path: {os.path.join(REPO, 'data', 'sample')}" in result.stdout  # resolved against the config's folder
    assert "bucket    256 → chunked" in result.stdout
    assert "| cpu | `chunked`" in result.stdout  # flash on CPU: docbeam's chunked first (measured)


def test_run_docbeam_answers_as_the_command_and_leaves_this_process_as_it_was(tmp_path):
    """The in-process runner the other tests use: output and exit code captured, argparse's exit turned into a
    code, and the root logger's handlers, the folder, the environment and sys.argv restored after each call."""
    import logging

    root = logging.getLogger()
    handlers, folder, argv, env = list(root.handlers), os.getcwd(), list(sys.argv), dict(os.environ)
    for _ in range(2):  # a second call must not print through the first call's handlers
        result = run_docbeam(
            "validate",
            "--config",
            LOCAL,
            "--set",
            "batching.bucket_size=3",
            cwd=tmp_path,
            env={**os.environ, "DOCBEAM_RUNNER_PROBE": "1"},
        )
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("batching.bucket_size: unknown key (got 3)") == 1
        assert (root.handlers, os.getcwd(), sys.argv, dict(os.environ)) == (handlers, folder, argv, env)
    usage = run_docbeam("validate", cwd=tmp_path)
    assert usage.returncode == 2 and "the following arguments are required: --config" in usage.stderr


def test_validate_rejects_an_unknown_key_naming_it(tmp_path):
    # A subprocess on purpose: the one end-to-end check that a refusal reaches the shell as exit status 2.
    result = docbeam("validate", "--config", LOCAL, "--set", "batching.bucket_size=3")
    assert result.returncode == 2
    assert "batching.bucket_size: unknown key (got 3)" in result.stderr


def test_validate_fails_at_start_when_no_backend_can_run_a_bucket():
    result = run_docbeam(
        "validate", "--config", LOCAL, "--set", "attention.backend=flash", "--set", "attention.flash={kernel: cudnn}"
    )
    assert result.returncode == 2
    assert "cannot run bucket 128 (cpu, float32" in result.stderr and "attention.fallback" in result.stderr


@pytest.mark.slow
def test_run_commits_with_rejected_documents_within_the_allowed_fraction_and_fails_beyond_it(
    tmp_path, tiny_checkpoint_dir
):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"id": "a", "text": "hello world"}\n{"id": "b"}\n')
    out = tmp_path / "out"
    common = [
        "run",
        "--config",
        LOCAL,
        "--set",
        f"input.path={corpus}",
        "--set",
        f"output.path={out}",
        "--set",
        f"model.path={tiny_checkpoint_dir}",
    ]
    # `refused` runs in a subprocess on purpose: the end-to-end check that a failed run reaches the shell as exit
    # status 1 (a committed one reaching it as 0: transaction_test's live-run test, whose first run is a process).
    refused = docbeam(*common)  # 1 of 2 rejected: over the default input.max_rejected_fraction of 0.1
    assert refused.returncode == 1
    why, details = refused.stderr.strip().splitlines()  # the reason first and alone; no Beam traceback
    assert "1 of 2 documents were rejected (50.0%), more than input.max_rejected_fraction=0.1" in why
    assert why.startswith("docbeam: job failed, nothing committed")
    log_file = details.removeprefix("details and tracebacks: ").removesuffix(", or run again with --verbose")
    assert "Traceback (most recent call last)" in open(log_file).read()  # the details are kept, in the named file
    verbose = run_docbeam(*common, "--verbose")
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert not (out / "summary.json").exists()
    result = run_docbeam(*common, "--set", "input.max_rejected_fraction=0.5", "--", "--direct_num_workers=1")
    assert result.returncode == 0, result.stderr
    assert "documents  read 2, embedded 1, rejected 1" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected_by_kind"] == {"missing_text": 1}


def test_a_stride_as_long_as_the_window_fails_at_start_naming_the_key():
    result = run_docbeam("validate", "--config", LOCAL, "--set", "tokenize.stride=254")
    assert result.returncode == 2
    assert "tokenize.stride=254 must be smaller than a window's content (254 tokens" in result.stderr


def test_validate_names_a_backend_whose_capability_check_crashes_and_exits_2():
    result = run_docbeam(
        "validate", "--config", LOCAL, "--set", "attention.backend=tests.fixtures_bad_backends:attend_check_raises"
    )
    assert result.returncode == 2, result.stderr
    assert (
        "attention backend 'tests.fixtures_bad_backends:attend_check_raises': its capability check raised "
        "KeyError: 'sm_90'"
    ) in result.stderr


def test_validate_refuses_an_output_that_holds_someone_elses_files(tmp_path):
    (tmp_path / "thesis.pdf").write_bytes(b"years of work")
    result = run_docbeam("validate", "--config", LOCAL, "--set", f"output.path={tmp_path}")
    assert result.returncode == 2
    assert "holds 1 file(s) that no docbeam run wrote (e.g. thesis.pdf)" in result.stderr
    assert (tmp_path / "thesis.pdf").read_bytes() == b"years of work"


def test_validate_says_what_each_backend_would_do_if_chosen(tmp_path, monkeypatch):
    """With native packing (auto), a backend that takes no segment ids would simply run unpacked if chosen:
    validate must say so, not call it refused; with packing forced on it is refused, naming why."""
    from docbeam import config
    from docbeam.attention import registry
    from docbeam.attention.interface import Backend
    from docbeam.pipeline.tools import validate

    monkeypatch.setitem(
        registry._REGISTRY,
        "plain",
        Backend(name="plain", attend=lambda *a, **k: None, description="takes no segment ids"),
    )

    def line_of(name, *overrides):
        cfg = config.load(LOCAL, [f"output.path={tmp_path / 'out'}", *overrides])
        return next(line for line in validate.validation_report(cfg).splitlines() if line.startswith(f"  {name} "))

    assert "runs every bucket, unpacked (batching.packing: auto would resolve to false with it)" in line_of("plain")
    assert "runs every bucket, packed" in line_of("native")
    refused = line_of("plain", "batching.packing=true")
    assert "refused for bucket 128: it takes no segment ids" in refused and "set batching.packing: false" in refused


def folder_state(path) -> dict[str, bytes | None]:
    """Every entry under ``path``: a file's bytes, None for a folder."""
    return {
        os.path.relpath(os.path.join(root, name), path): (
            None if name in dirs else open(os.path.join(root, name), "rb").read()
        )
        for root, dirs, files in os.walk(path)
        for name in dirs + files
    }


def garbled_manifest(out):
    out.mkdir()
    (out / "_manifest.json").write_text('{"format": "docbeam.manifest/1", "run_id": ')  # a manifest cut mid-write


def lock_that_is_a_folder(out):
    (out / "_lock.json").mkdir(parents=True)


def output_below_a_file(out):
    out.write_text("a report someone saved where the output folder goes")
    return str(out / "daily")


START_REFUSALS = {  # what the output is made into, and what stderr must say
    "garbled manifest": (garbled_manifest, "_manifest.json is not JSON"),
    "_lock.json is a folder": (lock_that_is_a_folder, "taking its lock _lock.json: IsADirectoryError"),
    "output below a file": (output_below_a_file, "out/daily: taking its lock _lock.json"),
    "unwritable output": (lambda out: "/proc/docbeam-cannot-write-here", "/proc/docbeam-cannot-write-here"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", START_REFUSALS)
def test_whatever_refuses_a_run_at_start_exits_2_naming_it_and_touches_nothing(case, tmp_path, tiny_checkpoint_dir):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"id": "a", "text": "hello world"}\n')
    prepare, message = START_REFUSALS[case]
    out = tmp_path / "out"
    output_path = prepare(out) or str(out)
    before = folder_state(tmp_path)

    result = run_docbeam(
        "run",
        "--config",
        LOCAL,
        "--set",
        f"input.path={corpus}",
        "--set",
        f"output.path={output_path}",
        "--set",
        f"model.path={tiny_checkpoint_dir}",
    )
    assert result.returncode == 2, result.stderr
    [last] = result.stderr.strip().splitlines()[-1:]
    assert last.startswith("docbeam: cannot start: ") and message in last
    # UnusablePath (an OS error), or ConfigError where docbeam's own check names the file and field
    assert last.endswith(("(UnusablePath; nothing was touched)", "(ConfigError; nothing was touched)"))
    assert folder_state(tmp_path) == before


@pytest.mark.parametrize("count", ["-5", "0", "many"])
def test_propose_buckets_refuses_a_count_that_is_not_one_naming_the_option(count, capsys):
    from docbeam.pipeline.driver import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["propose-buckets", "--config", "configs/local.yaml", "--documents", count])
    assert exited.value.code == 2
    assert "argument --documents: expected a whole number above 0" in capsys.readouterr().err
