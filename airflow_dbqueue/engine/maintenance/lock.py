"""The schema's maintenance lock: at most one run changes a schema at a time.

The lock is held on a connection of its own (:meth:`Database.dedicated_connection`) with the named
queries ``maintenance_try_lock`` and ``maintenance_unlock``: a session-level advisory lock on
PostgreSQL, an application lock owned by the session on SQL Server. Closing the connection releases it
whatever happened, and every step that changes things runs its statements on that same connection.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import DbQueueError
from airflow_dbqueue.engine.maintenance.results import APPLICATION_NAME

log = logging.getLogger(__name__)


class SchemaLock:
    """The maintenance lock of one schema; a block of :meth:`hold` inside another reuses the outer
    one's hold. Not thread-safe (one per :class:`Maintenance`, which is one per thread)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self.schema = db.schema
        self._held: Any = None
        self.skip_reason: str | None = None
        """Why the last :meth:`hold` that was refused was refused (which session holds the lock)."""

    @contextlib.contextmanager
    def hold(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Hold the lock for the block; yield whether it was obtained.

        Waits up to ``wait_s`` seconds for another run to finish; when it does not, logs which session
        holds the lock and yields ``False`` (the caller skips its work).
        """
        if self._held is not None:
            yield True
            return
        params = {"schema": self.schema}
        with self._db.dedicated_connection(APPLICATION_NAME) as conn:
            if not self._wait(conn, wait_s):
                yield False
                return
            self._held = conn
            self.skip_reason = None
            try:
                yield True
            finally:
                self._held = None
                with contextlib.suppress(DbQueueError):
                    self._db.fetchone("maintenance_unlock", params, conn)

    def _wait(self, conn: Any, wait_s: float) -> bool:
        """Take the lock on ``conn``, trying for up to ``wait_s``; False (and the reason) when another
        session keeps it."""
        params = {"schema": self.schema}
        deadline = time.monotonic() + max(0.0, wait_s)
        announced = False
        while True:
            row = self._db.fetchone("maintenance_try_lock", params, conn)
            if row and row[0]:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                self.skip_reason = (
                    f"another maintenance run holds the lock of schema {self.schema!r} "
                    f"({self._describe_holder(conn)})" + (f"; waited {wait_s:g}s" if wait_s > 0 else "")
                )
                log.warning("dbqueue maintenance skipped: %s", self.skip_reason)
                return False
            if not announced:
                log.info(
                    "dbqueue maintenance: waiting up to %gs for the lock of schema %r, held by %s",
                    wait_s,
                    self.schema,
                    self._describe_holder(conn),
                )
                announced = True
            time.sleep(min(0.25, left))

    def _describe_holder(self, conn: Any) -> str:
        try:
            row = self._db.fetchone("maintenance_lock_holder", {"schema": self.schema}, conn)
        except DbQueueError as exc:
            return f"holder unknown: {exc}"
        if row is None:
            return "holder gone since"
        pid, app, addr, connected_s, state = row
        return (
            f"pid {pid}, application {app!r}, client {addr or 'local'}, connected {connected_s:.0f}s, {state}"
        )

    @property
    def conn(self) -> Any:
        """The connection that holds the lock (steps that change things run on it)."""
        assert self._held is not None, "a maintenance step ran outside its lock"
        return self._held
