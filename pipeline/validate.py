"""``docbeam validate``: the resolved config, and for this machine which attention backend would run each
bucket and why — the same checks the job does at start."""
from __future__ import annotations

import yaml

from pipeline.config import JobConfig


def validation_report(cfg: JobConfig, verify: bool = False) -> str:
    import attention
    from attention.plan import AttentionPlanError, ask, gate
    from pipeline.config import expand_placeholders
    from pipeline.output import new_run_id, run_date
    from pipeline.plan import attention_cases, make_plan

    cfg = expand_placeholders(cfg, new_run_id(), run_date())
    out = ["# resolved config (digest %s)" % cfg.digest(),
           yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip()]
    plan = make_plan(cfg)  # raises, like `run` would, when a bucket has no backend
    cases = attention_cases(plan.encoder, [c.case.seq_len for c in plan.choices], plan.platform,
                            plan.config.batching.packing)
    out += ["", f"# model: window {plan.window_len} tokens, pooling {plan.pooling}, normalize {plan.normalize}",
            f"# attention backends on platform {plan.platform!r} ({cfg.model.dtype}, "
            f"{plan.encoder.num_heads} heads × {plan.encoder.head_dim}); batching.packing: "
            f"{str(plan.config.batching.packing).lower()}"
            + (" (auto)" if cfg.batching.packing == "auto" else "")]
    for name in attention.names():
        backend = attention.get(name)
        options = cfg.attention.options_for(name)
        try:
            answers = [(case.seq_len, ask(backend, case, options)) for case in cases]
        except AttentionPlanError as e:
            out.append(f"  {name:10s} NOT usable: {e}")
            continue
        if all(s.ok for _, s in answers):
            kernels = sorted({s.kernel for _, s in answers if s.kernel})
            out.append(f"  {name:10s} available" + (f" ({', '.join(kernels)})" if kernels else "")
                       + f" — {backend.description}")
        else:
            out.append(f"  {name:10s} NOT for: " + "; ".join(f"bucket {b}: {s.reason}" for b, s in answers if not s.ok))
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
    return "\n".join(out)
