"""Test DAGs for the batch lifecycle of DbQueueSparkSubmitOperator (see test_spark_operator.py)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, BaseHook, task
from psycopg import sql

from airflow_dbqueue.engine import Batch
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator, batch_tag, connect_session_id

JOB = str(Path(__file__).with_name("sleepy_job.py"))

with DAG(dag_id="dbqueue_test_spark_heartbeat", schedule=None, catchup=False):
    # The job outlives its 6 s lease twice over: only the heartbeat (every 2 s) keeps the batch
    # claimed. A beat may come late by up to 4 s before the lease runs out, which a busy 2-core
    # machine's scheduling of the task's threads stays well within.
    DbQueueSparkSubmitOperator(
        task_id="hold_batch",
        queue_name="jobs",
        application=JOB,
        application_args=["12"],
        max_messages=50,
        visibility_timeout=6,
    )

with DAG(dag_id="dbqueue_test_spark_timeout", schedule=None, catchup=False):
    # The timeout leaves either path's job time to start (spark-submit's JVM takes about 5 s here, a
    # Connect session about 2 s) and then ends it 585 s early.
    DbQueueSparkSubmitOperator(
        task_id="too_slow",
        queue_name="jobs",
        application=JOB,
        application_args=["600"],
        max_messages=50,
        visibility_timeout=300,
        execution_timeout=dt.timedelta(seconds=15),
        retries=0,
    )


# -- a try killed mid-batch, and an earlier try still running (test_spark_operator.py) ---------------

STAGING_JOB = str(Path(__file__).with_name("staging_job.py"))
STAGING = Path(os.environ.get("DBQUEUE_TEST_STAGING", "/nonexistent"))
"""Where the jobs stage their batches: a file a batch, named by its id (the tests set it)."""
SCHEMA = os.environ.get("DBQUEUE_TEST_SCHEMA", "")
"""The queue schema, which also holds the tests' results table ``drill_results``."""
GROUP = os.environ.get("DBQUEUE_TEST_GROUP") or None
"""The consumer group of the ring ``jobs`` the killed-try drill takes batches for (None: the queue's own
batches, whatever its design)."""


def _publish(conn: Any, batch: Batch) -> None:
    """Move the batch's staging into the results (in the ack's transaction), then drop the staging."""
    staged = STAGING / batch.batch_id
    assert int(staged.read_text()) == batch.size, "the job staged another batch size"
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.drill_results (queue, id, batch_id) SELECT %s, unnest(%s::bigint[]), %s"
        ).format(sql.Identifier(SCHEMA)),
        (batch.queue, [i for i, _ in batch.receipts], batch.batch_id),
    )
    staged.unlink()


def _discard(conn: Any, batch: Batch) -> None:
    (STAGING / batch.batch_id).unlink(missing_ok=True)


def _earlier_try(ti: Any) -> str:
    """The consumer name of an earlier try of the task ``process`` of this run."""
    return f"{ti.dag_id}.process.{ti.run_id}.{ti.map_index}.try0"


with DAG(dag_id="dbqueue_test_spark_killed_try", schedule=None, catchup=False):

    @task
    def killed_try(**context: Any) -> str:
        """Leave what a try of ``process`` that was SIGKILLed mid-batch leaves: its batch claimed, part
        of its staging written, and its job still running (a process with the batch id on its command
        line, in a session of its own: the killed task's orphan), writing staging."""
        with DbQueueHook() as hook:
            batch = hook.get_queue("jobs", GROUP).claim_batch(
                10, visibility_timeout=600, consumer=_earlier_try(context["ti"])
            )
        assert batch is not None
        # The orphan of the Spark path spark_default takes: a process of the job's own, or a client of
        # the killed try's Connect session (its id derived from the try's consumer name, as the
        # operator derives it) running there.
        orphan = ["--orphan"]
        spark = BaseHook.get_connection("spark_default")
        if spark.conn_type == "spark_connect":
            session_id = connect_session_id(_earlier_try(context["ti"]))
            orphan = ["--connect", f"{spark.host}:{spark.port}", session_id, batch_tag(batch.batch_id)]
        job = [sys.executable, STAGING_JOB, str(STAGING), *orphan, "--batch-id", batch.batch_id]
        subprocess.Popen(
            [*job, "--batch-size", "partial", "--batch-query", "-"],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Running, as a killed try's job would be by then: it has written staging once.
        deadline = time.monotonic() + 120
        while not (STAGING / batch.batch_id).exists():
            assert time.monotonic() < deadline, "the orphan never started"
            time.sleep(0.2)
        return batch.batch_id

    killed_try() >> DbQueueSparkSubmitOperator(
        task_id="process",
        queue_name="jobs",
        group=GROUP,
        application=STAGING_JOB,
        application_args=[str(STAGING)],
        max_messages=50,
        max_batches=3,
        visibility_timeout=120,
        publish=_publish,
        discard=_discard,
    )


def _publish_while_an_earlier_try_claims(conn: Any, batch: Batch) -> None:
    """Publish, and on the first try, claim a batch as an earlier try that is still running would (in
    a connection of its own, committed at once)."""
    from airflow.sdk import get_current_context

    ti = get_current_context()["ti"]
    if ti.try_number == 1:
        with DbQueueHook() as hook:
            assert hook.get_queue("jobs").claim_batch(5, consumer=_earlier_try(ti)) is not None
    _publish(conn, batch)


with DAG(dag_id="dbqueue_test_spark_zombie_claims", schedule=None, catchup=False):
    DbQueueSparkSubmitOperator(
        task_id="process",
        queue_name="jobs",
        application=STAGING_JOB,
        application_args=[str(STAGING)],
        max_messages=20,
        max_batches=1,
        visibility_timeout=120,
        publish=_publish_while_an_earlier_try_claims,
        discard=_discard,
        retries=1,
        retry_delay=dt.timedelta(seconds=0),
    )


# Run by a real scheduler (test_spark_operator.py), one DAG a Spark path, each on a queue of its own:
# the first try's job SIGKILLs the task process mid-batch and goes on running as its orphan (under
# spark-submit the job's own process; on Spark Connect a client of the try's session there); the
# retry must clean up after it.
# ``ring``: spark-submit on a ring queue, its batches taken for the ring's consumer group ``g``.
for path, spark_conn_id, group in (
    ("submit", "spark_default", None),
    ("connect", "spark_connect_default", None),
    ("ring", "spark_default", "g"),
):
    with DAG(dag_id=f"dbqueue_test_spark_sigkill_{path}", schedule=None, catchup=False):
        DbQueueSparkSubmitOperator(
            task_id="process",
            queue_name=f"jobs_{path}",
            group=group,
            application=STAGING_JOB,
            application_args=[str(STAGING), "--kill-task-once" + ("=ring" if group else "")],
            max_messages=50,
            max_batches=2,
            visibility_timeout=600,
            publish=_publish,
            discard=_discard,
            spark_conn_id=spark_conn_id,
            retries=1,
            retry_delay=dt.timedelta(seconds=0),
        )
