"""What tests/mesh_test.py runs in a process of its own with N virtual CPU devices (XLA's
``--xla_force_host_platform_device_count``, which must be set before JAX starts, so not in the test process):
a family's tiny random checkpoint encoded on one chip and on each mesh, through the worker's own runtime
(pipeline/stages/encode.py ``load_encoder``), every backend, unpacked and packed. Prints one JSON object.

``python tests/mesh_cases.py <family> <folder>``
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

MESHES = ((4, 1), (2, 2), (1, 4))  # data only, mixed, model only; (1, 1) is the reference
BUCKET = 64
LENGTHS = (40, 57, 23, 64, 12, 33, 9)  # 7 windows: rows that a data axis of 2 or 4 does not divide
PALLAS = {"kernel": "pallas_tpu", "interpret": True}
SPLASH = {"kernel": "splash_tpu", "interpret": True}  # local windows: pallas_tpu has no mask for them
GROUPED = {"kernel": "tokamax_chunked"}  # grouped k/v: the Pallas TPU kernels take as many k/v heads as q heads


def bert(folder):
    from family_fixtures import save_checkpoint, spread_norms_and_biases, tiny_model

    model = tiny_model("BertModel", num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return save_checkpoint(spread_norms_and_biases(model), folder), PALLAS


def modernbert(folder):
    from family_fixtures import save_checkpoint, spread_norms_and_biases, tiny_model
    from sparse_head_test import FAMILIES as MASKED_LM

    settings = MASKED_LM["modernbert"][1]  # 4 layers, local windows of ±4 every other layer
    model = tiny_model("ModernBertModel", num_attention_heads=4, **settings)
    return save_checkpoint(spread_norms_and_biases(model), folder), SPLASH


def qwen3(folder):
    from family_fixtures import save_checkpoint
    from family_qwen3_test import random_decoder

    return save_checkpoint(random_decoder("qwen3"), folder), GROUPED  # 4 query heads over 2 k/v heads


def gemma3(folder):
    from family_fixtures import save_checkpoint
    from family_gemma3_test import random_gemma3

    return save_checkpoint(random_gemma3(bidirectional=True), folder), GROUPED  # one k/v head, sliding layers


def deberta(folder):
    from family_deberta_test import V3
    from family_fixtures import save_checkpoint, spread_norms_and_biases, tiny_model

    model = tiny_model(
        "DebertaV2Model",
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=128,
        layer_norm_eps=1e-7,
        **V3,
    )
    return save_checkpoint(spread_norms_and_biases(model), folder), None  # no flash kernel takes relative positions


def splade(folder):
    from sparse_head_test import sparse_checkpoint

    return sparse_checkpoint(folder, "bert"), PALLAS  # 2 heads: model axes of 1 and 2


FAMILIES = {f.__name__: f for f in (bert, modernbert, qwen3, gemma3, deberta, splade)}


def windows(vocab: int):
    from docbeam.pipeline.records import TokenWindow

    rng = np.random.default_rng(0)
    high = min(vocab, 30522) - 2
    return [
        TokenWindow(f"d{i}", 0, 1, rng.integers(1, high, n).astype(np.int32), n, False) for i, n in enumerate(LENGTHS)
    ]


def batches(vocab: int):
    """The windows unpacked (8 rows of the bucket), and packed (up to two to a row, 5 rows)."""
    from docbeam.pipeline.stages.packer import packed_batch, padded_batch

    ws = windows(vocab)
    packed_rows = [[ws[0], ws[4]], [ws[1]], [ws[2], ws[5]], [ws[3]], [ws[6]]]
    return {"unpacked": padded_batch(ws, BUCKET, 8), "packed": packed_batch(packed_rows, BUCKET, 5)}


def flat(vectors) -> np.ndarray:
    """A head's window outputs as rows of float64: vectors as they are, multi-vector lists concatenated."""
    if isinstance(vectors, list):
        return np.stack([np.asarray(v, np.float64).ravel() for v in vectors])
    return np.asarray(vectors, np.float64).reshape(len(vectors), -1)


def lowest_cosine(a, b) -> float:
    a, b = flat(a), flat(b)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def run(family: str, folder: str) -> dict:
    import jax

    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.config import ModelConfig
    from docbeam.models import checkpoint
    from docbeam.models.heads.registry import resolve
    from docbeam.models.mesh import MeshShape, per_device_bytes
    from docbeam.pipeline.stages.encode import load_encoder

    folder, flash = FAMILIES[family](folder)
    ck = checkpoint.open_checkpoint(folder)
    head = resolve(ck, "auto", ModelConfig(path=folder))
    backends = {"native": {"backend": "native"}, "chunked": {"backend": "chunked"}}
    if flash:
        backends["flash"] = {"backend": "flash", "flash": flash}
    out = {"devices": len(jax.devices()), "cosines": {}, "kernels": {}, "param_bytes": {}}
    for packing, batch in batches(ck.config.vocab_size).items():
        packed = packing == "packed"
        for name, section in backends.items():
            attention = AttentionConfig.model_validate(section)
            reference = None
            for shape in ((1, 1), *(m for m in MESHES if ck.config.num_heads % m[1] == 0)):
                spec = standalone_spec(
                    folder, "float32", head.pooling, attention, (BUCKET,), packed, head=head, mesh=MeshShape(*shape)
                )
                runtime = load_encoder(spec)
                vectors, timing = runtime.encode(batch)
                assert timing["mesh"] == {"data": shape[0], "model": shape[1]}, timing["mesh"]
                if reference is None:
                    reference = vectors
                    continue
                key = f"{packing} {name} {shape[0]}x{shape[1]}"
                out["cosines"][key] = lowest_cosine(vectors, reference)
                out["kernels"][key] = timing["attention_kernel"] or timing["attention_backend"]
                if packing == "unpacked" and name == "native":
                    out["param_bytes"][f"{shape[0]}x{shape[1]}"] = {
                        "compiled": compiled_argument_bytes(runtime, batch),
                        "planned": per_device_bytes(runtime.params, shape[1]),
                        "total": per_device_bytes(runtime.params, 1),
                    }
    return out


def compiled_argument_bytes(runtime, batch) -> int:
    """What XLA's memory analysis of the compiled forward says each chip receives (parameters and the batch)."""
    from docbeam.models.runtime import compile_shape

    executable, _ = compile_shape(runtime, runtime.choices[batch.bucket_len].backend, batch.ids_BxT.shape)
    return int(executable.memory_analysis().argument_size_in_bytes)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
