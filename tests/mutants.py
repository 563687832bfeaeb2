"""Hand mutants of the code the fast suite must guard (packing, masks, positions, pooling, the commit): each is
put into the source, the fast suite's files that guard that code run (``-m "not extra and not full"``, stopping
at the first failure), and the source is put back. A mutant the files do not catch is a hole in the suite.

    .venv/bin/python tests/mutants.py            # every mutant; exit 1 if any survives
    .venv/bin/python tests/mutants.py packing    # those whose name holds "packing"

Not a test file (pytest does not collect it): a mutant per run of pytest is minutes, not a unit test's seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL_TESTS = (
    "tests/packed_encoding_test.py",
    "tests/encoder_test.py",
    "tests/pool_test.py",
    "tests/attention_parity_test.py",
)
COMMIT_TESTS = ("tests/commit_test.py", "tests/transaction_test.py", "tests/crash_test.py", "tests/output_test.py")

# (name, file, the text as it is, the mutant, the test files that must catch it)
MUTANTS = (
    (
        "packing: windows of a row overlap (start not advanced)",
        "pipeline/stages/packer.py",
        "            start += w.length\n",
        "            start += 0 * w.length\n",
        ("tests/packing_test.py", *MODEL_TESTS),
    ),
    (
        "packing: one segment id for every window of a row",
        "pipeline/stages/packer.py",
        "segment_ids_BxT[r, start:start + w.length] = k + 1",
        "segment_ids_BxT[r, start:start + w.length] = 1",
        ("tests/packing_test.py", *MODEL_TESTS),
    ),
    (
        "packing: slot lengths off by one",
        "pipeline/stages/packer.py",
        "slot_lengths_BxK[r, k] = w.length",
        "slot_lengths_BxK[r, k] = w.length + 1",
        ("tests/packing_test.py", *MODEL_TESTS),
    ),
    (
        "masks: padding keys attended (unpacked rows)",
        "attention/native.py",
        "valid_BxTxS = (jnp.arange(s)[None, :] < kv_lengths_B[:, None])[:, None, :]",
        "valid_BxTxS = (jnp.arange(s)[None, :] < s + 0 * kv_lengths_B[:, None])[:, None, :]",
        MODEL_TESTS,
    ),
    (
        "masks: packed windows see each other",
        "attention/native.py",
        "valid_BxTxS = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]",
        "valid_BxTxS = (segment_ids_BxT[:, :, None] > 0) | (segment_ids_BxT[:, None, :] >= 0)",
        MODEL_TESTS,
    ),
    (
        "positions: packed windows do not restart their positions",
        "models/families/blocks.py",
        "        positions_BxT = segment_positions(segment_ids_BxT)\n",
        "        positions_BxT = jnp.broadcast_to(jnp.arange(ids_BxT.shape[1], dtype=jnp.int32)[None, :], "
        "ids_BxT.shape)\n",
        MODEL_TESTS,
    ),
    (
        "positions: restart one token late",
        "models/families/blocks.py",
        "    return index_T[None, :] - start_BxT\n",
        "    return jnp.maximum(index_T[None, :] - start_BxT - 1, 0)\n",
        MODEL_TESTS,
    ),
    (
        "pooling: mean over the padded length",
        "models/encoder.py",
        "    return summed_BxD / jnp.maximum(lengths_B, 1)[:, None].astype(jnp.float32)",
        "    return summed_BxD / hidden_BxTxD.shape[1]",
        MODEL_TESTS,
    ),
    (
        "pooling: mean includes padding tokens",
        "models/encoder.py",
        "    mask_BxT = jnp.arange(hidden_BxTxD.shape[1])[None, :] < lengths_B[:, None]",
        "    mask_BxT = jnp.arange(hidden_BxTxD.shape[1])[None, :] >= 0 * lengths_B[:, None]",
        MODEL_TESTS,
    ),
    (
        "pooling: packed slots divided by the row's length",
        "models/encoder.py",
        "    return summed_BxKxD / jnp.maximum(slot_lengths_BxK, 1)[..., None].astype(jnp.float32)",
        "    return summed_BxKxD / jnp.maximum(slot_lengths_BxK.sum(-1, keepdims=True), 1)[..., None]"
        ".astype(jnp.float32)",
        MODEL_TESTS,
    ),
    (
        "commit: pointers written before the files are moved",
        "pipeline/store/transaction.py",
        "        if storage.exists(source) or not storage.exists(target):  # a retried commit may have moved it\n"
        "            storage.rename(source, target)\n    fence.commit_point()\n",
        "        pass\n    fence.commit_point()\n",
        COMMIT_TESTS,
    ),
    # Not a mutant here: dropping the proof of the lock before each move. A run taken over while paused finds
    # its staging folder already cleaned by the run that took over (recovery comes first), so its next move
    # fails either way; the proof only narrows the window. It survives every test, as an equivalent mutant must.
    (
        "commit: recovery leaves the temporary files of killed writes",
        "pipeline/store/transaction.py",
        "        delete_inside(output, list(state.leftovers))\n",
        "        delete_inside(output, [])\n",
        COMMIT_TESTS,
    ),
    (
        "commit: the previous run's files are kept",
        "pipeline/store/transaction.py",
        "    delete_inside(output, [storage.join(output, rel) for rel in replaced])\n",
        "    delete_inside(output, [])\n",
        COMMIT_TESTS,
    ),
    (
        "commit: a pointer written unconditionally",
        "pipeline/store/transaction.py",
        "        if not versioned.write_if(storage.join(output, name), _pointer(intent, name), versions[name][1]):",
        "        if not versioned.write_if(storage.join(output, name), _pointer(intent, name), None):",
        COMMIT_TESTS,
    ),
)


def caught(path: str, before: str, after: str, tests: tuple[str, ...]) -> tuple[bool, float, str]:
    """Whether ``tests`` fail with ``before`` replaced by ``after`` in ``path``; the seconds, and the test that
    failed first."""
    full = os.path.join(REPO, path)
    source = open(full).read()
    if source.count(before) != 1:
        raise SystemExit(
            f"{path}: the mutated text is there {source.count(before)} times, not once: update "
            f"tests/mutants.py to the code"
        )
    started = time.perf_counter()
    try:
        with open(full, "w") as f:
            f.write(source.replace(before, after))
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:xdist",
                "-p",
                "no:cacheprovider",
                "-m",
                "not extra and not full",
                *tests,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    finally:
        with open(full, "w") as f:
            f.write(source)
    failed = next(
        (line.split(" ")[1] for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))),
        run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "",
    )
    return run.returncode != 0, time.perf_counter() - started, failed


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or any(word in m[0] for word in argv)]
    survivors = []
    for name, path, before, after, tests in chosen:
        ok, seconds, failed = caught(path, before, after, tests)
        print(
            f"{'caught  ' if ok else 'SURVIVED'} {seconds:5.0f} s  {name}" + (f"  ({failed})" if failed else ""),
            flush=True,
        )
        if not ok:
            survivors.append(name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants caught by the fast suite")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
