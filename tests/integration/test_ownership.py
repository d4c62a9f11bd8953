"""The engine touches only what it created: reserved schemas are refused, an install goes only into a
schema of its own (or an empty one), and uninstall drops what the engine's catalogue lists and nothing
else, on a real PostgreSQL. The SQL Server twins run given ``$DBQUEUE_TEST_MSSQL_DSN`` (in
``tests/integration/test_ownership_mssql.py``); the dialect's decisions without a server are in
``tests/unit/test_mssql_ownership.py``."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from airflow_dbqueue.engine import DbQueue, ForeignObjectsError, InvalidNameError
from airflow_dbqueue.engine.dialects.postgres.schema import schema_sql
from airflow_dbqueue.engine.embedded import free_port
from tests.dialects import run_sql

pytestmark = pytest.mark.integration

LATEST = schema_sql()[0]
ENGINE_TABLES = {"schema_version", "queues", "meta", "data", "done", "archive", "batches", "rings"}


def run(
    dsn: str, schema: str, body: str, params: dict[str, Any] | None = None, **identifiers: str
) -> list[tuple[Any, ...]]:
    """Run ``body`` with tests/dialects.py's run_sql through a DbQueue of ``schema`` of its own (nothing
    of it installed or checked): ``{schema}`` and the ``identifiers``' placeholders are quoted."""
    with DbQueue(dsn, schema=schema, pool_size=1) as admin:
        return run_sql(admin, body, params, identifiers=identifiers)


READER = "catalog_reader"
"""The schema of the DbQueue that reads the catalog (``relations`` and the like, which also look at
schemas no DbQueue may take, such as public): its statements name no object of it."""


def relations(dsn: str, schema: str) -> set[str]:
    """Names of the tables (partitioned ones too), views and sequences in ``schema``."""
    rows = run(
        dsn,
        READER,
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(s)s AND c.relkind IN ('r', 'p', 'S', 'v')",
        {"s": schema},
    )
    return {r[0] for r in rows}


def functions(dsn: str, schema: str) -> set[str]:
    rows = run(
        dsn,
        READER,
        "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %(s)s",
        {"s": schema},
    )
    return {r[0] for r in rows}


def schema_exists(dsn: str, schema: str) -> bool:
    return bool(run(dsn, READER, "SELECT 1 FROM pg_namespace WHERE nspname = %(s)s", {"s": schema}))


@pytest.fixture
def new_schema(pg_dsn: str) -> Iterator[Callable[[], str]]:
    """Fresh schema names; every schema of those names is dropped (CASCADE) after the test."""
    names: list[str] = []

    def make() -> str:
        names.append(f"t_{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield make
    for name in names:
        run(pg_dsn, name, "DROP SCHEMA IF EXISTS {schema} CASCADE")


def user_table(dsn: str, schema: str, name: str = "customers") -> None:
    """Someone else's table with a row in it, in ``schema``."""
    run(dsn, schema, "CREATE TABLE {schema}.{t} (id integer PRIMARY KEY, who text)", t=name)
    run(dsn, schema, "INSERT INTO {schema}.{t} VALUES (1, 'ada')", t=name)


def user_rows(dsn: str, schema: str, name: str = "customers") -> list[tuple[Any, ...]]:
    return run(dsn, schema, "SELECT * FROM {schema}.{t}", t=name)


# -- reserved schemas: refused at construction, before any I/O ---------------------------------------


@pytest.mark.parametrize("schema", ["public", "information_schema", "pg_catalog", "pg_toast", "pg_temp_1"])
def test_reserved_schemas_are_refused_at_construction_without_io(schema: str) -> None:
    port = free_port()  # nothing listens there: a refusal that needed the server could not come at once
    with pytest.raises(InvalidNameError, match=rf"schema name '{schema}' is not valid"):
        DbQueue(f"host=127.0.0.1 port={port} user=postgres dbname=app", schema=schema)


def test_public_stays_untouched(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    """What the issue saw: DbQueue(schema="public") put its tables among the user's, and uninstall
    dropped public with them. Now nothing can be done through such a handle."""
    mine = new_schema()
    run(pg_dsn, mine, "CREATE TABLE public.{t} (id integer)", t=mine)
    try:
        with pytest.raises(InvalidNameError, match="reserved"):
            DbQueue(pg_dsn, schema="public")
        assert schema_exists(pg_dsn, "public")
        assert mine in relations(pg_dsn, "public")
        assert "meta" not in relations(pg_dsn, "public")
    finally:
        run(pg_dsn, mine, "DROP TABLE public.{t}", t=mine)


def test_the_cli_refuses_a_reserved_schema(pg_dsn: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_dbqueue.cli", "--dsn", pg_dsn, "--schema", "public", "init"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dbqueue: error: schema name 'public' is not valid"), proc.stderr
    assert "Traceback" not in proc.stderr


# -- install: only into a schema of its own -----------------------------------------------------------


def test_install_refuses_a_schema_that_holds_other_objects(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    run(pg_dsn, schema, "CREATE SCHEMA {schema}")
    user_table(pg_dsn, schema)
    run(pg_dsn, schema, "CREATE VIEW {schema}.report AS SELECT 1 AS one")
    with DbQueue(pg_dsn, schema=schema) as dbq, pytest.raises(ForeignObjectsError) as info:
        dbq.install()
    message = str(info.value)
    assert f"table {schema}.customers" in message and f"view {schema}.report" in message, message
    assert "Nothing was installed" in message
    assert sorted(info.value.objects) == [f"table {schema}.customers", f"view {schema}.report"]
    assert relations(pg_dsn, schema) == {"customers", "report"}  # nothing of the engine's was created
    assert user_rows(pg_dsn, schema) == [(1, "ada")]


def test_an_empty_existing_schema_is_used_and_kept(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    schema = new_schema()
    run(pg_dsn, schema, "CREATE SCHEMA {schema}")
    with DbQueue(pg_dsn, schema=schema) as dbq:
        assert dbq.install() == LATEST
        q = dbq.create_queue("orders")
        q.push_batch([{"n": i} for i in range(5)])
        dbq.create_queue("stream", design="ring", layout="slots", capacity=16).push(1)
        flat = dbq.create_queue("flat", design="ring", layout="rows", capacity=64)
        flat.add_group("audit")  # a group of the rows layout has tables and functions of its own
        flat.push(1)
        dbq.uninstall()
    assert schema_exists(pg_dsn, schema)  # the engine did not create it: it stays, empty
    assert relations(pg_dsn, schema) == set() and functions(pg_dsn, schema) == set()


def test_a_fresh_install_records_what_it_created_and_uninstall_drops_it_all(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.install()
        dbq.install()  # idempotent: records nothing twice
        owned = set(run(pg_dsn, schema, "SELECT kind, name FROM {schema}.owned_objects"))
        assert ("schema", schema) in owned
        assert {("table", t) for t in ENGINE_TABLES} <= owned
        assert {("function", f) for f in functions(pg_dsn, schema)} <= owned
        dbq.create_queue("stream", design="ring", layout="slots", capacity=16).push(1)
        assert {"ring_1_seq", "ring_1_gaps"} <= relations(pg_dsn, schema)
        dbq.uninstall()
        dbq.uninstall()  # nothing left to do: no error
    assert not schema_exists(pg_dsn, schema)


# -- uninstall: only what the engine created -----------------------------------------------------------


def test_uninstall_leaves_other_objects_and_their_schema(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    """Someone put a table of theirs (and a function) into the engine's schema after the install."""
    schema = new_schema()
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.install()
        dbq.create_queue("orders").push_batch([1, 2, 3])
        dbq.create_queue("stream", design="ring", capacity=8).push(1)
        user_table(pg_dsn, schema)
        run(pg_dsn, schema, "CREATE FUNCTION {schema}.helper() RETURNS int LANGUAGE sql AS 'SELECT 7'")
        dbq.uninstall()
    assert schema_exists(pg_dsn, schema)
    assert relations(pg_dsn, schema) == {"customers"}
    assert functions(pg_dsn, schema) == {"helper"}
    assert user_rows(pg_dsn, schema) == [(1, "ada")]


def test_uninstall_refuses_while_someone_elses_view_uses_a_queue_table(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema, other = new_schema(), new_schema()
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.install()
        q = dbq.create_queue("orders")
        ids = q.push_batch([{"n": i} for i in range(3)])
        run(pg_dsn, other, "CREATE SCHEMA {schema}")
        run(pg_dsn, other, "CREATE VIEW {schema}.depth AS SELECT id FROM {queues}.meta", queues=schema)
        with pytest.raises(
            ForeignObjectsError, match=rf"view {other}\.depth depends on table {schema}\.meta"
        ):
            dbq.uninstall()
        # nothing was dropped: the queue still works, with its messages
        assert [m.id for m in dbq.queue("orders").pop(10)] == ids
        assert relations(pg_dsn, schema) >= ENGINE_TABLES
        run(pg_dsn, other, "DROP VIEW {schema}.depth")
        dbq.uninstall()
    assert not schema_exists(pg_dsn, schema)


def test_uninstall_of_a_schema_without_an_install_touches_nothing(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.uninstall()  # no schema at all
        run(pg_dsn, schema, "CREATE SCHEMA {schema}")
        user_table(pg_dsn, schema)
        dbq.uninstall()  # someone else's schema of that name
    assert relations(pg_dsn, schema) == {"customers"}
    assert user_rows(pg_dsn, schema) == [(1, "ada")]
