"""Maintenance of a queue schema, every five minutes, while producers and consumers run.

    airflow dags test dbqueue_maintenance -c '{"archive_after_s": 0}'

Steps (each a task, each returning a JSON-safe report for XCom), in the order ``Maintenance.run`` and
``dbqueue maintain`` take them (``STEPS`` of ``airflow_dbqueue.engine.maintenance``): each task runs
``Maintenance.step``, so the DAG and the CLI take the same steps with the same settings.

1. ``check_horizon``: warn about whatever holds back the xmin horizon (a long transaction, a replication
   slot, a prepared transaction), naming its pid, application, age and query start. On SQL Server: long
   transactions of the database and snapshot transactions, which hold back log and version cleanup.
2. ``upkeep``: each queue's design upkeep: expired leases back to ready or failed, and, for ring queues,
   the numbers of pushes that rolled back or died given up as gaps (so a ring nobody pops recovers).
3. ``archive``: finished messages older than ``archive_after_s`` move to the archive in bounded batches
   with pauses and a time budget; archived messages older than ``archive_retention_s`` are deleted.
4. ``vacuum``: VACUUM (ANALYZE, SKIP_LOCKED) of the schema's tables. SQL Server has no VACUUM (its ghost
   cleanup task removes deleted rows): there it runs UPDATE STATISTICS, and its result says so.
5. ``compact_rings``: a ring table that outgrew its laid-out size (row versions kept while a long
   transaction held the xmin horizon) is rewritten with VACUUM FULL, which blocks the schema's ring
   pushes and pops while it runs (under a second for a 500 MB table here); not while a transaction
   older than ``min(horizon_min_age_s, 10)`` seconds still holds the horizon. Skipped on SQL Server.
6. ``rebuild_indexes``: REINDEX INDEX CONCURRENTLY of bloated B-tree indexes, estimated from the
   statistics the ``vacuum`` step refreshed (with ``vacuum`` off, this step ANALYZEs the tables first);
   INVALID leftovers of a failed rebuild are dropped. On SQL Server: ALTER INDEX ... REBUILD WITH
   (ONLINE = ON) of bloated or fragmented indexes where the engine edition allows it, REORGANIZE
   otherwise, decided at run time; the result names the mode and the edition.
7. ``sample``: one row a queue in the schema's ``samples`` table (depth, oldest age, pushes and pops
   since the last sample, and the xmin horizon with the dead rows of the schema's tables), which the
   Queues page draws as charts; samples older than ``samples_keep_s`` (a day) are deleted.
8. ``metrics``: depth by state, oldest ready age, rates, table sizes and index bloat, sent as gauges
   through Airflow's metrics (``dbqueue.queue.ready`` tagged with schema and queue, ...) and
   returned. It runs even when an earlier step failed.

Steps that change things take the schema's maintenance lock (a PostgreSQL advisory lock; on SQL Server
an application lock owned by the session, ``sp_getapplock``), so a second run at the same time (another
deployment, ``dbqueue maintain`` from a shell) never fights this one: it waits up to ``lock_wait_s`` and
then skips the step, saying in the log which session holds the lock.

Settings, from lowest to highest precedence: the defaults of ``MaintenanceConfig``; the Airflow
Variable ``dbqueue_maintenance`` (a JSON object, e.g. ``{"schema": "orders", "archive_after_s": 3600}``);
the run's params (``-c`` / "Trigger DAG w/ config"). ``conn_id`` (default ``dbqueue_default``) names the
Airflow connection and ``schema`` the queue schema (default: the connection's ``dbqueue_schema`` extra);
``queues`` limits archiving, upkeep and metrics to some queues (default: every queue of the schema).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import DAG, Param, Variable, chain, get_current_context, task

from airflow_dbqueue.engine import MaintenanceConfig
from airflow_dbqueue.engine.maintenance import STEPS
from airflow_dbqueue.hooks.dbqueue import DbQueueHook

VARIABLE = "dbqueue_maintenance"
DEFAULT_CONN_ID = "dbqueue_default"


def _optional(kind: str, description: str) -> Param:
    return Param(None, type=["null", kind], description=description)


def settings() -> tuple[str, str | None, MaintenanceConfig]:
    """Return ``(conn_id, schema, config)``: the run's params over the Variable over the defaults."""
    merged: dict[str, Any] = dict(Variable.get(VARIABLE, default=None, deserialize_json=True) or {})
    params = get_current_context()["params"]
    merged.update({k: v for k, v in params.items() if v is not None})
    conn_id = merged.pop("conn_id", None) or DEFAULT_CONN_ID
    schema = merged.pop("schema", None) or None
    return conn_id, schema, MaintenanceConfig.from_mapping(merged)


def hook(conn_id: str, schema: str | None) -> DbQueueHook:
    return DbQueueHook(conn_id, dbqueue_schema=schema)


def step_task(name: str) -> Any:
    """The task of maintenance step ``name``: the step as ``dbqueue maintain`` runs it, with this run's
    settings (``Maintenance.step``). ``metrics`` runs even when an earlier step failed."""

    @task(task_id=name, trigger_rule="all_done" if name == "metrics" else "all_success")
    def run_step() -> dict[str, Any]:
        conn_id, schema, cfg = settings()
        with hook(conn_id, schema) as h:
            return h.maintenance_step(name, cfg)

    return run_step()


with DAG(
    dag_id="dbqueue_maintenance",
    schedule=dt.timedelta(minutes=5),
    start_date=dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "conn_id": _optional("string", f"Airflow connection (default {DEFAULT_CONN_ID})"),
        "schema": _optional("string", "queue schema (default: the connection's dbqueue_schema extra)"),
        "queues": _optional("array", "queues to maintain (default: all)"),
        "archive_after_s": _optional("number", "archive finished messages older than this (300)"),
        "archive_retention_s": _optional("number", "delete archived messages older than this (7 days)"),
        "batch_size": _optional("integer", "rows per batch statement (1000)"),
        "pause_s": _optional("number", "pause between batches (0.05)"),
        "time_budget_s": _optional("number", "most seconds a batched step runs (60)"),
        "vacuum": _optional("boolean", "VACUUM (ANALYZE) the tables (true)"),
        "reindex": _optional("boolean", "rebuild bloated indexes online (true)"),
        "reindex_bloat_ratio": _optional("number", "rebuild an index this many times its size (2)"),
        "reindex_min_bytes": _optional("integer", "... and this many bytes above it (1 MiB)"),
        "reindex_fragmentation_pct": _optional(
            "number", "SQL Server: also rebuild indexes this many percent fragmented (30)"
        ),
        "compact_rings": _optional("boolean", "rewrite ring tables that outgrew their laid-out size (true)"),
        "compact_bloat_ratio": _optional("number", "... when this many times that size (1.5)"),
        "lock_wait_s": _optional("number", "wait this long for another run's lock, then skip (0)"),
        "horizon_min_age_s": _optional(
            "number", "warn of transactions open longer than this, and rebuild no index while one is (300)"
        ),
        "samples": _optional("boolean", "record a sample of each queue for the Queues page's charts (true)"),
        "samples_keep_s": _optional("number", "delete samples older than this (1 day)"),
    },
    tags=["dbqueue", "maintenance"],
    doc_md=__doc__,
):
    chain(*(step_task(name) for name in STEPS))
