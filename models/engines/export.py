"""The export of one shape's forward, in a process of its own.

Why a process: jax2onnx converts by swapping some of jax.numpy's functions (``jnp.clip`` among them) for shims
that bind its own primitives, for the whole process, while it traces. Any other thread tracing at that moment (the
compile pool's XLA compilation of the next shape, a second worker's encoder) picks up a shim XLA cannot lower and
fails ("MLIR translation rule for primitive 'jax.numpy.clip' not found"). In a child process the swap touches
nothing of the worker's. The child loads the checkpoint in float32 itself (what OpenVINO exports; it lowers the
precision from its hint), writes the IR into the engine cache and waits for the next shape; the worker reads and
compiles it. models/engines/exporter.py starts the child, keeps it while exports come and ends it.

    python -m docbeam.models.engines.export   (requests on stdin: a length and a pickled Recipe, layout, folder, key)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import tempfile
import time
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the child needs to build the forward: picklable, as the encoder plan a worker receives is."""

    model_path: str
    head: Any  # a models/heads Head; its for_export() form is the one exported
    attention: Any  # the job's AttentionConfig
    backend: str
    task: str | None = None


def forward(recipe: Recipe):
    """``(*inputs) -> output`` in float32 with the parameters baked in as JAX arrays (a numpy table indexed by a
    traced array, MPNet's relative-position buckets, would not trace)."""
    import jax
    import jax.numpy as jnp

    from docbeam.attention.dispatch import bind_choice
    from docbeam.models import checkpoint, encoder

    head = recipe.head.for_export()
    ck = checkpoint.open_checkpoint(recipe.model_path, "float32", with_weights=True, task=recipe.task)
    params = checkpoint.load_params(ck.folder, ck.config)
    if head.layers or head.reduce is not None:
        params = {"encoder": params, "head": head.load_params(ck.folder)}
    params = jax.tree.map(jnp.asarray, params)
    attend = bind_choice(recipe.attention, recipe.backend)
    embed = encoder.embed_fn(ck.config, attend, head.pooling, head.layers, head.reduce)
    return lambda *inputs: embed(params, *inputs)


def export(fn: Callable[..., Any], layout: tuple, folder: str, key: str) -> None:
    """``fn(*inputs)`` for ``layout`` (int32 inputs; None: absent) exported into the engine cache at ``folder``
    as OpenVINO IR. Raises what the exporter raises (an op it lacks, a Pallas kernel). Run in a process of its
    own (``main``): jax2onnx swaps jax.numpy functions process-wide while it traces."""
    import jax
    import numpy as np
    from jax2onnx import to_onnx

    from docbeam.models.engines.openvino import openvino_module

    ov = openvino_module()
    present = [i for i, shape in enumerate(layout) if shape is not None]

    def positional(*arrays):
        inputs = [None] * len(layout)
        for i, x in zip(present, arrays):
            inputs[i] = x
        return fn(*inputs)

    specs = [jax.ShapeDtypeStruct(layout[i], np.int32) for i in present]
    os.makedirs(folder, exist_ok=True)
    xml = os.path.join(folder, f"{key}.xml")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        onnx_path = os.path.join(tmp, "forward.onnx")
        to_onnx(positional, specs, model_name="docbeam_encoder", return_mode="file", output_path=onnx_path)
        model = ov.Core().read_model(onnx_path)
        # Written under a temporary name and renamed: a process killed mid-write leaves no half entry.
        partial = os.path.join(tmp, "model.xml")
        ov.save_model(model, partial, compress_to_fp16=False)
        os.replace(partial[:-4] + ".bin", xml[:-4] + ".bin")
        os.replace(partial, xml)


def compile_shape(recipe: Recipe, layout: tuple, dtype: str, folder: str, key: str):
    """``recipe``'s forward for ``layout`` as an OpenVinoForward: read from the engine cache, or exported there by
    the export process first."""
    from docbeam.models.engines.cache_bound import prune
    from docbeam.models.engines.exporter import EXPORTER
    from docbeam.models.engines.openvino import compile_model, read_exported

    t0 = time.perf_counter()
    model = read_exported(folder, key)
    cached = model is not None
    if model is None:
        EXPORTER.export((recipe, layout, folder, key))
        model = read_exported(folder, key)
        if model is None:
            raise RuntimeError(f"the export process wrote no readable model under {folder}")
        prune(folder)  # the cache grew: back within its bound
    return compile_model(model, dtype, folder, key, cached, t0)


def main() -> int:
    """The export process: requests until its stdin closes, one JSON line a reply on the stdout it started with.
    What the libraries print goes to stderr instead, so that no stray line is read as a reply. Each request loads
    its checkpoint afresh: a checkpoint rewritten in place between two shapes must not export from the old one."""
    from docbeam.models.engines.exporter import HEADER
    from docbeam.models.engines.openvino import openvino_module, why

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    openvino_module()
    while len(header := requests.read(HEADER.size)) == HEADER.size:
        (size,) = HEADER.unpack(header)
        recipe, layout, folder, key = pickle.loads(requests.read(size))
        try:
            export(forward(recipe), layout, folder, key)
            reply = {"ok": True}
        except Exception as e:  # noqa: BLE001  the reason goes back to the worker, which refuses the shape with it
            reply = {"ok": False, "error": f"{type(e).__name__}: {why(e)}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
