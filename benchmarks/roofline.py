"""A roofline, not a measurement: tokens/s per chip and per dollar that docbeam's forward could reach on TPU v5e
(one chip, eight) and two NVIDIA L4s, for a MiniLM-class and a Qwen3-Embedding-8B-shaped model, from each
chip's published bfloat16 rate and memory bandwidth and the model's FLOPs and bytes per token. It is the
ceiling a real run on those chips is to be held to later (no run on them has happened: no chip here).

    python benchmarks/roofline.py [--tokens-per-chip 2048] [--seq 256]

Per token, for a batch of ``--tokens-per-chip`` tokens per chip in rows of ``--seq``:
- FLOPs: 2 per parameter of every projection (embeddings are a lookup), plus attention's scores and weighted sum,
  4 · layers · seq · (heads · head_dim);
- bytes from memory: the chip's share of the weights once per batch (÷ tokens in it), plus the activations each
  layer reads and writes: 2 bytes (bfloat16) · layers · (12 · hidden + 3 · intermediate ÷ model axis);
- tokens/s = chips · min(peak FLOP/s ÷ FLOPs per token, bandwidth ÷ bytes per token), a mesh's collectives not
  counted (on a model axis, two all-reduces of [tokens, hidden] per layer over the chips' interconnect).
Parameter counts are the families' own (``jax.eval_shape`` of their init: models/memory_plan.py), from the
packaged all-MiniLM-L6-v2 and data/shapes/qwen3-embedding-8b/config.json. Chip figures are in CHIPS below
with their sources; a worker's price per hour is pipeline/telemetry/cost.py's (what summary.json's cost uses).
"""

from __future__ import annotations

import sys

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from docbeam.pipeline.telemetry.cost import PRICES

QWEN3_8B = f"{common.REPO}/data/shapes/qwen3-embedding-8b"
# peak dense bf16 FLOP/s, memory bytes/s, memory bytes. A worker's price per hour is the one summary.json's cost uses
# (pipeline/telemetry/cost.py PRICES: Dataflow's rates, dated, with their sources).
CHIPS = {
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s HBM, 16 GB
    "TPU v5e": {"flops": 197e12, "bandwidth": 819e9, "memory": 16e9},
    # https://www.nvidia.com/en-us/data-center/l4/: 121 TFLOP/s bf16 dense (242 with sparsity), 300 GB/s, 24 GB
    "NVIDIA L4": {"flops": 121e12, "bandwidth": 300e9, "memory": 24e9},
}
WORKERS = (  # (label, machine type, chip, chips per worker, mesh for MiniLM, mesh for Qwen3-8B or None: cannot fit)
    ("v5e-1 (ct5lp-hightpu-1t)", "ct5lp-hightpu-1t", "TPU v5e", 1, (1, 1), None),
    ("v5e-8 (ct5lp-hightpu-8t)", "ct5lp-hightpu-8t", "TPU v5e", 8, (8, 1), (2, 4)),
    ("2x L4 (g2-standard-24)", "g2-standard-24", "NVIDIA L4", 2, (2, 1), (1, 2)),
)
# Text Embeddings Inference's published figure on one L4 for bge-small-en-v1.5 (12 layers of 384: twice
# MiniLM-L6's depth), the bar the issue holds docbeam to.
TEI_L4_BGE_SMALL = 894_000


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--tokens-per-chip", type=int, default=2048, help="tokens per chip per batch (default 2048)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--qwen-seq", type=int, default=2048, help="tokens per row for Qwen3-8B (default 2048)")
    return p.parse_args(argv)


def shape(path: str) -> dict:
    import jax

    from docbeam.models.checkpoint import encoder_config, open_checkpoint
    from docbeam.models.memory_plan import abstract_params

    config = (
        encoder_config(path, "bfloat16", None) if path.startswith("/") else open_checkpoint(path, "bfloat16").config
    )
    params = abstract_params(config)
    embedding = sum(
        x.size for p, x in jax.tree_util.tree_leaves_with_path(params) if "embed" in jax.tree_util.keystr(p)
    )
    head_dim, _ = config.attention_shape(config.attention_features[0])
    return {
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
        "projection_parameters": int(sum(x.size for x in jax.tree.leaves(params)) - embedding),
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "attention_width": config.num_heads * head_dim,
    }


def per_token(model: dict, seq: int, tokens_per_chip: int, model_axis: int) -> tuple[float, float]:
    """(FLOPs, bytes read and written) per token on one chip."""
    flops = (
        2 * model["projection_parameters"] / model_axis
        + 4 * model["layers"] * seq * model["attention_width"] / model_axis
    )
    weights = 2 * model["projection_parameters"] / model_axis / tokens_per_chip
    activations = 2 * model["layers"] * (12 * model["hidden"] + 3 * model["intermediate"] / model_axis)
    return flops, weights + activations


def roofline(
    model: dict, chip: dict, chips: int, mesh: tuple[int, int], seq: int, tokens_per_chip: int, usd_per_hour: float
) -> dict:
    data, model_axis = mesh
    flops, nbytes = per_token(model, seq, tokens_per_chip, model_axis)
    per_group = min(chip["flops"] / flops, chip["bandwidth"] / nbytes)  # one group of model_axis chips
    tokens_s = per_group * (chips // model_axis)
    return {
        "mesh": {"data": data, "model": model_axis},
        "flops_per_token": flops * model_axis,
        "bound": "compute" if chip["flops"] / flops <= chip["bandwidth"] / nbytes else "memory",
        "tokens_per_second": tokens_s,
        "tokens_per_second_per_chip": tokens_s / chips,
        "million_tokens_per_dollar": tokens_s * 3600 / usd_per_hour / 1e6,
        "usd_per_worker_hour": usd_per_hour,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    models = {"MiniLM-L6 (all-MiniLM-L6-v2)": shape(common.DEFAULT_MODEL), "Qwen3-Embedding-8B shape": shape(QWEN3_8B)}
    rows, results = [], []
    for name, model in models.items():
        big = "Qwen3" in name
        seq = args.qwen_seq if big else args.seq
        for label, machine_type, chip_name, chips, small_mesh, big_mesh in WORKERS:
            mesh = big_mesh if big else small_mesh
            if mesh is None:
                rows.append([name, label, "does not fit (15.25 GiB of parameters, 16 GB chip)", "", "", "", ""])
                results.append({"model": name, "worker": label, "fits": False})
                continue
            price = PRICES[machine_type].usd_per_hour
            r = roofline(model, CHIPS[chip_name], chips, mesh, seq, args.tokens_per_chip, price)
            results.append({"model": name, "worker": label, "fits": True, **r})
            rows.append(
                [
                    name,
                    label,
                    f"{{data: {mesh[0]}, model: {mesh[1]}}}",
                    f"{r['flops_per_token'] / 1e6:,.1f} M",
                    f"{r['tokens_per_second_per_chip']:,.0f} ({r['bound']})",
                    f"{r['tokens_per_second']:,.0f}",
                    f"{r['million_tokens_per_dollar']:,.0f}",
                ]
            )
    print(
        common.table(
            [
                "model",
                "worker",
                "mesh",
                "FLOPs per token",
                "roofline tokens/s per chip",
                "tokens/s per worker",
                "M tokens per $",
            ],
            rows,
        )
    )
    minilm_l4 = next(r for r in results if r["worker"].startswith("2x L4") and "MiniLM" in r["model"])
    share = TEI_L4_BGE_SMALL * 2 / minilm_l4["tokens_per_second_per_chip"]
    print(
        f"\nTEI's published L4 figure, bge-small (twice MiniLM-L6's layers): {TEI_L4_BGE_SMALL:,} tokens/s, "
        f"{share:.0%} of this roofline scaled to MiniLM-L6 (x2): a real run should reach about that share."
    )
    common.write_results(
        args,
        "roofline",
        {
            "machine": common.machine(with_jax=False),
            "source": "computed from published chip figures and the models' shapes: a roofline, not a measurement",
            "chips": CHIPS,
            "models": models,
            "settings": {"tokens_per_chip": args.tokens_per_chip, "seq": args.seq, "qwen_seq": args.qwen_seq},
            "rows": results,
            "tei_l4_bge_small_tokens_per_second": TEI_L4_BGE_SMALL,
            "tei_share_of_roofline_scaled_to_minilm": share,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
