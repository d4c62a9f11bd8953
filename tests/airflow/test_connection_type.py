"""The provider's own connection type ``dbqueue``: discovered by Airflow's ProvidersManager with its form,
its Test button (``Connection.test_connection``, as the API server runs it, and ``airflow connections
test``) against the real PostgreSQL, the dialect it selects, and what its extras may not do silently."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import ConfigurationError, DbQueue
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from tests.airflow.conftest import AIRFLOW
from tests.helpers import checksum
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration


def dbqueue_conn(pg_dsn: str, schema: str, **extra: Any) -> dict[str, Any]:
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    return {
        "conn_type": "dbqueue",
        "host": info.get("host", "127.0.0.1"),
        "port": int(info.get("port", 5432)),
        "login": info.get("user"),
        "password": info.get("password"),
        "schema": info.get("dbname"),
        "extra": {"dialect": "postgresql", "dbqueue_schema": schema, **extra},
    }


def test_providers_manager_discovers_the_dbqueue_type_and_its_form() -> None:
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    hook = pm.hooks["dbqueue"]
    assert hook is not None
    assert (hook.hook_class_name, hook.connection_id_attribute_name, hook.package_name) == (
        "airflow_dbqueue.hooks.dbqueue.DbQueueHook",
        "dbqueue_conn_id",
        "airflow-dbqueue",
    )
    widgets = pm.connection_form_widgets
    dialect = widgets["extra__dbqueue__dialect"]
    assert dialect.field["schema"]["enum"] == ["postgresql", "mssql"]
    assert dialect.field["value"] == "postgresql" and dialect.field["schema"]["title"] == "Dialect"
    assert widgets["extra__dbqueue__dbqueue_schema"].field["value"] == "dbqueue"
    assert pm.field_behaviours["dbqueue"]["relabeling"] == {"schema": "Database"}


@pytest.fixture
def transient_conn() -> Iterator[dict[str, str]]:
    """What the API server's Test button does: the connection goes into an env var for the test."""
    added: dict[str, str] = {}
    yield added
    for key in added:
        os.environ.pop(key, None)


def test_button(conn_id: str, fields: dict[str, Any], transient_conn: dict[str, str]) -> tuple[bool, str]:
    from airflow.models.connection import Connection

    conn = Connection(conn_id=conn_id, **{**fields, "extra": json.dumps(fields["extra"])})
    key = f"AIRFLOW_CONN_{conn_id.upper()}"
    transient_conn[key] = os.environ[key] = conn.get_uri()
    status, message = conn.test_connection()
    return bool(status), str(message)


test_button.__test__ = False  # type: ignore[attr-defined]


def test_test_connection_against_the_real_database(
    pg_dsn: str, dbq: DbQueue, transient_conn: dict[str, str]
) -> None:
    dbq.create_queue("jobs")
    ok, msg = test_button("t_ok", dbqueue_conn(pg_dsn, dbq.schema), transient_conn)
    assert (ok, msg) == (True, f"connected (postgresql); schema {dbq.schema!r} holds 1 queue(s): jobs")

    closed = {**dbqueue_conn(pg_dsn, dbq.schema, connect_timeout="2"), "port": 1}
    ok, msg = test_button("t_closed", closed, transient_conn)
    assert not ok and msg.startswith("DatabaseUnavailableError: ") and ":1" in msg, msg

    ok, msg = test_button("t_dialect", dbqueue_conn(pg_dsn, dbq.schema, dialect="oracle"), transient_conn)
    assert not ok and "names the dialect 'oracle'" in msg and "postgresql, mssql" in msg, msg


def test_airflow_connections_test_runs_the_hook(pg_dsn: str, dbq: DbQueue) -> None:
    dbq.create_queue("jobs")
    closed = {**dbqueue_conn(pg_dsn, dbq.schema, connect_timeout="2"), "port": 1}
    env = dict(
        os.environ,
        AIRFLOW__CORE__TEST_CONNECTION="Enabled",
        AIRFLOW_CONN_DBQ_CLI=json.dumps(dbqueue_conn(pg_dsn, dbq.schema)),
        AIRFLOW_CONN_DBQ_CLOSED=json.dumps(closed),
    )
    out = {}
    for conn_id in ("dbq_cli", "dbq_closed"):
        proc = subprocess.run(
            [str(AIRFLOW), "connections", "test", conn_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        out[conn_id] = proc.stdout + proc.stderr
    assert "Connection success!" in out["dbq_cli"], out["dbq_cli"][-2000:]
    assert "Connection failed!" in out["dbq_closed"], out["dbq_closed"][-2000:]
    assert "DatabaseUnavailableError" in out["dbq_closed"], out["dbq_closed"][-2000:]


def test_the_hook_moves_messages_through_a_dbqueue_connection(
    pg_dsn: str, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the form's fields as the UI may store them, with the extra__dbqueue__ prefix
    conn = dbqueue_conn(pg_dsn, "ignored")
    conn["extra"] = {"extra__dbqueue__dialect": "postgresql", "extra__dbqueue__dbqueue_schema": dbq.schema}
    monkeypatch.setenv("AIRFLOW_CONN_DBQ", json.dumps(conn))
    sent = [{"n": i} for i in range(300)]
    with DbQueueHook("dbq") as hook:
        assert hook.get_conn().schema == dbq.schema
        hook.create_queue("jobs")
        assert len(hook.push("jobs", sent)) == 300
        got = hook.pop("jobs", 500)
        assert hook.ack("jobs", got) == 300
    assert checksum(m.payload for m in got) == checksum(sent)
    assert dbq.queue("jobs").stats().finished == 300


def test_a_dbqueue_connection_selects_sql_server_and_guards_the_odbc_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = {
        "conn_type": "dbqueue",
        "host": "sql.internal",
        "port": 1433,
        "login": "app",
        "password": "pw",
        "schema": "appdb",
        "extra": {"dialect": "mssql", "dbqueue_schema": "queues", "Encrypt": "no"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_MS", json.dumps(conn))
    dbq = DbQueueHook("ms").get_conn()  # no I/O
    assert (dbq.dialect, dbq.schema, dbq.db.where) == ("mssql", "queues", "sql.internal:1433/appdb")
    attrs = dbq.db._attrs  # type: ignore[attr-defined]
    assert attrs["ENCRYPT"] == "no" and "dialect" not in attrs and "dbqueue_schema" not in attrs
    # As OdbcHook: a driver named in the extra loads that library, so only where Airflow allows it.
    conn["extra"] = {**conn["extra"], "Driver": "/tmp/evil.so"}
    monkeypatch.setenv("AIRFLOW_CONN_MS", json.dumps(conn))
    with pytest.raises(ConfigurationError, match=r"allow_driver_in_extra"):
        DbQueueHook("ms").get_conn()
    monkeypatch.setenv("AIRFLOW__PROVIDERS_ODBC__ALLOW_DRIVER_IN_EXTRA", "True")
    assert DbQueueHook("ms").get_conn().db._attrs["DRIVER"] == "/tmp/evil.so"  # type: ignore[attr-defined]


def test_token_authentication_without_the_postgres_provider_is_refused(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    if importlib.util.find_spec("airflow.providers.postgres") is not None:
        pytest.skip("the postgres provider is installed: the token path is PostgresHook's")
    for key in ("iam", "azure"):
        monkeypatch.setenv("AIRFLOW_CONN_TOK", json.dumps(dbqueue_conn(pg_dsn, "q", **{key: True})))
        with pytest.raises(ConfigurationError, match=rf"asks for '{key}' token authentication.*postgres"):
            DbQueueHook("tok").get_conn()


def test_a_dbqueue_connection_through_a_transaction_pooler(
    pg_dsn: str, pgbouncer: PgBouncer, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The form's pooler and listen fields: the engine goes through PgBouncer in transaction mode and
    LISTENs on the listen host and port (the server, with the connection's login and database); the
    Spark jobs' JDBC URL asks for no server-side prepared statements."""
    server = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    conn = dbqueue_conn(pgbouncer.dsn("transaction"), dbq.schema)
    conn["extra"] = {
        "dialect": "postgresql",
        "dbqueue_schema": dbq.schema,
        "extra__dbqueue__dbqueue_pooler": "transaction",
        "dbqueue_listen_host": server.get("host"),
        "dbqueue_listen_port": str(server.get("port")),
    }
    monkeypatch.setenv("AIRFLOW_CONN_DBQ", json.dumps(conn))
    sent = [{"n": i} for i in range(50)]
    with DbQueueHook("dbq") as hook:
        engine = hook.get_conn()
        assert engine.db.transaction_pooled  # type: ignore[attr-defined]
        listen = psycopg.conninfo.conninfo_to_dict(engine.db.listen_dsn)  # type: ignore[attr-defined]
        assert (listen["host"], listen["port"], listen["dbname"]) == (
            server.get("host"),
            str(server.get("port")),
            pgbouncer.dbname,
        )
        hook.create_queue("jobs")
        hook.push("jobs", sent)
        got = hook.pop("jobs", 100)
        assert hook.ack("jobs", got) == 50
        url, _, _ = hook.jdbc()
        assert url.endswith("?prepareThreshold=0") and f":{pgbouncer.port}/" in url
    assert checksum(m.payload for m in got) == checksum(sent)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"dbqueue_pooler": "statement"}, "pooler must be one of"),
        ({"dbqueue_pooler": "transaction", "dbqueue_listen_port": "x5432"}, "must be a port number"),
        ({"dialect": "mssql", "dbqueue_pooler": "transaction"}, "PostgreSQL's"),
    ],
)
def test_bad_pooler_fields_are_refused_naming_the_connection(
    extra: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = {
        "conn_type": "dbqueue",
        "host": "db",
        "port": 6432,
        "login": "app",
        "schema": "app",
        "extra": extra,
    }
    monkeypatch.setenv("AIRFLOW_CONN_BAD", json.dumps(conn))
    with pytest.raises(ConfigurationError, match=match) as refused:
        DbQueueHook("bad").get_conn()
    assert "'bad'" in str(refused.value)
