"""On a ``spark_connect`` connection the operator refuses, before it claims anything, what only spark-submit
can deliver or what cannot run on Spark Connect, with a ConfigurationError that says why. Run in process
(the task's own code path, ``execute``), with real Airflow connections and a real queue; no Spark needed:
each case fails before a session is opened."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_dbqueue.engine import ConfigurationError, DbQueue
from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator, SparkBatchError
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB
from tests.helpers import checksum

pytestmark = pytest.mark.integration


@pytest.fixture
def conns(airflow_conn: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(the queue's connection, a spark_connect connection)."""
    conn = {"conn_type": "spark_connect", "host": "sc://127.0.0.1", "port": 1}  # nothing listens there
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CONNECT_TEST", json.dumps(conn))
    return airflow_conn, "spark_connect_test"


def _context() -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="d", task_id="t", run_id="r", map_index=-1, try_number=1)
    return {"ti": ti}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env_vars": {"X": "1"}}, "env_vars reach a spark-submit job's environment"),
        ({"jdbc_password_file": "/etc/pw"}, "jdbc_password_file is for a spark-submit driver"),
        ({"application": "SUBMIT_ONLY"}, "defines no batch_job"),
        ({"application": "/nonexistent/job.py"}, "is not a Python file here"),
    ],
)
def test_bad_input_on_connect_fails_before_anything_is_claimed(
    conns: tuple[str, str],
    dbq: DbQueue,
    tmp_path: Path,
    kwargs: dict[str, Any],
    message: str,
) -> None:
    q = dbq.create_queue("jobs")
    q.push_batch([{"job": i} for i in range(5)])
    if kwargs.get("application") == "SUBMIT_ONLY":
        job = tmp_path / "submit_only.py"
        job.write_text("import sys\nprint(sys.argv)\n")  # a spark-submit job with no batch_job
        kwargs = {**kwargs, "application": str(job)}
    op = DbQueueSparkSubmitOperator(
        task_id="t",
        queue_name="jobs",
        spark_conn_id=conns[1],
        dbqueue_conn_id=conns[0],
        **{"application": ORDER_ROLLUP_JOB, **kwargs},
    )
    with pytest.raises(ConfigurationError, match=message):
        op.execute(_context())
    st = q.stats()
    assert (st.ready, st.in_flight) == (5, 0)  # nothing was claimed
    assert q.open_batches() == []


def test_a_connect_server_that_is_down_fails_the_batch_and_releases_it_at_once(
    conns: tuple[str, str], dbq: DbQueue
) -> None:
    """Nothing listens where the connection points: the session's first call fails after the operator's
    short retries (not pyspark's ten minutes), and the batch is released at once, its messages ready
    again with the attempt counted."""
    q = dbq.create_queue("jobs")
    sent = [{"job": i} for i in range(7)]
    q.push_batch(sent)
    op = DbQueueSparkSubmitOperator(
        task_id="t",
        queue_name="jobs",
        application=ORDER_ROLLUP_JOB,
        spark_conn_id=conns[1],
        dbqueue_conn_id=conns[0],
    )
    t0 = time.monotonic()
    with pytest.raises(SparkBatchError, match="no session on the Spark Connect server"):
        op.execute(_context())
    assert time.monotonic() - t0 < 120
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (7, 0, 0)
    assert q.open_batches() == []
    again = q.pop(10)
    assert checksum(m.payload for m in again) == checksum(sent)
    assert [m.attempts for m in again] == [2] * 7  # the failed try, and this pop
