"""A deferrable sensor: wait in the triggerer (LISTEN/NOTIFY, polling as the fallback), claim, process.

    airflow dags test dbqueue_deferrable_sensor -c '{"events": 50, "delay": 8}'

``push_delayed`` pushes messages that become ready only after ``delay`` seconds, so the sensor finds
nothing at first and defers to DbQueueTrigger; the trigger only observes, and the sensor claims the
batch (at-least-once) back in the worker and hands it on. The consumer acks after processing.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import DbQueuePushOperator
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor

QUEUE = "example_events"

with DAG(
    dag_id="dbqueue_deferrable_sensor",
    schedule=None,
    catchup=False,
    params={
        "events": Param(50, type="integer", minimum=1, maximum=10_000),
        "delay": Param(8, type="number", minimum=0),
    },
    tags=["dbqueue", "example"],
):

    @task
    def create_queue() -> None:
        """Create the queue idempotently."""
        with DbQueueHook() as hook:
            hook.create_queue(QUEUE)

    push = DbQueuePushOperator(
        task_id="push_delayed",
        queue_name=QUEUE,
        payloads_callable=lambda ctx: [{"event": i} for i in range(int(ctx["params"]["events"]))],
        delay="{{ params.delay }}",
    )

    wait = DbQueueSensor(
        task_id="wait_and_claim",
        queue_name=QUEUE,
        min_messages="{{ params.events }}",
        claim=True,
        max_messages="{{ params.events }}",
        deferrable=True,
        poll_interval=1.0,
        timeout=300,
    )

    @task
    def process(claim: dict[str, Any]) -> dict[str, Any]:
        """Handle the claimed events, then ack them."""
        with DbQueueHook() as hook:
            events = sorted(m["payload"]["event"] for m in hook.claimed_messages(claim))
            acked = hook.ack_claim(claim)
        return {"count": len(events), "acked": acked, "events": events}

    create_queue() >> push >> wait
    process(wait.output)
