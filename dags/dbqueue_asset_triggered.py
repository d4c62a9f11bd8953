"""An asset-triggered DAG: a run starts when messages arrive in a queue.

The AssetWatcher runs ``MessageQueueTrigger(scheme="dbqueue", ...)`` (the common-messaging queue
provider of airflow-dbqueue, which runs DbQueueTrigger) in the triggerer. The trigger only observes,
so the run itself pops: it claims a batch, processes it and acks it. Unpause the DAG for the watcher to
be registered. Create the queue first (``dbqueue create example_inbox``, or DbQueueHook.create_queue).
"""

from __future__ import annotations

from typing import Any

from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import DbQueuePopOperator

QUEUE = "example_inbox"

inbox_trigger = MessageQueueTrigger(
    scheme="dbqueue",
    queue_name=QUEUE,
    dbqueue_conn_id="dbqueue_default",
    min_messages=1,
    poll_interval=5.0,
)
inbox = Asset(
    "dbqueue_example_inbox", watchers=[AssetWatcher(name="dbqueue_inbox_watcher", trigger=inbox_trigger)]
)

with DAG(
    dag_id="dbqueue_asset_triggered",
    schedule=[inbox],
    catchup=False,
    max_active_runs=1,
    tags=["dbqueue", "example"],
):
    pop = DbQueuePopOperator(task_id="pop_inbox", queue_name=QUEUE, max_messages=1000, xcom_max_messages=100)

    @task
    def process(claim: dict[str, Any]) -> dict[str, Any]:
        """Handle the batch, then ack it."""
        with DbQueueHook() as hook:
            items = [m["payload"] for m in hook.claimed_messages(claim)]
            acked = hook.ack_claim(claim)
        return {"count": len(items), "acked": acked, "items": items}

    process(pop.output)
