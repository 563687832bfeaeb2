"""``attention.backend: auto``: per bucket, the candidate measured correct and fastest on this worker's chip runs.

Why measured rather than ruled: which kernel wins moves with the length, the platform, the chip and every library
upgrade (on the CPU chunked attention beats native at 8k and loses at 128), and a kernel is worth running only
where it is proven. So for each bucket every candidate is

1. asked its capability check (a refusal is recorded with its reason),
2. run on the bucket's real per-chip shape (the rows one chip gets, the heads one chip holds) and held to native's
   output on the same inputs, at the parity gate's tolerance for the dtype: a candidate that raises, returns the
   wrong shape, or differs is never run, whatever its speed, and is recorded with its error,
3. timed warm, in turns with the others (so drift of a shared machine falls on every candidate alike), until the
   bucket's measuring budget is spent,

and the fastest that passed runs, unless it beats native by less than ``MIN_GAIN`` or than the noise of the two
measurements: then native runs (reliability first). A model with several kinds of layer (ModernBERT's global and
local) is timed as one call of each kind.

A measurement is cached (pipeline/stages/measurement_cache.py, beside the compilation cache), keyed by what can change the answer: the chip, the library versions,
the shapes, the candidates and their code. A scheduled job measures once; a library upgrade measures again. A
choice read from the cache is held to native once more before it runs, so a stale or tampered file cannot put a
wrong kernel to work.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
import typing

import numpy as np

from docbeam.attention import registry
from docbeam.attention.candidates import NATIVE, bind, check_label, default_candidates, options_of, split_label
from docbeam.attention.dispatch import (
    AttentionPlanError,
    Choice,
    ask_all,
    default_tolerance,
    max_abs_error,
)
from docbeam.attention.interface import AttentionCase, Support
from docbeam.attention.measure_key import cache_key, device_kind
from docbeam.attention.on_chip import (
    Inputs,
    Runner,
    check_output,
    chip_case,
    free_memory_bytes,
    native_scores_bytes,
    spread,
    time_in_turns,
)

log = logging.getLogger(__name__)

# A candidate must beat native by this share of native's time, and by more than the two measurements' noise.
MIN_GAIN = 0.05
# Seconds of timing per bucket, after compiling (at least attention/on_chip.py's MIN_ROUNDS of each candidate).
BUDGET_S = 1.0
# Native's score tensors above this share of the chip's free memory are not materialised to time it (a CPU would be
# killed, not raise): native is then refused for timing with the figure, and its parity reference is computed a few
# heads at a time.
NATIVE_MEMORY_SHARE = 0.25

VERDICTS = ("chosen", "passed", "mismatch", "failed", "refused")


# --- what a measurement records -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate at one bucket: its verdict and the figures behind it."""

    candidate: str
    verdict: str  # one of VERDICTS
    kernel: str = ""
    time_ms: float | None = None  # median per call, over the kinds of layer
    spread_ms: float | None = None  # median absolute deviation of the samples
    error: float | None = None  # largest difference from native over valid rows
    reason: str = ""

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The candidates of one bucket, measured on one kind of chip, and which runs."""

    bucket: int
    rows: int  # rows per chip it was timed at
    device: str  # the chip's kind (and on CPU its model), as ``device_kind`` says
    chosen: str
    why: str
    trials: tuple[Trial, ...]
    tolerance: float
    # How this process came by it, not what it says: two jobs of one process that chose alike share a warm encoder.
    measure_s: float = dataclasses.field(compare=False)  # seconds spent measuring this bucket; 0 when read
    cached: bool = dataclasses.field(default=False, compare=False)
    key: str = dataclasses.field(default="", compare=False)

    def trial(self, candidate: str) -> Trial:
        return next(t for t in self.trials if t.candidate == candidate)

    def as_dict(self) -> dict:
        return {
            "chosen": self.chosen,
            "why": self.why,
            "device": self.device,
            "rows_per_chip": self.rows,
            "tolerance": self.tolerance,
            "measure_s": round(self.measure_s, 3),
            "cached": self.cached,
            "key": self.key,
            "candidates": {
                t.candidate: {k: v for k, v in t.as_dict().items() if k != "candidate"} for t in self.trials
            },
        }

    @classmethod
    def from_dict(cls, bucket: int, raw: dict) -> "Measurement":
        """The inverse of ``as_dict`` for a cache file; raises (KeyError, TypeError, ValueError) on anything
        malformed, so a damaged file is re-measured rather than trusted."""
        trials = []
        for candidate, t in raw["candidates"].items():
            if not isinstance(t, dict) or t.get("verdict") not in VERDICTS:
                raise ValueError(f"candidate {candidate!r}: no valid verdict")
            figures = {k: t.get(k) for k in ("time_ms", "spread_ms", "error")}
            for k, v in figures.items():
                if v is not None and not isinstance(v, (int, float)):
                    raise TypeError(f"candidate {candidate!r}: {k} is not a number")
            trials.append(
                Trial(
                    str(candidate), t["verdict"], str(t.get("kernel", "")), **figures, reason=str(t.get("reason", ""))
                )
            )
        chosen = [t.candidate for t in trials if t.verdict == "chosen"]
        if chosen != [raw["chosen"]]:
            raise ValueError("the chosen candidate is not the one trial marked chosen")
        return cls(
            bucket,
            int(raw["rows_per_chip"]),
            str(raw["device"]),
            str(raw["chosen"]),
            str(raw["why"]),
            tuple(trials),
            float(raw["tolerance"]),
            0.0,
        )

    def describe(self) -> str:
        """One line per candidate, for ``docbeam validate`` and the logs."""
        cached = ", read from the measurement cache" if self.cached else ""
        lines = [
            f"bucket {self.bucket} on {self.device}, {self.rows} rows per chip: {self.chosen} ({self.why}{cached})"
        ]
        for t in self.trials:
            figures = [f"{t.time_ms:.3f} ms ± {t.spread_ms or 0:.3f}" if t.time_ms is not None else ""]
            figures.append(f"error {t.error:.2g}" if t.error is not None else "")
            lines.append(
                f"    {t.candidate:24s} {t.verdict:8s} "
                + "  ".join(f for f in figures if f)
                + (f"  {t.reason}" if t.reason else "")
            )
        return "\n".join(lines)


# --- choosing from measured trials (pure) ----------------------------------------------------------------------


def pick(trials: list[Trial], min_gain: float = MIN_GAIN) -> tuple[str, str]:
    """(the candidate that runs, why), from trials whose verdict is "passed" or not yet decided. The fastest that
    passed; native where the fastest beats it by less than ``min_gain`` or than the noise of the two."""
    passed = [t for t in trials if t.verdict == "passed" and t.time_ms is not None]
    if not passed:
        return "", "no candidate passed"
    fastest = min(passed, key=lambda t: t.time_ms)
    native = next((t for t in passed if t.candidate == NATIVE), None)
    if native is None:
        return fastest.candidate, "fastest that passed; native did not pass"
    if fastest.candidate == NATIVE:
        return NATIVE, "fastest"
    gain = 1 - fastest.time_ms / native.time_ms
    noise = ((fastest.spread_ms or 0) + (native.spread_ms or 0)) / native.time_ms
    speedup = native.time_ms / fastest.time_ms
    if gain <= max(min_gain, noise):
        return NATIVE, (
            f"a tie: {fastest.candidate} at {speedup:.2f}x native is within the noise "
            f"({max(min_gain, noise):.0%}); native runs"
        )
    return fastest.candidate, f"fastest: {speedup:.2f}x native"


def decided(trials: list[Trial], chosen: str) -> tuple[Trial, ...]:
    return tuple(dataclasses.replace(t, verdict="chosen") if t.candidate == chosen else t for t in trials)


# --- running a candidate -------------------------------------------------------------------------------------


def measure_bucket(
    spec,
    cases: tuple[AttentionCase, ...],
    rows: int,
    candidates: tuple[str, ...],
    device: str,
    budget_s: float | None = None,
) -> Measurement:
    """Every candidate checked, held to native and timed on the bucket's per-chip cases; see the module's doc."""
    import jax

    started = time.perf_counter()
    tolerance = spec.verify_tolerance or default_tolerance(cases[0].dtype)
    inputs = [Inputs.probe(case, rows) for case in cases]
    native = bind(spec, NATIVE)
    free, head_group = reference_heads(cases, rows)
    native_fits = head_group >= cases[0].num_heads
    references = [i.reference(native, head_group) for i in inputs]
    trials: list[Trial] = []
    runners: list[Runner] = []
    for label in dict.fromkeys((NATIVE, *candidates)):
        name, _ = split_label(label)
        if label == NATIVE and not native_fits:
            need = max(native_scores_bytes(c, rows) for c in cases)
            trials.append(
                Trial(
                    label,
                    "refused",
                    reason=f"its scores would take {need / 2**30:.1f} GiB of the chip's {free / 2**30:.1f} GiB free; "
                    "its output was computed a few heads at a time as the reference",
                )
            )
            continue
        try:
            support = ask_all(registry.get(name), cases, options_of(spec, label))
        except Exception as e:  # noqa: BLE001  a user's capability check may raise anything: a refusal here
            support = Support(ok=False, reason=f"its capability check raised {type(e).__name__}: {e}")
        if not support.ok:
            trials.append(Trial(label, "refused", reason=support.reason))
            continue
        fn = bind(spec, label)
        try:
            calls = [i.compiled(fn) for i in inputs]
            outs = [np.asarray(jax.block_until_ready(c())) for c in calls]
        except Exception as e:  # noqa: BLE001  any crash of a candidate on the bucket's shape refuses it
            trials.append(Trial(label, "failed", support.kernel, reason=f"{type(e).__name__}: {_line(e)}"))
            continue
        wrong = next((w for o, i in zip(outs, inputs) if (w := check_output(o, i))), "")
        if wrong:
            trials.append(Trial(label, "failed", support.kernel, reason=wrong + "; it must return q's shape and dtype"))
            continue
        error = max(max_abs_error(o, r, i.lengths) for o, r, i in zip(outs, references, inputs))
        if not error <= tolerance:
            trials.append(
                Trial(
                    label,
                    "mismatch",
                    support.kernel,
                    error=error if math.isfinite(error) else None,
                    reason=f"differs from native by {error:.3g} > {tolerance:.3g}"
                    if math.isfinite(error)
                    else "returned NaN or inf",
                )
            )
            continue
        trials.append(Trial(label, "passed", support.kernel, error=error))
        runners.append(Runner(label, calls, support.kernel))
    samples = time_in_turns(runners, budget_s or BUDGET_S) if len(runners) > 1 else {}
    timed = []
    for t in trials:
        s = samples.get(t.candidate)
        timed.append(
            dataclasses.replace(t, time_ms=round(statistics.median(s) * 1e3, 4), spread_ms=round(spread(s) * 1e3, 4))
            if s
            else t
        )
    if len(runners) == 1:  # nothing to time it against
        chosen, why = runners[0].label, "the only candidate that passed"
    else:
        chosen, why = pick(timed)
    if not chosen and not native_fits:  # native runs as it would have without auto (the memory plan sized it)
        chosen, why = NATIVE, "no candidate passed; native runs, untimed (too large to time here)"
    if not chosen:
        reasons = "; ".join(f"{t.candidate}: {t.verdict} ({t.reason})" for t in timed)
        raise AttentionPlanError(f"attention.backend auto: no candidate can run bucket {cases[0].seq_len}: {reasons}")
    return Measurement(
        cases[0].seq_len, rows, device, chosen, why, decided(timed, chosen), tolerance, time.perf_counter() - started
    )


def reference_heads(cases: tuple[AttentionCase, ...], rows: int) -> tuple[int | None, int]:
    """(the chip's free bytes, how many query heads native's reference may compute at once): every head where its
    scores fit ``NATIVE_MEMORY_SHARE`` of free memory, else a few at a time."""
    free = free_memory_bytes()
    if free is None or all(native_scores_bytes(c, rows) <= NATIVE_MEMORY_SHARE * free for c in cases):
        return free, cases[0].num_heads
    per_head = max(native_scores_bytes(c, rows) // c.num_heads for c in cases)
    return free, max(1, int(NATIVE_MEMORY_SHARE * free // per_head))


def recheck(spec, measurement: Measurement, cases: tuple[AttentionCase, ...], rows: int) -> str:
    """Why a cached choice must not run (it raises, or differs from native on the bucket's shape now), or "". Held
    at this job's tolerance and rows (never the file's own: a file could claim any), two rows at least."""
    if measurement.chosen == NATIVE:
        return ""
    import jax

    label = measurement.chosen
    try:
        check_label(label)
        support = ask_all(registry.get(split_label(label)[0]), cases, options_of(spec, label))
        if not support.ok:
            return f"its capability check refuses it now: {support.reason}"
        tolerance = spec.verify_tolerance or default_tolerance(cases[0].dtype)
        rows = max(rows, 2)
        inputs = [Inputs.probe(case, rows) for case in cases]
        native, fn = bind(spec, NATIVE), bind(spec, label)
        _, head_group = reference_heads(cases, rows)
        for i in inputs:
            out = np.asarray(jax.block_until_ready(i.compiled(fn)()))
            wrong = check_output(out, i)
            if wrong:
                return wrong
            error = max_abs_error(out, i.reference(native, head_group), i.lengths)
            if not error <= tolerance:
                return f"it differs from native by {error:.3g} > {tolerance:.3g}"
    except Exception as e:  # noqa: BLE001
        return f"it raised {type(e).__name__}: {_line(e)}"
    return ""


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


class Cache(typing.Protocol):
    """Where measurements are kept between processes (pipeline/stages/measurement_cache.py: beside the compilation
    cache): ``read`` gives None for a key it lacks or cannot use; neither may raise, the cache only saves time."""

    def read(self, key: str, bucket: int) -> Measurement | None: ...

    def write(self, measurement: Measurement) -> None: ...


_MEASURED: dict[str, Measurement] = {}  # once per process: the DirectRunner's driver and workers share it


def measured(
    spec,
    cases: tuple[AttentionCase, ...],
    rows: int,
    mesh,
    cache: "Cache",
    budget_s: float | None = None,
) -> Measurement:
    """This bucket's measurement on this process's chip: from the process, else from the cache (held to native
    again), else measured now and cached."""
    candidates = spec.candidates or default_candidates()
    chip_cases = tuple(chip_case(c, mesh.model) for c in cases)
    device = device_kind()
    key = cache_key(
        spec, chip_cases, rows, tuple(dict.fromkeys((NATIVE, *candidates))), device, mesh, min_gain=MIN_GAIN
    )
    if key in _MEASURED:  # measured by an earlier job of this process: this job spent nothing on it
        return dataclasses.replace(_MEASURED[key], cached=True, measure_s=0.0)
    found = cache.read(key, cases[0].seq_len)
    if found is not None and (found.rows != rows or found.chosen not in {NATIVE, *candidates}):
        log.warning("attention measurement %s is for other rows or candidates; measuring again", key)
        found = None
    strangers = sorted({t.candidate for t in found.trials} - {NATIVE, *candidates}) if found is not None else []
    if strangers:  # a cached file names only this job's candidates: nothing else is imported, let alone run
        log.warning(
            "attention measurement %s names candidates this job does not have %s; measuring again", key, strangers
        )
        found = None
    if found is not None:
        why_not = recheck(spec, found, chip_cases, rows)
        if why_not:
            log.warning("cached attention choice %s at bucket %s is not used: %s", found.chosen, found.bucket, why_not)
            found = None
    if found is None:
        found = dataclasses.replace(measure_bucket(spec, chip_cases, rows, candidates, device, budget_s), key=key)
        cache.write(found)
        log.info("attention measured: %s", found.describe())
    _MEASURED[key] = found
    return found


def measure_choices(spec, choices, rows_per_chip, mesh, cache: Cache) -> tuple[Choice, ...]:
    """Auto's choices still to be measured, measured on this process's chip: each bucket's chosen candidate, its
    kernel and the measurement. ``rows_per_chip(bucket)``: the rows one chip gets."""
    out = []
    for choice in choices:
        if not choice.to_measure:
            out.append(choice)
            continue
        found = measured(spec, choice.cases, rows_per_chip(choice.case.seq_len), mesh, cache)
        out.append(
            dataclasses.replace(
                choice, backend=found.chosen, kernel=found.trial(found.chosen).kernel, measurement=found
            )
        )
    return tuple(out)
