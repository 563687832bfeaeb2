"""output.pgvector with a sparse head's run: embeddings/ rows' sparse_embedding loaded as pgvector sparsevec into
the real Postgres, and a sparse inner-product query finds the expected neighbour."""

from __future__ import annotations

import glob
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import job_config
from pgvector_test import query

from docbeam.pipeline.driver.run import run_job

pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")


def parse_sparsevec(text: str) -> tuple[int, dict[int, float]]:
    """pgvector's text form ``{1:0.5,7:1.25}/30522`` (1-based indices) → (dimension, {0-based index: value})."""
    terms, dim = text.rsplit("/", 1)
    pairs = [t.split(":") for t in terms.strip("{}").split(",") if t]
    return int(dim), {int(i) - 1: float(v) for i, v in pairs}


@pytest.mark.slow
@pytest.mark.extra
def test_a_sparse_run_loads_sparsevec_rows_and_an_inner_product_query_finds_the_neighbour(tmp_path, postgres):
    from sparse_head_test import TEXTS, sparse_checkpoint

    folder = sparse_checkpoint(str(tmp_path / "model"), "bert", "max")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t, "lang": "en"}) + "\n" for i, t in TEXTS.items()))
    sections = dict(
        batching={"buckets": [32, 64], "tokens_per_batch": 512},
        input={"keep_fields": ["lang"]},
        output={"pgvector": {"dsn": postgres, "table": "splade"}},
    )
    summary = run_job(job_config(str(docs), str(tmp_path / "a"), folder, **sections))
    assert summary["pgvector"]["upserted"] == len(TEXTS)
    rows = {r["id"]: r for f in glob.glob(f"{tmp_path}/a/embeddings/*.parquet") for r in pq.read_table(f).to_pylist()}
    loaded = query(postgres, "SELECT id, sparse_embedding::text, fields FROM splade ORDER BY id")
    assert [r[0] for r in loaded] == sorted(rows)
    for doc_id, text, fields in loaded:
        dim, terms = parse_sparsevec(text)
        sparse = rows[doc_id]["sparse_embedding"]
        assert dim == 30522 and sorted(terms) == sparse["indices"] and fields == {"lang": "en"}
        assert np.allclose([terms[i] for i in sparse["indices"]], sparse["values"], rtol=1e-6)
    probe = rows["d5"]["sparse_embedding"]
    literal = "{" + ",".join(f"{i + 1}:{v!r}" for i, v in zip(probe["indices"], probe["values"])) + "}/30522"

    def score(other):
        dense = dict(zip(other["indices"], other["values"]))
        return sum(v * dense.get(i, 0.0) for i, v in zip(probe["indices"], probe["values"]))

    expected = max((i for i in rows if i != "d5"), key=lambda i: score(rows[i]["sparse_embedding"]))
    nearest = query(
        postgres,
        "SELECT id FROM splade WHERE id <> 'd5' ORDER BY sparse_embedding <#> %s::sparsevec LIMIT 1",
        (literal,),
    )
    assert nearest == [(expected,)]
    again = run_job(
        job_config(
            str(docs),
            str(tmp_path / "b"),
            folder,
            **{**sections, "input": {"keep_fields": ["lang"], "reuse_from": str(tmp_path / "a")}},
        )
    )
    assert again["docs_reused"] == len(TEXTS) and again["pgvector"]["applied"]
    assert query(postgres, "SELECT count(*) FROM splade") == [(len(TEXTS),)]
