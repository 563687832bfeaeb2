"""A checkpoint's safetensors as a family's ``read_params`` reads them: tensors by Hugging Face name (torch
[out, in] layout) with a task head's model prefix stripped, and shaped for models/families/blocks.py's
parameters (Dense kernels [in, out], fused projections side by side, norms, embeddings)."""

from __future__ import annotations

import numpy as np

from docbeam.models.families.encoder_config import CheckpointError


class Tensors:
    """A checkpoint's tensors by Hugging Face name (torch [out, in] layout), with the model prefix a task head
    adds (``roberta.``, ``model.``, …) stripped, and helpers that shape them for the blocks above."""

    def __init__(self, raw: dict[str, np.ndarray], prefixes: tuple[str, ...], where: str):
        self.where = where
        self.tensors = {}
        for name, value in raw.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            self.tensors[name] = value

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> np.ndarray:
        """Old checkpoints name LayerNorm parameters gamma/beta."""
        for candidate in (name, name.replace(".weight", ".gamma"), name.replace(".bias", ".beta")):
            if candidate in self.tensors:
                return np.asarray(self.tensors[candidate], np.float32)
        raise CheckpointError(
            f"model.path: {self.where} has no tensor {name!r}, which this model type needs "
            f"(first names: {sorted(self.tensors)[:5]})"
        )

    def dense(self, *prefixes: str, bias: bool = True) -> dict:
        """One Flax Dense from one or more torch Linears side by side (fused projections)."""
        out = {"kernel": np.concatenate([self(f"{p}.weight").T for p in prefixes], axis=1)}
        if bias:
            out["bias"] = np.concatenate([self(f"{p}.bias") for p in prefixes])
        return out

    def swapped_halves(self, prefix: str) -> dict:
        """A fused, unbiased torch Linear whose output halves are [linear | activated]: GatedMlp's order is
        the other way round."""
        return {"kernel": np.concatenate(np.split(self(f"{prefix}.weight").T, 2, axis=-1)[::-1], axis=-1)}

    def post_norm_layer(self, qkv: tuple[str, ...], out: str, attn_norm: str, wi: str, wo: str, mlp_norm: str) -> dict:
        """One blocks.PostNormLayer's parameters (biased projections, LayerNorms with bias, a plain MLP) from the
        torch names of its parts: MPNet and DistilBERT (and BERT) differ only in those names."""
        return {
            "attn": {"qkv": self.dense(*qkv), "out": self.dense(out)},
            "attn_norm": self.norm(attn_norm),
            "mlp": {"wi": self.dense(wi), "wo": self.dense(wo)},
            "mlp_norm": self.norm(mlp_norm),
        }

    def norm(self, prefix: str, bias: bool = True) -> dict:
        out = {"scale": self(f"{prefix}.weight")}
        if bias:
            out["bias"] = self(f"{prefix}.bias")
        return out

    def embedding(self, name: str) -> dict:
        return {"embedding": self(name)}
