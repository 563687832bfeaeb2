"""What every ``flash`` kernel is described by (attention/flash.py picks among them): its options
(``FlashOptions``: Pallas tiles, interpret mode), a ``Kernel`` record (the label it reports, its shape check,
its call, and which AttentionFn features it takes or why it cannot), and the refusal wording kernels share.
The kernels themselves live one file per family: flash_tpu.py, flash_gpu.py, flash_tokamax.py.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import pydantic

from docbeam.attention.interface import AttentionCase

KernelName = Literal["auto", "pallas_tpu", "splash_tpu", "pallas_gpu", "cudnn", "tokamax_triton",
                     "tokamax_mosaic", "tokamax_chunked", "chunked"]


class FlashOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    kernel: KernelName = "auto"
    block_q: pydantic.PositiveInt = 128  # Pallas kernels only: query rows per tile
    block_k: pydantic.PositiveInt = 128  # Pallas kernels only: key columns per tile
    interpret: bool = False  # Pallas kernels only: run in interpret mode, e.g. the TPU kernel on a CPU


@dataclasses.dataclass(frozen=True)
class Kernel:
    label: str  # what Support.kernel reports
    refusal: Callable[[AttentionCase, FlashOptions], str]  # "" when the kernel can run the case's shape
    # run(q_BxTxNxH, k, v, kv_lengths_B, scale, options, features), features: the AttentionFn's optional
    # keywords (segment_ids_BxT, local_window, bias, causal) that the kernel declared in ``takes``; with
    # ``grouped`` in ``takes``, k and v may carry fewer heads than q
    run: Callable[..., jax.Array]
    takes: dict[str, str] = dataclasses.field(default_factory=dict)  # feature → how the kernel receives it
    cannot: dict[str, str] = dataclasses.field(default_factory=dict)  # feature → why it cannot (the refusal)

    def feature_refusal(self, case: AttentionCase) -> str:
        needed = [name for name, wanted in (("segments", case.packed), ("windows", bool(case.local_window)),
                                            ("bias", case.bias), ("causal", case.causal),
                                            ("grouped", case.kv_heads != case.num_heads),
                                            ("relative", case.relative)) if wanted]
        missing = [name for name in needed if name not in self.takes]
        return "; ".join(self.why_not(name) for name in missing)

    def why_not(self, feature: str) -> str:
        if feature in self.cannot:
            return self.cannot[feature]
        if feature == "relative":
            return NO_RELATIVE.format(name=self.label)
        return f"takes no {feature}"


# Why a kernel cannot take a feature, as its refusal says it.
NO_WINDOW = "{name} has no local-window mask (ModernBERT's local layers need one)"
NO_BIAS = "{name} adds no per-head bias (relative-position models need one)"
NO_CAUSAL = "{name} has no causal mask here (decoder models need one)"
# No kernel but docbeam's chunked has a place for a content-dependent term: each would need it as a dense bias.
NO_RELATIVE = ("{name} scores only q·k plus at most a dense bias: DeBERTa's content-to-position and "
               "position-to-content terms would be a [B, N, T, S] array; flash's chunked kernel computes them per "
               "block (attention.backend: chunked)")
NO_GROUPED = ("{name} takes as many k/v heads as q heads (grouped-query decoders have fewer, and repeating them "
              "is the memory the kernel exists to save)")


def off_platform(name: str, platform: str, case: AttentionCase, options: FlashOptions) -> str:
    """A Pallas kernel off its own platform runs only in interpret mode (slowly; what tests on CPU use)."""
    if case.platform == platform or options.interpret:
        return ""
    return (f"{name} runs on {platform.upper()}, not {case.platform}; set flash.interpret: true to run the same "
            "kernel (slowly) in interpret mode")


def not_importable(module: str) -> str:
    """A kernel package that is missing or broken becomes the kernel's refusal reason, never an import error."""
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        return f"{module.split('.')[0]} not importable: {type(e).__name__}: {e}"
    return ""


def is_power_of_two(x: int) -> bool:
    return x & (x - 1) == 0
