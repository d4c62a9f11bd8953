"""How one implementation of the queue designs serves both faces: the synchronous one (``DbQueue``) and
the asyncio one (``AsyncDbQueue``).

The designs (``table.py``, ``ring*.py``, ``queue.py``, ``client.py``) are written once, as plain
functions whose every wait is a call of their :class:`~airflow_dbqueue.engine.dialects.base.Database`
(a statement, a transaction's begin and end, a wait for a notification) or of :func:`pause`. Under the
synchronous face those calls block the calling thread. Under the asyncio face the same functions run in
a greenlet (:func:`run_sync`) on the event loop's thread, and their database is an asynchronous one
(``dialects/postgres/aio.py``) whose calls hand an awaitable to the event loop (:func:`await_only`)
and resume the function with its result: the loop runs other tasks meanwhile, and no thread waits.
SQLAlchemy's asyncio extension runs its ORM the same way.

Cancellation (``asyncio.CancelledError``: ``task.cancel()``, ``asyncio.timeout``, ``wait_for``) reaches
the function as an exception at the call it is waiting in, and unwinds it as any error does: a
transaction it opened rolls back, a connection goes back to its pool. A statement in flight is cancelled
on the server (:func:`statement`); when it finished before the cancel reached it, its result is handed
back to the function as usual and the cancellation is held until the function's next wait
(:func:`interruptible`) or its end, where :func:`run_sync` raises it after ``on_cancelled`` has undone
what can be undone (a pop's leases released). So a cancelled call never leaves half a statement behind,
and the caller learns of everything that committed in a call that returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import greenlet

_T = TypeVar("_T")


class _AsyncCall(greenlet.greenlet):  # type: ignore[misc]
    """The greenlet of one call of the asyncio face, run by :func:`run_sync` on the event loop."""

    def __init__(self, fn: Callable[[], Any], driver: greenlet.greenlet) -> None:
        super().__init__(fn, driver)
        self.driver = driver
        #: A cancellation arrived while a statement ran to its end: raised at the next wait, or at the end.
        self.cancelled = False


def in_async_call() -> bool:
    """Whether the caller runs under the asyncio face (in :func:`run_sync`'s greenlet)."""
    return isinstance(greenlet.getcurrent(), _AsyncCall)


def _current() -> _AsyncCall:
    current = greenlet.getcurrent()
    if not isinstance(current, _AsyncCall):
        raise RuntimeError("an asynchronous database was called outside AsyncDbQueue's calls")
    return current


def await_only(awaitable: Awaitable[_T]) -> _T:
    """Wait for ``awaitable`` on the event loop from a function run by :func:`run_sync`; return its
    result (or raise its exception, a cancellation among them)."""
    return _current().driver.switch(awaitable)  # type: ignore[no-any-return]


def interruptible(awaitable: Awaitable[_T]) -> _T:
    """:func:`await_only` for a wait that nothing is in flight during (a sleep, a wait for a
    notification): a cancellation held since a statement finished is raised here instead."""
    call = _current()
    if call.cancelled:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise asyncio.CancelledError
    return await_only(awaitable)


def hold_cancellation() -> None:
    """Note, in the current call, a cancellation that arrived while something ran to its end."""
    current = greenlet.getcurrent()
    if isinstance(current, _AsyncCall):
        current.cancelled = True


async def run_sync(
    fn: Callable[[], _T], *, on_cancelled: Callable[[_T], Awaitable[None]] | None = None
) -> _T:
    """Run ``fn`` (a function of the designs, with an asynchronous database) on the event loop; return
    what it returns. A cancellation held until its end is raised after ``on_cancelled`` of its result."""
    call = _AsyncCall(fn, greenlet.getcurrent())
    request = call.switch()
    while not call.dead:
        try:
            value = await request
        except BaseException as exc:  # handed to the function, which unwinds with it
            request = call.throw(exc)
        else:
            request = call.switch(value)
    result: _T = request
    if call.cancelled:
        if on_cancelled is not None:
            await on_cancelled(result)
        raise asyncio.CancelledError
    return result


async def shielded(awaitable: Awaitable[_T], call: _AsyncCall | None) -> _T:
    """Await ``awaitable`` to its end whatever cancellations arrive meanwhile (a COMMIT, a ROLLBACK: what
    is cut short there leaves an unknown state); a cancellation is then held in ``call``."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            out = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            cancelled = True
            if task.done():
                out = task.result()
                break
    if cancelled:
        if call is None:
            raise asyncio.CancelledError
        call.cancelled = True
    return out


def pause(seconds: float) -> None:
    """Sleep ``seconds``: the thread under the synchronous face, only the task under the asyncio face."""
    if isinstance(greenlet.getcurrent(), _AsyncCall):
        interruptible(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


class FaceLock:
    """A lock for a short section that may wait on the database: a thread's lock under the synchronous
    face, a task's under the asyncio face (a thread's lock held across a wait would block the event
    loop's other tasks, and the loop's thread, for ever)."""

    __slots__ = ("_async", "_thread")

    def __init__(self) -> None:
        self._thread = threading.Lock()
        self._async: asyncio.Lock | None = None

    def __enter__(self) -> None:
        if isinstance(greenlet.getcurrent(), _AsyncCall):
            if self._async is None:
                self._async = asyncio.Lock()
            await_only(self._async.acquire())
        else:
            self._thread.acquire()

    def __exit__(self, *exc: object) -> None:
        if isinstance(greenlet.getcurrent(), _AsyncCall):
            assert self._async is not None
            self._async.release()
        else:
            self._thread.release()


@contextlib.contextmanager
def entered(manager: contextlib.AbstractAsyncContextManager[_T], *, shield_exit: bool = True) -> Iterator[_T]:
    """Enter an asynchronous context manager from a function run by :func:`run_sync`; its exit (a
    commit, a rollback, a connection handed back) runs to its end whatever cancellations arrive."""
    call = _current()
    value = await_only(manager.__aenter__())
    try:
        yield value
    except BaseException as exc:
        exit_ = manager.__aexit__(type(exc), exc, exc.__traceback__)
        if not await_only(shielded(exit_, call) if shield_exit else exit_):
            raise
    else:
        exit_ = manager.__aexit__(None, None, None)
        await_only(shielded(exit_, call) if shield_exit else exit_)


async def agen_close(agen: AsyncIterator[Any]) -> None:
    """Close an async generator if it has an ``aclose``."""
    aclose = getattr(agen, "aclose", None)
    if aclose is not None:
        await aclose()
