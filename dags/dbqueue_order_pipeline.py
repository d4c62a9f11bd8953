"""The order pipeline: wait for order events, roll each batch up on Spark, ack it with its results.

    airflow dags test dbqueue_order_pipeline -c '{"max_messages": 5000, "max_batches": 10}'

Producers (a web shop, ``dbqueue push``, the ``dbqueue pipeline`` demo) push order events to the
``orders`` queue. This DAG

1. ``prepare``: creates the queue (of the ``design`` param: ``table``, or ``ring`` of ``ring_capacity``
   slots) and the results tables idempotently;
2. ``wait_for_orders``: a deferrable DbQueueSensor; it only observes, so nothing is lost if a later
   task fails;
3. ``roll_up_orders_on_spark``: claims batches of up to ``max_messages`` and runs the PySpark job
   ``airflow_dbqueue/spark/order_rollup.py`` on each, on the path its Spark connection names
   (``spark_default`` unless ``$DBQUEUE_SPARK_CONN_ID`` says otherwise): a ``spark`` connection runs
   ``spark-submit`` per batch (its master: ``local[*]``, a cluster), a ``spark_connect`` connection
   runs the job on that Spark Connect server, in one session for the task's batches. The job reads
   the batch by id over JDBC and stages per customer/product/hour aggregates; the batch is acked in
   the transaction that publishes them, or released for the task's retry if anything fails;
4. ``report``: totals and the largest groups, for the log and XCom.

Settings read when the DAG is parsed: ``$DBQUEUE_RESULTS_SCHEMA`` (default ``order_results``),
``$DBQUEUE_PIPELINE_RETRIES`` (default 2) and ``$DBQUEUE_SPARK_CONN_ID`` (default ``spark_default``), the
Spark connection step 3 takes.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB
from airflow_dbqueue.spark.orders import OrderRollup

RESULTS = OrderRollup(os.environ.get("DBQUEUE_RESULTS_SCHEMA", "order_results"))

with DAG(
    dag_id="dbqueue_order_pipeline",
    schedule=None,
    catchup=False,
    params={
        "queue_name": Param("orders", type="string"),
        "design": Param("table", enum=["table", "ring"]),
        "ring_capacity": Param(131_072, type="integer", minimum=1, maximum=16_777_216),
        "max_messages": Param(5000, type="integer", minimum=1, maximum=100_000),
        "max_batches": Param(20, type="integer", minimum=1),
        "window_minutes": Param(60, type="integer", minimum=1),
    },
    default_args={
        "retries": int(os.environ.get("DBQUEUE_PIPELINE_RETRIES", "2")),
        "retry_delay": dt.timedelta(seconds=10),
    },
    tags=["dbqueue", "example", "spark"],
):

    @task
    def prepare(params: dict[str, Any]) -> None:
        """Create the queue and the results tables (idempotent). A ring holds at most its capacity of
        messages not yet acked, an open batch's included (docs/operating.md, sizing a ring)."""
        ring = {"design": "ring", "capacity": params["ring_capacity"]} if params["design"] == "ring" else {}
        with DbQueueHook() as hook:
            hook.create_queue(params["queue_name"], **ring)
            with hook.transaction() as conn:
                RESULTS.install(conn)

    wait = DbQueueSensor(
        task_id="wait_for_orders",
        queue_name="{{ params.queue_name }}",
        min_messages=1,
        deferrable=True,
        poll_interval=2.0,
        timeout=3600,
    )

    roll_up = DbQueueSparkSubmitOperator(
        task_id="roll_up_orders_on_spark",
        queue_name="{{ params.queue_name }}",
        application=ORDER_ROLLUP_JOB,
        application_args=[
            "--results-schema",
            RESULTS.schema,
            "--window-minutes",
            "{{ params.window_minutes }}",
        ],
        max_messages="{{ params.max_messages }}",
        max_batches="{{ params.max_batches }}",
        publish=RESULTS.publish,
        discard=RESULTS.discard,
        visibility_timeout=600,
        spark_conf={
            "spark.sql.shuffle.partitions": "4",
            "spark.ui.enabled": "false",
            "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
            "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
        },
        spark_submit_kwargs={"driver_memory": "1g"},
        spark_conn_id=os.environ.get("DBQUEUE_SPARK_CONN_ID", "spark_default"),
    )

    @task
    def report(params: dict[str, Any]) -> dict[str, Any]:
        """What the results hold now, and what is left in the queue."""
        with DbQueueHook() as hook:
            with hook.transaction() as conn:
                totals = RESULTS.totals(conn)
                top = RESULTS.top(conn, 5)
            stats = hook.stats(params["queue_name"])
        return {
            "batches": totals.batches,
            "messages": totals.messages,
            "orders": totals.orders,
            "quantity": totals.quantity,
            "amount_eur": str(totals.amount_eur),
            "groups": totals.groups,
            "top": top,
            "queue": stats,
        }

    prepare() >> wait >> roll_up >> report()
