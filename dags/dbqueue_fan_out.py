"""Fan-out: one stream of order events on a ring, consumed twice, by two DAGs at their own pace.

    airflow dags test dbqueue_fan_out_rollup -c '{"events": 500}'
    airflow dags test dbqueue_fan_out_audit

The ring ``example_stream`` has its default consumer group, which ``dbqueue_fan_out_rollup`` pops (it
also pushes the events and totals them per customer), and a group ``audit``, which
``dbqueue_fan_out_audit`` pops (it checksums every event it sees). Each group has its own positions,
leases and redeliveries: both DAGs get every event, whichever runs first and however far apart, and
acking in one group finishes nothing in the other. A slot of the ring is reused only when both groups
have passed its event; a group that nobody pops holds pushes back once the ring is full, so the audit
group is added with ``on_lag="drop_group"``: maintenance drops it, with a warning, when it has not
popped for an hour while events wait.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import DbQueuePopOperator, DbQueuePushOperator
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor

QUEUE = "example_stream"
AUDIT = "audit"


def payload_checksum(payloads: list[Any]) -> str:
    """Order-independent checksum of a batch of JSON payloads."""
    return hashlib.sha256(
        "\n".join(sorted(json.dumps(p, sort_keys=True) for p in payloads)).encode()
    ).hexdigest()


def make_events(context: Any) -> list[dict[str, int]]:
    """The stream: ``events`` order events with deterministic amounts."""
    n = int(context["params"]["events"])
    return [{"order": i, "customer": i % 5, "amount": (i * 13) % 97} for i in range(n)]


def create_stream() -> dict[str, Any]:
    """Create the ring and its audit group idempotently (either DAG may run first)."""
    with DbQueueHook() as hook:
        hook.create_queue(QUEUE, design="ring", capacity=4096, visibility_timeout=300)
        if AUDIT not in [g.name for g in hook.groups(QUEUE)]:
            hook.add_group(QUEUE, AUDIT, start="earliest", on_lag="drop_group", lag_timeout=3600)
        return {g.name: g.pop_position for g in hook.groups(QUEUE)}


def finish(claim: dict[str, Any]) -> tuple[list[Any], int]:
    """The claim's payloads, and how many were acked (in the claim's group)."""
    with DbQueueHook() as hook:
        payloads = [m["payload"] for m in hook.claimed_messages(claim)]
        return payloads, hook.ack_claim(claim)


with DAG(
    dag_id="dbqueue_fan_out_rollup",
    schedule=None,
    catchup=False,
    params={"events": Param(200, type="integer", minimum=1, maximum=4096)},
    tags=["dbqueue", "example"],
):

    @task(task_id="create_stream")
    def create_rollup_stream() -> dict[str, Any]:
        return create_stream()

    push = DbQueuePushOperator(task_id="push_events", queue_name=QUEUE, payloads_callable=make_events)
    pop = DbQueuePopOperator(task_id="pop_events", queue_name=QUEUE, max_messages=10_000, xcom_max_messages=0)

    @task
    def roll_up(claim: dict[str, Any]) -> dict[str, Any]:
        """Total the amounts per customer, then ack the default group's claim."""
        payloads, acked = finish(claim)
        totals: dict[str, int] = {}
        for p in payloads:
            totals[str(p["customer"])] = totals.get(str(p["customer"]), 0) + p["amount"]
        return {
            "count": len(payloads),
            "acked": acked,
            "checksum": payload_checksum(payloads),
            "totals": totals,
        }

    create_rollup_stream() >> push >> pop
    roll_up(pop.output)


with DAG(
    dag_id="dbqueue_fan_out_audit",
    schedule=None,
    catchup=False,
    tags=["dbqueue", "example"],
):

    @task(task_id="create_stream")
    def create_audit_stream() -> dict[str, Any]:
        return create_stream()

    wait = DbQueueSensor(
        task_id="wait_for_events",
        queue_name=QUEUE,
        group=AUDIT,
        mode="reschedule",
        poke_interval=1,
        timeout=120,
    )
    pop_audit = DbQueuePopOperator(
        task_id="pop_events", queue_name=QUEUE, group=AUDIT, max_messages=10_000, xcom_max_messages=0
    )

    @task
    def audit(claim: dict[str, Any]) -> dict[str, Any]:
        """Checksum every event the audit group got, then ack its claim."""
        payloads, acked = finish(claim)
        return {"count": len(payloads), "acked": acked, "checksum": payload_checksum(payloads)}

    create_audit_stream() >> wait >> pop_audit
    audit(pop_audit.output)
