"""Which engine runs one (rows, bucket) shape, decided on its first batch, on the worker's own CPU.

1. OpenVINO's output is held to XLA's on that batch, as the job would write it (each window's vector, or a
   multi-vector head's kept tokens): in float32 the largest difference, relative to the output's scale, at most
   ``FLOAT32_TOLERANCE``; in bfloat16 the precision gate's measures (models/precision_gate.py: the lowest cosine,
   and recall@10 where the batch has enough vectors). A shape that fails runs on XLA, with the figures as reason.
2. ``runner.engine: openvino`` then runs OpenVINO. ``auto`` times both in turns (attention/on_chip.py, as the
   attention choice does) and runs OpenVINO only where it beats XLA by more than ``MIN_GAIN`` and the noise:
   reliability first. auto's verdict is cached beside the engine's models, keyed by the CPU too, so a scheduled
   job measures once; where the verdict was OpenVINO, parity is checked again on every start, since it costs one
   batch; where it was XLA, the next start neither exports nor compiles OpenVINO for the shape (shapes.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from typing import Any, Callable

import numpy as np

from docbeam.attention.measure import MIN_GAIN
from docbeam.attention.measure_key import device_kind
from docbeam.attention.on_chip import Runner, spread, time_in_turns
from docbeam.models.engines import OPENVINO, XLA
from docbeam.models.precision_gate import GATES, K, cosines, recall_at_k

FLOAT32_TOLERANCE = 1e-4  # of the output's largest magnitude (at least 1): XLA and OpenVINO order sums differently
BUDGET_S = 1.0  # seconds of timing per shape, after the warm calls (at least MIN_ROUNDS of each engine)
# A verdict whose two timings are noisier than this (a busy machine) runs, but is not cached: the next run measures.
CACHE_NOISE = 0.2
SLOW = 2.0  # an engine this many times slower on one warm call is not timed further
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What runs a shape and why, with the figures behind it (the timing record's ``engine``,
    ``engine_reason`` and, once per shape, ``engine_measured``)."""

    engine: str  # xla | openvino
    reason: str
    parity: str = ""  # the gate's figures on the first batch ('' where OpenVINO never ran)
    xla_ms: float | None = None
    openvino_ms: float | None = None
    cached: bool = False  # auto's timing read from the cache, not measured in this process

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def flat(outputs) -> np.ndarray:
    """A job's outputs for a batch as [N, D]: window vectors as they are, a multi-vector head's per-window lists
    of token vectors stacked."""
    if isinstance(outputs, list):
        return np.concatenate([np.asarray(o, np.float32).reshape(-1, np.shape(o)[-1]) for o in outputs])
    return np.asarray(outputs, np.float32).reshape(len(outputs), -1)


def parity(dtype: str, ours, reference) -> tuple[bool, str]:
    """(OpenVINO's outputs pass, the figures), against XLA's on the same batch."""
    ours_NxD, reference_NxD = flat(ours), flat(reference)
    if ours_NxD.shape != reference_NxD.shape:
        return False, f"shape {list(ours_NxD.shape)} vs XLA's {list(reference_NxD.shape)}"
    # A row XLA gives as non-finite is repaired or rejected downstream whichever engine ran; any other must be finite.
    finite = np.isfinite(reference_NxD).all(axis=1)
    if not np.isfinite(ours_NxD[finite]).all():
        return False, "non-finite outputs where XLA's are finite"
    ours_NxD, reference_NxD = ours_NxD[finite], reference_NxD[finite]
    if dtype == "float32":
        scale = max(1.0, float(np.abs(reference_NxD).max(initial=0.0)))
        error = float(np.abs(ours_NxD - reference_NxD).max(initial=0.0)) / scale
        return error <= FLOAT32_TOLERANCE, f"largest difference {error:.2e} of scale (at most {FLOAT32_TOLERANCE:g})"
    figures = {"lowest cosine": float(cosines(ours_NxD, reference_NxD).min(initial=1.0))}
    if len(reference_NxD) > K:
        figures["recall@10"] = recall_at_k(ours_NxD, reference_NxD)
    failed = [name for name, value in figures.items() if value < GATES[name]]
    text = ", ".join(f"{name} {value:.5f}" for name, value in figures.items())
    return not failed, text + (f" (below {', '.join(f'{n} {GATES[n]}' for n in failed)})" if failed else "")


def noise(xla_s: list[float], openvino_s: list[float]) -> float:
    """The two timings' spread as a share of XLA's median."""
    return (spread(xla_s) + spread(openvino_s)) / statistics.median(xla_s)


def pick(xla_s: list[float], openvino_s: list[float]) -> tuple[str, str]:
    """auto's engine from the two engines' timings: OpenVINO only where it beats XLA by more than MIN_GAIN and
    the two measurements' noise."""
    xla, ov = statistics.median(xla_s), statistics.median(openvino_s)
    floor = max(MIN_GAIN, noise(xla_s, openvino_s))
    speedup = xla / ov
    if 1 - ov / xla <= floor:
        return XLA, f"auto: OpenVINO at {speedup:.2f}x XLA is not faster by more than {floor:.0%}"
    return OPENVINO, f"auto: OpenVINO {speedup:.2f}x XLA"


class VerdictCache:
    """auto's timings as JSON files named by their key under the engine cache's ``verdicts/``. Only saves
    time: an unreadable entry is measured again, an unwritable folder is a warning."""

    def __init__(self, folder: str):
        self.folder = os.path.join(folder, "verdicts")

    def read(self, key: str) -> Verdict | None:
        path = os.path.join(self.folder, f"{key}.json")
        try:
            if not os.path.exists(path):
                return None
            with open(path) as f:
                raw = json.load(f)
            return dataclasses.replace(Verdict(**raw), cached=True)
        except Exception as e:  # noqa: BLE001
            log.warning("engine verdict %s cannot be used (%s: %s); measuring again", path, type(e).__name__, e)
            return None

    def write(self, key: str, verdict: Verdict) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            path = os.path.join(self.folder, f"{key}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(verdict.as_dict(), f, indent=1, sort_keys=True)
            os.replace(path + ".tmp", path)
        except Exception as e:  # noqa: BLE001
            log.warning("engine verdict cannot be cached under %s (%s: %s)", self.folder, type(e).__name__, e)


def _seconds(run: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def verdict_key(export_key: str, dtype: str) -> str:
    """auto's timing holds for one exported model at one precision on one CPU, at this process's thread count.
    The dtype is not in the export key: float32 and bfloat16 jobs export the same float32 graph, but OpenVINO
    compiles it to different kernels, so each precision is timed against XLA's for itself."""
    from docbeam.models.engines.openvino import threads

    return hashlib.sha256(f"{export_key}|{dtype}|{device_kind()}|{threads()}".encode()).hexdigest()[:24]


def decide(
    requested: str,
    dtype: str,
    run_xla: Callable[[], Any],
    run_openvino: Callable[[], Any],
    outputs: Callable[[Any], Any],
    cache: VerdictCache | None,
    key: str,
) -> Verdict:
    """The engine for one shape, on its first batch: ``run_*`` run the batch on each engine (blocking),
    ``outputs`` turns a forward's result into what the job writes."""
    reference = outputs(run_xla())
    try:
        ours = outputs(run_openvino())
    except Exception as e:  # noqa: BLE001  a model that compiled but cannot run refuses only its shape
        return Verdict(
            XLA, f"OpenVINO failed on the first batch ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        )
    passed, figures = parity(dtype, ours, reference)
    if not passed:
        return Verdict(XLA, f"OpenVINO refused: parity with XLA {figures}", parity=figures)
    if requested == OPENVINO:
        return Verdict(OPENVINO, "runner.engine: openvino", parity=figures)
    cached = cache.read(key) if cache is not None else None
    if cached is not None:
        return dataclasses.replace(cached, parity=figures)
    # One warm call each first: an engine several times slower (emulated precision) is not timed for rounds.
    once = {name: _seconds(run) for name, run in ((XLA, run_xla), (OPENVINO, run_openvino))}
    if once[OPENVINO] > SLOW * once[XLA]:
        verdict = Verdict(
            XLA,
            f"auto: OpenVINO at {once[XLA] / once[OPENVINO]:.2f}x XLA on one call",
            parity=figures,
            xla_ms=round(once[XLA] * 1e3, 3),
            openvino_ms=round(once[OPENVINO] * 1e3, 3),
        )
        if cache is not None:
            cache.write(key, verdict)
        return verdict
    samples = time_in_turns([Runner(XLA, [run_xla]), Runner(OPENVINO, [run_openvino])], BUDGET_S)
    engine, reason = pick(samples[XLA], samples[OPENVINO])
    verdict = Verdict(
        engine,
        reason,
        parity=figures,
        xla_ms=round(statistics.median(samples[XLA]) * 1e3, 3),
        openvino_ms=round(statistics.median(samples[OPENVINO]) * 1e3, 3),
    )
    if cache is not None and noise(samples[XLA], samples[OPENVINO]) <= CACHE_NOISE:
        cache.write(key, verdict)
    return verdict
