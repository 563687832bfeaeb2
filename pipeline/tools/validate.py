"""``docbeam validate``: the resolved config, and for this machine which attention backend would run each
bucket and why — the same checks the job does at start. ``--for-launch`` first refuses the profiles'
placeholders (project, buckets, image), as ``run --dry-run`` and the Flex Template launcher do."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import yaml

from pipeline.driver.config import ConfigError, JobConfig

# The shipped Dataflow profiles are runnable in form only: these names stand for the user's own. A job
# launched with them would pull an image nobody built and write to a bucket nobody owns (or someone else's).
PLACEHOLDERS = {"my-docbeam-project": "project", "my-docbeam-bucket": "bucket"}
# Key -> how to replace it: on the command line, and in a Flex Template launch (README "Running on Dataflow").
LAUNCH_KEYS = {
    "runner.options.project": ("YOUR_PROJECT", "the launch's project"),
    "runner.options.temp_location": ("gs://YOUR_BUCKET/dataflow/temp", "environment.tempLocation"),
    "runner.options.staging_location": ("gs://YOUR_BUCKET/dataflow/staging", "environment.stagingLocation"),
    "runner.options.sdk_container_image": ("REGION-docker.pkg.dev/YOUR_PROJECT/docbeam/worker-tpu:0.1.0",
                                           "environment.sdkContainerImage"),
    "runner.options.service_account_email": ("docbeam-worker@YOUR_PROJECT.iam.gserviceaccount.com",
                                             "environment.serviceAccountEmail"),
    "input.path": ("gs://YOUR_BUCKET/corpus/{run_date}/*.jsonl.gz", "template parameter input"),
    "input.reuse_from": ("gs://YOUR_BUCKET/runs/{previous_run_date}", "template parameter overrides"),
    "output.path": ("gs://YOUR_BUCKET/runs/{run_date}", "template parameter output"),
    "runner.compilation_cache": ("gs://YOUR_BUCKET/jax-cache/tpu-v5e", "template parameter compilation_cache"),
}
DATAFLOW = "DataflowRunner"


def launch_values(cfg: JobConfig, beam_options: Mapping[str, object]) -> dict[str, object]:
    """What a launch would use for each of LAUNCH_KEYS: docbeam's own keys from ``cfg``, Beam's from
    ``beam_options`` (Beam's names), which hold the profile's options overridden by the launch's."""
    values = {"input.path": cfg.input.path, "input.reuse_from": cfg.input.reuse_from,
              "output.path": cfg.output.path, "runner.compilation_cache": cfg.runner.compilation_cache}
    for key in LAUNCH_KEYS:
        if key.startswith("runner.options."):
            values[key] = beam_options.get(key.removeprefix("runner.options."))
    return values


def beam_options_of(cfg: JobConfig, extra_beam_args: Sequence[str] = ()) -> dict[str, object]:
    """Beam's view of the profile's options followed by ``extra_beam_args`` (later flags win, as in a run)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    return PipelineOptions([*cfg.runner.beam_args(), *extra_beam_args]).get_all_options(retain_unknown_options=True)


def placeholder_problems(runner: str, values: Mapping[str, object]) -> list[str]:
    """One line per value a launch must not carry: a profile placeholder, or (on Dataflow) no worker image."""
    problems = []
    for key, value in values.items():
        found = [(marker, what) for marker, what in PLACEHOLDERS.items() if value and marker in str(value)]
        if found:
            marker, what = found[0]
            example, in_launch = LAUNCH_KEYS[key]
            problems.append(f"{key} is {value!r}: {marker!r} is the profiles' placeholder {what}; set yours "
                            f"(--set {key}={example}, or in a Flex Template launch: {in_launch})")
    if runner == DATAFLOW and not values.get("runner.options.sdk_container_image"):
        example, in_launch = LAUNCH_KEYS["runner.options.sdk_container_image"]
        problems.append("runner.options.sdk_container_image is not set: Dataflow workers would run Beam's default "
                        f"image, which lacks docbeam (--set runner.options.sdk_container_image={example}, or in a "
                        f"Flex Template launch: {in_launch})")
    return problems


def refuse_placeholders(runner: str, values: Mapping[str, object]) -> None:
    problems = placeholder_problems(runner, values)
    if problems:
        raise ConfigError("this job would launch on placeholders:\n  " + "\n  ".join(problems))


def backend_if_chosen(cfg: JobConfig, plan, name: str) -> str:
    """One line: whether ``name`` would run every bucket of this job were it chosen, and how (its kernels,
    packed or not), or why not. Packing is resolved for that choice, so a backend that takes no segment ids
    is not shown as refused merely because this config's own backend packs."""
    import attention
    from attention.plan import AttentionPlanError, ask_all, by_bucket
    from pipeline.driver.plan import attention_cases, resolved_packing

    backend = attention.get(name)
    packed = resolved_packing(cfg.model_copy(update={"attention": cfg.attention.model_copy(update={"backend": name})}))
    cases = attention_cases(plan.encoder, [c.case.seq_len for c in plan.choices], plan.platform, packed)
    try:  # one answer per bucket, over every kind of layer the model has
        answers = [(group[0].seq_len, ask_all(backend, group, cfg.attention.options_for(name)))
                   for group in by_bucket(cases)]
    except AttentionPlanError as e:
        return f"  {name:10s} NOT usable: {e}"
    refused = [(b, s) for b, s in answers if not s.ok]
    if refused:
        return f"  {name:10s} refused for " + "; ".join(f"bucket {b}: {s.reason}" for b, s in refused)
    kernels = sorted({s.kernel for _, s in answers if s.kernel})
    how = "packed" if packed else "unpacked"
    if cfg.batching.packing == "auto" and packed != plan.packing:
        how += f" (batching.packing: auto would resolve to {str(packed).lower()} with it)"
    return (f"  {name:10s} runs every bucket, {how}" + (f" ({', '.join(kernels)})" if kernels else "")
            + f" — {backend.description}")


def validation_report(cfg: JobConfig, verify: bool = False, for_launch: bool = False) -> str:
    import attention
    from attention.plan import gate
    from pipeline.driver.config import expand_placeholders
    from pipeline.store.output import new_run_id, run_date
    from pipeline.driver.plan import make_plan

    cfg = expand_placeholders(cfg, new_run_id(), run_date())
    if for_launch:
        refuse_placeholders(cfg.runner.name, launch_values(cfg, beam_options_of(cfg)))
    out = ["# resolved config (digest %s)" % cfg.digest(),
           yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip()]
    plan = make_plan(cfg)  # raises, like `run` would, when a bucket has no backend
    out += ["", f"# model: window {plan.window_len} tokens, pooling {plan.pooling}, normalize {plan.normalize}, "
            f"{plan.width} dimensions" + (f" (truncate_dim {plan.truncate_dim})" if plan.truncate_dim else ""),
            f"# attention backends on platform {plan.platform!r} ({cfg.model.dtype}, "
            f"{plan.encoder.num_heads} heads × {plan.encoder.head_dim}); batching.packing: "
            f"{str(plan.packing).lower()}"
            + (" (auto)" if cfg.batching.packing == "auto" else "")]
    out.append("# what each backend would do if attention.backend named it (packing as `auto` would resolve then):")
    for name in attention.names():
        out.append(backend_if_chosen(cfg, plan, name))
    from attention import flash

    out += ["# flash: which kernel `kernel: auto` picks per platform", flash.auto_kernel_table()]
    choices = list(plan.choices)
    if verify:
        choices = gate(plan.attention, choices)
    out.append(f"# plan: requested {cfg.attention.backend!r}, fallback {cfg.attention.fallback!r}"
               + (" (after the parity gate)" if verify else ""))
    for c in choices:
        line = f"  bucket {c.case.seq_len:6d} → {c.backend}" + (f" [{c.kernel}]" if c.kernel else "")
        if c.fallback_reason:
            line += f"  (fallback: {c.fallback_reason})"
        out.append(line)
    if for_launch:
        out.append("# launch: no placeholder in " + ", ".join(LAUNCH_KEYS))
    return "\n".join(out)
