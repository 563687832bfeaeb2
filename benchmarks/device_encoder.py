"""The device check's encoder part (benchmarks/device_check.py): docbeam's whole encoder in bfloat16 with
``flash`` attention, MiniLM-shaped and ModernBERT-base-shaped, beside sentence-transformers (torch SDPA) on the
same random weights, and both as a share of the chip's bfloat16 matmul rate measured in the same run.

Random weights of the real shapes, written by transformers as a checkpoint folder with a word-level tokenizer
(no Hub, no model package on the lent machine); both sides are handed token ids, so tokenizing is not timed."""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
from device_attention import best_seconds

# family: (transformers class, the shape's config, the small rehearsal's)
SHAPES = {
    "minilm": (
        "BertModel",
        {
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "vocab_size": 30522,
        },
    ),
    "modernbert_base": (
        "ModernBertModel",
        {
            "hidden_size": 768,
            "num_hidden_layers": 22,
            "num_attention_heads": 12,
            "intermediate_size": 1152,
            "vocab_size": 50368,
            "local_attention": 128,
            "global_attn_every_n_layers": 3,
        },
    ),
}
# The rehearsal's: the real vocabularies (ModernBERT's special ids sit at its end), everything else tiny.
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
SMALL_WINDOW = {"local_attention": 16, "global_attn_every_n_layers": 2}
LENGTHS, SMALL_LENGTHS = (1024, 8192), (64, 128)
TOKENS_PER_BATCH, SMALL_TOKENS_PER_BATCH = 16384, 512


def flops_per_token(config: dict, length: int) -> float:
    """Multiply-adds × 2 of one token through the layers (the embeddings and pooling are noise): the projections
    (Q, K, V, output: 4·D², the MLP: 2·D·I, or 3·D·I gated as ModernBERT's GeGLU) and attention's two
    products over the keys a token sees (all ``length``, or ModernBERT's local window on its local layers)."""
    d, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    gated = "local_attention" in config
    projections = 4 * d * d + (3 if gated else 2) * d * inner
    every = config.get("global_attn_every_n_layers", 1)
    local_keys = min(length, config.get("local_attention", length) + 1)
    keys = sum(length if layer % every == 0 else local_keys for layer in range(layers))
    return 2.0 * (layers * projections + 2 * d * keys)


def matmul_rate(small: bool) -> dict:
    """The chip's bfloat16 matmul rate here: an n×n by n×n product, float32 accumulation, best of a few."""
    import jax
    import jax.numpy as jnp

    n = 256 if small else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    seconds = best_seconds(lambda: product(a, a), repeats=10)
    return {"n": n, "seconds": seconds, "flops_per_s": 2.0 * n**3 / seconds}


def write_checkpoint(family: str, config: dict, folder: str) -> None:
    """transformers' own class of the family, seeded, saved as safetensors, with a word-level tokenizer over
    its vocabulary, so that sentence-transformers loads the folder as it would a Hub checkpoint."""
    import tokenizers
    import torch
    import transformers

    class_name = SHAPES[family][0]
    model_class = getattr(transformers, class_name)
    torch.manual_seed(0)
    model_class(model_class.config_class(max_position_embeddings=8192, **config)).save_pretrained(folder)
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, config["vocab_size"])}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "[PAD]",
                "unk_token": "[UNK]",
                "model_max_length": 8192,
            },
            f,
        )


def docbeam_side(folder: str, ids_BxT: np.ndarray) -> dict:
    """docbeam's encoder in bfloat16, ``flash`` attention, mean pooling: tokens/s and the kernel the plan picked
    for each kind of layer."""
    import jax

    from docbeam import attention
    from docbeam.attention.interface import current_platform
    from docbeam.models import checkpoint, encoder

    config = checkpoint.encoder_config(folder, "bfloat16")
    params = jax.device_put(checkpoint.load_params(folder, config))
    flash = attention.get("flash")
    options = flash.parse_options(None)
    kernels = sorted(
        {
            flash.supports(case, options).kernel or flash.supports(case, options).reason
            for case in encoder.attention_cases(config, [ids_BxT.shape[1]], current_platform())
        }
    )
    embed = jax.jit(encoder.embed_fn(config, flash.bind(options), "mean"))
    ids = jax.device_put(ids_BxT)
    lengths = jax.device_put(np.full(ids_BxT.shape[0], ids_BxT.shape[1], np.int32))
    seconds = best_seconds(lambda: embed(params, ids, lengths), repeats=5, within_s=5.0)
    return {"kernels": kernels, "seconds": seconds, "tokens_per_s": ids_BxT.size / seconds}


def sentence_transformers_side(folder: str, ids_BxT: np.ndarray) -> dict:
    """sentence-transformers on the folder (its Transformer and mean Pooling), bfloat16, torch SDPA, on CUDA
    where torch sees it: tokens/s of its forward on the same ids."""
    import sentence_transformers
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = sentence_transformers.SentenceTransformer(
        folder, device=device, model_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    )
    features = {
        "input_ids": torch.tensor(ids_BxT, dtype=torch.long, device=device),
        "attention_mask": torch.ones(ids_BxT.shape, dtype=torch.long, device=device),
    }

    class Synced:  # best_seconds waits on the result as it waits on JAX's
        def block_until_ready(self):
            if device == "cuda":
                torch.cuda.synchronize()

    def forward():
        with torch.inference_mode():
            model.forward(dict(features))["sentence_embedding"]
        return Synced()

    seconds = best_seconds(forward, repeats=5, within_s=5.0)
    return {"device": device, "torch": torch.__version__, "seconds": seconds, "tokens_per_s": ids_BxT.size / seconds}


def run(small: bool, deadline: float, rate: dict, save=lambda rows: None) -> list[dict]:
    """Each shape × length: both sides, their tokens/s and share of ``rate`` (matmul_rate's), until ``deadline``;
    ``save(rows)`` after each row."""
    rows = []
    for family, (_, full_config) in SHAPES.items():
        config = full_config
        if small:
            config = {**full_config, **SMALL, **(SMALL_WINDOW if "local_attention" in full_config else {})}
        lengths = SMALL_LENGTHS if small else LENGTHS
        with tempfile.TemporaryDirectory() as folder:
            try:
                write_checkpoint(family, config, folder)
            except Exception as e:  # noqa: BLE001  (no checkpoint, no row of this shape: each says why)
                rows += [
                    {
                        "shape": family,
                        "length": length,
                        "error": f"writing the checkpoint: {type(e).__name__}: {str(e)[:400]}",
                    }
                    for length in lengths
                ]
                continue
            for length in lengths:
                row = {"shape": family, "length": length, "dtype": "bfloat16"}
                if time.time() > deadline:
                    rows.append({**row, "skipped": "the check's time budget ran out"})
                    continue
                batch = max(1, (SMALL_TOKENS_PER_BATCH if small else TOKENS_PER_BATCH) // length)
                ids = np.random.default_rng(0).integers(2, config["vocab_size"], (batch, length)).astype(np.int32)
                row.update(batch=batch, flops_per_token=flops_per_token(config, length))
                for side, measure in (("docbeam", docbeam_side), ("sentence_transformers", sentence_transformers_side)):
                    try:
                        row[side] = measure(folder, ids)
                        row[side]["share_of_matmul_rate"] = (
                            row[side]["tokens_per_s"] * row["flops_per_token"] / rate["flops_per_s"]
                        )
                    except Exception as e:  # noqa: BLE001  (a side that fails is a finding; the other still runs)
                        row[side] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                if "tokens_per_s" in row["docbeam"] and "tokens_per_s" in row["sentence_transformers"]:
                    row["docbeam_over_sentence_transformers"] = (
                        row["docbeam"]["tokens_per_s"] / row["sentence_transformers"]["tokens_per_s"]
                    )
                rows.append(row)
                save(rows)
    return rows
