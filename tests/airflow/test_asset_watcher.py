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

import pytest

from airflow_dbqueue.engine import DbQueue
from tests.airflow.conftest import AIRFLOW, CONN_ID, conn_json, trigger_is_waiting

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
        q.push_batch(pushed)
        [(extra,)] = wait_for("the asset event", lambda: sql(env, "SELECT extra FROM asset_event"), 60)
        payload = json.loads(extra)["payload"]
        assert payload["status"] == "success" and payload["queue_name"] == "example_inbox"
        assert sql(env, "SELECT target_dag_id FROM asset_dag_run_queue") == [(DAG_ID,)]
        assert q.stats().ready == 3  # the trigger only observed
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


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop an Airflow component and everything it started."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
