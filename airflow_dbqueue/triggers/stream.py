"""The shared stream of a triggerer: one database connection observing the queues of one Airflow
connection and queue schema for every :class:`~airflow_dbqueue.triggers.dbqueue.DbQueueTrigger` on it.

The connection LISTENs on the channels of every queue watched there and runs each trigger's readiness
check (a :class:`Watch`), at the trigger's own pace or when its queue notifies; each trigger reads its
own results and decides whether to fire (:mod:`airflow_dbqueue.triggers.firing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Hashable
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine import DbQueueError, NotifyMode
from airflow_dbqueue.engine.dialects.base import CONNECT_TIMEOUT_S
from airflow_dbqueue.hooks.connection import Target, connection_target
from airflow_dbqueue.hooks.dbqueue import DbQueueHook

if TYPE_CHECKING:
    from airflow_dbqueue.engine import Queue
    from airflow_dbqueue.engine.dialects.base import AsyncDbConnection, Database

APPLICATION_NAME = "airflow-dbqueue-trigger"
"""The ``application_name`` of a stream's connection (one a connection and schema in a triggerer)."""


def open_queue(target: Target, queue_name: str, group: str | None = None) -> Queue:
    """Load a queue's settings (and its consumer group's, with ``group``) with the sync engine (run in a
    thread) and close its pool again."""
    from airflow_dbqueue.engine import DbQueue

    dbq = DbQueue(target.dsn, **target.engine_kwargs(), pool_size=1)
    try:
        return dbq.queue(queue_name).group(group)
    finally:
        dbq.close()


_watch_ids = itertools.count(1)


class Watch:
    """One trigger's observation of one queue on a stream: what to check, and when next."""

    def __init__(
        self,
        queue_name: str,
        min_priority: int | None,
        cap: int,
        poll_interval: float,
        use_notify: bool,
        *,
        group: str | None = None,
    ) -> None:
        self.id = next(_watch_ids)
        self.queue_name = queue_name
        self.group = group
        self.min_priority = min_priority
        self.cap = cap
        self.poll_interval = poll_interval
        self.use_notify = use_notify
        self.due = 0.0  # monotonic time of the next check; 0: at once
        self.notified = False
        self.queue: Queue | None = None
        self.error: BaseException | None = None
        self.channel: str | None = None  # the NOTIFY channel it wakes on, once LISTENed


class Stream:
    """The observation of the queues of one database schema: one connection, its LISTENs, and every
    watch's readiness check, each at its watch's own pace or when its queue notifies.

    :meth:`run` yields ``{watch id: (ready, head) or an exception}`` for the watches it checked; each
    subscriber reads its own entry. A watch's error (its queue does not exist, or cannot be observed
    asynchronously) goes to that watch alone; a failure of the connection ends the stream for all.
    """

    def __init__(self) -> None:
        self.watches: dict[int, Watch] = {}
        self._changed = asyncio.Event()

    def add(self, watch: Watch) -> None:
        self.watches[watch.id] = watch
        self._changed.set()

    def remove(self, watch: Watch) -> None:
        self.watches.pop(watch.id, None)

    def wake(self) -> None:
        """Make the stream look at its watches again (a watch's next check moved earlier)."""
        self._changed.set()

    async def run(self, conn_id: str, schema: str | None) -> AsyncGenerator[dict[int, Any], None]:
        from airflow_dbqueue.engine.dialects.factory import make_database

        conn = await DbQueueHook.aget_connection(conn_id)
        target = await asyncio.to_thread(connection_target, conn)  # a token login may do I/O
        target = target._replace(schema=schema or target.schema)
        # The dialect's database object opens no pool here: the stream's one connection is aconnect's.
        db = make_database(
            target.dsn, **target.engine_kwargs(), pool_size=1, connect_timeout=CONNECT_TIMEOUT_S
        )
        aconn = await db.aconnect(APPLICATION_NAME)
        listening: set[str] = set()
        try:
            while True:
                self._changed.clear()
                for w in list(self.watches.values()):
                    if w.queue is None and w.error is None:
                        await self._load(w, target, db.supports_notify, aconn, listening)
                results = await self._check_due(aconn)
                if results:
                    yield results
                if self._changed.is_set():
                    continue
                due = [w.due for w in self.watches.values() if w.error is None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                for channel in await self._wait(db, aconn, timeout, bool(listening)):
                    for w in self.watches.values():
                        if w.channel == channel:
                            w.notified = True
        finally:
            with contextlib.suppress(Exception):
                await aconn.close()

    async def _check_due(self, aconn: AsyncDbConnection) -> dict[int, Any]:
        """Check the readiness of every watch that was notified or whose poll is due; return what each
        saw, by watch id (a watch that failed reports its error)."""
        results: dict[int, Any] = {}
        for w in list(self.watches.values()):
            if w.error is not None:
                results[w.id] = w.error
            elif w.queue is not None and (w.notified or w.due <= time.monotonic()):
                w.notified = False
                w.due = time.monotonic() + w.poll_interval
                try:
                    results[w.id] = await w.queue.areadiness(aconn, w.min_priority, cap=w.cap)
                except NotImplementedError as exc:  # not PostgreSQL: this watch cannot go on
                    w.error = results[w.id] = exc
        return results

    async def _load(
        self,
        w: Watch,
        target: Target,
        can_listen: bool,
        aconn: AsyncDbConnection,
        listening: set[str],
    ) -> None:
        """Load a new watch's queue and LISTEN on its channel before its first check, so that a push
        committed after that check wakes it (unless the stream cannot LISTEN: a transaction pooler
        without a listen DSN, where every watch polls)."""
        try:
            w.queue = await asyncio.to_thread(open_queue, target, w.queue_name, w.group)
        except DbQueueError as exc:
            w.error = exc
            return
        if can_listen and w.use_notify and w.queue.settings.notify is not NotifyMode.NEVER:
            try:
                if w.queue.channel not in listening:
                    await w.queue.alisten(aconn)
            except NotImplementedError as exc:  # not PostgreSQL
                w.error = exc
                return
            w.channel = w.queue.channel
            listening.add(w.channel)

    async def _wait(
        self, db: Database, aconn: AsyncDbConnection, timeout: float | None, listen: bool
    ) -> set[str]:
        """Wait up to ``timeout`` seconds (None: until woken) for a NOTIFY or :meth:`wake`; return the
        channels that notified."""
        changed = asyncio.ensure_future(self._changed.wait())
        heard = asyncio.ensure_future(db.anotifies(aconn, timeout)) if listen else None
        waiting: set[asyncio.Future[Any]] = {changed} if heard is None else {changed, heard}
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        if heard is not None and heard.done() and not heard.cancelled():
            return heard.result()  # raises the connection's error, if it failed
        return set()


STREAMS: dict[tuple[int, Hashable], Stream] = {}
"""The shared streams of this process, by event loop and ``shared_stream_key``: the triggerer runs the
producer (``open_shared_stream``) and the subscribers (``filter_shared_stream``) of one key in one
loop, and they meet here."""


def stream_key(conn_id: str, schema: str | None) -> tuple[str, str, str]:
    """The shared stream of a connection and queue schema: the triggerer groups triggers by it, and the
    producer and its subscribers meet under it in :data:`STREAMS`."""
    return ("airflow_dbqueue", conn_id, schema or "")


def shared(key: Hashable) -> tuple[tuple[int, Hashable], Stream]:
    at = (id(asyncio.get_running_loop()), key)
    stream = STREAMS.get(at)
    if stream is None:
        stream = STREAMS[at] = Stream()
    return at, stream


def drop_shared(at: tuple[int, Hashable], stream: Stream) -> None:
    """Forget the shared stream ``stream`` found at ``at`` by :func:`shared`, once its producer ends."""
    if STREAMS.get(at) is stream:
        del STREAMS[at]
