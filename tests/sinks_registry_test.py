"""A sink is one plug-in (pipeline/sinks/): the registry refuses a key twice, output's sections and the CLI's sink
commands come from it, the code outside the sinks' folder names no sink, and the driver and the CLI treat every
sink's hooks alike (its command's refusal and failure, its summary line, its failure after the commit). The loads
themselves are tested against Postgres in tests/pgvector_test.py."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from docbeam import config
from docbeam.pipeline import sinks
from docbeam.pipeline.driver import cli
from docbeam.pipeline.sinks.pgvector.load import PostgresBehind
from docbeam.pipeline.sinks.pgvector.rows import table_layout
from docbeam.pipeline.store.output import EMBEDDINGS, SCORES


def test_a_sink_key_registered_twice_is_refused():
    @sinks.register("test_sink")
    class First(sinks.Sink):
        section = sinks.SinkSection

    try:
        with pytest.raises(ValueError, match="'test_sink' is registered already"):
            sinks.register("test_sink")(type("Second", (sinks.Sink,), {"section": sinks.SinkSection}))
        assert sinks.SINKS["test_sink"].key == "test_sink" and isinstance(sinks.SINKS["test_sink"], First)
    finally:
        del sinks.SINKS["test_sink"]


def code_files_outside_the_sinks():
    for top in ("pipeline", "models", "attention", "docbeam"):
        for folder, _, names in os.walk(os.path.join(REPO, top)):
            if os.path.relpath(folder, REPO).replace(os.sep, "/").startswith("pipeline/sinks"):
                continue
            yield from (os.path.join(folder, n) for n in names if n.endswith(".py"))


@pytest.mark.parametrize("key", list(sinks.SINKS))
def test_no_code_outside_the_sinks_folder_names_a_sink(key):
    named = re.compile(re.escape(key), re.I)
    found = [os.path.relpath(p, REPO) for p in code_files_outside_the_sinks() if named.search(open(p).read())]
    assert found == [], f"{key} is named outside pipeline/sinks/ (ask the registry instead): {found}"


def job(tmp_path, **output) -> dict:
    return {"input": {"path": "docs.jsonl", "keep_fields": ["lang"]}, "output": {"path": str(tmp_path), **output}}


def test_outputs_sections_are_the_registered_sinks_and_round_trip(tmp_path):
    fields = config.OutputConfig.model_fields
    assert {key: fields[key].annotation for key in sinks.SINKS} == {
        key: sink.section | None for key, sink in sinks.SINKS.items()
    }
    cfg = config.parse(
        job(tmp_path, vertex_ai=True, pgvector={"dsn": "postgresql://app:pw@db/x", "table": "docs"}, dedup=True),
        base_dir=".",
    )
    assert [sink.key for sink, _ in sinks.active(cfg)] == list(sinks.SINKS) == ["vertex_ai", "pgvector", "dedup"]
    assert cfg.output.vertex_ai.restricts == () and cfg.output.pgvector.table == "docs"
    assert config.parse(cfg.model_dump(mode="json"), base_dir=".") == cfg
    assert config.parse(job(tmp_path, vertex_ai=False), base_dir=".").output.vertex_ai is None
    with pytest.raises(config.ConfigError, match="output.vertex_al: unknown key"):
        config.parse(job(tmp_path, vertex_al=True), base_dir=".")
    with pytest.raises(config.ConfigError, match="output.pgvector loads float vectors"):
        config.parse(job(tmp_path, vector_dtype="int8", pgvector={"dsn": "", "table": "docs"}), base_dir=".")


@pytest.mark.parametrize("key, section", [("vertex_ai", {}), ("pgvector", {"dsn": "", "table": "docs"})])
def test_a_sink_that_skips_duplicates_needs_a_curating_sink_on(tmp_path, key, section):
    asked = {key: {**section, "skip_duplicates": True}}
    with pytest.raises(config.ConfigError, match=rf"output.{key}.skip_duplicates .* turn on output.dedup"):
        config.parse(job(tmp_path, **asked), base_dir=".")
    assert getattr(config.parse(job(tmp_path, **asked, dedup=True), base_dir=".").output, key).skip_duplicates


@pytest.mark.parametrize("first", ["docbeam.pipeline.sinks", "docbeam.config", "docbeam.pipeline.driver.cli"])
def test_outputs_sections_do_not_depend_on_which_module_is_imported_first(first):
    # A sink that imported the config package while the sinks registered left output without their sections.
    code = (
        f"import {first}\nfrom docbeam.config import OutputConfig\nfrom docbeam.pipeline import sinks\n"
        "print(sorted(set(sinks.SINKS) - set(OutputConfig.model_fields)), sorted(sinks.SINKS))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.split() == ["[]", "['dedup',", "'pgvector',", "'vertex_ai']"]


def test_the_cli_has_each_sinks_commands():
    subcommands = next(a for a in cli._parser()._actions if a.dest == "command").choices
    assert set(sinks.commands()) == {"sync-pgvector"} and set(sinks.commands()) <= set(subcommands)


def command(prepare, run) -> sinks.SinkCommand:
    return sinks.SinkCommand("test-command", "a test", lambda parser: None, prepare, run)


def test_a_sink_command_refused_failed_or_done_exits_2_1_or_0(capsys):
    def refuse(args):
        raise config.ConfigError("test-command.table: bad\nmore")

    def fail(prepared):
        raise RuntimeError("the database went away")

    assert cli.run_sink_command(command(refuse, fail), argparse.Namespace(), "details: log") == 2
    assert capsys.readouterr().err == "docbeam: cannot start: test-command.table: bad; nothing was touched\n"
    assert cli.run_sink_command(command(lambda args: 1, fail), argparse.Namespace(), "details: log") == 1
    assert (
        capsys.readouterr().err == "docbeam: test-command failed: RuntimeError: the database went away\ndetails: log\n"
    )
    assert cli.run_sink_command(command(lambda args: 1, lambda n: f"done {n}"), argparse.Namespace(), "") == 0
    assert capsys.readouterr().out == "done 1\n"


@pytest.mark.parametrize(
    "error, said",
    [
        (
            PostgresBehind("run r1 is committed to out, but loading it failed"),
            "docbeam: run failed: PostgresBehind: run r1",
        ),
        (RuntimeError("a worker died"), "docbeam: job failed, nothing committed (the previous output is unchanged)"),
    ],
)
def test_a_sink_behind_a_committed_run_is_not_reported_as_nothing_committed(error, said, tmp_path, monkeypatch, capsys):
    from docbeam.pipeline.driver import job as job_lib

    def failing_run(*args, **kwargs):
        raise error

    monkeypatch.setattr(job_lib, "run", failing_run)
    path = tmp_path / "job.yaml"
    path.write_text(f"input: {{path: docs.jsonl}}\noutput: {{path: {tmp_path / 'out'}}}\n")
    assert cli.main(["run", "--config", str(path)]) == 1
    assert capsys.readouterr().err.startswith(said)


def test_each_sinks_step_after_the_commit_prints_its_line():
    done = {"table": "docs", "applied": True, "upserted": 3, "deleted": 1}
    assert cli.sink_lines({"pgvector": done}) == ["  pgvector   docs: 3 rows upserted, 1 deleted"]
    assert cli.sink_lines({"pgvector": {"table": "docs", "applied": False}}) == [
        "  pgvector   run already in docs: nothing changed"
    ]
    assert cli.sink_lines({}) == []


@pytest.mark.parametrize(
    "head, layout",
    [
        (None, (EMBEDDINGS, "dense", [])),
        ({"name": "embedding", "folder": EMBEDDINGS}, (EMBEDDINGS, "dense", [])),
        ({"name": "classifier", "folder": SCORES}, (SCORES, "scores", [])),
        ({"name": "sparse", "folder": EMBEDDINGS}, (EMBEDDINGS, "sparse", [])),
        ({"name": "bge_m3", "folder": EMBEDDINGS}, (EMBEDDINGS, "dense_and_sparse", ["multi_vector"])),
        (  # a head of one's own: the table follows its columns' kinds, whatever its name
            {
                "name": "mypkg.heads:FirstToken",
                "folder": EMBEDDINGS,
                "columns": [
                    {"name": "embedding", "kind": "vector", "dim": 8, "dtype": "float32"},
                    {"name": "score", "kind": "score", "dim": None, "dtype": "float32"},
                ],
            },
            (EMBEDDINGS, "dense", ["score"]),
        ),
    ],
)
def test_the_pgvector_table_follows_the_committed_runs_head(head, layout):
    assert tuple(table_layout({"head": head} if head else {}))[:3] == layout
