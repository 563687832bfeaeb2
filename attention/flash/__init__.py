"""``flash``: the best maintained memory-efficient attention kernel for the platform.

``kernel: auto`` takes the first kernel in ``PLATFORM_KERNELS[platform]`` whose check passes for the
case; the check's ``Support.kernel`` names the kernel that will run, so nothing falls back silently.
Kernel packages are imported inside the functions: a missing or broken one becomes a refusal reason.

Every adapter turns right padding (``kv_lengths_B``) into the kernel's own mask format and pads the
sequence to the kernel's block size; padded query rows are sliced off again.

A model's local windows, per-head bias and packed rows' segment ids map onto what each kernel takes (each
``Kernel``'s ``takes`` and ``cannot``, next to its code); a kernel that cannot run one refuses the case with
the reason, and ``kernel: auto`` moves on to the next. In one bucket global and local layers may run
different kernels of the list (on TPU ``pallas_tpu`` for global layers, ``splash_tpu`` for local ones); the
backend stays ``flash``.

The kernels live one file per family in this package (attention/flash/tpu.py, gpu.py, tokamax.py; docbeam's own
``chunked`` below); what they share (options, the Kernel record) in attention/flash/kernel.py. Here: which
kernels ``auto`` tries per platform, picking one, and the ``flash`` backend that runs it.
"""

from __future__ import annotations

import jax.numpy as jnp

from docbeam.attention import chunked
from docbeam.attention.features import DECLARED
from docbeam.attention.flash import gpu, tokamax, tpu
from docbeam.attention.flash.kernel import FlashOptions, Kernel, KernelName
from docbeam.attention.interface import AttentionCase, Support
from docbeam.attention.registry import register

__all__ = [
    "KERNELS",
    "PLATFORM_KERNELS",
    "FlashOptions",
    "Kernel",
    "KernelName",
    "auto_kernel_table",
    "feature_table",
    "flash",
    "pick_kernel",
    "supports",
]

# What ``kernel: auto`` tries, in order, per platform (as jax.default_backend() names it).
PLATFORM_KERNELS: dict[str, tuple[str, ...]] = {
    "tpu": ("pallas_tpu", "splash_tpu"),  # splash takes the local windows pallas_tpu has no mask for
    "gpu": ("cudnn", "tokamax_triton"),  # cuDNN takes only 16-bit floats; Triton covers float32
    # Ordered by measurement at 8192 tokens, float32 (benchmarks/results/attention-flash-cpu.json holds the
    # times and peak memory, and the command that measures them): docbeam's chunked ran faster than tokamax's
    # xla_chunked, and both far below native's memory. tokamax stays as the second choice.
    "cpu": ("chunked", "tokamax_chunked"),
}


# --- anywhere: docbeam's own chunked online softmax (attention/chunked.py) -----------------------------


def _chunked_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del case, options  # plain XLA: every platform, dtype and shape
    return ""


def _chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, **features):
    del options  # block_q/block_k are Pallas tiles; chunked's own sizes are attention/chunk_sizes.py's
    return chunked.chunked(
        q_BxTxNxH,
        k_BxSxNxH,
        v_BxSxNxH,
        kv_lengths_B=kv_lengths_B,
        scale=scale,
        options=chunked.ChunkedOptions(),
        **features,
    )


KERNELS: dict[str, Kernel] = {
    **tpu.KERNELS,
    **gpu.KERNELS,
    **tokamax.KERNELS,
    "chunked": Kernel(
        "docbeam.chunked (xla online softmax, chunks tuned per length)",
        _chunked_refusal,
        _chunked,
        takes={
            "segments": "segment ids",
            "local_window": "only the key chunks the window reaches",
            "bias": "the bias function per block",
            "causal": "no key block past the diagonal",
            "grouped": "each k/v head read as it is",
            "relative_positions": "the relative rows each block reaches",
        },
    ),
}


def pick_kernel(case: AttentionCase, options: FlashOptions) -> tuple[str | None, Support]:
    """The kernel that runs ``case`` (None if none can), and the Support saying which or why not."""
    candidates = PLATFORM_KERNELS.get(case.platform, ()) if options.kernel == "auto" else (options.kernel,)
    refusals = []
    for name in candidates:
        kernel = KERNELS[name]
        reason = kernel.refusal(case, options) or kernel.feature_refusal(case, name)
        if not reason:
            label = kernel.label + (" (interpret mode)" if options.interpret and name.startswith("pallas") else "")
            return name, Support(ok=True, kernel=label)
        refusals.append(reason)
    if not candidates:
        return None, Support(
            ok=False, reason=f"flash has no kernel for platform {case.platform!r}; known: {', '.join(PLATFORM_KERNELS)}"
        )
    return None, Support(ok=False, reason="; ".join(refusals))


def supports(case: AttentionCase, options: FlashOptions) -> Support:
    return pick_kernel(case, options)[1]


def auto_kernel_table() -> str:
    """A markdown table of what ``kernel: auto`` picks per platform, for the README and ``docbeam validate``."""
    rows = ["| platform | `kernel: auto` tries, in order |", "|---|---|"]
    rows += [
        f"| {platform} | " + ", then ".join(f"`{name}` ({KERNELS[name].label})" for name in names) + " |"
        for platform, names in PLATFORM_KERNELS.items()
    ]
    return "\n".join(rows)


def feature_table() -> str:
    """A markdown table of how each kernel takes each feature (attention/features.py), or why it cannot, for
    docs/attention.md."""
    rows = ["| kernel | " + " | ".join(f.column for f in DECLARED.values()) + " |", "|---|" + "---|" * len(DECLARED)]
    for name, kernel in KERNELS.items():
        cells = [kernel.takes.get(feature) or "no: " + kernel.why_not(feature, name) for feature in DECLARED]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@register(
    "flash",
    options=FlashOptions,
    supports=supports,
    segments=True,
    local_window=True,
    bias=True,
    causal=True,
    grouped=True,
    relative_positions=True,
    description="the platform's maintained memory-efficient kernel (Pallas TPU, cuDNN, tokamax)",
)
def flash(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options: FlashOptions, **features):
    features = {key: value for key, value in features.items() if value is not None and value is not False}
    case = AttentionCase.of_call(q_BxTxNxH, k_BxSxNxH, **features)
    name, support = pick_kernel(case, options)
    if name is None:
        raise ValueError(f"attention backend flash cannot run {case}: {support.reason}")
    out_BxTxNxH = KERNELS[name].run(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, **features)
    # Kernels disagree on rows with no valid key (uniform average, zeros, or unspecified): pin them to zeros.
    return jnp.where((kv_lengths_B > 0)[:, None, None, None], out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)
