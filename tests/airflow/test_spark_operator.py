"""DbQueueSparkSubmitOperator's batch lifecycle with a real ``spark-submit``: the lease heartbeat keeps a
long job's batch, and a task timeout kills the job and releases the batch with nothing lost."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from tests.airflow.conftest import dags_test, migrated_airflow_env, spark_env
from tests.helpers import checksum

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("java_runtime")]

DAGS = Path(__file__).with_name("spark_dags")


@pytest.fixture(scope="module")
def lifecycle_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return spark_env(migrated_airflow_env(tmp_path_factory.mktemp("airflow-home-spark"), DAGS))


def batch_rows(pg_dsn: str, schema: str) -> list[tuple[int, int, str | None]]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            sql.SQL("SELECT state, cardinality(ids), last_error FROM {}.batches ORDER BY claimed_at").format(
                sql.Identifier(schema)
            )
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
    # the job slept 12 s on a 3 s lease; the ack succeeded, so the lease was extended throughout
    assert batch_rows(pg_dsn, dbq.schema) == [(1, 30, None)]
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (0, 0, 30)
    # the finished messages are exactly the ones pushed (kept with their payloads for the archiver)
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(
            sql.SQL("SELECT d.payload FROM {s}.done f JOIN {s}.data d ON d.id = f.id").format(
                s=sql.Identifier(dbq.schema)
            )
        ).fetchall()
    assert checksum(json.loads(bytes(r[0])) for r in rows) == checksum(sent)


def test_timeout_kills_the_job_and_releases_the_batch(
    lifecycle_env: dict[str, str], pg_dsn: str, dbq: DbQueue
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
    while sleepy_jobs_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sleepy_jobs_running() == []  # the job was killed with the task
