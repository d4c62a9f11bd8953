"""The order pipeline DAG with ``airflow dags test``: a real PostgreSQL, and on each of the two Spark paths
the same job: a real ``spark-submit`` (local[*]) per batch, or a session per batch on the real local
Spark Connect server of the test session.

Checked against what was pushed: every order lands in the results exactly once (per customer, product
and hour: orders, units and EUR amount), and the queue is drained. A poison batch (an order in a
currency without an FX rate) is released untouched; once the rate is added, the next run publishes
every order once.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.spark import demo
from airflow_dbqueue.spark.connect_server import LocalConnectServer
from airflow_dbqueue.spark.orders import SAMPLE_RATES, OrderRollup, expected_totals, sample_orders
from tests.airflow.conftest import CONN_ID, conn_json, connect_env, dags_test, event_log_text, spark_env

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("spark_system")]

DAG_ID = "dbqueue_order_pipeline"


@pytest.fixture(params=["submit", "connect"])
def spark_path(request: pytest.FixtureRequest) -> str:
    """Which Spark path the pipeline's ``spark_default`` connection takes."""
    return str(request.param)


@pytest.fixture
def path_env(airflow_env: dict[str, str], spark_path: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """The Airflow environment with ``spark_default`` on the path under test."""
    if spark_path == "connect":
        return connect_env(airflow_env, request.getfixturevalue("connect_server"))
    return spark_env(airflow_env)


@pytest.fixture
def results_schema(pg_dsn: str) -> Any:
    name = f"r_{uuid.uuid4().hex[:10]}"
    yield OrderRollup(name)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def run_pipeline(
    env: dict[str, str],
    pg_dsn: str,
    dbq: DbQueue,
    results: OrderRollup,
    conf: dict[str, Any],
    *,
    command: list[str] | None = None,
) -> tuple[bool, str]:
    return dags_test(
        env,
        pg_dsn,
        dbq.schema,
        DAG_ID,
        conf,
        command=command,
        DBQUEUE_RESULTS_SCHEMA=results.schema,
        DBQUEUE_PIPELINE_RETRIES="0",
    )


def expected_rollup(orders: list[dict[str, Any]], rates: dict[str, str]) -> dict[tuple[str, str, str], tuple]:
    """(customer, product, hour) -> (orders, units, EUR amount), computed the job's way in Python."""
    out: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, 0, Decimal(0)])
    for o in orders:
        hour = o["ordered_at"][:13]  # the sample data is in UTC: the hour is the prefix
        g = out[(o["customer_id"], o["product_id"], hour)]
        g[0] += 1
        g[1] += o["quantity"]
        g[2] += (o["quantity"] * Decimal(o["unit_price"]) * Decimal(rates[o["currency"]])).quantize(
            Decimal("0.0001"), ROUND_HALF_UP
        )
    return {k: tuple(v) for k, v in out.items()}


def rollup_rows(pg_dsn: str, results: OrderRollup) -> dict[tuple[str, str, str], tuple]:
    with psycopg.connect(pg_dsn, options="-c timezone=UTC") as c:
        rows = c.execute(
            sql.SQL(
                "SELECT customer_id, product_id, to_char(window_start, 'YYYY-MM-DD\"T\"HH24'), "
                "orders, quantity, amount_eur FROM {}.rollup"
            ).format(sql.Identifier(results.schema))
        ).fetchall()
    return {(r[0], r[1], r[2]): (r[3], r[4], r[5]) for r in rows}


def count(pg_dsn: str, table: sql.Composable) -> int:
    with psycopg.connect(pg_dsn) as c:
        row = c.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    assert row is not None
    return int(row[0])


def test_pipeline_rolls_up_every_order_once(
    path_env: dict[str, str], pg_dsn: str, dbq: DbQueue, results_schema: OrderRollup, spark_path: str
) -> None:
    orders = list(sample_orders(1500, seed=11, customers=30, products=12))
    dbq.create_queue("orders").push_batch(orders)
    # Two batches, the second a partial one: on spark-submit each batch is a launch of its own (a JVM).
    conf = {"queue_name": "orders", "max_messages": 1000, "max_batches": 5}
    # On Connect the DAG runs as the `dbqueue pipeline` demo runs it (Airflow's main with the garbage
    # collector frozen): the same checks hold of that command line.
    command = demo.dags_test_command(DAG_ID, conf) if spark_path == "connect" else None
    ok, out = run_pipeline(path_env, pg_dsn, dbq, results_schema, conf, command=command)
    assert ok, out[-6000:]
    assert expected_rollup(orders, SAMPLE_RATES) == rollup_rows(pg_dsn, results_schema)
    with psycopg.connect(pg_dsn) as c:
        totals = results_schema.totals(c)
    assert (totals.batches, totals.messages) == (2, 1500)  # 1000 + 500
    assert (totals.orders, totals.quantity, totals.amount_eur) == expected_totals(orders)
    st = dbq.queue("orders").stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, 1500)
    for staging in ("rollup_staging", "batch_staging"):
        assert count(pg_dsn, sql.Identifier(results_schema.schema, staging)) == 0
    assert "results published and batch acked" in out
    assert ("the Spark Connect job returned" in out) == (spark_path == "connect")


def test_poison_batch_is_released_then_published_once_fixed(
    path_env: dict[str, str], pg_dsn: str, dbq: DbQueue, results_schema: OrderRollup
) -> None:
    orders = list(sample_orders(400, seed=5, customers=20, products=8))
    orders[123] = {**orders[123], "currency": "NOK"}  # no FX rate for NOK yet: the job rejects the batch
    q = dbq.create_queue("orders")
    ids = q.push_batch(orders)
    conf = {"queue_name": "orders", "max_messages": 1000, "max_batches": 3}

    ok, out = run_pipeline(path_env, pg_dsn, dbq, results_schema, conf)
    assert not ok, out[-4000:]
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (400, 0, 0, 0)  # released, not lost
    assert [m.attempts for m in q.peek(400)] == [1] * 400
    with psycopg.connect(pg_dsn) as c:
        row = c.execute(
            sql.SQL("SELECT state, last_error FROM {}.batches").format(sql.Identifier(dbq.schema))
        ).fetchone()
    assert row is not None and row[0] == 2, row  # released
    assert "no FX rate for currency NOK" in row[1] and f"message {ids[123]}" in row[1], row[1]
    assert rollup_rows(pg_dsn, results_schema) == {}
    for staging in ("rollup_staging", "batch_staging"):
        assert count(pg_dsn, sql.Identifier(results_schema.schema, staging)) == 0

    rates = {**SAMPLE_RATES, "NOK": "0.085"}
    with psycopg.connect(pg_dsn) as c:
        results_schema.set_rate(c, "NOK", rates["NOK"])
    ok, out = run_pipeline(path_env, pg_dsn, dbq, results_schema, conf)
    assert ok, out[-6000:]
    assert expected_rollup(orders, rates) == rollup_rows(pg_dsn, results_schema)
    with psycopg.connect(pg_dsn) as c:
        totals = results_schema.totals(c)
    assert (totals.batches, totals.messages) == (1, 400)
    assert (totals.orders, totals.quantity, totals.amount_eur) == expected_totals(orders, rates)
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, 400)


def expected_daily(orders: list[dict[str, Any]], rates: dict[str, str]) -> dict[tuple[str, str, str], tuple]:
    """expected_rollup with windows of a day (from midnight UTC): (customer, product, "YYYY-MM-DDT00")."""
    out: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, 0, Decimal(0)])
    for key, (n, quantity, amount) in expected_rollup(orders, rates).items():
        g = out[(key[0], key[1], key[2][:10] + "T00")]
        g[0] += n
        g[1] += quantity
        g[2] += amount
    return {k: tuple(v) for k, v in out.items()}


def test_one_ring_feeds_two_pipelines_through_two_groups(
    airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue, connect_server: LocalConnectServer
) -> None:
    """The example pair dags/dbqueue_ring_pipelines.py on Spark Connect: one ring of orders, its default
    group rolled up per hour and its group ``daily`` per day, each into results of its own. Each
    pipeline publishes every order exactly once (its roll-up equals what was pushed, computed in
    Python, and its totals count every order once), whatever the other has done, and the ring is
    left empty for both groups."""
    orders = list(sample_orders(1200, seed=17, customers=25, products=10))
    ring = dbq.create_queue("order_events", design="ring", capacity=131_072)
    ring.add_group("daily", start="earliest")  # type: ignore[attr-defined]
    ring.push_batch(orders)
    hourly, daily = OrderRollup(f"r_{uuid.uuid4().hex[:10]}"), OrderRollup(f"r_{uuid.uuid4().hex[:10]}")
    env = {
        "DBQUEUE_RING_HOURLY_SCHEMA": hourly.schema,
        "DBQUEUE_RING_DAILY_SCHEMA": daily.schema,
        "DBQUEUE_PIPELINE_RETRIES": "0",
    }
    try:
        for dag_id in ("dbqueue_ring_hourly_rollup", "dbqueue_ring_daily_rollup"):
            ok, out = dags_test(connect_env(airflow_env, connect_server), pg_dsn, dbq.schema, dag_id, **env)
            assert ok, out[-6000:]
        assert rollup_rows(pg_dsn, hourly) == expected_rollup(orders, SAMPLE_RATES)
        assert rollup_rows(pg_dsn, daily) == expected_daily(orders, SAMPLE_RATES)
        with psycopg.connect(pg_dsn) as c:
            for results in (hourly, daily):
                totals = results.totals(c)
                assert totals.messages == len(orders)
                assert (totals.orders, totals.quantity, totals.amount_eur) == expected_totals(orders)
        for handle in (ring, ring.group("daily")):
            st = handle.stats()
            assert (st.ready, st.in_flight, st.failed, st.extra["lag_messages"]) == (0, 0, 0, 0), st
            assert handle.open_batches() == []
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            for results in (hourly, daily):
                c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(results.schema)))


PASSWORD = "pw-Kx4-never-logged"


def test_on_connect_the_password_reaches_the_jdbc_reads_but_no_command_line_or_logged_plan(
    airflow_env: dict[str, str],
    pg_dsn: str,
    dbq: DbQueue,
    results_schema: OrderRollup,
    connect_server: LocalConnectServer,
) -> None:
    """The queue connection has a password (the test server trusts local connections and ignores it).
    The Connect job's JDBC reads and writes get it in their options, so it is in the plans the server
    runs: the server's event log (which records each plan and statement as Spark logs them) holds
    those plans with the password redacted, and no process's command line holds it."""
    orders = list(sample_orders(300, seed=3, customers=10, products=5))
    dbq.create_queue("orders").push_batch(orders)
    conn = json.loads(conn_json(pg_dsn, dbq.schema))
    ok, out = dags_test(
        connect_env(airflow_env, connect_server),
        pg_dsn,
        dbq.schema,
        DAG_ID,
        {"queue_name": "orders", "max_messages": 300, "max_batches": 2},
        DBQUEUE_RESULTS_SCHEMA=results_schema.schema,
        DBQUEUE_PIPELINE_RETRIES="0",
        **{f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({**conn, "password": PASSWORD})},
    )
    assert ok, out[-6000:]
    with psycopg.connect(pg_dsn) as c:
        totals = results_schema.totals(c)
    assert (totals.batches, totals.messages) == (1, 300)
    assert (totals.orders, totals.quantity, totals.amount_eur) == expected_totals(orders)
    batch_id = _acked_batch(pg_dsn, dbq)
    events = event_log_text(connect_server)
    # the plans of this batch's session were logged, each JDBC password option redacted
    assert batch_id in events and 'key: \\"password\\"' in events and "(redacted)" in events
    assert PASSWORD not in events
    assert PASSWORD not in connect_server.log_tail(100_000)
    assert not [c for c in command_lines() if PASSWORD in c]


def _acked_batch(pg_dsn: str, dbq: DbQueue) -> str:
    with psycopg.connect(pg_dsn) as c:
        query = sql.SQL("SELECT batch_id FROM {}.batches").format(sql.Identifier(dbq.schema))
        row = c.execute(query).fetchone()
    assert row is not None
    return str(row[0])


def command_lines() -> list[str]:
    """The command line of every process on this machine that can be read."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return out
