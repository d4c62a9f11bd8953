"""Queue metrics through Airflow's metrics: stable gauge names; schema, queue, table and index as tags."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_GROUP_GAUGES = ("lag_messages", "lag_seconds", "idle_s")
_QUEUE_GAUGES = (
    "ready",
    "delayed",
    "in_flight",
    "failed",
    "finished",
    "oldest_ready_age_s",
    "pushed_per_s",
    "finished_per_s",
)
_TABLE_GAUGES = ("total_bytes", "table_bytes", "index_bytes", "live_tuples", "dead_tuples", "dead_ratio")
_HORIZON_GAUGES = ("xid_age", "age_s", "dead_rows")
_INDEX_GAUGES = ("size_bytes", "bloat_ratio", "bloat_bytes", "fragmentation_pct", "page_density_pct")


def emit_metrics(metrics: Mapping[str, Any], *, prefix: str = "dbqueue") -> int:
    """Send the gauges of a metrics dict (:meth:`DbQueueHook.queue_metrics`) through Airflow's metrics.

    Names are stable and carry no schema, queue, table or index name; those travel as tags, as
    Airflow's own metrics do since 3.2: ``<prefix>.queue.<gauge>`` tagged ``schema`` and ``queue``
    (``ready``, ``delayed``, ``in_flight``, ``failed``, ``finished``, ``oldest_ready_age_s``,
    ``pushed_per_s``, ``finished_per_s``), ``<prefix>.group.<gauge>`` tagged ``schema``, ``queue`` and
    ``group`` (a ring's consumer groups besides its default one: ``lag_messages``, ``lag_seconds``,
    ``idle_s``), ``<prefix>.table.<gauge>`` tagged ``schema`` and ``table``
    (sizes, live and dead rows), ``<prefix>.index.<gauge>`` tagged ``schema`` and ``index`` (size and
    bloat; on SQL Server also fragmentation and page density), ``<prefix>.xmin_holders`` tagged
    ``schema``, and ``<prefix>.horizon.<gauge>`` tagged ``schema``: what holds the xmin horizon furthest
    back now, whatever its age, in transaction ids (``xid_age``) and seconds (``age_s``), and the dead rows
    of the schema's tables (``dead_rows``).

    :return: how many gauges were sent (values that are ``None`` are left out).
    """
    from airflow.sdk.observability.stats import Stats

    schema = metrics["schema"]
    sent = 0

    def gauge(name: str, value: Any, tags: dict[str, str]) -> None:
        nonlocal sent
        if value is None:
            return
        Stats.gauge(f"{prefix}.{name}", float(value), tags={"schema": schema, **tags})
        sent += 1

    for queue, values in metrics.get("queues", {}).items():
        for key in _QUEUE_GAUGES:
            gauge(f"queue.{key}", values.get(key), {"queue": queue})
        for group, figures in (values.get("groups") or {}).items():
            for key in _GROUP_GAUGES:
                gauge(f"group.{key}", figures.get(key), {"queue": queue, "group": group})
    for table, values in metrics.get("tables", {}).items():
        for key in _TABLE_GAUGES:
            gauge(f"table.{key}", values.get(key), {"table": table})
    for index, values in metrics.get("indexes", {}).items():
        for key in _INDEX_GAUGES:
            gauge(f"index.{key}", values.get(key), {"index": index})
    gauge("xmin_holders", len(metrics.get("xmin_holders", [])), {})
    horizon = metrics.get("horizon") or {}
    for key in _HORIZON_GAUGES:
        gauge(f"horizon.{key}", horizon.get(key), {})
    return sent
