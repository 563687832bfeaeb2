"""The README performance table's figures from benchmarks/results/precision.json."""
from __future__ import annotations


def precision_figure(side: str, field: str):
    """benchmarks/readme.py's figure for one precision of benchmarks/precision.py's results: its speed over float32's
    (``field`` "float32") or ONNX Runtime int8's ("onnx int8"), or its recall@10 ("recall")."""
    def figure(r):
        sides = {x["side"]: x for x in r["sides"]}
        this, f32, ort = sides[side], sides["docbeam float32"], sides["onnxruntime int8"]
        if field == "recall":
            return this["gate"]["recall_at_10"], f"lowest cosine {this['gate']['lowest_cosine']:.5f}, {r['docs']} documents"
        base = f32 if field == "float32" else ort
        return (this["tokens_per_s"] / base["tokens_per_s"],
                f"{this['tokens_per_s']:,.0f} vs {base['tokens_per_s']:,.0f} tokens/s; float32 {f32['tokens_per_s']:,.0f}, "
                f"int8 {sides['docbeam int8']['tokens_per_s']:,.0f}, ONNX Runtime float32 "
                f"{sides['onnxruntime float32']['tokens_per_s']:,.0f} and int8 {ort['tokens_per_s']:,.0f}")
    return figure
