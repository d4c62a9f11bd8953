"""The shared stream of a triggerer: one ``AsyncDbQueue`` observing the queues of one Airflow
connection and queue schema for every :class:`~airflow_dbqueue.triggers.dbqueue.DbQueueTrigger` on it.

Its listening connection LISTENs on the channels of every queue watched there, and its one pooled
connection runs each trigger's readiness check (a :class:`Watch`), at the trigger's own pace or when
its queue notifies; each trigger reads its own results and decides whether to fire
(:mod:`airflow_dbqueue.triggers.firing`). On SQL Server, which has no asyncio face, every watch fails
with :class:`~airflow_dbqueue.engine.NotSupportedError` (the sensor pokes or reschedules there).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Hashable
from typing import Any

from airflow_dbqueue.engine import DbQueueError, NotifyMode, NotSupportedError
from airflow_dbqueue.engine.aio import AsyncDbQueue, AsyncQueue, Notifications
from airflow_dbqueue.hooks.connection import connection_target
from airflow_dbqueue.hooks.dbqueue import DbQueueHook

APPLICATION_NAME = "airflow-dbqueue-trigger"
"""The ``application_name`` of a stream's connection (one a connection and schema in a triggerer)."""


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
        self.queue: AsyncQueue | None = None
        self.error: BaseException | None = None
        self.channel: str | None = None  # the NOTIFY channel it wakes on, once LISTENed


class Stream:
    """The observation of the queues of one database schema: one connection, its LISTENs, and every
    watch's readiness check, each at its watch's own pace or when its queue notifies.

    :meth:`run` yields ``{watch id: (ready, head) or an exception}`` for the watches it checked; each
    subscriber reads its own entry. A watch's error (its queue does not exist) goes to that watch
    alone; a failure of the database ends the stream for all.
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
        conn = await DbQueueHook.aget_connection(conn_id)
        target = await asyncio.to_thread(connection_target, conn)  # a token login may do I/O
        target = target._replace(schema=schema or target.schema)
        try:
            # One pooled connection for every watch's check, and the listening one for their channels.
            dbq = AsyncDbQueue(
                target.dsn, **target.engine_kwargs(), pool_size=1, application_name=APPLICATION_NAME
            )
        except NotSupportedError as exc:  # not PostgreSQL: every watch fails with it
            async for results in self._refuse(exc):
                yield results
            return
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(dbq.close)
            heard = asyncio.Event()
            listeners = ChannelListeners(stack, heard)
            while True:
                self._changed.clear()
                for w in list(self.watches.values()):
                    if w.queue is None and w.error is None:
                        await self._load(w, dbq, listeners)
                results = await self._check_due(listeners)
                if results:
                    yield results
                if self._changed.is_set():
                    continue
                due = [w.due for w in self.watches.values() if w.error is None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                await self._wait(heard, timeout)

    async def _refuse(self, exc: BaseException) -> AsyncGenerator[dict[int, Any], None]:
        """Report ``exc`` to every watch, as they come, until the stream is closed."""
        while True:
            self._changed.clear()
            for w in self.watches.values():
                w.error = exc
            if self.watches:
                yield dict.fromkeys(self.watches, exc)
            await self._changed.wait()

    async def _check_due(self, listeners: ChannelListeners) -> dict[int, Any]:
        """Check the readiness of every watch that was notified or whose poll is due; return what each
        saw, by watch id (a watch that failed reports its error)."""
        results: dict[int, Any] = {}
        notified = listeners.take()
        for w in list(self.watches.values()):
            if w.error is not None:
                results[w.id] = w.error
            elif w.queue is not None and (w.channel in notified or w.due <= time.monotonic()):
                w.due = time.monotonic() + w.poll_interval
                results[w.id] = await w.queue.readiness(w.min_priority, cap=w.cap)
        return results

    async def _load(self, w: Watch, dbq: AsyncDbQueue, listeners: ChannelListeners) -> None:
        """Open a new watch's queue and LISTEN on its channel before its first check, so that a push
        committed after that check wakes it (unless the queue cannot: a transaction pooler without a
        listen DSN, where every watch polls)."""
        try:
            w.queue = await (await dbq.queue(w.queue_name)).group(w.group)
        except DbQueueError as exc:
            w.error = exc
            return
        if dbq.db.supports_notify and w.use_notify and w.queue.settings.notify is not NotifyMode.NEVER:
            await listeners.listen(w.queue)
            w.channel = w.queue.channel

    async def _wait(self, heard: asyncio.Event, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds (None: until woken) for a NOTIFY or :meth:`wake`."""
        waiting = {asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(heard.wait())}
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)


class ChannelListeners:
    """The channels a stream LISTENs on (``AsyncQueue.listening``, one a channel however many watches
    share it), each waited on by a task of its own that notes the channel and sets ``heard``."""

    def __init__(self, stack: contextlib.AsyncExitStack, heard: asyncio.Event) -> None:
        self._stack = stack
        self._heard = heard
        self._notified: set[str] = set()
        self._channels: set[str] = set()

    async def listen(self, queue: AsyncQueue) -> None:
        if queue.channel in self._channels:
            return
        notifications = await self._stack.enter_async_context(queue.listening())
        self._channels.add(queue.channel)
        task = asyncio.create_task(self._follow(queue.channel, notifications))

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self._stack.push_async_callback(stop)

    async def _follow(self, channel: str, notifications: Notifications) -> None:
        while True:
            if await notifications.wait(3600.0):
                self._notified.add(channel)
                self._heard.set()

    def take(self) -> set[str]:
        """The channels notified since the last call."""
        got, self._notified = self._notified, set()
        self._heard.clear()
        return got


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
