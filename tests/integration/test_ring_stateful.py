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
from typing import TYPE_CHECKING, ClassVar

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


class RingMachine(RuleBasedStateMachine):
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
                e.state = FAILED if e.attempts >= self.max_attempts else READY

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
