"""Which backend runs each bucket, decided before any work: capability checks, fallback, parity gate.

A bucket has one case per kind of layer the model has (``EncoderConfig.attention_features``: ModernBERT a
global and a local kind, MPNet one with a bias). One backend runs the whole bucket, so timing records name one
backend: it must accept every kind, and a refusal of any kind sends the whole bucket to the fallback, with the
reason naming the kind."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pydantic

from docbeam.attention import candidates, registry
from docbeam.attention.features import DECLARED, static_keywords
from docbeam.attention.interface import AttentionCase, Backend, Support
from docbeam.attention.settings import AttentionConfig
from docbeam.errors import Refused

log = logging.getLogger(__name__)


class AttentionPlanError(Refused, RuntimeError):
    """The configured backend cannot run a case and no fallback is configured: stop before any work."""


@dataclasses.dataclass(frozen=True)
class Choice:
    case: AttentionCase  # the bucket's first case (its seq_len names the bucket)
    requested: str
    backend: str  # the one that will run
    kernel: str
    fallback_reason: str | None = None
    cases: tuple[AttentionCase, ...] = ()  # every kind of layer in the bucket; () means just ``case``
    # attention.backend auto: the bucket's candidates as measured on the chip (attention/measure.py); None where
    # the backend is named, or auto's choice is still to be measured on the worker (``backend`` native until then)
    measurement: Any = None

    @property
    def to_measure(self) -> bool:
        return self.requested == candidates.AUTO and self.measurement is None

    def __post_init__(self):
        if not self.cases:
            object.__setattr__(self, "cases", (self.case,))


def ask(backend: Backend, case: AttentionCase, options: pydantic.BaseModel) -> Support:
    """The backend's capability check; one that crashes stops the job at start, naming the backend."""
    refused = backend.refusal(case)
    if refused is not None:
        return refused
    try:
        return backend.supports(case, options)
    except Exception as e:  # noqa: BLE001  a user's check may raise anything
        raise AttentionPlanError(
            f"attention backend {backend.name!r}: its capability check raised "
            f"{type(e).__name__}: {e} (asked about bucket {case.seq_len}, {case.platform}, "
            f"{case.dtype}); fix the backend or choose another attention.backend"
        ) from e


def ask_all(backend: Backend, cases, options: pydantic.BaseModel) -> Support:
    """One answer for a bucket's cases (one per kind of layer): ok when every kind is; the kernel names each
    kind's kernel where they differ; a refusal names the kind it is about when the model has several."""
    answers = [(case, ask(backend, case, options)) for case in cases]
    several = len(answers) > 1
    refused = [(case, s) for case, s in answers if not s.ok]
    if refused:
        return Support(
            ok=False,
            reason="; ".join(
                (f"{case.features.describe()} layers: " if several else "") + s.reason for case, s in refused
            ),
        )
    kernels = list(dict.fromkeys(s.kernel for _, s in answers))
    if len(kernels) <= 1:
        return Support(ok=True, kernel=kernels[0] if kernels else "")
    return Support(ok=True, kernel="; ".join(f"{case.features.describe()}: {s.kernel}" for case, s in answers))


def choose_backend(
    case: AttentionCase | tuple[AttentionCase, ...],
    requested: Backend,
    requested_options: pydantic.BaseModel,
    fallback: Backend | None,
    fallback_options: pydantic.BaseModel | None,
) -> Choice:
    """The requested backend if its check accepts the bucket's case (or every case of the bucket, one per kind
    of layer), else the fallback's (with the reason)."""
    cases = case if isinstance(case, tuple) else (case,)
    first = cases[0]
    support = ask_all(requested, cases, requested_options)
    if support.ok:
        return Choice(first, requested.name, requested.name, support.kernel, cases=cases)
    where = f"bucket {first.seq_len} ({first.platform}, {first.dtype}, head_dim {first.head_dim})"
    if fallback is None:
        raise AttentionPlanError(
            f"attention.backend {requested.name!r} cannot run {where}: {support.reason}. "
            f"Set attention.fallback (e.g. native) to run such buckets with another backend, or choose another "
            f"attention.backend"
        )
    fb_support = ask_all(fallback, cases, fallback_options)
    if not fb_support.ok:
        raise AttentionPlanError(
            f"neither attention.backend {requested.name!r} ({support.reason}) nor "
            f"attention.fallback {fallback.name!r} ({fb_support.reason}) can run {where}"
        )
    return Choice(first, requested.name, fallback.name, fb_support.kernel, fallback_reason=support.reason, cases=cases)


def by_bucket(cases: list[AttentionCase]) -> list[tuple[AttentionCase, ...]]:
    """The cases grouped by bucket (seq_len), in the order the buckets first appear."""
    groups: dict[int, list[AttentionCase]] = {}
    for case in cases:
        groups.setdefault(case.seq_len, []).append(case)
    return [tuple(group) for group in groups.values()]


# Not arrays: closed over by the jitted call, never its arguments.
STATIC_FEATURES = static_keywords()


def probe_inputs(case: AttentionCase, batch: int = 2, seed: int = 0):
    """Random q, k, v of the case's shape with mixed padding (one full row, one half row), and the keyword
    arguments of the call: ``kv_lengths_B``, and for each feature the case asks for its declaration's probe
    (attention/features.py: packed rows' two windows, a random bias, random relative positions, a window as it
    is); a grouped-query case gets k and v with its fewer heads."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shape = (batch, case.seq_len, case.num_heads, case.head_dim)
    kv_shape = (batch, case.seq_len, case.kv_heads, case.head_dim)  # grouped-query: fewer k/v heads
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32)).astype(case.dtype) for s in (shape, kv_shape, kv_shape))
    lengths = np.full((batch,), case.seq_len, np.int32)
    lengths[1::2] = max(1, case.seq_len // 2)
    kwargs = {"kv_lengths_B": jnp.asarray(lengths)}
    for feature in DECLARED.values():
        if feature.keyword and feature.asked_by(case):
            kwargs[feature.keyword] = feature.probe_argument(case, lengths, seed)
    return q, k, v, kwargs


def run_probe(fn, case: AttentionCase, q, k, v, kwargs):
    """``fn`` on probe inputs under jit: the arrays are arguments, the window and bias function closed over."""
    import jax

    static = {key: kwargs[key] for key in STATIC_FEATURES if key in kwargs}
    arrays = {key: value for key, value in kwargs.items() if key not in static}
    scale = case.head_dim**-0.5
    return jax.jit(lambda q, k, v, kw: fn(q, k, v, scale=scale, **kw, **static))(q, k, v, arrays)


def max_abs_error(candidate, reference, kv_lengths_B) -> float:
    """Error over the valid query rows only: padded rows are ignored downstream."""
    c = np.asarray(candidate, np.float32)
    r = np.asarray(reference, np.float32)
    valid = np.arange(c.shape[1])[None, :] < np.asarray(kv_lengths_B)[:, None]
    if not np.all(np.isfinite(c)):
        return float("inf")
    return float(np.abs(c - r)[valid].max()) if valid.any() else 0.0


def default_tolerance(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 2e-2


def verify(choice: Choice, candidate_fn, native_fn, tolerance: float | None = None) -> tuple[bool, float, float]:
    """Run one probe batch per kind of layer through the chosen backend and native; (agrees, the largest
    error, tolerance)."""
    error = 0.0
    for case in choice.cases:
        q, k, v, kwargs = probe_inputs(case)
        got = run_probe(candidate_fn, case, q, k, v, kwargs)
        want = run_probe(native_fn, case, q, k, v, kwargs)
        error = max(error, max_abs_error(got, want, kwargs["kv_lengths_B"]))
    tolerance = tolerance or default_tolerance(choice.case.dtype)
    return error <= tolerance, error, tolerance


def choose_backends(spec: AttentionConfig, cases: list[AttentionCase]) -> list[Choice]:
    """One Choice per bucket, whose backend runs every case (kind of layer) of the bucket; raises
    AttentionPlanError naming the bucket when nothing can run it."""
    if (
        spec.backend == candidates.AUTO
    ):  # native until measured (``measure_choices``): what a plan for another chip holds
        native = registry.get(candidates.NATIVE)
        return [
            dataclasses.replace(
                choose_backend(bucket, native, spec.options_for(candidates.NATIVE), None, None),
                requested=candidates.AUTO,
            )
            for bucket in by_bucket(cases)
        ]
    requested = registry.get(spec.backend)
    fallback = registry.get(spec.fallback) if spec.fallback else None
    fallback_options = spec.options_for(spec.fallback) if spec.fallback else None
    return [
        choose_backend(bucket, requested, spec.options_for(spec.backend), fallback, fallback_options)
        for bucket in by_bucket(cases)
    ]


def replan(spec: AttentionConfig, planned: tuple[Choice, ...], platform: str) -> tuple[Choice, ...]:
    """The planned buckets' choices made again for ``platform`` (a worker whose platform is not the one the
    job was planned for): the same cases on that platform, chosen, and gated when ``spec.verify``."""
    cases = [dataclasses.replace(case, platform=platform) for choice in planned for case in choice.cases]
    choices = choose_backends(spec, cases)
    return tuple(gate(spec, choices) if spec.verify else choices)


def probe(spec: AttentionConfig, choice: Choice) -> None:
    """Run the chosen backend once on a probe batch of the bucket's shape: the output must have q's shape
    and dtype and be finite everywhere (padded rows too), so a broken backend fails before the real work.
    Parity with native is the gate's job (``attention.verify``); this check always runs, once per kind of layer."""
    import jax

    fn = bind_choice(spec, choice.backend)
    for case in choice.cases:
        q, k, v, kwargs = probe_inputs(case)
        where = f"attention backend {choice.backend!r} at bucket {case.seq_len}" + (
            f" ({case.features.describe()} layers)" if len(choice.cases) > 1 or case.features.of_layer().asked else ""
        )
        try:
            out = np.asarray(jax.block_until_ready(run_probe(fn, case, q, k, v, kwargs)))
        except Exception as e:  # noqa: BLE001  any crash of a backend on its own probe is a start-up failure
            raise AttentionPlanError(f"{where} failed on a probe batch: {type(e).__name__}: {e}") from e
        if out.shape != q.shape or out.dtype != q.dtype:
            raise AttentionPlanError(
                f"{where} returned {out.dtype}{list(out.shape)} for q of {q.dtype}"
                f"{list(q.shape)} (batch, seq, heads, head_dim); it must return q's shape, "
                "layout and dtype"
            )
        if not np.all(np.isfinite(out.astype(np.float32))):
            raise AttentionPlanError(
                f"{where} returned non-finite values on a probe batch (NaN or inf); refusing to write such embeddings"
            )


def bind_choice(spec: AttentionConfig, backend_name: str):
    """The AttentionFn for a backend of this spec (or an auto candidate, ``flash[chunked]``), with its options."""
    return candidates.bind(spec, backend_name)


def gate(spec: AttentionConfig, choices: list) -> list:
    """The parity gate: each bucket's chosen backend against native on a probe batch, before real work."""
    native = registry.get("native").bind()
    gated = []
    for choice in choices:
        if choice.backend == "native" or choice.measurement is not None:  # auto held its choice to native already
            gated.append(choice)
            continue
        ok, error, tolerance = verify(choice, bind_choice(spec, choice.backend), native, spec.verify_tolerance)
        if ok:
            gated.append(choice)
            continue
        reason = (
            f"parity gate: {choice.backend} differs from native by {error:.3g} > {tolerance:.3g} "
            f"at bucket {choice.case.seq_len}"
        )
        if spec.on_mismatch == "fail" or not spec.fallback or spec.fallback == choice.backend:
            raise AttentionPlanError(
                f"{reason}; refusing to run (attention.on_mismatch={spec.on_mismatch!r}, "
                f"attention.fallback={spec.fallback!r})"
            )
        support = ask_all(registry.get(spec.fallback), choice.cases, spec.options_for(spec.fallback))
        if not support.ok:
            raise AttentionPlanError(
                f"{reason}, and attention.fallback {spec.fallback!r} cannot run it either: {support.reason}"
            )
        log.warning("%s; falling back to %s", reason, spec.fallback)
        gated.append(dataclasses.replace(choice, backend=spec.fallback, kernel=support.kernel, fallback_reason=reason))
    return gated
