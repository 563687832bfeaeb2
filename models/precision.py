"""Where the encoder spends reduced precision: ``model.dtype`` names a Precision, and ``Linear`` (every
projection of every family: q/k/v, attention output, MLP in and out) is the only place it is spent.

Why only there: XLA:CPU runs a dot whose inputs are bfloat16 and whose result is float32 natively, but a
dot whose result is bfloat16 it upcasts (convert both inputs to float32, an f32 dot, convert back). A model
whose every op computes in bfloat16 therefore pays three converts per matmul and still multiplies in
float32 (docs/performance.md "## Precision" has the HLO). So the residual stream, norms, softmax, rotary
positions and pooling stay float32; a projection takes its input in the reduced type, its weights stored
in it at load, and accumulates in float32 (bfloat16) or int32 (int8). Attention's q, k and v reach the
attention function in ``Precision.attention``, which its einsums accumulate in float32.

int8: weights quantised per output channel when the checkpoint is loaded (``prepare_params``: no export
step), activations per token at run time (symmetric, absmax/127), int8 × int8 → int32, then rescaled by
row scale × channel scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from docbeam.errors import Refused

INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class Precision:
    """One ``model.dtype``: how projection weights are stored (and so the type their dots take), and the
    type q, k and v reach the attention function in. Everything else is float32."""

    name: str
    weights: Any  # jnp dtype of Linear kernels: float32, bfloat16, or int8 with a float32 scale per channel
    attention: Any  # jnp dtype of q, k, v as the AttentionFn receives them

    @property
    def quantized(self) -> bool:
        return self.weights == jnp.int8


PRECISIONS = {
    "float32": Precision("float32", jnp.float32, jnp.float32),
    "bfloat16": Precision("bfloat16", jnp.bfloat16, jnp.bfloat16),
    # Attention stays float32: its matmuls are a small share at encoder lengths, and per-token int8 scores
    # would need a scale per key as well.
    "int8": Precision("int8", jnp.int8, jnp.float32),
}


# (model.dtype, platform) → why it is refused there. int8 is measured only on CPU (benchmarks/precision.py),
# where VNNI makes it faster than float32; off CPU bfloat16 is the reduced precision docbeam has measured.
_INT8_OFF_CPU = (
    "int8 projections are measured faster than float32 only on CPU (benchmarks/precision.py); on "
    "this platform they are unmeasured, and bfloat16 runs on its matrix units"
)
REFUSED: dict[tuple[str, str], str] = {("int8", "gpu"): _INT8_OFF_CPU, ("int8", "tpu"): _INT8_OFF_CPU}


class PrecisionRefused(Refused, ValueError):
    """A model.dtype this platform runs slower than float32, or not at all: refused at start (exit 2)."""


def precision_of(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"model.dtype {name!r} is not supported; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def precision_for(name: str, platform: str) -> Precision:
    """The precision, unless it is refused on ``platform`` (the plan's target platform): then why."""
    reason = REFUSED.get((name, platform))
    if reason:
        allowed = [other for other in PRECISIONS if (other, platform) not in REFUSED]
        raise PrecisionRefused(
            f"model.dtype: {name} is refused on {platform}: {reason}; use one of {', '.join(allowed)}"
        )
    return precision_of(name)


def quantize_channels(kernel_IxO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel [in, out] → int8 [in, out] and one float32 scale per output channel [out]
    (absmax/127, symmetric; an all-zero channel gets scale 1). ``kernel ≈ q * scale``."""
    kernel_IxO = np.asarray(kernel_IxO, np.float32)
    scale_O = np.abs(kernel_IxO).max(axis=0) / INT8_MAX
    scale_O = np.where(scale_O > 0, scale_O, 1.0).astype(np.float32)
    q_IxO = np.clip(np.rint(kernel_IxO / scale_O), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q_IxO, scale_O


def quantize_rows(x_NxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations per token: int8 [..., D] and a float32 scale per row [..., 1] (absmax/127)."""
    scale_Nx1 = jnp.max(jnp.abs(x_NxD), axis=-1, keepdims=True) / INT8_MAX
    scale_Nx1 = jnp.where(scale_Nx1 > 0, scale_Nx1, 1.0)
    q_NxD = jnp.clip(jnp.round(x_NxD / scale_Nx1), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q_NxD, scale_Nx1


def int8_matmul(x_NxI: jax.Array, q_IxO: jax.Array, scale_O: jax.Array) -> jax.Array:
    """x (float) @ the quantised kernel, in float32: x quantised per row, int8 × int8 accumulated in int32."""
    qx_NxI, row_scale_Nx1 = quantize_rows(x_NxI.astype(jnp.float32))
    acc_NxO = jax.lax.dot_general(
        qx_NxI, q_IxO, (((x_NxI.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )
    return acc_NxO.astype(jnp.float32) * (row_scale_Nx1 * scale_O)


def _int8_kernel_init(key, shape, dtype=jnp.int8):
    return jax.random.randint(key, shape, -INT8_MAX, INT8_MAX + 1, jnp.int32).astype(dtype)


class Linear(nn.Module):
    """flax's Dense (same parameter names, initialisers and [in, out] layout) with the precision's dot: the
    input cast to the weights' type and accumulated in float32, or quantised per token against int8
    weights. The result is float32 in every precision; so is the bias."""

    features: int
    precision: Precision
    use_bias: bool = True

    @nn.compact
    def __call__(self, x_xI: jax.Array) -> jax.Array:
        shape = (x_xI.shape[-1], self.features)
        if self.precision.quantized:
            kernel = self.param("kernel", _int8_kernel_init, shape, jnp.int8)
            scale = self.param(
                "scale", nn.initializers.constant(1.0 / (INT8_MAX * math.sqrt(shape[0]))), (self.features,), jnp.float32
            )
            y_xO = int8_matmul(x_xI, kernel, scale)
        else:
            dot_dtype = self.precision.weights
            kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, dot_dtype)
            y_xO = jax.lax.dot_general(
                x_xI.astype(dot_dtype),
                kernel.astype(dot_dtype),
                (((x_xI.ndim - 1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        if self.use_bias:
            y_xO = y_xO + self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        return y_xO


def prepare_params(params: dict, precision: Precision) -> dict:
    """A family's float32 parameter tree → the one ``precision`` runs: every Linear's kernel (a dict holding a
    2-D ``kernel``) stored as bfloat16, or as int8 with its ``scale`` per output channel. Done once, when the
    checkpoint is loaded, so the forward never converts a weight."""
    if precision.weights == jnp.float32:
        return params

    def walk(node):
        if not isinstance(node, dict):
            return node
        if np.ndim(node.get("kernel")) == 2:
            if precision.quantized:
                kernel, scale = quantize_channels(node["kernel"])
                return {**node, "kernel": kernel, "scale": scale}
            return {**node, "kernel": np.asarray(node["kernel"], np.float32).astype(precision.weights)}
        return {key: walk(value) for key, value in node.items()}

    return walk(params)
