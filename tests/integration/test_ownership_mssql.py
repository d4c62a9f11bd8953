"""tests/integration/test_ownership.py's checks on a real SQL Server, given $DBQUEUE_TEST_MSSQL_DSN
(skipped otherwise; never run yet: no SQL Server can run where this was written). The same decisions
on a fake connection are in tests/unit/test_mssql_ownership.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from airflow_dbqueue.engine import DbQueue, ForeignObjectsError
from tests.dialects import run_sql

pytestmark = pytest.mark.integration


@pytest.fixture
def schema(mssql_dsn: str) -> Iterator[str]:
    """A fresh schema name; whatever a test leaves under it is dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with DbQueue(mssql_dsn, schema=name, dialect="mssql") as dbq:
        run_sql(
            dbq,
            "DECLARE @sql nvarchar(max) = N''; "
            "SELECT @sql = @sql + N'DROP VIEW ' + QUOTENAME(s.name) + N'.' + QUOTENAME(v.name) + N'; ' "
            "FROM sys.views v JOIN sys.schemas s ON s.schema_id = v.schema_id WHERE s.name LIKE %(like)s; "
            "SELECT @sql = @sql + N'DROP TABLE ' + QUOTENAME(s.name) + N'.' + QUOTENAME(t.name) + N'; ' "
            "FROM sys.tables t JOIN sys.schemas s ON s.schema_id = t.schema_id WHERE s.name LIKE %(like)s; "
            "SELECT @sql = @sql + N'DROP SCHEMA ' + QUOTENAME(name) + N'; ' FROM sys.schemas "
            "WHERE name LIKE %(like)s; EXEC sys.sp_executesql @sql",
            {"like": f"{name}%"},
        )


def objects(dbq: DbQueue, schema: str) -> set[str]:
    rows = run_sql(
        dbq,
        "SELECT o.name FROM sys.objects o JOIN sys.schemas s ON s.schema_id = o.schema_id "
        "WHERE s.name = %(s)s AND o.parent_object_id = 0",
        {"s": schema},
    )
    return {r[0] for r in rows}


def schema_exists(dbq: DbQueue, schema: str) -> bool:
    return bool(run_sql(dbq, "SELECT 1 FROM sys.schemas WHERE name = %(s)s", {"s": schema}))


def create_schema_with_table(dbq: DbQueue, schema: str) -> None:
    run_sql(dbq, f"EXEC sys.sp_executesql N'CREATE SCHEMA [{schema}]'")
    run_sql(dbq, f"CREATE TABLE [{schema}].customers (id int PRIMARY KEY, who nvarchar(20))")
    run_sql(dbq, f"INSERT INTO [{schema}].customers VALUES (1, N'ada')")


def test_install_refuses_a_schema_holding_other_objects_on_sql_server(mssql_dsn: str, schema: str) -> None:
    with DbQueue(mssql_dsn, schema=schema, dialect="mssql") as dbq:
        create_schema_with_table(dbq, schema)
        with pytest.raises(ForeignObjectsError, match=rf"table \[{schema}\]\.\[customers\]"):
            dbq.install()
        assert objects(dbq, schema) == {"customers"}


def test_an_empty_schema_is_used_and_kept_on_sql_server(mssql_dsn: str, schema: str) -> None:
    with DbQueue(mssql_dsn, schema=schema, dialect="mssql") as dbq:
        run_sql(dbq, f"EXEC sys.sp_executesql N'CREATE SCHEMA [{schema}]'")
        dbq.install()
        dbq.create_queue("orders").push_batch([1, 2, 3])
        dbq.create_queue("stream", design="ring", capacity=16).push(1)
        dbq.uninstall()
        assert schema_exists(dbq, schema) and objects(dbq, schema) == set()


def test_uninstall_drops_only_the_engines_objects_on_sql_server(mssql_dsn: str, schema: str) -> None:
    with DbQueue(mssql_dsn, schema=schema, dialect="mssql") as dbq:
        dbq.install()
        dbq.create_queue("orders").push_batch([1, 2, 3])
        dbq.create_queue("stream", design="ring", capacity=16).push(1)
        run_sql(dbq, f"CREATE TABLE [{schema}].customers (id int PRIMARY KEY)")
        dbq.uninstall()
        assert objects(dbq, schema) == {"customers"}
        run_sql(dbq, f"DROP TABLE [{schema}].customers")
    with DbQueue(mssql_dsn, schema=schema, dialect="mssql") as dbq:
        dbq.install()  # a schema the engine created, alone: uninstall drops it whole
        dbq.uninstall()
        assert not schema_exists(dbq, schema)


def test_uninstall_refuses_while_a_view_uses_a_queue_table_on_sql_server(mssql_dsn: str, schema: str) -> None:
    other = f"{schema}_r"
    with DbQueue(mssql_dsn, schema=schema, dialect="mssql") as dbq:
        dbq.install()
        ids = dbq.create_queue("orders").push_batch([1, 2, 3])
        run_sql(dbq, f"EXEC sys.sp_executesql N'CREATE SCHEMA [{other}]'")
        run_sql(
            dbq, f"EXEC sys.sp_executesql N'CREATE VIEW [{other}].depth AS SELECT id FROM [{schema}].meta'"
        )
        with pytest.raises(ForeignObjectsError, match=rf"\[{other}\]\.\[depth\]"):
            dbq.uninstall()
        assert [m.id for m in dbq.queue("orders").pop(10)] == ids
