"""Stateful property-based test: one table-design queue against a plain Python model.

Hypothesis drives random sequences of pushes, pops under all three semantics, acks, nacks, lease
expiries (a "clock jump": ``lease_until`` rewritten into the past), stale receipts, exactly-once pops
committed or rolled back, and failed-message administration. After every step the queue's stats,
``peek`` order, ``count_ready``, ``list_failed`` and the raw rows (every message in exactly one
place) must equal the model.

``KeyedQueueMachine`` runs the same rules on a queue created with a time to live and
``ordering="per_key"``, with pushes that carry ordering keys and deduplication keys, and rules that let
messages expire (their ``meta_opt.expires_at`` rewritten into the past) and sweep them; its model hands
out only the head of each key and no expired message, and answers a known deduplication key with its first id.

Model order. A ready message is ordered by ``(-priority, process_at, id)``. Every delay here is 0, so
``process_at`` is ``now()`` of the statement that last made the message ready (push, nack with
delay 0, requeue_failed); lease reclaim keeps it. PostgreSQL's ``now()`` is the transaction start
time: the messages of one statement share it (ids break the tie) and later statements get later
times. So the model keeps a "tick" per ready-making statement and orders by ``(-priority, tick, id)``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

from airflow_dbqueue.engine import LeaseExpiredError, TransactionRequiredError
from tests.dialects import expire_leases

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message, Queue

pytestmark = pytest.mark.integration

PRIORITIES = (-3, 0, 7)
VISIBILITY_TIMEOUT = 600.0  # leases never run out by themselves during a run; expiry is a clock jump

READY, HELD, FAILED, FINISHED, DELETED = "ready", "held", "failed", "finished", "deleted"
_META_STATE = {READY: 0, HELD: 1, FAILED: 2}
_DONE_OUTCOME = {FINISHED: 1, DELETED: 2}

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclasses.dataclass
class Entry:
    """The model's view of one message."""

    id: int
    payload: int | str
    priority: int
    tick: int
    """Order of the statement that last set ``process_at``."""
    attempts: int = 0
    state: str = READY
    lease: Message | None = None
    """The current delivery while HELD."""
    expired: bool = False
    """HELD, but the lease has run out and nobody reclaimed it yet."""
    deliveries: int = 0
    """Hand-outs so far (a receipt's delivery); never reset."""
    key: str | None = None
    """Its ordering key (KeyedQueueMachine)."""
    past_ttl: bool = False
    """Its time to live has passed and no sweep has moved it yet (KeyedQueueMachine)."""
    failed_by_expiry: bool = False
    """FAILED by the expiry sweep (last_error "expired")."""


class _Rollback(Exception):
    """Raised inside ``dbq.transaction()`` to roll an exactly-once pop back."""


class QueueMachine(RuleBasedStateMachine):
    """One queue of the table design against the model; a fresh queue per example."""

    dbq: ClassVar[DbQueue]
    admin: ClassVar[psycopg.Connection[Any]]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: Queue | None = None
        self.max_attempts = 0
        self.archive = True
        self.entries: dict[int, Entry] = {}
        self.tick = 0
        self.payloads = itertools.count()
        self.once: set[int] = set()
        """Ids delivered under at-most-once or committed exactly-once: never to be delivered again."""
        self.stale: list[Message] = []
        """Deliveries whose receipt is no longer valid (acked, nacked, reclaimed, taken)."""

    # -- model helpers ---------------------------------------------------------------------------------

    def _in(self, state: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == state]

    def ready_order(self) -> list[Entry]:
        return sorted(self._in(READY), key=lambda e: (-e.priority, e.tick, e.id))

    def live_leases(self) -> list[Entry]:
        return sorted((e for e in self._in(HELD) if not e.expired), key=lambda e: e.id)

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def model_reclaim(self) -> int:
        """What reclaim_expired does to the model: expired leases go back (keeping their tick) or fail."""
        moved = 0
        for e in self._in(HELD):
            if e.expired:
                assert e.lease is not None
                self.stale.append(e.lease)
                e.state = FAILED if e.attempts >= self.max_attempts else READY
                e.lease, e.expired = None, False
                moved += 1
        return moved

    def model_pop_upkeep(self) -> None:
        """What a pop does before it claims (reclaim_every = 0: on every pop): reclaim expired leases."""
        self.model_reclaim()

    def check_delivery(self, msgs: list[Message], expected: list[Entry], *, leased: bool) -> None:
        """Popped messages are exactly the model's first n ready ones, in order, never a taken one again."""
        assert [m.id for m in msgs] == [e.id for e in expected]
        again = {m.id for m in msgs} & self.once
        assert not again, f"delivered again after at-most-once/exactly-once delivery: {sorted(again)}"
        for m, e in zip(msgs, expected, strict=True):
            assert m.payload == e.payload
            assert m.priority == e.priority
            assert m.attempts == e.attempts + 1
            assert m.receipt == (e.id, e.deliveries + 1)
            assert m.queue == self.queue.name
            assert (m.lease_until is not None) == leased

    @property
    def queue(self) -> Queue:
        assert self.q is not None
        return self.q

    # -- setup -----------------------------------------------------------------------------------------

    @initialize(max_attempts=st.sampled_from([1, 2, 3]), archive=st.booleans())
    def create(self, max_attempts: int, archive: bool) -> None:
        self.max_attempts, self.archive = max_attempts, archive
        self.q = self.dbq.create_queue(
            f"q{next(self._names)}",
            max_attempts=max_attempts,
            visibility_timeout=VISIBILITY_TIMEOUT,
            retry_backoff=0.0,
            retry_backoff_max=0.0,
            archive=archive,
        )
        # An at-least-once pop reclaims expired leases first when this much time has passed since
        # its last reclaim; 0 makes that happen on every such pop, so the model can predict it.
        self.q.reclaim_every = 0.0

    # -- push ------------------------------------------------------------------------------------------

    @rule(
        priority=st.sampled_from(PRIORITIES), k=st.integers(1, 5), large=st.lists(st.booleans(), max_size=5)
    )
    def push(self, priority: int, k: int, large: list[bool]) -> None:
        # A payload over 1900 bytes (a large one) goes to data; a small one stays in its meta row.
        payloads: list[int | str] = [next(self.payloads) for _ in range(k)]
        for i, big in enumerate(large[:k]):
            if big:
                payloads[i] = f"{payloads[i]}:" + "x" * 2000
        if k == 1:
            ids = [self.queue.push(payloads[0], priority=priority)]
        else:
            ids = self.queue.push_batch(payloads, priority=priority)
        assert len(ids) == k
        assert ids == sorted(ids), "ids must follow payload order"
        assert not set(ids) & set(self.entries), "ids must be new"
        tick = self.next_tick()
        for i, p in zip(ids, payloads, strict=True):
            self.entries[i] = Entry(id=i, payload=p, priority=priority, tick=tick)

    # -- pop -------------------------------------------------------------------------------------------

    @precondition(lambda self: self._in(READY) or any(e.expired for e in self._in(HELD)))
    @rule(
        how=st.sampled_from(
            ["at-least-once", "at-most-once", "exactly-once/commit", "exactly-once/rollback", "at-least-once"]
        ),
        n=st.integers(1, 6),
    )
    def pop(self, how: str, n: int) -> None:
        if how == "at-least-once":
            self._pop_at_least_once(n)
        elif how == "at-most-once":
            self.model_pop_upkeep()  # reclaim_every = 0: every pop reclaims expired leases first
            expected = self.ready_order()[:n]
            msgs = self.queue.pop(n, semantics="at-most-once")
            self.check_delivery(msgs, expected, leased=False)
            self._taken(msgs, expected)
        else:
            self._pop_exactly_once(n, commit=how.endswith("/commit"))

    def _pop_at_least_once(self, n: int) -> None:
        self.model_pop_upkeep()  # reclaim_every = 0: the pop reclaims expired leases first
        expected = self.ready_order()[:n]
        msgs = self.queue.pop(n, semantics="at-least-once")
        self.check_delivery(msgs, expected, leased=True)
        for m, e in zip(msgs, expected, strict=True):
            e.state, e.attempts, e.lease, e.expired, e.deliveries = HELD, m.attempts, m, False, m.receipt[1]

    def _pop_exactly_once(self, n: int, *, commit: bool) -> None:
        with pytest.raises(TransactionRequiredError):
            self.queue.pop(n, semantics="exactly-once")  # no transaction given: refused, nothing taken
        # The pop reclaims expired leases first, in its own transaction: they come back with its
        # commit, and stay expired when it rolls back (the model changes only after a commit).
        before = {i: dataclasses.replace(e) for i, e in self.entries.items()}
        stale_before = len(self.stale)
        self.model_pop_upkeep()
        expected = self.ready_order()[:n]
        msgs: list[Message] = []
        try:
            with self.dbq.transaction() as conn:
                msgs = self.queue.pop(n, semantics="exactly-once", conn=conn)
                self.check_delivery(msgs, expected, leased=False)
                if not commit:
                    raise _Rollback
        except _Rollback:
            self.entries = before  # the model is as before: the invariants check everything is back
            del self.stale[stale_before:]
            return
        self._taken(msgs, expected)

    def _taken(self, msgs: list[Message], expected: list[Entry]) -> None:
        for m, e in zip(msgs, expected, strict=True):
            e.state = FINISHED
            self.once.add(m.id)
            self.stale.append(m)

    # -- finish ----------------------------------------------------------------------------------------

    def _pick_live(self, data: st.DataObject) -> list[Entry]:
        live = self.live_leases()
        return data.draw(
            st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique_by=lambda e: e.id)
        )

    @precondition(lambda self: self.live_leases())
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack"]))
    def finish(self, data: st.DataObject, op: str) -> None:
        chosen = self._pick_live(data)
        msgs = [e.lease for e in chosen if e.lease is not None]
        if op == "ack":
            assert self.queue.ack(msgs) == len(chosen)
        else:
            assert self.queue.nack(msgs, delay=0) == len(chosen)
        tick = self.next_tick()  # one statement: every retried message gets the same process_at
        for e in chosen:
            self.stale.append(e.lease)
            e.lease = None
            if op == "ack":
                e.state = FINISHED
            elif e.attempts >= self.max_attempts:
                e.state = FAILED  # keeps its process_at
            else:
                e.state, e.tick = READY, tick

    @precondition(lambda self: self.live_leases())
    @rule(data=st.data(), reclaim=st.booleans())
    def expire_leases(self, data: st.DataObject, reclaim: bool) -> None:
        chosen = self._pick_live(data)
        expire_leases(self.dbq, [e.id for e in chosen])
        for e in chosen:
            e.expired = True
        if reclaim:
            self.reclaim_expired()

    @precondition(lambda self: any(e.expired for e in self._in(HELD)))
    @rule()
    def reclaim_expired(self) -> None:
        expected = self.model_reclaim()
        assert self.queue.reclaim_expired() == expected

    def _stale_candidates(self) -> list[Message]:
        """Receipts that must be refused: old deliveries (also those from before a requeue_failed,
        which resets attempts but not the delivery count), and current ones whose lease ran out."""
        out = list(self.stale)
        out += [e.lease for e in self._in(HELD) if e.expired and e.lease is not None]
        return out

    @precondition(lambda self: self._stale_candidates())
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack"]), with_live=st.booleans())
    def finish_stale_receipt(self, data: st.DataObject, op: str, with_live: bool) -> None:
        candidates = self._stale_candidates()
        stale = data.draw(
            st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique_by=lambda m: m.id)
        )
        stale_ids = {m.id for m in stale}
        # All or nothing: a valid lease in the same call must not be finished either.
        live = [e.lease for e in self.live_leases() if e.id not in stale_ids]
        batch = list(stale)
        if with_live and live:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(live)))
        with pytest.raises(LeaseExpiredError) as info:
            if op == "ack":
                self.queue.ack(batch)
            else:
                self.queue.nack(batch, delay=0)
        assert set(info.value.ids) == stale_ids
        # Nothing changed: the invariants compare the whole queue with the unchanged model.

    # -- failed messages -------------------------------------------------------------------------------

    @precondition(lambda self: self._in(FAILED))
    @rule(data=st.data(), op=st.sampled_from(["requeue", "delete"]))
    def administer_failed(self, data: st.DataObject, op: str) -> None:
        ids: list[int] | None = None  # all failed messages
        if not data.draw(st.booleans(), label="all"):
            # Some failed messages mixed with messages in other states, which must be left alone.
            failed = sorted(e.id for e in self._in(FAILED))
            others = sorted(i for i, e in self.entries.items() if e.state != FAILED)
            ids = data.draw(st.lists(st.sampled_from(failed), min_size=1, unique=True), label="failed")
            if others:
                ids += data.draw(st.lists(st.sampled_from(others), max_size=3, unique=True), label="others")
        hit = [e for e in self._in(FAILED) if ids is None or e.id in ids]
        if op == "requeue":
            assert self.queue.requeue_failed(ids) == len(hit)
            tick = self.next_tick()
            for e in hit:  # a requeued message has no time to live any more
                e.state, e.attempts, e.tick, e.past_ttl, e.failed_by_expiry = READY, 0, tick, False, False
        else:
            assert self.queue.delete_failed(ids) == len(hit)
            for e in hit:
                e.state = DELETED

    # -- invariants ------------------------------------------------------------------------------------

    @invariant()
    def stats_match(self) -> None:
        if self.q is None:
            return
        s = self.q.stats()
        finished = len(self._in(FINISHED)) + len(self._in(DELETED)) if self.archive else 0
        assert (s.ready, s.delayed, s.in_flight, s.failed, s.finished) == (
            len(self._in(READY)),
            0,
            len(self._in(HELD)),
            len(self._in(FAILED)),
            finished,
        )
        assert (s.oldest_ready_age_s is None) == (s.ready == 0)

    @invariant()
    def ready_order_matches(self) -> None:
        if self.q is None:
            return
        order = self.ready_order()
        peeked = self.q.peek(len(order) + 1)
        assert [m.id for m in peeked] == [e.id for e in order]
        assert [(m.payload, m.priority, m.attempts) for m in peeked] == [
            (e.payload, e.priority, e.attempts) for e in order
        ]
        # count_ready counts what a pop could take: also expired leases with attempts left
        back = [e for e in self._in(HELD) if e.expired and e.attempts < self.max_attempts]
        assert self.q.count_ready() == len(order) + len(back)
        assert self.q.count_ready(min_priority=0) == sum(e.priority >= 0 for e in order + back)
        head = min(order + back, key=lambda e: (-e.priority, e.tick, e.id), default=None)
        ready, receipt = self.q.readiness()
        assert ready == len(order) + len(back)
        assert receipt == (None if head is None else (head.id, head.deliveries))

    @invariant()
    def failed_match(self) -> None:
        if self.q is None:
            return
        failed = sorted(self._in(FAILED), key=lambda e: e.id)
        listed = self.q.list_failed(limit=1000)
        assert [(f.id, f.payload, f.attempts) for f in listed] == [
            (e.id, e.payload, e.attempts) for e in failed
        ]

    @invariant()
    def every_message_in_exactly_one_place(self) -> None:
        if self.q is None:
            return
        row = self.admin.execute(
            sql.SQL(
                """SELECT
                    (SELECT coalesce(array_agg(ARRAY[id, state, attempts, (payload IS NOT NULL)::int,
                                                  (lease_until IS NOT NULL)::int]),
                                     '{{}}') FROM {s}.meta
                      WHERE queue_id = %(qid)s),
                    (SELECT coalesce(array_agg(ARRAY[id, outcome, (payload IS NOT NULL)::int]), '{{}}')
                      FROM {s}.done WHERE queue_id = %(qid)s),
                    (SELECT coalesce(array_agg(id), '{{}}') FROM {s}.data WHERE id = ANY(%(ids)s))"""
            ).format(s=sql.Identifier(self.dbq.schema)),
            {"qid": self.q.settings.queue_id, "ids": list(self.entries)},
        ).fetchone()
        assert row is not None
        meta_rows, done_rows, data_ids = row[0], row[1], set(row[2])
        meta = {r[0]: (r[1], r[2]) for r in meta_rows}
        done = {r[0]: r[1] for r in done_rows}
        inline = {r[0] for r in meta_rows if r[3]} | {r[0] for r in done_rows if r[2]}
        assert len(meta) == len(meta_rows) and len(done) == len(done_rows), "an id appears twice"
        assert not meta.keys() & done.keys(), "an id is both live and finished"
        # meta has no CHECK constraints: the engine keeps lease_until set exactly while a message is leased.
        assert all((r[1] == 1) == bool(r[4]) for r in meta_rows), "lease_until and state disagree"
        assert meta == {
            e.id: (_META_STATE[e.state], e.attempts) for e in self.entries.values() if e.state in _META_STATE
        }
        expected_done = (
            {e.id: _DONE_OUTCOME[e.state] for e in self.entries.values() if e.state in _DONE_OUTCOME}
            if self.archive
            else {}
        )
        assert done == expected_done
        # Payloads stay with live messages and with finished ones kept for the archiver, nowhere else:
        # each in its own row when small, in data when large, never in both.
        assert data_ids | inline == meta.keys() | done.keys()
        assert not data_ids & inline, "a payload both in its row and in data"
        assert inline == {i for i in meta.keys() | done.keys() if isinstance(self.entries[i].payload, int)}


def test_table_queue_matches_model(dbq: DbQueue, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        QueueMachine.dbq, QueueMachine.admin = dbq, admin
        try:
            run_state_machine_as_test(QueueMachine, settings=SETTINGS)
        finally:
            del QueueMachine.dbq, QueueMachine.admin


DEDUP_KEYS = ("d0", "d1", "d2", "d3", "d4", "d5")
KEYED_SETTINGS = settings(SETTINGS, max_examples=8, stateful_step_count=20)


class KeyedQueueMachine(QueueMachine):
    """The machine above on a queue with a ttl, ordered per key, whose pushes carry ordering keys (two
    keys and none) and deduplication keys (from a pool of six, so that pushes repeat them). A pop takes
    only each key's head (no earlier message of its key ready, expired or not, or leased) and no
    message whose ttl passed; each pop first sweeps those to failed (the queue has a ttl), as does the
    ``sweep`` rule; a known deduplication key pushes nothing and returns the first push's id."""

    def __init__(self) -> None:
        super().__init__()
        self.dedup: dict[str, int] = {}

    @initialize(
        max_attempts=st.sampled_from([1, 2, 3]),
        archive=st.booleans(),
        notify=st.sampled_from(["never", "auto"]),
    )
    def create(self, max_attempts: int, archive: bool, notify: str = "auto") -> None:  # type: ignore[override]
        # notify "never": a push without deduplication keys takes table_push_with()'s single INSERT
        self.max_attempts, self.archive = max_attempts, archive
        self.q = self.dbq.create_queue(
            f"k{next(self._names)}",
            notify=notify,
            max_attempts=max_attempts,
            visibility_timeout=VISIBILITY_TIMEOUT,
            retry_backoff=0.0,
            retry_backoff_max=0.0,
            archive=archive,
            ttl=3600,
            ordering="per_key",
        )
        self.q.reclaim_every = 0.0

    def ready_order(self) -> list[Entry]:
        holding = [e for e in self.entries.values() if e.state in (READY, HELD) and e.key is not None]
        return [
            e
            for e in super().ready_order()
            if not e.past_ttl and not any(o.key == e.key and o.id < e.id for o in holding)
        ]

    def model_sweep(self) -> int:
        swept = [e for e in self._in(READY) if e.past_ttl]
        for e in swept:
            e.state, e.past_ttl, e.failed_by_expiry = FAILED, False, True
        return len(swept)

    def model_pop_upkeep(self) -> None:
        self.model_reclaim()
        self.model_sweep()

    @rule(
        priority=st.sampled_from(PRIORITIES),
        keys=st.lists(st.sampled_from(["a", "b", None]), min_size=1, max_size=4),
        dedup=st.none() | st.lists(st.sampled_from(DEDUP_KEYS), min_size=4, max_size=4),
    )
    def push(self, priority: int, keys: list[str | None], dedup: list[str] | None) -> None:  # type: ignore[override]
        payloads: list[int | str] = [next(self.payloads) for _ in keys]
        dkeys = None if dedup is None else dedup[: len(keys)]
        ids = self.queue.push_batch(payloads, priority=priority, keys=keys, dedup_keys=dkeys)
        assert len(ids) == len(keys)
        tick = self.next_tick()
        new: list[int] = []
        for i, (got, p, key) in enumerate(zip(ids, payloads, keys, strict=True)):
            dkey = None if dkeys is None else dkeys[i]
            if dkey is not None and dkey in self.dedup:
                assert got == self.dedup[dkey], "a known deduplication key returns the first push's id"
                continue
            assert got not in self.entries, "ids must be new"
            new.append(got)
            self.entries[got] = Entry(id=got, payload=p, priority=priority, tick=tick, key=key)
            if dkey is not None:
                self.dedup[dkey] = got
        assert new == sorted(new), "new ids follow payload order"

    @precondition(lambda self: any(not e.past_ttl for e in self._in(READY)))
    @rule(data=st.data(), sweep=st.booleans())
    def pass_ttl(self, data: st.DataObject, sweep: bool) -> None:
        live = sorted((e for e in self._in(READY) if not e.past_ttl), key=lambda e: e.id)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique_by=lambda e: e.id))
        self.admin.execute(
            sql.SQL(
                "UPDATE {s}.meta_opt SET expires_at = now() - interval '1 s' WHERE id = ANY(%(ids)s)"
            ).format(s=sql.Identifier(self.dbq.schema)),
            {"ids": [e.id for e in chosen]},
        )
        for e in chosen:
            e.past_ttl = True
        if sweep:
            self.sweep()

    @precondition(lambda self: any(e.past_ttl for e in self._in(READY)))
    @rule()
    def sweep(self) -> None:
        expected = self.model_sweep()
        assert self.queue.expire_messages() == expected

    @invariant()
    def expired_counted(self) -> None:
        if self.q is None:
            return
        by_expiry = sum(e.failed_by_expiry for e in self._in(FAILED))
        assert self.q.stats().extra.get("expired", 0) == by_expiry
        expired = {f.id for f in self.q.list_failed(limit=1000) if f.last_error == "expired"}
        assert expired == {e.id for e in self._in(FAILED) if e.failed_by_expiry}


def test_keyed_queue_with_a_ttl_matches_model(dbq: DbQueue, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        KeyedQueueMachine.dbq, KeyedQueueMachine.admin = dbq, admin
        try:
            run_state_machine_as_test(KeyedQueueMachine, settings=KEYED_SETTINGS)
        finally:
            del KeyedQueueMachine.dbq, KeyedQueueMachine.admin


def test_receipt_from_before_requeue_is_refused(dbq: DbQueue) -> None:
    q = dbq.create_queue("requeued", max_attempts=1, retry_backoff=0.0, retry_backoff_max=0.0)
    q.push("x")
    [first] = q.pop(semantics="at-least-once")
    q.nack([first], delay=0)  # attempts 1 >= max_attempts 1: failed
    assert q.requeue_failed() == 1
    [second] = q.pop(semantics="at-least-once")
    assert second.id == first.id
    # The first consumer's receipt belongs to a finished delivery: it must not ack the second one.
    with pytest.raises(LeaseExpiredError):
        q.ack([first])
    assert q.ack([second]) == 1
