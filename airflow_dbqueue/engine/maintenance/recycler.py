"""Recycling of the table design's partitions: TRUNCATE the generations of ``meta``, ``data`` and
``done`` that hold no row any more, after moving the few delayed or failed messages that would keep
an old generation from emptying into the one pushes write now. Unlike VACUUM, a TRUNCATE gives the
space of dead row versions back (to the file system, with their index entries) also while the xmin
horizon is held, and with no lock held longer than a partition's check and truncation. Only where the
database keeps old row versions in the table (PostgreSQL); elsewhere the step says why it has nothing
to do."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.queue import check_seconds

log = logging.getLogger(__name__)


class TableRecycler:
    """The partition recycling of one schema (see :meth:`Maintenance.recycle`)."""

    def __init__(self, db: Database, lock: SchemaLock) -> None:
        self._db = db
        self._lock = lock

    def recycle(
        self, *, move_limit: int, min_bytes: int, lock_timeout_s: float, lock_wait_s: float
    ) -> dict[str, Any]:
        if move_limit < 0 or min_bytes < 0:
            raise ConfigurationError(
                f"need recycle_move_limit >= 0 and recycle_min_bytes >= 0, got {move_limit} and {min_bytes}"
            )
        check_seconds("recycle_lock_timeout", lock_timeout_s, positive=True)
        if self._db.table_recycling_skipped is not None:
            return {"skipped": self._db.table_recycling_skipped}
        with self._lock.hold(lock_wait_s) as got:
            if not got:
                return {"skipped": self._lock.skip_reason}
            out = recycle_partitions(
                self._db, move_limit=move_limit, min_bytes=min_bytes, lock_timeout_s=lock_timeout_s
            )
        out.pop("holding", None)
        if out["moved"] or out["emptied"] or out["lock_not_granted"]:
            log.info("dbqueue partition recycling of schema %r: %s", self._db.schema, out)
        return out


def recycle_partitions(
    db: Database,
    *,
    move_limit: int,
    min_bytes: int,
    lock_timeout_s: float,
    skip_current: bool = False,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """One recycling pass: raise the queues' floors, move up to ``move_limit`` stragglers, then empty every
    partition of at least ``min_bytes`` that holds no row (``skip_current``: not those of the generation
    pushes write now).
    Safe beside other passes, in this process or others: moves skip rows others hold, and a partition is
    checked again under its lock before it is emptied. ``holding``: partitions that still held a row.
    ``stop``: once set, no further statement is sent (the pass ends after the one in progress)."""
    # First the queues' floors (the least process-at time of each queue's waiting and leased messages),
    # so that the claims start their walk of the ready index there, past what was popped since.
    row = db.fetchone("table_raise_floors")
    raised = int(row[0]) if row and row[0] is not None else 0
    moved = 0
    if move_limit:
        row = db.fetchone("table_move_stragglers", {"n": move_limit})
        moved = int(row[0]) if row else 0
    emptied: list[str] = []
    busy: list[str] = []
    holding: list[str] = []
    freed = 0
    longest = locked = 0.0
    stopped = stop is not None and stop.is_set()
    for table, gen, size, current in [] if stopped else db.fetchall("table_partitions"):
        if stop is not None and stop.is_set():
            break
        if size < min_bytes or (skip_current and current):
            continue
        t0 = time.monotonic()
        row = db.fetchone(
            "table_empty_partition",
            {"table": table, "gen": gen, "lock_timeout_ms": max(1, int(lock_timeout_s * 1000))},
        )
        longest = max(longest, time.monotonic() - t0)
        if row is None or row[0] is None:
            busy.append(f"{table}_{gen}")
        elif row[0] >= 0:
            emptied.append(f"{table}_{gen}")
            freed += int(size)
            locked = max(locked, float(row[0]) / 1000)
        else:
            holding.append(f"{table}_{gen}")
    return {
        "floors_raised": raised,
        "moved": moved,
        "emptied": emptied,
        "lock_not_granted": busy,
        "freed_bytes": freed,
        "longest_s": round(longest, 4),
        "longest_lock_s": round(locked, 4),
        "holding": holding,
    }


class AutoRecycler:
    """Partition recycling that follows the work of one :class:`DbQueue`: a daemon thread that, every
    ``interval_s`` in which this process pushed or popped a table-design queue, runs one recycling pass
    (:func:`recycle_partitions`) on a pooled connection of its own, so that partitions are emptied
    within about a second of their last message leaving, also while the xmin horizon is held, without a
    maintenance loop. An idle process sends nothing. A pass costs one catalogue query (the partitions'
    sizes) and, for each partition of ``min_bytes`` or more outside the generation pushes write now, a
    check whether it holds a row and, if not, its TRUNCATE (its lock waited for at most
    ``lock_timeout_s``: pushes and pops queue behind the request that long at most). Stragglers
    (delayed and failed messages) are moved only after a pass found an old partition still holding a
    row, and at most every ``MOVE_EVERY`` intervals: moving looks through the old generations' rows,
    which costs more than the check, and a backlog keeps partitions holding rows for a while. Several
    processes may recycle one schema at once; they meet only at a partition's lock, and the second
    finds it empty. A pass that fails is logged and the next one (after more work) tries again:
    recycling never fails a push or a pop."""

    MOVE_EVERY = 10

    def __init__(
        self,
        db: Database,
        *,
        interval_s: float,
        move_limit: int,
        min_bytes: int,
        lock_timeout_s: float,
    ) -> None:
        # A weak reference: the thread must not keep a DbQueue's pool open after its owner let it go
        # without closing it (the pool is closed when it is collected, and the thread then ends).
        self._db = weakref.ref(db)
        self._schema = db.schema
        self.interval_s = interval_s
        self._move_limit = move_limit
        self._min_bytes = min_bytes
        self._lock_timeout_s = lock_timeout_s
        self._active = False
        self._move_next = True
        self._last_move = -float("inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # Held by a pass, and by suspended(): a pass and the schema's drop never run at once.
        self._pass_lock = threading.Lock()
        #: Passes run and partitions emptied by this process (for tests and metrics).
        self.passes = 0
        self.emptied = 0

    def poke(self) -> None:
        """Note that this process pushed or popped a table-design queue (a plain attribute write)."""
        self._active = True
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._loop, name=f"dbqueue-recycle-{self._schema}", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._db() is None:
                return
            if not self._active:
                continue
            self._active = False
            try:
                self.run_once()
            except Exception as exc:  # logged; the next pass after more work tries again
                log.warning("dbqueue partition recycling of schema %r failed: %s", self._schema, exc)

    def run_once(self) -> dict[str, Any]:
        """One pass now, in the calling thread."""
        with self._pass_lock:
            return self._pass()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No pass runs inside this block: one in progress is waited for first. The schema's drop runs
        inside it, since a pass's TRUNCATE of a partition and the drop of its tables would deadlock."""
        with self._pass_lock:
            yield

    def _pass(self) -> dict[str, Any]:
        db = self._db()
        if db is None or self._stop.is_set():  # a statement now would open the closed pool again
            return {"skipped": "the DbQueue was closed"}
        now = time.monotonic()
        move = self._move_next and now - self._last_move >= self.MOVE_EVERY * self.interval_s
        if move:
            self._last_move = now
        out = recycle_partitions(
            db,
            move_limit=self._move_limit if move else 0,
            min_bytes=self._min_bytes,
            lock_timeout_s=self._lock_timeout_s,
            skip_current=True,
            stop=self._stop,
        )
        self.passes += 1
        self.emptied += len(out["emptied"])
        # Partitions that still hold a row may hold stragglers (moved next pass) or a backlog; partitions
        # whose lock was not granted are tried again next interval, activity or not.
        self._move_next = bool(out["holding"])
        if out["lock_not_granted"] or out["moved"]:
            self._active = True
        if out["moved"] or out["emptied"] or out["lock_not_granted"]:
            log.debug("dbqueue partition recycling of schema %r: %s", self._schema, out)
        return out

    def close(self) -> None:
        """Stop the thread: a pass in progress sends no statement after the one it is in, which is
        waited for (up to 30 s), so that no statement of the pass opens the DbQueue's pool again after
        its close."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30.0)
