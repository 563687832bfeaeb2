"""docbeam report on synthetic runs (tests/report_fixtures.py): the page, its charts, compare(), the manifest,
runs in which no batch ran, and the CLI."""

from __future__ import annotations

import argparse
import base64
import html.parser
import io
import json
import pathlib
import re
import subprocess

import matplotlib.image
import numpy as np
import pytest
from report_fixtures import RECOMPILE_AT, write_empty_run, write_run

from docbeam.pipeline.tools.report import command as report
from docbeam.pipeline.tools.report import data as report_data
from docbeam.pipeline.tools.report import load as report_load

CHARTS = {
    "batch latency by bucket and backend",
    "throughput over the run",
    "padding efficiency per bucket",
    "memory over the run",
    "XLA compile events",
    "rejected documents by kind",
}
CHROMIUM = pathlib.Path("/usr/bin/chromium")
# Hive-style partitions and a content hash: no hyphen or space where a browser could break the line.
LONG_SOURCE = (
    "gs://acme_ml_corpora_europe_west4/crawl/snapshot=20260501T000000Z/lang=en/source=forums/"
    "dedup=minhash_0.8/part_00017_of_01024_3f9a1c0d5b7e4a2c9d8f1e6b0a4c7d2e9f8a7b6c5d4e3f2a.jsonl.gz"
)


class _Page(html.parser.HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.tags, self.images, self.links, self.headings, self._heading = [], {}, [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.links += [v for k, v in attrs.items() if k in ("src", "href", "srcset", "action", "poster") and v]
        if tag == "img":
            self.images[attrs["alt"]] = attrs["src"]
        if tag in ("h2", "h3"):
            self._heading = ""

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data

    def handle_endtag(self, tag):
        if tag in ("h2", "h3") and self._heading is not None:
            self.headings.append(self._heading.strip())
            self._heading = None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "baseline": write_run(root / "baseline", seed=0),
        "slow": write_run(root / "slow", seed=1, slowdown={128: 1.3}, extra_errors=3, error_source=LONG_SOURCE),
        "drift": write_run(root / "drift", seed=1, slowdown=1.02),
        "fallbacks": write_run(root / "fallbacks", seed=1, extra_fallbacks=5),
    }


@pytest.fixture(scope="module")
def slow_report(runs):
    result = report.report(runs["slow"], baseline=runs["baseline"])
    return result, pathlib.Path(result.path).read_text(encoding="utf-8")


def test_report_is_written_beside_the_run_never_inside_it_and_is_self_contained(runs, slow_report):
    result, text = slow_report
    assert result.path == f"{runs['slow']}.report.html"  # inside, the next run would find a file no manifest lists
    assert not (pathlib.Path(runs["slow"]) / "report.html").exists()
    page = _Page(text)
    assert page.links and all(link.startswith("data:image/png;base64,") for link in page.links)
    assert not {"script", "link", "iframe", "object", "embed"} & set(page.tags)
    without_images = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)
    for external in ("http:", "https:", "url(", "@import", 'src="//'):
        assert external not in without_images


def test_report_has_every_chart_as_a_decodable_png(slow_report):
    images = _Page(slow_report[1]).images
    assert set(images) == CHARTS
    for alt, uri in images.items():
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])), format="png")
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600, alt
        assert pixels[..., :3].std() > 0.05, f"{alt} is blank"


def test_report_has_the_tables(slow_report):
    text = slow_report[1]
    headings = _Page(text).headings
    for heading in ("Regressions vs baseline", "Per bucket", "Charts", "Rejected documents", "Summary", "Metrics"):
        assert heading in headings
    assert "median compute_ms" in text and "p90 compute_ms" in text and "padding efficiency" in text
    assert "Recompilations after a shape" in text and "{}/{}/{}".format(*RECOMPILE_AT) in text
    assert "empty_text" in text and "sentence-transformers/all-MiniLM-L6-v2" in text


def test_pure_functions_on_the_loaded_run(runs):
    run = report_load.load_run(runs["baseline"])
    batches = run.batches
    assert len(batches["compute_ms"]) == 300 and np.all(np.diff(batches["t_s"]) >= 0) and batches["t_s"][0] == 0
    again = report_data.recompilations(batches)
    assert [batches["batch_id"][i] for i in again] == ["{}/{}/{}".format(*RECOMPILE_AT)]
    stats = {(s.bucket_len, s.backend): s for s in report_data.bucket_stats(batches)}
    assert set(stats) == {(32, "native"), (64, "flash"), (128, "flash"), (256, "flash")}
    assert stats[(128, "flash")].compiles == 3 and stats[(64, "flash")].compiles == 2
    assert all(0 < s.padding_efficiency <= 1 and s.median_ms <= s.p90_ms < 100 for s in stats.values())
    assert report_data.rejected_by_kind(run) == {
        "duplicate_id": 2,
        "empty_text": 1,
        "invalid_utf8": 1,
        "malformed_json": 1,
        "missing_text": 1,
    }


def test_compare_flags_a_30_percent_slowdown_and_more_rejects(runs, slow_report):
    regressions = slow_report[0].regressions
    assert [(r.what, r.where) for r in regressions] == [
        ("latency", "bucket 128 / flash"),
        ("rejected documents", "all"),
    ]
    assert 1.2 < regressions[0].current / regressions[0].baseline < 1.4
    assert (regressions[1].baseline, regressions[1].current) == (6, 9)
    assert "class=flag" in slow_report[1] and "regressions bad" in slow_report[1]


def test_compare_does_not_flag_a_2_percent_drift(runs):
    drift, baseline = report_load.load_run(runs["drift"]), report_load.load_run(runs["baseline"])
    assert report_data.compare(drift, baseline) == []
    assert report_data.compare(drift, baseline, threshold=0.0)


def test_compare_flags_more_fallbacks(runs):
    regressions = report_data.compare(report_load.load_run(runs["fallbacks"]), report_load.load_run(runs["baseline"]))
    assert [r.what for r in regressions] == ["fallbacks"]
    assert "flash->chunked" in regressions[0].detail


def test_compare_rejects_a_percentage_threshold(runs):
    run = report_load.load_run(runs["baseline"])
    with pytest.raises(ValueError, match="got 10"):
        report_data.compare(run, run, threshold=10)


def test_missing_errors_dir_and_sparse_summary(tmp_path):
    output = write_run(tmp_path / "run", with_errors=False)
    summary_path = pathlib.Path(output) / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({"docs_embedded": summary["docs_embedded"], "model": "tiny"}))
    result = report.report(output, dest=str(tmp_path / "elsewhere" / "r.html"))
    text = pathlib.Path(result.path).read_text()
    assert result.regressions == [] and "No error records" in text
    assert set(_Page(text).images) == CHARTS - {"rejected documents by kind"}
    summary_path.unlink()
    assert report.report(output).regressions == []


@pytest.mark.parametrize("summary", ["[1, 2]", '"a string"', "3"])
def test_a_summary_that_is_not_an_object_is_named_not_a_traceback(tmp_path, summary):
    output = write_run(tmp_path / "run", with_errors=False)
    (pathlib.Path(output) / "summary.json").write_text(summary)
    with pytest.raises(report_load.RunUnreadable, match=r"summary.json is not a JSON object"):
        report.report(output)


@pytest.mark.parametrize("spelling", ["{out}/.", "{out}/", "{out}/timing/.."])
def test_the_report_goes_beside_the_output_however_its_path_is_spelled(tmp_path, spelling):
    out = str(tmp_path / "run")
    assert report.default_dest(spelling.format(out=out)) == f"{out}.report.html"


def test_a_directory_that_is_not_a_run_is_named_in_the_error(tmp_path):
    with pytest.raises(report_load.RunUnreadable, match=re.escape(str(tmp_path))):
        report.report(str(tmp_path))


def test_cli_exit_status(runs, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="docbeam report")
    report.add_arguments(parser)
    assert "1 when" in parser.format_help()
    out = tmp_path / "cli.html"
    assert report.main(parser.parse_args([runs["slow"], "--baseline", runs["baseline"], "--out", str(out)])) == 1
    assert out.exists() and "REGRESSION latency" in capsys.readouterr().err
    args = parser.parse_args([runs["drift"], "--baseline", runs["baseline"], "--out", str(out), "--threshold", "0.05"])
    assert report.main(args) == 0


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian chromium at /usr/bin/chromium (apt-get install -y chromium)"
)
def test_report_renders_in_headless_chromium(slow_report, tmp_path):
    # The probe script lives only in this copy; the report itself carries no scripts.
    probe = (
        "<script>window.addEventListener('load', () => { const p = document.createElement('pre'); "
        "p.id = 'decoded'; p.textContent = JSON.stringify({scrollWidth: document.documentElement.scrollWidth, "
        "images: [...document.images].map(i => [i.alt, i.naturalWidth, i.naturalHeight])}); "
        "document.body.appendChild(p); });</script>"
    )
    page = tmp_path / "probe.html"
    page.write_text(slow_report[1].replace("</body>", probe + "</body>"), encoding="utf-8")
    screenshot = tmp_path / "screenshot.png"
    browser = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={screenshot}",
            "--window-size=1280,3000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    decoded = re.search(r'<pre id="decoded">(.*?)</pre>', browser.stdout)
    assert decoded, f"chromium exited {browser.returncode}; stderr tail: {browser.stderr[-2000:]}"
    probed = json.loads(html.unescape(decoded.group(1)))
    sizes = {alt: (width, height) for alt, width, height in probed["images"]}
    assert set(sizes) == CHARTS
    assert all(width >= 600 and height >= 300 for width, height in sizes.values()), sizes
    # Nothing (a long gs:// source among the rejects, a wide table) pushes the page past a laptop's width.
    assert probed["scrollWidth"] <= 1280, f"the page is {probed['scrollWidth']} px wide at a 1280 px window"
    pixels = matplotlib.image.imread(screenshot)
    assert pixels.shape[:2] == (3000, 1280) and pixels[..., :3].std() > 0.05


# ---------------------------------------------------------------- runs in which no batch ran


def _cli(*args) -> int:
    parser = argparse.ArgumentParser(prog="docbeam report")
    report.add_arguments(parser)
    return report.main(parser.parse_args([str(a) for a in args]))


def test_a_run_whose_documents_were_all_rejected_renders_and_says_why(tmp_path, capsys):
    output = write_empty_run(tmp_path / "run", rejected=("missing_text", "missing_text", "malformed_json"))
    assert _cli(output) == 0, capsys.readouterr().err
    text = (tmp_path / "run.report.html").read_text()
    assert "No batches ran: 0 documents embedded, 3 rejected — see rejected documents by kind" in text
    assert set(_Page(text).images) == {"rejected documents by kind"}
    assert "No data to draw: batch latency by bucket and backend, throughput over the run" in text
    assert "<b>—</b>" in text  # the padding efficiency card of a summary with padding_efficiency: null


def test_an_empty_input_renders_and_says_why(tmp_path, capsys):
    output = write_empty_run(tmp_path / "run")
    assert _cli(output) == 0, capsys.readouterr().err
    text = (tmp_path / "run.report.html").read_text()
    assert "No batches ran: 0 documents embedded, 0 rejected — the input held no documents" in text
    assert _Page(text).images == {} and "No error records" in text


def test_an_empty_run_against_a_busy_baseline_and_back(runs, tmp_path, capsys):
    empty = write_empty_run(tmp_path / "empty", rejected=("empty_text",) * 9)
    assert _cli(empty, "--baseline", runs["baseline"], "--out", tmp_path / "a.html") == 1
    assert "REGRESSION rejected documents (all): 9 vs 6" in capsys.readouterr().err
    text = (tmp_path / "a.html").read_text()
    assert "regressions bad" in text and "No (bucket, backend) has steady batches in both runs" in text
    assert _cli(empty, "--baseline", empty, "--out", tmp_path / "c.html") == 2  # nothing to compare: not a pass
    assert "nothing to compare" in capsys.readouterr().err
    text = (tmp_path / "c.html").read_text()
    assert "regressions amber" in text and "Nothing compared" in text and "No regressions" not in text
    assert _cli(runs["baseline"], "--baseline", empty, "--out", tmp_path / "b.html") == 1  # 90 fallbacks vs none
    assert set(_Page((tmp_path / "b.html").read_text()).images) == CHARTS


def test_a_run_that_was_not_committed_is_found_and_says_so(tmp_path, capsys):
    """A run that embedded nothing is left uncommitted in _staging/; the report points there and reads it."""
    staged = tmp_path / "out" / "_staging" / "r1"
    write_empty_run(staged, rejected=("missing_text",))
    summary = json.loads((staged / "summary.json").read_text())
    summary["failed"] = ["nothing was embedded", "too many rejects"]
    (staged / "summary.json").write_text(json.dumps(summary))
    assert _cli(tmp_path / "out") == 2
    assert f"it holds uncommitted runs, e.g. {staged} (pass that folder" in capsys.readouterr().err
    assert _cli(staged) == 0
    assert not (staged / "report.html").exists() and not (tmp_path / "out" / "_staging" / "r1.report.html").exists()
    text = (tmp_path / "out.r1.report.html").read_text()  # beside the whole output, not in its _staging/
    assert "This run failed and was not committed: nothing was embedded; too many rejects." in text
    assert "<td>nothing was embedded; too many rejects</td>" in text


# ---------------------------------------------------------------- what the page shows


def test_nested_summary_fields_are_tables_not_python_dicts(slow_report):
    text = slow_report[1]
    assert "{'" not in html.unescape(text)
    headings = _Page(text).headings
    assert {"Attention plan per bucket", "Batches per bucket", "Versions"} <= set(headings)
    assert "<tr><td>32</td><td>native</td><td>xla</td><td>flash needs bucket_len &gt;= 64</td></tr>" in text
    assert "<tr><td>jax</td><td>0.10.2</td></tr>" in text
    output = pathlib.Path(slow_report[0].path.removesuffix(".report.html"))
    buckets = json.loads((output / "summary.json").read_text())["buckets"]
    assert f"<td class=n>{buckets['256']['padded_tokens']:,}</td>" in text


def test_a_classifiers_report_says_scored_and_shows_the_label_shares(tmp_path):
    output = write_run(tmp_path / "run", with_errors=False)
    summary_path = pathlib.Path(output) / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(head={"name": "classifier", "folder": "scores"}, labels={"pos": 3, "neg": 1})
    summary_path.write_text(json.dumps(summary))
    text = pathlib.Path(report.report(output, dest=str(tmp_path / "r.html")).path).read_text()
    assert "documents scored" in text and "pos 75% · neg 25%" in text


def mesh_run(batches: int = 400) -> report_load.Run:
    """A worker on a mesh of two chips: chip 0 flat, chip 1 gaining 1 MB a batch; each record's own memory
    fields are its fullest chip's, as the runtime writes them."""
    records = []
    for i in range(batches):
        chips = {"tpu:0 (TPU v5 lite)": 2 * 2**30, "tpu:1 (TPU v5 lite)": 2 * 2**30 + i * 2**20}
        records.append(
            {
                "batch_id": f"b{i}",
                "started_at": f"2026-12-06T12:{i // 60:02d}:{i % 60:02d}+00:00",
                "worker": "vm-1:7",
                "device": "tpu:0 (TPU v5 lite) +1",
                "mesh": {"data": 2, "model": 1},
                "memory_in_use_bytes": max(chips.values()),
                "memory_peak_bytes": max(chips.values()),
                "memory_source": "device",
                "memory_per_device": chips,
            }
        )
    return report_load.Run(path="mesh", summary={}, batches=report_load.batch_columns(records), errors=[])


def test_a_mesh_runs_memory_is_judged_and_drawn_per_chip():
    from docbeam.pipeline.tools.report import charts

    trends = {t.worker: t for t in report_data.memory_trends(mesh_run())}
    assert set(trends) == {"vm-1:7 tpu:0 (TPU v5 lite)", "vm-1:7 tpu:1 (TPU v5 lite)"}
    assert trends["vm-1:7 tpu:1 (TPU v5 lite)"].leak_suspected
    assert not trends["vm-1:7 tpu:0 (TPU v5 lite)"].leak_suspected
    figure = charts.memory_chart(mesh_run())
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    assert labels == ["in use after batch, vm-1:7 tpu:0", "in use after batch, vm-1:7 tpu:1"]


def test_every_chart_title_fits_its_figure_however_long():
    """The compilations chart's title ran off the figure: a long title wraps onto lines the figure holds."""
    from docbeam.pipeline.tools.report import charts

    title = charts.compile_title({"compiles_ahead": 123456, "compiles": 1234567}, 1111111, 222222)
    fig, _ = charts._figure(title + ", and then some more words than any line holds")
    fig.canvas.draw()
    box, width = fig.axes[0].title.get_window_extent(), fig.bbox.width
    assert box.x0 >= 0 and box.x1 <= width, (box, width)


def test_an_empty_nested_field_reads_none_not_a_row_of_dashes():
    from docbeam.pipeline.tools.report.page import _summary_value

    assert _summary_value("reuse", {"from": None, "reason": "", "run_id": None}) == "none"
    assert (
        _summary_value("reuse", {"from": "gs://b/run", "reason": "", "run_id": "r1"}) == "from: gs://b/run; run_id: r1"
    )


def test_a_committed_shard_changed_after_the_commit_or_a_record_that_is_not_one_is_refused(tmp_path):
    """The report reads a committed run through the manifest's one checked path: a timing shard cut short after the
    commit, or a line that is JSON but no record, is a RunUnreadable (exit 2) naming the file, never a traceback."""
    out = pathlib.Path(write_run(tmp_path / "run", run_id="20260501T120000.000000Z-aaaaaa"))
    shard = sorted((out / "timing").glob("*.jsonl"))[0]
    original = shard.read_bytes()
    shard.write_bytes(original[:-5])
    with pytest.raises(report_load.RunUnreadable, match="not the size its manifest says"):
        report_load.load_run(str(out))
    shard.write_bytes(b"[1, 2]\n" + original[7:])  # same size, a line that is a list
    with pytest.raises(report_load.RunUnreadable, match="is a JSON list, not a record"):
        report_load.load_run(str(out))
    shard.write_bytes(original)
    assert report_load.load_run(str(out)).batch_count > 0


def test_a_summary_nested_past_pythons_recursion_limit_is_named_not_a_traceback(tmp_path):
    out = pathlib.Path(write_run(tmp_path / "run"))
    (out / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(report_load.RunUnreadable):
        report_load.load_run(str(out))
