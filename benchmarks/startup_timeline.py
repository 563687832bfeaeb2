"""What each thread of a `docbeam run` is doing, 100 ms at a time, from the process's start to past the first
batch: the timeline behind docs/performance.md's account of start-up.

    python benchmarks/startup_timeline.py [--until 5] [--step 0.1] [--config configs/local.yaml] [--set k=v ...]

Runs the job in this process with a thread that reads every other thread's stack (``sys._current_frames()``)
every 5 ms, then prints, per step and thread, how many samples were busy and the innermost docbeam frame with
the innermost Beam, JAX or Flax frame under it. Waiting threads (a lock, a queue, a sleep) are left out, so
where two threads are busy in the same step they took the interpreter's lock in turn: Python work on the way
to the first batch adds up rather than overlaps. The sampler takes the lock too, so the run is a little
slower than a plain one. Prints only; a timeline is for reading, not for a ratio.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

IDLE = {"wait", "_wait_for_tstate_lock", "sleep", "get", "select", "_worker", "result", "acquire"}
LIBRARIES = ("apache_beam", "/jax/", "/flax/")


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--until", type=float, default=5.0, help="seconds after the process's start to print (default 5)")
    p.add_argument("--step", type=float, default=0.1, help="seconds per line (default 0.1)")
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


class Sampler:
    """Every other thread's innermost frames, every ``interval`` seconds, stamped from ``t0``."""

    def __init__(self, t0: float, interval: float = 0.005):
        self.t0, self.interval, self.samples = t0, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        names = {}
        while not self._stop.wait(self.interval):
            now = time.time() - self.t0
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    self.samples.append((now, names.get(ident, str(ident)), label(frame)))


def label(frame) -> str | None:
    """The innermost docbeam frame and the innermost library frame, or None for a waiting thread."""
    if frame.f_code.co_name in IDLE:
        return None
    ours = library = None
    while frame is not None and not (ours and library):
        path = frame.f_code.co_filename
        if ours is None and path.startswith(common.REPO) and "site-packages" not in path:
            ours = f"{frame.f_code.co_name}@{os.path.relpath(path, common.REPO)}:{frame.f_lineno}"
        if library is None and any(lib in path for lib in LIBRARIES):
            library = f"{path.split('site-packages/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return f"{ours or '-'}  {library or ''}"


def timeline(samples, until: float, step: float) -> list[list]:
    bins = collections.defaultdict(collections.Counter)
    for t, thread, what in samples:
        if what is not None and t < until:
            bins[(int(t / step), thread)][what] += 1
    return [
        [f"{b * step:.1f}", thread, sum(c.values()), c.most_common(1)[0][0]] for (b, thread), c in sorted(bins.items())
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    from docbeam.pipeline.telemetry.observe import process_started

    t0 = process_started()
    with Sampler(t0) as sampler:
        from docbeam import config as config_lib
        from docbeam.pipeline.driver.cli import _setup_logging
        from docbeam.pipeline.driver.run import run_job

        _setup_logging()
        with tempfile.TemporaryDirectory(prefix="docbeam-timeline-") as tmp:
            out = os.path.join(tmp, "out")
            cfg = config_lib.load(args.config, [f"output.path={out}", "runner.progress_seconds=0", *args.set])
            summary = run_job(cfg, process_started=t0)
    since = summary["startup"]["since_process_start_s"]
    print(
        common.table(
            ["s", "thread", "busy samples", "innermost docbeam frame, innermost library frame"],
            timeline(sampler.samples, args.until, args.step),
        )
    )
    print(
        f"\nplan done {since['plan_done']:.2f} s, pipeline started {since['pipeline_started']:.2f} s, "
        f"first batch {since.get('first_batch_started', float('nan')):.2f} s after the process started"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
