"""Child processes of the benchmarks: timed, watched for memory, their output's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common

GB = 1e9


def rss_tree(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def watched_subprocess(script: str, case: dict, timeout: float, cap_bytes: float, prefix: str) -> dict:
    """``script --case <json>`` in a child whose process tree's RSS is watched: killed over ``cap_bytes`` or
    past ``timeout``; the result is the last stdout line starting with ``prefix``, else why there is none."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--case", json.dumps(case)],
            stdout=out,
            stderr=err,
            cwd=common.REPO,
        )
        started, killed, peak_watch = time.monotonic(), None, 0
        while proc.poll() is None:
            rss = rss_tree(proc.pid)
            peak_watch = max(peak_watch, rss)
            if rss > cap_bytes:
                killed = f"killed: RSS {rss / GB:.1f} GB over the {cap_bytes / GB:.0f} GB cap"
            elif time.monotonic() - started > timeout:
                killed = f"timeout after {timeout:.0f} s"
            if killed:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.05)
        wall = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith(prefix)]
        if lines:
            result = json.loads(lines[-1][len(prefix) :])
        elif killed:
            result = {"status": killed}
        else:
            tail = err.read()[-400:].strip().replace("\n", " ")
            status = "killed (OOM killer?)" if proc.returncode == -9 else f"died: exit {proc.returncode}"
            result = {"status": status, "error": tail}
    result["subprocess_wall_s"] = round(wall, 2)
    result["watchdog_peak_rss_bytes"] = peak_watch
    return result


def timed_process(command: list[str], env: dict, log_path: str) -> tuple[float, int]:
    """Wall seconds from launch to exit; the process' output goes to ``log_path``."""
    with open(log_path, "w") as log:
        started = time.perf_counter()
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=common.REPO).returncode
        return time.perf_counter() - started, code


def load_average() -> float:
    """The 1-minute load average: another busy process on the machine slows whichever side it overlaps."""
    return round(os.getloadavg()[0], 2)


def tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
