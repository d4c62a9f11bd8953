"""VACUUM (or what stands for it where a database has none) and ANALYZE of the schema's tables, and
their sizes and dead rows."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.maintenance.results import iso

log = logging.getLogger(__name__)


def table_health(db: Database) -> list[dict[str, Any]]:
    """Size and vacuum state of the schema's tables (JSON-safe dicts).

    Where the database counts no dead rows and has no VACUUM (SQL Server), the dead-row and vacuum
    columns are ``None``; ``last_analyze`` is the newest statistics update.
    """
    out = []
    for name, heap, idx, total, live, dead, vacuumed, analyzed, autovacuums, vacuums in db.fetchall(
        "table_health", {"schema": db.schema}
    ):
        if heap is None or idx is None or total is None:
            continue  # dropped while read (a ring of the rows layout has tables of its own)
        out.append(
            {
                "table": name,
                "table_bytes": int(heap),
                "index_bytes": int(idx),
                "total_bytes": int(total),
                "live_tuples": int(live),
                "dead_tuples": None if dead is None else int(dead),
                "dead_ratio": None
                if dead is None
                else round(dead / (live + dead), 4)
                if live + dead
                else 0.0,
                "last_vacuum": iso(vacuumed),
                "last_analyze": iso(analyzed),
                "autovacuum_count": None if autovacuums is None else int(autovacuums),
                "vacuum_count": None if vacuums is None else int(vacuums),
            }
        )
    return out


def vacuum(
    db: Database,
    lock: SchemaLock,
    tables: Sequence[str] | None = None,
    *,
    analyze_only: bool = False,
    lock_wait_s: float = 0.0,
) -> dict[str, Any]:
    """Run ``vacuum_table`` (or ``analyze_table``) on the schema's tables; see :meth:`Maintenance.vacuum`."""
    tables = db.tables if tables is None else tables
    for t in tables:
        if t not in db.tables:
            raise ConfigurationError(
                f"{t!r} is not a table of the dbqueue schema on {db.dialect_name}; choose from {db.tables}"
            )
    with lock.hold(lock_wait_s) as got:
        if not got:
            return {"skipped": lock.skip_reason}
        conn = lock.conn
        before = {r["table"]: r["dead_tuples"] for r in table_health(db)}
        done: dict[str, Any] = {}
        for t in tables:
            t0 = time.monotonic()
            db.execute(
                "analyze_table" if analyze_only else "vacuum_table", None, conn, identifiers={"table": t}
            )
            done[t] = {"seconds": round(time.monotonic() - t0, 3), "dead_before": before.get(t)}
        after = {r["table"]: r["dead_tuples"] for r in table_health(db)}
        for t in tables:
            done[t]["dead_after"] = after.get(t)
    if db.no_vacuum is not None:
        statement, note = db.no_vacuum
        log.info("dbqueue %s of schema %r: %s (%s)", statement, db.schema, done, note)
        return {"tables": done, "statement": statement, "note": note}
    log.info("dbqueue %s of schema %r: %s", "ANALYZE" if analyze_only else "VACUUM", db.schema, done)
    return {"tables": done}
