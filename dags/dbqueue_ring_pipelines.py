"""One ring of order events feeding two Spark pipelines through two consumer groups.

    airflow dags test dbqueue_ring_hourly_rollup
    airflow dags test dbqueue_ring_daily_rollup

Producers push order events to the ring ``order_events``. Every consumer group of a ring sees every
message at its own pace, so each DAG here takes its own batches of the same events and publishes
them, each exactly once, into results of its own:

- ``dbqueue_ring_hourly_rollup``: the ring's default group; rolls each batch up per customer, product
  and hour into ``$DBQUEUE_RING_HOURLY_SCHEMA`` (default ``ring_hourly``);
- ``dbqueue_ring_daily_rollup``: the group ``daily``; rolls each batch up per customer, product and
  day into ``$DBQUEUE_RING_DAILY_SCHEMA`` (default ``ring_daily``).

Both run the order roll-up job (``airflow_dbqueue/spark/order_rollup.py``) with
``DbQueueSparkSubmitOperator(group=...)``: claim a batch of the group, read it over JDBC by its batch
query, publish its aggregates and ack it in one transaction, release it on any failure. An asset
watcher (``MessageQueueTrigger(scheme="dbqueue", group=...)``) starts each DAG when its group has
messages to take; both are created paused: unpause them, with the triggerer and the scheduler
running, once the ring exists. ``prepare`` creates
the ring, the group and the results tables if they are missing (run each DAG once by hand, or create
them beforehand, so that the watchers find them).

Sizing: a ring holds at most ``capacity`` numbers from its floor, the lowest number some group still
needs, and a claimed batch holds the floor at its first message until it is acked or released. So the
slower pipeline sets the pace: with orders arriving at R a second and a batch taking T seconds from
claim to ack, ``capacity`` needs ``max_messages`` plus R x T for producers to run on while a batch is
processed (``docs/operating.md``, sizing a ring). ``RING_CAPACITY`` leaves room for two batches of
``MAX_MESSAGES`` each and more.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_dbqueue.engine import GroupNotFoundError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB
from airflow_dbqueue.spark.orders import OrderRollup

RING = "order_events"
RING_CAPACITY = 131_072
MAX_MESSAGES = 20_000

PIPELINES = {
    # dag_id: (consumer group, None for the ring's default one; window in minutes; results)
    "dbqueue_ring_hourly_rollup": (
        None,
        60,
        OrderRollup(os.environ.get("DBQUEUE_RING_HOURLY_SCHEMA", "ring_hourly")),
    ),
    "dbqueue_ring_daily_rollup": (
        "daily",
        1440,
        OrderRollup(os.environ.get("DBQUEUE_RING_DAILY_SCHEMA", "ring_daily")),
    ),
}


@task
def prepare(group: str | None, results_schema: str) -> None:
    """Create the ring, the consumer group (seeing every message still in the ring) and the results
    tables, each only if missing."""
    results = OrderRollup(results_schema)
    with DbQueueHook() as hook:
        if RING not in {q.name for q in hook.list_queues()}:
            hook.create_queue(RING, design="ring", capacity=RING_CAPACITY)
        if group is not None:
            try:
                hook.get_queue(RING, group)
            except GroupNotFoundError:
                hook.add_group(RING, group, start="earliest")
        with hook.transaction() as conn:
            results.install(conn)


@task
def report(group: str | None, results_schema: str) -> dict[str, Any]:
    """What a pipeline's results hold now, and what its group has left in the ring."""
    with DbQueueHook() as hook:
        with hook.transaction() as conn:
            totals = OrderRollup(results_schema).totals(conn)
        stats = hook.stats(RING, group=group)
    return {
        "group": group or "default",
        "batches": totals.batches,
        "messages": totals.messages,
        "orders": totals.orders,
        "amount_eur": str(totals.amount_eur),
        "left": stats,
    }


for dag_id, (group, window, results) in PIPELINES.items():
    watcher = AssetWatcher(
        name=f"{dag_id}_watcher",
        trigger=MessageQueueTrigger(
            scheme="dbqueue",
            queue_name=RING,
            group=group,
            dbqueue_conn_id="dbqueue_default",
            min_messages=1,
            poll_interval=5.0,
        ),
    )
    with DAG(
        dag_id=dag_id,
        schedule=[Asset(f"{dag_id}_orders", watchers=[watcher])],
        catchup=False,
        max_active_runs=1,
        # Paused until the ring and its group exist (``prepare``): an unpaused DAG's watcher starts
        # polling a queue that is not there yet.
        is_paused_upon_creation=True,
        default_args={
            "retries": int(os.environ.get("DBQUEUE_PIPELINE_RETRIES", "2")),
            "retry_delay": dt.timedelta(seconds=10),
        },
        tags=["dbqueue", "example", "spark", "ring"],
    ):
        roll_up = DbQueueSparkSubmitOperator(
            task_id="roll_up_on_spark",
            queue_name=RING,
            group=group,
            application=ORDER_ROLLUP_JOB,
            application_args=["--results-schema", results.schema, "--window-minutes", str(window)],
            max_messages=MAX_MESSAGES,
            max_batches=10,
            publish=results.publish,
            discard=results.discard,
            visibility_timeout=600,
            if_empty="success",
            spark_conf={
                "spark.sql.shuffle.partitions": "4",
                "spark.ui.enabled": "false",
                "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
                "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
            },
            spark_submit_kwargs={"driver_memory": "1g"},
            spark_conn_id=os.environ.get("DBQUEUE_SPARK_CONN_ID", "spark_default"),
        )

        prepare(group, results.schema) >> roll_up >> report(group, results.schema)
