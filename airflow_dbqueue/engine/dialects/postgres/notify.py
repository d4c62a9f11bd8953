"""LISTEN/NOTIFY on PostgreSQL: waiting pops wait through the one listening connection of ``hub.py``
(the asyncio face's, ``aio.py``, through one of its own).

:class:`PostgresNotify` is a part of :class:`PostgresDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import psycopg

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
