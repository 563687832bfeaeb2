"""The arguments of `docbeam report`, apart from the command: building the CLI's parser then imports neither Beam
nor the report's analysis, so every other command starts without them."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Write a self-contained HTML report of a docbeam run (local path or gs:// prefix)."
    parser.epilog = (
        "Exit status: 0 when the report was written and no regression was found, 1 when "
        "--baseline was given and at least one regression was found, 2 when a run cannot be read, "
        "--threshold is not a fraction, or the baseline shares no (bucket, backend) with the run "
        "(nothing could be compared)."
    )
    parser.add_argument("output", help="the run's output path (holds timing/, errors/, summary.json)")
    parser.add_argument(
        "--baseline",
        help="output path of an earlier run to compare against; regressions make the command exit with status 1",
    )
    parser.add_argument(
        "--out",
        help="where to write the HTML (default: OUTPUT.report.html, beside the output "
        "folder: a file inside it would be foreign to the next run)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        help="flag a (bucket, backend) whose median compute_ms grew by more than this fraction (default: %(default)s)",
    )
