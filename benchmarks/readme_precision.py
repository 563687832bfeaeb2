"""The README performance table's figures from benchmarks/results/precision.json."""

from __future__ import annotations


def precision_figure(side: str, field: str):
    """benchmarks/readme.py's figure for one precision of benchmarks/precision.py's results: its speed over float32's
    (``field`` "float32") or ONNX Runtime int8's ("onnx int8"), or its recall@10 ("recall")."""

    def figure(r):
        sides = {x["side"]: x for x in r["sides"]}
        this, f32, ort = sides[side], sides["docbeam float32"], sides["onnxruntime int8"]
        if field == "recall":
            return this["gate"][
                "recall_at_10"
            ], f"lowest cosine {this['gate']['lowest_cosine']:.5f}, {r['docs']} documents"
        base = f32 if field == "float32" else ort
        return (
            this["tokens_per_s"] / base["tokens_per_s"],
            f"{this['tokens_per_s']:,.0f} vs {base['tokens_per_s']:,.0f} tokens/s; float32 {f32['tokens_per_s']:,.0f}, "
            f"int8 {sides['docbeam int8']['tokens_per_s']:,.0f}, ONNX Runtime float32 "
            f"{sides['onnxruntime float32']['tokens_per_s']:,.0f} and int8 {ort['tokens_per_s']:,.0f}",
        )

    return figure


def engine_figure(dtype: str):
    """benchmarks/readme.py's figure for issue 51's target: docbeam with the engine it chooses (``runner.engine:
    auto``) over OpenVINO as sentence-transformers runs it, at the same precision; None where the run had no such
    pair (OpenVINO's bfloat16 is left out on a CPU that would emulate it)."""
    from docbeam.models.engines.openvino import PRECISION_HINTS

    hint = PRECISION_HINTS[dtype]

    def figure(r):
        sides = {x["side"]: x for x in r["sides"]}
        ours, theirs = sides.get(f"docbeam {dtype} auto"), sides.get(f"openvino {hint}")
        if ours is None or theirs is None:
            return None, f"this run has no docbeam {dtype} auto beside OpenVINO {hint}"
        return (
            ours["tokens_per_s"] / theirs["tokens_per_s"],
            f"{ours['tokens_per_s']:,.0f} vs {theirs['tokens_per_s']:,.0f} tokens/s; docbeam's engine per bucket: "
            f"{engines_ran(ours)}",
        )

    return figure


# In this order, each when the run had it: OpenVINO since 2026-12-05, docbeam's auto engine (runner.engine: auto,
# models/engines/) since 2026-12-07.
ORDER = (
    "docbeam float32",
    "docbeam float32 auto",
    "docbeam bfloat16",
    "docbeam bfloat16 auto",
    "docbeam int8",
    "onnxruntime float32",
    "onnxruntime int8",
    "openvino f32",
    "openvino bf16",
)
NAMES = {
    "onnxruntime": "ONNX Runtime",
    "openvino f32": "OpenVINO float32",
    "openvino bf16": "OpenVINO bfloat16",
    "docbeam float32 auto": "docbeam float32, engine auto",
    "docbeam bfloat16 auto": "docbeam bfloat16, engine auto",
}


def engines_ran(side: dict) -> str:
    """The engine that ran a docbeam side's batches, per bucket where they differ; — for the other runtimes."""
    ran = side.get("engines")
    if not ran:
        return "xla" if side["side"].startswith("docbeam") else "—"
    per_bucket = {}
    for key in ran:
        bucket, rest = key.split(" ", 1)
        per_bucket.setdefault(rest.split(":", 1)[0], []).append(bucket)
    if len(per_bucket) == 1:
        return next(iter(per_bucket))
    return "; ".join(f"{engine} ({', '.join(sorted(b, key=int))})" for engine, b in sorted(per_bucket.items()))


def display(side: str) -> str:
    return NAMES.get(side) or side.replace("onnxruntime", NAMES["onnxruntime"])


def precision_table(record: dict, link: str) -> str:
    """README's table of the five encoders side by side (benchmarks/precision.py's one run): speed, ratios,
    and the precision gate against docbeam float32, then the command, machine and results file behind them."""
    sides = {x["side"]: x for x in record["sides"]}
    f32, ort8 = sides["docbeam float32"]["tokens_per_s"], sides["onnxruntime int8"]["tokens_per_s"]
    columns = tuple(c for c in ORDER if c in sides)

    def gate(side, field, digits):
        g = sides[side].get("gate")
        return "reference" if g is None else f"{g[field]:.{digits}f}"

    def verdict(side):
        g = sides[side].get("gate")
        return "reference" if g is None else "passes" if g["passed"] else "**fails** " + "; ".join(g["failures"])

    rows = [
        ("tokens/s", lambda s: f"{sides[s]['tokens_per_s']:,.0f}"),
        ("engine that ran (bucket)", lambda s: engines_ran(sides[s])),
        ("÷ docbeam float32", lambda s: f"{sides[s]['tokens_per_s'] / f32:.2f}"),
        ("÷ ONNX Runtime int8", lambda s: f"{sides[s]['tokens_per_s'] / ort8:.2f}"),
        ("lowest cosine to docbeam float32", lambda s: gate(s, "lowest_cosine", 5)),
        ("recall@10 of docbeam float32's neighbours", lambda s: gate(s, "recall_at_10", 3)),
        ("precision gate (≥ 0.99 cosine, ≥ 0.98 recall@10)", verdict),
    ]
    count = {5: "five", 7: "seven", 8: "eight", 9: "nine"}.get(len(columns), str(len(columns)))
    out = [
        f"Reduced precision on CPU: {count} encoders of one model in one run, each against docbeam float32's vectors "
        "(the precision gate that `docbeam run` applies to `model.dtype`):",
        "",
        "| encoder (CPU) | " + " | ".join(map(display, columns)) + " |",
        "|---" * (1 + len(columns)) + "|",
    ]
    out += [f"| {what} | " + " | ".join(cell(s) for s in columns) + " |" for what, cell in rows]
    machine = record.get("machine", {})
    flags = ", ".join(machine.get("cpu_flags") or [])
    out += [
        "",
        f"`{record['command']}` ({machine.get('cpu_model', '?')}, {flags}, {machine.get('cpus_usable', '?')} "
        f"cores, {str(record.get('date', '?'))[:10]}, {record['docs']:,} held-out documents, {link})",
    ]
    return "\n".join(out)
