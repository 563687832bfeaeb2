"""The engine that compiles and runs the encoder's forward on a CPU worker: XLA (jax.jit, always there) or
OpenVINO (the same Flax forward exported through jax2onnx and compiled by OpenVINO: models/engines/openvino.py).

Why a second engine: on Intel's Xeons OpenVINO's CPU plugin runs the very same graph faster than XLA:CPU in
bfloat16 and somewhat faster in float32 (issue 51's figures; docs/performance.md). Why not always: on a CPU without
native bfloat16 it emulates it and runs many times slower, some ops do not export, and a kernel of ours (Pallas)
never does. So, like ``attention.backend: auto``, the engine is chosen per (rows, bucket) shape on the worker's own
CPU, held to XLA's output first (models/engines/choose.py), and every record names the engine that ran.
"""

from __future__ import annotations

from typing import Literal

ENGINES = ("xla", "openvino", "auto")
Engine = Literal["xla", "openvino", "auto"]
XLA, OPENVINO, AUTO = ENGINES
