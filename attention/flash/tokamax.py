"""``flash`` through tokamax (``tokamax.dot_product_attention``): its Triton kernel on GPUs, its Mosaic kernel on
Hopper/Blackwell GPUs and TPUs, and its XLA chunked form anywhere. Every one takes windows, a bias, segment
ids, causality and grouped k/v, the last three as tokamax's public API takes them."""

from __future__ import annotations

import jax.numpy as jnp

from docbeam.attention.flash.kernel import Kernel, not_importable


def _tokamax_triton_refusal(case, options) -> str:
    del options
    if case.platform != "gpu":
        return f"tokamax_triton runs on GPUs, not {case.platform}"
    return not_importable("tokamax")


def _tokamax_mosaic_refusal(case, options) -> str:
    del options
    if case.platform not in ("gpu", "tpu"):
        return f"tokamax_mosaic runs on Hopper/Blackwell GPUs or TPUs, not {case.platform}"
    if case.platform == "gpu" and case.dtype == "float32":
        return "tokamax_mosaic on GPU would silently compute float32 in bfloat16; use tokamax_triton"
    return not_importable("tokamax")


def _tokamax_chunked_refusal(case, options) -> str:
    del case, options
    return not_importable("tokamax")


def _tokamax(implementation: str):
    def run(
        q_BxTxNxH,
        k_BxSxNxH,
        v_BxSxNxH,
        kv_lengths_B,
        scale,
        options,
        segment_ids_BxT=None,
        local_window=None,
        bias=None,
        causal=False,
    ):
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
            q_BxTxNxH,
            k_BxSxNxH,
            v_BxSxNxH,
            bias=bias_1xNxTxS,
            mask=mask_Bx1xTxS,
            scale=scale,
            is_causal=causal,
            key_value_seq_lengths=None if segment_ids_BxT is not None else kv_lengths_B,
            local_window_size=None if local_window is None else tuple(local_window),
            implementation=implementation,
        )

    return run


TOKAMAX_TAKES = {
    "segments": "a dense [B, 1, T, S] mask",
    "local_window": "local_window_size",
    "bias": "a dense [1, N, T, S] array",
    "causal": "is_causal",
    "grouped": "k/v with fewer heads, as its API takes them",
}
KERNELS = {
    "tokamax_triton": Kernel("tokamax.triton", _tokamax_triton_refusal, _tokamax("triton"), takes=TOKAMAX_TAKES),
    "tokamax_mosaic": Kernel("tokamax.mosaic", _tokamax_mosaic_refusal, _tokamax("mosaic"), takes=TOKAMAX_TAKES),
    # tokamax's public API fixes the chunks at (512 queries, 1024 keys).
    "tokamax_chunked": Kernel(
        "tokamax.xla_chunked", _tokamax_chunked_refusal, _tokamax("xla_chunked"), takes=TOKAMAX_TAKES
    ),
}
