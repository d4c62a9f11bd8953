"""Produce and consume: push a batch of orders, wait for them, pop them leased, process, ack.

    airflow dags test dbqueue_produce_consume -c '{"orders": 500, "delay": 3}'

The consumer acks its claim only after its results are computed; if it fails, the leases expire and
the orders are delivered again. A batch larger than ``xcom_max_messages`` stays claimed in the database
and the consumer reads the payloads from there (only receipts travel through XCom). With ``delay``, the
orders become ready only that many seconds after the push, so the sensor (reschedule mode) gives its
worker slot back and pokes again later. ``release_on_failure`` nacks the claim when processing fails
(try ``fail_processing``), so the orders come back at once instead of when their leases expire.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Param, task

from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import DbQueueAckOperator, DbQueuePopOperator, DbQueuePushOperator
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor

QUEUE = "example_orders"


def payload_checksum(payloads: list[Any]) -> str:
    """Order-independent checksum of a batch of JSON payloads."""
    return hashlib.sha256(
        "\n".join(sorted(json.dumps(p, sort_keys=True) for p in payloads)).encode()
    ).hexdigest()


def make_orders(context: Any) -> list[dict[str, int]]:
    """The batch: ``orders`` orders with deterministic amounts."""
    n = int(context["params"]["orders"])
    return [{"order": i, "customer": i % 7, "amount": (i * 37) % 101} for i in range(n)]


with DAG(
    dag_id="dbqueue_produce_consume",
    schedule=None,
    catchup=False,
    params={
        "orders": Param(200, type="integer", minimum=1, maximum=100_000),
        "batch": Param(1000, type="integer", minimum=1, maximum=100_000),
        "xcom_max_messages": Param(100, type="integer", minimum=0),
        "delay": Param(0, type="number", minimum=0),
        "fail_processing": Param(False, type="boolean"),
    },
    tags=["dbqueue", "example"],
):

    @task
    def create_queue() -> dict[str, Any]:
        """Create the queue (and the queue schema) idempotently."""
        with DbQueueHook() as hook:
            hook.create_queue(QUEUE, max_attempts=3, visibility_timeout=300)
            return hook.stats(QUEUE)

    push = DbQueuePushOperator(
        task_id="push_orders", queue_name=QUEUE, payloads_callable=make_orders, delay="{{ params.delay }}"
    )

    wait = DbQueueSensor(
        task_id="wait_for_orders",
        queue_name=QUEUE,
        min_messages="{{ params.orders }}",
        mode="reschedule",
        poke_interval=1,
        timeout=120,
    )

    pop = DbQueuePopOperator(
        task_id="pop_orders",
        queue_name=QUEUE,
        max_messages="{{ params.batch }}",
        xcom_max_messages="{{ params.xcom_max_messages }}",
        semantics="at-least-once",
    )

    @task
    def process(claim: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """Total the orders per customer, then ack the claim (only after the results exist)."""
        with DbQueueHook() as hook:
            messages = hook.claimed_messages(claim)
            if params["fail_processing"]:
                raise RuntimeError(f"processing {len(messages)} orders failed (fail_processing is set)")
            totals: dict[str, int] = {}
            for m in messages:
                key = str(m["payload"]["customer"])
                totals[key] = totals.get(key, 0) + m["payload"]["amount"]
            acked = hook.ack_claim(claim)
        return {
            "count": len(messages),
            "acked": acked,
            "inline": claim["messages"] is not None,
            "checksum": payload_checksum([m["payload"] for m in messages]),
            "amount": sum(totals.values()),
            "totals": totals,
        }

    release = DbQueueAckOperator(
        task_id="release_on_failure",
        claim=pop.output,
        action="nack",
        delay=0,
        error="processing failed",
        trigger_rule="one_failed",
    )

    # A leaf that fails with the processing: without it the run would end green, its only other leaf
    # being release_on_failure, which succeeds exactly when processing fails.
    done = EmptyOperator(task_id="done")

    create_queue() >> push >> wait >> pop
    process(pop.output) >> [release, done]
