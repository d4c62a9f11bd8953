"""DbQueueHook against a real PostgreSQL, through real Airflow connections (env-var secrets backend)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_dbqueue.engine import (
    ConfigurationError,
    DatabaseUnavailableError,
    DbQueue,
    InvalidNameError,
    LeaseExpiredError,
    QueueExistsError,
    QueueNotFoundError,
)
from airflow_dbqueue.engine.aio import AsyncDbQueue
from airflow_dbqueue.get_provider_info import get_provider_info
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from tests.airflow.conftest import AIRFLOW, conn_json
from tests.helpers import checksum

pytestmark = pytest.mark.integration


def orders(n: int, start: int = 0) -> list[dict[str, int]]:
    return [{"order": i, "amount": (i * 37) % 101} for i in range(start, start + n)]


def test_no_io_in_constructor_and_unknown_connection() -> None:
    hook = DbQueueHook("no_such_connection")  # constructing looks nothing up
    assert hook.dbqueue_conn_id == "no_such_connection"
    with pytest.raises(AirflowNotFoundException, match="no_such_connection"):
        hook.get_conn()
    ok, msg = hook.test_connection()
    assert not ok and "no_such_connection" in msg


@pytest.mark.parametrize(
    ("conn_type", "match"),
    [
        (
            "http",
            r"type 'http'.*needs a connection of type 'dbqueue', or a database connection of type "
            r"'postgres', 'mssql' or 'odbc'",
        ),
        ("sqlite", r"type 'sqlite'"),
    ],
)
def test_wrong_connection_type(conn_type: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_WRONG", json.dumps({"conn_type": conn_type, "host": "example.com", "port": 1})
    )
    with pytest.raises(ConfigurationError, match=match):
        DbQueueHook("wrong").get_conn()


@pytest.mark.parametrize("conn_type", ["mssql", "odbc"])
def test_mssql_and_odbc_connections_select_the_sql_server_dialect(
    conn_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_MS",
        json.dumps(
            {
                "conn_type": conn_type,
                "host": "sql.internal",
                "port": 1434,
                "login": "app",
                "password": "p@ss;word",
                "schema": "appdb",
                "extra": {"dbqueue_schema": "queues", "Encrypt": "no", "TrustServerCertificate": "yes"},
            }
        ),
    )
    dbq = DbQueueHook("ms").get_conn()  # no I/O
    assert dbq.dialect == "mssql" and dbq.schema == "queues"
    assert dbq.db.where == "sql.internal:1434/appdb"
    attrs = dbq.db._attrs  # type: ignore[attr-defined]
    assert attrs["PWD"] == "p@ss;word" and attrs["UID"] == "app"
    assert attrs["ENCRYPT"] == "no" and attrs["TrustServerCertificate"] == "yes"
    assert "dbqueue_schema" not in attrs


def test_dsn_and_schema_from_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_C1",
        json.dumps(
            {
                "conn_type": "postgres",
                "host": "db.internal",
                "port": 6543,
                "login": "app",
                "password": "s3cret pw",
                "schema": "appdb",
                "extra": {"dbqueue_schema": "queues", "sslmode": "require", "ignored": 1},
            }
        ),
    )
    dbq = DbQueueHook("c1").get_conn()  # no I/O yet: the pool opens on first use
    info = psycopg.conninfo.conninfo_to_dict(dbq.db.dsn)
    assert info == {
        "host": "db.internal",
        "port": "6543",
        "user": "app",
        "password": "s3cret pw",
        "dbname": "appdb",
        "sslmode": "require",
    }
    assert dbq.schema == "queues"
    assert DbQueueHook("c1", dbqueue_schema="other").get_conn().schema == "other"
    # postgresql:// URIs give conn_type postgres too
    monkeypatch.setenv("AIRFLOW_CONN_C2", "postgresql://u@h:1/d")
    assert DbQueueHook("c2").get_conn().schema == "dbqueue"


@pytest.mark.parametrize("schema", ["public", "information_schema"])
def test_a_reserved_queue_schema_is_refused_before_any_io(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook builds its DbQueue as the engine and the CLI do: the same refusal, with no I/O (the host
    does not resolve)."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_RESERVED",
        json.dumps({"conn_type": "postgres", "host": "db.invalid", "extra": {"dbqueue_schema": schema}}),
    )
    with pytest.raises(InvalidNameError, match=rf"schema name '{schema}' is not valid: it is a reserved"):
        DbQueueHook("reserved").get_conn()
    monkeypatch.setenv(
        "AIRFLOW_CONN_FINE",
        json.dumps({"conn_type": "postgres", "host": "db.invalid", "extra": {"dbqueue_schema": "queues"}}),
    )
    assert DbQueueHook("fine").get_conn().schema == "queues"
    with pytest.raises(InvalidNameError, match="reserved"):
        DbQueueHook("fine", dbqueue_schema=schema).get_conn()


def test_round_trip_with_claims(airflow_conn: str, dbq: DbQueue) -> None:
    pushed = orders(1200)
    with DbQueueHook(airflow_conn) as hook:
        ok, msg = hook.test_connection()
        assert ok, msg
        s1 = hook.create_queue("orders", max_attempts=3).settings
        assert hook.create_queue("orders", max_attempts=3).settings == s1  # idempotent
        with pytest.raises(QueueExistsError):
            hook.create_queue("orders", max_attempts=4)
        ids = hook.push("orders", pushed[:1000]) + hook.push("orders", pushed[1000:], priority=0)
        assert len(set(ids)) == 1200

        small = hook.claim("orders", 50, xcom_max_messages=100)
        assert small["count"] == 50 and len(small["messages"]) == 50
        assert json.loads(json.dumps(small)) == small  # JSON-safe as it is
        large = hook.claim("orders", 1000, xcom_max_messages=100)
        assert large["count"] == 1000 and large["messages"] is None  # payloads stay in the database
        assert len(large["receipts"]) == 1000
        rest = hook.claim("orders", 1000, semantics="at-most-once", xcom_max_messages=1000)
        assert rest["count"] == 150 and rest["receipts"] == []

        got = hook.claimed_messages(small) + hook.claimed_messages(large) + hook.claimed_messages(rest)
        assert len(got) == 1200 and checksum(m["payload"] for m in got) == checksum(pushed)
        assert hook.ack_claim(small) == 50 and hook.ack_claim(large) == 1000 and hook.ack_claim(rest) == 0
        stats = hook.stats("orders")
        assert stats["ready"] == stats["in_flight"] == stats["failed"] == 0
        assert stats["finished"] == 1200


def test_nack_failed_admin_and_lost_lease(airflow_conn: str, dbq: DbQueue) -> None:
    with DbQueueHook(airflow_conn) as hook:
        hook.create_queue("jobs", max_attempts=1, retry_backoff=0)
        hook.push("jobs", orders(10))
        claim = hook.claim("jobs", 10)
        assert hook.nack_claim(claim, error="boom") == 10  # max_attempts=1: straight to failed
        failed = hook.list_failed("jobs")
        assert len(failed) == 10 and {f.last_error for f in failed} == {"boom"}
        assert hook.requeue_failed("jobs", [f.id for f in failed[:4]]) == 4
        assert hook.delete_failed("jobs") == 6
        assert hook.count_ready("jobs") == 4

        claim = hook.claim("jobs", 4, visibility_timeout=0.2)
        time.sleep(0.5)  # let the lease lapse
        with pytest.raises(LeaseExpiredError):
            hook.ack_claim(claim)
        assert hook.reclaim_expired("jobs") == 4  # max_attempts=1: expired leases fail
        assert hook.stats("jobs")["failed"] == 4


def test_claim_refuses_what_xcom_cannot_carry(airflow_conn: str, dbq: DbQueue) -> None:
    with DbQueueHook(airflow_conn) as hook:
        hook.create_queue("q")
        hook.push("q", orders(5))
        with pytest.raises(ConfigurationError, match="exactly-once"):
            hook.claim("q", 5, semantics="exactly-once")
        with pytest.raises(ConfigurationError, match="xcom_max_messages"):
            hook.claim("q", 500, semantics="at-most-once", xcom_max_messages=100)
        assert hook.count_ready("q") == 5  # nothing was popped


def test_transaction_is_exactly_once(airflow_conn: str, dbq: DbQueue) -> None:
    with DbQueueHook(airflow_conn) as hook:
        hook.create_queue("tx")
        pushed = orders(100)
        hook.push("tx", pushed)
        with hook.transaction() as conn:
            conn.execute(f"CREATE TABLE {dbq.schema}.results (v jsonb)")
        with pytest.raises(RuntimeError), hook.transaction() as conn:
            msgs = hook.pop("tx", 100, semantics="exactly-once", conn=conn)
            conn.execute(
                f"INSERT INTO {dbq.schema}.results SELECT unnest(%s::jsonb[])",
                [[json.dumps(m.payload) for m in msgs]],
            )
            raise RuntimeError("the job failed")  # rolls back the pop and the insert together
        assert hook.count_ready("tx") == 100
        with hook.transaction() as conn:
            msgs = hook.pop("tx", 100, semantics="exactly-once", conn=conn)
            conn.execute(
                f"INSERT INTO {dbq.schema}.results SELECT unnest(%s::jsonb[])",
                [[json.dumps(m.payload) for m in msgs]],
            )
        with hook.transaction() as conn:
            rows = conn.execute(f"SELECT v FROM {dbq.schema}.results").fetchall()
        assert checksum(r[0] for r in rows) == checksum(pushed)
        assert hook.count_ready("tx") == 0


def test_missing_queue_and_unreachable_database(
    airflow_conn: str, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DbQueueHook(airflow_conn) as hook, pytest.raises(QueueNotFoundError, match="nope"):
        hook.push("nope", [1])
    monkeypatch.setenv("AIRFLOW_CONN_DOWN", conn_json("host=127.0.0.1 port=1 user=x dbname=x", "s"))
    hook = DbQueueHook("down", connect_timeout=1)
    ok, msg = hook.test_connection()
    assert not ok and "127.0.0.1:1" in msg
    with pytest.raises(DatabaseUnavailableError):
        hook.stats("q")
    hook.close()


def test_engine_readiness_leased_and_receipts(dbq: DbQueue) -> None:
    """The engine methods added for the Airflow face: readiness (both faces), leased, receipts."""
    q = dbq.create_queue("obs", retry_backoff=0)
    assert q.readiness() == (0, None)
    ids = [*q.push_batch(orders(5)), q.push({"hi": 1}, priority=5)]
    assert q.readiness() == (6, (ids[5], 0))  # the head is what a pop takes first: highest priority
    assert q.readiness(min_priority=5) == (1, (ids[5], 0))
    assert q.readiness(cap=2)[0] == 2
    [m] = q.pop(1, semantics="at-least-once")
    assert q.readiness() == (5, (ids[0], 0))
    q.nack([m], delay=0)
    assert q.readiness() == (6, (ids[5], 1))  # back at the head, delivered once more

    async def observe() -> tuple[int, tuple[int, int] | None]:
        async with AsyncDbQueue(dbq.db.dsn, schema=dbq.schema) as adbq:
            return await (await adbq.queue("obs")).readiness()

    assert asyncio.run(observe()) == q.readiness()

    msgs = q.pop(6, semantics="at-least-once")
    receipts = [m.receipt for m in msgs]
    assert [m.receipt for m in q.leased(receipts)] == receipts
    assert checksum(m.payload for m in q.leased(receipts)) == checksum([*orders(5), {"hi": 1}])
    assert q.leased([(receipts[0][0], receipts[0][1] + 1)]) == []  # a stale receipt holds nothing
    assert q.nack_receipts(receipts[:2], delay=0) == 2
    assert q.ack_receipts(receipts[2:]) == 4
    with pytest.raises(LeaseExpiredError):
        q.ack_receipts(receipts[:1])  # nacked: that delivery is over
    with pytest.raises(ConfigurationError, match="pair"):
        q.ack_receipts([(1, 2, 3)])  # type: ignore[list-item]
    assert q.stats().ready == 2


def test_provider_is_discovered(tmp_path: object) -> None:
    """``airflow providers hooks/triggers/queues`` list the provider (three CLI calls in parallel)."""
    import os

    env = dict(os.environ, AIRFLOW__CORE__LOAD_EXAMPLES="False")
    procs = {
        what: subprocess.Popen(
            [str(AIRFLOW), "providers", what, "--output", "json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for what in ("hooks", "triggers", "queues")
    }
    out = {}
    for what, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out[what] = json.loads(stdout)
    assert {
        "connection_type": "dbqueue",
        "class": "airflow_dbqueue.hooks.dbqueue.DbQueueHook",
        "conn_id_attribute_name": "dbqueue_conn_id",
        "package_name": "airflow-dbqueue",
        "hook_name": "DB Queue",
    } in out["hooks"]
    assert any(
        t["package_name"] == "airflow-dbqueue" and t["class"] == "airflow_dbqueue.triggers.dbqueue"
        for t in out["triggers"]
    ), out["triggers"]
    assert {"queue_class_names": "airflow_dbqueue.queues.dbqueue.DbQueueMessageQueueProvider"} in out[
        "queues"
    ]
    assert get_provider_info()["queues"] == ["airflow_dbqueue.queues.dbqueue.DbQueueMessageQueueProvider"]
