"""Any AttentionFn on a device mesh (models/mesh.py): rows split on the ``data`` axis, heads on ``model``.

Attention is independent per row and per head, so every backend runs unchanged on its shard: the call is
wrapped in ``jax.shard_map`` over (data, heads), which is what a kernel needs (XLA cannot partition a Pallas or
cuDNN custom call itself) and costs plain XLA nothing. Grouped-query k/v with fewer heads than the model axis
(Gemma3's one, Qwen3-8B's eight on sixteen chips) are replicated across it, as MaxText does, and each shard
takes the k/v heads its own query heads read; they are never refused.

A call with an additive ``bias`` or DeBERTa's ``relative_positions`` carries functions of the model's
parameters, which a shard_map body cannot close over: it is partitioned by GSPMD instead (native and chunked,
the backends that take those features, are plain XLA), with q, k, v and the output pinned per head.
"""

from __future__ import annotations

from typing import Any, Callable

GSPMD_FEATURES = ("bias", "relative_positions")


def _specs(mesh, num_heads: int, kv_heads: int):
    from jax.sharding import PartitionSpec as P

    model = mesh.shape["model"]
    if num_heads % model:
        raise ValueError(
            f"runner.mesh: model: {model} does not divide the model's {num_heads} attention heads; use a model "
            f"axis that divides {num_heads}"
        )
    q = P("data", None, "model", None)
    kv = q if kv_heads % model == 0 else P("data", None, None, None)
    return q, kv


def on_mesh(attend: Callable[..., Any], mesh) -> Callable[..., Any]:
    """``attend`` run per shard of ``mesh``; on a one-device mesh ``attend`` itself."""
    if mesh.size == 1:
        return attend

    def sharded(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, *, kv_lengths_B, scale, **features):
        n, k = q_BxTxNxH.shape[2], k_BxSxKxH.shape[2]
        q_spec, kv_spec = _specs(mesh, n, k)
        if any(name in features for name in GSPMD_FEATURES):
            return _by_gspmd(
                attend, mesh, q_spec, kv_spec, q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_lengths_B, scale, features
            )
        return _by_shard_map(
            attend, mesh, q_spec, kv_spec, q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, kv_lengths_B, scale, features
        )

    return sharded


def _by_gspmd(attend, mesh, q_spec, kv_spec, q, k, v, kv_lengths_B, scale, features):
    import jax
    from jax.sharding import NamedSharding

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    out = attend(pin(q, q_spec), pin(k, kv_spec), pin(v, kv_spec), kv_lengths_B=kv_lengths_B, scale=scale, **features)
    return pin(out, q_spec)


def _by_shard_map(attend, mesh, q_spec, kv_spec, q, k, v, kv_lengths_B, scale, features):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n, kv_heads, model = q.shape[2], k.shape[2], mesh.shape["model"]
    replicated_kv = kv_heads % model != 0
    arrays = {name: value for name, value in features.items() if hasattr(value, "shape")}
    static = {name: value for name, value in features.items() if name not in arrays}

    def body(q_l, k_l, v_l, kv_lengths_l, arrays_l):
        if replicated_kv:  # each local query head reads the k/v head its global index maps to
            local_n = q_l.shape[2]
            heads = (jax.lax.axis_index("model") * local_n + jnp.arange(local_n)) // (n // kv_heads)
            k_l, v_l = jnp.take(k_l, heads, axis=2), jnp.take(v_l, heads, axis=2)
        return attend(q_l, k_l, v_l, kv_lengths_B=kv_lengths_l, scale=scale, **arrays_l, **static)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P("data"), {name: P("data") for name in arrays}),
        out_specs=q_spec,
        check_vma=False,  # kernels (pallas_call, cuDNN) do not say how their outputs vary across the mesh
    )(q, k, v, kv_lengths_B, arrays)
