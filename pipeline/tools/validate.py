"""``docbeam validate``: the resolved config, and for this machine which attention backend would run each
bucket and why — the same checks the job does at start. ``--for-launch`` first refuses the profiles'
placeholders (project, buckets, image), as ``run --dry-run`` and the Flex Template launcher do."""

from __future__ import annotations

import yaml

from docbeam import placeholders
from docbeam.config import JobConfig
from docbeam.pipeline.driver import precision_gate_at_start


def backend_if_chosen(cfg: JobConfig, plan, name: str) -> str:
    """One line: whether ``name`` would run every bucket of this job were it chosen, and how (its kernels,
    packed or not), or why not. Packing is resolved for that choice, so a backend that takes no segment ids
    is not shown as refused merely because this config's own backend packs."""
    from docbeam import attention
    from docbeam.attention.dispatch import AttentionPlanError, ask_all, by_bucket
    from docbeam.models.encoder import attention_cases
    from docbeam.pipeline.driver.plan import resolved_packing

    backend = attention.get(name)
    packed = resolved_packing(cfg.model_copy(update={"attention": cfg.attention.model_copy(update={"backend": name})}))
    cases = attention_cases(plan.encoder, [c.case.seq_len for c in plan.choices], plan.platform, packed)
    try:  # one answer per bucket, over every kind of layer the model has
        answers = [
            (group[0].seq_len, ask_all(backend, group, cfg.attention.options_for(name))) for group in by_bucket(cases)
        ]
    except AttentionPlanError as e:
        return f"  {name:10s} NOT usable: {e}"
    refused = [(b, s) for b, s in answers if not s.ok]
    if refused:
        return f"  {name:10s} refused for " + "; ".join(f"bucket {b}: {s.reason}" for b, s in refused)
    kernels = sorted({s.kernel for _, s in answers if s.kernel})
    how = "packed" if packed else "unpacked"
    if cfg.batching.packing == "auto" and packed != plan.packing:
        how += f" (batching.packing: auto would resolve to {str(packed).lower()} with it)"
    return (
        f"  {name:10s} runs every bucket, {how}"
        + (f" ({', '.join(kernels)})" if kernels else "")
        + f" — {backend.description}"
    )


def shown(cfg: JobConfig) -> dict:
    """The config as printed: each sink's section as it shows itself (a password in it is not: a scheduler keeps
    the output)."""
    from docbeam.pipeline import sinks

    dumped = cfg.model_dump(mode="json")
    for sink, section in sinks.active(cfg):
        dumped["output"][sink.key] = section.shown()
    return dumped


def validation_report(cfg: JobConfig, verify: bool = False, for_launch: bool = False) -> str:
    from docbeam import attention
    from docbeam.attention.dispatch import gate
    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.store.output import new_run_id, run_date

    cfg = placeholders.expand(cfg, new_run_id(), run_date())
    if for_launch:
        placeholders.refuse(cfg, placeholders.beam_options_of(cfg))
    out = ["# resolved config (digest %s)" % cfg.digest(), yaml.safe_dump(shown(cfg), sort_keys=False).rstrip()]
    plan = make_plan(cfg)  # raises, like `run` would, when a bucket has no backend
    out += [
        "",
        f"# model: window {plan.window_len} tokens, pooling {plan.pooling}, normalize {plan.normalize}, "
        f"{plan.width} dimensions"
        + (f" (truncate_dim {plan.truncate_dim})" if plan.truncate_dim else "")
        + f" written as {cfg.output.vector_dtype}",
        f"# head: {plan.head.name} → {plan.head.folder}/"
        + (f" ({plan.head.details()})" if plan.head.details() else "")
        + (f"; the checkpoint carries {plan.head.carried}" if plan.head.carried else ""),
        f"# attention backends on platform {plan.platform!r} ({cfg.model.dtype}, "
        f"{plan.encoder.num_heads} heads × {plan.encoder.head_dim}); batching.packing: "
        f"{str(plan.packing).lower()}"
        + (" (auto)" if cfg.batching.packing == "auto" else "")
        + f"; batching.shards: {plan.batching().shards}"
        + (" (auto)" if cfg.batching.shards == "auto" else ""),
    ]
    out.append("# what each backend would do if attention.backend named it (packing as `auto` would resolve then):")
    for name in attention.names():
        out.append(backend_if_chosen(cfg, plan, name))
    from docbeam.attention import flash

    out += ["# flash: which kernel `kernel: auto` picks per platform", flash.auto_kernel_table()]
    choices = list(plan.choices)
    if verify:
        choices = gate(plan.attention, choices)
    out.append(
        f"# plan: requested {cfg.attention.backend!r}, fallback {cfg.attention.fallback!r}"
        + (" (after the parity gate)" if verify else "")
    )
    for c in choices:
        if c.to_measure:
            out.append(
                f"  bucket {c.case.seq_len:6d} → measured on the worker ({plan.platform}; this machine has another)"
            )
            continue
        line = f"  bucket {c.case.seq_len:6d} → {c.backend}" + (f" [{c.kernel}]" if c.kernel else "")
        if c.fallback_reason:
            line += f"  (fallback: {c.fallback_reason})"
        out.append(line)
        if c.measurement is not None:
            out.append("    measured " + c.measurement.describe())
    if plan.memory is not None:
        out.append(f"# memory plan, per chip of the worker: {plan.memory.describe()}")
        if cfg.batching.tokens_per_batch == "auto":
            out.append(f"# batching.tokens_per_batch: auto resolves to {plan.tokens_per_batch}")
    if verify and cfg.model.dtype != "float32":  # as `run` does at start: refused (exit 2) when it fails under enforce
        out.append("# " + precision_gate_at_start.describe(precision_gate_at_start.gate_record(plan)))
    if for_launch:
        out.append("# launch: no placeholder in " + ", ".join(placeholders.LAUNCH_KEYS))
    return "\n".join(out)
