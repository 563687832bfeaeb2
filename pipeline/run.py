"""Build and run the job: read → tokenize → bucket → encode → pool → write, then summary.json.

The driver does the checks that must fail at start (config, checkpoint, buckets vs window length,
attention plan for every bucket) before any worker starts.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import time

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from models.checkpoint import open_checkpoint
from models.encoder import EncoderConfig
from pipeline import storage
from pipeline.bucket import BucketBatches, bucket_for
from pipeline.config import ConfigError, JobConfig
from attention.plan import AttentionSpec, plan
from pipeline.encode import Encode, EncoderSpec, attention_cases
from pipeline.read import ReadDocuments
from pipeline.tokenize import Tokenize
from pipeline.write import PoolDocuments, WriteOutputs

log = logging.getLogger(__name__)
OUTPUT_PARTS = ("embeddings", "timing", "errors", "profiles")
VERSIONED = ("docbeam", "apache-beam", "jax", "jaxlib", "flax", "transformers", "tokenizers", "tokamax", "numpy",
             "pyarrow")


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What the driver resolved from the config and the checkpoint before starting the job."""

    config: JobConfig
    window_len: int
    pooling: str
    normalize: bool
    platform: str
    choices: tuple  # attention.plan.Choice per bucket
    encoder: EncoderConfig

    def encoder_spec(self) -> EncoderSpec:
        cfg = self.config
        return EncoderSpec(
            model_path=cfg.model.path, dtype=cfg.model.dtype, pooling=self.pooling,
            buckets=tuple(c.case.seq_len for c in self.choices),
            attention=attention_spec(cfg), platform=self.platform, profile_batches=cfg.profile.batches,
            profile_dir=f"{cfg.output.path.rstrip('/')}/profiles", progress_seconds=cfg.runner.progress_seconds)


def attention_spec(cfg: JobConfig) -> AttentionSpec:
    a = cfg.attention
    return AttentionSpec(backend=a.backend, options=dict(a.options.get(a.backend) or {}), fallback=a.fallback,
                         fallback_options=dict(a.options.get(a.fallback) or {}) if a.fallback else {},
                         verify=a.verify, verify_tolerance=a.verify_tolerance, on_mismatch=a.on_mismatch)


def target_platform(cfg: JobConfig) -> str:
    if cfg.runner.device != "auto":
        return cfg.runner.device
    import jax

    return jax.default_backend()


def make_plan(cfg: JobConfig) -> JobPlan:
    """Everything that can fail before the job starts fails here, with the key to change."""
    storage.pipeline_options(cfg.runner.beam_args())  # gs:// checkpoints need FileSystems set up
    checkpoint = open_checkpoint(cfg.model.path, cfg.model.dtype)
    settings = checkpoint.settings
    window_len = cfg.model.max_seq_len or settings.max_seq_len
    if checkpoint.config.position == "absolute" and window_len > checkpoint.config.max_position:
        raise ConfigError(f"model.max_seq_len={window_len} exceeds the checkpoint's {checkpoint.config.max_position} "
                          "position embeddings; lower it or leave it unset")
    if cfg.batching.buckets[-1] < window_len:
        raise ConfigError(f"batching.buckets={list(cfg.batching.buckets)}: the largest bucket is below the model's "
                          f"window of {window_len} tokens; add {window_len} (or set model.max_seq_len lower)")
    special = 2  # [CLS] and [SEP] in every BERT-family window
    if cfg.tokenize.stride >= window_len - special:
        raise ConfigError(f"tokenize.stride={cfg.tokenize.stride} must be smaller than a window's content "
                          f"({window_len - special} tokens for window {window_len}); e.g. 32")
    pooling = settings.pooling if cfg.model.pooling == "auto" else cfg.model.pooling
    normalize = settings.normalize if cfg.model.normalize == "auto" else cfg.model.normalize
    platform = target_platform(cfg)
    # Buckets past the one that holds a full window never receive a batch.
    buckets = [b for b in cfg.batching.buckets if b <= bucket_for(window_len, cfg.batching.buckets)]
    choices = plan(attention_spec(cfg), attention_cases(checkpoint.config, buckets, platform))
    return JobPlan(cfg, window_len, pooling, normalize, platform, tuple(choices), checkpoint.config)


def build(p: beam.Pipeline, plan: JobPlan) -> None:
    cfg = plan.config
    read = p | "ReadDocuments" >> ReadDocuments(cfg.input)
    windows = read["documents"] | "Tokenize" >> Tokenize(cfg.model.path, plan.window_len, cfg.tokenize)
    batches = windows | "BucketByLength" >> BucketBatches(cfg.batching)
    total_windows = windows | "CountWindows" >> beam.combiners.Count.Globally()
    encoded = batches | "Encode" >> Encode(plan.encoder_spec(), total_windows)
    embeddings = encoded["windows"] | "PoolDocuments" >> PoolDocuments(plan.normalize)
    ({"embeddings": embeddings, "timing": encoded["timing"], "rejected": read["rejected"],
      "docs_read": read["docs_read"]} | "WriteOutputs" >> WriteOutputs(cfg.output.path, cfg.output.num_shards))


def clear_output(path: str) -> None:
    """A rerun into the same output replaces it: stale shards of an earlier run would mix in."""
    base = path.rstrip("/")
    for part in OUTPUT_PARTS:
        matches = FileSystems.match([f"{base}/{part}/**"])[0].metadata_list
        if matches:
            FileSystems.delete([m.path for m in matches])
    for name in ("summary.json", "_stats.json", "report.html"):
        if FileSystems.exists(f"{base}/{name}"):
            FileSystems.delete([f"{base}/{name}"])


def versions(names: tuple[str, ...] = VERSIONED) -> dict:
    """Installed versions of ``names`` (those not installed are left out)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def metrics_dict(result) -> dict:
    from apache_beam.metrics.metric import MetricsFilter

    try:
        queried = result.metrics().query(MetricsFilter().with_namespace("docbeam"))
    except Exception as e:  # some runners cannot report metrics; the summary still has the data-derived numbers
        log.warning("could not read Beam metrics: %s", e)
        return {}
    counters = {}
    for c in queried["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + (c.committed or 0)
    distributions = {}
    for d in queried["distributions"]:
        v = d.committed
        if v is None or not v.count:
            continue
        distributions[d.key.metric.name] = {"count": v.count, "sum": v.sum, "min": v.min, "max": v.max,
                                            "mean": v.sum / v.count}
    return {"counters": counters, "distributions": distributions}


def summarize(plan: JobPlan, stats: dict, metrics: dict, started: float, finished: float) -> dict:
    cfg = plan.config
    wall = finished - started
    real, padded = stats.get("real_tokens", 0), stats.get("padded_tokens", 0)
    summary = {
        "docs_read": stats.get("docs_read", 0), "docs_embedded": stats.get("docs_embedded", 0),
        "docs_rejected": stats.get("docs_rejected", 0), "windows": stats.get("windows", 0),
        "real_tokens": real, "padded_tokens": padded,
        "padding_efficiency": round(real / padded, 4) if padded else None,
        "batches": stats.get("batches", 0), "compiles": stats.get("compiles", 0),
        "wall_seconds": round(wall, 3), "docs_per_second": round(stats.get("docs_embedded", 0) / wall, 2),
        "tokens_per_second": round(real / wall, 1),
        "attention_requested": cfg.attention.backend,
        "attention_backends": stats.get("attention_backends", {}), "fallbacks": stats.get("fallbacks", {}),
        "attention_plan": {str(c.case.seq_len): {"backend": c.backend, "kernel": c.kernel,
                                                 "fallback_reason": c.fallback_reason} for c in plan.choices},
        "rejected_by_kind": stats.get("rejected_by_kind", {}), "buckets": stats.get("buckets", {}),
        "model": cfg.model.path, "window_len": plan.window_len, "pooling": plan.pooling, "normalize": plan.normalize,
        "dtype": cfg.model.dtype, "platform": plan.platform, "runner": cfg.runner.name,
        "config_digest": cfg.digest(), "versions": versions(),
        "started_at": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(),
        "finished_at": datetime.datetime.fromtimestamp(finished, datetime.timezone.utc).isoformat(),
        "metrics": metrics,
    }
    return summary


def run_job(cfg: JobConfig, extra_beam_args: list[str] = ()) -> dict:
    """Runs the job to completion and returns the summary (also written to ``summary.json``)."""
    plan = make_plan(cfg)
    out = cfg.output.path.rstrip("/")
    clear_output(out)
    options = storage.pipeline_options(cfg.runner.beam_args() + list(extra_beam_args))
    started = time.time()
    log.info("docbeam: starting %s with attention %s", cfg.runner.name,
             {c.case.seq_len: c.backend for c in plan.choices})
    with beam.Pipeline(options=options) as p:
        build(p, plan)
    result = p.result
    finished = time.time()
    stats = json.loads(storage.read_bytes(f"{out}/_stats.json") or b"{}")
    summary = summarize(plan, stats, metrics_dict(result), started, finished)
    storage.write_bytes(f"{out}/summary.json", json.dumps(summary, indent=2, sort_keys=True).encode())
    FileSystems.delete([f"{out}/_stats.json"])
    return summary
