"""Qwen3, Qwen2, Llama and Mistral: decoders. Pre-norm RMSNorm layers, q/k/v projections with fewer key/value
heads than query heads (grouped-query), rotary positions (half style, theta from config), SwiGLU, a final
RMSNorm, and causal attention: a token sees only the tokens before it in its window, so the window's last token
is the one that has seen it all (last-token pooling, and the ``<|endoftext|>`` the tokenizer appends). Qwen3
adds a per-head RMSNorm on q and k and drops every bias; Qwen2 biases q, k and v; Llama and Mistral are Qwen2
without those biases (``attention_bias`` biases all four projections), Mistral with a causal sliding window
(each query sees the ``sliding_window`` tokens ending at itself). Qwen3-Embedding 0.6B/4B/8B, gte-Qwen2.

A checkpoint trained to read both ways says so in config.json (``use_bidirectional_attention: true``,
``is_causal: false``, or NVIDIA's ``model_type: llama_bidirec``): its layers attend over the whole window and
it pools as its sentence-transformers files say (mean when they say nothing). pplx-embed, llama-embed-nemotron
(voyage-4-nano's output projection is refused). Llama 3's RoPE scaling (``rope_type: llama3``) is reproduced;
other scalings are refused."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from docbeam.models.families.blocks import FamilyModel, GatedMlp, GroupedSelfAttention, rms_norm
from docbeam.models.families.encoder_config import CheckpointError, EncoderConfig, HubConfig, Rope
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import precision_of

PREFIXES = ("model.",)  # Qwen3ForCausalLM's tensors; Qwen3Model (Qwen3-Embedding) saves them bare
LLAMA_BIDIRECTIONAL = "llama_bidirec"  # NVIDIA's LlamaBidirectionalModel (llama-embed-nemotron): never causal


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    num_kv_heads: int | None = None  # grouped-query: key/value heads, a divisor of num_heads; None: num_heads
    attention_head_dim: int | None = None  # config.json's head_dim; None: hidden_size // num_heads
    qk_norm: bool = True  # Qwen3's per-head q/k RMSNorm
    qkv_bias: bool = False  # Qwen2's biased q/k/v projections
    out_bias: bool = False  # Qwen3's attention_bias biases the output projection too
    causal: bool = True  # False: the checkpoint reads both ways (use_bidirectional_attention, EuroBERT)
    rope_bands: tuple[float, float, float, float] | None = None  # Rope.bands: Llama 3's RoPE scaling
    sliding_window: int | None = None  # Mistral's: a query sees itself and the sliding_window - 1 keys before it

    @property
    def local_window(self) -> tuple[int, int] | None:
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    @property
    def rope(self) -> Rope:
        return Rope(self.rope_theta, self.rope_style, self.rope_scale, self.rope_bands)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def attention_features(self) -> tuple:
        from docbeam.attention.interface import AttentionFeatures

        return (AttentionFeatures(local_window=self.local_window, causal=self.causal),)

    def check_heads(self) -> None:
        """head_dim is the config's own, so hidden_size need not divide by num_heads; the k/v heads must
        divide the query heads, each k/v head serving a whole group."""
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")


class Model(FamilyModel):
    """Token embeddings (no positions: they are rotary), pre-norm decoder layers, a final RMSNorm."""

    def encode(self, ids_BxT, rows, dtype):
        cfg = self.config
        x_BxTxD = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, name="embed")(ids_BxT)
        rope = cfg.rope
        for i in range(cfg.num_layers):
            x_BxTxD = Layer(cfg, self.attention, rope, name=f"layer_{i}")(x_BxTxD, rows)
        return rms_norm(cfg.layer_norm_eps, dtype, "final_norm")(x_BxTxD)


class Layer(nn.Module):
    config: Config
    attention: Callable[..., Any]
    rope: Rope

    @nn.compact
    def __call__(self, x_BxTxD, rows):
        cfg, precision = self.config, precision_of(self.config.dtype)
        h_BxTxD = rms_norm(cfg.layer_norm_eps, jnp.float32, "attn_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + GroupedSelfAttention(
            cfg.num_heads,
            cfg.kv_heads,
            cfg.head_dim,
            self.attention,
            precision,
            self.rope,
            qkv_bias=cfg.qkv_bias,
            out_bias=cfg.out_bias,
            qk_norm_eps=cfg.layer_norm_eps if cfg.qk_norm else None,
            causal=cfg.causal,
            local_window=cfg.local_window,
            name="attn",
        )(h_BxTxD, rows)
        h_BxTxD = rms_norm(cfg.layer_norm_eps, jnp.float32, "mlp_norm")(x_BxTxD)
        return x_BxTxD + GatedMlp(cfg.intermediate_size, cfg.activation, precision, name="mlp")(h_BxTxD)


def read_config(hub: HubConfig, dtype: str) -> Config:
    """transformers 5's keys (``rope_parameters``, ``layer_types``) or the Hub's (``rope_theta``,
    ``rope_scaling``); Qwen's sliding-window layers are refused: Qwen-Embedding checkpoints attend over the whole
    window, and docbeam would run such a layer as a full one."""
    model_type = hub.get("model_type")
    hub.refuse_unless("use_sliding_window", (False,), "sliding-window layers")
    # Mistral's sliding window (transformers: key j is seen from query i when j > i - sliding_window); Qwen's
    # sliding_window applies only with use_sliding_window, refused above.
    window = hub.raw.get("sliding_window") if model_type == "mistral" else None
    causal = model_type != LLAMA_BIDIRECTIONAL and not bidirectional(hub)
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise hub.error(
            f"sets sliding_window: {window!r} on a {'causal' if causal else 'bidirectional'} Mistral; "
            "supported: null, or a positive number of tokens on a causal one"
        )
    kinds = set(hub.raw.get("layer_types") or ())
    if kinds - {"full_attention"}:
        raise hub.error(f"has layer_types {sorted(kinds)}; docbeam runs only full_attention decoder layers")
    llama = model_type in ("llama", LLAMA_BIDIRECTIONAL)
    if llama:  # the others' MLPs take no mlp_bias
        hub.refuse_unless("mlp_bias", (False,), "biased MLP projections")
    if model_type == LLAMA_BIDIRECTIONAL:  # its own head pools as `pooling` says; sentence-transformers: the mean
        hub.refuse_unless("pooling", ("avg",), "docbeam pools a bidirectional Llama by the mean")
    # Qwen2 always biases q/k/v and never o; Mistral biases nothing; Qwen3 and Llama all four if attention_bias.
    biased = (model_type == "qwen3" or llama) and bool(hub.get("attention_bias", default=False))
    return Config(
        **decoder_fields(hub, dtype),
        qk_norm=model_type == "qwen3",
        qkv_bias=biased or model_type == "qwen2",
        out_bias=biased,
        causal=causal,
        sliding_window=window,
    )


def bidirectional(hub: HubConfig) -> bool:
    """transformers' flag (``use_bidirectional_attention``), or ``is_causal: false`` where a checkpoint says it
    that way; a config saying both ways at once is refused."""
    flag, is_causal = hub.raw.get("use_bidirectional_attention"), hub.raw.get("is_causal")
    for key, value in (("use_bidirectional_attention", flag), ("is_causal", is_causal)):
        if value not in (None, True, False):
            raise hub.error(f"sets {key}: {value!r}; supported: true, false")
    if flag is not None and is_causal is not None and flag == is_causal:
        raise hub.error(
            f"sets use_bidirectional_attention: {flag} and is_causal: {is_causal}, which contradict "
            "each other; keep one"
        )
    return flag is True or is_causal is False


def decoder_fields(hub: HubConfig, dtype: str) -> dict:
    """The keys every Llama-style decoder's config.json shares (EuroBERT's too); a RoPE scaling other than
    Llama 3's is refused."""
    heads, hidden = hub.get("num_attention_heads"), hub.get("hidden_size")
    head_dim = hub.get("head_dim", default=hidden // heads)
    rope = hub.rope(head_dim, 10_000.0, llama3=True)
    if rope.scale != 1.0:
        raise hub.error(f"sets a RoPE scaling, which docbeam does not reproduce for {hub.get('model_type')}")
    return dict(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=hub.get("num_hidden_layers"),
        num_heads=heads,
        intermediate_size=hub.get("intermediate_size"),
        max_position=hub.get("max_position_embeddings", default=32768),
        type_vocab_size=0,
        layer_norm_eps=hub.get("rms_norm_eps", default=1e-6),
        activation=hub.activation("hidden_act", default="silu"),
        position="rope",
        rope_theta=rope.theta,
        rope_bands=rope.bands,
        num_kv_heads=hub.get("num_key_value_heads", default=heads),
        attention_head_dim=head_dim,
        dtype=dtype,
    )


def layer_params(t: Tensors, p: str, config: Config) -> dict:
    """One layer's tensors (``p``: its prefix, ``layers.<i>``)."""
    attn = {
        "qkv": t.dense(*(f"{p}.self_attn.{n}_proj" for n in "qkv"), bias=config.qkv_bias),
        "out": t.dense(f"{p}.self_attn.o_proj", bias=config.out_bias),
    }
    if config.qk_norm:
        attn |= {
            "q_norm": t.norm(f"{p}.self_attn.q_norm", bias=False),
            "k_norm": t.norm(f"{p}.self_attn.k_norm", bias=False),
        }
    return {
        "attn_norm": t.norm(f"{p}.input_layernorm", bias=False),
        "attn": attn,
        "mlp_norm": t.norm(f"{p}.post_attention_layernorm", bias=False),
        # gate_proj is the activated half: GatedMlp's order.
        "mlp": {
            "wi": t.dense(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", bias=False),
            "wo": t.dense(f"{p}.mlp.down_proj", bias=False),
        },
    }


def read_params(t: Tensors, config: Config) -> dict:
    if t.has("linear.weight"):  # voyage-4-nano's: TEI applies it after the final norm; no reference here checks that
        raise CheckpointError(
            f"model.path: {t.where} has a tensor 'linear.weight' (an output projection after the "
            "decoder, sized by config.json's num_labels), which docbeam does not run; supported: "
            "decoders whose vectors are their hidden states"
        )
    params = {"embed": t.embedding("embed_tokens.weight"), "final_norm": t.norm("norm", bias=False)}
    for i in range(config.num_layers):
        params[f"layer_{i}"] = layer_params(t, f"layers.{i}", config)
    return params
