"""A DSN the server refuses outright fails at once with the engine's ``LoginError``, saying why; a
server that is down is still waited for up to the connect timeout."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import DatabaseUnavailableError, DbQueue, LoginError, SchemaError
from airflow_dbqueue.engine.embedded import free_port
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration


@pytest.fixture
def password_role(pg_dsn: str) -> Iterator[tuple[str, str]]:
    """A role of the test's own with a password, and ``pg_hba.conf`` asking for it on 127.0.0.1 (the
    server's own file, written ahead of its rules and put back afterwards)."""
    role, password = f"dbq_pw_{uuid.uuid4().hex[:8]}", "right-one"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'")
        hba = Path(str(c.execute("SHOW hba_file").fetchone()[0]))  # type: ignore[index]
    before = hba.read_text()
    _write_hba(pg_dsn, hba, f"host all {role} 127.0.0.1/32 scram-sha-256\n" + before)
    try:
        yield role, password
    finally:
        _write_hba(pg_dsn, hba, before)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP ROLE IF EXISTS "{role}"')


def _write_hba(pg_dsn: str, path: Path, text: str) -> None:
    path.write_text(text)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_reload_conf()")
    time.sleep(0.3)


def _refused_at_once(dsn: str, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(LoginError, match=match), DbQueue(dsn, connect_timeout=10) as dbq:
        dbq.list_queues()
    assert time.monotonic() - start < 3, "the refusal waited for the connect timeout"


def test_a_database_that_does_not_exist(pg_dsn: str) -> None:
    _refused_at_once(
        psycopg.conninfo.make_conninfo(pg_dsn, dbname="no_such_db"), 'database "no_such_db" does not exist'
    )


def test_a_role_that_does_not_exist(pg_dsn: str) -> None:
    _refused_at_once(
        psycopg.conninfo.make_conninfo(pg_dsn, user="no_such_role"), 'role "no_such_role" does not exist'
    )


def test_a_wrong_password(pg_dsn: str, password_role: tuple[str, str]) -> None:
    role, password = password_role
    with (
        DbQueue(psycopg.conninfo.make_conninfo(pg_dsn, user=role, password=password)) as dbq,
        pytest.raises(SchemaError),  # it logs in, and finds no queue schema
    ):
        dbq.list_queues()
    _refused_at_once(
        psycopg.conninfo.make_conninfo(pg_dsn, user=role, password="wrong"), "password authentication failed"
    )


def test_a_database_the_pooler_does_not_know(pgbouncer: PgBouncer) -> None:
    dsn = f"host=127.0.0.1 port={pgbouncer.port} dbname=no_such_db user=postgres"
    _refused_at_once(dsn, "no_such_db")


def test_a_server_that_is_down_is_still_waited_for() -> None:
    start = time.monotonic()
    with (
        pytest.raises(DatabaseUnavailableError),
        DbQueue(f"host=127.0.0.1 port={free_port()}", connect_timeout=2) as dbq,
    ):
        dbq.list_queues()
    took = time.monotonic() - start
    assert 1.5 < took < 6, f"{took:.1f}s: the connect timeout is 2s"
