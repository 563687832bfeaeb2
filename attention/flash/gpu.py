"""``flash`` on NVIDIA GPUs: cuDNN's fused attention through jax.nn (16-bit floats, plain padding only), and
Pallas's Triton mha (superseded by tokamax_triton; kept for ``flash.kernel: pallas_gpu``, and runnable on CPU
in interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from docbeam.attention.chunked import pad_to_multiple
from docbeam.attention.flash.kernel import Kernel, is_power_of_two, not_importable, off_platform


def _pallas_gpu_refusal(case, options) -> str:
    if not (
        is_power_of_two(options.block_q)
        and is_power_of_two(options.block_k)
        and min(options.block_q, options.block_k) >= 16
    ):
        tiles = (
            f"pallas_gpu (Triton) needs block_q and block_k powers of two >= 16, got "
            f"block_q={options.block_q}, block_k={options.block_k}"
        )
    else:
        tiles = ""
    return (
        off_platform("pallas_gpu", "gpu", case, options)
        or tiles
        or not_importable("jax.experimental.pallas.ops.gpu.attention")
    )


def _pallas_gpu(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options, segment_ids_BxT=None):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, s = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
    if t != s:
        raise ValueError(
            f"flash kernel pallas_gpu needs as many queries as keys (one segment-id array serves both), got {t} and {s}"
        )
    block = max(options.block_q, options.block_k)  # powers of two, so a multiple of both
    q, k, v = (pad_to_multiple(x, block) for x in (q_BxTxNxH, k_BxSxNxH, v_BxSxNxH))
    # One id array masks both sides: valid positions 1 (or the packed rows' ids), padding 0. Padded query
    # rows attend padded keys; a row with no valid key attends all of them. Both stay finite.
    if segment_ids_BxT is None:
        segment_ids_BxT = (jnp.arange(t)[None, :] < kv_lengths_B[:, None]).astype(jnp.int32)
    segment_ids_BxT = pad_to_multiple(segment_ids_BxT.astype(jnp.int32), block)
    blocks = gpu_attention.BlockSizes(block_q=options.block_q, block_k=options.block_k)
    out = gpu_attention.mha(
        q, k, v, segment_ids_BxT, sm_scale=scale, block_sizes=blocks, interpret=options.interpret
    )  # sm_scale defaults to 1
    return out[:, :t]


def _cudnn_refusal(case, options) -> str:
    del options
    if case.platform != "gpu":
        return f"cudnn runs on NVIDIA GPUs, not {case.platform}"
    if case.dtype not in ("bfloat16", "float16"):
        return (
            f"cudnn flash attention takes bfloat16 or float16, not {case.dtype}; use dtype bfloat16 "
            "or flash.kernel: tokamax_triton"
        )
    if case.head_dim % 8 or case.head_dim > 256:
        return f"cudnn needs head_dim a multiple of 8 and <= 256 (<= 128 before Hopper), got {case.head_dim}"
    return ""


def _cudnn(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B, scale, options):
    del options
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, scale=scale, key_value_seq_lengths=kv_lengths_B, implementation="cudnn"
    )


KERNELS = {
    "pallas_gpu": Kernel(
        "pallas.gpu.mha",
        _pallas_gpu_refusal,
        _pallas_gpu,
        takes={"segments": "segment ids"},
        cannot={
            "local_window": "pallas_gpu has no local-window mask (ModernBERT's local layers need one) (causal only)"
        },
    ),
    "cudnn": Kernel(
        "jax.nn.dot_product_attention[cudnn]",
        _cudnn_refusal,
        _cudnn,
        cannot={
            "local_window": "cudnn's sliding window is causal (keys left of the query only): it has "
            "no symmetric window; tokamax_triton runs it",
            "bias": "docbeam hands cudnn no bias (jax.nn would need it as a dense [B, N, T, S] "
            "array); tokamax_triton runs it",
            "segments": "docbeam hands cudnn no segment ids (jax.nn would need a dense mask); "
            "tokamax_triton runs packed rows",
            "causal": "docbeam hands cudnn no causal flag yet; tokamax_triton runs it",
            "grouped": "docbeam hands cudnn no grouped k/v yet; tokamax_triton runs it",
        },
    ),
}
