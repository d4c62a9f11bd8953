"""What holds back cleanup: on PostgreSQL the xmin horizon (a long transaction, a replication slot, a
prepared transaction), which keeps any VACUUM from removing dead rows; on SQL Server long and snapshot
transactions, which hold back log truncation and version cleanup. Online index rebuilds and ring
compaction are not started while one of them would hold them up."""

from __future__ import annotations

import logging

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.maintenance.config import HORIZON_MIN_AGE_S, HORIZON_MIN_XID_AGE
from airflow_dbqueue.engine.maintenance.results import XminHolder

log = logging.getLogger(__name__)

REBUILD_WAITS_FOR = ("transaction", "prepared transaction", "snapshot transaction")
"""The kinds of :class:`XminHolder` an online index rebuild waits for (not a replication slot)."""


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
        f"{what} not run: {len(holders)} transaction(s) open longer than {age:g}s, and {consequence} "
        f"({named}); the next run tries again"
    )
    log.warning("dbqueue: %s", error)
    return error
