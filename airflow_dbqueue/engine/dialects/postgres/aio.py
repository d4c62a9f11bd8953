"""PostgreSQL through psycopg's asyncio connections: the database of the asyncio face (``AsyncDbQueue``).

:class:`AsyncPostgres` is the :class:`~airflow_dbqueue.engine.dialects.base.Database` the designs call
when they run under the asyncio face (``engine/bridge.py``): the same named statements, prepared and
read in binary as :class:`~airflow_dbqueue.engine.dialects.postgres.dialect.PostgresDatabase` sends them
(whose schema, composed queries and error translation it shares), on an ``AsyncConnectionPool`` or on
the caller's ``AsyncConnection``. Waiting pops wait on :class:`AsyncNotifyHub`: one listening
connection read by the event loop, the hub's policy (one wake a NOTIFY, passed on, one poller a
channel) unchanged. Nothing of it holds a thread.

A statement that a cancellation interrupts is cancelled on the server (``cancel_safe``), so it rolls
back; one that had finished when the cancel reached it keeps its result, and the cancellation is held
for the call's next wait or its end (``bridge.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import psycopg
import psycopg.errors
from psycopg import IsolationLevel, sql
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from airflow_dbqueue.engine.bridge import (
    _AsyncCall,
    _current,
    await_only,
    entered,
    interruptible,
    shielded,
)
from airflow_dbqueue.engine.dialects.postgres.dialect import has_input
from airflow_dbqueue.engine.dialects.postgres.grants import rows_ring_statements
from airflow_dbqueue.engine.dialects.postgres.hub import LINGER, NotifyHub, Waiter
from airflow_dbqueue.engine.dialects.postgres.statements import BINARY_RESULTS
from airflow_dbqueue.engine.errors import DatabaseUnavailableError, LoginError

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.postgres.dialect import PostgresDatabase

log = logging.getLogger(__name__)

_TUPLES_OK = ExecStatus.TUPLES_OK
_ALL, _ONE, _COUNT = 0, 1, 2


_Statement: TypeAlias = tuple[bytes, "Mapping[str, Any] | None", bool, bool, int]
"""A statement to send: (query, params, binary results, prepared, what to return: _ALL, _ONE, _COUNT)."""


async def _execute(conn: psycopg.AsyncConnection[Any], statement: _Statement) -> Any:
    query, params, binary, prepare, kind = statement
    cur = await conn.execute(query, params, binary=binary, prepare=prepare)
    if kind == _ALL:
        res = cur.pgresult
        return await cur.fetchall() if res is not None and res.status == _TUPLES_OK else []
    if kind == _ONE:
        return await cur.fetchone()
    return cur.rowcount


class AsyncPostgres:
    """A dbqueue schema on PostgreSQL, for the asyncio face; everything it does not override is the
    synchronous database's (``sync``): its settings, its schema and composed statements.

    One object belongs to one event loop (its pool's and its hub's): the loop that first uses it.
    """

    def __init__(self, sync: PostgresDatabase, *, max_size: int) -> None:
        self.sync = sync
        self._max_size = max_size
        self._pool: AsyncConnectionPool | None = None
        self._opening: asyncio.Lock | None = None
        self._hub: AsyncNotifyHub | None = None
        self._closing: set[asyncio.Task[None]] = set()  # replaced pools, closing

    def __getattr__(self, name: str) -> Any:
        # Settings and pure helpers (schema, channel(), query(), supports_notify, payload_pops, ...).
        return getattr(self.sync, name)

    # -- the pool --------------------------------------------------------------------------------

    async def pool(self) -> AsyncConnectionPool:
        pool = self._pool
        if pool is not None:
            return pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                sync = self.sync
                pool = AsyncConnectionPool(
                    sync.dsn,
                    min_size=1,
                    max_size=self._max_size,
                    open=False,
                    timeout=sync._connect_timeout,
                    name=f"dbqueue-async-{sync.schema}",
                    configure=self._configure,
                    kwargs=sync._connect_kwargs(sync._application_name),
                )
                started = time.monotonic()
                try:
                    await self._refuse_login()
                    left = sync._connect_timeout - (time.monotonic() - started)
                    await pool.open(wait=True, timeout=max(0.1, left))
                except PoolTimeout as exc:
                    await pool.close(timeout=0)
                    raise DatabaseUnavailableError(
                        f"cannot connect to PostgreSQL at {sync.where} within "
                        f"{sync._connect_timeout:g}s: {exc}"
                    ) from None
                self._pool = pool
            return self._pool

    async def _refuse_login(self) -> None:
        """A login the server refuses raises :class:`LoginError` at once (the pool would retry it)."""
        sync = self.sync
        try:
            conn = await psycopg.AsyncConnection.connect(
                sync.dsn, connect_timeout=max(1, int(sync._connect_timeout))
            )
        except psycopg.OperationalError as exc:
            translated = sync._translated(exc)
            if isinstance(translated, LoginError):
                raise translated from None
            return
        await conn.close()

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The session settings of the synchronous pool's connections (``dialect._configure_connection``)."""
        await conn.set_isolation_level(IsolationLevel.READ_COMMITTED)
        if not self.sync.transaction_pooled:
            await conn.execute("SET TimeZone = 'UTC'; SET default_transaction_isolation = 'read committed'")

    async def aclose(self) -> None:
        hub, self._hub = self._hub, None
        if hub is not None:
            await hub.aclose()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A sound pooled connection (:meth:`_checkout`), handed back at the end (what is left open on it
        rolled back); one that broke meanwhile (the server went away) is closed, not handed back, and
        its pool replaced, as the synchronous face does."""
        pool, conn = await self._checkout()
        try:
            yield conn
        except BaseException:
            if not (conn.broken or conn.closed):
                await pool.putconn(conn)
                raise
            self._discard_pool(pool)
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        await pool.putconn(conn)

    async def _checkout(self) -> tuple[AsyncConnectionPool, psycopg.AsyncConnection[Any]]:
        """``PostgresDatabase._checkout`` on the asyncio pool: take a pooled connection that is sound, and
        replace the pool when one is stale.

        A connection that sat in the pool while the server ended it (a restart, pg_terminate_backend)
        has the server's error and EOF waiting on its socket, where an idle connection otherwise
        receives nothing: one readiness check of the socket (no round trip) finds it, a round trip
        confirms it. Every idle connection of the pool is then as likely stale, so the pool is replaced
        and the call gets a new connection, waiting up to the connect timeout while the server is not
        back yet.
        """
        for _ in range(3):
            pool = await self.pool()
            try:
                conn = await pool.getconn()
            except PoolClosed:
                continue  # replaced by another task meanwhile: take the new one
            try:
                sound = await _sound(conn)
            except BaseException:  # cancelled in the check's round trip: the connection goes back
                await pool.putconn(conn)
                raise
            if sound:
                return pool, conn
            log.info("a pooled connection to %s is stale (the server restarted?): new pool", self.sync.where)
            with contextlib.suppress(Exception):
                await conn.close()
            self._discard_pool(pool)
        pool = await self.pool()
        return pool, await pool.getconn()

    def _discard_pool(self, pool: AsyncConnectionPool) -> None:
        """Replace ``pool`` (``PostgresDatabase._discard_pool``): the next call opens a new one, and the
        old one closes in a task of its own, given the time its workers may need to finish a connection
        attempt; :meth:`aclose` waits for it."""
        if self._pool is not pool:
            return
        self._pool = None
        grace = self.sync._connect_timeout + 5

        async def close() -> None:
            with contextlib.suppress(Exception):
                await pool.close(timeout=grace)

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- statements ------------------------------------------------------------------------------

    async def _on(self, call: _AsyncCall, conn: psycopg.AsyncConnection[Any], statement: _Statement) -> Any:
        """Run ``statement`` on ``conn``; a cancellation meanwhile cancels it on the server, unless it
        finished first (then its result stands and the cancellation is held for ``call``)."""
        task = asyncio.ensure_future(_execute(conn, statement))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                with contextlib.suppress(Exception):
                    await shielded(conn.cancel_safe(timeout=5.0), call)
            try:
                out = await shielded(task, call)
            except Exception:  # QueryCanceled, or it failed anyway: it changed nothing
                raise asyncio.CancelledError from None
            call.cancelled = True
            return out

    async def _pooled(self, call: _AsyncCall, statement: _Statement) -> Any:
        async with self.connection() as conn:
            out = await self._on(call, conn, statement)
            if conn.info.transaction_status != TransactionStatus.IDLE:
                await conn.commit()
            return out

    def _run(
        self,
        name: str,
        params: Mapping[str, Any] | None,
        conn: Any,
        kind: int,
        identifiers: Mapping[str, str] | None,
    ) -> Any:
        sync = self.sync
        statement = (
            sync.query(name, identifiers),
            params,
            kind == _ALL and name in BINARY_RESULTS,
            name in sync._prepared,
            kind,
        )
        call = _current()
        try:
            if conn is None:
                return await_only(self._pooled(call, statement))
            return await_only(self._on(call, conn, statement))
        except Exception as exc:
            translated = sync._translated(exc)
            if translated is exc:
                raise
            raise translated from exc

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]:
        return self._run(name, params, conn, _ALL, identifiers)  # type: ignore[no-any-return]

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None:
        return self._run(name, params, conn, _ONE, identifiers)  # type: ignore[no-any-return]

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int:
        return self._run(name, params, conn, _COUNT, identifiers)  # type: ignore[no-any-return]

    def render(
        self, name: str, params: Mapping[str, Any], identifiers: Mapping[str, str] | None = None
    ) -> str:
        async def mogrify() -> str:
            async with self.connection() as c:
                return psycopg.AsyncClientCursor(c).mogrify(self.sync.query(name, identifiers), params)

        with self.sync.translate_errors():
            return await_only(mogrify())

    # -- transactions ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, conn: psycopg.AsyncConnection[Any] | None = None) -> Iterator[Any]:
        """A transaction that commits on success and rolls back on error (a savepoint in the caller's);
        its end runs to completion whatever cancellation arrives."""
        with self.sync.translate_errors():
            if conn is not None:
                with entered(conn.transaction()):
                    yield conn
                return
            with entered(self.connection()) as c, entered(c.transaction()):
                yield c

    @staticmethod
    def in_transaction(conn: Any) -> bool:
        return not (conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE)

    @contextlib.contextmanager
    def guarded(self, conn: Any) -> Iterator[Any]:
        """``PostgresDatabase.guarded`` on an async connection: a failing statement leaves the caller's
        transaction as it was."""
        if conn is None or (conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE):
            yield conn
            return
        with self.sync.translate_errors():
            if conn.info.transaction_status == TransactionStatus.INTRANS:
                with entered(conn.transaction()):
                    yield conn
                return
            try:
                yield conn
            except BaseException:
                if conn.info.transaction_status == TransactionStatus.INERROR:
                    await_only(shielded(conn.rollback(), _current()))
                raise

    def actions_on(self, queue_id: int | None) -> frozenset[str]:
        row = self.fetchone("actions_on", {"queue_id": queue_id})
        return frozenset(row[0] if row and row[0] else ())

    def grant_new_ring(self, conn: psycopg.AsyncConnection[Any], queue_id: int) -> None:
        """``PostgresGrants.grant_new_ring`` on an async connection."""
        roles = [r[0] for r in self.fetchall("grants_roles_of_queue", {"queue_id": queue_id}, conn)]
        if not roles:
            return
        for (seq,) in self.fetchall("ring_sequences_of", {"queue_ids": [queue_id]}, conn):
            for role in roles:
                statement = sql.SQL("GRANT USAGE, SELECT, UPDATE ON SEQUENCE {} TO {}").format(
                    sql.Identifier(self.sync.schema, seq), sql.Identifier(role)
                )
                with self.sync.translate_errors():
                    await_only(conn.execute(statement))
        objects = self.fetchall(
            "ring_rows_objects_of", {"schema": self.sync.schema, "queue_ids": [queue_id]}, conn
        )
        if not objects:
            return
        actions_of: dict[tuple[str, int], Any] = {}
        for role in roles:
            for qid, held in self.fetchall("role_actions_on", {"role": role, "queue_ids": [queue_id]}, conn):
                actions_of[(role, int(qid))] = held or ()
        for statement in rows_ring_statements(self.sync.schema, objects, actions_of):
            with self.sync.translate_errors():
                await_only(conn.execute(statement))

    # -- notifications ---------------------------------------------------------------------------

    def _notify_hub(self) -> AsyncNotifyHub:
        if self._hub is None:
            self._hub = AsyncNotifyHub(self)
        return self._hub

    @contextlib.contextmanager
    def listening(self, channel: str) -> Iterator[Waiter]:
        with contextlib.ExitStack() as stack:
            with self.sync.translate_errors():
                waiter = stack.enter_context(self._notify_hub().waiting(channel))
            yield waiter

    def wake_waiter(self, channel: str) -> None:
        hub = self._hub
        if hub is not None:
            hub.wake_one(channel)


async def _sound(conn: psycopg.AsyncConnection[Any]) -> bool:
    """``dialect._sound`` on an asyncio connection: nothing to read on its socket, or else a round trip
    works."""
    readable = has_input(conn)
    if readable is None or not readable:
        return readable is False
    try:
        await conn.execute("")
    except psycopg.Error:
        return False
    return True


class AsyncWaiter(Waiter):
    """A :class:`Waiter` whose wait suspends only its task."""

    __slots__ = ()

    def __init__(self, hub: NotifyHub, channel: str) -> None:
        super().__init__(hub, channel)
        self._event = asyncio.Event()  # type: ignore[assignment]

    def wait(self, timeout: float) -> bool:
        if self._hub.broken:
            with contextlib.suppress(Exception):
                self._hub.relisten(self.channel)
        elif self._hub.hold(self.channel):
            return True  # registered only now: a push that held the lock committed rows to look at
        event = cast("asyncio.Event", self._event)
        if timeout > 0 and not event.is_set():
            with contextlib.suppress(TimeoutError):
                interruptible(asyncio.wait_for(event.wait(), timeout))
        got = event.is_set()
        event.clear()
        return got


class AsyncNotifyHub(NotifyHub):
    """:class:`NotifyHub` on the event loop: its listening connection is an ``AsyncConnection`` whose
    socket the loop watches (``add_reader``); a LISTEN runs between two reads."""

    waiter_class = AsyncWaiter

    def __init__(self, db: AsyncPostgres) -> None:
        super().__init__(lambda: None, db.sync.waiters_lock)  # type: ignore[arg-type, return-value]
        self._db = db
        self._aconn: psycopg.AsyncConnection[Any] | None = None
        self._alock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None

    @property
    def broken(self) -> bool:
        return self._aconn is None and not self._closed

    def _listen(self, channel: str) -> None:
        if self._closed:
            raise RuntimeError("the notification hub is closed")
        await_only(self._alisten(channel))

    async def _alisten(self, channel: str) -> None:
        async with self._alock:
            conn = self._aconn
            if conn is None or conn.closed:
                sync = self._db.sync
                conn = await psycopg.AsyncConnection.connect(
                    sync.session_dsn("LISTEN"),
                    **sync._connect_kwargs(f"{sync._application_name}-listen", session=True),
                )
                conn.add_notify_handler(self._on_notify)
                self._aconn = conn
                self._listening.clear()
                self._held.clear()  # a new session holds none of the old one's locks
                self._idle.clear()
                self._loop = asyncio.get_running_loop()
            channels = list(dict.fromkeys([*list(self._waiters), channel]))
            self._unwatch()
            try:
                for c in channels:
                    if c not in self._listening:
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(c)))
                        self._listening.add(c)
                    await self._ahold_on(conn, c)  # after its LISTEN, before its waiters look
            except psycopg.OperationalError:
                self._drop_async()
                raise
            self._watch()

    async def _ahold_on(self, conn: psycopg.AsyncConnection[Any], channel: str) -> bool:
        """:meth:`NotifyHub._hold_on` on the asyncio connection (under ``_alock``, unwatched)."""
        lock = self._lock_to_try(channel)
        if lock is None:
            return False
        try:
            row = await (await conn.execute(*lock)).fetchone()
        except psycopg.DatabaseError as exc:
            row = exc
        return self._tried(channel, row)

    def hold(self, channel: str) -> bool:
        if channel in self._held or self._presence is None or self._closed:
            return False
        return bool(await_only(self._ahold(channel)))

    async def _ahold(self, channel: str) -> bool:
        async with self._alock:
            conn = self._aconn
            if conn is None or conn.closed or channel not in self._waiters:
                return False
            self._unwatch()
            try:
                return await self._ahold_on(conn, channel)
            except psycopg.Error:
                return False  # broken: the reader sees it and wakes every waiter
            finally:
                self._watch()

    def _release_later(self) -> None:
        loop = self._loop
        if loop is not None and not self._closed:
            loop.call_later(LINGER + 0.01, lambda: asyncio.ensure_future(self._arelease_idle()))

    async def _arelease_idle(self) -> None:
        """:meth:`NotifyHub._release_idle` on the asyncio connection."""
        async with self._alock:
            conn = self._aconn
            if conn is None or conn.closed or self._presence is None:
                return
            now = time.monotonic()
            due = [c for c, since in self._idle.items() if now - since >= LINGER]
            if not due:
                return
            self._unwatch()
            try:
                for channel in due:
                    del self._idle[channel]
                    lock = self._presence(channel)
                    if lock is not None:
                        await conn.execute(lock[1], lock[2])
                        self._held.discard(channel)
            except psycopg.Error:
                return  # broken: the reader sees it
            finally:
                self._watch()

    def _watch(self) -> None:
        conn, loop = self._aconn, self._loop
        if conn is not None and loop is not None and self._fd is None:
            self._fd = conn.fileno()
            loop.add_reader(self._fd, self._readable)

    def _unwatch(self) -> None:
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None

    def _readable(self) -> None:
        conn = self._aconn
        if conn is None:
            self._unwatch()
            return
        channels: list[str] = []
        try:
            conn.pgconn.consume_input()
            while pgn := conn.pgconn.notifies():
                channels.append(pgn.relname.decode())
        except (psycopg.Error, OSError) as exc:
            log.info("dbqueue: the listening connection broke (%s); waiters poll until one reconnects", exc)
            self._drop_async()
            self._wake_all()
            return
        for channel in channels:
            self.wake_one(channel)

    def _drop_async(self) -> None:
        self._unwatch()
        conn, self._aconn = self._aconn, None
        self._listening.clear()
        self._held.clear()
        self._idle.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    async def aclose(self) -> None:
        self._closed = True
        self._unwatch()
        conn, self._aconn = self._aconn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
        self._wake_all()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
