"""``docbeam``: run a job, validate a config, report on a run.

Exit codes: 0 the run committed its output (some documents may have been rejected: see errors/); 1 the
job ran but failed, nothing was committed and the previous output is unchanged; 2 refused at start
(config, checkpoint, attention, input or output), nothing was touched.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline import config as config_lib

log = logging.getLogger("docbeam")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="docbeam", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the pipeline"), ("validate", "check a config and show what would run")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="YAML job config, e.g. configs/local.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set attention.backend=flash (repeatable); a relative path "
                            "is relative to the current folder (the file's own paths: to the file)")
        if name == "run":
            p.add_argument("--force", action="store_true",
                           help="take over the output's lock even if another run seems alive")
            p.add_argument("--no-wait", action="store_true",
                           help="return once the job is submitted (a Flex Template launcher); the job commits "
                                "its output and releases the lock itself")
            p.add_argument("--dry-run", action="store_true",
                           help="build the Dataflow job (graph, pickled DoFns, environment), print the options "
                                "Dataflow would receive, submit nothing; no lock, no input or output touched")
            p.add_argument("beam_args", nargs=argparse.REMAINDER,
                           help="after --: extra Beam pipeline options, e.g. -- --direct_num_workers=2")
        else:
            p.add_argument("--verify", action="store_true",
                           help="also run each bucket's backend against native on a probe batch here")
            p.add_argument("--for-launch", action="store_true",
                           help="first refuse (exit 2) the profiles' placeholder project, buckets and image, as "
                                "run --dry-run and the Flex Template launcher do: a CI step before a launch")
    p = sub.add_parser("propose-buckets", help="propose bucket lengths and token budget from the corpus")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--documents", type=int, default=10_000, help="how many documents to sample (default 10000)")
    from pipeline import report

    report.add_arguments(sub.add_parser("report", help="HTML report (with charts) of a run's output"))
    return parser


def _setup_logging():
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("docbeam", "pipeline", "models", "attention"):
        logging.getLogger(name).setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    if args.command == "report":
        from pipeline import report

        return report.main(args)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        if args.command == "propose-buckets":
            from pipeline.bucket_advisor import proposal_report

            print(proposal_report(cfg, args.documents))
            return 0
        if args.command == "validate":
            from pipeline.validate import validation_report

            print(validation_report(cfg, verify=args.verify, for_launch=args.for_launch))
            return 0
        beam_args = [a for a in args.beam_args if a != "--"]
        if args.dry_run:
            from pipeline.dry_run import dry_run

            print(dry_run(cfg, beam_args).describe())
            return 0
        from pipeline.observe import process_started
        from pipeline.run import run_job

        summary = run_job(cfg, beam_args, force=args.force, wait=not args.no_wait,
                          process_started=process_started())
        if args.no_wait:
            print(f"docbeam: submitted run {summary['run_id']}; the job commits its output to {summary['output']}")
            return 0
    except config_lib.ConfigError as e:
        print(f"docbeam: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  the job failed: say why in one line, details in the log above
        from attention.plan import AttentionPlanError
        from models.checkpoint import CheckpointError
        from pipeline.lock import LockHeld
        from pipeline.output import OutputRefused

        if isinstance(e, (AttentionPlanError, CheckpointError, LockHeld, OutputRefused)):
            print(f"docbeam: cannot start: {e}", file=sys.stderr)
            return 2
        log.exception("job failed")
        print(f"docbeam: job failed, nothing committed (the previous output is unchanged): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary, cfg.output.path))
    return 0


def format_summary(s: dict, output: str) -> str:
    lines = [
        f"docbeam: done in {s['wall_seconds']:.1f} s → {output}",
        f"  documents  read {s['docs_read']}, embedded {s['docs_embedded']}, rejected {s['docs_rejected']}"
        + (f" {json.dumps(s['rejected_by_kind'])}" if s["rejected_by_kind"] else ""),
        *([f"  reused     {s['docs_reused']} documents ({s['reused_token_share']:.1%} of tokens) from run "
           f"{s['reuse']['run_id']}; encoded {s['docs_encoded']}"] if s.get("docs_reused") else []),
        *([f"  reuse      none: {s['reuse']['reason']}"] if s.get("reuse", {}).get("reason") else []),
        f"  windows    {s['windows']} in {s['batches']} batches ({s['compiles']} compilations)",
        f"  tokens     {s['real_tokens']} real / {s['padded_tokens']} padded "
        f"(padding efficiency {s['padding_efficiency']})",
        f"  speed      {s['docs_per_second']} docs/s, {s['tokens_per_second']} tokens/s",
        f"  attention  requested {s['attention_requested']}; ran {json.dumps(s['attention_backends'])}"
        + (f"; fallbacks {json.dumps(s['fallbacks'])}" if s["fallbacks"] else ""),
        *([format_startup(s)] if s.get("startup") else []),
    ]
    return "\n".join(lines)


def format_startup(s: dict) -> str:
    """One line of summary.json's start-up breakdown and stage shares."""
    from pipeline.observe import STAGES

    startup, since = s["startup"], s["startup"]["since_process_start_s"]
    parts = [f"{name} {startup['steps_s'][name]:.1f} s" for name in ("imports", "plan", "lock_and_checks", "graph")]
    parts += [f"encoder {name} {seconds:.1f} s" for name, seconds in sorted(startup["encoder_s"].items())]
    first = (f"first batch after {since['first_batch_started']:.1f} s" if "first_batch_started" in since
             else "no batch")
    shares = s.get("stages", {}).get("share_of_wall", {})
    shares = ", ".join(f"{k} {shares[k]:.1%}" for k in (*STAGES, "other") if k in shares)
    return f"  start-up   {first} ({', '.join(parts)})" + (f"\n  stages     {shares}" if shares else "")


if __name__ == "__main__":
    sys.exit(main())
