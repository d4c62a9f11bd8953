"""The triggerer path: a push makes an asset-watched DAG get a queued run.

A real ``airflow triggerer`` runs the AssetWatcher's ``MessageQueueTrigger(scheme="dbqueue")`` (that is,
DbQueueTrigger, found through the provider's ``queues`` entry); the push fires an asset event, and the
scheduler turns the queued asset event into an ``asset_triggered`` run of the DAG.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from tests.airflow.conftest import (
    AIRFLOW,
    CONN_ID,
    conn_json,
    deployment,
    deployment_env,
    log_tails,
    trigger_is_waiting,
)
from tests.helpers import checksum

pytestmark = pytest.mark.integration

DAG_ID = "dbqueue_asset_triggered"


def sql(env: dict[str, str], query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as c:
        return c.execute(query).fetchall()


def wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_push_queues_a_run_of_the_asset_watched_dag(
    airflow_env: dict[str, str], pg_dsn: str, dbq: DbQueue, tmp_path: Path
) -> None:
    q = dbq.create_queue("example_inbox")
    env = dict(airflow_env, **{f"AIRFLOW_CONN_{CONN_ID.upper()}": conn_json(pg_dsn, dbq.schema)})
    subprocess.run(
        [str(AIRFLOW), "dags", "reserialize"], env=env, check=True, capture_output=True, timeout=300
    )
    subprocess.run(
        [str(AIRFLOW), "dags", "unpause", DAG_ID], env=env, check=True, capture_output=True, timeout=300
    )
    [(classpath,)] = sql(env, "SELECT classpath FROM trigger")
    assert classpath == "airflow_dbqueue.triggers.dbqueue.DbQueueTrigger"

    log = (tmp_path / "triggerer.log").open("w")
    triggerer = subprocess.Popen(
        [str(AIRFLOW), "triggerer"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_for("the triggerer to run the trigger", lambda: trigger_is_waiting(dbq.db.dsn), 120)
        assert sql(env, "SELECT count(*) FROM asset_event") == [(0,)]
        pushed = [{"mail": i} for i in range(3)]
        ids = q.push_batch(pushed)
        [(extra,)] = wait_for("the asset event", lambda: sql(env, "SELECT extra FROM asset_event"), 60)
        payload = json.loads(extra)["payload"]
        assert payload["status"] == "success" and payload["queue_name"] == "example_inbox"
        assert sql(env, "SELECT target_dag_id FROM asset_dag_run_queue") == [(DAG_ID,)]
        assert q.stats().ready == 3  # the trigger only observed
        # the head it fired for, kept in the asset state store
        [(key, value)] = wait_for(
            "the stored head", lambda: sql(env, "SELECT key, value FROM asset_state_store"), 30
        )
        assert key.startswith("airflow_dbqueue.last_head:") and json.loads(value) == [ids[0], 0]
    finally:
        _stop(triggerer)
        log.close()

    # A restarted triggerer reads that head back: the queue has not changed, so it does not fire again.
    wait_for("the old trigger's connection to close", lambda: not trigger_connections(dbq.db.dsn), 30)
    log = (tmp_path / "triggerer2.log").open("w")
    triggerer = subprocess.Popen(
        [str(AIRFLOW), "triggerer"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_for("the restarted triggerer to run the trigger", lambda: trigger_is_waiting(dbq.db.dsn), 120)
        time.sleep(12)  # two of the watcher's 5 s polls of the unchanged queue
        assert sql(env, "SELECT count(*) FROM asset_event") == [(1,)], (
            tmp_path / "triggerer2.log"
        ).read_text()[-3000:]
    finally:
        _stop(triggerer)
        log.close()

    # The scheduler turns the queued asset event into a run. It runs until the run exists and is then
    # stopped: `scheduler --num-runs 1` sometimes never exits, because one of LocalExecutor's workers
    # misses its shutdown message and the scheduler waits for it forever (seen on Airflow 3.3.2).
    sched_log = (tmp_path / "scheduler.log").open("w")
    scheduler = subprocess.Popen(
        [str(AIRFLOW), "scheduler"],
        env=env,
        stdout=sched_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        query = f"SELECT run_type FROM dag_run WHERE dag_id = '{DAG_ID}'"
        runs = wait_for("the asset-triggered run", lambda: sql(env, query), 120)
    finally:
        _stop(scheduler)
        sched_log.close()
    assert runs == [("asset_triggered",)], (tmp_path / "scheduler.log").read_text()[-3000:]


def trigger_connections(dsn: str) -> int:
    """The triggers' stream connections open on the server."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-dbqueue-trigger'"
        ).fetchone()
    return int(row[0]) if row else 0


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop an Airflow component and everything it started."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow
def test_a_run_that_fails_before_it_claims_is_followed_by_another(
    pg_dsn: str, dbq: DbQueue, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The event-driven failure path on a real deployment: api-server (execution API), scheduler with
    LocalExecutor and triggerer as separate processes. The watcher (``max_wait=5``) fires for a push;
    the run it starts fails before it claims anything, so the queue's head never moves. The watcher
    fires again after max_wait, and the scheduler starts a second run; without max_wait there would be
    one event and one run until a triggerer restart. The messages stay in the queue, all of them."""
    env = deployment_env(
        tmp_path_factory.mktemp("airflow-home-refire"), Path(__file__).with_name("watcher_dags")
    )
    env[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = conn_json(pg_dsn, dbq.schema)
    logs = tmp_path_factory.mktemp("refire-logs")
    q = dbq.create_queue("refire")
    for args in (["dags", "reserialize"], ["dags", "unpause", "dbqueue_test_refire"]):
        subprocess.run([str(AIRFLOW), *args], env=env, check=True, capture_output=True, timeout=300)
    with deployment(env, logs, "api-server", "triggerer", "scheduler"):
        wait_for("the triggerer to run the trigger", lambda: trigger_is_waiting(dbq.db.dsn), 120)
        pushed = [{"mail": i} for i in range(3)]
        ids = q.push_batch(pushed)
        runs = "SELECT run_id, state FROM dag_run WHERE dag_id = 'dbqueue_test_refire' ORDER BY id"

        def second_run() -> list[tuple[Any, ...]]:
            got = sql(env, runs)
            return got if len(got) >= 2 and got[0][1] == "failed" else []

        try:
            got = wait_for("a second run after the first failed", second_run, 240)
        except AssertionError:
            raise AssertionError(f"runs: {sql(env, runs)}\n{log_tails(logs)}") from None
        # the first run's task ran (it has a start date) and failed: it failed before claiming
        [(state, started)] = sql(
            env, f"SELECT state, start_date FROM task_instance WHERE run_id = '{got[0][0]}'"
        )
        assert state == "failed" and started is not None
        events = [json.loads(e)["payload"] for (e,) in sql(env, "SELECT extra FROM asset_event ORDER BY id")]
        assert [e["reason"] for e in events[:2]] == ["ready", "max_wait"]
        assert all(e["head"] == [ids[0], 0] for e in events)  # the head never moved
        st = q.stats()
        assert (st.ready, st.in_flight) == (3, 0)  # nothing claimed, nothing lost
    got_msgs = q.pop(10, semantics="at-least-once")
    assert q.ack(got_msgs) == 3 and checksum(m.payload for m in got_msgs) == checksum(pushed)
