"""Writes synthetic but realistic docbeam runs (timing/, errors/, summary.json, _manifest.json) for the report
tests: a busy run, and runs in which no batch ran."""

from __future__ import annotations

import datetime
import json
import pathlib

import numpy as np

BUCKETS = {32: 90, 64: 100, 128: 70, 256: 40}  # bucket_len -> batches, split over two workers
WORKERS = ("host-a:101", "host-b:202")
RECOMPILE_AT = (WORKERS[0], 128, 46)  # worker, bucket, index of the bucket's batch that recompiles
ERRORS = [
    ("malformed_json", "Expecting value: line 1 column 1 (char 0)"),
    ("missing_text", "no 'text' field"),
    ("empty_text", "'text' is empty"),
    ("duplicate_id", "id doc-17 already seen"),
    ("duplicate_id", "id doc-42 already seen"),
    ("invalid_utf8", "byte 0xff at offset 12"),
]


def write_run(
    root: pathlib.Path,
    *,
    seed: int = 0,
    slowdown: dict[int, float] | float = 1.0,
    extra_errors: int = 0,
    extra_fallbacks: int = 0,
    with_errors: bool = True,
    error_source: str = "gs://docs/in/part-3.jsonl",
    run_id: str | None = None,
) -> str:
    """Four buckets, ~300 batches, one recompilation, six rejects. ``slowdown`` scales compute_ms (per
    bucket or everywhere); ``extra_fallbacks`` turns that many bucket-256 batches into chunked fallbacks;
    ``run_id`` names the shards after the run and commits them in ``_manifest.json``."""
    rng = np.random.default_rng(seed)
    start = datetime.datetime(2026, 5, 1, 12, 0, tzinfo=datetime.timezone.utc)
    records = []
    for w, worker in enumerate(WORKERS):
        clock_ms, peak = 1500.0 * w, 0
        plan = [(bucket, i) for bucket, n in BUCKETS.items() for i in range(w, n, 2)]
        rng.shuffle(plan)
        seen = set()
        fallbacks_left = extra_fallbacks if w == 0 else 0
        for bucket, i in plan:
            rows = min(64, 8192 // bucket)
            real_rows = rows if i < BUCKETS[bucket] - 2 else int(rng.integers(1, rows))
            backend, reason = ("native", "flash needs bucket_len >= 64") if bucket == 32 else ("flash", None)
            if bucket == 256 and fallbacks_left:
                backend, reason, fallbacks_left = "chunked", "flash block_q=512 exceeds VMEM", fallbacks_left - 1
            compiled = (bucket, rows, backend) not in seen or (worker, bucket, i) == RECOMPILE_AT
            seen.add((bucket, rows, backend))
            factor = slowdown.get(bucket, 1.0) if isinstance(slowdown, dict) else slowdown
            compute_ms = 0.002 * rows * bucket * (1 + bucket / 512) * rng.lognormal(0, 0.08) * factor
            compute_ms += rng.uniform(800, 2000) if compiled else 0.0
            real_tokens = int(real_rows * bucket * rng.uniform(0.55, 0.95))
            in_use = 350 * 2**20 + rows * bucket * 768 * 4 * 6 + int(rng.integers(0, 40 * 2**20))
            peak = max(peak, in_use + rows * bucket * 768 * 4 * 3)
            records.append(
                {
                    "batch_id": f"{worker}/{bucket}/{i}",
                    "bucket_len": bucket,
                    "rows": rows,
                    "real_rows": real_rows,
                    "real_tokens": real_tokens,
                    "padded_tokens": rows * bucket,
                    "attention_backend": backend,
                    "attention_requested": "flash",
                    "fallback_reason": reason,
                    "compiled": compiled,
                    "compute_ms": compute_ms,
                    "total_ms": compute_ms + rng.uniform(1, 3),
                    "device": f"cpu:{w} (TFRT_CPU_{w})",
                    "worker": worker,
                    "started_at": (start + datetime.timedelta(milliseconds=clock_ms)).isoformat(
                        timespec="microseconds"
                    ),
                    "memory_in_use_bytes": in_use,
                    "memory_peak_bytes": peak,
                    "memory_source": "device",
                }
            )
            clock_ms += compute_ms + rng.uniform(0.5, 4)
    errors = [
        {
            "source": error_source,
            "line": 10 + n,
            "id": None if kind == "malformed_json" else f"doc-{n}",
            "kind": kind,
            "reason": reason,
        }
        for n, (kind, reason) in enumerate(ERRORS + [("empty_text", "'text' is empty")] * extra_errors)
    ]
    files = _write_jsonl(root / "timing", records, shards=2, run_id=run_id)
    if with_errors:
        files += _write_jsonl(root / "errors", errors, shards=1, run_id=run_id)
    real, padded = sum(r["real_tokens"] for r in records), sum(r["padded_tokens"] for r in records)
    embedded = sum(r["real_rows"] for r in records)
    wall = max(r["compute_ms"] for r in records) / 1e3 + 30.0
    backends, fallbacks = {}, {}
    for r in records:
        backends[r["attention_backend"]] = backends.get(r["attention_backend"], 0) + 1
        if r["fallback_reason"]:
            key = f"flash->{r['attention_backend']}: {r['fallback_reason']}"
            fallbacks[key] = fallbacks.get(key, 0) + 1
    kinds = {}
    for e in errors:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    compute = [r["compute_ms"] for r in records]
    summary = {
        "docs_read": embedded + len(errors),
        "docs_embedded": embedded,
        "docs_rejected": len(errors),
        "windows": embedded,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded,
        "batches": len(records),
        "wall_seconds": wall,
        "docs_per_second": embedded / wall,
        "tokens_per_second": real / wall,
        "attention_backends": backends,
        "fallbacks": fallbacks,
        "rejected_by_kind": kinds,
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "config_digest": "3f9a1c0d",
        "versions": {"jax": "0.10.2", "flax": "0.12.8", "apache-beam": "2.77.0"},
        "attention_plan": {
            str(b): {
                "backend": "native" if b == 32 else "flash",
                "kernel": "xla" if b == 32 else "pallas_mosaic_tpu",
                "fallback_reason": "flash needs bucket_len >= 64" if b == 32 else None,
            }
            for b in BUCKETS
        },
        "buckets": {
            str(b): {
                "batches": sum(r["bucket_len"] == b for r in records),
                "real_tokens": sum(r["real_tokens"] for r in records if r["bucket_len"] == b),
                "padded_tokens": sum(r["padded_tokens"] for r in records if r["bucket_len"] == b),
            }
            for b in BUCKETS
        },
        "started_at": start.isoformat(),
        "finished_at": (start + datetime.timedelta(seconds=wall)).isoformat(),
        "metrics": {
            "counters": {"docs_read": embedded + len(errors), "batches_encoded": len(records)},
            "distributions": {
                "compute_ms": {
                    "count": len(compute),
                    "sum": sum(compute),
                    "min": min(compute),
                    "max": max(compute),
                    "mean": sum(compute) / len(compute),
                }
            },
        },
    }
    return _finish(root, summary, files, run_id)


def write_empty_run(root: pathlib.Path, *, rejected: tuple[str, ...] = (), run_id: str | None = None) -> str:
    """A completed run in which no batch ran, as the job writes it: every document ``rejected`` (one per
    kind listed) or, with none, an empty input. Beam still writes one empty shard per output."""
    errors = [
        {"source": "in.jsonl", "line": n + 1, "id": f"d{n}", "kind": kind, "reason": f"{kind} reason"}
        for n, kind in enumerate(rejected)
    ]
    files = _write_jsonl(root / "timing", [], shards=1, run_id=run_id)
    files += _write_jsonl(root / "errors", errors, shards=1, run_id=run_id)
    kinds = {k: rejected.count(k) for k in sorted(set(rejected))}
    summary = {
        "docs_read": len(errors),
        "docs_embedded": 0,
        "docs_rejected": len(errors),
        "windows": 0,
        "real_tokens": 0,
        "padded_tokens": 0,
        "padding_efficiency": None,
        "batches": 0,
        "compiles": 0,
        "wall_seconds": 4.2,
        "docs_per_second": 0.0,
        "tokens_per_second": 0.0,
        "attention_requested": "native",
        "attention_backends": {},
        "fallbacks": {},
        "rejected_by_kind": kinds,
        "buckets": {},
        "attention_plan": {"48": {"backend": "native", "kernel": "xla", "fallback_reason": None}},
        "model": "tiny",
        "versions": {"jax": "0.10.2"},
        "metrics": {"counters": {"docs_read": len(errors)}},
    }
    return _finish(root, summary, files, run_id)


def _finish(root: pathlib.Path, summary: dict, files: list[pathlib.Path], run_id: str | None) -> str:
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    if run_id:
        manifest = {
            "format": "docbeam.manifest/1",
            "run_id": run_id,
            "files": [{"path": f.relative_to(root).as_posix(), "size": f.stat().st_size} for f in files],
        }
        (root / "_manifest.json").write_text(json.dumps(manifest, indent=2))
    return str(root)


def _write_jsonl(
    directory: pathlib.Path, records: list[dict], shards: int, run_id: str | None = None
) -> list[pathlib.Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        lines = "".join(json.dumps(r) + "\n" for r in records[shard::shards])
        path = directory / f"part-{run_id + '-' if run_id else ''}{shard:05d}-of-{shards:05d}.jsonl"
        path.write_text(lines)
        paths.append(path)
    return paths
