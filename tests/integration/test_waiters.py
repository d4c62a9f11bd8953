"""Many threads of one process waiting on one queue: one listening connection serves them all.

A waiting pop holds no pooled connection while it waits, so sixty waiters work on the default pool of
ten; a notification wakes one waiter (which passes the wake on once it took something), not all of
them; a push at any point of a waiter's registration, or one that sent no NOTIFY because it saw an
earlier message ready, still reaches a waiter before its poll; and no message waits for a poll after
the listening connection was killed. Every poll here is far longer than the test, so a message found
only by a poll shows as a pop that timed out or a latency of many seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.dialects.postgres import hub
from airflow_dbqueue.engine.queue import Queue
from tests.helpers import checksum, notified_so_far

pytestmark = pytest.mark.integration

WAITERS = 60
MESSAGES = 150
POLL_S = 60.0
"""The waiters' poll: far longer than the test, so a message found only by a poll would be late by
tens of seconds."""
PROMPT_S = 5.0
"""The most a message may wait for a waiter here (on a loaded machine): a twelfth of the poll."""


class Wakes:
    """Counts the waits that a wake ended (Waiter.wait returned True)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._lock = threading.Lock()
        real_wait = hub.Waiter.wait

        def counting_wait(waiter: hub.Waiter, timeout: float) -> bool:
            got = real_wait(waiter, timeout)
            if got:
                with self._lock:
                    self.count += 1
            return got

        mp.setattr(hub.Waiter, "wait", counting_wait)


def _waiting(dbq: DbQueue) -> int:
    """How many pops of this DbQueue are registered with its listening connection now."""
    h = dbq.db._hub  # type: ignore[attr-defined]
    return 0 if h is None else sum(len(w) for w in h._waiters.values())


def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _run(dbq: DbQueue, q: Queue, wakes: Wakes, kill_listener_at: int | None = None) -> list[float]:
    """WAITERS threads popping one message at a time while one is pushed every 20 ms; return the
    latencies of the MESSAGES messages, each checked to arrive once."""
    got: list[Any] = []
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def waiter() -> None:
        try:
            while not stop.is_set():
                for m in q.pop(1, wait=5, poll_interval=POLL_S):
                    with lock:
                        got.append(m.payload)
                        latencies.append(time.time() - m.payload["at"])
        except Exception as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=waiter) for _ in range(WAITERS)]
    for t in threads:
        t.start()
    _until(lambda: _waiting(dbq) == WAITERS)
    sent = []
    for i in range(MESSAGES):
        if i == kill_listener_at:
            with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
                killed = c.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'airflow-dbqueue-listen'"
                ).fetchone()
            assert killed == (1,), "one listening connection serves every waiter"
        payload = {"i": i, "at": time.time()}
        q.push(payload)
        sent.append(payload)
        time.sleep(0.02)
    deadline = time.monotonic() + 20
    while len(got) < MESSAGES and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(got) == MESSAGES and checksum(got) == checksum(sent)
    assert max(latencies) < PROMPT_S, f"a message waited {max(latencies):.1f}s: it was found by a poll"
    return latencies


@pytest.mark.parametrize("design", ["table", "ring"])
def test_sixty_waiters_on_the_default_pool_get_every_message_once(default_dbq: DbQueue, design: str) -> None:
    """No error, every message once, none waited for a poll, and about two wakes a message (the
    NOTIFY's, and the one passed on), where waking every waiter would make sixty."""
    q = default_dbq.create_queue("q", design=design)  # notify="auto"
    with pytest.MonkeyPatch.context() as mp:
        wakes = Wakes(mp)
        _run(default_dbq, q, wakes)
    assert wakes.count <= 3 * MESSAGES, f"{wakes.count} wakes for {MESSAGES} messages"


def test_a_message_wakes_one_waiter_and_the_others_keep_their_wait(default_dbq: DbQueue) -> None:
    """One push into a queue that twenty pops wait on: one pop returns it; besides the wake of that
    pop, at most one other (the wake it passes on) looks and goes back to waiting, still registered."""
    q = default_dbq.create_queue("q")
    results: list[list[Any]] = []
    lock = threading.Lock()

    def waiter() -> None:
        got = [m.payload for m in q.pop(1, wait=15, poll_interval=POLL_S)]
        with lock:
            results.append(got)

    with pytest.MonkeyPatch.context() as mp:
        wakes = Wakes(mp)
        threads = [threading.Thread(target=waiter) for _ in range(20)]
        for t in threads:
            t.start()
        _until(lambda: _waiting(default_dbq) == 20)
        time.sleep(0.2)
        before = wakes.count
        q.push({"n": 1})
        _until(lambda: len(results) == 1)
        time.sleep(0.5)  # time for any other wake to show
        woken = wakes.count - before
        still = _waiting(default_dbq)
        q.push_batch([{"n": k} for k in range(2, 21)])  # one NOTIFY; the wakes pass on to all 19
        for t in threads:
            t.join(20)
    assert results[0] == [{"n": 1}]
    assert 1 <= woken <= 2, f"{woken} waiters woken by one message"
    assert still == 19, "the waiters not handed the message are still waiting"
    assert sorted(r[0]["n"] for r in results) == list(range(1, 21))


@pytest.mark.parametrize("where", ["before it registers", "after it registers, before it looks"])
def test_a_push_at_a_waiters_registration_reaches_it_without_the_poll(
    default_dbq: DbQueue, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push between a pop's first look and its registration with the listening connection, or
    between the registration and its look: the pop returns the message long before its poll."""
    q = default_dbq.create_queue("q")
    pushed: list[int] = []

    def push_once() -> None:
        if not pushed:
            pushed.append(q.push({"n": 1}))

    if where == "before it registers":
        real_waiting = hub.NotifyHub.waiting

        def waiting(self: hub.NotifyHub, channel: str) -> Any:
            push_once()
            return real_waiting(self, channel)

        monkeypatch.setattr(hub.NotifyHub, "waiting", waiting)
    else:
        real_pushing = type(q)._pushing

        def pushing(self: Queue) -> bool:
            push_once()
            return real_pushing(self)

        monkeypatch.setattr(type(q), "_pushing", pushing)
    start = time.monotonic()
    got = q.pop(1, wait=10, poll_interval=POLL_S)
    took = time.monotonic() - start
    assert pushed and [m.payload for m in got] == [{"n": 1}]
    assert took < PROMPT_S


@pytest.mark.parametrize("design", ["table", "ring"])
def test_a_push_that_saw_an_earlier_message_ready_still_reaches_a_waiter(
    default_dbq: DbQueue, design: str
) -> None:
    """notify="auto": a push (in a transaction of its caller) sees message 1 ready and sends no NOTIFY;
    message 1 is popped before that push commits, and a pop then waits. It finds message 2 once the
    push commits, long before its poll, because it saw a push in progress when it looked."""
    q = default_dbq.create_queue("q", design=design)
    q.push({"n": 1})
    got: list[Any] = []
    took: list[float] = []

    def waiter() -> None:
        start = time.monotonic()
        got.extend(m.payload for m in q.pop(1, wait=10, poll_interval=POLL_S))
        took.append(time.monotonic() - start)

    with default_dbq.transaction() as c:
        q.push({"n": 2}, conn=c)
        assert [m.payload for m in q.pop(1)] == [{"n": 1}]
        t = threading.Thread(target=waiter)
        t.start()
        _until(lambda: _waiting(default_dbq) == 1)
        time.sleep(0.5)  # the waiter has looked, and waits
    t.join(20)
    assert got == [{"n": 2}]
    assert took[0] < PROMPT_S, f"the pop took {took[0]:.1f}s: message 2 waited for the poll"


@pytest.mark.parametrize(("design", "notify"), [("table", "auto"), ("ring", "auto"), ("ring", "always")])
def test_waiters_go_on_after_the_listening_connection_is_killed(
    default_dbq: DbQueue, design: str, notify: str
) -> None:
    kw: dict[str, Any] = {"capacity": 500} if design == "ring" else {}
    q = default_dbq.create_queue("r", design=design, notify=notify, **kw)
    with pytest.MonkeyPatch.context() as mp:
        _run(default_dbq, q, Wakes(mp), kill_listener_at=MESSAGES // 2)


class Statements:
    """The names of the statements the DbQueue's database object runs (each still runs as it would)."""

    def __init__(self, dbq: DbQueue, mp: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        db = dbq.db
        for method in ("fetchone", "fetchall", "execute"):
            real = getattr(db, method)

            def recording(name: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                self.names.append(name)
                return _real(name, *args, **kwargs)

            mp.setattr(db, method, recording)


def test_an_idle_look_on_a_rows_ring_asks_and_does_not_pop(default_dbq: DbQueue) -> None:
    """A ring of the rows layout whose every message is taken: a waiting pop's looks are its question
    alone (ring_rows_ask), one statement, and it pops only at its first look, before it waits; a push
    then still reaches it at once (every lane was at or past the pushed row, so the push notified)."""
    q = default_dbq.create_queue("q", design="ring", layout="rows")
    sent = [{"n": k} for k in range(5)]
    for p in sent:
        q.push(p)
    got = [m.payload for _ in sent for m in q.pop(1)]
    assert got == sent
    q.reclaim_every = 3600.0  # no reclaim due in this test's looks
    with pytest.MonkeyPatch.context() as mp:
        statements = Statements(default_dbq, mp)
        assert q.pop(1, wait=1.0, poll_interval=0.2) == []
        idle = list(statements.names)
        statements.names.clear()
        found: list[Any] = []
        t = threading.Thread(target=lambda: found.extend(q.pop(1, wait=10, poll_interval=POLL_S)))
        t.start()
        _until(lambda: _waiting(default_dbq) == 1)
        time.sleep(0.3)  # the waiter has looked, and waits
        start = time.monotonic()
        q.push({"n": 5})
        t.join(20)
        took = time.monotonic() - start
    # The first look, before the pop registers with the listening connection: an empty pop (and its look
    # for gaps); then the poller's looks, every 0.2 s for 1 s, each the question alone.
    first_ask = idle.index("ring_rows_ask")
    assert idle[0] == "ring_rows_take_one" and set(idle[1:first_ask]) <= {"ring_rows_gaps"}, idle
    assert set(idle[first_ask:]) == {"ring_rows_ask"} and len(idle[first_ask:]) >= 4, idle
    assert [m.payload for m in found] == [{"n": 5}]
    assert took < PROMPT_S, f"the pop took {took:.1f}s: the push after an idle look waited for the poll"


def test_a_waiting_pop_on_a_rows_ring_still_reclaims_an_expired_lease(default_dbq: DbQueue) -> None:
    """A look that skips the pop still reclaims expired leases when the reclaim is due: a message whose
    lease ran out while a pop waits comes back to that pop, once (nothing is pushed meanwhile)."""
    q = default_dbq.create_queue("q", design="ring", layout="rows", visibility_timeout=1.0)
    q.push({"n": 1})
    [first] = q.pop(1, semantics="at-least-once")
    start = time.monotonic()
    again = q.pop(1, semantics="at-least-once", wait=15, poll_interval=0.2)
    took = time.monotonic() - start
    assert [(m.payload, m.delivery) for m in again] == [({"n": 1}, first.delivery + 1)]
    assert took < 5.0, f"the expired lease came back after {took:.1f}s"
    assert q.ack(again) == 1
    assert q.pop(1) == []


def test_a_waiting_pop_on_a_rows_ring_wakes_when_a_delayed_retry_comes_due(default_dbq: DbQueue) -> None:
    """A message nacked with a delay on a ring of the rows layout is found by a waiting pop when it comes
    due, not at the pop's poll: the waiter times its wait by the earliest message to deliver again (as
    the table design's waiters time theirs by the earliest delayed message). Nothing is pushed while it
    waits, so no NOTIFY can wake it. Every message is acked once, counted and checksummed."""
    q = default_dbq.create_queue("q", design="ring", layout="rows")
    sent = [{"n": k} for k in range(3)]
    q.push_batch(sent)
    first = q.pop(3, semantics="at-least-once")
    assert [m.payload for m in first] == sent
    assert q.ack(first[:2]) == 2
    delay, poll = 0.3, 2.0
    assert q.nack(first[2:], delay=delay) == 1
    start = time.monotonic()
    again = q.pop(1, semantics="at-least-once", wait=10, poll_interval=poll)
    took = time.monotonic() - start
    assert [(m.payload, m.delivery) for m in again] == [(sent[2], first[2].delivery + 1)]
    assert took < delay + 0.5 < poll, f"the retry due after {delay}s came after {took:.2f}s (poll {poll}s)"
    assert q.ack(again) == 1
    acked = [m.payload for m in [*first[:2], *again]]
    assert len(acked) == len(sent) and checksum(acked) == checksum(sent)
    assert q.pop(1) == []


def test_while_a_push_runs_one_waiter_of_a_rows_ring_looks_again_for_it(default_dbq: DbQueue) -> None:
    """Twenty pops wait on a ring of the rows layout while a push (in its caller's open transaction) has
    taken its row, and each is woken: each sees a push in progress and finds nothing. One of them (the
    newest to see it) looks again, backing off, and the others wait for a wake, so that half a second of
    it costs a few looks a waiter, not twenty waiters' backoffs. Once the push commits, a pop takes its
    message long before the poll, and every message arrives once, counted and checksummed."""
    q = default_dbq.create_queue("q", design="ring", layout="rows")
    waiters = 20
    got: list[Any] = []
    errors: list[str] = []
    lock = threading.Lock()

    def waiter() -> None:
        try:
            while True:
                msgs = q.pop(1, wait=30, poll_interval=POLL_S)
                with lock:
                    got.extend(m.payload for m in msgs)
                if any("stop" in m.payload for m in msgs):
                    return
        except Exception as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=waiter) for _ in range(waiters)]
    for t in threads:
        t.start()
    _until(lambda: _waiting(default_dbq) == waiters)
    time.sleep(0.3)  # every waiter has looked, and waits
    with pytest.MonkeyPatch.context() as mp:
        statements = Statements(default_dbq, mp)
        with default_dbq.transaction() as c:
            q.push({"n": 1}, conn=c)
            default_dbq.db._hub._wake_all()  # type: ignore[attr-defined]  # every waiter looks while the push runs
            time.sleep(0.6)
            during = list(statements.names)
        start = time.monotonic()
        _until(lambda: len(got) == 1, timeout=PROMPT_S)
        took = time.monotonic() - start
    stops = [{"stop": k} for k in range(waiters)]
    q.push_batch(stops)
    for t in threads:
        t.join(30)
    assert errors == []
    sent = [{"n": 1}, *stops]
    assert got[0] == {"n": 1} and len(got) == len(sent) and checksum(got) == checksum(sent)
    assert took < PROMPT_S
    asks = during.count("ring_rows_ask")
    assert waiters <= asks <= 3 * waiters, f"{asks} looks of {waiters} waiters while one push ran"


# -- a ring ordered per key: the settle that frees a lane wakes a waiter ------------------------------

ALO = "at-least-once"


def keyed_ring(dbq: DbQueue, **kw: Any) -> Queue:
    return dbq.create_queue(
        "k", design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key", max_attempts=5, **kw
    )


@pytest.mark.parametrize("settle", ["ack", "nack", "ack of the last message leased"])
def test_a_waiting_pop_on_a_ring_ordered_per_key_wakes_when_a_lane_is_freed(
    default_dbq: DbQueue, settle: str
) -> None:
    """Every lane with messages is held (a lease open: an ack, a nack, or a split lease's last message
    leased again to settle), so a pop waits, its poll a minute away, and no push comes. The ack or nack
    that frees the lane wakes it (a NOTIFY), and it takes the lane's run, in order. Counted and
    checksummed."""
    q = keyed_ring(default_dbq)
    sent = ["a1", "a2", "a3", "a4"]
    q.push_batch(sent, keys=["a"] * 4)
    first = q.pop(2 if settle.startswith("ack of") else 1, semantics=ALO)
    assert [m.payload for m in first] == sent[: len(first)]
    if len(first) == 2:
        assert q.ack(first[:1]) == 1  # splits the lease: a2 stays leased, and holds the lane
    got: list[Any] = []
    took: list[float] = []
    freed = [0.0]

    def waiter() -> None:
        msgs = q.pop(10, semantics=ALO, wait=30, poll_interval=POLL_S)
        took.append(time.monotonic() - freed[0])
        got.extend(msgs)

    with pytest.MonkeyPatch.context() as mp:
        wakes = Wakes(mp)
        t = threading.Thread(target=waiter)
        t.start()
        _until(lambda: _waiting(default_dbq) == 1)
        time.sleep(2.0)  # it has looked and found the lane held; its looks back off towards the poll
        assert not got
        before = wakes.count
        freed[0] = time.monotonic()
        if settle == "nack":
            assert q.nack(first, delay=0) == 1
        else:
            assert q.ack(first[-1:]) == 1
        t.join(30)
        woken = wakes.count - before
    again = settle == "nack"
    assert [(m.payload, m.delivery) for m in got] == [
        (p, 2 if again and p == "a1" else 1) for p in sent[len(first) - again :]
    ]
    assert woken >= 1, "the waiter was not woken: it found the lane at a look of its own"
    assert took[0] < PROMPT_S
    assert q.ack(got) == len(got)
    acked = [m.payload for m in first[: len(first) - again] + got]
    assert len(acked) == len(sent) and checksum(acked) == checksum(sent)
    assert q.pop(10) == []


def _notified(dbq: DbQueue, q: Queue, act: Callable[[], Any]) -> int:
    """How many notifications ``act`` sent on ``q``'s channel (read by a LISTEN of its own)."""
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        c.execute(f'LISTEN "{q.channel}"')
        act()
        return notified_so_far(c, dbq.db.dsn, q.channel)


def test_which_settles_of_a_ring_notify(default_dbq: DbQueue) -> None:
    """A ring without ordering per key: no ack or nack notifies (no lane is held past a pop's commit).
    Ordered per key: the ack or nack that frees a lane with something behind it notifies, once; one that
    frees a lane with nothing behind, or leaves it held (a nack's delay), does not; notify="never" never
    does. Every message is acked once in the end, counted and checksummed."""
    acked: dict[str, list[Any]] = {"p": [], "k": [], "n": []}

    def ack(h: Queue, msgs: list[Any]) -> Callable[[], Any]:
        def act() -> None:
            assert h.ack(msgs) == len(msgs)
            acked[h.name] += [m.payload for m in msgs]

        return act

    plain = default_dbq.create_queue("p", design="ring", layout="rows", capacity=64, lanes=4)
    plain.push_batch(["p1", "p2"])
    assert _notified(default_dbq, plain, ack(plain, plain.pop(1, semantics=ALO))) == 0  # a whole lease
    p2 = plain.pop(1, semantics=ALO)
    assert _notified(default_dbq, plain, lambda: plain.nack(p2, delay=0)) == 0
    assert _notified(default_dbq, plain, ack(plain, plain.pop(1, semantics=ALO))) == 0  # settled apart

    keyed = keyed_ring(default_dbq)
    keyed.push("k1", key="a")
    assert _notified(default_dbq, keyed, ack(keyed, keyed.pop(1, semantics=ALO))) == 0  # nothing behind it
    keyed.push_batch(["k2", "k3"], keys=["a", "a"])
    k2 = keyed.pop(1, semantics=ALO)
    # The nack runs between these two times (after _notified's connection and LISTEN): k2 is not due
    # before the first plus its delay, and is due by the second plus its delay.
    nacking = time.monotonic()
    assert _notified(default_dbq, keyed, lambda: keyed.nack(k2, delay=1.0)) == 0  # held: k2's delay
    due = time.monotonic() + 1.0
    assert keyed.pop(10, semantics=ALO) == [] or time.monotonic() >= nacking + 1.0
    time.sleep(max(0.0, due - time.monotonic()) + 0.05)
    run = keyed.pop(10, semantics=ALO)
    assert [(m.payload, m.delivery) for m in run] == [("k2", 2), ("k3", 1)]
    assert _notified(default_dbq, keyed, ack(keyed, run)) == 0  # settled apart, nothing behind
    keyed.push_batch(["k4", "k5"], keys=["a", "a"])
    assert _notified(default_dbq, keyed, ack(keyed, keyed.pop(1, semantics=ALO))) == 1  # k5 behind it
    k5 = keyed.pop(1, semantics=ALO)
    assert _notified(default_dbq, keyed, lambda: keyed.nack(k5, delay=0)) == 1  # due again at once
    assert _notified(default_dbq, keyed, ack(keyed, keyed.pop(1, semantics=ALO))) == 0

    never = default_dbq.create_queue(
        "n", design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key", notify="never"
    )
    never.push_batch(["n1", "n2"], keys=["a", "a"])
    assert _notified(default_dbq, never, ack(never, never.pop(1, semantics=ALO))) == 0
    ack(never, never.pop(1, semantics=ALO))()
    for h, want in ((plain, ["p1", "p2"]), (keyed, ["k1", "k2", "k3", "k4", "k5"]), (never, ["n1", "n2"])):
        assert sorted(acked[h.name]) == want and checksum(acked[h.name]) == checksum(want)
        assert h.pop(10) == []
