"""Long context: one sequence of 32,768 tokens through a rotary (RoFormer) encoder, flash and chunked vs
native, each in its own subprocess under a memory cap so native's O(T²) scores cannot take the machine down.

The encoder is a random RoFormer written by transformers itself (no download): 2 layers, hidden 128,
4 heads of 32. Run: python benchmarks/long_context.py [--quick] [--length 32768] [--mem-cap-gb 20]
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

common.bootstrap()

LAYERS, HIDDEN, HEADS = 2, 128, 4


def write_checkpoint(folder: str) -> str:
    sys.path.insert(0, os.path.join(common.REPO, "tests"))
    from conftest import write_tiny_checkpoint
    from models.checkpoint import resolve_dir

    return write_tiny_checkpoint(folder, resolve_dir(common.DEFAULT_MODEL), layers=LAYERS, hidden=HIDDEN,
                                 heads=HEADS, rope=True)


def run_case(checkpoint: str, backend: str, length: int) -> dict:
    """In the child: encode one sequence of ``length`` tokens; time, peak RSS, finiteness."""
    import jax
    import numpy as np

    import attention
    from models import checkpoint as ckpt
    from models import encoder

    ck = ckpt.open_checkpoint(checkpoint)
    params = ckpt.load_params(ck.folder, ck.config)
    embed = jax.jit(encoder.embed_fn(ck.config, attention.get(backend).bind(), "mean"))
    ids = np.random.default_rng(0).integers(1000, 30000, (1, length)).astype(np.int32)
    lengths = np.array([length], np.int32)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = np.asarray(embed(params, ids, lengths))
    seconds = time.perf_counter() - t0
    return {"backend": backend, "length": length, "status": "ok", "seconds": round(seconds, 2),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "growth_gb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 2**20, 2),
            "finite": bool(np.isfinite(out).all())}


def spawn(checkpoint: str, backend: str, length: int, cap_gb: float, timeout: float) -> dict:
    def limit():
        cap = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    cmd = [sys.executable, __file__, "--child", checkpoint, backend, str(length)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "length": length, "status": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
    return {"backend": backend, "length": length, "status": f"failed under the {cap_gb:g} GB cap: {tail}"}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(run_case(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return 0
    p = common.parser(__doc__)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--backends", default="flash,chunked,native")
    p.add_argument("--mem-cap-gb", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    length = 2048 if args.quick else args.length
    info = common.machine(with_jax=False)
    common.print_machine("long context: one sequence through a rotary encoder", info)
    scores_gb = 2 * HEADS * length * length * 4 / 2**30  # logits and probabilities, float32, per layer
    print(f"RoFormer {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads; one sequence of {length} tokens; "
          f"native materialises ~{scores_gb:.1f} GB of scores per layer; cap {args.mem_cap_gb:g} GB per case\n")
    results = []
    with tempfile.TemporaryDirectory(prefix="docbeam-long-") as tmp:
        checkpoint = write_checkpoint(os.path.join(tmp, "roformer"))
        for backend in args.backends.split(","):
            results.append(spawn(checkpoint, backend, length, args.mem_cap_gb, args.timeout))
            print(f"  {backend}: {results[-1]}", flush=True)
    rows = [[r["backend"], r["length"], r["status"], r.get("seconds", "—"), r.get("peak_rss_gb", "—"),
             r.get("finite", "—")] for r in results]
    print("\n" + common.table(["backend", "tokens", "status", "seconds", "peak RSS GB", "finite"], rows))
    common.write_results(args, "long_context", {"machine": info, "length": length,
                                                         "scores_gb_per_layer": scores_gb, "results": results})
    return 0 if any(r["status"] == "ok" and r["backend"] != "native" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
