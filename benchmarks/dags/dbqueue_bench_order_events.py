"""The order pipeline, event-driven: a push of orders starts a run that rolls them up on Spark.

``benchmarks/spark_paths.py --events N`` runs this DAG under a real scheduler, triggerer and execution
API and measures, for each of N pushes, the time from the push to its results published. An
``AssetWatcher`` runs ``MessageQueueTrigger(scheme="dbqueue")`` (DbQueueTrigger: LISTEN/NOTIFY, polling
as the fallback) on the orders queue, as ``dags/dbqueue_asset_triggered.py`` does; the run it starts
has one task, ``DbQueueSparkSubmitOperator`` with the order-rollup job, which claims the pushed
orders, runs the job on the path ``spark_default`` names (a ``spark_connect`` connection: a session on
that Connect server) and publishes the rollup with the ack. One task, so a run pays one task start.

Settings read when the DAG is parsed: ``$DBQUEUE_BENCH_QUEUE`` (default ``orders``) and
``$DBQUEUE_RESULTS_SCHEMA`` (default ``order_results``); the queue and the results tables must exist.
"""

from __future__ import annotations

import os

from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk import DAG, Asset, AssetWatcher

from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB
from airflow_dbqueue.spark.orders import OrderRollup

DAG_ID = "dbqueue_bench_order_events"
QUEUE = os.environ.get("DBQUEUE_BENCH_QUEUE", "orders")
RESULTS = OrderRollup(os.environ.get("DBQUEUE_RESULTS_SCHEMA", "order_results"))

orders_arrived = MessageQueueTrigger(
    scheme="dbqueue",
    queue_name=QUEUE,
    dbqueue_conn_id="dbqueue_default",
    min_messages=1,
    poll_interval=2.0,
)

with DAG(
    dag_id=DAG_ID,
    schedule=[
        Asset(f"dbqueue_{QUEUE}", watchers=[AssetWatcher(name="orders_watcher", trigger=orders_arrived)])
    ],
    catchup=False,
    max_active_runs=1,
    tags=["dbqueue", "benchmark", "spark"],
):
    DbQueueSparkSubmitOperator(
        task_id="roll_up_orders_on_spark",
        queue_name=QUEUE,
        application=ORDER_ROLLUP_JOB,
        application_args=["--results-schema", RESULTS.schema],
        max_messages=20_000,
        max_batches=10,
        publish=RESULTS.publish,
        discard=RESULTS.discard,
        visibility_timeout=600,
        if_empty="success",  # a push taken by the run before: nothing left for this one
        retries=0,
        spark_conf={
            "spark.sql.shuffle.partitions": "4",
            "spark.ui.enabled": "false",
            "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
            "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
        },
        spark_submit_kwargs={"driver_memory": "1g"},
    )
