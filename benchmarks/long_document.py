"""Long documents, whole model: one document of T tokens through a model shape with random weights (float32
checkpoint, mean pooling) in docbeam and in sentence-transformers (torch, SDPA attention), side by side at 4k, 8k
and 16k. ``--shape``:

- ``modernbert-base`` (answerdotai/ModernBERT-base): hidden 768, 22 layers of 12 heads x 64, a global layer every
  third and ±64-token local windows in the rest;
- ``qwen3-0.6b`` (Qwen/Qwen3-0.6B, as Qwen3-Embedding-0.6B runs it): hidden 1024, 28 causal layers of 16 query heads
  over 8 key/value heads of 128, SwiGLU 3072. Its vocabulary is all-MiniLM-L6-v2's 30,522 (the tokenizer both
  sides use) instead of 151,669: the embedding table is a lookup, no FLOPs, so only the load differs.

    python benchmarks/long_document.py [--quick] [--shape modernbert-base] [--lengths 4096,8192,16384]
                                       [--dtypes float32,bfloat16] [--backend chunked] [--repeats 2] [--name N]

Each (side, length) runs in its own subprocess under an address-space cap (benchmarks/long_context.py's
``spawn``), so its peak memory is its own: the child's peak RSS growth once the model is loaded and the document
tokenized (docbeam's compilation included). docbeam encodes the document as one window (one row of a bucket of
T, ``attention.backend`` chunked by default: local layers scan only the keys their window reaches, causal ones
stop at the diagonal); torch computes full attention in ModernBERT's every layer (it masks the local layers) and
SDPA's causal kernel in Qwen3's. Time: the best of ``--repeats`` passes after a warm-up pass. Useful work: the
FLOPs a model that computes nothing masked needs (projections and MLP: 2 x params x T; attention: 4 x
query-key pairs x heads x head width per layer, pairs T², T x window, or T(T+1)/2 when causal), per second,
beside a float32 matmul's rate on this machine. The vectors are compared (cosine to docbeam float32).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common, long_context

QUICK_LENGTHS = (1024, 2048)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's shape as the FLOP count needs it; ``kind`` picks the transformers class that builds it."""

    kind: str  # modernbert | qwen3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    global_every: int = 1  # every n-th layer global, the rest local (ModernBERT); 1: all global
    window: int = 0  # a local layer's keys (ModernBERT's local_attention)
    causal: bool = False

    def params(self) -> int:
        """Parameters of the projections and MLP, per model (the gated MLP's in projection is two matrices)."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    def pairs(self, length: int, layer: int) -> int:
        """Query-key pairs the layer cannot skip."""
        if self.causal:
            return length * (length + 1) // 2
        if self.window and layer % self.global_every:
            return length * min(length, self.window + 1)
        return length * length


SHAPES = {
    "modernbert-base": Shape("modernbert", 768, 22, 12, 12, 64, 1152, global_every=3, window=128),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, causal=True),
}


def transformers_model(shape: Shape, max_len: int):
    import transformers

    common_keys = dict(vocab_size=30522, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, intermediate_size=shape.intermediate,
                       max_position_embeddings=max_len, initializer_range=0.02)  # fmt: skip
    if shape.kind == "qwen3":
        config = transformers.Qwen3Config(
            **common_keys, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rope_theta=1000000.0,
            pad_token_id=0, bos_token_id=101, eos_token_id=102, tie_word_embeddings=True,
        )  # fmt: skip
        return transformers.Qwen3Model(config)
    config = transformers.ModernBertConfig(
        **common_keys, global_attn_every_n_layers=shape.global_every, local_attention=shape.window,
        pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102,
    )  # fmt: skip
    return transformers.ModernBertModel(config)


def make_checkpoint(folder: str, max_len: int, shape: Shape) -> str:
    """The shape with random weights (std 0.02) and all-MiniLM-L6-v2's tokenizer, as sentence-transformers saves
    it (Transformer + mean Pooling), so both sides load the same folder."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    from docbeam.models.checkpoint import resolve_dir

    tokenizer = resolve_dir(common.DEFAULT_MODEL)
    torch.manual_seed(0)
    transformers_model(shape, max_len).eval().save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copy(os.path.join(tokenizer, name), folder)
    word = models.Transformer(folder, max_seq_length=max_len)
    SentenceTransformer(modules=[word, models.Pooling(shape.hidden, "mean")], device="cpu").save(folder)
    return folder


def document_text(length: int) -> str:
    """Sample documents joined until the text has at least ``length`` tokens (cut to it by both sides)."""
    docs = common.read_documents(common.SAMPLE, None)
    text = " ".join(d.text for d in docs)
    return text[: length * 8]  # MiniLM's WordPiece: well over one character a token on this corpus


def useful_flops(shape: Shape, length: int) -> float:
    pairs = sum(shape.pairs(length, layer) for layer in range(shape.layers))
    return 2 * shape.params() * length + 4 * pairs * shape.heads * shape.head_dim


def run_docbeam(case: dict) -> dict:
    import numpy as np

    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.config import BatchingConfig, TokenizeConfig
    from docbeam.models.checkpoint import load_tokenizer
    from docbeam.pipeline.records import Document
    from docbeam.pipeline.stages.encode import load_encoder
    from docbeam.pipeline.stages.packer import batch_windows
    from docbeam.pipeline.stages.tokenize import windows_for

    length, folder = case["length"], case["folder"]
    doc = Document("long", document_text(length), "long.txt", None)
    tokenize = TokenizeConfig(long_documents="truncate", stride=0)
    windows = windows_for([doc], load_tokenizer(folder), window_len=length, config=tokenize)
    (batch,) = batch_windows(windows, BatchingConfig(buckets=(length,), tokens_per_batch=length, packing=False))
    spec = standalone_spec(
        model_path=folder, dtype=case["dtype"], pooling="mean", buckets=(length,), packing=False,
        attention=AttentionConfig(backend=case["backend"]),
    )  # fmt: skip
    runtime = load_encoder(spec)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    runtime.encode(batch)  # compile and warm
    times = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        vector = np.asarray(runtime.encode(batch)[0][0], np.float64)
        times.append(time.perf_counter() - t0)
    return finish(case, batch.real_tokens, times, before, vector)


def run_torch(case: dict) -> dict:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = SentenceTransformer(case["folder"], device="cpu", model_kwargs={"attn_implementation": "sdpa"})
    model.max_seq_length = case["length"]
    text = document_text(case["length"])
    tokens = len(model.tokenize([text])["input_ids"][0])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.encode([text], batch_size=1)
    times = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        vector = np.asarray(model.encode([text], batch_size=1)[0], np.float64)
        times.append(time.perf_counter() - t0)
    return finish(case, tokens, times, before, vector)


def finish(case: dict, tokens: int, times: list[float], rss_before_kb: int, vector) -> dict:
    import numpy as np

    path = os.path.join(case["work"], f"{case['side']}-{case['length']}.npy")
    np.save(path, vector)
    best = min(times)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 2**20
    return {**{k: case[k] for k in ("side", "length")}, "tokens": tokens, "seconds": times, "best_s": best,
            "tokens_per_s": tokens / best, "useful_gflops": useful_flops(SHAPES[case["shape"]], tokens) / best / 1e9,
            "peak_rss_growth_gb": round(peak, 3), "vector": path, "status": "ok"}  # fmt: skip


def matmul_rate(shape: Shape) -> float:
    """GFLOP/s of a float32 [4096, hidden] x [hidden, intermediate] matmul, jitted, best of 20 (the machine's
    reference)."""
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((4096, shape.hidden), jnp.float32), jnp.ones((shape.hidden, shape.intermediate), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = min(timed(lambda: f(a, b).block_until_ready()) for _ in range(20))
    return 2 * 4096 * shape.hidden * shape.intermediate / best / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import numpy as np

    p = common.parser(__doc__)
    p.add_argument("--shape", default="modernbert-base", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--dtypes", default="float32", help="docbeam's model.dtype values (torch runs float32)")
    p.add_argument("--backend", default="chunked")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cap-gb", type=float, default=16.0)
    p.add_argument("--name", help="results file name (default: long_document, or long_document-<shape>)")
    p.add_argument("--child", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.child:
        case = json.loads(args.child)
        print(json.dumps(run_docbeam(case) if case["side"].startswith("docbeam") else run_torch(case)), flush=True)
        return 0
    lengths = QUICK_LENGTHS if args.quick else tuple(int(n) for n in args.lengths.split(","))
    repeats = 1 if args.quick else args.repeats
    info = common.machine()
    common.print_machine("long documents, whole model: docbeam vs sentence-transformers", info)
    work = tempfile.mkdtemp(prefix="docbeam-long-document-")
    shape = SHAPES[args.shape]
    folder = make_checkpoint(os.path.join(work, "model"), max(lengths), shape)
    sides = [f"docbeam {d}" for d in args.dtypes.split(",")] + ["sentence-transformers float32"]
    results = []
    for length in lengths:
        for side in sides:
            case = {"side": side, "length": length, "folder": folder, "work": work, "repeats": repeats,
                    "backend": args.backend, "dtype": side.split()[-1], "shape": args.shape}  # fmt: skip
            ran = long_context.spawn(case, args.cap_gb, timeout=3600, script=__file__, native_gb=lambda n: 0)
            results.append({"side": side, "length": length, **ran})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "vector"}), flush=True)
    rate = matmul_rate(shape)
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append([r["side"], r["length"], None, None, None, None, r.get("status"), None])
            continue
        st = next((x for x in results if x["length"] == r["length"] and x["side"].startswith("sentence")), None)
        ref = next((x for x in results if x["length"] == r["length"] and x["side"] == "docbeam float32"), None)
        cosine = None
        if ref and ref.get("status") == "ok":
            a, b = np.load(r["vector"]), np.load(ref["vector"])
            cosine = r["cosine_to_docbeam_float32"] = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        speedup = common.ratio(r["tokens_per_s"], st["tokens_per_s"]) if st and st.get("status") == "ok" else None
        rows.append([r["side"], r["tokens"], r["best_s"], r["tokens_per_s"], speedup, r["peak_rss_growth_gb"],
                     f"{r['useful_gflops']:.0f} ({r['useful_gflops'] / rate:.0%})", cosine])  # fmt: skip
    print(
        f"\n## {args.shape}\n\nfloat32 matmul [4096, {shape.hidden}] x [{shape.hidden}, {shape.intermediate}]: {rate:.0f} GFLOP/s\n"
    )
    print(common.table(["side", "tokens", "best s", "tokens/s", "÷ sentence-transformers", "peak RSS growth GB",
                        "useful GFLOP/s (of the matmul rate)", "cosine to docbeam float32"], rows))  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    for r in results:
        r.pop("vector", None)
    name = args.name or ("long_document" if args.shape == "modernbert-base" else f"long_document-{args.shape}")
    common.write_results(args, name, {"machine": info, "shape": args.shape, "lengths": list(lengths),
                                      "backend": args.backend, "matmul_gflops": rate, "results": results})  # fmt: skip
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
