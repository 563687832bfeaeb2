"""EuroBERT: a Llama-style encoder read both ways. Llama's decoder layers as models/families/qwen3.py builds them
(pre-norm RMSNorm, grouped-query q/k/v, half-style rotary positions, SwiGLU, a final RMSNorm, no biases unless
``attention_bias``), every layer attending over the whole window: transformers' EuroBertModel hands its Llama
layers a bidirectional padding mask whatever the config says. Pooled mean unless its sentence-transformers files
say otherwise. EuroBERT-210m/610m/2.1b, jina-embeddings-v5-nano's backbone."""

from __future__ import annotations

import dataclasses

from docbeam.models.families import qwen3
from docbeam.models.families.encoder_config import HubConfig

PREFIXES = ("model.",)  # EuroBertForMaskedLM / ForSequenceClassification keep the encoder under model.
Model = qwen3.Model
read_params = qwen3.read_params  # Llama's tensor names


@dataclasses.dataclass(frozen=True)
class Config(qwen3.Config):
    """Qwen3's decoder config with Llama's choices: no q/k norm, never causal. The class names the family."""

    qk_norm: bool = False
    causal: bool = False


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub.refuse_unless("mlp_bias", (False,), "biased MLP projections")
    biased = bool(hub.get("attention_bias", default=False))  # Llama's: q, k, v and o alike
    fields = qwen3.decoder_fields(hub, dtype)
    return Config(
        **{
            **fields,
            "max_position": hub.get("max_position_embeddings", default=8192),
            "layer_norm_eps": hub.get("rms_norm_eps", default=1e-5),
        },
        qkv_bias=biased,
        out_bias=biased,
    )
