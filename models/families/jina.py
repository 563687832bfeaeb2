"""Jina embeddings v3 (``jina_embeddings_v3`` in transformers 5; on the Hub ``xlm-roberta`` run by jinaai's
remote code, told apart by ``position_embedding_type: rotary``): XLM-RoBERTa's post-norm layers with rotary
positions (half style, theta 20,000, counted from 0: no position table) instead of the 514-row table, and one
token type. The Hub's checkpoint carries LoRA adapters on every Linear and Embedding, one slice per task of
``lora_adaptations``; the task ``model.task`` names (default: config.json's ``default_lora_task``, else none: the
base weights, as the checkpoint's own code runs without a task) is merged into the weights here, once, as
``W + B·A·lora_alpha/lora_rank``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.models.families.blocks import PostNormEncoder
from docbeam.models.families.encoder_config import CheckpointError, EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors

PREFIXES = ("roberta.",)
LORA = ".parametrizations.weight"  # torch.nn.utils.parametrize's names: .original, and .0.lora_A / .0.lora_B


@dataclasses.dataclass(frozen=True)
class Config(EncoderConfig):
    tasks: tuple[str, ...] = ()  # lora_adaptations: the adapters' slices, in order
    task: str | None = None  # the adapter merged into the weights; None: the base weights
    instructions: tuple[tuple[str, str], ...] = ()  # task_instructions: the text each task puts before its input
    lora_rank: int = 4
    lora_alpha: float = 1.0

    @property
    def lora_scale(self) -> float:
        """The Hub's LoRAParametrization: ``scaling = alpha / rank``."""
        return self.lora_alpha / self.lora_rank

    @property
    def instruction(self) -> str | None:
        """The chosen task's prompt (the checkpoint's ``task_instructions``), None without a task or one."""
        return dict(self.instructions).get(self.task) if self.task else None


class Model(PostNormEncoder):
    """BERT's post-norm encoder with rotary positions (position: rope), biases everywhere, a plain MLP."""


def read_config(hub: HubConfig, dtype: str) -> Config:
    transformers_form = hub.raw.get("model_type") == "jina_embeddings_v3"
    if not transformers_form:
        hub.refuse_unless("position_embedding_type", ("rotary",), "Jina v3 runs with rotary positions")
        hub.refuse_unless("rotary_emb_interleaved", (False,), "rotary pairs interleaved")
        hub.refuse_unless("rotary_emb_scale_base", (None,), "xPos-scaled rotary positions")
    hidden, heads = hub.get("hidden_size"), hub.get("num_attention_heads")
    if hub.get("rotary_emb_dim", default=hidden // heads) != hidden // heads:
        raise hub.error(
            f"sets rotary_emb_dim: {hub.raw['rotary_emb_dim']}, rotary positions on part of each head, "
            f"which docbeam does not run; supported: the whole head ({hidden // heads})"
        )
    # jinaai's config class defaults rotary_emb_base to 10,000 (its checkpoint sets 20,000); transformers 20,000.
    rope = hub.rope(hidden // heads, 20_000.0 if transformers_form else 10_000.0, legacy_theta=("rotary_emb_base",))
    tasks = tuple(hub.get("lora_adaptations", default=()))
    instructions = hub.get("task_instructions", default={})
    if not isinstance(instructions, dict) or not set(instructions) <= set(tasks):
        raise hub.error(
            f"sets task_instructions: {instructions!r}; expected a text for some of its lora_adaptations {list(tasks)}"
        )
    default = hub.get("default_lora_task", default=None)
    if default is not None and default not in tasks:
        raise hub.error(f"sets default_lora_task: {default!r}, which is not among its lora_adaptations {list(tasks)}")
    return Config(
        vocab_size=hub.get("vocab_size"),
        hidden_size=hidden,
        num_layers=hub.get("num_hidden_layers"),
        num_heads=heads,
        intermediate_size=hub.get("intermediate_size"),
        max_position=hub.get("max_position_embeddings", default=8194),
        type_vocab_size=hub.get("type_vocab_size", default=1),
        layer_norm_eps=hub.get("layer_norm_eps", default=1e-5),
        activation=hub.activation("hidden_act", default="gelu"),
        position="rope",
        rope_theta=rope.theta,
        rope_scale=rope.scale,
        dtype=dtype,
        tasks=tasks,
        task=default,
        instructions=tuple(instructions.items()),
        lora_rank=int(hub.get("lora_rank", default=4)),
        lora_alpha=float(hub.get("lora_alpha", default=1)),
    )


def with_task(config: Config, task: str | None, where: str) -> Config:
    """``model.task`` chosen: one of the checkpoint's adapters; None keeps the checkpoint's default."""
    if task is None:
        return config
    if task not in config.tasks:
        have = (
            f"its lora_adaptations are {', '.join(config.tasks)}; set model.task to one of those"
            if config.tasks
            else "it sets no lora_adaptations (no task adapters); leave model.task out"
        )
        raise CheckpointError(f"model.task: {task!r} is not a task of {where}: {have}")
    return dataclasses.replace(config, task=task)


def read_params(t: Tensors, config: Config) -> dict:
    merged = Merged(t, config)
    embed = {"word": {"embedding": merged.embedding("embeddings.word_embeddings")}, "norm": t.norm("emb_ln")}
    if config.type_vocab_size:
        embed["token_type"] = {"embedding": merged.embedding("embeddings.token_type_embeddings")}
    params = {"embed": embed}
    for i in range(config.num_layers):
        p = f"encoder.layers.{i}"
        params[f"layer_{i}"] = {
            "attn": {"qkv": merged.dense(f"{p}.mixer.Wqkv"), "out": merged.dense(f"{p}.mixer.out_proj")},
            "attn_norm": t.norm(f"{p}.norm1"),
            "mlp": {"wi": merged.dense(f"{p}.mlp.fc1"), "wo": merged.dense(f"{p}.mlp.fc2")},
            "mlp_norm": t.norm(f"{p}.norm2"),
        }
    return params


class Merged:
    """A checkpoint's Linear and Embedding weights with the chosen task's LoRA merged in: the Hub's
    ``lora_forward`` (``W + B[task]·A[task]·scale``; an Embedding's slices are [vocab, r] and [r, dim], so
    ``W + A[task]·B[task]·scale``), computed once in float64."""

    def __init__(self, t: Tensors, config: Config):
        self.t, self.config = t, config
        self.index = config.tasks.index(config.task) if config.task else None

    def weight(self, name: str, embedding: bool = False) -> np.ndarray:
        """torch's layout: [out, in] for a Linear, [rows, dim] for an Embedding."""
        t = self.t
        base = t(f"{name}{LORA}.original") if t.has(f"{name}{LORA}.original") else t(f"{name}.weight")
        if self.index is None:
            return base
        a, b = self.slices(name, base.shape, embedding)
        delta = a @ b if embedding else b @ a
        return (base.astype(np.float64) + delta * self.config.lora_scale).astype(np.float32)

    def slices(self, name: str, shape: tuple, embedding: bool) -> tuple[np.ndarray, np.ndarray]:
        """The chosen task's (A, B), checked against lora_adaptations and lora_rank."""
        cfg, t = self.config, self.t
        if not t.has(f"{name}{LORA}.0.lora_A"):
            raise self.error(
                f"has no tensor {name}{LORA}.0.lora_A for model.task: {cfg.task!r}; the checkpoint "
                "carries no adapters (leave model.task out for its base weights)"
            )
        a, b = t(f"{name}{LORA}.0.lora_A"), t(f"{name}{LORA}.0.lora_B")
        tasks, rank = len(cfg.tasks), cfg.lora_rank
        expected = (
            ((tasks, shape[0], rank), (tasks, rank, shape[1]))
            if embedding
            else ((tasks, rank, shape[1]), (tasks, shape[0], rank))
        )
        if (a.shape, b.shape) != expected:
            raise self.error(
                f"holds {name}{LORA}.0.lora_A {list(a.shape)} and lora_B {list(b.shape)}, but "
                f"config.json's lora_adaptations ({len(cfg.tasks)} tasks) and lora_rank "
                f"({cfg.lora_rank}) say one slice per task of rank {cfg.lora_rank} for a weight of "
                f"shape {list(shape)}; the adapters belong to another config"
            )
        return a[self.index].astype(np.float64), b[self.index].astype(np.float64)

    def error(self, message: str):
        return HubConfig({}, self.t.where).error(message)

    def dense(self, name: str) -> dict:
        return {"kernel": self.weight(name).T, "bias": self.t(f"{name}.bias")}

    def embedding(self, name: str) -> np.ndarray:
        return self.weight(name, embedding=True)
