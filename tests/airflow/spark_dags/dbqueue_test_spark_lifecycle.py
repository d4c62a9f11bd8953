"""Test DAGs for the batch lifecycle of DbQueueSparkSubmitOperator (see test_spark_operator.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from airflow.sdk import DAG

from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator

JOB = str(Path(__file__).with_name("sleepy_job.py"))

with DAG(dag_id="dbqueue_test_spark_heartbeat", schedule=None, catchup=False):
    # The job outlives its 3 s lease several times over: only the heartbeat keeps the batch claimed.
    DbQueueSparkSubmitOperator(
        task_id="hold_batch",
        queue_name="jobs",
        application=JOB,
        application_args=["12"],
        max_messages=50,
        lease_timeout=3,
    )

with DAG(dag_id="dbqueue_test_spark_timeout", schedule=None, catchup=False):
    DbQueueSparkSubmitOperator(
        task_id="too_slow",
        queue_name="jobs",
        application=JOB,
        application_args=["600"],
        max_messages=50,
        lease_timeout=300,
        execution_timeout=dt.timedelta(seconds=25),
        retries=0,
    )
