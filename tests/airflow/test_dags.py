"""Every example DAG runs with ``airflow dags test`` against a real PostgreSQL, with asserted effects.

Each run gets the test's own queue schema (through the connection's ``dbqueue_schema`` extra). What the
consumer task saw is read back from the XComs in the throwaway Airflow metadata database.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from airflow_dbqueue.engine import DbQueue
from tests.airflow.conftest import dags_test
from tests.helpers import checksum

pytestmark = pytest.mark.integration


def run_dag(
    env: dict[str, str], pg_dsn: str, schema: str, dag_id: str, conf: dict[str, Any], *, succeed: bool = True
) -> str:
    ok, out = dags_test(env, pg_dsn, schema, dag_id, conf)
    assert ok == succeed, out[-4000:]
    return out


def xcom(env: dict[str, str], dag_id: str, task_id: str, key: str = "return_value") -> Any:
    db = Path(env["AIRFLOW_HOME"]) / "airflow.db"
    with sqlite3.connect(db) as c:
        row = c.execute(
            "SELECT value FROM xcom WHERE dag_id = ? AND task_id = ? AND key = ? ORDER BY timestamp DESC",
            (dag_id, task_id, key),
        ).fetchone()
    assert row is not None, f"no XCom {dag_id}.{task_id}.{key}"
    return json.loads(row[0])


def test_produce_consume(airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    n = 750  # larger than xcom_max_messages: the batch stays claimed, only receipts go through XCom
    out = run_dag(
        airflow_env,
        pg_dsn,
        dbq.schema,
        "dbqueue_produce_consume",
        {"orders": n, "xcom_max_messages": 100, "delay": 3},
    )
    # the orders were not ready at the first poke: the sensor gave its slot back and poked again
    assert out.count("marking task as UP_FOR_RESCHEDULE") >= 1
    pushed = [{"order": i, "customer": i % 7, "amount": (i * 37) % 101} for i in range(n)]
    result = xcom(airflow_env, "dbqueue_produce_consume", "process")
    assert result["count"] == result["acked"] == n and result["inline"] is False
    assert result["checksum"] == checksum(pushed)
    assert result["amount"] == sum(p["amount"] for p in pushed)
    claim = xcom(airflow_env, "dbqueue_produce_consume", "pop_orders")
    assert claim["messages"] is None and len(claim["receipts"]) == n  # no payload bytes in XCom
    assert xcom(airflow_env, "dbqueue_produce_consume", "wait_for_orders") == {
        "queue_name": "example_orders",
        "ready": n,
    }
    stats = dbq.queue("example_orders").stats()
    assert (stats.ready, stats.in_flight, stats.failed, stats.finished) == (0, 0, 0, n)


def test_failed_processing_releases_the_claim(airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    n = 60
    out = run_dag(
        airflow_env,
        pg_dsn,
        dbq.schema,
        "dbqueue_produce_consume",
        {"orders": n, "fail_processing": True},
        succeed=False,
    )
    assert "processing 60 orders failed" in out
    q = dbq.queue("example_orders")
    stats = q.stats()
    # release_on_failure nacked the claim: all back and ready now, not after the 300 s lease
    assert (stats.ready, stats.in_flight, stats.finished) == (n, 0, 0)
    again = q.pop(n)
    assert checksum(m.payload for m in again) == checksum(
        [{"order": i, "customer": i % 7, "amount": (i * 37) % 101} for i in range(n)]
    )
    assert all(m.attempts == 2 for m in again)


def test_deferrable_sensor(airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    n = 40
    out = run_dag(airflow_env, pg_dsn, dbq.schema, "dbqueue_deferrable_sensor", {"events": n, "delay": 4})
    assert "Pausing task as DEFERRED" in out and "running trigger in line" in out  # it did defer
    result = xcom(airflow_env, "dbqueue_deferrable_sensor", "process")
    assert result["count"] == result["acked"] == n and result["events"] == list(range(n))
    claim = xcom(airflow_env, "dbqueue_deferrable_sensor", "wait_and_claim")
    assert claim["count"] == n and checksum(m["payload"] for m in claim["messages"]) == checksum(
        [{"event": i} for i in range(n)]
    )
    stats = dbq.queue("example_events").stats()
    assert (stats.ready, stats.delayed, stats.in_flight, stats.finished) == (0, 0, 0, n)


def test_asset_triggered_dag(airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("example_inbox")
    pushed = [{"mail": i, "to": f"user{i % 5}"} for i in range(120)]
    q.push_batch(pushed)
    run_dag(airflow_env, pg_dsn, dbq.schema, "dbqueue_asset_triggered", {})
    result = xcom(airflow_env, "dbqueue_asset_triggered", "process")
    assert result["count"] == result["acked"] == 120 and checksum(result["items"]) == checksum(pushed)
    stats = q.stats()
    assert (stats.ready, stats.in_flight, stats.finished) == (0, 0, 120)


def test_fan_out_pair_consumes_one_stream_twice(
    airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue
) -> None:
    """dbqueue_fan_out_rollup pushes 300 events and pops them in the ring's default group;
    dbqueue_fan_out_audit pops the same 300 in its audit group (sensor, pop and ack with group=): each
    gets every event once, with the same checksum, and each group ends with nothing left."""
    n = 300
    pushed = [{"order": i, "customer": i % 5, "amount": (i * 13) % 97} for i in range(n)]
    run_dag(airflow_env, pg_dsn, dbq.schema, "dbqueue_fan_out_rollup", {"events": n})
    rollup = xcom(airflow_env, "dbqueue_fan_out_rollup", "roll_up")
    assert rollup["count"] == rollup["acked"] == n and rollup["checksum"] == checksum(pushed)
    assert sum(rollup["totals"].values()) == sum(p["amount"] for p in pushed)
    q = dbq.queue("example_stream")
    assert q.stats().ready == 0 and q.group("audit").stats().ready == n  # the audit group's, untouched
    run_dag(airflow_env, pg_dsn, dbq.schema, "dbqueue_fan_out_audit", {})
    audit = xcom(airflow_env, "dbqueue_fan_out_audit", "audit")
    assert audit["count"] == audit["acked"] == n and audit["checksum"] == checksum(pushed)
    claim = xcom(airflow_env, "dbqueue_fan_out_audit", "pop_events")
    assert claim["group"] == "audit" and claim["messages"] is None and len(claim["receipts"]) == n
    for group in (None, "audit"):
        stats = q.group(group).stats()
        assert (stats.ready, stats.in_flight, stats.failed) == (0, 0, 0), group
