"""The SQL Server ring's stored procedures run offline, on the T-SQL interpreter of tests/tsql.py.

No SQL Server can run here. These tests run ``ring_create``, ``ring_push``, ``ring_take``, ``ring_pop``,
``ring_pass``, ``ring_skip_gap``, ``ring_skip_abandoned``, ``ring_settle``, ``ring_add_group`` and
``ring_drop_group`` as the SQL Server ``functions.sql`` writes them, on tables held in memory, and check
what they do against what PostgreSQL's functions of the same names do (their comments in
``postgres/functions.sql``): lanes moved over given-up numbers, a take that runs past the end of the slots
taken in two parts, a pop of none, consumer groups holding the floor until dropped. The last tests
break the T-SQL on purpose, one change at a time, and check that the scenarios then fail.

What the interpreter leaves out is said in tests/tsql.py: no transactions, no concurrency (other
transactions are rows they hold locked), and ``ring_series`` computed directly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from airflow_dbqueue.engine.sqlfile import load_queries
from tests import tsql

Make = Callable[..., tsql.Ring]


def blocks() -> dict[str, str]:
    return tsql.schema_blocks()


def maker(text: Mapping[str, str] | None = None) -> Make:
    """Rings on a fresh server with the routines of ``text`` (the schema's blocks unless given)."""

    def make(**kw: Any) -> tsql.Ring:
        return tsql.Ring(tsql.ring_server(text or blocks()), **kw)

    return make


def ids(rows: list[tuple[Any, ...]]) -> list[int]:
    return [int(r[0]) for r in rows]


def fails(call: Callable[[], Any], number: int, match: str = "") -> tsql.TsqlError:
    """The error ``call`` raised, checked (an AssertionError otherwise: the checks below run on broken
    T-SQL too, where only AssertionError and the interpreter's errors count as failing)."""
    try:
        call()
    except tsql.TsqlError as exc:
        assert exc.number == number and re.search(match, exc.message), exc
        return exc
    raise AssertionError(f"no error {number}")


# -- the interpreter -------------------------------------------------------------------------------

PROBE = """-- name: probe
CREATE OR ALTER PROCEDURE [dbq].probe
    @lane int, @err int = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @t TABLE (k int PRIMARY KEY, a int NULL, b int NULL);
    DECLARE @x int = 5;
    DECLARE @swapped int;
    DECLARE @locked int = -1;
    DECLARE @past int;
    DECLARE @unknown int = 0;
    INSERT INTO @t (k, a, b) VALUES (1, 1, 2), (2, NULL, 4);
    UPDATE t SET a = t.b, b = t.a FROM @t t;
    SET @swapped = @@ROWCOUNT;
    SELECT @x = t.k FROM @t t WHERE t.k > 5;
    IF NULL = NULL OR NOT (NULL <> 1)
    BEGIN
        SET @unknown = 1;
    END;
    SELECT @past = count(*) FROM [dbq].ring_lanes l WITH (READCOMMITTEDLOCK, READPAST) WHERE l.lane >= @lane;
    BEGIN TRY
        SET LOCK_TIMEOUT 100;
        SELECT @locked = count(*) FROM [dbq].ring_lanes l WHERE l.lane >= @lane;
    END TRY
    BEGIN CATCH
        SET @err = ERROR_NUMBER();
    END CATCH;
    SELECT -7 / 2, -7 % 3, 7 % -3, @x, @swapped, @unknown, @past, @locked, (SELECT sum(t.a) FROM @t t),
        (SELECT min(t.k) FROM @t t WHERE t.k > 5);
END
"""


def test_the_interpreter_follows_t_sqls_rules_not_pythons() -> None:
    """Integer division and % truncate toward zero; a comparison with NULL is unknown; SELECT @x = over no
    row leaves @x; every SET of an UPDATE reads the row as it was; an aggregate over no row is NULL; a
    row another transaction holds is read past with READPAST and, without, makes a statement under a lock
    timeout fail with error 1222, which CATCH sees; a scalar subquery of two rows is an error."""
    ring = maker()(capacity=8, lanes=4)
    server = ring.server
    procedures, _ = tsql.load_routines(PROBE)
    server.procedures.update(procedures)
    server.lock("ring_lanes", (1, 3), "X")
    [[row]], out = server.call("probe", lane=2)
    assert row == (-3, -1, 1, 5, 2, 0, 1, -1, 6, None)
    assert out == {"err": 1222}
    with pytest.raises(tsql.Blocked):  # no lock timeout: it would wait for ever
        server.call("ring_floor", queue_id=1, floor=None)
    server.others.clear()
    with pytest.raises(tsql.TsqlError, match="more than 1 value"):
        server.query("SELECT (SELECT l.pos FROM [dbq].ring_lanes l)")
    with pytest.raises(tsql.TsqlError, match="CHECK constraint ring_leases_range_valid"):
        server.query(
            "INSERT INTO [dbq].ring_leases (queue_id, lo, hi, starts, n, lease_until) "
            "VALUES (1, 5, 4, N'[]', 1, SYSUTCDATETIME())"
        )


def test_a_ring_is_made_as_ring_create_writes_it() -> None:
    """ring_create: lane k at its first number (k, or the lanes' count for lane 0), slot j holding the last
    number <= 0 that maps to it with no payload, 64 push lanes, and the push sequence's 0 handed out."""
    ring = maker()(capacity=8, lanes=3)
    assert ring.positions() == [3, 1, 2]
    assert [ring.slot_of(j) for j in range(8)] == [(0, None)] + [(j - 8, None) for j in range(1, 8)]
    assert len(ring.server.tables["ring_push_lanes"].rows) == 64
    assert ring.issued == 0
    assert ring.push(b"a", b"b") == [1, 2]
    assert ring.issued == 2 and ring.slot_of(2) == (2, b"b")


def engine_call(query: str) -> tuple[str, dict[str, str]]:
    """The procedure that the SQL Server dialect's named query ``query`` runs, and the value it passes
    each argument: ``%(name)s`` (a parameter of the engine's), ``@var OUTPUT``, or a constant."""
    body = load_queries("airflow_dbqueue.engine.dialects.mssql", "queries")[query]
    found = re.search(r"EXEC \{schema\}\.(\w+)\s+(.*?)(?:;|$)", body, re.S)
    assert found is not None, query
    return found.group(1), dict(re.findall(r"@(\w+) = (%\(\w+\)s|@\w+ OUTPUT|[\w.]+)", found.group(2)))


def test_the_rings_calls_are_those_of_the_engines_named_queries() -> None:
    """tsql.Ring calls each procedure as the engine's named query of the procedure's name does: the same
    arguments, the same constants, its own queue, capacity and lanes where the engine passes its ring's,
    and nothing for the outputs. A named query that changes its call fails here, rather than leaving the
    tests that call the procedures through tsql.Ring testing calls the engine no longer makes."""
    ring = maker()(capacity=8, lanes=2)
    calls: list[tuple[str, dict[str, Any]]] = []
    call = ring.server.call

    def spy(name: str, **args: Any) -> Any:
        calls.append((name, args))
        return call(name, **args)

    ring.server.call = spy  # type: ignore[method-assign]
    ring.push(b"a", b"b")
    ring.abandon(1)
    ring.take(1)
    rows, _ = ring.pop(1, lease=True)
    ring.nack(ids(rows), [1])
    ring.skip_abandoned()
    ring.pass_lanes()
    own = {"queue_id": ring.queue_id, "capacity": ring.capacity, "lanes": ring.lanes}
    assert {name for name, _ in calls} == {
        "ring_push",
        "ring_take",
        "ring_pop",
        "ring_settle",
        "ring_skip_abandoned",
        "ring_pass",
    }
    for name, args in calls:
        procedure, passed = engine_call(name)
        assert procedure == name
        assert set(args) == set(passed), name
        for arg, value in passed.items():
            if value.startswith("%("):
                if value[2:-2] in own:
                    assert args[arg] == own[value[2:-2]], (name, arg)
            elif value.startswith("@") or value == "NULL":
                assert args[arg] is None, (name, arg)
            else:
                assert args[arg] == int(value), (name, arg)


# -- ring_pass -------------------------------------------------------------------------------------


def check_pass(make: Make) -> None:
    """Lanes at given-up numbers move over every given-up number at their heads, to the first number of
    their lane that is not one (a message, or a number not written); a lane another pop holds is left to
    it; a second pass, once it is free, moves it. Then pops take every message."""
    ring = make(capacity=16, lanes=4)
    assert ring.push(b"1", b"2", b"3") == [1, 2, 3]
    assert ring.abandon(4) == [4, 5, 6, 7]  # a push that died holding them
    assert ring.push(b"8", b"9", b"10") == [8, 9, 10]
    assert ring.abandon(1) == [11]
    assert ring.push(b"12") == [12]
    assert ids(ring.take(3)) == [1, 2, 3]
    assert ring.positions() == [4, 5, 6, 7]  # every lane stopped at an unwritten number
    assert ring.skip_abandoned() == 5  # 4 .. 7 and 11 given up
    assert ring.positions() == [4, 5, 6, 7]
    assert [ring.slot_of(x) for x in (4, 11)] == [(4, None), (11, None)]
    ring.server.lock("ring_lanes", (1, 2), "U")  # another pop holds lane 2
    ring.server.mine.clear()
    assert ring.pass_lanes() == 3
    assert ring.positions() == [8, 9, 6, 15]  # lane 3: 7 and 11 given up, 15 not written
    assert {k for k in ring.server.mine if k[0] == "ring_lanes"} == {
        ("ring_lanes", (1, 0)),
        ("ring_lanes", (1, 1)),
        ("ring_lanes", (1, 3)),
    }
    ring.server.others.clear()
    assert ring.pass_lanes() == 1 and ring.positions() == [8, 9, 10, 15]
    assert ring.pass_lanes() == 0
    assert ids(ring.take(10)) == [8, 9, 10, 12]


def test_ring_pass_moves_lanes_over_given_up_numbers_and_leaves_held_lanes() -> None:
    check_pass(maker())


@pytest.mark.parametrize("seed", range(30))
def test_ring_pass_walks_each_lane_as_postgresqls_does(seed: int) -> None:
    """A ring in a random state (pushes, numbers abandoned, takes, gaps given up, lanes and slots other
    transactions hold): each lane it can lock moves, number by number of its lane, while its slot holds
    the number with no payload (PostgreSQL's ring_pass, whose slot reads see committed versions: a slot
    being written stops the lane); the count is the lanes that moved."""
    rng = random.Random(seed)
    capacity = rng.randint(4, 16)
    ring = maker()(capacity=capacity, lanes=rng.randint(1, min(capacity, 5)))
    for _ in range(rng.randint(1, 12)):
        step = rng.random()
        if step < 0.45:
            try:
                ring.push(*[b"m"] * rng.randint(1, 3))
            except tsql.TsqlError as exc:  # the ring is full there
                assert "[DQ001]" in exc.message
        elif step < 0.7:
            ring.abandon(rng.randint(1, 3))
        elif step < 0.9:
            ring.take(rng.randint(1, 6))
        else:
            ring.skip_abandoned()
    ring.skip_abandoned()
    server = ring.server
    held = {lane for lane in range(ring.lanes) if rng.random() < 0.3}
    for lane in held:
        server.lock("ring_lanes", (1, lane), rng.choice("UX"))
    for slot in range(capacity):
        if rng.random() < 0.1:
            server.lock("ring_slots", (1, slot), "X")
    before = ring.positions()

    def given_up(number: int) -> bool:  # and its slot not being written by another transaction
        free = ("ring_slots", (1, number % capacity)) not in server.others
        return free and ring.slot_of(number) == (number, None)

    want = []
    for lane, start in enumerate(before):
        pos = start
        while lane not in held and given_up(pos):
            pos += ring.lanes
        want.append(pos)
    moved = ring.pass_lanes()
    assert ring.positions() == want, (before, held)
    assert moved == sum(a != b for a, b in zip(before, want, strict=True))


# -- the take's two parts --------------------------------------------------------------------------


def check_two_parts(make: Make) -> None:
    """A take whose window runs past the end of the slots: the first part up to the last slot, then, the
    held lanes having taken everything up to it, the second from slot 0; one lease row a part (its lowest
    and highest message, each held lane's position at the part, its messages); the ids in order; and the
    batch's size counted across both parts."""
    ring = make(capacity=8, lanes=2)
    assert ids(ring.take(6)) == [] and ring.push(*[b"a"] * 6) == [1, 2, 3, 4, 5, 6]
    assert ids(ring.take(6)) == [1, 2, 3, 4, 5, 6]
    assert ring.positions() == [8, 7]
    assert ring.push(*[b"b"] * 6) == [7, 8, 9, 10, 11, 12]  # slots 7, 0, 1, 2, 3, 4
    rows = ring.take(6, lease=True)
    assert ids(rows) == [7, 8, 9, 10, 11, 12]
    assert all(r[1:3] == (1, 1) and r[4] is not None and r[5] == b"b" for r in rows)
    assert ring.leases() == [(7, 7, [8, 7], 1), (8, 12, [8, 9], 5)]
    assert ring.positions() == [14, 13]
    # The batch's size holds across the parts.
    other = make(capacity=8, lanes=2)
    other.push(*[b"a"] * 6)
    other.take(6)
    other.push(*[b"b"] * 6)
    assert ids(other.take(3)) == [7, 8, 9]
    assert other.positions() == [10, 11]


def check_second_part_refused(make: Make) -> None:
    """When a held lane stopped before the end of the slots (at a number not written yet), the take ends
    with the first part even though the other lane could go on from slot 0: positions never pass a number
    nobody has seen, and the second part needs every held lane at the end. The next take, without the
    stopped lane, goes on; that lane is not even locked."""
    ring = make(capacity=8, lanes=2)
    ring.push(*[b"a"] * 4)
    assert ids(ring.take(4)) == [1, 2, 3, 4]
    assert ring.push(b"5", b"6") == [5, 6]
    assert ring.abandon(1) == [7]  # a push in progress, say
    assert ring.push(*[b"c"] * 5) == [8, 9, 10, 11, 12]  # slots 0 .. 4
    assert ids(ring.take(10)) == [5, 6]
    assert ring.positions() == [8, 7]
    ring.server.mine.clear()
    assert ids(ring.take(10)) == [8, 10, 12]  # lane 0 only: lane 1 waits at 7
    assert ring.positions() == [14, 7]
    assert ("ring_lanes", (1, 1)) not in ring.server.mine and ("ring_lanes", (1, 0)) in ring.server.mine


def test_a_take_past_the_end_of_the_slots_is_taken_in_two_parts() -> None:
    check_two_parts(maker())


def test_the_second_part_is_taken_only_when_the_held_lanes_took_everything_to_the_end() -> None:
    check_second_part_refused(maker())


def test_a_batch_reads_past_a_slot_being_written_and_stops_there() -> None:
    """A slot another transaction holds (a push writing it) is unwritten for a take, as its committed
    version is on PostgreSQL: the take stops before it, and its lane is not locked."""
    ring = maker()(capacity=8, lanes=2)
    ring.push(*[b"a"] * 5)
    ring.server.lock("ring_slots", (1, 4), "X")
    assert ids(ring.take(10)) == [1, 2, 3]
    assert ring.positions() == [4, 5]
    ring.server.others.clear()
    assert ids(ring.take(10)) == [4, 5]


# -- a pop of none ---------------------------------------------------------------------------------


def check_pop_of_none(make: Make) -> None:
    """A pop of none (n 0, what a push that finds the ring full runs between its attempts) gives up the
    gap it is told about once the push lanes listed are all seen unlocked, moves the lanes over the
    numbers given up (ring_pass), and reports the head: it serves no message due again, takes nothing,
    and leases nothing."""
    ring = make(capacity=16, lanes=4)
    assert ring.push(b"1", b"2", b"3") == [1, 2, 3]
    assert ring.abandon(1) == [4]
    assert ring.push(*[b"m"] * 5) == [5, 6, 7, 8, 9]
    [due] = ring.take(1, lease=True)
    assert ring.nack([due[0]], [1]) == [(due[0], 1)]  # ready again now
    retry = ring.retry()
    positions = ring.positions()
    assert positions[0] == 4  # lane 0 stopped at the unwritten 4

    def pop_of_none(**gap: Any) -> tuple[Any, ...]:
        rows, meta = ring.pop(0, consumer="push", **gap)
        assert rows == []
        assert ring.retry() == retry and ring.leases() == []
        return meta

    assert pop_of_none() == (4, 9, None)  # first sighting: no push lanes listed yet
    assert ring.positions() == positions
    ring.server.lock("ring_push_lanes", (1, 3), "X")  # a push in progress holds push lane 3
    assert pop_of_none(gap=4, issued=9) == (4, 9, "[3]")  # second sighting: the lanes held
    assert pop_of_none(gap=4, issued=9, snap="[3]") == (4, 9, "[3]")  # lane 3 still held: no proof
    assert ring.positions() == positions and ring.slot_of(4) == (4 - 16, None)
    ring.server.others.clear()  # that push ended
    ring.server.calls.clear()
    assert pop_of_none(gap=4, issued=9, snap="[3]") == (None, None, None)
    assert ring.slot_of(4) == (4, None) and ring.gaps_skipped() == 1
    assert ring.positions() == [8, *positions[1:]]  # lane 0 moved over 4; the others were at messages
    assert "ring_pass" in ring.server.calls and "ring_take" not in ring.server.calls
    # A pop of some takes the message due again first, then the lanes'.
    rows, meta = ring.pop(10)
    assert sorted(ids(rows)) == [1, 2, 3, 5, 6, 7, 8, 9] and meta == (None, None, None)
    assert ring.retry() == []


def test_a_pop_of_none_only_gives_the_gap_up_and_reports_the_head() -> None:
    check_pop_of_none(maker())


def test_a_pop_of_none_without_a_gap_changes_nothing() -> None:
    ring = maker()(capacity=8, lanes=2)
    ring.push(b"a", b"b", b"c")
    before = (ring.positions(), [dict(r) for r in ring.server.tables["ring_slots"].scan()])
    rows, meta = ring.pop(0)
    assert rows == [] and meta == (None, None, None)
    assert (ring.positions(), [dict(r) for r in ring.server.tables["ring_slots"].scan()]) == before


# -- a batch that finds every lane held --------------------------------------------------------------
# A wait is out of the interpreter's reach but for what the holders do when it comes (Server.on_wait):
# here a pop holding some lanes ends without taking anything and lets go, and the others keep theirs.


def held_ring(make: Make, *, lanes: int = 8) -> tsql.Ring:
    """A ring of 40 messages whose lanes other pops hold: lanes 1 to 5 one pop (which ends, taking
    nothing, when this one waits for one of them), the rest another (which keeps them)."""
    ring = make(capacity=64, lanes=lanes)
    assert ring.push(*[b"m"] * 40) == list(range(1, 41))
    first = set(range(1, min(6, lanes)))
    for lane in range(lanes):
        ring.server.lock("ring_lanes", (1, lane), "U")

    def ends(server: tsql.Server, waited: list[tuple[str, tuple[Any, ...]]]) -> bool:
        if any(table == "ring_lanes" and key[1] in first for table, key in waited):
            for lane in first:
                server.others.pop(("ring_lanes", (1, lane)), None)
            return True
        return False

    ring.server.on_wait = ends
    ring.server.mine.clear()
    return ring


def check_held_lanes(make: Make) -> None:
    """A batch pop that finds every lane held waits for the lowest one (one wait, for that lane alone),
    then takes free ones up to half the lanes (4 of 8: the lowest and 3 more, although 5 are free by
    then), and takes its messages from those: the same as PostgreSQL's ring_take."""
    ring = held_ring(make)
    rows = ring.take(100, wait=True)
    assert ring.server.lock_waits == [[("ring_lanes", (1, 1))]]
    taken = [x for x in range(1, 41) if x % 8 in (1, 2, 3, 4)]
    assert ids(rows) == taken
    assert ring.positions() == [8, 41, 42, 43, 44, 5, 6, 7]
    assert {k for k in ring.server.mine if k[0] == "ring_lanes"} == {
        ("ring_lanes", (1, n)) for n in (1, 2, 3, 4)
    }
    # Two messages: the lowest lane and one more.
    ring = held_ring(make)
    assert ids(ring.take(2, wait=True)) == [1, 2]
    assert ring.positions() == [8, 9, 10, 3, 4, 5, 6, 7]
    # One message: the lowest lane alone.
    ring = held_ring(make)
    assert ids(ring.take(1, wait=True)) == [1]
    assert ring.positions() == [8, 9, 2, 3, 4, 5, 6, 7]
    assert ring.server.lock_waits == [[("ring_lanes", (1, 1))]]
    # Two lanes (half of them is one): the lowest only.
    ring = held_ring(make, lanes=2)
    assert ids(ring.take(100, wait=True)) == list(range(1, 41, 2))


def test_a_batch_that_finds_every_lane_held_waits_for_the_lowest_then_shares_the_lanes() -> None:
    check_held_lanes(maker())


def check_no_wait(make: Make) -> None:
    """Without @wait (a pop in the caller's transaction), or while messages to deliver again are due
    (ring_pop serves those first), a take that finds every lane held returns nothing and waits for
    nothing; with @wait and holders that never let go, it waits 1 s (its own LOCK_TIMEOUT) and fails with
    error 1222, which the engine turns into an empty pop."""
    ring = held_ring(make)
    assert ring.take(100) == [] and ring.take(1) == []
    assert ring.server.lock_waits == [] and ring.positions() == [8, 1, 2, 3, 4, 5, 6, 7]
    ring = held_ring(make)
    ring.server.tables["ring_retry"].insert(
        {"queue_id": 1, "id": 1, "state": 1, "attempts": 1, "deliveries": 1, "due_at": ring.server.now}
    )
    assert ring.take(100, wait=True) == [] and ring.take(1, wait=True) == []
    assert ring.server.lock_waits == []
    ring = held_ring(make)
    ring.server.on_wait = None
    fails(lambda: ring.take(5, wait=True), 1222)
    assert len(ring.server.lock_waits) == 1
    assert ring.positions() == [8, 1, 2, 3, 4, 5, 6, 7]


def test_a_take_that_must_not_wait_returns_nothing_at_once() -> None:
    check_no_wait(maker())


def test_messages_due_again_keep_a_take_from_the_lanes() -> None:
    """A take with @retries finds nothing while messages to deliver again are due, whatever the lanes
    hold, and takes again once none is due (the check is part of the statements that lock lanes)."""
    ring = maker()(capacity=16, lanes=4)
    ring.push(*[b"m"] * 6)
    [due] = ring.take(1, lease=True)
    ring.nack([due[0]], [1])
    assert ring.take(1) == [] and ring.take(5) == [] and ring.take(5, wait=True) == []
    assert ring.positions() == [4, 5, 2, 3]
    rows, _ = ring.pop(1)  # ring_pop serves it
    assert ids(rows) == [1]
    assert ids(ring.take(10)) == [2, 3, 4, 5, 6]


# -- where a take ends -------------------------------------------------------------------------------


def check_take_ends(make: Make) -> None:
    """A take ends at its n-th row when every number up to it is written, given-up numbers counted as
    rows (one plain aggregate, as PostgreSQL's does), and otherwise before the first number not written,
    up to its n-th message (the window scan)."""
    ring = make(capacity=16, lanes=1)
    assert ring.push(b"1", b"2") == [1, 2]
    assert ring.abandon(1) == [3]
    assert ring.push(b"4", b"5", b"6") == [4, 5, 6]
    assert ring.skip_abandoned() == 1  # 3 given up: written, with no payload
    assert ids(ring.take(3)) == [1, 2]  # rows 1, 2, 3
    assert ring.positions() == [4]
    assert ids(ring.take(2)) == [4, 5] and ring.positions() == [6]
    # An unwritten number (a push in progress) ends the take before it, up to n messages.
    assert ring.abandon(2) == [7, 8]
    assert ring.push(b"9") == [9]
    assert ids(ring.take(5)) == [6] and ring.positions() == [7]
    other = make(capacity=16, lanes=1)
    other.push(b"1")
    other.abandon(1)
    other.push(b"3", b"4")
    other.skip_abandoned()
    other.abandon(1)
    other.push(b"6")
    assert ids(other.take(2)) == [1] and other.positions() == [3]  # rows 1 and 2 (given up)
    assert ids(other.take(9)) == [3, 4] and other.positions() == [5]  # 5 is not written


def test_a_take_ends_at_its_nth_row_or_before_the_first_unwritten_number() -> None:
    check_take_ends(maker())


# -- a dropped ring ------------------------------------------------------------------------------------


def push_call(ring: tsql.Ring, *, first: int | None = None) -> dict[str, Any]:
    _, out = ring.server.call(
        "ring_push",
        queue_id=1,
        cap=ring.capacity,
        payloads='["aa"]',
        payload=None,
        timeout_s=0.0,
        first=first,
        once=0,
        num=None,
        written=None,
    )
    return out


def check_dropped(make: Make) -> None:
    """A ring dropped while a push reads its floor (the drop held the lanes it deleted, then committed)
    is error DQ004, before and after the push took its numbers; a floor that stays locked is unknown,
    and the push finds no room instead. A pop (not in the caller's transaction) of a ring whose row is
    gone is DQ004 too; in the caller's transaction it takes nothing."""

    def dropping(server: tsql.Server, waited: list[tuple[str, tuple[Any, ...]]]) -> bool:
        server.others.clear()
        server.call("ring_drop", queue_id=1)
        return True

    for first in (None, 3):
        ring = make(capacity=8, lanes=2)
        ring.push(b"a", b"b")
        ring.server.lock("ring_lanes", (1, 0), "X")
        if first is None:  # the room check: no room yet
            assert push_call(ring)["num"] is None
        else:  # numbers taken (ring_push_one's): the ring stays full for them
            fails(lambda ring=ring, first=first: push_call(ring, first=first), 50000, r"^\[DQ001\]")
        ring.server.on_wait = dropping
        fails(
            lambda ring=ring, first=first: push_call(ring, first=first), 50000, r"^\[DQ004\] ring 1 does not"
        )
    ring = make(capacity=8, lanes=2)
    ring.push(b"a")
    ring.server.call("ring_drop", queue_id=1)
    fails(lambda: ring.pop(5), 50000, r"^\[DQ004\] ring 1 does not exist")
    assert ring.pop(5, own=True) == ([], (None, None, None))


def check_gone_round(make: Make) -> None:
    """A push's number given up as a gap while it waited (ring_push_one took it and found its slot not
    free, and ring_push writes it later, in a transaction of its own) is DQ002 to ring_push, whether the
    slot still holds the number given up or the ring has gone round over it since: a later number there
    (nobody else writes ours) is never the number before ours again, and the push would otherwise wait
    its whole timeout and fail as full (DQ001)."""
    ring = make(capacity=4, lanes=2)
    assert ring.push(b"1", b"2", b"3", b"4") == [1, 2, 3, 4]
    _, out = ring.server.call(
        "ring_push",
        queue_id=1,
        cap=4,
        payloads=None,
        payload=b"5",
        timeout_s=0.0,
        first=None,
        once=1,
        num=None,
        written=None,
    )
    assert (out["num"], out["written"]) == (5, 0)  # ring_push_one's: issued, its slot not free
    assert ids(ring.take(8)) == [1, 2, 3, 4]
    assert ring.skip_abandoned() == 1  # no push lane held: 5's holder is gone
    assert ring.slot_of(5) == (5, None)
    fails(lambda: push_call(ring, first=5), 50000, r"^\[DQ002\] ring 1: numbers 5 \.\. 5 were given up")
    assert ring.pass_lanes() == 1
    assert ring.push(b"6", b"7", b"8", b"9") == [6, 7, 8, 9]  # 9 in 5's slot
    assert ids(ring.take(8)) == [6, 7, 8, 9]
    assert ring.slot_of(9)[0] == 9
    fails(lambda: push_call(ring, first=5), 50000, r"^\[DQ002\] ring 1: numbers 5 \.\. 5 were given up")
    assert push_call(ring)["num"] == 10


def test_a_push_whose_number_the_ring_went_round_over_is_dq002() -> None:
    check_gone_round(maker())


def test_a_dropped_ring_is_dq004_to_pushes_and_pops() -> None:
    check_dropped(maker())


# -- consumer groups -------------------------------------------------------------------------------


def add_group(ring: tsql.Ring, name: str, *, earliest: bool) -> int:
    """ring_add_group, called as the engine's named query calls it: the new group's gid."""
    _, out = ring.server.call(
        "ring_add_group",
        queue_id=ring.queue_id,
        name=name,
        earliest=int(earliest),
        on_lag=0,
        lag_timeout_s=60.0,
        gid=None,
    )
    return int(out["gid"])


def group_of(ring: tsql.Ring, gid: int) -> tsql.Ring:
    """The ring as a consumer group's pops see it: its calls pass the group's gid for the queue id."""
    view = tsql.Ring.__new__(tsql.Ring)
    view.server, view.queue_id, view.capacity, view.lanes, view.seq = (
        ring.server,
        gid,
        ring.capacity,
        ring.lanes,
        ring.seq,
    )
    return view


def check_groups(make: Make) -> None:
    """A group added now sees what is pushed from then on; one added from the earliest message also what
    the ring still holds for some group. A group that has not taken a number holds the floor: a push a
    capacity ahead of it finds the ring full (and takes no number), until the group is dropped, which
    deletes its lanes. Given-up numbers are passed over in every group's lanes. Gids are never used
    twice."""
    ring = make(capacity=4, lanes=2)
    assert ring.push(b"1") == [1]
    late = add_group(ring, "late", earliest=False)
    early = add_group(ring, "early", earliest=True)
    assert (late, early) == (-1, -2)
    assert group_of(ring, late).positions() == [2, 3]  # past the push position
    assert group_of(ring, early).positions() == [2, 1]  # the default group's
    assert ring.push(b"2", b"3") == [2, 3]
    assert ids(group_of(ring, early).take(4)) == [1, 2, 3]
    assert ids(group_of(ring, late).take(4)) == [2, 3]
    assert ring.push(b"4", b"5") == []  # 5 would overwrite 1, which the default group has not taken
    assert ids(ring.take(4)) == [1, 2, 3]
    assert ring.push(b"4", b"5") == [4, 5]
    assert ids(ring.take(4)) == ids(group_of(ring, early).take(4)) == [4, 5]
    assert ring.push(b"6", b"7") == [6, 7]
    assert ids(ring.take(4)) == ids(group_of(ring, early).take(4)) == [6, 7]
    assert ring.push(b"8") == []  # late has not taken 4
    _, out = ring.server.call("ring_drop_group", queue_id=ring.queue_id, gid=late, dropped=None)
    assert out["dropped"] == 1
    assert [r for r in ring.server.tables["ring_lanes"].rows if r["queue_id"] == late] == []
    assert ring.push(b"8") == [8]
    assert ring.abandon(1) == [9]
    assert ring.skip_abandoned() == 1
    assert ring.pass_lanes() == 2  # lane 1 of the default group and of early, both at 9
    assert ring.positions() == group_of(ring, early).positions() == [8, 11]
    assert add_group(ring, "late", earliest=False) == -3


def test_consumer_groups_see_their_messages_and_hold_the_floor_until_dropped() -> None:
    check_groups(maker())


# -- the checks fail when the T-SQL is broken ------------------------------------------------------


def mutated(block: str, good: str, bad: str) -> dict[str, str]:
    text = dict(blocks())
    assert text[block].count(good) == 1, (block, good)
    text[block] = text[block].replace(good, bad)
    return text


MUTATIONS = [
    # ring_pass
    ("ring_pass", "AND s.seq = l.pos AND s.payload IS NULL);", "AND s.seq = l.pos);", check_pass),
    ("ring_pass", "UPDATE l SET pos = l.pos + @lanes", "UPDATE l SET pos = l.pos + 1", check_pass),
    (
        "ring_pass",
        "ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST)\n    WHERE t.queue_id = @queue_id;",
        "ring_lanes t WITH (ROWLOCK, UPDLOCK)\n    WHERE t.queue_id = @queue_id;",
        check_pass,
    ),
    ("ring_pass", "WHERE l.pos > l.start;", "WHERE l.pos >= l.start;", check_pass),
    # the take's two parts
    ("ring_take", "WHILE @part < 2 AND", "WHILE @part < 1 AND", check_two_parts),
    ("ring_take", "ORDER BY p.part, s.slot;", "ORDER BY s.slot;", check_two_parts),
    ("ring_take", "SELECT TOP (@n - @got) @lo", "SELECT TOP (@n) @lo", check_two_parts),
    ("ring_take", "SET @lo = @lo - @a + @cap;", "SET @lo = @lo + @cap;", check_two_parts),
    ("ring_take", "h.pos < @lo - @a + @cap)", "h.pos < @lo - @a)", check_second_part_refused),
    (
        "ring_take",
        "FROM @held h JOIN [dbq].ring_lanes l ON l.queue_id = @gid AND l.lane = h.lane;",
        "FROM @held h JOIN [dbq].ring_lanes l ON l.queue_id = @gid AND l.lane = h.lane WHERE 1 = 0;",
        check_two_parts,
    ),
    (
        "ring_take",
        "WHERE t.queue_id = @gid AND EXISTS (\n        SELECT 1",
        "WHERE t.queue_id = @gid AND 1 = 1 OR EXISTS (\n        SELECT 1",
        check_second_part_refused,
    ),
    # a push whose number was given up
    ("ring_push", "OR t.seq > @base1 + t.slot))", "OR 1 = 0))", check_gone_round),
    # a pop of none
    ("ring_pop", "IF @skipped > 0", "IF @skipped > 1000", check_pop_of_none),
    ("ring_skip_gap", "SET @skipped = @k;", "SET @skipped = 0;", check_pop_of_none),
    (
        "ring_pop",
        "SELECT TOP (@n) t.id, t.attempts",
        "SELECT TOP (@n + 1) t.id, t.attempts",
        check_pop_of_none,
    ),
    # a batch that finds every lane held
    ("ring_take", "IF @n > 1 AND @lanes > 2", "IF @n > 1 AND @lanes > 200", check_held_lanes),
    ("ring_take", "ELSE @lanes / 2 END - 1;", "ELSE @lanes END - 1;", check_held_lanes),
    (
        "ring_take",
        "WHERE t.queue_id = @gid\n            ORDER BY t.pos;",
        "WHERE t.queue_id = @gid\n            ORDER BY t.lane DESC;",
        check_held_lanes,
    ),
    ("ring_take", "SET LOCK_TIMEOUT 1000;", "SET NOCOUNT ON;", check_no_wait),
    ("ring_take", "IF @wait = 1 AND NOT EXISTS", "IF @wait >= 0 AND NOT EXISTS", check_no_wait),
    (
        "ring_take",
        "        BEGIN\n            RETURN;\n        END;\n    END;\n    IF @wait = 1",
        "        BEGIN\n            SET @k = 0;\n        END;\n    END;\n    IF @wait = 1",
        check_no_wait,
    ),
    # where a take ends
    ("ring_take", "IF @whole = 0", "IF @whole = 2", check_take_ends),
    ("ring_take", "@whole = min(r.ok)", "@whole = max(r.ok)", check_take_ends),
    ("ring_take", "SELECT TOP (@n - @got) @lo", "SELECT TOP (@n - @got + 1) @lo", check_take_ends),
    # a dropped ring
    ("ring_floor_try", "SET @gone = 1;", "SET @gone = 0;", check_dropped),
    ("ring_push", "SET @fail = 4;", "SET @fail = 1;", check_dropped),
    (
        "ring_pop",
        "IF NOT EXISTS (SELECT 1 FROM [dbq].rings g",
        "IF EXISTS (SELECT 1 FROM [dbq].rings g",
        check_dropped,
    ),
    # consumer groups
    ("ring_floor", "IF @lanes < @floor OR @floor IS NULL", "IF @lanes < @floor AND 1 = 0", check_groups),
    (
        "ring_add_group",
        "CASE WHEN @earliest = 1 THEN min(t.pos)",
        "CASE WHEN @earliest = 1 THEN max(t.pos)",
        check_groups,
    ),
    (
        "ring_take",
        "SET @queue_id = (SELECT g.queue_id FROM [dbq].ring_groups g WHERE g.gid = @gid);",
        "SET @queue_id = @gid;",
        check_groups,
    ),
    (
        "ring_drop_group",
        "DELETE FROM [dbq].ring_lanes WHERE queue_id = @gid;",
        "DELETE FROM [dbq].ring_lanes WHERE queue_id = @gid AND 1 = 0;",
        check_groups,
    ),
    (
        "ring_pass",
        "JOIN [dbq].ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST) ON t.queue_id = g.gid",
        "JOIN [dbq].ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST) ON t.queue_id = g.gid AND 1 = 0",
        check_groups,
    ),
]


@pytest.mark.parametrize(
    ("block", "good", "bad", "check"), MUTATIONS, ids=[f"{m[0]}:{m[2][:40]}" for m in MUTATIONS]
)
def test_the_checks_fail_on_broken_tsql(
    block: str, good: str, bad: str, check: Callable[[Make], None]
) -> None:
    """Each scenario above fails once one line of the T-SQL it runs is broken."""
    check(maker())  # whole, it passes
    with pytest.raises((AssertionError, tsql.TsqlError, tsql.Blocked)):
        check(maker(mutated(block, good, bad)))


# -- the engine on the interpreted procedures ------------------------------------------------------


def test_a_push_to_a_ring_kept_full_by_a_gap_pops_none_and_gets_in_on_interpreted_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RingQueue on the SQL Server dialect, its named queries run on the interpreter: a ring whose floor
    is held down only by a number a push took and never wrote. A push finds no room, pops none (the gap is
    seen, its push lanes listed, then given up and the lane moved over it) and is let in at its next try.
    Every message pushed comes out once."""
    from airflow_dbqueue.engine import DbQueue, ring
    from airflow_dbqueue.engine.models import Design, QueueSettings
    from tests.helpers import checksum

    server = tsql.ring_server(blocks())
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    fake = tsql.InterpretedSqlServer(server).attach(monkeypatch, dbq.db)
    monkeypatch.setattr(ring.time, "sleep", lambda s: None)
    dbq.db.execute("ring_create", {"queue_id": 1, "capacity": 4, "slot_bytes": 64, "lanes": 2})
    q = ring.RingQueue(
        dbq.db,
        QueueSettings(name="r", queue_id=1, design=Design.RING, max_payload_bytes=64, capacity=4, lanes=2),
    )
    q.push_timeout = 2.0
    numbers = tsql.Ring.__new__(tsql.Ring)  # the ring made above, for a push that dies holding a number
    numbers.server, numbers.seq = server, "[dbq].[ring_1_seq]"
    numbers.queue_id, numbers.capacity, numbers.lanes = 1, 4, 2
    pushed = [{"n": i} for i in range(7)]
    assert q.push_batch(pushed[:2]) == [1, 2]
    assert numbers.abandon(1) == [3]
    assert q.push_batch(pushed[2:3]) == [4]
    got = q.pop(3)
    assert [m.id for m in got] == [1, 2, 4]  # lane 1 stops at 3, seen twice: its push lanes listed
    assert q.push_batch(pushed[3:5]) == [5, 6]
    before = len(fake.log)
    assert q.push_batch(pushed[5:7]) == [7, 8]  # 7's slot held 3, given up on the way
    sent = fake.log[before:]
    assert [m.group(1) for s in sent if (m := re.search(r"EXEC \[dbq\]\.(ring_[a-z_]+)", s.text))] == [
        "ring_push",  # no room: nothing taken
        "ring_pop",  # a pop of none, with the gap and its push lanes: 3 is given up
        "ring_push",
    ]
    [help_pop] = [s.values for s in sent if "EXEC [dbq].ring_pop " in s.text]
    assert help_pop == [1, 4, 2, 0, False, 30.0, "push", False, 3, 4, "[]", False]
    assert q.stats().extra["gaps_skipped"] == 1
    got += q.pop(10)
    assert [m.id for m in got] == [1, 2, 4, 5, 6, 7, 8]
    assert checksum(m.payload for m in got) == checksum(pushed)


def test_a_dropped_rings_handle_raises_queue_not_found_on_interpreted_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ring queue made by DbQueue.create_queue on the interpreted procedures, then dropped by another
    client (as drop_queue does, but for its lock: see tsql.drop_queue). Through the old handle a push and
    a pop raise QueueNotFoundError (the procedures' DQ004, then the queue found gone), a pop in the
    caller's transaction takes nothing, and nothing is written."""
    from airflow_dbqueue.engine import DbQueue, QueueNotFoundError
    from tests.helpers import checksum

    server = tsql.ring_server(blocks())
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    tsql.InterpretedSqlServer(server).attach(monkeypatch, dbq.db)
    q = dbq.create_queue("events", design="ring", capacity=8, lanes=2)
    assert (q.settings.queue_id, q.settings.capacity, q.settings.lanes) == (1, 8, 2)
    pushed = [{"n": i} for i in range(3)]
    assert q.push_batch(pushed) == [1, 2, 3]
    got = q.pop(2)
    got += q.pop(1)  # the last pop came back full: the next one takes the fast path first
    assert checksum(m.payload for m in got) == checksum(pushed)
    tsql.drop_queue(dbq.db, 1)
    with pytest.raises(QueueNotFoundError, match="queue 'events' does not exist in schema 'dbq'"):
        q.push({"n": 9})
    with pytest.raises(QueueNotFoundError):
        q.push_batch([{"n": 10}, {"n": 11}])
    with pytest.raises(QueueNotFoundError):
        q.pop(5)
    with dbq.transaction() as conn:
        assert q.pop(5, semantics="exactly-once", conn=conn) == []
    assert {name: t.rows for name, t in server.tables.items() if t.rows} == {}
    assert set(server.sequences) == {"[dbq].[message_id_seq]", "[dbq].[group_gids]"}  # the ring's dropped


def test_an_ack_of_a_pop_past_the_end_of_the_slots_deletes_both_leases_on_interpreted_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pop past the end of the ring's slots writes two lease rows; the engine's ack of its messages
    deletes both in the one ring_ack batch (no ring_settle, no retry row), and an ack of part of a lease
    is refused by that batch and settled message by message."""
    from airflow_dbqueue.engine import DbQueue
    from tests.helpers import checksum

    server = tsql.ring_server(blocks())
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    fake = tsql.InterpretedSqlServer(server).attach(monkeypatch, dbq.db)
    q = dbq.create_queue("wrapack", design="ring", capacity=8, lanes=2)
    assert q.push_batch(list(range(6))) == list(range(1, 7))
    assert [m.id for m in q.pop(6)] == list(range(1, 7))
    sent = [f"m{i}" for i in range(6)]
    assert q.push_batch(sent) == list(range(7, 13))  # slots 7, 0, 1, 2, 3, 4
    got = q.pop(6, semantics="at-least-once")
    assert [(m.id, m.payload) for m in got] == list(zip(range(7, 13), sent, strict=True))
    assert len(list(server.tables["ring_leases"].scan())) == 2, "two parts: two lease rows"

    def procedures(since: int) -> list[str]:
        found = (
            re.findall(r"name: (ring_[a-z_]+)|EXEC \[dbq\]\.(ring_[a-z_]+)", s.text) for s in fake.log[since:]
        )
        return [a or b for hits in found for a, b in hits]

    before = len(fake.log)
    assert q.ack(got) == 6
    assert "ring_settle" not in procedures(before), procedures(before)
    assert list(server.tables["ring_leases"].scan()) == [] and list(server.tables["ring_retry"].scan()) == []
    more = q.push_batch(["a", "b", "c"])
    part = q.pop(3, semantics="at-least-once")
    assert [m.id for m in part] == more
    assert q.ack(part[:1]) == 1  # part of a lease: settled, the rest stay leased
    assert q.ack(part[1:]) == 2
    assert list(server.tables["ring_leases"].scan()) == [] and list(server.tables["ring_retry"].scan()) == []
    assert checksum(m.payload for m in got + part) == checksum([*sent, "a", "b", "c"])


def test_a_group_nobody_pops_holds_the_floor_until_maintenance_drops_it_on_interpreted_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Consumer groups on the interpreted procedures. Each group gets every message pushed since it was
    added ("earliest": also those still in the ring); a group nobody pops keeps the ring's floor down, so a
    push a ring ahead of it finds the ring full. Maintenance first notes the groups' lanes; once those of a
    group with messages to take have stayed still for its lag timeout (the server's clock), it drops the
    group (on_lag="drop_group"), the floor rises and the push gets in. A handle of the dropped group finds
    it gone, and its gid is never handed out again."""
    import datetime as dt

    from airflow_dbqueue.engine import DbQueue, GroupExistsError, GroupNotFoundError, QueueFullError
    from tests.helpers import checksum

    server = tsql.ring_server(blocks())
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    tsql.InterpretedSqlServer(server).attach(monkeypatch, dbq.db)
    q = dbq.create_queue("fan", design="ring", capacity=4, lanes=2)
    q.push_timeout = 0.0
    early = [{"n": 0}]
    assert q.push_batch(early) == [1]
    audit = q.add_group("audit", on_lag="drop_group", lag_timeout=60)
    watch = q.add_group("watch", start="earliest", lag_timeout=60)
    assert (audit._gid, watch._gid) == (-1, -2)
    with pytest.raises(GroupExistsError):
        q.add_group("watch")
    got = q.pop(8)
    seen = watch.pop(8, semantics="at-least-once")
    assert watch.ack(seen) == 1  # until then its lease keeps 1 in the ring
    pushed = [{"n": i} for i in range(1, 5)]
    assert q.push_batch(pushed) == [2, 3, 4, 5]  # 5 overwrites 1, which no group needs any more
    got += q.pop(8)
    more = watch.pop(8, semantics="at-least-once")
    assert watch.ack(more) == 4
    seen += more
    assert checksum(m.payload for m in got) == checksum(m.payload for m in seen) == checksum(early + pushed)
    assert [(g.name, g.pop_position) for g in q.groups()] == [("default", 6), ("audit", 2), ("watch", 6)]
    assert (q.stats().extra["floor"], audit.stats().extra["lag_messages"]) == (2, 4)
    late = [{"n": 5}, {"n": 6}]
    with pytest.raises(QueueFullError):
        q.push_batch(late)  # 6's slot holds 2, which audit has not taken: no number is taken
    assert q.maintain() == {
        "reclaimed": 0,
        "gaps_skipped": 0,
        "groups_lagging": 0,
        "groups_dropped": 0,
        "batches_purged": 0,
    }
    server.now += dt.timedelta(seconds=61)
    assert q.maintain() == {
        "reclaimed": 0,
        "gaps_skipped": 0,
        "groups_lagging": 1,
        "groups_dropped": 1,
        "batches_purged": 0,
    }
    assert [g.name for g in q.groups()] == ["default", "watch"]  # watch had nothing to take
    with pytest.raises(GroupNotFoundError):
        audit.pop(1)
    assert q.push_batch(late) == [6, 7]
    assert [m.payload for m in q.pop(4)] == [m.payload for m in watch.pop(4)] == late
    assert q.add_group("audit")._gid == -3
    left = [r for t in ("ring_lanes", "ring_leases", "ring_retry") for r in server.tables[t].rows]
    assert {r["queue_id"] for r in left} == {1, -2, -3}  # the dropped group's rows are gone


@pytest.mark.parametrize("shape", ["plain", "group"])
def test_peek_shows_what_the_next_pop_takes_on_interpreted_sql_server(
    monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """ring_peek as SQL Server runs it (the retry rows, then the lanes' slots from the lowest lane
    position's slot to the end, then from slot 0): on a ring of 64 slots through which 400 messages
    pass, its window going round the end of the slots again and again, peek(n) shows exactly what the
    pop of n that follows takes (tests.helpers.peek_then_pop), on the ring or on a consumer group."""
    from airflow_dbqueue.engine import DbQueue
    from tests.helpers import peek_then_pop

    server = tsql.ring_server(blocks())
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    tsql.InterpretedSqlServer(server).attach(monkeypatch, dbq.db)
    q = dbq.create_queue("deep", design="ring", capacity=64, lanes=4, max_attempts=10, retry_backoff=0)
    peek_then_pop(q, shape, total=400, deep=40)
