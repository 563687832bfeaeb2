"""The classifier head: a ``*ForSequenceClassification`` checkpoint's scores per document, as transformers'
``text-classification`` pipeline gives them (``top_k=None``).

Per window, inside the forward: the family's own head on the pooled states (BERT's pooler then classifier;
RoBERTa's dense, tanh, out_proj; ModernBERT's cls or mean pooling, dense, activation, norm, classifier), so
logits leave the device. Per document: the first window's logits (the pipeline's truncation, the default) or
the token-weighted mean of every window's (``model.classifier.windows: mean``), then the function the pipeline
applies: softmax for single-label, sigmoid for multi-label (and one label without a problem_type), none for
regression. Its rows go to ``scores/``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from docbeam.models.families import family_of
from docbeam.models.families.encoder_config import ACTIVATIONS, CheckpointError
from docbeam.models.heads import Column, Head, HeadLayer, NonFinite, non_finite, window_facts

FOLDER = "scores"  # its rows are scores, not vectors: a folder of their own beside embeddings/
PROBLEM_TYPES = {
    "regression": "none",
    "multi_label_classification": "sigmoid",
    "single_label_classification": "softmax",
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a family's classifier keeps its layers: (tensor prefix, layer, has bias) in the order they run."""

    pooling: str
    steps: tuple[tuple[str, HeadLayer, bool], ...]


def _bert(hf: dict, where: str) -> Layout:
    return Layout("cls", (("pooler.dense", HeadLayer("dense", "tanh"), True), ("classifier", HeadLayer("dense"), True)))


def _roberta(hf: dict, where: str) -> Layout:
    return Layout(
        "cls",
        (("classifier.dense", HeadLayer("dense", "tanh"), True), ("classifier.out_proj", HeadLayer("dense"), True)),
    )


def _modernbert(hf: dict, where: str) -> Layout:
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise CheckpointError(
            f"model.path: {where} sets classifier_pooling: {json.dumps(pooling)}; ModernBERT's "
            "classifier pools by cls or mean"
        )
    activation = hf.get("classifier_activation", "gelu")
    if activation not in ACTIVATIONS:
        raise CheckpointError(
            f"model.path: {where} sets classifier_activation: {json.dumps(activation)}, which "
            f"docbeam does not run (it runs {', '.join(ACTIVATIONS)})"
        )
    return Layout(
        pooling,
        (
            ("head.dense", HeadLayer("dense", activation), bool(hf.get("classifier_bias", False))),
            ("head.norm", HeadLayer("norm", eps=float(hf.get("norm_eps", 1e-5))), bool(hf.get("norm_bias", False))),
            ("classifier", HeadLayer("dense"), True),
        ),
    )


# The sequence classification heads docbeam reproduces, by the architecture config.json names.
LAYOUTS = {
    "BertForSequenceClassification": _bert,
    "RobertaForSequenceClassification": _roberta,
    "XLMRobertaForSequenceClassification": _roberta,
    "CamembertForSequenceClassification": _roberta,
    "ModernBertForSequenceClassification": _modernbert,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassifierHead(Head):
    labels: tuple[str, ...]  # id2label, in label-id order
    function: str  # "softmax" | "sigmoid" | "none"
    windows: str  # "first" | "mean": which windows' logits score a long document
    tensors: tuple[tuple[str, bool], ...]  # per layer: its tensor prefix in model.safetensors, whether it has a bias
    prefixes: tuple[str, ...] = ()  # the family's model prefixes (``bert.``), stripped from tensor names
    verb = "scored"

    @property
    def regression(self) -> bool:
        return self.function == "none"

    @property
    def counts_labels(self) -> bool:
        return not self.regression  # a regression's rows have no label

    def load_params(self, folder: str) -> tuple[dict, ...]:
        from safetensors import safe_open

        from docbeam.models.families.tensors import Tensors

        path = os.path.join(folder, "model.safetensors")
        wanted = {f"{prefix}.{part}" for prefix, _ in self.tensors for part in ("weight", "bias")}
        with safe_open(path, "numpy") as f:
            raw = {name: f.get_tensor(name) for name in f.keys() if _stripped(name, self.prefixes) in wanted}
        tensors = Tensors(raw, self.prefixes, path)
        params, width = [], None
        for (prefix, bias), layer in zip(self.tensors, self.layers, strict=True):
            if layer.kind == "dense":
                p = tensors.dense(prefix, bias=bias)
                width = p["kernel"].shape[1]
                p.setdefault("bias", np.zeros(width, np.float32))
            else:
                p = tensors.norm(prefix, bias=bias)
                p.setdefault("bias", np.zeros_like(p["scale"]))
            params.append(p)
        if width != len(self.labels):
            raise CheckpointError(
                f"model.path: {path}'s {self.tensors[-1][0]}.weight gives {width} logits, but "
                f"config.json's id2label names {len(self.labels)} labels; they must agree"
            )
        return tuple(params)

    def columns(self) -> list[Column]:
        return [Column("label", "label"), Column("score", "score"), Column("scores", "scores", len(self.labels))]

    def details(self) -> str:
        return f"labels {', '.join(self.labels)}; {self.function}; windows: {self.windows}"

    def summary_line(self) -> str:
        return f"classifier ({self.carried}, {self.function}) → {self.folder}/"

    def document_row(self, windows: list) -> dict | NonFinite:
        windows = sorted(windows, key=lambda w: w.index)
        used = windows[:1] if self.windows == "first" else windows
        broken = [w for w in used if not np.all(np.isfinite(w.vector))]
        weights = np.array([w.length for w in used], np.float64)
        logits = (np.stack([w.vector for w in used]).astype(np.float64) * weights[:, None]).sum(0) / weights.sum()
        scores = apply_function(logits, self.function).astype(np.float32)
        if broken or not np.all(np.isfinite(scores)):
            return non_finite(used, broken, "score")
        top = int(np.argmax(scores))
        return {
            "id": windows[0].doc_id,
            "label": None if self.regression else self.labels[top],
            "score": float(scores[0] if self.regression else scores[top]),
            "scores": scores.tolist(),
            **window_facts(windows),
        }

    def reuse_key(self) -> dict:
        return {
            "name": self.name,
            "architecture": self.carried,
            "labels": list(self.labels),
            "function": self.function,
            "windows": self.windows,
            "pooling": self.pooling,
        }

    def reusable(self, row: dict) -> bool:
        scores = np.asarray(row["scores"], np.float32)
        return scores.shape == (len(self.labels),) and bool(np.all(np.isfinite(scores)))

    def describe(self) -> dict:
        return {**super().describe(), "labels": list(self.labels), "function": self.function, "windows": self.windows}


def _stripped(name: str, prefixes: tuple[str, ...]) -> str:
    return next((name[len(p) :] for p in prefixes if name.startswith(p)), name)


def apply_function(logits: np.ndarray, function: str) -> np.ndarray:
    """The pipeline's postprocessing, in float64: softmax (max subtracted), sigmoid, or the logits as they are."""
    if function == "softmax":
        shifted = np.exp(logits - logits.max())
        return shifted / shifted.sum()
    if function == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    return logits


def function_for(hf: dict, num_labels: int, where: str) -> str:
    """transformers' text-classification pipeline's choice: problem_type first, then one label → sigmoid."""
    problem = hf.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise CheckpointError(
            f"model.path: {where} sets problem_type: {json.dumps(problem)}; expected one of "
            f"{', '.join(PROBLEM_TYPES)} or null"
        )
    if problem is not None:
        return PROBLEM_TYPES[problem]
    return "sigmoid" if num_labels == 1 else "softmax"


def labels_of(hf: dict, where: str) -> tuple[str, ...]:
    id2label = hf.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        raise CheckpointError(
            f"model.path: {where} has no id2label; a classifier names its labels there, e.g. "
            '{"0": "negative", "1": "positive"}'
        )
    try:
        ids = sorted(int(k) for k in id2label)
    except (TypeError, ValueError):
        ids = None
    if ids != list(range(len(id2label))) or not all(isinstance(v, str) for v in id2label.values()):
        raise CheckpointError(
            f"model.path: {where} sets id2label: {json.dumps(id2label)[:200]}; expected label "
            "ids 0, 1, ... each naming its label once"
        )
    return tuple(id2label[k] for k in sorted(id2label, key=int))


def resolve(checkpoint, hf: dict, carried: str | None, where: str, model_cfg) -> ClassifierHead:
    if carried is None or not carried.endswith("ForSequenceClassification"):
        raise CheckpointError(
            f"model.head: classifier, but {where} sets architectures: "
            f"{json.dumps(hf.get('architectures'))}, no sequence classification head; set "
            "model.head: auto (or embedding) to embed with it"
        )
    if carried not in LAYOUTS:
        raise CheckpointError(
            f"model.path: {where} sets architectures: [{carried!r}], whose classifier head "
            f"docbeam does not reproduce (it runs {', '.join(LAYOUTS)}); set model.head: "
            "embedding to embed with its backbone instead (the head is then not run)"
        )
    layout = LAYOUTS[carried](hf, where)
    labels = labels_of(hf, where)
    return ClassifierHead(
        name="classifier",
        pooling=layout.pooling,
        layers=tuple(layer for _, layer, _ in layout.steps),
        width=len(labels),
        folder=FOLDER,
        carried=carried,
        labels=labels,
        function=function_for(hf, len(labels), where),
        windows=model_cfg.classifier.windows,
        tensors=tuple((prefix, bias) for prefix, _, bias in layout.steps),
        prefixes=family_of(checkpoint.config).PREFIXES,
    )
