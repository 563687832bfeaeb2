"""One self-contained HTML page about a docbeam run: latency, throughput, padding, memory, compiles, rejects.

    docbeam report OUTPUT [--baseline BASELINE_OUTPUT] [--out FILE] [--threshold 0.1]

Everything is read and written through Beam's ``FileSystems``, so OUTPUT may be a local directory or a
gs:// prefix. Charts are inline PNGs and the page has no scripts or external assets, so it can be attached
to a CI run, mailed, or opened straight from a bucket.

This module is the command; beside it in pipeline/tools/report/, load.py loads a run, data.py analyses it,
charts.py draws it, page.py lays out the page, and args.py holds the command's arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from apache_beam.io.filesystems import FileSystems

from docbeam.errors import Refused
from docbeam.pipeline.store.output import STAGING
from docbeam.pipeline.store.paths import normalize_folder
from docbeam.pipeline.tools.report.args import add_arguments
from docbeam.pipeline.tools.report.data import Regression, check_threshold, compare, latency_changes
from docbeam.pipeline.tools.report.load import Run, load_run


@dataclasses.dataclass(frozen=True)
class ReportResult:
    path: str
    regressions: list[Regression]
    compared: bool = True  # with a baseline: whether any (bucket, backend) could be compared at all


def default_dest(output: str) -> str:
    """Beside the output folder, never inside it: a file there that no manifest lists is foreign to the
    next run (a warning, and a stale report left behind). A staged run's report goes beside the whole output."""
    path = normalize_folder(output)  # OUT/. and OUT/sub/.. name OUT: the report still goes beside it
    parent, _, name = path.rpartition("/")
    if parent.rpartition("/")[2] == STAGING:
        return f"{parent.rpartition('/')[0]}.{name}.report.html"
    return f"{path}.report.html"


def report(
    output: str, *, baseline: str | None = None, dest: str | None = None, threshold: float = 0.10
) -> ReportResult:
    """Writes the report of the run at ``output`` to ``dest`` (default ``<output>.report.html``, beside it)."""
    return write_report(load_run(output), load_run(baseline) if baseline else None, dest=dest, threshold=threshold)


def write_report(
    run: Run, baseline: Run | None = None, *, dest: str | None = None, threshold: float = 0.10
) -> ReportResult:
    """Writes the report of loaded runs; ``dest`` defaults to ``default_dest(run.path)``."""
    # Imported here so that `docbeam --help` and the other commands do not import matplotlib.
    from docbeam.pipeline.tools.report.page import render_html

    regressions = compare(run, baseline, threshold) if baseline is not None else []
    page = render_html(run, baseline, regressions, threshold)
    dest = dest or default_dest(run.path)
    with FileSystems.create(dest, mime_type="text/html") as f:
        f.write(page.encode("utf-8"))
    return ReportResult(
        path=dest, regressions=regressions, compared=baseline is None or bool(latency_changes(run, baseline))
    )


def main(args: argparse.Namespace) -> int:
    """Runs ``docbeam report``; returns the exit status (1 when regressions were found, 2 when a run
    cannot be read), so a scheduler can tell a regression from a missing run."""
    from docbeam.pipeline.store import storage

    storage.pipeline_options([])  # gs:// against an emulator without the credential-lookup stall
    # Only refusals are caught (a bad --threshold, a run that cannot be read): a run that reads but fails to
    # render is a bug to see with its traceback.
    try:
        check_threshold(args.threshold)
        run = load_run(args.output)
        baseline = load_run(args.baseline) if args.baseline else None
    except Refused as e:
        print(f"docbeam report: {e}", file=sys.stderr)
        return 2
    result = write_report(run, baseline, dest=args.out, threshold=args.threshold)
    print(f"wrote {result.path}")
    for regression in result.regressions:
        print(f"REGRESSION {regression}", file=sys.stderr)
    if result.regressions:
        return 1
    if not result.compared:
        print(
            f"docbeam report: nothing to compare: no (bucket, backend) has steady batches in both {args.output} "
            f"and the baseline {args.baseline} (different backends or buckets?)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="docbeam report")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
