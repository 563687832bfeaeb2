"""docbeam report on the files of a run: the manifest decides which shards are the run's, a real run's report shows what it did, and the data modules never import the rendering ones."""

from __future__ import annotations

import base64
import gzip
import html.parser
import io
import json
import pathlib
import re

import matplotlib.image
import pytest
from import_graph_test import import_graph
from report_fixtures import write_run
from report_test import CHARTS, _cli, _Page

from docbeam.pipeline.tools.report import charts as report_charts
from docbeam.pipeline.tools.report import command as report
from docbeam.pipeline.tools.report import data as report_data
from docbeam.pipeline.tools.report import load as report_load

# ---------------------------------------------------------------- the manifest of a committed run


@pytest.fixture
def committed_among_others(tmp_path):
    """A committed run next to another run's shards and a staging folder, as a rerun leaves them."""
    output = pathlib.Path(write_run(tmp_path / "out", seed=0, run_id="r2"))
    other = pathlib.Path(write_run(tmp_path / "other", seed=1, run_id="r1", extra_errors=3))
    for part in ("timing", "errors"):
        for shard in (other / part).iterdir():
            (output / part / shard.name).write_bytes(shard.read_bytes())
            staged = output / "_staging" / "r3" / part / shard.name
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.write_bytes(shard.read_bytes())
    return output


def test_a_manifest_limits_the_run_to_its_own_files_and_without_one_every_shard_is_read(committed_among_others):
    run = report_load.load_run(str(committed_among_others))
    assert run.batch_count == 300 and len(run.errors) == 6
    assert report_load.run_files(str(committed_among_others), "timing") == [
        str(committed_among_others / "timing" / f"part-r2-0000{i}-of-00002.jsonl") for i in (0, 1)
    ]
    (committed_among_others / "_manifest.json").unlink()  # a run from before manifests: read by glob
    run = report_load.load_run(str(committed_among_others))
    assert run.batch_count == 600 and len(run.errors) == 15


def test_a_manifest_naming_a_missing_file_or_an_unknown_format_cannot_be_read(committed_among_others, capsys):
    (committed_among_others / "errors" / "part-r2-00000-of-00001.jsonl").unlink()
    assert _cli(committed_among_others) == 2
    assert "part-r2-00000-of-00001.jsonl is missing or not the size its manifest says" in capsys.readouterr().err
    (committed_among_others / "_manifest.json").write_text(json.dumps({"format": "docbeam.manifest/9"}))
    with pytest.raises(ValueError, match="docbeam.manifest/9"):
        report_load.load_run(str(committed_among_others))


def reached(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every project module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_data_modules_do_not_import_the_rendering_modules():
    graph, rendering = import_graph(), {"pipeline.tools.report.page", "pipeline.tools.report.charts"}
    for module in (report_data, report_load):
        name = module.__name__.removeprefix("docbeam.")
        assert reached(graph, name) & rendering == set(), name
        source = re.sub(r'""".*?"""', "", pathlib.Path(module.__file__).read_text(), flags=re.S)
        assert "matplotlib" not in source, module.__name__
    assert "pipeline.tools.report.command" not in reached(graph, report_charts.__name__.removeprefix("docbeam."))
    assert rendering <= reached(graph, "pipeline.tools.report.command")  # the scan sees the report's imports


# ---------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, tiny_checkpoint_dir):
    """A small job through the real pipeline: the tiny model, bad records, and flash refused on CPU so every
    batch falls back to native."""
    from conftest import SAMPLE, job_config

    from docbeam.pipeline.driver.run import run_job

    root = tmp_path_factory.mktemp("real-run")
    lines = gzip.open(SAMPLE, "rt").read().splitlines()[:30]
    (root / "docs.jsonl").write_text(
        "\n".join(lines + ['{"id": "broken", "text": ', '{"id": "empty", "text": ""}']) + "\n"
    )
    output = str(root / "out")
    summary = run_job(
        job_config(
            str(root / "docs.jsonl"),
            output,
            tiny_checkpoint_dir,
            attention={"backend": "flash", "fallback": "native", "flash": {"kernel": "pallas_tpu"}},
        )
    )
    return output, summary


@pytest.mark.slow
def test_report_of_a_real_run_shows_what_the_run_did(real_run):
    output, summary = real_run
    result = report.report(output)
    text = pathlib.Path(result.path).read_text(encoding="utf-8")
    page = _Page(text)
    assert set(page.images) == CHARTS and result.regressions == []
    for alt, uri in page.images.items():
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])), format="png")
        assert pixels[..., :3].std() > 0.05, f"{alt} is blank"
    assert {
        "Per bucket",
        "Charts",
        "Rejected documents",
        "Summary",
        "Attention plan per bucket",
        "Batches per bucket",
        "Versions",
        "Metrics",
    } <= set(page.headings)
    assert "{'" not in html.unescape(text) and not re.search(r"\bnan\b", re.sub(r"data:image\S+", "", text), re.I)
    cards = dict(re.findall(r"<div class=card>([^<]+)<b>([^<]*)</b></div>", text))
    assert (cards["documents embedded"], cards["rejected"]) == (str(summary["docs_embedded"]), "2")
    assert cards["batches"] == str(summary["batches"]) and cards["fallback batches"] == str(summary["batches"])
    run = report_load.load_run(output)
    assert run.batch_count == summary["batches"] and report_data.rejected_by_kind(run) == {
        "empty_text": 1,
        "malformed_json": 1,
    }
    stats = report_data.bucket_stats(run.batches)
    assert {s.bucket_len for s in stats} == {int(b) for b in summary["buckets"]}
    assert {s.backend for s in stats} == {"native"} and sum(s.batches for s in stats) == summary["batches"]
    (reason,) = {c["fallback_reason"] for c in summary["attention_plan"].values()}
    assert report_data.fallbacks(run) == {f"flash->native: {reason}": summary["batches"]}
    assert html.escape(f"flash->native: {reason}") in text
