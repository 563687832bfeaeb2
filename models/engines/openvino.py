"""The encoder's forward for one input shape, exported from JAX and compiled by OpenVINO's CPU plugin: this
module is OpenVINO's side (import, cache keys, read, compile, call); the export runs in a child process
(models/engines/export.py), which imports this module and is never imported by it.

Why jax2onnx and OpenVINO's ONNX reader, not OpenVINO's own JAX frontend (``convert_model`` of a jaxpr): the
frontend is experimental and, at OpenVINO 2026.4, has no rule for ``gather``, ``iota``, ``min`` or ``split``, all
of which the encoder uses (the embedding lookup, positions, masks, the fused QKV split). jax2onnx is maintained
with Flax and exports the whole forward, head included, as one graph (issue 51's trial).

The graph is always exported in float32, the parameters baked in as constants: OpenVINO lowers precision itself
from ``INFERENCE_PRECISION_HINT`` (bfloat16 for a bfloat16 job), and a graph with bfloat16 weights mixed with
float32 accumulation does not load (its Einsum refuses mixed input types). So a bfloat16 job's OpenVINO forward
computes in OpenVINO's bfloat16, which the parity gate holds to XLA's bfloat16 output before it runs.

An exported model is kept as OpenVINO IR under the engine cache (``<compilation cache>/docbeam-openvino``), named
by a key of everything that changes the graph: the checkpoint's digests, the head, the shape, the library
versions and docbeam's models/ code. OpenVINO's own ``CACHE_DIR`` beside it keeps the compiled blobs, so a
second run on the VM neither exports nor compiles again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from docbeam.models.engines.cache_bound import COMPILED, mark_used

log = logging.getLogger(__name__)

# Per dtype of the job: OpenVINO's precision hint (int8 weights have no OpenVINO path here: refused).
PRECISION_HINTS = {"float32": "f32", "bfloat16": "bf16"}
PACKAGES = ("openvino", "jax2onnx")


def openvino_module():
    """``openvino``, imported without its usage telemetry. Importing it sends an event to Google Analytics from a
    forked process unless the user opted out: a fork of a multithreaded JAX process can deadlock, and a worker should
    not send usage data nobody agreed to. Its telemetry is a singleton, so it is created first here under OpenVINO's
    own name with the opt-in dialog's rule: it sends only where the user opted in (``opt_in_out --opt_in``)."""
    try:
        import openvino_telemetry

        openvino_telemetry.Telemetry(
            app_name="OpenVINO",
            app_version=importlib.metadata.version("openvino"),
            tid="docbeam-opt-in-only",
            backend="ga4",
            enable_opt_in_dialog=True,
            disable_in_ci=True,
        )
    except ImportError:
        pass
    import openvino

    return openvino


def unavailable() -> str:
    """Why OpenVINO cannot run here ('' when it can): a package missing, with the fix."""
    missing = []
    for name in PACKAGES:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'docbeam[openvino]')"
    return ""


def precision_refused(dtype: str) -> str:
    """Why OpenVINO would not run ``dtype`` well on this CPU ('' when it would): bfloat16 needs the CPU's own
    bfloat16 instructions (AVX-512 BF16 or AMX); without them OpenVINO emulates it, measured 20x slower than
    XLA:CPU (an Intel Xeon with AVX-512 and no BF16, MiniLM at 16 x 256)."""
    if dtype not in PRECISION_HINTS:
        return f"model.dtype {dtype}: OpenVINO runs float32 and bfloat16 only"
    if dtype == "bfloat16":
        ov = openvino_module()
        capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        if "BF16" not in capabilities:
            return f"this CPU has no native bfloat16 for OpenVINO (its capabilities: {', '.join(capabilities)})"
    return ""


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("jax", "jaxlib", *PACKAGES)}


@functools.lru_cache(maxsize=1)
def models_code_digest() -> str:
    """docbeam's models/ code (families, heads, encoder, this file): editing any of it exports again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def input_layout(inputs: Sequence[Any]) -> tuple:
    """The forward's positional inputs as the export sees them: each array's shape, None where absent (late
    chunking's spans come after two absent packed inputs)."""
    return tuple(None if x is None else tuple(int(d) for d in np.shape(x)) for x in inputs)


def export_key(model: tuple, layout: tuple) -> str:
    """The IR's name: ``model`` (what the runtime knows of the checkpoint and head) and the input layout, with
    the exporter's and OpenVINO's versions and docbeam's models/ code."""
    text = repr((model, layout, sorted(versions().items()), models_code_digest()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def read_exported(folder: str, key: str):
    """The exported model under ``key`` in the engine cache, or None (absent, or damaged: exported again)."""
    xml = os.path.join(folder, f"{key}.xml")
    if not (os.path.exists(xml) and os.path.exists(xml[:-4] + ".bin")):
        return None
    try:
        model = openvino_module().Core().read_model(xml)
    except Exception as e:  # noqa: BLE001  a damaged entry is exported again
        log.warning("OpenVINO model %s cannot be read (%s: %s); exporting again", xml, type(e).__name__, e)
        return None
    mark_used(xml)
    return model


def threads() -> int:
    """The cores this process may use: XLA:CPU uses them all, so OpenVINO is given as many."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass
class OpenVinoForward:
    """One shape's compiled model, called like the XLA executable it stands beside: ``(params, *inputs)`` (the
    parameters are baked into the graph; the absent inputs, None, are not the model's)."""

    compiled: Any  # openvino.CompiledModel
    hint: str
    compile_s: float
    exported_from_cache: bool

    def __post_init__(self):
        self._request = self.compiled.create_infer_request()

    def __call__(self, params, *inputs) -> np.ndarray:
        arrays = [np.asarray(x, np.int32) for x in inputs if x is not None]
        return np.asarray(self._request.infer(arrays)[0], np.float32)


def compile_model(model, dtype: str, folder: str, key: str, cached: bool, t0: float) -> OpenVinoForward:
    """``model`` (read from the engine cache at ``folder`` under ``key``) compiled for this CPU at ``dtype``'s
    precision hint with every core of the process; OpenVINO keeps the compiled blob beside it, in a folder of the
    key's own so that the cache's bound removes it with its IR (models/engines/cache_bound.py)."""
    if dtype not in PRECISION_HINTS:
        raise ValueError(f"model.dtype {dtype} has no OpenVINO precision here (float32 and bfloat16 do)")
    config = {
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS[dtype],
        "INFERENCE_NUM_THREADS": threads(),
        "CACHE_DIR": os.path.join(folder, COMPILED, key),
    }
    compiled = openvino_module().Core().compile_model(model, "CPU", config)
    return OpenVinoForward(compiled, PRECISION_HINTS[dtype], time.perf_counter() - t0, cached)


def why(e: BaseException) -> str:
    """An export's or conversion's failure in a line: OpenVINO's report of the ops it could not convert rather
    than the C++ file and line it was raised from."""
    text = " ".join(str(e).split())
    for marker in ("OpConversionFailure:", "NotImplementedError:"):
        if marker in text:
            text = text.split(marker, 1)[1].strip()
    return text[:400]
