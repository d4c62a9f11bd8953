"""The maintenance DAG under ``airflow dags test`` against a real PostgreSQL, and the hook's maintenance.

The DAG run is configured both ways a deployment would: an Airflow Variable (``dbqueue_maintenance``)
and the run's params; the effects are read back from the queue schema and from the XComs.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.hooks.dbqueue import (
    _HORIZON_GAUGES,
    _INDEX_GAUGES,
    _QUEUE_GAUGES,
    _TABLE_GAUGES,
    DbQueueHook,
    emit_metrics,
)
from tests.airflow.test_dags import run_dag, xcom

pytestmark = pytest.mark.integration

DAG_ID = "dbqueue_maintenance"


def archive_count(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(sql.SQL("SELECT count(*) FROM {}.archive").format(sql.Identifier(schema))).fetchone()
    return int(row[0]) if row else 0


def test_maintenance_dag(airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    orders = dbq.create_queue("orders", visibility_timeout=0.5)
    audit = dbq.create_queue("audit")
    orders.push_batch([{"order": i} for i in range(500)])
    orders.pop(300)  # finished at once
    leased = orders.pop(150, semantics="at-least-once")
    orders.ack(leased[:100])  # finished; 50 leases left to expire
    audit.push_batch(list(range(20)))
    audit.pop(20)
    # The Variable sets the batch size; the run's params set the rest (params win over the Variable).
    env = dict(airflow_env, AIRFLOW_VAR_DBQUEUE_MAINTENANCE=json.dumps({"batch_size": 150, "pause_s": 1}))
    out = run_dag(
        env,
        pg_dsn,
        dbq.schema,
        DAG_ID,
        {"archive_after_s": 0, "pause_s": 0, "queues": ["orders"], "reindex_min_bytes": 0},
    )

    archived = xcom(airflow_env, DAG_ID, "archive")
    assert archived["archive"]["rows"] == 400 and archived["archive"]["batches"] == 3  # 150, 150, 100
    assert archived["archive"]["stopped"] == "drained" and archived["purge_archive"]["rows"] == 0
    assert archive_count(pg_dsn, dbq.schema) == 400  # the audit queue was not in "queues"
    assert xcom(airflow_env, DAG_ID, "upkeep") == {
        "queues": {"orders": {"reclaimed": 50, "batches_purged": 0, "keys_forgotten": 0, "expired": 0}}
    }
    assert "meta" in xcom(airflow_env, DAG_ID, "vacuum")["tables"]
    assert xcom(airflow_env, DAG_ID, "compact_rings") == {"actions": []}  # no ring table grew
    assert all(a["ok"] for a in xcom(airflow_env, DAG_ID, "rebuild_indexes")["actions"])
    assert xcom(airflow_env, DAG_ID, "check_horizon") == {"xmin_holders": []}

    metrics = xcom(airflow_env, DAG_ID, "metrics")
    assert metrics["schema"] == dbq.schema and list(metrics["queues"]) == ["orders"]
    m = metrics["queues"]["orders"]
    assert (m["ready"], m["in_flight"], m["finished"]) == (100, 0, 0)  # 50 never popped + 50 reclaimed
    assert m["pushed_per_s"] > 0 and m["finished_per_s"] > 0
    assert "Sent " in out and "dbqueue gauges" in out
    stats = orders.stats()
    assert (stats.ready, stats.in_flight, stats.finished) == (100, 0, 0)


def test_maintenance_dag_skips_while_another_run_holds_the_lock(
    airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue
) -> None:
    q = dbq.create_queue("orders")
    q.push_batch(list(range(30)))
    q.pop(30)
    with dbq.maintenance().lock():  # another run, e.g. `dbqueue maintain` from a shell
        out = run_dag(airflow_env, pg_dsn, dbq.schema, DAG_ID, {"archive_after_s": 0})
    assert "another maintenance run holds the lock of schema" in out and "airflow-dbqueue-maintenance" in out
    archived = xcom(airflow_env, DAG_ID, "archive")
    assert archived["archive"]["stopped"] == "skipped" and archived["purge_archive"] is None
    assert xcom(airflow_env, DAG_ID, "vacuum")["skipped"]
    assert xcom(airflow_env, DAG_ID, "rebuild_indexes")["skipped"]
    assert xcom(airflow_env, DAG_ID, "metrics")["queues"]["orders"]["finished"] == 30  # still measured
    assert archive_count(pg_dsn, dbq.schema) == 0


def test_hook_maintenance_and_metrics(
    airflow_conn: str, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.observability.stats import Stats

    sent: list[tuple[str, float, dict[str, Any]]] = []
    monkeypatch.setattr(
        Stats, "gauge", lambda stat, value, *a, tags=None, **k: sent.append((stat, value, tags or {}))
    )
    q = dbq.create_queue("jobs")
    q.push_batch(list(range(40)))
    q.pop(25)
    with DbQueueHook(airflow_conn) as hook:
        report = hook.maintain({"archive_after_s": 0, "reindex": False})
        assert report["skipped"] is None and report["archive"]["rows"] == 25
        assert json.loads(json.dumps(report)) == report
        # A second run while the first holds the lock skips and says so.
        with hook.maintenance().lock(), DbQueueHook(airflow_conn) as other:
            skipped = other.archive(archive_after=0)
        assert skipped["stopped"] == "skipped" and "airflow-dbqueue-maintenance" in skipped["skipped"]
    # Stable names; the schema and the queue, table or index are tags.
    gauges = {(name, tuple(sorted(tags.items()))): value for name, value, tags in sent}
    schema = ("schema", dbq.schema)
    assert gauges[("dbqueue.queue.ready", (("queue", "jobs"), schema))] == 15.0
    assert gauges[("dbqueue.queue.finished", (("queue", "jobs"), schema))] == 0.0
    assert ("dbqueue.table.dead_tuples", (schema, ("table", "meta"))) in gauges
    # meta_0's part of meta_ready_idx: the messages are in generation 0 (schema.sql)
    assert ("dbqueue.index.bloat_ratio", (("index", "meta_ready_idx_0"), schema)) in gauges
    assert ("dbqueue.xmin_holders", (schema,)) in gauges
    names = {name for name, _, _ in sent}
    assert names <= {
        *(f"dbqueue.queue.{g}" for g in _QUEUE_GAUGES),
        *(f"dbqueue.table.{g}" for g in _TABLE_GAUGES),
        *(f"dbqueue.index.{g}" for g in _INDEX_GAUGES),
        *(f"dbqueue.horizon.{g}" for g in _HORIZON_GAUGES),
        "dbqueue.xmin_holders",
    }, names
    # the horizon now: the dead rows of the schema's tables (the 25 pops left some in meta)
    assert gauges[("dbqueue.horizon.dead_rows", (schema,))] == report["metrics"]["horizon"]["dead_rows"]
    assert not [n for n in names if dbq.schema in n or "jobs" in n or "meta" in n]
    assert emit_metrics({"schema": "s", "queues": {"q": {"ready": 1, "oldest_ready_age_s": None}}}) == 2
    sent.clear()  # a ring's consumer group: its lag as gauges tagged with the queue and the group
    audit = {"lag_messages": 7, "lag_seconds": 1.5, "idle_s": None}
    assert emit_metrics({"schema": "s", "queues": {"q": {"ready": 1, "groups": {"audit": audit}}}}) == 4
    assert ("dbqueue.group.lag_messages", 7.0, {"schema": "s", "queue": "q", "group": "audit"}) in sent
    assert "dbqueue.index.page_density_pct" not in names  # PostgreSQL
    # SQL Server's index measures (IndexHealth.as_dict there) go out as gauges too.
    sent.clear()
    index = {"size_bytes": 8192, "bloat_ratio": 1.1, "fragmentation_pct": 12.5, "page_density_pct": 81.0}
    assert emit_metrics({"schema": "s", "indexes": {"meta_pkey": index}}) == 5  # and xmin_holders
    assert ("dbqueue.index.page_density_pct", 81.0, {"schema": "s", "index": "meta_pkey"}) in sent


def mssql_conn_json(mssql_dsn: str, schema: str) -> str:
    """An Airflow connection (JSON form) of type mssql for an ``mssql://`` URL, queues in ``schema``."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    url = urlsplit(mssql_dsn)
    return json.dumps(
        {
            "conn_type": "mssql",
            "host": url.hostname,
            "port": url.port or 1433,
            "login": unquote(url.username or ""),
            "password": unquote(url.password or ""),
            "schema": unquote(url.path.strip("/")),
            "extra": {"dbqueue_schema": schema, **dict(parse_qsl(url.query))},
        }
    )


def test_hook_maintenance_on_sql_server(
    mssql_dsn: str, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook's maintenance through an Airflow connection of type mssql (skipped without
    $DBQUEUE_TEST_MSSQL_DSN; never run yet): the report, the gauges, and a second run that skips."""
    from airflow.sdk.observability.stats import Stats

    from tests.conftest import installed_dbq

    sent: list[tuple[str, float, dict[str, Any]]] = []
    monkeypatch.setattr(
        Stats, "gauge", lambda stat, value, *a, tags=None, **k: sent.append((stat, value, tags or {}))
    )
    monkeypatch.setenv("AIRFLOW_CONN_DBQUEUE_MSSQL", mssql_conn_json(mssql_dsn, schema_name))
    with installed_dbq(mssql_dsn, schema_name, dialect="mssql") as dbq:
        q = dbq.create_queue("jobs")
        q.push_batch(list(range(40)))
        q.pop(25)
        with DbQueueHook("dbqueue_mssql") as hook:
            assert hook.get_conn().dialect == "mssql"
            report = hook.maintain({"archive_after_s": 0})
            assert report["skipped"] is None and report["archive"]["rows"] == 25
            assert report["vacuum"]["statement"] == "UPDATE STATISTICS"
            assert report["indexes"]["mode"] in ("online rebuild", "reorganize")
            assert json.loads(json.dumps(report)) == report
            with hook.maintenance().lock(), DbQueueHook("dbqueue_mssql") as other:
                skipped = other.archive(archive_after=0)
            assert skipped["stopped"] == "skipped" and "airflow-dbqueue-maintenance" in skipped["skipped"]
        assert [m.payload for m in q.pop(15)] == list(range(25, 40))  # untouched
    assert ("dbqueue.queue.ready", 15.0, {"schema": schema_name, "queue": "jobs"}) in sent
    assert any(
        n == "dbqueue.index.page_density_pct" and t == {"schema": schema_name, "index": "meta_ready_idx"}
        for n, _, t in sent
    )
