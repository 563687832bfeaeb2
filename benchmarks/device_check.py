"""The first light on a lent GPU: attention (every backend and flash kernel against native) and the whole
encoder (beside sentence-transformers, as a share of the chip's matmul rate), in one process, one results JSON.

    bash benchmarks/device_check.sh run WHEELS [--small]   # what the lease runs (installs the carried wheels)
    python benchmarks/device_check.py --out FILE [--small] [--budget-s 400]

Written for the machine as it stands: only the encoder and attention packages of docbeam, no Apache Beam, no
registry. The results file is rewritten after each part, so a lease cut short still leaves what ran. Exit 1
when docbeam pulled Beam in or any row holds an error (a refusal is an answer, not an error); 0 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # grown on demand: other rows' memory stays free
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

PACKAGES = ("jax", "jaxlib", "flax", "tokamax", "pydantic", "torch", "transformers", "sentence-transformers",
            "docbeam", "apache-beam")
ATTENTION_SHARE = 0.6  # of the budget: attention's rows first, the encoder's in the rest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the results JSON")
    p.add_argument("--small", action="store_true", help="tiny sizes: the CPU rehearsal of the same code")
    p.add_argument("--budget-s", type=float, default=400.0, help="seconds for both parts; rows past it are "
                                                                  "recorded as skipped (default %(default)s)")
    return p.parse_args(argv)


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def describe_machine() -> dict:
    import jax

    import docbeam
    import docbeam.attention  # noqa: F401  (the two packages the check runs, imported before Beam could be)
    import docbeam.models.encoder  # noqa: F401

    return {"python": platform.python_version(), "versions": versions(), "docbeam_from": docbeam.__file__,
            "beam_imported": any(m == "apache_beam" or m.startswith("apache_beam.") for m in sys.modules),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind}


def errors(rows: list[dict]) -> list[dict]:
    """The rows that failed: an error of the row or of one of its sides."""
    return [r for r in rows if "error" in r or any(isinstance(v, dict) and "error" in v for v in r.values())]


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    results = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "small": args.small,
               "budget_s": args.budget_s, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}

    def save(**parts):
        results.update(parts, seconds=round(time.time() - started, 1))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    save(machine=describe_machine())
    import device_attention
    import device_encoder

    save(attention=device_attention.run(args.small, started + ATTENTION_SHARE * args.budget_s,
                                        lambda rows: save(attention=rows)))
    rate = device_encoder.matmul_rate(args.small)
    save(bf16_matmul=rate)
    save(encoder=device_encoder.run(args.small, started + args.budget_s, rate))
    failed = errors(results["attention"]) + errors(results["encoder"])
    ran = sum(1 for r in results["attention"] if "seconds" in r)
    print(f"device_check: {ran} attention rows ran, {len(failed)} failed, {len(results['encoder'])} encoder rows, "
          f"{results['seconds']} s -> {args.out}")
    for row in failed:
        print(f"device_check: failed: {json.dumps(row)[:600]}", file=sys.stderr)
    if results["machine"]["beam_imported"]:
        print("device_check: importing docbeam.attention and docbeam.models pulled in apache_beam; they must "
              "import without it (the lent machine has none)", file=sys.stderr)
    return 1 if failed or results["machine"]["beam_imported"] else 0


if __name__ == "__main__":
    sys.exit(main())
