"""One listening connection for every waiting pop of a :class:`PostgresDatabase`.

One connection per database object LISTENs on each channel that somebody waits on (from the first
waiter of the channel until the hub closes), and a thread of its own reads the notifications and hands
each to **one** waiter of its channel, through an in-process event: a wait holds none of the pool's
connections, and a NOTIFY wakes one waiter, not all of them. A waiter that was woken and took messages
passes the wake on to the next waiter (:meth:`Waiter.pass_on`): a push of many messages sends one
NOTIFY, and the waiters take them a batch each, one after the other, instead of all at once or after
their poll. A wake given to a waiter that leaves without using it goes to the next one, so none is
lost. One waiter of each channel polls (:attr:`Waiter.polls`) as the fallback; the others wait for a
wake alone, so that many waiters do not each poll. Where a queue asks it, one waiter of each channel
(the newest that saw a push in progress, :meth:`Waiter.take_recheck`) looks again for that push, backing
off; the others that see one wait for a wake too.

While somebody waits on a channel the connection also holds that queue's waiters' lock shared
(``presence``: queries/table.sql's waiters_hold), taken after its LISTEN and before the first waiter's
look, and released when the channel has had no waiter for :data:`LINGER` seconds (a consumer that waits
pop after pop keeps it): a push with notify="auto" notifies while it is held, and asks nothing else
otherwise (table_push in functions.sql). The take is a try, so that the connection never waits behind
a push's transaction: a push that decided that nobody waits holds the lock exclusively until it commits,
and a waiter that could not take it tries again before each wait, looking again at once when it took it
(that push's rows are visible then).

The connection is a session of its own (``listen_dsn``, or the engine's DSN when it keeps sessions).
When it breaks, every waiter is woken to look at its queue again (a NOTIFY may have been missed), and
the next waiter that arrives connects anew (its locks went with the old session: it takes them again
before the waiters look); meanwhile every waiter polls.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

log = logging.getLogger(__name__)

#: Seconds a channel's waiters' lock stays held after its last waiter left: a consumer that waits pop after
#: pop registers once, not twice a pop; pushes in that time notify a channel nobody waits on.
LINGER = 1.0

#: A channel's waiters' lock: (the statement that tries it shared, the one that releases it, their
#: parameters), or None for a channel without one.
Presence = Callable[[str], "tuple[bytes, bytes, dict[str, Any]] | None"]


_refused: set[str] = set()


def unheld(channel: str, exc: Exception) -> None:
    """A waiters' lock the server refused (its lock table full: ``max_locks_per_transaction``): the
    channel's waiters wait unregistered, found by their poll, and pushes do not know they wait. Said
    once a channel and process; the waiters try it again before each wait."""
    if channel in _refused:
        return
    _refused.add(channel)
    log.warning(
        "dbqueue: the waiters' lock of %s was refused (%s): its waiting pops find messages by their poll "
        "until it is taken",
        channel,
        exc,
    )


class Waiter:
    """One waiting pop's place on a channel: :meth:`wait` returns when it was handed a notification,
    or after its timeout."""

    __slots__ = ("_event", "_hub", "channel")

    def __init__(self, hub: NotifyHub, channel: str) -> None:
        self._hub = hub
        self._event = threading.Event()
        self.channel = channel

    @property
    def polls(self) -> bool:
        """Whether this waiter polls its queue as the fallback of its channel's waiters in this process
        (the hub's one poller of the channel), or every waiter does, as while the listening connection
        is broken. The others wait for a wake alone: any wake reaches some waiter, which passes it on,
        so one poller a channel finds what a lost notification left as soon as all of them would."""
        hub = self._hub
        return hub.broken or hub._pollers.get(self.channel) is self

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; return True if a notification was handed to this waiter.

        When the listening connection broke since (every waiter was woken then), it is made again
        first; while that fails (the server is down), the wait is a poll."""
        if self._hub.broken:
            with contextlib.suppress(Exception):
                self._hub.relisten(self.channel)
        elif self._hub.hold(self.channel):
            return True  # registered only now: a push that held the lock committed rows to look at
        if timeout > 0:
            self._event.wait(timeout)
        got = self._event.is_set()
        self._event.clear()
        return got

    def wake(self) -> None:
        self._event.set()

    def take_recheck(self) -> None:
        """Take its channel's recheck: this waiter saw a push in progress (one that may send no NOTIFY)
        and looks again soon, backing off, while the other waiters of the channel that see one wait for
        a wake (:meth:`rechecks`). The newest such waiter holds it, so a push seen just now is looked
        for at the first pause, not at the end of an older waiter's grown one."""
        with self._hub._lock:
            self._hub._recheckers[self.channel] = self

    def rechecks(self) -> bool:
        """Whether this waiter still holds its channel's recheck (no newer waiter took it)."""
        return self._hub._recheckers.get(self.channel) is self

    def recheck_done(self) -> None:
        """Give up its channel's recheck, if it holds it: it saw no push in progress, or took something
        (and passes the wake on)."""
        with self._hub._lock:
            if self._hub._recheckers.get(self.channel) is self:
                del self._hub._recheckers[self.channel]

    def pass_on(self) -> None:
        """Hand a wake to another waiter of this channel: this one took messages, and more may be ready
        (a push of many sends one NOTIFY, and a push into a queue that was not empty none)."""
        self._hub.wake_one(self.channel, but=self)


class NotifyHub:
    """The listening connection of one database object and the waiters on its channels.

    :param connect: opens the connection to LISTEN on (autocommit, a session of its own).
    """

    #: What :meth:`waiting` yields (the asyncio face's hub yields waiters that suspend only their task).
    waiter_class: type[Waiter] = Waiter

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], presence: Presence | None = None
    ) -> None:
        self._connect = connect
        self._presence = presence
        self._held: set[str] = set()  # the channels whose waiters' lock the connection holds
        self._idle: dict[str, float] = {}  # of those, the ones nobody waits on: since when (monotonic)
        # Reentrant: a LISTEN (run under it) may deliver a notification that psycopg hands to
        # _on_notify in the same thread. The reader thread never takes it while it holds psycopg's lock.
        self._lock = threading.RLock()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        self._waiters: dict[str, collections.deque[Waiter]] = {}
        self._pollers: dict[str, Waiter] = {}  # the one waiter of each channel that polls
        self._recheckers: dict[str, Waiter] = {}  # the waiter of each channel that looks for a push seen
        self._listening: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False

    # -- waiters ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def waiting(self, channel: str) -> Any:
        """Yield a :class:`Waiter` on ``channel``, LISTENed to before this returns: a NOTIFY committed
        after that reaches it (or another waiter of the channel). Raises what connecting raises."""
        waiter = self.waiter_class(self, channel)
        with self._lock:
            self._waiters.setdefault(channel, collections.deque()).append(waiter)
            self._pollers.setdefault(channel, waiter)
            self._idle.pop(channel, None)
        try:
            self._listen(channel)
        except BaseException:
            self._leave(waiter)
            raise
        try:
            yield waiter
        finally:
            self._leave(waiter)

    def _leave(self, waiter: Waiter) -> None:
        successor = None
        with self._lock:
            queue = self._waiters.get(waiter.channel)
            if queue is not None:
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
                if not queue:
                    del self._waiters[waiter.channel]
                    if waiter.channel in self._held:
                        self._idle[waiter.channel] = time.monotonic()
                        self._release_later()
            if self._pollers.get(waiter.channel) is waiter:
                del self._pollers[waiter.channel]
                if queue:  # the longest waiter polls next; woken, it times its wait as a poller
                    successor = self._pollers[waiter.channel] = queue[0]
            rechecked = self._recheckers.get(waiter.channel) is waiter
            if rechecked:
                del self._recheckers[waiter.channel]
        if waiter._event.is_set() or rechecked:  # a wake it did not use, or its recheck, goes to another
            self.wake_one(waiter.channel)
        if successor is not None:
            successor.wake()

    def wake_one(self, channel: str, but: Waiter | None = None) -> None:
        """Hand a notification of ``channel`` to the waiter that has waited longest (``but`` aside) and
        has no wake pending; it moves to the back of the line. The channel's poller gets it only when no
        other waiter is free, so that it stays in its wait and goes on polling."""
        with self._lock:
            queue = self._waiters.get(channel)
            if not queue:
                return
            poller = self._pollers.get(channel)
            for _ in range(len(queue)):
                w = queue.popleft()
                queue.append(w)
                if w is not but and w is not poller and not w._event.is_set():
                    w.wake()
                    return
            if poller is not None and poller is not but and not poller._event.is_set():
                poller.wake()

    def _wake_all(self) -> None:
        with self._lock:
            waiters = [w for q in self._waiters.values() for w in q]
        for w in waiters:
            w.wake()

    # -- the connection --------------------------------------------------------------------------

    @property
    def broken(self) -> bool:
        """Whether there is no listening connection while somebody waits (it broke)."""
        return self._conn is None and not self._closed

    def relisten(self, channel: str) -> None:
        """Make the listening connection again (LISTENing on every channel waited on)."""
        self._listen(channel)

    def _listen(self, channel: str) -> None:
        """LISTEN on ``channel`` (connecting first when there is no connection, or it broke)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the notification hub is closed")
            try:
                self._listen_on(self._connection(), channel)
            except psycopg.OperationalError:
                self._drop(self._conn)  # broken before the reader saw it: once more, on a new one
                self._listen_on(self._connection(), channel)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._read, args=(self._conn,), name="dbqueue-notify", daemon=True
                )
                self._thread.start()

    def _connection(self) -> psycopg.Connection[Any]:
        """The listening connection, made anew (LISTENing on every channel somebody waits on) when
        there is none. Under ``_lock``."""
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = self._connect()
            conn.add_notify_handler(self._on_notify)
            self._listening.clear()
            self._held.clear()  # a new session holds none of the old one's locks
            self._idle.clear()
            for channel in list(self._waiters):
                self._listen_on(conn, channel)
            os.write(self._wake_w, b"x")  # a reader still running switches to it
        return conn

    def _listen_on(self, conn: psycopg.Connection[Any], channel: str) -> None:
        if channel not in self._listening:
            # psycopg's lock: the reader thread holds it only while it reads what arrived
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            self._listening.add(channel)
        self._hold_on(conn, channel)

    def _lock_to_try(self, channel: str) -> tuple[bytes, dict[str, Any]] | None:
        """The statement that tries the channel's waiters' lock and its parameters, for either face's
        connection to run; None when the connection holds it already or the channel has none."""
        if channel in self._held or self._presence is None:
            return None
        lock = self._presence(channel)
        return None if lock is None else (lock[0], lock[2])

    def _tried(self, channel: str, row: Any) -> bool:
        """What a try of the channel's waiters' lock answered (its row, or the error it raised) means:
        whether it was taken now, the connection then holding it. A broken connection's error is raised
        again (the caller's to handle); one the server refused the lock with is said (:func:`unheld`)."""
        if isinstance(row, psycopg.OperationalError):
            raise row
        if isinstance(row, psycopg.DatabaseError):
            unheld(channel, row)
            return False
        if not (row and row[0]):
            return False
        self._held.add(channel)
        return True

    def _hold_on(self, conn: psycopg.Connection[Any], channel: str) -> bool:
        """Try the channel's waiters' lock on ``conn`` (after its LISTEN; under ``_lock``): whether it
        was taken now (False when held already, or a push holds it, or the channel has none)."""
        lock = self._lock_to_try(channel)
        if lock is None:
            return False
        try:
            row = conn.execute(*lock).fetchone()
        except psycopg.DatabaseError as exc:
            row = exc
        return self._tried(channel, row)

    def hold(self, channel: str) -> bool:
        """Take the channel's waiters' lock if the connection does not hold it yet (a push held it when
        it was tried): whether it was taken now, when the waiter that asks looks again at once."""
        if channel in self._held or self._presence is None:
            return False
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed or channel not in self._waiters:
                return False
            try:
                return self._hold_on(conn, channel)
            except psycopg.Error:
                return False  # broken: the reader sees it and wakes every waiter

    def _release_later(self) -> None:
        """A held channel has no waiter now: release its lock after :data:`LINGER` (the reader's)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _release_idle(self) -> float | None:
        """Release the waiters' locks of the channels nobody has waited on for :data:`LINGER` seconds;
        return the seconds until the next is due (None: none)."""
        with self._lock:
            if not self._idle:
                return None
            now = time.monotonic()
            conn = self._conn
            due = [c for c, since in self._idle.items() if now - since >= LINGER]
            for channel in due:
                del self._idle[channel]
                lock = self._presence(channel) if self._presence is not None else None
                if conn is None or conn.closed or lock is None:
                    continue
                try:
                    conn.execute(lock[1], lock[2])
                except psycopg.Error:
                    return None  # broken: the reader sees it
                self._held.discard(channel)
            if not self._idle:
                return None
            return max(0.0, min(self._idle.values()) + LINGER - now)

    def _drop(self, conn: psycopg.Connection[Any] | None) -> None:
        """Forget a broken connection (under ``_lock``)."""
        if conn is not None and self._conn is conn:
            self._conn = None
            self._listening.clear()
            self._held.clear()
            self._idle.clear()
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _on_notify(self, n: psycopg.Notify) -> None:
        self.wake_one(n.channel)

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        """Read notifications until the hub closes; on a broken connection, wake every waiter."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        registered = conn.fileno()
        poller.register(registered, select.POLLIN)
        due: float | None = None
        while True:
            try:
                events = poller.poll(None if due is None else int(due * 1000) + 1)
            except InterruptedError:
                continue
            due = self._release_idle()
            with self._lock:
                current = self._conn
                if self._closed or current is None:  # closed, or dropped and not made again
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
            if any(fd == self._wake_r for fd, _ in events):
                os.read(self._wake_r, 4096)
            if current is not conn:  # replaced after a break: read the new one
                with contextlib.suppress(KeyError, ValueError):
                    poller.unregister(registered)
                conn = current
                registered = conn.fileno()
                poller.register(registered, select.POLLIN)
                continue
            if not any(fd == registered for fd, _ in events):
                continue
            channels: list[str] = []
            try:
                with conn.lock:  # released before any waiter is woken (which takes _lock)
                    conn.pgconn.consume_input()
                    while pgn := conn.pgconn.notifies():
                        channels.append(pgn.relname.decode())
            except (psycopg.Error, OSError) as exc:
                log.info(
                    "dbqueue: the listening connection broke (%s); waiters poll until one reconnects", exc
                )
                self._wake_all()  # a NOTIFY may have been missed: every waiter looks again
                with self._lock:
                    self._drop(conn)
                continue  # the loop's top ends the reader, or reads a connection made meanwhile
            for channel in channels:
                self.wake_one(channel)

    def close(self) -> None:
        """Close the connection and end the reader; waiters still waiting are woken."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
            thread, self._thread = self._thread, None
        os.write(self._wake_w, b"x")
        if thread is not None:
            thread.join(5)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self._wake_all()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
