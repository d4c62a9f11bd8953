"""Stateful property-based test: a small ring against a model, through wraps, gaps and leases.

Hypothesis interleaves pushes (committed, or rolled back after taking their numbers: gaps), pops under
all three semantics (exactly-once committed or rolled back), acks, nacks, lease expiries (a clock jump)
and drains, on rings of 2 to 6 slots, so that nearly every step wraps the ring or finds it full.

What must hold: ids are the push numbers in order (a rolled-back push spends its numbers); a pop
returns the lowest ready ids, in order, with their payloads, never a finished one; a push that fits
(every predecessor a capacity back is finished in the model, and below the ring's floor) succeeds,
and any push either succeeds or raises QueueFullError having pushed nothing (a push that took its
numbers leaves them as gaps); depth by state always matches; the floor is never above a message that
is ready or leased, and the slot of every such message still holds it (no push ever overwrote a
message a consumer still needs); and a drain after every lease is settled delivers every ready
message, so nothing is lost behind a gap.

It runs on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one (skipped
otherwise): the clock jump rewrites the leases' due times with each dialect's SQL (the conformance
suite's ``expire_leases``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, ClassVar

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

from airflow_dbqueue.engine import QueueFullError
from tests.dialects import dialect_dbq, expire_leases, run_sql  # noqa: F401 - dialect_dbq is the fixture "dbq"

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message
    from airflow_dbqueue.engine.ring import RingQueue
    from airflow_dbqueue.engine.ring_rows import RowsRingQueue

pytestmark = pytest.mark.integration

READY, HELD, DONE, FAILED = "ready", "held", "done", "failed"

SETTINGS = settings(
    max_examples=30, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclasses.dataclass
class Entry:
    id: int
    payload: int
    attempts: int = 0
    state: str = READY
    lease: Message | None = None


class _Rollback(Exception):
    pass


class _FinishesLeases:
    """The rule both ring models share: ack, nack (due again at once) or run out (then reclaim) some of
    the held leases; a message nacked or reclaimed goes to ``exhausted`` once it used its last attempt,
    to ``again`` otherwise (each model's state names). The models give it ``dbq``, ``q``, ``queue``,
    ``max_attempts`` and ``_in``."""

    again: ClassVar[str]
    exhausted: ClassVar[str]

    @precondition(lambda self: self.q is not None and self._in(HELD))
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "expire"]))
    def finish(self, data: st.DataObject, op: str) -> None:
        held = self._in(HELD)
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, unique_by=lambda e: e.id))
        msgs = [e.lease for e in chosen if e.lease is not None]
        if op == "ack":
            assert self.queue.ack(msgs) == len(chosen)
        elif op == "nack":
            assert self.queue.nack(msgs, delay=0) == len(chosen)
        else:
            expire_leases(self.dbq, [e.id for e in chosen], self.queue)
            assert self.queue.reclaim_expired() == len(chosen)
        for e in chosen:
            e.lease = None
            if op == "ack":
                e.state = DONE
            else:
                e.state = self.exhausted if e.attempts >= self.max_attempts else self.again


class _RowsRing(_FinishesLeases):
    """The models of a ring of the rows layout: one ring an example, made by :meth:`_create` and
    dropped as the example ends (its own tables). The models give it ``_names`` and ``max_attempts``."""

    def _create(self, prefix: str, lanes: int, **settings: Any) -> None:
        """The example's ring (``self.q``), with ``settings`` (its capacity, ordering, ttl...): retries
        due at once, leases that do not run out unless the test says so, and reclaim only when it says
        so."""
        self.q = self.dbq.create_queue(
            f"{prefix}{next(self._names)}",
            design="ring",
            layout="rows",
            lanes=lanes,
            max_attempts=self.max_attempts,
            visibility_timeout=600.0,
            retry_backoff=0.0,
            retry_backoff_max=0.0,
            **settings,
        )
        self.queue.reclaim_every = 3600.0
        self.queue._last_reclaim = float("inf")

    def teardown(self) -> None:
        if self.q is not None:
            self.dbq.drop_queue(self.q.name)


class RingMachine(_FinishesLeases, RuleBasedStateMachine):
    again, exhausted = READY, FAILED
    dbq: ClassVar[DbQueue]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: RingQueue | None = None
        self.cap = 0
        self.max_attempts = 0
        self.next_number = 1
        self.entries: dict[int, Entry] = {}
        self.gaps: set[int] = set()
        self.payloads = itertools.count()

    @property
    def queue(self) -> RingQueue:
        assert self.q is not None
        return self.q

    def _in(self, state: str) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.state == state), key=lambda e: e.id)

    @initialize(cap=st.integers(2, 6), max_attempts=st.sampled_from([1, 3]))
    def create(self, cap: int, max_attempts: int) -> None:
        self.cap, self.max_attempts = cap, max_attempts
        q = self.dbq.create_queue(
            f"r{next(self._names)}",
            design="ring",
            layout="slots",  # the model's: a capacity of slots (the rows layout's is test_ring_rows.py's)
            capacity=cap,
            max_attempts=max_attempts,
            visibility_timeout=600.0,
            retry_backoff=0.0,
            retry_backoff_max=0.0,
        )
        self.q = q  # type: ignore[assignment]
        self.queue.push_timeout = 0.05
        self.queue.reclaim_every = 3600.0  # reclaim only when the test says so

    # -- push --------------------------------------------------------------------------------------

    def _fits(self, k: int) -> bool:
        """Whether every predecessor (a capacity back) of the next k numbers is finished in the model
        and below the ring's floor: then the push must find room."""
        floor = self.queue.stats().extra["floor"]
        for x in range(self.next_number, self.next_number + k):
            prev = x - self.cap
            if prev >= 1 and not (prev in self.entries and self.entries[prev].state in (DONE, FAILED)):
                return False
            if prev >= floor:
                return False
        return True

    @precondition(lambda self: self.q is not None)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, self.cap))
        payloads = [next(self.payloads) for _ in range(k)]
        fits = self._fits(k)
        numbers = list(range(self.next_number, self.next_number + k))
        try:
            ids = self.queue.push_batch(payloads)
        except QueueFullError:
            assert not fits, "a push that fits raised QueueFullError"
            # A batch that finds the ring full before taking numbers takes none; a push of one takes
            # its number first, and a full ring leaves it a gap. Either all of the batch's numbers were
            # taken or none, and nothing was written.
            taken = self.queue.stats().extra["push_position"] - (self.next_number - 1)
            assert taken in (0, k), f"a failed push of {k} took {taken} numbers"
            self.gaps.update(numbers[:taken])
            self.next_number += taken
            return
        self.next_number += k
        assert ids == numbers, (ids, numbers)
        for i, p in zip(ids, payloads, strict=True):
            self.entries[i] = Entry(i, p)

    @precondition(lambda self: self.q is not None)
    @rule(k=st.integers(1, 2))
    def push_rolled_back(self, k: int) -> None:
        if not self._fits(k):
            return  # it could wait for the whole push timeout; the push rule covers full rings
        with pytest.raises(_Rollback), self.dbq.transaction() as conn:
            ids = self.queue.push_batch(list(range(k)), conn=conn)
            assert ids == list(range(self.next_number, self.next_number + k))
            raise _Rollback
        self.gaps.update(range(self.next_number, self.next_number + k))
        self.next_number += k

    # -- pop ---------------------------------------------------------------------------------------

    def _check_prefix(self, msgs: list[Message]) -> list[Entry]:
        ready = self._in(READY)
        assert [m.id for m in msgs] == [e.id for e in ready[: len(msgs)]], "not the lowest ready ids in order"
        for m, e in zip(msgs, ready, strict=False):
            assert (m.payload, m.attempts) == (e.payload, e.attempts + 1)
        return ready[: len(msgs)]

    @precondition(lambda self: self.q is not None)
    @rule(
        how=st.sampled_from(["at-most-once", "at-least-once", "eo-commit", "eo-rollback"]),
        n=st.integers(1, 4),
    )
    def pop(self, how: str, n: int) -> None:
        if how.startswith("eo"):
            try:
                with self.dbq.transaction() as conn:
                    msgs = self.queue.pop(n, semantics="exactly-once", conn=conn)
                    taken = self._check_prefix(msgs)
                    if how == "eo-rollback":
                        raise _Rollback
            except _Rollback:
                return
            for e in taken:
                e.state = DONE
            return
        msgs = self.queue.pop(n, semantics=how)
        taken = self._check_prefix(msgs)
        for m, e in zip(msgs, taken, strict=True):
            e.attempts += 1
            if how == "at-least-once":
                e.state, e.lease = HELD, m
            else:
                e.state = DONE

    # -- finish ------------------------------------------------------------------------------------

    @precondition(lambda self: self.q is not None)
    @rule()
    def drain(self) -> None:
        """Settle every lease, then pop until empty: every ready message comes out, in id order."""
        held = self._in(HELD)
        if held:
            assert self.queue.ack([e.lease for e in held if e.lease is not None]) == len(held)
            for e in held:
                e.state, e.lease = DONE, None
        want = [e.id for e in self._in(READY)]
        got: list[int] = []
        for _ in range(len(want) + 3):
            got += [m.id for m in self.queue.pop(self.cap)]
        assert got == want, "a ready message was not delivered (lost behind a gap?)"
        for i in got:
            self.entries[i].state = DONE
            self.entries[i].attempts += 1

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def depth_matches(self) -> None:
        if self.q is None:
            return
        s = self.q.stats()
        assert (s.ready, s.delayed, s.in_flight, s.failed) == (
            len(self._in(READY)),
            0,
            len(self._in(HELD)),
            len(self._in(FAILED)),
        )
        assert s.extra["push_position"] == self.next_number - 1
        needed = self._in(READY) + self._in(HELD)
        assert s.extra["floor"] <= min((e.id for e in needed), default=10**18)
        assert [(f.id, f.payload) for f in self.q.list_failed(limit=1000)] == [
            (e.id, e.payload) for e in self._in(FAILED)
        ]

    @invariant()
    def needed_messages_keep_their_slots(self) -> None:
        """No push overwrote a message that is ready or leased: its slot still holds it, payload too."""
        if self.q is None:
            return
        needed = self._in(READY) + self._in(HELD)
        if not needed:
            return
        rows = run_sql(
            self.dbq,
            "SELECT seq, payload FROM {schema}.ring_slots WHERE queue_id = %(q)s",
            {"q": self.q.settings.queue_id},
        )
        held = {int(seq): payload for seq, payload in rows}
        for e in needed:
            assert e.id in held, f"message {e.id} ({e.state}) was overwritten"
            assert self.q.settings.decode(bytes(held[e.id])) == e.payload, f"message {e.id}'s payload changed"


def test_ring_matches_model(dbq: DbQueue) -> None:
    RingMachine.dbq = dbq
    try:
        run_state_machine_as_test(RingMachine, settings=SETTINGS)
    finally:
        del RingMachine.dbq


class RingGroupsMachine(RingMachine):
    """The same ring with a second consumer group, "b", that pops at most once at its own pace, and is
    dropped and added again (start="now") now and then. What must hold besides the default group's
    properties: b's pops return its lowest messages not yet taken, in order, with their payloads; a push
    that fits only when b has passed the predecessor succeeds (and none overwrites a message b still
    needs: its slot holds it); after b is dropped, the default group alone holds the floor."""

    def __init__(self) -> None:
        super().__init__()
        self.b: RingQueue | None = None
        self.b_from = 1  # the first number b sees
        self.b_taken: set[int] = set()

    @initialize(cap=st.integers(2, 6), max_attempts=st.sampled_from([1, 3]))
    def create(self, cap: int, max_attempts: int) -> None:
        super().create(cap, max_attempts)
        self.b = self.queue.add_group("b")

    def _b_needs(self) -> list[Entry]:
        if self.b is None:
            return []
        return [self.entries[i] for i in sorted(self.entries) if i >= self.b_from and i not in self.b_taken]

    def _fits(self, k: int) -> bool:
        needs = {e.id for e in self._b_needs()}
        if any(x - self.cap in needs for x in range(self.next_number, self.next_number + k)):
            return False
        return super()._fits(k)

    @precondition(lambda self: self.b is not None)
    @rule(n=st.integers(1, 4))
    def pop_b(self, n: int) -> None:
        assert self.b is not None
        want = self._b_needs()
        msgs = self.b.pop(n)
        assert [m.id for m in msgs] == [e.id for e in want[: len(msgs)]], "b: not its lowest ids in order"
        assert [m.payload for m in msgs] == [e.payload for e in want[: len(msgs)]]
        self.b_taken.update(m.id for m in msgs)

    @precondition(lambda self: self.b is not None)
    @rule()
    def drain_b(self) -> None:
        assert self.b is not None
        want = [e.id for e in self._b_needs()]
        got: list[int] = []
        for _ in range(len(want) + 3):
            got += [m.id for m in self.b.pop(self.cap)]
        assert got == want, "b: a message was not delivered (lost behind a gap?)"
        self.b_taken.update(got)

    @precondition(lambda self: self.q is not None)
    @rule()
    def drop_or_add_b(self) -> None:
        if self.b is not None:
            assert self.queue.drop_group("b") is True
            self.b = None
        else:
            self.b = self.queue.add_group("b")
            self.b_from, self.b_taken = self.next_number, set()

    @invariant()
    def b_messages_keep_their_slots(self) -> None:
        """No push overwrote a message that b still needs, and the floor is at or below it."""
        needs = self._b_needs()
        if self.q is None or not needs:
            return
        assert self.q.stats().extra["floor"] <= needs[0].id
        rows = run_sql(
            self.dbq,
            "SELECT seq, payload FROM {schema}.ring_slots WHERE queue_id = %(q)s",
            {"q": self.q.settings.queue_id},
        )
        held = {int(seq): payload for seq, payload in rows}
        for e in needs:
            assert e.id in held, f"message {e.id}, which b still needs, was overwritten"
            assert self.q.settings.decode(bytes(held[e.id])) == e.payload


def test_ring_with_a_second_group_matches_model(dbq: DbQueue) -> None:
    """(about 20 s)"""
    RingGroupsMachine.dbq = dbq
    try:
        run_state_machine_as_test(
            RingGroupsMachine, settings=settings(SETTINGS, max_examples=20, stateful_step_count=30)
        )
    finally:
        del RingGroupsMachine.dbq


# -- the rows layout's expiry ------------------------------------------------------------------------

LANE, AGAIN, X_FAILED, O_FAILED, DROPPED = "lane", "again", "failed: expired", "failed: other", "dropped"
ROWS_CAPACITY = 400
"""Rows of the expiry machine's rings: a segment (a quarter) holds more rows than an example pushes, so
every row stays in the first segment and a pop's scan (two segments) sees them all."""
NEVER = 10**9


@dataclasses.dataclass
class RowEntry:
    id: int
    payload: int
    attempts: int = 0
    state: str = LANE
    lease: Message | None = None


class RowsExpiryMachine(_RowsRing, RuleBasedStateMachine):
    """A ring of the rows layout created with a ttl, against a model of its lanes and of time.

    Pushes carry a ttl of 30, 60 or 3600 s (or the queue's, 3600); the model's clock moves forward in
    steps, and each move writes every row's expiry relative to the server's clock (what is left of its
    ttl), so a row expires exactly when the model says. Pops (one and many, each semantics, exactly
    once committed or rolled back), acks, nacks, lease expiries with a reclaim, and requeues of the
    failed messages interleave, on 1 to 3 lanes, failing or dropping expired messages.

    What the model predicts, from the layout's rules: a pop serves messages due again first, in id
    order (one whose row expired fails as expired instead, or is dropped); then it locks the lanes with
    messages, lowest position first, as many as it still wants, and takes their rows in row order, each
    lane's contiguously, up to n; an expired row at a lane's head (nothing taken from the lane in this
    pop) is passed and its messages fail as expired (or are dropped); one behind a taken row stops the
    lane; a pop that passed expired rows and took nothing looks again. So every pop's ids and payloads
    are predicted exactly; stats count ready, in flight, failed, the failed by expiry and the expired
    no pop has reached; list_failed lists the failed with their last_error; a requeue pushes the failed
    again as one row without a ttl; and a drain delivers exactly the model's deliverable messages."""

    again, exhausted = AGAIN, O_FAILED
    dbq: ClassVar[DbQueue]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: RowsRingQueue | None = None
        self.lanes = 1
        self.max_attempts = 3
        self.drop = False
        self.clock = 0
        self.rows: list[list[RowEntry]] = []
        self.deadline: list[int] = []  # by row: the model's time it expires at
        self.payloads = itertools.count()

    @property
    def queue(self) -> RowsRingQueue:
        assert self.q is not None
        return self.q

    def _all(self) -> list[RowEntry]:
        return [e for row in self.rows for e in row]

    def _in(self, *states: str) -> list[RowEntry]:
        return sorted((e for e in self._all() if e.state in states), key=lambda e: e.id)

    def _expired(self, e: RowEntry) -> bool:
        return self.deadline[e.id >> 16] <= self.clock

    @initialize(lanes=st.integers(1, 3), max_attempts=st.sampled_from([1, 3]), drop=st.booleans())
    def create(self, lanes: int, max_attempts: int, drop: bool) -> None:
        self.lanes, self.max_attempts, self.drop = lanes, max_attempts, drop
        self._create("x", lanes, capacity=ROWS_CAPACITY, ttl=3600, on_expiry="drop" if drop else "fail")

    def _fail(self, e: RowEntry) -> None:
        e.state = DROPPED if self.drop else X_FAILED

    # -- push and time -----------------------------------------------------------------------------

    def _write_expiries(self) -> None:
        """Each row's expiry, what is left of its ttl from the server's now() (0: expires now)."""
        if not self.rows:
            return
        left = [float(min(d - self.clock, NEVER)) for d in self.deadline]
        for k in range(4):
            run_sql(
                self.dbq,
                f"UPDATE {{schema}}.ring_{self.queue.settings.queue_id}_rq{k} t "
                "SET expires_at = now() + make_interval(secs => u.s) "
                "FROM unnest(%(rows)s::bigint[], %(left)s::float8[]) u(r, s) WHERE t.r = u.r",
                {"rows": list(range(len(self.rows))), "left": left},
            )

    @precondition(lambda self: self.q is not None and len(self.rows) < ROWS_CAPACITY // 4 - 4)
    @rule(k=st.integers(1, 3), ttl=st.sampled_from([None, 30, 60, 3600]))
    def push(self, k: int, ttl: int | None) -> None:
        payloads = [next(self.payloads) for _ in range(k)]
        r = len(self.rows)
        ids = self.queue.push_batch(payloads, ttl=ttl)
        assert ids == [(r << 16) | i for i in range(k)]
        self.rows.append([RowEntry(i, p) for i, p in zip(ids, payloads, strict=True)])
        self.deadline.append(self.clock + (3600 if ttl is None else ttl))
        self._write_expiries()

    @precondition(lambda self: self.q is not None)
    @rule(dt=st.sampled_from([10, 30, 60]))
    def time_passes(self, dt: int) -> None:
        self.clock += dt
        self._write_expiries()

    # -- pop ---------------------------------------------------------------------------------------

    def _again(self, n: int) -> list[RowEntry]:
        """Messages due again, in id order, up to n; one whose row expired fails (or is dropped)."""
        out: list[RowEntry] = []
        for e in self._in(AGAIN):
            if len(out) >= n:
                break
            if self._expired(e):
                self._fail(e)
            else:
                out.append(e)
        return out

    def _lanes_once(
        self, pending: list[RowEntry], locked: list[int], left: int
    ) -> tuple[list[RowEntry], bool]:
        """One pass over the locked lanes' rows in row order: what it takes (up to left) and whether it
        passed an expired row."""
        out: list[RowEntry] = []
        took: set[int] = set()
        stopped: set[int] = set()
        passed = False
        for e in pending:
            lane = (e.id >> 16) % self.lanes
            if lane not in locked or lane in stopped:
                continue
            if not self._expired(e):
                took.add(lane)
                out.append(e)
                if len(out) == left:
                    break
            elif lane in took:  # behind a row taken: the lane stops
                stopped.add(lane)
            else:  # at the lane's head: passed
                self._fail(e)
                passed = True
        return out, passed

    def _predict(self, n: int) -> list[RowEntry]:
        """The pop of n as the model takes it (states changed here; the caller marks what it took)."""
        out = self._again(n)
        while len(out) < n:
            pending = self._in(LANE)
            heads: dict[int, int] = {}
            for e in pending:
                heads.setdefault((e.id >> 16) % self.lanes, e.id)
            locked = sorted(heads, key=lambda lane: heads[lane])[: n - len(out)]
            took, passed = self._lanes_once(pending, locked, n - len(out))
            out += took
            if took or not passed:
                break  # a pop that passed expired rows and took nothing looks again
        return out

    def _check(self, msgs: list[Message], want: list[RowEntry]) -> None:
        assert [m.id for m in msgs] == [e.id for e in want], "not the messages the model takes"
        assert [(m.payload, m.attempts) for m in msgs] == [(e.payload, e.attempts + 1) for e in want]

    @precondition(lambda self: self.q is not None)
    @rule(
        how=st.sampled_from(["at-most-once", "at-least-once", "eo-commit", "eo-rollback"]),
        n=st.integers(1, 4),
    )
    def pop(self, how: str, n: int) -> None:
        before = {e.id: e.state for e in self._all()}
        want = self._predict(n)
        if how.startswith("eo"):
            try:
                with self.dbq.transaction() as conn:
                    msgs = self.queue.pop(n, semantics="exactly-once", conn=conn)
                    self._check(msgs, want)
                    if how == "eo-rollback":
                        raise _Rollback
            except _Rollback:
                for e in self._all():  # nothing happened, expiries included
                    e.state = before[e.id]
                return
            for e in want:
                e.state = DONE
            return
        msgs = self.queue.pop(n, semantics=how)
        self._check(msgs, want)
        for m, e in zip(msgs, want, strict=True):
            e.attempts += 1
            if how == "at-least-once":
                e.state, e.lease = HELD, m
            else:
                e.state = DONE

    # -- finish ------------------------------------------------------------------------------------

    @precondition(lambda self: self.q is not None and len(self.rows) < ROWS_CAPACITY // 4 - 4)
    @rule()
    def requeue(self) -> None:
        """The failed messages, expired or not, pushed again as one row without a ttl (new ids)."""
        failed = self._in(X_FAILED, O_FAILED)
        assert self.queue.requeue_failed() == len(failed)
        for e in failed:
            e.state = DONE  # gone from ring_failed; its payload lives on in the new row
        if failed:
            r = len(self.rows)
            self.rows.append([RowEntry((r << 16) | i, e.payload) for i, e in enumerate(failed)])
            self.deadline.append(NEVER)
            self._write_expiries()

    @precondition(lambda self: self.q is not None)
    @rule()
    def drain(self) -> None:
        """Settle every lease, then pop until empty: exactly what the model can still deliver."""
        held = self._in(HELD)
        if held:
            assert self.queue.ack([e.lease for e in held if e.lease is not None]) == len(held)
            for e in held:
                e.state, e.lease = DONE, None
        got: list[Message] = []
        want: list[RowEntry] = []
        while batch := self._predict(4):
            want += batch
            for e in batch:
                e.state = DONE
        for _ in range(len(want) + 3):
            got += self.queue.pop(4)
        assert [(m.id, m.payload) for m in got] == [(e.id, e.payload) for e in want]

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def stats_and_failed_match(self) -> None:
        if self.q is None:
            return
        s = self.q.stats()
        waiting = self._in(LANE, AGAIN)
        live = [e for e in waiting if not self._expired(e)]
        assert (s.ready, s.delayed, s.in_flight, s.failed) == (
            len(live),
            0,
            len(self._in(HELD)),
            len(self._in(X_FAILED, O_FAILED)),
        )
        assert (s.extra["expired"], s.extra["expired_pending"]) == (
            len(self._in(X_FAILED)),
            len(waiting) - len(live),
        )
        failed = self.q.list_failed(limit=1000)
        assert [(f.id, f.payload) for f in failed] == [
            (e.id, e.payload) for e in self._in(X_FAILED, O_FAILED)
        ]
        assert [f.id for f in failed if f.last_error == "expired"] == [e.id for e in self._in(X_FAILED)]


def test_rows_ring_expiry_matches_model(dbq: DbQueue) -> None:
    """(about 30 s)"""
    RowsExpiryMachine.dbq = dbq
    try:
        run_state_machine_as_test(
            RowsExpiryMachine, settings=settings(SETTINGS, max_examples=30, stateful_step_count=30)
        )
    finally:
        del RowsExpiryMachine.dbq


# -- a ring of the rows layout ordered per key: keys -> lanes ---------------------------------------

KEYED_PUSHES = 64
"""Pushes a segment of the model's rings: a push takes a row a lane, so the capacity is 4 x 64 x lanes."""
KEYS_POOL = ["a", "b", "c", "d", "e"]


@dataclasses.dataclass
class KeyedEntry:
    id: int
    payload: int
    lane: int
    attempts: int = 0
    state: str = READY
    lease: Message | None = None


class RowsKeyedMachine(_RowsRing, RuleBasedStateMachine):
    """A ring of the rows layout ordered per key, against a model of its lanes.

    Pushes of one to three messages with ordering keys (or none) take a block of a row a lane: the ids
    are predicted exactly (a message's lane is its key's, ``lane_of``, or its place in the batch
    modulo the lanes for one without a key). Pops (one and many, each semantics, exactly once
    committed or rolled back), acks, nacks and lease expiries with a reclaim interleave on 1 to 4
    lanes. What the model predicts of every pop, from the ordering's rules: it takes nothing from a
    lane that holds a leased message; from every other lane it takes a prefix of the lane's waiting
    messages (those due again first, all in id order, as the lane had them), at most n in all, and
    something whenever some free lane has a message waiting; with n above everything waiting, every
    free lane's waiting messages. Stats count ready (the free lanes' waiting messages, what count_ready,
    readiness and peek show too), blocked (the held lanes'), in flight and failed; a drain after every
    lease is settled delivers exactly the model's waiting messages, each lane's in order."""

    again, exhausted = READY, FAILED
    dbq: ClassVar[DbQueue]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: RowsRingQueue | None = None
        self.lanes = 1
        self.max_attempts = 3
        self.pushes = 0
        self.entries: list[KeyedEntry] = []
        self.payloads = itertools.count()

    @property
    def queue(self) -> RowsRingQueue:
        assert self.q is not None
        return self.q

    def _in(self, *states: str) -> list[KeyedEntry]:
        return sorted((e for e in self.entries if e.state in states), key=lambda e: e.id)

    def _waiting(self, lane: int) -> list[KeyedEntry]:
        return [e for e in self._in(READY, HELD) if e.lane == lane]

    def _free(self, lane: int) -> bool:
        return not any(e.state == HELD for e in self._waiting(lane))

    @initialize(lanes=st.integers(1, 4), max_attempts=st.sampled_from([1, 3]))
    def create(self, lanes: int, max_attempts: int) -> None:
        self.lanes, self.max_attempts = lanes, max_attempts
        self._create("k", lanes, ordering="per_key", capacity=4 * KEYED_PUSHES * lanes)

    @precondition(lambda self: self.q is not None and self.pushes < KEYED_PUSHES)
    @rule(keys=st.lists(st.sampled_from([*KEYS_POOL, None]), min_size=1, max_size=3))
    def push(self, keys: list[str | None]) -> None:
        payloads = [next(self.payloads) for _ in keys]
        lanes = [i % self.lanes if k is None else self.queue.lane_of(k) for i, k in enumerate(keys)]
        ids = self.queue.push_batch(payloads, keys=keys)
        first = self.pushes * self.lanes
        want = [((first + lane) << 16) | lanes[:i].count(lane) for i, lane in enumerate(lanes)]
        assert ids == want
        self.pushes += 1
        self.entries += [KeyedEntry(i, p, lane) for i, p, lane in zip(ids, payloads, lanes, strict=True)]

    def _check(self, msgs: list[Message], n: int) -> list[KeyedEntry]:
        """The pop's messages against the model's rules (see the class); return their entries."""
        by_id = {e.id: e for e in self.entries}
        got = [by_id[m.id] for m in msgs]
        assert len(got) <= n
        assert [(m.payload, m.delivery) for m in msgs] == [(e.payload, e.attempts + 1) for e in got]
        for lane in {e.lane for e in got}:
            mine = [e for e in got if e.lane == lane]
            assert self._free(lane), f"lane {lane} was held"
            assert mine == self._waiting(lane)[: len(mine)], f"lane {lane}: not its head run in order"
        free_waiting = [e for lane in range(self.lanes) if self._free(lane) for e in self._waiting(lane)]
        assert got or not free_waiting, "a free lane had messages and the pop took none"
        if n >= len(free_waiting) + self.lanes:
            assert sorted(e.id for e in got) == sorted(e.id for e in free_waiting)
        return got

    @precondition(lambda self: self.q is not None)
    @rule(
        how=st.sampled_from(["at-most-once", "at-least-once", "eo-commit", "eo-rollback"]),
        n=st.sampled_from([1, 2, 3, 100]),
    )
    def pop(self, how: str, n: int) -> None:
        if how.startswith("eo"):
            try:
                with self.dbq.transaction() as conn:
                    got = self._check(self.queue.pop(n, semantics="exactly-once", conn=conn), n)
                    if how == "eo-rollback":
                        raise _Rollback
            except _Rollback:
                return  # nothing happened
            for e in got:
                e.attempts += 1
                e.state = DONE
            return
        msgs = self.queue.pop(n, semantics=how)
        got = self._check(msgs, n)
        for m, e in zip(msgs, got, strict=True):
            e.attempts += 1
            if how == "at-least-once":
                e.state, e.lease = HELD, m
            else:
                e.state = DONE

    @precondition(lambda self: self.q is not None)
    @rule()
    def drain(self) -> None:
        """Settle every lease, then pop until empty: exactly the model's waiting messages, each lane's
        in order, counted and checksummed."""
        held = self._in(HELD)
        if held:
            assert self.queue.ack([e.lease for e in held if e.lease is not None]) == len(held)
            for e in held:
                e.state, e.lease = DONE, None
        want = self._in(READY)
        got: list[Message] = []
        for _ in range(len(want) + 2):
            got += self.queue.pop(100)
        by_id = {e.id: e for e in self.entries}
        assert sorted(m.id for m in got) == [e.id for e in want]
        assert sum(m.payload for m in got) == sum(e.payload for e in want)
        for lane in range(self.lanes):
            assert [m.id for m in got if by_id[m.id].lane == lane] == [e.id for e in want if e.lane == lane]
        for e in want:
            e.state = DONE

    @invariant()
    def stats_match(self) -> None:
        """Stats: ready is what a pop could take now (the free lanes' waiting messages), blocked the
        waiting messages of held lanes. count_ready, readiness and peek count and show the former, in
        the order pops take them (those due again first, then the lanes', each by id)."""
        if self.q is None:
            return
        now = [e for e in self._in(READY) if self._free(e.lane)]
        s = self.q.stats()
        assert (s.ready, s.extra["blocked"], s.delayed, s.in_flight, s.failed) == (
            len(now),
            len(self._in(READY)) - len(now),
            0,
            len(self._in(HELD)),
            len(self._in(FAILED)),
        )
        order = sorted(now, key=lambda e: (e.attempts == 0, e.id))
        head = (order[0].id, order[0].attempts) if order else None
        assert self.q.readiness() == (len(now), head)
        assert [(m.id, m.payload, m.delivery) for m in self.q.peek(100)] == [
            (e.id, e.payload, e.attempts) for e in order
        ]


def test_rows_ring_ordered_per_key_matches_model(dbq: DbQueue) -> None:
    """(about 30 s)"""
    RowsKeyedMachine.dbq = dbq
    try:
        run_state_machine_as_test(
            RowsKeyedMachine, settings=settings(SETTINGS, max_examples=30, stateful_step_count=30)
        )
    finally:
        del RowsKeyedMachine.dbq
