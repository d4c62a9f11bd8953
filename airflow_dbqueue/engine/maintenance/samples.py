"""Samples: one row a queue a maintenance run in the schema's ``samples`` table, so that a queue's depth,
oldest age, push and pop rates and the xmin horizon can be drawn over the last hours (the Queues page).

Where the counts come from, so that nothing is added to the push or pop path:

- a ring keeps totals already. The slots layout: its push position (the numbers its push sequence
  handed out) and its default group's pop position (how far its consumers took); numbers given up as
  gaps (a push that rolled back) count as pushed and popped. The rows layout: its push total (the
  messages of the rows its segments hold, plus those of every segment emptied so far, which the
  rotation that empties a segment records beside it) and its default group's pop total (the push total
  less what the group has not finished: ready, delayed, in flight, and expired but not reached by a pop
  yet, read in the same snapshot), so a message counts as popped once it is acked, taken at most once
  or exactly once, failed, or expired and reached by a pop; a
  push that rolled back wrote no row and counts nothing. A sample records both (``push_total``,
  ``pop_total``); pushes and pops between two samples are their differences.
- the table design keeps no counter. Its rows carry their times: a sample counts the messages whose
  ``enqueued_at`` (pushes) and, finished, whose ``finished_at`` (pops) fall between the queue's previous
  sample and this one, in meta, done and archive, as the metrics' rates do. That is exact for a queue
  that archives (finished rows stay in done, then archive, for the archive retention, a week by
  default); a queue that does not archive deletes a message when it finishes, so its pushes and pops
  are not counted (``None``). A push whose transaction is still open when a sample is taken, and
  commits after it, is missed by both samples.

Retention deletes samples older than ``samples_keep_s`` in batches of ``batch_size``, in the same step.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import PermissionDeniedError
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.maintenance.queues import Queues
from airflow_dbqueue.engine.models import Design, QueueSettings, QueueStats
from airflow_dbqueue.engine.queue import Queue, check_seconds
from airflow_dbqueue.engine.ring import RingQueue
from airflow_dbqueue.engine.ring_rows import RowsRingQueue
from airflow_dbqueue.engine.table import stats_from_row

log = logging.getLogger(__name__)

SAMPLE_FIELDS = (
    "queue",
    "at",
    "ready",
    "delayed",
    "in_flight",
    "failed",
    "oldest_age_s",
    "push_total",
    "pop_total",
    "pushed",
    "popped",
    "groups",
    "horizon_xid_age",
    "horizon_age_s",
    "dead_rows",
)
"""The fields of a sample as :func:`read` returns it (``at``: seconds since the epoch, UTC)."""


def record(
    db: Database,
    lock: SchemaLock,
    queues: Queues,
    names: Sequence[str] | None,
    *,
    horizon: dict[str, Any],
    keep_s: float,
    batch_size: int,
    lock_wait_s: float,
) -> dict[str, Any]:
    """Record one sample of each queue (or of ``names``), with the schema's ``horizon`` figures
    (:func:`horizon.now`), and delete samples older than ``keep_s``; see :meth:`Maintenance.sample`."""
    keep_s = check_seconds("samples_keep_s", keep_s, positive=True)
    notes: list[str] = []
    with lock.hold(lock_wait_s) as got:
        if not got:
            return {"skipped": lock.skip_reason, "recorded": 0, "deleted": 0, "notes": notes}
        row = db.fetchone("sample_clock")
        assert row is not None
        taken_at = row[0]
        rows = _rows(db, queues, names, taken_at, notes)
        last = _last(db, [r["queue_id"] for r in rows])
        if db.schema_passes:
            _flows(db, rows, last, taken_at)
            rows = _insert_all(db, lock, rows, taken_at=taken_at, horizon=horizon, notes=notes)
        else:
            recorded = []
            for r in rows:
                _counts(db, r, last.get(r["queue_id"]), taken_at)
                if _insert(db, lock, r, taken_at=taken_at, horizon=horizon, notes=notes):
                    recorded.append(r)
            rows = recorded
        deleted = 0
        while True:
            with db.transaction(lock.conn) as c:
                got_row = db.fetchone("samples_purge_batch", {"keep_s": float(keep_s), "n": batch_size}, c)
            n = int(got_row[0]) if got_row else 0
            deleted += n
            if n < batch_size:
                break
    log.info(
        "dbqueue samples of schema %r: %d recorded, %d older than %gs deleted",
        db.schema,
        len(rows),
        deleted,
        keep_s,
    )
    return {
        "skipped": None,
        "recorded": len(rows),
        "deleted": deleted,
        "taken_at": taken_at.isoformat() if isinstance(taken_at, dt.datetime) else taken_at,
        "notes": notes,
        "queues": {
            r["name"]: {k: r[k] for k in ("pushed", "popped", "push_total", "pop_total")} for r in rows
        },
    }


def _params(r: dict[str, Any], taken_at: Any, horizon: dict[str, Any]) -> dict[str, Any]:
    """The parameters of ``sample_insert`` for the figures ``r`` of one queue."""
    return {
        **{k: v for k, v in r.items() if k not in ("archive", "design")},
        "taken_at": taken_at,
        "groups": json.dumps(r["groups"]) if r["groups"] else None,
        "horizon_xid_age": horizon.get("xid_age"),
        "horizon_age_s": horizon.get("age_s"),
        "dead_rows": horizon.get("dead_rows"),
    }


def _insert(
    db: Database,
    lock: SchemaLock,
    r: dict[str, Any],
    *,
    taken_at: Any,
    horizon: dict[str, Any],
    notes: list[str],
) -> bool:
    """Insert one queue's sample in a transaction of its own; False (noted) when the role may not."""
    try:  # a transaction a queue: a role that administers some queues samples those
        with db.transaction(lock.conn) as c:
            db.execute("sample_insert", _params(r, taken_at, horizon), c)
    except PermissionDeniedError:
        notes.append(f"queue {r['name']!r} not sampled: the role may not administer it")
        return False
    return True


def _insert_all(
    db: Database,
    lock: SchemaLock,
    rows: list[dict[str, Any]],
    *,
    taken_at: Any,
    horizon: dict[str, Any],
    notes: list[str],
) -> list[dict[str, Any]]:
    """Insert every queue's sample with one statement; when the role may not administer some of the
    queues (the statement fails whole), a transaction a queue, so that it samples those it may. Returns
    the rows recorded."""
    if not rows:
        return rows
    params: dict[str, Any] = {
        "taken_at": taken_at,
        "horizon_xid_age": horizon.get("xid_age"),
        "horizon_age_s": horizon.get("age_s"),
        "dead_rows": horizon.get("dead_rows"),
        "queue_ids": [r["queue_id"] for r in rows],
        "groups": [json.dumps(r["groups"]) if r["groups"] else None for r in rows],
    }
    for k in ("ready", "delayed", "in_flight", "failed", "oldest_age_s", "push_total", "pop_total"):
        params[k] = [r[k] for r in rows]
    params["pushed"] = [r["pushed"] for r in rows]
    params["popped"] = [r["popped"] for r in rows]
    try:
        with db.transaction(lock.conn) as c:
            db.execute("sample_insert_all", params, c)
    except PermissionDeniedError:
        return [r for r in rows if _insert(db, lock, r, taken_at=taken_at, horizon=horizon, notes=notes)]
    return rows


def _rows(
    db: Database, queues: Queues, names: Sequence[str] | None, taken_at: Any, notes: list[str]
) -> list[dict[str, Any]]:
    """Each queue's figures now, through its stats (as the metrics read them). Where the dialect counts
    the schema at once (``schema_passes``), the table-design queues' figures come from one statement
    (``stats_all``); a ring's from its own stats, a queue at a time."""
    if not db.schema_passes:
        return [
            r
            for name, q in queues.each(names, notes, "not sampled")
            if (r := _queue_row(queues, name, q, notes))
        ]
    listed = queues.listed(names, notes, "not sampled")
    tables = [s for s in listed if s.design is Design.TABLE]
    counted = {
        int(row[0]): stats_from_row(str(row[0]), row[1:])
        for row in db.fetchall("stats_all", {"queue_ids": [s.queue_id for s in tables]})
    }
    rings = {
        name: q
        for name, q in queues.each(
            [s.name for s in listed if s.design is not Design.TABLE], notes, "not sampled"
        )
    }
    out = []
    for s in listed:
        if s.design is Design.TABLE:
            stats = counted.get(s.queue_id)
            if stats is None:  # dropped since the listing (or not the role's to see)
                notes.append(queues.vanished_note(s.name, "not sampled"))
                continue
            out.append(_figures(s, stats, None))
        elif s.name in rings and (r := _queue_row(queues, s.name, rings[s.name], notes)):
            out.append(r)
    return out


def _figures(settings: QueueSettings, stats: QueueStats, groups: dict[str, int] | None) -> dict[str, Any]:
    """One queue's row of figures from its stats (a ring's with its totals and groups' lag: the slots
    layout's positions, the rows layout's totals in messages; None for a table queue, and for a ring of
    the rows layout made by a build that did not count them)."""

    def total(rows_key: str, slots_key: str) -> int | None:
        if groups is None:
            return None
        value = stats.extra[rows_key] if rows_key in stats.extra else stats.extra.get(slots_key)
        return None if value is None else int(value)

    return {
        "name": settings.name,
        "queue_id": settings.queue_id,
        "design": settings.design.value,
        "archive": settings.archive,
        "ready": stats.ready,
        "delayed": stats.delayed,
        "in_flight": stats.in_flight,
        "failed": stats.failed,
        "oldest_age_s": stats.oldest_ready_age_s,
        "push_total": total("push_total", "push_position"),
        "pop_total": total("pop_total", "pop_position"),
        "pushed": None,
        "popped": None,
        "groups": groups or {},
    }


def _queue_row(queues: Queues, name: str, q: Queue, notes: list[str]) -> dict[str, Any] | None:
    """One queue's figures through its handle (None, noted, when it was dropped meanwhile)."""
    try:
        stats = q.stats()
        groups: dict[str, int] = {}
        if isinstance(q, (RingQueue, RowsRingQueue)):
            for info in q.groups()[1:]:
                groups[info.name] = int(q.group(info.name).stats().extra["lag_messages"])
    except Exception:
        if not queues.gone(name, q.settings.queue_id):
            raise
        notes.append(queues.vanished_note(name, "not sampled"))
        return None
    return _figures(q.settings, stats, groups if isinstance(q, (RingQueue, RowsRingQueue)) else None)


def _last(db: Database, queue_ids: list[int]) -> dict[int, tuple[Any, int | None, int | None]]:
    """Each queue's newest sample: ``{queue_id: (taken_at, push_total, pop_total)}``."""
    if not queue_ids:
        return {}
    return {int(r[0]): (r[1], r[2], r[3]) for r in db.fetchall("samples_last", {"queue_ids": queue_ids})}


def _counts(
    db: Database, r: dict[str, Any], prev: tuple[Any, int | None, int | None] | None, until: Any
) -> None:
    """Fill ``r``'s ``pushed`` and ``popped``: since the queue's previous sample ``prev`` (none: left
    ``None``)."""
    if prev is None:
        return
    since, push_total, pop_total = prev
    if r["push_total"] is not None:
        if push_total is not None and pop_total is not None:
            r["pushed"] = r["push_total"] - push_total
            r["popped"] = r["pop_total"] - pop_total
    elif r["archive"]:
        row = db.fetchone("table_flow", {"queue_id": r["queue_id"], "since": since, "until": until})
        if row is not None:
            r["pushed"], r["popped"] = int(row[0]), int(row[1])


def _flows(
    db: Database,
    rows: list[dict[str, Any]],
    last: dict[int, tuple[Any, int | None, int | None]],
    until: Any,
) -> None:
    """:func:`_counts` of every row, with one statement (``table_flow_all``) for the table-design
    queues that archive."""
    tables = []
    for r in rows:
        prev = last.get(r["queue_id"])
        if r["push_total"] is not None or not r["archive"]:
            _counts(db, r, prev, until)
        elif prev is not None:
            tables.append((r, prev[0]))
    if not tables:
        return
    params = {
        "queue_ids": [r["queue_id"] for r, _ in tables],
        "since": [since for _, since in tables],
        "min_since": min(since for _, since in tables),
        "until": until,
    }
    flow = {int(q): (int(p), int(o)) for q, p, o in db.fetchall("table_flow_all", params)}
    for r, _ in tables:
        r["pushed"], r["popped"] = flow.get(r["queue_id"], (0, 0))


def read(
    db: Database, *, window_s: float, queues: Sequence[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The samples of the last ``window_s`` seconds, by queue, oldest first (fields: :data:`SAMPLE_FIELDS`,
    ``at`` in seconds since the epoch). Under row-level security a role reads the samples of the queues
    it may see."""
    window_s = check_seconds("window_s", window_s, positive=True)
    rows = db.fetchall(
        "samples_read",
        {"window_s": float(window_s), "all_queues": queues is None, "names": list(queues or [])},
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        sample = dict(zip(SAMPLE_FIELDS, r, strict=True))
        sample["at"] = float(sample["at"])
        sample["groups"] = json.loads(sample["groups"]) if sample["groups"] else {}
        for k in (
            "ready",
            "delayed",
            "in_flight",
            "failed",
            "push_total",
            "pop_total",
            "pushed",
            "popped",
            "horizon_xid_age",
            "dead_rows",
        ):
            if sample[k] is not None:
                sample[k] = int(sample[k])
        out.setdefault(sample.pop("queue"), []).append(sample)
    return out
