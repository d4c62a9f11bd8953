"""The schema's queues as maintenance sees them, and each queue's design upkeep (lease reclaim; a
ring's gap recovery).

A queue may be dropped while maintenance runs, which is no failure of the run: a step skips it and
notes so. Whether a queue is gone is asked of the database, never of the client's cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from airflow_dbqueue.engine.errors import QueueNotFoundError

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import Database
    from airflow_dbqueue.engine.models import QueueSettings
    from airflow_dbqueue.engine.queue import Queue

log = logging.getLogger(__name__)


class QueueOpener(Protocol):
    """What maintenance needs of the client that owns a schema's queues (a :class:`DbQueue`)."""

    def queue(self, name: str) -> Queue:
        """The named queue; raises :class:`QueueNotFoundError` when there is none."""
        ...

    def list_queues(self) -> list[QueueSettings]: ...

    def _refresh_if_dropped(self, name: str, queue_id: int) -> bool:
        """Whether queue ``name`` with ``queue_id`` was dropped, asked of the database (a handle the
        client cached for it is forgotten then)."""
        ...


class Queues:
    """The queues of one schema, opened through the client that owns them."""

    def __init__(self, opener: QueueOpener, schema: str, db: Database | None = None) -> None:
        self._dbq = opener
        self.schema = schema
        self.db = db
        """The schema's database, for the steps that count every queue at once (None: a queue at a
        time)."""

    def current(self, name: str) -> Queue | None:
        """The queue of that name as the database has it now (not a handle of a queue dropped since it
        was cached), or None when there is none."""
        try:
            q = self._dbq.queue(name)
            if self.gone(name, q.settings.queue_id):
                q = self._dbq.queue(name)  # created again under the name since, or QueueNotFoundError
        except QueueNotFoundError:
            return None
        return q

    def gone(self, name: str, queue_id: int) -> bool:
        """Whether queue ``name`` (as ``queue_id``) was dropped: asked of the database, not the cache."""
        return self._dbq._refresh_if_dropped(name, queue_id)

    def vanished_note(self, name: str, what: str) -> str:
        """A note (also logged) that queue ``name`` no longer exists, and ``what`` became of its step."""
        note = f"queue {name!r} no longer exists in schema {self.schema!r} (dropped meanwhile): {what}"
        log.info("dbqueue maintenance: %s", note)
        return note

    def each(self, queues: Sequence[str] | None, notes: list[str], what: str) -> Iterator[tuple[str, Queue]]:
        """Yield ``(name, queue)`` for the named queues (or every queue), noting those that no longer
        exist."""
        names = list(queues) if queues is not None else [s.name for s in self._dbq.list_queues()]
        for name in names:
            q = self.current(name)
            if q is None:
                notes.append(self.vanished_note(name, what))
                continue
            yield name, q

    def listed(self, queues: Sequence[str] | None, notes: list[str], what: str) -> list[QueueSettings]:
        """The settings of the named queues (or of every queue) from one listing of the schema's queues,
        noting those that do not exist: the steps that count every queue with one statement start here,
        without a handle or a query a queue."""
        every = self._dbq.list_queues()
        if queues is None:
            return every
        by_name = {s.name: s for s in every}
        out = []
        for name in queues:
            if name in by_name:
                out.append(by_name[name])
            else:
                notes.append(self.vanished_note(name, what))
        return out

    def filter(self, queues: Sequence[str] | None, notes: list[str]) -> dict[str, Any]:
        """The parameters of a batch statement that limit it to ``queues`` (None: every queue)."""
        if queues is None:
            return {"all_queues": True, "queue_ids": []}
        ids = []
        for name in queues:
            q = self.current(name)
            if q is None:
                notes.append(self.vanished_note(name, "skipped"))
            else:
                ids.append(q.settings.queue_id)
        return {"all_queues": False, "queue_ids": ids}


def upkeep(
    queues: Queues, names: Sequence[str] | None, *, limit: int, notes: list[str]
) -> dict[str, dict[str, int]]:
    """Run every queue's design upkeep (:meth:`Queue.maintain`); return what it did, by queue.

    The table design returns expired leases to ready (or failed); the ring design recovers its gaps
    here too. Safe to run alongside consumers (claims skip locked rows), so it takes no lock. Where the
    dialect counts the schema at once (``schema_passes``), one statement (``upkeep_due``) names the
    table-design queues that have an expired lease, a batch or a deduplication key to forget, or a
    message whose time to live passed, and only those run their upkeep statements; the others report
    zeros, as their statements would have.
    """
    from airflow_dbqueue.engine.models import Design
    from airflow_dbqueue.engine.table import TableQueue

    what = "its upkeep was skipped"
    out: dict[str, dict[str, int]] = {}
    if queues.db is not None and queues.db.schema_passes:
        listed = queues.listed(names, notes, what)
        due = {
            int(r[0])
            for r in queues.db.fetchall("upkeep_due", {"older_than_s": TableQueue.batch_retention_s})
        }
        idle = [s.name for s in listed if s.design is Design.TABLE and s.queue_id not in due]
        out.update(
            {name: {"reclaimed": 0, "batches_purged": 0, "keys_forgotten": 0, "expired": 0} for name in idle}
        )
        names = [s.name for s in listed if s.name not in out]
    for name, q in queues.each(names, notes, what):
        try:
            out[name] = q.maintain(limit=limit)
        except Exception:
            if not queues.gone(name, q.settings.queue_id):
                raise
            notes.append(queues.vanished_note(name, "its upkeep was skipped"))
            continue
        if any(out[name].values()):
            log.info("dbqueue upkeep of queue %r in schema %r: %s", name, queues.schema, out[name])
    return out
