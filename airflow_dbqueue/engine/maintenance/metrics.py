"""The schema's queue metrics as one JSON-safe dict: depth by state, age of the oldest ready message,
push and finish rates, table sizes, dead rows, index bloat, what holds back cleanup, and the horizon
now (the oldest holder's age, whatever it is, and the dead rows of the schema's tables)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import ConfigurationError, GroupNotFoundError
from airflow_dbqueue.engine.maintenance.config import HORIZON_MIN_AGE_S, HORIZON_MIN_XID_AGE, RATE_WINDOW_S
from airflow_dbqueue.engine.maintenance.horizon import now as horizon_now
from airflow_dbqueue.engine.maintenance.horizon import xmin_holders
from airflow_dbqueue.engine.maintenance.queues import Queues
from airflow_dbqueue.engine.maintenance.statistics import table_health
from airflow_dbqueue.engine.models import Design
from airflow_dbqueue.engine.ring import RingQueue
from airflow_dbqueue.engine.ring_rows import RowsRingQueue
from airflow_dbqueue.engine.table import stats_from_row


def queue_metrics(
    db: Database, queues: Queues, names: Sequence[str] | None, rate_window_s: float, notes: list[str]
) -> dict[str, Any]:
    """By queue: its stats, design, and push and finish rates over the last ``rate_window_s``. Where the
    dialect counts the schema at once (``schema_passes``), the table-design queues' stats and every
    queue's rates come from one statement each (``stats_all``, ``queue_rates_all``); a ring's stats and
    groups from its handle."""
    if db.schema_passes:
        return _schema_metrics(db, queues, names, rate_window_s, notes)
    per_queue: dict[str, Any] = {}
    for name, q in queues.each(names, notes, "left out of the metrics"):
        try:
            stats = q.stats().as_dict()
            row = db.fetchone(
                "queue_rates", {"queue_id": q.settings.queue_id, "window_s": float(rate_window_s)}
            )
            # a ring's groups are read in the same try: a drop meanwhile fails them as it fails stats
            groups = group_metrics(q) if isinstance(q, (RingQueue, RowsRingQueue)) else {}
        except Exception:
            if not queues.gone(name, q.settings.queue_id):
                raise
            notes.append(queues.vanished_note(name, "left out of the metrics"))
            continue
        pushed, finished = (int(row[0]), int(row[1])) if row else (0, 0)
        stats["design"] = q.settings.design.value
        if groups:
            stats["groups"] = groups
        stats["pushed_per_s"] = round(pushed / rate_window_s, 3)
        stats["finished_per_s"] = round(finished / rate_window_s, 3) if q.settings.archive else None
        per_queue[name] = stats
    return per_queue


def _schema_metrics(
    db: Database, queues: Queues, names: Sequence[str] | None, rate_window_s: float, notes: list[str]
) -> dict[str, Any]:
    what = "left out of the metrics"
    listed = queues.listed(names, notes, what)
    tables = [s for s in listed if s.design is Design.TABLE]
    counted = {
        int(r[0]): r[1:] for r in db.fetchall("stats_all", {"queue_ids": [s.queue_id for s in tables]})
    }
    rates = {
        int(r[0]): (int(r[1]), int(r[2]))
        for r in db.fetchall(
            "queue_rates_all", {"queue_ids": [s.queue_id for s in listed], "window_s": float(rate_window_s)}
        )
    }
    handles = dict(queues.each([s.name for s in listed if s.design is not Design.TABLE], notes, what))
    per_queue: dict[str, Any] = {}
    for s in listed:
        groups: dict[str, Any] = {}
        if s.design is Design.TABLE:
            row = counted.get(s.queue_id)
            if row is None:  # dropped since the listing
                notes.append(queues.vanished_note(s.name, what))
                continue
            stats = stats_from_row(s.name, row).as_dict()
            # stats_all counts the messages that failed by expiry, so every table queue has the figure
            stats.setdefault("expired", 0)
        else:
            q = handles.get(s.name)
            if q is None:
                continue  # noted by each()
            try:
                stats = q.stats().as_dict()
                groups = group_metrics(q) if isinstance(q, (RingQueue, RowsRingQueue)) else {}
            except Exception:
                if not queues.gone(s.name, s.queue_id):
                    raise
                notes.append(queues.vanished_note(s.name, what))
                continue
        pushed, finished = rates.get(s.queue_id, (0, 0))
        stats["design"] = s.design.value
        if groups:
            stats["groups"] = groups
        stats["pushed_per_s"] = round(pushed / rate_window_s, 3)
        stats["finished_per_s"] = round(finished / rate_window_s, 3) if s.archive else None
        per_queue[s.name] = stats
    return per_queue


def group_metrics(q: RingQueue | RowsRingQueue) -> dict[str, Any]:
    """By consumer group of a ring besides its default one (whose figures are the queue's own): what
    it has still to finish (``lag_messages``), the age of its oldest ready message (``lag_seconds``) and
    how long maintenance has seen it not move (``idle_s``), so that a group nobody pops shows; and its
    position (``pop_position``) and what maintenance does when it lags (``on_lag``, ``lag_timeout_s``)."""
    out: dict[str, Any] = {}
    for info in q.groups()[1:]:
        try:
            extra = q.group(info.name).stats().extra
        except GroupNotFoundError:
            continue  # dropped meanwhile
        out[info.name] = {
            "lag_messages": extra["lag_messages"],
            "lag_seconds": extra["lag_seconds"],
            "idle_s": None if info.idle_s is None else round(info.idle_s, 3),
            "pop_position": info.pop_position,
            "on_lag": info.on_lag.value,
            "lag_timeout_s": info.lag_timeout_s,
        }
    return out


def metrics(
    db: Database,
    queues: Queues,
    names: Sequence[str] | None = None,
    *,
    rate_window_s: float = RATE_WINDOW_S,
    horizon_min_age_s: float = HORIZON_MIN_AGE_S,
    horizon_min_xid_age: int = HORIZON_MIN_XID_AGE,
) -> dict[str, Any]:
    """Return the schema's metrics; see :meth:`Maintenance.metrics`."""
    if not math.isfinite(rate_window_s) or rate_window_s <= 0:
        raise ConfigurationError(f"rate_window_s must be a finite number > 0, got {rate_window_s}")
    notes: list[str] = []
    per_queue = queue_metrics(db, queues, names, rate_window_s, notes)
    tables = table_health(db)
    state = horizon_now(db, tables)
    return {
        "schema": db.schema,
        "at": dt.datetime.now(dt.UTC).isoformat(),
        "rate_window_s": rate_window_s,
        "queues": per_queue,
        "tables": {t.pop("table"): t for t in tables},
        "indexes": {i.index: i.as_dict() for i in db.index_survey().indexes},
        "xmin_holders": [
            h.as_dict()
            for h in xmin_holders(db, min_age_s=horizon_min_age_s, min_xid_age=horizon_min_xid_age)
        ],
        "horizon": {
            "oldest": state["oldest"],
            "xid_age": state["xid_age"],
            "age_s": state["age_s"],
            "dead_rows": state["dead_rows"],
            "note": state["note"],
        },
        "notes": notes,
    }
