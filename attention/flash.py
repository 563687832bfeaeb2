"""``flash``: the best maintained memory-efficient attention kernel for the platform.

``kernel: auto`` takes the first kernel in ``PLATFORM_KERNELS[platform]`` whose check passes for the
case; the check's ``Support.kernel`` names the kernel that will run, so nothing falls back silently.
Kernel packages are imported inside the functions: a missing or broken one becomes a refusal reason.

Every adapter turns right padding (``kv_lengths_B``) into the kernel's own mask format and pads the
sequence to the kernel's block size; padded query rows are sliced off again.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import pydantic

from attention import chunked
from attention.chunked import pad_to_multiple
from attention.interface import AttentionCase, Support, current_platform
from attention.registry import register

KernelName = Literal["auto", "pallas_tpu", "pallas_gpu", "cudnn", "tokamax_triton", "tokamax_mosaic",
                     "tokamax_chunked", "chunked"]

# What ``kernel: auto`` tries, in order, per platform (as jax.default_backend() names it).
PLATFORM_KERNELS: dict[str, tuple[str, ...]] = {
    "tpu": ("pallas_tpu",),
    "gpu": ("cudnn", "tokamax_triton"),  # cuDNN takes only 16-bit floats; Triton covers float32
    # Ordered by measurement at 8192 tokens, float32, 12 heads x 32 (benchmarks/results/attention-flash-cpu.json,
    # one run on a 2-core Xeon, load ~4 from other jobs): docbeam's chunked 2.37 s, 16 MB; tokamax's
    # xla_chunked 4.80 s, 87 MB; native (einsum) 5.97 s, 6.5 GB. tokamax stays as the second choice.
    "cpu": ("chunked", "tokamax_chunked"),
}


class FlashOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    kernel: KernelName = "auto"
    block_q: pydantic.PositiveInt = 128  # Pallas kernels only: query rows per tile
    block_k: pydantic.PositiveInt = 128  # Pallas kernels only: key columns per tile
    interpret: bool = False  # Pallas kernels only: run in interpret mode, e.g. the TPU kernel on a CPU


@dataclasses.dataclass(frozen=True)
class Kernel:
    label: str  # what Support.kernel reports
    refusal: Callable[[AttentionCase, FlashOptions], str]  # "" when the kernel can run the case
    run: Callable[..., jax.Array]  # run(q_BxTxNxH, k, v, kv_lengths_B, scale, options)


def _not_importable(module: str) -> str:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        return f"{module.split('.')[0]} not importable: {type(e).__name__}: {e}"
    return ""


def _is_power_of_two(x: int) -> bool:
    return x & (x - 1) == 0


# --- TPU: Pallas flash attention (jax.experimental.pallas.ops.tpu.flash_attention) -------------------

def _pallas_tpu_refusal(case: AttentionCase, options: FlashOptions) -> str:
    if case.platform != "tpu" and not options.interpret:
        return (f"pallas_tpu runs on TPU, not {case.platform}; set flash.interpret: true to run the same "
                "kernel (slowly) in interpret mode")
    if case.dtype not in ("float32", "bfloat16"):
        return f"pallas_tpu takes float32 or bfloat16, not {case.dtype}"
    if case.head_dim > 128 and case.head_dim % 128:
        return f"pallas_tpu needs head_dim <= 128 or a multiple of 128, got {case.head_dim}"
    if options.block_k % 128 or options.block_q % 8:
        return (f"pallas_tpu needs block_k a multiple of 128 and block_q a multiple of 8, got "
                f"block_q={options.block_q}, block_k={options.block_k}")
    return _not_importable("jax.experimental.pallas.ops.tpu.flash_attention")


def _pallas_tpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    t = q_BxTxNxH.shape[1]
    q_BxNxTxH, k_BxNxSxH, v_BxNxSxH = (
        jnp.swapaxes(pad_to_multiple(x, block), 1, 2)
        for x, block in ((q_BxTxNxH, options.block_q), (k_BxSxNxH, options.block_k), (v_BxSxNxH, options.block_k)))
    b, padded_t, padded_s = q_BxTxNxH.shape[0], q_BxNxTxH.shape[2], k_BxNxSxH.shape[2]
    # Valid keys are segment 1, padded keys 0. Every query row, padded ones included, is segment 1: padded
    # rows then attend the valid keys, and a row with no valid key gets the kernel's large finite
    # negative mask everywhere (a uniform average), so nothing comes out NaN.
    segment_ids = tpu_flash.SegmentIds(
        q=jnp.ones((b, padded_t), jnp.int32),
        kv=(jnp.arange(padded_s)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32))
    blocks = tpu_flash.BlockSizes(block_q=options.block_q, block_k_major=options.block_k,
                                  block_k=options.block_k, block_b=1)  # forward only: no backward blocks
    interpret = pltpu.force_tpu_interpret_mode() if options.interpret else contextlib.nullcontext()
    with interpret:
        out_BxNxTxH = tpu_flash.flash_attention(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, segment_ids=segment_ids,
                                                sm_scale=scale, block_sizes=blocks)  # sm_scale defaults to 1
    return jnp.swapaxes(out_BxNxTxH, 1, 2)[:, :t]


# --- GPU: Pallas Triton mha (jax.experimental.pallas.ops.gpu.attention; superseded by tokamax) -------

def _pallas_gpu_refusal(case: AttentionCase, options: FlashOptions) -> str:
    if case.platform != "gpu" and not options.interpret:
        return (f"pallas_gpu runs on GPU, not {case.platform}; set flash.interpret: true to run the same "
                "kernel (slowly) in interpret mode")
    if not (_is_power_of_two(options.block_q) and _is_power_of_two(options.block_k)
            and min(options.block_q, options.block_k) >= 16):
        return (f"pallas_gpu (Triton) needs block_q and block_k powers of two >= 16, got "
                f"block_q={options.block_q}, block_k={options.block_k}")
    return _not_importable("jax.experimental.pallas.ops.gpu.attention")


def _pallas_gpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, s = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
    if t != s:
        raise ValueError(f"flash kernel pallas_gpu needs as many queries as keys (one segment-id array "
                         f"serves both), got {t} and {s}")
    block = max(options.block_q, options.block_k)  # powers of two, so a multiple of both
    q, k, v = (pad_to_multiple(x, block) for x in (q_BxTxNxH, k_BxSxNxH, v_BxSxNxH))
    # One id array masks both sides: valid positions 1, padding 0. Padded query rows attend padded keys;
    # a row with no valid key attends all of them. Both stay finite.
    segment_ids_BxT = (jnp.arange(q.shape[1])[None, :] < kv_lengths_B[:, None]).astype(jnp.int32)
    blocks = gpu_attention.BlockSizes(block_q=options.block_q, block_k=options.block_k)
    out = gpu_attention.mha(q, k, v, segment_ids_BxT, sm_scale=scale, block_sizes=blocks,
                            interpret=options.interpret)  # sm_scale defaults to 1
    return out[:, :t]


# --- GPU: cuDNN fused attention through jax.nn --------------------------------------------------------

def _cudnn_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del options
    if case.platform != "gpu":
        return f"cudnn runs on NVIDIA GPUs, not {case.platform}"
    if case.dtype not in ("bfloat16", "float16"):
        return (f"cudnn flash attention takes bfloat16 or float16, not {case.dtype}; use dtype bfloat16 "
                "or flash.kernel: tokamax_triton")
    if case.head_dim % 8 or case.head_dim > 256:
        return (f"cudnn needs head_dim a multiple of 8 and <= 256 (<= 128 before Hopper), "
                f"got {case.head_dim}")
    return ""


def _cudnn(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
    del options
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, scale=scale,
                                        key_value_seq_lengths=kv_lengths_B, implementation="cudnn")


# --- tokamax (tokamax.dot_product_attention) -----------------------------------------------------------

def _tokamax_triton_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del options
    if case.platform != "gpu":
        return f"tokamax_triton runs on GPUs, not {case.platform}"
    return _not_importable("tokamax")


def _tokamax_mosaic_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del options
    if case.platform not in ("gpu", "tpu"):
        return f"tokamax_mosaic runs on Hopper/Blackwell GPUs or TPUs, not {case.platform}"
    if case.platform == "gpu" and case.dtype == "float32":
        return "tokamax_mosaic on GPU would silently compute float32 in bfloat16; use tokamax_triton"
    return _not_importable("tokamax")


def _tokamax_chunked_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del case, options
    return _not_importable("tokamax")


def _tokamax(implementation: str):
    def run(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
        del options
        import tokamax
        from absl import flags

        if not flags.FLAGS.is_parsed():
            # tokamax 0.0.12 reads its settings from absl flags and, on first use, parses all of sys.argv,
            # which fails on any command line not written for absl (pytest's, docbeam's). Fixed upstream
            # by parsing known flags only (openxla/tokamax#957); until then keep its defaults.
            flags.FLAGS.mark_as_parsed()
        return tokamax.dot_product_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, scale=scale,
                                             key_value_seq_lengths=kv_lengths_B, implementation=implementation)
    return run


# --- anywhere: docbeam's own chunked online softmax (attention/chunked.py) -----------------------------

def _chunked_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del case, options  # plain XLA: every platform, dtype and shape
    return ""


def _chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
    del options  # block_q/block_k are Pallas tiles; chunked's own sizes are tuned per length
    return chunked.chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale,
                           options=chunked.ChunkedOptions())


KERNELS: dict[str, Kernel] = {
    "pallas_tpu": Kernel("pallas.tpu.flash_attention", _pallas_tpu_refusal, _pallas_tpu),
    "pallas_gpu": Kernel("pallas.gpu.mha", _pallas_gpu_refusal, _pallas_gpu),
    "cudnn": Kernel("jax.nn.dot_product_attention[cudnn]", _cudnn_refusal, _cudnn),
    "tokamax_triton": Kernel("tokamax.triton", _tokamax_triton_refusal, _tokamax("triton")),
    "tokamax_mosaic": Kernel("tokamax.mosaic", _tokamax_mosaic_refusal, _tokamax("mosaic")),
    # tokamax's public API fixes the chunks at (512 queries, 1024 keys).
    "tokamax_chunked": Kernel("tokamax.xla_chunked", _tokamax_chunked_refusal, _tokamax("xla_chunked")),
    "chunked": Kernel("docbeam.chunked (xla online softmax, chunks tuned per length)", _chunked_refusal, _chunked),
}


def pick_kernel(case: AttentionCase, options: FlashOptions) -> tuple[str | None, Support]:
    """The kernel that runs ``case`` (None if none can), and the Support saying which or why not."""
    candidates = PLATFORM_KERNELS.get(case.platform, ()) if options.kernel == "auto" else (options.kernel,)
    refusals = []
    for name in candidates:
        kernel = KERNELS[name]
        reason = kernel.refusal(case, options)
        if not reason:
            label = kernel.label + (" (interpret mode)" if options.interpret and name.startswith("pallas") else "")
            return name, Support(ok=True, kernel=label)
        refusals.append(reason)
    if not candidates:
        return None, Support(ok=False, reason=f"flash has no kernel for platform {case.platform!r}; "
                                              f"known: {', '.join(PLATFORM_KERNELS)}")
    return None, Support(ok=False, reason="; ".join(refusals))


def supports(case: AttentionCase, options: FlashOptions) -> Support:
    return pick_kernel(case, options)[1]


def auto_kernel_table() -> str:
    """A markdown table of what ``kernel: auto`` picks per platform, for the README and ``docbeam validate``."""
    rows = ["| platform | `kernel: auto` tries, in order |", "|---|---|"]
    rows += [f"| {platform} | " + ", then ".join(f"`{name}` ({KERNELS[name].label})" for name in names) + " |"
             for platform, names in PLATFORM_KERNELS.items()]
    return "\n".join(rows)


@register("flash", options=FlashOptions, supports=supports,
          description="the platform's maintained memory-efficient kernel (Pallas TPU, cuDNN, tokamax)")
def flash(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options: FlashOptions):
    b, t, n, h = q_BxTxNxH.shape
    case = AttentionCase(platform=current_platform(), dtype=jnp.dtype(q_BxTxNxH.dtype).name,
                         seq_len=max(t, k_BxSxNxH.shape[1]), num_heads=n, head_dim=h)
    name, support = pick_kernel(case, options)
    if name is None:
        raise ValueError(f"attention backend flash cannot run {case}: {support.reason}")
    out_BxTxNxH = KERNELS[name].run(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options)
    # Kernels disagree on rows with no valid key (uniform average, zeros, or unspecified): pin them to zeros.
    return jnp.where((kv_lengths_B > 0)[:, None, None, None], out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)
