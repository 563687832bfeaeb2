"""XLM-RoBERTa, RoBERTa, CamemBERT: BERT whose position ids start past the padding id (fairseq's
``pad_token_id + 1 + i``; 514 table rows hold 512 positions), with one token type. multilingual-e5, bge-m3,
arctic-embed-l-v2."""

from __future__ import annotations

import dataclasses

from docbeam.models.families import bert
from docbeam.models.families.encoder_config import EncoderConfig, HubConfig

PREFIXES = ("roberta.", "xlm_roberta.", "camembert.", "model.")
Model = bert.Model
read_params = bert.read_params


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    pad_token_id: int = 1

    @property
    def position_offset(self) -> int:
        return self.pad_token_id + 1


def read_config(hub: HubConfig, dtype: str) -> Config:
    hub.refuse_unless("position_embedding_type", ("absolute",), "relative position embeddings")
    fields = bert.common_fields(hub, dtype)
    pad = int(hub.get("pad_token_id", default=1))
    # max_position: the longest window the table covers, as the plan and settings count it.
    return Config(
        **{
            **fields,
            "max_position": fields["max_position"] - pad - 1,
            "type_vocab_size": hub.get("type_vocab_size", default=1),
        },
        pad_token_id=pad,
    )
