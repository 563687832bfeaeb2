"""The job plan: every check that must fail at start, built once on the driver and handed to the workers.

``run``, ``validate`` and ``propose-buckets`` all start here, so a config that ``validate`` approves is one
``run`` starts, and a refused one touches nothing (exit 2).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import os

from docbeam.attention.dispatch import Choice, choose_backends, gate
from docbeam.attention.probe_once import probe_all
from docbeam.config import AttentionConfig, BatchingConfig, ConfigError, EmbedConfig, JobConfig, TokenizeConfig
from docbeam.errors import refused_at_start
from docbeam.models.checkpoint import (
    dense_digest,
    hub_revision,
    load_tokenizer,
    open_checkpoint,
    pinned_path,
    tokenizer_digest,
    weights_digest,
)
from docbeam.models.checkpoint.sentence_transformers.settings import document_prompt
from docbeam.models.encoder import EncoderConfig, attention_cases
from docbeam.models.heads import Head
from docbeam.models.heads.registry import resolve as resolve_head
from docbeam.models.memory_plan import MemoryPlan
from docbeam.models.runtime import EncoderPlan
from docbeam.pipeline.driver.head_plan import (
    check_head_fits_output,
    check_kept_fields,
    check_selection,
    tokenize_for,
    vector_dtype,
)
from docbeam.pipeline.driver.memory_at_start import memory_plan
from docbeam.pipeline.stages.keep import KeptFields, plan_columns
from docbeam.pipeline.stages.packer import bucket_for
from docbeam.pipeline.stages.read import sample_records
from docbeam.pipeline.stages.reuse import ReuseDecision, decide
from docbeam.pipeline.stages.tokenize import prompt_token_ids, stride_problem
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage
from docbeam.pipeline.store.paths import is_remote

VERSIONED = (
    "docbeam",
    "apache-beam",
    "jax",
    "jaxlib",
    "flax",
    "transformers",
    "tokenizers",
    "tokamax",
    "numpy",
    "pyarrow",
)


@dataclasses.dataclass(frozen=True, kw_only=True)  # built by keyword: a dozen fields, some of one type
class JobPlan:
    """What the driver resolved from the config and the checkpoint, after checking the input and output; built
    once. ``config`` is the job's config as given: every value resolved here (the pinned model, packing, the
    buckets used, the backend per bucket) is a field of the plan, never written back into the config. The
    workers receive ``encoder_plan``, its encoder part, as it is (pipeline/stages/encode.py ``EncoderSpec``)."""

    config: JobConfig | EmbedConfig  # EmbedConfig: docbeam.EmbedDocuments's, which has no input or output
    encoder_plan: EncoderPlan  # the pinned model, its head, packing and the backend per bucket (models/runtime.py)
    window_len: int
    prompt: str | None  # put in front of every window (model.prompt resolved against the checkpoint)
    encoder: EncoderConfig
    reuse_key: dict  # what must match for another run's vectors to be reused (pipeline/stages/reuse.py)
    reuse: ReuseDecision
    kept: KeptFields = KeptFields()  # input.keep_fields resolved: the kept columns, typed from a sample
    precision_gate: dict | None = (
        None  # model.dtype's precision gate at start (pipeline/driver/precision_gate_at_start.py)
    )
    context_len: int | None = None  # output.chunking: late: the context windows' length; None: window chunking
    memory: MemoryPlan | None = (
        None  # each chip's share: parameters, the largest batch (pipeline/driver/memory_at_start.py)
    )

    @property
    def model_path(self) -> str:
        """model.path, a Hub id's branch pinned to the commit the driver resolved it to."""
        return self.encoder_plan.model_path

    @property
    def head(self) -> Head:
        """What each window's token states become, and each document's row (models/heads/)."""
        return self.encoder_plan.head

    @property
    def platform(self) -> str:
        return self.encoder_plan.platform

    @property
    def packing(self) -> bool:
        """batching.packing resolved (auto: whether every backend this job may run takes segment ids)."""
        return self.encoder_plan.packing

    @property
    def choices(self) -> tuple[Choice, ...]:
        """One per bucket that can receive a batch: the backend that runs it, and why."""
        return self.encoder_plan.choices

    @property
    def checked(self) -> bool:
        """The choices were probed (and gated, with attention.verify) on ``platform``, here."""
        return self.encoder_plan.checked

    @property
    def attention(self) -> AttentionConfig:
        return self.config.attention

    @property
    def pooling(self) -> str:
        return self.head.pooling

    @property
    def normalize(self) -> bool:
        return self.head.normalize

    @property
    def truncate_dim(self) -> int | None:
        """Documents' vectors keep their first truncate_dim dimensions (None: all)."""
        return self.head.truncate_dim

    @property
    def width(self) -> int:
        """Of every vector (or scores list) written: after the head's layers and any truncation."""
        return self.head.dim

    @property
    def tokenize(self) -> TokenizeConfig:
        """The tokenize section the job runs: a classifier that scores a document by its first window needs
        no other window, so its documents are cut there (``long_documents: truncate``)."""
        return tokenize_for(self.config, self.head)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets that can receive a batch (packing may fill the longest, never one past a full window)."""
        return tuple(sorted(c.case.seq_len for c in self.choices))

    def batching(self) -> BatchingConfig:
        """The batching BucketBatches runs: the config's, on the plan's buckets with the plan's packing and batch
        size (a new object handed to the stage; ``config`` stays as given)."""
        from docbeam.pipeline.driver.shards import resolved_shards

        batching = self.config.batching
        shards = resolved_shards(batching, self.config.runner)
        return batching.model_copy(
            update={
                "buckets": self.buckets,
                "packing": self.packing,
                "shards": shards,
                "tokens_per_batch": self.tokens_per_batch,
            }
        )

    @property
    def tokens_per_batch(self) -> int:
        """batching.tokens_per_batch as the job runs it (``auto`` resolved by the memory plan)."""
        return self.memory.tokens_per_batch if self.memory is not None else self.config.batching.tokens_per_batch


def target_platform(cfg: JobConfig) -> str:
    return _local_platform() if cfg.runner.device == "auto" else cfg.runner.device


def _local_platform() -> str:
    import jax

    return jax.default_backend()


def _local_devices(platform: str) -> int:
    """This machine's chips of ``platform`` (1 when it has none: the workers' count comes from the profile)."""
    import jax

    return len(jax.local_devices()) if platform == _local_platform() else 1


def check_window(cfg: JobConfig, encoder: EncoderConfig, window_len: int, special_tokens: int) -> list[int]:
    """The buckets that can receive a batch, after the checks on window, positions and stride."""
    if encoder.position == "absolute" and window_len > encoder.max_position:
        raise ConfigError(
            f"model.max_seq_len={window_len} exceeds the checkpoint's {encoder.max_position} "
            "position embeddings; lower it or leave it unset"
        )
    if cfg.batching.buckets[-1] < window_len:
        raise ConfigError(
            f"batching.buckets={list(cfg.batching.buckets)}: the largest bucket is below the model's "
            f"window of {window_len} tokens; add {window_len} (or set model.max_seq_len lower)"
        )
    problem = stride_problem(cfg.tokenize.stride, window_len, special_tokens)
    if problem:
        raise ConfigError(problem)
    # Buckets past the one that holds a full window never receive a batch.
    used = [b for b in cfg.batching.buckets if b <= bucket_for(window_len, cfg.batching.buckets)]
    if encoder.position == "absolute" and used[-1] > encoder.max_position:
        # Padding past the position table reads positions that do not exist: NaN embeddings.
        raise ConfigError(
            f"batching.buckets: bucket {used[-1]} is longer than the checkpoint's "
            f"{encoder.max_position} position embeddings; use buckets up to {encoder.max_position}, "
            f"e.g. end them at {window_len}"
        )
    return used


def check_inputs(cfg: JobConfig) -> list[str]:
    """Every input pattern matches a path, and none lies inside the output (a run would replace its own
    input); the paths matched, in order. Matched as the job matches them (pipeline/stages/read.py), so this
    refuses what the job would."""
    from docbeam.pipeline.stages.read import match_paths

    out = cfg.output.path
    matched = []
    for pattern in cfg.input.patterns:
        if output_lib.inside(out, pattern) or pattern.rstrip("/") == out:
            raise ConfigError(
                f"input.path {pattern!r} lies inside output.path {out!r}; a run replaces its output, "
                "so keep the input elsewhere"
            )
        try:
            paths = match_paths(pattern)
        except FileNotFoundError:
            hint = (
                f"it is a folder: use {pattern.rstrip('/')}/*.jsonl (or another glob)"
                if not is_remote(pattern) and os.path.isdir(pattern)
                else "check the path and the glob"
            )
            raise ConfigError(f"input.path {pattern!r} matches no file; {hint}") from None
        inside = [p for p in paths if output_lib.inside(out, p)]
        if inside:
            raise ConfigError(
                f"input.path {pattern!r} matches {inside[0]}, inside output.path {out!r}; keep the "
                "input outside the output"
            )
        matched += paths
    return list(dict.fromkeys(matched))


def check_output(cfg: JobConfig) -> output_lib.OutputState:
    try:
        with refused_at_start(
            f"output.path {cfg.output.path} cannot be checked (a damaged "
            f"{output_lib.MANIFEST}, {output_lib.LOCK} or {output_lib.STAGING}/ entry, or a folder "
            "that cannot be read)"
        ):
            state = output_lib.inspect(cfg.output.path)
            output_lib.check_writable(cfg.output.path, state, cfg.output.mode)
    except output_lib.OutputRefused as e:
        raise ConfigError(str(e)) from None
    return state


def resolved_packing(cfg: JobConfig) -> bool:
    """``batching.packing: auto`` → true when every backend this job may run takes segment ids, else
    false (switching attention.backend to one that does not must keep working); true and false stay."""
    from docbeam.attention import registry

    if cfg.batching.packing != "auto":
        return cfg.batching.packing
    # auto runs native wherever no candidate is measured faster: packing follows native, and a candidate that takes
    # no segment ids is refused for packed buckets, with that reason, in the measurement.
    backend = "native" if cfg.attention.backend == "auto" else cfg.attention.backend
    names = [backend] + ([cfg.attention.fallback] if cfg.attention.fallback else [])
    return all(registry.get(name).segments for name in names)


def make_plan(
    cfg: JobConfig | EmbedConfig, *, probe_backends: bool = True, for_output: bool = True, for_input: bool = True
) -> JobPlan:
    """Everything that can fail before the job starts fails here, with the key to change. Tools that write
    no output (propose-buckets) leave out the output's checks (``for_output=False``); a dry run, which reads
    and writes nothing, leaves out both (its placeholders name buckets that need not exist), as does
    docbeam.EmbedDocuments (an EmbedConfig has neither: the user's pipeline reads and writes)."""
    storage.pipeline_options(cfg.runner.beam_args())  # gs:// paths need FileSystems set up
    checkpoint = open_checkpoint(cfg.model.path, cfg.model.dtype, task=cfg.model.task)
    # The workers load the commit the driver resolved a Hub id's branch to.
    pinned = pinned_path(cfg.model.path, checkpoint.folder)
    # Hashing the weights releases the GIL: it runs on another core beside the checks and probes below.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="docbeam-digest") as pool:
        weights = pool.submit(weights_digest, pinned)
        return _checked_plan(cfg, pinned, checkpoint, weights, probe_backends, for_output, for_input)


def _checked_plan(
    cfg: JobConfig,
    pinned: str,
    checkpoint,
    weights: concurrent.futures.Future,
    probe_backends: bool,
    for_output: bool,
    for_input: bool,
) -> JobPlan:
    """``make_plan`` once the checkpoint is open (``pinned``: its path) and its weights are being hashed."""
    settings = checkpoint.settings
    window_len = cfg.model.max_seq_len or settings.max_seq_len
    prompt = document_prompt(settings, cfg.model.prompt, checkpoint.folder)
    tokenizer = load_tokenizer(checkpoint.folder)
    # Every window repeats the prompt's tokens: they count against the window like the special tokens.
    special = tokenizer.num_special_tokens_to_add(pair=False) + len(prompt_token_ids(tokenizer, prompt))
    buckets = check_window(cfg, checkpoint.config, window_len, special)
    context_len = late_context(cfg, checkpoint.config, window_len, settings.max_seq_len)
    if context_len:
        buckets = check_window(cfg, checkpoint.config, context_len, special)
    # A dry run reads no input: its kept columns are untyped (pipeline/stages/keep.py plan_columns). An
    # EmbedConfig keeps no fields: the user's own pipeline carries its records' other fields.
    paths = check_inputs(cfg) if for_input and isinstance(cfg, JobConfig) else None
    kept = (
        plan_columns(cfg.input, None if paths is None else functools.partial(sample_records, cfg.input, paths))
        if isinstance(cfg, JobConfig)
        else KeptFields()
    )
    if for_output:
        check_output(cfg)
    platform = target_platform(cfg)
    attention = cfg.attention
    packing = resolved_packing(cfg)
    choices = choose_backends(attention, attention_cases(checkpoint.config, buckets, platform, packing))
    checked = probe_backends and platform == _local_platform()
    if checked:  # a backend that crashes or returns garbage fails here, not on the workers
        choices = gate(attention, choices) if attention.verify else choices
        probe_all(attention, choices)
    memory = memory_plan(
        cfg,
        checkpoint.config,
        choices,
        platform,
        _local_devices(platform),
    )
    if checked:  # attention.backend auto: measured here, on the platform the workers have
        choices = measured_choices(cfg, choices, memory)
    head = resolve_head(checkpoint, cfg.model.head, cfg.model, vector_dtype(cfg))
    check_head_fits_output(cfg, head)
    check_selection(cfg, head, kept)
    check_kept_fields(head, kept)
    from docbeam.pipeline import sinks  # Beam's: imported once a config is past its own checks

    for sink, _ in sinks.active(cfg):
        sink.check(cfg, head, kept)
    tokenize = tokenize_for(cfg, head)
    key = {
        "weights_digest": weights.result(),
        "tokenizer_digest": tokenizer_digest(checkpoint.folder),
        "window_len": window_len,
        "stride": tokenize.stride,
        "long_documents": tokenize.long_documents,
        "pooling": head.pooling,
        "normalize": head.normalize,
        "dtype": cfg.model.dtype,
        "prompt": prompt,
        "model_revision": hub_revision(pinned),
        "truncate_dim": head.truncate_dim,
        "dense_digest": dense_digest(checkpoint.folder, settings),
        "vector_dtype": vector_dtype(cfg),
        "head": head.reuse_key(),
    }
    key["task"] = getattr(checkpoint.config, "task", None)  # the adapter merged in (Jina v3), the default's too
    reuse = (
        decide(cfg.input.reuse_from, key, cfg.input.reuse_mismatch, cfg.output.granularity, head.folder)
        if for_output
        else ReuseDecision(None, "")
    )
    encoder_plan = EncoderPlan(
        model_path=pinned,
        dtype=cfg.model.dtype,
        head=head,
        attention=attention,
        choices=tuple(choices),
        platform=platform,
        checked=checked,
        packing=packing,
        task=cfg.model.task,
        checkpoint_key=(key["weights_digest"], key["dense_digest"], checkpoint.config),
        mesh=cfg.runner.mesh_shape(),
        engine=cfg.runner.engine,
    )
    return JobPlan(
        config=cfg,
        encoder_plan=encoder_plan,
        window_len=window_len,
        prompt=prompt,
        encoder=checkpoint.config,
        reuse_key=key,
        reuse=reuse,
        kept=kept,
        context_len=context_len,
        memory=memory,
    )


def measured_choices(cfg: JobConfig | EmbedConfig, choices, memory) -> list:
    """``attention.backend: auto``'s buckets measured on this machine's chip at the rows each chip gets
    (attention/measure.py), read from the measurement cache beside the compilation cache where it has them."""
    from docbeam.pipeline.stages.measurement_cache import measured_on_this_chip

    if not any(c.to_measure for c in choices):
        return choices
    tokens = memory.tokens_per_batch or cfg.batching.tokens_per_batch
    return list(measured_on_this_chip(cfg.attention, choices, tokens, memory.mesh, cfg.runner.compilation_cache))


def late_context(cfg: JobConfig | EmbedConfig, encoder: EncoderConfig, window_len: int, model_len: int) -> int | None:
    """``output.chunking: late``: the context windows' length, the checkpoint's own (its max_seq_length, within
    its positions) and never below a chunk's window; None for window chunking. Its batches need a bucket."""
    if not isinstance(cfg, JobConfig) or cfg.output.chunking != "late":
        return None
    context_len = max(window_len, min(model_len, encoder.max_position) if encoder.position == "absolute" else model_len)
    if cfg.batching.buckets[-1] < context_len:
        raise ConfigError(
            f"output.chunking: late encodes each document in context windows of up to {context_len} "
            f"tokens (the checkpoint's length), but batching.buckets ends at "
            f"{cfg.batching.buckets[-1]}; add {context_len}, or use output.chunking: window"
        )
    return context_len


def versions(names: tuple[str, ...] = VERSIONED) -> dict:
    """Installed versions of ``names`` (those not installed are left out)."""
    return dict(installed_versions(names))


@functools.lru_cache(maxsize=None)
def installed_versions(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Read once per process: each lookup scans every folder on sys.path for dist-info (about a quarter of a
    second for the ten names on a 2-core VM, per run), and what is installed does not change while it runs."""
    out = []
    for name in names:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(out)
