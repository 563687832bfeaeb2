"""What ``docbeam report`` shows of a deduplicated run (summary.json's ``dedup`` record): the marks by method, the
histogram of each document's closest similarity, and the sweep, how many documents each eps or threshold would
mark, which NeMo Curator advises reading before choosing eps."""

from __future__ import annotations

BAR = 40  # characters of the longest histogram bar


def _bars(counts: dict) -> list[list]:
    top = max(counts.values(), default=0) or 1
    return [[low, n, "█" * max(1, round(BAR * n / top)) if n else ""] for low, n in sorted(counts.items())]


def tables(record: dict) -> list[tuple[str, list[str], list[list], str]]:
    marked = record.get("marked") or {}
    against = record.get("against") or {}
    settings = record.get("settings") or {}
    rows = [[kind, n] for kind, n in marked.items()]
    rows += [
        ["kept", record.get("kept", 0)],
        ["earlier runs' kept documents compared", record.get("earlier_compared", 0)],
    ]
    out = [
        (
            "Deduplication",
            ["documents", "count"],
            rows,
            f"Methods: {', '.join(k for k in ('exact', 'near', 'semantic') if settings.get(k))}. "
            + (f"Against run {against['run_id']}'s kept documents. " if against.get("files") else "")
            + (against.get("reason") or "")
            + " Marked documents keep their rows; duplicates/ names each one's kept original.",
        )
    ]
    histogram, sweep = record.get("histogram") or {}, record.get("sweep") or {}
    if histogram.get("near"):
        out.append(
            (
                "Near duplicates: closest candidate's estimated Jaccard",
                ["from", "documents", ""],
                _bars(histogram["near"]),
                "Each document with an LSH candidate before it, by the estimated Jaccard of the closest one; "
                "documents without a candidate are not counted (the bands' S-curve finds few pairs below about "
                f"{_s_curve_middle(settings.get('near') or {}):.2f}).",
            )
        )
    if histogram.get("semantic"):
        out.append(
            (
                "Semantic duplicates: greatest cosine to a document before it in its cluster",
                ["from", "documents", ""],
                _bars(histogram["semantic"]),
                "SemDeDup's measure, against any document before it (kept or not).",
            )
        )
    for method, unit, chosen in (
        ("near", "threshold", (settings.get("near") or {}).get("threshold")),
        ("semantic", "eps", (settings.get("semantic") or {}).get("eps")),
    ):
        if sweep.get(method) is not None:
            out.append(
                (
                    f"Sweep: documents each {unit} would mark ({method})",
                    [unit, "documents"],
                    [
                        [f"{value}{' (this run)' if float(value) == chosen else ''}", n]
                        for value, n in sweep[method].items()
                    ],
                    f"Counted from the histogram's measure; this run's {unit} marked {marked.get(method, 0)} "
                    "(a document is marked only against a kept one, so fewer than its sweep count can be).",
                )
            )
    return out


def _s_curve_middle(near: dict) -> float:
    bands, rows = near.get("bands", 14), near.get("rows", 8)
    return (1 / bands) ** (1 / rows)
