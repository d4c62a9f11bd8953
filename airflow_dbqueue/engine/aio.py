"""``AsyncDbQueue`` and ``AsyncQueue``: the engine's asyncio face.

The same methods, arguments, defaults, errors and semantics as :class:`~airflow_dbqueue.engine.DbQueue`
and :class:`~airflow_dbqueue.engine.Queue`, awaited::

    async with AsyncDbQueue(dsn) as dbq:
        q = await dbq.create_queue("orders")
        await q.push({"order": 1})
        [m] = await q.pop(semantics="at-least-once", wait=30)
        await q.ack([m])

They run the designs' one implementation (``bridge.py`` says how) on psycopg's ``AsyncConnectionPool``:
a waiting pop holds no thread and no connection (one listening connection per ``AsyncDbQueue``, read
by the event loop, wakes its waiters), and ``conn=`` takes a psycopg ``AsyncConnection`` with a
transaction open, so that a push or an exactly-once pop commits with the caller's own writes.

Cancellation (``task.cancel()``, ``asyncio.timeout``, ``wait_for``) leaves no transaction open and
no lease behind: a statement in flight is cancelled on the server and rolls back; one that finished
first stands, and then an at-least-once pop gives back what it leased (a ``nack`` without delay: the
messages are ready again at once, this delivery counted) before the cancellation is raised. A pop at most
once whose statement finished has taken its messages, as a consumer that fails after its pop does; in
the caller's transaction, the caller's rollback decides.

PostgreSQL only: on SQL Server (no asyncio driver here) the constructor raises
:class:`~airflow_dbqueue.engine.errors.NotSupportedError`; use ``DbQueue`` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.bridge import run_sync
from airflow_dbqueue.engine.client import DbQueue
from airflow_dbqueue.engine.dialects.base import CONNECT_TIMEOUT_S, DEFAULT_SCHEMA
from airflow_dbqueue.engine.dialects.factory import make_async_database
from airflow_dbqueue.engine.errors import NotSupportedError
from airflow_dbqueue.engine.models import Batch, Message, QueueSettings, Semantics
from airflow_dbqueue.engine.queue import Queue as _SyncQueue

if TYPE_CHECKING:
    from types import TracebackType

    import psycopg

    from airflow_dbqueue.engine.dialects.postgres.aio import AsyncPostgres
    from airflow_dbqueue.engine.queue import Queue

__all__ = ["AsyncDbQueue", "AsyncQueue"]


def _awaited(name: str) -> Any:
    """An ``AsyncQueue`` method that runs the handle's method ``name`` under the asyncio face."""

    async def method(self: AsyncQueue, *args: Any, **kwargs: Any) -> Any:
        return await run_sync(functools.partial(getattr(self._q, name), *args, **kwargs))

    method.__name__ = method.__qualname__ = name
    return method


class AsyncQueue:
    """A queue's handle under the asyncio face: :class:`~airflow_dbqueue.engine.Queue`'s methods,
    awaited (``name``, ``settings`` and ``channel`` are its attributes)."""

    def __init__(self, handle: Queue, dbq: AsyncDbQueue) -> None:
        self._q = handle
        self._dbq = dbq
        self.name = handle.name
        self.settings: QueueSettings = handle.settings

    def __repr__(self) -> str:
        return f"<AsyncQueue {self._q!r}>"

    @property
    def channel(self) -> str:
        return self._q.channel

    @property
    def handle(self) -> Queue:
        """The design's handle that this one drives (its attributes: ``push_timeout``, ``gap_timeout``,
        ``reclaim_every``); its methods are for the asyncio face's calls only."""
        return self._q

    async def pop(
        self,
        n: int = 1,
        *,
        semantics: Semantics | str = Semantics.AT_MOST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        poll_interval: float = 1.0,
        consumer: str | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
        group: str | None = None,
    ) -> list[Message]:
        """:meth:`Queue.pop <airflow_dbqueue.engine.Queue.pop>`, awaited; ``wait`` suspends only this
        task. Cancelled after its statement leased messages, it gives them back before it raises."""
        call = functools.partial(
            self._q.pop,
            n,
            semantics=semantics,
            visibility_timeout=visibility_timeout,
            wait=wait,
            poll_interval=poll_interval,
            consumer=consumer,
            conn=conn,
            group=group,
        )
        leased = conn is None and Semantics.parse(semantics) is Semantics.AT_LEAST_ONCE
        handle = self._q if group is None else None

        async def give_back(messages: list[Message]) -> None:
            if leased and messages:
                target = handle if handle is not None else await run_sync(lambda: self._q.group(group))
                await asyncio.shield(run_sync(lambda: target.nack(messages, delay=0)))

        return await run_sync(call, on_cancelled=give_back)

    push = _awaited("push")
    push_batch = _awaited("push_batch")
    pop_payloads = _awaited("pop_payloads")
    ack = _awaited("ack")
    nack = _awaited("nack")
    ack_receipts = _awaited("ack_receipts")
    nack_receipts = _awaited("nack_receipts")
    reclaim_expired = _awaited("reclaim_expired")
    maintain = _awaited("maintain")
    peek = _awaited("peek")
    count_ready = _awaited("count_ready")
    readiness = _awaited("readiness")
    stats = _awaited("stats")
    list_failed = _awaited("list_failed")
    requeue_failed = _awaited("requeue_failed")
    delete_failed = _awaited("delete_failed")
    leased = _awaited("leased")

    async def claim_batch(
        self,
        n: int,
        *,
        visibility_timeout: float | None = None,
        consumer: str | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> Batch | None:
        """:meth:`Queue.claim_batch <airflow_dbqueue.engine.Queue.claim_batch>`, awaited. Cancelled
        after its statement claimed a batch (outside a caller's transaction), it releases the batch
        before it raises."""
        call = functools.partial(
            self._q.claim_batch, n, visibility_timeout=visibility_timeout, consumer=consumer, conn=conn
        )

        async def give_back(batch: Batch | None) -> None:
            if batch is not None and conn is None:
                await asyncio.shield(run_sync(lambda: self._q.release_batch(batch.batch_id, delay=0)))

        return await run_sync(call, on_cancelled=give_back)

    get_batch = _awaited("get_batch")
    open_batches = _awaited("open_batches")
    batch_query = _awaited("batch_query")
    ack_batch = _awaited("ack_batch")
    release_batch = _awaited("release_batch")
    extend_batch = _awaited("extend_batch")
    groups = _awaited("groups")
    drop_group = _awaited("drop_group")
    recover_gaps = _awaited("recover_gaps")

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[Notifications]:
        """LISTEN on this queue's NOTIFY channel for as long as the block lasts (for observers, such as
        the Airflow trigger, that wake on a push without popping): the LISTEN is in place when the block
        begins, and :meth:`Notifications.wait` returns whether a notification arrived since its last
        return. It shares the ``AsyncDbQueue``'s one listening connection with waiting pops."""
        manager = self._dbq.db.listening(self.channel)
        waiter = await run_sync(manager.__enter__)
        try:
            yield Notifications(waiter)
        finally:
            manager.__exit__(None, None, None)

    async def group(self, name: str | None) -> AsyncQueue:
        """The handle of consumer group ``name``
        (:meth:`Queue.group <airflow_dbqueue.engine.Queue.group>`)."""
        handle = await run_sync(lambda: self._q.group(name))
        return self if handle is self._q else AsyncQueue(handle, self._dbq)

    async def add_group(self, name: str, **kwargs: Any) -> AsyncQueue:
        """Add a consumer group and return its handle (:meth:`Queue.add_group
        <airflow_dbqueue.engine.Queue.add_group>`)."""
        return AsyncQueue(await run_sync(lambda: self._q.add_group(name, **kwargs)), self._dbq)


# Each awaited method says what its synchronous twin says.
for _name, _value in list(vars(AsyncQueue).items()):
    if inspect.iscoroutinefunction(_value) and _value.__doc__ is None:
        _twin = inspect.getdoc(getattr(_SyncQueue, _name, None)) or ""
        _value.__doc__ = f"Awaited :meth:`Queue.{_name} <airflow_dbqueue.engine.Queue.{_name}>`.\n\n{_twin}"


class Notifications:
    """What :meth:`AsyncQueue.listening` yields."""

    def __init__(self, waiter: Any) -> None:
        self._waiter = waiter

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a notification of the queue; return whether one came (one
        that came since the last wait returns at once)."""
        return await run_sync(lambda: bool(self._waiter.wait(timeout)))


class AsyncDbQueue:
    """Queues in one schema of one PostgreSQL database, for asyncio applications: :class:`DbQueue`'s
    queue methods, awaited. The parameters are :class:`DbQueue`'s, and ``application_name``, what its
    sessions are called on the server (default ``airflow-dbqueue``; the listening one adds ``-listen``).
    ``recycle_interval`` defaults to None here: the partition recycling is a thread of the synchronous
    face, which an asyncio application turns on by giving a number.

    Constructing it does no I/O; the pool opens on first use, on the running event loop, which the
    object then belongs to. Use ``async with``, or ``await close()``. Installing the schema and
    maintenance are the synchronous face's (``DbQueue``): :meth:`install` runs it in a thread.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = DEFAULT_SCHEMA,
        pool_size: int = 10,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        dialect: str | None = None,
        pooler: str | None = None,
        listen_dsn: str | None = None,
        recycle_interval: float | None = None,
        application_name: str | None = None,
    ) -> None:
        self._sync = DbQueue(
            dsn,
            schema=schema,
            pool_size=pool_size,
            connect_timeout=connect_timeout,
            dialect=dialect,
            pooler=pooler,
            listen_dsn=listen_dsn,
            recycle_interval=recycle_interval,
        )
        try:
            self.db: AsyncPostgres = make_async_database(self._sync.db, pool_size=pool_size)
        except NotSupportedError:
            self._sync.close()
            raise
        if application_name is not None:  # what its sessions show in pg_stat_activity
            self._sync.db._application_name = application_name  # type: ignore[attr-defined]
        # The client's own logic (create, open, list and drop queues) on the asynchronous database.
        self._client = copy.copy(self._sync)
        self._client.db = self.db
        self._client._queues = {}
        self._handles: dict[int, AsyncQueue] = {}
        self.dialect = self._sync.dialect
        self.schema = self._sync.schema

    async def __aenter__(self) -> AsyncDbQueue:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pool and the listening connection (and the recycling, when one was asked for)."""
        try:
            await self.db.aclose()
        finally:
            self._sync.close()

    @property
    def sync(self) -> DbQueue:
        """The synchronous face on the same database and schema (its own pool, opened on first use):
        for what only it offers (maintenance, grants), from a thread."""
        return self._sync

    async def install(self) -> int:
        """:meth:`DbQueue.install`, run in a thread on the synchronous face's connection."""
        return await asyncio.to_thread(self._sync.install)

    async def uninstall(self) -> None:
        """:meth:`DbQueue.uninstall`, run in a thread on the synchronous face's connection."""
        await asyncio.to_thread(self._sync.uninstall)
        self._client._queues.clear()
        self._handles.clear()

    def _wrap(self, handle: Queue) -> AsyncQueue:
        got = self._handles.get(id(handle))
        if got is None or got._q is not handle:
            got = self._handles[id(handle)] = AsyncQueue(handle, self)
        return got

    async def create_queue(self, name: str, **settings: Any) -> AsyncQueue:
        """:meth:`DbQueue.create_queue`, awaited."""
        return self._wrap(await run_sync(lambda: self._client.create_queue(name, **settings)))

    async def queue(self, name: str) -> AsyncQueue:
        """:meth:`DbQueue.queue`, awaited."""
        return self._wrap(await run_sync(lambda: self._client.queue(name)))

    async def list_queues(self) -> list[QueueSettings]:
        """:meth:`DbQueue.list_queues`, awaited."""
        return await run_sync(self._client.list_queues)

    async def drop_queue(self, name: str, *, missing_ok: bool = False) -> bool:
        """:meth:`DbQueue.drop_queue`, awaited."""
        return await run_sync(lambda: self._client.drop_queue(name, missing_ok=missing_ok))

    def transaction(self) -> _Transaction:
        """``async with dbq.transaction() as conn``: a pooled ``AsyncConnection`` in a transaction, for
        exactly-once work (``conn=conn``); it commits when the block ends, or rolls back on an exception
        (a cancellation among them)."""
        return _Transaction(self)


class _Transaction:
    def __init__(self, dbq: AsyncDbQueue) -> None:
        self._dbq = dbq
        self._stack: Any = None

    async def __aenter__(self) -> psycopg.AsyncConnection[Any]:
        stack = contextlib.AsyncExitStack()
        conn = await stack.enter_async_context(self._dbq.db.connection())
        await stack.enter_async_context(conn.transaction())
        self._stack = stack
        return conn

    async def __aexit__(self, *exc: Any) -> bool | None:
        stack, self._stack = self._stack, None
        return await asyncio.shield(stack.__aexit__(*exc))
