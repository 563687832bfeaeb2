"""What every family's config is made of: EncoderConfig (BERT's fields, which each family extends), the
activations and dtypes a config may name, Rope (rotary positions as a checkpoint sets them), and HubConfig,
which reads a Hub ``config.json`` in either of its forms and refuses, naming file, key and value, what a
family does not reproduce. models/families/blocks.py builds the layers; models/families/tensors.py maps
the weights; models/encoder.py re-exports the config and the arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from docbeam.errors import Refused
from docbeam.models.precision import PRECISIONS


class CheckpointError(Refused, ValueError):
    """A checkpoint docbeam cannot run as its authors meant: refused at start (exit 2), naming the file and key."""


DTYPES = tuple(PRECISIONS)  # model.dtype's choices: what each spends reduced precision on is models/precision.py's


def gelu_erf(x):
    """BERT's "gelu", the exact erf form. erf(±4) is ±1 in float32, so clipping its argument there changes
    nothing, and lets XLA:CPU skip its large-argument path (the speed-up measured when it was adopted is in
    CHANGELOG.md); it stays the float64 erf form within 2e-6 over the float32 range (tests/encoder_test.py)."""
    return 0.5 * x * (1.0 + jax.lax.erf(jnp.clip(x * 0.7071067811865476, -4.0, 4.0)))


ACTIVATIONS = {
    "gelu": gelu_erf,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary positions: frequency ``scale · theta^(-2i/H)`` for pair i. ``scale`` is 1 unless the checkpoint
    stretches its context: 1/factor for linear scaling, factor^(-2/H) (with theta·factor) for fixed NTK."""

    theta: float
    style: str = "half"  # "half" (Llama, ModernBERT, GTE, Nomic) or "interleaved" (RoFormer)
    scale: float = 1.0
    # Llama 3's frequency bands: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings);
    # llama3_frequencies below says what they do. None: every frequency scaled alike.
    bands: tuple[float, float, float, float] | None = None


def llama3_frequencies(
    inv_freq_H2: jax.Array, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_position: float
) -> jax.Array:
    """Llama 3's RoPE scaling, as transformers' _compute_llama3_parameters: wavelengths shorter than
    ``original / high_freq_factor`` keep their frequency, those longer than ``original / low_freq_factor`` are
    divided by ``factor``, and the band between blends the two linearly in ``original / wavelength``."""
    wavelen_H2 = 2 * math.pi / inv_freq_H2
    scaled_H2 = jnp.where(wavelen_H2 > original_max_position / low_freq_factor, inv_freq_H2 / factor, inv_freq_H2)
    smooth_H2 = (original_max_position / wavelen_H2 - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_H2 = (1 - smooth_H2) * scaled_H2 / factor + smooth_H2 * scaled_H2
    medium_H2 = (wavelen_H2 >= original_max_position / high_freq_factor) & (
        wavelen_H2 <= original_max_position / low_freq_factor
    )
    return jnp.where(medium_H2, smoothed_H2, scaled_H2)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    position: Literal["absolute", "rope", "relative"] = "absolute"  # relative: none in the input (DeBERTa-v3)
    rope_theta: float = 10000.0
    rope_style: Literal["half", "interleaved"] = "half"  # RoFormer rotates interleaved pairs; Llama-style halves
    rope_scale: float = 1.0  # Rope.scale: what the checkpoint's RoPE scaling does to every frequency (GTE's NTK)
    dtype: str = "float32"  # model.dtype: a models/precision.py Precision (projections only; the rest is float32)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope(self) -> Rope:
        """The rotary positions a rope-position model's layers use (one rule for every family that has one)."""
        return Rope(self.rope_theta, self.rope_style, self.rope_scale)

    @property
    def output_size(self) -> int:
        """The width of the hidden states the model returns, which pooling sees: hidden_size, unless the
        family projects inside the model (EmbeddingGemma 2's embedding_projection)."""
        return self.hidden_size

    def attention_shape(self, features) -> tuple[int, int | None]:
        """(head_dim, key/value heads or None for as many as query heads) of the layers calling attention with
        these AttentionFeatures: one shape for the whole model unless its kinds of layer differ."""
        del features
        return self.head_dim, getattr(self, "num_kv_heads", None)

    @property
    def position_offset(self) -> int:
        """The first position id a window uses: BERT counts from 0 (RoBERTa overrides it)."""
        return 0

    @property
    def attention_features(self) -> tuple:
        """The distinct AttentionFeatures this model's layers call attention with (what the plan asks each
        backend's capability check about, per bucket): BERT's layers are all global, with no bias."""
        from docbeam.attention.interface import AttentionFeatures

        return (AttentionFeatures(),)

    def __post_init__(self):
        self.check_heads()
        if self.dtype not in PRECISIONS:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {', '.join(PRECISIONS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")

    def check_heads(self) -> None:
        """BERT's heads split hidden_size evenly (a decoder with its own head_dim overrides this)."""
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")


_MISSING = object()
SIZES = {
    key: 1
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "num_key_value_heads",
        "head_dim",
        "n_layer",
        "n_layers",
        "n_head",
        "n_heads",
        "n_embd",
        "n_inner",
        "n_positions",
        "dim",
        "hidden_dim",
    )
} | {"type_vocab_size": 0}
EPSILONS = ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "norm_eps")


class HubConfig:
    """A checkpoint's config.json, read by families that accept both the keys files on the Hub carry and
    those transformers 5 writes: ``get`` takes the alternatives, and every refusal names file, key and value."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def check_numbers(self) -> "HubConfig":
        """The sizes every family reads are whole numbers of at least one (type_vocab_size: of at least zero)
        and the norms' epsilons positive finite numbers: a string ``"384"``, ``0`` heads or ``-1`` layers is
        refused here, naming the key, before any arithmetic meets it."""
        for key, value in self.raw.items():
            least = SIZES.get(key)
            if value is None or (least is None and key not in EPSILONS):
                continue
            if least is not None and (type(value) is not int or value < least):
                raise self.error(f"sets {key}: {json.dumps(value)}; it must be a whole number of at least {least}")
            if key in EPSILONS and (type(value) not in (int, float) or not 0 < value < float("inf")):
                raise self.error(f"sets {key}: {json.dumps(value)}; it must be a positive number (e.g. 1e-12)")
        return self

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        if default is _MISSING:
            raise self.error(f"has none of {', '.join(keys)}, which this family needs")
        return default

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"model.path: {self.where} {message}")

    def refuse_unless(self, key: str, allowed: tuple, why: str) -> None:
        """A key whose other values change the model in a way this family does not reproduce."""
        value = self.raw.get(key, allowed[0])
        if value not in allowed:
            raise self.error(
                f"sets {key}: {value!r}, which docbeam does not run ({why}); supported: "
                f"{', '.join(repr(a) for a in allowed)}"
            )

    def activation(self, *keys: str, default: str) -> str:
        value = self.get(*keys, default=default)
        if value not in ACTIVATIONS:
            raise self.error(f"sets {keys[0]}: {value!r}; supported: {sorted(ACTIVATIONS)}")
        return value

    def rope(
        self,
        head_dim: int,
        default_theta: float,
        layer_type: str | None = None,
        legacy_theta: tuple[str, ...] = ("rope_theta",),
        llama3: bool = False,
    ) -> Rope:
        """Half-style rotary positions from transformers 5's ``rope_parameters`` (flat, or nested per layer
        type) or the Hub's ``rope_theta`` / ``rope_scaling``: default, linear, fixed NTK (GTE's ``ntk``), and
        Llama 3's frequency bands where the family's layers apply them (``llama3``)."""
        params = self.raw.get("rope_parameters") or {}
        if layer_type is not None:
            params = params.get(layer_type) or {}
        scaling = dict(self.raw.get("rope_scaling") or {}) if not params else {}
        theta = float(params.get("rope_theta") or self.get(*legacy_theta, default=default_theta))
        kind = (
            params.get("rope_type")
            or params.get("type")
            or scaling.get("rope_type")
            or scaling.get("type")
            or "default"
        )
        factor = float(params.get("factor") or scaling.get("factor") or 1.0)
        key = "rope_parameters" if params else "rope_scaling"
        if kind == "default":
            return Rope(theta)
        if kind == "linear":
            return Rope(theta, scale=1.0 / factor)
        if kind == "llama3" and llama3:
            spec = params or scaling
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if any(spec.get(k) is None for k in keys):
                raise self.error(f"sets {key} {spec}, a llama3 RoPE scaling without all of {', '.join(keys)}")
            return Rope(theta, bands=tuple(float(spec[k]) for k in keys))
        if kind == "ntk" and scaling.get("mixed_b") is None:
            # The Hub's NTKScalingRotaryEmbedding (GTE): base·factor, every frequency divided by factor^(2/H).
            return Rope(theta * factor, scale=factor ** (-2.0 / head_dim))
        raise self.error(
            f"sets {key} {params or scaling}, a RoPE scaling docbeam does not reproduce; supported: "
            "none, linear, ntk (fixed, without mixed_b)"
        )
