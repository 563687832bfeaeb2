"""What the attention parity tests share: the rule that a backend declaring what a test's cases ask for runs at
least one of them on the CPU, since each test skips a case the backend's own check refuses."""

from __future__ import annotations

from docbeam import attention
from docbeam.attention.features import refusals


def declared_features(name: str, options, platform: str) -> frozenset[str]:
    """The features ``name`` with ``options`` declares on ``platform``: a backend's ``register(..., <feature>=True)``;
    for flash, those of the kernel the options name (its ``takes``), or of any kernel ``auto`` tries there."""
    backend = attention.get(name)
    if name != "flash":
        return backend.takes
    from docbeam.attention.flash import KERNELS, PLATFORM_KERNELS

    kernels = PLATFORM_KERNELS.get(platform, ()) if options.kernel == "auto" else (options.kernel,)
    return backend.takes & frozenset(feature for kernel in kernels for feature in KERNELS[kernel].takes)


def assert_runs_a_declared_case(name: str, raw_options: dict, cases: dict) -> None:
    """Of ``cases`` (label → AttentionCase, one platform), those asking only for features ``name`` declares must
    not all be refused by its own check: a test that skips each refused case would pass without comparing it."""
    backend = attention.get(name)
    options = backend.parse_options(raw_options)
    platform = next(iter(cases.values())).platform
    takes = declared_features(name, options, platform)
    declared = {label: case for label, case in cases.items() if not refusals(case, takes)}
    answers = {label: backend.refusal(case) or backend.supports(case, options) for label, case in declared.items()}
    refused = {label: support.reason for label, support in answers.items() if not support.ok}
    assert not declared or len(refused) < len(declared), (
        f"{name} {raw_options} declares what {', '.join(declared)} ask for, yet refuses every one on {platform}, "
        "so the parity test would skip them all and never compare it: "
        + "; ".join(f"{label}: {reason}" for label, reason in refused.items())
    )
