"""What every ``flash`` kernel is described by (attention/flash/__init__.py picks among them): its options
(``FlashOptions``: Pallas tiles, interpret mode), a ``Kernel`` record (the label it reports, its shape check,
its call, and which features of attention/features.py it takes, or why it cannot), and the refusal wording
kernels share.
The kernels themselves live one file per family beside it: tpu.py, gpu.py, tokamax.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import pydantic

from docbeam.attention.features import DECLARED
from docbeam.attention.interface import AttentionCase

KernelName = Literal[
    "auto",
    "pallas_tpu",
    "splash_tpu",
    "pallas_gpu",
    "cudnn",
    "tokamax_triton",
    "tokamax_mosaic",
    "tokamax_chunked",
    "chunked",
]


class FlashOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    kernel: KernelName = "auto"
    block_q: pydantic.PositiveInt = 128  # Pallas kernels only: query rows per tile
    block_k: pydantic.PositiveInt = 128  # Pallas kernels only: key columns per tile
    interpret: pydantic.StrictBool = False  # Pallas kernels only: run in interpret mode, e.g. the TPU kernel on a CPU


@dataclasses.dataclass(frozen=True)
class Kernel:
    label: str  # what Support.kernel reports
    refusal: Callable[[AttentionCase, FlashOptions], str]  # "" when the kernel can run the case's shape
    # run(q_BxTxNxH, k, v, kv_lengths_B, scale, options, **arguments): the AttentionFn's optional arguments of
    # the features (attention/features.py) the kernel declared in ``takes``; with ``grouped`` in ``takes``, k and
    # v may carry fewer heads than q
    run: Callable[..., jax.Array]
    takes: dict[str, str] = dataclasses.field(default_factory=dict)  # feature → how the kernel receives it
    cannot: dict[str, str] = dataclasses.field(default_factory=dict)  # feature → why not, where the feature's
    # own kernel_refusal does not say it

    def __post_init__(self):
        unknown = sorted((set(self.takes) | set(self.cannot)) - set(DECLARED))
        if unknown:
            raise ValueError(
                f"flash kernel {self.label!r} names unknown features {unknown} in takes/cannot; "
                f"declared: {', '.join(DECLARED)} (attention/features.py)"
            )

    def feature_refusal(self, case: AttentionCase, name: str) -> str:
        """Why the kernel called ``name`` cannot run the features ``case`` asks for ("" when it can)."""
        return "; ".join(
            self.why_not(f.name, name) for f in DECLARED.values() if f.asked_by(case) and f.name not in self.takes
        )

    def why_not(self, feature: str, name: str) -> str:
        return self.cannot.get(feature) or DECLARED[feature].kernel_refusal.format(kernel=name)


def off_platform(name: str, platform: str, case: AttentionCase, options: FlashOptions) -> str:
    """A Pallas kernel off its own platform runs only in interpret mode (slowly; what tests on CPU use)."""
    if case.platform == platform or options.interpret:
        return ""
    return (
        f"{name} runs on {platform.upper()}, not {case.platform}; set flash.interpret: true to run the same "
        "kernel (slowly) in interpret mode"
    )


def not_importable(module: str) -> str:
    """A kernel package that is missing or broken becomes the kernel's refusal reason, never an import error."""
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        return f"{module.split('.')[0]} not importable: {type(e).__name__}: {e}"
    return ""


def is_power_of_two(x: int) -> bool:
    return x & (x - 1) == 0
