"""The first light on a lent GPU: attention (every backend and flash kernel against native) and the whole
encoder (beside sentence-transformers, as a share of the chip's matmul rate), one process per part, one results JSON.

    bash benchmarks/device_check.sh run WHEELS [--small]   # what the lease runs (installs the carried wheels)
    python benchmarks/device_check.py --part attention|encoder --out FILE [--small] [--budget-s 200]

Written for the machine as it stands: only the encoder and attention packages of docbeam, no Apache Beam, no
registry. The results file is rewritten after each case, so a lease cut short still leaves what ran. Exit 1
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

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "tokamax",
    "pydantic",
    "torch",
    "transformers",
    "sentence-transformers",
    "docbeam",
    "apache-beam",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part",
        required=True,
        choices=("attention", "encoder"),
        help="one part per process, so that the memory JAX's allocator keeps after attention's 32k-token "
        "rows is not missing from torch's side of the encoder part",
    )
    p.add_argument("--out", required=True, help="the results JSON; a part adds its keys to what is there")
    p.add_argument("--small", action="store_true", help="tiny sizes: the CPU rehearsal of the same code")
    p.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="seconds for the part; rows past it are recorded as skipped (default %(default)s)",
    )
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

    return {
        "python": platform.python_version(),
        "versions": versions(),
        "docbeam_from": docbeam.__file__,
        "beam_imported": any(m == "apache_beam" or m.startswith("apache_beam.") for m in sys.modules),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }


def errors(rows: list[dict]) -> list[dict]:
    """The rows that failed: an error of the row or of one of its sides."""
    return [r for r in rows if "error" in r or any(isinstance(v, dict) and "error" in v for v in r.values())]


def main(argv=None) -> int:
    """One part into ``--out``, beside what the other part left there."""
    args = parse_args(argv)
    started = time.time()
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.setdefault("commands", []).append(" ".join([os.path.basename(sys.executable), *sys.argv]))

    def save(**parts):
        results.update(parts)
        results.setdefault("seconds", {})[args.part] = round(time.time() - started, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    deadline = started + args.budget_s
    save(small=args.small, machine=describe_machine())
    if args.part == "attention":
        import device_attention

        save(attention=device_attention.run(args.small, deadline, lambda rows: save(attention=rows)))
    else:
        import device_encoder

        rate = device_encoder.matmul_rate(args.small)
        save(bf16_matmul=rate)
        save(encoder=device_encoder.run(args.small, deadline, rate, lambda rows: save(encoder=rows)))
    rows = results[args.part]
    failed = errors(rows)
    print(
        f"device_check: {args.part}: {sum(1 for r in rows if 'skipped' not in r)} rows, {len(failed)} failed, "
        f"{results['seconds'][args.part]} s -> {args.out}"
    )
    for row in failed:
        print(f"device_check: failed: {json.dumps(row)[:600]}", file=sys.stderr)
    if results["machine"]["beam_imported"]:
        print(
            "device_check: importing docbeam.attention and docbeam.models pulled in apache_beam; they must "
            "import without it (the lent machine has none)",
            file=sys.stderr,
        )
    return 1 if failed or results["machine"]["beam_imported"] else 0


if __name__ == "__main__":
    sys.exit(main())
