"""Every rule of pipeline/ is written in one place that the others import. Each test states one rule
and names the one place; it fails when a module spells the rule out again.

Source rules are read from the code's string literals and f-strings (docstrings and comments may mention a
name; only code can disagree with the rule).
"""

from __future__ import annotations

import ast
import functools
import os

import numpy as np
import pytest
from conftest import REPO


@functools.lru_cache(maxsize=1)
def pipeline_modules() -> dict[str, ast.Module]:
    found = {}
    for folder, _, names in sorted(os.walk(os.path.join(REPO, "pipeline"))):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found[os.path.relpath(path, REPO)] = ast.parse(f.read())
    return found


def code_strings(tree: ast.Module) -> list[str]:
    """Every string literal and f-string (its literal parts joined, each value as ``{}``) that is not a
    docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    parts_of_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and id(node) not in parts_of_fstrings
        ):
            found.append(node.value)
    return found


def spelled_outside(owner: str, needles: tuple[str, ...]) -> list[str]:
    """``module: string`` for each code string outside ``owner`` that contains one of ``needles``."""
    return [
        f"{module}: {text!r}"
        for module, tree in pipeline_modules().items()
        if module != owner
        for text in code_strings(tree)
        if any(needle in text for needle in needles)
    ]


def test_only_store_paths_decides_whether_a_path_is_remote():
    """No ``startswith("gs://")``, ``"://" in path``, ``FileSystems.get_scheme(path)`` or ``len("gs://")``
    outside pipeline/store/paths.py: a path is remote or on GCS by is_remote/is_gcs, split by split_gcs."""

    def decides(node) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_scheme":
            return True
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            return "://" in str(node.args[0].value) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "startswith",
                "len",
                "removeprefix",
            )
        return (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Constant)
            and "://" in str(node.left.value)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
        )

    found = [
        f"{module}:{node.lineno}"
        for module, tree in pipeline_modules().items()
        if module != "pipeline/store/paths.py"
        for node in ast.walk(tree)
        if decides(node)
    ]
    assert found == [], "use pipeline.store.paths.is_remote, is_gcs or split_gcs"


def test_is_remote_agrees_with_the_filesystems_that_open_the_path():
    from apache_beam.io.filesystems import FileSystems

    from docbeam.pipeline.store.paths import is_gcs, is_remote, split_gcs

    for path in (
        "gs://b/a.jsonl",
        " gs://b/x",
        "s3://b/k",
        "hdfs://h/p",
        "/abs/in.jsonl",
        "rel/in.jsonl",
        "C:\\data\\x",
        "pkg:gt/model",
        "a/b://c",
        "~/corpus/*.jsonl",
    ):
        assert is_remote(path) == (FileSystems.get_scheme(path) is not None), path
    assert is_gcs("gs://b/a") and not is_gcs("s3://b/a")
    assert split_gcs("gs://bucket/runs/day/x.json") == ("bucket", "runs/day/x.json")
    assert split_gcs("gs://bucket") == ("bucket", "")


def test_the_output_folder_layout_is_named_only_in_store_output():
    from docbeam.pipeline.store import output

    names = (output.STAGING, output.MANIFEST, output.SUCCESS, output.SUMMARY, output.INTENT, output.MARKER, output.LOCK)
    folders = tuple(f"{name}/" for name in (output.EMBEDDINGS, output.ERRORS, output.TIMING, output.PROFILES))
    found = spelled_outside("pipeline/store/output.py", names + folders)
    assert [f for f in found if " " not in f.split(": ", 1)[1]] == [], "import the name from pipeline.store.output"
    assert output.part_prefix("gs://b/out/", output.TIMING, "r1") == "gs://b/out/timing/part-r1"
    assert output.carries_run("timing/part-r1-00000-of-00001.jsonl", "r1")
    assert output.in_folder("embeddings/part-r1-0.parquet", output.EMBEDDINGS)
    assert not output.in_folder("embeddings_old/part-r1-0.parquet", output.EMBEDDINGS)


def test_every_placeholder_is_spelled_only_in_driver_placeholders():
    from docbeam import placeholders

    needles = (*placeholders.PATH_PLACEHOLDERS, *placeholders.PROFILE_PLACEHOLDERS, "YOUR_BUCKET", "YOUR_PROJECT")
    assert spelled_outside("docbeam/placeholders.py", needles) == []
    for placeholder in placeholders.PATH_PLACEHOLDERS:  # a new one is filled, or this fails
        filled = placeholders.fill(f"gs://b/{placeholder}/x", "20261130T114500Z-3f9a1c", "2026-11-30")
        assert "{" not in filled, placeholder
        assert placeholders.without_path_placeholders(f"out/{placeholder}") == "out/"


def test_exit_status_2_is_decided_by_refused_alone():
    """A handler that returns 2 catches docbeam.errors.Refused and nothing else: a new start-time check gets
    exit 2 by its base class, never by joining a list of exception types."""
    wrong = []
    for module, tree in pipeline_modules().items():
        for handler in ast.walk(tree):
            if not isinstance(handler, ast.ExceptHandler):
                continue
            returns_2 = any(
                isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value == 2
                for n in ast.walk(ast.Module(body=handler.body, type_ignores=[]))
            )
            caught = ast.unparse(handler.type) if handler.type else "everything"
            if returns_2 and caught != "Refused":
                wrong.append(f"{module}:{handler.lineno} except {caught}: return 2")
    assert wrong == []


def test_metric_names_are_formatted_and_read_back_only_through_observe():
    from docbeam.pipeline.telemetry.observe import (
        COMPILE_MS,
        DOCS_REJECTED,
        FALLBACKS,
        STAGE_US,
        fallback_key,
        labelled,
        metric_name,
        parse_metric_name,
        shape_label,
    )

    labels = {
        STAGE_US: "read",
        DOCS_REJECTED: "malformed_json",
        COMPILE_MS: shape_label(8, 128, "native"),
        FALLBACKS: fallback_key("flash", "native", "bucket 64 [seq < block_q]"),
    }
    for family, label in labels.items():
        assert parse_metric_name(metric_name(family, label)) == (family, label)
    assert parse_metric_name("docs_read") == ("docs_read", None)
    counters = {
        metric_name(STAGE_US, "read"): 5,
        metric_name(STAGE_US, "pool"): 7,
        "docs_read": 3,
        metric_name(DOCS_REJECTED, "empty_text"): 1,
    }
    assert labelled(counters, STAGE_US) == {"read": 5, "pool": 7}
    families = (STAGE_US, DOCS_REJECTED, FALLBACKS, COMPILE_MS, "startup_ms", "compute_ms")
    found = spelled_outside("pipeline/telemetry/observe.py", tuple(f"{family}[" for family in families))
    assert found == [], "format with observe.metric_name, read with observe.labelled"


def test_a_batch_names_the_fields_of_its_windows():
    from docbeam.pipeline.records import Batch, TokenWindow, WindowRef, batch_id

    window = TokenWindow("doc-1", 0, 2, np.array([101, 7, 102], np.int32), 5, False)
    batch = Batch(
        batch_id=batch_id(16, [window], packed=False),
        bucket_len=16,
        ids_BxT=np.zeros((1, 16), np.int32),
        lengths_B=np.array([3], np.int32),
        windows=(tuple(WindowRef.of(window)),),
    )
    (ref,) = batch.windows
    assert isinstance(ref, WindowRef) and (ref.doc_id, ref.index, ref.num_windows) == ("doc-1", 0, 2)
    assert batch.batch_id.startswith("b16-") and batch_id(16, [ref], packed=True).startswith("p16-")
    assert batch_id(16, [ref], packed=False) == batch.batch_id  # the same windows, the same id


@pytest.mark.parametrize("packed", [False, True])
def test_the_bucketing_stage_makes_the_batch_ids_and_window_refs_records_defines(packed):
    from docbeam.pipeline.records import TokenWindow, WindowRef, batch_id
    from docbeam.pipeline.stages import packer

    windows = [TokenWindow(f"d{i}", 0, 1, np.arange(1, 4 + i, dtype=np.int32), 2 + i, False) for i in range(3)]
    made = packer.packed_batch([windows[:2], windows[2:]], 16, 2) if packed else packer.padded_batch(windows, 16, 4)
    assert all(isinstance(ref, WindowRef) for ref in made.windows)
    assert made.batch_id == batch_id(16, made.windows, packed=packed)
