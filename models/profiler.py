"""A JAX profiler trace of a worker's first batches, handed to its owner when it ends.

Needed since the first ``profile.batches`` batches show compilation and steady state side by side; a
worker that gets fewer batches still ends its trace when its owner says so (``finish``), before the commit.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Callable


class FirstBatchesProfiler:
    """Traces batches 1..``batches`` (0: never); ``publish(trace_dir)`` copies a finished trace away."""

    def __init__(self, batches: int, publish: Callable[[str], None] | None):
        self.batches = batches if publish is not None else 0
        self._publish = publish
        self._trace_dir: str | None = None
        self._done = 0

    def before_batch(self) -> None:
        if self.batches and self._done == 0 and self._trace_dir is None:
            import jax

            self._trace_dir = tempfile.mkdtemp(prefix="docbeam-profile-")
            jax.profiler.start_trace(self._trace_dir, create_perfetto_trace=True)

    def after_batch(self) -> None:
        self._done += 1
        if self._done >= self.batches:
            self.finish()

    def finish(self) -> None:
        if self._trace_dir is None:
            return
        import jax

        jax.profiler.stop_trace()
        trace_dir, self._trace_dir = self._trace_dir, None
        self._publish(trace_dir)
        shutil.rmtree(trace_dir, ignore_errors=True)
