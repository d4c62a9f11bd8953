"""Stateful property-based test: deduplication keys on a ring of the rows layout, against a model.

Hypothesis interleaves pushes whose deduplication keys come from a small pool (so that they repeat,
across pushes and within one batch), pushes without keys, pushes in a caller's transaction that commit or
roll back, racing pushes (one in an open transaction, another in a thread that waits for it), pops under
every semantics, acks, nacks, lease expiries, the passing of time (the model's clock: every key's age
written into the ring's key table) and the upkeep, which forgets the keys older than the window; on a
ring large enough never to fill, or a small one that pushes fill (a rule fills it) and rotate, with a
ttl or without; retries push keys pushed before, into a ring that may be full.

What the model predicts, from the layout's rules (ring_rows.py): a push whose key was pushed within the
queue's ``dedup_window`` (by the model's clock) pushes nothing for it and returns the first push's id;
the batch's other keys (each once, at its first occurrence) are pushed as one row, in batch order, and
take the next row number; a push of known keys only takes none, and needs no room (it returns the ids
from a full ring too). A push that needs a row succeeds when the ring must have room (every message
finished, no gap) and otherwise succeeds or raises QueueFullError, pushing nothing, keeping no key and
taking no row number. A key a window old is taken over by the next push of it. A push that rolls back
spends its row number (a gap) and remembers no key; a push that waited for a racing push of its key gets
that push's id once it commits, and pushes once it rolled back. ``maintain()`` forgets exactly the keys
at least a window old. The key table holds exactly the model's keys and ids, the row sequence the model's
rows; every message delivered is one the model holds, with its payload and attempts, those due again
first in id order and each lane's in row order (and, on a large ring in an example without a gap, exactly
the messages the model takes); stats count ready, in flight, failed and the push and pop totals; and a
drain delivers exactly the model's messages, counted and checksummed.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from hypothesis import event, settings
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
from tests.dialects import run_sql
from tests.helpers import checksum
from tests.integration.test_dedup import rows_issued
from tests.integration.test_ring_stateful import (
    AGAIN,
    DONE,
    HELD,
    LANE,
    O_FAILED,
    ROWS_CAPACITY,
    SETTINGS,
    RowEntry,
    _Rollback,
    _RowsRing,
)

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message
    from airflow_dbqueue.engine.ring_rows import RowsRingQueue

pytestmark = pytest.mark.integration

# event(): labels of the cases the examples reach (a known key, a key taken over, a full ring, a race
# that waited...), for a run that counts them: hypothesis's statistics do not report a state machine run
# inside a test.

POOL = ["a", "b", "c", "d", "e"]
"""The deduplication keys the machine draws from: few, so that pushes repeat them."""
MAX_ROWS = ROWS_CAPACITY // 4 - 4
"""Row numbers an example issues at most on a large ring: every row stays in its first segment (no
rotation, so no push ever finds it full)."""
Keyed = dict[str, tuple[int, int]]
"""The model's keys: key -> (the id its first push made, the model's time of that push)."""


class RowsDedupMachine(_RowsRing, RuleBasedStateMachine):
    """A ring of the rows layout whose pushes carry deduplication keys, against a model of its keys, its
    rows and time (see the module)."""

    again, exhausted = AGAIN, O_FAILED
    dbq: ClassVar[DbQueue]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: RowsRingQueue | None = None
        self.lanes = 1
        self.small = False  # a ring of the least capacity for its lanes, which pushes fill and rotate
        self.full = False  # a push found the ring full, and nothing was popped since
        self.max_attempts = 3
        self.window = 60
        self.clock = 0
        self.next_row = 0
        self.gaps: set[int] = set()  # row numbers taken by pushes that rolled back
        self.keys: Keyed = {}
        self.entries: dict[int, RowEntry] = {}
        self.payloads = itertools.count()

    @property
    def queue(self) -> RowsRingQueue:
        assert self.q is not None
        return self.q

    def _in(self, *states: str) -> list[RowEntry]:
        return sorted((e for e in self.entries.values() if e.state in states), key=lambda e: e.id)

    @initialize(
        lanes=st.integers(1, 3),
        small=st.booleans(),
        max_attempts=st.sampled_from([1, 3]),
        window=st.sampled_from([30, 60]),
        ttl=st.sampled_from([None, 3600]),
    )
    def create(self, lanes: int, small: bool, max_attempts: int, window: int, ttl: int | None) -> None:
        """A ring large enough never to fill, or a small one that pushes fill (the least capacity for its
        lanes: four segments of two rows a lane); with a ttl (the keyed push's variant that writes each
        row's expiry; nothing expires within an example) or without."""
        self.lanes, self.small, self.max_attempts, self.window = lanes, small, max_attempts, window
        self._create("k", lanes, capacity=8 * lanes if small else ROWS_CAPACITY, ttl=ttl, dedup_window=window)

    # -- the model of a push -----------------------------------------------------------------------

    def _room(self, rows: int) -> bool:
        """Whether the example may take ``rows`` more row numbers (a large ring: within its first
        segment)."""
        return self.small or self.next_row + rows <= MAX_ROWS

    def _fits(self) -> bool:
        """Whether a push that needs a row must find room: on a large ring always; on a small one when
        every message pushed is finished and no push left a gap (every lane is then past every row, so
        the segment the row needs can be emptied). Otherwise a push may succeed or raise QueueFullError,
        having pushed nothing, kept no key and taken no row number."""
        if not self.small:
            return True
        return not self.gaps and all(e.state in (DONE, O_FAILED) for e in self.entries.values())

    def _plan(self, keys: list[str], known: Keyed, row: int) -> tuple[list[int], dict[str, int]]:
        """The ids a push of ``keys`` returns, given the keys ``known``, and the keys it pushes (each at
        its first occurrence, with its id in row ``row``): a key pushed less than a window ago returns
        its first push's id."""
        fresh: dict[str, int] = {}
        for k in keys:
            if k in fresh or (k in known and self.clock - known[k][1] < self.window):
                event("a known key" if k not in fresh else "a key repeated in its batch")
                continue
            if k in known:
                event("a key a window old, taken over")
            fresh[k] = (row << 16) | len(fresh)
        return [fresh[k] if k in fresh else known[k][0] for k in keys], fresh

    def _keyed_push(
        self, keys: list[str], known: Keyed, conn: Any = None, fits: bool | None = None
    ) -> tuple[dict[str, int], list[Any]] | None:
        """Push one payload a key (in ``conn``'s transaction when given), check the ids against the model
        (``known`` the keys the push sees) and take the row number when it pushes anything; return the
        keys it pushed with their ids, and the payloads by key; None when the ring was full (allowed
        only when it may be, ``fits`` or :meth:`_fits`, and the push needs a row: a push of known keys
        only needs none, and returns their ids from a full ring too)."""
        payloads = [next(self.payloads) for _ in keys]
        want, fresh = self._plan(keys, known, self.next_row)
        must = not fresh or (self._fits() if fits is None else fits)
        self.queue.push_timeout = 5.0 if must else 0.05
        try:
            if len(keys) == 1 and conn is None:
                got = [self.queue.push(payloads[0], dedup_key=keys[0])]
            else:
                got = self.queue.push_batch(payloads, dedup_keys=keys, conn=conn)
        except QueueFullError:
            assert not must, f"keys {keys} (known {known}): QueueFullError from a push that must fit"
            event("a keyed push found the ring full")
            self.full = True
            return None
        assert got == want, f"keys {keys} known {known} at {self.clock}: ids {got}, the model's {want}"
        if not fresh and not self._fits():
            event("a push of known keys into a ring that may be full")
            if self.full:
                event("a push of known keys into a full ring")
        if fresh:
            self.next_row += 1
            self.full = False
        return fresh, payloads

    def _remember(self, keys: list[str], payloads: list[Any], fresh: dict[str, int]) -> None:
        """A committed push: its keys are known from now, its new messages in their lane."""
        for k, p in zip(keys, payloads, strict=True):
            if k in fresh and fresh[k] not in self.entries:
                self.keys[k] = (fresh[k], self.clock)
                self.entries[fresh[k]] = RowEntry(fresh[k], p)

    # -- push --------------------------------------------------------------------------------------

    @precondition(lambda self: self.q is not None and self._room(1))
    @rule(keys=st.lists(st.sampled_from(POOL), min_size=1, max_size=4))
    def push(self, keys: list[str]) -> None:
        pushed = self._keyed_push(keys, self.keys)
        if pushed is not None:
            self._remember(keys, pushed[1], pushed[0])

    @precondition(lambda self: self.q is not None and self._room(1) and self.keys)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """A producer's retry: a push of keys pushed before (known, or a window old), into a ring that
        may be full."""
        self.push(data.draw(st.lists(st.sampled_from(sorted(self.keys)), min_size=1, max_size=3)))

    @precondition(lambda self: self.q is not None and self._room(1))
    @rule(k=st.integers(1, 3))
    def push_without_keys(self, k: int) -> None:
        payloads = [next(self.payloads) for _ in range(k)]
        r = self.next_row
        must = self._fits()
        self.queue.push_timeout = 5.0 if must else 0.05
        try:
            ids = self.queue.push_batch(payloads)
        except QueueFullError:
            assert not must, "QueueFullError from a push that must fit"
            self.full = True
            return
        assert ids == [(r << 16) | i for i in range(k)]
        self.next_row += 1
        self.full = False
        for i, p in enumerate(payloads):
            self.entries[(r << 16) | i] = RowEntry((r << 16) | i, p)

    @precondition(lambda self: self.q is not None and self.small and not self.full)
    @rule()
    def fill(self) -> None:
        """Push without keys until the small ring is full (it holds at most its capacity in rows): then
        a push that needs a row may not find room, and a retry of known keys still returns their ids."""
        for _ in range(8 * self.lanes + 1):
            self.push_without_keys(1)
            if self.full:
                return
        raise AssertionError(f"a ring of {8 * self.lanes} rows took {8 * self.lanes + 1} pushes")

    @precondition(lambda self: self.q is not None and self._room(2))
    @rule(
        pushes=st.lists(st.lists(st.sampled_from(POOL), min_size=1, max_size=3), min_size=1, max_size=2),
        commit=st.booleans(),
    )
    def push_in_transaction(self, pushes: list[list[str]], commit: bool) -> None:
        """Pushes in the caller's transaction: each sees the keys of those before it; a rollback keeps no
        key (a key it took over keeps its old push) and leaves the rows it took as gaps."""
        seen: Keyed = dict(self.keys)
        done: list[tuple[list[str], list[Any], dict[str, int]]] = []
        rows: list[int] = []
        fits = self._fits()  # the ring as the transaction found it (its own rows need no room)
        try:
            with self.dbq.transaction() as conn:
                self._write_ages(conn)  # one now() for the ages and the pushes
                for keys in pushes:
                    row = self.next_row
                    pushed = self._keyed_push(keys, seen, conn, fits)
                    if pushed is None:
                        continue  # a full ring: the transaction goes on without this push
                    fresh, payloads = pushed
                    if fresh:
                        rows.append(row)
                    seen.update({k: (i, self.clock) for k, i in fresh.items()})
                    done.append((keys, payloads, fresh))
                if not commit:
                    raise _Rollback
        except _Rollback:
            self.gaps.update(rows)
            return
        for keys, payloads, fresh in done:
            self._remember(keys, payloads, fresh)

    @precondition(lambda self: self.q is not None and self.next_row < MAX_ROWS - 2)
    @rule(
        first=st.lists(st.sampled_from(POOL), min_size=1, max_size=3),
        second=st.lists(st.sampled_from(POOL), min_size=1, max_size=3),
        commit=st.booleans(),
    )
    def race(self, first: list[str], second: list[str], commit: bool) -> None:
        """A push in an open transaction and a retry in another thread (its own transaction): a retry of
        a key the first push claimed (or saw) waits for it, then returns its ids if it committed, or
        pushes if it rolled back. The first took its row number before the retry started, so the retry's
        row, if any, is the next one. Into a full ring the retry does not wait on the key but looks for
        it until its push_timeout: it gets the first push's ids once that committed, and otherwise
        needs room as any push."""
        row = self.next_row
        got: list[list[int]] = []
        errors: list[BaseException] = []
        second_payloads = [next(self.payloads) for _ in second]

        def retry() -> None:
            try:
                got.append(self.queue.push_batch(second_payloads, dedup_keys=second))
            except BaseException as exc:  # reported by the test's thread
                errors.append(exc)

        t = threading.Thread(target=retry)
        try:
            with self.dbq.transaction() as conn:
                pushed = self._keyed_push(first, self.keys, conn)
                if pushed is None:
                    return  # a full ring
                fresh, payloads = pushed
                self.queue.push_timeout = 1.5  # the retry's: longer than the wait below
                t.start()
                self._wait_until_blocked_or_done(t)
                if not commit:
                    raise _Rollback
        except _Rollback:
            if fresh:
                self.gaps.add(row)
        else:
            self._remember(first, payloads, fresh)
        t.join(30)
        assert not t.is_alive()
        want, fresh2 = self._plan(second, self.keys, self.next_row)
        if errors:
            assert len(errors) == 1 and isinstance(errors[0], QueueFullError), errors
            assert fresh2 and not self._fits(), f"retry {second}: QueueFullError from a push that must fit"
            event("race: the retry found the ring full")
            return
        assert got == [want], f"retry {second} after {first} ({commit=}): {got}, the model's {want}"
        if fresh2:
            self.next_row += 1
        self._remember(second, second_payloads, fresh2)

    def _wait_until_blocked_or_done(self, t: threading.Thread) -> None:
        """Until the thread's push waits for a lock (on a key the open transaction holds) or is done (it
        shares no key): the outcome does not depend on it, only whether the race is run."""
        deadline = time.monotonic() + 0.3
        pattern = f"%ring_{self.queue.settings.queue_id}_rpushk%"
        while t.is_alive() and time.monotonic() < deadline:
            [(waiting,)] = run_sql(
                self.dbq,
                "SELECT count(*) FROM pg_catalog.pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE %(p)s",
                {"p": pattern},
            )
            if waiting:
                event("race: the retry waited")
                return
            t.join(0.005)

    # -- time and upkeep ---------------------------------------------------------------------------

    @precondition(lambda self: self.q is not None)
    @rule(dt=st.sampled_from([10, 30, 60]))
    def time_passes(self, dt: int) -> None:
        """The model's clock moves; every key's push time in the ring's key table is written to be its
        model age before the server's now(), so a key is a window old exactly when the model says."""
        self.clock += dt
        self._write_ages()

    def _write_ages(self, conn: Any = None) -> None:
        """Write every key's model age into the key table, before the server's now() (``conn``'s, in
        its transaction, when given: a push there then sees the ages exactly, window boundary included)."""
        if not self.keys:
            return
        run_sql(
            self.dbq,
            f"UPDATE {{schema}}.ring_{self.queue.settings.queue_id}_rkeys k "
            "SET pushed_at = now() - make_interval(secs => u.age) "
            "FROM unnest(%(keys)s::text[], %(ages)s::float8[]) u(k, age) WHERE k.dedup_key = u.k",
            {"keys": list(self.keys), "ages": [float(self.clock - t) for _, t in self.keys.values()]},
            conn,
        )

    @precondition(lambda self: self.q is not None)
    @rule(later=st.sampled_from([0, 30, 60]))
    def maintain(self, later: int) -> None:
        """The upkeep (``later`` seconds on) forgets exactly the keys a window old or older; a later push
        of one pushes again."""
        if later:
            self.time_passes(later)
        old = [k for k, (_, t) in self.keys.items() if self.clock - t >= self.window]
        report = self.queue.maintain()
        assert report["keys_forgotten"] == len(old), (report, old, self.keys, self.clock)
        assert report["reclaimed"] == 0
        for k in old:
            del self.keys[k]
        event("maintain forgot " + ("no key" if not old else "one key" if len(old) == 1 else "keys"))

    # -- pop ---------------------------------------------------------------------------------------

    def _predict(self, n: int) -> list[RowEntry] | None:
        """The messages a pop of n takes, as the layout takes them (messages due again first, in id
        order; then the lanes with messages, lowest position first, as many as it still wants, their
        rows in row order): None once the example left a gap, which stops its lane until a pop gives it
        up (when depends on the transactions running), and on a small ring, whose rows span more
        segments than a pop's scan."""
        if self.small or self.gaps:
            event("pop: with a gap")
            return None
        out = self._in(AGAIN)[:n]
        pending = self._in(LANE)
        heads: dict[int, int] = {}
        for e in pending:
            heads.setdefault((e.id >> 16) % self.lanes, e.id)
        locked = sorted(heads, key=lambda lane: heads[lane])[: n - len(out)]
        out += [e for e in pending if (e.id >> 16) % self.lanes in locked][: n - len(out)]
        return out

    def _check(self, msgs: list[Message], n: int, taken: set[int] | None = None) -> list[RowEntry]:
        """Check a pop of n against the model: each message one it holds ready, with its payload and
        attempts, those due again first (in id order) and each lane's in row order; return the entries
        (the states not changed yet). ``taken``: ids already taken in this drain."""
        assert len(msgs) <= n
        want = self._predict(n)
        if want is not None and taken is None:
            assert [m.id for m in msgs] == [e.id for e in want], "not the messages the model takes"
        out: list[RowEntry] = []
        for m in msgs:
            assert taken is None or m.id not in taken, f"message {m.id} delivered twice"
            e = self.entries.get(m.id)
            assert e is not None and e.state in (LANE, AGAIN), (
                f"message {m.id} delivered, not ready in the model"
            )
            assert (m.payload, m.attempts) == (e.payload, e.attempts + 1), (m, e)
            out.append(e)
        again = [e.id for e in self._in(AGAIN) if taken is None or e.id not in taken]
        assert [e.id for e in out[: len(again)]] == again[:n], "the messages due again first, in id order"
        lanes: dict[int, list[int]] = {}
        for e in self._in(LANE):
            if taken is None or e.id not in taken:
                lanes.setdefault((e.id >> 16) % self.lanes, []).append(e.id)
        for lane, ids in lanes.items():
            mine = [e.id for e in out if e.state == LANE and (e.id >> 16) % self.lanes == lane]
            assert mine == ids[: len(mine)], f"lane {lane}: {mine}, not its next rows {ids}"
        return out

    @precondition(lambda self: self.q is not None)
    @rule(
        how=st.sampled_from(["at-most-once", "at-least-once", "eo-commit", "eo-rollback"]),
        n=st.integers(1, 4),
    )
    def pop(self, how: str, n: int) -> None:
        if how.startswith("eo"):
            try:
                with self.dbq.transaction() as conn:
                    taken = self._check(self.queue.pop(n, semantics="exactly-once", conn=conn), n)
                    if how == "eo-rollback":
                        raise _Rollback
            except _Rollback:
                return
            for e in taken:
                e.state = DONE
            self.full = self.full and not taken  # a pop may make room
            return
        msgs = self.queue.pop(n, semantics=how)
        for m, e in zip(msgs, self._check(msgs, n), strict=True):
            e.attempts += 1
            e.state, e.lease = (HELD, m) if how == "at-least-once" else (DONE, None)
        self.full = self.full and not msgs

    @precondition(lambda self: self.q is not None)
    @rule()
    def drain(self) -> None:
        """Settle every lease, then pop until the model's messages are out (a gap may stop a lane for a
        while: until every transaction that ran when a pop found it has ended): exactly those, counted
        and checksummed, and nothing more."""
        held = self._in(HELD)
        if held:
            assert self.queue.ack([e.lease for e in held if e.lease is not None]) == len(held)
            for e in held:
                e.state, e.lease = DONE, None
        want = self._in(LANE, AGAIN)
        got: list[Message] = []
        taken: set[int] = set()
        deadline = time.monotonic() + 10.0
        while True:
            msgs = self.queue.pop(4)
            self._check(msgs, 4, taken)
            got += msgs
            taken.update(m.id for m in msgs)
            if len(got) >= len(want) or time.monotonic() > deadline:
                break
            if not msgs:
                event("drain: waited for a gap to be given up")
                time.sleep(0.01)
        got += self.queue.pop(4)  # nothing more
        assert sorted(m.id for m in got) == [e.id for e in want], (
            "the drain did not give the model's messages"
        )
        assert checksum(m.payload for m in got) == checksum(e.payload for e in want)
        for e in want:
            e.state = DONE
            e.attempts += 1
        self.full = False

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def keys_and_rows_match(self) -> None:
        """The key table holds exactly the model's keys with their first pushes' ids, and the ring issued
        exactly the model's row numbers (a push of known keys only takes none)."""
        if self.q is None:
            return
        rows = run_sql(
            self.dbq, f"SELECT dedup_key, id FROM {{schema}}.ring_{self.q.settings.queue_id}_rkeys"
        )
        assert dict(rows) == {k: i for k, (i, _) in self.keys.items()}
        assert rows_issued(self.dbq, self.q) == self.next_row

    @invariant()
    def stats_match(self) -> None:
        if self.q is None:
            return
        s = self.q.stats()
        assert (s.ready, s.delayed, s.in_flight, s.failed) == (
            len(self._in(LANE, AGAIN)),
            0,
            len(self._in(HELD)),
            len(self._in(O_FAILED)),
        )
        assert (s.extra["push_total"], s.extra["pop_total"]) == (
            len(self.entries),
            len(self._in(DONE, O_FAILED)),
        )
        assert [(f.id, f.payload) for f in self.q.list_failed(limit=1000)] == [
            (e.id, e.payload) for e in self._in(O_FAILED)
        ]


def test_rows_ring_dedup_keys_match_model(dbq: DbQueue) -> None:
    """(about 30 s, more on a loaded machine)"""
    RowsDedupMachine.dbq = dbq
    try:
        run_state_machine_as_test(
            RowsDedupMachine, settings=settings(SETTINGS, max_examples=25, stateful_step_count=30)
        )
    finally:
        del RowsDedupMachine.dbq
