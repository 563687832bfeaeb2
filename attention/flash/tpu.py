"""``flash`` on TPU: Pallas flash attention (global layers, packed rows, causal) and splash attention (local
windows, which pallas_tpu has no mask for). Both also run on CPU in interpret mode (``flash.interpret: true``),
slowly: how the tests check them without a TPU."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from docbeam.attention.chunked import pad_to_multiple
from docbeam.attention.flash.kernel import Kernel, not_importable, off_platform


def _dtype_refusal(name: str, case) -> str:
    return "" if case.dtype in ("float32", "bfloat16") else f"{name} takes float32 or bfloat16, not {case.dtype}"


def _tile_refusal(name: str, options) -> str:
    """Tiles must fit the TPU's (8 sublanes, 128 lanes) vector registers."""
    if options.block_k % 128 or options.block_q % 8:
        return (
            f"{name} needs block_k a multiple of 128 and block_q a multiple of 8, got "
            f"block_q={options.block_q}, block_k={options.block_k}"
        )
    return ""


def _pallas_tpu_refusal(case, options) -> str:
    if case.head_dim > 128 and case.head_dim % 128:
        head_dim = f"pallas_tpu needs head_dim <= 128 or a multiple of 128, got {case.head_dim}"
    else:
        head_dim = ""
    return (
        off_platform("pallas_tpu", "tpu", case, options)
        or _dtype_refusal("pallas_tpu", case)
        or head_dim
        or _tile_refusal("pallas_tpu", options)
        or not_importable("jax.experimental.pallas.ops.tpu.flash_attention")
    )


def interpreted(pltpu):
    """TPU interpret mode, which simulates the chip's memories; with more than one device in the process, Pallas'
    plain HLO interpreter (``interpret=True``) instead: TPU interpret mode starts each kernel at a barrier of
    every device, a Python thread each, and XLA:CPU does not run every virtual device's program at once, so on
    a mesh (runner.mesh, tests/mesh_test.py) the second call waits for ever."""
    import jax

    return pltpu.force_tpu_interpret_mode(True if jax.device_count() > 1 else pltpu.InterpretParams())


def _pallas_tpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None, causal=False):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    t = q_BxTxNxH.shape[1]
    q_BxNxTxH, k_BxNxSxH, v_BxNxSxH = (
        jnp.swapaxes(pad_to_multiple(x, block), 1, 2)
        for x, block in ((q_BxTxNxH, options.block_q), (k_BxSxNxH, options.block_k), (v_BxSxNxH, options.block_k))
    )
    b, padded_t, padded_s = q_BxTxNxH.shape[0], q_BxNxTxH.shape[2], k_BxNxSxH.shape[2]
    if segment_ids_BxT is not None:  # packed rows: padding (0) attends padding, which every padded row has
        segment_ids = tpu_flash.SegmentIds(
            q=pad_to_multiple(segment_ids_BxT, options.block_q), kv=pad_to_multiple(segment_ids_BxT, options.block_k)
        )
    else:
        # Valid keys are segment 1, padded keys 0. Every query row, padded ones included, is segment 1: padded
        # rows then attend the valid keys, and a row with no valid key gets the kernel's large finite
        # negative mask everywhere (a uniform average), so nothing comes out NaN.
        segment_ids = tpu_flash.SegmentIds(
            q=jnp.ones((b, padded_t), jnp.int32),
            kv=(jnp.arange(padded_s)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32),
        )
    blocks = tpu_flash.BlockSizes(
        block_q=options.block_q, block_k_major=options.block_k, block_k=options.block_k, block_b=1
    )  # forward only: no backward blocks
    with interpreted(pltpu) if options.interpret else contextlib.nullcontext():
        out_BxNxTxH = tpu_flash.flash_attention(
            q_BxNxTxH,
            k_BxNxSxH,
            v_BxNxSxH,
            segment_ids=segment_ids,
            causal=causal,
            sm_scale=scale,  # sm_scale defaults to 1
            block_sizes=blocks,
        )
    return jnp.swapaxes(out_BxNxTxH, 1, 2)[:, :t]


def _splash_tpu_refusal(case, options) -> str:
    return (
        off_platform("splash_tpu", "tpu", case, options)
        or _dtype_refusal("splash_tpu", case)
        or _tile_refusal("splash_tpu", options)
        or not_importable("jax.experimental.pallas.ops.tpu.splash_attention")
    )


def _splash_tpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None, local_window=None):
    """A LocalMask (or FullMask) per head, known at trace time, so the kernel skips key blocks wholly outside
    the window; padding and packing as segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    b, t, n, _ = q_BxTxNxH.shape
    if k_BxSxNxH.shape[1] != t:
        raise ValueError(
            f"flash kernel splash_tpu needs as many queries as keys (one mask serves both), got "
            f"{t} and {k_BxSxNxH.shape[1]}"
        )
    block = math.lcm(options.block_q, options.block_k)
    q_BxNxTxH, k_BxNxTxH, v_BxNxTxH = (
        jnp.swapaxes(pad_to_multiple(x, block), 1, 2)
        for x in (q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype), k_BxSxNxH, v_BxSxNxH)
    )  # splash does not scale
    padded = q_BxNxTxH.shape[2]
    if segment_ids_BxT is None:  # valid positions 1, padding 0
        segment_ids_BxT = (jnp.arange(t)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32)
    # Padding attends padding: with the window's diagonal, every row keeps a key, so no softmax is empty.
    segment_ids_BxT = pad_to_multiple(segment_ids_BxT.astype(jnp.int32), block)
    head_mask = (
        splash_mask.FullMask((padded, padded))
        if local_window is None
        else splash_mask.LocalMask((padded, padded), tuple(local_window), offset=0)
    )
    kernel = splash.make_splash_mha(
        splash_mask.MultiHeadMask([head_mask] * n),
        head_shards=1,
        q_seq_shards=1,
        interpret=options.interpret,
        block_sizes=splash.BlockSizes(
            block_q=options.block_q, block_kv=options.block_k, block_kv_compute=options.block_k
        ),
    )  # forward only: no backward blocks
    out_BxNxTxH = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, splash.SegmentIds(q=ids, kv=ids)))(
        q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, segment_ids_BxT
    )
    return jnp.swapaxes(out_BxNxTxH, 1, 2)[:, :t]


KERNELS = {
    "pallas_tpu": Kernel(
        "pallas.tpu.flash_attention",
        _pallas_tpu_refusal,
        _pallas_tpu,
        takes={"segments": "segment ids", "causal": "its causal flag"},
        cannot={
            "local_window": "pallas_tpu has no local-window mask (ModernBERT's local layers "
            "need one); splash_tpu runs it",
            "bias": "pallas_tpu takes a bias only as a dense [B, N, T, S] array, which docbeam does not build for it",
        },
    ),
    "splash_tpu": Kernel(
        "pallas.tpu.splash_attention",
        _splash_tpu_refusal,
        _splash_tpu,
        takes={"segments": "segment ids", "local_window": "a LocalMask per head"},
    ),
}
