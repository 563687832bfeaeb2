"""DeBERTa-v2 and -v3 (``deberta-v2``): BERT's post-norm layers with disentangled attention. Beside q·k, each
score gets content→position (``q_i · Kr[δ(i, j)]``, c2p) and position→content (``k_j · Qr[δ(i, j)]``, p2c)
terms: Kr and Qr are one relative-embedding table (LayerNormed with ``norm_rel_ebd: layer_norm``) projected by
each layer (by its own key/query projections with ``share_att_key``), δ the query − key offset, log-bucketed
past ``position_buckets / 2`` and clipped to the table. The scores are scaled by ``1/√(d · (1 + #terms))``.
v3 puts no positions in the input (``position_biased_input: false``). The terms go to attention as
``relative_positions`` (attention/relative.py): the backend computes them per block. NeMo Curator's quality
and domain classifiers, mDeBERTa."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families import bert
from docbeam.models.families.blocks import Embeddings, FamilyModel, Mlp, Rows, layer_norm
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import Linear, precision_of

PREFIXES = ("deberta.",)
TERMS = ("c2p", "p2c")  # pos_att_type values docbeam runs (DeBERTa v1's p2p is not one of v2's)


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    relative_attention: bool = True
    position_buckets: int = 256  # ≤ 0: no log buckets, offsets clipped to max_relative_positions
    max_relative_positions: int = 512  # the log buckets' reach (max_position_embeddings when the file says < 1)
    share_att_key: bool = True  # Kr, Qr by the layer's key and query projections, else by pos_key/pos_query
    pos_att_type: tuple[str, ...] = TERMS
    norm_rel_ebd: bool = True  # a LayerNorm on the relative embeddings

    @property
    def span(self) -> int:
        """Offsets each side the table holds: it has 2 · span rows."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def relative_terms(self) -> tuple[str, ...]:
        return self.pos_att_type if self.relative_attention else ()

    @property
    def attention_features(self) -> tuple:
        from docbeam.attention.interface import AttentionFeatures

        return (AttentionFeatures(relative_positions=bool(self.relative_terms)),)


def log_bucket(offset, buckets: int, max_position: int):
    """transformers' make_log_bucket_position, in float32 as it computes: offsets within ±buckets/2 as they
    are, beyond that logarithmic, reaching buckets/2 − 1 past the middle at max_position."""
    mid = buckets // 2
    near = (offset < mid) & (offset > -mid)
    magnitude = jnp.where(near, mid - 1, jnp.abs(offset))
    far = (
        jnp.ceil(
            jnp.log(magnitude.astype(jnp.float32) / mid) / jnp.log(jnp.float32((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return jnp.where(magnitude <= mid, offset, (far * jnp.sign(offset)).astype(offset.dtype))


def relative_row(config: Config) -> Callable:
    """query − key offset → row of the relative table: bucketed, shifted by the span, clipped to the table."""

    def row(offset):
        if config.position_buckets > 0:
            offset = log_bucket(offset, config.position_buckets, config.max_relative_positions)
        return jnp.clip(offset + config.span, 0, 2 * config.span - 1)

    return row


class DisentangledAttention(nn.Module):
    config: Config
    attention: Callable[..., Any]

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows, rel_RxD):
        from docbeam.attention.relative import RelativePositions

        cfg, precision = self.config, precision_of(self.config.dtype)
        B, T, D = x_BxTxD.shape
        N, H = cfg.num_heads, cfg.head_dim
        qkv = Linear(3 * D, precision, name="qkv")
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = jnp.split(
            qkv(x_BxTxD).astype(precision.attention).reshape(B, T, 3 * N, H), 3, axis=2
        )
        features = {} if rows.segment_ids_BxT is None else {"segment_ids_BxT": rows.segment_ids_BxT}
        terms = cfg.relative_terms
        if terms:
            if cfg.share_att_key:  # the layer's own query and key projections
                pos_q_RxD, pos_k_RxD, _ = jnp.split(qkv(rel_RxD), 3, axis=-1)
            else:
                pos_q_RxD = Linear(D, precision, name="pos_query")(rel_RxD) if "p2c" in terms else None
                pos_k_RxD = Linear(D, precision, name="pos_key")(rel_RxD) if "c2p" in terms else None
            tables = {
                term: t_RxD.astype(precision.attention).reshape(-1, N, H)
                for term, t_RxD in (("c2p", pos_k_RxD), ("p2c", pos_q_RxD))
                if term in terms
            }
            features["relative_positions"] = RelativePositions(relative_row(cfg), tables.get("c2p"), tables.get("p2c"))
        attn_BxTxNxH = self.attention(
            q_BxTxNxH,
            k_BxTxNxH,
            v_BxTxNxH,
            kv_lengths_B=rows.lengths_B,
            scale=1.0 / math.sqrt(H * (1 + len(cfg.pos_att_type))),
            **features,
        )
        return Linear(D, precision, name="out")(attn_BxTxNxH.reshape(B, T, D))


class Layer(nn.Module):
    """BERT's post-norm layer around disentangled attention."""

    config: Config
    attention: Callable[..., Any]

    @nn.compact
    def __call__(self, x_BxTxD, rows: Rows, rel_RxD):
        cfg = self.config
        attn_BxTxD = DisentangledAttention(cfg, self.attention, name="attn")(x_BxTxD, rows, rel_RxD)
        x_BxTxD = layer_norm(cfg.layer_norm_eps, jnp.float32, "attn_norm")(x_BxTxD + attn_BxTxD)
        mlp = Mlp(cfg.intermediate_size, cfg.activation, precision_of(cfg.dtype), name="mlp")
        return layer_norm(cfg.layer_norm_eps, jnp.float32, "mlp_norm")(x_BxTxD + mlp(x_BxTxD))


class Model(FamilyModel):
    """Embeddings (absolute positions only with position_biased_input), zeroed on padding as transformers
    masks them; one relative table shared by every layer."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = Embeddings(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.layer_norm_eps,
            dtype,
            position_table=cfg.max_position if cfg.position == "absolute" else 0,
            type_vocab_size=cfg.type_vocab_size,
            name="embed",
        )(ids_BxT, rows)
        if rows.segment_ids_BxT is None:
            valid_BxT = jnp.arange(ids_BxT.shape[1])[None, :] < rows.lengths_B[:, None]
        else:
            valid_BxT = rows.segment_ids_BxT > 0
        x_BxTxD = x_BxTxD * valid_BxT[..., None].astype(x_BxTxD.dtype)
        rel_RxD = None
        if cfg.relative_terms:
            rel_RxD = self.param("rel_embeddings", nn.initializers.normal(0.02), (2 * cfg.span, cfg.hidden_size))
            if cfg.norm_rel_ebd:
                rel_RxD = layer_norm(cfg.layer_norm_eps, jnp.float32, "rel_norm")(rel_RxD)
        for i in range(cfg.num_layers):
            x_BxTxD = Layer(cfg, self.attention, name=f"layer_{i}")(x_BxTxD, rows, rel_RxD)
        return x_BxTxD


def read_config(hub: HubConfig, dtype: str) -> Config:
    hidden = hub.get("hidden_size")
    for key, default, why in (
        ("embedding_size", hidden, "an embedding projection (embed_proj)"),
        (
            "attention_head_size",
            hidden // hub.get("num_attention_heads"),
            "heads of another size than hidden_size / num_attention_heads",
        ),
    ):
        if hub.get(key, default=default) != default:
            raise hub.error(
                f"sets {key}: {hub.raw[key]!r}, which needs {why} docbeam does not build; "
                f"supported: {default} (or the key left out)"
            )
    if hub.get("conv_kernel_size", default=0) > 0:
        raise hub.error(
            f"sets conv_kernel_size: {hub.raw['conv_kernel_size']!r}, DeBERTa-v2's convolution beside "
            "the first layer, which docbeam does not build; supported: 0 (DeBERTa-v3 has none)"
        )
    raw_terms = hub.get("pos_att_type", default=[])
    terms = [t.strip() for t in (raw_terms.lower().split("|") if isinstance(raw_terms, str) else raw_terms)]
    if set(terms) - set(TERMS):
        raise hub.error(
            f"sets pos_att_type: {raw_terms!r}; docbeam runs {', '.join(TERMS)} (content→position and "
            "position→content), alone or both"
        )
    norm = [x.strip() for x in str(hub.get("norm_rel_ebd", default="none")).lower().split("|")]
    if set(norm) - {"none", "layer_norm"}:
        raise hub.error(f"sets norm_rel_ebd: {hub.raw['norm_rel_ebd']!r}; supported: none, layer_norm")
    fields = {
        **bert.common_fields(hub, dtype),
        "type_vocab_size": hub.get("type_vocab_size", default=0),
        "layer_norm_eps": hub.get("layer_norm_eps", default=1e-7),
    }
    max_relative = int(hub.get("max_relative_positions", default=-1))
    return Config(
        **fields,
        position="absolute" if hub.get("position_biased_input", default=True) else "relative",
        relative_attention=bool(hub.get("relative_attention", default=False)),
        position_buckets=int(hub.get("position_buckets", default=-1)),
        max_relative_positions=max_relative if max_relative >= 1 else fields["max_position"],
        share_att_key=bool(hub.get("share_att_key", default=False)),
        pos_att_type=tuple(dict.fromkeys(t for t in terms if t)),
        norm_rel_ebd="layer_norm" in norm,
    )


def read_params(t: Tensors, config: Config) -> dict:
    params = {"embed": bert.embedding_params(t, config)}
    terms = config.relative_terms
    if terms:
        params["rel_embeddings"] = t("encoder.rel_embeddings.weight")
        if config.norm_rel_ebd:
            params["rel_norm"] = t.norm("encoder.LayerNorm")
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        attn = {
            "qkv": t.dense(*(f"{p}.attention.self.{n}_proj" for n in ("query", "key", "value"))),
            "out": t.dense(f"{p}.attention.output.dense"),
        }
        if terms and not config.share_att_key:
            attn.update(
                {
                    f"pos_{name}": t.dense(f"{p}.attention.self.pos_{name}_proj")
                    for name, term in (("key", "c2p"), ("query", "p2c"))
                    if term in terms
                }
            )
        params[f"layer_{i}"] = {
            "attn": attn,
            "attn_norm": t.norm(f"{p}.attention.output.LayerNorm"),
            "mlp": {"wi": t.dense(f"{p}.intermediate.dense"), "wo": t.dense(f"{p}.output.dense")},
            "mlp_norm": t.norm(f"{p}.output.LayerNorm"),
        }
    return params
