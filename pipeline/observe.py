"""What every batch reports about the process it ran in (compilations, memory, device, worker), and the names
the job's metrics are reported under."""
from __future__ import annotations

import os
import resource
import socket
import threading

import psutil

ENCODER_FN_NAME = "docbeam_embed"  # the jitted forward's name, as jax.monitoring reports it
METRICS_NAMESPACE = "docbeam"  # every Beam counter and distribution of the job; the summary queries it


def fallback_key(requested: str, ran: str, reason: str) -> str:
    """How a fallback is named in summary.json, the report and the Beam counter ``fallbacks[...]``."""
    return f"{requested}->{ran}: {reason}"


class CompileWatch:
    """Counts lowerings of the encoder's jitted forward (a jit cache miss: a new shape or backend).

    jax.monitoring reports every compilation with the function's name, so this measures what XLA did
    instead of inferring it from shapes we have seen.
    """

    _instance = None
    _lock = threading.Lock()

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs):
        if kwargs.get("fun_name") != f"jit({ENCODER_FN_NAME})":
            return
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1
        if event in ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration"):
            self.seconds += duration

    @classmethod
    def get(cls) -> "CompileWatch":
        with cls._lock:
            if cls._instance is None:
                cls._instance = CompileWatch()
            return cls._instance


def memory(device) -> dict:
    """Device memory where the platform reports it (GPU/TPU), host RSS otherwise (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        return {"memory_in_use_bytes": int(stats["bytes_in_use"]),
                "memory_peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
                "memory_source": "device"}
    return {"memory_in_use_bytes": psutil.Process().memory_info().rss,
            "memory_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory_source": "host_rss"}


def describe_device(device) -> str:
    return f"{device.platform}:{device.id} ({getattr(device, 'device_kind', '')})"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
