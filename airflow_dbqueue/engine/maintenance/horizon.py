"""What holds back cleanup: on PostgreSQL the xmin horizon (a long transaction, a replication slot, a
prepared transaction), which keeps any VACUUM from removing dead rows; on SQL Server long and snapshot
transactions, which hold back log truncation and version cleanup. Online index rebuilds and ring
compaction are not started while one of them would hold them up.

:func:`now` gives the horizon's figures of the moment (the oldest holder, whatever its age, and the dead
rows of the schema's tables), which samples record and the metrics report; :func:`costs` gathers what a
held horizon cost a maintenance run from its steps' results."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.maintenance.config import (
    HORIZON_MIN_AGE_S,
    HORIZON_MIN_DEAD_ROWS,
    HORIZON_MIN_XID_AGE,
)
from airflow_dbqueue.engine.maintenance.results import XminHolder
from airflow_dbqueue.engine.maintenance.statistics import table_health

log = logging.getLogger(__name__)

REBUILD_WAITS_FOR = ("transaction", "prepared transaction", "snapshot transaction")
"""The kinds of :class:`XminHolder` an online index rebuild waits for (not a replication slot)."""
HELD_BACK = "transaction(s) open longer than"
"""The words of :func:`held_back`'s reason by which :func:`costs` knows a step it kept from running."""
NO_MONITOR_NOTE = (
    "the horizon check sees only the sessions of the maintenance's own role: grant it "
    "pg_monitor (or pg_read_all_stats) to see every session that holds the horizon back"
)
"""The note of a run whose role does not see every session (PostgreSQL without ``pg_monitor``)."""


def xmin_holders(
    db: Database, *, min_age_s: float = HORIZON_MIN_AGE_S, min_xid_age: int = HORIZON_MIN_XID_AGE
) -> list[XminHolder]:
    """Return what holds back cleanup; see :meth:`Maintenance.xmin_holders`."""
    rows = db.fetchall("xmin_holders", {"min_age_s": float(min_age_s), "min_xid_age": min_xid_age})
    return [XminHolder.from_row(r) for r in rows]


def check_horizon(
    db: Database, *, min_age_s: float = HORIZON_MIN_AGE_S, min_xid_age: int = HORIZON_MIN_XID_AGE
) -> list[XminHolder]:
    """:func:`xmin_holders`, with a warning logged for each."""
    holders = xmin_holders(db, min_age_s=min_age_s, min_xid_age=min_xid_age)
    for h in holders:
        log.warning("dbqueue: %s: %s", db.horizon_warning, h.describe())
    return holders


def held_back(
    db: Database,
    what: str,
    age: float | None,
    consequence: str = "an online rebuild waits for every transaction older than itself",
) -> str | None:
    """Why ``what`` should not run now (transactions open longer than ``age`` are there, and
    ``consequence`` says what they would do to it), or None; ``age`` None does not look."""
    if age is None:
        return None
    holders = [h for h in xmin_holders(db, min_age_s=age) if h.kind in REBUILD_WAITS_FOR]
    if not holders:
        return None
    named = "; ".join(h.describe() for h in holders[:3]) + (" ..." if len(holders) > 3 else "")
    error = (
        f"{what} not run: {len(holders)} {HELD_BACK} {age:g}s, and {consequence} "
        f"({named}); the next run tries again"
    )
    log.warning("dbqueue: %s", error)
    return error


def now(db: Database, tables: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The horizon of the moment: ``oldest``, what holds it furthest back whatever its age (a
    :class:`XminHolder` as a dict, or ``None``), and its ``age_s`` and ``xid_age`` (0 when nothing holds
    it; ``xid_age`` ``None`` where the database has no transaction ids to count); ``tables``, each table
    of the schema's dead and live rows and size (``tables``: :func:`table_health`'s rows when the caller
    has them); ``dead_rows``, their sum (``None`` where the database counts none); and ``note``, why the
    figures may miss sessions of other roles (``None`` when the role sees them all)."""
    holders = xmin_holders(db, min_age_s=0.0, min_xid_age=0)
    health = table_health(db) if tables is None else tables
    dead = [t["dead_tuples"] for t in health if t["dead_tuples"] is not None]
    oldest = holders[0] if holders else None
    return {
        "oldest": oldest.as_dict() if oldest else None,
        "age_s": oldest.age_s if oldest else 0.0,
        "xid_age": oldest.xid_age if oldest else 0,
        "tables": {
            t["table"]: {k: t[k] for k in ("dead_tuples", "live_tuples", "total_bytes")} for t in health
        },
        "dead_rows": sum(dead) if dead or not health else None,
        "note": None if db.sees_all_activity() else NO_MONITOR_NOTE,
    }


def costs(results: Mapping[str, Any], *, min_dead_rows: int = HORIZON_MIN_DEAD_ROWS) -> dict[str, Any]:
    """What a held horizon cost one maintenance run, from its steps' results by step name (as
    :meth:`Maintenance.step` returns them: ``check_horizon``, ``vacuum``, ``compact_rings``,
    ``rebuild_indexes``, ``sample``; a step missing is left out).

    ``held``: whether something held the horizon past the run's thresholds (``holders``, as
    ``check_horizon`` named them); ``oldest``, ``tables``, ``dead_rows`` and ``note``: the horizon after the
    run's VACUUM (:func:`now`, from ``sample``); ``not_removable``: the tables whose VACUUM left at least
    ``min_dead_rows`` dead rows, which no snapshot needs once the horizon moves on; ``deferred``: the ring
    compactions and index rebuilds the run did not start because transactions held the horizon.
    """
    holders = list((results.get("check_horizon") or {}).get("xmin_holders") or [])
    state = (results.get("sample") or {}).get("horizon") or {}
    not_removable = []
    for table, v in sorted(((results.get("vacuum") or {}).get("tables") or {}).items()):
        left = v.get("dead_after")
        if left is not None and left >= min_dead_rows:
            not_removable.append(
                {"table": table, "dead_rows": left, "why": f"{left} dead rows not yet removable"}
            )
    deferred = [
        {"step": "compact", "object": a["table"], "action": a["action"], "why": a["error"]}
        for a in (results.get("compact_rings") or {}).get("actions") or []
        if not a["ok"] and HELD_BACK in (a.get("error") or "")
    ] + [
        {"step": "indexes", "object": a["index"], "action": a["action"], "why": a["error"]}
        for a in (results.get("rebuild_indexes") or {}).get("actions") or []
        if not a["ok"] and HELD_BACK in (a.get("error") or "")
    ]
    return {
        "held": bool(holders),
        "holders": holders,
        "oldest": state.get("oldest"),
        "dead_rows": state.get("dead_rows"),
        "tables": {t: v for t, v in (state.get("tables") or {}).items() if v.get("dead_tuples")},
        "not_removable": not_removable,
        "deferred": deferred,
        "note": state.get("note"),
    }
