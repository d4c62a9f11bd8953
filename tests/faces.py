"""The engine's two faces for the suites that run on both: the synchronous ``DbQueue`` and the asyncio
``AsyncDbQueue``, the latter seen through the synchronous interface.

:class:`AsyncFace` runs an event loop in a thread of its own; :class:`SyncView` calls an
``AsyncQueue`` (or ``AsyncDbQueue``) method by running its coroutine on that loop and waiting for its
result, so a test written against ``Queue`` drives the asyncio face unchanged, and a test's threads
become that loop's tasks. A caller's connection of the asyncio face is an ``AsyncConnection``: a test
that hands a synchronous one to the asyncio face is skipped there, saying which tests cover it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.aio import AsyncDbQueue, AsyncQueue

FACES = ["sync", "async"]

_T = TypeVar("_T")

CALLERS_CONNECTION_TESTS = "tests/integration/test_async_face.py (exactly once in an AsyncConnection)"


class AsyncFace:
    """An event loop in a thread of its own, and the ``AsyncDbQueue`` of a schema on it."""

    def __init__(self, dbq: DbQueue) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="async-face", daemon=True)
        self._thread.start()
        db = dbq.db
        self.adbq = AsyncDbQueue(
            db.dsn,
            schema=dbq.schema,
            pool_size=8,
            pooler=getattr(db, "pooler", None),
            listen_dsn=getattr(db, "listen_dsn", None),
        )

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        try:
            self.run(self.adbq.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def view(self, target: Any) -> Any:
        return SyncView(target, self)


class SyncView:
    """An ``AsyncQueue`` or ``AsyncDbQueue`` called as its synchronous twin (see the module)."""

    def __init__(self, target: Any, face: AsyncFace) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_face", face)

    def __getattr__(self, name: str) -> Any:
        target = self._target
        attr = getattr(target, name, None)
        if attr is None and isinstance(target, AsyncQueue):
            return getattr(target.handle, name)  # push_timeout, gap_timeout, reclaim_every, ...
        if attr is None:
            raise AttributeError(name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            conn = kwargs.get("conn")
            if isinstance(conn, psycopg.Connection):
                pytest.skip(f"the asyncio face takes an AsyncConnection as conn=: {CALLERS_CONNECTION_TESTS}")
            out = self._face.run(attr(*args, **kwargs))
            return self._face.view(out) if isinstance(out, AsyncQueue) else out

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        target = self._target
        setattr(target.handle if isinstance(target, AsyncQueue) else target, name, value)

    def __delattr__(self, name: str) -> None:
        target = self._target
        with contextlib.suppress(AttributeError):
            delattr(target.handle if isinstance(target, AsyncQueue) else target, name)

    def __repr__(self) -> str:
        return f"<SyncView {self._target!r}>"


def faced(request: pytest.FixtureRequest, dbq: DbQueue) -> Iterator[Any]:
    """``dbq`` itself (the synchronous face), or a :class:`SyncView` of an ``AsyncDbQueue`` on the same
    schema (the asyncio face), as ``request.param`` says; the asyncio face is PostgreSQL's."""
    if request.param == "sync":
        yield dbq
        return
    if dbq.dialect != "postgresql":
        pytest.skip(
            f"the asyncio face is PostgreSQL's; on {dbq.dialect} AsyncDbQueue raises NotSupportedError"
        )
    face = AsyncFace(dbq)
    try:
        yield face.view(face.adbq)
    finally:
        face.close()
