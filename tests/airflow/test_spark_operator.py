"""DbQueueSparkSubmitOperator's batch lifecycle on both Spark paths, a real ``spark-submit`` per batch and
a session per batch on the test session's real Spark Connect server: the lease heartbeat keeps a long
job's batch; a task timeout stops the job and releases the batch with nothing lost; a try finds what
a killed try left (its batch claimed, its job still running) and releases it at once; a run does not
end green while a batch of its task is still claimed."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.operators.spark import batch_tag
from airflow_dbqueue.spark.connect_server import LocalConnectServer
from tests.airflow.conftest import (
    AIRFLOW,
    CONN_ID,
    conn_json,
    connect_env,
    dags_test,
    deployment,
    deployment_env,
    event_log_text,
    log_tails,
    migrated_airflow_env,
    spark_env,
)
from tests.helpers import checksum

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("java_runtime")]

DAGS = Path(__file__).with_name("spark_dags")


@pytest.fixture(scope="module")
def submit_lifecycle_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return spark_env(migrated_airflow_env(tmp_path_factory.mktemp("airflow-home-spark"), DAGS))


@pytest.fixture(params=["submit", "connect"])
def spark_path(request: pytest.FixtureRequest) -> str:
    """Which Spark path ``spark_default`` takes."""
    return str(request.param)


@pytest.fixture
def lifecycle_env(
    submit_lifecycle_env: dict[str, str], spark_path: str, request: pytest.FixtureRequest
) -> dict[str, str]:
    if spark_path == "connect":
        return connect_env(submit_lifecycle_env, request.getfixturevalue("connect_server"))
    return submit_lifecycle_env


def canceled_on_connect(server: LocalConnectServer, batch_id: str, wait_s: float = 20.0) -> bool:
    """Whether the Connect server recorded an operation of the batch's job (tagged with the batch's
    tag) as canceled: its Spark work was interrupted, not left running. The server's event log is
    written through a buffer, so it is read again for up to ``wait_s`` seconds."""
    tag = batch_tag(batch_id)
    deadline = time.monotonic() + wait_s
    while True:
        started, canceled = set(), set()
        for line in event_log_text(server).splitlines():
            if "SparkListenerConnectOperation" not in line:
                continue
            event = json.loads(line)
            if event["Event"].endswith("SparkListenerConnectOperationStarted"):
                if tag in event.get("sparkSessionTags", []):
                    started.add(event["operationId"])
            elif event["Event"].endswith("SparkListenerConnectOperationCanceled"):
                canceled.add(event["operationId"])
        if started & canceled or time.monotonic() > deadline:
            return bool(started & canceled)
        time.sleep(1.0)


def batches(c: psycopg.Connection[Any], schema: str) -> sql.Composable:
    """Every batch of the schema, as a relation (batch_id, state, ids, consumer, claimed_at,
    last_error): the table design's and the slots rings' (the schema's ``batches``), and those of the
    rings of the rows layout (each ring's own ledger, a batch's state its newest state row)."""
    s = sql.Identifier(schema)
    parts: list[sql.Composable] = [
        sql.SQL("SELECT batch_id, state, ids, consumer, claimed_at, last_error FROM {}.batches").format(s)
    ]
    for (qid,) in c.execute(sql.SQL("SELECT queue_id FROM {}.ring_rows").format(s)).fetchall():
        parts.append(
            sql.SQL(
                "SELECT b.batch_id, coalesce(x.state, 0::smallint), b.ids, b.consumer, b.claimed_at, "
                "x.last_error FROM {b} b LEFT JOIN LATERAL (SELECT y.state, y.last_error FROM {bs} y "
                "WHERE y.batch_id = b.batch_id ORDER BY y.ver DESC LIMIT 1) x ON true"
            ).format(b=sql.Identifier(schema, f"ring_{qid}_rb"), bs=sql.Identifier(schema, f"ring_{qid}_rbs"))
        )
    return sql.SQL("(") + sql.SQL(" UNION ALL ").join(parts) + sql.SQL(")")


def batch_rows(pg_dsn: str, schema: str, dag_id: str = "") -> list[tuple[int, int, str | None]]:
    """(state, size, last error) of the batches claimed by tries of ``dag_id``'s tasks (all: "")."""
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            sql.SQL(
                "SELECT state, cardinality(ids), last_error FROM {} b "
                "WHERE starts_with(consumer, %s) ORDER BY claimed_at"
            ).format(batches(c, schema)),
            (f"{dag_id}." if dag_id else "",),
        ).fetchall()


def sleepy_jobs_running() -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "sleepy_job.py" in line and "ps -eo" not in line]


def test_heartbeat_keeps_a_long_jobs_batch(lifecycle_env: dict[str, str], pg_dsn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("jobs")
    sent = [{"job": i} for i in range(30)]
    q.push_batch(sent)
    ok, out = dags_test(lifecycle_env, pg_dsn, dbq.schema, "dbqueue_test_spark_heartbeat")
    assert ok, out[-5000:]
    # the job slept 12 s on a 6 s lease; the ack succeeded, so the lease was extended throughout
    assert batch_rows(pg_dsn, dbq.schema) == [(1, 30, None)]
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (0, 0, 30)
    # the finished messages are exactly the ones pushed (kept with their payloads for the archiver)
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(
            sql.SQL(
                "SELECT coalesce(f.payload, d.payload) FROM {s}.done f LEFT JOIN {s}.data d ON d.id = f.id"
            ).format(s=sql.Identifier(dbq.schema))
        ).fetchall()
    assert checksum(json.loads(bytes(r[0])) for r in rows) == checksum(sent)


def test_timeout_kills_the_job_and_releases_the_batch(
    lifecycle_env: dict[str, str],
    pg_dsn: str,
    dbq: DbQueue,
    spark_path: str,
    request: pytest.FixtureRequest,
) -> None:
    q = dbq.create_queue("jobs")
    sent = [{"job": i, "blob": "x" * (i % 7)} for i in range(40)]
    q.push_batch(sent)
    t0 = time.monotonic()
    ok, out = dags_test(lifecycle_env, pg_dsn, dbq.schema, "dbqueue_test_spark_timeout")
    assert not ok and time.monotonic() - t0 < 300, out[-5000:]  # the 600 s job did not run out
    [(state, size, error)] = batch_rows(pg_dsn, dbq.schema)
    assert (state, size) == (2, 40) and error is not None and "Timeout" in error, error
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (40, 0, 0, 0)  # nothing lost
    again = q.pop(100)
    assert checksum(m.payload for m in again) == checksum(sent)
    deadline = time.monotonic() + 20
    if spark_path == "connect":  # the server's sleeping task was interrupted with the task
        server = request.getfixturevalue("connect_server")
        batch_id = _first_batch(pg_dsn, dbq.schema)
        while not canceled_on_connect(server, batch_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert canceled_on_connect(server, batch_id)
    while sleepy_jobs_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sleepy_jobs_running() == []  # the job was killed with the task


def staging_jobs_running(batch_id: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "staging_job.py" in line and batch_id in line]


def drill_env(tmp_path: Path, pg_dsn: str, dbq: DbQueue) -> dict[str, str]:
    """The staging directory and the results table of the drill DAGs (in the queue schema, dropped
    with it; a message published twice breaks its key); what they need in the environment."""
    (tmp_path / "staging").mkdir()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            sql.SQL(
                "CREATE TABLE {}.drill_results"
                " (queue text, id bigint, batch_id text NOT NULL, PRIMARY KEY (queue, id))"
            ).format(sql.Identifier(dbq.schema))
        )
    return {"DBQUEUE_TEST_STAGING": str(tmp_path / "staging"), "DBQUEUE_TEST_SCHEMA": dbq.schema}


def results(
    pg_dsn: str, schema: str, dag_id: str = "", *, ring: bool = False, rows_ring: int | None = None
) -> list[tuple[int, str, bytes]]:
    """The drill's results with each message's payload: (id, batch id, payload), of the batches of
    ``dag_id``'s tasks (all: ""). A small payload is in its message's meta row (or done row, once
    finished), a large one in data; with ``ring``, the batches are of the schema's only ring, and a
    payload is in the slot holding its number (a ring's numbers and the table design's ids overlap);
    with ``rows_ring`` (a queue_id), of that ring of the rows layout, message k of its row r (the id
    ``(r << 16) | k``) being element k + 1 of the row's payloads."""
    if rows_ring is not None:
        where = (
            "(SELECT (t.payloads)[(r.id & 65535) + 1] FROM {s}." + f"ring_{int(rows_ring)}_rq"
            " t WHERE t.r = r.id >> 16)"
        )
    elif ring:
        where = "(SELECT t.payload FROM {s}.ring_slots t WHERE t.seq = r.id)"
    else:
        where = (
            "coalesce((SELECT m.payload FROM {s}.meta m WHERE m.id = r.id), "
            "(SELECT f.payload FROM {s}.done f WHERE f.id = r.id), "
            "(SELECT d.payload FROM {s}.data d WHERE d.id = r.id))"
        )
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            sql.SQL(
                "SELECT * FROM (SELECT r.id, r.batch_id, " + where + " AS payload "
                "FROM {s}.drill_results r WHERE r.batch_id IN "
                "(SELECT batch_id::text FROM {b} b WHERE starts_with(consumer, %s))) x "
                "WHERE x.payload IS NOT NULL"
            ).format(s=sql.Identifier(schema), b=batches(c, schema)),
            (f"{dag_id}." if dag_id else "",),
        ).fetchall()


@pytest.mark.parametrize("design", ["table", "ring-group", "ring-rows"])
def test_a_try_finds_the_batch_a_killed_try_left_and_releases_it_at_once(
    lifecycle_env: dict[str, str], pg_dsn: str, dbq: DbQueue, tmp_path: Path, *, design: str, spark_path: str
) -> None:
    """What a try killed mid-batch leaves (its batch claimed with a 600 s lease, part of its staging,
    its orphaned job still running and writing staging) is cleaned up by the next try of the task:
    the orphan is stopped, the staging discarded and the batch released at once, and the try then
    claims those messages with the rest. Every message is published exactly once, the queue is
    drained, no batch is left open and no staging is left.

    ``airflow dags test`` runs the task in its own process, which a test cannot SIGKILL without
    ending the run, so an upstream task plays the killed try: it claims under the consumer name of an
    earlier try of ``process`` and starts the orphan (see the DAG). ``ring-group``: the queue is a ring
    and both tries take batches for its consumer group ``g`` (``group=``); its default group, which
    nobody pops, still holds all 30. ``ring-rows``: a ring of the rows layout, its own batches (its
    default group's), on spark-submit only: the batch calls the operator makes are the engine's on
    either path, and Connect's ring case is the slots layout's."""
    if design == "ring-rows" and spark_path == "connect":
        pytest.skip("the rows layout's batches under the operator: spark-submit's path is enough")
    ring = design == "ring-group"
    rows_layout = design == "ring-rows"
    settings: dict[str, Any] = {}
    if ring:
        settings = {"design": "ring", "capacity": 64, "layout": "slots"}
    elif rows_layout:
        settings = {"design": "ring", "capacity": 64, "layout": "rows"}
    q = dbq.create_queue("jobs", **settings)
    handle = q.add_group("g") if ring else q  # type: ignore[attr-defined]
    sent = [{"job": i, "blob": "y" * (i % 5)} for i in range(30)]
    q.push_batch(sent)
    env = drill_env(tmp_path, pg_dsn, dbq)
    if ring:
        env["DBQUEUE_TEST_GROUP"] = "g"
    ok, out = dags_test(lifecycle_env, pg_dsn, dbq.schema, "dbqueue_test_spark_killed_try", **env)
    assert ok, out[-5000:]
    rows = batch_rows(pg_dsn, dbq.schema)
    assert [(state, size) for state, size, _ in rows] == [(2, 10), (1, 30)], rows
    error = rows[0][2]
    assert error is not None and error.startswith("released by dbqueue_test_spark_killed_try.process.")
    assert "try1: " in error and "try0 ended without acking or releasing it" in error, error
    got = results(pg_dsn, dbq.schema, ring=ring, rows_ring=q.settings.queue_id if rows_layout else None)
    assert len(got) == 30 and checksum(json.loads(bytes(p)) for _, _, p in got) == checksum(sent)
    st = handle.stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, 0 if ring or rows_layout else 30)
    assert handle.open_batches() == []
    if ring:
        assert q.stats().ready == 30  # the default group's: untouched
    assert list((tmp_path / "staging").iterdir()) == []  # the orphan's staging discarded, and not rewritten
    assert staging_jobs_running(str(_first_batch(pg_dsn, dbq.schema))) == []  # the orphan was stopped


def _first_batch(pg_dsn: str, schema: str, dag_id: str = "") -> str:
    """The first batch claimed by a try of ``dag_id``'s tasks (of any DAG: "")."""
    with psycopg.connect(pg_dsn) as c:
        query = sql.SQL(
            "SELECT batch_id FROM {} b WHERE starts_with(consumer, %s) ORDER BY claimed_at LIMIT 1"
        )
        row = c.execute(query.format(batches(c, schema)), (f"{dag_id}." if dag_id else "",)).fetchone()
    assert row is not None
    return str(row[0])


def test_a_try_does_not_end_green_while_a_batch_of_its_task_is_still_claimed(
    lifecycle_env: dict[str, str], pg_dsn: str, dbq: DbQueue, tmp_path: Path
) -> None:
    """While the first try ran, an earlier try still running (a zombie) claimed a batch of the same
    queue. The first try published its own batch, then found that one still claimed and failed, so
    the run did not end green with it stranded; its retry released it and processed it. Every message
    is published exactly once, and no batch is left open."""
    q = dbq.create_queue("jobs")
    sent = [{"job": i} for i in range(25)]
    q.push_batch(sent)
    env = drill_env(tmp_path, pg_dsn, dbq)
    ok, out = dags_test(lifecycle_env, pg_dsn, dbq.schema, "dbqueue_test_spark_zombie_claims", **env)
    assert ok, out[-5000:]
    assert "are still claimed (an earlier try still running claimed them)" in out
    rows = batch_rows(pg_dsn, dbq.schema)
    assert [(state, size) for state, size, _ in rows] == [(1, 20), (2, 5), (1, 5)], rows
    got = results(pg_dsn, dbq.schema)
    assert len(got) == 25 and checksum(json.loads(bytes(p)) for _, _, p in got) == checksum(sent)
    st = q.stats()
    assert (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, 25)
    assert q.open_batches() == [] and list((tmp_path / "staging").iterdir()) == []


@pytest.mark.slow
def test_a_task_sigkilled_mid_batch_under_a_real_scheduler_leaves_nothing_behind(
    pg_dsn: str, dbq: DbQueue, tmp_path: Path, connect_server: LocalConnectServer
) -> None:
    """The drill of a real deployment, on both Spark paths at once and on a ring's consumer group under
    spark-submit (one DAG each, on a queue of its own, run side by side by one deployment): api-server
    (execution API), scheduler with LocalExecutor as separate processes, a real spark-submit and the test
    session's Spark Connect server. The first try's job SIGKILLs its task process mid-batch, with its 30
    messages claimed under a 600 s lease: under spark-submit the LocalExecutor's child, parent of
    spark-submit, and the job goes on running as an orphan that writes staging; on Connect the task process
    itself, whose job goes on in its session on the server (a client of that session runs the batch's
    tagged operations and writes staging). The retry stops the orphan (on Connect: interrupts and releases
    the session), discards its staging and releases the batch at once, then processes the messages. Each
    run ends green only with every message published exactly once: no batch open, no lease stranded, no
    staging left, no orphan running."""
    env = spark_env(deployment_env(tmp_path / "home", DAGS))
    env.update(
        drill_env(tmp_path, pg_dsn, dbq),
        AIRFLOW_CONN_SPARK_CONNECT_DEFAULT=connect_env(env, connect_server)["AIRFLOW_CONN_SPARK_DEFAULT"],
        # The orphans hold the killed task's inherited stdin (the supervisor's socket to it), so the
        # supervisor waits this long after the kill before it reports the try failed (default 60 s).
        AIRFLOW__WORKERS__SOCKET_CLEANUP_TIMEOUT="5",
        **{f"AIRFLOW_CONN_{CONN_ID.upper()}": conn_json(pg_dsn, dbq.schema)},
    )
    paths = ("submit", "connect", "ring")
    queues = {path: dbq.create_queue(f"jobs_{path}") for path in paths[:2]}
    # ring: spark-submit on a ring, for its consumer group g; its default group, which nobody pops,
    # keeps all 30.
    ring = dbq.create_queue("jobs_ring", design="ring", capacity=64, layout="slots")
    queues["ring"] = ring.add_group("g")  # type: ignore[attr-defined]
    sent = {path: [{"job": i, "path": path, "blob": "z" * (i % 3)} for i in range(30)] for path in paths}
    for path in paths:
        (ring if path == "ring" else queues[path]).push_batch(sent[path])
    dag_ids = {path: f"dbqueue_test_spark_sigkill_{path}" for path in paths}
    subprocess.run(
        [str(AIRFLOW), "dags", "reserialize"], env=env, check=True, capture_output=True, timeout=300
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    home = Path(env["AIRFLOW_HOME"])

    def meta(query: str, *args: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(home / "airflow.db") as c:
            return c.execute(query, args).fetchall()

    def run_state(dag_id: str) -> list[tuple[Any, ...]]:
        return meta("SELECT state FROM dag_run WHERE dag_id = ?", dag_id)

    with deployment(env, logs, "api-server", "scheduler"):
        for dag_id in dag_ids.values():
            subprocess.run(
                [str(AIRFLOW), "dags", "trigger", dag_id],
                env=env,
                check=True,
                capture_output=True,
                timeout=300,
            )
        deadline = time.monotonic() + 420
        while any(run_state(d) not in ([("success",)], [("failed",)]) for d in dag_ids.values()):
            assert time.monotonic() < deadline, log_tails(logs)
            time.sleep(1)
        tries = {
            path: (
                run_state(d),
                meta("SELECT try_number, state FROM task_instance WHERE dag_id = ?", d),
                meta("SELECT try_number, state FROM task_instance_history WHERE dag_id = ?", d),
            )
            for path, d in dag_ids.items()
        }
    for path, dag_id in dag_ids.items():
        assert tries[path] == ([("success",)], [(2, "success")], [(1, "failed")]), (
            path,
            tries,
            log_tails(logs),
        )
        marker = {"submit": "killed-once", "connect": "killed-once-connect", "ring": "killed-once-ring"}[path]
        killed = (tmp_path / marker).read_text()  # "pid cmdline" of the task process the job killed
        assert killed.split()[1] == "airflow", killed
        rows = batch_rows(pg_dsn, dbq.schema, dag_id)
        assert [(state, size) for state, size, _ in rows] == [(2, 30), (1, 30)], (path, rows)
        assert rows[0][2] is not None and "try1 ended without acking or releasing it" in rows[0][2], rows
        got = results(pg_dsn, dbq.schema, dag_id, ring=path == "ring")
        assert len(got) == 30 and checksum(json.loads(bytes(p)) for _, _, p in got) == checksum(sent[path])
        st = queues[path].stats()
        finished = 0 if path == "ring" else 30  # a ring keeps no finished messages
        assert (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, finished), (path, killed)
        assert queues[path].open_batches() == []
        assert staging_jobs_running(_first_batch(pg_dsn, dbq.schema, dag_id)) == []
    assert ring.stats().ready == 30  # the default group's: untouched
    assert list((tmp_path / "staging").iterdir()) == []
    # on Connect, the killed try's job (the orphan's operations, tagged with its batch) was interrupted
    assert canceled_on_connect(connect_server, _first_batch(pg_dsn, dbq.schema, dag_ids["connect"]))
