"""LISTEN/NOTIFY on PostgreSQL: waiting pops (through the one listening connection of ``hub.py``), and
the async connections of observers (a trigger) that LISTEN and check readiness without a thread.

:class:`PostgresNotify` is a part of :class:`PostgresDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import sql

from airflow_dbqueue.engine.dialects.postgres.hub import NotifyHub, Waiter


class _Connections(Protocol):
    """What the notification part takes from the rest of :class:`PostgresDatabase`."""

    schema: str
    dsn: str
    listen_dsn: str | None
    transaction_pooled: bool

    def _notify_hub(self) -> NotifyHub: ...

    def connection(
        self, conn: psycopg.Connection[Any] | None = None
    ) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def translate_errors(self) -> AbstractContextManager[None]: ...

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> bytes: ...


if TYPE_CHECKING:  # the dialect's class supplies them
    _Base = _Connections
else:
    _Base = object


class PostgresNotify(_Base):
    """The LISTEN/NOTIFY part of :class:`PostgresDatabase` (see the module's docstring)."""

    supports_notify = True
    async_observers = True

    def channel(self, queue_id: int) -> str:
        """Return the NOTIFY channel of a queue (at most 63 bytes: schema names are at most 40)."""
        return f"dbq.{self.schema}.{queue_id}"

    @contextlib.contextmanager
    def listening(self, channel: str) -> Iterator[Waiter]:
        """Yield a :class:`~airflow_dbqueue.engine.dialects.postgres.hub.Waiter` on ``channel``: one
        listening connection serves every waiter of this object (``hub.py``), so a wait holds none of
        the pool's connections."""
        with contextlib.ExitStack() as stack:
            with self.translate_errors():
                waiter = stack.enter_context(self._notify_hub().waiting(channel))
            yield waiter

    async def aconnect(self, application_name: str) -> psycopg.AsyncConnection[Any]:
        """Open an async connection of its own to the database, in autocommit; the caller closes it.

        It goes to ``listen_dsn`` when one is given (it LISTENs); behind a transaction pooler without
        one it goes through the pooler, never prepares, and must not LISTEN (``supports_notify``)."""
        kwargs: dict[str, Any] = {"autocommit": True, "application_name": application_name}
        if self.listen_dsn is None and self.transaction_pooled:
            kwargs["prepare_threshold"] = None
        with self.translate_errors():
            return await psycopg.AsyncConnection.connect(self.listen_dsn or self.dsn, **kwargs)

    async def afetchone(
        self, aconn: psycopg.AsyncConnection[Any], name: str, params: Mapping[str, Any]
    ) -> tuple[Any, ...] | None:
        """Run the named query on the caller's async connection; return its first row (None: none)."""
        with self.translate_errors():
            cur = await aconn.execute(self.query(name), params)
            return await cur.fetchone()

    async def alisten(self, aconn: psycopg.AsyncConnection[Any], channel: str) -> None:
        """LISTEN on ``channel`` on the caller's async connection."""
        with self.translate_errors():
            await aconn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    async def anotifies(self, aconn: psycopg.AsyncConnection[Any], timeout: float | None) -> set[str]:
        """The channels of the next NOTIFY on ``aconn`` (and any that arrived with it), or none after
        ``timeout`` seconds (None: no limit)."""
        channels: set[str] = set()
        async for n in aconn.notifies(timeout=timeout, stop_after=1):
            channels.add(n.channel)
        return channels
