"""Test DAG of the event-driven failure path (test_asset_watcher.py): a watcher with ``max_wait``,
and runs that fail before they claim anything."""

from __future__ import annotations

from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

refire = MessageQueueTrigger(
    scheme="dbqueue",
    queue_name="refire",
    dbqueue_conn_id="dbqueue_default",
    poll_interval=0.5,
    max_wait=5,
)

with DAG(
    dag_id="dbqueue_test_refire",
    schedule=[Asset("dbqueue_test_refire", watchers=[AssetWatcher(name="refire_watcher", trigger=refire)])],
    catchup=False,
    max_active_runs=1,
):

    @task(retries=0)
    def fail_before_claiming() -> None:
        raise RuntimeError("this run fails before it claims anything")

    fail_before_claiming()
