"""``flash``: the best maintained memory-efficient attention kernel for the platform.

``kernel: auto`` takes the first kernel in ``PLATFORM_KERNELS[platform]`` whose check passes for the
case; the check's ``Support.kernel`` names the kernel that will run, so nothing falls back silently.
Kernel packages are imported inside the functions: a missing or broken one becomes a refusal reason.

Every adapter turns right padding (``kv_lengths_B``) into the kernel's own mask format and pads the
sequence to the kernel's block size; padded query rows are sliced off again.

A model's local windows, per-head bias and packed rows' segment ids map onto what each kernel takes
(``FEATURES`` below); a kernel that cannot run one refuses the case with the reason, and ``kernel: auto`` moves
on to the next. In one bucket global and local layers may run different kernels of the list (on TPU
``pallas_tpu`` for global layers, ``splash_tpu`` for local ones); the backend stays ``flash``.
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

KernelName = Literal["auto", "pallas_tpu", "splash_tpu", "pallas_gpu", "cudnn", "tokamax_triton",
                     "tokamax_mosaic", "tokamax_chunked", "chunked"]

# What ``kernel: auto`` tries, in order, per platform (as jax.default_backend() names it).
PLATFORM_KERNELS: dict[str, tuple[str, ...]] = {
    "tpu": ("pallas_tpu", "splash_tpu"),  # splash takes the local windows pallas_tpu has no mask for
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
                                            ("grouped", case.kv_heads != case.num_heads)) if wanted]
        missing = [name for name in needed if name not in self.takes]
        return "; ".join(self.cannot.get(name, f"takes no {name}") for name in missing)


# Why a kernel cannot take a feature, as its refusal says it.
NO_WINDOW = "{name} has no local-window mask (ModernBERT's local layers need one)"
NO_BIAS = "{name} adds no per-head bias (relative-position models need one)"
NO_CAUSAL = "{name} has no causal mask here (decoder models need one)"
NO_GROUPED = ("{name} takes as many k/v heads as q heads (grouped-query decoders have fewer, and repeating them "
              "is the memory the kernel exists to save)")


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


def _pallas_tpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None, causal=False):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    t = q_BxTxNxH.shape[1]
    q_BxNxTxH, k_BxNxSxH, v_BxNxSxH = (
        jnp.swapaxes(pad_to_multiple(x, block), 1, 2)
        for x, block in ((q_BxTxNxH, options.block_q), (k_BxSxNxH, options.block_k), (v_BxSxNxH, options.block_k)))
    b, padded_t, padded_s = q_BxTxNxH.shape[0], q_BxNxTxH.shape[2], k_BxNxSxH.shape[2]
    if segment_ids_BxT is not None:  # packed rows: padding (0) attends padding, which every padded row has
        segment_ids = tpu_flash.SegmentIds(q=pad_to_multiple(segment_ids_BxT, options.block_q),
                                           kv=pad_to_multiple(segment_ids_BxT, options.block_k))
    else:
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
                                                causal=causal, sm_scale=scale,  # sm_scale defaults to 1
                                                block_sizes=blocks)
    return jnp.swapaxes(out_BxNxTxH, 1, 2)[:, :t]


# --- TPU: Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention) ----------------

def _splash_tpu_refusal(case: AttentionCase, options: FlashOptions) -> str:
    if case.platform != "tpu" and not options.interpret:
        return (f"splash_tpu runs on TPU, not {case.platform}; set flash.interpret: true to run the same "
                "kernel (slowly) in interpret mode")
    if case.dtype not in ("float32", "bfloat16"):
        return f"splash_tpu takes float32 or bfloat16, not {case.dtype}"
    if options.block_k % 128 or options.block_q % 8:
        return (f"splash_tpu needs block_k a multiple of 128 and block_q a multiple of 8, got "
                f"block_q={options.block_q}, block_k={options.block_k}")
    return _not_importable("jax.experimental.pallas.ops.tpu.splash_attention")


def _splash_tpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None,
                local_window=None):
    """A LocalMask (or FullMask) per head, known at trace time, so the kernel skips key blocks wholly outside
    the window; padding and packing as segment ids."""
    import math

    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    b, t, n, _ = q_BxTxNxH.shape
    if k_BxSxNxH.shape[1] != t:
        raise ValueError(f"flash kernel splash_tpu needs as many queries as keys (one mask serves both), got "
                         f"{t} and {k_BxSxNxH.shape[1]}")
    block = math.lcm(options.block_q, options.block_k)
    q_BxNxTxH, k_BxNxTxH, v_BxNxTxH = (
        jnp.swapaxes(pad_to_multiple(x, block), 1, 2)
        for x in (q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype), k_BxSxNxH, v_BxSxNxH))  # splash does not scale
    padded = q_BxNxTxH.shape[2]
    if segment_ids_BxT is None:  # valid positions 1, padding 0
        segment_ids_BxT = (jnp.arange(t)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32)
    # Padding attends padding: with the window's diagonal, every row keeps a key, so no softmax is empty.
    segment_ids_BxT = pad_to_multiple(segment_ids_BxT.astype(jnp.int32), block)
    head_mask = (splash_mask.FullMask((padded, padded)) if local_window is None
                 else splash_mask.LocalMask((padded, padded), tuple(local_window), offset=0))
    kernel = splash.make_splash_mha(
        splash_mask.MultiHeadMask([head_mask] * n), head_shards=1, q_seq_shards=1, interpret=options.interpret,
        block_sizes=splash.BlockSizes(block_q=options.block_q, block_kv=options.block_k,
                                      block_kv_compute=options.block_k))  # forward only: no backward blocks
    out_BxNxTxH = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, splash.SegmentIds(q=ids, kv=ids)))(
        q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, segment_ids_BxT)
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


def _pallas_gpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, s = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
    if t != s:
        raise ValueError(f"flash kernel pallas_gpu needs as many queries as keys (one segment-id array "
                         f"serves both), got {t} and {s}")
    block = max(options.block_q, options.block_k)  # powers of two, so a multiple of both
    q, k, v = (pad_to_multiple(x, block) for x in (q_BxTxNxH, k_BxSxNxH, v_BxSxNxH))
    # One id array masks both sides: valid positions 1 (or the packed rows' ids), padding 0. Padded query
    # rows attend padded keys; a row with no valid key attends all of them. Both stay finite.
    if segment_ids_BxT is None:
        segment_ids_BxT = (jnp.arange(t)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32)
    segment_ids_BxT = pad_to_multiple(segment_ids_BxT.astype(jnp.int32), block)
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
    def run(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None, local_window=None,
            bias=None, causal=False):
        """The window goes to tokamax as its ``local_window_size`` (its kernels skip blocks outside it); its
        public API takes segment ids and a bias only as dense arrays, so those are built here: a
        ``[B, 1, T, S]`` mask and a ``[1, N, T, S]`` bias, O(T²) memory at the lengths that need them
        (MPNet's 512 tokens: 12 MB)."""
        del options
        import tokamax
        from absl import flags

        if not flags.FLAGS.is_parsed():
            # tokamax 0.0.12 reads its settings from absl flags and, on first use, parses all of sys.argv,
            # which fails on any command line not written for absl (pytest's, docbeam's). Fixed upstream
            # by parsing known flags only (openxla/tokamax#957); until then keep its defaults.
            flags.FLAGS.mark_as_parsed()
        t, s = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
        mask_Bx1xTxS = None
        if segment_ids_BxT is not None:  # packed rows are self-attention: one id array serves both sides
            mask_Bx1xTxS = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
        bias_1xNxTxS = None if bias is None else bias(jnp.arange(t), jnp.arange(s))[None].astype(jnp.float32)
        return tokamax.dot_product_attention(
            q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, bias=bias_1xNxTxS, mask=mask_Bx1xTxS, scale=scale, is_causal=causal,
            key_value_seq_lengths=None if segment_ids_BxT is not None else kv_lengths_B,
            local_window_size=None if local_window is None else tuple(local_window), implementation=implementation)
    return run


# --- anywhere: docbeam's own chunked online softmax (attention/chunked.py) -----------------------------

def _chunked_refusal(case: AttentionCase, options: FlashOptions) -> str:
    del case, options  # plain XLA: every platform, dtype and shape
    return ""


def _chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, **features):
    del options  # block_q/block_k are Pallas tiles; chunked's own sizes are tuned per length
    return chunked.chunked(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale,
                           options=chunked.ChunkedOptions(), **features)


SEGMENT_IDS = {"segments": "segment ids"}
TOKAMAX_TAKES = {"segments": "a dense [B, 1, T, S] mask", "windows": "local_window_size",
                 "bias": "a dense [1, N, T, S] array", "causal": "is_causal",
                 "grouped": "k/v with fewer heads, as its API takes them"}
KERNELS: dict[str, Kernel] = {
    "pallas_tpu": Kernel("pallas.tpu.flash_attention", _pallas_tpu_refusal, _pallas_tpu,
                         takes={**SEGMENT_IDS, "causal": "its causal flag"},
                         cannot={"windows": NO_WINDOW.format(name="pallas_tpu") + "; splash_tpu runs it",
                                 "bias": "pallas_tpu takes a bias only as a dense [B, N, T, S] array, which "
                                         "docbeam does not build for it",
                                 "grouped": NO_GROUPED.format(name="pallas_tpu")}),
    "splash_tpu": Kernel("pallas.tpu.splash_attention", _splash_tpu_refusal, _splash_tpu,
                         takes={"segments": "segment ids", "windows": "a LocalMask per head"},
                         cannot={"bias": NO_BIAS.format(name="splash_tpu"),
                                 "causal": NO_CAUSAL.format(name="splash_tpu"),
                                 "grouped": NO_GROUPED.format(name="splash_tpu")}),
    "pallas_gpu": Kernel("pallas.gpu.mha", _pallas_gpu_refusal, _pallas_gpu, takes=SEGMENT_IDS,
                         cannot={"windows": NO_WINDOW.format(name="pallas_gpu") + " (causal only)",
                                 "bias": NO_BIAS.format(name="pallas_gpu"),
                                 "causal": NO_CAUSAL.format(name="pallas_gpu"),
                                 "grouped": NO_GROUPED.format(name="pallas_gpu")}),
    "cudnn": Kernel("jax.nn.dot_product_attention[cudnn]", _cudnn_refusal, _cudnn,
                    cannot={"windows": "cudnn's sliding window is causal (keys left of the query only): it has no "
                                       "symmetric window; tokamax_triton runs it",
                            "bias": "docbeam hands cudnn no bias (jax.nn would need it as a dense [B, N, T, S] "
                                    "array); tokamax_triton runs it",
                            "segments": "docbeam hands cudnn no segment ids (jax.nn would need a dense mask); "
                                        "tokamax_triton runs packed rows",
                            "causal": "docbeam hands cudnn no causal flag yet; tokamax_triton runs it",
                            "grouped": "docbeam hands cudnn no grouped k/v yet; tokamax_triton runs it"}),
    "tokamax_triton": Kernel("tokamax.triton", _tokamax_triton_refusal, _tokamax("triton"), takes=TOKAMAX_TAKES),
    "tokamax_mosaic": Kernel("tokamax.mosaic", _tokamax_mosaic_refusal, _tokamax("mosaic"), takes=TOKAMAX_TAKES),
    # tokamax's public API fixes the chunks at (512 queries, 1024 keys).
    "tokamax_chunked": Kernel("tokamax.xla_chunked", _tokamax_chunked_refusal, _tokamax("xla_chunked"),
                              takes=TOKAMAX_TAKES),
    "chunked": Kernel("docbeam.chunked (xla online softmax, chunks tuned per length)", _chunked_refusal, _chunked,
                      takes={"segments": "segment ids", "windows": "only the key chunks the window reaches",
                             "bias": "the bias function per block", "causal": "no key block past the diagonal",
                             "grouped": "each k/v head read as it is"}),
}


def pick_kernel(case: AttentionCase, options: FlashOptions) -> tuple[str | None, Support]:
    """The kernel that runs ``case`` (None if none can), and the Support saying which or why not."""
    candidates = PLATFORM_KERNELS.get(case.platform, ()) if options.kernel == "auto" else (options.kernel,)
    refusals = []
    for name in candidates:
        kernel = KERNELS[name]
        reason = kernel.refusal(case, options) or kernel.feature_refusal(case)
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


def feature_table() -> str:
    """A markdown table of how each kernel takes windows, bias and segment ids, or why it cannot, for the README."""
    rows = ["| kernel | local windows | per-head bias | segment ids (packing) | causal | grouped-query k/v |",
            "|---|---|---|---|---|---|"]
    for name, kernel in KERNELS.items():
        cells = [kernel.takes.get(feature) or "no: " + kernel.cannot.get(feature, f"takes no {feature}")
                 for feature in ("windows", "bias", "segments", "causal", "grouped")]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@register("flash", options=FlashOptions, supports=supports, segments=True, windows=True, bias=True, causal=True,
          grouped=True,
          description="the platform's maintained memory-efficient kernel (Pallas TPU, cuDNN, tokamax)")
def flash(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, options: FlashOptions, **features):
    b, t, n, h = q_BxTxNxH.shape
    case = AttentionCase(platform=current_platform(), dtype=jnp.dtype(q_BxTxNxH.dtype).name,
                         seq_len=max(t, k_BxSxNxH.shape[1]), num_heads=n, head_dim=h,
                         packed=features.get("segment_ids_BxT") is not None,
                         local_window=features.get("local_window"), bias=features.get("bias") is not None,
                         causal=bool(features.get("causal")), num_kv_heads=k_BxSxNxH.shape[2])
    name, support = pick_kernel(case, options)
    if name is None:
        raise ValueError(f"attention backend flash cannot run {case}: {support.reason}")
    features = {key: value for key, value in features.items() if value is not None and value is not False}
    out_BxTxNxH = KERNELS[name].run(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, **features)
    # Kernels disagree on rows with no valid key (uniform average, zeros, or unspecified): pin them to zeros.
    return jnp.where((kv_lengths_B > 0)[:, None, None, None], out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)
