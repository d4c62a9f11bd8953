"""Waiting pops in several processes on one ring (the rows layout, PostgreSQL's default, and the slots
layout).

Each process listens once, whatever its waiters, and a message whose push sent no NOTIFY (under
``notify="auto"`` a push that finds an earlier message not taken yet sends none) still reaches a
waiter of another process long before its poll: a waiter whose look found nothing while a row was
issued and not taken looks again soon, and one told that every row issued is taken is woken by the
next push's NOTIFY (ring_rows_ask and ring_pushing say why). The taker of the earlier message, in its
own process, does not pop again until the round is over, so it cannot be what finds the later one.
Every poll here is far longer than the test, so a message found only by a poll shows as one many
seconds late.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from tests.helpers import checksum, child_processes

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized

pytestmark = pytest.mark.integration

PROCESSES = 3
ROUNDS = 4
POLL_S = 120.0
"""The waiters' poll: far longer than the test."""
PROMPT_S = 5.0
"""The most a message may wait for a waiter here (on a loaded machine)."""
HELD_S = 0.5
"""How long the later push's transaction stays open after the earlier message was taken."""
QUEUE = "q"


def _waiter(dsn: str, schema: str, idx: int, rounds: Synchronized[int], out: mp.Queue[Any]) -> None:
    """One process, one waiting thread (its main one): pop one message at a time and report it; after
    taking a message of round r, pop again only once the test has moved past round r; end on a stop
    message."""
    try:
        with DbQueue(dsn, schema=schema) as dbq:
            q = dbq.queue(QUEUE)
            out.put(("ready", idx))
            while True:
                for m in q.pop(1, wait=30, poll_interval=POLL_S):
                    out.put(("took", idx, m.payload, time.time()))
                    if m.payload["round"] < 0:
                        return
                    while rounds.value <= m.payload["round"]:
                        time.sleep(0.01)
    except BaseException:
        out.put(("error", idx, traceback.format_exc()))


def _next(out: mp.Queue[Any], timeout: float) -> tuple[Any, ...]:
    try:
        item: tuple[Any, ...] = out.get(timeout=timeout)
    except queue_mod.Empty:
        pytest.fail(f"no waiter reported within {timeout:.0f}s")
    assert item[0] != "error", item[2]
    return item


def _listening(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-dbqueue-listen'"
        ).fetchone()
    return int(row[0]) if row else 0


def _round(dbq: DbQueue, q: Any, out: mp.Queue[Any], r: int) -> list[tuple[dict[str, Any], float, int]]:
    """Round ``r``: message A's push and message B's push are both in progress (B's, finding A's row
    issued and not taken, sends no NOTIFY); A commits and wakes a waiter of each process, one of which
    takes it and holds its process; B commits HELD_S later. Returns each message with the seconds from
    its commit to its taking, and its taker."""
    a, b = {"round": r, "m": "A"}, {"round": r, "m": "B"}
    with dbq.transaction() as tb:
        with dbq.transaction() as ta:
            q.push(a, conn=ta)
            q.push(b, conn=tb)
        a_at = time.time()  # A committed (its NOTIFY goes out)
        took_a = _next(out, PROMPT_S)
        assert took_a[0] == "took" and took_a[2] == a, took_a
        time.sleep(HELD_S)
    b_at = time.time()  # B committed, without a NOTIFY
    took_b = _next(out, PROMPT_S + HELD_S)
    assert took_b[0] == "took" and took_b[2] == b, took_b
    assert took_b[1] != took_a[1], "A's taker holds its process until the round is over"
    return [(a, took_a[3] - a_at, took_a[1]), (b, took_b[3] - b_at, took_b[1])]


@pytest.mark.parametrize("layout", ["rows", "slots"])
def test_a_push_that_sent_no_notify_reaches_a_waiter_of_another_process(
    pg_dsn: str, schema_name: str, layout: str
) -> None:
    """Rounds of _round: B reaches a waiter of another process well within PROMPT_S of its commit (the
    poll is POLL_S), every message arrives once with equal checksums, and each process listens on one
    connection."""
    ctx = child_processes()
    rounds = ctx.Value("i", 0)
    out: mp.Queue[Any] = ctx.Queue()
    moved: list[tuple[dict[str, Any], float, int]] = []
    with DbQueue(pg_dsn, schema=schema_name) as dbq:
        dbq.install()
        q = dbq.create_queue(QUEUE, design="ring", layout=layout)  # notify="auto"
        procs = [
            ctx.Process(target=_waiter, args=(pg_dsn, schema_name, k, rounds, out)) for k in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        try:
            assert {_next(out, 120)[1] for _ in procs} == set(range(PROCESSES))
            deadline = time.monotonic() + 30
            while _listening(pg_dsn) < PROCESSES and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # every waiter has looked, and waits
            assert _listening(pg_dsn) == PROCESSES, "one listening connection a process"
            for r in range(ROUNDS):
                moved += _round(dbq, q, out, r)
                with rounds.get_lock():
                    rounds.value += 1
                time.sleep(0.3)  # the takers wait again
            q.push_batch([{"round": -1, "m": k} for k in range(PROCESSES)])  # one NOTIFY: each process ends
            stops = [_next(out, 30) for _ in procs]
            for p in procs:
                p.join(30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            dbq.uninstall()
    assert sorted(s[1] for s in stops) == list(range(PROCESSES))
    sent = [{"round": r, "m": m} for r in range(ROUNDS) for m in "AB"]
    got = [m for m, _, _ in moved]
    assert len(got) == len(sent) and checksum(got) == checksum(sent)
    worst = max(moved, key=lambda x: x[1])
    assert worst[1] < PROMPT_S, f"message {worst[0]} waited {worst[1]:.1f}s: it was found by a poll"
