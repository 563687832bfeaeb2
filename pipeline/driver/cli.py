"""``docbeam``: run a job, validate a config, report on a run.

Exit codes: 0 the run committed its output (some documents may have been rejected: see errors/); 1 the
job ran but failed, nothing was committed and the previous output is unchanged; 2 refused at start
(config, checkpoint, attention, input or output: any ``docbeam.errors.Refused``), nothing was touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

from docbeam import config as config_lib
from docbeam.errors import Refused
from docbeam.pipeline.telemetry import cost

log = logging.getLogger("docbeam")


VERBOSE_HELP = (
    "stream the whole log (Beam's and JAX's records, tracebacks) to stderr; without it they go only to "
    "a log file, which a failure names"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="docbeam", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the pipeline"), ("validate", "check a config and show what would run")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="YAML job config, e.g. configs/local.yaml")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set attention.backend=flash (repeatable); a relative path "
            "is relative to the current folder (the file's own paths: to the file)",
        )
        p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        if name == "run":
            p.add_argument(
                "--force", action="store_true", help="take over the output's lock even if another run seems alive"
            )
            p.add_argument(
                "--no-wait",
                action="store_true",
                help="return once the job is submitted (a Flex Template launcher); the job commits "
                "its output and releases the lock itself",
            )
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="build the Dataflow job (graph, pickled DoFns, environment), print the options "
                "Dataflow would receive, submit nothing; no lock, no input or output touched",
            )
            p.add_argument(
                "beam_args",
                nargs=argparse.REMAINDER,
                help="after --: extra Beam pipeline options, e.g. -- --direct_num_workers=2",
            )
        else:
            p.add_argument(
                "--verify",
                action="store_true",
                help="also run each bucket's backend against native on a probe batch here, and hold a "
                "model.dtype other than float32 to the precision gate on the input's first documents",
            )
            p.add_argument(
                "--for-launch",
                action="store_true",
                help="first refuse (exit 2) the profiles' placeholder project, buckets and image, as "
                "run --dry-run and the Flex Template launcher do: a CI step before a launch",
            )
    p = sub.add_parser("propose-buckets", help="propose bucket lengths and token budget from the corpus")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--documents", type=positive_int, default=10_000, help="how many documents to sample (default 10000)"
    )
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    from docbeam.pipeline import sinks

    for command in sinks.commands().values():  # each sink's own, e.g. to load a committed run again
        p = sub.add_parser(command.name, help=command.help)
        command.add_arguments(p)
        p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        p.set_defaults(sink_command=command)
    from docbeam.pipeline.tools.report import args as report_args  # not the report itself: it imports Beam

    report_args.add_arguments(sub.add_parser("report", help="HTML report (with charts) of a run's output"))
    return parser


OWN_LOGGERS = ("docbeam",)  # every module logs under its installed name, docbeam.…
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _OwnMessages(logging.Filter):
    """The console's share of the log: docbeam's own messages, not Beam's, JAX's or a traceback's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] in OWN_LOGGERS and not getattr(record, "log_file_only", False)


class _WithoutTraceback(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        return super().format(record)


def _setup_logging(command: str, verbose: bool) -> str:
    """Everything (Beam's and JAX's records, tracebacks) goes to a log file, whose path is returned. The console
    gets docbeam's own messages without tracebacks: on stdout for ``run`` (its running commentary, so that
    stderr holds only why a run failed), on stderr for the other commands (whose stdout is their report).
    ``--verbose`` streams the whole log to stderr instead."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "docbeam", False)]:  # main() called again in-process
        root.removeHandler(handler)
        handler.close()
    folder = os.path.join(tempfile.gettempdir(), "docbeam-logs")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{command}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log")
    log_file = logging.FileHandler(path, encoding="utf-8")
    log_file.setFormatter(logging.Formatter(LOG_FORMAT))
    if verbose:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(LOG_FORMAT))
    else:
        console = logging.StreamHandler(sys.stdout if command == "run" else sys.stderr)
        console.setFormatter(_WithoutTraceback("%(levelname)s %(name)s: %(message)s"))
        console.addFilter(_OwnMessages())
        console.setLevel(logging.INFO if command == "run" else logging.WARNING)
    for handler in (log_file, console):
        handler.docbeam = True
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    return path


def first_line(error: Exception) -> str:
    """Why, without what Beam appends when it re-raises a step's error (the step's name, a traceback's text)."""
    text = str(error).strip()
    return text.split("\n")[0].split(" [while running")[0] if text else type(error).__name__


def positive_int(text: str) -> int:
    """An option's count: a whole number above zero (argparse names the option and exits 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log_path = _setup_logging(args.command, getattr(args, "verbose", False))
    details = f"details and tracebacks: {log_path}, or run again with --verbose"
    if args.command == "report":
        from docbeam.pipeline.tools.report import command as report

        return report.main(args)
    if getattr(args, "sink_command", None) is not None:
        return run_sink_command(args.sink_command, args, details)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        if args.command == "propose-buckets":
            from docbeam.pipeline.tools.bucket_advisor import proposal_report

            print(proposal_report(cfg, args.documents))
            return 0
        if args.command == "validate":
            from docbeam.pipeline.tools.validate import validation_report

            print(validation_report(cfg, verify=args.verify, for_launch=args.for_launch))
            return 0
        beam_args = [a for a in args.beam_args if a != "--"]
        if args.dry_run:
            from docbeam.pipeline.driver.dry_run import dry_run

            print(dry_run(cfg, beam_args).describe())
            return 0
        from docbeam.pipeline.driver.job import run
        from docbeam.pipeline.telemetry.observe import process_started

        summary = run(
            cfg, beam_args=beam_args, force=args.force, wait=not args.no_wait, process_started=process_started()
        )
        if args.no_wait:
            print(f"docbeam: submitted run {summary['run_id']}; the job commits its output to {summary['output']}")
            return 0
    except Refused as e:
        print(f"docbeam: cannot start: {e} ({type(e).__name__}; nothing was touched)", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  the job failed: why comes first and alone; tracebacks in the log file
        log.error("job failed", exc_info=True, extra={"log_file_only": True})
        from docbeam.pipeline.sinks import SinkBehind

        what = (
            "job failed, nothing committed (the previous output is unchanged)"
            if args.command == "run" and not isinstance(e, SinkBehind)
            else f"{args.command} failed"
        )
        print(f"docbeam: {what}: {type(e).__name__}: {first_line(e)}\n{details}", file=sys.stderr)
        return 1
    print(format_summary(summary, cfg.output.path))
    return 0


def run_sink_command(command, args, details: str) -> int:
    """A sink's command (pipeline/sinks/): refused (exit 2) before it touches anything, failed (exit 1), or its
    line printed."""
    try:
        prepared = command.prepare(args)
    except Refused as e:
        print(f"docbeam: cannot start: {first_line(e)}; nothing was touched", file=sys.stderr)
        return 2
    try:
        done = command.run(prepared)
    except Exception as e:  # noqa: BLE001  e.g. a load rolled back; why comes first, tracebacks in the log file
        log.error("%s failed", command.name, exc_info=True, extra={"log_file_only": True})
        print(f"docbeam: {command.name} failed: {type(e).__name__}: {first_line(e)}\n{details}", file=sys.stderr)
        return 1
    print(done)
    return 0


def format_summary(s: dict, output: str) -> str:
    from docbeam.pipeline.driver import precision_gate_at_start

    lines = [
        f"docbeam: done in {s['wall_seconds']:.1f} s → {output}",
        f"  documents  read {s['docs_read']}, {verb(s)} {s['docs_embedded']}, rejected {s['docs_rejected']}"
        + (f" {json.dumps(s['rejected_by_kind'])}" if s["rejected_by_kind"] else ""),
        *(
            [format_head(s["head"], s.get("labels")) + format_sizes(s.get("representations"), s["head"])]
            if notable_head(s.get("head"))
            else []
        ),
        *(
            [f"  selected   {s['docs_selected']} documents where {s['select']['where']} (selected/)"]
            if "docs_selected" in s
            else []
        ),
        *(
            [
                f"  reused     {s['docs_reused']} documents ({s['reused_token_share']:.1%} of tokens) from run "
                f"{s['reuse']['run_id']}; encoded {s['docs_encoded']}"
            ]
            if s.get("docs_reused")
            else []
        ),
        *([f"  reuse      none: {s['reuse']['reason']}"] if s.get("reuse", {}).get("reason") else []),
        f"  windows    {s['windows']} in {s['batches']} batches ({s['compiles']} compilations)",
        f"  tokens     {s['real_tokens']} real / {s['padded_tokens']} padded "
        f"(padding efficiency {s['padding_efficiency']})",
        f"  speed      {s['docs_per_second']} docs/s, {s['tokens_per_second']} tokens/s",
        f"  attention  requested {s['attention_requested']}; ran {json.dumps(s['attention_backends'])}"
        + (f"; fallbacks {json.dumps(s['fallbacks'])}" if s["fallbacks"] else "")
        + measured_line(s.get("attention_plan") or {}),
        *([engine_line(s)] if s.get("engines") else []),
        *([f"  cost       {cost.describe(s['cost'])}"] if "cost" in s else []),
        *(
            [f"  precision  {s['dtype']}: {precision_gate_at_start.describe(s['precision_gate'])}"]
            if s.get("precision_gate")
            else []
        ),
        *([format_startup(s)] if s.get("startup") else []),
        *sink_lines(s),
    ]
    return "\n".join(lines)


def engine_line(s: dict) -> str:
    """What compiled and ran the forward (runner.engine), per bucket with the reason its shapes gave."""
    per_bucket = "; ".join(
        f"{bucket}: " + ", ".join(f"{why} ({n})" for why, n in sorted(b.get("engines", {}).items()))
        for bucket, b in sorted(s.get("buckets", {}).items(), key=lambda kv: int(kv[0]))
        if b.get("engines")
    )
    return f"  engine     ran {json.dumps(s['engines'])}" + (f"; {per_bucket}" if per_bucket else "")


def measured_line(plan: dict) -> str:
    """For attention.backend auto: what each bucket's measurement chose and why."""
    parts = [
        f"{bucket}: {line['measurement']['chosen']} ({line['measurement']['why']})"
        for bucket, line in plan.items()
        if isinstance(line, dict) and isinstance(line.get("measurement"), dict)
    ]
    return f"; measured {'; '.join(parts)}" if parts else ""


def described(head: dict) -> dict:
    """The run's head as its summary describes it, one written before heads declared their lines included."""
    from docbeam.models.heads.registry import described as head_described

    return head_described(head)


def verb(s: dict) -> str:
    return described(s.get("head") or {}).get("verb", "embedded")


def notable_head(head: dict | None) -> bool:
    """A run's head is worth a line unless it is the plain embedding of an embedding checkpoint."""
    return bool(head) and "line" in described(head)


def format_head(head: dict, labels: dict | None) -> str:
    """Which head ran (its own line: models/heads/), and the labels its rows were given."""
    shown = f"; top labels {json.dumps(labels)}" if labels else ""
    return f"  head       {described(head)['line']}{shown}"


def format_sizes(representations: dict | None, head: dict) -> str:
    """What a document's row holds beyond one dense vector: ``; per document: multi_vector 30.5 vectors``."""
    if not representations or set(representations) <= {"embedding"}:
        return ""
    return "; per document: " + ", ".join(
        f"{name} " + " ".join(f"{v} {k.removesuffix('_per_document')}" for k, v in sizes.items())
        for name, sizes in representations.items()
    )


def sink_lines(s: dict) -> list[str]:
    """Each sink's line for the record its step after the commit left in the summary."""
    from docbeam.pipeline import sinks

    lines = [sink.summary_line(s[key]) for key, sink in sinks.SINKS.items() if s.get(key)]
    return [line for line in lines if line]


def format_startup(s: dict) -> str:
    """One line of summary.json's start-up breakdown and stage shares."""
    from docbeam.pipeline.telemetry.observe import STAGES

    startup, since = s["startup"], s["startup"]["since_process_start_s"]
    parts = [f"{name} {startup['steps_s'][name]:.1f} s" for name in ("imports", "plan", "lock_and_checks", "graph")]
    parts += [
        "encoder warm from an earlier job in this process" if name == "reused" else f"encoder {name} {seconds:.1f} s"
        for name, seconds in sorted(startup["encoder_s"].items())
    ]
    first = f"first batch after {since['first_batch_started']:.1f} s" if "first_batch_started" in since else "no batch"
    shares = s.get("stages", {}).get("share_of_wall", {})
    shares = ", ".join(f"{k} {shares[k]:.1%}" for k in (*STAGES, "other") if k in shares)
    return f"  start-up   {first} ({', '.join(parts)})" + (f"\n  stages     {shares}" if shares else "")


if __name__ == "__main__":
    sys.exit(main())
