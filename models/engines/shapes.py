"""The runtime's side of the engine choice: per shape, XLA's forward beside OpenVINO's (where the shape may and
does export), and the verdict of its first batch. models/runtime.py calls only ``EngineSet.prepare`` (when a
shape compiles) and ``EngineSet.decide`` (on its first batch); everything else about OpenVINO stays here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from typing import Any, Callable

from docbeam.models.engines import AUTO, OPENVINO, XLA
from docbeam.models.engines.choose import Verdict, VerdictCache, decide, verdict_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShapeForward:
    """One shape's forward, called like XLA's executable: OpenVINO's once its first batch chose it, else XLA's.
    ``refused``: why OpenVINO has no model for this shape ('' when it has one)."""

    xla: Callable[..., Any]
    openvino: Any = None  # models/engines/openvino.OpenVinoForward
    refused: str = ""
    key: str = ""  # the export key: auto's verdict is cached under it and the CPU
    compile_s: float = 0.0  # exporting (or reading) and compiling OpenVINO's model
    verdict: Verdict | None = None
    told: bool = False  # a timing record has carried the verdict's figures

    def __call__(self, params, *inputs):
        run = self.openvino if self.verdict is not None and self.verdict.engine == OPENVINO else self.xla
        return run(params, *inputs)


def engine_off(requested: str, platform: str, chips: int, dtype: str, backend: str) -> str:
    """Why every shape of this worker (or of this backend's buckets) runs on XLA ('' when OpenVINO may run)."""
    from docbeam.models.engines.openvino import precision_refused, unavailable

    if requested == XLA:
        return "runner.engine: xla"
    if platform != "cpu":
        return f"OpenVINO runs on CPU workers; this worker's chips are {platform}"
    if chips > 1:
        return f"OpenVINO runs on one CPU device; runner.mesh spreads the encoder over {chips}"
    if backend != "native":
        return f"attention backend {backend} is a kernel for XLA; OpenVINO exports the native attention only"
    return unavailable() or precision_refused(dtype)


@dataclasses.dataclass
class EngineSet:
    """One runtime's engines: what was asked (``runner.engine``), how to build the float32 forward to export
    (``recipe(backend)``: models/engines/export.py), and where the exported models and auto's verdicts are kept."""

    requested: str  # xla | openvino | auto
    platform: str
    chips: int
    dtype: str
    model_key: tuple  # the checkpoint's digests, the head, the task: part of every export key
    recipe: Callable[[str], Any]  # backend -> the export.Recipe of its forward
    folder: str  # the engine cache
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # Late chunking's shapes and those not compiled ahead: their ShapeForward, built on first use.
    _first_use: dict = dataclasses.field(default_factory=dict)

    def off(self, backend: str) -> str:
        return engine_off(self.requested, self.platform, self.chips, self.dtype, backend)

    def prepare(self, backend: str, xla: Callable[..., Any], layout: tuple) -> ShapeForward:
        """XLA's forward for ``layout``, beside OpenVINO's where it may and can export (a failure refuses the
        shape with its reason; it never fails the job)."""
        from docbeam.models.engines import openvino
        from docbeam.models.engines.export import compile_shape

        why = self.off(backend)
        if why:
            return ShapeForward(xla, refused=why)
        key = openvino.export_key((self.model_key, backend), layout)
        kept = self.cached_xla(key)
        if kept is not None:  # auto measured XLA faster on this CPU before: OpenVINO is neither exported nor held
            log.info("engine for %s: xla (%s; cached, OpenVINO not compiled)", key, kept.reason)
            return ShapeForward(xla, key=key, verdict=kept)
        try:
            with self._lock:  # one export at a time: each child loads and traces the whole model
                compiled = compile_shape(self.recipe(backend), layout, self.dtype, self.folder, key)
        except Exception as e:  # noqa: BLE001  an op the exporter lacks, a Pallas call: this shape runs on XLA
            reason = f"OpenVINO cannot take this shape ({type(e).__name__}: {openvino.why(e)})"
            log.warning("%s %s: %s", backend, layout, reason)
            return ShapeForward(xla, refused=reason)
        return ShapeForward(xla, compiled, key=key, compile_s=compiled.compile_s)

    def cached_xla(self, key: str) -> Verdict | None:
        """auto's cached verdict for the shape where it kept XLA, else None. Parity does not matter where XLA runs,
        and a compiled OpenVINO model it would never call holds the whole model's weights again in memory."""
        if self.requested != AUTO:
            return None
        cached = VerdictCache(self.folder).read(verdict_key(key, self.dtype))
        if cached is None or cached.engine != XLA:
            return None
        return dataclasses.replace(cached, parity="")

    def forward(self, key, forward):
        """What runs the batch of ``key``: its ShapeForward (compiled ahead, or built on first use)."""
        return self._first_use.get(key, forward)

    def for_batch(self, key, forward, jitted, params, inputs, outputs, wait_for_compiles) -> tuple[Verdict, str]:
        """(the verdict for the batch's shape, its figures as JSON on the shape's first batch, else ''). ``forward``:
        the pool's ShapeForward for ``key``, or XLA's ``jitted`` forward for a shape built here on first use."""
        from docbeam.models.engines.openvino import input_layout

        if not isinstance(forward, ShapeForward):  # late chunking's spans, or a shape not compiled ahead
            if key not in self._first_use:
                self._first_use[key] = self.prepare(key[0], jitted, input_layout(inputs))
            forward = self._first_use[key]
        if forward.verdict is None and forward.openvino is not None and self.requested == AUTO:
            # auto times the two engines: not beside the other shapes' compilations (a failed one fails its own
            # shape's batch, not this one)
            with contextlib.suppress(Exception):
                wait_for_compiles()
        verdict = self.decide(forward, params, inputs, outputs)
        told, forward.told = ("" if forward.told else json.dumps(verdict.as_dict(), sort_keys=True)), True
        return verdict, told

    def decide(self, shape: ShapeForward, params, inputs: tuple, outputs: Callable[[Any], Any]) -> Verdict:
        """The shape's verdict on its first batch (``inputs``, as the forward takes them)."""
        import jax

        if shape.verdict is None:
            if shape.openvino is None:
                shape.verdict = Verdict(XLA, shape.refused)
            else:
                shape.verdict = decide(
                    self.requested,
                    self.dtype,
                    lambda: jax.block_until_ready(shape.xla(params, *inputs)),
                    lambda: shape.openvino(params, *inputs),
                    outputs,
                    VerdictCache(self.folder) if self.requested == AUTO else None,
                    verdict_key(shape.key, self.dtype),
                )
            if shape.verdict.engine == XLA:
                shape.openvino = None  # never called from here on: its memory goes back
            log.info("engine for %s: %s (%s)", shape.key or "shape", shape.verdict.engine, shape.verdict.reason)
        return shape.verdict


def engine_folder(compilation_cache_local: str | None) -> str:
    """The engine cache: beside JAX's compilation cache (its local folder, the VM's copy of a gs:// one), else
    beside JAX_COMPILATION_CACHE_DIR's, else in the user's cache folder."""
    import jax

    base = compilation_cache_local or jax.config.jax_compilation_cache_dir
    if base and "://" not in str(base):
        return os.path.join(str(base), "docbeam-openvino")
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "docbeam", "openvino")
